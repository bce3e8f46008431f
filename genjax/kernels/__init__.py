"""Native kernels for products XLA:CPU runs slowly: a few activation rows, and 4-bit weights.

* :mod:`genjax.kernels.rows`: products of 1-32 activation rows with float32, bfloat16 or int8
  weights (decode steps, beams, speculative verification), reading each weight once: an XLA FFI
  custom call on the CPU, XLA's product elsewhere and on meshes.
* :mod:`genjax.kernels.q4`: the 4-bit weight format (blocks of 32, llama.cpp's Q4_0 / Q4_1
  layout) and its product with float activations: an XLA FFI custom call on the CPU, an XLA
  product elsewhere.
* :mod:`genjax.kernels.native`: builds a kernel's C++ source on first use for this CPU, caches
  the library, and reports why when it cannot.

Floor 2: imports only :mod:`genjax.errors` and :mod:`genjax.typing`.
"""

from genjax.kernels import q4, rows

__all__ = ["q4", "rows"]
