"""examples/train_tiny.py runs end to end with tiny settings and resumes where it stopped."""

from __future__ import annotations

import json
import os
import sys

import jax
import numpy as np
import pytest

import genjax

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import train_tiny  # noqa: E402


@pytest.mark.slow  # the example end to end (25 s): runs with -m slow
def test_trains_resumes_and_exports_a_loadable_folder(tmp_path, capsys):
    args = ["--size", "draft", "--workdir", str(tmp_path / "work"), "--out", str(tmp_path / "out")]
    args += ["--vocab-size", "300", "--max-files", "3", "--holdout-every", "40"]
    train_tiny.main([*args, "--steps", "2", "--save-every", "1"])
    first = json.loads((tmp_path / "work" / "eval.json").read_text())
    assert first["steps"] == 2 and np.isfinite(first["valid_nats_per_token"])
    train_tiny.main([*args, "--steps", "3", "--save-every", "1"])  # the same run, one step more
    printed = capsys.readouterr().out
    assert "resumed at step 2" in printed
    result = json.loads((tmp_path / "work" / "eval.json").read_text())
    assert result["steps"] == 3 and result["valid_bits_per_byte"] > 0

    model, params = genjax.models.from_pretrained(tmp_path / "out")
    assert model.vocab_size == 300
    tok = genjax.tokenizer.from_pretrained(tmp_path / "out")
    config = genjax.GenerationConfig.from_pretrained(tmp_path / "out")
    assert config.do_sample and config.eos_token_id == tok.eos_token_id
    ids = tok("def f(x):")["input_ids"]
    out = genjax.generate(model, params, ids, config, max_new_tokens=3, key=jax.random.key(0))
    assert out.sequences.shape == (1, ids.shape[1] + 3)
