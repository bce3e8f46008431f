"""Beam search step time: 4 beams at batch 1 against greedy at batch 4, genjax and transformers.

Both runs push 4 rows through the model per step, so their difference is what beam search adds:
the log-softmax, the top-k over ``M * V`` totals, the hypothesis bookkeeping and the reordering
of the KV cache (one gather of every layer's rows per step). Builds a GPT-2-small-shaped model
(12 layers, width 768, vocab 50257) with random weights in transformers, saves it as safetensors,
loads it into genjax, and times both libraries on the same weights in one run, alternating them.

Step time = (time of ``N`` new tokens - time of 1 new token) / (N - 1), so the prefill and the
call overhead cancel. No EOS is set, so every run makes exactly ``N`` tokens. Also times the KV
cache gather alone (jitted, the beam shape) to show its share of a beam step.

Run:  python bench/beam.py [--new-tokens 64] [--prompt 32] [--runs 3] [--no-torch]
Needs the `parity` extra (torch, transformers) unless --no-torch.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

BEAMS = 4


def _hf_model(layers: int, width: int, vocab: int):
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=layers, n_embd=width, n_head=width // 64, vocab_size=vocab, n_positions=1024
    )
    return transformers.GPT2LMHeadModel(config).eval()


def _genjax_runner(model, params, ids, new_tokens: int, num_beams: int):
    import genjax

    config = genjax.GenerationConfig(
        max_new_tokens=new_tokens, num_beams=num_beams, pad_token_id=0, early_stopping=False
    )

    def run() -> float:
        start = time.perf_counter()
        out = genjax.generate(model, params, ids, config)
        out.sequences.block_until_ready()
        return time.perf_counter() - start

    return run


def _torch_runner(hf, ids, new_tokens: int, num_beams: int):
    import torch

    tokens = torch.from_numpy(ids.astype(np.int64))

    def run() -> float:
        with torch.inference_mode():
            start = time.perf_counter()
            out = hf.generate(
                tokens,
                attention_mask=torch.ones_like(tokens),
                do_sample=False,
                num_beams=num_beams,
                max_new_tokens=new_tokens,
                eos_token_id=None,
                pad_token_id=0,
            )
            elapsed = time.perf_counter() - start
        assert out.shape[1] == ids.shape[1] + new_tokens
        return elapsed

    return run


def _gather_ms(model, rows: int, length: int, runs: int, steps: int = 32) -> float:
    """Median ms of one KV-cache row gather of the beam search shape, measured as the loop does
    it: ``steps`` gathers carried through a jitted ``fori_loop`` (buffers reused, no host)."""
    cache = model.init_cache(rows, length)
    order = jnp.asarray(np.random.default_rng(0).permutation(rows), jnp.int32)

    @jax.jit
    def gathers(cache, order):
        return jax.lax.fori_loop(0, steps, lambda i, c: c.gather_rows(order), cache)

    jax.block_until_ready(gathers(cache, order))
    times = []
    for _ in range(max(runs, 5)):
        start = time.perf_counter()
        jax.block_until_ready(gathers(cache, order))
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--no-torch", action="store_true", help="time genjax only")
    args = parser.parse_args()

    import genjax

    hf = _hf_model(args.layers, args.width, args.vocab)
    with tempfile.TemporaryDirectory() as folder:
        hf.save_pretrained(folder, safe_serialization=True)
        model, params = genjax.models.from_pretrained(folder)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, args.vocab, size=(BEAMS, args.prompt)).astype(np.int32)
    cases = {"greedy, batch 4": (prompt, 1), f"beam {BEAMS}, batch 1": (prompt[:1], BEAMS)}
    libs = {"genjax": lambda ids, n, m: _genjax_runner(model, params, ids, n, m)}
    if not args.no_torch:
        import torch

        libs["transformers"] = lambda ids, n, m: _torch_runner(hf, ids, n, m)
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(
        f"jax {jax.__version__} on {jax.devices()[0].device_kind}; GPT-2 shape, {args.layers} "
        f"layers, width {args.width}, vocab {args.vocab}; prompt {args.prompt}, "
        f"{args.new_tokens} new tokens"
    )

    runners = {
        (lib, case, n): make(ids, n, beams)
        for case, (ids, beams) in cases.items()
        for lib, make in libs.items()
        for n in (1, args.new_tokens)
    }
    for run in runners.values():
        run()  # compiles (genjax) or warms up (torch)
    times = {key: [] for key in runners}
    for _ in range(args.runs):  # interleaved, so that load changes hit every figure alike
        for key, run in runners.items():
            times[key].append(run())
    step_ms = {}
    for lib, case, _ in runners:
        long = statistics.median(times[lib, case, args.new_tokens])
        short = statistics.median(times[lib, case, 1])
        step_ms[lib, case] = 1e3 * (long - short) / (args.new_tokens - 1)

    header = f"{'ms / step':>20} | " + " | ".join(f"{lib:>12}" for lib in libs)
    print(header)
    print("-" * len(header))
    for case in cases:
        print(f"{case:>20} | " + " | ".join(f"{step_ms[lib, case]:12.2f}" for lib in libs))
    greedy, beam = cases
    print(
        f"{'beam / greedy':>20} | "
        + " | ".join(f"{step_ms[lib, beam] / step_ms[lib, greedy]:11.2f}x" for lib in libs)
    )
    if "transformers" in libs:
        for case in cases:
            ratio = step_ms["transformers", case] / step_ms["genjax", case]
            print(f"genjax speed-up, {case}: {ratio:.2f}x")
    gather = _gather_ms(model, BEAMS, bucket_total(args), args.runs)
    share = gather / step_ms["genjax", beam]
    print(f"KV cache gather alone: {gather:.3f} ms ({share:.0%} of a genjax beam step)")


def bucket_total(args) -> int:
    """The cache length genjax allocates: the prompt bucket plus the new tokens."""
    from genjax.generation.entry import bucket_length

    return bucket_length(args.prompt) + args.new_tokens


if __name__ == "__main__":
    main()
