"""Checks and preparation of ``generate``'s arguments, on the host, before anything is traced.

Every check names the argument, the value received, what is allowed and how to fix it. Arrays
are prepared with numpy when they are concrete, so a new prompt shape compiles nothing.
"""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from genjax.config import GenerationConfig
from genjax.config.fields import FIELD_NAMES, METADATA_FIELDS
from genjax.errors import InputError, ShardingError, UnsupportedError
from genjax.sharding import Layout, context_layout, layout_for
from genjax.stopping import stop_string_table
from genjax.typing import Array


def effective_config(
    config: GenerationConfig | None, overrides: dict, default: GenerationConfig | None = None
) -> GenerationConfig:
    """The call's config before the library defaults, merged as transformers v5's
    ``_prepare_generation_config`` merges it.

    ``config`` (None: ``GenerationConfig()``) keeps its set fields; its unset (None) fields and
    the custom keys it lacks come from ``default``, the model's ``generation_config``; then
    ``overrides`` (``generate``'s ``**config_overrides``) are put on top. So ``do_sample=False``
    given by the caller wins over a checkpoint's ``do_sample: true``, while the checkpoint's
    ``repetition_penalty`` and EOS ids still apply.
    """
    if config is None:
        config = GenerationConfig()
    elif not isinstance(config, GenerationConfig):
        raise TypeError(
            f"generate() expects `config` to be a genjax.GenerationConfig or None, got "
            f"{type(config).__name__}. Build one with GenerationConfig(...) or "
            f"GenerationConfig.from_pretrained(path)."
        )
    if default is not None:
        filled = _filled(default)
        config, _ = config.updated(defaults_only=True, allow_custom_entries=True, **filled)
    return _override(config, overrides)


@dataclasses.dataclass(frozen=True)
class Lengths:
    """The length settings of a call before the library default (``max_length=20``), for
    transformers' length rules (:func:`num_new_tokens`)."""

    max_length: int | None
    max_new_tokens: int | None


def resolve_config(config, overrides: dict, default=None) -> tuple[Lengths, GenerationConfig]:
    """``(lengths, resolved)``: the call's config in transformers v5's order: the caller's
    ``config``, its unset fields from the model's ``default``, then the library defaults
    (``with_defaults``), then ``overrides`` on top. As in transformers, an override of None
    stays None (``top_k=None`` turns top-k off), and the "ignored flag" warnings count only
    what each step set (``do_sample=False`` as an override silences the checkpoint's
    ``temperature``)."""
    base = effective_config(config, {}, default)
    resolved = _override(base.with_defaults(), overrides)
    lengths = Lengths(
        overrides.get("max_length", base.max_length),
        overrides.get("max_new_tokens", base.max_new_tokens),
    )
    return lengths, resolved


def _override(config: GenerationConfig, overrides: dict) -> GenerationConfig:
    if not overrides:
        return config
    config, unused = config.updated(**overrides)
    if unused:
        raise TypeError(
            f"generate() got unexpected keyword arguments {sorted(unused)}: they are not "
            f"GenerationConfig fields. Check their spelling against GenerationConfig."
        )
    return config


def _filled(config: GenerationConfig) -> dict:
    """The set fields and custom keys of ``config`` (its values as they are, arrays kept)."""
    values = {name: getattr(config, name) for name in FIELD_NAMES if name not in METADATA_FIELDS}
    values = {k: v for k, v in values.items() if v is not None}
    return {**values, **dict(config.extra)}


def check_inputs(model, input_ids, attention_mask, key, config):
    """Validates the arrays at the Python boundary (values only when they are concrete)."""
    if not hasattr(input_ids, "shape"):
        input_ids = np.asarray(input_ids)
    if input_ids.ndim != 2 or not jnp.issubdtype(input_ids.dtype, jnp.integer):
        raise InputError(
            f"`input_ids` must be an integer array of shape [batch, prompt_length]; got dtype "
            f"{input_ids.dtype} and shape {tuple(input_ids.shape)}. For one prompt use "
            f"ids[None, :]."
        )
    if input_ids.shape[1] == 0 or input_ids.shape[0] == 0:
        raise InputError(
            f"`input_ids` must hold at least one prompt of at least one token; got shape "
            f"{tuple(input_ids.shape)}."
        )
    check_in_vocabulary("input_ids", input_ids, model.vocab_size)
    if attention_mask is not None:
        if not hasattr(attention_mask, "shape"):
            attention_mask = np.asarray(attention_mask)
        if tuple(attention_mask.shape) != tuple(input_ids.shape):
            raise InputError(
                f"`attention_mask` must have the shape of `input_ids` {tuple(input_ids.shape)}; "
                f"got {tuple(attention_mask.shape)}."
            )
    check_padding(model, input_ids, attention_mask, config)
    if config.do_sample and key is None:
        raise InputError(
            "sampling (do_sample=True) needs an explicit PRNG key: pass key=jax.random.key(seed)."
        )
    if key is not None and not (
        isinstance(key, jax.Array) and jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
    ):
        if isinstance(key, jax.Array) and key.shape == (2,) and key.dtype == jnp.uint32:
            key = jax.random.wrap_key_data(key)
        else:
            raise InputError(
                f"`key` must be a single PRNG key from jax.random.key(seed); got "
                f"{type(key).__name__} {getattr(key, 'shape', '')}."
            )
    if key is not None and key.shape != ():
        raise InputError(f"`key` must be a single key of shape (); got shape {key.shape}.")
    return input_ids, attention_mask, key


def check_in_vocabulary(name: str, ids, vocab_size: int) -> None:
    """Raises InputError naming ``name`` when concrete ``ids`` hold an id outside
    ``[0, vocab_size)``; traced ids pass (their values cannot be read)."""
    if isinstance(ids, jax.core.Tracer):
        return
    values = local_values(ids)
    low, high = int(values.min()), int(values.max())
    if low < 0 or high >= vocab_size:
        raise InputError(
            f"`{name}` holds ids in [{low}, {high}], outside the model's vocabulary "
            f"[0, {vocab_size - 1}]. Tokenize with the model's own tokenizer."
        )


RIGHT_PADDING_WARNING = (
    "A decoder-only architecture is being used, but right-padding was detected! For correct "
    "generation results, please set `padding_side='left'` when initializing the tokenizer."
)  # transformers v5's text, word for word


def check_padding(model, input_ids, attention_mask, config) -> None:
    """Checks the attention mask's values and warns on right padding, when they are concrete.

    Raises :class:`InputError` for a mask holding values other than 0 and 1 (a float mask of
    weights, say: positions are counted from the mask) and for a row with no token to attend to.
    Warns, as transformers does for a decoder-only model and a batch of more than one row, when
    some row ends in padding: the mask's last column holds a 0 or, without a mask, the last
    input id is the pad id (``pad_token_id``, else the first EOS id). Tracers are skipped, so
    ``generate`` stays usable inside the user's ``jit``; so are the row checks of a global array
    this process holds only part of.
    """
    if attention_mask is not None and not isinstance(attention_mask, jax.core.Tracer):
        values = np.unique(local_values(attention_mask))
        wrong = [v for v in values.tolist() if v not in (0, 1)]  # NaN is never 0 or 1
        if wrong:
            shown = ", ".join(repr(v) for v in wrong[:5]) + (", ..." if len(wrong) > 5 else "")
            raise InputError(
                f"`attention_mask` must hold only 0 (padding) and 1 (a token); got "
                f"{attention_mask.dtype} values {shown}. Pass a 0/1 mask, e.g. "
                f"(mask > 0).astype(np.int32), as the tokenizer returns it."
            )
        if _fully_readable(attention_mask):
            mask = np.asarray(attention_mask)
            empty = np.flatnonzero(~mask.astype(bool).any(axis=1)).tolist()
            if empty:
                raise InputError(
                    f"`attention_mask` rows {empty} are all 0: those prompts have no token to "
                    f"attend to and would generate garbage. Give every prompt at least one token "
                    f"(e.g. the BOS token) or leave the empty prompts out."
                )
    if input_ids.shape[0] < 2 or getattr(model, "is_encoder_decoder", False):
        return
    if attention_mask is not None:
        if isinstance(attention_mask, jax.core.Tracer) or not _fully_readable(attention_mask):
            return
        right_padded = bool((np.asarray(attention_mask)[:, -1] == 0).any())
    else:
        pad = config.pad_token_id
        if pad is None and config.eos_token_id is not None:
            pad = config.eos_token_id
        traced = (input_ids, pad)
        if pad is None or any(isinstance(x, jax.core.Tracer) for x in traced):
            return
        if not _fully_readable(input_ids):
            return
        pad = np.ravel(np.asarray(pad))[0]
        right_padded = bool((np.asarray(input_ids)[:, -1] == pad).any())
    if right_padded:
        warnings.warn(RIGHT_PADDING_WARNING, UserWarning, stacklevel=5)


def _fully_readable(x) -> bool:
    return not (isinstance(x, jax.Array) and not x.is_fully_addressable)


def local_values(x) -> np.ndarray:
    """The values of ``x`` this process holds, flattened: all of them, except for a global
    array of a multi-host mesh, where only the process' own shards can be read."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.concatenate([np.ravel(s.data) for s in x.addressable_shards])
    return np.asarray(x)


def num_new_tokens(config: Lengths, resolved, prompt_length: int, model) -> int:
    """N, by transformers' rules: ``max_new_tokens`` wins; else ``max_length - P`` when
    ``max_length`` was set; else 20 new tokens, capped by ``max_position_embeddings``."""
    limit = getattr(model, "max_position_embeddings", None)
    if config.max_new_tokens is not None:
        new = config.max_new_tokens
    elif config.max_length is not None:
        new = config.max_length - prompt_length
    else:
        new = resolved.max_length if resolved.max_length is not None else 20
        if limit is not None:
            new = min(new, limit - prompt_length)
    if new < 1:
        raise InputError(
            f"nothing to generate: the prompt has {prompt_length} tokens and the config allows "
            f"max_length={config.max_length}, max_new_tokens={config.max_new_tokens}. "
            + (
                f"Shorten the prompt to under {limit} tokens (the model's max_position_embeddings)."
                if limit is not None and prompt_length >= limit
                else f"Shorten the prompt, raise max_length above {prompt_length}, or set "
                f"max_new_tokens (which takes precedence over max_length)."
            )
        )
    if limit is not None and prompt_length + new > limit:
        raise InputError(
            f"prompt length {prompt_length} + {new} new tokens = {prompt_length + new} exceeds "
            f"the model's max_position_embeddings={limit}. "
            + (
                f"Shorten the prompt or lower max_new_tokens to at most {limit - prompt_length}."
                if prompt_length < limit
                else f"Shorten the prompt to under {limit} tokens (it leaves no room to generate)."
            )
        )
    return int(new)


def check_assisted_extras(streamer, layout) -> None:
    """Assisted generation does not stream or shard yet: say so before anything is traced."""
    if streamer is not None:
        raise UnsupportedError(
            "streamer= is not supported with assisted generation (assistant_model= or "
            "prompt_lookup_num_tokens) yet. Drop the streamer, or the assistant."
        )
    if layout is not None:
        raise UnsupportedError(
            "assisted generation (assistant_model= or prompt_lookup_num_tokens) does not run on "
            "a mesh yet. Call generate without mesh= and outside `jax.set_mesh`."
        )


def call_layout(model, mesh, rules, batch: int) -> Layout | None:
    """The sharding layout of a call: from ``mesh``, else from the mesh set by
    ``jax.set_mesh``, else None (one device); checked against the model and batch."""
    if mesh is not None:
        manual = tuple(getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()))
        if manual:
            raise ShardingError(
                f"generate() got mesh= inside shard_map (or pmap), whose mesh axes {manual} are "
                f"manual: there every array is already one device's block. Drop mesh= inside "
                f"shard_map: generate then runs on each block, and constrains any axes left "
                f"automatic (not in shard_map's axis_names=) by the mesh in effect."
            )
        return layout_for(model, mesh, rules, batch)
    layout = context_layout(model, rules, batch)
    if layout is None and rules is not None:
        raise InputError(
            "generate() got sharding rules= but no mesh: pass mesh=genjax.sharding.make_mesh("
            "...) too, or call it under `with jax.set_mesh(mesh):`."
        )
    return layout


def stop_string_table_for(config: GenerationConfig, tokenizer):
    """The stop-string tables (built on the host, cached), or None without stop strings."""
    if config.stop_strings is None:
        return None
    if tokenizer is None:
        raise InputError(
            f"stop_strings={config.stop_strings!r} need the model's tokenizer to find the tokens "
            f"that spell them, but no tokenizer was given. Pass tokenizer= to generate (a "
            f"transformers tokenizer or a tokenizers.Tokenizer), or unset stop_strings."
        )
    return stop_string_table(tokenizer, config.stop_strings)


def infer_attention_mask(input_ids: Array, pad_token_id: Array, eos_token_ids: Array | None):
    """transformers' default mask: ``ids != pad`` if pad occurs in the input and is not EOS.
    Computed with numpy when everything is concrete (a new shape compiles nothing)."""
    if not any(isinstance(x, jax.core.Tracer) for x in (input_ids, pad_token_id, eos_token_ids)):
        ids, pad = np.asarray(input_ids), np.asarray(pad_token_id)
        has_pad = (ids == pad).any()
        if eos_token_ids is not None:
            has_pad &= not (np.asarray(eos_token_ids) == pad).any()
        return np.where(has_pad, ids != pad, True).astype(np.int32)
    has_pad = jnp.any(input_ids == pad_token_id)
    if eos_token_ids is not None:
        has_pad = has_pad & ~jnp.any(eos_token_ids == pad_token_id)
    return jnp.where(has_pad, input_ids != pad_token_id, True).astype(jnp.int32)


def as_int32(x) -> Array:
    """``x`` as an int32 jax array. Host arrays are converted by numpy and transferred with
    ``device_put``, which compiles nothing (``jnp.asarray`` compiles a program per new shape)."""
    if isinstance(x, (jax.Array, jax.core.Tracer)):
        return jnp.asarray(x, jnp.int32)
    return jax.device_put(np.asarray(x, np.int32))


def negative_prompt(model, config, mode_name: str, input_ids, ids, mask):
    """Checks the classifier-free guidance inputs of a call (:mod:`genjax.decoding.guidance`).

    Args:
        model: the decoder-only model.
        config: the resolved config; guidance runs when ``guidance_scale`` is active (set and
            not 1).
        mode_name: the call's loop ("sampling", "beams" or "assisted").
        input_ids: int[B, P] the prompts.
        ids: ``negative_prompt_ids`` int[B, Pn], or None (then each row's last prompt token).
        mask: ``negative_prompt_attention_mask`` int[B, Pn], or None (all ones).

    Returns:
        ``(ids int32[B, Pn], mask int32[B, Pn])``, or ``(None, None)`` without a negative prompt.

    Raises:
        UnsupportedError: guidance with beams or assisted generation.
        InputError: a negative prompt without guidance, of the wrong shape, or with ids outside
            the vocabulary; a mask without ids or not of 0s and 1s.
    """
    if mask is not None and ids is None:
        raise InputError(
            "negative_prompt_attention_mask= was given without negative_prompt_ids=: pass the "
            "negative prompt's ids too, or drop the mask."
        )
    if not config.is_active("guidance_scale"):
        if ids is not None:
            raise InputError(
                f"negative_prompt_ids= is the unconditional context of classifier-free guidance, "
                f"which runs only with guidance_scale != 1 (got {config.guidance_scale!r}). Set "
                f"guidance_scale (e.g. 1.5), or drop negative_prompt_ids."
            )
        return None, None
    if mode_name != "sampling":
        raise UnsupportedError(
            f"guidance_scale={config.guidance_scale!r} (classifier-free guidance) is supported "
            f"by genjax with greedy decoding and sampling only, not with {mode_name} decoding. "
            f"Set num_beams=1 and drop the assistant, or leave guidance_scale at 1."
        )
    if ids is None:
        return None, None
    if not hasattr(ids, "shape"):
        ids = np.asarray(ids)
    batch = input_ids.shape[0]
    if ids.ndim != 2 or not jnp.issubdtype(ids.dtype, jnp.integer) or ids.shape[1] == 0:
        raise InputError(
            f"`negative_prompt_ids` must be an integer array of shape [batch, length >= 1]; got "
            f"dtype {ids.dtype} and shape {tuple(ids.shape)}."
        )
    if ids.shape[0] != batch:
        raise InputError(
            f"`negative_prompt_ids` has {ids.shape[0]} rows but input_ids has {batch}: give one "
            f"negative prompt per prompt (left-padded, with negative_prompt_attention_mask)."
        )
    check_in_vocabulary("negative_prompt_ids", ids, model.vocab_size)
    if mask is None:
        xp = jnp if isinstance(ids, jax.core.Tracer) else np
        return as_int32(ids), as_int32(xp.ones(ids.shape, xp.int32))
    if not hasattr(mask, "shape"):
        mask = np.asarray(mask)
    if tuple(mask.shape) != tuple(ids.shape):
        raise InputError(
            f"`negative_prompt_attention_mask` must have the shape of `negative_prompt_ids` "
            f"{tuple(ids.shape)}; got {tuple(mask.shape)}."
        )
    if not isinstance(mask, jax.core.Tracer):
        wrong = [v for v in np.unique(local_values(mask)).tolist() if v not in (0, 1)]
        if wrong:
            raise InputError(
                f"`negative_prompt_attention_mask` must hold only 0 (padding) and 1 (a token); "
                f"got values {wrong[:5]}."
            )
    return as_int32(ids), as_int32(mask)
