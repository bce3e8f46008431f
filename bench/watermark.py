"""What green-list watermarking costs per decoding step: genjax's in-loop processor (torch's CPU
``randperm`` reproduced in JAX) against transformers' ``WatermarkLogitsProcessor`` on the same
scores and tokens, and what a precomputed table of green lists would hold instead.

Run from the repository root (transformers and torch for the peer column)::

    python bench/watermark.py [--vocab 32000 128256] [--batch 1 8] [--repeats 5]

Prints one line per (scheme, vocabulary, batch): genjax's jitted processor call (compile
excluded) and transformers' call, in milliseconds, and their ratio; then, per vocabulary, the
size of a ``bool[V, V]`` green-list table (lefthash only) as bits.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from genjax.processors import LogitsContext, watermark


def _call(processor, scores, context):
    return processor(scores, context)


process = jax.jit(_call)


def _time(fn, repeats: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e3


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, nargs="+", default=[32000, 128256])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    try:
        import torch
        from transformers.generation.logits_process import WatermarkLogitsProcessor
    except ImportError:
        torch = None
    rng = np.random.default_rng(0)
    print(f"backend {jax.default_backend()}; ms per processor call (one decoding step)")
    for scheme in ("lefthash", "selfhash"):
        for vocab in args.vocab:
            for batch in args.batch:
                ids = rng.integers(0, vocab, size=(batch, 16))
                scores = rng.normal(size=(batch, vocab)).astype(np.float32)
                context = LogitsContext.for_prompt(jnp.asarray(ids, jnp.int32))
                proc = watermark(2.0, seeding_scheme=scheme, context_width=2)
                s = jnp.asarray(scores)
                run = lambda proc=proc, s=s, context=context: process(proc, s, context)  # noqa: E731
                ours = _time(lambda run=run: run().block_until_ready(), args.repeats)
                line = f"{scheme:9s} V={vocab:<7d} B={batch:<3d} genjax {ours:9.2f}"
                if torch is not None:
                    peer = WatermarkLogitsProcessor(vocab, "cpu", seeding_scheme=scheme,
                                                    context_width=2)  # fmt: skip
                    t_ids, t_scores = torch.as_tensor(ids), torch.as_tensor(scores)
                    theirs = _time(lambda: peer(t_ids, t_scores), args.repeats)  # noqa: B023
                    line += f"  transformers {theirs:9.2f}  ratio {theirs / ours:6.2f}x"
                print(line, flush=True)
    for vocab in args.vocab:
        print(
            f"bool[V, V] lefthash table for V={vocab}: {vocab * vocab / 8 / 2**20:.0f} MiB as bits"
        )


if __name__ == "__main__":
    main()
