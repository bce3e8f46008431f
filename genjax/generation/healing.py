"""Token healing: the prompt's last token is regenerated as any vocabulary token that extends
it, so a prompt cut inside a word ("import os.pa") continues from the whole word ("path").

It runs on the host, before the compiled program, on concrete prompts: transformers v5's
``GenerationMixin.heal_tokens``, step for step::

    rows     decode each row (skip_special_tokens), strip, re-tokenize the B texts with padding,
             replace the BOS id by the pad id
    tail     for each row: t = its last token, s = decode([t]), with " " replaced by the
             tokenizer's space token (when convert_tokens_to_ids(" ") is not None)
    biases   {(id,): 10.0 for every vocabulary string extending s}, then +1.0 on (t,)
    skip     a row all padding, a row with one bias entry, a one-token row
    regen    the row without t -> one new token by ``generate`` with
             GenerationConfig(max_new_tokens=1, pad_token_id=tokenizer.pad_token_id,
             sequence_bias=biases), merged with the model's generation_config as any call is

The row is then the regenerated one. With the default merge, a checkpoint whose
``generation_config.json`` samples (``do_sample: true``) samples the healed token too, as in
transformers: the healing step then needs ``key=`` even when the call itself is greedy.

Differences from transformers:
    - the healing step runs with ``token_healing=False`` (transformers' inner ``generate``
      would heal its prompt again when the model's config turns healing on);
    - transformers heals every copy of a row for ``num_beams``/``num_return_sequences``
      separately; genjax heals each prompt once and the program repeats it (the same tokens
      when the healing step is greedy; with a sampling step the copies share one draw);
    - genjax's own :class:`~genjax.tokenizer.Tokenizer` re-tokenizes with its left padding
      (a transformers tokenizer pads on its ``padding_side``, right by default).

The attention mask of the call afterwards is transformers' too: its mask is computed from the
prompts as given and is not recomputed after healing. A mask of all ones (no padding) stays all
ones over the healed prompts, which may be shorter (the strip) and may hold pad ids (the BOS
replaced); any other mask is kept as it is, which needs the healed prompts to keep their length
(else genjax raises). Re-tokenizing a padded batch may move its padding (to the right for a
tokenizer that pads right), so heal a batch of prompts of different lengths one prompt at a
time, or with :func:`genjax.heal_tokens` and a mask of your own.

Layer: floor 5 (generation); reads the tokenizer classes of :mod:`genjax.io.tokenizer`.

References:
    Guidance's token healing: https://github.com/guidance-ai/guidance (README, "Token
    healing"); transformers PR #30081.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping

import jax
import numpy as np

from genjax.config import GenerationConfig
from genjax.errors import InputError, UnsupportedError
from genjax.generation import encoder_decoder
from genjax.generation.inputs import infer_attention_mask, resolve_config
from genjax.generation.prefill import special_ids
from genjax.io.tokenizer import Tokenizer

__all__ = ["ExtensionsTrie", "heal", "heal_call", "healing_config", "healing_step"]

EXTENSION_BIAS = 10.0  # added to the score of every token extending the tail token
ORIGINAL_BONUS = 1.0  # added once more to the tail token itself, to limit aggressive healing

Regenerate = Callable[[np.ndarray, GenerationConfig, int], np.ndarray]
"""``fn(ids int[1, L-1], config, row) -> int[L]``: the row with one new token (``row`` is the
row's index in the batch, for its key)."""


class ExtensionsTrie:
    """transformers' ``ExtensionsTrie`` over a vocabulary: the tokens that extend a prefix.

    It mirrors transformers' quirk exactly: the walk down the trie stops at the first character
    of the prefix that has no child, and the tokens below *that* node are returned glued to the
    *whole* prefix. So a prefix with no exact path returns strings that are not in the
    vocabulary (``extensions("ab?")`` with tokens "ab" and "abc" gives ``["ab?", "ab?c"]``);
    :func:`heal` maps them through the tokenizer as transformers does.

    Example:
        >>> ExtensionsTrie(["app", "apple", "application"]).extensions("app")
        ['app', 'apple', 'application']
    """

    _END = ""  # the key that marks a token's end, as transformers' `_termination_char`

    def __init__(self, tokens):
        self.data: dict = {}
        for token in tokens:
            if not token:
                continue
            node = self.data
            for char in token:
                node = node.setdefault(char, {})
            node[self._END] = 1

    def extensions(self, prefix: str) -> list[str]:
        """The vocabulary strings that extend ``prefix`` (``prefix`` itself first when it is a
        token), children in the order their characters were first added."""
        node = self.data
        for char in prefix:
            if char not in node:
                break  # transformers' `_get_node`: stop here, keep the node reached
            node = node[char]
        return [prefix + rest for rest in self._below(node)]

    def _below(self, node: dict) -> list[str]:
        found = [self._END] if self._END in node else []
        for char, child in node.items():
            if char != self._END:
                found.extend(char + rest for rest in self._below(child))
        return found


@functools.lru_cache(maxsize=8)
def _trie(tokens: tuple[str, ...]) -> ExtensionsTrie:
    return ExtensionsTrie(tokens)


class _Vocabulary:
    """The tokenizer calls healing makes, for a transformers tokenizer (its own methods) or a
    genjax :class:`~genjax.tokenizer.Tokenizer` (its `tokenizers` backend, transformers' rules:
    an unknown string is the unk id, else None)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.genjax = isinstance(tokenizer, Tokenizer)
        needed = ("get_vocab", "batch_decode", "decode", "convert_tokens_to_ids")
        if not self.genjax and not all(hasattr(tokenizer, name) for name in needed):
            raise InputError(
                f"token healing needs the model's tokenizer as a transformers tokenizer "
                f"(AutoTokenizer.from_pretrained) or genjax.tokenizer.from_pretrained(path); got "
                f"{type(tokenizer).__name__}, which lacks {', '.join(needed)}."
            )
        self.bos_token_id = tokenizer.bos_token_id
        self.pad_token_id = tokenizer.pad_token_id

    def vocab(self) -> dict[str, int]:
        return self.tokenizer.get_vocab()

    def texts(self, ids: np.ndarray) -> list[str]:
        return list(self.tokenizer.batch_decode(ids.tolist(), skip_special_tokens=True))

    def encode(self, texts: list[str]) -> np.ndarray:
        if self.genjax:
            return np.asarray(self.tokenizer(texts)["input_ids"], np.int64)
        return np.asarray(self.tokenizer(texts, padding=True, return_tensors="np")["input_ids"])

    def text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.genjax else self.tokenizer.decode(token_id)

    def token_to_id(self, token: str) -> int | None:
        if not self.genjax:
            return self.tokenizer.convert_tokens_to_ids(token)
        found = self.tokenizer.backend.token_to_id(token)
        return self.tokenizer.token_id("unk_token") if found is None else found

    def id_to_token(self, token_id: int) -> str:
        if self.genjax:
            return self.tokenizer.backend.id_to_token(token_id)
        return self.tokenizer.convert_ids_to_tokens(token_id)


def heal(input_ids, tokenizer, regenerate: Regenerate) -> np.ndarray:
    """The healed prompts: transformers' ``heal_tokens`` (see the module docstring).

    Args:
        input_ids: int[B, P] prompts (concrete).
        tokenizer: a transformers tokenizer or a genjax :class:`~genjax.tokenizer.Tokenizer`.
        regenerate: the healing step (:data:`Regenerate`), given each row to heal and its
            :func:`healing_config`.

    Returns:
        int64[B, P'] the healed prompts; ``P'`` is the re-tokenized length (the texts are
        stripped, so it may differ from ``P``).
    """
    vocab = _Vocabulary(tokenizer)
    bos, pad = vocab.bos_token_id, vocab.pad_token_id
    ids = vocab.encode([text.strip() for text in vocab.texts(np.asarray(input_ids))])
    if bos is not None:
        ids = np.where(ids == bos, pad, ids)  # healing is not conditioned on BOS
    if ids.size == 0:
        return ids
    trie = _trie(tuple(vocab.vocab()))
    space = vocab.token_to_id(" ")
    space_token = None if space is None else vocab.id_to_token(space)[0]  # transformers' [0]
    for row, tail_id in enumerate(ids[:, -1].tolist()):
        tail = vocab.text(tail_id)
        if space_token is not None:
            tail = tail.replace(" ", space_token)
        if np.all(ids[row] == pad):
            continue  # an empty prompt
        biases = {(vocab.token_to_id(token),): EXTENSION_BIAS for token in trie.extensions(tail)}
        if len(biases) == 1:
            continue  # no alternative to heal with
        _check_biases(biases, tail, tail_id)
        biases[(tail_id,)] += ORIGINAL_BONUS
        trimmed = ids[row, :-1].copy()
        if trimmed.size == 0:
            continue
        if np.count_nonzero(ids[row] != pad) == 1:  # a one-token prompt: regenerate from BOS
            if bos is None:
                raise InputError(
                    "token healing regenerates a one-token prompt from the BOS token, but the "
                    "tokenizer has no bos_token_id (transformers fails here too). Give the "
                    "prompt more than one token, or leave token_healing unset."
                )
            trimmed[-1] = bos
        healed = regenerate(trimmed[None], healing_config(pad, biases), row)
        ids[row] = np.asarray(healed).reshape(-1)[: ids.shape[1]]
    return ids


def _check_biases(biases: Mapping, tail: str, tail_id: int) -> None:
    """Raises where transformers fails: an extension string outside the vocabulary (its id is
    None: the sequence-bias processor refuses it), or a tail token that is not among its own
    extensions (transformers' ``seq_bias[(tail_id,)]`` is a KeyError)."""
    if (None,) in biases or (tail_id,) not in biases:
        raise InputError(
            f"token healing cannot heal the prompt's last token {tail_id} ({tail!r}): its text "
            f"does not spell a vocabulary entry, so the strings found as its extensions are "
            f"not tokens (transformers fails here too). Leave token_healing unset for this "
            f"prompt, or end it on a whole word."
        )


def healing_config(pad_token_id, biases: Mapping) -> GenerationConfig:
    """The healing step's config: transformers' ``GenerationConfig(max_new_tokens=1,
    pad_token_id=...)`` with ``sequence_bias``; ``generate`` merges it with the model's
    ``generation_config``. ``token_healing=False``: the step does not heal again."""
    return GenerationConfig(
        max_new_tokens=1,
        pad_token_id=pad_token_id,
        sequence_bias=[[list(ids), float(bias)] for ids, bias in biases.items()],
        token_healing=False,
    )


def heal_call(model, input_ids, config, request, regenerate: Regenerate):
    """``(input_ids, request)`` for a ``generate`` call: the prompts healed and the request's
    ``attention_mask`` replaced when the call's resolved config sets ``token_healing``, else
    both as given.

    Args:
        model: the model; its ``generation_config`` is merged as ``generate`` merges it.
        input_ids: int[B, P] the prompts as given.
        config: the call's config (before the merge) or None.
        request: the call's :class:`~genjax.generation.plan.CallRequest`.
        regenerate: the healing step (:data:`Regenerate`).

    Raises:
        InputError: no ``tokenizer=``, traced prompts (inside ``jax.jit``), or a padded batch
            whose healed prompts changed length.
        UnsupportedError: an encoder-decoder model.
    """
    default = getattr(model, "generation_config", None)
    settings = [request.overrides.get("token_healing")]
    settings += [getattr(c, "token_healing", None) for c in (config, default)]
    if not any(settings):  # nothing sets it: skip the config merge prepare() does anyway
        return input_ids, request
    _, resolved = resolve_config(config, dict(request.overrides), default)
    mask = request.attention_mask
    if not resolved.token_healing:
        return input_ids, request
    if encoder_decoder.is_encoder_decoder(model):
        raise UnsupportedError(
            "token_healing=True is for decoder-only models: an encoder-decoder model's prompt "
            "is its encoder input, which the decoder does not continue. Leave it unset."
        )
    if request.tokenizer is None:
        raise InputError(
            "token_healing=True needs the model's tokenizer: pass tokenizer= to generate (a "
            "transformers tokenizer or genjax.tokenizer.from_pretrained(path)), as transformers "
            "asks for it in its `tokenizer` argument."
        )
    if any(isinstance(x, jax.core.Tracer) for x in (input_ids, mask)):
        raise InputError(
            "token_healing=True needs concrete input_ids and a tokenizer: it decodes and "
            "re-tokenizes the prompts on the host, which cannot happen inside jax.jit. Heal "
            "before the jitted call, ids = genjax.heal_tokens(model, params, ids, tokenizer), "
            "and generate from them with token_healing unset."
        )
    ids = np.asarray(input_ids)
    if mask is None:
        mask = infer_attention_mask(ids, *special_ids(resolved))
    healed = heal(ids, request.tokenizer, regenerate)
    mask = _healed_mask(np.asarray(mask), healed.shape)
    return healed.astype(np.int32), dataclasses.replace(request, attention_mask=mask)


def _healed_mask(mask: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """transformers' mask after healing: the prompts' mask, not recomputed (see the module
    docstring); all ones stays all ones over the healed prompts' shape."""
    if mask.all():
        return np.ones(shape, np.int32)
    if mask.shape != shape:
        raise InputError(
            f"token healing re-tokenized a padded batch of prompts {mask.shape} into "
            f"{shape}: transformers keeps the first mask, which no longer lines up with the "
            f"prompts. Heal prompts of different lengths one at a time, or heal them with "
            f"genjax.heal_tokens and pass a mask of your own."
        )
    return mask.astype(np.int32)


def healing_step(generate, model, params, tokenizer, key) -> Regenerate:
    """The healing step :func:`heal` runs: one new token by ``generate`` (the caller's
    :func:`genjax.generate`), with ``fold_in(key, row)`` as row ``row``'s key."""

    def regenerate(ids, config: GenerationConfig, row: int):
        default = getattr(model, "generation_config", None)
        if key is None and resolve_config(config, {}, default)[1].do_sample:
            raise InputError(
                "token healing regenerates the prompt's last token with the model's "
                "generation_config (as transformers does), which samples (do_sample=True), so "
                "it needs a PRNG key even when the call itself is greedy: pass "
                "key=jax.random.key(seed), or give the model a greedy config with "
                "model.with_generation_config(model.generation_config.replace(do_sample=False))."
            )
        row_key = None if key is None else jax.random.fold_in(key, row)
        out = generate(model, params, ids, config, key=row_key, tokenizer=tokenizer)
        return out.sequences[0]

    return regenerate
