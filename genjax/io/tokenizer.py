"""Tokenizers from Hugging Face checkpoints: ``tokenizer.json`` through the `tokenizers` library,
special tokens from ``tokenizer_config.json``, and chat templates rendered in a sandboxed Jinja.

Everything here runs on the host, outside ``jit``: encoding produces left-padded NumPy arrays
ready for :func:`genjax.generate`, decoding turns its ``sequences`` back into text.

Example:
    >>> tok = genjax.tokenizer.from_pretrained(genjax.io.bundled.path())
    >>> batch = tok(["def f():", "import os"])  # left-padded int32 arrays
    >>> batch["attention_mask"]
    array([[1, 1, 1],
           [0, 1, 1]], dtype=int32)
    >>> out = genjax.generate(model, params, batch["input_ids"], config,
    ...                       attention_mask=batch["attention_mask"])
    >>> tok.batch_decode(out.sequences, skip_special_tokens=True)[1]
    'import os.path.join'

References:
    The chat-template environment follows transformers' ``utils/chat_template_utils.py``:
    an immutable sandbox with ``trim_blocks``/``lstrip_blocks``, loop controls, a ``tojson``
    filter that does not escape HTML, and the ``raise_exception``/``strftime_now`` globals.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import numpy as np

from genjax.errors import CheckpointError, InputError

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token")
_HUB_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "*.jinja"]


@dataclasses.dataclass(frozen=True)
class Tokenizer:
    """A `tokenizers.Tokenizer` with the checkpoint's special tokens and chat template.

    Padding is always on the left, as decoder-only generation needs.
    """

    backend: Any  # tokenizers.Tokenizer
    special_tokens: Mapping[str, str]  # e.g. {"eos_token": "</s>", "pad_token": "<pad>"}
    chat_template: str | None = None

    # ------------------------------------------------------------------ ids and tokens
    @property
    def backend_tokenizer(self) -> Any:
        """The `tokenizers.Tokenizer` (transformers' name for it), where stop strings read the
        vocabulary, its decoder and its pre-tokenizer (a byte-level one is matched on bytes)."""
        return self.backend

    def get_vocab(self) -> dict[str, int]:
        """Token string -> id, added tokens included."""
        return self.backend.get_vocab(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        """The number of ids, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        """The token string of each id (None for an id outside the vocabulary)."""
        return [self.backend.id_to_token(int(i)) for i in ids]

    def token_id(self, name: str) -> int | None:
        """The id of a special token by role (``"eos_token"``, ``"pad_token"``...), or None."""
        token = self.special_tokens.get(name)
        return None if token is None else self.backend.token_to_id(token)

    @property
    def eos_token_id(self) -> int | None:
        return self.token_id("eos_token")

    @property
    def bos_token_id(self) -> int | None:
        return self.token_id("bos_token")

    @property
    def pad_token_id(self) -> int | None:
        """The pad id, falling back to the EOS id as generation does."""
        pad = self.token_id("pad_token")
        return self.eos_token_id if pad is None else pad

    # ------------------------------------------------------------------ encode / decode
    def __call__(self, texts: str | Sequence[str], add_special_tokens: bool = True) -> dict:
        """Encodes texts into left-padded arrays.

        Args:
            texts: one string or a list of B strings.
            add_special_tokens: let the tokenizer add BOS/EOS as its ``tokenizer.json``
                post-processor says (``add_bos_token`` in tokenizer_config.json is not read,
                as for transformers' generic fast tokenizer).

        Returns:
            ``{"input_ids": int32[B, P], "attention_mask": int32[B, P]}``, padded on the left
            with ``pad_token_id`` (0 when the tokenizer has neither pad nor EOS token).
        """
        if isinstance(texts, str):
            texts = [texts]
        if not texts or not all(isinstance(t, str) for t in texts):
            raise InputError(f"expected a string or a non-empty list of strings, got {texts!r}.")
        encodings = self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        return self.pad([e.ids for e in encodings])

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The ids of one text."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def pad(self, rows: Sequence[Sequence[int]]) -> dict:
        """Left-pads id lists into ``input_ids`` and ``attention_mask`` int32[B, P]."""
        length = max(len(r) for r in rows)
        pad = self.pad_token_id if self.pad_token_id is not None else 0
        ids = np.full((len(rows), length), pad, np.int32)
        mask = np.zeros((len(rows), length), np.int32)
        for i, row in enumerate(rows):
            if row:
                ids[i, length - len(row) :] = row
                mask[i, length - len(row) :] = 1
        return {"input_ids": ids, "attention_mask": mask}

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """The text of one id sequence."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def batch_decode(self, ids, skip_special_tokens: bool = False) -> list[str]:
        """The text of each row of an int[B, S] array or list of id lists."""
        return [self.decode(row, skip_special_tokens) for row in np.asarray(ids).tolist()]

    # ------------------------------------------------------------------ chat
    def apply_chat_template(
        self,
        conversation: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        continue_final_message: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        chat_template: str | None = None,
        **template_kwargs: Any,
    ) -> str | list[int]:
        """Renders a conversation with the checkpoint's chat template (sandboxed Jinja).

        Args:
            conversation: messages, each a dict with ``role`` and ``content``.
            add_generation_prompt: end with the template's cue for the assistant's turn.
            tokenize: return ids (the template adds special tokens itself, so none are
                added on top); False returns the rendered text.
            continue_final_message: leave the last message open so generation continues it.
            tools: JSON-schema tool descriptions passed to the template.
            documents: ``{"title", "text"}`` dicts passed to the template.
            chat_template: a template to use instead of the checkpoint's.
            **template_kwargs: more variables for the template.

        Example:
            >>> print(tok.apply_chat_template([{"role": "user", "content": "Hi"}],
            ...                               add_generation_prompt=True, tokenize=False))
            # user: Hi
            # assistant:
        """
        template = chat_template or self.chat_template
        if template is None:
            raise InputError(
                "this tokenizer has no chat template (no `chat_template` in "
                "tokenizer_config.json and no chat_template.jinja). Pass chat_template=... ."
            )
        if add_generation_prompt and continue_final_message:
            raise InputError(
                "add_generation_prompt and continue_final_message cannot both be set: one opens "
                "a new assistant turn, the other continues the last message."
            )
        messages = [dict(m) for m in conversation]
        for message in messages:
            if "role" not in message:
                raise InputError(f"each message needs a 'role'; got {message!r}.")
        text = _compile(template).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            tools=None if tools is None else [dict(t) for t in tools],
            documents=None if documents is None else [dict(d) for d in documents],
            **{**dict(self.special_tokens), **template_kwargs},
        )
        if continue_final_message:
            text = _cut_after_final_message(text, messages)
        return self.encode(text, add_special_tokens=False) if tokenize else text


def _cut_after_final_message(text: str, messages: list[dict]) -> str:
    """Drops what the template wrote after the last message's content."""
    final = messages[-1].get("content")
    if not isinstance(final, str) or final.strip() not in text:
        raise InputError(
            "continue_final_message needs the last message's content, as a string, to appear in "
            "the rendered template."
        )
    end = text.rindex(final.strip()) + len(final.strip())
    return text[:end]


_TEMPLATES: dict[str, Any] = {}


def _compile(template: str):
    """Compiles (once per template string) in an immutable Jinja sandbox."""
    if template in _TEMPLATES:
        return _TEMPLATES[template]
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _Generation(jinja2.ext.Extension):
        """Accepts ``{% generation %}...{% endgeneration %}`` and renders the body as is."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(
                lineno
            )

        def _render(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
            sort_keys=sort_keys,
        )  # fmt: skip

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        compiled = env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as error:
        message = f"the chat template does not parse: {error} (line {error.lineno})."
        raise InputError(message) from None
    _TEMPLATES[template] = compiled
    return compiled


def _token_text(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(value, Mapping):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{path} is not valid JSON: {error}.") from None


def _chat_template(folder: str, config: Mapping[str, Any]) -> str | None:
    """The default chat template: chat_template.jinja, else tokenizer_config's entry (a string,
    or a list of named templates of which 'default' is taken)."""
    jinja_path = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(jinja_path):
        with open(jinja_path, encoding="utf-8") as f:
            return f.read()
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        return named.get("default")
    return template


def from_pretrained(
    name_or_path: str | os.PathLike,
    revision: str | None = None,
    local_files_only: bool = False,
    cache_dir: str | None = None,
    token: str | None = None,
    gguf_file: str | os.PathLike | None = None,
) -> Tokenizer:
    """Loads the tokenizer of a checkpoint folder, hub id or GGUF file.

    Reads ``tokenizer.json`` (required), and ``tokenizer_config.json``,
    ``special_tokens_map.json`` and ``chat_template.jinja`` when present. A GGUF file
    (``gguf_file=`` as in transformers, or a path ending in ``.gguf``) gives the tokenizer and chat
    template of its metadata (:mod:`genjax.io.gguf_tokenizer`).

    Raises:
        CheckpointError: the folder or ``tokenizer.json`` is missing (a checkpoint with only a
            SentencePiece ``tokenizer.model`` must be converted to ``tokenizer.json`` first),
            or a file is not valid (truncated JSON, an unreadable tokenizer).

    Example:
        >>> tok = from_pretrained(genjax.io.bundled.path())  # a folder or a Hub id
        >>> tok.eos_token_id, tok.pad_token_id
        (0, 0)
        >>> tok = from_pretrained("dir", gguf_file="model.Q4_1.gguf")  # doctest: +SKIP
    """
    from tokenizers import Tokenizer as Backend

    from genjax.io import gguf_tokenizer
    from genjax.models.loading import gguf_location

    gguf_path = gguf_location(name_or_path, gguf_file, revision, local_files_only, cache_dir, token)
    if gguf_path is not None:
        backend, special, template = gguf_tokenizer.read(gguf_path)
        return Tokenizer(backend=backend, special_tokens=special, chat_template=template)
    folder = os.fspath(name_or_path)
    if not os.path.isdir(folder):
        folder = _download(folder, revision, local_files_only, cache_dir, token)
    path = os.path.join(folder, "tokenizer.json")
    if not os.path.isfile(path):
        hint = (
            " It has a SentencePiece tokenizer.model: save it once with transformers' "
            "AutoTokenizer(...).save_pretrained() to produce tokenizer.json."
            if os.path.isfile(os.path.join(folder, "tokenizer.model"))
            else ""
        )
        raise CheckpointError(f"no tokenizer.json in {folder}.{hint}")
    try:
        backend = Backend.from_file(path)
    except Exception as error:  # noqa: BLE001 - tokenizers raises a bare Exception
        raise CheckpointError(
            f"{path} is not a readable tokenizer.json ({error}); it may be truncated or "
            "corrupt. Download or save the tokenizer again."
        ) from None
    config: dict = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        if os.path.isfile(os.path.join(folder, name)):
            config.update(_read_json(os.path.join(folder, name)))
    special = {k: _token_text(config.get(k)) for k in SPECIAL_TOKEN_KEYS}
    return Tokenizer(
        backend=backend,
        special_tokens={k: v for k, v in special.items() if v is not None},
        chat_template=_chat_template(folder, config),
    )


def _download(repo_id, revision, local_files_only, cache_dir, token) -> str:
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(
            repo_id,
            revision=revision,
            allow_patterns=_HUB_FILES,
            local_files_only=local_files_only,
            cache_dir=cache_dir,
            token=token,
        )
    except Exception as error:  # noqa: BLE001 - any hub failure becomes one clear error
        raise CheckpointError(
            f"{repo_id!r} is not a local folder and could not be fetched from the hub: {error}"
        ) from error
