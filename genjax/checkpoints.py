"""``genjax.checkpoints``: the public name of :mod:`genjax.io.checkpoints` (orbax checkpoints)."""

from genjax.io.checkpoints import (
    LAYOUT,
    LAYOUT_FILE,
    PARAMS_DIR,
    TOKENIZER_FILES,
    convert,
    is_checkpoint,
    restore,
    save,
)

__all__ = [
    "LAYOUT",
    "LAYOUT_FILE",
    "PARAMS_DIR",
    "TOKENIZER_FILES",
    "convert",
    "is_checkpoint",
    "restore",
    "save",
]
