"""The engine's compiled step programs (a decode program per decoded-row bucket and attention
span, a prefill program per lane count, chunk length and span: :class:`EnginePrograms`), shared
between managers.

A manager compiles its step programs ahead of time in ``warmup`` (``jit(...).lower(...)
.compile()``), so serving never compiles. Ahead-of-time programs do not land in ``jax.jit``'s
own cache, so they are kept here, by the jitted step (the model and the static sizes it was
made for, :func:`~genjax.serving.engine.compile_step`) and the signature of its arguments
(tree structure, shapes, dtypes, shardings): a second manager of the same model and sizes, or
one made again, compiles nothing. The oldest of more than :data:`MAX_PROGRAMS` are dropped.

The programs missing are traced one after the other, then compiled on one thread per CPU.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from collections.abc import Callable, Hashable, Mapping
from typing import Any

import jax
import numpy as np

from genjax.models.quantize import library_dots
from genjax.serving.scheduler import Scheduler
from genjax.serving.step import (
    compile_decode,
    compile_prefill,
    decode_input,
    prefill_input,
    with_first,
)

__all__ = ["MAX_PROGRAMS", "EnginePrograms", "compile_buckets"]

MAX_PROGRAMS = 64
"""Compiled step programs kept for reuse."""

_PROGRAMS: dict[tuple, Any] = {}
_LOCK = threading.Lock()


def signature(args: Any) -> tuple:
    """What a compiled program depends on in ``args``: the tree structure (static fields
    included) and each leaf's shape, dtype and sharding."""
    leaves, treedef = jax.tree.flatten(args)
    return treedef, tuple(
        (np.shape(x), str(_dtype(x)), getattr(x, "sharding", None)) for x in leaves
    )


def _dtype(x: Any):
    return x.dtype if hasattr(x, "dtype") else np.result_type(x)


def compile_buckets(
    steps: Mapping[Hashable, Any], arguments: Callable[[Hashable], tuple]
) -> dict[Hashable, Any]:
    """The compiled program of each bucket (the engine's: a decoded-row count and an attention
    span): ``steps[b]`` (a jitted step) for ``arguments(b)``.

    Args:
        steps: bucket -> its jitted step function.
        arguments: bucket -> the arguments the program is called with (only their shapes,
            dtypes and shardings matter).

    Returns:
        bucket -> a compiled program, called with arguments of the same signature.
    """
    compiled, missing, lowered = {}, [], []
    for bucket, step in steps.items():
        args = arguments(bucket)
        key = (step, signature(args))
        with _LOCK:
            found = _PROGRAMS.get(key)
        if found is not None:
            compiled[bucket] = found
            continue
        missing.append((bucket, key))
        lowered.append(step.lower(*args))
    workers = max(1, min(len(lowered), os.cpu_count() or 1))
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        programs = list(pool.map(lambda program: program.compile(), lowered))
    for (bucket, key), program in zip(missing, programs, strict=True):
        compiled[bucket] = program
        with _LOCK:
            _PROGRAMS[key] = program
            while len(_PROGRAMS) > MAX_PROGRAMS:
                _PROGRAMS.pop(next(iter(_PROGRAMS)))
    return compiled


PREFILL = "prefill"
"""Keys a prefill program among the compiled ones as ``(PREFILL, P_k, C_k, M_p)`` (a decode
program's key: ``(B_k, M_s)``)."""


class EnginePrograms:
    """A manager's step programs: a decode program per decoded-row bucket ``B_k`` and span
    ``M_s``, a prefill program per lane count ``P_k``, chunk length ``C_k`` and span ``M_p``
    (:mod:`genjax.serving.step`), compiled by :meth:`compile` and run by :meth:`step`.

    Args:
        model, params: the model and its parameters (int8 params want library dots where
            products have several rows: :func:`~genjax.models.quantize.library_dots`).
        shape: the engine's :class:`~genjax.serving.engine.EngineShape`.
        layout: the mesh's :class:`~genjax.sharding.Layout`, or None on one device.
    """

    def __init__(self, model, params, shape, layout=None):
        self.shape, self.layout = shape, layout
        top, meshed = shape.max_top_logprobs, layout is not None
        self._steps = {
            bucket: compile_decode(
                model, shape.max_steps, top, library_dots(params, bucket, meshed), layout
            )
            for bucket in shape.buckets
        }
        # A chunk has C rows per lane: library dots either way.
        self._steps[PREFILL] = compile_prefill(
            model, top, library_dots(params, shape.chunk, meshed), layout
        )
        self._compiled: dict[Hashable, Any] = {}

    def compile(self, params, state, pool) -> None:
        """Compiles every program for arguments like these (ahead of time: serving then
        compiles nothing; programs compiled before for the same sizes are reused)."""
        shape, plans = self.shape, Scheduler(self.shape)
        work = {(b, m): decode_input(plans._step_input(1, b, m)) for b, m in shape.programs}
        steps = {(b, m): self._steps[b] for b, m in shape.programs}
        for lanes, chunk, span in shape.prefill_programs:
            steps[PREFILL, lanes, chunk, span] = self._steps[PREFILL]
        ended = np.zeros((shape.max_batch_size,), bool)
        if self.layout is not None:
            ended = jax.device_put(ended, self.layout.sharding())

        def arguments(program):
            if program[0] == PREFILL:
                _, lanes, chunk, span = program
                chunked = plans._step_input(1, *shape.programs[0], span, lanes, chunk)
                return params, state, prefill_input(chunked), pool
            return params, state, work[program], ended, pool

        self._compiled = compile_buckets(steps, arguments)

    def step(self, params, state, work, pool):
        """Runs the prefill program of ``work``'s lanes, chunk length and span, then the decode
        program of its bucket and span, on ``state`` (donated); returns ``(state, output)``."""
        lanes, chunk = work.prefill_tokens.shape
        prefill = self._compiled[PREFILL, lanes, chunk, work.prefill_table.shape[1]]
        state, prefilled = prefill(params, state, prefill_input(work), pool)
        decode = self._compiled[work.decode_tables.shape]
        state, output = decode(params, state, decode_input(work), prefilled.ended, pool)
        return state, with_first(output, prefilled)
