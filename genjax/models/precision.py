"""``dtype="auto"``: the fastest weight format whose outputs move only by a measured amount.

``from_pretrained(path, dtype="auto", batch_size=B)`` (and ``genjax generate/serve --dtype
auto``) loads what :func:`auto_precision` picks for the default backend and the batch size the
caller will decode at. The default ``dtype=None`` stays float32 and exact; ``"auto"`` is the
caller's statement that logits may move as measured below.

The choice, from ``bench/precision.py`` on the 2-core AMD EPYC (AVX2, AVX-512, VNNI; no AMX),
SmolLM2-135M-Instruct, one decode step against float32's
(``bench/results/2026-12-02-cpu-amd-epyc-precision.txt``):

| rows | bfloat16 | int8 weights | int4 weights |
|---|---|---|---|
| 1 | 1.94x | 3.36x | 3.18x |
| 4 | 1.12x | 1.05x | 1.64x |
| 8 | 1.10-1.11x | 1.02-1.04x | 0.97-1.10x |
| 16 | 0.95x | 0.81x | 0.73x |
| 32 | 1.30x | 0.99x | 0.59x |

With genjax's row kernel (:mod:`genjax.kernels.rows`) int8 products of up to 32 rows read the
int8 weights directly, and int8 became the fastest format up to 16 rows. On the 2-core Intel
Xeon (AMX), SmolLM's shape, greedy, ms per step float32 / bfloat16 / int8 (same run,
``bench/results/2026-12-02-cpu-intel-xeon-decode-attention.txt``): 1 row 19.2 / 13.0 / 7.2;
8 rows 31.0 / 30.1 / 20.1; 32 rows 81.6 / 60.9 / 76.7; the model's products alone at 16 rows
33.1 / 27.3 / 22.1 (``bench/matmul_stack.py``). Re-measured on the AMD EPYC with the kernel
(``bench/results/2026-12-03-cpu-amd-epyc-precision.txt``), a decode step against float32's,
bfloat16 / int8 / int4: 1 row 2.13x / 3.33x / 2.78x; 8 rows 1.15x / 1.22x / 1.20x; 16 rows
1.38x / 1.26x / 1.21x; 32 rows 1.41x / 0.90x / 0.92x.

With the AVX-512 BF16 pair product (:func:`bf16_pair_kernel_runs`), bfloat16 became the
faster format from 4 rows and is the more exact one (below): on the AMD EPYC
(``bench/results/2026-12-04-cpu-amd-epyc-precision.txt``), a decode step against float32's,
bfloat16 / int8: 1 row 1.81x / 3.19x; 2 rows 1.51x / 2.24x; 4 rows 1.75x / 1.83x (12.4 against
11.9 ms); 8 rows 1.97x / 1.06x; 16 rows 1.53x / 0.85x; 32 rows 2.03x / 1.09x.

* CPU, fewer than :data:`CPU_FLOAT32_FROM_ROWS` rows (one user): float32 activations with int8
  weights (``quantize="int8"``), the one large and steady gain (and 1.15x llama.cpp end to end
  on the Q4_1 file, ``2026-12-03-cpu-amd-epyc-four-bit.txt``).
* CPU, more rows, where the pair product runs: bfloat16. (The Intel Xeon has it too; there the
  pair product was not yet measured against int8 weights at 4-16 rows.)
* CPU without it, up to :data:`CPU_INT8_KERNEL_ROWS` rows where the row kernel takes int8
  products: int8 weights as above.
* CPU, more rows: bfloat16 on a CPU with bfloat16 dot products (:func:`cpu_has_bf16_products`:
  AMX bfloat16 tiles, as on Intel Xeon since Sapphire Rapids, or AVX-512 BF16, as on AMD EPYC
  since Zen 4): there bfloat16 was the faster format at 32 rows on both CPU kinds this
  project measured (above, and ``bench/results/2026-12-02-cpu-intel-xeon-bf16-layout.txt``).
  Elsewhere float32: bfloat16 was not measured on a CPU without those instructions.
* GPU and TPU: bfloat16 params and activations (products accumulate in float32). Not measured
  by this project (no accelerator was lent to its benchmark runs); it is the format those
  devices' matrix units are built for.

What each narrow path changes against float32 on the same checkpoint (first new token's
logits over four chat prompts; greedy tokens teacher forced, 64 per prompt): bfloat16 largest
change 2.2% of the largest logit, tokens equal at 98.0%; int8 5.7%, 97.7%; int4 2.0%, 96.9%
(int4 keeps the file's own 4-bit values, so only its rounded decode activations move it).

Static or traced: nothing here is traced; the choice is made on the host before loading.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from genjax.errors import InputError
from genjax.kernels import native
from genjax.kernels import rows as rows_kernel

AUTO = "auto"

CPU_FLOAT32_FROM_ROWS = 4
"""On a CPU without genjax's row kernel, decoding this many rows or more picks float32
(bfloat16 with bfloat16 dot products) over int8 weights."""

CPU_INT8_KERNEL_ROWS = 16
"""On a CPU where genjax's row kernel takes int8 products (:mod:`genjax.kernels.rows`), int8
weights are picked up to this many rows."""


def auto_precision(batch_size: int | None = None, backend: str | None = None):
    """The ``(dtype, quantize)`` that ``dtype="auto"`` loads.

    Args:
        batch_size: the rows the caller will decode together (None: a few, as one user or a
            small server batch).
        backend: ``"cpu"``, ``"gpu"``, ``"tpu"``...; None: JAX's default backend.

    Returns:
        ``("float32", "int8")``, ``("float32", None)`` or ``("bfloat16", None)`` (see the
        module docstring; on a CPU with bfloat16 dot products, :func:`cpu_has_bf16_products`,
        ``("bfloat16", None)`` where int8 is not picked; with the pair product from
        :data:`CPU_FLOAT32_FROM_ROWS` rows).

    Raises:
        InputError: ``batch_size`` is not a positive integer.

    Example:
        >>> auto_precision(1, "cpu"), auto_precision(8, "gpu")
        (('float32', 'int8'), ('bfloat16', None))
        >>> auto_precision(64, "cpu") == (
        ...     ("bfloat16" if cpu_has_bf16_products() else "float32"), None)
        True
    """
    if batch_size is not None and (
        isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1
    ):
        raise InputError(f"batch_size must be a positive int or None, got {batch_size!r}.")
    backend = backend or jax.default_backend()
    if backend != "cpu":
        return "bfloat16", None
    few = batch_size is None or batch_size < CPU_FLOAT32_FROM_ROWS
    if few:
        return "float32", "int8"
    if bf16_pair_kernel_runs():
        return "bfloat16", None
    if batch_size <= CPU_INT8_KERNEL_ROWS and int8_kernel_takes(batch_size):
        return "float32", "int8"
    return ("bfloat16", None) if cpu_has_bf16_products() else ("float32", None)


def bf16_pair_kernel_runs() -> bool:
    """Whether genjax's row kernel multiplies bfloat16 rows with the AVX-512 BF16 pair product
    in this process (:func:`genjax.kernels.rows.pairs_available`, kernels not turned off)."""
    width = rows_kernel.PAIR_INPUT_MULTIPLE
    return rows_kernel.pairs_available() and rows_kernel.takes(jnp.bfloat16, 1, width)


def int8_kernel_takes(rows: int) -> bool:
    """Whether genjax's row kernel runs int8 products of ``rows`` rows in this process."""
    return rows_kernel.takes(jnp.int8, rows, rows_kernel.INPUT_MULTIPLE)


BF16_PRODUCT_FLAGS = ("amx_bf16", "avx512_bf16")
"""Linux ``/proc/cpuinfo`` flags of CPUs with bfloat16 dot-product instructions."""


def cpu_has_bf16_products() -> bool:
    """True when this machine's CPU reports bfloat16 dot-product instructions (one of
    :data:`BF16_PRODUCT_FLAGS` in Linux's ``/proc/cpuinfo``); False when it does not or the
    file cannot be read (other systems: the choice stays float32)."""
    return not native.cpu_flags().isdisjoint(BF16_PRODUCT_FLAGS)


def resolve(dtype, quantize: str | None, batch_size: int | None):
    """``(dtype, quantize)`` to load: :func:`auto_precision` for ``dtype="auto"``, else as given.

    Raises:
        InputError: ``dtype="auto"`` with ``quantize`` set (auto picks the quantization too), or
            ``batch_size`` without ``dtype="auto"`` (it would change nothing).
    """
    if not (isinstance(dtype, str) and dtype == AUTO):
        if batch_size is not None:
            raise InputError(
                f"batch_size={batch_size!r} only informs dtype='auto'; with dtype={dtype!r} it "
                "would change nothing. Leave it out, or pass dtype='auto'."
            )
        return dtype, quantize
    if quantize is not None:
        raise InputError(
            f"dtype='auto' picks the quantization too, so quantize={quantize!r} cannot be "
            "combined with it; pass a concrete dtype with quantize, or leave quantize out."
        )
    return auto_precision(batch_size)
