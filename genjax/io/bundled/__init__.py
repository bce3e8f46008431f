"""The models that ship inside the package, trained by ``examples/train_tiny.py``.

Two Hugging Face folders (``config.json``, ``model.safetensors``, ``tokenizer.json``,
``tokenizer_config.json``, ``generation_config.json``) live next to this file:

* ``genjax-tiny``: the default model of the ``genjax`` command, a small Llama trained on the
  Python standard library's source code (it writes Python-looking text).
* ``genjax-tiny-draft``: a much smaller model with the same tokenizer, the draft model for
  speculative decoding, distilled from ``genjax-tiny`` (trained on its next-token
  distributions) so that it proposes the target's greedy token more often.

They load with ``genjax.models.from_pretrained(genjax.io.bundled.path("genjax-tiny"))`` and with
transformers' ``AutoModelForCausalLM.from_pretrained`` on the same folder.
"""

from __future__ import annotations

import os

from genjax.errors import CheckpointError

DEFAULT_MODEL = "genjax-tiny"
DRAFT_MODEL = "genjax-tiny-draft"
NAMES = (DEFAULT_MODEL, DRAFT_MODEL)


def path(name: str = DEFAULT_MODEL) -> str:
    """Returns the folder of a bundled model.

    Args:
        name: one of ``NAMES``.

    Example:
        >>> os.path.basename(path())
        'genjax-tiny'
    """
    if name not in NAMES:
        raise ValueError(f"name must be one of {list(NAMES)}, got {name!r}.")
    folder = os.path.join(os.path.dirname(os.path.abspath(__file__)), name)
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise CheckpointError(
            f"the bundled model {name!r} is missing from {folder}; reinstall genjax, or "
            "recreate it with examples/train_tiny.py."
        )
    return folder
