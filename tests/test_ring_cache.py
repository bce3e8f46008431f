"""Sliding-window ring caches (:mod:`genjax.cache.ring`): the same tokens as the full cache.

The model is the recorded Gemma 3 fixture (layers: sliding, sliding, full; ``W = 4``), whose
transformers records ``tests/test_generate.py`` already compares on 9-token prompts (longer than
``W``, so through the rings). Here prompts of 13 tokens go through the paths that write a ring
in more than one way: chunked prefill with chunks shorter and longer than ``W`` and the
``max_cache_len`` slot layout (against the same transformers records), prompt lookup (rejected
tokens rolled back, also in the ``max_cache_len`` layout) against the same model with
``ring_cache=False`` (every layer ``S`` slots, the window applied by the mask). Beam search on
rings is ``tests/test_beam.py``'s gemma3 and qwen3 records. Programs compile with
``jax_disable_most_optimizations``.
"""

import dataclasses
import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import genjax
from genjax import GenerationConfig
from genjax.cache import KVCache, ring_bias
from genjax.cache.memory import CacheRequest, cache_bytes
from genjax.errors import UnsupportedError

pytestmark = pytest.mark.usefixtures("fast_compiles")

FIXTURE = Path(__file__).parent / "fixtures" / "gemma3"
WINDOW = 4


@functools.cache
def _models():
    ring, params = genjax.models.from_pretrained(FIXTURE)
    ring = ring.with_generation_config(None)
    full = dataclasses.replace(ring, config=dataclasses.replace(ring.config, ring_cache=False))
    return ring, full, params


def _prompts():
    ids = np.random.default_rng(3).integers(3, 128, (2, 13)).astype(np.int32)
    ids[:, 8:11] = ids[:, 2:5]  # an n-gram for prompt lookup to find
    mask = np.ones_like(ids)
    mask[1, :3] = 0  # left padding
    return ids, mask


def test_ring_written_in_chunks_of_any_length_equals_a_full_forward():
    ring, full, params = _models()
    ids, mask = _prompts()
    length = ids.shape[1]
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    expected, _ = jax.jit(full.apply)(params, ids, positions, full.init_cache(2, length), mask)
    cache = ring.init_cache(2, 16)
    assert [cache.ring_slots(i) for i in range(3)] == [WINDOW, WINDOW, None]
    assert cache.keys[0].shape[-1] == WINDOW and cache.keys[2].shape[-1] == 16
    mask16 = np.pad(mask, ((0, 0), (0, 3)), constant_values=1)
    apply, start, got = jax.jit(ring.apply), 0, []
    for size in (6, 1, 3, 1, 1, 1):  # longer than W, one token, shorter than W
        part = slice(start, start + size)
        logits, cache = apply(params, ids[:, part], positions[:, part], cache, mask16)
        got.append(logits)
        start += size
    real = mask == 1  # a padding query attends to nothing: its logits mean nothing
    np.testing.assert_allclose(np.concatenate(got, axis=1)[real], expected[real], atol=1e-4)
    assert int(cache.index) == length


def test_ring_bias_masks_by_logical_slot():
    mask = jnp.array([[0, 1, 1, 1, 1, 1, 1, 1]])
    # One query at slot 5 over a ring of 4: ring slots hold logical 4, 5, 2, 3; window 3.
    assert (ring_bias(mask, jnp.int32(5), 1, 3, 4)[0, 0, 0] == 0).tolist() == [1, 1, 0, 1]
    # Two queries at slots 2, 3: the ring before them (logical 0, 1, -2, -1: 0 is padding,
    # the negative ones never written), then their own slots 2, 3.
    allowed = (ring_bias(mask, jnp.int32(2), 2, 3, 4)[0, 0] == 0).astype(int).tolist()
    assert allowed == [[0, 1, 0, 0, 1, 0], [0, 1, 0, 0, 1, 1]]


def test_prefilled_cache_keeps_the_last_slots_of_each_ring():
    cache = KVCache.create(2, 1, 6, 1, 1, windows=(3, None))
    assert cache.ring_slots(0) == 3
    full = cache.with_length(6, ring=False)
    values = jnp.arange(6, dtype=jnp.float32).reshape(1, 6, 1, 1) + 1
    _, _, full = full.update_layer(0, values, values)
    grown = full.advance(6).with_length(10)  # logical slots 3, 4, 5 at 3 mod 3, 4 mod 3, ...
    assert grown.values[0][0, 0, :, 0].tolist() == [4.0, 5.0, 6.0]
    assert grown.ring_slots(0) == 3 and grown.values[1].shape[2] == 10 and grown.length == 10
    wider = full.advance(6).with_length(10, margin=2)  # 5 slots: logical 1..5
    assert wider.values[0][0, 0, :, 0].tolist() == [6.0, 2.0, 3.0, 4.0, 5.0]


def _recorded(case):
    """The gemma3 fixture's transformers case ``case``: (config kwargs, ids, mask, sequences)."""
    meta = json.loads((FIXTURE / "cases.json").read_text())
    records = np.load(FIXTURE / "records.npz")
    spec = next(c for c in meta["cases"] if c["name"] == case)
    kwargs = dict(spec["generate_kwargs"])
    for key in ("return_dict_in_generate", "output_scores", "output_logits"):
        kwargs.pop(key, None)
    prefix = spec["inputs"]
    ids, mask = records[f"{prefix}/input_ids"], records[f"{prefix}/attention_mask"]
    return kwargs, ids, mask, records[f"{case}/sequences"]


@pytest.mark.parametrize(
    "layout",
    [
        dict(prefill_chunk_size=3),  # chunks shorter than W, then the ring grows its margin
        dict(max_cache_len=32, prefill_chunk_size=6),  # rings from the start, chunks > W
    ],
    ids=["chunks_shorter_than_w", "max_cache_len_chunks_longer_than_w"],
)
def test_chunked_prefill_into_rings_matches_recorded_transformers(layout):
    ring, _, params = _models()
    kwargs, ids, mask, expected = _recorded("greedy")  # 9-token prompts, W = 4
    out = genjax.generate(
        ring, params, ids, GenerationConfig(**kwargs, **layout), attention_mask=mask
    )
    np.testing.assert_array_equal(out.sequences[:, : expected.shape[1]], expected)


def test_prompt_lookup_rolls_back_rings_as_the_full_cache():
    ring, full, params = _models()
    ids, _ = _prompts()
    config = GenerationConfig(max_new_tokens=30, pad_token_id=0, eos_token_id=None)
    plain = genjax.generate(full, params, ids[:1], config)
    config = config.replace(prompt_lookup_num_tokens=3)
    out = genjax.generate(ring, params, ids[:1], config)
    expected = genjax.generate(full, params, ids[:1], config)
    np.testing.assert_array_equal(out.sequences, expected.sequences)
    np.testing.assert_array_equal(out.sequences, plain.sequences)
    np.testing.assert_array_equal(out.num_accepted_tokens, expected.num_accepted_tokens)
    assert 0 < int(out.num_accepted_tokens[0]) < 30  # some candidates taken, some rolled back
    # The max_cache_len slot layout: rings of W + G + 1 slots from the chunked prefill on.
    fixed = genjax.generate(ring, params, ids[:1], config, max_cache_len=48)
    np.testing.assert_array_equal(fixed.sequences[:, :43], out.sequences)
    np.testing.assert_array_equal(fixed.num_accepted_tokens, out.num_accepted_tokens)


@pytest.mark.slow  # 15 s: runs with -m slow
def test_a_windowed_draft_proposes_what_it_would_without_the_window():
    """Draft = target, one row: with a hole in the draft cache each round, a window counted in
    slots saw fewer tokens than the target's and proposals were rejected (6 of 20 taken where
    the same model without windows takes 14)."""
    ring, full, params = _models()
    ids, _ = _prompts()
    wide = dataclasses.replace(
        full, config=dataclasses.replace(full.config, sliding_windows=(64,) * 2 + (None,))
    )
    config = GenerationConfig(
        max_new_tokens=20,
        pad_token_id=0,
        eos_token_id=None,
        num_assistant_tokens=3,
        num_assistant_tokens_schedule="constant",
        assistant_confidence_threshold=0.0,
    )
    plain = genjax.generate(ring, params, ids[:1], config)
    taken = {}
    for name, model in (("ring", ring), ("wide", wide)):
        out = genjax.generate(
            model, params, ids[:1], config, assistant_model=model, assistant_params=params
        )
        if name == "ring":
            np.testing.assert_array_equal(out.sequences, plain.sequences)
        taken[name] = int(out.num_accepted_tokens[0])
    assert taken["ring"] == taken["wide"] >= 12, taken


def test_assisted_decoding_with_a_windowed_target_refuses_several_rows():
    ring, _, params = _models()
    ids, mask = _prompts()
    config = GenerationConfig(max_new_tokens=4, pad_token_id=0, prompt_lookup_num_tokens=3)
    with pytest.raises(UnsupportedError, match="prompt lookup with a sliding-window target"):
        genjax.generate(ring, params, ids, config, attention_mask=mask)


def test_cache_memory_counts_the_ring_slots():
    ring, full, _ = _models()
    rows, length, heads, head_dim = 2, 100, 2, 16
    per_slot = 2 * rows * heads * head_dim * 4  # keys and values, float32
    ring_bytes = cache_bytes(CacheRequest(ring, rows, length))
    assert ring_bytes == per_slot * (WINDOW + WINDOW + length) + 4  # + index
    assert cache_bytes(CacheRequest(full, rows, length)) == per_slot * 3 * length + 4
    margin = cache_bytes(CacheRequest(ring, rows, length, ring_margin=4))
    assert margin == per_slot * (2 * (WINDOW + 4) + length) + 4
    # The int8 cache keeps every layer at `length` slots.
    assert cache_bytes(CacheRequest(ring, rows, length, quantized=True)) == cache_bytes(
        CacheRequest(full, rows, length, quantized=True)
    )
