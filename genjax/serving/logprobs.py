"""OpenAI's ``logprobs`` shapes for ``genjax serve``, built from the engine's per-token
log-probabilities (:class:`~genjax.serving.GenerationOutput`'s ``logprobs`` and
``top_logprobs``).

The values are the model's raw log-probabilities: ``log_softmax`` of its logits before any
processor (logit bias, penalties, temperature, top-k/top-p), as vLLM reports by default; they
equal ``jax.nn.log_softmax(genjax.generate(..., output_logits=True).logits)`` at the chosen
tokens. There is one entry per completion token counted in ``usage`` (an EOS token and the
tokens of a stop string included).

Chat (``logprobs: true``, ``top_logprobs: k``)::

    {"content": [{"token": "Hi", "logprob": -0.3, "bytes": [72, 105],
                  "top_logprobs": [{"token": "Hi", "logprob": -0.3, "bytes": [72, 105]}, ...]}],
     "refusal": null}

Completions (``logprobs: k``), the chosen token always among ``top_logprobs`` (so up to ``k + 1``
entries)::

    {"tokens": ["Hi"], "token_logprobs": [-0.3], "top_logprobs": [{"Hi": -0.3, ...}],
     "text_offset": [0]}

A token's text is what it decodes to alone, U+FFFD standing for bytes that are not a whole UTF-8
character; chat's ``bytes`` are its exact bytes. ``text_offset`` counts characters of those texts
from the start of the completion. Streamed, each chunk carries the entries of the tokens that
arrived with it (text held back for a possible stop string comes in a later chunk).
"""

from __future__ import annotations

import threading
from typing import Any

from genjax.stopping.stop_strings import token_texts

__all__ = ["ChoiceLogprobs", "TokenTexts"]


class TokenTexts:
    """Token id -> ``(text, utf8_bytes)``, read once from the vocabulary on first use.

    Example:
        >>> texts = TokenTexts(tokenizer)  # doctest: +SKIP
        >>> texts(483)  # doctest: +SKIP
        ('def', b'def')
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._table: dict[int, bytes] | None = None
        self._lock = threading.Lock()

    def __call__(self, token_id: int) -> tuple[str, bytes]:
        if self._table is None:
            with self._lock:
                if self._table is None:
                    texts, _ = token_texts(self.tokenizer)
                    self._table = {
                        i: t if isinstance(t, bytes) else t.encode() for i, t in texts.items()
                    }
        raw = self._table.get(int(token_id))
        if raw is None:  # an id the vocabulary does not list (e.g. padding of the embedding)
            raw = self.tokenizer.decode([int(token_id)]).encode()
        return raw.decode("utf-8", errors="replace"), raw


class ChoiceLogprobs:
    """The log-probabilities of one choice, turned into OpenAI's shape for its endpoint.

    Args:
        kind: "chat" or "completion".
        top: the top log-probabilities per token the request asked (chat ``top_logprobs``,
            completions ``logprobs``).
        texts: the server's :class:`TokenTexts`.
    """

    def __init__(self, kind: str, top: int, texts: TokenTexts):
        self.kind, self.top, self.texts = kind, top, texts
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.tops: list[list[tuple[int, float]]] = []
        self.sent = 0  # entries already streamed
        self.offset = 0  # completions: text_offset of the next streamed entry

    def update(self, output) -> None:
        """Takes the tokens and log-probabilities of the newest output of the choice."""
        if output.logprobs is not None:
            self.tokens = output.generated_tokens
            self.logprobs, self.tops = output.logprobs, output.top_logprobs

    def take(self) -> dict[str, Any] | None:
        """The entries not streamed yet, in the endpoint's shape; None when there are none."""
        end = min(len(self.tokens), len(self.logprobs))
        if end <= self.sent:
            return None
        body = self._body(self.sent, end, self.offset)
        self.sent = end
        if self.kind != "chat":
            self.offset = body["text_offset"][-1] + len(body["tokens"][-1])
        return body

    def whole(self) -> dict[str, Any]:
        """Every entry, in the endpoint's shape (a response not streamed)."""
        return self._body(0, min(len(self.tokens), len(self.logprobs)), 0)

    def _body(self, start: int, end: int, offset: int) -> dict[str, Any]:
        rows = range(start, end)
        if self.kind == "chat":
            content = [
                {
                    **self._chat_token(self.tokens[i], self.logprobs[i]),
                    "top_logprobs": [self._chat_token(t, v) for t, v in self.tops[i]],
                }
                for i in rows
            ]
            return {"content": content, "refusal": None}
        tokens = [self.texts(self.tokens[i])[0] for i in rows]
        offsets = []
        for text in tokens:
            offsets.append(offset)
            offset += len(text)
        tops = []
        for i in rows:
            entry = {self.texts(t)[0]: v for t, v in self.tops[i][: self.top]}
            entry.setdefault(self.texts(self.tokens[i])[0], self.logprobs[i])
            tops.append(entry)
        return {
            "tokens": tokens,
            "token_logprobs": [self.logprobs[i] for i in rows],
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def _chat_token(self, token: int, logprob: float) -> dict[str, Any]:
        text, raw = self.texts(token)
        return {"token": text, "logprob": logprob, "bytes": list(raw)}
