"""Sampling warpers (truncation of the next-token distribution); re-exported by processors.

Sorting the vocabulary is by far the most expensive step a warper can take (on CPU, XLA's float
sort of a GPT-2-sized vocabulary costs tens of times as much as ``lax.top_k`` of its 256 largest
scores; ``bench/processors.py`` times both), so the warpers that need sorted scores avoid a full
sort:

* ``top_k``, ``top_p`` and ``top_h`` are :class:`SortedFilter` s. Each reads a per-row cut-off
  from the scores sorted in descending order and keeps the scores at or above it. They look only
  at the ``PREFIX`` (256) largest scores, found with ``lax.top_k``, plus the largest score and the
  log-sum-exp of the rest. When that is not enough to decide exactly (``top_k`` with ``k > 256``,
  a nucleus wider than 256 tokens), a ``lax.cond`` falls back to one full sort for the whole batch
  and the same code runs on it, so the answer never depends on the shortcut.
* :func:`~genjax.processors.chain` merges adjacent sorted filters into one, so ``top_h``,
  ``top_k`` and ``top_p`` (adjacent in transformers' order) share that partial sort.
* ``typical_p`` sorts by a different key and does the same with its own partial sort.

Ties: a sorted filter keeps every score equal to its cut-off; transformers breaks such ties by
sort order (``top_p``, ``top_h``) and may drop some. This only matters for exactly equal floats.

References:
    Holtzman et al. 2020, "The Curious Case of Neural Text Degeneration" (top-p).
    Nguyen et al. 2024, "Turning Up the Heat: Min-p Sampling for Creative and Coherent LLM Outputs".
    Meister et al. 2022, "Locally Typical Sampling" (typical decoding), arXiv:2202.00666.
    Hewitt et al. 2022, "Truncation Sampling as Language Model Desmoothing" (epsilon and eta
    sampling), arXiv:2210.15191.
    Top-H decoding, "Top-H Decoding: Adapting the Creativity and Coherence with Bounded Entropy in
    Text Generation", arXiv:2509.02510.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from genjax.processors.base import (
    NEG_INF,
    LogitsContext,
    Transform,
    as_count,
    as_float,
    per_row,
)
from genjax.typing import Array

PREFIX = 256
"""How many of the largest scores a sorted filter looks at before falling back to a full sort."""

TOP_H_CANDIDATES = 100
"""transformers' top-h looks only at the 100 most likely tokens (``TopHLogitsWarper.top_n``)."""


@dataclasses.dataclass(frozen=True)
class SortedView:
    """What a sorted filter sees: the largest scores in order, and a summary of the others."""

    values: Array  # float32[B, C]: the C largest scores, descending; filtered ones are -inf
    tail_max: Array  # float32[B, 1]: the largest score not in `values` (-inf when none is left)
    tail_lse: Array  # float32[B, 1]: log-sum-exp of the scores not in `values`
    vocab: int  # V, static


Stage = Transform
"""A sorted filter's rule, as a :class:`~genjax.processors.Transform` whose ``run(view)`` gives
``(cut-off float32[B, 1], exact bool[B])``. ``exact`` is False where the view holds too few
scores to decide; the filter then reruns on the fully sorted row."""


@jax.tree_util.register_pytree_node_class
class SortedFilter:
    """A processor keeping, per row, the scores at or above a cut-off read off the sorted scores.

    Made by :func:`top_k`, :func:`top_p` and :func:`top_h`. ``a.then(b)`` is one filter applying
    ``a`` then ``b`` on one shared partial sort; :func:`~genjax.processors.chain` does this for
    adjacent filters. Cost: one ``lax.top_k`` of ``min(V, 256)`` scores and two passes over V per
    call, whatever the number of stages; plus one full sort of V on steps where the 256 largest
    scores do not decide every row.

    A pytree: the stages' values are its leaves, the stages' kinds and settings its structure.

    Example:
        >>> warp = top_k(50).then(top_p(0.9))
    """

    def __init__(self, *stages: Stage):
        self.stages = stages

    def tree_flatten(self):
        return self.stages, None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children)

    def __repr__(self) -> str:
        return " .then(".join(repr(stage) for stage in self.stages) + ")" * (len(self.stages) - 1)

    def then(self, other: SortedFilter) -> SortedFilter:
        """The filter applying ``self``'s stages, then ``other``'s, on one shared sort."""
        return SortedFilter(*self.stages, *other.stages)

    def __call__(self, scores: Array, context: Any = None) -> Array:
        scores = jnp.asarray(scores)
        batch, vocab = scores.shape
        size = min(vocab, PREFIX)  # with V <= 256, the prefix is the whole sorted row
        cut, exact = _run_stages(_prefix_view(scores, size), self.stages)
        if size < vocab:
            cut = jax.lax.cond(
                jnp.all(exact),
                lambda: cut,
                lambda: _run_stages(_full_view(scores), self.stages)[0],
            )
        return jnp.where(scores < cut, NEG_INF, scores)


def _run_stages(view: SortedView, stages: tuple[Stage, ...]) -> tuple[Array, Array]:
    """Applies the stages in turn to the view; returns the final cut-off and exactness."""
    cut = jnp.full(view.tail_max.shape, NEG_INF, view.values.dtype)
    exact = jnp.ones(view.values.shape[:1], bool)
    for i, stage in enumerate(stages):
        threshold, stage_exact = stage.run(view)
        exact &= stage_exact
        cut = jnp.maximum(cut, threshold)
        if i + 1 == len(stages):
            break
        # The next stage sees what this one left. A cut above the tail removes the whole tail; a
        # cut inside the tail leaves an unknown part of it, which the next stage cannot see.
        clears_tail = threshold > view.tail_max
        keeps_tail = (threshold == NEG_INF) | (view.tail_max == NEG_INF)
        exact &= (clears_tail | keeps_tail)[:, 0]
        view = dataclasses.replace(
            view,
            values=jnp.where(view.values < threshold, NEG_INF, view.values),
            tail_max=jnp.where(clears_tail, NEG_INF, view.tail_max),
            tail_lse=jnp.where(clears_tail, NEG_INF, view.tail_lse),
        )
    return cut, exact


def _prefix_view(scores: Array, size: int) -> SortedView:
    """The ``size`` largest scores (one ``lax.top_k``) and a summary of the rest."""
    batch, vocab = scores.shape
    values, indices = jax.lax.top_k(scores, size)
    if size == vocab:
        empty = jnp.full((batch, 1), NEG_INF, scores.dtype)
        return SortedView(values, empty, empty, vocab)
    rows = jnp.arange(batch)[:, None]
    rest = scores.at[rows, indices].set(NEG_INF)
    return SortedView(
        values=values,
        tail_max=jnp.max(rest, axis=-1, keepdims=True),
        tail_lse=jax.nn.logsumexp(rest, axis=-1, keepdims=True),
        vocab=vocab,
    )


def _full_view(scores: Array) -> SortedView:
    """All scores sorted in descending order (one full sort of V); nothing left outside."""
    empty = jnp.full((scores.shape[0], 1), NEG_INF, scores.dtype)
    return SortedView(_sort_descending(scores), empty, empty, scores.shape[-1])


_LOW_BITS = 0x7FFFFFFF


def _sort_descending(scores: Array) -> Array:
    """float[B, V] sorted along V from largest to smallest.

    float32 scores are sorted as order-preserving int32 keys (negative floats get their low 31
    bits flipped), which XLA sorts several times faster than floats on CPU.
    """
    if scores.dtype != jnp.float32:
        return -jnp.sort(-scores, axis=-1)
    bits = jax.lax.bitcast_convert_type(scores, jnp.int32)
    keys = jnp.where(bits < 0, bits ^ _LOW_BITS, bits)
    keys = jnp.flip(jax.lax.sort(keys, dimension=-1, is_stable=False), axis=-1)
    bits = jnp.where(keys < 0, keys ^ _LOW_BITS, keys)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def temperature(value: float | Array) -> Transform:
    """Divides the scores by ``value`` (> 0; traced, scalar or float[B]). Cost: O(B * V).

    Example:
        >>> warp = temperature(0.7)
    """
    return Transform(_temperature, {"value": as_float(value)})


def _temperature(scores: Array, context: LogitsContext, value: Array) -> Array:
    return scores / per_row(value).astype(scores.dtype)


def _value_at(values: Array, position: Array) -> Array:
    """float[B, 1]: ``values[b, position[b]]`` for int32[B] positions."""
    return jnp.take_along_axis(values, position[:, None], axis=-1)


def top_k(k: int | Array, min_tokens_to_keep: int = 1) -> SortedFilter:
    """Keeps the ``k`` highest scores per row (ties with the k-th kept too); sets others to -inf.

    ``k`` may be traced (scalar or int[B]); ``k = 0`` keeps everything, as the disabled
    processor would, and so do values at or above the vocabulary size. ``min_tokens_to_keep``
    (static) raises ``k`` to at least that many. Cost: one ``lax.top_k`` of 256 per call (shared
    with adjacent sorted filters, see :class:`SortedFilter`); a full sort of V on steps with
    ``256 < k < V``.

    Example:
        >>> warp = top_k(50)
    """
    keep = {"min_tokens_to_keep": int(min_tokens_to_keep)}
    return SortedFilter(Transform(_top_k_stage, {"k": as_count(k)}, keep))


def _top_k_stage(view: SortedView, k: Array, min_tokens_to_keep: int) -> tuple[Array, Array]:
    batch, size = view.values.shape
    kk = jnp.where(k <= 0, view.vocab, jnp.maximum(k, min_tokens_to_keep))
    kk = jnp.broadcast_to(jnp.minimum(kk, view.vocab), (batch,))
    kth = _value_at(view.values, jnp.clip(kk - 1, 0, size - 1))
    keep_all = kk >= view.vocab
    return jnp.where(keep_all[:, None], NEG_INF, kth), keep_all | (kk <= size)


def top_p(p: float | Array, min_tokens_to_keep: int = 1) -> SortedFilter:
    """Nucleus filtering: keeps the smallest set of top tokens whose probability reaches ``p``.

    As in transformers, tokens are sorted from least to most likely, and a token is dropped when
    the cumulative probability up to and including it is ``<= 1 - p``; the ``min_tokens_to_keep``
    (static) most likely always stay. ``p`` (traced, scalar or float[B]) of 1 keeps everything,
    as the disabled processor would (transformers' warper, which generate never builds for 1,
    would still drop tokens whose probability underflows to 0). Cost: one ``lax.top_k`` of 256
    (shared with adjacent sorted filters, see :class:`SortedFilter`); a full sort of V on steps
    where the nucleus of some row is wider than 256 tokens.

    Example:
        >>> warp = top_p(0.9)
    """
    keep = {"min_tokens_to_keep": int(min_tokens_to_keep)}
    return SortedFilter(Transform(_top_p_stage, {"p": as_float(p)}, keep))


def _top_p_stage(view: SortedView, p: Array, min_tokens_to_keep: int) -> tuple[Array, Array]:
    batch, size = view.values.shape
    total = jnp.logaddexp(jax.nn.logsumexp(view.values, -1, keepdims=True), view.tail_lse)
    probs = jnp.exp(view.values - total)
    tail_mass = jnp.exp(view.tail_lse - total)
    # Probability of each token plus every less likely one, summed from the least likely up.
    below = jnp.flip(jnp.cumsum(jnp.flip(probs, -1), -1), -1) + tail_mass
    limit = 1.0 - per_row(p)
    keep_all = limit <= 0.0  # p = 1 keeps every token, as the disabled processor would
    removed = (below <= limit) & ~keep_all
    removed = removed.at[:, : min(min_tokens_to_keep, size)].set(False)
    kept = size - jnp.sum(removed, axis=-1)
    cut = jnp.where(keep_all, NEG_INF, _value_at(view.values, kept - 1))
    exact = ((tail_mass <= limit) & jnp.isfinite(total)) | keep_all
    return cut, jnp.broadcast_to(exact, (batch, 1))[:, 0]


def top_h(h: float | Array) -> SortedFilter:
    """Top-H: keeps the most likely tokens while their entropy stays within ``h`` times the total.

    Among the 100 most likely tokens (transformers' ``top_n``), renormalized, tokens are added from
    the most likely while the running sum of ``-p log p`` stays ``<= h * H`` (``H`` the entropy of
    those 100); the most likely token always stays, and every token outside them is dropped.
    ``h`` in (0, 1], traced, scalar or float[B]; a row's ``h <= 0`` (which ``GenerationConfig``
    refuses) keeps every token: the serving engine's rows without top-H. Cost: one
    ``lax.top_k`` of 256 (shared with adjacent sorted filters, see :class:`SortedFilter`) and
    O(B * 100) work.

    Example:
        >>> warp = top_h(0.4)

    References:
        "Top-H Decoding: Adapting the Creativity and Coherence with Bounded Entropy in Text
        Generation", arXiv:2509.02510.
    """
    return SortedFilter(Transform(_top_h_stage, {"h": as_float(h)}))


def _top_h_stage(view: SortedView, h: Array) -> tuple[Array, Array]:
    batch = view.values.shape[0]
    top = view.values[:, : min(TOP_H_CANDIDATES, view.vocab)]
    logp = jax.nn.log_softmax(top, axis=-1)
    probs = jnp.exp(logp)
    live = probs > 0
    terms = jnp.where(live, -probs * logp, 0.0)
    budget = per_row(h) * jnp.sum(terms, axis=-1, keepdims=True)
    selected = live & (jnp.cumsum(terms, axis=-1) <= budget)
    selected = selected.at[:, 0].set(True)
    kept = jnp.sum(selected, axis=-1)
    cut = jnp.where(per_row(h) <= 0, NEG_INF, _value_at(view.values, kept - 1))
    return cut, jnp.ones((batch,), bool)


def _kth_largest(scores: Array, k: int) -> Array:
    """float[B, 1]: each row's k-th largest score (k static)."""
    if k <= 1:
        return jnp.max(scores, axis=-1, keepdims=True)
    return jax.lax.top_k(scores, min(k, scores.shape[-1]))[0][:, -1:]


def min_p(p: float | Array, min_tokens_to_keep: int = 1) -> Transform:
    """Drops tokens whose probability is below ``p`` times the most likely token's probability.

    ``p`` traced, scalar or float[B]; the ``min_tokens_to_keep`` (static) most likely stay. Cost:
    one softmax of V; no sort (a ``lax.top_k`` of ``min_tokens_to_keep`` when it is above 1).

    Example:
        >>> warp = min_p(0.05)

    References:
        Nguyen et al. 2024, "Turning Up the Heat: Min-p Sampling for Creative and Coherent LLM
        Outputs".
    """
    keep = {"min_tokens_to_keep": int(min_tokens_to_keep)}
    return Transform(_min_p, {"p": as_float(p)}, keep)


def _min_p(scores: Array, context: Any, p: Array, min_tokens_to_keep: int) -> Array:
    probs = jax.nn.softmax(scores, axis=-1)
    removed = probs < per_row(p) * jnp.max(probs, axis=-1, keepdims=True)
    if min_tokens_to_keep > 1:
        _, keep = jax.lax.top_k(probs, min(min_tokens_to_keep, scores.shape[-1]))
        rows = jnp.arange(scores.shape[0])[:, None]
        removed = removed.at[rows, keep].set(False)
    return jnp.where(removed, NEG_INF, scores)


def typical_p(mass: float | Array, min_tokens_to_keep: int = 1) -> Transform:
    """Locally typical sampling: keeps the tokens whose surprisal is closest to the entropy.

    Tokens are ordered by ``|-log p - H|`` (``H`` the entropy), and the smallest set in that order
    whose probability reaches ``mass`` stays (the token that crosses ``mass`` included), plus the
    ``min_tokens_to_keep`` (static) most typical. ``mass`` in (0, 1], traced, scalar or float[B];
    1 keeps everything, as the disabled processor would. Cost: one softmax and one
    ``lax.top_k`` of 256 over V; a full sort of V (int32 keys) on steps where some row needs
    more than 256 tokens to reach ``mass``.

    Example:
        >>> warp = typical_p(0.9)

    References:
        Meister et al. 2022, "Locally Typical Sampling", arXiv:2202.00666.
    """
    keep = {"min_tokens_to_keep": int(min_tokens_to_keep)}
    return Transform(_typical_p, {"mass": as_float(mass)}, keep)


def _typical_p(scores: Array, context: Any, mass: Array, min_tokens_to_keep: int) -> Array:
    vocab = scores.shape[-1]
    logp = jax.nn.log_softmax(scores, axis=-1)
    entropy = -jnp.nansum(logp * jnp.exp(logp), axis=-1, keepdims=True)
    shifted = jnp.abs(-logp - entropy)
    probs = jax.nn.softmax(scores, axis=-1)
    size = min(vocab, PREFIX)

    keep_all = jnp.broadcast_to(per_row(mass) >= 1.0, (scores.shape[0], 1))

    def cut_off(order_shifted: Array, order_probs: Array) -> tuple[Array, Array]:
        # The first position where the running mass reaches `mass` (clamped to the end).
        reached = jnp.sum(jnp.cumsum(order_probs, -1) < per_row(mass), axis=-1)
        n = order_shifted.shape[-1]
        last = _value_at(order_shifted, jnp.minimum(reached, n - 1))
        floor = order_shifted[:, min(min_tokens_to_keep, n) - 1, None]
        cut = jnp.where(keep_all, jnp.inf, jnp.maximum(last, floor))
        return cut, (reached < n) | keep_all[:, 0]

    def full() -> Array:
        return cut_off(*_sort_ascending_with(shifted, probs))[0]

    negated, indices = jax.lax.top_k(-shifted, size)  # the `size` most typical tokens
    cut, exact = cut_off(-negated, jnp.take_along_axis(probs, indices, axis=-1))
    if size < vocab:
        cut = jax.lax.cond(jnp.all(exact), lambda: cut, full)
    return jnp.where(shifted > cut, NEG_INF, scores)


def _sort_ascending_with(keys: Array, payload: Array) -> tuple[Array, Array]:
    """Sorts non-negative float32 ``keys`` [B, V] ascending, carrying ``payload`` along.

    Non-negative floats order like their int32 bit patterns, which XLA sorts faster.
    """
    bits = jax.lax.bitcast_convert_type(keys, jnp.int32)
    bits, payload = jax.lax.sort((bits, payload), dimension=-1, is_stable=False, num_keys=1)
    return jax.lax.bitcast_convert_type(bits, jnp.float32), payload


def epsilon_cutoff(epsilon: float | Array, min_tokens_to_keep: int = 1) -> Transform:
    """Epsilon sampling: drops tokens whose probability is below ``epsilon``.

    The ``min_tokens_to_keep`` (static) most likely always stay. ``epsilon`` in (0, 1), traced,
    scalar or float[B]. Cost: one softmax of V; no sort.

    Example:
        >>> warp = epsilon_cutoff(3e-4)

    References:
        Hewitt et al. 2022, "Truncation Sampling as Language Model Desmoothing",
        arXiv:2210.15191.
    """
    keep = {"min_tokens_to_keep": int(min_tokens_to_keep)}
    return Transform(_epsilon_cutoff, {"epsilon": as_float(epsilon)}, keep)


def _epsilon_cutoff(scores: Array, context: Any, epsilon: Array, min_tokens_to_keep: int) -> Array:
    probs = jax.nn.softmax(scores, axis=-1)
    removed = probs < per_row(epsilon)
    removed &= scores < _kth_largest(scores, min_tokens_to_keep)
    return jnp.where(removed, NEG_INF, scores)


def eta_cutoff(epsilon: float | Array, min_tokens_to_keep: int = 1) -> Transform:
    """Eta sampling: drops tokens whose probability is below ``min(eps, sqrt(eps) * exp(-H))``.

    ``H`` is the entropy of the row's distribution, so flat distributions are cut less. The
    ``min_tokens_to_keep`` (static) most likely always stay. ``epsilon`` in (0, 1), traced, scalar
    or float[B]. Cost: one softmax of V and one entropy; no sort.

    Example:
        >>> warp = eta_cutoff(2e-3)

    References:
        Hewitt et al. 2022, "Truncation Sampling as Language Model Desmoothing",
        arXiv:2210.15191.
    """
    keep = {"min_tokens_to_keep": int(min_tokens_to_keep)}
    return Transform(_eta_cutoff, {"epsilon": as_float(epsilon)}, keep)


def _eta_cutoff(scores: Array, context: Any, epsilon: Array, min_tokens_to_keep: int) -> Array:
    logp = jax.nn.log_softmax(scores, axis=-1)
    probs = jnp.exp(logp)
    entropy = -jnp.sum(jnp.where(probs > 0, probs * logp, 0.0), axis=-1, keepdims=True)
    eps = per_row(epsilon)
    eta = jnp.minimum(eps, jnp.sqrt(eps) * jnp.exp(-entropy))
    removed = (probs < eta) & (scores < _kth_largest(scores, min_tokens_to_keep))
    return jnp.where(removed, NEG_INF, scores)
