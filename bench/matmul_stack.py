"""A whole model's matrix products at a few activation rows: genjax's CPU kernel against XLA's.

Decoding at batch 1-32, beam search and speculative verification all multiply every weight
matrix of the model by a few rows per step, reading all the weights from memory each time.
This script builds one model shape's matrices (every layer's, plus the output head), multiplies
them all in sequence by ``M`` float32 rows inside one ``lax.fori_loop`` (each product's input
depends on the previous one, so nothing is hoisted or skipped), and prints the milliseconds per
pass through the stack with genjax's ``layers.linear`` taking its kernel
(``genjax.kernels.rows``) and taking XLA's product (traced under ``rows.disabled()``), and
their ratio. Attention, norms and the cache are left out: this is the matrix floor of a step.

Shapes (``--shape``): ``smollm`` (SmolLM-135M: 30 layers, width 576, MLP 1536, vocab 49152,
538 MB of float32 matrices) and ``gpt2`` (12 layers, width 768, MLP 3072, vocab 50257).

Run:  python bench/matmul_stack.py [--shape smollm] [--rows 1 2 5 8 16 32 64] [--loops 10]
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

# (out, in, count per layer), then the head (out, in)
STACKS = {
    "smollm": ([(576, 576, 2), (192, 576, 2), (1536, 576, 2), (576, 1536, 1)], 30, (49152, 576)),
    "gpt2": ([(2304, 768, 1), (768, 768, 1), (3072, 768, 1), (768, 3072, 1)], 12, (50257, 768)),
}


def matrices(shape: str) -> list[jax.Array]:
    per_layer, layers, head = STACKS[shape]
    rng = np.random.default_rng(0)
    sizes = [(o, i) for _ in range(layers) for o, i, n in per_layer for _ in range(n)] + [head]
    return [jnp.asarray(rng.standard_normal(size, np.float32) * 0.01) for size in sizes]


def ms_per_pass(weights: list[jax.Array], rows: int, loops: int, kernel: bool) -> float:
    """Median milliseconds of one pass through ``weights`` at ``rows`` rows, over 5 timings."""
    widest = max(w.shape[1] for w in weights)

    def passes(x, weights):
        def body(_, carry):
            for w in weights:
                y = linear(x[:, : w.shape[1]] + carry, w, None, jnp.float32)
                carry = carry + y[:, :1] * 1e-9
            return carry

        return jax.lax.fori_loop(0, loops, body, jnp.zeros((rows, 1), jnp.float32))

    program = jax.jit(passes)
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
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 2, 5, 8, 16, 32, 64])
    parser.add_argument("--loops", type=int, default=10, help="passes per timing")
    args = parser.parse_args()
    weights = matrices(args.shape)
    megabytes = sum(w.size for w in weights) * 4 / 1e6
    print(
        f"jax {jax.__version__}; {args.shape}: {len(weights)} float32 matrices, {megabytes:.0f} MB"
    )
    print(
        f"kernel built: {rows_kernel.kernel_available()} (used for 1-{rows_kernel.MAX_ROWS} rows)"
    )
    print(f"{'rows':>5} {'kernel ms':>10} {'XLA ms':>8} {'XLA/kernel':>11} {'kernel GB/s':>12}")
    for rows in args.rows:
        kernel = ms_per_pass(weights, rows, args.loops, kernel=True)
        xla = ms_per_pass(weights, rows, args.loops, kernel=False)
        rate = megabytes / kernel
        print(f"{rows:>5} {kernel:>10.1f} {xla:>8.1f} {xla / kernel:>10.2f}x {rate:>12.1f}")


if __name__ == "__main__":
    main()
