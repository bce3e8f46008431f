"""Cost of choosing the next token: greedy against sampling with the usual warpers.

Times, per decoding step on float32 logits [batch, vocab] (default 8 x 50257, GPT-2's vocabulary),
each jitted separately and called on the same logits:

* ``greedy``: ``argmax``, what greedy decoding does;
* ``sample``: the processor chain ``processors.from_config`` builds for ``temperature``,
  ``top_k`` and ``top_p`` (one shared ``lax.top_k`` of 256, see
  ``genjax/processors/warpers.py``), then ``jax.random.categorical``;
* ``warpers``: that processor chain alone, then ``argmax`` (the warpers' own cost);
* ``full sort``: the same warpers written with a full sort of the vocabulary per step (what a
  straightforward port does), then ``argmax``, for comparison;
* ``lm_head``: the [batch, 768] x [768, vocab] matmul that produces such logits in GPT-2 small,
  for scale;
* ``transformers``: transformers' ``TemperatureLogitsWarper``, ``TopKLogitsWarper`` and
  ``TopPLogitsWarper`` then ``torch.multinomial`` (PyTorch, same logits; when installed).

Logits are ``scale * N(0, 1)``; ``--top-k 0`` times top-p alone, whose nucleus may then exceed the
256-score prefix (``--scale`` sets how flat the distribution is), so the fallback full sort runs.

Run:  python bench/processors.py [--batch 8] [--vocab 50257] [--top-k 50] [--top-p 0.9]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from genjax import GenerationConfig, processors


def _time(fn, *args, repeats: int) -> float:
    """Median seconds per call of a jitted ``fn`` (compiled first)."""
    jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(repeats):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) / repeats)
    return statistics.median(samples)


def _full_sort_warpers(temperature: float, k: int, p: float):
    """temperature, top-k and top-p with a full descending sort per warper (the naive port)."""

    def warp(scores):
        scores = scores / temperature
        if k > 0:
            kth = -jnp.sort(-scores, axis=-1)[:, k - 1 : k]
            scores = jnp.where(scores < kth, -jnp.inf, scores)
        ascending = jnp.sort(scores, axis=-1)
        cumulative = jnp.cumsum(jax.nn.softmax(ascending, axis=-1), axis=-1)
        first_kept = jnp.sum(cumulative <= 1 - p, axis=-1, keepdims=True)
        threshold = jnp.take_along_axis(ascending, first_kept, axis=-1)
        return jnp.where(scores < threshold, -jnp.inf, scores)

    return warp


def _time_transformers(logits: np.ndarray, args, repeats: int) -> float | None:
    try:
        import torch
        from transformers.generation import logits_process as hf
    except ImportError:
        return None
    warpers = [hf.TemperatureLogitsWarper(args.temperature)]
    if args.top_k:
        warpers.append(hf.TopKLogitsWarper(args.top_k))
    warpers.append(hf.TopPLogitsWarper(args.top_p))
    scores = torch.from_numpy(logits)
    ids = torch.zeros((logits.shape[0], 1), dtype=torch.long)

    def step():
        out = scores
        for warper in warpers:
            out = warper(ids, out)
        return torch.multinomial(out.softmax(-1), 1)

    with torch.inference_mode():
        step()
        samples = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(repeats):
                step()
            samples.append((time.perf_counter() - start) / repeats)
    return statistics.median(samples)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--top-k", type=int, default=50)
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--scale", type=float, default=3.0, help="logits = scale * N(0, 1)")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args(argv)

    rng = np.random.default_rng(0)
    logits = (rng.normal(size=(args.batch, args.vocab)) * args.scale).astype(np.float32)
    x = jnp.asarray(logits)
    key = jax.random.key(0)
    config = GenerationConfig(
        do_sample=True, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p
    ).with_defaults()
    warp = processors.from_config(config, eos_token_ids=None)
    naive = _full_sort_warpers(args.temperature, args.top_k, args.top_p)
    hidden = jnp.asarray(rng.normal(size=(args.batch, 768)).astype(np.float32))
    lm_head = jnp.asarray(rng.normal(size=(768, args.vocab)).astype(np.float32))

    timings = {
        "greedy": _time(jax.jit(lambda s: jnp.argmax(s, -1)), x, repeats=args.repeats),
        "sample": _time(
            jax.jit(lambda s, k: jax.random.categorical(k, warp(s, None), axis=-1)),
            x,
            key,
            repeats=args.repeats,
        ),
        "warpers": _time(jax.jit(lambda s: jnp.argmax(warp(s, None), -1)), x, repeats=args.repeats),
        "full sort": _time(
            jax.jit(lambda s: jnp.argmax(naive(s), -1)), x, repeats=max(2, args.repeats // 10)
        ),
        "lm_head": _time(jax.jit(jnp.dot), hidden, lm_head, repeats=args.repeats),
    }
    hf = _time_transformers(logits, args, args.repeats)
    if hf is not None:
        timings["transformers"] = hf

    kept = np.isfinite(np.asarray(jax.jit(lambda s: warp(s, None))(x))).sum(-1)
    print(
        f"device={jax.devices()[0].platform} batch={args.batch} vocab={args.vocab} "
        f"temperature={args.temperature} top_k={args.top_k} top_p={args.top_p} "
        f"scale={args.scale}; tokens kept per row: {kept.min()}..{kept.max()}"
    )
    greedy = timings["greedy"]
    for name, seconds in timings.items():
        print(f"  {name:13s} {seconds * 1e3:8.3f} ms/step   {seconds / greedy:6.1f} x greedy")
    print(
        f"  sampling overhead over greedy: {(timings['sample'] - greedy) * 1e3:.3f} ms/step "
        f"(warpers alone {(timings['warpers'] - greedy) * 1e3:.3f} ms; lm_head matmul "
        f"{timings['lm_head'] * 1e3:.3f} ms)"
    )


if __name__ == "__main__":
    main()
