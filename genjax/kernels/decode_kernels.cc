// The library of genjax's decode-step kernels: products of a few activation rows
// (rows_matmul.h, genjax.kernels.rows) and the cache sums of one-token attention
// (decode_attention.h, genjax.kernels.attention). One library, so that they share one helper team:
// a team's helper spins for a while after each job, and a step alternates the two kernels layer
// by layer, so two teams would keep a spinning thread on a core the other kernel needs.

#include "decode_attention.h"
#include "rows_matmul.h"
