"""One compiled program for many calls: the slot layout of a cache preallocated to
``max_cache_len``.

Without ``max_cache_len``, ``generate``'s program is shaped by the prompt bucket ``Pb`` and the
number of new tokens ``N``: the KV cache and the token buffer hold ``Pb + N`` slots, so each
bucket and each ``N`` compiles a program. With ``max_cache_len = M`` (the config field, or
``generate(..., max_cache_len=M)``), every call with ``P + N <= M`` runs the same program::

    slot   0 .. o-1 | o ........ e-1 | e ......... e+N-1 | e+N ... S-1
           padding  | the prompt (P) | the new tokens    | pad, never written
           (masked) |                | (N)               |

* The token buffer and the cache hold ``S = M + C - 1`` slots, ``C`` being the chunk:
  ``prefill_chunk_size`` when set, else the prompt-bucket policy's granularity (16 by
  default; see :mod:`genjax.buckets`).
* The prompt is left-padded with ``o = (-P) mod C`` masked slots, so it ends at ``e = o + P``,
  a multiple of ``C``.
* The prefill runs the prompt through the model ``C`` slots at a time, in a ``lax.while_loop``
  of ``e / C`` steps: its cost follows the prompt, not ``M``.
* The decoding loop stops once slot ``e + N - 1`` is written (or every row finished).

Static or traced:
    Static: ``M`` and ``C`` (so ``S``), hence every array shape. Traced: the prompt's end ``e``,
    the padding ``o`` and the loop's end ``e + N``: the prompt length, its bucket and
    ``max_new_tokens`` (or ``max_length``) can change from call to call without compiling.

Outputs (static shapes, unlike the bucketed path which returns ``P + N`` columns):
    ``sequences`` int32[B*R, M]: the prompt as given, its ``N`` new tokens, then
    ``pad_token_id`` up to ``M`` (also after a row's EOS, as usual). ``scores`` and ``logits``
    float32[B*R, M - 1, V] (``M - 1`` is the most new tokens a call can ask for): step ``t``
    for new token ``t``, 0 from step ``N`` on. ``out.sequences[:, :P + N]`` and
    ``out.scores[:, :N]`` are what the call would return without ``max_cache_len``.

Every strategy uses this buffer. Beam search and beam sampling: ``B*M`` rows of it (``M``
beams); the beam loop's first new slot is the traced ``e`` (``BeamState.start`` in
:mod:`genjax.decoding.beam`), its hypotheses hold ``M - 1`` new tokens of which a call fills
``N``, and it stops at the call's ``N`` (``BeamRules.num_new_tokens``), which
``early_stopping`` and ``length_penalty`` count. ``beam_indices`` int32[B*R, M - 1], -1 from
step ``N`` on; ``scores`` has ``B*M`` rows. Assisted generation (a draft model or prompt
lookup, :mod:`genjax.decoding.assisted`): its rows start at ``e`` and stop at ``e + N``
(``AssistRules.end``, traced); its caches hold the ``S`` slots plus the rolled-back slots of
``M - 1`` steps (``cache_lengths(S, M - 1, ...)``), prefilled in chunks like the others.

Encoder-decoder models give their decoder's tokens and self-attention cache ``M`` slots
without this layout: the decoder's prefix has a static length, so it needs no chunks or
padding (see :mod:`genjax.generation.encoder_decoder`).

References:
    transformers' ``StaticCache`` / ``max_cache_len`` (a cache preallocated once so that
    compiled programs are reused); chunked prefill as in vLLM and gemma's sampler.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from genjax.errors import InputError
from genjax.typing import Array

__all__ = ["FixedSlots", "check_length", "pad_prompt", "plan", "prefill_chunks"]


@dataclasses.dataclass(frozen=True)
class FixedSlots:
    """The static layout of a ``max_cache_len`` call (hashable: a static jit argument)."""

    max_cache_len: int  # M: the most prompt + new tokens of one call
    chunk: int  # C: prompts are padded to a multiple of it and prefilled C slots at a time

    @property
    def buffer_length(self) -> int:
        """``S = M + C - 1``: slots of the token buffer and of the KV cache."""
        return self.max_cache_len + self.chunk - 1

    @property
    def max_steps(self) -> int:
        """``M - 1``: the steps ``scores``/``logits`` hold, the most new tokens of one call."""
        return self.max_cache_len - 1

    def place(self, input_ids: Array, attention_mask: Array, pad_token_id: Array):
        """Puts int[B, P] prompts into the int32[B, S] buffer layout of the module docstring.

        Concrete arrays are laid out with numpy (nothing is compiled); traced ones with jnp.

        Returns:
            ``(tokens int32[B, S], mask int32[B, S], offset, prompt_end)``: ``offset = o`` and
            ``prompt_end = e`` are Python ints; ``mask`` is 0 outside the prompt.
        """
        prompt_length = input_ids.shape[1]
        offset = -prompt_length % self.chunk
        prompt_end = offset + prompt_length
        right = self.buffer_length - prompt_end
        tokens, mask = pad_prompt(input_ids, attention_mask, pad_token_id, offset, right)
        return tokens, mask, offset, prompt_end

    def prefill(self, model, params, tokens, mask, prompt_end, cache, *, keep_one: bool):
        """Runs the prompt through ``model`` ``C`` slots at a time into ``cache``.

        Args:
            model: the model (static); ``model.apply`` writes ``C`` slots at ``cache.index``.
            params: its parameters.
            tokens: int32[B, S], laid out by :meth:`place`.
            mask: int32[B, S], 1 on real prompt tokens.
            prompt_end: int32[] (traced), ``e``: a multiple of ``C``, at least ``C``.
            cache: an empty cache of ``S`` slots (float or quantized), index 0.
            keep_one: whether ``model.apply`` takes ``logits_to_keep`` (then only the last
                position's logits are computed).

        Returns:
            ``(logits float32[B, V], cache, cache_mask int32[B, S])``: the logits at slot
            ``e - 1``, the cache holding slots ``0 .. e - 1`` (index ``e``), and the attention
            mask of the decoding loop: the prompt's mask, then 1 on every slot from ``e``.
        """
        length = tokens.shape[1]
        positions = jnp.maximum(jnp.cumsum(mask, axis=-1) - 1, 0)  # transformers v5's rule
        cache_mask = jnp.where(jnp.arange(length)[None, :] >= prompt_end, 1, mask)
        chunks = prompt_end // self.chunk
        logits, cache = prefill_chunks(
            model, params, tokens, positions, cache_mask, cache, self.chunk, chunks,
            keep_one=keep_one,
        )  # fmt: skip
        return logits, cache, cache_mask

    def sequences(self, tokens: Array, offset: Array) -> Array:
        """int32[B, M]: the buffer from the user's first prompt slot ``offset`` (traced) on."""
        return jax.lax.dynamic_slice_in_dim(tokens, offset, self.max_cache_len, axis=1)


def plan(config, policy, prompt_length: int, num_new_tokens: int):
    """The :class:`FixedSlots` of a call, or None when ``config.max_cache_len`` is unset.

    Args:
        config: the resolved :class:`~genjax.GenerationConfig` of the call.
        policy: the call's :class:`~genjax.buckets.BucketPolicy` (gives the chunk unless
            ``config.prefill_chunk_size`` is set).
        prompt_length: ``P``, the width of ``input_ids``.
        num_new_tokens: ``N``, from ``max_new_tokens`` or ``max_length``.

    Raises:
        InputError: ``P + N > max_cache_len`` (every strategy: greedy, sampling, beams,
            assisted generation).
    """
    size = config.max_cache_len
    if size is None:
        return None
    check_length(size, prompt_length, num_new_tokens)
    return FixedSlots(size, config.prefill_chunk_size or policy.granularity)


def check_length(
    size: int, prompt_length: int, num_new_tokens: int, prompt: str = "prompt"
) -> None:
    """Raises InputError unless ``prompt_length + num_new_tokens <= size`` (``max_cache_len``),
    saying how to fix it; ``prompt`` names what ``prompt_length`` counts (an encoder-decoder
    model's ``"decoder prefix"``).

    Example:
        >>> check_length(8, 3, 5)  # passes: 3 + 5 <= 8
    """
    if prompt_length + num_new_tokens > size:
        fix = (
            f"lower max_new_tokens to at most {size - prompt_length}"
            if prompt_length < size
            else f"shorten the {prompt} to under {size} tokens"
        )
        raise InputError(
            f"{prompt} length {prompt_length} + {num_new_tokens} new tokens = "
            f"{prompt_length + num_new_tokens} exceeds max_cache_len={size}: {fix}, or raise "
            f"max_cache_len (which compiles a new program)."
        )


def prefill_chunks(
    model, params, tokens, positions, mask, cache, chunk: int, num_chunks, *, keep_one: bool
):
    """Runs slots ``0 .. num_chunks * chunk - 1`` through ``model``, ``chunk`` slots at a time
    (a ``lax.while_loop``), into ``cache`` from its index 0: the chunked prefill of the
    ``max_cache_len`` layout and of ``prefill_chunk_size``. Each chunk attends to the slots
    before it through the cache, so the result equals one pass over all the slots.

    Args:
        model: the model (static); ``model.apply`` writes ``chunk`` slots at ``cache.index``.
        params: its parameters.
        tokens: int32[B, T] with ``T >= num_chunks * chunk``.
        positions: int32[B, T], the position ids of ``tokens``.
        mask: int32[B, S], the attention mask over every slot of ``cache`` (``S`` slots).
        cache: an empty cache (float or quantized), index 0.
        chunk: ``C`` (static).
        num_chunks: int32[] or int, at least 1 (may be traced).
        keep_one: whether ``model.apply`` takes ``logits_to_keep`` (then only the last
            position's logits are computed).

    Returns:
        ``(logits float32[B, V], cache)``: the logits at slot ``num_chunks * chunk - 1`` and
        the cache holding the slots before it (index ``num_chunks * chunk``).
    """
    extra = {"logits_to_keep": 1} if keep_one else {}

    def run_chunk(k, cache):  # slots k*C .. k*C + C - 1 -> float32[B, V], cache
        piece = [
            jax.lax.dynamic_slice_in_dim(x, k * chunk, chunk, axis=1) for x in (tokens, positions)
        ]  # int32[B, C] each
        logits, cache = model.apply(params, *piece, cache, mask, **extra)
        return logits[:, -1].astype(jnp.float32), cache

    first = jnp.zeros((), jnp.int32)
    shape = jax.eval_shape(run_chunk, first, cache)[0]

    def body(carry):
        k, cache, _ = carry
        logits, cache = run_chunk(k, cache)
        return k + 1, cache, logits

    carry = (first, cache, jnp.zeros(shape.shape, shape.dtype))
    _, cache, logits = jax.lax.while_loop(lambda c: c[0] < num_chunks, body, carry)
    return logits, cache


def _on_host(x) -> bool:
    """Whether ``x`` can be read on this host: not traced, and not a global array whose rows
    lie partly on other processes (a multi-host mesh splitting the batch), which is padded
    with JAX instead (every process runs the same operation)."""
    if isinstance(x, jax.core.Tracer):
        return False
    return not isinstance(x, jax.Array) or x.is_fully_addressable or x.is_fully_replicated


def pad_prompt(
    input_ids: Array, attention_mask: Array, pad_token_id: Array, left: int, right: int = 0
):
    """Pads int32[B, P] ids and mask with ``left`` and ``right`` masked slots (static counts)
    holding ``pad_token_id``: int32[B, left + P + right] each. With numpy when all are
    concrete and on this host, so a new prompt shape compiles nothing."""
    if not left and not right:
        return input_ids, attention_mask
    widths = ((0, 0), (left, right))
    if all(_on_host(x) for x in (input_ids, attention_mask, pad_token_id)):
        pad = int(np.asarray(pad_token_id))
        ids = np.pad(np.asarray(input_ids, np.int32), widths, constant_values=pad)
        mask = np.pad(np.asarray(attention_mask, np.int32), widths)
        return jax.device_put(ids), jax.device_put(mask)
    ids = jnp.pad(input_ids.astype(jnp.int32), widths, constant_values=pad_token_id)
    return ids, jnp.pad(attention_mask.astype(jnp.int32), widths)
