"""Structured output (genjax.constraints): regex, choice and JSON-schema automata on the bundled
model, through greedy decoding, sampling, beams, per-row constraints and ``max_cache_len``; the
device tables against each other and against the hand-applied ``allowed_tokens_fn`` mask; one
compiled program for patterns of the same padded table size; the combinations that raise."""

import json
import re

import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest

import genjax
from genjax import GenerationConfig, constraints
from genjax.errors import InputError, UnsupportedError
from genjax.testing import count_compiles as compiles

pytestmark = pytest.mark.usefixtures("fast_compiles")  # LLVM at -O0: see conftest.py

PHONE = r"[0-9]{3}-[0-9]{4}"
PROMPTS = ["def f(x):", "The number is", "import os", "# note"]
GREEDY = GenerationConfig(max_new_tokens=12, do_sample=False, eos_token_id=0, pad_token_id=0)
SAMPLING = GREEDY.replace(do_sample=True, temperature=1.0, top_k=50, top_p=0.95)

SCHEMAS = [
    {  # nested objects
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 8},
                    "active": {"type": "boolean"},
                },
                "required": ["name", "active"],
            }
        },
        "required": ["user"],
    },
    {  # an array with bounds
        "type": "object",
        "properties": {
            "xs": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3}
        },
        "required": ["xs"],
    },
    {  # enums
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "size": {"type": "string", "enum": ["S", "M", "L"]},
        },
        "required": ["color", "size"],
    },
    {  # numbers
        "type": "object",
        "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
        "required": ["x", "y"],
    },
    {  # required and optional fields
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "note": {"type": "string", "maxLength": 6},
            "ok": {"type": "boolean"},
        },
        "required": ["id"],
    },
    {  # a string pattern
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"}},
        "required": ["code"],
    },
    {  # a bounded top-level array
        "type": "array",
        "items": {"type": "string", "maxLength": 3},
        "minItems": 1,
        "maxItems": 2,
    },
]


@pytest.fixture(scope="module")
def bundled():
    path = genjax.io.bundled.path()
    model, params = genjax.models.from_pretrained(path)
    # Without the bundled file's sampling defaults: each test's config says greedy or sampling.
    model = model.with_generation_config(None)
    return model, params, genjax.tokenizer.from_pretrained(path)


def _prompts(tok, count=4):
    batch = tok((PROMPTS * 2)[:count])
    return batch["input_ids"], batch["attention_mask"]


def _new_texts(tok, out, prompt_length):
    """Each row's new tokens as (text, ended with EOS)."""
    texts = []
    for row in np.asarray(out.sequences[:, prompt_length:]).tolist():
        ended = 0 in row
        texts.append((tok.decode(row[: row.index(0)] if ended else row), ended))
    return texts


def _is_prefix(constraint, token_ids):
    """Whether the tokens (before any EOS) are a path of the automaton."""
    table, state = constraint.next_states(), 0
    for token in token_ids:
        if token == constraint.eos_token_id:
            return bool(constraint.final[state])
        state = table[state, token]
        if state < 0:
            return False
    return True


# --- host automata and device tables -----------------------------------------------------------


def test_automaton_accepts_what_the_regex_matches(bundled):
    _, _, tok = bundled
    c = constraints.regex(PHONE, tok)
    assert c.accepts(tok.encode("123-4567")) and not c.accepts(tok.encode("123-456"))
    assert not c.accepts(tok.encode("123-45678"))
    table = c.next_states()
    eos_allowed = table[:, c.eos_token_id] >= 0
    np.testing.assert_array_equal(eos_allowed, c.final)  # EOS only in accepting states
    assert constraints.regex(PHONE, tok) is c  # cached


def test_compressed_table_equals_dense(bundled):
    _, _, tok = bundled
    rows = [constraints.regex(PHONE, tok), constraints.choice(["yes", "no", "maybe"], tok)]
    dense = constraints.device_automaton(rows, 2, 4096)
    packed = constraints.device_automaton(rows, 2, 4096, dense_limit_bytes=0)
    assert isinstance(dense, constraints.DenseTable)
    assert isinstance(packed, constraints.CompressedTable)
    rng = np.random.default_rng(0)
    states = jnp.asarray(rng.integers(0, dense.next_state.shape[0], 256), jnp.int32)
    np.testing.assert_array_equal(dense.allowed(states), packed.allowed(states))
    allowed = np.asarray(dense.allowed(states))
    tokens = rng.integers(0, 4096, 256)
    for i in range(256):  # half allowed tokens, half random ones
        if i % 2 and allowed[i].any():
            tokens[i] = rng.choice(np.flatnonzero(allowed[i]))
    tokens = jnp.asarray(tokens, jnp.int32)
    np.testing.assert_array_equal(dense.advance(states, tokens), packed.advance(states, tokens))


# --- generate -----------------------------------------------------------------------------------


def test_regex_greedy_and_sampled_outputs_match(bundled):
    model, params, tok = bundled
    ids, mask = _prompts(tok)
    c = constraints.regex(PHONE, tok)
    for config in (GREEDY, SAMPLING):
        out = genjax.generate(
            model, params, ids, config, attention_mask=mask, key=jax.random.key(3), constraint=c
        )
        for text, ended in _new_texts(tok, out, ids.shape[1]):
            assert ended and re.fullmatch(PHONE, text), text


def test_choice_outputs_are_choices(bundled):
    model, params, tok = bundled
    ids, mask = _prompts(tok)
    choices = ["yes", "no", "maybe"]
    c = constraints.choice(choices, tok)
    out = genjax.generate(
        model, params, ids, SAMPLING, attention_mask=mask, key=jax.random.key(0), constraint=c
    )
    for text, ended in _new_texts(tok, out, ids.shape[1]):
        assert ended and text in choices, text


def test_constrained_greedy_equals_allowed_tokens_fn_by_hand(bundled):
    """The constraint equals unconstrained greedy decoding restricted, through
    ``allowed_tokens_fn``, by the automaton walked over the tokens generated so far."""
    model, params, tok = bundled
    ids, mask = _prompts(tok)
    c = constraints.regex(r"[a-z]{2,6}( [a-z]{1,5}){0,2}", tok)
    table = jnp.asarray(c.next_states(model.vocab_size))
    new = GREEDY.max_new_tokens

    def allowed(tokens, length):
        prompt_end = tokens.shape[1] - new

        def walk(slot, state):
            following = table[state, tokens[:, slot]]
            return jnp.where((slot < length) & (following >= 0), following, state)

        state = jax.lax.fori_loop(prompt_end, tokens.shape[1], walk, jnp.zeros(len(tokens), int))
        return table[state] >= 0

    constrained = genjax.generate(model, params, ids, GREEDY, attention_mask=mask, constraint=c)
    by_hand = genjax.generate(
        model, params, ids, GREEDY, attention_mask=mask, allowed_tokens_fn=allowed
    )
    np.testing.assert_array_equal(constrained.sequences, by_hand.sequences)
    for text, ended in _new_texts(tok, constrained, ids.shape[1]):
        assert not ended or re.fullmatch(c.pattern, text), text


def test_json_schemas_one_per_row_sampled_validate(bundled):
    """Eight rows, seven schemas (one twice): every row that ends parses and validates; a row
    that runs out of tokens (numbers are unbounded) must still be on a path of its automaton."""
    model, params, tok = bundled
    ids, mask = _prompts(tok, 8)
    schemas = [*SCHEMAS, SCHEMAS[2]]
    rows = [constraints.json_schema(s, tok) for s in schemas]
    config = SAMPLING.replace(max_new_tokens=64, temperature=0.7)
    out = genjax.generate(
        model, params, ids, config, attention_mask=mask, key=jax.random.key(1), constraint=rows
    )
    texts = _new_texts(tok, out, ids.shape[1])
    new_tokens = np.asarray(out.sequences[:, ids.shape[1] :]).tolist()
    for schema, c, (text, ended), tokens in zip(schemas, rows, texts, new_tokens, strict=True):
        if ended:
            jsonschema.validate(json.loads(text), schema)
        else:
            assert _is_prefix(c, tokens), text
    assert sum(ended for _, ended in texts) >= 6, texts


def test_beam_search_outputs_match(bundled):
    model, params, tok = bundled
    ids, mask = _prompts(tok, 2)
    c = constraints.regex(PHONE, tok)
    config = GREEDY.replace(num_beams=3, num_return_sequences=2)
    out = genjax.generate(model, params, ids, config, attention_mask=mask, constraint=c)
    for text, ended in _new_texts(tok, out, ids.shape[1]):
        assert ended and re.fullmatch(PHONE, text), text
    # The max_cache_len slot layout: the same hypotheses, pad after P + N.
    fixed = genjax.generate(
        model, params, ids, config, attention_mask=mask, constraint=c, max_cache_len=48
    )
    end = ids.shape[1] + GREEDY.max_new_tokens
    np.testing.assert_array_equal(fixed.sequences[:, :end], out.sequences)
    np.testing.assert_array_equal(fixed.sequences[:, end:], 0)
    np.testing.assert_allclose(fixed.sequences_scores, out.sequences_scores, rtol=1e-5)


def test_per_row_regexes_with_max_cache_len(bundled):
    model, params, tok = bundled
    ids, mask = _prompts(tok)
    patterns = [PHONE, r"(yes|no)", r"[A-Z][a-z]{1,4}", PHONE]
    rows = [constraints.regex(p, tok) for p in patterns]
    config = GREEDY.replace(max_cache_len=48)
    out = genjax.generate(model, params, ids, config, attention_mask=mask, constraint=rows)
    for pattern, (text, ended) in zip(patterns, _new_texts(tok, out, ids.shape[1]), strict=True):
        assert ended and re.fullmatch(pattern, text), (pattern, text)


def test_same_table_size_does_not_recompile(bundled):
    model, params, tok = bundled
    ids, mask = _prompts(tok, 2)
    first, second = constraints.regex(PHONE, tok), constraints.regex(r"[0-9]{4}-[0-9]{3}", tok)
    tables = [constraints.device_automaton(c, 2, model.vocab_size) for c in (first, second)]
    assert tables[0].next_state.shape == tables[1].next_state.shape
    genjax.generate(model, params, ids, GREEDY, attention_mask=mask, constraint=first)
    with compiles() as compiled:
        out = genjax.generate(model, params, ids, GREEDY, attention_mask=mask, constraint=second)
    assert not compiled, compiled
    for text, ended in _new_texts(tok, out, ids.shape[1]):
        assert ended and re.fullmatch(r"[0-9]{4}-[0-9]{3}", text), text


def test_streamed_and_sharded_tokens_equal_plain(bundled):
    """A streamer receives the constrained tokens; a (4, 2) mesh gives one device's tokens."""
    model, params, tok = bundled
    c = constraints.regex(PHONE, tok)
    ids, mask = _prompts(tok, 8)
    plain = genjax.generate(model, params, ids, GREEDY, attention_mask=mask, constraint=c)
    mesh = genjax.sharding.make_mesh((4, 2))
    sharded = genjax.generate(
        model, params, ids, GREEDY, attention_mask=mask, constraint=c, mesh=mesh
    )
    np.testing.assert_array_equal(plain.sequences, sharded.sequences)

    class Collect(genjax.streaming.BaseStreamer):
        def __init__(self):
            self.values = []

        def put(self, value):
            self.values.append(np.asarray(value).reshape(-1).tolist())

        def end(self):
            pass

    streamer = Collect()
    single = tok(["def f(x):"])["input_ids"]
    one = genjax.generate(model, params, single, GREEDY, constraint=c, streamer=streamer)
    streamed = [v[0] for v in streamer.values[1:]]  # after the prompt
    assert streamed == np.asarray(one.sequences[0, single.shape[1] :]).tolist()[: len(streamed)]
    text = tok.decode([t for t in streamed if t != 0])
    assert re.fullmatch(PHONE, text), text


# --- what raises --------------------------------------------------------------------------------


def test_unsupported_and_invalid_constraints_raise(bundled):
    model, params, tok = bundled
    ids, mask = _prompts(tok, 2)
    c = constraints.regex(PHONE, tok)
    with pytest.raises(UnsupportedError, match="assisted"):
        genjax.generate(
            model, params, ids, GREEDY.replace(prompt_lookup_num_tokens=3), constraint=c
        )
    with pytest.raises(UnsupportedError, match="context-free"):
        constraints.grammar("start: 'a'", tok)
    with pytest.raises(InputError, match="admits no"):
        constraints.regex(r"[a&&b]", tok)
    with pytest.raises(InputError, match="one per row"):
        genjax.generate(model, params, ids, GREEDY, attention_mask=mask, constraint=[c])
    with pytest.raises(InputError, match="EOS id 0"):
        genjax.generate(model, params, ids, GREEDY.replace(eos_token_id=5), constraint=c)
    with pytest.raises(InputError, match="Constraint"):
        genjax.generate(model, params, ids, GREEDY, attention_mask=mask, constraint=PHONE)
