"""How the cost of one linear layer grows with the number of activation rows, on this backend.

Speculative decoding verifies ``G + 1`` tokens in one target pass, beam search runs ``beams`` rows,
and batched decoding runs ``batch`` rows; each is worth it only if a matrix product with a few
rows costs little more than with one row. This script measures exactly that: for each weight
matrix of a model shape, the time of ``x @ W.T`` with ``x`` float32[M, in] and ``W``
float32[out, in] three ways: the plain product in genjax's ``[out, in]`` layout
(``dot_general`` contracting both ``in`` axes), the same matrix stored ``[in, out]`` (``x @ W``),
genjax's ``layers.linear`` on the ``[out, in]`` matrix as XLA runs it (on CPU, with 2-16 rows,
the swapped product ``W @ x.T`` and a transpose of its small result), and genjax's CPU kernel
(``genjax.kernels.rows``, which ``layers.linear`` takes for 1-32 float32 rows where it builds),
for M = 1, 2, 3, 5, 8, 16, 32. ``bench/matmul_stack.py`` times a whole model's matrices instead,
streaming from memory. Each
product runs ``--repeats`` times inside one ``lax.fori_loop`` (one compiled program, no dispatch
per product), the weight staying the same, so the figures are for a matrix that fits in the CPU
cache when it is small and streams from memory when it is not, as in decoding.

Shapes:
    ``tiny``: the bundled ``genjax-tiny`` target (Llama, width 256, MLP 704, vocab 4096) and
        its draft's head (vocab 4096 x width 96): the speculative-decoding pair.
    ``gpt2``: GPT-2 small (768 wide, MLP 3072, fused qkv 2304, vocab 50257).
    ``smollm``: the SmolLM-135M shape (576 wide, MLP 1536, vocab 49152).

Run:  python bench/matmul_rows.py [--shapes tiny gpt2] [--rows 1 2 5 8] [--repeats 100]
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

SHAPES = {
    "tiny": [("q_proj/o_proj", 256, 256), ("k/v_proj", 128, 256), ("gate/up", 704, 256),
             ("down", 256, 704), ("head", 4096, 256), ("draft head", 4096, 96)],
    "gpt2": [("c_attn", 2304, 768), ("c_proj", 768, 768), ("c_fc", 3072, 768),
             ("mlp c_proj", 768, 3072), ("head", 50257, 768)],
    "smollm": [("q/o_proj", 576, 576), ("k/v_proj", 192, 576), ("gate/up", 1536, 576),
               ("down", 576, 1536), ("head", 49152, 576)],
}  # fmt: skip
_OUT_IN = (((1,), (1,)), ((), ()))  # x[M, in] . W[out, in] over `in`
_IN_OUT = (((1,), (0,)), ((), ()))  # x[M, in] . W[in, out] over `in`
PRODUCTS = {
    "out_in": lambda x, weight: jax.lax.dot_general(x, weight, _OUT_IN),
    "in_out": lambda x, weight: jax.lax.dot_general(x, weight, _IN_OUT),
    "linear": lambda x, weight: linear(x, weight, None, jnp.float32),  # weight [out, in]
    "kernel": lambda x, weight: rows_kernel.matmul(x, weight),  # weight [out, in]
}


def _per_product_s(product: str, weight: jax.Array, rows: int, repeats: int) -> float:
    """Median seconds of one product with ``rows`` rows, over 5 timed loops."""
    multiply = PRODUCTS[product]

    @jax.jit
    def loop(x, weight):
        def body(i, carry):
            # The carry feeds the next product, so XLA cannot hoist or drop any of them.
            y = multiply(x + carry, weight)
            return carry + y[0, 0] * 1e-9

        return jax.lax.fori_loop(0, repeats, body, jnp.float32(0))

    x = jnp.ones((rows, weight.shape[0] if product == "in_out" else weight.shape[1]), jnp.float32)
    with rows_kernel.disabled(product == "linear"):  # XLA's product, as genjax had it
        jax.block_until_ready(loop(x, weight))
    samples = []
    for _ in range(5):
        start = time.perf_counter()
        jax.block_until_ready(loop(x, weight))
        samples.append((time.perf_counter() - start) / repeats)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["tiny", "gpt2"])
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 2, 3, 5, 8, 16, 32])
    parser.add_argument("--repeats", type=int, default=100, help="products per timed loop")
    args = parser.parse_args()
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; float32; microseconds per")
    print(
        "product: [out, in] plain / [in, out] / genjax linear on [out, in] through XLA / genjax's"
    )
    print(f"kernel; (x N): the kernel's time over its time with M={args.rows[0]} rows")
    rng = np.random.default_rng(0)
    for shape in args.shapes:
        print(f"\n== {shape} ==")
        print(f"{'matrix':>12} {'[out, in]':>12} " + " ".join(f"{f'M={m}':>34}" for m in args.rows))
        for name, out_features, in_features in SHAPES[shape]:
            weight = rng.standard_normal((out_features, in_features), np.float32)
            out_in = jnp.asarray(weight)
            in_out = jnp.asarray(np.ascontiguousarray(weight.T))
            cells, one = [], None
            for rows in args.rows:
                a = _per_product_s("out_in", out_in, rows, args.repeats) * 1e6
                b = _per_product_s("in_out", in_out, rows, args.repeats) * 1e6
                c = _per_product_s("linear", out_in, rows, args.repeats) * 1e6
                d = _per_product_s("kernel", out_in, rows, args.repeats) * 1e6
                one = one or d
                cells.append(f"{a:6.0f}/{b:<6.0f}/{c:<6.0f}/{d:<6.0f}(x{d / one:4.1f})")
            print(f"{name:>12} {f'{out_features}x{in_features}':>12} " + " ".join(cells))


if __name__ == "__main__":
    main()
