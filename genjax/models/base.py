"""The behaviour the built-in models share: input checks, caches, params and HF tensor names."""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from genjax.cache import KVCache
from genjax.errors import InputError
from genjax.typing import Array, PyTree

_LEAF_TO_HF = {"kernel": "weight", "scale": "weight", "embedding": "weight", "bias": "bias"}


class ModelBase:
    """Mixin for a frozen dataclass model with a ``config`` field.

    Subclasses define ``_module()`` (the flax module), ``num_kv_heads``, ``head_dim``,
    ``hf_prefix`` (the state-dict prefix of the base model, e.g. ``"model."``),
    ``_hf_transposed(path)`` and ``_hf_buffers`` (a regex of non-parameter tensors to skip).
    """

    config: Any
    config_class: type = object  # the frozen config dataclass, with a ``from_hf`` constructor
    hf_prefix: str = ""
    _hf_buffers: re.Pattern | None = None

    def _module(self) -> nn.Module:
        raise NotImplementedError

    def _hf_transposed(self, path: tuple[str, ...]) -> bool:
        raise NotImplementedError

    @classmethod
    def from_hf_config(
        cls, config: Mapping[str, Any], dtype: str = "float32", ignore_config_keys=()
    ) -> ModelBase:
        """Builds the model from an HF ``config.json`` dict (see the config class's ``from_hf``)."""
        return cls(cls.config_class.from_hf(config, dtype, ignore_config_keys))

    @property
    def generation_config(self) -> Any:
        """The checkpoint's :class:`~genjax.GenerationConfig` (``generation_config.json``, else
        derived from ``config.json``), or None for a model built without one (``from_config``).

        ``genjax.generate`` starts from it as transformers v5 does: ``config=None`` means this
        config, a given config's unset fields are filled from it. It is not part of the model's
        equality or hash (it changes traced values and host-side planning, never the model's
        structure), so models differing only in it share compiled programs.
        ``dataclasses.replace`` drops it; attach one with :meth:`with_generation_config`.
        """
        return self.__dict__.get("_generation_config")

    def with_generation_config(self, generation_config: Any) -> ModelBase:
        """A copy of the model carrying ``generation_config`` (a ``GenerationConfig`` or None).

        Example:
            >>> tuned = model.with_generation_config(GenerationConfig(max_new_tokens=8))
            ... # doctest: +SKIP
            >>> tuned == model, tuned.generation_config.max_new_tokens  # doctest: +SKIP
            (True, 8)
        """
        model = copy.copy(self)
        object.__setattr__(model, "_generation_config", generation_config)
        return model

    @property
    def max_position_embeddings(self) -> int | None:
        """The context length from config.json; transformers caps generation lengths by it."""
        return self.config.max_position_embeddings

    @property
    def head_dim(self) -> int:
        """``H``."""
        return self.config.head_dim

    @property
    def vocab_size(self) -> int:
        """``V``, the number of logits."""
        return self.config.vocab_size

    @property
    def num_layers(self) -> int:
        """``L``."""
        return self.config.num_layers

    @property
    def dtype(self) -> jnp.dtype:
        """The dtype of activations and parameters."""
        return jnp.dtype(self.config.dtype)

    def init_cache(self, batch: int, max_length: int, dtype: jnp.dtype | None = None) -> KVCache:
        """Returns an empty cache of ``max_length`` slots (static) for ``batch`` rows (static).

        Args:
            batch: ``B``.
            max_length: ``S``, the prompt plus every token to be generated.
            dtype: the key/value dtype; None means the model dtype.

        Example:
            >>> cache = model.init_cache(2, 16)
            >>> cache.keys[0].shape  # [B, K, H, S] per layer
            (2, 2, 64, 16)

        Layers with a sliding window ``W < max_length`` (:attr:`cache_windows`) keep ``W``
        slots, written modulo ``W`` (:mod:`genjax.cache.ring`); ``cache.length`` is still
        ``max_length``.
        """
        return KVCache.create(
            num_layers=self.num_layers,
            batch=batch,
            length=max_length,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=self.dtype if dtype is None else jnp.dtype(dtype),
            windows=self.cache_windows,
        )

    @property
    def cache_windows(self) -> tuple[int | None, ...]:
        """Per layer the sliding window its cache layer may keep as a ring (static); empty:
        none. See :mod:`genjax.cache.ring`."""
        return ()

    def apply(
        self,
        params: PyTree,
        tokens: Array,
        positions: Array,
        cache: KVCache,
        attention_mask: Array,
        logits_to_keep: int = 0,
        *,
        output_hidden_states: bool = False,
        output_attentions: bool = False,
    ) -> tuple[Array, KVCache] | tuple[Array, KVCache, dict[str, Array]]:
        """Runs ``T`` tokens written at ``cache.index``; pure, jittable with the model static.

        Args:
            params: the parameter tree (see the module docstring).
            tokens: int32[B, T].
            positions: int32[B, T] position ids (``cumsum(mask) - 1`` for real tokens).
            cache: the cache; the tokens go to slots ``index .. index + T - 1``.
            attention_mask: int or bool[B, S] over all cache slots, nonzero where a slot holds a
                real token (slots at and after ``index + T`` may hold anything).
            logits_to_keep: static; 0 computes the logits of all ``T`` positions, ``k > 0`` only
                of the last ``k`` (as transformers' ``logits_to_keep``: a prefill needs one).
                Or, as transformers' tensor form, int32[k] positions (traced) whose logits
                to compute: the serving engine keeps a prompt chunk's last real token's.
            output_hidden_states: static; also return every layer's hidden states.
            output_attentions: static; also return every layer's attention weights. With both
                False the program is the one without these arguments.

        Returns:
            ``(logits, cache)``: float32[B, T or k, V] and the cache with ``index`` advanced by
            ``T``. With an ``output_*`` flag, ``(logits, cache, outputs)``: ``outputs`` is a
            dict with ``"hidden_states"`` dtype[L+1, B, T, D] (the embeddings, the output of
            each layer but the last, then the last layer's after the final norm, as
            transformers orders them) and ``"attentions"`` dtype[L, B, N, T, S] (the softmax
            weights of each layer over the cache's ``S`` slots, in the model dtype), each when
            asked for.

        Example:
            >>> cache = model.init_cache(1, 4)
            >>> pos = jnp.arange(3)[None]  # int32[B, T]: the prompt "def f():"
            >>> logits, cache = jax.jit(model.apply)(params, ids[:1], pos, cache, jnp.ones((1, 4)))
            >>> logits.shape, int(cache.index)
            ((1, 3, 4096), 3)
        """
        _check_inputs(tokens, positions, cache, attention_mask)
        _check_logits_to_keep(logits_to_keep)
        flags = {}
        if output_hidden_states or output_attentions:  # else the module's defaults
            flags = dict(
                output_hidden_states=output_hidden_states, output_attentions=output_attentions
            )
        return self._module().apply(
            {"params": params}, tokens, positions, cache, attention_mask, logits_to_keep, **flags
        )

    def param_shapes(self) -> PyTree:
        """Returns the parameter tree as ``jax.ShapeDtypeStruct`` leaves (nothing allocated)."""
        return jax.eval_shape(self.init_params, jax.random.key(0))

    def init_params(self, key: Array) -> PyTree:
        """Returns randomly initialised parameters (flax initialisers), for tests and benchmarks."""
        tokens = jnp.zeros((1, 1), jnp.int32)
        cache = self.init_cache(1, 1)
        mask = jnp.ones((1, 1), jnp.int32)
        return jax.jit(self._module().init)(key, tokens, tokens, cache, mask)["params"]

    def hf_tensor_name(self, path: tuple[str, ...]) -> tuple[str, bool]:
        """Maps a parameter path to its HF state-dict name (prefix stripped) and transpose flag.

        Example:
            >>> model.hf_tensor_name(("layers", "0", "mlp", "up_proj", "kernel"))
            ('layers.0.mlp.up_proj.weight', False)
        """
        name = ".".join((*path[:-1], _LEAF_TO_HF[path[-1]]))
        return name, self._hf_transposed(path)

    def is_hf_buffer(self, name: str) -> bool:
        """True for checkpoint tensors that are buffers, not parameters (skipped at load)."""
        return self._hf_buffers is not None and self._hf_buffers.search(name) is not None


def _check_inputs(tokens: Array, positions: Array, cache: KVCache, attention_mask: Array) -> None:
    if tokens.ndim != 2:
        raise InputError(f"tokens must be int[B, T], got shape {tokens.shape}.")
    if positions.shape != tokens.shape:
        raise InputError(
            f"positions must match tokens {tokens.shape}, got shape {positions.shape}; pass "
            "cumsum(attention_mask) - 1 for the written slots."
        )
    batch, length = tokens.shape
    if length > cache.length:
        raise InputError(f"{length} tokens do not fit a cache of {cache.length} slots.")
    if attention_mask.shape != (batch, cache.length):
        raise InputError(
            f"attention_mask must be [B, S] = {(batch, cache.length)} (every cache slot), got "
            f"shape {attention_mask.shape}."
        )
    if cache.batch != batch:
        raise InputError(f"the cache holds {cache.batch} rows, but tokens have {batch}.")
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise InputError(f"tokens must be integers, got dtype {tokens.dtype}.")


def _check_logits_to_keep(logits_to_keep) -> None:
    """Raises InputError unless ``logits_to_keep`` is an int >= 0 or a 1-D integer array."""
    if isinstance(logits_to_keep, int) and not isinstance(logits_to_keep, bool):
        if logits_to_keep >= 0:
            return
    else:
        dtype = getattr(logits_to_keep, "dtype", None)
        if (
            dtype is not None
            and jnp.ndim(logits_to_keep) == 1
            and jnp.issubdtype(dtype, jnp.integer)
        ):
            return
    raise InputError(
        f"logits_to_keep must be an int >= 0 (0: every position) or a 1-D integer array of "
        f"positions, got {logits_to_keep!r}."
    )
