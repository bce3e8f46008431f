"""What README.md promises: its API snippet runs; `jax.disable_jit()` runs generate eagerly."""

from __future__ import annotations

import os
import re

import jax
import numpy as np
import pytest

import genjax
from genjax.io import bundled
from genjax.io import tokenizer as tokenizers
from genjax.testing import write_random_checkpoint

README = os.path.join(os.path.dirname(__file__), "..", "README.md")


def _section(title: str) -> str:
    with open(README, encoding="utf-8") as f:
        text = f.read()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else None]


def test_the_use_snippet_runs_on_the_bundled_model():
    [snippet] = re.findall(r"```python\n(.*?)```", _section("Use"), re.S)[:1]
    # The bundled model stands in for "path/or/hub-id"; 3 new tokens keep it quick.
    snippet = snippet.replace('"path/or/hub-id"', repr(bundled.path()))
    snippet = snippet.replace("max_new_tokens=64", "max_new_tokens=3")
    batch = tokenizers.from_pretrained(bundled.path())(["def f():", "import"])
    scope = {"input_ids": batch["input_ids"], "mask": batch["attention_mask"]}
    exec(compile(snippet, "README.md", "exec"), scope)
    out = scope["out"]
    assert out.scores.shape[:2] == (2, 3)
    scores = genjax.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)
    assert scores.shape == (2, 3) and np.all(np.asarray(scores) <= 0)


@pytest.mark.slow  # eager generate (20 s): runs with -m slow
def test_disable_jit_runs_generate_eagerly_with_the_same_tokens(tmp_path):
    assert "jax.disable_jit()" in _section("Use")  # the README says how to debug eagerly
    # A one-layer model: eager mode dispatches every op by itself, so depth is most of its time.
    folder = tmp_path / "tiny"
    write_random_checkpoint(folder, "llama", num_hidden_layers=1, eos_token_id=None)
    model, params = genjax.models.from_pretrained(folder)
    ids = np.asarray([[0, 5, 6, 7], [8, 9, 10, 11]], np.int32)
    mask = np.asarray([[0, 1, 1, 1], [1, 1, 1, 1]], np.int32)
    config = genjax.GenerationConfig(max_new_tokens=3, do_sample=True, top_k=20, pad_token_id=0)
    run = lambda: (
        genjax.generate(  # noqa: E731
            model, params, ids, config, attention_mask=mask, key=jax.random.key(5)
        ).sequences
    )
    jitted = np.asarray(run())
    with jax.disable_jit():
        eager = run()
    assert not isinstance(eager, jax.core.Tracer)
    np.testing.assert_array_equal(np.asarray(eager), jitted)
