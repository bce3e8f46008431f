"""Checks that an assisted call can run, made before anything is traced."""

from __future__ import annotations

from genjax.errors import InputError, UnsupportedError


def is_assisted(config, assistant_model=None) -> bool:
    """Whether a call runs assisted generation: an assistant model, or prompt lookup."""
    return assistant_model is not None or config.prompt_lookup_num_tokens is not None


def check_config(config, assistant_model=None) -> None:
    """Raises UnsupportedError for config options assisted generation cannot run with.

    Args:
        config: the resolved :class:`~genjax.GenerationConfig` of an assisted call.
        assistant_model: the draft model, or None for prompt lookup.

    Raises:
        UnsupportedError: beam search (as transformers), ``num_return_sequences > 1`` (as
            transformers), ``assistant_early_exit`` or ``use_mtp``.
        InputError: both a draft and ``prompt_lookup_num_tokens``.

    Example:
        >>> check_config(genjax.GenerationConfig(prompt_lookup_num_tokens=4).with_defaults())
    """
    what = "prompt lookup" if assistant_model is None else "assisted generation"
    if config.num_beams > 1:
        raise UnsupportedError(
            f"{what} cannot be combined with beam search (num_beams={config.num_beams}), as in "
            f"transformers. Set num_beams=1, or drop the assistant / prompt_lookup_num_tokens."
        )
    if config.num_return_sequences > 1:
        raise UnsupportedError(
            f"{what} returns one sequence per prompt, as in transformers; got "
            f"num_return_sequences={config.num_return_sequences}. Repeat the prompts instead."
        )
    for name in ("assistant_early_exit", "use_mtp"):
        if getattr(config, name):
            raise UnsupportedError(
                f"generation option `{name}={getattr(config, name)!r}` is not supported by "
                f"genjax yet. Pass a draft model as assistant_model= instead."
            )
    if assistant_model is not None and config.prompt_lookup_num_tokens is not None:
        raise InputError(
            f"got both assistant_model= and prompt_lookup_num_tokens="
            f"{config.prompt_lookup_num_tokens}; candidates come from one source. Drop one."
        )


def check_call(config, model, assistant_model, assistant_params, batch: int) -> None:
    """Raises a clear error for an assisted call genjax cannot run, before anything is traced:
    :func:`check_config`, then the checks that need the models.

    Args:
        config: the resolved :class:`~genjax.GenerationConfig`.
        model: the target model; assistant_model, assistant_params: the draft and its params
            (None for prompt lookup).
        batch: ``B``.

    Raises:
        UnsupportedError: see :func:`check_config`; a sliding-window target with ``B > 1``.
        InputError: a draft without params, or whose vocabulary differs from the target's.

    Example:
        >>> check_call(config.with_defaults(), model, model, None, batch=2)
        Traceback (most recent call last):
        genjax.errors.InputError: assistant_model= needs its parameters: pass assistant_params= too.
    """
    check_config(config, assistant_model)
    windows = getattr(getattr(model, "config", None), "sliding_windows", ()) or ()
    if batch > 1 and any(w is not None for w in windows):
        how = "speculative decoding" if assistant_model is not None else "prompt lookup"
        raise UnsupportedError(
            f"{how} with a sliding-window target ({sorted(set(windows) - {None})}) needs batch "
            f"size 1: with more rows the cache holds holes, which a window counted in cache "
            f"slots would see. Run one prompt at a time."
        )
    if assistant_model is None:
        return
    if assistant_params is None:
        raise InputError("assistant_model= needs its parameters: pass assistant_params= too.")
    if assistant_model.vocab_size != model.vocab_size:
        raise InputError(
            f"the assistant's vocabulary has {assistant_model.vocab_size} tokens but the "
            f"target's has {model.vocab_size}; speculative decoding needs the same tokenizer "
            f"and vocabulary (universal assisted generation is not supported). Use a draft "
            f"trained with the target's tokenizer."
        )
