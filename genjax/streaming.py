"""Streamers: text as it is generated, token by token, from inside the compiled loop.

Pass a streamer to :func:`genjax.generate` as ``streamer=``. As in transformers, ``generate``
calls ``streamer.put(prompt_ids)`` once with the prompt (int32[1, P], before the program runs;
for an encoder-decoder model the decoder's prefix, which starts with its start token),
then ``streamer.put(token_ids)`` with each new token (int32[1]) as the loop produces it, then
``streamer.end()`` once the result is ready. The tokens reach the host from inside the jitted
``lax.while_loop`` through an ordered ``jax.experimental.io_callback``, so they arrive in order
while decoding is still running.

* :class:`BaseStreamer`: the ``put``/``end`` contract; subclass it for your own sink. Any object
  with these two methods works (transformers' own streamers too).
* :class:`TextStreamer`: prints the text to stdout as it becomes final, optionally without the
  prompt.
* :class:`TextIteratorStreamer`: puts text chunks in a queue; iterate over it from another
  thread while ``generate`` runs.

When text is final: the token ids seen so far are decoded together (so multi-token characters
and a tokenizer's spacing rules come out right) and the part not printed yet is released when

* the text ends with a newline (then the ids before the last one are dropped from the cache);
* its last character is a CJK ideograph (these words have no spaces between them);
* it holds only letters, combining marks, digits and whitespace;
* otherwise, up to its last space: a symbol may be the start of some formatting, and a trailing
  U+FFFD (the replacement character) stands for a multi-byte UTF-8 character whose remaining
  bytes are in the next token, so it is held back until that token completes it.

``end()`` releases the rest. The chunks therefore concatenate to ``tokenizer.decode`` of all the
ids put (for decoders that decode a sequence as the concatenation of its tokens' bytes or text,
such as byte-level BPE), and no chunk ends inside a character.

Static or traced:
    Static (part of the compiled program): whether a streamer is given. A call without a
    streamer compiles a program with no callback in it; a call with one compiles, once, the
    same program plus a callback per token.
    Traced: the stream id, a small int32[] naming the streamer in a host-side registry, so a new
    streamer object, or several calls streaming at once from different threads, reuse the
    compiled program. The streamer object itself never enters the program.

Limits (as in transformers): batch size 1 and ``num_return_sequences=1`` (one text to stream),
and no beam search (the best beam is only known at the end). ``generate`` must be called with
concrete arrays, not inside the user's own ``jax.jit`` (``end()`` runs on the host after the
result is ready). The callbacks are synchronous: the loop waits while ``put`` runs, so a slow
``put`` slows decoding; ``bench/streaming.py`` measures the cost.

Example:
    >>> tok = genjax.tokenizer.from_pretrained(genjax.io.bundled.path())
    >>> streamer = genjax.streaming.TextStreamer(tok, skip_prompt=True, skip_special_tokens=True)
    >>> out = genjax.generate(model, params, tok("def f():")["input_ids"], config,
    ...                       streamer=streamer)
    return True

References:
    Hugging Face transformers' ``generation/streamers.py`` defines the contract and the rules
    for when text is final.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import queue
import threading
import unicodedata
from collections.abc import Iterator
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from genjax.decoding.sampling import TokenHook
from genjax.errors import InputError, UnsupportedError
from genjax.typing import Array

__all__ = ["BaseStreamer", "TextIteratorStreamer", "TextStreamer"]


class BaseStreamer:
    """What ``generate`` calls: ``put`` with the prompt, then with each new token; ``end`` once.

    Example:
        >>> class Collect(BaseStreamer):
        ...     def __init__(self):
        ...         self.ids = []
        ...     def put(self, value):
        ...         self.ids.append(np.asarray(value).reshape(-1).tolist())
        ...     def end(self):
        ...         pass
    """

    def put(self, value: np.ndarray) -> None:
        """Receives token ids: the prompt int32[1, P] first, then each new token int32[1]."""
        raise NotImplementedError

    def end(self) -> None:
        """Called once after the last token, when the result is ready."""
        raise NotImplementedError


class TextStreamer(BaseStreamer):
    """Prints the text to stdout as soon as it is final (see the module docstring).

    Args:
        tokenizer: anything with ``decode(ids, **decode_kwargs) -> str``: a
            :class:`genjax.tokenizer.Tokenizer`, a transformers tokenizer, a
            ``tokenizers.Tokenizer``.
        skip_prompt: do not print the first ``put`` (the prompt); useful for chat.
        **decode_kwargs: passed to ``tokenizer.decode``, e.g. ``skip_special_tokens=True``.

    Example:
        >>> streamer = TextStreamer(tok, skip_prompt=True, skip_special_tokens=True)
        >>> out = genjax.generate(model, params, ids[:1], config, attention_mask=mask[:1],
        ...                       streamer=streamer)  # prints as it goes
        return True
    """

    def __init__(self, tokenizer: Any, skip_prompt: bool = False, **decode_kwargs: Any):
        self.tokenizer = tokenizer
        self.skip_prompt = skip_prompt
        self.decode_kwargs = decode_kwargs
        self.token_cache: list[int] = []  # ids decoded together; trimmed after each newline
        self.print_len = 0  # characters of decode(token_cache) already released
        self.next_tokens_are_prompt = True

    def put(self, value: Any) -> None:
        """Adds token ids (int[P], int[1, P] or int[1]) and releases the text now final.

        Raises:
            ValueError: ids of more than one row.
        """
        ids = _row_ids(value, type(self).__name__)
        if self.skip_prompt and self.next_tokens_are_prompt:
            self.next_tokens_are_prompt = False
            return
        self.token_cache.extend(ids)
        text = self._decode(self.token_cache)
        if text.endswith("\n"):
            printable = text[self.print_len :]
            # Keep the newline's token as context, so the next line's leading space survives
            # decoders that strip a leading space.
            self.token_cache = self.token_cache[-1:]
            self.print_len = len(self._decode(self.token_cache))
        else:
            end = max(self.print_len, _final_length(text, self.print_len))
            printable = text[self.print_len : end]
            self.print_len = end
        self.on_finalized_text(printable)

    def end(self) -> None:
        """Releases the rest of the text and ends the stream (a newline for stdout)."""
        printable = ""
        if self.token_cache:
            printable = self._decode(self.token_cache)[self.print_len :]
        self.token_cache = []
        self.print_len = 0
        self.next_tokens_are_prompt = True
        self.on_finalized_text(printable, stream_end=True)

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        """Where final text goes: stdout here. Override it to send the text elsewhere."""
        print(text, flush=True, end=None if stream_end else "")

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, **self.decode_kwargs)


class TextIteratorStreamer(TextStreamer):
    """Queues the text chunks; iterate over the streamer from another thread to read them.

    Args:
        tokenizer: as for :class:`TextStreamer`.
        skip_prompt: as for :class:`TextStreamer`.
        timeout: seconds a ``put`` on a full queue or a ``next`` on an empty one may wait before
            raising ``queue.Full`` / ``queue.Empty``; None waits forever. Set it so that a
            consumer does not hang when ``generate`` fails.
        **decode_kwargs: passed to ``tokenizer.decode``.

    Example:
        >>> streamer = TextIteratorStreamer(tok, skip_prompt=True, timeout=60)
        >>> thread = threading.Thread(target=genjax.generate, args=(model, params, ids[:1], config),
        ...                           kwargs=dict(attention_mask=mask[:1], streamer=streamer))
        >>> thread.start()
        >>> text = "".join(streamer)
        >>> thread.join()
        >>> text.strip()
        'return True'
    """

    def __init__(
        self,
        tokenizer: Any,
        skip_prompt: bool = False,
        timeout: float | None = None,
        **decode_kwargs: Any,
    ):
        super().__init__(tokenizer, skip_prompt, **decode_kwargs)
        self.text_queue: queue.Queue[str | None] = queue.Queue()
        self.stop_signal = None  # what end() queues after the last chunk
        self.timeout = timeout

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        """Queues the chunk, then the stop signal when the stream ends."""
        self.text_queue.put(text, timeout=self.timeout)
        if stream_end:
            self.text_queue.put(self.stop_signal, timeout=self.timeout)

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        value = self.text_queue.get(timeout=self.timeout)
        if value is self.stop_signal:
            raise StopIteration
        return value


# ----------------------------------------------------------------------------- when text is final


def _row_ids(value: Any, name: str) -> list[int]:
    """The ids of one row, from int[P], int[1, P] (numpy, jax, torch or nested lists)."""
    ids = np.asarray(value)
    if ids.ndim > 1 and ids.shape[0] > 1:
        raise ValueError(
            f"{name} streams one sequence, but put() got ids of shape {ids.shape}. Stream "
            f"batch size 1 (and num_return_sequences=1)."
        )
    return ids.reshape(-1).astype(np.int64).tolist()


def _final_length(text: str, start: int) -> int:
    """How many leading characters of ``text`` (of which ``start`` are released) are final,
    by the rules of the module docstring (the newline case is handled by the caller)."""
    if text and _is_cjk(ord(text[-1])):
        return len(text)
    pending = text[start:]
    if all(ch.isspace() or unicodedata.category(ch)[0] in "LMN" for ch in pending):
        return len(text)
    # A symbol (U+FFFD included: category So) waits for the next space.
    return text.rfind(" ") + 1


def _is_cjk(codepoint: int) -> bool:
    """Whether the code point is a CJK ideograph (the CJK Unified Ideographs blocks and their
    extensions, and the compatibility ideographs). Hangul, Hiragana and Katakana are not:
    those scripts separate words with spaces."""
    return any(low <= codepoint <= high for low, high in _CJK_BLOCKS)


_CJK_BLOCKS = (
    (0x4E00, 0x9FFF),
    (0x3400, 0x4DBF),
    (0x20000, 0x2A6DF),
    (0x2A700, 0x2B73F),
    (0x2B740, 0x2B81F),
    (0x2B820, 0x2CEAF),
    (0xF900, 0xFAFF),
    (0x2F800, 0x2FA1F),
)


# ----------------------------------------------------------------------------- generate's side

_STREAMS: dict[int, _Stream] = {}  # stream id -> stream, for the calls streaming right now
_STREAMS_LOCK = threading.Lock()
_NEXT_ID = itertools.count()


def check_streamer(streamer: Any, input_ids: Any, config: Any, traced: bool) -> None:
    """Validates a streamer and the call it streams, before anything is traced.

    Args:
        streamer: the object passed as ``streamer=``.
        input_ids: int[B, P], the prompts.
        config: the call's resolved :class:`~genjax.GenerationConfig`.
        traced: whether any input of the call is a tracer (inside the user's ``jax.jit``).

    Raises:
        TypeError: ``streamer`` lacks ``put``/``end`` methods.
        UnsupportedError: beam search, or a call traced inside the user's ``jax.jit``.
        InputError: more than one sequence (batch size or ``num_return_sequences`` above 1).
    """
    if not (callable(getattr(streamer, "put", None)) and callable(getattr(streamer, "end", None))):
        raise TypeError(
            f"streamer must have put(ids) and end() methods (a genjax.streaming.BaseStreamer); "
            f"got {type(streamer).__name__}."
        )
    if config.num_beams > 1:
        raise UnsupportedError(
            f"streamer= cannot be used with beam search (num_beams={config.num_beams}), as in "
            f"transformers: the best beam is known only at the end. Set num_beams=1, or drop "
            f"the streamer and decode out.sequences."
        )
    if traced:
        raise UnsupportedError(
            "streamer= needs a call with concrete arrays, not one traced inside your own "
            "jax.jit: the streamer's end() runs on the host once the result is ready. Call "
            "genjax.generate directly (it is jitted internally)."
        )
    batch, copies = input_ids.shape[0], config.num_return_sequences
    if batch * copies != 1:
        raise InputError(
            f"streamer= supports batch size 1 only, as in transformers (one text to stream); got "
            f"{batch} prompt(s) x num_return_sequences={copies}. Stream one prompt with "
            f"num_return_sequences=1, or drop the streamer and decode out.sequences."
        )


@dataclasses.dataclass
class _Stream:
    """A registered streamer and the first exception its ``put`` raised in a callback (raising
    it there would surface as an XLA runtime error wrapping a traceback)."""

    streamer: Any
    error: Exception | None = None


@contextlib.contextmanager
def stream_to(streamer: Any | None, prompt_ids: Any) -> Iterator[Array | None]:
    """Registers ``streamer`` for one ``generate`` call and puts the prompt.

    Yields the stream id (int32[], traced by the program; None without a streamer) for
    :func:`token_hook`. The caller must wait inside the ``with`` block for the result, then
    call ``end()`` after it. On leaving, the streamer is unregistered, and the first exception
    its ``put`` raised inside the program (after which it got no more tokens) is raised again.

    Args:
        streamer: the streamer, or None (then nothing happens).
        prompt_ids: int[1, P], the prompt as the user gave it.
    """
    if streamer is None:
        yield None
        return
    stream_id = next(_NEXT_ID) % (2**31 - 1)
    stream = _Stream(streamer)
    with _STREAMS_LOCK:
        _STREAMS[stream_id] = stream
    try:
        streamer.put(np.asarray(prompt_ids, np.int32))
        yield jnp.asarray(stream_id, jnp.int32)
    finally:
        with _STREAMS_LOCK:
            _STREAMS.pop(stream_id, None)
    if stream.error is not None:
        raise stream.error


def token_hook(stream_id: Array) -> TokenHook:
    """The hook the decoding loop calls with each new token: an ordered host callback that
    hands the active rows' tokens to the registered streamer.

    The stream id and the tokens travel as one int32[1 + B] array (finished rows as -1): each
    operand of a host callback costs a transfer, so one is cheaper than three.

    Args:
        stream_id: int32[] from :func:`stream_to` (traced).
    """

    def hook(tokens: Array, active: Array) -> None:
        rows = jnp.where(active, tokens.astype(jnp.int32), -1)
        packed = jnp.concatenate([jnp.reshape(stream_id, (1,)).astype(jnp.int32), rows])
        io_callback(_deliver, None, packed, ordered=True)

    return hook


def _deliver(packed: np.ndarray) -> None:
    """Host side of :func:`token_hook`: rows already finished (-1, padding) are not streamed."""
    # The callback gets a jax Array: index it as NumPy, or each index is a dispatched jax op,
    # which costs far more per token than the NumPy copy.
    packed = np.asarray(packed)
    tokens = packed[1:]
    tokens = tokens[tokens >= 0]
    if not tokens.size:
        return
    with _STREAMS_LOCK:
        stream = _STREAMS[int(packed[0])]
    if stream.error is None:
        try:
            stream.streamer.put(tokens)
        except Exception as error:  # noqa: BLE001 - raised again on the host by stream_to
            stream.error = error
