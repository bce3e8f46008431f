"""genjax: Hugging Face-compatible text generation as pure, jittable JAX functions."""
