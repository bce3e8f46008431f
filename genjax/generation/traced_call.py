"""What the three decoding loops of ``generate`` share inside its compiled program.

:class:`TracedCall` holds one call's plan (static), its traced inputs, the special ids and the
stopping rules started before the prefill, and builds what every loop needs from them: the
processor chain, the prefill (of the model, its draft, or an encoder-decoder model), the
classifier-free guidance branch, the processors' view of the prompt and the sharding hook.
Everything here runs under ``generate``'s ``jax.jit``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from genjax.cache.quantized import init_cache
from genjax.cache.slots import pad_prompt
from genjax.config import GenerationConfig
from genjax.decoding import guidance
from genjax.generation import encoder_decoder, recording
from genjax.generation.outputs import GenerateOutput
from genjax.generation.plan import CallPlan, TracedInputs
from genjax.generation.prefill import accepts_logits_to_keep, prefill, prompt_context
from genjax.processors import Processor, from_config
from genjax.stopping import StoppingRules
from genjax.typing import Array, PyTree


@dataclasses.dataclass(frozen=True)
class TracedCall:
    """What the three loops share, inside the trace: the plan (static), the traced inputs, the
    special ids and the started stopping rules."""

    plan: CallPlan
    params: PyTree
    input_ids: Array  # int32[B, W]: laid out in the program's slots
    attention_mask: Array  # int32[B, W]
    traced: TracedInputs  # its config's traced fields are tracers here
    pad_token_id: Array  # int32[]
    eos_token_ids: Array | None  # int32[E]
    stopping: StoppingRules  # clock started before the prefill

    @property
    def config(self) -> GenerationConfig:
        """The resolved config (traced fields are tracers)."""
        return self.traced.config

    def processors(self) -> Processor:
        """The processor chain of the config, in transformers' order."""
        return from_config(
            self.config,
            self.eos_token_ids,
            extra=self.traced.logits_processor,
            allowed_tokens_fn=self.plan.allowed_tokens_fn,
        )

    def prefill(self, new_slots: int | None = None, *, draft: bool = False, ring_margin=0):
        """:func:`genjax.generation.prefill.prefill` of the model (the assistant when
        ``draft``) into ``W + new_slots`` slots (default ``N``), sliding-window rings with
        ``ring_margin`` extra slots (static). With ``max_cache_len`` (``plan.slots``) the
        prompt goes into the slot buffer's cache instead, with ``new_slots`` (default 0) more
        (:meth:`prefill_slots`)."""
        model, params = self.plan.model, self.params
        if draft:
            model, params = self.plan.assistant, self.traced.assistant_params
        if self.plan.slots is not None:
            return self.prefill_slots(model, params, new_slots or 0, ring_margin)
        new_slots = self.plan.steps if new_slots is None else new_slots
        if self.traced.decoder_input_ids is not None:  # an encoder-decoder model
            return encoder_decoder.prefill(
                model,
                params,
                self.input_ids,
                self.attention_mask,
                self.traced.decoder_input_ids,
                new_slots,
                self.pad_token_id,
                self.plan.quantized,
                self.traced.encoder_states,
                self.plan.forward_flags,
            )
        return prefill(
            model,
            params,
            self.input_ids,
            self.attention_mask,
            new_slots,
            self.pad_token_id,
            self.plan.quantized,
            self.plan.prefill_chunk,
            ring_margin,
            forward_flags=None if draft else self.plan.forward_flags,
        )

    def prefill_slots(self, model, params, new_slots: int = 0, ring_margin: int = 0):
        """The prefill of the ``max_cache_len`` layout (:meth:`genjax.cache.slots.FixedSlots.
        prefill`): the prompt, ``C`` slots at a time, into an empty cache of ``S + new_slots``
        slots (static; assisted generation's rolled-back slots), sliding-window rings with
        ``ring_margin`` extra slots (static); its first new slot is the traced ``bounds[0]``.

        Returns:
            ``(logits float32[B, 1, V], cache, cache_mask int32[B, S + new_slots], tokens
            int32[B, S])`` as :meth:`prefill` returns them: ``tokens`` is the laid-out buffer.
        """
        plan, ids, mask = self.plan, self.input_ids, self.attention_mask
        if new_slots:
            ids, mask = pad_prompt(ids, mask, self.pad_token_id, 0, new_slots)
        cache = init_cache(model, ids.shape[0], ids.shape[1], plan.quantized)
        if ring_margin and getattr(cache, "windows", ()):
            cache = cache.with_length(ids.shape[1], margin=ring_margin)  # rings of W + margin
        logits, cache, cache_mask = plan.slots.prefill(
            model, params, ids, mask, self.traced.bounds[0], cache,
            keep_one=accepts_logits_to_keep(model),
        )  # fmt: skip
        return logits[:, None], cache, cache_mask, self.input_ids

    def guidance_branch(self, prompt_end: Array) -> guidance.GuidanceState:
        """The classifier-free guidance branch, prefilled: the negative prompt, else each row's
        last prompt token (the slot before ``prompt_end``), with ``N`` new slots."""
        ids = self.traced.negative_prompt_ids
        mask = self.traced.negative_prompt_attention_mask
        if ids is None:
            ids = jax.lax.dynamic_slice_in_dim(self.input_ids, prompt_end - 1, 1, axis=1)
            mask = jnp.ones_like(ids)

        def prefill_context(ids, mask, positions):
            return prefill(
                self.plan.model,
                self.params,
                ids,
                mask,
                self.plan.steps,
                self.pad_token_id,
                self.plan.quantized,
                self.plan.prefill_chunk,
                positions=positions,
            )

        return guidance.start(prefill_context, ids, mask, self.config.guidance_scale)

    def context(self, tokens: Array, length: Array, attention_mask: Array, rows_per_prompt: int):
        """The processors' view of the prompt (:func:`prompt_context`); for an encoder-decoder
        model with the source ids, one row per decoder row (``rows_per_prompt`` static). With
        ``max_cache_len`` its ``max_length`` is transformers' ``P + N`` (traced)."""
        context = prompt_context(tokens, length, attention_mask, self.traced.offset)
        if self.traced.bounds is not None:
            context = context.replace(max_length=self.traced.bounds[1] - self.traced.offset)
        if self.traced.source_length is None:
            return context
        source = encoder_decoder.source_tokens(
            self.input_ids, self.traced.source_length, rows_per_prompt
        )
        return context.replace(encoder_tokens=source)

    def constrain(self):
        """The loops' ``constrain`` hook: the layout's shardings (recorded outputs' buffers
        with their rows on ``batch``: :func:`~genjax.generation.recording.constrain_state`), or
        None."""
        layout = self.plan.layout
        if layout is None:
            return None
        if not self.plan.forward_flags:
            return layout.constrain
        return functools.partial(recording.constrain_state, layout)

    def finish(self, out: GenerateOutput) -> GenerateOutput:
        """The output, sharded as the layout says (recorded outputs with their rows on
        ``batch``)."""
        layout = self.plan.layout
        if layout is None:
            return out
        if not self.plan.forward_flags:
            return layout.constrain(out)
        return recording.constrain_output(layout, out)
