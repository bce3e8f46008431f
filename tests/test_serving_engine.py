"""The continuous-batching engine: paged cache, the pure step, the scheduler and the manager.

One two-layer random Llama; one engine shape (3 slots, blocks of 4, 48 tokens per request), so
the step compiles once for the file. Greedy requests through the engine must equal
``genjax.generate`` of each request alone, token for token.

No test waits on the clock or on thread timing: arrivals that must land mid-request are made by a
result handler (it runs in the loop thread between steps), cancellations likewise, several
requests arrive together under ``pause()``, and the scheduler frees a request's blocks before its
final output is published. Timeouts only bound a broken run.
"""

import dataclasses
import functools
import io
import itertools
import sys
import tempfile
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from matrix import by_default

import genjax
from genjax import GenerationConfig
from genjax import processors as P
from genjax.cache import GatheredKVCache, KVCache, PagedKVCache, attention_bias
from genjax.errors import GenerationConfigError, InputError, UnsupportedError
from genjax.processors import LogitsContext
from genjax.serving import (
    BlockAllocator,
    ContinuousBatchingConfig,
    RequestStatus,
    RowSettings,
    StepInput,
    compile_step,
    init_continuous_batching,
    init_state,
)
from genjax.serving.blocks import block_hashes
from genjax.serving.choosing import ban_repeated_ngrams
from genjax.serving.config import attention_spans
from genjax.serving.options import build_request
from genjax.serving.runner import ServeOptions, engine_sizes
from genjax.serving.step import reads_pool_in_place
from genjax.testing import count_compiles as compiles
from genjax.testing import write_random_checkpoint

pytestmark = pytest.mark.usefixtures("fast_compiles")


# 13 usable blocks of 4 slots: three requests growing past ~17 tokens each force a preemption.
CB = ContinuousBatchingConfig(
    max_batch_size=3,
    block_size=4,
    max_length=48,
    num_blocks=14,
    prefill_chunk_size=8,
    prefill_chunk_sizes=(4,),  # a prompt's last 1-4 tokens run in lanes of 4
    max_prefill_requests=2,  # requests arriving together prefill together (lanes 1, 2)
    attention_spans=(16,),  # steps whose rows hold at most 4 blocks attend over those alone
    max_decode_steps=4,
    max_constraint_states=0,  # constraints: tests/test_serving_constraints.py
    poll_interval=0.01,
)
REF_NEW = 12  # reference generate calls make 12 tokens; shorter requests compare a prefix


class _CharTokenizer:
    """Token t decodes to one letter: enough to test stop strings on the host."""

    def decode(self, ids):
        return "".join(chr(ord("a") + int(t) % 26) for t in ids)


@functools.cache
def _model():
    path = tempfile.mkdtemp(prefix="genjax-serving-")
    # No EOS in config.json: each request names its own EOS ids (the model's would apply to
    # the engine and to the generate reference alike, as test_model_generation_config checks).
    write_random_checkpoint(path, "llama", num_hidden_layers=2, eos_token_id=None)
    return genjax.models.from_pretrained(path)


@functools.cache
def _manager():
    model, params = _model()
    manager = init_continuous_batching(
        model, params, GenerationConfig(pad_token_id=0), CB, tokenizer=_CharTokenizer()
    )
    manager.start()
    return manager


@pytest.fixture(scope="module")
def manager():
    m = _manager()
    yield m
    m.stop(block=True, timeout=30)


def _prompt(seed, length):
    model, _ = _model()
    return np.random.default_rng(seed).integers(3, model.vocab_size, length).tolist()


@functools.cache
def _reference(prompt: tuple, repetition_penalty=None, eos=None, min_new=None, extra=()):
    """Greedy new tokens of ``genjax.generate`` on the prompt alone, cut after EOS; ``extra``:
    more config fields as ``(name, value)`` pairs (hashable values)."""
    model, params = _model()
    config = GenerationConfig(
        max_new_tokens=REF_NEW,
        pad_token_id=0,
        repetition_penalty=repetition_penalty,
        eos_token_id=list(eos) if eos else None,
        min_new_tokens=min_new,
        **{name: _lists(value) for name, value in extra},
    )
    out = genjax.generate(model, params, np.asarray([prompt], np.int32), config)
    new = np.asarray(out.sequences)[0, len(prompt) :].tolist()
    for i, token in enumerate(new):
        if eos and token in eos:
            return new[: i + 1]
    return new


# ---- the paged cache ------------------------------------------------------------------------
def test_attention_bias_per_row_index_equals_scalar_rows():
    mask = jnp.ones((2, 10), jnp.int32)
    per_row = attention_bias(mask, jnp.array([3, 5], jnp.int32), 2, sliding_window=4)
    for row, index in enumerate((3, 5)):
        scalar = attention_bias(mask, jnp.asarray(index, jnp.int32), 2, sliding_window=4)
        np.testing.assert_array_equal(per_row[row], scalar[row])


def test_paged_cache_runs_the_model_like_the_contiguous_cache():
    model, params = _model()
    ids = jnp.asarray([_prompt(1, 6), _prompt(2, 6)], jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(6, dtype=jnp.int32), (2, 6))
    dense = model.init_cache(2, 12)
    paged = PagedKVCache.create(2, 8, 4, 3, 2, model.num_kv_heads, model.head_dim)
    paged = paged.replace(block_tables=jnp.asarray([[5, 2, 7], [1, 6, 3]], jnp.int32))
    mask = jnp.ones((2, 12), jnp.int32)
    apply = jax.jit(model.apply)  # eager runs op by op, several times slower
    want, dense = apply(params, ids, positions, dense, mask)
    got, paged = apply(params, ids, positions, paged, mask)
    np.testing.assert_allclose(got, want, atol=1e-5)
    token = jnp.argmax(want[:, -1], -1)[:, None].astype(jnp.int32)
    want, _ = apply(params, token, positions[:, -1:] + 1, dense, mask)
    got, paged = apply(params, token, positions[:, -1:] + 1, paged, mask)
    np.testing.assert_allclose(got, want, atol=1e-5)
    np.testing.assert_array_equal(paged.index, [7, 7])
    assert isinstance(dense, KVCache)


@functools.cache
def _bundled(dtype: str = "float32"):
    """The bundled model: head width 64, so the CPU attention kernel reads paged pools."""
    model, params = genjax.models.from_pretrained(genjax.io.bundled.path(), dtype=dtype)
    return model.with_generation_config(None), params


@pytest.mark.parametrize(
    "quantized, in_place_dtype",
    by_default(
        [(False, None), (True, None), (False, "float32"), (False, "bfloat16")],
        keep=[(False, None), (True, None), (False, "float32")],  # bfloat16: -m slow
        ids=["float", "int8", "float32-in-place", "bfloat16-in-place"],
        unpack=True,
    ),
)  # fmt: skip
def test_gathered_blocks_decode_like_the_pool_and_scatter_back_only_the_slots_written(
    quantized, in_place_dtype
):
    """The pool's own decode (read in place by the CPU kernel where the head width allows, else
    gathered per layer) equals the gathered view's, bit for bit."""
    model, params = _bundled(in_place_dtype) if in_place_dtype else _model()
    heads_of_64 = in_place_dtype is not None
    ids = jnp.asarray([_prompt(1, 6), _prompt(2, 6)], jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(6, dtype=jnp.int32), (2, 6))
    layers = model.config.num_layers
    dtype = jnp.dtype(model.config.dtype)
    paged = PagedKVCache.create(
        layers, 8, 4, 3, 2, model.num_kv_heads, model.head_dim, dtype, quantized=quantized
    )
    paged = paged.replace(block_tables=jnp.asarray([[5, 2, 7], [1, 6, 0]], jnp.int32))
    mask = jnp.ones((2, 12), jnp.int32)
    _, paged = model.apply(params, ids, positions, paged, mask)
    paged = paged.replace(index=jnp.asarray([6, 4], jnp.int32))  # row 1 overwrites slots 4, 5
    start, gathered = paged, paged.gather()
    assert isinstance(gathered, GatheredKVCache) and gathered.length == 12
    tokens = jnp.asarray([[7], [9]], jnp.int32)
    paged_text = jax.jit(model.apply).lower(params, tokens, paged.index[:, None], paged, mask)
    text = paged_text.as_text()
    assert ("genjax_pagedattention_scores" in text) == heads_of_64 == reads_pool_in_place(paged)
    assert ("genjax_write_pages_16" in text) == (in_place_dtype == "bfloat16")  # pool in place
    for _ in range(3):  # an int8 pool's view requantizes the slot before each call's
        fed = paged.index[:, None]
        want, paged = model.apply(params, tokens, fed, paged, mask)
        got, gathered = model.apply(params, tokens, fed, gathered, mask)
        np.testing.assert_array_equal(got, want)
        tokens = jnp.argmax(want[:, -1], -1)[:, None].astype(jnp.int32)
    back = start.scatter(gathered, start.index, count=4)  # up to 4 slots; rows wrote 3
    np.testing.assert_array_equal(back.index, [9, 7])
    pools = ("keys", "values", "key_scales", "value_scales")
    for name in pools:
        for got, want in zip(getattr(back, name), getattr(paged, name), strict=True):
            np.testing.assert_array_equal(got[1:], want[1:])  # block 0 is scratch


# ---- the block allocator --------------------------------------------------------------------
def test_block_allocator_shares_counts_and_evicts_a_prefix_tail_first():
    allocator = BlockAllocator(5)  # blocks 1..4
    h0, h1, h2 = block_hashes(list(range(12)), block_size=4)
    a = allocator.allocate(2)
    allocator.register(a[0], h0)
    allocator.register(a[1], h1)
    b = allocator.match([h0, h1, h2])  # the longest known run
    assert b == a and allocator.refcount(a[0]) == 2 and allocator.num_used == 2
    allocator.free(a)
    assert allocator.refcount(a[0]) == 1 and allocator.num_used == 2
    allocator.free(b)
    assert allocator.num_used == 0 and allocator.num_cached == 2 and allocator.num_free == 4
    # Never-used blocks go first, then the least recently freed: the prefix's tail.
    c = allocator.allocate(3)
    assert c[:2] == [3, 4] and c[2] == a[1] and allocator.num_cached == 1
    assert allocator.match([h0, h1]) == [a[0]]  # h1 was forgotten with its block
    assert allocator.allocate(1) is None and allocator.num_used == 4


def test_attention_spans_are_powers_of_two_in_blocks_then_the_whole_table():
    assert attention_spans(4096, 16, 256) == (16, 64, 256)  # 256, 1024, 4096 tokens
    assert attention_spans(768, 16, 128, growth=2) == (8, 16, 32, 48)
    assert attention_spans(200, 16, 256) == (13,)
    assert attention_spans(48, 4, 16) == (4, 12)
    shape = CB.engine_shape()
    assert shape.spans == (4, 12)
    assert shape.programs == ((1, 4), (1, 12), (2, 4), (2, 12), (3, 4), (3, 12))
    assert ContinuousBatchingConfig(max_length=512).engine_shape().spans == (16, 32)
    assert ContinuousBatchingConfig(max_length=256).engine_shape().spans == (16,)
    assert ContinuousBatchingConfig(attention_spans=()).engine_shape().spans == (32,)
    for bad in ((0,), (513,), (True,), 128):
        with pytest.raises(InputError, match="attention_spans"):
            ContinuousBatchingConfig(attention_spans=bad).engine_shape()


def test_chunk_lengths_default_to_a_half_and_a_quarter_of_the_chunk_and_are_checked():
    def chunks(**kwargs):
        return ContinuousBatchingConfig(**kwargs).engine_shape().chunks

    assert chunks() == (8, 16, 32)  # C = 32
    assert chunks(prefill_chunk_size=64) == (16, 32, 64)
    assert chunks(prefill_chunk_size=16) == (8, 16)
    assert chunks(prefill_chunk_size=8) == (8,)
    assert chunks(prefill_chunk_size=24) == (12, 24)  # 6 is below 8
    assert chunks(prefill_chunk_sizes=()) == (32,)
    assert chunks(prefill_chunk_sizes=(3, 32, 3)) == (3, 32)
    shape = CB.engine_shape()
    assert shape.chunks == (4, 8)
    assert shape.prefill_spans(4) == shape.prefill_spans(8) == (4, 12)
    assert len(shape.prefill_programs) == 2 * 2 * 2  # lanes x chunk lengths x spans
    small = ContinuousBatchingConfig(max_length=64, block_size=4, attention_spans=(8,))
    assert small.engine_shape().spans == (2, 16)
    assert small.engine_shape().prefill_spans(32) == (16,)  # 2 blocks cannot hold 32 slots
    assert small.engine_shape().prefill_spans(8) == (2, 16)
    for bad in ((0,), (33,), (True,), 16, (8.0,)):
        with pytest.raises(InputError, match="prefill_chunk_sizes"):
            ContinuousBatchingConfig(prefill_chunk_sizes=bad).engine_shape()


def test_prefill_lanes_are_powers_of_two_then_the_limit_and_checked():
    assert CB.engine_shape().lane_buckets == (1, 2)
    assert ContinuousBatchingConfig(max_prefill_requests=6).engine_shape().lane_buckets == (
        1,
        2,
        4,
        6,
    )
    for bad in (0, 9):  # 9 > max_batch_size 8
        with pytest.raises(InputError, match="max_prefill_requests"):
            ContinuousBatchingConfig(max_prefill_requests=bad).engine_shape()
    # genjax serve: 4 by default (fewer with fewer slots); a value given is kept, and checked.
    model, _ = _model()
    sizes = [
        engine_sizes(ServeOptions(max_batch_size=b, max_prefill_requests=p), model)
        for b, p in ((8, None), (2, None), (8, 8))
    ]
    assert [s.max_prefill_requests for s in sizes] == [4, 2, 8]
    too_many = engine_sizes(ServeOptions(max_batch_size=2, max_prefill_requests=3), model)
    with pytest.raises(InputError, match="max_prefill_requests=3 exceeds max_batch_size=2"):
        too_many.engine_shape(model)


# ---- the step alone -------------------------------------------------------------------------
def test_step_alone_prefills_chooses_and_decodes_a_hand_checked_request():
    model, params = _model()
    shape = CB.engine_shape()
    state = init_state(model, shape)
    step = compile_step(model, shape.max_steps, shape.max_top_logprobs)
    prompt = _prompt(3, 3)
    tables = np.zeros((3, shape.max_blocks_per_row), np.int32)
    tables[1, :2] = [9, 4]  # slot 1 holds positions 0..7 in blocks 9 and 4
    row = RowSettings.empty(1, shape)
    row = row.replace(max_new_tokens=np.asarray([4], np.int32))
    chunk = np.zeros((1, shape.chunk), np.int32)  # one lane: one prompt prefilled
    chunk[0, :3] = prompt
    work = StepInput(
        block_tables=tables,
        release=np.zeros((3,), bool),
        num_steps=np.asarray(2, np.int32),
        prefill_slot=np.asarray([1], np.int32),
        prefill_start=np.asarray([0], np.int32),
        prefill_tokens=chunk,
        prefill_count=np.asarray([3], np.int32),
        prefill_last=np.asarray([True]),
        prefill_table=tables[[1], :2],  # span 2 blocks: the chunk's C = 8 slots
        prompt_length=np.asarray([3], np.int32),
        row=row,
        admit=np.asarray([True]),
        constraint_state=np.asarray([-1], np.int32),  # unconstrained
        history=np.zeros((1, shape.max_length), np.int32),
        decode_rows=np.asarray([1], np.int32),  # bucket 1: slot 1 alone goes through the model
        decode_tables=tables[[1], :2],  # span 2 blocks: the decode loop reads only those
    )
    state, out = step(params, state, work)
    want = _reference(tuple(prompt))
    # The chunk's last prompt logits give the first token; two decode steps give two more.
    assert out.first_token.tolist() == [want[0]] and int(out.steps) == 2
    np.testing.assert_array_equal(out.tokens[:2, 1], want[1:3])
    np.testing.assert_array_equal(out.tokens[:, [0, 2]], -1)  # free slots chose nothing
    np.testing.assert_array_equal(out.tokens[2:], -1)
    assert not np.asarray(out.finished).any()
    np.testing.assert_array_equal(state.lengths, [0, 6, 0])  # 3 prompt + 3 new tokens
    np.testing.assert_array_equal(state.cache.index[1], 5)  # the newest token is not fed yet
    np.testing.assert_array_equal(state.tokens[1, :6], prompt + want[:3])
    np.testing.assert_array_equal(state.decoding, [False, True, False])
    # Writes went to the row's blocks 9 and 4 (the chunk's padding and the free rows' decode
    # steps to the scratch block 0); no other block was touched.
    written = np.abs(np.asarray(state.cache.keys[0])).sum(axis=(1, 2, 3)) > 0
    assert set(np.flatnonzero(written)) <= {0, 4, 9} and written[4] and written[9]


# ---- the manager ----------------------------------------------------------------------------
def _bounded(call, timeout=120.0):
    """Runs ``call()`` in a helper thread and returns its result; fails (rather than hangs)
    when it has not returned within ``timeout`` seconds."""
    result = []
    thread = threading.Thread(target=lambda: result.append(call()), daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"{call} did not return"
    return result[0]


def _lists(value):
    """Tuples back to the lists a GenerationConfig field takes."""
    return [_lists(v) for v in value] if isinstance(value, tuple) else value


def test_engine_greedy_equals_generate_alone_across_a_mixed_workload(manager):
    prompts = [_prompt(10 + i, n) for i, n in enumerate((5, 13, 3, 20, 9, 17, 2))]
    first = _reference(tuple(prompts[2]))
    eos = (first[3], 7)  # an id the greedy run meets at its 4th token, and one more
    plain = _reference(tuple(prompts[6]))
    # Bans that change the greedy tokens: its first token suppressed, its third a bad word.
    bans = (("no_repeat_ngram_size", 2), ("suppress_tokens", (plain[0],)))
    bans += (("bad_words_ids", ((plain[2],),)),)
    specs = [
        dict(max_new_tokens=12, no_repeat_ngram_size=1),
        dict(max_new_tokens=6, repetition_penalty=1.3),
        dict(max_new_tokens=10, eos_token_id=list(eos)),
        dict(max_new_tokens=11, logprobs=1),
        dict(max_new_tokens=10, eos_token_id=list(eos), min_new_tokens=5),
        dict(max_new_tokens=9, logprobs=2),
        dict(max_new_tokens=12, repetition_penalty=1.3, **{k: _lists(v) for k, v in bans}),
    ]
    extras = [()] * 7
    extras[0], extras[6] = (("no_repeat_ngram_size", 1),), bans
    ids = ["mixed-0"]

    def arrive_while_the_first_decodes(out):
        if out.request_id == "mixed-0" and len(ids) == 1 and not out.is_finished():
            pairs = zip(prompts[1:], specs[1:], strict=True)
            ids.extend(manager.add_request(p, **s) for p, s in pairs)

    spans, chunk_spans = [], []  # the attention spans (blocks) of the decode loops and chunks
    lanes, lengths = [], []  # prompts prefilled together and the chunk length, per step with one
    step = manager._step

    def recorded(work):
        spans.append(work.decode_tables.shape[1])
        if (work.prefill_slot >= 0).any():
            chunk_spans.append(work.prefill_table.shape[1])
            lanes.append(int((work.prefill_slot >= 0).sum()))
            lengths.append(work.prefill_tokens.shape[1])
            longest = work.prefill_count[work.prefill_slot >= 0].max()
            assert lengths[-1] == (4 if longest <= 4 else 8), (longest, lengths[-1])
        return step(work)

    manager._step = recorded
    manager.register_result_handler(arrive_while_the_first_decodes)
    try:
        manager.add_request(prompts[0], request_id="mixed-0", streaming=True, **specs[0])
        first_out = manager.get_result("mixed-0", timeout=300)
        assert len(ids) == 7, "the handler did not add the other requests"
        outputs = [first_out] + [manager.get_result(i, timeout=300) for i in ids[1:]]
    finally:
        del manager._step  # the class's again
    # Steps whose rows held at most 4 blocks read those alone; the others the whole table. So
    # did the prompt chunks (the preempted requests' recomputed ones end past 16 slots).
    assert set(spans) == {4, 12}, sorted(set(spans))
    assert set(chunk_spans) == {4, 12}, sorted(set(chunk_spans))
    assert max(lanes) >= 2, lanes  # the two free slots' requests started in the same step
    assert set(lengths) == {4, 8}, lengths  # prompts' last few tokens ran in lanes of 4
    for prompt, spec, extra, out in zip(prompts, specs, extras, outputs, strict=True):
        eos_ids = tuple(spec.get("eos_token_id", ())) or None
        if "logprobs" in spec:  # plain greedy: each token is its raw distribution's argmax
            assert [top[0][0] for top in out.top_logprobs] == out.generated_tokens
            assert [top[0][1] for top in out.top_logprobs] == out.logprobs
            assert {len(top) for top in out.top_logprobs} == {spec["logprobs"]}
        want = _reference(
            tuple(prompt),
            spec.get("repetition_penalty"),
            eos_ids,
            spec.get("min_new_tokens"),
            extra,
        )[: spec["max_new_tokens"]]
        assert out.status is RequestStatus.FINISHED
        assert out.generated_tokens == want, (spec, out.generated_tokens, want)
        assert out.finish_reason == ("stop" if eos_ids and want[-1] in eos_ids else "length")
        assert out.prompt_ids == prompt and len(out.timestamps) == len(want)
    assert outputs[2].finish_reason == "stop" and len(outputs[2].generated_tokens) == 4
    # The n-gram and token bans changed what the same requests give without them.
    for i, penalty in ((0, None), (6, 1.3)):
        unbanned = _reference(tuple(prompts[i]), penalty)[: specs[i]["max_new_tokens"]]
        assert outputs[i].generated_tokens != unbanned
    assert not {plain[0], plain[2]} & set(outputs[6].generated_tokens)
    new = outputs[0].generated_tokens  # size 1: no token of the prompt, none twice
    assert not set(new) & set(prompts[0]) and len(set(new)) == len(new), new
    metrics = manager.metrics()
    assert metrics["preemptions"] > 0  # 13 usable blocks for 7 requests of ~20
    assert metrics["blocks_in_use"] == 0  # freed before the last final output was published


def test_cancel_from_a_handler_ends_before_the_next_step_and_frees_every_block(manager):
    prompt = _prompt(30, 4)
    seen = []

    def cancel_at_three_tokens(out):
        if out.request_id == "cancel-me" and not seen and len(out.generated_tokens) >= 3:
            seen.append(out.generated_tokens)
            manager.cancel_request("cancel-me")

    manager.register_result_handler(cancel_at_three_tokens)
    manager.add_request(prompt, request_id="cancel-me", max_new_tokens=44, streaming=True)
    out = manager.get_result("cancel-me", timeout=300)
    assert out.status is RequestStatus.CANCELLED and out.finish_reason == "cancelled"
    # No step ran between the handler's cancel and its processing.
    assert out.generated_tokens == seen[0]
    assert seen[0] == _reference(tuple(prompt))[: len(seen[0])]
    assert list(manager.request_id_iter("cancel-me", timeout=60))[-1] == out
    assert manager.metrics()["blocks_in_use"] == 0


def test_cancel_of_a_queued_request_ends_it_with_no_tokens(manager):
    with manager.pause():
        rid = manager.add_request(_prompt(31, 5), max_new_tokens=8)
        manager.cancel_request(rid)
        manager.cancel_request("no-such-request")  # ignored
    out = manager.get_result(rid, timeout=300)
    assert out.status is RequestStatus.CANCELLED and out.generated_tokens == []
    assert manager.get_result("no-such-request", timeout=300) is None  # at once: unknown id
    assert list(manager.request_id_iter("no-such-request", timeout=300)) == []


@functools.cache
def _other_params():
    _, params = _model()
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(9), len(leaves))
    noisy = [
        x + 0.05 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys, strict=True)
    ]
    return jax.tree.unflatten(tree, noisy)


def _greedy_from(prefix_params, prefix, params, last, count):
    """Greedy tokens after feeding ``last``, the cache holding ``prefix`` computed with
    ``prefix_params`` and every later token with ``params`` (a contiguous cache, no engine)."""
    model, _ = _model()
    cache = model.init_cache(1, CB.max_length)
    mask = jnp.ones((1, CB.max_length), jnp.int32)
    positions = jnp.arange(len(prefix), dtype=jnp.int32)[None]
    _, cache = model.apply(prefix_params, jnp.asarray([prefix], jnp.int32), positions, cache, mask)
    out, token = [], last
    for position in range(len(prefix), len(prefix) + count):
        feed = (jnp.asarray([[token]], jnp.int32), jnp.asarray([[position]], jnp.int32))
        logits, cache = model.apply(params, *feed, cache, mask)
        token = int(jnp.argmax(logits[0, -1]))
        out.append(token)
    return out


def test_params_replaced_under_pause_in_a_handler_drive_the_next_steps(manager):
    _, params = _model()
    new = _other_params()
    prompt = _prompt(90, 6)
    seen = []

    def swap_at_three_tokens(out):
        if out.request_id == "swap" and not seen and len(out.generated_tokens) >= 3:
            seen.append(out.generated_tokens)
            with manager.pause():
                manager.params = new

    manager.register_result_handler(swap_at_three_tokens)
    try:
        manager.add_request(prompt, request_id="swap", max_new_tokens=12, streaming=True)
        out = manager.get_result("swap", timeout=300)
    finally:
        with manager.pause():
            manager.params = params
    k = len(seen[0])
    old = _reference(tuple(prompt))
    assert out.generated_tokens[:k] == old[:k] == seen[0]
    # The tokens fed before the swap (prompt and seen[:-1]) stay in the cache as computed.
    later = _greedy_from(params, prompt + seen[0][:-1], new, seen[0][-1], 12 - k)
    assert out.generated_tokens[k:] == later
    assert later != old[k:]  # the new params show


def test_pause_holds_every_step_while_params_are_replaced(manager):
    _, params = _model()
    new = _other_params()
    prompt = _prompt(91, 7)
    with manager.pause():
        steps = manager.metrics()["steps"]
        manager.params = new
        rid = manager.add_request(prompt, max_new_tokens=8, streaming=True)
        assert manager.metrics()["steps"] == steps
    try:
        out = manager.get_result(rid, timeout=300)
    finally:
        with manager.pause():
            manager.params = params
    want = _greedy_from(new, prompt[:-1], new, prompt[-1], 8)
    assert out.generated_tokens == want
    assert want != _reference(tuple(prompt))[:8]


def test_prefix_caching_shares_full_blocks_and_prefills_only_the_suffix():
    model, params = _model()
    prefix = _prompt(100, 17)  # blocks 0-3 (16 tokens) are shared; block 4 differs
    prompts = [prefix + _prompt(101, 3), prefix + _prompt(102, 5)]
    runs = {}
    for caching in (True, False):
        cb = dataclasses.replace(CB, prefix_caching=caching)
        m = init_continuous_batching(model, params, GenerationConfig(pad_token_id=0), cb)
        m.start()
        try:
            with m.pause():  # both queued before the first step: A prefills, then B is admitted
                ids = m.add_requests(prompts, max_new_tokens=5)  # 6 + 7 blocks: no preemption
            runs[caching] = ([m.get_result(i, timeout=300) for i in ids], m.metrics())
        finally:
            m.stop(block=True, timeout=60)
    (cached, metrics), (plain, plain_metrics) = runs[True], runs[False]
    for prompt, a, b in zip(prompts, cached, plain, strict=True):
        assert a.generated_tokens == b.generated_tokens == _reference(tuple(prompt))[:5]
    # B (22 tokens) found A's first 4 blocks and prefilled only its last 6 tokens.
    assert plain_metrics["prefill_tokens"] == 20 + 22
    assert metrics["prefill_tokens"] == 20 + 6
    assert metrics["prefix_cache_hit_tokens"] == 16 and metrics["prefix_cache_query_tokens"] == 42
    assert metrics["prefix_cache_hit_rate"] == pytest.approx(16 / 42)
    assert plain_metrics["prefix_cache_hit_rate"] == 0.0
    # Nothing is referenced at the end; A's 5 and B's own fifth prompt block stay cached.
    assert metrics["blocks_in_use"] == 0 and metrics["blocks_cached"] == 6
    assert metrics["blocks_free"] == CB.num_blocks - 1
    assert plain_metrics["blocks_in_use"] == 0 and plain_metrics["blocks_cached"] == 0


def test_metrics_count_requests_tokens_and_latencies():
    model, params = _model()
    m = init_continuous_batching(model, params, GenerationConfig(pad_token_id=0), CB)
    m.start()
    try:
        with m.pause():
            ids = m.add_requests([_prompt(110 + i, 6) for i in range(4)], max_new_tokens=5)
            waiting = m.metrics()
        outs = [m.get_result(i, timeout=300) for i in ids]
        metrics = m.metrics()
    finally:
        m.stop(block=True, timeout=60)
    assert waiting["running"] == 0 and waiting["tokens"] == 0
    assert metrics["running"] == metrics["waiting"] == 0
    assert metrics["tokens"] == sum(len(o.generated_tokens) for o in outs) == 20
    assert metrics["tokens_per_second"] > 0 and metrics["busy_seconds"] > 0
    ttft, itl = metrics["ttft_seconds"], metrics["itl_seconds"]
    assert ttft["count"] == 4 and sum(ttft["counts"]) == 4
    assert len(ttft["counts"]) == len(ttft["edges"]) + 1
    assert itl["count"] == 4 * 4 and itl["sum"] >= 0
    first = [o.timestamps[0] - o.created_time for o in outs]
    assert ttft["sum"] == pytest.approx(sum(first), abs=1e-6)


def test_stop_strings_end_the_request_and_trim_what_follows(manager):
    prompt = _prompt(40, 6)
    want = _reference(tuple(prompt))
    stop = _CharTokenizer().decode(want[2:4])
    out = manager.get_result(
        manager.add_request(prompt, max_new_tokens=12, stop_strings=[stop]), timeout=120
    )
    assert out.finish_reason == "stop"
    text = _CharTokenizer().decode(out.generated_tokens)
    assert stop in text and stop not in text[:-1]
    assert out.generated_tokens == want[: len(out.generated_tokens)]


def test_no_compilation_after_warmup_over_a_random_workload(manager):
    rng = np.random.default_rng(5)
    with compiles() as compiled:
        ids = []
        for i in range(6):
            spec = dict(max_new_tokens=int(rng.integers(1, 10)))
            if i % 2:
                spec.update(do_sample=True, temperature=0.8, top_p=0.9, top_k=20, min_p=0.05)
            if i % 4 == 1:
                spec.update(typical_p=0.9, epsilon_cutoff=1e-4, eta_cutoff=1e-3)
            if i % 3 == 0:
                spec.update(repetition_penalty=1.2, eos_token_id=[5, 6], min_new_tokens=2)
            if i % 2 == 0:
                spec.update(presence_penalty=0.1 * i, frequency_penalty=-0.2, logprobs=i % 4)
                spec.update(sequence_bias=[[[int(rng.integers(3, 50))], float(i)]])
            ids.append(
                manager.add_request(_prompt(50 + i, int(rng.integers(1, 30))), seed=i, **spec)
            )
        outs = [manager.get_result(i, timeout=300) for i in ids]
    assert all(o.status is RequestStatus.FINISHED for o in outs)
    assert compiled == []


def test_add_request_rejects_what_the_engine_cannot_run(manager):
    model, _ = _model()
    with pytest.raises(UnsupportedError, match="guidance_scale=1.5.*continuous-batch"):
        manager.add_request([3, 4], guidance_scale=1.5)
    with pytest.raises(InputError, match="encoder_no_repeat_ngram_size=9.*max_no_repeat_ngram"):
        manager.add_request([3, 4], encoder_no_repeat_ngram_size=9)
    with pytest.raises(InputError, match="max_no_repeat_ngram_size to 9"):
        manager.add_request([3, 4], no_repeat_ngram_size=9)
    with pytest.raises(InputError, match="max_bias_sequence_length to 9"):
        manager.add_request([3, 4], bad_words_ids=[[5], list(range(6, 15))])
    with pytest.raises(InputError, match="give 4 biased tokens.*max_logit_bias"):
        small = dataclasses.replace(manager.shape, max_bias=3)
        config = GenerationConfig(suppress_tokens=[3, 4, 5, 6], max_new_tokens=2)
        build_request("x", [3, 4], config, small, 64, seed=0, streaming=False)
    with pytest.raises(UnsupportedError, match="not supported in continuous batching"):
        manager.add_request([3, 4], num_beams=2)
    with pytest.raises(UnsupportedError, match="output_attentions=True"):
        manager.add_request([3, 4], output_attentions=True)
    # transformers v5 writes these defaults into generation_config.json: not an option set
    quiet = dict(output_attentions=False, output_hidden_states=False, output_logits=False)
    manager.cancel_request(manager.add_request([3, 4], max_new_tokens=1, **quiet))
    with pytest.raises(InputError, match="max_top_logprobs"):
        manager.add_request([3, 4], logprobs=CB.max_top_logprobs + 1)
    with pytest.raises(InputError, match="presence_penalty must be finite"):
        manager.add_request([3, 4], presence_penalty=float("nan"))
    with pytest.raises(InputError, match="outside the vocabulary"):
        manager.add_request([3, model.vocab_size])
    with pytest.raises(InputError, match="can never fit"):
        manager.add_request(list(range(3, 43)), max_new_tokens=10)
    with pytest.raises(GenerationConfigError):
        manager.add_request([3, 4], do_sample=True, temperature=-1.0)
    with pytest.raises(UnsupportedError, match=r"suppress_tokens names \[5\].*forced"):
        manager.add_request([3, 4], forced_eos_token_id=[5, 6], suppress_tokens=[5])
    with pytest.raises(UnsupportedError, match="begin_suppress_tokens with forced_bos"):
        manager.add_request([3], forced_bos_token_id=5, begin_suppress_tokens=[6])
    with pytest.raises(UnsupportedError, match="remove_invalid_values=True with suppress_tok"):
        manager.add_request([3, 4], remove_invalid_values=True, suppress_tokens=[5])
    with pytest.raises(InputError, match="forced_eos_token_id has 9 ids.*max_eos_tokens"):
        manager.add_request([3, 4], forced_eos_token_id=list(range(3, 12)))


def test_per_row_ngram_bans_equal_the_processor_at_each_size():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 6, (4, 24)).astype(np.int32)  # a small alphabet: many repeats
    tokens[2, 7:9] = tokens[2, 2:4]  # row 2 (size 3, 9 tokens) ends with an earlier 2-gram
    lengths = np.asarray([24, 17, 9, 20], np.int32)
    sizes = np.asarray([1, 2, 3, 0], np.int32)
    scores = jnp.asarray(rng.normal(size=(4, 6)), jnp.float32)
    got = ban_repeated_ngrams(scores, tokens, lengths, sizes, 4)
    for row, (length, size) in enumerate(zip(lengths, sizes, strict=True)):
        want = scores[row : row + 1]
        if size:
            context = LogitsContext.for_prompt(tokens[row : row + 1, :length])
            want = P.no_repeat_ngram_size(int(size))(want, context)
        np.testing.assert_array_equal(got[row : row + 1], want)
    assert np.isinf(np.asarray(got[:3])).any(axis=1).all()  # every size banned something
    # With window_end, n-grams of each row's prompt alone (its first prompt_lengths tokens).
    prompts = np.asarray([20, 6, 7, 3], np.int32)
    got = ban_repeated_ngrams(scores, tokens, lengths, sizes, 4, window_end=prompts)
    for row, (length, size, prompt) in enumerate(zip(lengths, sizes, prompts, strict=True)):
        want = scores[row : row + 1]
        if size:
            ids = tokens[row : row + 1, :length]
            context = LogitsContext.for_prompt(ids).replace(prompt_end=jnp.asarray(prompt))
            want = P.encoder_no_repeat_ngram_size(int(size))(want, context)
        np.testing.assert_array_equal(got[row : row + 1], want)
    assert np.isinf(np.asarray(got[:3])).any(axis=1).all()
    assert not np.array_equal(got, ban_repeated_ngrams(scores, tokens, lengths, sizes, 4))


def test_stop_ends_every_request_and_waits_never_hang(manager):
    model, params = _model()
    m = init_continuous_batching(model, params, GenerationConfig(pad_token_id=0), CB)
    with compiles() as compiled:  # the module's manager compiled these sizes' programs
        m.start()
    assert compiled == []
    ids = m.add_requests([_prompt(60 + i, 8) for i in range(5)], max_new_tokens=40)
    m.stop(block=True, timeout=60)
    assert not m.is_running()
    outs = [_bounded(lambda i=i: m.get_result(i)) for i in ids]
    assert all(o is not None and o.is_finished() for o in outs)
    assert {o.status for o in outs} <= {RequestStatus.FINISHED, RequestStatus.CANCELLED}
    assert _bounded(lambda: m.get_result("unknown")) is None
    late = m.add_request([3, 4], max_new_tokens=2)
    assert _bounded(lambda: m.get_result(late)).status is RequestStatus.CANCELLED
    stream = _bounded(lambda: list(m.request_id_iter(late)))
    assert [o.status for o in stream] == [RequestStatus.CANCELLED]
    # Every final output once, in finishing order, then None (the loop has ended).
    drained = _bounded(lambda: [m.get_result() for _ in range(7)])
    assert sorted(o.request_id for o in drained[:6]) == sorted([*ids, late])
    assert drained[6] is None
    m.cancel_request(late)  # harmless after the end
    assert _bounded(lambda: list(m.request_id_iter(ids[0]))) == [outs[0]]


def test_stop_of_a_manager_never_started_cancels_its_queued_requests():
    model, params = _model()
    m = init_continuous_batching(model, params, GenerationConfig(pad_token_id=0), CB)
    rid = m.add_request([3, 4, 5], max_new_tokens=2)
    m.stop()
    out = _bounded(lambda: m.get_result(rid))
    assert out.status is RequestStatus.CANCELLED and out.generated_tokens == []
    assert m.metrics()["waiting"] == 0 and m.metrics()["blocks_in_use"] == 0


@pytest.mark.parametrize(
    "warpers",
    [
        dict(temperature=0.7, top_p=0.9),
        dict(typical_p=0.3, epsilon_cutoff=1e-3, eta_cutoff=2e-3),
        dict(top_h=0.4, renormalize_logits=True),
    ],
    ids=["top_p", "truncation", "top_h_renormalized"],
)
def test_sampled_requests_equal_generate_with_the_same_seed(manager, warpers):
    model, params = _model()
    prompt = _prompt(70, 7)
    config = GenerationConfig(max_new_tokens=REF_NEW, pad_token_id=0, do_sample=True, **warpers)

    def reference(config):
        ids = np.asarray([prompt], np.int32)
        out = genjax.generate(model, params, ids, config, key=jax.random.key(3))
        return np.asarray(out.sequences)[0, len(prompt) :].tolist()

    want = reference(config)
    assert want != reference(
        GenerationConfig(max_new_tokens=REF_NEW, pad_token_id=0, do_sample=True)
    )
    rid = manager.add_request(prompt, generation_config=config, seed=3)
    assert manager.get_result(rid, timeout=120).generated_tokens == want


def test_bias_penalties_and_logprobs_equal_generate_with_the_same_processors(manager):
    model, params = _model()
    prompt = _prompt(120, 6)
    plain = _reference(tuple(prompt))
    # Ban the plain run's first token, favour another; OpenAI's penalties as generate's extra
    # processors (where the engine applies them); raw logprobs from generate's output_logits.
    bias = [[[plain[0]], -100.0], [[plain[2]], 1.0], [[9], -1.0]]
    config = GenerationConfig(max_new_tokens=REF_NEW, pad_token_id=0, sequence_bias=bias)
    ref = genjax.generate(
        model,
        params,
        np.asarray([prompt], np.int32),
        config.replace(output_logits=True, return_dict_in_generate=True),
        logits_processor=[genjax.processors.count_penalties(presence=0.5, frequency=0.3)],
    )
    want = np.asarray(ref.sequences)[0, len(prompt) :].tolist()
    logp = np.asarray(jax.nn.log_softmax(ref.logits[0], axis=-1))  # [N, V]
    rid = manager.add_request(
        prompt,
        generation_config=config,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        logprobs=3,
        streaming=True,
    )
    out = manager.get_result(rid, timeout=120)
    assert out.generated_tokens == want and want != plain and plain[0] not in want
    np.testing.assert_allclose(out.logprobs, logp[np.arange(REF_NEW), want], atol=2e-5)
    top = np.argsort(-logp, axis=-1)[:, :3]
    assert [[i for i, _ in row] for row in out.top_logprobs] == top.tolist()
    got = np.asarray([[v for _, v in row] for row in out.top_logprobs])
    np.testing.assert_allclose(got, np.take_along_axis(logp, top, -1), atol=2e-5)
    # Streamed outputs carry the log-probabilities of the tokens they hold, and only then.
    for partial in manager.request_id_iter(rid, timeout=60):
        assert partial.logprobs == out.logprobs[: len(partial.generated_tokens)]
    # Without the penalties the biased run falls into a loop (the penalties are honoured).
    unpenalized = manager.get_result(manager.add_request(prompt, generation_config=config), 120)
    assert unpenalized.generated_tokens != want and unpenalized.logprobs is None


def test_multi_token_bias_bad_words_and_begin_suppress_equal_generate_alone(manager):
    prompt = _prompt(130, 6)
    plain = _reference(tuple(prompt))
    # A bias whose prefix is the prompt's last token (so it applies at the first new token), a
    # banned bigram of the plain path, a banned single token; and a first-token-only ban.
    favoured = next(t for t in range(3, 60) if t not in plain[:2])
    cases = [
        (
            ("sequence_bias", (((prompt[-1], favoured), 30.0), ((plain[1], plain[2]), -2.0))),
            ("bad_words_ids", ((favoured, plain[1]), (7,))),
        ),
        (("begin_suppress_tokens", (plain[0],)),),
    ]
    for extra in cases:
        want = _reference(tuple(prompt), extra=extra)
        rid = manager.add_request(
            prompt, max_new_tokens=REF_NEW, **{name: _lists(value) for name, value in extra}
        )
        got = manager.get_result(rid, timeout=120).generated_tokens
        assert got == want and want != plain
    assert want[0] != plain[0] and plain[0] in _reference(tuple(prompt))  # begin only


def test_length_forcing_decay_and_prompt_rules_equal_generate_alone(manager):
    prompt = _prompt(140, 6)
    plain = _reference(tuple(prompt))
    early = (plain[1],)  # an EOS the plain run meets at its second token
    # the prompt followed by the start of its greedy run, which then repeats one of those
    primed = prompt + plain[:3]
    cases = [  # (prompt, eos, min_new_tokens, extra fields): each changes the plain run's tokens
        (prompt, early, None, (("min_length", len(prompt) + 5),)),  # with the prompt: 5 new
        (prompt, (), None, (("forced_eos_token_id", (5, 6)),)),  # the last new token: 5 or 6
        (prompt, (7,), None, (("exponential_decay_length_penalty", (1, 8.0)),)),  # EOS 7 soon
        (prompt, (), None, (("encoder_repetition_penalty", 3.0),)),  # the prompt rewarded
        (primed, (), None, (("encoder_no_repeat_ngram_size", 1),)),  # no token of the prompt
        # transformers' order: EOS blocked to -inf, made the lowest float, then boosted past
        # every other score; without remove_invalid_values it stays blocked for 8 tokens
        (
            prompt,
            (7,),
            8,
            (("remove_invalid_values", True), ("exponential_decay_length_penalty", (0, 10.0))),
        ),
    ]
    for ids, eos, min_new, extra in cases:
        want = _reference(tuple(ids), eos=eos or None, min_new=min_new, extra=extra)
        fields = {name: _lists(value) for name, value in extra}
        rid = manager.add_request(
            ids,
            max_new_tokens=REF_NEW,
            eos_token_id=list(eos) or None,
            min_new_tokens=min_new,
            **fields,
        )
        assert manager.get_result(rid, timeout=120).generated_tokens == want, extra
        assert want != _reference(tuple(ids), eos=eos or None, min_new=min_new), extra
    assert want[-1] == 7 and len(want) < 8
    # forced_bos_token_id forces the first new token after a one-token prompt only.
    first = _reference(tuple(prompt[:1]))
    forced = (("forced_bos_token_id", 9 if first[0] != 9 else 10),)
    want = _reference(tuple(prompt[:1]), extra=forced)
    for ids, expected in ((prompt[:1], want), (prompt, plain)):
        rid = manager.add_request(ids, max_new_tokens=REF_NEW, forced_bos_token_id=forced[0][1])
        assert manager.get_result(rid, timeout=120).generated_tokens == expected
    assert want[0] == forced[0][1] and want != first


def test_max_time_ends_a_request_after_the_round_trip_that_passes_it(manager):
    prompt = _prompt(150, 6)
    plain = _reference(tuple(prompt))
    scheduler = manager._scheduler
    ticks = itertools.count()  # a clock one second later at each read: admission reads 0,
    scheduler.clock = lambda: float(next(ticks))  # then each round trip's tokens 1, 2, 3...
    try:
        rid = manager.add_request(prompt, max_new_tokens=REF_NEW, max_time=2.5)
        out = manager.get_result(rid, timeout=120)
        # a request without max_time never reads the clock: it runs to its length
        whole = manager.get_result(manager.add_request(prompt, max_new_tokens=REF_NEW), 120)
    finally:
        scheduler.clock = time.monotonic
    # three round trips (the first token, then decode loops): ended after the third
    assert out.finish_reason == "length" and next(ticks) == 4
    assert 2 < len(out.generated_tokens) < REF_NEW
    assert out.generated_tokens == plain[: len(out.generated_tokens)]
    assert whole.generated_tokens == plain and whole.finish_reason == "length"


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_generate_batch_returns_every_request_by_id_with_a_progress_bar(monkeypatch):
    model, params = _model()
    prompts = [_prompt(80, 4), _prompt(81, 11)]
    config = GenerationConfig(max_new_tokens=5, pad_token_id=0)
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    results = genjax.serving.generate_batch(
        model, params, prompts, config, True, continuous_batching_config=CB, timeout=300
    )
    assert list(results) == ["req_0", "req_1"]
    assert "generate_batch" in terminal.getvalue() and "2/2" in terminal.getvalue()
    for i, prompt in enumerate(prompts):
        assert results[f"req_{i}"].generated_tokens == _reference(tuple(prompt))[:5]
