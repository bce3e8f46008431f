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
  for (int64_t o = 0; o < outer; ++o) {
    std::memcpy(target + (o * slots + start) * inner, source + o * run, run * sizeof(uint16_t));
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
