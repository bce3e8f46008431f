// Writes T new slots into one layer's 16-bit (bfloat16 or float16) KV cache block, in place:
//
//   block[o, start + t, i] = update[o, t, i]   for t < T, start = clamp(index, 0, S - T)
//
// viewing the block as [outer, S, inner] around its slot axis and the update as [outer, T, inner];
// a negative index counts from the end first (index + S), as jax.lax.dynamic_update_slice does. The custom call's result aliases the block
// (genjax.kernels.cache_writes passes input_output_aliases), so XLA hands the kernel the block's
// own buffer and only the T slots are written.
//
// Why not XLA: XLA:CPU computes a 16-bit float dynamic_update_slice in float32 (it widens the
// whole block and narrows it back), and written on the bits as uint16 the bit casts around the
// update keep its fusion from working in place: either way each decode step copies every layer's
// cache, about 6 ms of SmolLM's 53 ms bfloat16 step at batch 32 on the 2-core Intel Xeon.
//
// The element bits are copied as they are (no arithmetic), so the values equal XLA's.

#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace genjax_cache_writes {

inline ffi::Error WriteSlots(ffi::AnyBuffer block, ffi::AnyBuffer update,
                             ffi::Buffer<ffi::S32> index, ffi::Result<ffi::AnyBuffer> out,
                             int64_t axis) {
  const auto dims = block.dimensions();
  const auto new_dims = update.dimensions();
  const int64_t rank = static_cast<int64_t>(dims.size());
  if (block.element_type() != update.element_type() || out->element_type() != block.element_type() ||
      ffi::ByteWidth(block.element_type()) != 2 || static_cast<int64_t>(new_dims.size()) != rank ||
      axis < 0 || axis >= rank || index.element_count() != 1) {
    return ffi::Error::InvalidArgument(
        "cache_writes: a 16-bit block, an update of its type and rank, a slot axis in range and "
        "one int32 index expected");
  }
  int64_t outer = 1, inner = 1;
  for (int64_t d = 0; d < rank; ++d) {
    if (d != axis && dims[d] != new_dims[d]) {
      return ffi::Error::InvalidArgument("cache_writes: update and block differ off the slot axis");
    }
    if (d < axis) outer *= dims[d];
    if (d > axis) inner *= dims[d];
  }
  const int64_t slots = dims[axis], count = new_dims[axis];
  if (count > slots) {
    return ffi::Error::InvalidArgument("cache_writes: more new slots than the block holds");
  }
  int64_t start = index.typed_data()[0];
  if (start < 0) start += slots;
  start = std::clamp<int64_t>(start, 0, slots - count);
  auto* target = static_cast<uint16_t*>(out->untyped_data());
  const auto* source = static_cast<const uint16_t*>(update.untyped_data());
  if (target != static_cast<const uint16_t*>(block.untyped_data())) {
    // Not aliased after all (XLA did not reuse the block's buffer): start from its contents.
    std::memcpy(target, block.untyped_data(), block.size_bytes());
  }
  const int64_t run = count * inner;  // contiguous elements per outer position
  if (run == 1) {  // one slot of a keys block [B, K, H, S]: a strided store per element (a
    //               memcpy call each took 76 us per layer at SmolLM's batch 32)
    for (int64_t o = 0; o < outer; ++o) target[o * slots + start] = source[o];
    return ffi::Error::Success();
  }
  for (int64_t o = 0; o < outer; ++o) {
    std::memcpy(target + (o * slots + start) * inner, source + o * run, run * sizeof(uint16_t));
  }
  return ffi::Error::Success();
}

// Writes R new slots into one layer's 16-bit paged pool, in place:
//
//   keys pool [N, K, H, bs]:   pool[block[r], k, h, offset[r]] = update[r, k, h]
//   values pool [N, K, bs, H]: pool[block[r], k, offset[r], h] = update[r, k, h]
//
// as `pool.at[block, :, :, offset].set(update)` (keys) or `.at[block, :, offset, :]` (values)
// writes them: a negative index counts from the end first, a write whose block or offset is
// still out of range is dropped, and later rows win where two write the same slot.
inline ffi::Error WritePages(ffi::AnyBuffer pool, ffi::AnyBuffer update,
                             ffi::Buffer<ffi::S32> blocks, ffi::Buffer<ffi::S32> offsets,
                             ffi::Result<ffi::AnyBuffer> out, bool keys) {
  const auto pd = pool.dimensions();
  const auto ud = update.dimensions();
  if (pool.element_type() != update.element_type() || out->element_type() != pool.element_type() ||
      ffi::ByteWidth(pool.element_type()) != 2 || pd.size() != 4 || ud.size() != 3 ||
      blocks.element_count() != ud[0] || offsets.element_count() != ud[0] || ud[1] != pd[1] ||
      ud[2] != (keys ? pd[2] : pd[3])) {
    return ffi::Error::InvalidArgument(
        "cache_writes: a 16-bit pool [N, K, H, bs] (keys) or [N, K, bs, H] (values), an update "
        "[R, K, H] of its type and R int32 blocks and offsets expected");
  }
  auto* target = static_cast<uint16_t*>(out->untyped_data());
  if (target != static_cast<const uint16_t*>(pool.untyped_data())) {
    std::memcpy(target, pool.untyped_data(), pool.size_bytes());  // not aliased after all
  }
  const auto* source = static_cast<const uint16_t*>(update.untyped_data());
  const int64_t N = pd[0], K = pd[1], H = ud[2], bs = keys ? pd[3] : pd[2];
  for (int64_t r = 0; r < ud[0]; ++r) {
    int64_t block = blocks.typed_data()[r], offset = offsets.typed_data()[r];
    if (block < 0) block += N;
    if (offset < 0) offset += bs;
    if (block < 0 || block >= N || offset < 0 || offset >= bs) continue;
    const uint16_t* row = source + r * K * H;
    for (int64_t k = 0; k < K; ++k) {
      uint16_t* head = target + (block * K + k) * H * bs;
      if (keys) {
        for (int64_t h = 0; h < H; ++h) head[h * bs + offset] = row[k * H + h];
      } else {
        std::memcpy(head + offset * H, row + k * H, H * sizeof(uint16_t));
      }
    }
  }
  return ffi::Error::Success();
}

}  // namespace genjax_cache_writes

XLA_FFI_DEFINE_HANDLER_SYMBOL(GenjaxWriteSlots16, genjax_cache_writes::WriteSlots,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("axis"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(GenjaxWritePages16, genjax_cache_writes::WritePages,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<bool>("keys"));
