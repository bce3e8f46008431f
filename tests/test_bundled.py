"""The bundled models: they load, their tokenizer matches the recording, and greedy decoding
gives the tokens and processed scores transformers gave (recorded by
``tests/fixtures/make_bundled_fixtures.py``; live with ``-m parity``)."""

from __future__ import annotations

import functools
import json
import os
import sys

import numpy as np
import pytest

import genjax
import genjax.io.bundled
from genjax import tokenizer as T

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "bundled")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "fixtures"))
from make_bundled_fixtures import MAX_NEW_TOKENS, MODELS, PROMPTS, record  # noqa: E402


@pytest.fixture(scope="module")
def recorded():
    with np.load(os.path.join(FIXTURES, "records.npz")) as data:
        return {key: data[key] for key in data.files}


@functools.cache
def _greedy(name):
    folder = genjax.io.bundled.path(name)
    model, params = genjax.models.from_pretrained(folder)
    tok = T.from_pretrained(folder)
    # Called as the recording calls transformers: the model's generation_config.json is the
    # base (its repetition_penalty applies) and do_sample=False on top makes it greedy.
    batch = tok(PROMPTS)
    out = genjax.generate(
        model,
        params,
        batch["input_ids"],
        attention_mask=batch["attention_mask"],
        do_sample=False,
        max_new_tokens=MAX_NEW_TOKENS,
        output_scores=True,
    )
    return batch, out, tok


def test_folders_are_complete_and_small():
    total = 0
    for name in MODELS:
        folder = genjax.io.bundled.path(name)
        files = set(os.listdir(folder))
        expected = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}
        assert expected | {"generation_config.json"} <= files
        total += sum(os.path.getsize(os.path.join(folder, f)) for f in files)
        config = genjax.GenerationConfig.from_pretrained(folder)
        assert config.do_sample and config.eos_token_id == config.pad_token_id
    assert total < 20 * 2**20
    with open(os.path.join(genjax.io.bundled.path(MODELS[0]), "tokenizer.json")) as f:
        default_tokenizer = json.load(f)
    with open(os.path.join(genjax.io.bundled.path(MODELS[1]), "tokenizer.json")) as f:
        assert json.load(f) == default_tokenizer  # the draft shares the vocabulary


@pytest.mark.parametrize("name", MODELS)
def test_greedy_matches_recorded_transformers(name, recorded):
    batch, out, _ = _greedy(name)
    np.testing.assert_array_equal(batch["input_ids"], recorded[f"{name}/input_ids"])
    np.testing.assert_array_equal(batch["attention_mask"], recorded[f"{name}/attention_mask"])
    np.testing.assert_array_equal(out.sequences, recorded[f"{name}/sequences"])
    np.testing.assert_allclose(out.scores, recorded[f"{name}/scores"], atol=2e-4, rtol=1e-5)


def test_default_model_writes_python():
    _, out, tok = _greedy(MODELS[0])
    text = tok.decode(out.sequences[0], skip_special_tokens=True)
    assert text.startswith(PROMPTS[0])
    new = text[len(PROMPTS[0]) :]
    assert new.startswith("\n    ")  # an indented body follows the def line


@pytest.mark.parity
@pytest.mark.parametrize("name", MODELS)
def test_greedy_matches_transformers_live(name):
    expected = record(genjax.io.bundled.path(name))
    batch, out, _ = _greedy(name)
    np.testing.assert_array_equal(batch["input_ids"], expected["input_ids"])
    np.testing.assert_array_equal(out.sequences, expected["sequences"])
    np.testing.assert_allclose(out.scores, expected["scores"], atol=2e-4, rtol=1e-5)
