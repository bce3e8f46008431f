"""Sliding-window ring caches against the full cache: cache memory and decode step time.

A random Gemma 3 text checkpoint (``gemma3_text``: five sliding-window layers to one global
layer, one KV head of 256, as Gemma 3 270M/1B; fewer and narrower layers so that a CPU runs it)
decodes with a cache of ``S`` slots, once with its sliding layers kept as rings of ``W`` slots
(``ring_cache=True``, the default) and once with every layer at ``S`` slots
(``ring_cache=False``, the window applied by the mask). Reported, measured in one run:

- the cache bytes of each (``genjax.cache.memory.cache_bytes``) and the ratio ring / full,
  next to the local layers' expected share ``1 - (L_local / L) * (1 - W / S)``;
- the decode step time: one jitted ``model.apply`` of one token per row at slot ``S - 1``
  (the step at the end of a long context, where a full cache's sliding layers read all ``S``
  slots and a ring's read ``W``), the cache donated, median of ``--steps`` steps, the two layouts
  interleaved round by round; and the ratio ring / full;
- that both layouts give the same greedy tokens: a short ``generate`` from the same prompt,
  longer than ``W``.

Run:  python bench/ring_cache.py [--length 4096] [--window 512] [--batch 1 8] [--steps 20]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time

import _machine
import jax
import jax.numpy as jnp
import numpy as np

import genjax
from genjax.cache import memory
from genjax.testing import write_random_checkpoint

SHAPE = dict(
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=256,
    vocab_size=4096,
    max_position_embeddings=32768,
    sliding_window_pattern=6,
    layer_types=None,
)


def _layouts(folder: str, dtype: str):
    ring, params = genjax.models.from_pretrained(folder, dtype=dtype)
    ring = ring.with_generation_config(None)
    full = dataclasses.replace(ring, config=dataclasses.replace(ring.config, ring_cache=False))
    return {"ring": ring, "full": full}, params


def _step_times(models, params, batch: int, length: int, steps: int) -> dict:
    """Median seconds of one decode step at the end of a ``length``-slot cache, per layout."""
    token = jnp.ones((batch, 1), jnp.int32)
    mask = jnp.ones((batch, length), jnp.int32)
    start = length - steps - 1
    programs, caches = {}, {}
    for name, model in models.items():
        programs[name] = jax.jit(model.apply, donate_argnums=(3,))
        cache = model.init_cache(batch, length)
        caches[name] = cache.replace(index=jnp.asarray(start, jnp.int32))
        _, caches[name] = programs[name](params, token, token * start, caches[name], mask)
    times = {name: [] for name in models}
    for step in range(steps - 1):
        for name in models:  # interleaved, so both see the same machine load
            position = token * (start + 1 + step)
            begin = time.perf_counter()
            logits, caches[name] = programs[name](params, token, position, caches[name], mask)
            jax.block_until_ready(logits)
            times[name].append(time.perf_counter() - begin)
    return {name: statistics.median(values) for name, values in times.items()}


def _same_tokens(models, params, window: int) -> bool:
    ids = np.random.default_rng(0).integers(3, SHAPE["vocab_size"], (2, 2 * window))
    config = genjax.GenerationConfig(max_new_tokens=16, pad_token_id=0, eos_token_id=None)
    out = {
        name: np.asarray(genjax.generate(model, params, ids.astype(np.int32), config).sequences)
        for name, model in models.items()
    }
    return bool(np.array_equal(out["ring"], out["full"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=4096, help="cache slots S")
    parser.add_argument("--window", type=int, default=512, help="sliding window W")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--check-window", type=int, default=16, help="W of the token check")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        write_random_checkpoint(tmp, "gemma3_text", sliding_window=args.window, **SHAPE)
        models, params = _layouts(tmp, args.dtype)
        windows = models["ring"].config.sliding_windows
        local = sum(w is not None for w in windows) / len(windows)
        expected = 1 - local * (1 - args.window / args.length)
        for batch in args.batch:
            sizes = {
                name: memory.cache_bytes(memory.CacheRequest(model, batch, args.length))
                for name, model in models.items()
            }
            times = _step_times(models, params, batch, args.length, args.steps)
            rows.append(
                dict(
                    batch=batch,
                    slots=args.length,
                    window=args.window,
                    full_bytes=sizes["full"],
                    ring_bytes=sizes["ring"],
                    bytes_ratio=sizes["ring"] / sizes["full"],
                    expected_ratio=expected,
                    full_step_ms=times["full"] * 1e3,
                    ring_step_ms=times["ring"] * 1e3,
                    step_ratio=times["ring"] / times["full"],
                )
            )
    with tempfile.TemporaryDirectory() as tmp:  # a small window, so that prompts pass it
        write_random_checkpoint(tmp, "gemma3_text", sliding_window=args.check_window, **SHAPE)
        same = _same_tokens(*_layouts(tmp, args.dtype), args.check_window)
    print(
        f"cpu: {_machine.cpu_model()}; device: {jax.devices()[0].device_kind}; {args.dtype}; "
        f"layers "
        f"{SHAPE['num_hidden_layers']} (local share {local:.3f}); greedy tokens ring == full "
        f"(W={args.check_window}, prompt {2 * args.check_window}, 16 new): {same}"
    )
    header = list(rows[0])
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        cells = [f"{v:.4g}" if isinstance(v, float) else str(v) for v in row.values()]
        print("| " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as f:
            meta = dict(cpu=_machine.cpu_model(), dtype=args.dtype, shape=SHAPE, same_tokens=same)
            json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
