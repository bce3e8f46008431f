"""What building a constraint costs on the host: time, peak memory, automaton and table sizes.

Each case runs in a fresh subprocess (so its peak resident memory is its own, read from
``getrusage``), on the bundled tokenizer (4096 tokens) and on a synthetic 50k vocabulary (the
bundled tokens plus 46k tokens made by joining two bundled token texts, like BPE merges; a
stand-in for GPT-2's 50257 until a real one is at hand; ``--vocab 128k``: 128256 tokens, Llama
3's count, made the same way). For each: the sizing before the build
(:mod:`genjax.constraints.limits`), the whole build (sizing, outlines-core's ``Index``, the CSR
read-out), states and transitions, and the device table :func:`device_automaton` picks with its
bytes (dense ``int32[S, V]`` up to ``DENSE_LIMIT_BYTES``, compressed otherwise) and the time to
make it. Patterns over the default bounds show how fast they are refused.

Run:  python bench/structured_build.py [--timeout 300] [--vocab 4k 50k 128k] [--cases json_schema]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from _machine import cpu_model

SCHEMA = "bench"  # bench/structured.py's schema
CASES = [
    ("json_schema (structured.py's)", "schema", SCHEMA),
    ("json_object (depth 1)", "object", ""),
    ("regex [0-9]{3}-[0-9]{4}", "regex", r"[0-9]{3}-[0-9]{4}"),
    ("regex [a-z]{1,500}", "regex", r"[a-z]{1,500}"),
    ("regex [a-z]{1,5000}", "regex", r"[a-z]{1,5000}"),
    ("regex (a|b)*a(a|b){20}", "regex", r"(a|b)*a(a|b){20}"),
    ("regex .{0,100000}", "regex", r".{0,100000}"),
    ("json_schema maxLength 100000", "json", '{"type": "string", "maxLength": 100000}'),
    (
        "json_schema array minItems 5000",
        "json",
        '{"type": "array", "items": {"type": "integer"}, "minItems": 5000}',
    ),
]

CHILD = r"""
import json, resource, sys, time
sys.path.insert(0, "bench")
import jax, numpy as np, genjax
from genjax.constraints import automata, limits, tables
from genjax.errors import InputError
kind, arg, vocab = sys.argv[1], sys.argv[2], sys.argv[3]
tok = genjax.tokenizer.from_pretrained(genjax.io.bundled.path())
if vocab in ("50k", "128k"):
    from genjax.stopping.stop_strings import token_texts
    from outlines_core import Vocabulary
    size = {"50k": 50257, "128k": 128256}[vocab]
    texts = [t for i, t in sorted(token_texts(tok)[0].items()) if t and i != tok.eos_token_id]
    seen, rng = set(texts), np.random.default_rng(0)
    while len(seen) < size - 1:
        a, b = rng.integers(256, len(texts), 2)
        seen.add(texts[a] + texts[b])
    spelled = {t: [i] for i, t in enumerate(sorted(seen)) if i != 0}
    eos = 0
    v = automata._Vocabulary(Vocabulary(eos, spelled), "synthetic", eos, size,
                             limits.leading_chars([t for t in spelled]))
    automata._vocabulary = lambda *a, **k: v
else:
    automata._vocabulary(tok, None)
from structured import SCHEMA
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.perf_counter()
try:
    if kind == "schema":
        c = genjax.constraints.json_schema(SCHEMA, tok)
    elif kind == "object":
        c = genjax.constraints.json_object(tok)
    elif kind == "json":
        c = genjax.constraints.json_schema(json.loads(arg), tok)
    else:
        c = genjax.constraints.regex(arg, tok)
except InputError as error:
    out = {"refused": str(error)[:90], "seconds": time.perf_counter() - start}
else:
    seconds = time.perf_counter() - start
    vsize = automata._vocabulary(tok, None).size
    t = time.perf_counter()
    table = jax.block_until_ready(tables.device_automaton(c, 1, vsize))
    out = {"seconds": seconds, "states": c.num_states, "edges": int(c.tokens.shape[0]),
           "table": type(table).__name__, "table_seconds": time.perf_counter() - t,
           "table_mib": sum(x.nbytes for x in jax.tree.leaves(table)) / 2**20}
out["peak_mib"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024
print(json.dumps(out))
"""


def _run(kind: str, arg: str, vocab: str, timeout: float) -> dict:
    try:
        done = subprocess.run(
            [sys.executable, "-c", CHILD, kind, arg, vocab],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return {"timeout": timeout}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if lines else {"error": done.stderr[-300:]}


def _line(name: str, vocab: str, r: dict) -> str:
    head = f"  {vocab:4s} {name:34s}"
    if "timeout" in r:
        return f"{head} still building after {r['timeout']:.0f} s"
    if "error" in r:
        return f"{head} failed: {r['error']!r}"
    if "refused" in r:
        return (
            f"{head} refused in {r['seconds']:6.2f} s, peak +{r['peak_mib']:5.0f} MiB: "
            f"{r['refused']}..."
        )
    return (
        f"{head} {r['seconds']:6.2f} s, peak +{r['peak_mib']:5.0f} MiB, states {r['states']:6d}, "
        f"transitions {r['edges']:9d}, {r['table']} {r['table_mib']:7.1f} MiB "
        f"in {r['table_seconds']:.2f} s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per case")
    parser.add_argument("--vocab", nargs="+", default=["4k", "50k"], choices=["4k", "50k", "128k"])
    parser.add_argument("--cases", nargs="+", help="only the cases whose name contains one")
    args = parser.parse_args()
    print(f"# python bench/structured_build.py (cpu: {cpu_model()}, {time.strftime('%Y-%m-%d')})")
    print("build (sizing + outlines-core Index + CSR read-out), then the device table:")
    for vocab in args.vocab:
        for name, kind, arg in CASES:
            if args.cases and not any(part in name for part in args.cases):
                continue
            print(_line(name, vocab, _run(kind, arg, vocab, args.timeout)), flush=True)


if __name__ == "__main__":
    main()
