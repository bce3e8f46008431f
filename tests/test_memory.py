"""KV-cache sizes, the memory check before allocating, and bfloat16 generate on a mesh.

The bfloat16 model is ``tests/test_quantized_cache.py``'s tiny GQA Llama (8 query heads, 4 KV
heads), loaded with ``dtype="bfloat16"``; its two programs compile with
``jax_disable_most_optimizations``. Everything else here compiles nothing.
"""

import jax
import numpy as np
import pytest

import genjax
from genjax import sharding
from genjax.cache import memory
from genjax.cache.memory import CacheRequest
from genjax.errors import CacheMemoryError, InputError
from genjax.testing import write_random_checkpoint

LAYERS, KV_HEADS, HEAD_DIM = 1, 4, 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("memory") / "llama"
    write_random_checkpoint(
        path,
        "llama",
        num_hidden_layers=LAYERS,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=8,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=2**31 - 1,  # so that only the memory check can refuse a length
    )
    return path


def test_cache_bytes_count_every_slot_and_divide_over_the_mesh(checkpoint):
    model, _ = genjax.models.from_pretrained(checkpoint)
    rows, length = 8, 1000
    numbers = 2 * LAYERS * rows * length * KV_HEADS * HEAD_DIM  # keys and values
    assert memory.cache_bytes(CacheRequest(model, rows, length)) == numbers * 4 + 4  # + index
    # int8 codes, plus one float32 scale per head vector of HEAD_DIM numbers.
    quantized = memory.cache_bytes(CacheRequest(model, rows, length, quantized=True))
    assert quantized == numbers + (numbers // HEAD_DIM) * 4 + 4
    assert (quantized - 4) / (numbers * 4) == 1 / 4 + 1 / HEAD_DIM  # 37.5% of float32 here
    model16, _ = genjax.models.from_pretrained(checkpoint, dtype="bfloat16")
    assert memory.cache_bytes(CacheRequest(model16, rows, length)) == numbers * 2 + 4
    # On a (2, 4) mesh rows split 2 ways and the 4 KV heads 4 ways; on (1, 8) the KV heads do
    # not divide, so they are replicated (sharding.layout_for's fallback).
    split = sharding.layout_for(model, sharding.make_mesh((2, 4)))
    assert memory.cache_bytes(CacheRequest(model, rows, length), split) == numbers * 4 // 8 + 4
    wide = sharding.layout_for(model, sharding.make_mesh((1, 8)))
    assert memory.cache_bytes(CacheRequest(model, rows, length), wide) == numbers * 4 + 4


def test_free_memory_comes_from_memory_stats_or_the_host(monkeypatch):
    devices = jax.devices()  # 8 virtual CPU devices: no memory_stats, they share the host
    assert devices[0].memory_stats() is None
    assert memory._host_available_bytes() > 0
    monkeypatch.setattr(memory, "_host_available_bytes", lambda: 8 * 10**9)
    free, source = memory.free_bytes(devices)
    assert free == 10**9 and "host memory" in source and "shared by 8 devices" in source
    assert memory.free_bytes(devices[:1])[0] == 8 * 10**9


def test_generate_refuses_a_cache_that_cannot_fit_and_gives_the_figure(checkpoint):
    model, params = genjax.models.from_pretrained(checkpoint)
    ids = np.full((8, 5), 7, np.int32)  # padded to a 16-slot bucket
    new = 10**9
    per_slot = 2 * LAYERS * KV_HEADS * HEAD_DIM  # numbers per row and slot
    needed = 8 * (16 + new) * per_slot * 4 + 4
    config = genjax.GenerationConfig(max_new_tokens=new, pad_token_id=0)
    with pytest.raises(CacheMemoryError, match=rf"needs {needed:,} bytes \(\d+\.\d\d GiB\)") as e:
        genjax.generate(model, params, ids, config)
    message = str(e.value)
    assert "per device" in message and "bytes (" in message and "available in host" in message
    assert "cache_implementation='quantized'" in message
    assert isinstance(e.value, InputError)  # so `except ValueError` catches it
    # Beams multiply the rows; the int8 cache needs 1/4 + 1/H of the float32 bytes.
    quantized = {"cache_implementation": "quantized", "cache_config": {"nbits": 8}}
    codes = 8 * 3 * (16 + new) * per_slot * (1 + 4 / HEAD_DIM) + 4
    with pytest.raises(CacheMemoryError, match=rf"needs {int(codes):,} bytes"):
        genjax.generate(model, params, ids, config, num_beams=3, **quantized)
    # On a mesh, the figure is per device: rows over data (2), KV heads over model (4).
    per_device = 8 // 2 * (16 + new) * (per_slot // 4) * 4 + 4
    with pytest.raises(CacheMemoryError, match=rf"needs {per_device:,} bytes"):
        genjax.generate(model, params, ids, config, mesh=sharding.make_mesh((2, 4)))
    # A huge prompt bucket is counted before the prompts are padded to it (numpy would fail
    # to allocate the padded prompts first).
    bucket = 2**40
    needed = 8 * (bucket + 4) * per_slot * 4 + 4
    with pytest.raises(CacheMemoryError, match=rf"needs {needed:,} bytes.*prompt_buckets="):
        genjax.generate(model, params, ids, config, max_new_tokens=4, prompt_buckets=[bucket])


@pytest.mark.usefixtures("fast_compiles")
def test_bfloat16_generate_on_a_mesh_equals_one_device_and_scores_are_float32(checkpoint):
    model, params = genjax.models.from_pretrained(checkpoint, dtype="bfloat16")
    assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {np.dtype("bfloat16")}
    rng = np.random.default_rng(0)
    ids = rng.integers(3, model.vocab_size, (8, 5)).astype(np.int32)
    config = genjax.GenerationConfig(
        max_new_tokens=16, pad_token_id=0, eos_token_id=None, output_scores=True
    )
    one = genjax.generate(model, params, ids, config)
    mesh = genjax.generate(model, params, ids, config, mesh=sharding.make_mesh((2, 4)))
    # A one-device mesh: XLA's products, as on the mesh (one device without a mesh takes
    # genjax's row kernel, whose float32 sums run in another order).
    single = genjax.generate(model, params, ids, config, mesh=sharding.make_mesh((1, 1)))
    # Processors and sampling run on float32 logits, whatever the model dtype.
    assert one.scores.dtype == mesh.scores.dtype == single.scores.dtype == np.float32
    np.testing.assert_array_equal(mesh.sequences, one.sequences)
    np.testing.assert_array_equal(single.sequences, one.sequences)
    # The products are summed in float32 and rounded to bfloat16 once on both (a bfloat16
    # all-reduce would round each partial sum and move many logits by a step or more). The
    # partitioned sums may still add in another order: at most one bfloat16 step apart, and
    # rarely (on the AMD EPYC none of the 12928 logits differed).
    step = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(np.asarray(single.scores)), 1e-30))) - 7)
    got, want = np.asarray(mesh.scores), np.asarray(single.scores)
    apart = np.where(got == want, 0.0, np.abs(got - want))
    assert (apart <= step).all(), apart.max()
    # The row kernel's sums round some products the other way, and bfloat16 activations carry
    # that through the layers (AMD EPYC: 0.5% of the logits differ, by at most 0.45% of the
    # largest logit).
    moved = np.abs(np.asarray(one.scores) - want)
    assert moved.max() <= 0.02 * np.abs(want).max(), moved.max()
    assert (apart > 0).mean() < 1e-3, (apart > 0).mean()
