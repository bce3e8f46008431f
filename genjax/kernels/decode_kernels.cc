// The library of genjax's decode-step kernels: products of a few activation rows
// (rows_matmul.h, genjax.kernels.rows) and the cache sums of one-token attention
// (decode_attention.h, genjax.kernels.attention), built and loaded as one library, with in-place
// writes into 16-bit caches (cache_writes.h, genjax.kernels.cache_writes) and the paged pool's
// block gather (block_gather.h, genjax.kernels.block_gather). All but the writes split their
// work through team.h, on XLA's intra-op thread pool.

#include "block_gather.h"
#include "cache_writes.h"
#include "decode_attention.h"
#include "rows_matmul.h"
