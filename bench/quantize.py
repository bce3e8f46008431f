"""Weight-only int8 against float32: greedy decode speed at batch 1 and the logit difference.

For each model shape (GPT-2 small, SmolLM-135M; random weights in Hugging Face format, as in
``bench/run.py``), loads the float32 params, quantizes them with
``genjax.quantize_params(model, params, "int8")``, and times greedy generation of
``--new-tokens`` tokens after a 32-token prompt at batch 1, float32 and int8 interleaved run by
run in this one process. Prints medians (min-max) of new tokens per second, the int8/float32
ratio, the parameter bytes, and the accuracy: the largest absolute difference of the first
step's logits (the prefill's last position) against float32, relative to the largest float32
logit, whether its argmax agrees, and how many of the greedy tokens agree before the first
difference.

Run:  python bench/quantize.py [--shapes gpt2 smollm] [--runs 3] [--new-tokens 128]
                               [--layers N]
Needs the `parity` extra (torch, transformers) to write the random checkpoints.
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

CASE = _cases.CASES["greedy_b1"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", choices=list(_cases.SHAPES), default=None)
    parser.add_argument("--runs", type=int, default=3, help="measured runs of each (default 3)")
    parser.add_argument("--new-tokens", type=int, default=128, help="default 128")
    parser.add_argument("--layers", type=int, default=None, help="default: the full depth")
    args = parser.parse_args(argv)
    args.shapes = args.shapes or list(_cases.SHAPES)
    if args.runs < 1 or args.new_tokens < 2 or (args.layers is not None and args.layers < 1):
        parser.error("--runs and --layers must be at least 1, --new-tokens at least 2")
    return args


def _timed_generate(model, params, ids, config) -> tuple[float, object]:
    import genjax

    start = time.perf_counter()
    out = genjax.generate(model, params, ids, config)
    out.sequences.block_until_ready()
    return time.perf_counter() - start, out


def _first_step_logits(model, params, ids):
    """float32[V]: the logits of the prefill's last position (the first new token's)."""
    import jax.numpy as jnp

    batch, length = ids.shape
    cache = model.init_cache(batch, length)
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    mask = jnp.ones((batch, length), jnp.int32)
    logits, _ = model.apply(params, jnp.asarray(ids), positions, cache, mask, logits_to_keep=1)
    return logits[0, -1]


def _agreeing_prefix(a, b) -> int:
    """How many leading entries of two 1-D token arrays are equal."""
    import numpy as np

    differ = np.flatnonzero(np.asarray(a) != np.asarray(b))
    return int(differ[0]) if differ.size else len(a)


def bench_shape(shape: _cases.Shape, args: argparse.Namespace) -> dict:
    import jax.numpy as jnp
    import numpy as np

    import genjax

    layers = args.layers or shape.layers
    with tempfile.TemporaryDirectory() as folder:
        facts = _cases.write_checkpoint(shape, layers, folder)
        model, params = genjax.models.from_pretrained(folder)
    qparams = genjax.quantize_params(model, params, "int8")
    ids = _cases.prompt_ids(CASE, facts["vocab_size"]).astype(np.int32)
    new = args.new_tokens
    config = genjax.GenerationConfig(
        max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0
    )
    variants = {"float32": params, "int8": qparams}
    compile_s, outputs, rates = {}, {}, {name: [] for name in variants}
    for name, p in variants.items():
        compile_s[name], outputs[name] = _timed_generate(model, p, ids, config)
    for _ in range(args.runs):  # interleaved, so that load on the machine hits both alike
        for name, p in variants.items():
            elapsed, _ = _timed_generate(model, p, ids, config)
            rates[name].append(new / elapsed)
    reference = _first_step_logits(model, params, ids)
    quantized = _first_step_logits(model, qparams, ids)
    generated = [np.asarray(outputs[name].sequences)[0, CASE.prompt :] for name in variants]
    return dict(
        shape=shape,
        layers=layers,
        rates=rates,
        compile_s=compile_s,
        bytes={
            "float32": genjax.quantize.param_bytes(params),
            "int8": genjax.quantize.param_bytes(qparams),
        },
        max_abs_diff=float(jnp.max(jnp.abs(quantized - reference))),
        max_abs_logit=float(jnp.max(jnp.abs(reference))),
        argmax_agrees=bool(jnp.argmax(quantized) == jnp.argmax(reference)),
        agreeing_tokens=_agreeing_prefix(*generated),
        new_tokens=new,
    )


def _fmt(xs: list[float]) -> str:
    return f"{statistics.median(xs):6.2f} ({min(xs):.2f}-{max(xs):.2f})"


def report(result: dict) -> None:
    shape, rates = result["shape"], result["rates"]
    f32, i8 = (statistics.median(rates[name]) for name in ("float32", "int8"))
    print(
        f"\n{shape.title}, {result['layers']} layers: greedy, batch 1, prompt {CASE.prompt}, "
        f"{result['new_tokens']} new tokens"
    )
    print(f"  {'':8} {'new tokens/s (min-max)':>24} {'params MB':>10} {'first call s':>13}")
    for name in ("float32", "int8"):
        print(
            f"  {name:8} {_fmt(rates[name]):>24} {result['bytes'][name] / 1e6:10.1f} "
            f"{result['compile_s'][name]:13.1f}"
        )
    print(
        f"  int8 / float32 speed: {i8 / f32:.2f}x (target >= 1.5x); params "
        f"{result['bytes']['int8'] / result['bytes']['float32']:.2f}x the bytes"
    )
    print(
        f"  first-step logits: max |int8 - float32| = {result['max_abs_diff']:.4f} "
        f"({result['max_abs_diff'] / result['max_abs_logit']:.2%} of max |logit| "
        f"{result['max_abs_logit']:.2f}); argmax "
        f"{'agrees' if result['argmax_agrees'] else 'differs'}; greedy tokens agree for "
        f"{result['agreeing_tokens']} of {result['new_tokens']}"
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import jax

    print(f"jax {jax.__version__} on {jax.devices()[0].platform}, {os.cpu_count()} CPUs")
    for name in args.shapes:
        report(bench_shape(_cases.SHAPES[name], args))


if __name__ == "__main__":
    main()
