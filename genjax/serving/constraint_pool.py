"""Structured output in the continuous-batching engine: one pool of token automata on the device,
shared by every request, and the host's bookkeeping of it.

The pool is a :class:`~genjax.constraints.CompressedTable` of fixed size (the engine's
``constraint_states`` ``S_p`` and ``constraint_edges`` ``E_p``; ``V`` the model's vocabulary):
``bits uint32[S_p, ceil(V / 32)]`` (the allowed tokens of each state), ``offsets int32[S_p + 1]``
and ``targets int32[E_p]`` (the states each state's allowed tokens lead to, in token order).
Memory: ``S_p * ceil(V / 32) * 4 + 4 * (S_p + 1) + 4 * E_p`` bytes (about
``S_p * V / 8 + 4 * E_p``).

The host keeps a numpy copy. Each distinct automaton (by content: the same pattern over the same
vocabulary, whichever ``Constraint`` object carries it) is installed once at a contiguous range of
``n + 1`` states (its ``n`` states renumbered by the range's start; the spare row closes its last
state's edge range) and a contiguous range of its ``e`` transitions::

    states  | json schema: 39 + 1 | regex: 9 + 1 | free ...      (first fit)
    edges   | 5082                | 508          | free ...

Installed automata are counted by the requests holding a slot with them; one no request holds
stays installed (the next request with the same constraint finds it) until its space is needed,
least recently used first. A request whose automaton cannot be placed while others are in use
waits at the head of the queue until they finish; one larger than the whole pool is refused when
it is added. After an install the whole pool goes to the device with one ``jax.device_put``
before the next step, which takes it as an argument (not donated; its shapes never change, so it
never compiles anything).

Static or traced:
    Static: whether the engine has a pool (``constraint_states > 0``), ``S_p``, ``E_p``, ``V``.
    Traced: the pool's contents, each row's automaton state (``EngineState.constraint_state``,
    -1 for an unconstrained row) and each row's constraint EOS id.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence

import jax
import numpy as np

from genjax.constraints import CompressedTable, Constraint
from genjax.constraints.tables import bitmask, check_vocab_size
from genjax.errors import InputError
from genjax.generation.constrained import check_eos

__all__ = ["ConstraintPool", "check_constraint", "constraint_key", "walk"]


def constraint_key(constraint: Constraint) -> bytes:
    """A digest of the automaton's content (its transitions and EOS id): equal automata share
    one place in the pool.

    Example:
        >>> c = genjax.constraints.choice(["yes", "no"], tok)
        >>> constraint_key(c) == constraint_key(genjax.constraints.regex("(yes|no)", tok))
        True
    """
    digest = hashlib.blake2b(digest_size=16)
    digest.update(np.asarray([constraint.eos_token_id, constraint.vocab_size], np.int64).tobytes())
    for array in (constraint.offsets, constraint.tokens, constraint.targets):
        digest.update(np.ascontiguousarray(array, np.int32).tobytes())
    return digest.digest()


def walk(constraint: Constraint, tokens: Sequence[int]) -> int:
    """The automaton's state after ``tokens`` from its initial state (a refused token leaves the
    state as it is, as :func:`genjax.decoding.automaton.advance_rows` does).

    Example:
        >>> c = genjax.constraints.choice(["yes", "no"], tok)
        >>> bool(c.final[walk(c, tok.encode("yes"))])
        True
    """
    state = 0
    for token in tokens:
        following = constraint.step(state, int(token))
        state = state if following < 0 else following
    return state


def check_constraint(
    constraint: Constraint,
    max_states: int,
    max_edges: int,
    vocab_size: int,
    eos_token_ids: Sequence[int],
) -> None:
    """Raises InputError unless the engine can run ``constraint`` for a request.

    Args:
        constraint: the request's constraint.
        max_states: the pool's states ``S_p`` (0: the engine has no pool).
        max_edges: the pool's transitions ``E_p``.
        vocab_size: the model's ``V``.
        eos_token_ids: the request's EOS ids (the constraint's must be one of them).
    """
    if not isinstance(constraint, Constraint):
        raise InputError(
            f"constraint= must be a genjax.constraints.Constraint (from regex(), json_schema(), "
            f"json_object() or choice()); got {type(constraint).__name__}."
        )
    if max_states == 0:
        raise InputError(
            "this engine has no constraint pool (ContinuousBatchingConfig.max_constraint_states "
            "is 0). Set max_constraint_states (and max_constraint_edges) to run constraints."
        )
    check_vocab_size(constraint, vocab_size)
    check_eos(constraint.eos_token_id, list(eos_token_ids) or None, "request")
    states, edges = constraint.num_states + 1, int(constraint.tokens.shape[0])
    if states > max_states or edges > max_edges:
        raise InputError(
            f"the constraint needs {states} states ({constraint.num_states} + 1) and {edges} "
            f"transitions of the engine's constraint pool, which holds {max_states} states and "
            f"{max_edges} transitions. Raise ContinuousBatchingConfig.max_constraint_states "
            f"(to at least {states}) and max_constraint_edges (to at least {edges}); for "
            f"`genjax serve`, --max-constraint-states and --max-constraint-edges."
        )


@dataclasses.dataclass
class _Installed:
    """One automaton in the pool."""

    state_start: int  # its state 0 is pool state `state_start`
    states: int  # rows taken: its n states and the spare one
    edge_start: int
    edges: int
    refs: int = 0  # requests holding a slot with it
    used: int = 0  # when it was last acquired (a counter)


class ConstraintPool:
    """The host's copy of the device pool (see the module docstring). Plain numpy; used by the
    scheduler in the engine's loop thread only.

    Args:
        max_states: ``S_p`` (at least 1).
        max_edges: ``E_p`` (at least 1).
        vocab_size: the model's ``V``.
        sharding: where :meth:`device` puts the pool (replicated on the engine's mesh, so no
            step copies it); None: the default device.

    Example:
        >>> c = genjax.constraints.choice(["yes", "no"], tok)
        >>> pool = ConstraintPool(max_states=64, max_edges=1024, vocab_size=4096)
        >>> pool.acquire(constraint_key(c), c)  # c's state 0 is the pool's state 0
        0
    """

    def __init__(self, max_states: int, max_edges: int, vocab_size: int, sharding=None):
        self.max_states, self.max_edges, self.vocab_size = max_states, max_edges, vocab_size
        self.sharding = sharding
        self.bits = np.zeros((max_states, -(-vocab_size // 32)), np.uint32)
        self.offsets = np.zeros((max_states + 1,), np.int32)
        self.targets = np.full((max_edges,), -1, np.int32)
        self._installed: dict[bytes, _Installed] = {}
        self._clock = 0
        self._device: CompressedTable | None = None  # None: the numpy copy changed

    @property
    def num_installed(self) -> int:
        """Automata in the pool, held or not."""
        return len(self._installed)

    def acquire(self, key: bytes, constraint: Constraint) -> int | None:
        """Takes a reference to the automaton (installing it when needed); returns the pool state
        of its initial state, or None when it cannot be placed now (the request waits)."""
        entry = self._installed.get(key)
        if entry is None:
            entry = self._install(key, constraint)
            if entry is None:
                return None
        entry.refs += 1
        self._clock += 1
        entry.used = self._clock
        return entry.state_start

    def release(self, key: bytes) -> None:
        """Drops a reference taken by :meth:`acquire` (the automaton stays installed)."""
        self._installed[key].refs -= 1

    def device(self) -> CompressedTable:
        """The pool on the device, uploaded again after an install."""
        if self._device is None:
            # Copies: the device buffers must not alias the numpy arrays installs change.
            self._device = jax.device_put(
                CompressedTable(
                    bits=self.bits.copy(),
                    offsets=self.offsets.copy(),
                    targets=self.targets.copy(),
                    initial=np.zeros((0,), np.int32),  # each row's state is in the engine state
                    eos_token_id=np.full((), -1, np.int32),  # each row's is in its settings
                    vocab_size=self.vocab_size,
                ),
                self.sharding,
            )
        return self._device

    def _install(self, key: bytes, constraint: Constraint) -> _Installed | None:
        states, edges = constraint.num_states + 1, int(constraint.tokens.shape[0])
        while True:
            entries = self._installed.values()
            taken = [(e.state_start, e.states) for e in entries]
            state_start = _first_fit(taken, states, self.max_states)
            taken = [(e.edge_start, e.edges) for e in entries]
            edge_start = _first_fit(taken, edges, self.max_edges)
            if state_start is not None and edge_start is not None:
                break
            unused = [(e.used, k) for k, e in self._installed.items() if e.refs == 0]
            if not unused:
                return None
            del self._installed[min(unused)[1]]  # least recently used first
        n = constraint.num_states
        rows = slice(state_start, state_start + n)
        self.bits[rows] = bitmask(constraint.offsets, constraint.tokens, n, self.vocab_size)
        self.offsets[state_start : state_start + n + 1] = constraint.offsets + edge_start
        span = slice(edge_start, edge_start + edges)
        self.targets[span] = constraint.targets + state_start
        entry = _Installed(state_start, states, edge_start, edges)
        self._installed[key] = entry
        self._device = None
        return entry


def _first_fit(taken: list[tuple[int, int]], size: int, total: int) -> int | None:
    """The lowest start of ``size`` free entries among ``taken`` ``(start, size)`` ranges of
    ``[0, total)``; None when no gap is large enough."""
    start = 0
    for begin, length in sorted(taken):
        if begin - start >= size:
            return start
        start = max(start, begin + length)
    return start if total - start >= size else None
