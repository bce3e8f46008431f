"""What ``max_time`` costs: decode speed with and without the clock read inside the loop.

``max_time`` makes the compiled loop read the host clock through a callback after every ``k``-th
token (``genjax.stopping.MAX_TIME_CHECK_EVERY``). This script builds a small random Llama
(width 256) with ``genjax.testing.write_random_checkpoint``, then times greedy generation of
``--new-tokens`` tokens at each batch size without ``max_time`` and with a ``max_time`` too
large to stop anything, for each ``k`` in ``--every``: median and best of ``--runs`` runs, the
variants interleaved. It then sets a budget of about a quarter of the run and reports how far
past it the call ran, in steps.

Run:  python bench/max_time.py [--batch 1 8] [--runs 5] [--new-tokens 256] [--every 1 4 16]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import jax
import numpy as np

import genjax
import genjax.stopping
import genjax.testing


def _compile(model, params, ids, config, every: int | None):
    """An ahead-of-time compiled ``generate`` returning the sequences. ``every`` sets k, which is
    static but not in the jit cache key, so the caches are cleared first; the compiled program
    keeps its own k afterwards."""
    if every is not None:
        genjax.stopping.MAX_TIME_CHECK_EVERY = every
    jax.clear_caches()
    run = jax.jit(lambda p, i: genjax.generate(model, p, i, config).sequences)
    return run.lower(params, ids).compile()


def _seconds(compiled, params, ids) -> float:
    start = time.perf_counter()
    compiled(params, ids).block_until_ready()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--every", type=int, nargs="+", default=[1, 4, 16])
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as folder:
        genjax.testing.write_random_checkpoint(
            folder,
            "llama",
            hidden_size=256,
            intermediate_size=688,
            num_hidden_layers=args.layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=1024,
            max_position_embeddings=1024,
            eos_token_id=None,
        )
        model, params = genjax.models.from_pretrained(folder)
    # No EOS, so only max_time can end a call early.
    plain = genjax.GenerationConfig(max_new_tokens=args.new_tokens, pad_token_id=0)
    timed = plain.replace(max_time=1e6)
    print(f"jax {jax.__version__} on {jax.devices()[0].platform} ({jax.devices()[0].device_kind})")
    print(
        f"model: random Llama, {args.layers} layers, width 256, vocab 1024; prompt "
        f"{args.prompt}, {args.new_tokens} new tokens, greedy; median of {args.runs} runs"
    )
    header = f"{'batch':>5} | {'variant':>22} | {'tokens/s (best)':>19} | {'vs none (best)':>16}"
    print(header)
    print("-" * len(header))
    rng = np.random.default_rng(0)
    default_every = genjax.stopping.MAX_TIME_CHECK_EVERY
    for batch in args.batch:
        ids = jax.numpy.asarray(rng.integers(3, 1024, size=(batch, args.prompt)), "int32")
        variants = {"no max_time": _compile(model, params, ids, plain, None)}
        for k in args.every:
            variants[f"max_time, every {k}"] = _compile(model, params, ids, timed, k)
        genjax.stopping.MAX_TIME_CHECK_EVERY = default_every
        speeds: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(args.runs):  # interleaved, so the drift of a shared machine cancels
            for name, compiled in variants.items():
                _seconds(compiled, params, ids)  # warm
                seconds = _seconds(compiled, params, ids)
                speeds[name].append(batch * args.new_tokens / seconds)
        base, base_best = statistics.median(speeds["no max_time"]), max(speeds["no max_time"])
        for name, values in speeds.items():
            speed, best = statistics.median(values), max(values)
            print(
                f"{batch:>5} | {name:>22} | {speed:8.1f} ({best:8.1f}) | "
                f"{speed / base:6.3f}x ({best / base_best:5.3f}x)"
            )

        step = batch / base
        budget = step * args.new_tokens / 4
        config = plain.replace(max_time=budget, output_scores=True)
        jax.clear_caches()
        out = genjax.generate(model, params, ids, config)  # compiles
        start = time.perf_counter()
        out = genjax.generate(model, params, ids, config)
        out.sequences.block_until_ready()
        seconds = time.perf_counter() - start
        produced = int(np.any(np.asarray(out.scores[0]) != 0, axis=-1).sum())
        print(
            f"{batch:>5} | budget {budget * 1e3:.1f} ms (~{args.new_tokens // 4} steps of "
            f"{step * 1e3:.2f} ms): stopped after {produced} tokens, call took "
            f"{seconds * 1e3:.1f} ms ({(seconds - budget) / step:+.1f} steps; includes dispatch)"
        )


if __name__ == "__main__":
    main()
