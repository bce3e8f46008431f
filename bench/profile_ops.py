"""Where a ``generate`` call's time goes, per XLA operation, for several weight formats of the real
checkpoint: the per-fusion profile behind the dtype work (issue 29).

For each format (``bench/precision.py``'s: float32, bfloat16, int8, int4) the script compiles one
greedy ``generate`` call at ``--batch`` rows (random ``--prompt-length``-token prompts,
``--new-tokens`` new tokens), runs it ``--calls`` times under ``jax.profiler.trace`` and reads the
time of every XLA operation from the trace. Operations are labelled from the optimized HLO that
XLA dumps for the call (a temporary ``--xla_dump_to`` folder):

* the part of the call: ``decode`` (inside the decoding loop's body) or ``prompt`` (everything
  else: prefill, setup, the loop's own bookkeeping);
* the operation: a custom call by its target and weight operand (``genjax_rows_matmul_s8
  s8[1536,576]`` is the int8 row kernel on a 1536 x 576 matrix), any other by its kind (the
  fusion's name without its number: ``wrapped_convert``, ``ynn_fusion``, ...).

It prints, per label, milliseconds per call and operations per call for each format, the ratio
of each format's time to the first format's, and the wall time of a call (timed over as many
untraced calls). The trace is host
time on XLA:CPU's thunk executor; where two threads run operations at once their times add up,
so the rows can sum to more than the wall time.

Run:  python bench/profile_ops.py [--formats float32 int8] [--batch 32] [--new-tokens 40]
                                  [--prompt-length 32] [--calls 3] [--top 25]
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import tempfile
import time

DUMP = tempfile.mkdtemp(prefix="genjax-profile-ops-")
# Before JAX starts: XLA reads its flags once.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + f" --xla_dump_to={DUMP} --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*_generate.*"
)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _machine  # noqa: E402
from four_bit import real_checkpoint  # noqa: E402
from precision import FORMATS  # noqa: E402

_INSTRUCTION = re.compile(r"^\s*%(\S+) = (.*)$")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_OPERANDS = re.compile(r"operand_layout_constraints=\{((?:[^{}]|\{[^}]*\})*)\}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", nargs="+", choices=list(FORMATS), default=["float32", "int8"])
    parser.add_argument("--batch", type=int, default=32, help="rows (default 32)")
    parser.add_argument("--new-tokens", type=int, default=40, help="default 40")
    parser.add_argument("--prompt-length", type=int, default=32, help="default 32")
    parser.add_argument("--calls", type=int, default=3, help="traced calls (default 3)")
    parser.add_argument("--top", type=int, default=25, help="labels printed (default 25)")
    args = parser.parse_args(argv)
    if min(args.batch, args.new_tokens, args.prompt_length, args.calls, args.top) < 1:
        parser.error("--batch, --new-tokens, --prompt-length, --calls and --top must be >= 1")
    return args


def labels(hlo_text: str) -> dict[str, str]:
    """Operation name -> label (``"decode genjax_rows_matmul_s8 s8[1536,576]"``, ``"prompt
    ynn_fusion"``) for every instruction of an optimized HLO module's text."""
    out = {}
    for line in hlo_text.splitlines():
        match = _INSTRUCTION.match(line)
        if not match:
            continue
        name, rest = match.groups()
        part = "decode" if "/while/body/" in rest else "prompt"
        target = _TARGET.search(rest)
        if target:
            operands = _OPERANDS.search(rest)
            shapes = operands.group(1).split(", ") if operands else [""]
            weight = shapes[min(1, len(shapes) - 1)].split("{")[0]  # a product's weight
            out[name] = f"{part} {target.group(1)} {weight}".rstrip()
        else:
            out[name] = f"{part} {re.sub(r'[.0-9]+$', '', name)}"
    return out


def _new_module(before: set[str]) -> str:
    """The text of the one ``_generate`` module dumped since ``before`` was listed."""
    found = set(glob.glob(f"{DUMP}/*_generate*after_optimizations.txt")) - before
    if len(found) != 1:
        raise RuntimeError(f"expected one new _generate module in {DUMP}, found {sorted(found)}")
    with open(found.pop()) as file:
        return file.read()


def profile(model, params, ids, config, calls: int) -> tuple[dict, float]:
    """(label -> (milliseconds per call, operations per call), wall seconds per call, timed
    untraced)."""
    import jax

    import genjax

    before = set(glob.glob(f"{DUMP}/*_generate*after_optimizations.txt"))

    def call():
        genjax.generate(model, params, ids, config).sequences.block_until_ready()

    call()
    names = labels(_new_module(before))
    start = time.perf_counter()
    for _ in range(calls):
        call()
    wall = (time.perf_counter() - start) / calls  # untraced: the profiler slows calls down
    trace = tempfile.mkdtemp(prefix="genjax-trace-")
    with jax.profiler.trace(trace, create_perfetto_trace=True):
        for _ in range(calls):
            call()
    (path,) = glob.glob(f"{trace}/**/perfetto_trace.json.gz", recursive=True)
    with gzip.open(path) as file:
        events = json.load(file)
    events = events["traceEvents"] if isinstance(events, dict) else events
    time_ms, count = collections.Counter(), collections.Counter()
    for event in events:
        label = names.get(event.get("name")) if event.get("ph") == "X" else None
        if label:
            time_ms[label] += event.get("dur", 0) / 1e3 / calls
            count[label] += 1 / calls
    return {label: (time_ms[label], count[label]) for label in time_ms}, wall


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    path, _ = real_checkpoint()

    import jax.numpy as jnp
    import numpy as np

    import genjax

    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(100, 40000, (args.batch, args.prompt_length)), jnp.int32)
    config = genjax.GenerationConfig(
        max_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0
    )
    print(f"# {_machine.cpu_model()} ({', '.join(_machine.cpu_extensions())}), "
          f"{_machine.cpu_count()} threads; SmolLM2-135M-Instruct (Q4_1 GGUF); batch "
          f"{args.batch}, prompt {args.prompt_length}, {args.new_tokens} new tokens, "
          f"{args.calls} traced calls")  # fmt: skip
    results, walls = {}, {}
    for name in args.formats:
        model, params = genjax.models.from_pretrained(path, **FORMATS[name])
        results[name], walls[name] = profile(
            model.with_generation_config(None), params, ids, config, args.calls
        )
    first = args.formats[0]
    every = set().union(*results.values())
    top = sorted(every, key=lambda label: -max(r.get(label, (0, 0))[0] for r in results.values()))
    head = "".join(f" {name + ' ms':>13s} {'n':>6s} {'x' + first:>9s}" for name in args.formats)
    print(f"{'per call':58s}{head}")
    for label in top[: args.top]:
        cells = ""
        for name in args.formats:
            ms, n = results[name].get(label, (0.0, 0.0))
            base = results[first].get(label, (0.0, 0.0))[0]
            ratio = f"{ms / base:.2f}x" if base else "-"
            cells += f" {ms:13.1f} {n:6.0f} {ratio:>9s}"
        print(f"{label[:58]:58s}{cells}")
    for part in ("decode", "prompt"):
        cells = ""
        for name in args.formats:
            total = sum(ms for label, (ms, _) in results[name].items() if label.startswith(part))
            base = sum(ms for label, (ms, _) in results[first].items() if label.startswith(part))
            cells += f" {total:13.1f} {'':6s} {total / base:8.2f}x"
        print(f"{'all ' + part + ' operations':58s}{cells}")
    cells = "".join(
        f" {walls[name] * 1e3:13.1f} {'':6s} {walls[name] / walls[first]:8.2f}x"
        for name in args.formats
    )
    print(f"{'wall time of a call':58s}{cells}")


if __name__ == "__main__":
    main()
