"""Assisted generation with ``max_cache_len``: one program sized to ``M`` slots serves every
prompt length ``P`` and ``max_new_tokens`` ``N`` with ``P + N <= M`` (:mod:`genjax.cache.slots`;
the rows start at the slot buffer's traced prompt end and stop at the call's end,
``AssistRules.end``; the caches keep room for ``M - 1`` steps of rolled-back slots).

A random two-layer Llama target on three left-padded prompts of different lengths, with prompt
lookup (greedy: random models fall into loops, which it then predicts) and with a draft (the
target's weights plus noise) that samples, each run twice through one ``max_cache_len``
program: 6-slot prompts, then 18-slot prompts (two prefill chunks) with another ``N``, which
compiles nothing. ``sequences``' first ``P + N`` columns, ``scores`` and
``num_accepted_tokens`` equal the call without ``max_cache_len`` (the scores up to float32
rounding: the attention sums run over a longer cache); ``pad_token_id`` and 0 follow.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from matrix import by_default

import genjax
from genjax import GenerationConfig
from genjax.errors import InputError
from genjax.testing import count_compiles, write_random_checkpoint

pytestmark = pytest.mark.usefixtures("fast_compiles")  # LLVM at -O0: see conftest.py

SIZE = 32  # M: 6 + 20 tokens fit, and 18 + 14 exactly
IDS = np.array([[0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14], [0, 3, 4, 5, 3, 4]], np.int32)
MASK = (np.arange(6)[None] >= np.array([2, 0, 1])[:, None]).astype(np.int32)
LONGER = np.concatenate([IDS, (IDS[:, ::-1] % 7) + 20, IDS + 30], 1)  # 18 slots
LONGER_MASK = np.concatenate([MASK, np.ones_like(IDS), np.ones_like(IDS)], 1)
MODES = {
    "prompt_lookup": GenerationConfig(prompt_lookup_num_tokens=3),
    "draft_sampling": GenerationConfig(
        num_assistant_tokens=3, do_sample=True, temperature=0.8, top_k=20
    ),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """``(model, params, draft params)``: a random Llama target and its weights plus noise."""
    folder = tmp_path_factory.mktemp("assisted_cache")
    # No EOS in config.json: the model's generation config would stop rows (as transformers).
    write_random_checkpoint(folder, "llama", seed=0, eos_token_id=None)
    model, params = genjax.models.from_pretrained(str(folder))
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(7), len(leaves))
    noise = [
        0.35 * jnp.std(x) * jax.random.normal(k, x.shape, x.dtype)
        for x, k in zip(leaves, keys, strict=True)
    ]
    noisy = [x + n for x, n in zip(leaves, noise, strict=True)]
    return model, params, jax.tree.unflatten(treedef, noisy)


def _generate(models, mode: str, ids, mask, new_tokens: int, **options):
    model, params, draft_params = models
    config = MODES[mode].replace(max_new_tokens=new_tokens, pad_token_id=0, output_scores=True)
    if mode != "prompt_lookup":
        options = dict(options, assistant_model=model, assistant_params=draft_params)
    call = functools.partial(genjax.generate, model, params, ids, config, attention_mask=mask)
    return call(key=jax.random.key(0), **options)


def _check_equal(got, expected, end: int, steps: int):
    sequences = np.asarray(got.sequences)
    assert sequences.shape == (len(IDS), SIZE)
    np.testing.assert_array_equal(sequences[:, :end], expected.sequences)
    np.testing.assert_array_equal(sequences[:, end:], 0)
    np.testing.assert_array_equal(got.num_accepted_tokens, expected.num_accepted_tokens)
    scores = np.asarray(got.scores)
    assert scores.shape[1] == SIZE - 1
    np.testing.assert_allclose(scores[:, :steps], expected.scores, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(scores[:, steps:], 0.0)


@pytest.mark.parametrize("mode", by_default(sorted(MODES), keep=["prompt_lookup"]))
def test_one_program_gives_the_outputs_of_the_calls_without_max_cache_len(models, mode):
    first = _generate(models, mode, IDS, MASK, 20, max_cache_len=SIZE)
    with count_compiles() as compiled:
        second = _generate(models, mode, LONGER, LONGER_MASK, 14, max_cache_len=SIZE)
    assert compiled == []
    expected = _generate(models, mode, IDS, MASK, 20)
    expected_second = _generate(models, mode, LONGER, LONGER_MASK, 14)
    accepted = [np.asarray(e.num_accepted_tokens).sum() for e in (expected, expected_second)]
    assert sum(accepted) > 0  # candidates were accepted: the rows' caches hold holes
    _check_equal(first, expected, 6 + 20, 20)
    _check_equal(second, expected_second, 18 + 14, 14)


def test_calls_that_do_not_fit_raise_before_compiling(models):
    with count_compiles() as compiled:
        with pytest.raises(InputError, match="18 \\+ 15 new tokens = 33 exceeds max_cache_len"):
            _generate(models, "prompt_lookup", LONGER, LONGER_MASK, 15, max_cache_len=SIZE)
    assert compiled == []
