"""Models: the protocol ``generate`` relies on, the built-in architectures, and HF loading.

The model protocol
------------------
Any object with these members plugs into ``genjax.generate``; nothing else about it matters
(it need not be flax, nor come from a checkpoint):

* It is **hashable and immutable** (a frozen dataclass holding a frozen config dataclass): it is
  passed to ``jax.jit`` as a static argument, so equal models share compiled programs.
* ``vocab_size: int`` (``V``), ``num_layers: int`` (``L``), ``dtype`` (the activation and
  parameter dtype), and ``max_position_embeddings: int | None``: the ``config.json`` value that
  transformers caps generated lengths by (a hard limit for GPT-2's learned table, the trained
  context for rotary models), or None when the model has none.
* ``init_cache(batch, max_length, dtype=None) -> genjax.cache.KVCache``: an empty cache of
  ``max_length`` slots (``KVCache.create``); ``dtype=None`` means the model dtype.
* ``apply(params, tokens, positions, cache, attention_mask) -> (logits, cache)``, pure:

  - ``tokens``: int32[B, T], written to cache slots ``cache.index .. cache.index + T - 1``.
  - ``positions``: int32[B, T] position ids, computed by the caller from the attention mask as
    transformers does (``cumsum(mask) - 1``; padding gets any in-range value).
  - ``attention_mask``: int[B, S] over all ``S`` cache slots, nonzero where a slot holds a real
    token; slots at and after ``index + T`` may hold anything (causality hides them).
  - Query ``i`` may attend to slot ``j`` iff ``mask[b, j]`` and ``j <= index + i`` (and
    ``index + i - j < W`` with a sliding window ``W``): ``genjax.cache.attention_bias``.
  - Each layer writes its keys and values with ``cache.update_layer(layer, k, v)`` and attends
    over the returned blocks (keys ``[B, K, H, S]``, values ``[B, K, S, H]``, as
    ``genjax.models.attention.attention`` takes them); after all layers the cache is
    ``advance(T)``-ed. A layer for which ``cache.ring_slots(layer)`` is an int ``R`` keeps a
    ring (``genjax.cache.ring``): its blocks have ``R`` (or ``R + T``) slots, masked by
    ``genjax.cache.ring_bias`` instead (the built-in decoder, ``genjax.models.decoder``, does
    this; a model that never passes ``windows`` to ``KVCache.create`` never sees a ring).
  - Returns float32[B, T, V] logits (computed in the model dtype, then cast) and the new cache.
  - Optional: a keyword ``logits_to_keep: int`` (static, default 0 = all positions); ``k > 0``
    returns only the last ``k`` positions' logits, float32[B, k, V], as transformers'
    ``logits_to_keep``. ``generate`` passes ``logits_to_keep=1`` to the prefill when ``apply``
    accepts it, so a long prompt does not pay for ``P`` rows of the vocabulary projection. The
    serving engine passes transformers' tensor form, int32[k] positions (traced), to keep the
    logits of a prompt chunk's last real token; a model taking the keyword takes both forms.
  - Optional: keywords ``output_hidden_states: bool`` and ``output_attentions: bool``
    (static, default False). When either is True, ``apply`` returns ``(logits, cache,
    outputs)``, ``outputs`` a dict holding ``"hidden_states"`` dtype[L+1, B, T, D] (the
    embeddings, each layer's output but the last, then the last layer's after the final norm,
    transformers' order) and/or ``"attentions"`` dtype[L, B, N, T, S] (each layer's softmax
    weights over the cache's ``S`` logical slots). ``generate``'s ``output_hidden_states`` and
    ``output_attentions`` need them (every built-in model has them; an encoder-decoder model's
    ``encode`` and ``apply`` return transformers' ``encoder_*``, ``decoder_*`` and
    ``cross_attentions`` instead: ``genjax.models.encoder_decoder``).

  A full forward pass is ``apply`` on a fresh ``init_cache(B, T)`` (index 0). Prefill then
  decode is ``apply`` with ``T = P`` then ``T = 1`` repeatedly on one cache of length ``S``.
  ``generate`` runs the prefill on ``init_cache(B, P)`` (a full forward pass of the prompt)
  and grows that cache to ``S`` slots with ``KVCache.with_length`` before decoding, so the
  prompt's attention does not read the ``S - P`` empty slots (and its sliding-window layers
  keep the last ``W`` slots as rings).

Static or traced: the model (its config, dtype, layer count) is static; params, tokens,
positions, the cache and the mask are traced.

Example::

    model, params = genjax.models.from_pretrained("HuggingFaceTB/SmolLM2-135M")
    cache = model.init_cache(batch=1, max_length=16)
    mask = jnp.ones((1, 16), jnp.int32)
    logits, cache = model.apply(params, ids, jnp.arange(4)[None], cache, mask)   # prefill 4
    logits, cache = model.apply(params, next_id, jnp.array([[4]]), cache, mask)  # one more

Encoder-decoder models
----------------------
T5, mT5, BART, mBART and Marian (``is_encoder_decoder`` True) follow a second form of the
protocol: ``encode(params, input_ids, attention_mask)``; ``init_cache(batch, max_length,
encoder_states, encoder_mask, params)``, which computes the cross-attention keys and values
once and keeps them, one entry per prompt, in a :class:`genjax.cache.EncoderDecoderCache`; and a
decoder ``apply`` with the shape contract above. :mod:`genjax.models.encoder_decoder` defines it.
``generate`` does not drive them yet.

Built-in architectures
----------------------
``LlamaModel`` (model_type llama, mistral, qwen2, qwen3) and its subclasses ``Olmo2Model``
(olmo2), ``Phi3Model`` (phi3: Phi-3, Phi-4) and ``GemmaModel`` (gemma2, gemma3_text), one shared
rotary decoder (:mod:`genjax.models.decoder`, a config flag per feature) read from each
architecture's ``config.json``; ``GPT2Model`` (gpt2); the encoder-decoders ``T5Model`` (t5, mt5)
and ``BartModel`` (bart, mbart, marian). Their parameters are nested dicts whose paths mirror the
HF state-dict names (``params["layers"]["0"]["self_attn"]["q_proj"]["kernel"]`` is
``model.layers.0.self_attn.q_proj.weight``, [out, in]); the modules ``decoder`` and ``gpt2`` list
each tree, and ``llama``, ``olmo2``, ``phi3``, ``gemma`` and ``gpt2`` which ``config.json`` keys
they handle, ignore or reject. ``from_pretrained`` also reads llama.cpp GGUF files
(``gguf_file=``, or a ``.gguf`` path): :mod:`genjax.models.gguf`.

Layer
-----
Floor 3. Imports :mod:`genjax.cache`, :mod:`genjax.config`, :mod:`genjax.errors` and
:mod:`genjax.typing`, never the decoding loops or anything above. Static: the model and its
config (hashable; a static jit argument). Traced: params, tokens, positions, the cache, masks.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import jax.numpy as jnp

from genjax.cache import KVCache
from genjax.models.bart import BartConfig, BartModel
from genjax.models.gemma import GemmaModel
from genjax.models.gpt2 import GPT2Config, GPT2Model
from genjax.models.llama import LlamaConfig, LlamaModel
from genjax.models.loading import (
    ARCHITECTURES,
    from_config,
    from_pretrained,
    load_params,
    save_params,
)
from genjax.models.olmo2 import Olmo2Model
from genjax.models.phi3 import Phi3Model
from genjax.models.precision import auto_precision
from genjax.models.rope import SUPPORTED_ROPE_TYPES, RopeConfig
from genjax.models.t5 import T5Config, T5Model
from genjax.typing import Array, PyTree


@runtime_checkable
class Model(Protocol):
    """What ``generate`` needs from a model (see the module docstring for the contract)."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def max_position_embeddings(self) -> int | None: ...

    @property
    def num_layers(self) -> int: ...

    @property
    def dtype(self) -> Any: ...

    def init_cache(
        self, batch: int, max_length: int, dtype: jnp.dtype | None = None
    ) -> KVCache: ...

    def apply(
        self,
        params: PyTree,
        tokens: Array,
        positions: Array,
        cache: KVCache,
        attention_mask: Array,
    ) -> tuple[Array, KVCache]: ...


__all__ = [
    "ARCHITECTURES",
    "BartConfig",
    "BartModel",
    "GPT2Config",
    "GPT2Model",
    "GemmaModel",
    "LlamaConfig",
    "LlamaModel",
    "Model",
    "Olmo2Model",
    "Phi3Model",
    "RopeConfig",
    "SUPPORTED_ROPE_TYPES",
    "T5Config",
    "T5Model",
    "auto_precision",
    "from_config",
    "from_pretrained",
    "load_params",
    "save_params",
]
