"""The pytree split of ``GenerationConfig``: active traced fields are leaves, the rest is static.

A traced field (``TRACED_FIELDS``) is a leaf only while ``config.is_active(name)``; every other
field, and ``extra``, lives in the treedef. Unflattening never validates, so tracers pass through
``jit``, ``vmap`` and ``scan`` unchanged.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np

from genjax.config.checks import SPECS
from genjax.config.fields import FIELD_NAMES, TRACED_FIELDS
from genjax.typing import INT32_MAX

_FLOAT_TRACED = frozenset(n for n in TRACED_FIELDS if SPECS[n].kind == "tfloat")


def register(cls: type) -> None:
    """Registers ``cls`` (``GenerationConfig``) as a pytree with keyed leaves."""

    def unflatten(aux: tuple[Any, ...], leaves: Any) -> Any:
        active, static, extra = aux
        config = object.__new__(cls)
        for name, value in zip(_static_names(active), static, strict=True):
            object.__setattr__(config, name, value)
        for name, value in zip(active, leaves, strict=True):
            object.__setattr__(config, name, value)
        object.__setattr__(config, "extra", extra)
        return config

    jax.tree_util.register_pytree_with_keys(
        cls, _flatten_with_keys, unflatten, flatten_func=_flatten
    )


@functools.cache
def _static_names(active: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(name for name in FIELD_NAMES if name not in active)


def _as_leaf(name: str, value: Any) -> Any:
    """A list of token ids -> one int32[E] array; an int in a float field -> a Python float;
    a ``top_k`` past int32 -> int32's largest (``k`` at least the vocabulary keeps every token
    either way)."""
    if isinstance(value, tuple):
        return np.asarray(value, dtype=np.int32)
    if name in _FLOAT_TRACED and isinstance(value, int):
        return float(value)
    if name == "top_k" and isinstance(value, int) and value > INT32_MAX:
        return INT32_MAX
    return value


def _flatten(config: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    active = tuple(name for name in TRACED_FIELDS if config.is_active(name))
    leaves = tuple(_as_leaf(name, getattr(config, name)) for name in active)
    static = tuple(getattr(config, name) for name in _static_names(active))
    return leaves, (active, static, config.extra)


def _flatten_with_keys(config: Any) -> tuple[Any, tuple[Any, ...]]:
    leaves, aux = _flatten(config)
    keyed = tuple(
        (jax.tree_util.GetAttrKey(n), leaf) for n, leaf in zip(aux[0], leaves, strict=True)
    )
    return keyed, aux
