"""Beam search and beam sampling with ``max_cache_len`` for a decoder-only model: one program
sized to ``M`` slots serves every prompt length ``P`` and ``max_new_tokens`` ``N`` with
``P + N <= M`` (:mod:`genjax.cache.slots`; the beam loop's first new slot is traced,
``BeamState.start``, and it stops at the call's ``N``, ``BeamRules.num_new_tokens``).

On the tiny Llama and the left-padded prompts of ``tests/fixtures/beam``, with the settings of
three recorded cases (``early_stopping="never"`` with ``length_penalty=2``, whose heuristic
reads ``N``; ``early_stopping=True`` with a repetition penalty and ``min_new_tokens``, which
read the prompt's slots; beam sampling with ``num_return_sequences`` below ``num_beams`` and a
pad id that is not 0), each case runs twice through one ``max_cache_len`` program: the
recorded prompts with ``N = 8``, then longer prompts (two prefill chunks) with ``N = 5``,
which compiles nothing. Every output (``sequences``' first ``P + N`` columns,
``sequences_scores``, ``scores``, ``beam_indices``) equals the call without ``max_cache_len``
(the float ones up to float32 rounding: the attention sums run over a longer cache); the slots
after ``P + N`` hold ``pad_token_id``, the steps after ``N`` score 0 and point at no beam.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import jax
import numpy as np
import pytest
from matrix import by_default

import genjax
from genjax import GenerationConfig
from genjax.testing import count_compiles

pytestmark = pytest.mark.usefixtures("fast_compiles")  # LLVM at -O0: see conftest.py

FIXTURES = Path(__file__).parent / "fixtures"
SIZE = 32  # M: 9 + 8 and 20 + 5 tokens fit; the slot buffer holds 32 + 16 - 1 slots
CASES = {  # a recorded case's settings, with changes (the same for both calls compared)
    "many_lp_two_never": {},
    "many_penalty": {"early_stopping": True},
    "one_sample": {"num_return_sequences": 2, "pad_token_id": 1},
}
FLOATS = dict(rtol=1e-5, atol=1e-5)


@functools.cache
def _setup():
    """The tiny Llama, the recorded cases by name, and two batches of left-padded prompts:
    the recorded ones (``P = 9``) and the same rows with 11 more tokens (``P = 20``)."""
    model, params = genjax.models.from_pretrained(FIXTURES / "llama")
    meta = json.loads((FIXTURES / "beam" / "llama.json").read_text())
    arrays = np.load(FIXTURES / "beam" / "llama.npz")
    ids, mask = arrays["input_ids"], arrays["attention_mask"]
    more = np.random.default_rng(0).integers(1, model.vocab_size, (len(ids), 11), np.int32)
    longer = (np.concatenate([ids, more], 1), np.concatenate([mask, np.ones_like(more)], 1))
    cases = {case["name"]: case for case in meta["cases"]}
    return model, params, cases, ((ids, mask), longer)


def _config(name: str) -> GenerationConfig:
    kwargs = dict(_setup()[2][name]["generate_kwargs"])
    kwargs.pop("return_dict_in_generate")
    return GenerationConfig(**{**kwargs, **CASES[name]})


def _generate(name: str, prompt: int, **options):
    model, params, _, prompts = _setup()
    ids, mask = prompts[prompt]
    config = _config(name)
    return genjax.generate(
        model, params, ids, config, attention_mask=mask, key=jax.random.key(0), **options
    )


def _check_equal(got, expected, config: GenerationConfig, end: int, steps: int):
    """``got`` (with ``max_cache_len``) holds ``expected`` (without) in its first ``end = P + N``
    columns and ``steps = N`` steps, then the values of slots and steps the call never ran."""
    sequences = np.asarray(got.sequences)
    assert sequences.shape == (len(expected.sequences), SIZE)
    np.testing.assert_array_equal(sequences[:, :end], expected.sequences)
    np.testing.assert_array_equal(sequences[:, end:], config.pad_token_id)
    np.testing.assert_allclose(got.sequences_scores, expected.sequences_scores, **FLOATS)
    indices = np.asarray(got.beam_indices)
    np.testing.assert_array_equal(indices[:, :steps], expected.beam_indices)
    np.testing.assert_array_equal(indices[:, steps:], -1)
    scores = np.asarray(got.scores)
    assert scores.shape[1] == SIZE - 1
    np.testing.assert_allclose(scores[:, :steps], expected.scores, **FLOATS)
    np.testing.assert_array_equal(scores[:, steps:], 0.0)


@pytest.mark.parametrize("name", by_default(list(CASES), keep=["many_lp_two_never"]))
def test_one_program_gives_the_outputs_of_the_calls_without_max_cache_len(name):
    config = _config(name)
    first = _generate(name, 0, max_cache_len=SIZE)
    with count_compiles() as compiled:
        second = _generate(name, 1, max_new_tokens=5, max_cache_len=SIZE)
    assert compiled == []
    _check_equal(first, _generate(name, 0), config, 9 + 8, 8)
    _check_equal(second, _generate(name, 1, max_new_tokens=5), config, 20 + 5, 5)
