"""Host side of structured output: a regex (or JSON schema, or list of choices) becomes a
token-level automaton over a tokenizer's vocabulary, built by ``outlines-core``.

The automaton is read out of ``outlines_core.Index`` once and kept as numpy arrays in CSR form
(per state, its sorted allowed tokens and the state each leads to), with states renumbered so that
the initial state is 0. :mod:`genjax.constraints.tables` turns one or more of them into the device
table the decoding loops read.

Caches (in memory, per process): the vocabulary read from a tokenizer (by tokenizer object and
token count, then by content), and the last 32 automata by (regex, vocabulary content), so a
pattern used again costs a dictionary lookup.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import itertools
import json
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from genjax.constraints import limits
from genjax.errors import InputError, UnsupportedError
from genjax.stopping.stop_strings import token_texts

__all__ = ["Constraint", "choice", "grammar", "json_object", "json_schema", "regex"]

_CACHE_SIZE = 32


@dataclasses.dataclass(frozen=True, eq=False)
class Constraint:
    """A token automaton for one pattern over one vocabulary (host numpy arrays, CSR form).

    From state ``s`` the allowed tokens are ``tokens[offsets[s]:offsets[s + 1]]`` (sorted) and
    token ``tokens[i]`` leads to ``targets[i]``. State 0 is the initial state. The EOS id is
    allowed exactly in the accepting states (``final``), where it leads back to the same state.

    Build one with :func:`regex`, :func:`json_schema`, :func:`json_object` or :func:`choice`.
    """

    pattern: str  # the regex the automaton recognises
    offsets: np.ndarray  # int32[n + 1]
    tokens: np.ndarray  # int32[E]: allowed tokens, sorted within each state
    targets: np.ndarray  # int32[E]: the state each allowed token leads to
    final: np.ndarray  # bool[n]: accepting states
    eos_token_id: int
    vocab_size: int  # the tokenizer's token count: every id is below it
    build_seconds: float  # time spent building this automaton (once; the cache returns it)

    @property
    def num_states(self) -> int:
        """``n``, the number of states."""
        return int(self.final.shape[0])

    def next_states(self, vocab_size: int | None = None) -> np.ndarray:
        """int32[n, V]: the dense transition table, -1 where a token is not allowed.

        Example:
            >>> c = genjax.constraints.choice(["yes", "no"], tok)  # doctest: +SKIP
            >>> c.next_states().shape  # doctest: +SKIP
            (9, 4096)
        """
        vocab = self.vocab_size if vocab_size is None else vocab_size
        table = np.full((self.num_states, vocab), -1, np.int32)
        rows = np.repeat(np.arange(self.num_states), np.diff(self.offsets))
        table[rows, self.tokens] = self.targets
        return table

    def accepts(self, token_ids: Sequence[int]) -> bool:
        """Whether the token sequence (EOS ids at the end are ignored) ends in an accepting
        state. Host-side, for checks and tests."""
        ids = list(token_ids)
        while ids and ids[-1] == self.eos_token_id:
            ids.pop()
        state = 0
        for token in ids:
            state = self.step(state, token)
            if state < 0:
                return False
        return bool(self.final[state])

    def step(self, state: int, token: int) -> int:
        """The state after ``token`` from ``state`` (host-side), -1 when it is refused.

        Example:
            >>> c = genjax.constraints.choice(["yes", "no"], tok)
            >>> c.step(0, tok.encode("no")[0]) > 0, c.step(0, tok.encode("maybe")[0])
            (True, -1)
        """
        start, stop = self.offsets[state], self.offsets[state + 1]
        at = start + np.searchsorted(self.tokens[start:stop], token)
        if at >= stop or self.tokens[at] != token:
            return -1
        return int(self.targets[at])

    def __repr__(self) -> str:
        pattern = self.pattern if len(self.pattern) <= 60 else self.pattern[:57] + "..."
        return (
            f"Constraint({pattern!r}, states={self.num_states}, edges={self.tokens.shape[0]}, "
            f"vocab_size={self.vocab_size})"
        )


def regex(
    pattern: str,
    tokenizer: Any,
    *,
    eos_token_id: int | None = None,
    max_states: int | None = None,
    max_transitions: int | None = None,
) -> Constraint:
    """Outputs that match ``pattern`` in full (``re.fullmatch``), then EOS.

    The automaton is sized before it is built (:mod:`genjax.constraints.limits`): one with more
    than ``max_states`` states or ``max_transitions`` transitions is refused, most before any
    expensive work (``[a-z]{1,100000}``, ``(a|b)*a(a|b){20}`` fail in well under a second).

    Args:
        pattern: a regular expression (the dialect of ``outlines-core``: Rust ``regex``-like,
            no look-around or back-references).
        tokenizer: a transformers tokenizer, a ``tokenizers.Tokenizer`` or
            :class:`genjax.tokenizer.Tokenizer`; byte-level vocabularies are matched on bytes.
        eos_token_id: the EOS id allowed in accepting states; None reads the tokenizer's.
        max_states: the bound on the automaton's states; None:
            :data:`~genjax.constraints.limits.MAX_STATES` (32768).
        max_transitions: the bound on its transitions (allowed (state, token) pairs); None:
            :data:`~genjax.constraints.limits.MAX_TRANSITIONS` (2**26).

    Raises:
        InputError: a pattern the vocabulary cannot spell (nothing is admitted), an invalid
            pattern, no EOS id, or an automaton over the bounds (the message gives its size).

    Example:
        >>> c = genjax.constraints.regex(r"\\d{3}-\\d{4}", tok)  # doctest: +SKIP
        >>> out = genjax.generate(model, params, ids, cfg, constraint=c)  # doctest: +SKIP
    """
    if not isinstance(pattern, str) or not pattern:
        raise InputError(f"regex needs a non-empty pattern string; got {pattern!r}.")
    bounds = (
        limits.MAX_STATES if max_states is None else max_states,
        limits.MAX_TRANSITIONS if max_transitions is None else max_transitions,
    )
    limits.check_limits(*bounds)
    vocabulary = _vocabulary(tokenizer, eos_token_id)
    key = (pattern, vocabulary.fingerprint)
    found = _AUTOMATA.get(key)
    if found is not None:
        _AUTOMATA.move_to_end(key)
        limits.check_counts(pattern, found.num_states, found.tokens.shape[0], *bounds)
        return found
    built = _build(pattern, vocabulary, *bounds)
    _AUTOMATA[key] = built
    if len(_AUTOMATA) > _CACHE_SIZE:
        _AUTOMATA.popitem(last=False)
    return built


def json_schema(
    schema: Mapping[str, Any] | str,
    tokenizer: Any,
    *,
    whitespace_pattern: str | None = None,
    max_recursion_depth: int = 3,
    **kwargs,
) -> Constraint:
    """Outputs that are JSON documents valid under ``schema`` (through ``outlines-core``'s
    schema-to-regex builder).

    What the regex enforces is what ``outlines-core`` supports: types, ``properties`` and
    ``required``, ``enum``/``const``, string ``minLength``/``maxLength``/``pattern``/``format``,
    array ``minItems``/``maxItems``, ``anyOf``/``oneOf``/``allOf``, ``$ref`` up to
    ``max_recursion_depth``. Numeric bounds (``minimum``, ``maximum``) are not enforced.

    Args:
        schema: a JSON schema as a dict or a JSON string.
        tokenizer: as for :func:`regex`.
        whitespace_pattern: the regex for whitespace between tokens; None: ``[ ]?``.
        max_recursion_depth: how deep recursive ``$ref`` and nested free objects unfold.
        **kwargs: ``eos_token_id``, ``max_states``, ``max_transitions`` as for :func:`regex`
            (a schema with ``maxLength: 100000`` or deep nesting exceeds the default bounds).

    Example:
        >>> schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
        >>> c = genjax.constraints.json_schema(schema, tok)  # doctest: +SKIP
    """
    from outlines_core.json_schema import build_regex_from_schema

    text = schema if isinstance(schema, str) else json.dumps(schema)
    try:
        pattern = build_regex_from_schema(text, whitespace_pattern, max_recursion_depth)
    except (ValueError, TypeError) as error:
        raise InputError(f"json_schema: cannot turn the schema into a regex: {error}") from error
    return regex(pattern, tokenizer, **kwargs)


def json_object(tokenizer: Any, *, max_recursion_depth: int = 1, **kwargs) -> Constraint:
    """Any JSON object (``{"type": "object"}``), nested objects and arrays unfolded
    ``max_recursion_depth`` levels deep (the automaton grows quickly with the depth).

    Example:
        >>> c = genjax.constraints.json_object(tok)  # doctest: +SKIP
    """
    return json_schema(
        {"type": "object"}, tokenizer, max_recursion_depth=max_recursion_depth, **kwargs
    )


def choice(choices: Sequence[str], tokenizer: Any, **kwargs) -> Constraint:
    """Outputs that are exactly one of ``choices`` (literal strings).

    Example:
        >>> c = genjax.constraints.choice(["yes", "no", "maybe"], tok)  # doctest: +SKIP
    """
    if isinstance(choices, str) or not choices or not all(isinstance(c, str) for c in choices):
        raise InputError(
            f"choice needs a non-empty list of strings, e.g. ['yes', 'no']; got {choices!r}."
        )
    return regex("(" + "|".join(re.escape(c) for c in choices) + ")", tokenizer, **kwargs)


def grammar(*args, **kwargs) -> Constraint:
    """Context-free grammars (Lark/EBNF) are not supported: a token automaton recognises regular
    languages only. Always raises UnsupportedError.

    Example:
        >>> grammar("start: 'a'")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        genjax.errors.UnsupportedError: context-free grammars are not supported ...
    """
    raise UnsupportedError(
        "context-free grammars are not supported by genjax.constraints: the device automaton "
        "recognises regular languages. Use regex() or json_schema() (recursive schemas unfold "
        "to max_recursion_depth)."
    )


@dataclasses.dataclass(frozen=True, eq=False)
class _Vocabulary:
    index: Any  # outlines_core.Vocabulary
    fingerprint: str  # hash of the token texts, the EOS id and the excluded ids
    eos_token_id: int
    size: int  # ids are below it
    leading_chars: np.ndarray  # int32[T, 2]: each token's first two code points (limits.py)


def _vocabulary(tokenizer: Any, eos_token_id: int | None) -> _Vocabulary:
    """The ``outlines_core.Vocabulary`` of ``tokenizer`` (cached by object, then by content)."""
    eos = eos_token_id if eos_token_id is not None else getattr(tokenizer, "eos_token_id", None)
    if eos is None or isinstance(eos, bool) or not isinstance(eos, int | np.integer) or eos < 0:
        raise InputError(
            f"a constraint needs the EOS id it allows in accepting states, but the tokenizer has "
            f"none ({eos!r}); pass eos_token_id=."
        )
    quick = (id(tokenizer), int(eos))
    seen = _BY_TOKENIZER.get(quick)
    if seen is not None and seen[0] is tokenizer:
        return seen[1]
    from outlines_core import Vocabulary

    texts, _ = token_texts(tokenizer)
    skip = _special_ids(tokenizer) | {int(eos)}
    spelled: dict[Any, list[int]] = {}
    for index, text in sorted(texts.items()):
        if index not in skip and text:
            spelled.setdefault(text, []).append(int(index))
    digest = hashlib.sha256(repr((sorted(spelled.items()), int(eos))).encode()).hexdigest()
    vocabulary = _Vocabulary(
        index=Vocabulary(int(eos), spelled),
        fingerprint=digest,
        eos_token_id=int(eos),
        size=max([*texts, int(eos)]) + 1,
        leading_chars=limits.leading_chars([t for t, ids in spelled.items() for _ in ids]),
    )
    _BY_TOKENIZER[quick] = (tokenizer, vocabulary)
    if len(_BY_TOKENIZER) > 8:
        _BY_TOKENIZER.popitem(last=False)
    return vocabulary


def _special_ids(tokenizer: Any) -> set[int]:
    """Ids of special (added) tokens, which no pattern may spell."""
    ids = {int(i) for i in (getattr(tokenizer, "all_special_ids", None) or [])}
    for backend in (tokenizer, getattr(tokenizer, "backend_tokenizer", None)):
        added = getattr(backend, "get_added_tokens_decoder", None)
        if callable(added):
            ids |= {int(i) for i, token in added().items() if getattr(token, "special", False)}
    return ids


def _build(pattern: str, vocabulary: _Vocabulary, max_states: int, max_transitions: int):
    """Sizes ``pattern`` (:func:`limits.check_pattern`), builds its outlines-core index and
    reads it out in CSR form (:func:`_read_out`), the counts checked as they grow."""
    from outlines_core import Index

    start = time.perf_counter()
    limits.check_pattern(pattern, vocabulary.leading_chars, max_states, max_transitions)
    try:
        index = Index(pattern, vocabulary.index)
    except ValueError as error:
        raise InputError(
            f"the constraint's pattern admits no output over this vocabulary (or is invalid): "
            f"{error}"
        ) from error
    offsets, tokens, targets, final = _read_out(
        index, pattern, vocabulary.eos_token_id, max_states, max_transitions
    )
    constraint = Constraint(
        pattern=pattern,
        offsets=offsets,
        tokens=tokens,
        targets=targets,
        final=final,
        eos_token_id=vocabulary.eos_token_id,
        vocab_size=vocabulary.size,
        build_seconds=time.perf_counter() - start,
    )
    _check_admits_something(constraint)
    return constraint


def _read_out(index: Any, pattern: str, eos_token_id: int, max_states: int, max_transitions: int):
    """An outlines-core ``Index`` as CSR arrays, one state at a time.

    States are visited breadth first from the initial state, each through
    ``get_allowed_tokens`` and ``get_next_state``, so the host holds numpy's 12 bytes per
    transition (int32 token and target, int32 renumbered target) instead of the Python dict of
    dicts ``get_transitions`` returns (about 140 bytes per transition with its int objects:
    2.8 GiB for ``bench/structured.py``'s JSON schema over a 50k vocabulary), and a walk past
    the bounds stops at the first state over them. States are renumbered with the initial
    state 0 and the others in the order of their outlines-core ids.

    Returns:
        ``(offsets int32[n + 1], tokens int32[E], targets int32[E], final bool[n])`` as
        :class:`Constraint` holds them.
    """
    initial = index.get_initial_state()
    found, order = {initial}, [initial]
    tokens, targets = {}, {}
    total = 0
    for state in order:  # grows as new states are found
        allowed = np.sort(np.fromiter(index.get_allowed_tokens(state) or (), np.int64))
        count = allowed.shape[0]
        # EOS (allowed in accepting states) has no next state here; the automaton stays put.
        moves = allowed != eos_token_id
        step = map(index.get_next_state, itertools.repeat(state), allowed[moves].tolist())
        following = np.full(count, state, np.int64)
        following[moves] = np.fromiter(step, np.int64, int(moves.sum()))
        for target in np.unique(following).tolist():
            if target not in found:
                found.add(target)
                order.append(target)
        total += count
        if len(order) > max_states or total > max_transitions:
            limits.check_counts(pattern, len(order), total, max_states, max_transitions, True)
        tokens[state], targets[state] = allowed.astype(np.int32), following
    others = np.sort(np.array([s for s in order if s != initial], np.int64))
    numbered = [initial, *others.tolist()]

    def number(states: np.ndarray) -> np.ndarray:
        return np.where(states == initial, 0, np.searchsorted(others, states) + 1).astype(np.int32)

    counts = np.array([tokens[s].shape[0] for s in numbered], np.int64)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    flat_tokens = np.concatenate([tokens.pop(s) for s in numbered])
    flat_targets = np.concatenate([number(targets.pop(s)) for s in numbered])
    finals = np.fromiter(index.get_final_states(), np.int64)
    final = np.zeros(len(numbered), bool)
    final[number(finals[np.isin(finals, others) | (finals == initial)])] = True
    return offsets, flat_tokens, flat_targets, final


def _check_admits_something(constraint: Constraint) -> None:
    """Raises InputError when no accepting state can be reached from the initial state."""
    seen, todo = {0}, [0]
    while todo:
        state = todo.pop()
        if constraint.final[state]:
            return
        for target in constraint.targets[constraint.offsets[state] : constraint.offsets[state + 1]]:
            if int(target) not in seen:
                seen.add(int(target))
                todo.append(int(target))
    raise InputError(
        f"the constraint {constraint.pattern!r} admits no complete output over this vocabulary: "
        f"no accepting state is reachable. Check the pattern against the tokenizer."
    )


_AUTOMATA: collections.OrderedDict[tuple, Constraint] = collections.OrderedDict()
_BY_TOKENIZER: collections.OrderedDict[tuple, tuple] = collections.OrderedDict()
