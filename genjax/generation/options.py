"""Generation options that genjax refuses, and those that are deliberately inert.

An option that is accepted and changes nothing is the worst defect a port can have: the user
believes they got what they asked for. So every ``GenerationConfig`` field either changes what
``generate`` does, or raises :class:`~genjax.errors.UnsupportedError` naming it
(:func:`check_options`, called by the call plan before anything is traced), or is listed in
:data:`INERT` with the reason it cannot change the tokens, or in :data:`OTHER_MODES` with the
mode it acts in. ``tests/test_options.py`` walks every field and fails on one without a
decision.
"""

from __future__ import annotations

import inspect

from genjax.config import GenerationConfig
from genjax.errors import UnsupportedError

INERT: dict[str, str] = {
    # Metadata and files.
    "_from_model_config": "metadata: marks a config derived from config.json",
    "transformers_version": "metadata: the version that wrote the file",
    "return_dict_in_generate": "genjax always returns a GenerateOutput",
    "compile_config": "torch.compile settings; genjax programs are always jitted",
    "disable_compile": "torch.compile switch; genjax programs are always jitted",
    "continuous_batching_config": "deprecated in transformers; serving has its own config",
    "is_assistant": "marks a draft model's own config; read by nothing in generate",
    "bos_token_id": "transformers uses it only to start a prompt-less generation; generate "
    "always takes input_ids (forced_bos_token_id forces a first token)",
    "decoder_start_token_id": "encoder-decoder models only (their decoder's first token: "
    "tests/test_encdec_generate.py); transformers ignores it for decoder-only models",
    # Outputs besides the tokens (tested where they are built).
    "output_scores": "adds GenerateOutput.scores; the tokens are the same",
    "output_logits": "adds GenerateOutput.logits; the tokens are the same",
    "output_hidden_states": "adds GenerateOutput.hidden_states (encoder-decoder models: "
    "encoder_hidden_states, decoder_hidden_states); the tokens are the same "
    "(tests/test_hidden_states.py, tests/test_encoder_decoder_outputs.py); raises where "
    "genjax does not record them (check_forward_outputs)",
    "output_attentions": "adds GenerateOutput.attentions (encoder-decoder models: "
    "encoder_attentions, decoder_attentions, cross_attentions); the tokens are the same "
    "(tests/test_hidden_states.py, tests/test_encoder_decoder_outputs.py); raises where "
    "genjax does not record them (check_forward_outputs)",
    # Same tokens by design.
    "use_cache": "genjax always decodes through its KV cache (same tokens; see generate)",
    "prefill_chunk_size": "the prompt is prefilled in chunks of this size: the same tokens "
    "(tests/test_options.py checks the chunks and the scores)",
    "prompt_lookup_num_tokens": "prompt lookup decoding: the model verifies the candidates, so "
    "greedy tokens equal plain greedy decoding's (tests/test_assisted.py)",
    # Ignored by transformers v5 in the modes where genjax also ignores it.
    "low_memory": "deprecated; transformers ignores it except in beam search, where genjax "
    "raises as transformers does",
    "diversity_penalty": "used only by group beam search (num_beam_groups > 1), which genjax "
    "refuses; transformers ignores it in every other mode",
    "num_beam_groups": "only with num_beams > 1 (group beam search, refused); with "
    "num_beams=1 transformers decodes greedily and ignores it",
    "assistant_ensemble_weight": "used only by assisted generation with a draft model, where "
    "genjax raises; transformers ignores it without one",
    "speculation_type": "selects a speculative decoder only with an assistant model, where "
    "genjax raises; transformers ignores it without one",
}
"""Fields whose value cannot change the tokens, with the reason."""

OTHER_MODES: dict[str, str] = {
    "max_time": "a wall-clock limit: it stops a call that runs too long (tests/test_stopping.py)",
    "stop_strings": "needs the tokenizer= argument (tests/test_stopping.py)",
    "token_healing": "needs the tokenizer= argument: the prompt's last token is healed on the "
    "host before the program (tests/test_token_healing.py)",
    "early_stopping": "beam search only (tests/test_beam.py); transformers ignores it otherwise",
    "length_penalty": "beam search only (tests/test_beam.py); transformers ignores it otherwise",
    "num_assistant_tokens": "assisted generation only (tests/test_assisted.py): ignored by "
    "transformers without an assistant",
    "num_assistant_tokens_schedule": "assisted generation only (tests/test_assisted.py): "
    "ignored by transformers without an assistant",
    "assistant_confidence_threshold": "assisted generation only (tests/test_assisted.py): "
    "ignored by transformers without an assistant",
    "max_matching_ngram_size": "prompt lookup only (tests/test_assisted.py): ignored by "
    "transformers without prompt_lookup_num_tokens",
    "assistant_lookbehind": "universal assisted generation only (different tokenizers), "
    "which genjax refuses; transformers ignores it otherwise",
    "target_lookbehind": "universal assisted generation only (different tokenizers), which "
    "genjax refuses; transformers ignores it otherwise",
}
"""Fields that act only in a mode or with an argument a plain greedy call lacks (an assistant,
beams, a tokenizer, a slow clock), where they are tested, as named; inert elsewhere, as in
transformers."""

FORWARD_OUTPUTS = ("output_hidden_states", "output_attentions")
"""The flags that record the model's forward pass at every step (:func:`check_forward_outputs`)."""
_NEEDS_OWN_DRAFT = ("assistant_early_exit", "use_mtp")


def check_options(config: GenerationConfig, assistant_model, assisted: bool) -> None:
    """Raises UnsupportedError for a set option genjax would otherwise ignore.

    Args:
        config: the call's resolved config.
        assistant_model: the draft model, or None.
        assisted: whether the call runs assisted generation (a draft or prompt lookup).

    Raises:
        UnsupportedError: ``assistant_early_exit`` / ``use_mtp`` (the model drafting for
            itself, from an early layer or multi-token heads; transformers runs assisted
            generation with them);
            with assisted generation, ``assistant_ensemble_weight`` and ``speculation_type``
            (another acceptance rule and another drafter than standard speculative decoding).

    Example:
        >>> check_options(GenerationConfig(output_scores=True), None, False)  # passes
    """
    for name in _NEEDS_OWN_DRAFT:
        value = getattr(config, name)
        if value is not None and value is not False:
            raise UnsupportedError(
                f"generation option `{name}={value!r}` (the model drafting for itself) is not "
                f"supported by genjax yet; transformers would run assisted generation. Unset "
                f"{name}, or pass a separate draft model as assistant_model=."
            )
    if not assisted:
        return
    if config.assistant_ensemble_weight is not None:
        raise UnsupportedError(
            f"generation option `assistant_ensemble_weight={config.assistant_ensemble_weight!r}`"
            f" (ensemble verification of the draft) is not supported by genjax yet, and "
            f"transformers rejects it with prompt lookup. Unset it for standard (lossless) "
            f"speculative decoding."
        )
    if config.speculation_type is not None:
        raise UnsupportedError(
            f"generation option `speculation_type={config.speculation_type!r}` is not supported "
            f"by genjax: it runs standard speculative decoding with the draft model only. Unset "
            f"speculation_type."
        )


def check_forward_outputs(
    config: GenerationConfig, model, *, assisted: bool, encoder_decoder: bool
) -> None:
    """Raises UnsupportedError for ``output_hidden_states`` / ``output_attentions`` in a call
    genjax does not record them in, naming the option and what it is combined with.

    They are recorded for models whose ``apply`` takes the flags (the built-in ones,
    encoder-decoder models included: transformers' ``encoder_*``, ``decoder_*`` and
    ``cross_attentions`` fields), in greedy decoding, sampling, beam search and beam sampling,
    on one device or a mesh (their rows on ``batch``), with the prompt prefilled in one pass (an
    encoder-decoder model's decoder prefix always is). ``max_cache_len`` is refused with them
    for every model; what an encoder-decoder call refuses anyway (assisted generation:
    :func:`genjax.generation.encoder_decoder.check_request`) is refused here first, naming the
    flag.

    Args:
        config: the call's resolved config.
        model: the model.
        assisted: whether the call runs assisted generation.
        encoder_decoder: whether ``model`` is an encoder-decoder model.

    Example:
        >>> check_forward_outputs(GenerationConfig(), model, assisted=False,
        ...                       encoder_decoder=False)  # passes: no flag set
    """
    asked = [name for name in FORWARD_OUTPUTS if getattr(config, name)]
    if not asked:
        return
    refused = []
    if not _takes_output_flags(model):
        refused.append(
            f"{type(model).__name__}, whose apply() takes no output_hidden_states / "
            f"output_attentions keywords (see the model protocol in genjax.models)"
        )
    if assisted:
        refused.append("assisted generation (a draft model or prompt_lookup_num_tokens)")
    if config.max_cache_len is not None:
        refused.append("max_cache_len")
    if config.prefill_chunk_size is not None and not encoder_decoder:
        refused.append("prefill_chunk_size")
    if refused:
        flags = " and ".join(f"`{name}=True`" for name in asked)
        raise UnsupportedError(
            f"generation option {flags} is not supported by genjax with "
            f"{'; '.join(refused)}: it records them in greedy decoding, sampling and beam "
            f"search, on one device or a mesh, with the prompt prefilled in one pass. "
            f"Unset {' and '.join(asked)} or drop the combination."
        )


def _takes_output_flags(model) -> bool:
    """Whether ``model.apply`` takes the protocol's ``output_hidden_states`` and
    ``output_attentions`` keywords."""
    try:
        parameters = inspect.signature(model.apply).parameters
    except (TypeError, ValueError):  # no introspectable signature
        return False
    return all(name in parameters for name in FORWARD_OUTPUTS)
