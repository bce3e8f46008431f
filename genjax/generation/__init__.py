"""``generate``: validate a call, plan it, prefill, run the right decoding loop, assemble outputs.

``entry`` is :func:`generate` itself and its jitted programs; ``inputs`` validates the call and
derives its lengths and layout on the host; ``prefill`` holds the pieces every program shares
(the prompt pass, stopping state, special ids); ``outputs`` the output type and transition
scores; ``buckets`` the prompt-length policies; ``compiling`` ahead-of-time warm-up and the
persistent compile cache; ``pmap`` the ``jax.pmap`` form.

Layer:
    Floor 5. May import every floor below (config, processors, stopping, cache, models,
    decoding, sharding, streaming); nothing below imports it.

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
from genjax.generation.entry import generate
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
    "pmap_generate",
    "warmup",
]
