"""genjax: Hugging Face-compatible text generation as pure, jittable JAX functions.

Example:
    >>> import jax, genjax
    >>> model, params = genjax.models.from_pretrained("path/to/checkpoint")
    >>> config = genjax.GenerationConfig(max_new_tokens=32, do_sample=True, temperature=0.7)
    >>> out = genjax.generate(model, params, input_ids, config, key=jax.random.key(0))

The axis letters used in shapes throughout are defined in :mod:`genjax.typing`.
"""

from genjax import bundled, checkpoints, models, processors, sharding, streaming, tokenizer
from genjax.config import GenerationConfig, GenerationMode
from genjax.generate import generate
from genjax.outputs import GenerateOutput, compute_transition_scores

__version__ = "0.1.0"

__all__ = [
    "GenerateOutput",
    "GenerationConfig",
    "GenerationMode",
    "bundled",
    "checkpoints",
    "compute_transition_scores",
    "generate",
    "models",
    "processors",
    "sharding",
    "streaming",
    "tokenizer",
]
