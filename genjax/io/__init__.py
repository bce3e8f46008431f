"""Files around a model: orbax checkpoints, tokenizers and chat templates, the bundled models.

``checkpoints`` writes and restores orbax folders (and registers them with
:func:`genjax.models.from_pretrained`), ``tokenizer`` reads ``tokenizer.json`` and renders chat
templates (``gguf_tokenizer`` builds one from a GGUF file's metadata), ``bundled`` locates the
models that ship inside the package.

Layer:
    Floor 4. May import the floors below: ``config``, ``models``, ``sharding`` and the rest.

Static or traced:
    Nothing here is traced: these functions run on the host, before or after ``jit``.
"""

from genjax.io import bundled, checkpoints, gguf_tokenizer, tokenizer

__all__ = ["bundled", "checkpoints", "gguf_tokenizer", "tokenizer"]
