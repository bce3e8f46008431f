"""Accounting for every key of an HF ``config.json``: handled, ignored, or rejected by name."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from genjax.errors import UnsupportedError

# Keys no built-in architecture reads, because they do not change the forward pass at inference.
# They include every attribute transformers v5's ``PreTrainedConfig`` gives all configs (its
# fields, the kwargs its ``__post_init__`` pops, the special-token ids and the generation
# parameters it strips), so that any config.json saved by transformers passes.
IGNORED_KEYS = frozenset(
    {
        # Bookkeeping.
        "architectures",
        "name_or_path",
        "attn_implementation",
        "_attn_implementation",
        "experts_implementation",
        "_experts_implementation",
        "auto_map",
        "model_type",
        "transformers_version",
        "_name_or_path",
        "_model_name_or_path",  # written by transformers for a model read from GGUF
        "_commit_hash",
        "_attn_implementation_autoset",
        "torch_dtype",  # genjax takes the dtype from from_pretrained(dtype=...), float32 by default
        "dtype",
        "use_bfloat16",
        "torchscript",
        "tokenizer_class",
        "prefix",
        # Training only.
        "initializer_range",
        "attention_dropout",
        "pretraining_tp",  # sliced matmuls in transformers v4, the same math
        "tf_legacy_loss",
        "pruned_heads",
        "problem_type",
        "finetuning_task",
        "id2label",
        "label2id",
        "num_labels",
        "chunk_size_feed_forward",
        # Outputs and caching: genjax decides these itself.
        "use_cache",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "is_decoder",
        "tie_encoder_decoder",
        "cross_attention_hidden_size",
        # Token ids and generation settings: GenerationConfig reads them.
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "sep_token_id",
        "unk_token_id",
        "decoder_start_token_id",
        "task_specific_params",
        "max_length",
        "min_length",
        "do_sample",
        "early_stopping",
        "num_beams",
        "num_beam_groups",
        "diversity_penalty",
        "temperature",
        "top_k",
        "top_p",
        "typical_p",
        "repetition_penalty",
        "length_penalty",
        "no_repeat_ngram_size",
        "encoder_no_repeat_ngram_size",
        "bad_words_ids",
        "num_return_sequences",
        "output_scores",
        "return_dict_in_generate",
        "forced_bos_token_id",
        "forced_eos_token_id",
        "remove_invalid_values",
        "exponential_decay_length_penalty",
        "suppress_tokens",
        "begin_suppress_tokens",
        "encoder_repetition_penalty",
        "epsilon_cutoff",
        "eta_cutoff",
        "num_assistant_tokens",
        "num_assistant_tokens_schedule",
        "assistant_confidence_threshold",
        "assistant_lookbehind",
        "target_lookbehind",
    }
)


def _truthy(value: Any) -> bool:
    return bool(value)


def _set(value: Any) -> bool:
    return value is not None


# Keys that change the math in ways genjax does not implement: (when to reject, why). An
# architecture that implements one passes it as ``implemented`` (Phi-3's partial rotary).
REJECTED_KEYS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "quantization_config": (_set, "quantized checkpoints are not supported; use a float one"),
    "attn_logit_softcapping": (_set, "attention logit soft-capping is not implemented"),
    "final_logit_softcapping": (_set, "final logit soft-capping is not implemented"),
    "is_encoder_decoder": (_truthy, "encoder-decoder models are not supported"),
    "add_cross_attention": (_truthy, "cross-attention layers are not supported"),
    "use_mrope": (_truthy, "multimodal rope (mrope) is not supported"),
    "partial_rotary_factor": (
        lambda value: value not in (None, 1, 1.0),
        "partial rotary embeddings are not implemented",
    ),
}


def check_keys(
    config: Mapping[str, Any],
    model_type: str,
    handled: Iterable[str],
    ignored: Iterable[str] = (),
    ignore_config_keys: Iterable[str] = (),
    implemented: Iterable[str] = (),
) -> None:
    """Raises unless every key of ``config`` is handled, ignored, or acceptable.

    Args:
        config: the parsed ``config.json``.
        model_type: the architecture, for messages.
        handled: the keys the architecture reads.
        ignored: the architecture's own ignored keys, besides ``IGNORED_KEYS``.
        ignore_config_keys: keys the caller vouches for (``from_pretrained(ignore_config_keys=)``).
        implemented: keys of ``REJECTED_KEYS`` this architecture implements (not rejected).

    Raises:
        UnsupportedError: naming each rejected or unknown key.
    """
    vouched = set(ignore_config_keys)
    for key, (reject, reason) in REJECTED_KEYS.items():
        if key in config and key not in vouched | set(implemented) and reject(config[key]):
            raise UnsupportedError(f"config.json sets {key}={config[key]!r}: {reason}.")
    known = set(handled) | set(ignored) | IGNORED_KEYS | set(REJECTED_KEYS) | vouched
    unknown = sorted(set(config) - known)
    if unknown:
        raise UnsupportedError(
            f"config.json of this {model_type!r} checkpoint has key(s) {unknown} that genjax does "
            "not know; they may change the forward pass. If you are sure they do not, pass "
            f"from_pretrained(..., ignore_config_keys={unknown})."
        )


def read(config: Mapping[str, Any], key: str, defaults: Mapping[str, Any]) -> Any:
    """Returns ``config[key]`` when present (even if null), else the architecture default."""
    return config[key] if key in config else defaults[key]
