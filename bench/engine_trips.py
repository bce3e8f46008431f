"""Where the serving engine's time goes on ``bench/serving.py``'s offline workload: each host
round trip's work and time.

The engine (``genjax.serving``, sized as ``bench/serving.py`` sizes it: 8 slots, prompt chunks
of 64, no prefix cache) serves the seeded workload once to warm up and once measured. In the
measured pass every round trip (the manager's ``_step``: a prefill program then a decode
program) is timed to the end of its device work, and its input read: the prompt tokens it
prefilled and the rows its chunks computed (lanes x chunk length, the padding included), and
the decode iterations it ran with the requests they decoded. The report splits the wall time
into trips with a prompt chunk (a chunk and one decode iteration), decode-only trips (up to
``max_decode_steps`` iterations) and the host's time between trips; gives the decode rows'
occupancy (requests decoding per iteration, of the 8 slots) and the prompt chunks' share of
real tokens; and sets the matrix products' arithmetic (2 x parameters multiplied per token:
every prompt token through the layers, every new token through the layers and the head) against
the wall time, as GFLOP/s.

Run:  python bench/engine_trips.py [--requests 64] [--layers 30] [--dtype float32]
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
import serving  # noqa: E402
from _peers import PAD_TOKEN_ID  # noqa: E402


class TripLog:
    """Wraps a manager's ``_step``: per round trip, its input's sizes and its device time."""

    def __init__(self, manager, jax):
        self.jax, self.step, self.trips, self.active = jax, manager._step, [], False
        manager._step = self

    def __call__(self, work):
        begin = time.perf_counter()
        state, out = self.step(work)
        self.jax.block_until_ready(out)
        if self.active:
            counts = np.asarray(work.prefill_count)
            real = np.asarray(work.prefill_slot) >= 0
            decoding = np.asarray(out.tokens)[: int(out.steps)] >= 0  # [steps, R]
            self.trips.append(
                dict(
                    seconds=time.perf_counter() - begin,
                    prompt_tokens=int(counts[real].sum()),
                    prompt_rows=int(np.asarray(work.prefill_tokens).size) if real.any() else 0,
                    bucket=int(np.asarray(work.decode_rows).size),
                    steps=int(out.steps),
                    decoded=int(decoding.sum()),
                )
            )
        return state, out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--layers", type=int, default=None, help="default: SmolLM's 30")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = parser.parse_args(argv)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax

    import genjax
    from genjax.serving import ContinuousBatchingConfig, init_continuous_batching

    shape = _cases.SHAPES["smollm"]
    layers = args.layers or shape.layers
    prompts, outputs = serving.workload(args.requests, shape.config["vocab_size"])
    with tempfile.TemporaryDirectory() as tmp:
        _cases.write_checkpoint(shape, layers, tmp)
        model, params = genjax.models.from_pretrained(tmp, dtype=args.dtype)
    cb = ContinuousBatchingConfig(
        max_batch_size=serving.BATCH,
        block_size=16,
        max_length=max(len(p) + n for p, n in zip(prompts, outputs, strict=True)),
        prefill_chunk_size=64,
        prefix_caching=False,
    )
    config = genjax.GenerationConfig(pad_token_id=PAD_TOKEN_ID, eos_token_id=None)
    manager = init_continuous_batching(model, params, config, cb)
    log = TripLog(manager, jax)
    manager.start()

    def serve() -> float:
        start = time.perf_counter()
        with manager.pause():
            ids = [
                manager.add_request(p, max_new_tokens=n)
                for p, n in zip(prompts, outputs, strict=True)
            ]
        for i in ids:
            manager.get_result(i, timeout=3600)
        return time.perf_counter() - start

    try:
        serve()
        log.active = True
        wall = serve()
    finally:
        manager.stop(block=True, timeout=60)

    trips = log.trips
    chunked = [t for t in trips if t["prompt_rows"]]
    decode_only = [t for t in trips if not t["prompt_rows"]]
    iterations = sum(t["steps"] for t in trips)
    decoded = sum(t["decoded"] for t in trips)
    prompt_tokens = sum(t["prompt_tokens"] for t in trips)
    prompt_rows = sum(t["prompt_rows"] for t in trips)
    made = sum(outputs)
    n_layer = layers * sum(o * i * n for o, i, n in _MATRICES)
    head = shape.config["vocab_size"] * shape.config["hidden_size"]
    flops = 2 * (prompt_tokens * n_layer + made * (n_layer + head))
    device = sum(t["seconds"] for t in trips)
    chunked_s = sum(t["seconds"] for t in chunked)
    decode_s = sum(t["seconds"] for t in decode_only)
    decode_iterations = sum(t["steps"] for t in decode_only)
    iteration_s = decode_s / max(decode_iterations, 1)
    # a chunked trip also runs one decode iteration: counted at the decode-only trips' rate
    prompt_s = chunked_s - sum(t["steps"] for t in chunked) * iteration_s
    decode_rate = 2 * serving.BATCH * (n_layer + head) / iteration_s
    prompt_rate = 2 * n_layer * prompt_tokens / max(prompt_s, 1e-9)
    lines = [
        f"engine trips: {args.requests} requests of bench/serving.py's workload, SmolLM-135M "
        f"shape, {layers} layers, {args.dtype}; 8 slots, chunks of 64, no prefix cache",
        f"CPU: {_machine.cpu_model()} ({_machine.cpu_count()} usable); jax {jax.__version__}",
        f"wall {wall:.1f} s, {made / wall:.1f} output tokens/s: {len(trips)} round trips, "
        f"device {device:.1f} s ({device / wall:.0%}), host between trips {wall - device:.1f} s",
        f"  trips with a prompt chunk: {len(chunked)}, {chunked_s:.1f} s; their prompt work "
        f"about {prompt_s:.1f} s ({prompt_s / wall:.0%} of the wall), "
        f"{prompt_s / max(prompt_tokens, 1) * 1e3:.2f} ms per prompt token; {prompt_tokens} "
        f"prompt tokens in {prompt_rows} chunk rows ({prompt_tokens / max(prompt_rows, 1):.0%} "
        "real)",
        f"  decode-only trips: {len(decode_only)}, {decode_s:.1f} s ({decode_s / wall:.0%}), "
        f"{decode_iterations} iterations, {iteration_s * 1e3:.1f} ms each",
        f"  decode iterations in all: {iterations}, {decoded} tokens: {decoded / iterations:.2f} "
        f"of {serving.BATCH} slots decoding per iteration "
        f"({decoded / iterations / serving.BATCH:.0%})",
        f"matrix products: {flops / 1e12:.2f} TFLOP, {flops / wall / 1e9:.1f} GFLOP/s over the "
        f"wall; a decode iteration {decode_rate / 1e9:.1f} GFLOP/s if all 8 rows decode; "
        f"prompt chunks {prompt_rate / 1e9:.1f} GFLOP/s",
    ]
    print("\n".join(lines))
    return 0


# SmolLM-135M's matrices per layer: (out, in, count)
_MATRICES = [(576, 576, 2), (192, 576, 2), (1536, 576, 3)]

if __name__ == "__main__":
    sys.exit(main())
