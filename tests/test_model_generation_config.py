"""The model carries its checkpoint's generation config and ``generate`` merges it as
transformers v5 does (recorded by ``tests/fixtures/make_model_default_fixtures.py``; live with
``-m parity``)."""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import numpy as np
import pytest

import genjax
import genjax.io.bundled
from genjax import GenerationConfig
from genjax.generation.inputs import resolve_config

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "model_defaults")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "fixtures"))
from make_model_default_fixtures import (  # noqa: E402
    BUNDLED,
    BUNDLED_CASES,
    BUNDLED_NEW_TOKENS,
    TINY_CASES,
    record,
    write_tiny,
)


@pytest.fixture(scope="module")
def recorded():
    with np.load(os.path.join(FIXTURES, "records.npz")) as data:
        arrays = {key: data[key] for key in data.files}
    with open(os.path.join(FIXTURES, "cases.json")) as f:
        return arrays, json.load(f)


@pytest.fixture(scope="module")
def bundled():
    return genjax.models.from_pretrained(genjax.io.bundled.path(BUNDLED))


def _config(fields):
    return None if fields is None else GenerationConfig(**fields)


def _assert_same(out, expected, pad):
    """genjax's ``sequences`` hold ``N`` new tokens; transformers stops when every row is done:
    the recorded columns match and the rest is padding."""
    got = np.asarray(out.sequences)
    width = expected.shape[1]
    np.testing.assert_array_equal(got[:, :width], expected)
    assert (got[:, width:] == pad).all(), got


def test_from_pretrained_attaches_the_generation_file(bundled):
    model, _ = bundled
    folder = genjax.io.bundled.path(BUNDLED)
    assert model.generation_config == GenerationConfig.from_pretrained(folder)
    assert model.generation_config.repetition_penalty == 1.1


def test_without_a_file_the_config_comes_from_config_json(tmp_path, recorded):
    _, cases = recorded
    write_tiny(tmp_path, cases["tiny"]["eos"], with_file=False)
    model, _ = genjax.models.from_pretrained(tmp_path)
    assert model.generation_config.eos_token_id == cases["tiny"]["eos"][0]
    assert model.generation_config._from_model_config
    assert model.generation_config == GenerationConfig.from_model_config(tmp_path)


def test_the_generation_config_is_not_part_of_equality_or_hash(bundled):
    model, _ = bundled
    bare = genjax.models.from_config(os.path.join(genjax.io.bundled.path(BUNDLED), "config.json"))
    assert bare.generation_config is None
    assert model == bare and hash(model) == hash(bare)
    other = model.with_generation_config(GenerationConfig(max_new_tokens=3))
    assert other == model and other.generation_config.max_new_tokens == 3
    assert model.generation_config.max_new_tokens == 128  # the original is unchanged
    assert dataclasses.replace(model).generation_config is None


@pytest.mark.parametrize("case", BUNDLED_CASES, ids=lambda c: c["name"])
def test_bundled_greedy_matches_transformers(bundled, recorded, case):
    """transformers starts from the file (repetition_penalty=1.1 applies) and the caller's
    do_sample=False wins over the file's do_sample=True."""
    arrays, _ = recorded
    model, params = bundled
    kwargs = dict(case["kwargs"], max_new_tokens=BUNDLED_NEW_TOKENS)
    args = (model, params, arrays["bundled/input_ids"], _config(case["config"]))
    if case["name"] == "user_config":
        # transformers says the same: the file's temperature and top_p fill a config that
        # does not sample.
        with pytest.warns(UserWarning, match=r"\['temperature', 'top_p'\]"):
            out = genjax.generate(*args, **kwargs)
    else:
        out = genjax.generate(*args, **kwargs)
    np.testing.assert_array_equal(np.asarray(out.sequences), arrays[f"bundled/{case['name']}"])


def test_bundled_file_changes_greedy_tokens(bundled, recorded):
    """The file's repetition penalty is what makes transformers' tokens: without it genjax
    diverges (the fourth new token, as the issue reports)."""
    arrays, _ = recorded
    model, params = bundled
    bare = model.with_generation_config(None)
    ids = arrays["bundled/input_ids"]
    out = genjax.generate(bare, params, ids, max_new_tokens=BUNDLED_NEW_TOKENS)
    expected = arrays["bundled/kwargs"]
    got = np.asarray(out.sequences)
    assert not np.array_equal(got, expected)
    np.testing.assert_array_equal(got[:, : ids.shape[1] + 3], expected[:, : ids.shape[1] + 3])


@pytest.mark.parametrize("case", TINY_CASES, ids=lambda c: c["name"])
def test_tiny_checkpoint_matches_transformers(tmp_path, recorded, case):
    """A processor, max_new_tokens and two EOS ids from generation_config.json (or the EOS of
    config.json without it) apply with config=None, fill a user config, and yield to
    overrides."""
    arrays, cases = recorded
    write_tiny(tmp_path, cases["tiny"]["eos"], case["file"])
    model, params = genjax.models.from_pretrained(tmp_path)
    out = genjax.generate(
        model,
        params,
        arrays["tiny/input_ids"],
        _config(case["config"]),
        attention_mask=arrays["tiny/attention_mask"],
        **case["kwargs"],
    )
    pad = 0 if case["file"] else cases["tiny"]["eos"][0]  # no pad id: the first EOS, as in HF
    _assert_same(out, arrays[f"tiny/{case['name']}"], pad)


def test_models_without_a_generation_config_use_the_library_defaults(tmp_path, recorded):
    """from_config / custom models: config=None is GenerationConfig() (20 new tokens, no EOS
    from any file)."""
    arrays, cases = recorded
    write_tiny(tmp_path, cases["tiny"]["eos"], with_file=True)
    model = genjax.models.from_config(tmp_path / "config.json")
    params = genjax.models.load_params(model, tmp_path)
    ids = arrays["tiny/input_ids"]
    out = genjax.generate(model, params, ids, attention_mask=arrays["tiny/attention_mask"])
    assert out.sequences.shape == (2, ids.shape[1] + 20)


def test_merge_order_follows_transformers():
    """User config > model config > library defaults; overrides last, so None turns a
    sampling value off; the model's custom keys are carried over."""
    model_config = GenerationConfig(
        do_sample=True, top_k=7, temperature=0.5, max_new_tokens=9, extra={"custom": 1}
    )
    user = GenerationConfig(num_beams=2, length_penalty=0.5, temperature=0.9, do_sample=True)
    lengths, resolved = resolve_config(user, {}, model_config)
    assert (resolved.num_beams, resolved.top_k, resolved.temperature) == (2, 7, 0.9)
    assert resolved.custom == 1 and lengths.max_new_tokens == 9 and resolved.top_p == 1.0
    _, resolved = resolve_config(None, {"top_k": None, "do_sample": False}, model_config)
    assert resolved.top_k is None and resolved.do_sample is False
    _, resolved = resolve_config(None, {"top_k": None}, None)
    assert resolved.top_k is None


@pytest.mark.parity
def test_live_matches_the_recording(recorded):
    arrays, cases = recorded
    live, live_cases = record()
    assert live_cases["tiny"] == cases["tiny"]
    for key, value in live.items():
        np.testing.assert_array_equal(value, arrays[key], err_msg=key)


def test_a_gguf_file_carries_its_special_token_ids(tmp_path):
    """As transformers (from_model_config of the GGUF-derived config): BOS/EOS/pad ids."""
    from safetensors.numpy import load_file

    from genjax.testing import write_gguf, write_random_checkpoint

    config = write_random_checkpoint(tmp_path / "hf", "llama")
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    tokens = {"tokens": [f"t{i}" for i in range(config["vocab_size"])], "bos_token_id": 1}
    tokens.update(eos_token_id=7, padding_token_id=0)
    path = write_gguf(tmp_path / "m.gguf", config, tensors, tokenizer=tokens)
    model, _ = genjax.models.from_pretrained(tmp_path, gguf_file="m.gguf")
    got = model.generation_config
    assert (got.bos_token_id, got.eos_token_id, got.pad_token_id) == (1, 7, 0), got
    assert os.path.isfile(path)
