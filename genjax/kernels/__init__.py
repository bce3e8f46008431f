"""Native kernels for products XLA cannot fuse: 4-bit weights on the CPU.

* :mod:`genjax.kernels.q4`: the 4-bit weight format (blocks of 32, llama.cpp's Q4_0 / Q4_1
  layout) and its product with float activations: an XLA FFI custom call on the CPU, an XLA
  product elsewhere.
* :mod:`genjax.kernels.native`: builds a kernel's C++ source on first use for this CPU, caches
  the library, and reports why when it cannot.

Floor 2: imports only :mod:`genjax.errors` and :mod:`genjax.typing`.
"""

from genjax.kernels import q4

__all__ = ["q4"]
