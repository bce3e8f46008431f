"""The matrix products of a decode step alone, in genjax and in PyTorch: the floor of a step.

A decode step of a model shape multiplies every weight matrix once, by ``rows`` activation rows
(the batch, or batch x beams). This script runs exactly those products for the full depth of a
shape, each layer with its own random float32 weights, so that they stream from memory as in
decoding, and nothing else: no attention over the cache, no norms, no sampling. The rows that feed
each product come from the one before, so neither library can skip or reorder any of them.

    genjax  ``layers.linear`` (what the models call), ``--steps`` steps in one ``lax.fori_loop``
    torch   ``torch.nn.functional.linear`` (what transformers' ``nn.Linear`` calls) in a Python
            loop under ``torch.inference_mode()``, with ``torch.set_num_threads`` = usable CPUs

Per row count it prints the milliseconds per step (median of ``--runs`` timed loops, with min-max),
the weight bytes read per second, and torch's time over genjax's. A library's whole decode step
cannot be faster than its products, so genjax's full step against torch's products bounds the
speed-up over transformers that genjax can show at that batch on this machine.

``--dtypes float32 bfloat16 int8`` also runs genjax's products with bfloat16 weights and
activations, and with weight-only int8 weights (``genjax.quantize``'s scheme; several rows
compiled with ``quantize.LIBRARY_DOT_OPTIONS``, as ``generate`` does), and prints each one's time
over float32's: the floor of each dtype's decode step.

Run:  python bench/matmul_floor.py [--shapes smollm gpt2] [--rows 1 4 8 32] [--steps 16]
                                   [--dtypes float32 bfloat16 int8]
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time

import _cases
import _machine
import jax
import jax.numpy as jnp
import numpy as np

from genjax.models.layers import linear
from genjax.models.quantize import LIBRARY_DOT_OPTIONS, quantize_weight


def layer_matrices(shape: _cases.Shape) -> list[tuple[int, int]]:
    """[(out, in)] of one layer's weight matrices, in the order a decode step multiplies them."""
    c = shape.config
    if shape.arch == "gpt2":
        width = c["n_embd"]
        return [(3 * width, width), (width, width), (4 * width, width), (width, 4 * width)]
    width, mlp = c["hidden_size"], c["intermediate_size"]
    kv = width // c["num_attention_heads"] * c["num_key_value_heads"]
    return [(width, width), (kv, width), (kv, width), (width, width)] + [
        (mlp, width),
        (mlp, width),
        (width, mlp),
    ]


def random_weights(
    shape: _cases.Shape, depth: int | None = None
) -> tuple[list[list[np.ndarray]], np.ndarray]:
    """float32 [out, in] matrices of ``depth`` layers (default: the shape's full depth), and the
    [vocab, width] output head."""
    rng = np.random.default_rng(_cases.SEED)
    matrices = layer_matrices(shape)
    layers = [
        [rng.standard_normal(size, np.float32) * 0.02 for size in matrices]
        for _ in range(depth or shape.layers)
    ]
    width = matrices[0][1]
    vocab = shape.config["vocab_size"]
    return layers, rng.standard_normal((vocab, width), np.float32) * 0.02


def _step(multiply, layers, head, x):
    """One step's products on x[rows, width]; returns the head's output [rows, vocab].

    Each product takes the output of one before it (the values do not matter, the dependency
    does): q, k, v and o, gate, up and down in a Llama layer (7 matrices), fused qkv, attention
    projection, fc and its projection in a GPT-2 layer (4 matrices).
    """
    width = x.shape[1]
    for weights in layers:
        if len(weights) == 7:  # Llama
            q, k, v = (multiply(x, w) for w in weights[:3])
            o = multiply(q, weights[3])
            mlp = multiply(o, weights[4]) * multiply(o, weights[5])
            x = x + multiply(mlp, weights[6]) * 1e-3 + (k.sum() + v.sum()) * 0
        else:  # GPT-2
            qkv = multiply(x, weights[0])
            o = multiply(qkv[:, :width], weights[1])
            x = x + multiply(multiply(o, weights[2]), weights[3]) * 1e-3
    return multiply(x, head)


def genjax_loop(layers, head, rows: int, steps: int, dtype: str = "float32"):
    """Compiles ``steps`` steps in one ``lax.fori_loop`` and returns a no-argument function that
    runs them to completion; ``dtype`` is the weights' (``int8``: weight-only, float32
    activations)."""
    if dtype == "int8":
        convert = lambda w: quantize_weight(jnp.asarray(w))  # noqa: E731
        multiply = lambda x, weight: linear(x, *weight, jnp.float32)  # noqa: E731
        activations = jnp.float32
    else:
        convert = lambda w: jnp.asarray(w, dtype)  # noqa: E731
        multiply = lambda x, weight: linear(x, weight, None, dtype)  # noqa: E731
        activations = dtype
    params = ([[convert(w) for w in matrices] for matrices in layers], convert(head))
    options = LIBRARY_DOT_OPTIONS if dtype == "int8" and rows > 1 else None

    @functools.partial(jax.jit, compiler_options=options)
    def loop(x, params):
        def body(i, x):
            logits = _step(multiply, *params, x)
            return x + logits[:, : x.shape[1]] * 1e-6

        return jax.lax.fori_loop(0, steps, body, x)

    x = jnp.ones((rows, head.shape[1]), activations)
    run = lambda: jax.block_until_ready(loop(x, params))  # noqa: E731
    run()
    return run


def time_genjax(layers, head, rows: int, steps: int, runs: int) -> list[float]:
    """Seconds per step of ``steps`` steps in one compiled loop, ``runs`` times."""
    run = genjax_loop(layers, head, rows, steps)
    return [_timed(run) / steps for _ in range(runs)]


def time_dtypes(layers, head, rows: int, steps: int, runs: int, dtypes) -> dict[str, list]:
    """Seconds per step of genjax's loop at each dtype, the dtypes interleaved loop by loop."""
    loops = {dtype: genjax_loop(layers, head, rows, steps, dtype) for dtype in dtypes}
    seconds = {dtype: [] for dtype in dtypes}
    for _ in range(runs):
        for dtype, run in loops.items():
            seconds[dtype].append(_timed(run) / steps)
    return seconds


def time_torch(layers, head, rows: int, steps: int, runs: int) -> list[float]:
    """Seconds per step of ``steps`` steps of a Python loop, ``runs`` times."""
    import torch

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    layers = [[torch.from_numpy(w) for w in matrices] for matrices in layers]
    head = torch.from_numpy(head)
    multiply = torch.nn.functional.linear

    def loop():
        x = torch.ones(rows, head.shape[1])
        with torch.inference_mode():
            for _ in range(steps):
                logits = _step(multiply, layers, head, x)
                x = x + logits[:, : x.shape[1]] * 1e-6

    loop()
    return [_timed(loop) / steps for _ in range(runs)]


def _timed(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", choices=sorted(_cases.SHAPES), default=["smollm"])
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 4, 8, 32])
    parser.add_argument("--steps", type=int, default=16, help="steps per timed loop")
    parser.add_argument("--runs", type=int, default=5, help="timed loops per library and rows")
    parser.add_argument("--dtypes", nargs="+", choices=["float32", "bfloat16", "int8"])
    args = parser.parse_args()
    if args.dtypes:
        dtype_table(args)
        return
    import torch

    print(f"jax {jax.__version__} on {jax.devices()[0].platform}, torch {torch.__version__} "
          f"({len(os.sched_getaffinity(0))} threads); float32; ms per step, median (min-max) of "
          f"{args.runs} loops of {args.steps} steps")  # fmt: skip
    for name in args.shapes:
        shape = _cases.SHAPES[name]
        layers, head = random_weights(shape)
        nbytes = sum(w.nbytes for matrices in layers for w in matrices) + head.nbytes
        print(
            f"\n== {shape.title}: {shape.layers} layers + head, {nbytes / 1e6:.0f} MB of weights =="
        )
        print(
            f"{'rows':>5} {'genjax':>22} {'GB/s':>6} {'torch':>22} {'GB/s':>6} {'torch/genjax':>13}"
        )
        for rows in args.rows:
            cells, medians = [], []
            for timer in (time_genjax, time_torch):  # one after the other, same weights
                seconds = timer(layers, head, rows, args.steps, args.runs)
                median = statistics.median(seconds)
                medians.append(median)
                cells.append(
                    f"{median * 1e3:7.1f} ({min(seconds) * 1e3:.1f}-{max(seconds) * 1e3:.1f})"
                    f"{'':>3} {nbytes / median / 1e9:6.1f}"
                )
            print(f"{rows:>5} {cells[0]:>29} {cells[1]:>29} {medians[1] / medians[0]:12.2f}x")


def dtype_table(args) -> None:
    """genjax's products at each of ``args.dtypes``, interleaved; ratios over float32."""
    machine = f"{_machine.cpu_model()} ({', '.join(_machine.cpu_extensions())})"
    print(
        f"jax {jax.__version__} on {jax.devices()[0].platform}; {machine}; ms per step, median "
        f"(min-max) of {args.runs} interleaved loops of {args.steps} steps; x: float32 / this"
    )
    for name in args.shapes:
        shape = _cases.SHAPES[name]
        layers, head = random_weights(shape)
        print(f"\n== {shape.title}: {shape.layers} layers + head ==")
        print(f"{'rows':>5} " + " ".join(f"{dtype:>26}" for dtype in args.dtypes))
        for rows in args.rows:
            seconds = time_dtypes(layers, head, rows, args.steps, args.runs, args.dtypes)
            base = statistics.median(seconds.get("float32") or seconds[args.dtypes[0]])
            cells = []
            for dtype in args.dtypes:
                median = statistics.median(seconds[dtype])
                span = f"{min(seconds[dtype]) * 1e3:.1f}-{max(seconds[dtype]) * 1e3:.1f}"
                cells.append(f"{median * 1e3:7.1f} ({span}) x{base / median:4.2f}")
            print(f"{rows:>5} " + " ".join(f"{cell:>26}" for cell in cells), flush=True)


if __name__ == "__main__":
    main()
