"""Cache blocks on the host: the allocator with reference counts and the prefix cache.

Plain Python (no JAX). Block 0 is the scratch block and is never handed out. Each other block is
*free* (never written, or its content forgotten), *used* (held by at least one running request;
its reference count says by how many) or *cached* (no request holds it, but it is full of a
known prompt prefix and may be reused until it is evicted).

Prefix caching: a full block of prompt tokens is named by a hash of its token ids chained with
the hash of the block before it, so equal hashes mean equal prefixes, not only equal blocks::

    tokens   a b c d | e f g h | i j
    hash     h0 = H(root, abcd)   h1 = H(h0, efgh)   (the partial block i j is not named)

A new request looks its blocks' hashes up in order and takes the longest run found (each found
block's count goes up), so its prefill starts after them. A block whose count drops to zero keeps
its hash and joins the back of a least-recently-used queue; allocation takes never-used blocks
first, then evicts from the front of that queue (forgetting the hash). A request frees its blocks
last first, so a prefix's tail is evicted before its head.

References:
    Kwon et al. 2023, "Efficient Memory Management for Large Language Model Serving with
    PagedAttention", arXiv:2309.06180 (automatic prefix caching in vLLM).
"""

from __future__ import annotations

import collections
import hashlib

import numpy as np

from genjax.cache import SCRATCH_BLOCK

__all__ = ["BlockAllocator", "block_hashes"]

_ROOT = b"genjax-prefix"


def block_hashes(tokens: list[int], block_size: int) -> list[bytes]:
    """Chained hashes of the full blocks of ``tokens`` (a partial last block has none).

    Example:
        >>> a = block_hashes([1, 2, 3, 4, 5], block_size=2)
        >>> len(a), a == block_hashes([1, 2, 3, 4], block_size=2)
        (2, True)
        >>> block_hashes([9, 2, 3, 4], 2)[1] == a[1]  # the same block after another prefix
        False
    """
    hashes, previous = [], _ROOT
    full = len(tokens) // block_size
    ids = np.asarray(tokens[: full * block_size], np.int64)
    for i in range(full):
        digest = hashlib.blake2b(previous, digest_size=16)
        digest.update(ids[i * block_size : (i + 1) * block_size].tobytes())
        previous = digest.digest()
        hashes.append(previous)
    return hashes


class BlockAllocator:
    """Hands out pool blocks ``1 .. num_blocks - 1`` with reference counts and a prefix cache.

    Args:
        num_blocks: blocks in the pool, the scratch block 0 included.

    Example:
        >>> allocator = BlockAllocator(4)
        >>> allocator.allocate(2), allocator.num_free
        ([1, 2], 1)
        >>> allocator.allocate(2) is None  # all or nothing
        True
        >>> allocator.register(1, b"h0"); allocator.free([1, 2])
        >>> allocator.num_used, allocator.num_cached, allocator.match([b"h0", b"h1"])
        (0, 1, [1])
    """

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._fresh = collections.deque(b for b in range(num_blocks) if b != SCRATCH_BLOCK)
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, bytes] = {}  # block -> its prefix hash
        self._block_of: dict[bytes, int] = {}  # prefix hash -> block
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()

    @property
    def num_free(self) -> int:
        """Blocks no request holds (never used, or cached and evictable)."""
        return len(self._fresh) + len(self._evictable)

    @property
    def num_used(self) -> int:
        """Blocks held by at least one request."""
        return self.num_blocks - 1 - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks no request holds that still name a prefix (reusable until evicted)."""
        return len(self._evictable)

    def refcount(self, block: int) -> int:
        """The number of requests holding ``block``."""
        return self._refs[block]

    def allocate(self, count: int) -> list[int] | None:
        """``count`` blocks (count 1 each), or None (and nothing taken) when fewer are free."""
        if count > self.num_free:
            return None
        blocks = []
        for _ in range(count):
            if self._fresh:
                block = self._fresh.popleft()
            else:
                block, _ = self._evictable.popitem(last=False)  # least recently used
                del self._block_of[self._hash_of.pop(block)]
            self._refs[block] = 1
            blocks.append(block)
        return blocks

    def free(self, blocks: list[int]) -> None:
        """Drops one reference to each block, last first; a block no one holds becomes cached
        (when it names a prefix) or free."""
        for block in reversed(blocks):
            self._refs[block] -= 1
            if self._refs[block] > 0:
                continue
            if block in self._hash_of:
                self._evictable[block] = None
            else:
                self._fresh.append(block)

    def register(self, block: int, digest: bytes) -> None:
        """Names a full, written block by its prefix hash (kept first come: a hash already
        naming another block, or a block already named, is left as it is)."""
        if digest in self._block_of or block in self._hash_of:
            return
        self._block_of[digest] = block
        self._hash_of[block] = digest

    def match(self, hashes: list[bytes], multiple: int = 1) -> list[int]:
        """The blocks of the longest run of ``hashes`` found from the first, cut to a multiple
        of ``multiple`` blocks; each is taken (its count goes up, and a cached one leaves the
        eviction queue)."""
        found = []
        for digest in hashes:
            block = self._block_of.get(digest)
            if block is None:
                break
            found.append(block)
        found = found[: len(found) - len(found) % multiple]
        for block in found:
            if self._refs[block] == 0:
                del self._evictable[block]
            self._refs[block] += 1
        return found
