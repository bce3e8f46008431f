"""Detecting green-list watermarks: :class:`WatermarkDetector`, with transformers' fields.

Text generated with ``watermarking_config`` (see :func:`genjax.processors.watermark`) holds more
"green" tokens than chance. The detector re-derives each token's green list from the tokens before
it, with the same primitives as the processor (so the two cannot disagree), counts the green
tokens and turns the count into a z-score against the ``greenlist_ratio`` a plain text would
reach, exactly as transformers' ``WatermarkDetector``.

Layer:
    Floor 2, beside :mod:`genjax.processors` (the only genjax package it imports, with
    :mod:`genjax.config` and :mod:`genjax.errors`). It runs on the host and returns numpy arrays.

References:
    Kirchenbauer et al. 2023, "A Watermark for Large Language Models", arXiv:2301.10226.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from genjax.config.files import decoder_config, read_model_config
from genjax.errors import InputError
from genjax.processors.greenlist import (
    check_watermarking,
    fixed_table,
    key_words,
    lefthash_seed,
    selfhash_seed,
    tokens_are_green,
)

__all__ = ["WatermarkDetector", "WatermarkDetectorOutput"]


@dataclasses.dataclass(frozen=True)
class WatermarkDetectorOutput:
    """What :meth:`WatermarkDetector.__call__` returns with ``return_dict=True``; every field is
    a numpy array with one entry per row, as transformers' ``WatermarkDetectorOutput``."""

    num_tokens_scored: np.ndarray  # float64[B]: n-grams scored (unique ones if so configured)
    num_green_tokens: np.ndarray  # float64[B]: of those, the green ones
    green_fraction: np.ndarray  # float64[B]: num_green_tokens / num_tokens_scored
    z_score: np.ndarray  # float64[B]: standard deviations above the unwatermarked expectation
    p_value: np.ndarray  # float64[B]: one-sided normal tail of z_score
    prediction: np.ndarray  # bool[B]: z_score > z_threshold
    confidence: np.ndarray  # float64[B]: 1 - p_value


class WatermarkDetector:
    """Scores token sequences for the green-list watermark of ``watermarking_config``.

    Same arguments and results as transformers' ``WatermarkDetector``: a sequence starting with
    the model's BOS (``decoder_start_token_id`` for encoder-decoder models) has it dropped first;
    each n-gram of ``context_width + 1`` tokens (``context_width`` with ``selfhash``) scores its
    last token; repeated n-grams count each time unless ``ignore_repeated_ngrams``.

    Args:
        model_config: the model's config: a transformers ``PreTrainedConfig``, a ``config.json``
            mapping or path, or a genjax model (its ``vocab_size`` and the BOS id of its
            ``generation_config``). Only ``vocab_size`` and the BOS id are read.
        device: accepted for transformers' signature and ignored (JAX's default device is used).
        watermarking_config: the mapping (or transformers ``WatermarkingConfig``) generation used.
        ignore_repeated_ngrams: score each distinct n-gram once.
        max_cache_size: accepted for transformers' signature; every distinct n-gram of a call is
            scored once in one batched program, so no cache is kept between calls.

    Example:
        >>> detector = WatermarkDetector({"vocab_size": 128, "bos_token_id": 1},
        ...                              watermarking_config={"bias": 2.0})
        >>> out = detector(np.array([[1, 5, 9, 17, 4, 60]]), return_dict=True)
        >>> out.num_tokens_scored.tolist(), out.prediction.tolist()
        ([4.0], [False])
    """

    def __init__(
        self,
        model_config: Any,
        device: Any = None,
        watermarking_config: Any = None,
        ignore_repeated_ngrams: bool = False,
        max_cache_size: int = 128,
    ):
        if watermarking_config is None:
            raise TypeError(
                "WatermarkDetector needs watermarking_config=, the mapping (or transformers "
                "WatermarkingConfig) the text was generated with."
            )
        if not isinstance(watermarking_config, Mapping):
            watermarking_config = watermarking_config.to_dict()
        self.vocab_size, self.bos_token_id = _model_ids(model_config)
        self.config = check_watermarking(watermarking_config, self.vocab_size)
        self.greenlist_ratio = self.config["greenlist_ratio"]
        self.ignore_repeated_ngrams = bool(ignore_repeated_ngrams)

    @property
    def ngram_length(self) -> int:
        """Tokens per scored n-gram: ``context_width + 1``, or ``context_width`` (selfhash)."""
        selfhash = self.config["seeding_scheme"] == "selfhash"
        return self.config["context_width"] + 1 - int(selfhash)

    def __call__(
        self, input_ids: Any, z_threshold: float = 3.0, return_dict: bool = False
    ) -> WatermarkDetectorOutput | np.ndarray:
        """Scores ``input_ids`` int[B, S]; returns bool[B] predictions, or every field.

        Raises:
            ValueError: rows that disagree on a leading BOS, or fewer than ``context_width + 1``
                tokens after it (transformers' errors).
            InputError: a token id outside ``[0, vocab_size)``.
        """
        ids = np.asarray(input_ids)
        if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
            raise InputError(f"input_ids must be int[B, S]; got {ids.dtype}{list(ids.shape)}.")
        has_bos = ids[:, 0] == self.bos_token_id if self.bos_token_id is not None else None
        if has_bos is not None and has_bos.any() != has_bos.all():
            raise ValueError(
                "Some batch contains inconsistent leading BOS token. Make sure to prepare input "
                "with the same tokenization parameters."
            )
        if has_bos is not None and has_bos[0]:
            ids = ids[:, 1:]
        width = self.config["context_width"]
        if ids.shape[-1] - width < 1:
            raise ValueError(
                f"Must have at least `1` token to score after the first min_prefix_len={width} "
                f"tokens required by the seeding scheme."
            )
        if ids.min() < 0 or ids.max() >= self.vocab_size:
            raise InputError(
                f"input_ids hold ids outside the vocabulary [0, {self.vocab_size - 1}]: "
                f"min {ids.min()}, max {ids.max()}. Pass the ids the model generated."
            )
        scored, green = self._score(ids)
        z_score = (green - self.greenlist_ratio * scored) / np.sqrt(
            scored * self.greenlist_ratio * (1 - self.greenlist_ratio)
        )
        prediction = z_score > z_threshold
        if not return_dict:
            return prediction
        p_value = np.array([0.5 * math.erfc(z / math.sqrt(2)) for z in z_score.tolist()])
        return WatermarkDetectorOutput(
            num_tokens_scored=scored,
            num_green_tokens=green,
            green_fraction=green / scored,
            z_score=z_score,
            p_value=p_value,
            prediction=prediction,
            confidence=1 - p_value,
        )

    def _score(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(scored, green), float64[B] each: the n-gram counts of every row."""
        n = self.ngram_length
        windows = np.lib.stride_tricks.sliding_window_view(ids, n, axis=1)  # [B, S - n + 1, n]
        counts = [collections.Counter(map(tuple, row.tolist())) for row in windows]
        unique = sorted(set().union(*counts))
        green = dict(zip(unique, self._is_green(np.array(unique, np.int32)).tolist(), strict=True))
        if self.ignore_repeated_ngrams:
            scored = [len(c) for c in counts]
            hits = [sum(green[g] for g in c) for c in counts]
        else:
            scored = [sum(c.values()) for c in counts]
            hits = [sum(f * green[g] for g, f in c.items()) for c in counts]
        return np.asarray(scored, np.float64), np.asarray(hits, np.float64)

    def _is_green(self, ngrams: np.ndarray) -> np.ndarray:
        """bool[U]: whether each n-gram int32[U, n]'s last token is green for its prefix.

        One program per scheme, n-gram width (selfhash; lefthash reads only the last two
        tokens), vocabulary and green-list size: the key is traced, the count padded to a power
        of two (at least 64)."""
        cfg = self.config
        selfhash = cfg["seeding_scheme"] == "selfhash"
        ngrams = ngrams if selfhash else ngrams[:, -2:]
        count = len(ngrams)
        padded = np.zeros((max(64, 1 << (count - 1).bit_length()), ngrams.shape[1]), np.int32)
        padded[:count] = ngrams
        key = int(cfg["hashing_key"])
        table = jnp.asarray(fixed_table(key, self.vocab_size)) if selfhash else None
        size = int(self.vocab_size * cfg["greenlist_ratio"])
        words = tuple(np.uint32(w) for w in key_words(key))
        hits = _green_ngrams(jnp.asarray(padded), words, table, self.vocab_size, size)
        return np.asarray(hits)[:count]


@functools.partial(jax.jit, static_argnums=(3, 4))
def _green_ngrams(ngrams, key, table, vocab: int, size: int):
    """bool[U]: the green test of each n-gram int32[U, n] (a selfhash one when ``table`` is
    given, else a lefthash pair), as transformers' detector runs it."""

    def seed(ngram):
        if table is not None:
            return selfhash_seed(ngram, key, table)
        return lefthash_seed(ngram[:-1], key[1])

    def block(ngrams):  # int32[64, n]: bounds the [64, G] green lists held at once
        return tokens_are_green(jax.vmap(seed)(ngrams), ngrams[:, -1], vocab, size)

    return lax.map(block, ngrams.reshape(-1, 64, ngrams.shape[-1])).reshape(-1)


def _model_ids(model_config: Any) -> tuple[int, int | None]:
    """(vocab_size, BOS id) of a genjax model or a model config (mapping, path, to_dict())."""
    if isinstance(getattr(model_config, "vocab_size", None), int) and hasattr(
        model_config, "generation_config"
    ):  # a genjax model
        generation = model_config.generation_config
        if getattr(model_config, "is_encoder_decoder", False):
            bos = getattr(model_config, "decoder_start_token_id", None)
        else:
            bos = None if generation is None else generation.bos_token_id
        return model_config.vocab_size, bos
    config = read_model_config(model_config)
    text = decoder_config(config)
    vocab = config.get("vocab_size", text.get("vocab_size"))
    if not isinstance(vocab, int) or vocab < 1:
        raise InputError(
            f"model_config has no usable vocab_size (got {vocab!r}); pass the model's config "
            f"(e.g. model.config or the path of its config.json)."
        )
    key = "decoder_start_token_id" if config.get("is_encoder_decoder") else "bos_token_id"
    return vocab, config.get(key, text.get(key))
