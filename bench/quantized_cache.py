"""The int8 KV cache against the float cache: memory, logit error, greedy agreement, speed.

For each model (the bundled ``genjax-tiny`` on real text prompts, and a random Llama with head
dimension 64 on random ids) it runs greedy generation twice from the same prompts, with the
float cache and with ``cache_implementation="quantized"`` (``cache_config={"nbits": 8}``), and
reports, measured in one run:

- cache bytes of the call (``genjax.cache.memory.cache_bytes``), float vs int8 + scales, and
  the ratio;
- the greedy agreement rate: the fraction of new tokens equal at the same position, and the
  fraction of rows identical over the whole run;
- the largest logit difference over the run, taken at every step up to and including each row's
  first differing token (after it the two runs see different prefixes), next to the largest
  logit magnitude;
- decode speed: median wall time of a whole ``generate`` call (compiled beforehand), the two
  caches interleaved run by run, and the ratio quantized / float.

Run:  python bench/quantized_cache.py [--batch 8] [--new-tokens 64] [--runs 3] [--dtype float32]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import jax
import numpy as np

import genjax
from genjax.cache import memory
from genjax.generation.entry import bucket_length
from genjax.testing import write_random_checkpoint

QUANTIZED = {"cache_implementation": "quantized", "cache_config": {"nbits": 8}}
PROMPTS = [
    "def fibonacci(n):",
    "Once upon a time",
    "import numpy as np\n",
    "The quick brown fox",
    "class Stack:\n    def push(self, item):",
    "In the beginning",
    "for i in range(10):",
    "Hello, world",
]
RANDOM_SHAPE = dict(
    hidden_size=512,
    intermediate_size=1024,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    vocab_size=2048,
    max_position_embeddings=4096,
)


def _bundled_inputs(batch: int):
    folder = genjax.io.bundled.path("genjax-tiny")
    tok = genjax.tokenizer.from_pretrained(folder)
    texts = [PROMPTS[i % len(PROMPTS)] for i in range(batch)]
    encoded = tok(texts)
    width = max(len(ids) for ids in encoded["input_ids"])
    ids = np.zeros((batch, width), np.int32)
    mask = np.zeros((batch, width), np.int32)
    for row, tokens in enumerate(encoded["input_ids"]):  # left padding
        ids[row, width - len(tokens) :] = tokens
        mask[row, width - len(tokens) :] = 1
    return folder, ids, mask


def _random_inputs(folder: str, batch: int, prompt: int):
    write_random_checkpoint(folder, "llama", **RANDOM_SHAPE)
    ids = np.random.default_rng(0).integers(3, RANDOM_SHAPE["vocab_size"], (batch, prompt))
    return folder, ids.astype(np.int32), np.ones((batch, prompt), np.int32)


def _first_divergence(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    same = a == b
    return np.where(same.all(1), same.shape[1], np.argmin(same, axis=1))


def _timed(model, params, ids, mask, config, extra) -> tuple[float, genjax.GenerateOutput]:
    start = time.perf_counter()
    out = genjax.generate(model, params, ids, config, attention_mask=mask, **extra)
    jax.block_until_ready(out)
    return time.perf_counter() - start, out


def measure(name: str, folder: str, ids, mask, args) -> dict:
    """Runs both caches on one model and returns the figures."""
    model, params = genjax.models.from_pretrained(folder, dtype=args.dtype)
    new = args.new_tokens
    config = genjax.GenerationConfig(
        max_new_tokens=new, min_new_tokens=new, pad_token_id=0, eos_token_id=None
    )
    logged = config.replace(output_logits=True)
    prompt = bucket_length(ids.shape[1])
    sizes = {
        kind: memory.cache_bytes(memory.CacheRequest(model, len(ids), prompt + new, kind))
        for kind in (False, True)
    }
    _, exact = _timed(model, params, ids, mask, logged, {})
    _, quant = _timed(model, params, ids, mask, logged, QUANTIZED)
    new_exact = np.asarray(exact.sequences)[:, -new:]
    new_quant = np.asarray(quant.sequences)[:, -new:]
    stop = _first_divergence(new_exact, new_quant)
    logits_exact, logits_quant = np.asarray(exact.logits), np.asarray(quant.logits)
    diff = max(
        np.abs(logits_quant[r, : min(stop[r] + 1, new)] - logits_exact[r, : min(stop[r] + 1, new)])
        .max()
        .item()
        for r in range(len(ids))
    )
    times = {False: [], True: []}
    for kind in (False, True):  # compile the unlogged programs
        _timed(model, params, ids, mask, config, QUANTIZED if kind else {})
    for _ in range(args.runs):
        for kind in (False, True):
            elapsed, _ = _timed(model, params, ids, mask, config, QUANTIZED if kind else {})
            times[kind].append(elapsed)
    median = {kind: statistics.median(t) for kind, t in times.items()}
    return {
        "model": name,
        "dtype": args.dtype,
        "batch": len(ids),
        "slots": prompt + new,
        "float_bytes": sizes[False],
        "int8_bytes": sizes[True],
        "bytes_ratio": sizes[True] / sizes[False],
        "token_agreement": float(np.mean(new_exact == new_quant)),
        "rows_identical": float(np.mean(stop == new)),
        "mean_first_divergence": float(np.mean(stop)),
        "max_logit_diff": diff,
        "max_abs_logit": float(np.abs(logits_exact).max()),
        "float_s": median[False],
        "int8_s": median[True],
        "tokens_per_s_ratio": median[False] / median[True],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=32, help="random model's prompt length")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--models", nargs="+", default=["bundled", "random"])
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            if name == "bundled":
                folder, ids, mask = _bundled_inputs(args.batch)
            else:
                folder, ids, mask = _random_inputs(tmp, args.batch, args.prompt)
            rows.append(measure(name, folder, ids, mask, args))
    print(f"device: {jax.devices()[0].device_kind}, {args.new_tokens} new tokens, {args.runs} runs")
    header = (
        "model", "dtype", "batch", "slots", "float_bytes", "int8_bytes", "bytes_ratio",
        "token_agreement", "rows_identical", "mean_first_divergence", "max_logit_diff",
        "max_abs_logit", "float_s", "int8_s", "tokens_per_s_ratio",
    )  # fmt: skip
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        cells = [f"{v:.4g}" if isinstance(v, float) else str(v) for v in (row[k] for k in header)]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
