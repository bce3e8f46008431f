"""Device side of structured output: one or more automata as a table the decoding loops read.

:func:`device_automaton` stacks the automata of a call (one shared by every row, or one per row)
into one table: their states are concatenated, each row starting at its automaton's initial
state, and the state count is padded to a size of the form ``m * 2**k`` (``m`` in 4..7, at
least 16: :func:`_bucket`), so patterns of similar size share one compiled program. Two
formats implement :class:`genjax.decoding.automaton.TokenAutomaton`:

* :class:`DenseTable` (``int32[S, V]`` next-state ids, -1 = refused) when it takes at most
  :data:`DENSE_LIMIT_BYTES` (64 MiB); a step is one row gather for the mask and one element
  gather for the next state.
* :class:`CompressedTable` otherwise: a ``uint32[S, ceil(V / 32)]`` bitmask of allowed tokens
  (the mask: one row gather and a bit unpack) and the transitions' targets in CSR order (per
  state, by token); the next state is the target at the token's rank among the state's allowed
  tokens, counted from the bitmask row with population counts. Memory: ``S * V / 8`` bytes plus
  ``4`` per transition.

Why 64 MiB and the two formats: the dense table costs ``4 * S * V`` bytes and a step reads one
row per batch row, the cheapest mask there is; it holds every state of a JSON schema's
automaton (about 2k states) over a 4096-token vocabulary. Over 32k-50k tokens it holds 256 to
512 states (choices, short regexes) and a JSON schema takes the compressed form:
``S * V / 8 + 4 * E`` bytes, a bitmask 32x smaller than the dense table plus 4 bytes per
transition (``structured.py``'s schema over a 50k vocabulary: 153 MiB, against 785 MiB dense),
at the price of population counts over the ``V / 32`` words of a row per step.
``bench/results/*-structured-build.txt`` has the sizes and times measured per case.

Static or traced:
    Static: the format and the array shapes (padded state count ``S``, padded transition count
    ``E``, ``V``, the batch). Traced: every table entry, the initial states, the EOS id: another
    pattern with the same padded sizes reuses the compiled program.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from genjax.constraints.automata import Constraint
from genjax.errors import InputError
from genjax.typing import Array

__all__ = [
    "DENSE_LIMIT_BYTES",
    "CompressedTable",
    "DenseTable",
    "bitmask",
    "check_vocab_size",
    "device_automaton",
]

DENSE_LIMIT_BYTES = 64 * 2**20
"""The largest dense ``int32[S, V]`` table (bytes); larger ones use :class:`CompressedTable`."""


@struct.dataclass
class DenseTable:
    """A token automaton as a dense next-state table (see the module docstring)."""

    next_state: Array  # int32[S, V]: the state after each token, -1 where refused
    initial: Array  # int32[B]: each input row's initial state
    eos_token_id: Array  # int32[]

    def allowed(self, state: Array) -> Array:
        """bool[R, V] for int32[R] states."""
        return self.next_state[state] >= 0

    def advance(self, state: Array, tokens: Array) -> Array:
        """int32[R]: the next states, -1 for refused tokens."""
        return self.next_state[state, tokens]


@struct.dataclass
class CompressedTable:
    """A token automaton as an allowed-token bitmask plus CSR transitions (module docstring)."""

    bits: Array  # uint32[S, W]: bit t % 32 of word t // 32 is set when token t is allowed
    offsets: Array  # int32[S + 1]: state s's transitions are [offsets[s], offsets[s + 1])
    targets: Array  # int32[E]: the state each allowed token leads to, by state then token
    initial: Array  # int32[B]
    eos_token_id: Array  # int32[]
    vocab_size: int = struct.field(pytree_node=False)  # V

    def allowed(self, state: Array) -> Array:
        words = self.bits[state]  # uint32[R, W]
        shifts = jnp.arange(32, dtype=jnp.uint32)
        bits = (words[:, :, None] >> shifts) & jnp.uint32(1)  # [R, W, 32]
        return bits.reshape(state.shape[0], -1)[:, : self.vocab_size].astype(bool)

    def advance(self, state: Array, tokens: Array) -> Array:
        """The token's transition is the state's ``rank``-th, ``rank`` being the number of
        allowed tokens below it: the set bits of the state's words before the token's word,
        plus those below its bit. One row gather and ``W`` population counts per row, instead
        of a binary search over the transitions (about 20 dependent gathers)."""
        words = self.bits[state]  # uint32[R, W]
        word_index = (tokens // 32).astype(jnp.int32)
        bit = (tokens % 32).astype(jnp.uint32)
        before = jnp.arange(words.shape[1])[None, :] < word_index[:, None]
        counts = jax.lax.population_count(words).astype(jnp.int32)
        rank = jnp.sum(jnp.where(before, counts, 0), axis=1)
        word = jnp.take_along_axis(words, word_index[:, None], axis=1)[:, 0]
        below = word & ((jnp.uint32(1) << bit) - jnp.uint32(1))
        rank = rank + jax.lax.population_count(below).astype(jnp.int32)
        allowed = ((word >> bit) & jnp.uint32(1)) == 1
        at = jnp.minimum(self.offsets[state] + rank, self.targets.shape[0] - 1)
        return jnp.where(allowed, self.targets[at], -1).astype(jnp.int32)


def device_automaton(
    constraint: Constraint | Sequence[Constraint],
    batch: int,
    vocab_size: int,
    *,
    dense_limit_bytes: int | None = None,
) -> DenseTable | CompressedTable:
    """The device table of a call's constraint(s).

    Args:
        constraint: one :class:`Constraint` for every row, or a list of ``batch`` of them, one
            per input row (the same object may repeat; it is stored once).
        batch: ``B``, the call's input rows.
        vocab_size: ``V``, the model's vocabulary (at least the tokenizer's).
        dense_limit_bytes: the dense format's memory bound; None reads
            :data:`DENSE_LIMIT_BYTES` (which a program may change).

    Raises:
        InputError: a list of the wrong length, something not a Constraint, automata with
            different EOS ids, or a tokenizer larger than the model's vocabulary.

    Example:
        >>> table = device_automaton(genjax.constraints.regex("a+", tok), 2, 4096)  # doctest: +SKIP
    """
    rows = _per_row(constraint, batch)
    unique = list({id(c): c for c in rows}.values())
    limit = DENSE_LIMIT_BYTES if dense_limit_bytes is None else dense_limit_bytes
    starts = np.cumsum([0, *(c.num_states for c in unique)])
    start_of = {id(c): int(s) for c, s in zip(unique, starts[:-1], strict=True)}
    initial = jnp.asarray([start_of[id(c)] for c in rows], jnp.int32)
    key = (tuple(id(c) for c in unique), vocab_size, limit)
    found = _TABLES.get(key)
    if found is not None and all(a is b for a, b in zip(found[0], unique, strict=True)):
        _TABLES.move_to_end(key)
        return found[1].replace(initial=initial)
    table = _stack(unique, starts, initial, vocab_size, limit)
    _TABLES[key] = (tuple(unique), table)  # holds the constraints, so their ids stay theirs
    if len(_TABLES) > 8:
        _TABLES.popitem(last=False)
    return table


def _stack(unique, starts, initial, vocab_size, limit):
    """The table of the distinct automata ``unique``, whose states start at ``starts``."""
    for c in unique:
        check_vocab_size(c, vocab_size)
    if len({c.eos_token_id for c in unique}) > 1:
        raise InputError(
            f"the per-row constraints use different EOS ids "
            f"{sorted({c.eos_token_id for c in unique})}; build them with one tokenizer."
        )
    eos = jnp.asarray(unique[0].eos_token_id, jnp.int32)
    states = _bucket(int(starts[-1]))
    offsets = [np.zeros(1, np.int64)]
    tokens, targets, total = [], [], 0
    for c, start in zip(unique, starts[:-1], strict=True):
        offsets.append(c.offsets[1:].astype(np.int64) + total)
        tokens.append(c.tokens)
        targets.append(c.targets + int(start))
        total += c.tokens.shape[0]
    offsets = np.concatenate(offsets)
    offsets = np.concatenate([offsets, np.full(states - (offsets.shape[0] - 1), total)])
    tokens, targets = np.concatenate(tokens), np.concatenate(targets)
    if states * vocab_size * 4 <= limit:
        table = np.full((states, vocab_size), -1, np.int32)
        table[np.repeat(np.arange(states), np.diff(offsets)), tokens] = targets
        return DenseTable(jnp.asarray(table), initial, eos)
    return _compressed(offsets, tokens, targets, states, vocab_size, initial, eos)


def check_vocab_size(constraint: Constraint, vocab_size: int) -> None:
    """Raises InputError when ``constraint`` was built for more tokens than the model's
    ``vocab_size`` (its ids would fall outside the logits)."""
    if constraint.vocab_size > vocab_size:
        raise InputError(
            f"the constraint was built for a tokenizer of {constraint.vocab_size} tokens, more "
            f"than the model's vocab_size={vocab_size}. Build it with the model's tokenizer."
        )


def bitmask(offsets, tokens, states: int, vocab_size: int) -> np.ndarray:
    """uint32[states, ceil(V / 32)]: bit ``t % 32`` of word ``t // 32`` of row ``s`` set when
    CSR state ``s`` (``offsets`` int[states + 1], ``tokens`` int[E]) allows token ``t``."""
    bits = np.zeros((states, -(-vocab_size // 32)), np.uint32)
    rows = np.repeat(np.arange(states), np.diff(offsets))
    np.bitwise_or.at(bits, (rows, tokens // 32), (np.uint32(1) << (tokens % 32)).astype(np.uint32))
    return bits


def _compressed(offsets, tokens, targets, states, vocab_size, initial, eos) -> CompressedTable:
    # Targets stay in the automata's order, by state then token (Constraint keeps each state's
    # tokens sorted): the order the ranks count in.
    edges = _bucket(tokens.shape[0])
    bits = bitmask(offsets, tokens, states, vocab_size)
    pad = edges - tokens.shape[0]
    return CompressedTable(
        bits=jnp.asarray(bits),
        offsets=jnp.asarray(offsets, jnp.int32),
        targets=jnp.asarray(np.concatenate([targets, np.full(pad, -1)]), jnp.int32),
        initial=initial,
        eos_token_id=eos,
        vocab_size=vocab_size,
    )


_TABLES: collections.OrderedDict[tuple, tuple] = collections.OrderedDict()
"""The last 8 device tables, by (the automata's ids, V, the dense bound)."""


def _per_row(constraint, batch: int) -> list[Constraint]:
    if isinstance(constraint, Constraint):
        return [constraint] * batch
    if isinstance(constraint, list | tuple) and all(isinstance(c, Constraint) for c in constraint):
        if len(constraint) != batch:
            raise InputError(
                f"constraint= holds {len(constraint)} constraints, but the batch has {batch} "
                f"rows: pass one Constraint for every row, or a list of one per row."
            )
        return list(constraint)
    raise InputError(
        f"constraint= must be a genjax.constraints.Constraint (from regex(), json_schema(), "
        f"json_object() or choice()) or a list of one per row; got {type(constraint).__name__}."
    )


def _bucket(count: int) -> int:
    """The smallest size of the form ``m * 2**k`` (``m`` in 4..7) holding ``count``, at least
    16: four sizes per doubling, so padding wastes at most a quarter (a power of two wasted up to
    half: ``bench/structured.py``'s schema over 50k tokens has 20.7M transitions, padded to 21.0M
    rather than 33.6M) while patterns of similar size still share a compiled program.

    Example:
        >>> [_bucket(n) for n in (1, 16, 17, 21, 33, 2000, 2189)]
        [16, 16, 20, 24, 40, 2048, 2560]
    """
    count = max(16, int(count))
    step = 1 << max(0, (count - 1).bit_length() - 3)  # a quarter of the power of two below
    return -(-count // step) * step
