"""A whole model's matrix products at a few activation rows: genjax's CPU kernel against XLA's,
for float32, bfloat16 and int8 weights.

Decoding at batch 1-32, beam search and speculative verification all multiply every weight
matrix of the model by a few rows per step, reading all the weights from memory each time.
This script builds one model shape's matrices (every layer's, plus the output head), multiplies
them all in sequence by ``M`` float32 rows inside one ``lax.fori_loop`` (each product's input
depends on the previous one, so nothing is hoisted or skipped), and prints the milliseconds per
pass through the stack with genjax's ``layers.linear`` taking its kernel
(``genjax.kernels.rows``) and taking XLA's product (traced under ``rows.disabled()``), and
their ratio, for each weight dtype of ``--dtypes`` (``bfloat16``: activations and weights in
bfloat16, products accumulated in float32; ``int8``: weight-only int8 with a float32 scale per
output, float32 activations, XLA's products compiled with the library-dot options ``generate``
uses from two rows). Attention, norms and the cache are left out: this is the matrix floor of a
step.

Shapes (``--shape``): ``smollm`` (SmolLM-135M: 30 layers, width 576, MLP 1536, vocab 49152,
538 MB of float32 matrices) and ``gpt2`` (12 layers, width 768, MLP 3072, vocab 50257).

Run:  python bench/matmul_stack.py [--shape smollm] [--dtypes float32 bfloat16 int8]
          [--rows 1 2 5 8 16 32 64] [--loops 10]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from genjax.kernels import rows as rows_kernel
from genjax.models.layers import linear
from genjax.models.quantize import LIBRARY_DOT_OPTIONS, quantize_weight

# (out, in, count per layer), then the head (out, in)
STACKS = {
    "smollm": ([(576, 576, 2), (192, 576, 2), (1536, 576, 2), (576, 1536, 1)], 30, (49152, 576)),
    "gpt2": ([(2304, 768, 1), (768, 768, 1), (3072, 768, 1), (768, 3072, 1)], 12, (50257, 768)),
}


def matrices(shape: str, dtype: str) -> list[tuple[jax.Array, jax.Array | None]]:
    """Every matrix of ``shape`` as (weight, int8 scale or None) in ``dtype``."""
    per_layer, layers, head = STACKS[shape]
    rng = np.random.default_rng(0)
    sizes = [(o, i) for _ in range(layers) for o, i, n in per_layer for _ in range(n)] + [head]
    weights = []
    for size in sizes:
        weight = jnp.asarray(rng.standard_normal(size, np.float32) * 0.01)
        if dtype == "int8":
            weights.append(quantize_weight(weight))
        else:
            weights.append((weight.astype(dtype), None))
    return weights


def ms_per_pass(weights, dtype: str, rows: int, loops: int, kernel: bool) -> float:
    """Median milliseconds of one pass through ``weights`` at ``rows`` rows, over 5 timings."""
    widest = max(w.shape[1] for w, _ in weights)
    compute = jnp.bfloat16 if dtype == "bfloat16" else jnp.float32

    def passes(x, weights):
        def body(_, carry):
            for weight, scale in weights:
                inputs = (x[:, : weight.shape[1]] + carry).astype(compute)
                y = linear(inputs, weight, scale, compute)
                carry = carry + y[:, :1].astype(jnp.float32) * 1e-9
            return carry

        return jax.lax.fori_loop(0, loops, body, jnp.zeros((rows, 1), jnp.float32))

    library_dots = dtype == "int8" and rows > 1  # as generate compiles int8 params
    program = jax.jit(passes, compiler_options=LIBRARY_DOT_OPTIONS if library_dots else None)
    x = jnp.ones((rows, widest), jnp.float32)
    with rows_kernel.disabled(not kernel):
        jax.block_until_ready(program(x, weights))  # traced and compiled here
    samples = []
    for _ in range(5):
        start = time.perf_counter()
        jax.block_until_ready(program(x, weights))
        samples.append((time.perf_counter() - start) / loops * 1e3)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(STACKS), default="smollm")
    parser.add_argument("--dtypes", nargs="+", choices=["float32", "bfloat16", "int8"],
                        default=["float32", "bfloat16", "int8"])  # fmt: skip
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 2, 5, 8, 16, 32, 64])
    parser.add_argument("--loops", type=int, default=10, help="passes per timing")
    args = parser.parse_args()
    print(f"jax {jax.__version__}; {args.shape}; kernel built: {rows_kernel.kernel_available()}")
    limits = {k.name: f"1-{v}" for k, v in rows_kernel.MAX_ROWS.items()}
    if rows_kernel.pairs_available():  # inputs in 32s, as every matrix here
        limits["bfloat16"] = f"1-{rows_kernel.pair_max_rows()} (AVX-512 BF16 pair product)"
    limits = ", ".join(f"{name} {rows}" for name, rows in limits.items())
    print(f"rows that genjax's linear gives the kernel: {limits}")
    for dtype in args.dtypes:
        weights = matrices(args.shape, dtype)
        megabytes = sum(w.size * w.dtype.itemsize for w, _ in weights) / 1e6
        print(f"\n== {dtype}: {len(weights)} matrices, {megabytes:.0f} MB ==")
        print(f"{'rows':>5} {'kernel ms':>10} {'XLA ms':>8} {'XLA/kernel':>11} {'kernel GB/s':>12}")
        for rows in args.rows:
            kernel = ms_per_pass(weights, dtype, rows, args.loops, kernel=True)
            xla = ms_per_pass(weights, dtype, rows, args.loops, kernel=False)
            rate = megabytes / kernel
            print(f"{rows:>5} {kernel:>10.1f} {xla:>8.1f} {xla / kernel:>10.2f}x {rate:>12.1f}")


if __name__ == "__main__":
    main()
