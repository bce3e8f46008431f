"""Experiment: a decode loop with its layers unrolled (genjax's way) against ``lax.scan``.

Scanning over layer params stacked on a leading axis makes XLA compile one layer instead of
``L`` (MaxText's ``scan_layers`` does this), so it is the obvious lever on compile time. This
script measures what it costs at run time on this backend, on a decoder of the SmolLM-135M shape
(30 layers, width 576, MLP 1536, 9 query heads and 3 KV heads of 64, vocab 49152, random
float32 weights) written in plain ``jax.numpy``:

    unrolled  one Python loop over 30 per-layer param dicts; the KV cache is 30 arrays
              float32[B, K, S, H] per keys and values (one layout for both modes)
    scan      ``lax.scan`` over params stacked to [30, ...]; the cache is one float32[30, B, K, S,
              H] array per keys and values, scanned as inputs and written back as outputs

Each decodes ``--steps`` greedy tokens inside one ``lax.while_loop`` (cache in the carry, S
slots), so the figures are steady per-step times with no dispatch. It prints the XLA compile
time (lower + compile) and the median ms per step over ``--repeats`` calls, per mode and batch.

Run:  python bench/experiments/scan_layers.py [--batches 1 8] [--steps 128] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

LAYERS, WIDTH, MLP, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 30, 576, 1536, 9, 3, 64, 49152


def _random_params(seed: int = 0) -> tuple[list[dict], jax.Array, jax.Array]:
    """30 per-layer dicts of [out, in] weights and norm scales, the embedding and the head."""
    rng = np.random.default_rng(seed)

    def weight(*shape):
        return jnp.asarray(rng.normal(size=shape).astype(np.float32) * 0.02)

    layers = [
        dict(
            q=weight(HEADS * HEAD_DIM, WIDTH),
            k=weight(KV_HEADS * HEAD_DIM, WIDTH),
            v=weight(KV_HEADS * HEAD_DIM, WIDTH),
            o=weight(WIDTH, HEADS * HEAD_DIM),
            gate=weight(MLP, WIDTH),
            up=weight(MLP, WIDTH),
            down=weight(WIDTH, MLP),
            norm1=jnp.ones(WIDTH),
            norm2=jnp.ones(WIDTH),
        )
        for _ in range(LAYERS)
    ]
    return layers, weight(VOCAB, WIDTH), weight(VOCAB, WIDTH)


def _rms_norm(x, scale):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * scale


def _linear(x, kernel):  # x float32[B, in], kernel [out, in] -> [B, out]
    return jnp.einsum("bi,oi->bo", x, kernel)


def _layer(p, x, keys, values, position):
    """One decoder layer for one token per row: x float32[B, D], keys/values [B, K, S, H].

    Returns the layer's output and its cache blocks with the token written at ``position``.
    """
    batch, slots = x.shape[0], keys.shape[2]
    h = _rms_norm(x, p["norm1"])
    q = _linear(h, p["q"]).reshape(batch, KV_HEADS, HEADS // KV_HEADS, HEAD_DIM)
    k = _linear(h, p["k"]).reshape(batch, KV_HEADS, 1, HEAD_DIM)
    v = _linear(h, p["v"]).reshape(batch, KV_HEADS, 1, HEAD_DIM)
    keys = jax.lax.dynamic_update_slice(keys, k, (0, 0, position, 0))
    values = jax.lax.dynamic_update_slice(values, v, (0, 0, position, 0))
    scores = jnp.einsum("bkgh,bksh->bkgs", q, keys) * HEAD_DIM**-0.5
    scores = jnp.where(jnp.arange(slots) <= position, scores, -1e30)
    weights = jax.nn.softmax(scores, -1)
    out = jnp.sum(weights[..., None] * values[:, :, None], axis=3).reshape(batch, -1)
    x = x + _linear(out, p["o"])
    h = _rms_norm(x, p["norm2"])
    x = x + _linear(jax.nn.silu(_linear(h, p["gate"])) * _linear(h, p["up"]), p["down"])
    return x, keys, values


def _step_unrolled(params, token, cache, position):
    x = params["embed"][token]
    keys, values = [], []
    for p, layer_keys, layer_values in zip(params["layers"], *cache, strict=True):
        x, layer_keys, layer_values = _layer(p, x, layer_keys, layer_values, position)
        keys.append(layer_keys)
        values.append(layer_values)
    return jnp.argmax(_linear(x, params["head"]), -1), (keys, values)


def _step_scan(params, token, cache, position):
    def body(x, layer):
        p, layer_keys, layer_values = layer
        x, layer_keys, layer_values = _layer(p, x, layer_keys, layer_values, position)
        return x, (layer_keys, layer_values)

    x, cache = jax.lax.scan(body, params["embed"][token], (params["layers"], *cache))
    return jnp.argmax(_linear(x, params["head"]), -1), cache


def measure(mode: str, batch: int, slots: int, steps: int, repeats: int) -> tuple[float, float]:
    """(compile seconds, median ms per step) of ``steps`` greedy steps in one while loop."""
    layers, embed, head = _random_params()
    shape = (batch, KV_HEADS, slots, HEAD_DIM)
    if mode == "unrolled":
        params = dict(layers=layers, embed=embed, head=head)
        cache = ([jnp.zeros(shape)] * LAYERS, [jnp.zeros(shape)] * LAYERS)
        step = _step_unrolled
    else:
        stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), *layers)
        params = dict(layers=stacked, embed=embed, head=head)
        cache = (jnp.zeros((LAYERS, *shape)), jnp.zeros((LAYERS, *shape)))
        step = _step_scan

    @jax.jit
    def decode(params, cache):
        def body(carry):
            position, token, cache = carry
            token, cache = step(params, token, cache, position)
            return position + 1, token, cache

        start = (0, jnp.zeros(batch, jnp.int32), cache)
        return jax.lax.while_loop(lambda carry: carry[0] < steps, body, start)[1]

    start = time.perf_counter()
    compiled = decode.lower(params, cache).compile()
    compile_seconds = time.perf_counter() - start
    jax.block_until_ready(compiled(params, cache))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(params, cache))
        times.append(time.perf_counter() - start)
    return compile_seconds, statistics.median(times) / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    slots = 32 + args.steps
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; SmolLM-135M shape, float32,")
    print(f"{args.steps} greedy steps in one while loop, {slots} cache slots")
    print(f"{'batch':>5} {'mode':>9} {'compile s':>10} {'ms/step':>8}")
    for batch in args.batches:
        for mode in ("unrolled", "scan"):
            seconds, per_step = measure(mode, batch, slots, args.steps, args.repeats)
            print(f"{batch:>5} {mode:>9} {seconds:>10.2f} {per_step:>8.2f}", flush=True)


if __name__ == "__main__":
    main()
