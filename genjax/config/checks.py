"""Private validation for ``genjax.config.GenerationConfig``.

One table (``SPECS``) says, for every field, which kind of value it holds and the allowed range.
``normalize`` canonicalizes a value (NumPy scalars to Python, lists to tuples, dicts to
``FrozenDict``); ``check_field`` raises ``GenerationConfigError`` for a bad value;
``check_combinations`` raises for combinations that crash or silently misbehave; ``minor_issues``
lists the combinations that transformers v5 only warns about. Tracers are never inspected: they
pass every check.
"""

from __future__ import annotations

import dataclasses
import difflib
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from genjax.config.fields import FIELD_NAMES
from genjax.config.files import FrozenDict, freeze, is_array, is_tracer
from genjax.errors import GenerationConfigError
from genjax.typing import INT32_MAX

Predicate = Callable[[np.ndarray], Any]


@dataclasses.dataclass(frozen=True)
class Spec:
    """How one field is checked.

    Attributes:
        kind: the value kind (see ``_TYPE_CHECKS`` and ``check_field``).
        rule: the allowed range in words, e.g. ``"in [0, 1]"``; empty when any value goes.
        ok: elementwise predicate on ``np.asarray(value)`` implementing ``rule``.
        fix: advice appended to the error message.
        choices: allowed values for kind ``"choice"``.
    """

    kind: str
    rule: str = ""
    ok: Predicate | None = None
    fix: str = ""
    choices: tuple[Any, ...] = ()


def _ge(lo: float) -> Predicate:
    return lambda a: a >= lo


def _gt(lo: float) -> Predicate:
    return lambda a: a > lo


def _within(lo: float, hi: float, lo_open: bool = False, hi_open: bool = False) -> Predicate:
    return lambda a: ((a > lo) if lo_open else (a >= lo)) & ((a < hi) if hi_open else (a <= hi))


_FINITE = ("finite", np.isfinite)
_NONNEG = (">= 0", _ge(0))
_POS = (">= 1", _ge(1))
_UNIT = ("in [0, 1]", _within(0.0, 1.0))

CACHE_IMPLEMENTATIONS = (
    "static",
    "offloaded_static",
    "sliding_window",
    "hybrid",
    "hybrid_chunked",
    "offloaded_hybrid",
    "offloaded_hybrid_chunked",
    "dynamic",
    "offloaded",
    "quantized",
    "paged",
)
# Arguments of transformers' ``generate`` that users sometimes put in a config by mistake.
GENERATE_ARGUMENTS = (
    "logits_processor",
    "stopping_criteria",
    "prefix_allowed_tokens_fn",
    "synced_gpus",
    "assistant_model",
    "streamer",
    "negative_prompt_ids",
    "negative_prompt_attention_mask",
)


def _s(kind: str, rule_ok: tuple[str, Predicate] | None = None, fix: str = "", **kw: Any) -> Spec:
    rule, ok = rule_ok if rule_ok else ("", None)
    return Spec(kind, rule, ok, fix, **kw)


SPECS: dict[str, Spec] = {
    "max_length": _s("int", _NONNEG, "It counts the prompt too; prefer max_new_tokens."),
    "max_new_tokens": _s("int", _POS, "Pass the number of tokens to generate, e.g. 64."),
    "min_length": _s("int", _NONNEG),
    "min_new_tokens": _s("int", _NONNEG),
    "early_stopping": _s("early_stopping", fix="Pass True, False or 'never'."),
    "max_time": _s("tfloat", ("> 0 (seconds)", _gt(0.0))),
    "stop_strings": _s("stop_strings"),
    "do_sample": _s("bool"),
    "num_beams": _s("int", _POS, "Use 1 for greedy or sampling, more for beam search."),
    "use_mtp": _s("bool"),
    "use_cache": _s("bool"),
    "cache_implementation": _s("choice", choices=CACHE_IMPLEMENTATIONS),
    "cache_config": _s("mapping"),
    "max_cache_len": _s("int", _POS),
    "temperature": _s(
        "tfloat",
        (">= 0 (and > 0 when do_sample=True)", _ge(0.0)),
        "Use a positive value such as 0.7 to sample, or do_sample=False for greedy decoding.",
    ),
    "top_k": _s("tint", _NONNEG, "Use 0 to disable top-k filtering."),
    "top_p": _s("tfloat", _UNIT, "Use 1.0 to disable top-p (nucleus) filtering."),
    "min_p": _s("tfloat", _UNIT, "Typical values are 0.01-0.2; None disables min-p filtering."),
    "top_h": _s("tfloat", ("in (0, 1]", _within(0.0, 1.0, lo_open=True))),
    "typical_p": _s("tfloat", ("in (0, 1]", _within(0.0, 1.0, lo_open=True)), "1.0 disables it."),
    "epsilon_cutoff": _s(
        "tfloat", ("in [0, 1)", _within(0.0, 1.0, hi_open=True)), "0 disables it."
    ),
    "eta_cutoff": _s("tfloat", ("in [0, 1)", _within(0.0, 1.0, hi_open=True)), "0 disables it."),
    "repetition_penalty": _s("tfloat", ("> 0", _gt(0.0)), "Use 1.0 for no penalty."),
    "encoder_repetition_penalty": _s("tfloat", ("> 0", _gt(0.0)), "Use 1.0 for no penalty."),
    "length_penalty": _s("tfloat", _FINITE),
    "no_repeat_ngram_size": _s("int", _NONNEG, "Use 0 to disable it."),
    "bad_words_ids": _s("token_lists"),
    "renormalize_logits": _s("bool"),
    "forced_bos_token_id": _s("token", _NONNEG),
    "forced_eos_token_id": _s("tokens", _NONNEG),
    "remove_invalid_values": _s("bool"),
    "exponential_decay_length_penalty": _s("decay"),
    "suppress_tokens": _s("token_list"),
    "begin_suppress_tokens": _s("token_list"),
    "sequence_bias": _s("sequence_bias"),
    "token_healing": _s("bool"),
    "guidance_scale": _s("tfloat", _FINITE),
    "watermarking_config": _s("mapping"),
    "num_return_sequences": _s("int", _POS),
    "output_attentions": _s("bool"),
    "output_hidden_states": _s("bool"),
    "output_scores": _s("bool"),
    "output_logits": _s("bool"),
    "return_dict_in_generate": _s("bool"),
    "pad_token_id": _s("token"),
    "bos_token_id": _s("token", _NONNEG),
    "eos_token_id": _s("tokens", _NONNEG),
    "encoder_no_repeat_ngram_size": _s("int", _NONNEG),
    "decoder_start_token_id": _s("tokens", _NONNEG),
    "is_assistant": _s("bool"),
    "num_assistant_tokens": _s("int", _POS),
    "num_assistant_tokens_schedule": _s(
        "choice", choices=("heuristic", "heuristic_transient", "constant")
    ),
    "assistant_confidence_threshold": _s("tfloat", _UNIT),
    "prompt_lookup_num_tokens": _s("int", _POS),
    "max_matching_ngram_size": _s("int", _POS),
    "assistant_early_exit": _s("int", _POS),
    "assistant_lookbehind": _s("int", _NONNEG),
    "target_lookbehind": _s("int", _NONNEG),
    "assistant_ensemble_weight": _s(
        "float",
        ("in (0, 1)", _within(0.0, 1.0, lo_open=True, hi_open=True)),
        "Use None for standard (lossless) speculative decoding.",
    ),
    "speculation_type": _s("str"),
    "compile_config": _s("mapping"),
    "disable_compile": _s("bool"),
    "continuous_batching_config": _s("mapping"),
    "low_memory": _s("bool"),
    "penalty_alpha": _s("float", _NONNEG),
    "dola_layers": _s("dola_layers"),
    "diversity_penalty": _s("float", _FINITE),
    "num_beam_groups": _s("int", _POS),
    "constraints": _s("any"),
    "force_words_ids": _s("any"),
    "prefill_chunk_size": _s("int", _POS),
    "_from_model_config": _s("bool"),
    "transformers_version": _s("str"),
}

TRACED_KINDS = frozenset({"tfloat", "tint", "token", "tokens"})
_STATIC_SCALARS = frozenset({"bool", "int", "float", "str", "choice"})


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _as_tuple(value: Any) -> Any:
    if isinstance(value, list | tuple):
        return tuple(freeze(item) for item in value)
    if isinstance(value, np.ndarray) and value.ndim == 1:
        return tuple(value.tolist())
    return value


def _normalize_sequence_bias(value: Any) -> Any:
    """Dict ``{(ids...): bias}`` or list ``[[ids, bias], ...]`` -> ``((ids, bias), ...)``."""
    pairs = value.items() if isinstance(value, Mapping) else value
    if not isinstance(pairs, list | tuple) and not isinstance(value, Mapping):
        return value
    out = []
    for pair in pairs:
        if not isinstance(pair, list | tuple) or len(pair) != 2:
            return freeze(value)
        ids, bias = pair
        ids = _as_tuple(ids)
        out.append((ids, bias.item() if isinstance(bias, np.generic) else bias))
    return tuple(out)


def normalize(name: str, value: Any) -> Any:
    """Canonical stored form of a field value; malformed values are returned for the check to name.

    Example:
        >>> normalize("eos_token_id", [1, 2])
        (1, 2)
    """
    if value is None or is_tracer(value):
        return value
    kind = SPECS[name].kind
    if isinstance(value, np.generic):
        value = value.item()
    if kind in _STATIC_SCALARS and is_array(value) and np.ndim(value) == 0:
        return np.asarray(value).item()
    if kind == "tokens":
        return _as_tuple(value) if isinstance(value, list | tuple) else value
    if kind in ("token_list", "stop_strings", "decay", "dola_layers"):
        return _as_tuple(value)
    if kind == "token_lists":
        return tuple(_as_tuple(ids) for ids in value) if isinstance(value, list | tuple) else value
    if kind == "sequence_bias":
        return _normalize_sequence_bias(value)
    if kind == "mapping" and not isinstance(value, Mapping) and hasattr(value, "to_dict"):
        return freeze(value.to_dict())
    if kind in ("mapping", "any"):
        return freeze(value)
    return value


def _error(name: str, value: Any, expected: str, fix: str = "") -> GenerationConfigError:
    fix = fix or "Pass a value that satisfies this, or None to use the default."
    return GenerationConfigError(
        f"GenerationConfig.{name}={value!r} is invalid: {name} must be {expected}. {fix}"
    )


def _array_ok(value: Any, dtype_kinds: str) -> bool:
    return np.asarray(value).dtype.kind in dtype_kinds and np.ndim(value) <= 1


def _check_ints(ids: Any, *, nonempty: bool = False) -> bool:
    if not isinstance(ids, tuple) or (nonempty and not ids):
        return False
    return all(_is_int(i) and i >= 0 for i in ids)


def _sequence_bias_ok(value: Any) -> bool:
    if not isinstance(value, tuple) or not value:
        return False
    return all(
        isinstance(p, tuple)
        and _check_ints(p[0], nonempty=True)
        and _is_number(p[1])
        and not np.isnan(p[1])
        for p in value
    )


# kind -> (predicate on the normalized value, the expected type in words)
_TYPE_CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "bool": (lambda v: isinstance(v, bool), "a bool"),
    "int": (_is_int, "an int"),
    "float": (_is_number, "a float"),
    "str": (lambda v: isinstance(v, str), "a str"),
    "tfloat": (
        lambda v: _is_number(v) or (is_array(v) and _array_ok(v, "fiu")),
        "a float or a numeric array of shape [B]",
    ),
    "tint": (
        lambda v: _is_int(v) or (is_array(v) and _array_ok(v, "iu")),
        "an int or an integer array of shape [B]",
    ),
    "token": (
        lambda v: _is_int(v) or (is_array(v) and _array_ok(v, "iu")),
        "an int token id (or an integer array of shape [B])",
    ),
    "tokens": (
        lambda v: (
            _is_int(v)
            or (isinstance(v, tuple) and all(_is_int(i) for i in v))
            or (is_array(v) and _array_ok(v, "iu"))
        ),
        "an int token id or a list of int token ids",
    ),
    "token_list": (lambda v: _check_ints(v), "a list of token ids >= 0"),
    "token_lists": (
        lambda v: (
            isinstance(v, tuple) and bool(v) and all(_check_ints(i, nonempty=True) for i in v)
        ),
        "a non-empty list of non-empty lists of token ids >= 0, e.g. [[5], [6, 7]]",
    ),
    "early_stopping": (lambda v: isinstance(v, bool) or v == "never", "True, False or 'never'"),
    "stop_strings": (
        lambda v: (
            (isinstance(v, str) and bool(v))
            or (isinstance(v, tuple) and bool(v) and all(isinstance(s, str) and s for s in v))
        ),
        "a non-empty string or a non-empty list of non-empty strings",
    ),
    "sequence_bias": (
        _sequence_bias_ok,
        "a non-empty list of [token_ids, bias] pairs, no bias NaN (or a dict "
        "{tuple(token_ids): bias})",
    ),
    "decay": (
        lambda v: (
            isinstance(v, tuple)
            and len(v) == 2
            and _is_int(v[0])
            and v[0] >= 0
            and _is_number(v[1])
            and np.isfinite(v[1])
        ),
        "a pair (start_index >= 0, a finite decay_factor)",
    ),
    "dola_layers": (
        lambda v: v in ("low", "high") or _check_ints(v),
        "'low', 'high' or a list of layer indices",
    ),
    "mapping": (lambda v: isinstance(v, FrozenDict), "a dict"),
    "any": (lambda v: True, "anything"),
}


_KIND_FIXES = {
    "token": "Token ids are non-negative integers: pass e.g. 2, not 2.0 or '2'.",
    "tokens": "Token ids are non-negative integers: pass e.g. 2 or [2, 32000], not 2.0.",
    "tfloat": "Pass a Python number (e.g. 0.7) or an array with one value per row.",
}


def check_field(name: str, value: Any) -> None:
    """Raises ``GenerationConfigError`` when ``value`` (already normalized) is not allowed.

    Example:
        >>> check_field("top_p", 0.9)  # fine
    """
    if value is None:
        return
    spec = SPECS[name]
    if is_tracer(value):
        if spec.kind in TRACED_KINDS:
            return
        raise _error(
            name,
            value,
            "a concrete Python value",
            f"{name} is static (it shapes the compiled program), so it cannot be traced; "
            "pass it as a Python value outside jit.",
        )
    if spec.kind == "choice":
        if value not in spec.choices:
            raise _error(name, value, f"one of {spec.choices}")
        return
    type_ok, expected = _TYPE_CHECKS[spec.kind]
    if not type_ok(value):
        rule = f", with values {spec.rule}" if spec.rule else ""
        raise _error(name, value, expected + rule, spec.fix or _KIND_FIXES.get(spec.kind, ""))
    if spec.ok is not None and not _range_ok(spec.ok, value):
        raise _error(name, value, spec.rule, spec.fix)
    if spec.kind == "tfloat" and spec.ok is not None and not _range_ok(spec.ok, _float32(value)):
        raise _error(name, value, f"{spec.rule} in float32, the precision the logits use", spec.fix)
    ids = tuple(p[0] for p in value) if spec.kind == "sequence_bias" else value
    if spec.kind in _ID_KINDS and any(i > INT32_MAX for i in _ints(ids)):
        raise _error(name, value, "token ids below 2**31 (int32)", _KIND_FIXES["tokens"])


_ID_KINDS = ("token", "tokens", "token_list", "token_lists", "sequence_bias")


def _float32(value: Any) -> np.ndarray:
    """``value`` as the float32 the program holds (overflow becomes inf, quietly)."""
    with np.errstate(over="ignore"):
        return np.asarray(value, np.float64).astype(np.float32)


def _ints(value: Any) -> list[int]:
    """Every integer in a token-id value (an id, an array, lists of lists)."""
    if is_array(value):
        return [int(i) for i in np.ravel(np.asarray(value))]
    if isinstance(value, tuple):
        return [i for item in value for i in _ints(item)]
    return [value] if _is_int(value) else []


def _range_ok(ok: Predicate, value: Any) -> bool:
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 2**63:
        # past int64 numpy makes an object array: compare the Python int itself
        try:
            return bool(ok(value))
        except TypeError:
            return False
    array = np.asarray(value)
    if array.dtype.kind not in "fiub":
        return False
    return bool(np.all(ok(array)))


def _concrete(value: Any) -> bool:
    return value is not None and not is_tracer(value)


def check_combinations(cfg: Any) -> None:
    """Raises ``GenerationConfigError`` for combinations of fields that cannot work together."""
    temperature = cfg.temperature
    if cfg.do_sample is True and _concrete(temperature) and not np.all(_float32(temperature) > 0):
        raise _error(
            "temperature",
            temperature,
            "> 0 when do_sample=True (in float32: sampling divides the logits by it)",
            "Pass a positive temperature such as 0.7, or set do_sample=False for greedy decoding.",
        )
    n = cfg.num_return_sequences
    if n is not None and n > 1:
        if cfg.num_beams is None or cfg.num_beams == 1:
            if not cfg.do_sample:
                raise _error(
                    "num_return_sequences",
                    n,
                    "1 with greedy decoding (do_sample is not True and num_beams=1)",
                    "Greedy decoding returns one sequence per prompt; set do_sample=True to draw "
                    "several samples, or num_beams >= num_return_sequences for beam search.",
                )
        elif n > cfg.num_beams:
            raise _error(
                "num_return_sequences",
                n,
                f"<= num_beams ({cfg.num_beams}) in beam search",
                f"Set num_beams >= {n} or num_return_sequences <= {cfg.num_beams}.",
            )
    _check_forced_not_suppressed(cfg)
    for key in cfg.extra:
        if key in GENERATE_ARGUMENTS:
            raise GenerationConfigError(
                f"{key!r} is an argument of generate(), not a GenerationConfig field. Pass it to "
                "generate() directly and remove it from the config."
            )


def _check_forced_not_suppressed(cfg: Any) -> None:
    if cfg.suppress_tokens is None:
        return
    suppressed = set(cfg.suppress_tokens)
    for name in ("forced_bos_token_id", "forced_eos_token_id"):
        forced = getattr(cfg, name)
        if not _concrete(forced):
            continue
        forced_set = set(np.atleast_1d(np.asarray(forced)).tolist())
        if forced_set and forced_set <= suppressed:
            raise GenerationConfigError(
                f"Every token in GenerationConfig.{name}={forced!r} is also in suppress_tokens, so "
                "all logits would be -inf at the forcing step and generation would produce nan. "
                f"Remove the overlap from {name} or suppress_tokens (to delay EOS, use "
                "min_new_tokens instead)."
            )


def _should_warn(outer: str, inner: str, user_set: frozenset[str] | None) -> bool:
    """v5 rule: warn unless only the outer flag (do_sample / num_beams) was set by the caller."""
    if user_set is None:
        return True
    return not (outer in user_set and inner not in user_set)


def _set_and_not(value: Any, neutral: Any) -> bool:
    """True when ``value`` is set and (if concrete and scalar) differs from ``neutral``."""
    if value is None:
        return False
    if is_tracer(value) or is_array(value) or neutral is None:
        return True
    return value != neutral


_SAMPLING_ONLY = (
    ("temperature", 1.0),
    ("top_p", 1.0),
    ("min_p", None),
    ("top_h", None),
    ("typical_p", 1.0),
    ("top_k", 50),
    ("epsilon_cutoff", 0.0),
    ("eta_cutoff", 0.0),
)


def minor_issues(cfg: Any, user_set: frozenset[str] | None) -> dict[str, str]:
    """Issues that transformers v5 only warns about, keyed by field name.

    ``user_set`` names the fields the caller set explicitly; ``None`` counts every field as set.
    """
    issues: dict[str, str] = {}
    pad = cfg.pad_token_id
    if _concrete(pad) and np.any(np.asarray(pad) < 0):
        issues["pad_token_id"] = (
            f"pad_token_id={pad!r} is negative, which breaks batched generation with padding. "
            "Set it to a real token id (often the EOS id)."
        )
    if cfg.do_sample is not True:
        for name, neutral in _SAMPLING_ONLY:
            value = getattr(cfg, name)
            if _set_and_not(value, neutral) and _should_warn("do_sample", name, user_set):
                issues[name] = (
                    f"do_sample is not True, but {name}={value!r} is set; it is only used when "
                    f"sampling. Set do_sample=True or unset {name}."
                )
    if cfg.num_beams is None or cfg.num_beams == 1:
        for name, neutral in (("early_stopping", False), ("length_penalty", 1.0)):
            value = getattr(cfg, name)
            if _set_and_not(value, neutral) and _should_warn("num_beams", name, user_set):
                issues[name] = (
                    f"num_beams is {cfg.num_beams}, but {name}={value!r} is set; it is only used "
                    f"by beam search. Set num_beams > 1 or unset {name}."
                )
    if cfg.use_cache is False:
        for name in ("cache_implementation", "cache_config"):
            if getattr(cfg, name) is not None:
                issues[name] = f"use_cache is False, so {name} has no effect. Unset one of them."
    return issues


def unknown_field_message(name: str) -> str:
    close = difflib.get_close_matches(name, FIELD_NAMES, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return (
        f"GenerationConfig has no field {name!r}.{hint} To keep a custom key, use "
        f"config.updated({name}=..., allow_custom_entries=True)."
    )


def immutable_update_message(args: tuple, kwargs: dict) -> str:
    """Why ``GenerationConfig.update`` refuses: ported v5 code would keep the old config."""
    given = ", ".join([*map(repr, args), *(f"{k}={v!r}" for k, v in kwargs.items())])
    return (
        f"GenerationConfig is immutable (a pytree): update({given}) cannot change it in place "
        f"as transformers' update does. Use config = config.replace({given}) for a new config, "
        f"or config, unused = config.updated({given}) for the new config and the unused kwargs "
        f"(what transformers' update returns)."
    )


def warn_minor(issues: dict[str, str]) -> None:
    lines = "\n".join(f"- {name}: {text}" for name, text in issues.items())
    warnings.warn(
        f"GenerationConfig flags that may be ignored: {sorted(issues)}\n{lines}\n"
        "These may come from a model's generation_config.json.",
        UserWarning,
        stacklevel=4,
    )
