"""genjax: Hugging Face-compatible text generation as pure, jittable JAX functions.

Example:
    >>> import jax, genjax
    >>> model, params = genjax.models.from_pretrained(genjax.io.bundled.path())  # or a Hub id
    >>> tok = genjax.tokenizer.from_pretrained(genjax.io.bundled.path())
    >>> batch = tok(["def f():", "import os"])  # left-padded int32[B, P]
    >>> config = genjax.GenerationConfig(max_new_tokens=4, do_sample=True, temperature=0.7)
    >>> key = jax.random.key(0)
    >>> out = genjax.generate(model, params, batch["input_ids"], config,
    ...                       attention_mask=batch["attention_mask"], key=key)
    >>> out.sequences.shape  # [B, P + max_new_tokens]
    (2, 7)

Docstring examples run as doctests (``tests/test_doctests.py``); besides ``jax``, ``jnp``, ``np``
and ``genjax`` they may use ``model, params`` (the bundled ``genjax-tiny``), ``tok``, ``ids,
mask`` (``tok(["def f():", "import os"])``, int32[2, 3], left-padded), ``config`` (greedy,
``max_new_tokens=4``) and ``mesh`` (``make_mesh((2, 4))``) without defining them.

The package is built in floors, each importing only the floors below it (``tests/test_layout.py``
checks it): ``errors``/``typing``; ``config``, ``processors``, ``watermarking``, ``stopping``,
``cache``, ``kernels``; ``models``, ``decoding``, ``sharding``; ``io``, ``streaming``,
``constraints``; ``generation``, ``serving``; and this face with ``cli``. The axis letters used
in shapes are defined in :mod:`genjax.typing`.
"""

from genjax import (
    cache,
    checkpoints,
    config,
    constraints,
    decoding,
    io,
    kernels,
    models,
    processors,
    serving,
    sharding,
    stopping,
    streaming,
    tokenizer,
    watermarking,
)
from genjax.config import GenerationConfig, GenerationMode
from genjax.generation import (
    GenerateOutput,
    WarmupEntry,
    buckets,
    compute_transition_scores,
    disable_compile_cache,
    enable_compile_cache,
    generate,
    heal_tokens,
    pmap_generate,
    warmup,
)
from genjax.io import bundled
from genjax.models import quantize
from genjax.models.quantize import quantize_params

# `genjax.sharding.pmap_generate` is where the older API found it; the function belongs to the
# generation layer, which the sharding module sits below, so the face places the name there.
sharding.pmap_generate = pmap_generate

__version__ = "0.1.0"

__all__ = [
    "GenerateOutput",
    "GenerationConfig",
    "GenerationMode",
    "WarmupEntry",
    "buckets",
    "bundled",
    "cache",
    "checkpoints",
    "compute_transition_scores",
    "config",
    "constraints",
    "decoding",
    "disable_compile_cache",
    "enable_compile_cache",
    "generate",
    "heal_tokens",
    "io",
    "kernels",
    "models",
    "pmap_generate",
    "processors",
    "quantize",
    "quantize_params",
    "serving",
    "sharding",
    "stopping",
    "streaming",
    "tokenizer",
    "warmup",
    "watermarking",
]
