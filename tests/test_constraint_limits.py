"""Bounds on constraint automata (genjax.constraints.limits): patterns whose automaton would be
too large are refused before outlines-core builds them; ones at the bounds are admitted."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import outlines_core
import pytest

import genjax
from genjax.constraints import automata, limits
from genjax.errors import InputError
from genjax.serving.guided import ConstraintCache, GuidedSpec
from genjax.serving.protocol import APIError

SMALL_SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "name": {"type": "string", "maxLength": 8},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["id", "name"],
}


@pytest.fixture(scope="module")
def tok():
    return genjax.tokenizer.from_pretrained(genjax.io.bundled.path())


@pytest.fixture
def no_index(monkeypatch):
    """Makes any outlines-core Index build fail the test: a refusal must come before it."""

    def refuse(*args, **kwargs):
        raise AssertionError("outlines_core.Index was built for a pattern over the bounds")

    monkeypatch.setattr(outlines_core, "Index", refuse)


def _fresh(pattern, tok, **kwargs):
    automata._AUTOMATA.clear()
    return genjax.constraints.regex(pattern, tok, **kwargs)


@pytest.mark.parametrize(
    ("pattern", "kwargs", "message"),
    [
        (r"[a-z]{1,100000}", {}, r"more than 32768 states \(max_states|about \d+ transitions"),
        (r"[a-z]{1,5000}", {"max_states": 1024}, r"unrolls to 5000 character positions"),
        (r"[a-z]{1,3000}", {"max_states": 2048}, r"more than 2048 states"),
        (r"(a|b)*a(a|b){20}", {"max_states": 4096}, r"more than 4096 states"),
        (r".{0,100000}", {}, r"more than 32768 states|about \d+ transitions"),
        (r"[a-z]{1,1000}", {"max_transitions": 10_000}, r"about \d+ transitions.*2 x max_trans"),
        (r"(?i)[a-z]{1,5}x{1,90}", {"max_states": 64}, r"unrolls to 95|more than 64 states"),
    ],
)
def test_patterns_over_the_bounds_are_refused_before_outlines_core_builds(
    tok, no_index, pattern, kwargs, message
):
    with pytest.raises(InputError, match=message) as error:
        _fresh(pattern, tok, **kwargs)
    text = str(error.value)
    assert "max_states=" in text and "max_constraint_states" in text  # how to raise it


def test_json_schemas_over_the_bounds_are_refused_before_outlines_core_builds(tok, no_index):
    long = {"type": "string", "maxLength": 100000}
    with pytest.raises(InputError, match="unrolls to 300002 character positions"):
        genjax.constraints.json_schema(long, tok)
    nested = {"type": "string"}
    for _ in range(8):
        nested = {"type": "array", "items": nested, "minItems": 1, "maxItems": 10}
    with pytest.raises(InputError, match="character positions"):
        genjax.constraints.json_schema(nested, tok)
    many = {"type": "array", "items": {"type": "integer"}, "minItems": 5000}
    with pytest.raises(InputError, match="unrolls to 30002 character positions"):
        genjax.constraints.json_schema(many, tok, max_states=4096)


def test_an_automaton_at_the_bounds_is_admitted_and_one_more_is_refused(tok):
    exact = _fresh(r"[a-z]{1,50}", tok)
    states, edges = exact.num_states, int(exact.tokens.shape[0])
    assert (states, edges) == (51, 75546)
    at = _fresh(r"[a-z]{1,50}", tok, max_states=states, max_transitions=edges)
    np.testing.assert_array_equal(at.targets, exact.targets)
    with pytest.raises(InputError, match="more than 50 states"):  # sized before the build
        _fresh(r"[a-z]{1,50}", tok, max_states=states - 1)
    # Counted as the automaton is read out: the walk stops at the state that crosses a bound.
    with pytest.raises(InputError, match=f"of at least 51 states and at least {edges} trans"):
        _fresh(r"[a-z]{1,50}", tok, max_transitions=edges - 1)


def test_the_exact_count_catches_byte_level_states_the_sizing_cannot_see(tok):
    # The character DFA of (a|b)*a(a|b){6} has 128 states; outlines-core's has 256.
    exact = _fresh(r"(a|b)*a(a|b){6}", tok)
    with pytest.raises(InputError, match=f"of at least {exact.num_states} states"):
        _fresh(r"(a|b)*a(a|b){6}", tok, max_states=exact.num_states - 1)


def _reference_csr(index, eos):
    """outlines-core's ``get_transitions`` (the Python dict) as CSR over the states reachable
    from the initial one (initial 0, the others by id), the EOS self-loops included."""
    table, initial = index.get_transitions(), index.get_initial_state()
    reachable, queue = {initial}, [initial]
    for state in queue:
        for target in table.get(state, {}).values():
            if target not in reachable:
                reachable.add(target)
                queue.append(target)
    numbered = [initial, *sorted(reachable - {initial})]
    number = {state: i for i, state in enumerate(numbered)}
    rows = [sorted(table.get(state, {}).items()) for state in numbered]
    offsets = np.cumsum([0, *map(len, rows)])
    tokens = [t for row in rows for t, _ in row]
    targets = [number[s] for row in rows for _, s in row]
    final = [index.is_final_state(state) for state in numbered]
    return offsets, tokens, targets, final


@pytest.mark.parametrize(
    "pattern", [r"[0-9]{3}-[0-9]{4}", r"(?i)hello( world)?", r"[a-z]{1,40}", "schema"]
)
def test_the_read_out_is_outlines_cores_reachable_transitions(tok, pattern):
    """State by state through get_allowed_tokens / get_next_state, the automaton equals the
    transition dict outlines-core returns, less the states the initial one cannot reach (which
    (?i)hello( world)? has)."""
    if pattern == "schema":
        from outlines_core.json_schema import build_regex_from_schema

        pattern = build_regex_from_schema(json.dumps(SMALL_SCHEMA), None, 3)
    vocabulary = automata._vocabulary(tok, None)
    built = _fresh(pattern, tok)
    index = outlines_core.Index(pattern, vocabulary.index)
    offsets, tokens, targets, final = _reference_csr(index, vocabulary.eos_token_id)
    np.testing.assert_array_equal(built.offsets, offsets)
    np.testing.assert_array_equal(built.tokens, tokens)
    np.testing.assert_array_equal(built.targets, targets)
    np.testing.assert_array_equal(built.final, final)
    assert built.tokens.dtype == built.targets.dtype == built.offsets.dtype == np.int32
    if pattern.startswith("(?i)"):
        assert len(index.get_transitions()) > built.num_states  # an unreachable state dropped


@pytest.mark.parametrize(
    "pattern",
    [
        r"\d{3}-\d{4}",
        r"(yes|no|maybe)",
        r"[A-Za-z_][A-Za-z0-9_]{0,15}",
        r"(\+|-)?[0-9]+(\.[0-9]+)?",
        r"(?i)hello( world)?",
        "schema",
    ],
)
def test_the_sizing_admits_what_the_exact_count_admits(tok, pattern):
    """Sizing with the bounds set to the automaton's exact counts passes on these
    patterns: their character DFA has no more states than the token automaton, and the
    transition estimate stays within its slack (2x) on automata of 1000 transitions or more;
    short literal patterns, where it overshoots up to 2.6x, get twice their count."""
    if pattern == "schema":
        from outlines_core.json_schema import build_regex_from_schema

        pattern = build_regex_from_schema(json.dumps(SMALL_SCHEMA), None, 3)
    built = _fresh(pattern, tok)
    edges = int(built.tokens.shape[0])
    vocabulary = automata._vocabulary(tok, None)
    bound = edges if edges >= 1000 else 2 * edges
    # outlines-core's states, those no token boundary reaches included (genjax drops them):
    # the character DFA the sizing builds has those too.
    states = len(outlines_core.Index(pattern, vocabulary.index).get_transitions())
    limits.check_pattern(pattern, vocabulary.leading_chars, states, bound)


def test_a_cached_automaton_is_checked_against_the_callers_bounds(tok):
    _fresh(r"[0-9]{1,20}", tok)
    with pytest.raises(InputError, match="builds an automaton of 21 states"):
        genjax.constraints.regex(r"[0-9]{1,20}", tok, max_states=10)  # from the cache


def test_bad_bounds_and_unparsable_patterns(tok):
    with pytest.raises(InputError, match="max_states must be a positive int.*got 0"):
        genjax.constraints.regex("a+", tok, max_states=0)
    with pytest.raises(InputError, match="max_transitions must be a positive int.*got True"):
        genjax.constraints.choice(["a"], tok, max_transitions=True)
    chars = np.array([[97, -1]], np.int32)
    limits.check_pattern(r"\p{L}{1,3}", chars, 1, 1)  # Rust-only syntax: not sized here
    limits.check_pattern(r"[a&&b]{1,9}", chars, 1, 1)  # read otherwise by Python (no warning)
    leading = limits.leading_chars([b"\x80a", b"\xe4", "z", b"ab", "\u00e9t"]).tolist()
    assert leading == [[-1, -1], [0xFFFD, -1], [122, -1], [97, 98], [233, 116]]


def test_the_server_refuses_before_building_with_the_pools_sizes(tok, no_index):
    shape = SimpleNamespace(constraint_states=4096, constraint_edges=2**20)
    manager = SimpleNamespace(shape=shape, model=SimpleNamespace(vocab_size=4096))
    cache = ConstraintCache(tok, manager)
    long, longer = ({"type": "string", "maxLength": n} for n in (2000, 9999))
    cases = [
        GuidedSpec("guided_regex", "regex", r"(a|b)*a(a|b){20}"),
        GuidedSpec("guided_json", "json_schema", json.dumps(longer)),
        GuidedSpec("response_format", "json_schema", json.dumps(long)),
    ]
    for spec in cases:
        with pytest.raises(APIError) as error:
            cache.build(spec, tok.eos_token_id)
        assert error.value.status == 400 and error.value.param == spec.param
        assert "max-constraint-states" in str(error.value)
