"""Stopping rules: when a row is finished, as pure functions of the token buffer.

transformers checks its ``StoppingCriteriaList`` after appending each new token, the first one
included, and a row is finished once any criterion says so. genjax does the same inside the
decoding loop, on the fixed token buffer ``tokens`` int32[B, S] whose slot ``length - 1`` holds the
newest token. The rules are:

* **Max length**: the buffer is full (:func:`should_continue`).
* **EOS**: the newest token is one of the EOS ids (:func:`is_eos`).
* **Custom criteria**: pure functions ``fn(tokens int32[B, S], length int32[]) -> bool[B]``, True
  where that row is done (:data:`StopCriterion`).
* **Stop strings**: a stop string ends within the newest token's text, found through tables
  built once on the host from the tokenizer's vocabulary (:func:`stop_string_table`,
  :func:`stop_string_hits`).
* **Max time**: the call has run longer than ``max_time`` seconds, read from the host clock
  through a callback inside the compiled loop (:func:`start_timer`, :func:`time_is_up`).

:class:`StoppingRules` carries all of them through a call; :func:`finished_rows` applies them.

Axes (besides those of :mod:`genjax.typing`): ``U`` rows of a stop-string table (token ids, then
one spare row), ``X`` stop strings, ``W`` the window of newest tokens a stop string can span,
``Q`` positions per token, ``O`` end overlaps per token, ``E`` EOS ids.

Static or traced:
    Static: which rules are present, the custom criteria (hashable callables), the number of stop
    strings and the shapes of their tables (``U``, ``X``, ``W``, ``Q``, ``O``), the clock and how
    often it is read. Traced: the EOS ids, the stop-string table values, ``max_time`` and the
    start time.

Differences from transformers:
    * Custom criteria see the fixed buffer and ``length`` rather than a growing ``input_ids``
      (and no scores); slots from ``length`` on hold pad, and genjax's bucket padding may come
      before the prompt.
    * ``max_time`` counts from the start of the compiled program (before the prefill, as
      transformers starts before its prefill), so input checks and compilation are not counted;
      the clock is ``time.monotonic``, not ``time.time``.
    * A tokenizer with only ``get_vocab()`` is accepted for stop strings: its tokens are taken as
      their text (transformers needs a full tokenizer).

References:
    Hugging Face transformers' ``generation/stopping_criteria.py`` (``StopStringCriteria``,
    ``MaxTimeCriteria``, ``EosTokenCriteria``, ``StoppingCriteriaList``) defines the semantics.
"""

from __future__ import annotations

import collections
import json
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.experimental import io_callback

from genjax.errors import InputError
from genjax.typing import Array

StopCriterion = Callable[[Array, Array], Array]
"""``fn(tokens int32[B, S], length int32[]) -> bool[B]``: True where a row is done.

``tokens`` is the whole buffer: possibly some pad slots, the prompt, the tokens generated so far
(the newest at slot ``length - 1``), then pad. It must be pure and jittable, and hashable (it is
static: pass the same object to reuse a compiled program)."""

Clock = Callable[[], float]
"""A host clock: seconds as a float, never going backwards (``time.monotonic``)."""

MAX_TIME_CHECK_EVERY = 1
"""Default number of new tokens between two clock reads when ``max_time`` is set.

1 reads after every token, as transformers does, so a call ends within one step of its budget.
A read is a synchronous host callback, 0.2-0.8 ms on a shared 2-core CPU (jax 0.10). Measured
with ``bench/max_time.py`` (4-layer, width-256 Llama): at batch 1 (1.1 ms per step) decoding ran
38-50% slower with a read every token and 15-20% slower with one every 16; at batch 8 (10 ms per
step) the difference was within the noise (under 3%). Models whose steps take several ms or more
pay a few percent at most. The value is read when a program is traced and is not part of the jit
cache key (call ``jax.clear_caches()`` after changing it); :func:`stopping_rules` takes it per
call as ``check_time_every``."""

_NO_MATCH = -1  # table entry for "no position", and the length of unused token ids


# ----------------------------------------------------------------------------- EOS and max length


def is_eos(tokens: Array, eos_token_ids: Array | None) -> Array:
    """bool[B]: True where ``tokens`` (int32[B]) is one of ``eos_token_ids`` (int32[E]).

    With no EOS ids, nothing is EOS.

    Example:
        >>> is_eos(jnp.array([2, 5]), jnp.array([2, 3])).tolist()
        [True, False]
    """
    if eos_token_ids is None:
        return jnp.zeros(tokens.shape, bool)
    eos = jnp.atleast_1d(jnp.asarray(eos_token_ids, jnp.int32))
    return jnp.any(tokens[:, None] == eos[None, :], axis=-1)


def should_continue(length: Array, max_length: int, finished: Array) -> Array:
    """bool[]: keep decoding while the buffer has room and some row is unfinished.

    Args:
        length: int32[], slots of the buffer filled so far.
        max_length: the buffer length ``S`` (static).
        finished: bool[B], rows that are done.

    Example:
        >>> bool(should_continue(jnp.int32(5), 8, jnp.array([True, False])))
        True
    """
    return (length < max_length) & ~jnp.all(finished)


# ----------------------------------------------------------------------------- stop strings


@struct.dataclass
class StopStringTable:
    """What each token id can contribute to each stop string, for :func:`stop_string_hits`.

    A stop string ``s`` is matched backwards from the newest token. The newest token must begin
    with the last ``e`` characters of ``s`` for some ``e`` in its ``end_lengths`` (it may run on
    past ``s``). Each earlier token, when ``c`` characters of ``s`` are matched already, must end
    where the unmatched rest ends: ``c`` must be one of its ``positions`` (it may run off the
    start of ``s``); then ``c`` grows by its length. ``s`` is found once ``c >= len(s)``.
    For ``s = "stop"`` and the tokens ``["s", "to", "pped"]``: "pped" has end length 1, "to"
    sits at position 1 (c becomes 3), "s" at position 3 (c becomes 4 = len(s)): a match.

    Lengths count characters, or UTF-8 bytes for byte-level and byte-fallback vocabularies. Ids
    outside the tokenizer's vocabulary use the last row, which matches nothing.
    """

    positions: Array  # int32[U, X, Q]: matched counts the token can continue at; -1 pads
    end_lengths: Array  # int32[U, X, O]: suffix lengths of s the token starts with; -1 pads
    token_lengths: Array  # int32[U]: the token's text length; -1 for unused ids
    target_lengths: Array  # int32[X]: the stop strings' lengths
    window: int = struct.field(pytree_node=False)  # W: newest tokens looked at, max len(s)


def stop_string_table(tokenizer: Any, stop_strings: str | Sequence[str]) -> StopStringTable:
    """Builds (or fetches from a cache) the tables :func:`stop_string_hits` needs.

    Runs on the host with numpy, once per (vocabulary, stop strings): the last 8 tables are
    cached, by vocabulary content and by tokenizer object (a tokenizer changed in place without
    changing its number of tokens is not read again). Building takes about 5 s for a 128k-token
    vocabulary on a slow CPU, as in transformers; a cached table comes back in milliseconds.

    The vocabulary is cleaned as transformers' ``StopStringCriteria`` cleans it: a token stands
    for the text it adds when decoded after other text (so GPT-2's "Ġ" and SentencePiece's "▁"
    become spaces); byte-level vocabularies (GPT-2 style) and byte-fallback tokens (``<0x0A>``)
    are matched on UTF-8 bytes, so a stop string may end inside a character.

    Args:
        tokenizer: the vocabulary's source: a transformers tokenizer (``get_vocab``, calling it,
            ``convert_ids_to_tokens``, ``convert_tokens_to_string``), a ``tokenizers.Tokenizer``,
            or any object with ``get_vocab()`` alone, whose tokens are then taken as their text.
        stop_strings: one non-empty string or a sequence of them.

    Returns:
        A :class:`StopStringTable` of device arrays (traced when passed to a jitted function;
        its shapes, and ``window``, are static).

    Raises:
        InputError: empty stop strings, or no token can end any of them.
        TypeError: ``tokenizer`` has no ``get_vocab()``.

    Example:
        >>> table = stop_string_table(tokenizer, ["\\n\\n", "###"])
        >>> table.window
        3
    """
    strings = _check_stop_strings(stop_strings)
    source = _VocabSource.of(tokenizer)
    # Fast path: the same tokenizer object, with as many tokens as before, and the same strings.
    quick = (id(tokenizer), source.size(), strings)
    seen = _BY_TOKENIZER.get(quick)
    if seen is not None and seen[0] is tokenizer:
        return seen[1]
    vocab = source.vocab()
    key = (source.fingerprint(), tuple(sorted(vocab.items())), strings)
    table = _BY_CONTENT.get(key)
    if table is None:
        targets = tuple(s.encode("utf-8") for s in strings) if source.mode else strings
        table = _build_table(source.clean(vocab), targets)
    _remember(_BY_CONTENT, key, table)
    _remember(_BY_TOKENIZER, quick, (tokenizer, table))
    return table


# The last 8 tables, by vocabulary content and by tokenizer object (which the entry keeps alive).
_BY_CONTENT: collections.OrderedDict[tuple, StopStringTable] = collections.OrderedDict()
_BY_TOKENIZER: collections.OrderedDict[tuple, tuple] = collections.OrderedDict()


def _remember(cache: collections.OrderedDict, key: tuple, value: Any) -> None:
    cache[key] = value
    cache.move_to_end(key)
    if len(cache) > 8:
        cache.popitem(last=False)


def stop_string_hits(
    table: StopStringTable, tokens: Array, length: Array, first_slot: Array | int = 0
) -> Array:
    """bool[B]: rows where one of the stop strings ends within the newest token.

    Matches transformers' ``StopStringCriteria`` on ``tokens[:, first_slot:length]``: a stop
    string counts only if it overlaps the newest token (it may end inside it, and start tokens
    earlier); text entirely before the newest token never stops a row again.

    Args:
        table: from :func:`stop_string_table`.
        tokens: int32[B, S], the token buffer.
        length: int32[], slots filled; the newest token is at ``length - 1``.
        first_slot: int32[], the first slot of the text (slots before it are genjax's bucket
            padding, which transformers never sees).

    Example:
        >>> stop_string_hits(table, tokens, jnp.int32(7)).shape
        (2,)
    """
    spare = table.token_lengths.shape[0] - 1
    slots = length - 1 - jnp.arange(table.window)  # int32[W], newest first
    ids = jnp.take(tokens, jnp.maximum(slots, 0), axis=1)  # int32[B, W]
    ids = jnp.where(slots >= first_slot, jnp.minimum(ids, spare), spare)
    ends = table.end_lengths[ids[:, 0]]  # int32[B, X, O]
    before = jnp.cumsum(table.token_lengths[ids[:, 1:]], axis=1)  # int32[B, W-1]
    # matched[:, j]: characters of s matched once the j+1 newest tokens are used.
    matched = ends[:, None] + jnp.pad(before, ((0, 0), (1, 0)))[:, :, None, None]  # [B, W, X, O]
    fits = jnp.any(  # token j+1 ends where the unmatched rest of s ends
        matched[:, :-1, :, :, None] == table.positions[ids[:, 1:]][:, :, :, None, :], axis=-1
    )
    fits = jnp.concatenate([(ends > 0)[:, None], fits], axis=1)  # bool[B, W, X, O]
    unbroken = jnp.cumsum(~fits, axis=1) == 0
    found = unbroken & (matched >= table.target_lengths[None, None, :, None])
    return jnp.any(found, axis=(1, 2, 3))


def _check_stop_strings(stop_strings: Any) -> tuple[str, ...]:
    if isinstance(stop_strings, str):
        strings = (stop_strings,)
    else:
        strings = tuple(stop_strings) if isinstance(stop_strings, Sequence) else ()
    if not strings or not all(isinstance(s, str) and s for s in strings):
        raise InputError(
            f"stop_strings must be a non-empty string or a non-empty list of non-empty strings; "
            f"got {stop_strings!r}. Remove empty strings: an empty stop string would stop at once."
        )
    return strings


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte: the printable Latin-1 bytes stand for
    themselves and the other 68 bytes, in order, for ``chr(256)``, ``chr(257)``, ... (so a space
    is "Ġ" and a newline "Ċ")."""
    printable = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    alphabet, spare = {}, 256
    for byte in range(256):
        if byte in printable:
            alphabet[chr(byte)] = byte
        else:
            alphabet[chr(spare)] = byte
            spare += 1
    return alphabet


class _VocabSource:
    """Reads a tokenizer's vocabulary and the text each token stands for, the way transformers'
    ``StopStringCriteria`` does, for the three kinds of tokenizer accepted."""

    _PREFIX = "abcdef"  # decoded before each token, then cut, so prefix-space rules do not apply

    def __init__(self, tokenizer: Any, decoder: Any, kind: str):
        self.tokenizer, self.decoder, self.kind = tokenizer, decoder, kind
        self.mode = _matching_mode(decoder)  # "byte_level", "byte_fallback" or None

    @classmethod
    def of(cls, tokenizer: Any) -> _VocabSource:
        if not callable(getattr(tokenizer, "get_vocab", None)):
            raise TypeError(
                f"stop strings need the tokenizer's vocabulary, but {type(tokenizer).__name__} has "
                f"no get_vocab() method. Pass the model's transformers tokenizer or a "
                f"tokenizers.Tokenizer as tokenizer=."
            )
        if callable(getattr(tokenizer, "convert_tokens_to_string", None)) and callable(tokenizer):
            backend = getattr(tokenizer, "backend_tokenizer", None)
            return cls(tokenizer, getattr(backend, "decoder", None), "transformers")
        if callable(getattr(tokenizer, "id_to_token", None)) and hasattr(tokenizer, "decoder"):
            return cls(tokenizer, tokenizer.decoder, "tokenizers")
        return cls(tokenizer, None, "plain")

    def fingerprint(self) -> tuple:
        state = _decoder_state(self.decoder)
        return (self.kind, self.mode, None if state is None else json.dumps(state, sort_keys=True))

    def size(self) -> int:
        """The number of tokens, added ones included, read cheaply where the tokenizer can."""
        if self.kind == "tokenizers":
            return self.tokenizer.get_vocab_size(with_added_tokens=True)
        if self.kind == "transformers" and hasattr(type(self.tokenizer), "__len__"):
            return len(self.tokenizer)
        return len(self.tokenizer.get_vocab())

    def vocab(self) -> dict[str, int]:
        if self.kind == "tokenizers":
            return dict(self.tokenizer.get_vocab(with_added_tokens=True))
        return dict(self.tokenizer.get_vocab())

    def clean(self, vocab: dict[str, int]) -> dict[int, str | bytes]:
        """token id -> the text (bytes in the byte modes) that the token adds when decoded."""
        if self.kind == "plain":
            return {index: token for token, index in vocab.items()}
        alphabet = _byte_alphabet() if self.mode == "byte_level" else {}
        base = self._prefix_tokens()
        clean = {}
        for token, index in vocab.items():
            text = self._as_bytes(token, alphabet)
            if text is None:
                text = self._decode([*base, token])
                cut = text.find(self._PREFIX)
                if cut < 0:
                    raise InputError(
                        f"cannot read the text of token {token!r}: decoding it after "
                        f"{self._PREFIX!r} gave {text!r}. Stop strings need a tokenizer whose "
                        f"decoder keeps plain text."
                    )
                text = text[cut + len(self._PREFIX) :]
                if self.mode:
                    text = text.encode("utf-8")
            clean[index] = text
        return clean

    def _as_bytes(self, token: str, alphabet: dict[str, int]) -> bytes | None:
        if self.mode == "byte_level" and all(char in alphabet for char in token):
            return bytes(alphabet[char] for char in token)
        if (
            self.mode == "byte_fallback"
            and len(token) == 6
            and token[:3] == "<0x"
            and token[5] == ">"
        ):
            try:
                return bytes([int(token[3:5], 16)])
            except ValueError:
                return None
        return None

    def _prefix_tokens(self) -> list[str]:
        if self.kind == "tokenizers":
            ids = self.tokenizer.encode(self._PREFIX, add_special_tokens=False).ids
            return [self.tokenizer.id_to_token(i) for i in ids]
        ids = self.tokenizer(self._PREFIX, add_special_tokens=False)["input_ids"]
        return list(self.tokenizer.convert_ids_to_tokens(ids))

    def _decode(self, tokens: list[str]) -> str:
        if self.kind == "tokenizers":
            decoder = self.tokenizer.decoder
            return decoder.decode(tokens) if decoder is not None else " ".join(tokens)
        return self.tokenizer.convert_tokens_to_string(tokens)


def _decoder_state(decoder: Any) -> Any:
    """The decoder's JSON description as a Python value, or None."""
    if decoder is None:
        return None
    state = getattr(decoder, "__getstate__", lambda: None)()
    if isinstance(state, bytes):
        state = state.decode("utf-8", "replace")
    if isinstance(state, str):
        try:
            return json.loads(state)
        except json.JSONDecodeError:
            return None
    return None


def _matching_mode(decoder: Any) -> str | None:
    """transformers' rule: a ByteLevel decoder, or a decoder (sequence) naming ByteFallback, then
    ByteLevel, matches on bytes; anything else on characters."""
    if decoder is None:
        return None
    if type(decoder).__name__ == "ByteLevel":
        return "byte_level"
    names = set(_types_named(_decoder_state(decoder)))
    if "ByteFallback" in names:
        return "byte_fallback"
    if "ByteLevel" in names:
        return "byte_level"
    return None


def _types_named(state: Any):
    if isinstance(state, dict):
        if isinstance(state.get("type"), str):
            yield state["type"]
        for value in state.values():
            yield from _types_named(value)
    elif isinstance(state, list):
        for value in state:
            yield from _types_named(value)


def _token_fits(stop: str | bytes, token: str | bytes) -> tuple[list[int], list[int]]:
    """(positions, end lengths) of one token for one stop string (see :class:`StopStringTable`).

    A position ``c`` in 1..len(stop)-1 is valid when the token, placed so that it ends ``c``
    characters before the end of ``stop``, agrees with ``stop`` wherever they overlap. An end
    length ``e`` is valid when the token has ``stop[-e:]`` ending at one of its characters and
    either ``e == len(stop)`` or that occurrence starts the token.
    """
    n, size = len(token), len(stop)
    positions = []
    for matched in range(1, size):
        overlap = min(n, size - matched)
        if token[n - overlap :] == stop[size - matched - overlap : size - matched]:
            positions.append(matched)
    ends = []
    for i in range(n):
        if token[i : i + 1] == stop[-1:]:
            overlap = min(i + 1, size)
            if token[i + 1 - overlap : i + 1] == stop[size - overlap :]:
                ends.append(overlap)
    return positions, ends


def _build_table(clean: dict[int, str | bytes], targets: tuple) -> StopStringTable:
    fits = [{index: _token_fits(stop, text) for index, text in clean.items()} for stop in targets]
    most_positions = max((len(p) for per in fits for p, _ in per.values()), default=0)
    most_ends = max((len(e) for per in fits for _, e in per.values()), default=0)
    if most_ends == 0:
        raise InputError(
            f"no token of the tokenizer's vocabulary can end any of the stop strings "
            f"{[t.decode('utf-8') if isinstance(t, bytes) else t for t in targets]}; they "
            f"probably hold characters the vocabulary lacks. Check the stop strings."
        )
    rows = max(clean) + 2  # the last row is the spare one for ids outside the vocabulary
    positions = np.full((rows, len(targets), max(most_positions, 1)), _NO_MATCH, np.int32)
    end_lengths = np.full((rows, len(targets), most_ends), _NO_MATCH, np.int32)
    token_lengths = np.full((rows,), _NO_MATCH, np.int32)
    for x, per in enumerate(fits):
        for index, (valid, ends) in per.items():
            positions[index, x, : len(valid)] = valid
            end_lengths[index, x, : len(ends)] = ends
    for index, text in clean.items():
        token_lengths[index] = len(text)
    with jax.ensure_compile_time_eval():  # concrete device arrays, safe to cache, even in a trace
        return StopStringTable(
            positions=jnp.asarray(positions),
            end_lengths=jnp.asarray(end_lengths),
            token_lengths=jnp.asarray(token_lengths),
            target_lengths=jnp.asarray([len(t) for t in targets], jnp.int32),
            window=max(len(t) for t in targets),
        )


# ----------------------------------------------------------------------------- max time


def _now_host(clock: Clock) -> np.ndarray:
    """The clock as int32[2] (whole seconds, nanoseconds): exact, unlike one float32."""
    seconds, fraction = divmod(float(clock()), 1.0)
    return np.array([seconds, round(fraction * 1e9)], np.int32)


def _elapsed_host(clock: Clock, start: np.ndarray) -> np.ndarray:
    start = np.asarray(start, np.float64)
    return np.float32(float(clock()) - (start[0] + start[1] * 1e-9))


def read_clock(clock: Clock = time.monotonic) -> Array:
    """int32[2]: the host clock now (whole seconds, nanoseconds), read through a callback, so
    inside a jitted function it is read when the program runs, not when it is traced.

    Example:
        >>> start = read_clock()
    """
    shape = jax.ShapeDtypeStruct((2,), jnp.int32)
    return io_callback(lambda: _now_host(clock), shape)


def seconds_since(start: Array, clock: Clock = time.monotonic, after: Any = None) -> Array:
    """float32[]: host seconds elapsed since ``start`` (from :func:`read_clock`).

    Args:
        start: int32[2], from :func:`read_clock`.
        clock: the same clock as for ``start``.
        after: arrays the read must wait for (it is their consumer, so XLA cannot run it first).
    """
    shape = jax.ShapeDtypeStruct((), jnp.float32)
    return io_callback(lambda s, _: _elapsed_host(clock, s), shape, start, after)


# ----------------------------------------------------------------------------- all rules


@struct.dataclass
class StoppingRules:
    """Everything that decides when rows finish, fixed for a whole call.

    Build it with :func:`stopping_rules`; inside the compiled program call :func:`start_timer`
    before any work that should count against ``max_time``.
    """

    eos_token_ids: Array | None  # int32[E], or None when nothing is EOS
    stop_strings: StopStringTable | None  # tables of the stop strings, or None
    max_time: Array | None  # float32[] or float32[B]: seconds allowed, or None for no limit
    start_time: Array | None  # int32[2]: the clock when the call began (after start_timer)
    first_slot: Array  # int32[]: the buffer slot where the text begins (bucket padding before)
    criteria: tuple[StopCriterion, ...] = struct.field(pytree_node=False, default=())
    clock: Clock = struct.field(pytree_node=False, default=time.monotonic)
    check_time_every: int = struct.field(pytree_node=False, default=MAX_TIME_CHECK_EVERY)


def stopping_rules(
    eos_token_ids: Array | None = None,
    *,
    criteria: Sequence[StopCriterion] = (),
    stop_strings: StopStringTable | None = None,
    max_time: float | Array | None = None,
    first_slot: Array | int = 0,
    clock: Clock = time.monotonic,
    check_time_every: int | None = None,
) -> StoppingRules:
    """Collects the stopping rules of one call, checking the static ones.

    Args:
        eos_token_ids: int32[E] or an int (traced), or None.
        criteria: custom :data:`StopCriterion` functions (static; hashable).
        stop_strings: a table from :func:`stop_string_table`, or None.
        max_time: seconds (traced; a float or float32[B]), or None for no limit.
        first_slot: int32[] (traced), where the text begins in the buffer (see
            :func:`stop_string_hits`).
        clock: the host clock for ``max_time`` (static), ``time.monotonic`` by default; a test may
            pass a fake one.
        check_time_every: read the clock after every ``k``-th new token (static; the first token
            is always checked), so a call may run up to ``k - 1`` tokens past ``max_time``. None
            means :data:`MAX_TIME_CHECK_EVERY`.

    Raises:
        TypeError: a criterion that is not a hashable callable.
        ValueError: ``check_time_every < 1``.

    Example:
        >>> rules = stopping_rules(jnp.array([2]), criteria=[lambda t, n: t[:, n - 1] == 7])
    """
    criteria = as_criteria(criteria)
    if check_time_every is None:
        check_time_every = MAX_TIME_CHECK_EVERY
    if not isinstance(check_time_every, int) or check_time_every < 1:
        raise ValueError(f"check_time_every must be an int >= 1; got {check_time_every!r}.")
    eos = None if eos_token_ids is None else jnp.atleast_1d(jnp.asarray(eos_token_ids, jnp.int32))
    return StoppingRules(
        eos_token_ids=eos,
        stop_strings=stop_strings,
        max_time=None if max_time is None else jnp.asarray(max_time, jnp.float32),
        start_time=None,
        first_slot=jnp.asarray(first_slot, jnp.int32),
        criteria=criteria,
        clock=clock,
        check_time_every=check_time_every,
    )


def as_criteria(criteria: Sequence[StopCriterion] | StopCriterion) -> tuple[StopCriterion, ...]:
    """Checks custom criteria before tracing and returns them as a tuple (a static value).

    Raises:
        TypeError: an entry that is not callable, or not hashable.

    Example:
        >>> as_criteria([lambda tokens, length: tokens[:, length - 1] == 7])
    """
    if callable(criteria):
        criteria = (criteria,)
    elif isinstance(criteria, str) or not isinstance(criteria, Sequence | tuple):
        raise TypeError(
            f"stopping_criteria must be a list of functions fn(tokens, length) -> bool[B]; got "
            f"{type(criteria).__name__}."
        )
    criteria = tuple(criteria)
    for fn in criteria:
        _check_criterion(fn)
    return criteria


def _check_criterion(fn: Any) -> None:
    if any(cls.__name__ == "StoppingCriteria" for cls in type(fn).__mro__):
        raise TypeError(
            f"{type(fn).__name__} is a transformers StoppingCriteria, which runs torch code on "
            f"input_ids. genjax needs a jittable JAX function fn(tokens int32[B, S], length "
            f"int32[]) -> bool[B]; the newest token is tokens[:, length - 1]."
        )
    if not callable(fn):
        raise TypeError(
            f"stopping_criteria must hold functions fn(tokens int32[B, S], length int32[]) -> "
            f"bool[B]; got {type(fn).__name__} {fn!r}. Wrap it in such a function."
        )
    try:
        hash(fn)
    except TypeError:
        raise TypeError(
            f"stopping criterion {fn!r} is not hashable, but criteria are static (part of the "
            f"compiled program). Use a function or a frozen dataclass instead."
        ) from None


def start_timer(rules: StoppingRules, *operands: Any) -> tuple[StoppingRules, tuple]:
    """Reads the start time for ``max_time`` and ties ``operands`` to come after the read.

    Call it first thing in the compiled program and use the returned ``operands`` (e.g. the
    prompt) for the work that follows, so XLA cannot move that work before the clock read. With
    no ``max_time`` it changes nothing.

    Returns:
        (the rules with ``start_time`` set, the operands).

    Example:
        >>> rules, (input_ids,) = start_timer(rules, input_ids)
    """
    if rules.max_time is None:
        return rules, operands
    start, operands = jax.lax.optimization_barrier((read_clock(rules.clock), operands))
    return rules.replace(start_time=start), operands


def time_is_up(rules: StoppingRules, step: Array, after: Any) -> Array:
    """bool[] or bool[B]: whether ``max_time`` has passed, read after new-token index ``step``.

    The clock is read (a host callback) when ``step % check_time_every == 0`` and only after
    ``after`` is computed; transformers reads it after every token.

    Args:
        rules: with ``start_time`` set by :func:`start_timer`.
        step: int32[], index of the newest token among the new ones (0 for the first).
        after: arrays the clock read waits for (e.g. a scalar computed from the newest tokens;
            it is sent to the host, so keep it small and unsharded).
    """
    if rules.max_time is None:
        return jnp.zeros((), bool)
    if rules.start_time is None:
        raise ValueError("max_time is set but the timer was not started: call start_timer first.")

    def read(after):
        return seconds_since(rules.start_time, rules.clock, after)

    if rules.check_time_every == 1:
        elapsed = read(after)
    else:
        due = step % rules.check_time_every == 0
        elapsed = jax.lax.cond(due, read, lambda _: jnp.zeros((), jnp.float32), after)
    return elapsed > rules.max_time


def finished_rows(
    rules: StoppingRules, finished: Array, tokens: Array, length: Array, step: Array
) -> Array:
    """bool[B]: ``finished`` updated after the token at slot ``length - 1`` was written.

    A row is finished once any rule says so (transformers' ``StoppingCriteriaList``): EOS, a
    custom criterion, a stop string, or ``max_time`` (which finishes every row).

    Args:
        rules: the call's :class:`StoppingRules`.
        finished: bool[B], rows finished before this token.
        tokens: int32[B, S], the buffer with the newest token at ``length - 1``.
        length: int32[], slots filled.
        step: int32[], the newest token's index among the new tokens (0 for the first).

    Example:
        >>> done = finished_rows(rules, done, state.tokens, state.length, step)
    """
    newest = jax.lax.dynamic_index_in_dim(tokens, length - 1, axis=1, keepdims=False)
    done = finished | is_eos(newest, rules.eos_token_ids)
    for fn in rules.criteria:
        done = done | _criterion_result(fn, tokens, length)
    if rules.stop_strings is not None:
        done = done | stop_string_hits(rules.stop_strings, tokens, length, rules.first_slot)
    # The clock read waits on a scalar of the newest tokens: one value, so no gather on a mesh.
    return done | time_is_up(rules, step, jnp.max(newest))


def _criterion_result(fn: StopCriterion, tokens: Array, length: Array) -> Array:
    result = jnp.asarray(fn(tokens, length))
    batch = tokens.shape[0]
    if result.dtype != jnp.bool_ or result.shape not in ((), (batch,)):
        raise TypeError(
            f"stopping criterion {fn!r} returned {result.dtype}{list(result.shape)}; it must "
            f"return bool[{batch}] (one flag per row) or a bool scalar. Compare, e.g. "
            f"tokens[:, length - 1] == 7."
        )
    return jnp.broadcast_to(result, (batch,))
