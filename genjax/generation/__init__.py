"""``generate``: validate a call, plan it, prefill, run the right decoding loop, assemble outputs.

``plan`` checks a call and decides everything about it on the host, once: its
:class:`~genjax.generation.plan.CallPlan` (the mode, the program's prompt width and recorded
steps, the ``max_cache_len`` slot layout, the sharding layout, the user's processors and
stopping criteria, streaming, the output flags, the KV caches; frozen and hashable) and the
arrays the program traces. ``entry`` is :func:`generate` itself and its one jitted program,
whose single static argument is the plan and whose three loops (sampling, beams, assisted) read
it; ``inputs`` holds the host checks ``plan`` calls (arrays, lengths, layout, stop strings);
``constrained`` turns ``constraint=`` into the device automaton (:mod:`genjax.constraints`);
``encoder_decoder`` the source and decoder-prefix pieces of an encoder-decoder call (the
encoder pass and the cross-attention cache, inside the program; the loops are the same);
``prefill`` the pieces every loop shares inside the program (the prompt pass, stopping state,
special ids); ``outputs`` the output type and transition scores; ``buckets`` the prompt-length
policies; ``compiling`` :func:`warmup` (it plans each call as ``generate`` does, then lowers
and compiles the same program) and the persistent compile cache; ``pmap`` the ``jax.pmap``
form; ``healing`` token healing, the host step before ``generate``'s program. The call flow::

    generate ─> plan.prepare ─> PreparedCall ─> entry.program(plan)(plan, params, arrays...)
    warmup   ─> plan.prepare ─> PreparedCall ─> entry.lower_program(call).compile()

Layer:
    Floor 5. May import every floor below (config, processors, stopping, cache, models,
    decoding, sharding, streaming, constraints); nothing below imports it.

Static or traced:
    Static: the model, batch size, prompt bucket, ``max_new_tokens`` (traced with
    ``max_cache_len``), ``num_beams``, ``num_return_sequences``, which processors are enabled, the
    output flags. Traced: params, the PRNG key, every sampling value, the special ids.
"""

from genjax.generation import buckets
from genjax.generation.compiling import (
    WarmupEntry,
    disable_compile_cache,
    enable_compile_cache,
    warmup,
)
from genjax.generation.entry import generate, heal_tokens
from genjax.generation.outputs import GenerateOutput, compute_transition_scores
from genjax.generation.pmap import pmap_generate

__all__ = [
    "GenerateOutput",
    "WarmupEntry",
    "buckets",
    "compute_transition_scores",
    "disable_compile_cache",
    "enable_compile_cache",
    "generate",
    "heal_tokens",
    "pmap_generate",
    "warmup",
]
