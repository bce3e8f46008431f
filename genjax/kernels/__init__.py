"""Native kernels for what XLA:CPU runs slowly: products of a few rows, decode attention, 4 bits.

* :mod:`genjax.kernels.rows`: products of a few activation rows with float32, bfloat16 or int8
  weights (decode steps, beams, speculative verification; int8 prompts of up to 256 rows),
  reading each weight once: an XLA FFI custom call on the CPU, XLA's product elsewhere and on
  meshes.
* :mod:`genjax.kernels.attention`: one-token attention's two sums over the KV cache, over each
  row's unmasked slots only: an XLA FFI custom call on the CPU, XLA's sums elsewhere and on
  meshes.
* :mod:`genjax.kernels.cache_writes`: a decode step's new slots written into a bfloat16 or
  float16 KV cache in place (XLA:CPU copies the whole block): an XLA FFI custom call on the CPU,
  ``dynamic_update_slice`` elsewhere and on meshes.
* :mod:`genjax.kernels.block_gather`: rows of a paged KV pool's blocks copied into logical order
  (the serving engine's gather): an XLA FFI custom call on the CPU, XLA's gather elsewhere.
* :mod:`genjax.kernels.gate`: where those four kernels run (CPU, no automatic mesh, not
  switched off) and their shared library, ``decode_kernels.cc``.
* :mod:`genjax.kernels.q4`: the 4-bit weight format (blocks of 32, llama.cpp's Q4_0 / Q4_1
  layout) and its product with float activations: an XLA FFI custom call on the CPU, an XLA
  product elsewhere.
* :mod:`genjax.kernels.native`: builds a kernel's C++ source on first use for this CPU, caches
  the library, and reports why when it cannot.

Floor 2: imports only :mod:`genjax.errors` and :mod:`genjax.typing`.
"""

from genjax.kernels import attention, block_gather, cache_writes, gate, q4, rows

__all__ = ["attention", "block_gather", "cache_writes", "gate", "q4", "rows"]
