"""The serving engine with and without shorter prompt-chunk lengths, alternating in one process.

``ContinuousBatchingConfig.prefill_chunk_sizes`` lets a step run its prompt chunks in lanes
shorter than ``prefill_chunk_size`` when every chunk of the step fits (a prompt's last chunk is
usually much shorter). This serves ``bench/serving.py``'s offline workload (seeded prompt
lengths log-uniform in 8..512, outputs 16..256, all arriving at once) with two managers of the
same model, chunks of 64 and 8 slots: one with the default lengths (64, 32, 16), one with 64
alone; both warm up first, then serve the workload in turn ``--rounds`` times (the first round
of each is reported apart), without the prefix cache, so every round prefills every prompt.
Random SmolLM-135M-shape weights, float32. Prints output tokens/s per round and the ratio of the
medians of the later rounds, and the prompt rows each computed (real tokens against the rows
the chunks ran).

Run:  python bench/engine_chunk_lengths.py [--requests 32] [--rounds 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _cases  # noqa: E402
import _machine  # noqa: E402
import serving  # noqa: E402

VARIANTS = {"lengths 64/32/16": None, "64 alone": ()}


def _managers(model, params, longest: int) -> dict:
    import genjax
    from genjax.serving import ContinuousBatchingConfig, init_continuous_batching

    config = genjax.GenerationConfig(pad_token_id=serving.PAD_TOKEN_ID, eos_token_id=None)
    managers = {}
    for name, sizes in VARIANTS.items():
        sizes = ContinuousBatchingConfig(
            max_batch_size=serving.BATCH,
            block_size=16,
            max_length=longest,
            prefill_chunk_size=64,
            prefill_chunk_sizes=sizes,
            prefix_caching=False,  # every round prefills its prompts again
        )
        manager = init_continuous_batching(model, params, config, sizes)
        manager.start()
        managers[name] = manager
    return managers


def _serve(manager, prompts, outputs) -> tuple[float, int]:
    """Output tokens/s of one run of the workload, and the prompt rows its chunks computed."""
    rows = []
    step = manager._step

    def counted(work):
        lanes = work.prefill_slot >= 0
        if lanes.any():
            rows.append(int(lanes.sum()) * work.prefill_tokens.shape[1])
        return step(work)

    manager._step = counted
    try:
        start = time.perf_counter()
        with manager.pause():  # all arrive at once
            ids = [
                manager.add_request(p, max_new_tokens=n)
                for p, n in zip(prompts, outputs, strict=True)
            ]
        made = sum(len(manager.get_result(i, timeout=3600).generated_tokens) for i in ids)
        return made / (time.perf_counter() - start), sum(rows)
    finally:
        del manager._step


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args(argv)
    import genjax

    shape = serving.SHAPES["smollm"]
    with tempfile.TemporaryDirectory(prefix="genjax-bench-chunks-") as folder:
        checkpoint = _cases.write_checkpoint(shape, shape.layers, folder)
        prompts, outputs = serving.workload(args.requests, checkpoint["vocab_size"])
        model, params = genjax.models.from_pretrained(folder)
        longest = max(len(p) + n for p, n in zip(prompts, outputs, strict=True))
        managers = _managers(model, params, longest)
        speeds = {name: [] for name in managers}
        computed = {}
        try:
            for manager in managers.values():  # warm-up: compiles, then one short request
                manager.get_result(manager.add_request(prompts[0], max_new_tokens=4), 3600)
            for round_ in range(args.rounds):
                for name, manager in managers.items():
                    speed, computed[name] = _serve(manager, prompts, outputs)
                    speeds[name].append(speed)
                    print(f"round {round_ + 1} {name}: {speed:.1f} tok/s", file=sys.stderr)
        finally:
            for manager in managers.values():
                manager.stop(block=True, timeout=60)
    print(
        f"engine, {args.requests} requests of bench/serving.py's workload, SmolLM-135M shape, "
        f"float32, 8 slots, chunks of 64; CPU: {_machine.cpu_model()}"
    )
    print(f"prompt tokens {sum(map(len, prompts))}")
    for name, values in speeds.items():
        later = [f"{v:.1f}" for v in values[1:]]
        print(
            f"{name:18s} first round {values[0]:6.1f} tok/s, later rounds {' '.join(later)}; "
            f"prompt rows computed {computed[name]}"
        )
    first, second = (statistics.median(v[1:] or v) for v in speeds.values())
    print(f"median of the later rounds: {first / second:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
