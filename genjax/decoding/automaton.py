"""The decoding loops' hook for structured output: a token automaton whose state rides in the carry.

A :class:`TokenAutomaton` is a pytree (its tables are leaves, so they are traced) that says, for
an automaton state per row, which tokens may come next and which state each token leads to. The
loops of :mod:`genjax.decoding.sampling` and :mod:`genjax.decoding.beam` carry one state per row
(``int32[B]``, or ``[B*M]`` for beams, reordered with the beams) and, each step:

1. mask the scores of tokens the automaton does not allow with ``-inf`` (:func:`mask_scores`),
   before every logits processor and warper of the chain (the beam loop masks the log-probs,
   as transformers applies ``prefix_allowed_tokens_fn``);
2. after a token is chosen, advance each running row's state (:func:`advance_rows`). A row whose
   chosen token the automaton refuses (every score was ``-inf``, e.g. a processor removed the
   only allowed token) gets the automaton's EOS id instead, so it finishes.

The automata themselves are built by :mod:`genjax.constraints` (a regex or a JSON schema turned
into a table over the vocabulary); this module knows nothing about how.

Static or traced:
    Static: whether there is an automaton and the kind of its table (its pytree structure and
    array shapes). Traced: the tables' contents, the EOS id and every state.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import jax.numpy as jnp

from genjax.processors.base import NEG_INF
from genjax.typing import Array

__all__ = ["TokenAutomaton", "advance_rows", "mask_scores"]


@runtime_checkable
class TokenAutomaton(Protocol):
    """What the decoding loops need from an automaton (a pytree; see the module docstring).

    ``initial`` holds each row's first state (int32[B] over the call's input rows); the loops'
    callers repeat it for ``num_return_sequences`` or beams and put it in the carry.
    """

    initial: Array  # int32[B]: each input row's initial state
    eos_token_id: Array  # int32[]: the token allowed in accepting states

    def allowed(self, state: Array) -> Array:
        """bool[R, V]: the tokens allowed after each of int32[R] states."""
        ...

    def advance(self, state: Array, tokens: Array) -> Array:
        """int32[R]: the state after int32[R] ``tokens`` from int32[R] ``state``; -1 where the
        token is not allowed."""
        ...


def mask_scores(
    scores: Array, automaton: TokenAutomaton, state: Array, rows: Array | None = None
) -> Array:
    """float32[R, V] ``scores`` with ``-inf`` on the tokens the automaton refuses in ``state``.

    Args:
        scores: float32[R, V].
        automaton: the automaton.
        state: int32[R] states.
        rows: bool[R], the rows to mask (the others keep every score; their state is not
            read); None: every row.

    Example:
        >>> scores = mask_scores(logits, automaton, carry.automaton_state)  # doctest: +SKIP
    """
    if rows is None:
        return jnp.where(automaton.allowed(state), scores, NEG_INF)
    allowed = automaton.allowed(jnp.where(rows, state, 0))
    return jnp.where(allowed | ~rows[:, None], scores, NEG_INF)


def advance_rows(
    automaton: TokenAutomaton, state: Array, tokens: Array, running: Array
) -> tuple[Array, Array]:
    """Advances the running rows' states by their chosen tokens.

    Args:
        automaton: the automaton.
        state: int32[R] states before the tokens.
        tokens: int32[R] chosen tokens.
        running: bool[R], rows still generating; the others keep their state and token.

    Returns:
        ``(tokens, state)``: the tokens, with the automaton's EOS id where a running row's token
        is refused, and the new states (unchanged for refused tokens and stopped rows).

    Example:
        >>> tokens, state = advance_rows(automaton, state, tokens, ~finished)  # doctest: +SKIP
    """
    following = automaton.advance(state, tokens)
    refused = running & (following < 0)
    eos = jnp.asarray(automaton.eos_token_id, jnp.int32)
    tokens = jnp.where(refused, eos, tokens)
    moved = running & (following >= 0)
    return tokens, jnp.where(moved, following, state).astype(jnp.int32)
