"""Greedy decode speed: genjax against transformers (PyTorch) on the same random weights.

Builds a GPT-2-small-shaped model (12 layers, width 768, vocab 50257) with random weights in
transformers, saves it as safetensors, loads it into genjax, and times greedy generation of
``--new-tokens`` tokens after a ``--prompt``-token prompt at each batch size, alternating the two
libraries run by run. Prints medians (with min-max) of new tokens per second and the ratio.

Run:  python bench/decode.py [--batch 1 8] [--runs 3] [--new-tokens 128] [--prompt 32]
Needs the `parity` extra (torch, transformers).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import jax
import numpy as np


def _hf_model(layers: int, width: int, vocab: int):
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=layers, n_embd=width, n_head=width // 64, vocab_size=vocab, n_positions=1024
    )
    return transformers.GPT2LMHeadModel(config).eval()


def _time_hf(model, ids, new_tokens: int) -> float:
    import torch

    with torch.inference_mode():
        start = time.perf_counter()
        out = model.generate(
            torch.from_numpy(ids),
            attention_mask=torch.ones_like(torch.from_numpy(ids)),
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            eos_token_id=None,
            pad_token_id=0,
        )
        elapsed = time.perf_counter() - start
    assert out.shape[1] == ids.shape[1] + new_tokens
    return elapsed


def _time_genjax(model, params, ids, config) -> float:
    import genjax

    start = time.perf_counter()
    out = genjax.generate(model, params, ids, config)
    out.sequences.block_until_ready()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=50257)
    args = parser.parse_args()

    import torch

    import genjax

    torch.set_num_threads(max(1, torch.get_num_threads()))
    hf = _hf_model(args.layers, args.width, args.vocab)
    with tempfile.TemporaryDirectory() as folder:
        hf.save_pretrained(folder, safe_serialization=True)
        model, params = genjax.models.from_pretrained(folder)
    config = genjax.GenerationConfig(max_new_tokens=args.new_tokens, pad_token_id=0)

    print(
        f"jax {jax.__version__} on {jax.devices()[0].platform}; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads"
    )
    print(
        f"model: GPT-2 shape, {args.layers} layers, width {args.width}, vocab {args.vocab}; "
        f"prompt {args.prompt}, {args.new_tokens} new tokens, greedy"
    )
    header = f"{'batch':>5} | {'genjax tok/s':>20} | {'transformers tok/s':>20} | {'ratio':>6}"
    print(header)
    print("-" * len(header))
    rng = np.random.default_rng(0)
    for batch in args.batch:
        ids = rng.integers(0, args.vocab, size=(batch, args.prompt)).astype(np.int32)
        start = time.perf_counter()
        _time_genjax(model, params, ids, config)  # compiles
        compile_s = time.perf_counter() - start
        _time_hf(hf, ids.astype(np.int64), 4)  # warms up torch
        ours, theirs = [], []
        for _ in range(args.runs):
            ours.append(batch * args.new_tokens / _time_genjax(model, params, ids, config))
            theirs.append(
                batch * args.new_tokens / _time_hf(hf, ids.astype(np.int64), args.new_tokens)
            )
        fmt = lambda xs: f"{statistics.median(xs):7.1f} ({min(xs):.1f}-{max(xs):.1f})"
        ratio = statistics.median(ours) / statistics.median(theirs)
        print(
            f"{batch:>5} | {fmt(ours):>20} | {fmt(theirs):>20} | {ratio:5.2f}x"
            f"   (genjax first call {compile_s:.1f} s)"
        )


if __name__ == "__main__":
    main()
