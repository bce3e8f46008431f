"""The engine's int8 KV pool (``ContinuousBatchingConfig(kv_cache_dtype="int8")``).

One engine over the bundled ``genjax-tiny`` (float32, 4 layers, 2 KV heads of 64): 2 slots,
blocks of 4, prompt chunks of 8. A request's greedy tokens and log-probabilities must equal
``genjax.generate`` of it alone with the int8 cache (``cache_implementation="quantized"``) and
the engine's chunks (``prefill_chunk_size=8``, the prompt unpadded: chunks start at position 0):
each model call attends to its own tokens exactly and to earlier ones through their int8 codes,
so the chunking is part of the numbers. Prompts within one chunk equal the unchunked call too.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import genjax
from genjax import GenerationConfig
from genjax.cache import PagedKVCache, QuantizedKVCache
from genjax.cache.memory import check_pool_fits, paged_block_bytes
from genjax.errors import CacheMemoryError, GenerationConfigError, InputError, UnsupportedError
from genjax.serving import ContinuousBatchingConfig, RequestStatus, init_continuous_batching
from genjax.serving.engine import init_state
from genjax.serving.runner import ServeOptions, engine_sizes
from genjax.testing import count_compiles as compiles

pytestmark = pytest.mark.usefixtures("fast_compiles")

CHUNK, NEW = 8, 10
CB = ContinuousBatchingConfig(  # two slots; no bias, n-gram or constraint tables (cheaper)
    max_batch_size=2,
    block_size=4,
    max_length=40,
    num_blocks=64,  # no preemption, no eviction of cached prefixes
    prefill_chunk_size=CHUNK,
    max_decode_steps=4,
    max_logit_bias=0,
    max_bias_sequence_length=1,
    max_no_repeat_ngram_size=0,
    max_top_logprobs=0,  # logprobs=0: the chosen tokens' own log-probabilities only
    max_constraint_states=0,
    kv_cache_dtype="int8",
    poll_interval=0.01,
)
QUANTIZED = {"cache_implementation": "quantized", "cache_config": {"nbits": 8}}


@functools.cache
def _model(dtype=None):
    model, params = genjax.models.from_pretrained(genjax.io.bundled.path(), dtype=dtype)
    return model.with_generation_config(None), params  # greedy, no EOS: NEW tokens each


@pytest.fixture(scope="module")
def manager():
    model, params = _model()
    m = init_continuous_batching(model, params, GenerationConfig(pad_token_id=0), CB)
    m.start()
    yield m
    m.stop(block=True, timeout=30)


def _prompt(seed, length):
    return np.random.default_rng(seed).integers(3, 4096, length).tolist()


@functools.cache
def _reference(prompt: tuple, chunked: bool = True, quantized: bool = True):
    """``genjax.generate`` of the prompt alone: (greedy new tokens, their raw log-probabilities
    float32[NEW]); ``chunked``: in the engine's chunks (only differs for prompts over one)."""
    model, params = _model()
    config = GenerationConfig(max_new_tokens=NEW, pad_token_id=0, output_logits=True)
    config = config.replace(**QUANTIZED) if quantized else config
    extra = {}
    if chunked and len(prompt) > CHUNK:
        config = config.replace(prefill_chunk_size=CHUNK)
        extra = {"prompt_buckets": [len(prompt)]}  # no padding: chunks start at position 0
    out = genjax.generate(model, params, np.asarray([prompt], np.int32), config, **extra)
    tokens = np.asarray(out.sequences)[0, len(prompt) :]
    logprobs = np.asarray(jax.nn.log_softmax(out.logits[0], axis=-1))[np.arange(NEW), tokens]
    return tokens.tolist(), logprobs


def _run(manager, prompts, **options):
    """Queues the prompts together (the first prefills first) and returns their outputs."""
    with manager.pause():
        ids = manager.add_requests(prompts, max_new_tokens=NEW, logprobs=0, **options)
    return [manager.get_result(i, timeout=300) for i in ids]


# ---- the pool alone ---------------------------------------------------------------------------
@jax.jit
def _two_writes(cache, old, new):
    """Writes slots 0..5 (``old``), then 6..8 (``new``); returns the keys float[B, K, H, 9] and
    values float[B, K, 9, H] the second write returns, and the cache."""
    _, _, cache = cache.update_layer(0, old, old * 2)
    keys, values, cache = cache.advance(6).update_layer(0, new, new * 2)
    return keys[..., :9], values[:, :, :9], cache


def test_int8_pool_returns_the_quantized_cache_numbers_slot_for_slot():
    rng = np.random.default_rng(0)
    heads, dim, block = 2, 8, 4
    old = jnp.asarray(rng.normal(size=(1, 6, heads, dim)), jnp.float32)
    new = jnp.asarray(rng.normal(size=(1, 3, heads, dim)), jnp.float32)
    dense = QuantizedKVCache.create(1, 1, 12, heads, dim)
    paged = PagedKVCache.create(1, 5, block, 3, 1, heads, dim, quantized=True)
    paged = paged.replace(block_tables=jnp.asarray([[3, 1, 4]], jnp.int32))
    want_k, want_v, _ = _two_writes(dense, old, new)
    keys, values, paged = _two_writes(paged, old, new)
    np.testing.assert_array_equal(keys, want_k)
    np.testing.assert_array_equal(values, want_v)
    # The second call's slots are exact, the first call's rounded through int8.
    np.testing.assert_array_equal(values[0, :, 6:], jnp.swapaxes(new[0] * 2, 0, 1))
    assert np.abs(np.asarray(values[0, :, :6] - jnp.swapaxes(old[0] * 2, 0, 1))).max() > 0
    assert paged.keys[0].dtype == jnp.int8 and paged.key_scales[0].shape == (5, heads, block)
    assert not np.asarray(paged.keys[0])[[0, 2]].any()  # only the row's blocks were written


def test_block_bytes_give_about_2x_bfloat16_and_4x_float32_tokens_per_byte():
    (f32, _), (bf16, _) = _model(), _model("bfloat16")
    layers, heads, dim = f32.num_layers, f32.num_kv_heads, f32.head_dim  # 4, 2, 64
    for model, size in ((f32, 4), (bf16, 2)):
        float_block = paged_block_bytes(model, 16)
        int8_block = paged_block_bytes(model, 16, quantized=True)
        assert float_block == 2 * layers * heads * 16 * dim * size
        assert int8_block == 2 * layers * heads * 16 * (dim + size)  # codes and one scale
        budget = 64 * float_block
        sizes = dataclasses.replace(
            CB, block_size=16, num_blocks=None, kv_cache_memory_bytes=budget
        )
        auto = dataclasses.replace(sizes, kv_cache_dtype="auto").engine_shape(model)
        int8 = sizes.engine_shape(model)
        assert auto.num_blocks == 64 and int8.num_blocks == budget // int8_block
        ratio = int8.num_blocks / auto.num_blocks  # tokens per byte, int8 over the model dtype
        assert ratio == pytest.approx({4: 256 / 68, 2: 128 / 66}[size], rel=0.02)
    # The pool allocated is the pool counted (scratch block included).
    shape = CB.engine_shape(f32)
    pool = init_state(f32, shape).cache
    leaves = (*pool.keys, *pool.values, *pool.key_scales, *pool.value_scales)
    counted = shape.num_blocks * paged_block_bytes(f32, CB.block_size, quantized=True)
    assert sum(x.nbytes for x in leaves) == counted


def test_pool_that_cannot_fit_raises_before_allocating(monkeypatch):
    model, _ = _model()
    monkeypatch.setattr("genjax.cache.memory.free_bytes", lambda devices: (1000, "free (test)"))
    with pytest.raises(CacheMemoryError, match="kv_cache_dtype='int8'"):
        check_pool_fits(model, 9, 4)
    with pytest.raises(CacheMemoryError, match=r"int8 \+ scales\) needs 47,872 bytes"):
        init_continuous_batching(model, _model()[1], None, dataclasses.replace(CB, num_blocks=11))


@pytest.mark.parametrize("value", ["fp8", "float16", "INT8", None, jnp.int8])
def test_bad_kv_cache_dtype_raises_naming_it(value):
    model, params = _model()
    with pytest.raises(InputError, match=r"ContinuousBatchingConfig\.kv_cache_dtype=.*'int8'"):
        init_continuous_batching(model, params, None, dataclasses.replace(CB, kv_cache_dtype=value))


def test_pool_sizes_from_bytes_are_checked():
    model, params = _model()
    both = dataclasses.replace(CB, num_blocks=20, kv_cache_memory_bytes=10**6)
    with pytest.raises(InputError, match="both num_blocks=20 and kv_cache_memory_bytes"):
        init_continuous_batching(model, params, None, both)
    small = dataclasses.replace(CB, num_blocks=None, kv_cache_memory_bytes=40_000)  # 9 blocks
    with pytest.raises(InputError, match=r"kv_cache_memory_bytes=40,000\) holds 8 usable"):
        init_continuous_batching(model, params, None, small)
    with pytest.raises(InputError, match="call engine_shape"):
        small.engine_shape()
    with pytest.raises(InputError, match="kv_cache_memory_bytes must be a positive int"):
        dataclasses.replace(small, kv_cache_memory_bytes=0).engine_shape(model)


def test_serve_flags_reach_the_engine_sizes():
    from genjax.cli import main

    model, _ = _model()
    options = ServeOptions(max_length=64, kv_cache_dtype="int8", kv_cache_memory_bytes=10**6)
    sizes = engine_sizes(options, model)
    assert (sizes.kv_cache_dtype, sizes.kv_cache_memory_bytes) == ("int8", 10**6)
    assert engine_sizes(ServeOptions(max_length=64), model).kv_cache_dtype == "auto"
    assert main(["serve", "--kv-cache-dtype", "fp8"]) == 2  # argparse: not a choice


# ---- requests through the engine --------------------------------------------------------------
def _check_logprobs(differences):
    """The engine's log-probabilities against ``generate``'s with the int8 cache, all tokens:
    int8 codes round the last-bit differences of other batch shapes, so now and then a code
    lands one step apart and moves later log-probabilities by up to about 1e-3; most tokens
    see float noise only."""
    differences = np.concatenate(differences)
    assert differences.max() < 5e-3 and np.median(differences) < 1e-5, differences
    return differences


def test_int8_engine_equals_generate_with_the_int8_cache_across_prompt_lengths(manager):
    lengths = (5, 20, 3, 13, 17)  # within one chunk, and over two or three
    prompts = [_prompt(10 + i, n) for i, n in enumerate(lengths)]
    preempted = manager.metrics()["preemptions"]
    outputs = _run(manager, prompts)
    assert manager.metrics()["preemptions"] == preempted  # a recomputed request would differ
    differences, floats = [], []
    for prompt, out in zip(prompts, outputs, strict=True):
        tokens, logprobs = _reference(tuple(prompt))
        assert out.status is RequestStatus.FINISHED
        assert out.generated_tokens == tokens, len(prompt)
        differences.append(np.abs(np.asarray(out.logprobs) - logprobs))
        if len(prompt) < CHUNK:  # the float cache (one program for the short prompts)
            floats.append(out.logprobs - _reference(tuple(prompt), quantized=False)[1])
    differences = _check_logprobs(differences)
    # The pool is int8: the float cache's log-probabilities are far further away.
    assert np.median(np.abs(np.concatenate(floats))) > 1e-4 > 10 * np.median(differences)
    # Chunking moves the numbers a little (each chunk reads the one before through its codes);
    # on this model the unchunked call still gives the same tokens.
    tokens, logprobs = _reference(tuple(prompts[3]), chunked=False)
    assert outputs[3].generated_tokens == tokens
    assert 1e-4 < np.abs(np.asarray(outputs[3].logprobs) - logprobs).mean() < 0.05


def test_prefix_hits_are_cut_to_whole_chunks_so_shared_blocks_stay_exact(manager):
    prefix = _prompt(40, 13)  # 3 shared blocks of 4; 12 is no multiple of C = 8: 8 are taken
    first = prefix + _prompt(41, 4)
    # The second shares 3 blocks with the first, 8 tokens taken; the third 4 blocks, 16 taken.
    prompts = [first, prefix + _prompt(42, 7), first[:16] + _prompt(43, 1)]
    before = manager.metrics()
    outputs = _run(manager, prompts)
    after = manager.metrics()
    assert after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"] == 8 + 16
    assert after["preemptions"] == before["preemptions"]
    differences = []
    for prompt, out in zip(prompts, outputs, strict=True):
        tokens, logprobs = _reference(tuple(prompt))
        assert out.generated_tokens == tokens
        differences.append(np.abs(np.asarray(out.logprobs) - logprobs))
    _check_logprobs(differences)


def test_no_compilation_after_warmup_with_the_int8_pool(manager):
    rng = np.random.default_rng(5)
    with compiles() as compiled:
        ids = []
        for i in range(5):
            spec = dict(max_new_tokens=int(rng.integers(1, 9)), seed=i)
            if i % 2:
                spec.update(do_sample=True, temperature=0.8, top_p=0.9, repetition_penalty=1.2)
            ids.append(manager.add_request(_prompt(60 + i, int(rng.integers(1, 30))), **spec))
        outs = [manager.get_result(i, timeout=300) for i in ids]
    assert all(o.status is RequestStatus.FINISHED for o in outs)
    assert compiled == []
    metrics = manager.metrics()
    counted = manager.shape.num_blocks * paged_block_bytes(manager.model, 4, quantized=True)
    assert metrics["kv_cache_bytes"] == counted
    assert metrics["kv_cache_tokens"] == (manager.shape.num_blocks - 1) * 4


def test_request_cache_implementation_must_match_the_pool(manager):
    model, params = _model()
    prompt = _prompt(70, 6)
    # On the int8 pool, "quantized" is what it runs: the same tokens as without it.
    (out,) = _run(manager, [prompt], **QUANTIZED)
    assert out.generated_tokens == _reference(tuple(prompt))[0]
    with pytest.raises(UnsupportedError, match=r"cache_config\['nbits'\]=4"):
        manager.add_request(prompt, cache_implementation="quantized", cache_config={"nbits": 4})
    with pytest.raises(UnsupportedError, match="offloaded.*kv_cache_dtype"):
        manager.add_request(prompt, cache_implementation="offloaded")
    with pytest.raises(GenerationConfigError, match="cache_config"):
        manager.add_request(prompt, cache_implementation="static", cache_config={"nbits": 8})
    # A float pool refuses it and names the engine-level option (nothing is queued).
    floats = init_continuous_batching(
        model, params, None, dataclasses.replace(CB, kv_cache_dtype="auto")
    )
    try:
        with pytest.raises(UnsupportedError, match="kv_cache_dtype='int8'"):
            floats.add_request(prompt, **QUANTIZED)
        assert floats.metrics()["waiting"] == 0
    finally:
        floats.stop()
