"""Structured output in the continuous-batching engine: the constraint pool on the host, the
scheduler holding a request whose automaton has no room, and constrained requests through the
engine on the bundled model, each equal to ``genjax.generate(..., constraint=)`` of it alone.

One manager for the file (4 slots, a block pool that forces preemptions, a constraint pool of 80
states: two of the JSON schemas below do not fit together). No test waits on the clock: requests
that must run together are added under ``pause()``; timeouts only bound a broken run.
"""

import dataclasses
import functools
import json
import re

import jax
import jsonschema
import numpy as np
import pytest

import genjax
from genjax import GenerationConfig, constraints
from genjax.constraints.tables import bitmask
from genjax.errors import InputError
from genjax.serving import (
    ContinuousBatchingConfig,
    RequestStatus,
    Scored,
    StepOutput,
    init_continuous_batching,
)
from genjax.serving.constraint_pool import ConstraintPool, constraint_key, walk
from genjax.serving.options import EngineOptions, build_request
from genjax.serving.scheduler import Scheduler
from genjax.testing import count_compiles as compiles

pytestmark = pytest.mark.usefixtures("fast_compiles")

CB = ContinuousBatchingConfig(
    max_batch_size=4,
    block_size=4,
    max_length=64,
    num_blocks=30,  # 29 usable blocks: four requests of ~46 tokens (12 blocks) preempt
    prefill_chunk_size=8,
    max_decode_steps=4,
    max_constraint_states=80,
    max_constraint_edges=16384,
    poll_interval=0.01,
)
NEW = 40  # every reference generate call makes 40 tokens (one compiled program per table size)
PROMPTS = ["The number is", "def f(x):", "import os", "# note", "Once upon a time"]
WORDS = r"([a-z]{2,8}[0-9] )+"  # 12 states: where a row is in a word matters
PHONE = r"[0-9]{3}-[0-9]{4}"
CHOICES = ["yes", "no", "maybe"]
COLOUR = {  # 44 states
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]}, "size": {"type": "integer"}},
    "required": ["color", "size"],
}
TAGS = {  # 41 states: with COLOUR, 87 > 80
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["id", "tags"],
}
GREEDY = GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=0, pad_token_id=0)
SAMPLED = GREEDY.replace(do_sample=True, temperature=0.7, top_p=0.9)


@functools.cache
def _bundled():
    path = genjax.io.bundled.path()
    model, params = genjax.models.from_pretrained(path)
    # Without the bundled file's sampling defaults: each request says greedy or sampling.
    return model.with_generation_config(None), params, genjax.tokenizer.from_pretrained(path)


@functools.cache
def _constraint(kind: str, pattern: str):
    tok = _bundled()[2]
    if kind == "schema":
        return constraints.json_schema(json.loads(pattern), tok)
    if kind == "choice":
        return constraints.choice(json.loads(pattern), tok)
    return constraints.regex(pattern, tok)


def _words():
    return _constraint("regex", WORDS)


def _schema(schema):
    return _constraint("schema", json.dumps(schema))


def _ids(i):
    return _bundled()[2].encode(PROMPTS[i])


@functools.cache
def _reference_cached(prompt: tuple, constraint, config, seed):
    model, params, _ = _bundled()
    key = None if seed is None else jax.random.key(seed)
    out = genjax.generate(
        model, params, np.asarray([prompt], np.int32), config, key=key, constraint=constraint
    )
    new = np.asarray(out.sequences)[0, len(prompt) :].tolist()
    return new[: new.index(0) + 1] if 0 in new else new


def _reference(prompt, constraint=None, config=GREEDY, seed=None, max_new_tokens=NEW):
    """``genjax.generate`` of the prompt alone, cut after EOS and to ``max_new_tokens``."""
    return _reference_cached(tuple(prompt), constraint, config, seed)[:max_new_tokens]


@pytest.fixture(scope="module")
def manager():
    model, params, tok = _bundled()
    m = init_continuous_batching(model, params, GREEDY, CB, tokenizer=tok)
    m.start()
    yield m
    m.stop(block=True, timeout=30)


def _run_together(manager, requests):
    """Adds ``(prompt, kwargs)`` requests under ``pause()`` (so they share steps); returns their
    final outputs."""
    with manager.pause():
        ids = [manager.add_request(prompt, **kwargs) for prompt, kwargs in requests]
    return [manager.get_result(i, timeout=300) for i in ids]


# ---- the pool on the host -------------------------------------------------------------------
def test_pool_installs_once_renumbers_and_evicts_the_least_recently_used():
    words, phone = _words(), _constraint("regex", PHONE)
    choice = _constraint("choice", json.dumps(CHOICES))
    pool = ConstraintPool(max_states=30, max_edges=13000, vocab_size=4096)
    start = pool.acquire(constraint_key(words), words)
    again = dataclasses.replace(words)  # another object, the same automaton: shared
    assert pool.acquire(constraint_key(again), again) == start == 0 and pool.num_installed == 1
    placed = pool.acquire(constraint_key(phone), phone)
    assert placed == words.num_states + 1  # after words' states and its spare row
    n, edges = phone.num_states, phone.tokens.shape[0]
    np.testing.assert_array_equal(
        pool.bits[placed : placed + n], bitmask(phone.offsets, phone.tokens, n, 4096)
    )
    begin = pool.offsets[placed]
    assert begin == words.tokens.shape[0]  # phone's edges follow words'
    np.testing.assert_array_equal(pool.offsets[placed : placed + n + 1], phone.offsets + begin)
    np.testing.assert_array_equal(pool.targets[begin : begin + edges], phone.targets + placed)
    # Full of automata in use (13 + 10 + 10 > 30): the choice waits.
    assert pool.acquire(constraint_key(choice), choice) is None
    pool.release(constraint_key(phone))
    assert pool.acquire(constraint_key(choice), choice) == placed  # phone evicted, slot reused
    pool.release(constraint_key(words))
    pool.release(constraint_key(words))
    pool.release(constraint_key(choice))
    # Nothing in use: phone takes the place of the least recently used (words), not choice's.
    assert pool.acquire(constraint_key(phone), phone) == 0 and pool.num_installed == 2
    table = pool.device()
    assert table.bits.shape == (30, 128) and table.targets.shape == (13000,)


def test_walk_follows_the_automaton_like_the_device_loop():
    tok = _bundled()[2]
    c = _constraint("choice", json.dumps(CHOICES))
    ids = tok.encode("maybe")
    assert c.final[walk(c, ids)] and not c.final[walk(c, ids[:-1])]
    assert walk(c, [*ids[:1], 3999]) == walk(c, ids[:1])  # a refused token keeps the state


def test_scheduler_holds_a_request_until_its_automaton_has_room():
    model, _, tok = _bundled()
    shape = CB.engine_shape()
    pool = ConstraintPool(shape.constraint_states, shape.constraint_edges, model.vocab_size)
    scheduler = Scheduler(shape, tok, constraints=pool)

    def request(name, schema, generated=()):
        options = EngineOptions(constraint=_schema(schema))
        r = build_request(name, _ids(0), GREEDY, shape, model.vocab_size, seed=0,
                          streaming=False, extras=options)  # fmt: skip
        r.generated = list(generated)
        return r

    brace = tok.encode('{"')  # a recomputed request starts where its tokens led
    colour, tags = request("c", COLOUR), request("t", TAGS, brace)
    scheduler.add(colour)
    scheduler.add(tags)
    work = scheduler.plan()
    assert work.admit.tolist() == [True]  # one lane: this engine prefills one prompt a step
    assert work.constraint_state.tolist() == [colour.constraint_state] == [0]
    scheduler.absorb(_first_token(shape, tok.encode("{")[0]))
    work = scheduler.plan()  # tags' automaton does not fit beside colour's (44 + 41 > 80)
    assert list(scheduler.waiting) == [tags] and work.prefill_slot.tolist() == [-1]
    scheduler.finish(colour, RequestStatus.FINISHED, "stop")
    work = scheduler.plan()  # colour's automaton, unused now, is evicted
    assert tags.slot is not None and pool.num_installed == 1
    state = walk(_schema(TAGS), brace)
    assert work.constraint_state.tolist() == [state] and state > 0
    scheduler.finish(tags, RequestStatus.CANCELLED, "cancelled")
    assert pool.acquire(constraint_key(_schema(COLOUR)), _schema(COLOUR)) is not None


def test_scheduler_runs_k_iterations_while_a_request_waits_only_for_a_slot():
    model, _, tok = _bundled()
    shape = CB.engine_shape()
    scheduler = Scheduler(shape, tok)
    requests = [
        build_request(str(i), _ids(i), GREEDY, shape, model.vocab_size, seed=0, streaming=False)
        for i in range(5)  # prompts of one chunk each; 4 slots
    ]
    for request in requests:
        scheduler.add(request)
    for request in requests[:4]:
        work = scheduler.plan()  # each prefill step decodes the other rows once
        assert int(work.num_steps) == 1 and work.prefill_slot.tolist() == [request.slot]
        scheduler.absorb(_first_token(shape, 7))
    work = scheduler.plan()  # every slot decodes; the fifth request waits for one to finish
    assert list(scheduler.waiting) == [requests[4]] and work.prefill_slot.tolist() == [-1]
    assert int(work.num_steps) == shape.max_steps == 4
    scheduler.finish(requests[0], RequestStatus.FINISHED, "stop")
    work = scheduler.plan()  # the freed slot admits it: one iteration beside its prefill
    assert int(work.num_steps) == 1 and work.prefill_slot.tolist() == [requests[4].slot]


def _first_token(shape, token):
    """A step output that gives the prefilled request ``token`` and nothing else."""
    rows, steps = shape.max_batch_size, shape.max_steps
    empty = np.zeros((1, 0))
    return StepOutput(
        tokens=np.full((steps, rows), -1, np.int32),
        first_token=np.asarray([token], np.int32),  # one lane
        finished=np.zeros((rows,), bool),
        steps=np.asarray(0, np.int32),
        logprobs=np.zeros((steps, rows), np.float32),
        top_ids=np.zeros((steps, rows, 0), np.int32),
        top_logprobs=np.zeros((steps, rows, 0), np.float32),
        first=Scored(np.zeros((1,), np.float32), empty, empty),
    )


# ---- through the engine ---------------------------------------------------------------------
def test_constrained_requests_equal_generate_alone_beside_unconstrained_ones(manager):
    words, phone = _words(), _constraint("regex", PHONE)
    choice = _constraint("choice", json.dumps(CHOICES))
    requests = [
        (_ids(0), dict(constraint=words, max_new_tokens=20)),
        (_ids(1), dict(max_new_tokens=12)),
        (_ids(2), dict(constraint=phone, max_new_tokens=20)),
        (_ids(3), dict(constraint=choice, max_new_tokens=20)),
        (_ids(4), dict(constraint=words, generation_config=SAMPLED, seed=3, max_new_tokens=16)),
    ]
    outs = _run_together(manager, requests)
    tok = _bundled()[2]
    for (prompt, spec), out in zip(requests, outs, strict=True):
        config = spec.get("generation_config", GREEDY)
        want = _reference(
            prompt, spec.get("constraint"), config, spec.get("seed"), spec["max_new_tokens"]
        )
        assert out.status is RequestStatus.FINISHED
        assert out.generated_tokens == want, (spec, out.generated_tokens, want)
    text = [tok.decode(o.generated_tokens, skip_special_tokens=True) for o in outs]
    assert (
        re.fullmatch(r"([a-z]{2,8}[0-9] )*[a-z0-9 ]*", text[0])
        and len(outs[0].generated_tokens) == 20
    )
    assert re.fullmatch(PHONE, text[2]) and outs[2].finish_reason == "stop"
    assert text[3] in CHOICES and outs[3].finish_reason == "stop"
    unconstrained = _reference(_ids(1), max_new_tokens=12)
    assert outs[1].generated_tokens == unconstrained and not re.fullmatch(PHONE, text[1])
    # The sampled request differs from greedy under the same automaton (the seed is honoured).
    assert outs[4].generated_tokens != _reference(_ids(4), words, max_new_tokens=16)


def test_json_schema_outputs_validate_and_a_request_waits_for_pool_room(manager):
    # COLOUR's and TAGS' automata (44 + 41 states, and a spare each) never fit the pool of 80
    # together: TAGS starts only once COLOUR has finished, and both equal generate alone.
    colour, tags = _schema(COLOUR), _schema(TAGS)
    outs = _run_together(
        manager, [(_ids(0), dict(constraint=colour)), (_ids(1), dict(constraint=tags))]
    )
    tok = _bundled()[2]
    for (schema, constraint, i), out in zip(
        [(COLOUR, colour, 0), (TAGS, tags, 1)], outs, strict=True
    ):
        assert out.generated_tokens == _reference(_ids(i), constraint)
        assert out.finish_reason == "stop"
        jsonschema.validate(
            json.loads(tok.decode(out.generated_tokens, skip_special_tokens=True)), schema
        )
    assert outs[1].timestamps[0] >= outs[0].timestamps[-1]
    assert manager.metrics()["constraint_automata"] >= 1


def test_preempted_constrained_requests_still_equal_generate(manager):
    words = _words()
    before = manager.metrics()["preemptions"]
    requests = [(_ids(i), dict(constraint=words)) for i in range(4)]
    outs = _run_together(manager, requests)
    assert manager.metrics()["preemptions"] > before  # 4 x 12 blocks > 29
    for (prompt, _), out in zip(requests, outs, strict=True):
        assert out.generated_tokens == _reference(prompt, words)
        assert len(out.generated_tokens) == NEW
    assert manager.metrics()["blocks_in_use"] == 0


def test_no_compilation_after_warmup_over_a_mixed_constrained_workload(manager):
    tok = _bundled()[2]
    rng = np.random.default_rng(7)
    with compiles() as compiled:
        fresh = constraints.regex(r"[a-c]{2}[0-9]{1,3}", tok)  # installed and uploaded anew
        pick = [_words(), None, fresh, _schema(COLOUR), _constraint("regex", PHONE)]
        requests = []
        for i, constraint in enumerate(pick):
            spec = dict(constraint=constraint, max_new_tokens=int(rng.integers(2, 12)), seed=i)
            if i % 2:
                spec.update(do_sample=True, temperature=0.9, top_k=20, logprobs=2)
            requests.append((_ids(i), spec))
        outs = _run_together(manager, requests)
    assert all(o.status is RequestStatus.FINISHED for o in outs)
    assert compiled == []


def test_add_request_rejects_constraints_the_engine_cannot_run(manager):
    model, params, tok = _bundled()
    big = constraints.regex(r"[0-9]{100}", tok)  # 101 states > 80
    with pytest.raises(InputError, match=r"needs 102 states.*max_constraint_states"):
        manager.add_request(_ids(0), constraint=big)
    other_eos = constraints.regex(PHONE, tok, eos_token_id=5)
    with pytest.raises(InputError, match="EOS id 5.*request's eos_token_id"):
        manager.add_request(_ids(0), constraint=other_eos)
    with pytest.raises(InputError, match="must be a genjax.constraints.Constraint"):
        manager.add_request(_ids(0), constraint=PHONE)
    off = init_continuous_batching(
        model, params, GREEDY, dataclasses.replace(CB, max_constraint_states=0)
    )  # never started: nothing compiles
    with pytest.raises(InputError, match="max_constraint_states is 0"):
        off.add_request(_ids(0), constraint=_words())
    off.stop()
