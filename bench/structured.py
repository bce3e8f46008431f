"""What structured output costs: automaton build time and the per-step overhead of a constraint.

On the bundled model (``genjax-tiny``: a 4-layer Llama, width 256, 4096 tokens) this script

1. builds JSON-schema automata with ``genjax.constraints`` (outlines-core's index over the
   bundled tokenizer, read out into CSR arrays): cold (the vocabulary is read too), then from
   the in-memory cache; and reports states, transitions and the device table's size;
2. times greedy decoding at batch 1 and 8 with and without a JSON-schema constraint, in the
   same run, each variant compiled first, the variants interleaved ``--runs`` times. The per-step
   time is ``(t(N) - t(1)) / (steps - 1)``: the call with ``N`` new tokens less the call with
   one (prefill and first token), over the loop steps the longer call ran (rows end at EOS, so a
   constrained call may run fewer than ``N``; the table gives the steps). The constraint is
   timed in both device formats: the dense ``int32[S, V]`` table and the compressed one
   (bitmask + CSR transitions), forced by setting ``DENSE_LIMIT_BYTES`` to 0;
3. times the continuous-batching engine with 8 requests submitted at once, unconstrained and
   each with the JSON-schema constraint (its pool holds the automaton in the compressed
   format): wall time to the last result over the longest request's tokens, medians of
   ``--runs`` rounds after one warm-up round.

Run:  python bench/structured.py [--runs 5] [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import time

import jax
import numpy as np

import genjax
from genjax.constraints import automata, tables

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer"},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 8},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "[0-9]{5}"},
            },
            "required": ["city"],
        },
        "role": {"enum": ["admin", "user", "guest"]},
    },
    "required": ["name", "age", "tags", "address", "role"],
}
PROMPT = "import json\n\ndef load(path):\n    "


def _cpu() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or "unknown"


def _build_times(tok) -> list[str]:
    lines = ["automaton build (host, outlines-core + CSR read-out):"]
    automata._AUTOMATA.clear()
    automata._BY_TOKENIZER.clear()
    cases = [
        (
            "json_schema (this script's schema), cold",
            lambda: genjax.constraints.json_schema(SCHEMA, tok),
        ),
        ("json_schema, cached", lambda: genjax.constraints.json_schema(SCHEMA, tok)),
        ("json_object (depth 1)", lambda: genjax.constraints.json_object(tok)),
        ("regex [0-9]{3}-[0-9]{4}", lambda: genjax.constraints.regex(r"[0-9]{3}-[0-9]{4}", tok)),
    ]
    for name, build in cases:
        start = time.perf_counter()
        c = build()
        seconds = time.perf_counter() - start
        table = tables.device_automaton(c, 1, 4096)
        size = sum(x.nbytes for x in jax.tree.leaves(table))
        lines.append(
            f"  {name:44s} {seconds * 1e3:9.1f} ms   states {c.num_states:5d}   "
            f"transitions {c.tokens.shape[0]:7d}   {type(table).__name__} {size / 2**20:.1f} MiB"
        )
    return lines


def _steps(sequences: np.ndarray, prompt_length: int, new_tokens: int) -> int:
    """Loop steps run: the longest row's tokens up to and including its EOS (id 0)."""
    longest = 0
    for row in sequences[:, prompt_length:].tolist():
        longest = max(longest, row.index(0) + 1 if 0 in row else new_tokens)
    return longest


def _run(model, params, ids, config, new_tokens, constraint, dense_limit):
    """One generate call; ``dense_limit`` (when not None) replaces ``DENSE_LIMIT_BYTES``."""
    saved = tables.DENSE_LIMIT_BYTES
    if dense_limit is not None:
        tables.DENSE_LIMIT_BYTES = dense_limit
    try:
        out = genjax.generate(
            model, params, ids, config, max_new_tokens=new_tokens, constraint=constraint
        )
        return np.asarray(jax.block_until_ready(out.sequences))
    finally:
        tables.DENSE_LIMIT_BYTES = saved


def _engine_rates(model, params, tok, constraint, new_tokens: int, runs: int) -> dict:
    """Median engine time per decode step with 8 requests at once, unconstrained and each with
    ``constraint``: ``(t(N) - t(1)) / (steps - 1)`` as for ``generate``, ``t`` the wall time from
    submitting the 8 requests to the last result, ``steps`` the longest request's tokens."""
    from genjax.serving import ContinuousBatchingConfig, init_continuous_batching

    config = genjax.GenerationConfig(do_sample=False, eos_token_id=0, pad_token_id=0)
    sizes = ContinuousBatchingConfig(max_batch_size=8, max_length=256, max_constraint_edges=2**22)
    manager = init_continuous_batching(model, params, config, sizes, tokenizer=tok)
    manager.start()
    manager.warmup()
    prompt = tok(PROMPT)["input_ids"][0].tolist()

    def round_trip(n: int, extra: dict) -> tuple[float, int]:
        start = time.perf_counter()
        ids = [manager.add_request(prompt, max_new_tokens=n, **extra) for _ in range(8)]
        outs = [manager.get_result(request_id=i, timeout=600) for i in ids]
        return time.perf_counter() - start, max(len(o.generated_tokens) for o in outs)

    variants = {"unconstrained": {}, "json_schema": {"constraint": constraint}}
    per_step = {name: [] for name in variants}
    try:
        for run in range(runs + 1):  # the first round warms the automaton pool up
            for name, extra in variants.items():
                one, _ = round_trip(1, extra)
                full, steps = round_trip(new_tokens, extra)
                if run:
                    per_step[name].append((full - one) / max(steps - 1, 1) * 1e3)
    finally:
        manager.stop(block=True, timeout=60)
    return {name: statistics.median(values) for name, values in per_step.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    path = genjax.io.bundled.path()
    model, params = genjax.models.from_pretrained(path)
    tok = genjax.tokenizer.from_pretrained(path)
    print(
        f"cpu: {_cpu()}, jax {jax.__version__}, backend {jax.default_backend()}, "
        f"devices {len(jax.devices())}"
    )
    print("\n".join(_build_times(tok)))
    constraint = genjax.constraints.json_schema(SCHEMA, tok)
    config = genjax.GenerationConfig(do_sample=False, eos_token_id=0, pad_token_id=0)
    print(
        f"\ngreedy decoding, {args.new_tokens} new tokens, median of {args.runs} "
        f"interleaved runs, ms per loop step:"
    )
    for batch in (1, 8):
        ids = tok([PROMPT] * batch)["input_ids"]
        variants = {
            "unconstrained": (None, None),
            "json_schema dense": (constraint, None),
            "json_schema compressed": (constraint, 0),
        }

        def run(name, n, ids=ids, variants=variants):
            return _run(model, params, ids, config, n, *variants[name])

        steps, times = {}, {name: {1: [], args.new_tokens: []} for name in variants}
        for name in variants:  # compile both lengths first
            steps[name] = _steps(run(name, args.new_tokens), ids.shape[1], args.new_tokens)
            run(name, 1)
        for _ in range(args.runs):
            for name in variants:
                for n in (1, args.new_tokens):
                    start = time.perf_counter()
                    run(name, n)
                    times[name][n].append(time.perf_counter() - start)
        base = None
        for name in variants:
            full = statistics.median(times[name][args.new_tokens])
            one = statistics.median(times[name][1])
            per_step = (full - one) / max(steps[name] - 1, 1) * 1e3
            base = per_step if base is None else base
            print(
                f"  batch {batch}  {name:24s} {per_step:7.3f} ms/step  "
                f"(steps {steps[name]:3d})  ratio to unconstrained {per_step / base:5.2f}"
            )
    rates = _engine_rates(model, params, tok, constraint, args.new_tokens, args.runs)
    print(f"\nthe continuous-batching engine, 8 requests at once, medians of {args.runs}:")
    for name, ms in rates.items():
        print(f"  {name:24s} {ms:7.3f} ms/step  ratio to unconstrained "
              f"{ms / rates['unconstrained']:5.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
