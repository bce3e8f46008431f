"""The engine's compiled step programs, one per decoded-row bucket and attention span, shared
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

__all__ = ["MAX_PROGRAMS", "compile_buckets"]

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
