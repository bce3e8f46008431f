"""Tokenizers from GGUF files: a `tokenizers` object built from llama.cpp's ``tokenizer.ggml.*``
metadata, with the file's special tokens and chat template.

A GGUF file has no ``tokenizer.json``: it stores the vocabulary (``tokens``, ``token_type``,
``scores``), the BPE ``merges``, the special token ids and ``add_bos_token``/``add_eos_token``.
The tokenizer built here is the one transformers v5 builds from the same metadata
(``integrations/gguf/gguf_tokenizer_mapping.py``), so both encode text to the same ids:

* ``tokenizer.ggml.model == "gpt2"``: byte-level BPE. Tokens not spelled in the byte alphabet are
  respelled byte by byte; the text is split by GPT-2's pattern, or by the pattern of the
  ``tokenizer.ggml.pre`` family (``_SPLITS``: llama3, qwen2...) when the file names one.
* ``"llama"``: SentencePiece-style BPE with byte fallback, ``▁`` for spaces (prepended to the
  first word), BOS added unless the file says ``add_bos_token = false``. Merges absent from the
  file are derived from the vocabulary and its scores, best score first.
* Control tokens (type 3) become special added tokens (matched whole, skipped by
  ``skip_special_tokens``); user-defined ones (type 4) plain added tokens.

Other tokenizer models (``t5``, ``gemma4``, ...) are refused by name.

Example:
    >>> tok = genjax.tokenizer.from_pretrained("dir", gguf_file="model.Q4_1.gguf")  # doctest: +SKIP
    >>> tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    ...  # doctest: +SKIP
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from genjax.errors import CheckpointError, UnsupportedError
from genjax.models import gguf

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp's token types
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> the split pattern its merges were learned with (others: GPT-2's).
_SPLITS = {
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx", "pixtral"), _LLAMA3
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2),
}
_SPECIAL_IDS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}


def read(path: str | os.PathLike) -> tuple[Any, dict[str, str], str | None]:
    """The tokenizer a GGUF file describes, as the parts of a :class:`genjax.tokenizer.Tokenizer`
    (which :func:`genjax.tokenizer.from_pretrained` assembles).

    Args:
        path: the ``.gguf`` file.

    Returns:
        ``(backend, special_tokens, chat_template)``: a ``tokenizers.Tokenizer``, the special
        tokens by role (``{"eos_token": "<|im_end|>", ...}``) and the template or None.

    Raises:
        CheckpointError: an unreadable file, or one without a tokenizer.
        UnsupportedError: a tokenizer model other than ``gpt2`` or ``llama``.

    Example:
        >>> backend, special, template = read("SmolLM2-135M-Instruct.Q4_1.gguf")  # doctest: +SKIP
        >>> special["eos_token"]  # doctest: +SKIP
        '<|im_end|>'
    """
    path = os.fspath(path)
    metadata = gguf.read_metadata(gguf.open_file(path))
    fields = {
        key[len("tokenizer.ggml.") :]: value
        for key, value in metadata.items()
        if key.startswith("tokenizer.ggml.")
    }
    if "tokens" not in fields:
        raise CheckpointError(f"{path} holds no tokenizer (no tokenizer.ggml.tokens).")
    tokens = fields["tokens"]
    special = {
        name: tokens[fields[key]]
        for name, key in _SPECIAL_IDS.items()
        if fields.get(key) is not None and 0 <= fields[key] < len(tokens)
    }
    backend = build_backend(fields, metadata.get("general.architecture"), special, path)
    return backend, special, metadata.get("tokenizer.chat_template")


def build_backend(
    fields: Mapping[str, Any], architecture: str | None, special: Mapping[str, str], path: str
):
    """The ``tokenizers.Tokenizer`` of the ``tokenizer.ggml.*`` entries ``fields`` (prefix
    stripped: ``tokens``, ``merges``, ``model``...), ``special`` the named special tokens."""
    from tokenizers import AddedToken

    kind = fields.get("model")
    if kind == "gpt2":
        backend = _byte_level(fields, path)
    elif kind == "llama" and architecture not in ("gemma", "gemma2", "gemma3", "phi3"):
        backend = _sentencepiece(fields, path)
    else:
        raise UnsupportedError(
            f"{path} describes a {kind!r} tokenizer (architecture {architecture!r}); genjax builds "
            "'gpt2' (byte-level BPE) and 'llama' (SentencePiece BPE) GGUF tokenizers. Use the "
            "model's tokenizer.json instead."
        )
    tokens, types = fields["tokens"], fields.get("token_type") or ()
    spelled = _byte_alphabet() if kind == "gpt2" else None
    control = [
        AddedToken(token, normalized=False, special=True)
        for token, kind_id in zip(tokens, types, strict=False)
        if kind_id == _CONTROL and (spelled is None or set(token) <= spelled)
    ]
    backend.add_special_tokens(control)
    vocab = backend.get_vocab(with_added_tokens=True)
    backend.add_tokens(
        [
            AddedToken(token, normalized=False, special=False)
            for token, kind_id in zip(tokens, types, strict=False)
            if kind_id == _USER_DEFINED and token in vocab
        ]
    )
    named = [token for token in special.values() if token in vocab]
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in named])
    _set_post_processor(backend, fields, special)
    return backend


def _byte_alphabet() -> set[str]:
    from tokenizers import pre_tokenizers

    return set(pre_tokenizers.ByteLevel.alphabet())


def _byte_spelling() -> dict[int, str]:
    """GPT-2's byte -> printable character table (bytes_to_unicode)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    table = {byte: chr(byte) for byte in printable}
    extra = (byte for byte in range(256) if byte not in table)
    table.update({byte: chr(256 + n) for n, byte in enumerate(extra)})
    return dict(sorted(table.items()))


def _byte_level(fields: Mapping[str, Any], path: str):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    spelling, alphabet = _byte_spelling(), _byte_alphabet()
    vocab = {
        token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode()): index
        for index, token in enumerate(fields["tokens"])
    }
    backend = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=_merges(fields, None, path),
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    split = _SPLITS.get(fields.get("pre"))
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece(fields: Mapping[str, Any], path: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokens = fields["tokens"]
    vocab = {token: index for index, token in enumerate(tokens)}
    scores = dict(zip(tokens, fields["scores"], strict=True)) if "scores" in fields else None
    backend = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=_merges(fields, scores, path),
            fuse_unk=True,
            byte_fallback=True,
            dropout=None,
        )
    )
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first", split=False
    )
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(content=" ", left=1, right=0),
        ]
    )
    return backend


def _merges(fields: Mapping[str, Any], scores, path: str) -> list[tuple[str, str]]:
    """The file's merges, else the ones its vocabulary implies: every split of a token into two
    tokens, ordered by the token's score (best first), then by the pieces' lengths."""
    if "merges" in fields:
        return [tuple(merge.split(" ")) for merge in fields["merges"]]
    tokens = fields["tokens"]
    if scores is None:
        if "scores" not in fields:
            raise CheckpointError(f"{path} has neither tokenizer.ggml.merges nor scores.")
        scores = dict(zip(tokens, fields["scores"], strict=True))
    vocab = {token: index for index, token in enumerate(tokens)}
    found = []
    for token, score in scores.items():
        pieces = [
            (token[:cut], token[cut:], score)
            for cut in range(1, len(token))
            if token[:cut] in vocab and token[cut:] in vocab
        ]
        found.extend(sorted(pieces, key=lambda p: (vocab[p[0]], vocab[p[1]])))
    found.sort(key=lambda p: (p[2], len(p[0]), len(p[1])), reverse=True)
    return [(left, right) for left, right, _ in found]


def _set_post_processor(backend, fields: Mapping[str, Any], special: Mapping[str, str]) -> None:
    """BOS/EOS around each sequence as the file asks (``add_bos_token`` defaults to true for
    SentencePiece vocabularies, as llama.cpp and transformers assume)."""
    from tokenizers import processors

    add_bos = fields.get("add_bos_token", fields.get("model") == "llama")
    add_bos = bool(add_bos) and "bos_token" in special
    add_eos = bool(fields.get("add_eos_token", False)) and "eos_token" in special
    bos, eos = special.get("bos_token"), special.get("eos_token")
    single = f"{f'{bos}:0 ' if add_bos else ''}$A:0{f' {eos}:0' if add_eos else ''}"
    pair = f"{single}{f' {bos}:1' if add_bos else ''} $B:1{f' {eos}:1' if add_eos else ''}"
    used = [(bos, add_bos), (eos, add_eos)]
    backend.post_processor = processors.TemplateProcessing(
        single=single,
        pair=pair,
        special_tokens=[(token, backend.token_to_id(token)) for token, on in used if on],
    )
