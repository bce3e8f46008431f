"""Where the first generate call's extra time goes: trace, lowering, XLA compile, first run.

``run.py``'s compile column is the first call minus the steady call, one number. This script
splits it for the suite's shapes (same random checkpoints, ``_cases.write_checkpoint``), using
only jax's public staging API on a user-level ``jax.jit`` around ``genjax.generate`` (the same
program generate compiles, its inner jit inlined):

    trace    ``jitted.trace(params, ids)``: Python runs the model and the loop once, abstractly
    lower    ``traced.lower()``: the jaxpr to StableHLO
    compile  ``lowered.compile()``: XLA's passes and code generation
    first    the first execution of the compiled program minus the median steady execution

Each repetition starts from ``jax.clear_caches()``, so every stage runs again; the table gives
the median and min-max over ``--repeats``. The cases are ``run.py``'s (same prompts and
sampling settings), float32, ``--new-tokens`` (default 128) new tokens.

Run:  python bench/compile_time.py [--shapes smollm] [--cases greedy_b1 sample_b8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import _cases
import _peers
import jax
import numpy as np

import genjax

STAGES = ("trace", "lower", "compile", "first", "total")


def _seconds(start: float) -> float:
    return time.perf_counter() - start


def measure(model, params, ids: np.ndarray, config, steady_runs: int = 2) -> dict[str, float]:
    """One cold compile of generate on ``ids`` with ``config``, split into stages (seconds)."""
    jax.clear_caches()
    key = jax.random.key(0) if config.do_sample else None
    jitted = jax.jit(
        lambda params, ids, key: genjax.generate(model, params, ids, config, key=key).sequences
    )
    start = time.perf_counter()
    traced = jitted.trace(params, ids, key)
    times = {"trace": _seconds(start)}
    start = time.perf_counter()
    lowered = traced.lower()
    times["lower"] = _seconds(start)
    start = time.perf_counter()
    compiled = lowered.compile()
    times["compile"] = _seconds(start)
    runs = []
    for _ in range(1 + steady_runs):
        start = time.perf_counter()
        jax.block_until_ready(compiled(params, ids, key))
        runs.append(_seconds(start))
    times["first"] = runs[0] - statistics.median(runs[1:])
    times["total"] = sum(times[stage] for stage in STAGES[:-1])
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", choices=sorted(_cases.SHAPES), default=["smollm"])
    parser.add_argument(
        "--cases", nargs="+", choices=list(_cases.CASES), default=["greedy_b1", "greedy_b8"]
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=128)
    args = parser.parse_args()
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; seconds, median (min-max) of")
    print(f"{args.repeats} cold compiles; {args.new_tokens} new tokens unless the case says")
    print(f"{'shape':>8} {'case':>10} " + " ".join(f"{stage:>17}" for stage in STAGES))
    for name in args.shapes:
        shape = _cases.SHAPES[name]
        with tempfile.TemporaryDirectory(prefix=f"genjax-compile-{name}-") as folder:
            _cases.write_checkpoint(shape, shape.layers, folder)
            model, params = genjax.models.from_pretrained(folder)
        for case in _cases.select_cases(args.cases, quick=False):
            config = _peers.genjax_config(genjax, case.sampling(), case.tokens(args.new_tokens))
            ids = _cases.prompt_ids(case, shape.config["vocab_size"]).astype(np.int32)
            samples = [measure(model, params, ids, config) for _ in range(args.repeats)]
            cells = []
            for stage in STAGES:
                values = [sample[stage] for sample in samples]
                cells.append(
                    f"{statistics.median(values):5.2f} ({min(values):.2f}-{max(values):.2f})"
                )
            print(
                f"{name:>8} {case.name:>10} " + " ".join(f"{cell:>17}" for cell in cells),
                flush=True,
            )


if __name__ == "__main__":
    main()
