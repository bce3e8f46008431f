"""``GenerationConfig``: transformers' generation settings as a frozen, validated JAX pytree.

Every field of transformers v5 ``GenerationConfig`` is here with the same name, default and
meaning, and ``generation_config.json`` files are read and written in the same format, so a
checkpoint's file works unchanged in both libraries. As in v5, almost every field defaults to
``None``; ``with_defaults()`` fills the ``None`` fields from ``DEFAULT_GENERATION_PARAMS`` (v5's
``_get_default_generation_params()``), and ``genjax.generate`` calls it first.

Static or traced:
    A config is a pytree. Its *traced* fields (``TRACED_FIELDS``) are the numbers a user changes
    between calls: sampling strengths and cutoffs, penalties, special token ids, the assistant
    confidence threshold and ``max_time``. Everything else (lengths, ``num_beams``,
    ``num_return_sequences``, ``do_sample``, output flags, token lists such as ``bad_words_ids``...)
    is *static*: it shapes the compiled program and lives in the treedef.

    A traced field is a pytree leaf only when it is *active*: not ``None`` and not equal to its
    neutral value (``NEUTRAL_VALUES``: ``temperature=1.0``, ``top_k=0``, ``top_p=1.0``...). An
    inactive traced field stays in the treedef as a plain Python value. Whether a processor runs is
    thus part of the program while its strength is an argument: under ``jax.jit``, temperature
    0.7 -> 0.8 reuses the compiled program, while 1.0 -> 0.7 compiles once more (a new treedef).

Leaf representation (what a traced function sees):
    * Python floats and ints stay Python scalars; inside a trace they are weakly typed float32 /
      int32 scalars, so they never promote bfloat16 logits. An int in a float field (``"top_p": 1``
      in a file) becomes a Python float leaf, so a float field is always float32 when traced.
    * A list of token ids (``eos_token_id=[2, 32000]``, also ``forced_eos_token_id`` and
      ``decoder_start_token_id``) becomes ONE ``np.int32`` array leaf of shape ``[E]``; ``E`` is
      static. A single int id stays a scalar int leaf.
    * Arrays are allowed for per-row settings, e.g. ``temperature=jnp.array([0.5, 1.0])`` (shape
      ``[B]``); an array is always active.
    Unflattening never validates, so tracers flow through ``jit``/``vmap``/``scan`` unchanged.

Differences from transformers, on purpose:
    * Frozen: ``replace(**kw)`` and ``update(**kw)`` return new configs. The constructor takes only
      known fields plus ``extra=``; unknown keys of a file or of ``from_dict``/``from_pretrained``
      kwargs are kept in ``extra`` (readable as attributes) and written back.
    * Bad values raise ``GenerationConfigError`` at construction, naming the field, the value, the
      allowed range and a fix. v5's warnings become ``UserWarning`` (errors with ``strict=True``).
    * genjax always returns a ``GenerateOutput``, so v5's warning about ``output_*`` flags without
      ``return_dict_in_generate`` is not raised; ``return_dict_in_generate`` is kept for files.
    * ``compile_config`` and ``watermarking_config`` are stored as plain mappings (a transformers
      ``WatermarkingConfig`` becomes its ``to_dict()``); genjax does not use ``compile_config``
      (torch only) and, like v5, does not save it. ``watermarking_config`` is checked and run by
      :func:`genjax.processors.watermark` (a SynthID config raises ``UnsupportedError``).

Layer:
    Floor 2. Imports only :mod:`genjax.errors`; ``fields`` declares the fields, ``checks``
    validates them, ``files`` reads and writes JSON, ``generation_config`` is the class,
    ``checkpoint`` finds the config a checkpoint folder gives its model.
"""

from genjax.config.checkpoint import checkpoint_default
from genjax.config.fields import (
    DEFAULT_GENERATION_PARAMS,
    NEUTRAL_VALUES,
    TRACED_FIELDS,
    TRANSFORMERS_VERSION,
    GenerationMode,
)
from genjax.config.generation_config import GenerationConfig

__all__ = [
    "DEFAULT_GENERATION_PARAMS",
    "NEUTRAL_VALUES",
    "TRACED_FIELDS",
    "TRANSFORMERS_VERSION",
    "GenerationConfig",
    "GenerationMode",
    "checkpoint_default",
]
