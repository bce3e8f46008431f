"""Serving an offline workload: genjax's continuous-batching engine against static batching and
transformers' continuous batching, on the same random weights.

The workload (seeded): ``--requests`` requests (default 64; ``--quick`` 16), prompt lengths
log-uniform in 8..512, output lengths uniform in 16..256 (EOS disabled, so each request makes
exactly its length), all arriving at once. Four ways to serve it, each in a process of its own:

* ``engine``: ``genjax.serving`` (8 requests at once unless ``--slots`` says otherwise, paged
  cache, chunked prefill, no prefix cache: the passes repeat the same prompts), one request
  each;
* ``generate``: ``genjax.generate`` on static batches of 8 in arrival order, each batch running
  to its longest request (the tokens past a request's own length are wasted, not counted);
* ``hf_cb``: transformers' continuous batching (``model.init_continuous_batching``, the manager
  behind ``generate_batch``, which gives each request its own ``max_new_tokens``), sized as the
  engine: ``--slots`` requests at once, 64 prompt tokens plus the decoding rows per step, room
  for every request at its longest;
* ``hf_generate``: transformers ``generate`` on the same static batches of 8.

Each warms up on a small part (the first request alone; for the static ways, the first batch);
the genjax ways then run the whole workload once to count the compilations new shapes cause (no
torch way compiles), and a last run gives the figures: output tokens/s (requested tokens only /
wall time from arrival to the last result), time to first token and inter-token latency, p50
and p99 over requests and token gaps. Continuous batching records a timestamp per token; static
batching has none inside a call, so a request's first token is taken at its batch's start plus
the batch's prefill time (a one-token call, timed once) and its gaps as the batch's decode time
spread evenly.

Run:  python bench/serving.py [--quick] [--dtype bfloat16] [--json out.json] [--libs engine ...]
Needs the ``parity`` extra (torch, transformers). Prints ratios of genjax's engine against each
peer measured in the same run, and the CPU model.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _cases  # noqa: E402
import _machine  # noqa: E402
import numpy as np  # noqa: E402
from _peers import PAD_TOKEN_ID  # noqa: E402

LIBS = ("engine", "generate", "hf_cb", "hf_generate")
BATCH = 8  # static batches, and both continuous batchers' slots unless --slots says otherwise
SMALL_LLAMA = _cases.Shape(
    name="llama-small",
    title="small Llama (4 layers, 256 wide, vocab 8192)",
    arch="llama",
    layers=4,
    config=dict(
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=688,
        vocab_size=8192,
        tie_word_embeddings=False,
        rope_theta=10000.0,
        max_position_embeddings=1024,
    ),
)
SHAPES = {"smollm": _cases.SHAPES["smollm"], "llama-small": SMALL_LLAMA}
PROMPT_RANGE = (8, 512)
OUTPUT_RANGE = (16, 256)


def workload(count: int, vocab_size: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """Seeded prompts (log-uniform lengths) and output lengths (uniform), in arrival order."""
    rng = np.random.default_rng(seed)
    low, high = PROMPT_RANGE
    lengths = np.exp(rng.uniform(math.log(low), math.log(high), count)).round().astype(int)
    outputs = rng.integers(OUTPUT_RANGE[0], OUTPUT_RANGE[1] + 1, count)
    prompts = [rng.integers(1, vocab_size, n).tolist() for n in lengths]
    return prompts, [int(n) for n in outputs]


# ---- the workers (one process per way of serving) ------------------------------------------
class _Compiles:
    """Counts XLA compilations (jax's backend-compile events) while ``active``."""

    def __init__(self, jax):
        self.active, self.count = False, 0
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event, duration, **kwargs):
        if self.active and event == "/jax/core/compile/backend_compile_duration":
            self.count += 1


def _engine(folder, prompts, outputs, slots=None, dtype="float32"):
    import jax

    import genjax
    from genjax.serving import ContinuousBatchingConfig, init_continuous_batching

    model, params = genjax.models.from_pretrained(folder, dtype=dtype)
    config = genjax.GenerationConfig(pad_token_id=PAD_TOKEN_ID, eos_token_id=None)
    longest = max(len(p) + n for p, n in zip(prompts, outputs, strict=True))
    # No prefix cache: the measured pass serves the prompts the first pass served, and with 32
    # requests 94% of their tokens were still cached from it (none with 64: the pool had
    # recycled them); the workload's random prompts share nothing within one pass.
    cb = ContinuousBatchingConfig(
        max_batch_size=slots or BATCH,
        block_size=16,
        max_length=longest,
        prefill_chunk_size=64,
        prefix_caching=False,
    )
    manager = init_continuous_batching(model, params, config, cb)
    compiles = _Compiles(jax)
    manager.start()
    manager.get_result(manager.add_request(prompts[0], max_new_tokens=outputs[0]), timeout=3600)

    def serve():
        start = time.time()
        with manager.pause():  # all arrive at once
            ids = [
                manager.add_request(p, max_new_tokens=n)
                for p, n in zip(prompts, outputs, strict=True)
            ]
        results = [manager.get_result(i, timeout=3600) for i in ids]
        wall = time.time() - start
        ttft = [r.timestamps[0] - r.created_time for r in results]
        gaps = [float(g) for r in results for g in np.diff(r.timestamps)]
        return wall, [len(r.generated_tokens) for r in results], ttft, gaps

    try:
        return _two_passes(serve, compiles)
    finally:
        manager.stop(block=True, timeout=60)


def _hf_cb(folder, prompts, outputs, slots=None, dtype="float32"):
    model, transformers, _ = _torch_model(folder, dtype)
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    config = transformers.GenerationConfig(
        do_sample=False, eos_token_id=None, pad_token_id=PAD_TOKEN_ID, max_new_tokens=16
    )
    # The engine's sizes: `slots` requests, blocks of 16, room for all at their longest, 64
    # prompt tokens plus the decoding rows per step (the default sizes the cache from free memory).
    slots = slots or BATCH
    longest = max(len(p) + n for p, n in zip(prompts, outputs, strict=True))
    cb = ContinuousBatchingConfig(
        block_size=16,
        num_blocks=slots * -(-longest // 16) + 1,
        max_batch_tokens=64 + slots,
        max_requests_per_batch=slots,
    )
    manager = model.init_continuous_batching(
        generation_config=config, continuous_batching_config=cb
    )
    manager.start()

    def serve(items):
        start = time.perf_counter()
        ids = [manager.add_request(p, max_new_tokens=n, record_timestamps=True) for p, n in items]
        results, waiting = {}, set(ids)
        while waiting:  # results in finishing order (no per-id wait: robust in 5.x)
            out = manager.get_result(timeout=600)
            if out is None:
                raise RuntimeError(f"transformers returned no result for {sorted(waiting)}")
            if out.request_id in waiting:
                waiting.discard(out.request_id)
                results[out.request_id] = out
        wall = time.perf_counter() - start
        ordered = [results[i] for i in ids]
        ttft = [r.timestamps[0] - r.created_time for r in ordered]
        gaps = [float(g) for r in ordered for g in np.diff(r.timestamps)]
        return wall, [len(r.generated_tokens) for r in ordered], ttft, gaps

    items = list(zip(prompts, outputs, strict=True))
    try:
        serve(items[:1])
        return _summary(serve(items), None)
    finally:
        manager.stop(block=True, timeout=60)


def _static(call, prompts, outputs, compiles=None):
    """Serves the workload in static batches of ``BATCH`` with ``call(prompts, new_tokens)``."""
    batches = [
        (prompts[i : i + BATCH], outputs[i : i + BATCH]) for i in range(0, len(prompts), BATCH)
    ]
    call(batches[0][0], max(batches[0][1]))
    prefill = []
    first_pass = None
    if compiles is not None:  # the first pass: new shapes (counted)
        compiles.active = True
        for group, lengths in batches:
            call(group, max(lengths))
        first_pass, compiles.active = compiles.count, False
    for group, _ in batches:  # each batch's prefill: a one-token call
        call(group, 1)
        prefill.append(_timed(lambda g=group: call(g, 1)))

    start = time.perf_counter()
    ttft, gaps, made = [], [], []
    for (group, lengths), first in zip(batches, prefill, strict=True):
        began, longest = time.perf_counter() - start, max(lengths)
        took = _timed(lambda g=group, n=longest: call(g, n))
        step = (took - first) / max(1, longest - 1)
        ttft += [began + first] * len(group)
        gaps += [step for n in lengths for _ in range(n - 1)]
        made += lengths
    return _summary((time.perf_counter() - start, made, ttft, gaps), first_pass)


def _generate(folder, prompts, outputs, dtype="float32"):
    import jax

    import genjax

    model, params = genjax.models.from_pretrained(folder, dtype=dtype)
    compiles = _Compiles(jax)

    def call(group, new_tokens):
        width = max(len(p) for p in group)
        ids = np.full((len(group), width), PAD_TOKEN_ID, np.int32)
        mask = np.zeros_like(ids)
        for row, prompt in enumerate(group):  # left padding
            ids[row, width - len(prompt) :] = prompt
            mask[row, width - len(prompt) :] = 1
        config = genjax.GenerationConfig(
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            eos_token_id=None,
            pad_token_id=PAD_TOKEN_ID,
        )
        out = genjax.generate(model, params, ids, config, attention_mask=mask)
        out.sequences.block_until_ready()

    return _static(call, prompts, outputs, compiles)


def _hf_generate(folder, prompts, outputs, dtype="float32"):
    model, _, torch = _torch_model(folder, dtype)

    def call(group, new_tokens):
        width = max(len(p) for p in group)
        ids = torch.full((len(group), width), PAD_TOKEN_ID, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, prompt in enumerate(group):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        with torch.inference_mode():
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                eos_token_id=None,
                pad_token_id=PAD_TOKEN_ID,
                do_sample=False,
            )

    return _static(call, prompts, outputs)


def _torch_model(folder, dtype="float32"):
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(_machine.cpu_count())
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype))
    model.generation_config.eos_token_id = None
    return model.eval(), transformers, torch


def _timed(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def _two_passes(serve, compiles):
    """Runs ``serve`` twice: compilations counted in the first, the figures from the second."""
    if compiles is not None:
        compiles.active = True
    serve()
    first_pass = compiles.count if compiles is not None else None
    if compiles is not None:
        compiles.active = False
    return _summary(serve(), first_pass)


def _summary(measured, compiles) -> dict:
    wall, made, ttft, gaps = measured
    return dict(
        wall_s=wall,
        tokens=int(sum(made)),
        tokens_per_s=sum(made) / wall,
        ttft_p50_s=float(np.percentile(ttft, 50)),
        ttft_p99_s=float(np.percentile(ttft, 99)),
        itl_p50_s=float(np.percentile(gaps, 50)),
        itl_p99_s=float(np.percentile(gaps, 99)),
        itl_mean_s=float(np.mean(gaps)),
        compiles_after_warmup=compiles,
    )


_WORKERS = {"engine": _engine, "generate": _generate, "hf_cb": _hf_cb, "hf_generate": _hf_generate}


def _worker(conn, lib, folder, prompts, outputs, slots, dtype):
    if lib in ("engine", "generate"):
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    try:
        extra = dict(slots=slots) if lib in ("engine", "hf_cb") else {}
        conn.send(("ok", _WORKERS[lib](folder, prompts, outputs, dtype=dtype, **extra)))
    except Exception as error:  # reported, never a crash of the suite
        conn.send(("error", f"{type(error).__name__}: {error}"))


def run_lib(lib, folder, prompts, outputs, slots=BATCH, dtype="float32") -> dict:
    """Runs one way of serving in a fresh process (the continuous batchers with ``slots``
    requests at once), the weights in ``dtype`` (both libraries load the same float32
    checkpoint and cast it); ``{"error": ...}`` if it failed."""
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    process = context.Process(
        target=_worker, args=(child, lib, folder, prompts, outputs, slots, dtype)
    )
    process.start()
    child.close()
    try:
        kind, value = parent.recv()
    except EOFError:
        kind, value = "error", f"worker died (exit code {process.exitcode})"
    process.join(60)
    return value if kind == "ok" else {"error": value}


# ---- the report -------------------------------------------------------------------------------
def lscpu_model() -> str:
    """The CPU model as lscpu names it (else /proc/cpuinfo's)."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in text.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return _machine.environment()["processor"]


def report(results: dict, header: list[str]) -> str:
    lines = list(header)
    cells = ("tokens/s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "compiles")
    lines.append(f"{'':<12}" + "".join(f"{c:>11}" for c in cells))
    for lib, r in results.items():
        if "error" in r:
            lines.append(f"{lib:<12} failed: {r['error'][:150]}")
            continue
        compiles = "-" if r["compiles_after_warmup"] is None else str(r["compiles_after_warmup"])
        row = [
            f"{r['tokens_per_s']:.1f}",
            f"{r['ttft_p50_s'] * 1e3:.0f} ms",
            f"{r['ttft_p99_s'] * 1e3:.0f} ms",
            f"{r['itl_p50_s'] * 1e3:.1f} ms",
            f"{r['itl_p99_s'] * 1e3:.1f} ms",
            compiles,
        ]
        lines.append(f"{lib:<12}" + "".join(f"{c:>11}" for c in row))
    engine = results.get("engine", {})
    if "error" not in engine and engine:
        lines.append("")
        lines.append("engine / peer (throughput: higher is better; latency: peer / engine, so")
        lines.append("also higher is better for the engine):")
        for lib, r in results.items():
            if lib == "engine" or "error" in r:
                continue
            ratio = engine["tokens_per_s"] / r["tokens_per_s"]
            parts = [f"tokens/s x{ratio:.2f}"]
            for key in ("ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s"):
                if engine[key] > 0 and r[key] > 0:
                    parts.append(f"{key[:-2]} x{r[key] / engine[key]:.2f}")
                else:
                    parts.append(f"{key[:-2]} n/a (a zero gap)")
            lines.append(f"  vs {lib:<12} " + ", ".join(parts))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="16 requests, the small Llama")
    parser.add_argument("--requests", type=int, default=None, help="default 64 (--quick: 16)")
    parser.add_argument("--shape", choices=list(SHAPES), default=None)
    parser.add_argument("--layers", type=int, default=None, help="default: the shape's depth")
    parser.add_argument("--libs", nargs="+", choices=LIBS, default=list(LIBS))
    parser.add_argument("--json", metavar="PATH", help="also write every number here")
    parser.add_argument(
        "--slots",
        type=int,
        default=BATCH,
        help=f"requests at once in the engine and in hf_cb ({BATCH}); static batches stay {BATCH}",
    )
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="the weights and activations of every library (float32)",
    )
    args = parser.parse_args(argv)
    count = args.requests or (16 if args.quick else 64)
    shape = SHAPES[args.shape or ("llama-small" if args.quick else "smollm")]
    layers = args.layers or shape.layers
    with tempfile.TemporaryDirectory(prefix="genjax-bench-serving-") as folder:
        checkpoint = _cases.write_checkpoint(shape, layers, folder)
        prompts, outputs = workload(count, checkpoint["vocab_size"])
        results = {}
        for lib in args.libs:
            print(f"[{time.strftime('%H:%M:%S')}] {lib}", file=sys.stderr, flush=True)
            results[lib] = run_lib(lib, folder, prompts, outputs, args.slots, args.dtype)
    env = _machine.environment()
    lengths = [len(p) for p in prompts]
    header = [
        f"serving: {count} requests at once, {shape.title}, {layers} layers, "
        f"{checkpoint['params'] / 1e6:.1f}M params, {args.dtype}",
        f"prompts {min(lengths)}..{max(lengths)} (mean {np.mean(lengths):.0f}), outputs "
        f"{min(outputs)}..{max(outputs)} (sum {sum(outputs)}); static batches of {BATCH}; "
        f"continuous batching slots {args.slots}",
        f"CPU: {lscpu_model()} ({env['usable_cpus']} usable cores); "
        + ", ".join(f"{k} {v}" for k, v in env["versions"].items() if v),
        "",
    ]
    text = report(results, header)
    print(text)
    if args.json:
        with open(args.json, "w") as file:
            json.dump(dict(results=results, environment=env, header=header), file, indent=1)
    return 0 if all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
