"""The OpenAI wire format of ``genjax serve``: request schemas, their mapping onto the engine's
per-request options, and the text a choice shows (stop strings cut, held back while streaming).

Everything here is plain Python (pydantic models, no I/O, no threads), so it is tested without a
server. :mod:`genjax.serving.server` puts it behind HTTP.

Request fields:
    * Honoured: ``model``, ``prompt`` (a string, a list of strings, a list of token ids, or a
      list of such lists) / ``messages`` (rendered with the tokenizer's chat template),
      ``max_tokens`` / ``max_completion_tokens``, ``temperature`` (0: greedy), ``top_p``, ``n``
      (n engine requests; choice ``j`` of prompt ``i`` gets seed ``derive_seed(seed, i*n + j)``),
      ``stop``, ``seed``, ``stream``, ``stream_options.include_usage``, ``user`` (metadata), and
      the transformers names ``top_k``, ``min_p``, ``repetition_penalty``.
    * vLLM's ``min_tokens`` (EOS and ``stop_token_ids`` blocked before that many tokens: the
      engine's ``min_new_tokens``), ``stop_token_ids`` (ids that end a choice as EOS does,
      finish reason "stop"), ``ignore_eos`` (the model's EOS ids end nothing; ``stop_token_ids``
      still do; refused with structured output, which ends at EOS),
      ``bad_words`` (strings, banned as token sequences: :func:`bad_words_ids`),
      ``include_stop_str_in_output`` (the text keeps the stop string, or the EOS or stop token,
      that ended it; by default, as in vLLM, it does not) and ``skip_special_tokens`` (default
      true: special tokens are left out of the text), ``truncate_prompt_tokens`` (each
      prompt's last ``k`` tokens, chat template included; -1: the server's context;
      :func:`truncated`).
    * OpenAI's ``presence_penalty`` and ``frequency_penalty`` (each in ``[-2, 2]``; counted over
      the generated tokens only, :func:`genjax.processors.count_penalties`) and ``logit_bias``
      (token-id strings to biases in ``[-100, 100]``, added to the logits first, as
      transformers' one-token ``sequence_bias``; ids must be in the vocabulary).
    * Log-probabilities: chat's ``logprobs: true`` with ``top_logprobs`` (0 to 20), completions'
      ``logprobs`` (0 to 5), answered in OpenAI's shapes (:mod:`genjax.serving.logprobs`). The
      values are the model's raw log-probabilities, ``log_softmax`` of its logits before any
      processor (penalties, bias, temperature, top-k/top-p), as vLLM reports by default.
    * Structured output (:mod:`genjax.serving.guided`): OpenAI's ``response_format``
      (``{"type": "text"}``, ``{"type": "json_object"}``, ``{"type": "json_schema",
      "json_schema": {"name", "schema", "strict", "description"}}``) and vLLM's ``guided_json``
      (a schema), ``guided_regex`` and ``guided_choice`` (a list of strings); one per request.
    * Accepted only at their neutral value, else 400 naming the field (the engine cannot honour
      them): ``echo`` (false), ``best_of`` (null or 1), ``suffix`` (null); chat's ``tools``
      (null or empty: tool calling is not supported), ``tool_choice`` (null, "none" or "auto"),
      ``store`` (false) and ``service_tier`` (null, "auto" or "default"). Chat's
      ``parallel_tool_calls`` is accepted: with no tools it has nothing to act on.
    * Chat content parts other than text (images, audio, files): 400 naming the part.
    * Any other field (``top_logprobs`` on completions among them): 400 naming it.

Fields a request leaves unset take the model's ``generation_config.json`` values (as
transformers' and vLLM's servers do), so ``temperature`` unset means the checkpoint's sampling
settings, not OpenAI's ``temperature=1``, and ``stop`` unset or empty means its
``stop_strings`` (the engine stops on them and the text ends before them; a request's ``stop``
replaces them). Two
exceptions follow vLLM: a sampling cutoff (``top_p`` below 1, ``top_k`` or ``min_p`` above 0)
without ``temperature`` samples even when the checkpoint decodes greedily, at the checkpoint's
temperature (default 1), since a cutoff means nothing to greedy decoding; and a
``temperature`` below :data:`SAMPLING_EPS` decodes greedily.
"""

from __future__ import annotations

import math
import re
import secrets
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from genjax.config import GenerationConfig
from genjax.processors.ngram import bias_pairs
from genjax.serving.options import bias_entries
from genjax.typing import INT32_MAX

__all__ = [
    "APIError",
    "ChatRequest",
    "CompletionRequest",
    "derive_seed",
    "engine_options",
    "generation_options",
    "parse_request",
]

MAX_STOP_STRINGS = 4
MAX_STOP_LENGTH = 256
_SEED_MODULUS = 2**31 - 1


class APIError(Exception):
    """An error answered in OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers or {}

    def body(self) -> dict[str, Any]:
        """The JSON body."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


SAMPLING_EPS = 1e-5
"""A ``temperature`` below this decodes greedily (vLLM's rule: dividing the logits by less
would overflow float32 and draw the most likely token anyway)."""


def invalid(param: str, message: str, code: str = "invalid_value") -> APIError:
    """A 400 naming ``param``."""
    return APIError(400, message, param=param, code=code)


# ---------------------------------------------------------------------------- schemas


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool | None = None


class JsonSchemaFormat(_Strict):
    """``response_format.json_schema``: OpenAI's named schema (``strict`` is accepted; the
    output always follows the schema)."""

    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """OpenAI's ``response_format``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _Sampling(_Strict):
    """The fields completions and chat share."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Extras under their transformers names.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    # vLLM's extras for the end of a choice.
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    truncate_prompt_tokens: int | None = None
    # OpenAI's, honoured by the engine.
    logit_bias: dict[str, float] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # Structured output: OpenAI's, and vLLM's extra fields (genjax.serving.guided).
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None


class CompletionRequest(_Sampling):
    """``POST /v1/completions``."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    # OpenAI's, accepted at values that ask for nothing this server lacks (see _neutral).
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    store: bool | None = None
    service_tier: str | None = None


_TYPE_TAG = re.compile(r"str|int|bool|float|none|[A-Z]\w*|.*\[.*")


def parse_request(kind: type[_Sampling], data: Any) -> _Sampling:
    """Validates a decoded JSON body; a 400 naming the first bad field otherwise.

    Example:
        >>> parse_request(CompletionRequest, {"model": "m", "prompt": "Hi"}).prompt
        'Hi'
        >>> parse_request(CompletionRequest, {"model": "m", "prompt": "Hi", "x": 1})
        Traceback (most recent call last):
        genjax.serving.protocol.APIError: unknown field 'x': this server does not accept it.
    """
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(data).__name__}.")
    if kind is ChatRequest:
        _check_content_parts(data.get("messages"))
    try:
        return kind.model_validate(data)
    except ValidationError as error:
        first = error.errors()[0]
        # A union reports each member's failure under the member's type; name the field.
        param = ".".join(str(p) for p in first["loc"] if not _TYPE_TAG.fullmatch(str(p)))
        if first["type"] == "extra_forbidden":
            message = f"unknown field {param!r}: this server does not accept it."
            raise invalid(param, message, "unknown_field") from None
        if first["type"] == "missing":
            raise invalid(param, f"{param!r} is required.", "missing_field") from None
        shown = repr(first.get("input"))
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        raise invalid(param, f"{param}: {first['msg']} (got {shown}).") from None


def _check_content_parts(messages: Any) -> None:
    """A 400 naming a content part that is not text (an image, audio or a file): this server
    serves text-only models. Anything else malformed is left to the schema's message."""
    for i, message in enumerate(messages if isinstance(messages, list) else ()):
        parts = message.get("content") if isinstance(message, dict) else None
        for j, part in enumerate(parts if isinstance(parts, list) else ()):
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind != "text":
                raise invalid(
                    f"messages.{i}.content.{j}.type",
                    f"content parts of type {kind!r} are not supported: this server serves "
                    f"text-only models. Send the content as a string or as parts of type "
                    f"'text'.",
                    "unsupported_value",
                )


def messages_as_dicts(request: ChatRequest) -> list[dict[str, Any]]:
    """The chat messages as the template sees them (content parts joined into one string)."""
    out = []
    for message in request.messages:
        content = message.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        entry: dict[str, Any] = {"role": message.role, "content": content or ""}
        if message.name is not None:
            entry["name"] = message.name
        out.append(entry)
    return out


# ---------------------------------------------------------------------------- options


def _neutral(request: _Sampling) -> None:
    """400 for a field the engine cannot honour, when set to anything but its neutral value."""
    engine = "the continuous-batching engine cannot honour it"
    checks = [
        ("echo", lambda v: v in (None, False), engine, "leave it unset"),
        ("best_of", lambda v: v in (None, 1), engine, "leave it unset"),
        ("suffix", lambda v: v is None, engine, "leave it unset"),
        ("tools", lambda v: not v, "it calls no tools", "leave tools unset or empty"),
        (
            "tool_choice",
            lambda v: v in (None, "none", "auto"),
            "it calls no tools, so no call can be required",
            'leave it unset, "none" or "auto"',
        ),
        ("store", lambda v: v in (None, False), "it stores no completions", "leave it unset"),
        (
            "service_tier",
            lambda v: v in (None, "auto", "default"),
            "it has one tier",
            'leave it unset, "auto" or "default"',
        ),
    ]
    for name, ok, why, fix in checks:
        if name in type(request).model_fields and not ok(getattr(request, name)):
            raise invalid(
                name,
                f"{name}={getattr(request, name)!r} is not supported by this server: {why}; {fix}.",
                "unsupported_field",
            )


def _number(name: str, value: float | None, low: float, high: float, low_open: bool = False):
    if value is None:
        return
    bad = not math.isfinite(value) or value > high or (value <= low if low_open else value < low)
    if bad:
        side = "(" if low_open else "["
        raise invalid(name, f"{name} must be in {side}{low}, {high}], got {value!r}.")


def generation_options(
    request: _Sampling,
    base: GenerationConfig,
    max_n: int,
    *,
    vocab_size: int | None = None,
    max_logit_bias: int = 300,
) -> tuple[GenerationConfig, int | None, int, tuple[str, ...]]:
    """Checks a request's sampling fields and maps them onto a generation config.

    ``logit_bias`` becomes the config's ``sequence_bias`` (one-token sequences, after the base
    config's own, which a request's entry for the same token replaces). The fields the config
    has no place for are mapped by :func:`engine_options`.

    Args:
        request: a parsed :class:`CompletionRequest` or :class:`ChatRequest`.
        base: the model's generation config (fields the request leaves unset keep its values).
        max_n: the largest ``n`` the server can ever hold at once.
        vocab_size: ``logit_bias`` ids must be below it (None: not checked).
        max_logit_bias: the most ``logit_bias`` entries the engine holds per request.

    Returns:
        ``(config, max_tokens, n, stop)``: the config for every choice (``max_new_tokens`` not
        set: the caller fits it to each prompt), the requested token budget or None, the number
        of choices per prompt, the stop strings.

    Raises:
        APIError: 400 naming the first invalid or unsupported field.

    Example:
        >>> body = parse_request(CompletionRequest, {"model": "m", "prompt": "Hi", "n": 2,
        ...                                          "temperature": 0, "stop": "\\n"})
        >>> config, max_tokens, n, stop = generation_options(body, GenerationConfig(), 8)
        >>> config.do_sample, max_tokens, n, stop
        (False, None, 2, ('\\n',))
    """
    _neutral(request)
    bias = _logit_bias(request.logit_bias, vocab_size, max_logit_bias)
    _number("temperature", request.temperature, 0.0, 100.0)
    _number("top_p", request.top_p, 0.0, 1.0, low_open=True)
    _number("min_p", request.min_p, 0.0, 1.0)
    _number("repetition_penalty", request.repetition_penalty, 0.0, 100.0, low_open=True)
    for name in ("top_p", "repetition_penalty"):
        if getattr(request, name) is not None and np.float32(getattr(request, name)) == 0:
            value = getattr(request, name)
            raise invalid(name, f"{name}={value!r} is 0 in float32; use at least 1e-30.")
    if request.top_k is not None and not 0 <= request.top_k <= INT32_MAX:
        raise invalid("top_k", f"top_k must be in [0, {INT32_MAX}] (0: off), got {request.top_k}.")
    n = 1 if request.n is None else request.n
    if not 1 <= n <= max_n:
        raise invalid("n", f"n must be between 1 and {max_n} on this server, got {n}.")
    max_tokens, param = request.max_tokens, "max_tokens"
    if isinstance(request, ChatRequest) and request.max_completion_tokens is not None:
        max_tokens, param = request.max_completion_tokens, "max_completion_tokens"
    if max_tokens is not None and max_tokens < 1:
        raise invalid(param, f"{param} must be at least 1, got {max_tokens}.")
    if request.stream_options is not None and not request.stream:
        raise invalid("stream_options", "stream_options is only allowed with stream: true.")
    # stop unset or empty: the checkpoint's stop strings, which the engine stops on and the
    # text ends before, as the request's own (a config cannot say "none" over the checkpoint's)
    own = base.stop_strings or ()
    stop = _stop_strings(request.stop) or ((own,) if isinstance(own, str) else tuple(own))

    fields: dict[str, Any] = {"stop_strings": None, "max_new_tokens": None, "max_length": None}
    for name in ("top_p", "top_k", "min_p", "repetition_penalty"):
        if getattr(request, name) is not None:
            fields[name] = getattr(request, name)
    fields.update(_end_fields(request, base, vocab_size))
    if request.temperature is not None:
        sampled = request.temperature >= SAMPLING_EPS
        fields["do_sample"] = sampled
        if sampled:
            fields["temperature"] = request.temperature
    elif not base.do_sample and _cuts(request):
        fields["do_sample"] = True  # a cutoff is a request to sample (vLLM: temperature 1)
    if not fields.get("do_sample", base.do_sample):
        # Greedy: the sampling cutoffs would only draw "ignored flag" warnings.
        fields.update(do_sample=False, temperature=None, top_p=None, top_k=None, min_p=None)
    if bias:
        own = bias_pairs(base.sequence_bias) if base.sequence_bias else []
        merged = {tuple(ids): b for ids, b in own}
        merged.update(((i,), b) for i, b in bias.items())
        fields["sequence_bias"] = [[list(ids), b] for ids, b in merged.items()]
    config = base.replace(**fields)
    if bias:
        _check_bias_room(config, len(bias), max_logit_bias)
    return config, max_tokens, n, stop


def _end_fields(request: _Sampling, base: GenerationConfig, vocab_size: int | None) -> dict:
    """The config fields of vLLM's ``min_tokens``, ``stop_token_ids`` and ``ignore_eos`` (see
    the module docstring), or a 400 naming the bad one."""
    fields: dict[str, Any] = {}
    if request.min_tokens is not None:
        if not 0 <= request.min_tokens <= INT32_MAX:
            message = f"min_tokens must be in [0, {INT32_MAX}], got {request.min_tokens}."
            raise invalid("min_tokens", message)
        fields["min_new_tokens"] = request.min_tokens
    stop_ids = list(dict.fromkeys(request.stop_token_ids or ()))
    top = INT32_MAX if vocab_size is None else vocab_size - 1
    bad = [i for i in stop_ids if not 0 <= i <= top]
    if bad:
        message = f"stop_token_ids holds {bad[0]}, outside the vocabulary [0, {top}]."
        raise invalid("stop_token_ids", message)
    if request.ignore_eos and _constrained(request):
        raise invalid(
            "ignore_eos",
            "ignore_eos cannot be combined with structured output: a constrained choice ends "
            "at the model's EOS once its text is complete. Leave ignore_eos unset.",
        )
    if request.ignore_eos or stop_ids:
        own = base.eos_token_id
        eos = [] if request.ignore_eos or own is None else np.atleast_1d(own).tolist()
        eos = list(dict.fromkeys([*(int(i) for i in eos), *stop_ids]))
        fields["eos_token_id"] = eos  # empty: no EOS (None would take the model's back)
    return fields


def bad_words_ids(words: list[str] | None, encode) -> list[list[int]]:
    """vLLM's ``bad_words`` as ``bad_words_ids``: each word's tokens as it would begin a text,
    and, where a leading space spells it with as many tokens but another first one, as it
    would follow a space (vLLM's rule); ``encode``: ``text -> ids`` without special tokens.

    Raises:
        APIError: 400 naming ``bad_words`` for an entry with no tokens.

    Example:
        >>> table = {"cat": [5], " cat": [9], "a b": [1, 2], " a b": [3, 2]}
        >>> bad_words_ids(["cat", " a b"], table.get)
        [[5], [9], [1, 2], [3, 2]]
    """
    out: list[list[int]] = []
    for word in words or ():
        bare = list(encode(word.lstrip()) or ())
        if not bare:
            raise invalid("bad_words", f"bad_words entry {word!r} has no tokens.")
        out.append(bare)
        spaced = list(encode(" " + word.lstrip()) or ())
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            out.append(spaced)
    return out


def truncated(rows: list[list[int]], keep: int | None, context: int) -> list[list[int]]:
    """vLLM's ``truncate_prompt_tokens``: each prompt's last ``keep`` tokens (-1: ``context``,
    the server's tokens per request); None leaves them whole.

    Raises:
        APIError: 400 naming ``truncate_prompt_tokens`` when it is neither -1 nor positive.

    Example:
        >>> truncated([[1, 2, 3], [4]], 2, 8), truncated([[1, 2, 3]], -1, 2)
        ([[2, 3], [4]], [[2, 3]])
    """
    if keep is None:
        return rows
    if keep != -1 and keep < 1:
        message = f"truncate_prompt_tokens must be -1 (the context) or at least 1, got {keep}."
        raise invalid("truncate_prompt_tokens", message)
    return [ids[-(context if keep == -1 else keep) :] for ids in rows]


def _constrained(request: _Sampling) -> bool:
    """Whether the request asks for structured output."""
    guided = (request.guided_json, request.guided_regex, request.guided_choice)
    formatted = request.response_format is not None and request.response_format.type != "text"
    return formatted or any(value is not None for value in guided)


def _cuts(request: _Sampling) -> bool:
    """Whether the request sets a sampling cutoff that changes the distribution drawn from."""
    return (request.top_p is not None and request.top_p < 1) or bool(request.top_k or request.min_p)


def _check_bias_room(config: GenerationConfig, asked: int, most: int):
    """A 400 naming ``logit_bias`` when it and the checkpoint's own biased and banned tokens
    together pass the engine's ``most`` per request."""
    own = len(bias_entries(config)) - asked
    if own + asked > most:
        raise invalid(
            "logit_bias",
            f"logit_bias holds {asked} tokens and the model's generation config biases or bans "
            f"{own} more; this server holds at most {most} per request. Send at most "
            f"{max(most - own, 0)} logit_bias entries.",
        )


def _logit_bias(bias: dict[str, float] | None, vocab_size: int | None, most: int):
    """``{token_id: bias}`` from OpenAI's ``logit_bias``, or a 400 naming it."""
    out: dict[int, float] = {}
    if len(bias or {}) > most:
        raise invalid("logit_bias", f"logit_bias holds at most {most} tokens, got {len(bias)}.")
    for key, value in (bias or {}).items():
        token = int(key) if key.isascii() and key.isdigit() else -1
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            top = "" if vocab_size is None else f" below {vocab_size}"
            raise invalid(
                "logit_bias", f"logit_bias keys must be token ids (\"0\" to a number{top}), got "
                f"{key!r}.",
            )  # fmt: skip
        if not (math.isfinite(value) and -100 <= value <= 100):
            raise invalid("logit_bias", f"logit_bias values must be in [-100, 100], got {value!r}.")
        out[token] = float(value)
    return out


def engine_options(request: _Sampling, max_top_logprobs: int = 20) -> dict[str, Any]:
    """Checks the fields ``GenerationConfig`` has no place for and maps them onto
    ``add_request``'s keywords (:class:`~genjax.serving.options.EngineOptions`).

    Args:
        request: a parsed :class:`CompletionRequest` or :class:`ChatRequest`.
        max_top_logprobs: the most top log-probabilities the engine returns per token.

    Returns:
        ``{"presence_penalty", "frequency_penalty", "logprobs"}``; ``logprobs`` is None (none
        asked) or how many top log-probabilities each token carries.

    Raises:
        APIError: 400 naming the field: a penalty outside ``[-2, 2]``, chat ``top_logprobs``
            outside 0..20 or without ``logprobs: true``, completions ``logprobs`` outside 0..5.

    Example:
        >>> body = parse_request(ChatRequest, {"model": "m", "messages": [{"role": "user",
        ...     "content": "Hi"}], "logprobs": True, "top_logprobs": 2, "presence_penalty": 1})
        >>> engine_options(body)
        {'presence_penalty': 1.0, 'frequency_penalty': 0.0, 'logprobs': 2}
    """
    for name in ("presence_penalty", "frequency_penalty"):
        _number(name, getattr(request, name), -2.0, 2.0)
    chat = isinstance(request, ChatRequest)
    name, most = ("top_logprobs", 20) if chat else ("logprobs", 5)
    most, count = min(most, max_top_logprobs), getattr(request, name)
    if count is not None and not 0 <= count <= most:
        raise invalid(name, f"{name} must be between 0 and {most}, got {count}.")
    if chat:
        if count and not request.logprobs:
            raise invalid(name, "top_logprobs needs logprobs: true.")
        count = (count or 0) if request.logprobs else None
    return {
        "presence_penalty": float(request.presence_penalty or 0.0),
        "frequency_penalty": float(request.frequency_penalty or 0.0),
        "logprobs": count,
    }


def _stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    stops = () if stop is None else (stop,) if isinstance(stop, str) else tuple(stop)
    if len(stops) > MAX_STOP_STRINGS:
        raise invalid("stop", f"stop holds at most {MAX_STOP_STRINGS} strings, got {len(stops)}.")
    for s in stops:
        if not s or len(s) > MAX_STOP_LENGTH:
            raise invalid(
                "stop", f"each stop string needs 1 to {MAX_STOP_LENGTH} characters, got {s!r}."
            )
    return stops


def derive_seed(seed: int | None, index: int) -> int:
    """The engine seed of choice ``index``: ``seed`` itself for the first (so ``n=1`` and the
    first of ``n=2`` agree), spread by a large odd constant for the others; a random base when
    ``seed`` is None. Always in ``[0, 2**31 - 1)``, as the engine's int32 seed needs.

    Example:
        >>> derive_seed(7, 0), derive_seed(7, 0) == derive_seed(7, 0)
        (7, True)
    """
    if seed is None:
        seed = secrets.randbelow(_SEED_MODULUS)
    return (seed + index * 0x9E3779B1) % _SEED_MODULUS
