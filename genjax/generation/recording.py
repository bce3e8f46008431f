"""Recording the model's forward passes for ``output_hidden_states`` / ``output_attentions``.

When the call plan asks for them (:attr:`~genjax.generation.plan.CallPlan.forward_flags`,
static), the model's ``apply`` gets those flags and returns its extra outputs third (the model
protocol of :mod:`genjax.models`): the prefill's are kept as they are, and the decoding loops
write each later call's into buffers of their carry (``step_outputs``, leaves ``[N - 1, ...]``).
:func:`records` wraps both as :class:`~genjax.generation.outputs.ForwardRecord` s, which
``PreparedCall.finish`` lays out per token on the host. An encoder-decoder model's prefill
also returns its encoder's outputs (:data:`ONCE`), kept as they are. Without the flags nothing
here adds to the program. On a mesh the records keep their rows on ``batch`` (their axis 1,
after the layer axis; axis 2 in the loops' buffers, after the step axis): :func:`constrain_state`
and :func:`constrain_output`. Everything runs inside ``generate``'s trace; the plan is static.
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp

from genjax.decoding.sampling import step_output_buffers
from genjax.generation.outputs import ForwardRecord, GenerateOutput
from genjax.typing import PyTree

ONCE = ("encoder_hidden_states", "encoder_attentions")
"""Outputs of the prefill alone, returned once as computed (an encoder-decoder model's
encoder: one row per prompt, which transformers does not repeat for beams or return
sequences)."""


def step_fn(plan):
    """The loops' step function: the model's ``apply``, with the plan's ``output_*`` flags when
    it records (it then returns the extra outputs third)."""
    flags = plan.forward_flags
    return functools.partial(plan.model.apply, **flags) if flags else plan.model.apply


def with_buffers(plan, params: PyTree, state, prefill_outputs: list):
    """``state`` (a loop's initial state) with zero buffers for the extra outputs of the loop's
    ``N - 1`` model calls, when the plan records (``prefill_outputs`` is then ``[the prefill's
    outputs]``, else empty and ``state`` is returned as it is)."""
    if not prefill_outputs:
        return state
    calls = max(plan.steps - 1, 0)
    return state.replace(step_outputs=step_output_buffers(step_fn(plan), params, state, calls))


def constrain_state(layout, state):
    """A loop's carry (a sampling or beam state) constrained by the sharding ``layout``, with
    the recorded buffers' rows (``step_outputs`` leaves ``[N - 1, X, rows, ...]``) on axis 2
    rather than the leading step axis, so each device writes its own rows every step."""
    buffers = state.step_outputs
    state = layout.constrain(state.replace(step_outputs=None))
    if buffers is None:
        return state
    return state.replace(step_outputs=layout.constrain(buffers, rows_at=2))


def constrain_output(layout, out: GenerateOutput) -> GenerateOutput:
    """``out`` constrained by the sharding ``layout``: its recorded hidden states and
    attentions with their rows on ``batch`` (a :class:`ForwardRecord` 's prefill ``[X, rows,
    ...]`` and steps ``[N - 1, X, rows, ...]``, the :data:`ONCE` outputs ``[X, B, ...]``), the
    rest as :meth:`genjax.sharding.Layout.constrain` puts it."""
    fields = {field.name: getattr(out, field.name) for field in dataclasses.fields(out)}
    recorded = {
        name: value
        for name, value in fields.items()
        if isinstance(value, ForwardRecord) or (name in ONCE and value is not None)
    }
    out = layout.constrain(out.replace(**dict.fromkeys(recorded)))
    placed = {
        name: layout.constrain(value, rows_at=1)
        if not isinstance(value, ForwardRecord)
        else value.replace(
            prefill=layout.constrain(value.prefill, rows_at=1),
            steps=layout.constrain(value.steps, rows_at=2),
        )
        for name, value in recorded.items()
    }
    return out.replace(**placed)


def records(prefill_outputs: list, step_outputs: PyTree, copies: int) -> dict:
    """``GenerateOutput``'s per-token outputs (``hidden_states`` / ``attentions``, or an
    encoder-decoder model's ``decoder_*`` and ``cross_attentions``) as ``ForwardRecord`` s: the
    prefill's ``B`` rows repeated ``copies`` times (static: ``R``, or ``M`` beams; transformers
    expands the prompts before its prefill), then the loop's buffers; the :data:`ONCE` outputs
    as they are. Empty when nothing is recorded."""
    if not prefill_outputs:
        return {}
    (first,) = prefill_outputs
    once = {name: first[name] for name in ONCE if name in first}
    per_token = {
        name: ForwardRecord(
            prefill=jnp.repeat(first[name], copies, axis=1), steps=step_outputs[name]
        )
        for name in first
        if name not in once
    }
    return {**once, **per_token}
