"""Stop strings: the tables a stop-string check needs, built once per vocabulary, and the check.

Part of :mod:`genjax.stopping` (which re-exports :class:`StopStringTable`,
:func:`stop_string_table` and :func:`stop_string_hits`); see its docstring for the rules, the
axes (``U``, ``X``, ``W``, ``Q``, ``O``) and what is static or traced.

References:
    Hugging Face transformers' ``StopStringCriteria`` (``generation/stopping_criteria.py``)
    defines the semantics: a stop string may span several tokens and may end inside a token.
"""

from __future__ import annotations

import collections
import json
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from genjax.errors import InputError
from genjax.typing import Array

_NO_MATCH = -1  # table entry for "no position", and the length of unused token ids


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
    changing its number of tokens is not read again). Building is a Python pass over every
    token, as in transformers (seconds for a large vocabulary); a cached table is a lookup.

    The vocabulary is cleaned as transformers' ``StopStringCriteria`` cleans it: a token stands
    for the text it adds when decoded after other text (so GPT-2's "Ġ" and SentencePiece's "▁"
    become spaces); byte-level vocabularies (GPT-2 style) and byte-fallback tokens (``<0x0A>``)
    are matched on UTF-8 bytes, so a stop string may end inside a character.

    Args:
        tokenizer: the vocabulary's source: a transformers tokenizer (``get_vocab``, calling it,
            ``convert_ids_to_tokens``, ``convert_tokens_to_string``), a ``tokenizers.Tokenizer``
            or an object holding one as ``backend_tokenizer`` (``genjax.tokenizer.Tokenizer``),
            or any object with ``get_vocab()`` alone, whose tokens are then taken as their text.
            A ByteLevel decoder (or, without a decoder, a ByteLevel pre-tokenizer) means bytes.
        stop_strings: one non-empty string or a sequence of them.

    Returns:
        A :class:`StopStringTable` of device arrays (traced when passed to a jitted function;
        its shapes, and ``window``, are static).

    Raises:
        InputError: empty stop strings, or a stop string no sequence of tokens spells (named).
        TypeError: ``tokenizer`` has no ``get_vocab()``.

    Example:
        >>> table = stop_string_table(tok, ["\\n\\n", "###"])
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
        table = _build_table(source.clean(vocab), targets, source.hint())
    _remember(_BY_CONTENT, key, table)
    _remember(_BY_TOKENIZER, quick, (tokenizer, table))
    return table


def token_texts(tokenizer: Any) -> tuple[dict[int, str | bytes], bool]:
    """Each token id's text, read as :func:`stop_string_table` reads it (the text the token adds
    when decoded after other text), for other vocabulary-level automata (structured output).

    Returns:
        ``(texts, as_bytes)``: token id -> text, and whether the texts are UTF-8 ``bytes`` (a
        byte-level or byte-fallback vocabulary) rather than ``str``.

    Example:
        >>> texts, as_bytes = token_texts(tokenizer)  # doctest: +SKIP
    """
    source = _VocabSource.of(tokenizer)
    return source.clean(source.vocab()), source.mode is not None


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
        >>> table = stop_string_table(tok, ["\\n\\n"])
        >>> tokens = tok(["x = 1\\n\\n", "x = 1"])["input_ids"]  # int32[2, 4]
        >>> stop_string_hits(table, tokens, jnp.int32(4)).tolist()
        [True, False]
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
        for backend in (tokenizer, getattr(tokenizer, "backend_tokenizer", None)):
            if _is_tokenizers_backend(backend):
                return cls(backend, _byte_level_hint(backend), "tokenizers")
        return cls(tokenizer, None, "plain")

    def fingerprint(self) -> tuple:
        state = _decoder_state(self.decoder)
        return (self.kind, self.mode, None if state is None else json.dumps(state, sort_keys=True))

    def hint(self) -> str:
        """Advice for a stop string no token sequence spells, from how the vocabulary was read."""
        if self.kind == "plain":
            return (
                f" The tokenizer ({type(self.tokenizer).__name__}) has only get_vocab(), so each "
                f'token is taken as its own text; a byte-level vocabulary ("Ġ" for a space) '
                f"needs a transformers tokenizer or a tokenizers.Tokenizer to be read as bytes."
            )
        return ""

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


def _is_tokenizers_backend(backend: Any) -> bool:
    """Whether ``backend`` looks like a ``tokenizers.Tokenizer`` (the library's, or an object
    with its reading methods)."""
    return all(
        callable(getattr(backend, name, None)) for name in ("get_vocab", "id_to_token", "encode")
    ) and hasattr(backend, "decoder")


def _byte_level_hint(backend: Any) -> Any:
    """The decoder that decides the matching mode of a ``tokenizers.Tokenizer``: its own, or,
    when it has none, its pre-tokenizer, so that a ByteLevel pre-tokenizer alone still means
    byte-level tokens ("Ġ" for a space)."""
    decoder = backend.decoder
    if decoder is None:
        pre_tokenizer = getattr(backend, "pre_tokenizer", None)
        if "ByteLevel" in set(_types_named(_decoder_state(pre_tokenizer))):
            return pre_tokenizer
    return decoder


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


def _can_spell(per: dict[int, tuple[list[int], list[int]]], lengths: dict, size: int) -> bool:
    """Whether some chain of tokens spells the stop string: from a token's end length, earlier
    tokens at valid positions grow the matched count until it reaches ``size``."""
    steps = collections.defaultdict(set)  # matched count -> lengths of the tokens fitting there
    for index, (positions, _) in per.items():
        for matched in positions:
            steps[matched].add(lengths[index])
    frontier = [end for _, ends in per.values() for end in ends]
    seen = set()
    while frontier:
        matched = frontier.pop()
        if matched >= size:
            return True
        if matched not in seen:
            seen.add(matched)
            frontier.extend(matched + length for length in steps[matched])
    return False


def _build_table(clean: dict[int, str | bytes], targets: tuple, hint: str) -> StopStringTable:
    fits = [{index: _token_fits(stop, text) for index, text in clean.items()} for stop in targets]
    lengths = {index: len(text) for index, text in clean.items()}
    never = [
        t for t, per in zip(targets, fits, strict=True) if not _can_spell(per, lengths, len(t))
    ]
    if never:
        names = [t.decode("utf-8") if isinstance(t, bytes) else t for t in never]
        raise InputError(
            f"the stop strings {names} can never match: no sequence of the tokenizer's tokens "
            f"spells them, so they probably hold characters the vocabulary lacks.{hint} Remove "
            f"them or pass the model's own tokenizer."
        )
    most_positions = max((len(p) for per in fits for p, _ in per.values()), default=0)
    most_ends = max(len(e) for per in fits for _, e in per.values())
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
