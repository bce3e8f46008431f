"""Test helpers: tiny random checkpoints (Hugging Face folders and GGUF files), left-padded
batches, a tiny byte-level BPE tokenizer and a chi-square test, all without torch.

Layer:
    Floor 1: imports nothing else of genjax, so tests of every layer can use it.
"""

from __future__ import annotations

import contextlib
import math

import jax
import numpy as np

from genjax.testing.checkpoints import tiny_config, write_random_checkpoint
from genjax.testing.gguf import write_gguf

__all__ = [
    "MESH_LLAMA",
    "TINY_CORPUS",
    "assert_same_generation",
    "chi_square_p_value",
    "count_compiles",
    "left_padded_batch",
    "tiny_bpe_tokenizer",
    "tiny_config",
    "write_gguf",
    "write_random_checkpoint",
]


def assert_same_generation(out, expected, atol: float) -> None:
    """Asserts that two ``GenerateOutput`` objects agree: equal sequences (and beam indices),
    scores and beam scores within ``atol`` (plus a 1e-5 relative margin on the scores)."""
    np.testing.assert_array_equal(out.sequences, expected.sequences)
    np.testing.assert_allclose(out.scores, expected.scores, atol=atol, rtol=1e-5)
    if expected.sequences_scores is not None:
        np.testing.assert_allclose(out.sequences_scores, expected.sequences_scores, atol=atol)
        np.testing.assert_array_equal(out.beam_indices, expected.beam_indices)


MESH_LLAMA = dict(
    num_hidden_layers=1,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=8,
)
"""``write_random_checkpoint(path, "llama", **MESH_LLAMA)``: one layer whose 8 query and 4 KV
heads split over ``model`` axes of 2 and 4 (queries also 8), for the sharding tests."""

TINY_CORPUS = ("def fibonacci(n):\n    return n", "hello world, hello tokens") * 20
"""The text :func:`tiny_bpe_tokenizer` learns from by default."""


def left_padded_batch(
    batch: int, length: int, vocab_size: int, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Random prompts with some left padding, for tests: ``(ids, mask)``, both int32[B, P].

    Ids are drawn from ``[3, vocab_size)``; rows 1, 4 and 6 (those that exist) start with 2, 1
    and 3 padding slots, which hold id 0 and mask 0.

    Example:
        >>> ids, mask = left_padded_batch(8, 5, vocab_size=101)
        >>> mask[1].tolist()
        [0, 0, 1, 1, 1]
    """
    ids = np.random.default_rng(seed).integers(3, vocab_size, (batch, length)).astype(np.int32)
    mask = np.ones_like(ids)
    for row, padding in ((1, 2), (4, 1), (6, 3)):
        if row < batch:
            mask[row, :padding] = 0
    return np.where(mask == 1, ids, 0), mask


def chi_square_p_value(counts: np.ndarray, expected: np.ndarray) -> float:
    """Pearson's chi-square goodness-of-fit p-value of observed ``counts`` against ``expected``
    counts (same shape, same total), for tests of sampling distributions.

    Cells expected fewer than 5 times are merged into one; the p-value comes from the
    Wilson-Hilferty normal approximation of the chi-square distribution. A count in a cell whose
    expected count is 0 (an impossible outcome) gives 0.

    Example:
        >>> round(chi_square_p_value(np.array([480, 520]), np.array([500.0, 500.0])), 2)
        0.2
    """
    counts, expected = np.ravel(counts), np.ravel(expected)
    if counts[expected == 0].sum() > 0:
        return 0.0
    small = expected < 5
    counts = np.append(counts[~small], counts[small].sum())
    expected = np.append(expected[~small], expected[small].sum())
    keep = expected > 0
    stat = float((((counts - expected) ** 2)[keep] / expected[keep]).sum())
    dof = int(keep.sum()) - 1
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def tiny_bpe_tokenizer(corpus=TINY_CORPUS, vocab_size: int = 300):
    """Returns a byte-level BPE ``tokenizers.Tokenizer`` trained on ``corpus``, with the special
    tokens ``<pad>``, ``<s>``, ``</s>`` at ids 0, 1, 2 (no post-processor: add one if needed).

    Example:
        >>> tiny_bpe_tokenizer().token_to_id("</s>")
        2
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(list(corpus), trainer)
    return backend


_COMPILE_LISTS: list[list[str]] = []  # one list per open count_compiles block


def _on_compile(event: str, duration: float, **kwargs) -> None:
    if _COMPILE_LISTS and event == "/jax/core/compile/backend_compile_duration":
        _COMPILE_LISTS[-1].append(kwargs.get("fun_name", "?"))


jax.monitoring.register_event_duration_secs_listener(_on_compile)


@contextlib.contextmanager
def count_compiles():
    """Yields the list of XLA programs compiled inside the block (``"jit(name)"`` strings), from
    JAX's monitoring events: one backend compile event per program, so an empty list means no
    XLA program at all was built ("a second call compiles nothing").

    Example:
        >>> f = jax.jit(lambda x: x * 3)
        >>> with count_compiles() as compiled:
        ...     _ = f(1.0)
        ...     _ = f(2.0)
        >>> compiled
        ['jit(<lambda>)']
    """
    compiled: list[str] = []
    _COMPILE_LISTS.append(compiled)
    try:
        yield compiled
    finally:
        _COMPILE_LISTS.remove(compiled)
