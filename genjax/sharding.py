"""Device meshes, one table of logical-axis rules, and the shardings of a whole generate call.

Every parameter dimension has a logical axis name; a rule maps each name to a mesh axis (or to
None, replicated). The defaults are Megatron-style tensor parallelism on ``model`` and data
parallelism on ``data``:

    logical axis   meaning                          default mesh axis
    batch          rows of a call (B)               data
    heads          query heads, N * H features      model   (q/k/v column-parallel in)
    kv_heads       key/value heads, K * H features  model
    mlp            MLP width F                      model   (up column-parallel, down row-parallel)
    embed          model width D                    None
    vocab          vocabulary V                     None    ("model" for vocab-parallel logits)
    positions      learned position table rows      None

Because each sharded weight is split along the axis its matmul contracts or produces, XLA's
partitioner computes attention heads and MLP columns locally and inserts one reduction after the
row-parallel projections; no weight matrix is ever gathered whole (``tests/test_sharding.py``
checks the compiled program for it). A rule naming an axis the mesh lacks replicates that
logical axis, so a ``("data",)`` mesh gives pure data parallelism. Int8 params
(:mod:`genjax.quantize`) keep their kernel's axes; a ``kernel_scale`` [out] follows the axis of
the kernel's rows (kernels are [out, in]) and an ``embedding_scale`` [V] the table's rows.

The state of a generate call follows the same rules (:class:`Layout`): every ``[B, ...]`` array
of the loop carry (token buffer, positions, mask, finished flags, recorded scores, beam scores
and hypotheses) has its rows on ``batch``; each layer's KV cache (keys ``[B, K, H, S]``, values
``[B, K, S, H]``) has ``B`` on ``batch`` and ``K`` on ``kv_heads``; scalars (the slot counter,
the PRNG key) are replicated. An encoder-decoder model (T5, BART, mBART, Marian) follows the same
rules: its params by the T5 and BART names in the table below (``q``/``k``/``v``/``q_proj``...
and ``wi``/``fc1`` column-parallel, ``o``/``out_proj`` and ``wo``/``fc2`` row-parallel, T5's
relative position bias ``[buckets, N]`` on its heads), its source rows on ``batch``, and its
cache's cross-attention keys ``[B / R, K, H, Se]`` and values ``[B / R, K, Se, H]`` (one entry per
prompt, beside the decoder's slots) like a KV cache; a BART encoder head count that does not
divide over ``model`` raises as the decoder's does.

Five ways to run sharded, all giving the single-device tokens:

1. ``genjax.generate(model, params, ids, config, mesh=mesh)``: params not yet on ``mesh`` are
   placed with :func:`shard_params`, ``input_ids``/``attention_mask`` with their rows on
   ``data``; the compiled program constrains its inputs, the while-loop carry after every step,
   and its outputs (which come back with their rows on ``data``).
2. Your own ``jax.jit`` (``pjit`` is ``jax.jit`` with ``in_shardings``/``out_shardings``)
   under ``with jax.set_mesh(mesh):``: ``generate`` reads the mesh in effect and constrains the
   loop carry the same way; your ``in_shardings`` (or the shardings of the arrays you pass)
   place params and inputs, e.g. ``in_shardings=(param_shardings(params, mesh),
   batch_sharding(mesh), batch_sharding(mesh))`` for ``(params, ids, mask)``.
3. Inside your own ``jax.shard_map``: call ``generate`` on each block with no ``mesh=``, e.g.
   ``jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P(), P("data"), P("data")),
   out_specs=P("data")))`` with ``f(params, ids, mask)`` returning
   ``generate(model, params, ids, config, attention_mask=mask).sequences``. Each device then
   runs the whole generate on its rows with the params it is given (here replicated). Axes the
   map makes manual are left alone; axes it leaves automatic (``axis_names={"data"}`` on a
   ``(data, model)`` mesh) are constrained by the rules as in 2, so ``model`` can still split
   the KV cache. Inside the map the ids are tracers, so prompts are not padded to a bucket
   (each prompt length compiles its program) and the key is the same on every block, so blocks
   holding the same prompts sample the same tokens: fold the block index in
   (``jax.random.fold_in(key, jax.lax.axis_index("data"))``) for independent draws (block ``i``
   then draws what a single-device call on its rows with ``fold_in(key, i)`` draws). Passing
   ``mesh=`` inside the map raises :class:`~genjax.errors.ShardingError`.
   (``tests/test_shard_map.py``.)
4. ``jax.pmap`` data parallelism for users of the older API is
   :func:`genjax.generation.pmap_generate`, in the generation layer above this module.
5. Multi-host (``jax.distributed``): every process runs the same script, builds the same global
   mesh over ``jax.devices()`` (all processes' devices) and calls ``generate(..., mesh=mesh)``
   with the same checkpoint, prompts, config and key. Params and prompts may be host arrays
   (each process places its own devices' blocks) or global arrays made with
   ``jax.make_array_from_callback``; outputs are global arrays whose rows each process holds in
   part: gather them with ``jax.experimental.multihost_utils.process_allgather``. Only the
   process' own shards of ``input_ids`` are checked against the vocabulary.
   (``examples/multihost.py``, ``tests/test_multihost.py``: two CPU processes with gloo.)

Uneven sizes: a batch that does not divide over ``data``, or query heads that do not divide over
``model``, raise :class:`~genjax.errors.ShardingError` naming the sizes and the fix. Key/value
heads that do not divide over ``model`` (``K < model`` in GQA, e.g. 2 KV heads on 8 devices) fall
back explicitly: the k/v projections and the KV cache are replicated on ``model`` (each device
holds all ``K`` heads; query heads stay split), which :func:`layout_for` records in its rules.
(:func:`shard_params` alone applies the rules as given: it only checks that column counts divide.)

Known limits: GPT-2's fused ``c_attn`` ``[D, 3D]`` is split on its ``3D`` output columns, which do
not align with heads, so XLA moves the q/k/v activations (never the weight) between devices once
per layer. XLA does not split ``lax.top_k`` over rows, so beam search's choice of continuations
and the ``top_k``/``top_p`` processors' partial sort gather their ``[rows, V]`` (beam search:
``[B, M*V]``) scores over ``data`` once per step.

Static or traced: the mesh, the rules and the :class:`Layout` are static (part of the compiled
program's shardings: a new mesh compiles a new program); the arrays are traced.

Example:
    >>> mesh = genjax.sharding.make_mesh((2, 4))
    >>> out = genjax.generate(model, params, ids, config, attention_mask=mask, mesh=mesh)
    >>> out.sequences.sharding.spec
    P('data',)

References:
    Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion Parameter Language Models Using
    Model Parallelism" (column- then row-parallel layers).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from genjax.cache import EncoderDecoderCache, KVCache
from genjax.cache.quantized import QuantizedKVCache
from genjax.errors import ShardingError, UnsupportedError
from genjax.typing import Array, PyTree

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

CACHE_AXES: tuple[str | None, ...] = ("batch", "kv_heads", None, None)
"""Logical axes of each layer's KV-cache keys float[B, K, H, S] and values float[B, K, S, H]
(the last two axes are not sharded, so one spec serves both)."""

# Parameter path (joined with "/") -> logical axes of the array, first match wins.
_PARAM_AXES: tuple[tuple[str, tuple[str | None, ...]], ...] = (
    # Llama family
    (r"self_attn/q_proj/kernel$", ("heads", "embed")),
    (r"self_attn/q_proj/bias$", ("heads",)),
    (r"self_attn/[kv]_proj/kernel$", ("kv_heads", "embed")),
    (r"self_attn/[kv]_proj/bias$", ("kv_heads",)),
    (r"self_attn/o_proj/kernel$", ("embed", "heads")),
    (r"mlp/(gate|up)_proj/kernel$", ("mlp", "embed")),
    (r"mlp/(gate|up)_proj/bias$", ("mlp",)),
    (r"mlp/down_proj/kernel$", ("embed", "mlp")),
    (r"embed_tokens/embedding$", ("vocab", "embed")),
    (r"lm_head/kernel$", ("vocab", "embed")),
    # GPT-2 (c_attn is one fused [3D, D] q|k|v matrix: split it on its output rows)
    (r"attn/c_attn/kernel$", ("heads", "embed")),
    (r"attn/c_attn/bias$", ("heads",)),
    (r"attn/c_proj/kernel$", ("embed", "heads")),
    (r"mlp/c_fc/kernel$", ("mlp", "embed")),
    (r"mlp/c_fc/bias$", ("mlp",)),
    (r"mlp/c_proj/kernel$", ("embed", "mlp")),
    (r"wte/embedding$", ("vocab", "embed")),
    (r"wpe/embedding$", ("positions", "embed")),
    # T5 (SelfAttention and EncDecAttention: q/k/v [N*H, D], o [D, N*H]; wi/wi_0/wi_1 [F, D],
    # wo [D, F]; the relative position bias [buckets, N] split on its heads)
    (r"Attention/q/kernel$", ("heads", "embed")),
    (r"Attention/[kv]/kernel$", ("kv_heads", "embed")),
    (r"Attention/o/kernel$", ("embed", "heads")),
    (r"relative_attention_bias/embedding$", (None, "heads")),
    (r"DenseReluDense/wi(_[01])?/kernel$", ("mlp", "embed")),
    (r"DenseReluDense/wo/kernel$", ("embed", "mlp")),
    (r"shared/embedding$", ("vocab", "embed")),
    # BART, mBART, Marian (self_attn and encoder_attn; q/k/v_proj are matched above for
    # self_attn; fc1 [F, D], fc2 [D, F])
    (r"encoder_attn/q_proj/kernel$", ("heads", "embed")),
    (r"encoder_attn/q_proj/bias$", ("heads",)),
    (r"encoder_attn/[kv]_proj/kernel$", ("kv_heads", "embed")),
    (r"encoder_attn/[kv]_proj/bias$", ("kv_heads",)),
    (r"_attn/out_proj/kernel$", ("embed", "heads")),
    (r"/fc1/kernel$", ("mlp", "embed")),
    (r"/fc1/bias$", ("mlp",)),
    (r"/fc2/kernel$", ("embed", "mlp")),
    (r"embed_positions/embedding$", ("positions", "embed")),
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
        >>> dict(make_mesh((1, 8)).shape)
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
    # int8 params (genjax.quantize): a kernel's float32[out] scales shard like its output axis,
    # an embedding table's float32[V] row scales like its rows; both are the matrix's first axis.
    if name.endswith(("/kernel_scale", "/embedding_scale")):
        return _axes_of(name[: -len("_scale")], 2)[:1]
    for pattern, names in _PARAM_AXES:
        if re.search(pattern, name):
            return names
    return (None,) * ndim


def logical_axes(params: PyTree) -> dict[str, tuple[str | None, ...]]:
    """The logical axes of every parameter of a built-in model, by "/"-joined path.

    Parameters no rule names (norm scales, GPT-2 layer-norm biases...) are replicated.

    Example:
        >>> logical_axes(params)["layers/0/mlp/up_proj/kernel"]
        ('mlp', 'embed')
    """
    leaves = jax.tree_util.tree_leaves_with_path(params)
    return {_param_name(p): _axes_of(_param_name(p), np.ndim(x)) for p, x in leaves}


def _as_rules(rules: Rules | Mapping[str, str | None] | None) -> Rules:
    """Rules as a hashable tuple of (logical axis, mesh axis) pairs; None means the defaults."""
    if rules is None:
        return DEFAULT_RULES
    if isinstance(rules, Mapping):
        pairs = tuple(rules.items())
    elif isinstance(rules, Iterable) and not isinstance(rules, str):
        pairs = tuple(tuple(p) if isinstance(p, list) else p for p in rules)
    else:
        pairs = None
    if pairs is None or not all(_is_rule(p) for p in pairs):
        raise TypeError(
            f"rules must be a dict or a sequence of (logical axis, mesh axis or None) pairs, "
            f"like genjax.sharding.DEFAULT_RULES; got {rules!r}."
        )
    return pairs


def _is_rule(pair) -> bool:
    """Whether ``pair`` is ``(logical axis name, mesh axis name or None)``."""
    if not isinstance(pair, tuple) or len(pair) != 2:
        return False
    return isinstance(pair[0], str) and (pair[1] is None or isinstance(pair[1], str))


def _mesh_axis(name: str | None, mesh: Mesh | AbstractMesh, rules: Rules) -> str | None:
    """The mesh axis a logical axis maps to; None when unmapped, absent from the mesh, or manual
    (inside ``shard_map`` or ``pmap`` over that axis, where arrays are already per device)."""
    axis = dict(rules).get(name) if name is not None else None
    usable = axis in mesh.shape and axis not in getattr(mesh, "manual_axes", ())
    return axis if usable else None


def partition_spec(
    axes: Sequence[str | None],
    shape: Sequence[int],
    mesh: Mesh | AbstractMesh,
    rules: Rules = DEFAULT_RULES,
) -> PartitionSpec:
    """Maps logical axes to a PartitionSpec, checking each sharded size divides evenly.

    Raises:
        ShardingError: a dimension does not divide by its mesh axis; the message names both.
    """
    spec = []
    for name, size in zip(axes, shape, strict=True):
        mesh_axis = _mesh_axis(name, mesh, rules)
        if mesh_axis is not None:
            ways = mesh.shape[mesh_axis]
            if size % ways:
                raise ShardingError(
                    f"logical axis {name!r} of size {size} does not divide over mesh axis "
                    f"{mesh_axis!r} of size {ways}. Use a mesh whose {mesh_axis!r} axis divides "
                    f"{size}, or map {name!r} to None in the rules to replicate it."
                )
        spec.append(mesh_axis)
    return PartitionSpec(*spec)


def param_shardings(params: PyTree, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> PyTree:
    """A NamedSharding for every parameter, from its logical axes and ``rules``.

    Raises:
        UnsupportedError: 4-bit params on a mesh of several devices.
    """
    check_no_four_bit(params, mesh)

    def sharding(path, leaf) -> NamedSharding:
        axes = _axes_of(_param_name(path), np.ndim(leaf))
        return NamedSharding(mesh, partition_spec(axes, np.shape(leaf), mesh, rules))

    return jax.tree_util.tree_map_with_path(sharding, params)


def check_no_four_bit(params: PyTree, mesh: Mesh | AbstractMesh) -> None:
    """Raises UnsupportedError when ``params`` hold 4-bit kernels (``kernel_q4``) and ``mesh``
    has several devices: their products are a single-device CPU kernel
    (:mod:`genjax.kernels.q4`) that XLA cannot split, so a mesh would replicate every product."""
    if mesh.size <= 1:
        return
    names = [_param_name(path) for path, _ in jax.tree_util.tree_leaves_with_path(params)]
    four_bit = [name for name in names if name.endswith("/kernel_q4")]
    if four_bit:
        raise UnsupportedError(
            f"4-bit params ({four_bit[0]} and {len(four_bit) - 1} more) run on one device; a "
            f"mesh of {mesh.size} devices cannot split their products. Use float or int8 params "
            "(quantize='int8') on a mesh."
        )


def shard_params(params: PyTree, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> PyTree:
    """Places the parameters on the mesh, split as the rules say.

    Example:
        >>> params = shard_params(params, make_mesh((2, 4)))
        >>> params["layers"]["0"]["mlp"]["up_proj"]["kernel"].sharding.spec
        P('model', None)
    """
    return jax.device_put(params, param_shardings(params, mesh, _as_rules(rules)))


def batch_sharding(mesh: Mesh, ndim: int = 2, rules: Rules = DEFAULT_RULES) -> NamedSharding:
    """The sharding of a ``[B, ...]`` input (ids, mask): rows on the batch axis."""
    return NamedSharding(
        mesh, PartitionSpec(_mesh_axis("batch", mesh, rules), *[None] * (ndim - 1))
    )


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where the arrays of one generate call live on a mesh; static and hashable.

    Built by :func:`layout_for`, which checks the model against the mesh. ``generate`` passes it
    to the decoding loops as their ``constrain`` hook, so the while-loop carry keeps its
    shardings from one step to the next.

    Attributes:
        mesh: a concrete ``Mesh``, or the ``AbstractMesh`` in effect inside a user's
            ``jax.jit`` under ``jax.set_mesh`` (then only constraints are applied, nothing is
            placed).
        rules: the logical-axis rules in effect, after the fallbacks of :func:`layout_for`.

    Example:
        >>> layout = layout_for(model, make_mesh((2, 4)))
        >>> layout.cache_spec  # 2 kv heads do not divide over 'model': replicated
        P('data', None, None, None)
    """

    mesh: Mesh | AbstractMesh
    rules: Rules = DEFAULT_RULES

    def spec(self, *axes: str | None) -> PartitionSpec:
        """The PartitionSpec of an array with these logical axes (no divisibility check)."""
        return PartitionSpec(*(_mesh_axis(name, self.mesh, self.rules) for name in axes))

    def sharding(self, *axes: str | None) -> NamedSharding:
        """The NamedSharding of an array with these logical axes."""
        return NamedSharding(self.mesh, self.spec(*axes))

    def ways(self, name: str) -> int:
        """How many devices split the logical axis ``name`` (1 when replicated)."""
        axis = _mesh_axis(name, self.mesh, self.rules)
        return 1 if axis is None else int(self.mesh.shape[axis])

    @property
    def cache_spec(self) -> PartitionSpec:
        """The spec of each layer's cache keys [B, K, H, S] and values [B, K, S, H]."""
        return self.spec(*CACHE_AXES)

    def constrain(self, tree: PyTree, rows_at: int = 0) -> PyTree:
        """Constrains a state or output pytree: rows on ``batch``, caches by :data:`CACHE_AXES`.

        Every array leaf of rank > ``rows_at`` has its axis ``rows_at`` (its rows: the leading
        axis unless said otherwise, e.g. 1 for recorded hidden states ``[L + 1, B, T, D]``) on
        ``batch`` and its other axes replicated; other leaves (counters, the PRNG key) are
        replicated; a :class:`KVCache` follows
        :data:`CACHE_AXES` (a :class:`~genjax.cache.quantized.QuantizedKVCache` too, its scales
        ``[B, K, S]`` likewise), and so do an :class:`~genjax.cache.EncoderDecoderCache`'s
        decoder slots and its per-prompt cross-attention keys ``[B / R, K, H, Se]`` and values
        ``[B / R, K, Se, H]`` (its encoder mask has its rows on ``batch``). Works inside
        ``jax.jit`` (``with_sharding_constraint``).

        Args:
            tree: e.g. a :class:`~genjax.decoding.sampling.DecodeState`, a
                :class:`~genjax.decoding.beam.BeamState` or a :class:`~genjax.GenerateOutput`.
            rows_at: the rows' axis of the array leaves that are not caches (static).
        """
        rows, replicated = self.sharding(*[None] * rows_at, "batch"), self.sharding()

        def one(x):
            if isinstance(x, (KVCache, QuantizedKVCache)):
                cache = self.sharding(*CACHE_AXES)
                x = x.replace(
                    keys=jax.lax.with_sharding_constraint(x.keys, cache),
                    values=jax.lax.with_sharding_constraint(x.values, cache),
                    index=jax.lax.with_sharding_constraint(x.index, replicated),
                )
                if isinstance(x, QuantizedKVCache):  # scales [B, K, S]: as keys, less H
                    scales = self.sharding(*CACHE_AXES[:-1])
                    x = x.replace(
                        key_scales=jax.lax.with_sharding_constraint(x.key_scales, scales),
                        value_scales=jax.lax.with_sharding_constraint(x.value_scales, scales),
                    )
                return x
            if isinstance(x, EncoderDecoderCache):  # cross blocks [B / R, K, H, Se] as keys
                cross = self.sharding(*CACHE_AXES)
                return x.replace(
                    self_attention=one(x.self_attention),
                    cross_keys=jax.lax.with_sharding_constraint(x.cross_keys, cross),
                    cross_values=jax.lax.with_sharding_constraint(x.cross_values, cross),
                    encoder_mask=jax.lax.with_sharding_constraint(
                        x.encoder_mask, self.sharding("batch")
                    ),
                )
            return jax.lax.with_sharding_constraint(x, rows if np.ndim(x) > rows_at else replicated)

        caches = (KVCache, QuantizedKVCache, EncoderDecoderCache)
        return jax.tree_util.tree_map(one, tree, is_leaf=lambda x: isinstance(x, caches))

    def place_params(self, params: PyTree) -> PyTree:
        """Returns ``params`` unchanged when every leaf already lives on this mesh (any split),
        else :func:`shard_params` by the rules. Tracers are returned unchanged.

        Raises:
            UnsupportedError: 4-bit params (:func:`check_no_four_bit`).
        """
        check_no_four_bit(params, self.mesh)
        leaves = jax.tree_util.tree_leaves(params)
        if any(isinstance(x, jax.core.Tracer) for x in leaves) or all(
            isinstance(getattr(x, "sharding", None), NamedSharding) and x.sharding.mesh == self.mesh
            for x in leaves
        ):
            return params
        return shard_params(params, self.mesh, self.rules)

    def place_rows(self, *arrays: Array) -> tuple[Array, ...]:
        """Puts concrete ``[B, ...]`` arrays on the mesh with their rows on ``batch``."""
        return tuple(
            x
            if x is None or isinstance(x, jax.core.Tracer)
            else jax.device_put(x, self.sharding("batch"))
            for x in arrays
        )


def layout_for(
    model,
    mesh: Mesh | AbstractMesh,
    rules: Rules | Mapping[str, str | None] | None = None,
    batch: int | None = None,
) -> Layout:
    """Checks a model (and batch) against a mesh and returns the :class:`Layout` to run it with.

    Args:
        model: a model; its ``config.num_heads`` (``N``), ``num_kv_heads`` (``K``) and (BART,
            mBART, Marian) ``config.encoder_heads`` are checked when it has them (the built-in
            models do).
        mesh: the mesh (static).
        rules: logical-axis rules (a dict or pairs; static); None means :data:`DEFAULT_RULES`.
        batch: the number of prompt rows ``B`` to check against the ``batch`` axis, if known.

    Returns:
        The layout. When ``K`` does not divide over the ``kv_heads`` axis (GQA with fewer KV
        heads than devices), its rules map ``kv_heads`` to None: k/v projections and the cache
        are replicated on that axis while query heads stay split.

    Raises:
        ShardingError: ``N`` or ``B`` does not divide over its mesh axis, naming both sizes and
            the fix.

    Example:
        >>> layout = layout_for(model, make_mesh((2, 4)), batch=8)
    """
    rules = _as_rules(rules)
    layout = Layout(mesh, rules)
    heads = getattr(getattr(model, "config", None), "num_heads", None)
    encoder_heads = getattr(getattr(model, "config", None), "encoder_heads", None)  # BART's
    kv_heads = getattr(model, "num_kv_heads", None)
    checks = (
        ("batch", batch, "rows"),
        ("heads", heads, "attention heads"),
        ("heads", encoder_heads, "encoder attention heads"),
    )
    for name, size, what in checks:
        ways = layout.ways(name)
        if size is not None and size % ways:
            axis = _mesh_axis(name, mesh, rules)
            fits = [d for d in range(1, size + 1) if size % d == 0]
            fix = (
                f"pad the batch to a multiple of {ways} rows (and drop the extra outputs)"
                if name == "batch"
                else f"use a mesh whose {axis!r} axis is one of {fits}"
            )
            raise ShardingError(
                f"{size} {what} do not divide over mesh axis {axis!r} of size {ways} (logical "
                f"axis {name!r}). Either {fix}, or pass rules mapping {name!r} to None to "
                f"replicate it."
            )
    if kv_heads is not None and kv_heads % layout.ways("kv_heads"):
        table = dict(rules)
        table["kv_heads"] = None
        layout = Layout(mesh, tuple(table.items()))
    return layout


def context_layout(
    model,
    rules: Rules | Mapping[str, str | None] | None = None,
    batch: int | None = None,
) -> Layout | None:
    """The layout of the mesh set by ``jax.set_mesh`` (checked as :func:`layout_for`), or None.

    None as well when no rule maps to an axis of that mesh that is not manual: inside
    ``shard_map`` or ``pmap`` every array is already one device's block, so nothing is
    constrained.

    Example:
        >>> with jax.set_mesh(make_mesh((2, 4))):
        ...     dict(context_layout(model).mesh.shape)
        {'data': 2, 'model': 4}
    """
    mesh = jax.sharding.get_abstract_mesh()
    rules = _as_rules(rules)
    if mesh.empty or all(_mesh_axis(name, mesh, rules) is None for name, _ in rules):
        return None
    return layout_for(model, mesh, rules, batch)
