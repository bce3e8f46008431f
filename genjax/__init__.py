"""genjax: Hugging Face-compatible text generation as pure, jittable JAX functions.

Example:
    >>> import jax, genjax
    >>> model, params = genjax.models.from_pretrained("path/to/checkpoint")  # doctest: +SKIP
    >>> config = genjax.GenerationConfig(max_new_tokens=32, do_sample=True, temperature=0.7)
    >>> key = jax.random.key(0)
    >>> out = genjax.generate(model, params, input_ids, config, key=key)  # doctest: +SKIP

The package is built in floors, each importing only the floors below it (``tests/test_layout.py``
checks it): ``errors``/``typing``; ``config``, ``processors``, ``stopping``, ``cache``;
``models``, ``decoding``, ``sharding``; ``io``, ``streaming``, ``constraints``; ``generation``,
``serving``; and this face with ``cli``. The axis letters used in shapes are defined in
:mod:`genjax.typing`.
"""

from genjax import (
    cache,
    checkpoints,
    config,
    constraints,
    decoding,
    io,
    models,
    processors,
    serving,
    sharding,
    stopping,
    streaming,
    tokenizer,
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
    "io",
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
]
