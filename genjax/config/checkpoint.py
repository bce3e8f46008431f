"""The generation config a checkpoint folder gives its model, found as transformers v5 finds it."""

from __future__ import annotations

import os

from genjax.config.generation_config import GenerationConfig


def checkpoint_default(folder: str | os.PathLike) -> GenerationConfig | None:
    """The generation config a model loaded from ``folder`` carries, as transformers v5 loads it.

    ``generation_config.json`` when the folder has one; else the config
    :meth:`GenerationConfig.from_model_config` derives from ``config.json`` (its token ids and
    any generation keys); else None. ``genjax.models.from_pretrained`` attaches it to the model
    (``model.generation_config``) and ``genjax.generate`` starts from it.

    Raises:
        GenerationConfigError: a ``generation_config.json`` that is malformed or holds bad values.

    Example:
        >>> import json, os, tempfile
        >>> folder = tempfile.mkdtemp()
        >>> with open(os.path.join(folder, "config.json"), "w") as f:
        ...     json.dump({"model_type": "llama", "eos_token_id": 2}, f)
        >>> checkpoint_default(folder).eos_token_id
        2
    """
    folder = os.fspath(folder)
    if os.path.isfile(os.path.join(folder, "generation_config.json")):
        return GenerationConfig.from_pretrained(folder)
    if os.path.isfile(os.path.join(folder, "config.json")):
        return GenerationConfig.from_model_config(os.path.join(folder, "config.json"))
    return None
