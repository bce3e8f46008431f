"""What a served request's choices show and how they go back over the wire: each choice's text
with stop strings cut (:class:`StopText`), its counts (:func:`usage`), the server-sent events of a
stream (:func:`stream_chunk`, :func:`choice_delta`) and a whole response (:func:`final_body`), in
OpenAI's shapes.

Plain Python (no I/O, no threads), so it is tested without a server; :mod:`genjax.serving.server`
sends what it builds.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Any

import numpy as np

from genjax.serving.logprobs import ChoiceLogprobs

__all__ = [
    "Choice",
    "StopText",
    "choice_delta",
    "final_body",
    "make_choices",
    "stream_chunk",
    "usage",
]


class StopText:
    """The text one choice shows, from its tokens so far: stop strings cut (the stop string is
    not shown), and, while streaming, the tail that could be the start of a stop string held
    back, as is an unfinished UTF-8 character.

    Args:
        decode: ``ids -> text``.
        stops: the stop strings.
        keep_stop: show the stop string found (vLLM's ``include_stop_str_in_output``).

    Example:
        >>> text = StopText(lambda ids: "".join(map(chr, ids)), ("END",))
        >>> text.advance([ord(c) for c in "abcE"], final=False)  # "E" might start "END"
        'abc'
        >>> text.advance([ord(c) for c in "abcEND!"], final=False), text.stopped
        ('', True)
        >>> text.text
        'abc'
    """

    def __init__(self, decode, stops: tuple[str, ...], keep_stop: bool = False):
        self.decode, self.stops, self.keep_stop = decode, stops, keep_stop
        self.text = ""  # everything shown so far
        self.stopped = False  # a stop string was found

    def advance(self, ids: list[int], final: bool) -> str:
        """The new text to show after ``ids`` (all tokens so far); ``final``: nothing follows."""
        if self.stopped:
            return ""
        text = self.decode(ids)
        found = [(i, n) for n, i in enumerate(text.find(s) for s in self.stops) if i >= 0]
        if found:  # the earliest, and the first listed of those found there
            cut, n = min(found)
            end = cut + len(self.stops[n]) if self.keep_stop else cut
            text, final, self.stopped = text[:end], True, True
        if not final:
            text = text.rstrip("\ufffd")  # a multi-byte character still being written
            text = text[: len(text) - self._held(text)]
        if len(text) <= len(self.text) or not text.startswith(self.text):
            return ""
        delta, self.text = text[len(self.text) :], text
        return delta

    def _held(self, text: str) -> int:
        """The length of the longest tail of ``text`` that begins some stop string."""
        held = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(text)), held, -1):
                if text.endswith(stop[:k]):
                    held = k
                    break
        return held


@dataclasses.dataclass
class Choice:
    """One engine request of an HTTP request: its choice index and text."""

    index: int
    request_id: str
    prompt: int  # the index of its prompt
    prompt_tokens: int
    text: StopText
    tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    scores: ChoiceLogprobs | None = None  # when the request asked for log-probabilities
    stop_ids: frozenset[int] = frozenset()  # the ids that end it (EOS, stop_token_ids)
    keep_stop: bool = False  # show the token or string that ended it

    def shown(self, output) -> list[int]:
        """The tokens of an engine output whose text the choice shows: all of them, but the
        EOS or stop token that ended it (as vLLM, unless ``include_stop_str_in_output``)."""
        ids = output.generated_tokens
        ended = output.is_finished() and output.finish_reason == "stop"
        if ended and not self.keep_stop and ids and ids[-1] in self.stop_ids:
            return ids[:-1]
        return ids

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.error is not None


def make_choices(
    tag: str, lengths: list[int], n: int, decode, stops: tuple[str, ...], ends, keep_stop: bool
) -> list[Choice]:
    """``n`` choices per prompt (``lengths``: their token counts), choice ``k`` with engine
    request id ``f"{tag}-{k}"``; ``ends``: the request's EOS ids (an id, a list or None), the
    tokens whose text a choice they end does not show unless ``keep_stop``."""
    ids = [] if ends is None else np.atleast_1d(np.asarray(ends)).tolist()
    stop_ids = frozenset(int(i) for i in ids)
    return [
        Choice(
            i * n + j,
            f"{tag}-{i * n + j}",
            i,
            length,
            StopText(decode, stops, keep_stop),
            stop_ids=stop_ids,
            keep_stop=keep_stop,
        )
        for i, length in enumerate(lengths)
        for j in range(n)
    ]


def usage(choices: list[Choice]) -> dict[str, int]:
    """Token counts; a prompt shared by ``n`` choices counts once, as OpenAI counts it."""
    prompt_tokens = sum({c.prompt: c.prompt_tokens for c in choices}.values())
    completion = sum(c.tokens for c in choices)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
    }


def stream_chunk(kind: str, model: str, stream_id: str, created: int, choice: dict) -> str:
    """One server-sent event carrying one choice's delta (``kind``: "chat" or "completion")."""
    chat = kind == "chat"
    body = {
        "id": stream_id,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
    }
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


def choice_delta(
    kind: str, index: int, text: str | None, finish: str | None, logprobs: dict | None = None
) -> dict:
    """A streamed choice: new text (None: none), the log-probabilities of the tokens that came
    with it, and, on its last chunk, the finish reason."""
    if kind == "chat":
        if text is None and logprobs is not None:
            text = ""
        delta = {} if text is None else {"content": text}
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
    return {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}


def final_body(kind: str, model: str, created: int, choices: list[Choice]) -> dict:
    """The non-streamed response: every choice's text and finish reason, and the usage."""
    chat = kind == "chat"
    rows = []
    for c in sorted(choices, key=lambda c: c.index):
        row: dict[str, Any] = {"index": c.index}
        if chat:
            row["message"] = {"role": "assistant", "content": c.text.text}
        else:
            row["text"] = c.text.text
        logprobs = None if c.scores is None else c.scores.whole()
        rows.append({**row, "logprobs": logprobs, "finish_reason": c.finish_reason})
    return {
        "id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex,
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": rows,
        "usage": usage(choices),
    }
