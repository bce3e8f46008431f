"""Green-list watermarking (Kirchenbauer et al.), bit for bit as transformers'
``WatermarkLogitsProcessor``: :func:`watermark` (the processor), :func:`check_watermarking` (the
``watermarking_config`` mapping), and the green-list primitives the detector
(:mod:`genjax.watermarking`) shares.

transformers draws each green list as the first ``G = int(V * greenlist_ratio)`` entries of
``torch.randperm(V)`` on a CPU generator seeded per step. torch's CPU ``randperm`` (for
``V < 2**32 / 20``, every real vocabulary) is MT19937 seeded with the seed's low 32 bits
(``init_genrand``), then a forward Fisher-Yates shuffle of ``arange(V)``::

    for i in 0 .. V-2:   j = i + mt_next() % (V - i);   swap(r[i], r[j])

Position ``i`` never changes after step ``i``, so the green list needs only the first ``G``
steps and ``G`` MT outputs. Both are reproduced here in uint32 JAX ops inside the compiled loop:
the MT state is built by a 623-step scan and refilled in vectorized twists of 624 words; the
``G`` swaps are not run one by one but solved in parallel (:func:`green_lists` explains how), so
a step costs ``O(G log G)`` vectorized work and no sequential loop over the vocabulary.

Seeds, as transformers computes them (``hk`` = ``hashing_key``, ``T`` = the constant table
``randperm(1_000_003)`` seeded with ``hk``, ``w`` the last ``context_width`` tokens)::

    lefthash:  seed = hk * w[-1]                              (a Python int)
    selfhash:  seed = min_k(hk * (T[w_k] + 1) * (T[w[-1]] + 1))  (int64, wrapping)
    generator.manual_seed(seed % (2**64 - 1))                  (MT uses the low 32 bits)

``selfhash`` appends each of the 40 best-scored candidates to the context and keeps those that are
green in their own list. The int64 products are done on (hi, lo) uint32 pairs, so nothing needs
``jax_enable_x64``. ``T`` is built once per ``hashing_key`` on the host (numpy's MT19937 gives the
same stream) and only its first ``min(V, 1_000_003)`` entries are kept: token ids index it.

Why no table of green lists: with ``lefthash`` the list depends only on the previous token, so a
bool[V, V] table would replace the per-step shuffle, but it holds ``V**2`` bits (122 MiB for
V = 32000, 1961 MiB for V = 128256), costs ``V`` shuffles to build and must be rebuilt per
``hashing_key``; with ``selfhash`` and ``context_width > 1`` the seed depends on several tokens,
so no table indexed by one token exists. Computing the list in the loop is exact for every
vocabulary and key (``bench/watermark.py`` times it against transformers).

References:
    Kirchenbauer et al. 2023, "A Watermark for Large Language Models", arXiv:2301.10226;
    "On the Reliability of Watermarks for Large Language Models", arXiv:2306.04634.
    Matsumoto and Nishimura 1998, "Mersenne Twister".
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from genjax.errors import GenerationConfigError, UnsupportedError
from genjax.processors.base import LogitsContext, Transform, as_float
from genjax.typing import Array

TABLE_SIZE = 1_000_003  # transformers' fixed_table length
SELFHASH_CANDIDATES = 40  # transformers' rejection-sampling candidates
_MT_N = 624
_U32 = jnp.uint32

DEFAULTS = {
    "greenlist_ratio": 0.25,
    "bias": 2.0,
    "hashing_key": 15485863,
    "seeding_scheme": "lefthash",
    "context_width": 1,
}
_SYNTHID_KEYS = frozenset(
    {"ngram_len", "keys", "context_history_size", "sampling_table_seed", "sampling_table_size"}
)


def check_watermarking(config: Mapping[str, Any], vocab_size: int | None = None) -> dict:
    """Returns ``config`` (a ``watermarking_config`` mapping) with transformers' defaults filled.

    Args:
        config: the keys of transformers' ``WatermarkingConfig``: ``greenlist_ratio`` (0 < r < 1),
            ``bias``, ``hashing_key`` (an int in [0, 2**63)), ``seeding_scheme`` ("lefthash" or
            "selfhash"), ``context_width`` (>= 1).
        vocab_size: when given, ``int(vocab_size * greenlist_ratio)`` must be at least 1.

    Raises:
        UnsupportedError: a SynthID config (``ngram_len``, ``keys``, ...).
        GenerationConfigError: an unknown key or a bad value, naming it and the fix.

    Example:
        >>> check_watermarking({"bias": 1.5})["seeding_scheme"]
        'lefthash'
    """
    if _SYNTHID_KEYS & set(config):
        raise UnsupportedError(
            "generation option `watermarking_config` holds a SynthID text watermarking config "
            f"(keys {sorted(_SYNTHID_KEYS & set(config))}); genjax implements only the green-list "
            "WatermarkingConfig (greenlist_ratio, bias, hashing_key, seeding_scheme, "
            "context_width). Remove it, or use a green-list config."
        )
    unknown = sorted(set(config) - set(DEFAULTS))
    if unknown:
        raise _bad(f"has unknown keys {unknown}; the known keys are {sorted(DEFAULTS)}")
    out = {**DEFAULTS, **config}
    if out["seeding_scheme"] not in ("lefthash", "selfhash"):
        raise _bad(f"seeding_scheme={out['seeding_scheme']!r} must be 'lefthash' or 'selfhash'")
    ratio = out["greenlist_ratio"]
    if not isinstance(ratio, int | float) or isinstance(ratio, bool) or not 0.0 < ratio < 1.0:
        raise _bad(f"greenlist_ratio={ratio!r} must be a number strictly between 0 and 1")
    for name, low in (("context_width", 1), ("hashing_key", 0)):
        value = out[name]
        if not isinstance(value, int | np.integer) or isinstance(value, bool) or value < low:
            raise _bad(f"{name}={value!r} must be an int >= {low}")
    if out["hashing_key"] >= 2**63:
        raise _bad(f"hashing_key={out['hashing_key']} must be below 2**63 (torch's int64)")
    if not isinstance(out["bias"], int | float) or isinstance(out["bias"], bool):
        raise _bad(f"bias={out['bias']!r} must be a number, e.g. 2.0")
    if vocab_size is not None:
        _check_vocab(out, vocab_size)
    return out


def _check_vocab(config: Mapping[str, Any], vocab: int) -> None:
    if int(vocab * config["greenlist_ratio"]) < 1:
        raise _bad(
            f"greenlist_ratio={config['greenlist_ratio']} gives an empty green list for "
            f"vocab_size={vocab}; raise it to at least {1 / vocab:.3g}"
        )
    if config["seeding_scheme"] == "lefthash" and config["hashing_key"] * (vocab - 1) >= 2**64 - 1:
        raise UnsupportedError(
            f"watermarking_config hashing_key={config['hashing_key']} times a token id reaches "
            f"2**64 - 1 for vocab_size={vocab}, where transformers' seed wraps modulo 2**64 - 1; "
            f"genjax supports hashing_key * (vocab_size - 1) < 2**64 - 1. Use a smaller key."
        )


def _bad(what: str) -> GenerationConfigError:
    return GenerationConfigError(
        f"GenerationConfig.watermarking_config {what}. It takes transformers' WatermarkingConfig "
        f"keys, e.g. {{'greenlist_ratio': 0.25, 'bias': 2.0, 'seeding_scheme': 'lefthash'}}."
    )


def watermark(
    bias: float | Array = 2.0,
    *,
    greenlist_ratio: float = 0.25,
    hashing_key: int = 15485863,
    seeding_scheme: str = "lefthash",
    context_width: int = 1,
) -> Transform:
    """Adds ``bias`` to the scores of each row's green tokens, as transformers'
    ``WatermarkLogitsProcessor``.

    With ``lefthash`` the green list is seeded by the row's last token; with ``selfhash`` each of
    the 40 best-scored candidates is appended to the last ``context_width - 1`` tokens, and the
    candidates green in their own list get the bias. A row with fewer than ``context_width``
    tokens (transformers' ``input_ids``) is left unchanged.

    Static or traced: ``bias`` is traced (scalar or per row [B]); the ratio, key, scheme and
    width are static (they shape the shuffle). Cost per call: one green list of
    ``G = int(V * greenlist_ratio)`` entries per row (lefthash) or 40 per row (selfhash), each
    ``O(G log G)`` vectorized work after a 623-step MT seeding scan.

    Example:
        >>> import jax.numpy as jnp
        >>> ctx = LogitsContext.for_prompt(jnp.array([[5, 3]], jnp.int32))
        >>> watermark(2.0)(jnp.zeros((1, 8)), ctx).tolist()  # transformers' green list of 3
        [[0.0, 0.0, 2.0, 2.0, 0.0, 0.0, 0.0, 0.0]]
    """
    config = check_watermarking(
        {
            "greenlist_ratio": greenlist_ratio,
            "hashing_key": hashing_key,
            "seeding_scheme": seeding_scheme,
            "context_width": context_width,
        }
    )
    settings = {k: v for k, v in config.items() if k != "bias"}
    settings["hashing_key"] = int(settings["hashing_key"])
    return Transform(_watermark, values={"bias": as_float(bias)}, settings=settings)


def _watermark(
    scores: Array,
    context: LogitsContext,
    bias: Array,
    greenlist_ratio: float,
    hashing_key: int,
    seeding_scheme: str,
    context_width: int,
) -> Array:
    vocab = scores.shape[-1]
    _check_vocab(
        {
            "greenlist_ratio": greenlist_ratio,
            "hashing_key": hashing_key,
            "seeding_scheme": seeding_scheme,
        },
        vocab,
    )
    green_size = int(vocab * greenlist_ratio)
    window = _last_tokens(context, context_width)  # int32[B, C]
    if seeding_scheme == "lefthash":
        seeds = lefthash_seed(window, key_words(hashing_key)[1])
        green = green_masks(seeds, vocab, green_size)
    else:
        green = _selfhash_green(scores, window, hashing_key, vocab, green_size)
    bias = jnp.asarray(bias, scores.dtype)
    bias = bias[:, None] if bias.ndim == 1 else bias
    marked = jnp.where(green, scores + bias, scores)
    return jnp.where(context.input_length >= context_width, marked, scores)


def _last_tokens(context: LogitsContext, width: int) -> Array:
    """int32[B, width]: each row's last ``width`` tokens of the buffer (slots ``length-width ..
    length-1``, clamped at slot 0 for rows that are too short, which are then left unchanged)."""
    slots = jnp.clip(context.length - width + jnp.arange(width), 0, context.tokens.shape[1] - 1)
    return jnp.take(context.tokens, slots, axis=1)


def _selfhash_green(scores: Array, window: Array, key: int, vocab: int, size: int) -> Array:
    """bool[B, V]: the best-scored candidates that are green when appended to ``window``."""
    batch, count = scores.shape[0], min(SELFHASH_CANDIDATES, vocab)
    _, candidates = lax.top_k(scores, count)  # int32[B, 40], best first
    table = jnp.asarray(fixed_table(key, vocab))
    prefix = jnp.broadcast_to(window[:, None, 1:], (batch, count, window.shape[1] - 1))
    ngrams = jnp.concatenate([prefix, candidates[..., None]], -1).reshape(batch * count, -1)
    seeds = jax.vmap(lambda ngram: selfhash_seed(ngram, key_words(key), table))(ngrams)
    hits = tokens_are_green(seeds, ngrams[:, -1], vocab, size).reshape(batch, count)
    rows = jnp.arange(batch)[:, None]
    return jnp.zeros(scores.shape, bool).at[rows, candidates].max(hits)


# --- seeds ---------------------------------------------------------------------------------


def key_words(hashing_key: int) -> tuple[int, int]:
    """(hi, lo): the two 32-bit words of ``hashing_key`` (an int in [0, 2**63))."""
    return hashing_key >> 32, hashing_key % 2**32


def lefthash_seed(window: Array, key_lo: int | Array) -> Array:
    """uint32[...]: the MT seed of a window int32[..., C] (the low 32 bits of
    ``hashing_key * window[..., -1]``; ``key_lo`` is the key's low word, see :func:`key_words`)."""
    return jnp.asarray(key_lo, _U32) * window[..., -1].astype(_U32)


def selfhash_seed(ngram: Array, key: tuple[int | Array, int | Array], table: Array) -> Array:
    """uint32[]: the MT seed of ``ngram`` int32[C] (its last entry the scored token): the low 32
    bits of ``min_k(hk * (T[w_k] + 1) * (T[w[-1]] + 1)) % (2**64 - 1)`` in torch's int64, for
    ``key`` the (hi, lo) words of ``hk`` (:func:`key_words`) and ``table`` :func:`fixed_table`."""
    a = table[ngram % TABLE_SIZE].astype(_U32) + 1  # uint32[C], < 2**20
    b = table[ngram[-1] % TABLE_SIZE].astype(_U32) + 1
    key_hi, key_lo = (jnp.asarray(word, _U32) for word in key)
    hi, lo = _mul_u64(*_mul_u64(key_hi, key_lo, a), b)  # int64 product, two's complement, per k
    flipped = hi ^ _U32(0x80000000)  # unsigned order of (flipped, lo) = signed 64-bit order
    least = flipped.min()
    lo = jnp.where(flipped == least, lo, _U32(0xFFFFFFFF)).min()
    hi = least ^ _U32(0x80000000)
    # A negative seed s becomes s + 2**64 - 1: its low word drops by one.
    return jnp.where(hi >= _U32(0x80000000), lo - _U32(1), lo)


def _mul_u64(hi: Array, lo: Array, y: Array) -> tuple[Array, Array]:
    """(hi, lo) * y modulo 2**64, for a 64-bit (hi, lo) and a uint32 ``y``."""
    carry, low = _mul_wide(lo, y)
    return carry + hi * y, low


def _mul_wide(x: Array, y: Array) -> tuple[Array, Array]:
    """The full 64-bit product of uint32 ``x`` and ``y`` as (hi, lo), from 16-bit halves."""
    x0, x1, y0, y1 = x & 0xFFFF, x >> 16, y & 0xFFFF, y >> 16
    p00, p01, p10, p11 = x0 * y0, x0 * y1, x1 * y0, x1 * y1
    mid = (p00 >> 16) + (p01 & 0xFFFF) + (p10 & 0xFFFF)
    lo = (p00 & 0xFFFF) | (mid << 16)
    hi = p11 + (p01 >> 16) + (p10 >> 16) + (mid >> 16)
    return hi, lo


@functools.lru_cache(maxsize=8)
def fixed_table(hashing_key: int, vocab: int) -> np.ndarray:
    """int32[min(V, 1_000_003)]: the first entries of transformers' ``fixed_table``, torch's
    ``randperm(1_000_003)`` seeded with ``hashing_key`` (computed on the host, once per key)."""
    count = min(vocab, TABLE_SIZE)
    bits = np.random.MT19937(0)
    bits._legacy_seeding(hashing_key % 2**32)  # init_genrand, as torch's manual_seed
    draws = bits.random_raw(count)
    moved: dict[int, int] = {}
    out = np.empty(count, np.int32)
    for i in range(count):
        j = i + int(draws[i]) % (TABLE_SIZE - i)
        out[i] = moved.get(j, j)
        moved[j] = moved.get(i, i)
    return out


# --- torch's CPU randperm ------------------------------------------------------------------


def _mt_state(seed: Array) -> Array:
    """uint32[624]: MT19937's ``init_genrand(seed)`` state, for a uint32[] seed."""

    def step(prev, j):
        word = _U32(1812433253) * (prev ^ (prev >> 30)) + j
        return word, word

    _, rest = lax.scan(step, seed.astype(_U32), jnp.arange(1, _MT_N, dtype=_U32))
    return jnp.concatenate([seed.astype(_U32)[None], rest])


def _mt_twist(mt: Array) -> Array:
    """The next uint32[624] state: the sequential twist, in four vectorized pieces (words 227
    and on read words the same twist already replaced)."""

    def mix(word, following, far):
        y = (word & _U32(0x80000000)) | (following & _U32(0x7FFFFFFF))
        return far ^ (y >> 1) ^ jnp.where(y & 1, _U32(0x9908B0DF), _U32(0))

    a = mix(mt[:227], mt[1:228], mt[397:])
    b = mix(mt[227:454], mt[228:455], a)
    c = mix(mt[454:623], mt[455:], b[:169])
    d = mix(mt[623:], a[:1], b[169:170])
    return jnp.concatenate([a, b, c, d])


def _mt_temper(y: Array) -> Array:
    y = y ^ (y >> 11)
    y = y ^ ((y << 7) & _U32(0x9D2C5680))
    y = y ^ ((y << 15) & _U32(0xEFC60000))
    return y ^ (y >> 18)


def shuffle_offsets(seed: Array, n: int, steps: int) -> Array:
    """int32[steps]: torch's ``randperm(n)`` swap offsets ``mt_next() % (n - i)`` for a uint32[]
    seed (the MT19937 seed's low 32 bits), i in ``[0, steps)``."""
    blocks = -(-steps // _MT_N)

    def block(state, _):
        state = _mt_twist(state)
        return state, _mt_temper(state)

    _, words = lax.scan(block, _mt_state(seed), None, length=blocks)
    words = words.reshape(-1)[:steps]
    return (words % (n - jnp.arange(steps, dtype=_U32))).astype(jnp.int32)


def green_lists(seeds: Array, vocab: int, size: int) -> Array:
    """int32[K, size]: for each seed of uint32[K], the first ``size`` entries of torch's CPU
    ``randperm(vocab)`` seeded with it, i.e. transformers' green list, without running the
    swaps one by one.

    Step ``i`` swaps positions ``i`` and ``j_i = i + offset_i >= i``, so position ``i`` is final
    after it and holds what position ``j_i`` held just before: the value the previous step with
    the same target left there (``q(i)``: the latest ``k < i`` with ``j_k = j_i``), or ``j_i``
    itself if no earlier step wrote it. What step ``k`` left at ``j_k`` is ``v(k)``, the value
    at position ``k`` just before step ``k``, which is ``v(p(k))`` for the latest step
    ``p(k) < k`` that targeted position ``k``, or ``k``. ``v`` follows the chain ``p`` to its
    root by pointer jumping (until nothing moves; chains are short); ``q`` peels the latest step
    of each target per round (as many rounds as the most steps sharing a target, a handful). No
    sort (slow in XLA on CPU); the scatters and gathers index one flat array across the K seeds
    (batched ones are slow too)::

        offsets 2 0 1      j = [2, 1, 3]
        step 0: [2 1 0 3]  step 1: [2 1 0 3]  step 2: [2 1 3 0]   -> green list [2, 1, 3]
        q = [-, -, -] so entry i = j_i: [2, 1, 3]
    """
    count = seeds.shape[0]
    steps = jnp.arange(size, dtype=jnp.int32)
    target = steps + jax.vmap(lambda seed: shuffle_offsets(seed, vocab, size))(seeds)  # [K, G]
    row = jnp.arange(count, dtype=jnp.int32)[:, None]
    q = _previous_same_target(target, row * vocab, count * vocab)
    # p(k): the latest earlier step that targeted position k (a step never targets below itself).
    moved = (target < size) & (target != steps)
    slots = jnp.where(moved, row * size + target, count * size).reshape(-1)
    p = jnp.full(count * size, -1, jnp.int32).at[slots].max(jnp.tile(steps, count), mode="drop")
    p = p.reshape(count, size)
    root = (jnp.where(p < 0, steps, p) + row * size).reshape(-1)  # flat positions
    root = lax.while_loop(lambda state: state[1], _jump, (root, jnp.asarray(True)))[0]
    before = root[(row * size + jnp.maximum(q, 0)).reshape(-1)].reshape(count, size)
    return jnp.where(q < 0, target, before - row * size)


def _jump(state: tuple[Array, Array]) -> tuple[Array, Array]:
    """One pointer-jumping round; the flag says whether anything moved (chains are short, so a
    few rounds reach every root)."""
    root = state[0]
    nxt = root[root]
    return nxt, jnp.any(nxt != root)


def _previous_same_target(target: Array, offset: Array, slots: int) -> Array:
    """int32[K, G]: for each step the latest earlier step of its row with the same target, or
    -1. Each round takes the latest remaining step of every target (a scatter-max into one flat
    array of ``slots``, row ``k``'s targets shifted by ``offset[k]``); the steps taken in the
    previous round get it as their predecessor."""
    steps = jnp.broadcast_to(jnp.arange(target.shape[1], dtype=jnp.int32), target.shape)
    flat_target = (target + offset).reshape(-1)

    def peel(state):
        remaining, taken, q = state
        where = jnp.where(remaining, flat_target, slots)
        latest = jnp.full(slots, -1, jnp.int32).at[where].max(steps.reshape(-1), mode="drop")
        latest = latest[flat_target]
        q = jnp.where(taken, latest, q)
        top = remaining & (latest == steps.reshape(-1))
        return remaining & ~top, top, q

    none = jnp.zeros(flat_target.shape, bool)
    state = (~none, none, jnp.full(flat_target.shape, -1, jnp.int32))
    return lax.while_loop(lambda state: state[0].any(), peel, state)[2].reshape(target.shape)


def green_masks(seeds: Array, vocab: int, size: int) -> Array:
    """bool[K, V]: True on the green list of each seed of uint32[K] (see :func:`green_lists`)."""
    count = seeds.shape[0]
    flat = green_lists(seeds, vocab, size) + jnp.arange(count, dtype=jnp.int32)[:, None] * vocab
    return jnp.zeros(count * vocab, bool).at[flat.reshape(-1)].set(True).reshape(count, vocab)


def tokens_are_green(seeds: Array, tokens: Array, vocab: int, size: int) -> Array:
    """bool[K]: whether each of ``tokens`` int32[K] is on the green list of its seed."""
    return jnp.any(green_lists(seeds, vocab, size) == tokens[:, None], axis=-1)
