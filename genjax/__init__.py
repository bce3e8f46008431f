"""genjax: Hugging Face-compatible text generation as pure, jittable JAX functions.

Example:
    >>> import jax, genjax
    >>> model, params = genjax.models.from_pretrained("path/to/checkpoint")
    >>> config = genjax.GenerationConfig(max_new_tokens=32, do_sample=True, temperature=0.7)
    >>> out = genjax.generate(model, params, input_ids, config, key=jax.random.key(0))

The axis letters used in shapes throughout are defined in :mod:`genjax.typing`.
"""

from genjax import (
    buckets,
    bundled,
    checkpoints,
    models,
    processors,
    quantize,
    sharding,
    streaming,
    tokenizer,
)
from genjax.config import GenerationConfig, GenerationMode
from genjax.generate import generate
from genjax.outputs import GenerateOutput, compute_transition_scores
from genjax.quantize import quantize_params
from genjax.warmup import WarmupEntry, disable_compile_cache, enable_compile_cache, warmup

__version__ = "0.1.0"

__all__ = [
    "GenerateOutput",
    "GenerationConfig",
    "GenerationMode",
    "WarmupEntry",
    "buckets",
    "bundled",
    "checkpoints",
    "compute_transition_scores",
    "disable_compile_cache",
    "enable_compile_cache",
    "generate",
    "models",
    "processors",
    "quantize",
    "quantize_params",
    "sharding",
    "streaming",
    "tokenizer",
    "warmup",
]
