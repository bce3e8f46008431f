"""Online serving: how much a long prompt arriving slows the requests already decoding.

Eight requests (32-token prompts) decode in the continuous-batching engine; once the first has
made ``--arrive-after`` tokens, a ``--long``-token prompt arrives. The engine prefills it in
chunks of ``prefill_chunk_size`` tokens, one chunk per step beside the decoding rows, so they
keep moving while it prefills (the issue's target: their inter-token p99 at most 2x).

The same eight requests also run without the long prompt. Compared, for the tokens the eight
make while the long prompt prefills (from its arrival to its first token), against their tokens
of the same indices in the run without it:

* the gaps between consecutive tokens of a request, p50 / p99 / mean. The engine returns up to
  ``max_decode_steps`` tokens per step, so most gaps of the steady run are 0 and its p99 is one
  step of ``K`` decode iterations; while a prompt prefills (or requests wait) the scheduler runs
  one decode iteration per step, so every gap is one chunk plus one iteration;
* hence also the mean gap, the decode rate each request sees (seconds per token).

Each pass runs twice (the first compiles the programs it needs); the second is reported, with
the programs it compiled (0 expected). Random SmolLM-135M-shape weights (float32), the engine's
default settings unless given. Prints the CPU model.

Run:  python bench/serving_long_prompt.py [--long 2048] [--chunk 32]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _cases  # noqa: E402
import _machine  # noqa: E402
import numpy as np  # noqa: E402

ROWS = 8
PROMPT = 32


def _gaps(results, first: int, last: int) -> list[float]:
    """The gaps before tokens ``first .. last - 1`` of every result (seconds)."""
    return [
        float(t[i] - t[i - 1]) for t in (r.timestamps for r in results) for i in range(first, last)
    ]


def _serve(manager, prompts, new_tokens: int, long_prompt, arrive_after: int):
    """Runs the eight requests, the long one arriving after ``arrive_after`` tokens of the
    first; returns their results and the long request's (None without one)."""
    with manager.pause():
        ids = [
            manager.add_request(p, max_new_tokens=new_tokens, streaming=(i == 0))
            for i, p in enumerate(prompts)
        ]
    long_id = None
    if long_prompt is not None:
        for partial in manager.request_id_iter(ids[0]):
            if len(partial.generated_tokens) >= arrive_after:
                long_id = manager.add_request(long_prompt, max_new_tokens=4)
                break
    results = [manager.get_result(i, timeout=3600) for i in ids]
    long = None if long_id is None else manager.get_result(long_id, timeout=3600)
    return results, long


def _summary(gaps: list[float]) -> dict:
    return dict(
        p50=float(np.percentile(gaps, 50)),
        p99=float(np.percentile(gaps, 99)),
        mean=float(np.mean(gaps)),
        count=len(gaps),
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--long", type=int, default=2048, help="the long prompt's tokens")
    parser.add_argument("--chunk", type=int, default=None, help="prefill_chunk_size")
    parser.add_argument("--arrive-after", type=int, default=16, help="tokens of the first")
    parser.add_argument("--layers", type=int, default=None, help="default: the shape's depth")
    args = parser.parse_args(argv)

    import genjax
    from genjax.serving import ContinuousBatchingConfig, init_continuous_batching
    from genjax.testing import count_compiles

    shape = _cases.SHAPES["smollm"]
    folder = tempfile.mkdtemp(prefix="genjax-long-prompt-")
    checkpoint = _cases.write_checkpoint(shape, args.layers or shape.layers, folder)
    model, params = genjax.models.from_pretrained(folder)
    defaults = ContinuousBatchingConfig()
    chunk = args.chunk or defaults.prefill_chunk_size
    # Tokens the eight make while the prompt prefills: one per chunk, and margin after it.
    steps = -(-args.long // chunk)
    new_tokens = args.arrive_after + steps + 2 * defaults.max_decode_steps
    cb = ContinuousBatchingConfig(
        max_batch_size=ROWS + 1,
        max_length=args.long + 64,
        prefill_chunk_size=chunk,
        prefix_caching=False,  # each pass prefills the same prompts again in full
    )
    config = genjax.GenerationConfig(eos_token_id=None, pad_token_id=0)
    manager = init_continuous_batching(model, params, config, cb)
    rng = np.random.default_rng(0)
    vocab = checkpoint["vocab_size"]
    prompts = [rng.integers(3, vocab, PROMPT).tolist() for _ in range(ROWS)]
    long_prompt = rng.integers(3, vocab, args.long).tolist()
    manager.start()
    try:
        measured = {}
        for name, extra in (("steady", None), ("long prompt", long_prompt)):
            for _ in range(2):  # the first compiles
                with count_compiles() as compiled:
                    started = time.perf_counter()
                    results, long = _serve(manager, prompts, new_tokens, extra, args.arrive_after)
                    wall = time.perf_counter() - started
                measured[name] = (results, long, len(compiled), wall)
    finally:
        manager.stop(block=True, timeout=60)

    during, long, _, _ = measured["long prompt"]
    # The token indices the eight made from the long prompt's arrival to its first token.
    window = (long.created_time, long.timestamps[0])
    first = max(
        1, min(next(i for i, t in enumerate(r.timestamps) if t > window[0]) for r in during)
    )
    last = max(
        next((i for i, t in enumerate(r.timestamps) if t >= window[1]), len(r.timestamps))
        for r in during
    )
    with_long = _summary(_gaps(during, first, last))
    steady = _summary(_gaps(measured["steady"][0], first, last))
    env = _machine.environment()
    print(
        f"online: {ROWS} requests decoding ({PROMPT}-token prompts), a {args.long}-token prompt "
        f"arriving after {args.arrive_after} tokens; SmolLM-135M shape, "
        f"{args.layers or shape.layers} layers, float32"
    )
    print(
        f"engine: prefill_chunk_size {chunk}, max_decode_steps {defaults.max_decode_steps}, "
        f"{ROWS + 1} slots; CPU: {_machine.cpu_model()} ({env['usable_cpus']} usable)"
    )
    print(
        f"the long prompt's first token came {window[1] - window[0]:.2f} s after it arrived; "
        f"tokens {first}..{last - 1} of the eight compared"
    )
    print(f"{'':14s}{'gap p50':>10s}{'gap p99':>10s}{'gap mean':>10s}{'gaps':>7s}{'compiles':>10s}")
    for name, figures in (("steady", steady), ("long prompt", with_long)):
        compiles = measured[name][2]
        print(
            f"{name:14s}{figures['p50'] * 1e3:8.1f}ms{figures['p99'] * 1e3:8.1f}ms"
            f"{figures['mean'] * 1e3:8.1f}ms{figures['count']:7d}{compiles:10d}"
        )
    print(
        f"long prompt / steady: gap p99 x{with_long['p99'] / steady['p99']:.2f}, "
        f"gap mean x{with_long['mean'] / steady['mean']:.2f} (lower is better; target p99 <= 2)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
