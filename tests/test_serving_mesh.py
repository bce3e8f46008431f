"""The continuous-batching engine on a mesh of 8 virtual CPU devices gives one device's tokens.

One tiny GQA Llama (8 query heads, 4 KV heads): on a (2, 4) mesh its KV pool is split 4 ways
over KV heads; on (1, 8) the 4 KV heads do not divide 8 and the pool is replicated while the
query heads stay split, as ``genjax.generate(..., mesh=)`` falls back. Each engine has two
slots (decoded-row buckets 1 and 2: two step programs per mesh; the int8 one a single slot),
shared by the whole file.
"""

import dataclasses
import functools
import tempfile

import jax
import numpy as np
import pytest
from matrix import by_default

import genjax
from genjax import GenerationConfig, sharding
from genjax.cache.memory import paged_block_bytes
from genjax.errors import CacheMemoryError, ShardingError, UnsupportedError
from genjax.serving import ContinuousBatchingConfig, RequestStatus, init_continuous_batching
from genjax.testing import MESH_LLAMA, count_compiles, write_random_checkpoint

pytestmark = pytest.mark.usefixtures("fast_compiles")

NEW, CHUNK = 8, 8
CB = ContinuousBatchingConfig(
    max_batch_size=2,
    block_size=4,
    max_length=32,
    prefill_chunk_size=CHUNK,
    max_decode_steps=4,
    max_logit_bias=0,
    max_bias_sequence_length=1,
    max_no_repeat_ngram_size=0,
    max_top_logprobs=2,
    max_constraint_states=0,
    poll_interval=0.01,
)
SAMPLED = dict(do_sample=True, temperature=0.8, top_p=0.9)
# (prompt length, seed or None for greedy): a prompt of one chunk, one of two, a short one.
WORKLOAD = ((5, None), (11, 3), (3, 7))


@functools.cache
def _model(quantize=None):
    path = tempfile.mkdtemp(prefix="genjax-serving-mesh-")
    write_random_checkpoint(
        path,
        "llama",
        **MESH_LLAMA,
        eos_token_id=None,  # NEW tokens each
    )
    return genjax.models.from_pretrained(path, quantize=quantize)


@functools.cache
def _manager(shape=None, kv_cache_dtype="auto"):
    model, params = _model()
    mesh = None if shape is None else sharding.make_mesh(shape)
    sizes = CB
    if kv_cache_dtype == "int8":  # one slot: one step program
        sizes = dataclasses.replace(CB, kv_cache_dtype="int8", max_batch_size=1)
    manager = init_continuous_batching(
        model, params, GenerationConfig(pad_token_id=0), sizes, mesh=mesh
    )
    manager.start()
    return manager


@pytest.fixture(scope="module", autouse=True)
def _stop_managers():
    yield
    for manager in (_manager(), _manager((2, 4)), _manager((1, 8))):
        manager.stop(block=True, timeout=30)


def _spec(x):
    """The mesh axis of each of ``x``'s dimensions (None: replicated)."""
    spec = tuple(x.sharding.spec)
    return spec + (None,) * (x.ndim - len(spec))


def _prompt(seed, length):
    return np.random.default_rng(seed).integers(3, 101, length).tolist()


def _run(manager, workload=WORKLOAD, **options):
    """Queues the workload's requests together; returns their final outputs."""
    with manager.pause():
        ids = [
            manager.add_request(
                _prompt(length, length),
                max_new_tokens=NEW,
                logprobs=2,
                **({} if seed is None else dict(seed=seed, **SAMPLED)),
                **options,
            )
            for length, seed in workload
        ]
    outs = [manager.get_result(i, timeout=300) for i in ids]
    assert all(o.status is RequestStatus.FINISHED for o in outs), outs
    return outs


@functools.cache
def _generate(length, seed, quantized=False):
    """``genjax.generate``'s new tokens for one workload request alone (``quantized``: with the
    int8 cache, whose numbers an int8 pool reproduces for a prompt within one chunk)."""
    model, params = _model()
    config = GenerationConfig(max_new_tokens=NEW, pad_token_id=0)
    if quantized:
        config = config.replace(cache_implementation="quantized", cache_config={"nbits": 8})
    if seed is not None:
        config = config.replace(**SAMPLED)
    ids = np.asarray([_prompt(length, length)], np.int32)
    key = None if seed is None else jax.random.key(seed)
    out = genjax.generate(model, params, ids, config, key=key)
    return np.asarray(out.sequences)[0, length:].tolist()


@functools.cache
def _one_device():
    return _run(_manager())


@pytest.mark.parametrize("shape", by_default([(2, 4), (1, 8)], keep=[(2, 4)], ids=str))
def test_meshed_engine_equals_one_device_and_generate(shape):
    meshed, alone = _run(_manager(shape)), _one_device()
    for (length, seed), out, ref in zip(WORKLOAD, meshed, alone, strict=True):
        assert out.generated_tokens == ref.generated_tokens == _generate(length, seed)
        np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=1e-5)
        for mine, theirs in zip(out.top_logprobs, ref.top_logprobs, strict=True):
            assert [t for t, _ in mine] == [t for t, _ in theirs]
            np.testing.assert_allclose([v for _, v in mine], [v for _, v in theirs], atol=1e-5)


def test_pool_is_split_over_kv_heads_and_params_over_model():
    split, replicated = _manager((2, 4)), _manager((1, 8))
    _run(split, workload=WORKLOAD[:1])  # the state after steps keeps its shardings
    pool = split._state.cache
    assert _spec(pool.keys[0]) == (None, "model", None, None)
    assert _spec(pool.values[0]) == (None, "model", None, None)
    assert {s.data.shape[1] for s in pool.keys[0].addressable_shards} == {1}  # 4 heads / 4
    assert _spec(split._state.tokens) == (None, None)
    # 4 KV heads on 8 devices: the pool is replicated, the query heads still split.
    assert _spec(replicated._state.cache.keys[0]) == (None, None, None, None)
    q_proj = replicated.params["layers"]["0"]["self_attn"]["q_proj"]["kernel"]
    assert _spec(q_proj) == ("model", None)
    # Params replaced under pause are placed on the mesh too.
    host = jax.device_get(split.params)
    with split.pause():
        split.params = host
    assert _spec(split.params["layers"]["0"]["mlp"]["up_proj"]["kernel"]) == ("model", None)
    assert (
        _run(split, workload=WORKLOAD[:1])[0].generated_tokens == _one_device()[0].generated_tokens
    )


def test_meshed_engine_compiles_nothing_after_warmup_and_forks_sequences():
    manager = _manager((2, 4))
    model, params = _model()
    prompt = _prompt(6, 6)
    config = GenerationConfig(max_new_tokens=NEW, pad_token_id=0, num_return_sequences=2, **SAMPLED)
    ids = np.asarray([prompt], np.int32)
    out = genjax.generate(model, params, ids, config, key=jax.random.key(4))
    rows = np.asarray(out.sequences)[:, len(prompt) :].tolist()
    with count_compiles() as compiled:
        workload = ((4, None), (9, 11), (14, 5), (2, None))
        _run(manager, workload=workload, repetition_penalty=1.2)
        rid = manager.add_request(prompt, generation_config=config, seed=4)
        forked = manager.get_result(rid, timeout=300)
    assert compiled == []
    assert forked.sequences == rows and rows[0] != rows[1]


@pytest.mark.slow  # a second meshed engine (9 s): runs with -m slow
def test_int8_pool_scales_are_split_and_tokens_equal_generate_with_the_int8_cache():
    manager = _manager((2, 4), "int8")
    try:
        outs = _run(manager, workload=WORKLOAD[:1])
        pool = manager._state.cache
        assert pool.keys[0].dtype == np.int8
        assert _spec(pool.key_scales[0]) == (None, "model", None)
        assert _spec(pool.value_scales[0]) == (None, "model", None)
        assert outs[0].generated_tokens == _generate(*WORKLOAD[0], quantized=True)
    finally:
        manager.stop(block=True, timeout=30)


def test_mesh_is_checked_before_anything_compiles():
    model, params = _model()
    with pytest.raises(ShardingError, match="8 attention heads do not divide over mesh axis"):
        init_continuous_batching(model, params, None, CB, mesh=sharding.make_mesh((1, 3)))
    with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh"):
        init_continuous_batching(model, params, None, CB, mesh=(2, 4))
    model4, params4 = _model("int4")
    with pytest.raises(UnsupportedError, match="4-bit params"):
        init_continuous_batching(model4, params4, None, CB, mesh=sharding.make_mesh((1, 4)))


def test_pool_must_fit_each_device_share_on_a_mesh(monkeypatch):
    model, params = _model()
    needed = CB.engine_shape(model).num_blocks * paged_block_bytes(model, CB.block_size)
    free = (needed // 2, "free (test)")
    monkeypatch.setattr("genjax.cache.memory.free_bytes", lambda devices: free)
    with pytest.raises(CacheMemoryError, match=f"needs {needed:,} bytes"):
        init_continuous_batching(model, params, None, CB)
    split = init_continuous_batching(model, params, None, CB, mesh=sharding.make_mesh((2, 4)))
    assert split.metrics()["kv_cache_bytes"] == needed  # the whole pool, a quarter per device
    free = (needed // 8, "free (test)")
    with pytest.raises(CacheMemoryError, match="per device, split 4 ways"):
        init_continuous_batching(model, params, None, CB, mesh=sharding.make_mesh((2, 4)))
