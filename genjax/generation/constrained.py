"""Structured output in a ``generate`` call: the ``constraint=`` argument checked and turned into
the device automaton the decoding loops carry (:mod:`genjax.constraints`,
:mod:`genjax.decoding.automaton`), before anything is traced."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from genjax import constraints
from genjax.config import GenerationConfig
from genjax.decoding.automaton import TokenAutomaton
from genjax.errors import InputError, UnsupportedError

__all__ = ["automaton_for", "check_eos"]


def automaton_for(
    constraint: Any, mode: Any, batch: int, model: Any, config: GenerationConfig
) -> TokenAutomaton | None:
    """The call's device automaton, or None without a constraint.

    Args:
        constraint: ``generate``'s ``constraint=``: a Constraint, a list of one per row, None.
        mode: the call's :class:`~genjax.generation.plan.Mode`.
        batch: ``B``, the input rows.
        model: the model (its ``vocab_size``).
        config: the resolved config (its EOS ids).

    Raises:
        UnsupportedError: with assisted generation.
        InputError: a malformed constraint, or one whose EOS id is not an EOS id of the call.
    """
    if constraint is None:
        return None
    if getattr(mode, "value", mode) == "assisted":
        raise UnsupportedError(
            "constraint= cannot be combined with assisted generation (an assistant_model or "
            "prompt_lookup_num_tokens): the draft's candidates are not checked against the "
            "automaton. Drop the assistant, or the constraint."
        )
    automaton = constraints.device_automaton(constraint, batch, int(model.vocab_size))
    check_eos(int(automaton.eos_token_id), config.eos_token_id)
    return automaton


def check_eos(eos: int, eos_token_id: Any, whose: str = "call") -> None:
    """Raises InputError unless the constraint's EOS id ``eos`` is one of ``eos_token_id`` (the
    ``whose`` call's or request's EOS ids): the constraint ends rows with it, which must then
    finish them."""
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(eos_token_id)):
        return
    ids = [] if eos_token_id is None else np.atleast_1d(np.asarray(eos_token_id)).tolist()
    if eos not in ids:
        raise InputError(
            f"the constraint allows EOS id {eos} in its accepting states, but the {whose}'s "
            f"eos_token_id is {eos_token_id!r}, so rows would not end there. Set eos_token_id "
            f"to include {eos} (or build the constraint with eos_token_id= one of the {whose}'s)."
        )
