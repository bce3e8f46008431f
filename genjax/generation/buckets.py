"""Prompt-length buckets: the padded prompt lengths that share one compiled program.

``generate`` left-pads each prompt with masked slots to its bucket length, so every prompt length
in a bucket runs the same compiled program. A policy is a small frozen (hashable) object:

* :func:`powers_of_two` (the default, at least 16): 16, 32, 64, ... Few programs, at most half
  the prefill wasted on padding.
* :func:`multiples_of` ``(n)``: n, 2n, 3n, ... Less padding, more programs (multiples of 64 suit
  long prompts on accelerators).
* :func:`lengths` ``(*ls)``: exactly these bucket lengths; a longer prompt is an error.

``generate(..., prompt_buckets=...)`` accepts a policy, ``None`` (the default), an int ``n`` (for
``multiples_of(n)``) or a sequence of ints (for ``lengths``); :func:`resolve` does the
conversion and the validation.

With ``max_cache_len`` (see :mod:`genjax.cache.slots`) buckets no longer shape the program: the
prompt is only padded to a multiple of the policy's :attr:`BucketPolicy.granularity` (the
greatest common divisor of its bucket lengths) and prefilled that many slots at a time.

Everything here is static: bucket lengths are Python ints decided before tracing.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from genjax.errors import InputError

__all__ = [
    "DEFAULT",
    "BucketPolicy",
    "lengths",
    "multiples_of",
    "powers_of_two",
    "resolve",
]


@dataclasses.dataclass(frozen=True)
class BucketPolicy:
    """Which padded lengths prompts are rounded up to (static, hashable).

    Build one with :func:`powers_of_two`, :func:`multiples_of` or :func:`lengths`.

    Example:
        >>> multiples_of(64).length(70)
        128
    """

    kind: str  # "powers_of_two", "multiples_of" or "lengths"
    size: int = 16  # powers_of_two: the smallest bucket; multiples_of: the step
    allowed: tuple[int, ...] = ()  # lengths: the bucket lengths, increasing

    def length(self, prompt_length: int) -> int:
        """The bucket length of a prompt of ``prompt_length`` tokens (>= ``prompt_length``).

        Raises:
            InputError: with :func:`lengths`, a prompt longer than the largest bucket.
        """
        prompt_length = max(int(prompt_length), 1)
        if self.kind == "powers_of_two":
            return max(self.size, 1 << (prompt_length - 1).bit_length())
        if self.kind == "multiples_of":
            return -(-prompt_length // self.size) * self.size
        for bucket in self.allowed:
            if bucket >= prompt_length:
                return bucket
        raise InputError(
            f"a prompt of {prompt_length} tokens is longer than the largest prompt bucket "
            f"{self.allowed[-1]} (prompt_buckets={list(self.allowed)}). Add a larger bucket, "
            f"or pass prompt_buckets=None for powers of two."
        )

    @property
    def granularity(self) -> int:
        """The largest ``g`` dividing every bucket length: with ``max_cache_len`` prompts are
        padded to a multiple of it and prefilled ``g`` slots at a time."""
        if self.kind == "lengths":
            return math.gcd(*self.allowed)
        return self.size

    def buckets_up_to(self, limit: int) -> tuple[int, ...]:
        """Every bucket length up to the one holding a ``limit``-token prompt, increasing.

        Example:
            >>> powers_of_two().buckets_up_to(40)
            (16, 32, 64)
        """
        last = self.length(limit)
        if self.kind == "lengths":
            return tuple(b for b in self.allowed if b <= last)
        if self.kind == "multiples_of":
            return tuple(range(self.size, last + 1, self.size))
        return tuple(1 << i for i in range(self.size.bit_length() - 1, last.bit_length()))


def powers_of_two(minimum: int = 16) -> BucketPolicy:
    """Buckets ``minimum, 2 * minimum, 4 * minimum, ...``; ``minimum`` a power of two."""
    if not isinstance(minimum, int) or minimum < 1 or minimum & (minimum - 1):
        raise InputError(
            f"powers_of_two(minimum) needs a power of two >= 1 as the smallest bucket; got "
            f"{minimum!r}. Use e.g. 16."
        )
    return BucketPolicy("powers_of_two", minimum)


def multiples_of(step: int) -> BucketPolicy:
    """Buckets ``step, 2 * step, 3 * step, ...``; ``step`` an int >= 1."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 1:
        raise InputError(
            f"multiples_of(step) needs an int >= 1; got {step!r}. Use e.g. 64 for buckets of "
            f"64, 128, 192, ..."
        )
    return BucketPolicy("multiples_of", step)


def lengths(*bucket_lengths: int) -> BucketPolicy:
    """Exactly these bucket lengths (ints >= 1, any order, at least one)."""
    bad = [b for b in bucket_lengths if not isinstance(b, int) or isinstance(b, bool) or b < 1]
    if not bucket_lengths or bad:
        raise InputError(
            f"lengths(...) needs one or more bucket lengths, ints >= 1; got "
            f"{list(bucket_lengths)!r}. Use e.g. lengths(32, 128, 512)."
        )
    return BucketPolicy("lengths", allowed=tuple(sorted(set(bucket_lengths))))


DEFAULT = powers_of_two(16)
"""The policy ``generate`` uses when ``prompt_buckets`` is None."""


def resolve(prompt_buckets) -> BucketPolicy:
    """The policy for ``generate``'s ``prompt_buckets`` argument.

    Args:
        prompt_buckets: None (:data:`DEFAULT`), a :class:`BucketPolicy`, an int ``n``
            (``multiples_of(n)``) or a sequence of ints (``lengths(*seq)``).

    Raises:
        InputError: any other value, naming it.
    """
    if prompt_buckets is None:
        return DEFAULT
    if isinstance(prompt_buckets, BucketPolicy):
        return prompt_buckets
    if isinstance(prompt_buckets, int) and not isinstance(prompt_buckets, bool):
        return multiples_of(prompt_buckets)
    if isinstance(prompt_buckets, Sequence) and not isinstance(prompt_buckets, str):
        return lengths(*prompt_buckets)
    raise InputError(
        f"prompt_buckets must be None (powers of two from 16), an int n (multiples of n), a "
        f"sequence of bucket lengths, or a genjax.buckets policy; got {prompt_buckets!r}."
    )
