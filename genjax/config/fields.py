"""The fields of ``GenerationConfig``: transformers v5's names and defaults, and which are traced.

``GenerationFields`` declares every field once, with a comment giving static (S) or traced (T),
the type and the allowed values; :class:`genjax.config.GenerationConfig` adds validation, the
pytree split and the JSON files on top of it.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any

from genjax.config.files import FrozenDict

TRANSFORMERS_VERSION = "5.24.0"
"""The transformers release whose ``generation_config.json`` format genjax reads and writes; written
as ``transformers_version`` when a config was not loaded from a file that already names one."""

DEFAULT_GENERATION_PARAMS: dict[str, Any] = {
    "max_length": 20,
    "min_length": 0,
    "do_sample": False,
    "use_cache": True,
    "early_stopping": False,
    "num_beams": 1,
    "temperature": 1.0,
    "top_k": 50,
    "top_p": 1.0,
    "typical_p": 1.0,
    "repetition_penalty": 1.0,
    "length_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0,
    "bad_words_ids": None,
    "num_return_sequences": 1,
    "output_scores": False,
    "return_dict_in_generate": False,
    "forced_bos_token_id": None,
    "forced_eos_token_id": None,
    "remove_invalid_values": False,
    "exponential_decay_length_penalty": None,
    "suppress_tokens": None,
    "begin_suppress_tokens": None,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
    "encoder_repetition_penalty": 1.0,
    "num_assistant_tokens": 20,
    "num_assistant_tokens_schedule": "constant",
    "assistant_confidence_threshold": 0.4,
    "assistant_lookbehind": 10,
    "target_lookbehind": 10,
    "num_beam_groups": 1,
    "diversity_penalty": 0.0,
}
"""Values of unset fields at generate time; equal to v5's ``_get_default_generation_params()``."""

TRACED_FIELDS: tuple[str, ...] = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "top_h",
    "typical_p",
    "epsilon_cutoff",
    "eta_cutoff",
    "repetition_penalty",
    "encoder_repetition_penalty",
    "length_penalty",
    "guidance_scale",
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
    "forced_bos_token_id",
    "forced_eos_token_id",
    "decoder_start_token_id",
    "assistant_confidence_threshold",
    "max_time",
)
"""Fields that become pytree leaves when active (see the module docstring)."""

NEUTRAL_VALUES: dict[str, float] = {
    "temperature": 1.0,
    "top_k": 0,
    "top_p": 1.0,
    "typical_p": 1.0,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
    "repetition_penalty": 1.0,
    "encoder_repetition_penalty": 1.0,
    "guidance_scale": 1.0,
}
"""Values at which a traced field has no effect, so it stays static. Others: only ``None``."""

METADATA_FIELDS = ("_from_model_config", "transformers_version")

Float = Any  # float, or an array of shape [B] (traced fields)
TokenIds = Any  # int, tuple of ints, or an int array (traced fields)


class GenerationMode(str, enum.Enum):
    """The decoding strategy a config selects; values equal transformers' ``GenerationMode``."""

    CONTRASTIVE_SEARCH = "contrastive_search"
    GREEDY_SEARCH = "greedy_search"
    SAMPLE = "sample"
    ASSISTED_GENERATION = "assisted_generation"
    DOLA_GENERATION = "dola_generation"
    BEAM_SEARCH = "beam_search"
    BEAM_SAMPLE = "beam_sample"
    CONSTRAINED_BEAM_SEARCH = "constrained_beam_search"
    GROUP_BEAM_SEARCH = "group_beam_search"


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class GenerationFields:
    """Every field of transformers v5 ``GenerationConfig``, with its default (``None``: unset)."""

    # Length of the output.
    max_length: int | None = None  # S; >= 0; prompt + new tokens
    max_new_tokens: int | None = None  # S; >= 1
    min_length: int | None = None  # S; >= 0; prompt + new tokens
    min_new_tokens: int | None = None  # S; >= 0
    early_stopping: bool | str | None = None  # S; True, False or "never" (beam search)
    max_time: Float = None  # T; float32 scalar, seconds > 0
    stop_strings: str | tuple[str, ...] | None = None  # S
    # Strategy.
    do_sample: bool | None = None  # S
    num_beams: int | None = None  # S; >= 1
    use_mtp: bool | None = None  # S
    # Cache.
    use_cache: bool | None = None  # S
    cache_implementation: str | None = None  # S; one of v5's names
    cache_config: Mapping[str, Any] | None = None  # S
    max_cache_len: int | None = None  # S; >= 1
    # Logits processing.
    temperature: Float = None  # T; float32 scalar or [B]; > 0 when sampling
    top_k: Any = None  # T; int32 scalar or [B]; >= 0 (0 disables)
    top_p: Float = None  # T; float32 scalar or [B]; in [0, 1]
    min_p: Float = None  # T; float32 scalar or [B]; in [0, 1]
    top_h: Float = None  # T; float32 scalar or [B]; in (0, 1]
    typical_p: Float = None  # T; float32 scalar or [B]; in (0, 1]
    epsilon_cutoff: Float = None  # T; float32 scalar or [B]; in [0, 1)
    eta_cutoff: Float = None  # T; float32 scalar or [B]; in [0, 1)
    repetition_penalty: Float = None  # T; float32 scalar or [B]; > 0
    encoder_repetition_penalty: Float = None  # T; float32 scalar or [B]; > 0
    length_penalty: Float = None  # T; float32 scalar or [B] (beam scores / length**p)
    no_repeat_ngram_size: int | None = None  # S; >= 0
    bad_words_ids: tuple[tuple[int, ...], ...] | None = None  # S
    renormalize_logits: bool | None = None  # S
    forced_bos_token_id: TokenIds = None  # T; int32 scalar
    forced_eos_token_id: TokenIds = None  # T; int32 scalar or [E]
    remove_invalid_values: bool | None = None  # S
    exponential_decay_length_penalty: tuple[int, float] | None = None  # S; (start, factor)
    suppress_tokens: tuple[int, ...] | None = None  # S
    begin_suppress_tokens: tuple[int, ...] | None = None  # S
    sequence_bias: tuple[tuple[tuple[int, ...], float], ...] | None = None  # S; ((ids, bias),)
    token_healing: bool | None = None  # S
    guidance_scale: Float = None  # T; float32 scalar or [B]
    watermarking_config: Mapping[str, Any] | None = None  # S
    # Outputs.
    num_return_sequences: int | None = None  # S; >= 1
    output_attentions: bool | None = None  # S
    output_hidden_states: bool | None = None  # S
    output_scores: bool | None = None  # S
    output_logits: bool | None = None  # S
    return_dict_in_generate: bool | None = None  # S; kept for files, genjax ignores it
    # Special tokens.
    pad_token_id: TokenIds = None  # T; int32 scalar
    bos_token_id: TokenIds = None  # T; int32 scalar
    eos_token_id: TokenIds = None  # T; int32 scalar, or int32[E] for a list
    # Encoder-decoder models.
    encoder_no_repeat_ngram_size: int | None = None  # S; >= 0
    decoder_start_token_id: TokenIds = None  # T; int32 scalar or [B]
    # Assisted generation.
    is_assistant: bool | None = None  # S
    num_assistant_tokens: int | None = None  # S; >= 1
    num_assistant_tokens_schedule: str | None = None  # S; heuristic[_transient] or constant
    assistant_confidence_threshold: Float = None  # T; float32 scalar; in [0, 1]
    prompt_lookup_num_tokens: int | None = None  # S; >= 1
    max_matching_ngram_size: int | None = None  # S; >= 1
    assistant_early_exit: int | None = None  # S; >= 1
    assistant_lookbehind: int | None = None  # S; >= 0
    target_lookbehind: int | None = None  # S; >= 0
    assistant_ensemble_weight: float | None = None  # S; in (0, 1)
    speculation_type: str | None = None  # S
    # Performance (torch only; kept for files).
    compile_config: Mapping[str, Any] | None = None  # S; never saved, as in v5
    disable_compile: bool | None = None  # S
    # Deprecated in transformers; kept so that files round-trip.
    continuous_batching_config: Mapping[str, Any] | None = None  # S
    low_memory: bool | None = None  # S
    penalty_alpha: float | None = None  # S; >= 0 (contrastive search)
    dola_layers: str | tuple[int, ...] | None = None  # S
    diversity_penalty: float | None = None  # S
    num_beam_groups: int | None = None  # S; >= 1
    constraints: Any = None  # S
    force_words_ids: Any = None  # S
    prefill_chunk_size: int | None = None  # S; >= 1
    # Metadata (ignored by ==, hash and generation).
    _from_model_config: bool | None = None  # S; True when built from a model's config.json
    transformers_version: str | None = None  # S; written back unchanged when loaded from a file
    extra: Mapping[str, Any] = dataclasses.field(default_factory=FrozenDict)  # S; unknown keys
    _user_set: dataclasses.InitVar[frozenset[str] | None] = None  # fields set by the caller


FIELD_NAMES: tuple[str, ...] = tuple(
    f.name for f in dataclasses.fields(GenerationFields) if f.name != "extra"
)
"""Every field's name, in declaration order (``extra`` aside)."""
