"""Device meshes and one table of logical-axis rules for sharding the built-in models.

Every parameter dimension has a logical axis name; a rule maps each name to a mesh axis (or to
None, replicated). The defaults are Megatron-style tensor parallelism on ``model`` and data
parallelism on ``data``:

    logical axis   meaning                          default mesh axis
    batch          rows of a call (B)               data
    heads          query heads, N * H columns       model   (q/k/v column-parallel in)
    kv_heads       key/value heads, K * H columns   model
    mlp            MLP width F                      model   (up column-parallel, down row-parallel)
    embed          model width D                    None
    vocab          vocabulary V                     None    ("model" for vocab-parallel logits)
    positions      learned position table rows      None

Because each sharded weight is split along the axis its matmul contracts or produces, XLA's
partitioner computes attention heads and MLP columns locally and inserts one reduction after the
row-parallel projections.

Static or traced: the mesh and the rules are static (they are part of the compiled program's
shardings); the arrays are traced.

Example:
    >>> mesh = genjax.sharding.make_mesh((2, 4))
    >>> params = genjax.sharding.shard_params(params, mesh)
    >>> out = jax.jit(functools.partial(genjax.generate, model))(params, ids, config)

References:
    Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion Parameter Language Models Using
    Model Parallelism" (column- then row-parallel layers).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from genjax.typing import PyTree

Rules = tuple[tuple[str, str | None], ...]

DEFAULT_RULES: Rules = (
    ("batch", "data"),
    ("heads", "model"),
    ("kv_heads", "model"),
    ("mlp", "model"),
    ("embed", None),
    ("vocab", None),
    ("positions", None),
)

# Parameter path (joined with "/") -> logical axes of the array, first match wins.
_PARAM_AXES: tuple[tuple[str, tuple[str | None, ...]], ...] = (
    # Llama family
    (r"self_attn/q_proj/kernel$", ("embed", "heads")),
    (r"self_attn/q_proj/bias$", ("heads",)),
    (r"self_attn/[kv]_proj/kernel$", ("embed", "kv_heads")),
    (r"self_attn/[kv]_proj/bias$", ("kv_heads",)),
    (r"self_attn/o_proj/kernel$", ("heads", "embed")),
    (r"mlp/(gate|up)_proj/kernel$", ("embed", "mlp")),
    (r"mlp/(gate|up)_proj/bias$", ("mlp",)),
    (r"mlp/down_proj/kernel$", ("mlp", "embed")),
    (r"embed_tokens/embedding$", ("vocab", "embed")),
    (r"lm_head/kernel$", ("embed", "vocab")),
    # GPT-2 (c_attn is one fused [D, 3D] q|k|v matrix: split it on its output columns)
    (r"attn/c_attn/kernel$", ("embed", "heads")),
    (r"attn/c_attn/bias$", ("heads",)),
    (r"attn/c_proj/kernel$", ("heads", "embed")),
    (r"mlp/c_fc/kernel$", ("embed", "mlp")),
    (r"mlp/c_fc/bias$", ("mlp",)),
    (r"mlp/c_proj/kernel$", ("mlp", "embed")),
    (r"wte/embedding$", ("vocab", "embed")),
    (r"wpe/embedding$", ("positions", "embed")),
)


def make_mesh(
    shape: Sequence[int],
    axis_names: Sequence[str] = ("data", "model"),
    devices: Sequence[jax.Device] | None = None,
) -> Mesh:
    """Returns a mesh of ``prod(shape)`` devices with the given axis names.

    Args:
        shape: devices along each axis, e.g. ``(2, 4)`` for 2-way data and 4-way model
            parallelism.
        axis_names: one name per axis.
        devices: the devices to use; defaults to the first ``prod(shape)`` of ``jax.devices()``.

    Example:
        >>> make_mesh((1, 8)).shape
        {'data': 1, 'model': 8}
    """
    shape = tuple(int(s) for s in shape)
    if len(shape) != len(axis_names):
        raise ValueError(
            f"make_mesh got shape {shape} but axis_names {tuple(axis_names)}: give one name per "
            f"axis."
        )
    devices = list(jax.devices() if devices is None else devices)
    count = int(np.prod(shape))
    if count > len(devices):
        raise ValueError(
            f"a mesh of shape {shape} needs {count} devices, but {len(devices)} are available. "
            f"On CPU, set XLA_FLAGS=--xla_force_host_platform_device_count={count} before "
            f"importing jax."
        )
    return Mesh(np.asarray(devices[:count]).reshape(shape), tuple(axis_names))


def _param_name(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def _axes_of(name: str, ndim: int) -> tuple[str | None, ...]:
    for pattern, names in _PARAM_AXES:
        if re.search(pattern, name):
            return names
    return (None,) * ndim


def logical_axes(params: PyTree) -> dict[str, tuple[str | None, ...]]:
    """The logical axes of every parameter of a built-in model, by "/"-joined path.

    Parameters no rule names (norm scales, GPT-2 layer-norm biases...) are replicated.

    Example:
        >>> logical_axes(params)["layers/0/mlp/up_proj/kernel"]
        ('embed', 'mlp')
    """
    leaves = jax.tree_util.tree_leaves_with_path(params)
    return {_param_name(p): _axes_of(_param_name(p), np.ndim(x)) for p, x in leaves}


def partition_spec(
    axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh, rules: Rules = DEFAULT_RULES
) -> PartitionSpec:
    """Maps logical axes to a PartitionSpec, checking each sharded size divides evenly.

    Raises:
        ValueError: a dimension does not divide by its mesh axis; the message names both.
    """
    table = dict(rules)
    spec = []
    for name, size in zip(axes, shape, strict=True):
        mesh_axis = table.get(name) if name is not None else None
        if mesh_axis is not None:
            ways = mesh.shape[mesh_axis]
            if size % ways:
                raise ValueError(
                    f"logical axis {name!r} of size {size} does not divide over mesh axis "
                    f"{mesh_axis!r} of size {ways}. Use a mesh whose {mesh_axis!r} axis divides "
                    f"{size}, or map {name!r} to None in the rules to replicate it."
                )
        spec.append(mesh_axis)
    return PartitionSpec(*spec)


def param_shardings(params: PyTree, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> PyTree:
    """A NamedSharding for every parameter, from its logical axes and ``rules``."""

    def sharding(path, leaf) -> NamedSharding:
        axes = _axes_of(_param_name(path), np.ndim(leaf))
        return NamedSharding(mesh, partition_spec(axes, np.shape(leaf), mesh, rules))

    return jax.tree_util.tree_map_with_path(sharding, params)


def shard_params(params: PyTree, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> PyTree:
    """Places the parameters on the mesh, split as the rules say.

    Example:
        >>> params = shard_params(params, make_mesh((2, 4)))
    """
    return jax.device_put(params, param_shardings(params, mesh, rules))


def batch_sharding(mesh: Mesh, ndim: int = 2, rules: Rules = DEFAULT_RULES) -> NamedSharding:
    """The sharding of a ``[B, ...]`` input (ids, mask): rows on the batch axis."""
    return NamedSharding(mesh, PartitionSpec(dict(rules)["batch"], *([None] * (ndim - 1))))
