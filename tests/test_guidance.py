"""Classifier-free guidance (``guidance_scale``, ``negative_prompt_ids``) against transformers.

The recordings (``tests/fixtures/guidance/``, written by
``tests/fixtures/make_guidance_fixtures.py``) run transformers' ``model.generate`` with
``guidance_scale`` on the tiny llama and gpt2 checkpoints; the ``parity`` test records them
again live.
"""

from __future__ import annotations

import functools
import importlib.util
import json
from pathlib import Path

import jax
import numpy as np
import pytest
from matrix import spread

import genjax
from genjax import GenerationConfig
from genjax.errors import InputError, UnsupportedError
from genjax.testing import count_compiles

pytestmark = pytest.mark.usefixtures("fast_compiles")  # LLVM at -O0: see conftest.py

FIXTURES = Path(__file__).parent / "fixtures"
RECORDS = FIXTURES / "guidance"


@functools.cache
def _model(arch):
    model, params = genjax.models.from_pretrained(FIXTURES / arch)
    records = np.load(FIXTURES / arch / "records.npz")
    meta = json.loads((FIXTURES / arch / "cases.json").read_text())["meta"]
    ids, mask = records["greedy/input_ids"], records["greedy/attention_mask"]
    return model, params, ids, mask, meta["never_hit_eos"]


@functools.cache
def _recorded():
    recorded = json.loads((RECORDS / "guidance.json").read_text())
    return recorded, dict(np.load(RECORDS / "guidance.npz"))


def _run(arch, case, meta, **extra):
    model, params, ids, mask, never_eos = _model(arch)
    kwargs = {
        "pad_token_id": meta["pad_token_id"],
        "eos_token_id": never_eos,
        "do_sample": False,
        "max_new_tokens": meta["steps"],
        **case["kwargs"],
    }
    if case["negative"]:
        kwargs["negative_prompt_ids"] = np.asarray(meta["negative_prompt_ids"])
        kwargs["negative_prompt_attention_mask"] = np.asarray(
            meta["negative_prompt_attention_mask"]
        )
    return genjax.generate(
        model,
        params,
        ids,
        GenerationConfig(output_scores=True, return_dict_in_generate=True),
        attention_mask=mask,
        key=jax.random.key(0),
        **kwargs,
        **extra,
    )


def _assert_scores_equal(got, expected):
    got = np.asarray(got)
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(expected))
    finite = np.isfinite(expected)
    np.testing.assert_allclose(got[finite], expected[finite], atol=1e-4, rtol=0)


def _check(arch, case, meta, arrays, out):
    expected_scores = arrays[f"{arch}/{case['name']}/scores"]
    if case["kwargs"].get("do_sample"):  # torch's draw cannot be reproduced: step 0's scores
        _assert_scores_equal(out.scores[:, :1], expected_scores)
        return
    np.testing.assert_array_equal(out.sequences, arrays[f"{arch}/{case['name']}/sequences"])
    _assert_scores_equal(out.scores, expected_scores)


def _cases():
    """(architecture, case): two cases per architecture by default, the rest under -m slow."""
    recorded, _ = _recorded()
    return spread((arch, case["name"]) for arch in ["llama", "gpt2"] for case in recorded["cases"])


@pytest.mark.parametrize("arch, name", _cases())
def test_guidance_matches_recorded_transformers(arch, name):
    recorded, arrays = _recorded()
    case = next(c for c in recorded["cases"] if c["name"] == name)
    out = _run(arch, case, recorded["meta"])
    _check(arch, case, recorded["meta"], arrays, out)


def test_guidance_with_max_cache_len_and_chunked_prefill_gives_the_same_tokens():
    recorded, arrays = _recorded()
    case = next(c for c in recorded["cases"] if c["name"] == "greedy_negative")
    out = _run("llama", case, recorded["meta"], max_cache_len=32, prefill_chunk_size=4)
    expected = arrays["llama/greedy_negative/sequences"]
    np.testing.assert_array_equal(out.sequences[:, : expected.shape[1]], expected)


def test_guidance_scale_is_traced_and_one_per_row_works():
    """A new scale reuses the program; a per-row scale equals each row run with its scale."""
    model, params, ids, mask, never_eos = _model("llama")
    config = GenerationConfig(max_new_tokens=4, pad_token_id=0, eos_token_id=never_eos)

    def run(scale):
        return np.asarray(
            genjax.generate(
                model, params, ids, config, attention_mask=mask, guidance_scale=scale
            ).sequences
        )

    low = run(1.5)
    with count_compiles() as compiled:
        high = run(4.0)
    assert "jit(_generate)" not in compiled
    assert not np.array_equal(low, high)
    mixed = run(np.asarray([1.5, 4.0, 1.5], np.float32))
    np.testing.assert_array_equal(mixed[[0, 2]], low[[0, 2]])
    np.testing.assert_array_equal(mixed[1], high[1])


def test_guidance_inside_jit_equals_eager_call():
    model, params, ids, mask, never_eos = _model("gpt2")
    config = GenerationConfig(
        max_new_tokens=4, pad_token_id=0, eos_token_id=never_eos, guidance_scale=2.0
    )
    negative = np.asarray([[5, 6], [7, 8], [9, 10]], np.int32)
    expected = genjax.generate(
        model, params, ids, config, attention_mask=mask, negative_prompt_ids=negative
    ).sequences

    @jax.jit
    def run(params, ids, mask, negative):
        return genjax.generate(
            model, params, ids, config, attention_mask=mask, negative_prompt_ids=negative
        ).sequences

    np.testing.assert_array_equal(run(params, ids, mask, negative), expected)


def test_guidance_with_return_sequences_repeats_the_branch_per_row():
    model, params, ids, mask, never_eos = _model("llama")
    config = GenerationConfig(
        max_new_tokens=4, pad_token_id=0, eos_token_id=never_eos, guidance_scale=2.0
    )
    single = genjax.generate(model, params, ids, config, attention_mask=mask).sequences
    out = genjax.generate(
        model,
        params,
        ids,
        config,
        attention_mask=mask,
        do_sample=True,
        top_k=1,
        num_return_sequences=2,
        key=jax.random.key(3),
    ).sequences  # top_k=1 sampling is greedy: both copies equal the single row
    np.testing.assert_array_equal(np.asarray(out)[0::2], single)
    np.testing.assert_array_equal(np.asarray(out)[1::2], single)


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"negative_prompt_ids": [[1, 2]] * 3}, InputError, "guidance_scale != 1"),
        (
            {"guidance_scale": 2.0, "negative_prompt_attention_mask": [[1]] * 3},
            InputError,
            "without negative_prompt_ids",
        ),
        ({"guidance_scale": 2.0, "negative_prompt_ids": [[1, 2]]}, InputError, "1 rows"),
        ({"guidance_scale": 2.0, "negative_prompt_ids": [[1, 999]] * 3}, InputError, "999"),
        (
            {
                "guidance_scale": 2.0,
                "negative_prompt_ids": [[1, 2]] * 3,
                "negative_prompt_attention_mask": [[1, 0.5]] * 3,
            },
            InputError,
            "0.5",
        ),
        ({"guidance_scale": 2.0, "num_beams": 2}, UnsupportedError, "beams decoding"),
        ({"guidance_scale": 2.0, "prompt_lookup_num_tokens": 2}, UnsupportedError, "assisted"),
    ],
)
def test_bad_guidance_inputs_raise_before_tracing(kwargs, error, words):
    model, params, ids, mask, _ = _model("llama")
    with pytest.raises(error, match=words):
        genjax.generate(model, params, ids, attention_mask=mask, max_new_tokens=2, **kwargs)


@pytest.mark.parity
def test_guidance_matches_live_transformers():
    spec = importlib.util.spec_from_file_location(
        "make_guidance_fixtures", FIXTURES / "make_guidance_fixtures.py"
    )
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    recorded = script.record()
    arrays = recorded["arrays"]
    for arch in script.ARCHS:
        for case in recorded["cases"]:
            out = _run(arch, case, recorded["meta"])
            _check(arch, case, recorded["meta"], arrays, out)
