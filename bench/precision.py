"""What each narrow format changes on the real checkpoint: logits and greedy tokens against
float32, and decode speed at batch 1, 8 and 32 (the figures behind ``dtype="auto"``).

The checkpoint is the parity suite's SmolLM2-135M-Instruct Q4_1 GGUF (``tests/real_model.py``),
loaded by genjax as float32 (dequantized), bfloat16, int8 weights and int4 weights (the file's
Q4_1 blocks kept). For each format:

* logits: over a few chat prompts, the first new token's logits against float32's: the largest
  absolute change relative to the largest float32 logit, and the mean change relative to the
  mean |logit|;
* tokens: each format generates ``--new-tokens`` greedy tokens per prompt, and float32
  predicts the next token at every position of that continuation (teacher forced): the share
  of positions where both pick the same token;
* speed: one decode step at batch 1, 8 and 32 (random 32-token prompts; the difference of two
  call lengths divided by the extra tokens), interleaved with the other formats, medians;
* prefill (``--prompt-lengths``): one forward pass over a random prompt of each length at
  batch 1, interleaved with the other formats, medians.

Run:  python bench/precision.py [--runs 3] [--new-tokens 64] [--batches 1 8 32]
                                [--prompt-lengths 42 128 500] [--speed-only]
                                [--formats float32 int4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _machine  # noqa: E402
from four_bit import PROMPTS, chat_ids, real_checkpoint  # noqa: E402

FORMATS = {  # name -> from_pretrained keywords
    "float32": {},
    "bfloat16": {"dtype": "bfloat16"},
    "int8": {"quantize": "int8"},
    "int4": {"quantize": "int4"},
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="timed runs of each (default 3)")
    parser.add_argument("--new-tokens", type=int, default=64, help="default 64")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt-lengths", type=int, nargs="*", default=[], help="prefill")
    parser.add_argument("--speed-only", action="store_true", help="skip the accuracy part")
    parser.add_argument(
        "--formats", nargs="+", choices=list(FORMATS), default=list(FORMATS), help="default all"
    )
    args = parser.parse_args(argv)
    if args.runs < 1 or args.new_tokens < 2 or min(args.batches + args.prompt_lengths) < 1:
        parser.error(
            "--runs, --batches and --prompt-lengths must be at least 1, --new-tokens at least 2"
        )
    return args


def _first_logits(model, params, ids):
    import jax.numpy as jnp
    import numpy as np

    ids = jnp.asarray([ids], jnp.int32)
    positions = jnp.arange(ids.shape[1])[None]
    mask = jnp.ones_like(ids)
    logits, _ = model.apply(params, ids, positions, model.init_cache(1, ids.shape[1]), mask)
    return np.asarray(logits[0, -1], np.float32)


def _all_logits(model, params, ids):
    import jax.numpy as jnp
    import numpy as np

    ids = jnp.asarray([ids], jnp.int32)
    positions = jnp.arange(ids.shape[1])[None]
    mask = jnp.ones_like(ids)
    logits, _ = model.apply(params, ids, positions, model.init_cache(1, ids.shape[1]), mask)
    return np.asarray(logits[0], np.float32)


def _accuracy(loaded, prompts, new_tokens):
    import jax.numpy as jnp
    import numpy as np

    import genjax

    config = genjax.GenerationConfig(max_new_tokens=new_tokens, do_sample=False)
    out = {}
    base_model, base = loaded["float32"]
    for name, (model, params) in loaded.items():
        if name == "float32":
            continue
        max_rel, mean_rel, agree, total = [], [], 0, 0
        for ids in prompts:
            want = _first_logits(base_model, base, ids)
            got = _first_logits(model, params, ids)
            max_rel.append(np.abs(got - want).max() / np.abs(want).max())
            mean_rel.append(np.abs(got - want).mean() / np.abs(want).mean())
            seq = genjax.generate(model, params, jnp.asarray([ids], jnp.int32), config).sequences
            new = np.asarray(seq)[0, len(ids) :]
            teacher = _all_logits(base_model, base, ids + new.tolist())[len(ids) - 1 : -1]
            agree += int((teacher.argmax(-1) == new).sum())
            total += len(new)
        out[name] = dict(
            max_change=float(max(max_rel)),
            mean_change=float(statistics.mean(mean_rel)),
            agree=agree,
            total=total,
        )
    return out


def _step_ms(model, params, batch, runs):
    """Median milliseconds of one decode step at ``batch`` rows (two call lengths' difference)."""
    import jax.numpy as jnp
    import numpy as np

    import genjax

    ids = jnp.asarray(np.random.default_rng(0).integers(100, 40000, (batch, 32)), jnp.int32)
    short, long = 8, 40
    calls = {}
    for n in (short, long):
        config = genjax.GenerationConfig(max_new_tokens=n, do_sample=False, pad_token_id=0)
        calls[n] = lambda config=config: genjax.generate(model, params, ids, config)
        calls[n]().sequences.block_until_ready()
    steps = []
    for _ in range(runs):
        times = {}
        for n, call in calls.items():
            start = time.perf_counter()
            call().sequences.block_until_ready()
            times[n] = time.perf_counter() - start
        steps.append((times[long] - times[short]) / (long - short) * 1e3)
    return statistics.median(steps)


def _prefill_ms(loaded, length, runs):
    """Median milliseconds of one forward pass over a ``length``-token prompt, per format,
    timed interleaved."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    ids = jnp.asarray(np.random.default_rng(0).integers(100, 40000, (1, length)), jnp.int32)
    calls = {}
    for name, (model, params) in loaded.items():

        @jax.jit
        def forward(params, ids, model=model):
            mask = jnp.ones(ids.shape, jnp.int32)
            positions = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
            cache = model.init_cache(*ids.shape)
            return model.apply(params, ids, positions, cache, mask, logits_to_keep=1)[0][:, -1]

        calls[name] = lambda forward=forward, params=params: forward(params, ids)
        calls[name]().block_until_ready()
    times = {name: [] for name in calls}
    for _ in range(runs):
        for name, call in calls.items():
            start = time.perf_counter()
            call().block_until_ready()
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(values) for name, values in times.items()}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    path, tokenizer = real_checkpoint()
    prompts = [chat_ids(tokenizer, prompt) for prompt in PROMPTS]

    import genjax

    loaded = {}
    for name in dict.fromkeys(["float32", *args.formats]):
        model, params = genjax.models.from_pretrained(path, **FORMATS[name])
        loaded[name] = (model.with_generation_config(None), params)
    print(f"# {_machine.cpu_model()} ({', '.join(_machine.cpu_extensions())}), "
          f"{_machine.cpu_count()} threads; SmolLM2-135M-Instruct (Q4_1 GGUF)")  # fmt: skip
    accuracy = {} if args.speed_only else _accuracy(loaded, prompts, args.new_tokens)
    if accuracy:
        print(
            f"against float32, {len(prompts)} chat prompts, {args.new_tokens} greedy tokens each:"
        )
    for name, row in accuracy.items():
        print(f"  {name:9s} first-step logits: largest change {row['max_change']:.2%} of the "
              f"largest logit, mean {row['mean_change']:.2%} of the mean |logit|; tokens = "
              f"float32 argmax at {row['agree']}/{row['total']} "
              f"({row['agree'] / row['total']:.1%})")  # fmt: skip
    print(f"decode step, ms (median of {args.runs}), and speed against float32:")
    for batch in args.batches:
        steps = {name: _step_ms(*pair, batch, args.runs) for name, pair in loaded.items()}
        cells = ", ".join(
            f"{name} {ms:.1f} ({steps['float32'] / ms:.2f}x)" for name, ms in steps.items()
        )
        print(f"  batch {batch:3d}: {cells}; auto picks {genjax.models.auto_precision(batch)}")
    if args.prompt_lengths:
        print(f"prefill at batch 1, ms (median of {args.runs}), and speed against float32:")
    for length in args.prompt_lengths:
        times = _prefill_ms(loaded, length, args.runs)
        cells = ", ".join(
            f"{name} {ms:.1f} ({times['float32'] / ms:.2f}x)" for name, ms in times.items()
        )
        print(f"  {length:4d} tokens: {cells}")


if __name__ == "__main__":
    main()
