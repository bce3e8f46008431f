"""Bounds on a constraint's automaton, checked before ``outlines-core`` builds it.

``outlines-core``'s native ``Index`` build cannot be interrupted (it runs in Rust, outside the
GIL, until it ends), and its cost grows with the automaton: about ``states * V`` token walks and
host memory per transition (its map, and genjax's arrays read out of it state by state). A
pattern such as ``.{0,100000}``, ``(a|b)*a(a|b){20}`` (a DFA of 2**21 states from a short
pattern) or a JSON schema with ``maxLength: 100000`` would run for minutes and take
gigabytes; ``[a-z]{1,5000}`` has 8M transitions over 4096 tokens and about 50M over 50k. So
every build is sized first, in Python, in time bounded by the limits themselves:

1. The pattern is parsed (Python's ``re`` parser; the regexes outlines-core accepts and its
   JSON-schema builder emits use the shared syntax) and its counted repetitions are unrolled
   arithmetically into a count of character positions; more than ``4 * max_states`` positions
   is refused without building anything.
2. The character-level DFA is built by subset construction over the positions (Glushkov
   automaton), stopping past ``max_states`` states; more is refused. outlines-core's token
   automaton has about as many states, and more over a byte-level vocabulary (the states inside
   multi-byte characters that tokens can end in): 25007 here against its 25003 for a
   5000-item array, 1089 against 2189 for a JSON schema with free strings.
3. Its transitions are estimated: per DFA state, the vocabulary's tokens whose first two
   characters it can read. On JSON schemas and long repetitions the estimate is within 0.97x to
   1.06x of the exact count on the bundled tokenizer, but it overshoots on short literal
   patterns (2.6x on ``(?i)hello( world)?``), so only more than ``2 * max_transitions`` is
   refused here.

After the build the exact counts are checked again (:func:`check_counts`) as the transitions
are read out into arrays, state by state. A pattern Python's parser rejects or reads differently
(Rust-only syntax such as ``\\p{L}`` or ``[a&&b]``) skips steps 1-3 and gets only the exact
check.

The defaults, :data:`MAX_STATES` and :data:`MAX_TRANSITIONS`, admit JSON schemas of ordinary
size over vocabularies up to Llama 3's 128k tokens (``bench/structured.py``'s schema has 20.6M
transitions over 50k tokens and 51.2M over 128k) and bound a build to about ``MAX_STATES * V``
token walks and ``60 * MAX_TRANSITIONS`` bytes of host memory at its peak (outlines-core's
index, genjax's arrays and the device table's making: 2.9 GB for that schema over 128k tokens,
in 25 s on the 2-core Intel Xeon); ``bench/results/*-structured-build*.txt`` has the measured
figures.
Raise them with the ``max_states=`` / ``max_transitions=`` keywords of
:func:`genjax.constraints.regex` and friends; the serving engine uses its pool's sizes
(``max_constraint_states`` and ``max_constraint_edges``) instead.
"""

from __future__ import annotations

import bisect
import re
import warnings
from re import _constants as sre
from re import _parser as sre_parse

import numpy as np

from genjax.errors import InputError

__all__ = ["MAX_STATES", "MAX_TRANSITIONS", "check_counts", "check_pattern", "leading_chars"]

MAX_STATES = 2**15
"""Default bound on an automaton's states."""

MAX_TRANSITIONS = 2**26
"""Default bound on an automaton's transitions (allowed (state, token) pairs)."""

_POSITIONS_PER_STATE = 4
"""Positions allowed per state of ``max_states`` (a DFA may have fewer states than positions:
``json_object`` has 1527 positions and 1623 token-level states on the bundled tokenizer)."""

_ESTIMATE_SLACK = 2
"""The transition estimate refuses only above this multiple of ``max_transitions``: it counts
tokens by their first two characters and overshoots; the exact count after the build enforces
the bound itself."""

_WORK_PER_STATE = 64
"""Glushkov work (follow-set updates) allowed per admitted state before the sizing gives up."""

_TOP = 0x110000  # one past the last code point
_CATEGORIES = {
    "DIGIT": [(48, 58)],
    "SPACE": [(9, 14), (32, 33)],
    "WORD": [(48, 58), (65, 91), (95, 96), (97, 123), (0x80, _TOP)],
    "LINEBREAK": [(10, 11)],
}
_HOW_TO_RAISE = (
    "Simplify the pattern (smaller repetition counts, maxLength, maxItems or nesting), or raise "
    "the bound: max_states= / max_transitions= of genjax.constraints.regex / json_schema / "
    "json_object / choice; in the serving engine ContinuousBatchingConfig.max_constraint_states "
    "/ max_constraint_edges (genjax serve --max-constraint-states / --max-constraint-edges)."
)


def check_limits(max_states: int, max_transitions: int) -> None:
    """Raises InputError unless both bounds are positive ints."""
    for name, value in (("max_states", max_states), ("max_transitions", max_transitions)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InputError(f"{name} must be a positive int (None: the default); got {value!r}.")


def leading_chars(texts) -> np.ndarray:
    """int32[T, 2]: the first two code points of each token text (``str`` or UTF-8 ``bytes``):
    -1 as the second where the token has one character, -1 as the first for a token that starts
    with a UTF-8 continuation byte, U+FFFD for an incomplete character.

    Example:
        >>> leading_chars(["ab", "z", b"\\x80a"]).tolist()
        [[97, 98], [122, -1], [-1, -1]]
    """
    out = np.full((len(texts), 2), -1, np.int32)
    for i, text in enumerate(texts):
        if isinstance(text, bytes):
            if text[:1] and 0x80 <= text[0] < 0xC0:
                continue  # starts inside a character: stays [-1, -1]
            text = text[:8].decode("utf-8", errors="replace")
        codes = [ord(c) for c in text[:2]] or [0xFFFD]
        out[i, : len(codes)] = codes
    return out


def check_pattern(pattern: str, chars: np.ndarray, max_states: int, max_transitions: int) -> None:
    """Sizes ``pattern``'s automaton (module docstring, steps 1-3) and raises InputError when it
    exceeds a bound; returns quietly for patterns Python's ``re`` parser cannot read.

    Args:
        pattern: the regex.
        chars: int32[T, 2], the first two code points of each token (:func:`leading_chars`).
        max_states: the bound on states.
        max_transitions: the bound on transitions.

    Example:
        >>> check_pattern("[a-z]{1,5000}", np.array([[97, -1]]), 1024, 2**20)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        genjax.errors.InputError: the constraint's pattern '[a-z]{1,5000}' unrolls to 5000 ...
    """
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            tree = sre_parse.parse(pattern)
    except (re.error, OverflowError):
        return
    except RecursionError:
        raise InputError(
            f"the constraint's pattern {_short(pattern)} nests too deeply to size. {_HOW_TO_RAISE}"
        ) from None
    if caught:  # Python reads it differently from Rust (set operations such as [a&&b])
        return
    positions = _positions(tree)
    if positions is None:
        return
    if positions > _POSITIONS_PER_STATE * max_states:
        raise InputError(
            f"the constraint's pattern {_short(pattern)} unrolls to {positions} character "
            f"positions, more than {_POSITIONS_PER_STATE} per state of max_states={max_states} "
            f"(its automaton would have about that many states). {_HOW_TO_RAISE}"
        )
    glushkov = _Glushkov(max_states * _WORK_PER_STATE)
    try:
        start = glushkov.build(tree, bool(tree.state.flags & re.IGNORECASE))
    except _TooMuchWork:
        raise InputError(
            f"the constraint's pattern {_short(pattern)} is too large to size within "
            f"max_states={max_states} (its position automaton needs more than "
            f"{glushkov.budget} steps). {_HOW_TO_RAISE}"
        ) from None
    states, transitions = glushkov.count(
        start, chars, max_states, _ESTIMATE_SLACK * max_transitions
    )
    if states > max_states:
        raise InputError(
            f"the constraint's pattern {_short(pattern)} has more than {max_states} states "
            f"(max_states; its character-level DFA, counted before building the token "
            f"automaton). {_HOW_TO_RAISE}"
        )
    if transitions > _ESTIMATE_SLACK * max_transitions:
        raise InputError(
            f"the constraint's pattern {_short(pattern)} has about {transitions} transitions over "
            f"this vocabulary ({states} states; estimated from each token's first two "
            f"characters), "
            f"more than {_ESTIMATE_SLACK} x max_transitions={max_transitions}. {_HOW_TO_RAISE}"
        )


def check_counts(
    pattern: str, states: int, transitions: int, max_states, max_transitions, partial=False
):
    """Raises InputError when a built automaton's exact counts (with ``partial``, the counts
    of the part read so far) exceed the bounds."""
    if states > max_states or transitions > max_transitions:
        some = "at least " if partial else ""
        raise InputError(
            f"the constraint's pattern {_short(pattern)} builds an automaton of {some}{states} "
            f"states and {some}{transitions} transitions over this vocabulary, more than "
            f"max_states="
            f"{max_states} / max_transitions={max_transitions}. {_HOW_TO_RAISE}"
        )


def _short(pattern: str) -> str:
    return repr(pattern if len(pattern) <= 80 else pattern[:77] + "...")


def _positions(items) -> int | None:
    """Character positions of a parsed pattern with every counted repetition unrolled; None for
    constructs a DFA cannot express (back-references, look-around)."""
    total = 0
    for op, av in items:
        if op in (sre.LITERAL, sre.NOT_LITERAL, sre.ANY, sre.IN):
            total += 1
        elif op is sre.AT:
            continue
        elif op is sre.BRANCH:
            parts = [_positions(branch) for branch in av[1]]
            if None in parts:
                return None
            total += sum(parts)
        elif op is sre.SUBPATTERN or op is sre.ATOMIC_GROUP:
            inner = _positions(av[-1] if op is sre.SUBPATTERN else av)
            if inner is None:
                return None
            total += inner
        elif op in (sre.MAX_REPEAT, sre.MIN_REPEAT, sre.POSSESSIVE_REPEAT):
            low, high, inner = av
            inner = _positions(inner)
            if inner is None:
                return None
            total += inner * (max(low, 1) if high is sre.MAXREPEAT else high)
        else:
            return None
    return total


class _TooMuchWork(Exception):
    pass


class _Glushkov:
    """The position automaton of a parsed pattern: per position its character class (intervals
    of code points) and the set of positions that may follow it."""

    def __init__(self, budget: int):
        self.budget, self.work = budget, 0
        self.classes: list[list[tuple[int, int]]] = []
        self.follow: list[set[int]] = []

    def build(self, items, ignore_case: bool):
        """(first positions, last positions, whether the empty text matches)."""
        return self._sequence(items, ignore_case)

    def _link(self, last: set[int], first: set[int]) -> None:
        if first:
            for p in last:
                self.follow[p].update(first)
            self.work += len(last) * len(first)
        if self.work > self.budget:
            raise _TooMuchWork

    def _sequence(self, items, ignore_case):
        first, last, nullable = set(), set(), True
        for op, av in items:
            if op is not sre.AT:
                nullable = self._concat(first, last, nullable, self._node(op, av, ignore_case))
        return first, last, nullable

    def _concat(self, first: set, last: set, nullable: bool, part) -> bool:
        """Appends ``part`` (first, last, nullable) to a sequence whose ``first`` and ``last``
        sets are updated in place; returns whether the longer sequence is nullable."""
        f, lst, n = part
        self._link(last, f)
        if nullable:
            first.update(f)
        if not n:
            last.clear()
        last.update(lst)
        return nullable and n

    def _node(self, op, av, ignore_case):
        if op is sre.BRANCH:
            first, last, nullable = set(), set(), False
            for branch in av[1]:
                f, lst, n = self._sequence(branch, ignore_case)
                first.update(f)
                last.update(lst)
                nullable = nullable or n
            return first, last, nullable
        if op is sre.SUBPATTERN:
            case = (ignore_case or bool(av[1] & re.IGNORECASE)) and not av[2] & re.IGNORECASE
            return self._sequence(av[3], case)
        if op is sre.ATOMIC_GROUP:
            return self._sequence(av, ignore_case)
        if op in (sre.MAX_REPEAT, sre.MIN_REPEAT, sre.POSSESSIVE_REPEAT):
            return self._repeat(*av, ignore_case)
        self.classes.append(_char_class(op, av, ignore_case))
        self.follow.append(set())
        return {len(self.classes) - 1}, {len(self.classes) - 1}, False

    def _repeat(self, low, high, inner, ignore_case):
        """``x{low,high}`` as ``x^low (x (x ...)?)?``: the optional copies nest (built from the
        innermost out), so linking them costs one pass over each copy's last positions."""
        if high is sre.MAXREPEAT:
            f, lst, _ = self._sequence(inner, ignore_case)
            self._link(lst, f)
            tail = (f, lst, True)
        else:
            tail_first, tail_last = set(), set()
            for _ in range(high - low):
                f, lst, n = self._sequence(inner, ignore_case)
                self._link(lst, tail_first)
                tail_first = f | tail_first if n else f
                tail_last.update(lst)
            tail = (tail_first, tail_last, True)
        first, last, nullable = set(), set(), True
        for _ in range(low):
            nullable = self._concat(first, last, nullable, self._sequence(inner, ignore_case))
        self._concat(first, last, nullable, tail)
        return first, last, nullable

    def count(self, pattern_start, chars: np.ndarray, max_states: int, max_transitions: int):
        """(states, estimated transitions) of the DFA, by subset construction from
        ``pattern_start`` (:meth:`build`'s result); stops as soon as either exceeds its bound.

        A DFA state is the set of positions that may come next plus whether the text so far is
        accepted (position -1). Its transitions are estimated as the tokens whose first two
        characters it can read (``chars``: a first code point of -1, a token starting inside a
        character, never counts): longer tokens may still fail later, and byte-level states
        inside multi-byte characters are not seen.
        """
        first, last, nullable = pattern_start
        bounds = sorted({0, _TOP, *(b for c in self.classes for span in c for b in span)})
        atoms = len(bounds) - 1
        pairs = _pair_counts(chars, bounds)  # int64[A, A + 1]
        masks = [_atom_mask(c, bounds) for c in self.classes]
        initial = frozenset(first | ({-1} if nullable else set()))
        seen, todo, transitions = {initial}, [initial], 0
        reads: dict[frozenset, list[int]] = {}  # the atoms a state can read, then "end" (A)

        def readable(state):
            if state not in reads:
                mask = 0
                for p in state:
                    mask |= masks[p] if p >= 0 else 0
                reads[state] = [*_bits(mask), atoms]
            return reads[state]

        while todo and len(seen) <= max_states and transitions <= max_transitions:
            parts = [((1 << atoms) - 1, frozenset())]
            for p in todo.pop():
                if p < 0:
                    continue
                following = self.follow[p] | ({-1} if p in last else set())
                refined = []
                for mask, after in parts:
                    if mask & masks[p]:
                        refined.append((mask & masks[p], after | following))
                    if mask & ~masks[p]:
                        refined.append((mask & ~masks[p], after))
                parts = refined
            for mask, after in parts:
                if after:
                    transitions += int(pairs[np.ix_(_bits(mask), readable(after))].sum())
                    if after not in seen:
                        seen.add(after)
                        todo.append(after)
        return len(seen), transitions


def _pair_counts(chars: np.ndarray, bounds: list[int]) -> np.ndarray:
    """int64[A, A + 1]: tokens by the atoms of their first two characters (column A: none)."""
    atoms = len(bounds) - 1
    whole = chars[chars[:, 0] >= 0]
    first = np.searchsorted(bounds, whole[:, 0], side="right") - 1
    second = np.searchsorted(bounds, whole[:, 1], side="right") - 1
    second = np.where(whole[:, 1] < 0, atoms, second)
    counts = np.zeros((atoms, atoms + 1), np.int64)
    np.add.at(counts, (first, second), 1)
    return counts


def _bits(value: int) -> list[int]:
    out = []
    while value:
        low = value & -value
        out.append(low.bit_length() - 1)
        value ^= low
    return out


def _atom_mask(spans: list[tuple[int, int]], bounds: list[int]) -> int:
    mask = 0
    for low, high in spans:
        i, j = bisect.bisect_left(bounds, low), bisect.bisect_left(bounds, high)
        mask |= ((1 << (j - i)) - 1) << i
    return mask


def _char_class(op, av, ignore_case) -> list[tuple[int, int]]:
    """Code point intervals ``[low, high)`` a position matches (Unicode categories estimated:
    ``\\w`` counts every non-ASCII character)."""
    if op is sre.LITERAL or op is sre.NOT_LITERAL:
        spans = _literal(av, ignore_case)
        return spans if op is sre.LITERAL else _complement(spans)
    if op is sre.ANY:
        return [(0, 10), (11, _TOP)]
    spans, negate = [], False
    for kind, value in av:
        if kind is sre.NEGATE:
            negate = True
        elif kind is sre.LITERAL:
            spans += _literal(value, ignore_case)
        elif kind is sre.RANGE:
            spans.append((value[0], value[1] + 1))
        elif kind is sre.CATEGORY:
            name = str(value).replace("CATEGORY_", "").replace("UNI_", "").replace("LOC_", "")
            base = _CATEGORIES.get(name.replace("NOT_", ""), [(0, _TOP)])
            spans += _complement(base) if name.startswith("NOT_") else base
    return _complement(spans) if negate else spans


def _literal(code: int, ignore_case: bool) -> list[tuple[int, int]]:
    if not ignore_case:
        return [(code, code + 1)]
    char = chr(code)
    return [(ord(c), ord(c) + 1) for c in {char, char.lower(), char.upper()} if len(c) == 1]


def _complement(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out, at = [], 0
    for low, high in sorted(spans):
        if low > at:
            out.append((at, low))
        at = max(at, high)
    return out + ([(at, _TOP)] if at < _TOP else [])
