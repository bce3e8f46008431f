"""The benchmark suite: genjax against transformers PyTorch on the same random weights.

For each model shape (GPT-2 small, SmolLM-135M), saves a random-weight checkpoint in Hugging
Face format, then times every case with genjax, transformers (default cache) and transformers
with ``cache_implementation="static"``, interleaved run by run, each library in its own process.
Prints a table per shape and the fraction of the memory-bandwidth limit that batch-1 greedy
decoding reaches; ``--json`` writes every number and the environment.

Run:  python bench/run.py [--quick] [--json out.json] [--shapes gpt2 smollm t5 | --real]
                          [--cases greedy_b1 ...] [--runs 3] [--libs genjax torch torch-static]
                          [--flax-python PATH] [--dtypes float32 bfloat16 int8]
Needs the `parity` extra (torch, transformers); `--libs ... flax446` also needs the venv that
bench/setup_flax_peer.sh makes. ``--dtypes`` adds a column per library and dtype
(``genjax:bfloat16``, ``torch:bfloat16``, ``genjax:int8`` for weight-only int8; transformers has
no int8 column) and
compares each narrow genjax column with genjax float32 and with transformers at the same dtype.
The header names the CPU and its vector extensions (AVX2, AVX-512, AVX-512 BF16, AMX): results
differ between the CPU kinds this project runs on, so record each run under its CPU's name.
See bench/README.md for the columns.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _cases  # noqa: E402
import _flax_peer  # noqa: E402
import _machine  # noqa: E402
import _report  # noqa: E402
from _peers import DEFAULT_LIBS, DTYPES, FLAX_LIB, LIBS, Peer, PeerError, columns  # noqa: E402

NEW_TOKENS = 128
QUICK_LAYERS = 2
QUICK_NEW_TOKENS = 16
FLOOR_CASE = "greedy_b1"  # the case timed next to the matmul-only floor


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke test: {QUICK_LAYERS} layers, {QUICK_NEW_TOKENS} new tokens, 1 run, "
        "batches 1 and 8 only",
    )
    parser.add_argument("--json", metavar="PATH", help="also write every number here")
    parser.add_argument("--shapes", nargs="+", choices=list(_cases.SHAPES), default=None)
    parser.add_argument(
        "--real",
        action="store_true",
        help="the real SmolLM2-135M-Instruct (bench/_real.py) instead of the random shapes",
    )
    parser.add_argument("--cases", nargs="+", choices=list(_cases.CASES), default=None)
    parser.add_argument(
        "--libs",
        nargs="+",
        choices=LIBS,
        default=list(DEFAULT_LIBS),
        help=f"default: {' '.join(DEFAULT_LIBS)}; {FLAX_LIB} (transformers 4.46.3 Flax) needs "
        "bench/setup_flax_peer.sh",
    )
    parser.add_argument(
        "--flax-python",
        metavar="PATH",
        help=f"python of the {FLAX_LIB} venv (default ${_flax_peer.PYTHON_ENV}, else "
        ".flax-peer-venv/bin/python)",
    )
    parser.add_argument(
        "--dtypes",
        nargs="+",
        choices=DTYPES,
        default=["float32"],
        help="weight dtypes to run (default float32); int8 = genjax's weight-only int8",
    )
    parser.add_argument("--runs", type=int, default=None, help="measured runs (default 3)")
    parser.add_argument("--new-tokens", type=int, default=None, help="default 128")
    parser.add_argument("--layers", type=int, default=None, help="default: the full depth")
    args = parser.parse_args(argv)
    if args.real and args.shapes:
        parser.error("--real runs the real checkpoint alone; leave out --shapes")
    args.shapes = ["real"] if args.real else args.shapes or _cases.RANDOM_SHAPES
    if args.runs is None:
        args.runs = 1 if args.quick else 3
    if args.new_tokens is None:
        args.new_tokens = QUICK_NEW_TOKENS if args.quick else NEW_TOKENS
    if args.layers is None and args.quick:
        args.layers = QUICK_LAYERS
    if args.runs < 1 or args.new_tokens < 2 or (args.layers is not None and args.layers < 1):
        parser.error("--runs and --layers must be at least 1, --new-tokens at least 2")
    if "real" in args.shapes and args.layers is not None:
        parser.error("the real checkpoint keeps its 30 layers: leave out --layers and --quick")
    args.columns = columns(args.libs, args.dtypes)
    args.flax_python = _flax_peer.python_path(args.flax_python)
    args.flax_versions = None
    if FLAX_LIB in args.libs:
        try:
            args.flax_versions = _flax_peer.check_python(args.flax_python)
        except _flax_peer.FlaxPeerSetupError as error:
            parser.error(str(error))
    return args


def log(message: str) -> None:
    """Progress on stderr, so that stdout holds only the tables."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def measure_bandwidth(libs: list[str]) -> dict:
    """Host bandwidth (numpy copy, here) and, with jax on an accelerator, its bandwidth (in a
    genjax worker, so that this process never holds accelerator memory)."""
    log("measuring memory bandwidth")
    host = _machine.host_bandwidth()
    bandwidth = dict(host=host, host_samples=[host["bytes_per_s"]], device_bytes_per_s=None)
    if "genjax" in libs:
        peer = Peer("genjax", None)
        try:
            bandwidth["device_bytes_per_s"] = peer.call("device_bandwidth")
        except PeerError as error:
            log(f"device bandwidth not measured: {error.message}")
        finally:
            peer.close()
    return bandwidth


def remeasure_host_bandwidth(bandwidth: dict) -> None:
    """Measures the host bandwidth again and keeps the best measurement so far: on a shared
    machine one measurement can land on a busy moment and understate the limit."""
    log("measuring host memory bandwidth again")
    host = _machine.host_bandwidth()
    bandwidth["host_samples"].append(host["bytes_per_s"])
    if host["bytes_per_s"] > bandwidth["host"]["bytes_per_s"]:
        bandwidth["host"] = host


class MatmulFloor:
    """genjax's matrix products of a batch-1 step alone (``bench/matmul_floor.py``'s loop, as
    many steps as the case decodes), in its own genjax worker. ``run_case`` times one loop per
    round of its runs, so each floor sample and each library's run of that round share the
    machine's moment, and floor / step is a ratio of paired samples. A failure is logged and
    leaves the samples taken so far."""

    def __init__(self, shape_name: str, depth: int, steps: int):
        log(f"{shape_name}: compiling the matmul-only floor at 1 row")
        self.ms: list[float] = []
        self._peer = Peer("genjax", None)
        self._live = True
        self._call("floor_prepare", shape=shape_name, depth=depth, steps=steps)

    def run(self) -> None:
        """One timed loop, kept in ``ms`` (ms per step)."""
        seconds = self._call("floor_run")
        if seconds is not None:
            self.ms.append(seconds * 1e3)

    def close(self) -> None:
        self._peer.close()

    def _call(self, op: str, **kwargs):
        """The op's result; None once the worker has failed (logged the first time)."""
        if not self._live:
            return None
        try:
            return self._peer.call(op, **kwargs)
        except PeerError as error:
            log(f"  matmul floor stopped: {error.message.splitlines()[0][:200]}")
            self._live = False
            return None


def run_case(case: _cases.Case, shape: _cases.Shape, folder: str, checkpoint: dict, args) -> dict:
    """Times one case with every library: fresh workers, one warm-up call each, then
    ``args.runs`` interleaved runs; for ``FLOOR_CASE`` (with genjax) also the matmul-only
    floor, once per round. Errors become ``{"error": ...}`` entries, never a crash."""
    new_tokens = case.tokens(args.new_tokens)
    ids = _cases.prompt_ids(case, checkpoint["vocab_size"])
    results = {name: {} for name in args.columns}
    peers = {name: Peer(name, folder, args.flax_python) for name in args.columns}
    floor = None
    try:
        live = _load(peers, results)
        live = _warm_up(peers, results, live, case, ids, new_tokens)
        if case.name == FLOOR_CASE and "genjax" in live and not shape.encoder_decoder:
            floor = MatmulFloor(shape.name, checkpoint["layers"], new_tokens)
        after_round = floor.run if floor else lambda: None
        live = _interleave(peers, results, live, case.name, args.runs, after_round)
        for lib in live:
            results[lib]["device_peak_mb"] = peers[lib].call("device_peak_mb")
            results[lib]["summary"] = _report.summarize(results[lib], case.batch, new_tokens)
    finally:
        for peer in peers.values():
            peer.close()
        if floor:
            floor.close()
    outcome = dict(
        title=case.title,
        batch=case.batch,
        prompt=case.prompt,
        new_tokens=new_tokens,
        strategy=case.sampling(),
        libs=results,
        ratio=_report.ratio(results),
        ratio_flax446=_report.ratio(results, against=(FLAX_LIB,)),
        dtype_ratios=_report.dtype_ratios(results),
    )
    if floor and floor.ms:
        outcome["matmul_floor"] = _report.floor_shares(floor.ms, results)
    return outcome


def _load(peers: dict, results: dict) -> list[str]:
    """Loads the checkpoint in every worker at once (nothing is timed yet); returns the
    libraries that loaded."""
    for peer in peers.values():
        peer.send("load")
    live = []
    for lib, peer in peers.items():
        ok, info = _attempt(results[lib], "load", peer.receive)
        if ok:
            results[lib]["load"] = info
            live.append(lib)
    return live


def _warm_up(peers, results, live, case, ids, new_tokens) -> list[str]:
    """Builds the calls and makes the first (compiling) ones, one library at a time so that
    they do not overlap; returns the libraries that succeeded."""
    ready = []
    for lib in live:
        log(f"  {case.name}: {lib} first call")
        call = peers[lib].call
        prepare = functools.partial(
            call, "prepare", ids=ids, fields=case.sampling(), new_tokens=new_tokens
        )
        if not _attempt(results[lib], "prepare", prepare)[0]:
            continue
        ok, warmup = _attempt(results[lib], "warmup", functools.partial(call, "warmup"))
        if ok:
            results[lib]["warmup"] = warmup
            ready.append(lib)
    return ready


def _interleave(peers, results, live, name: str, runs: int, after_round) -> list[str]:
    """``runs`` rounds of one run per library in turn, each round followed by
    ``after_round()``; returns the libraries that never failed (a library that fails drops
    out, keeping its error)."""
    live = list(live)
    for run in range(runs):
        log(f"  {name}: run {run + 1}/{runs}")
        for lib in list(live):
            ok, numbers = _attempt(results[lib], "run", functools.partial(peers[lib].call, "run"))
            if ok:
                results[lib].setdefault("runs", []).append(numbers)
            else:
                live.remove(lib)
        after_round()
    return live


def _attempt(result: dict, during: str, step) -> tuple[bool, object]:
    """Runs ``step()``; returns ``(True, value)``, or on a :class:`PeerError` stores
    ``result["error"]`` and returns ``(False, None)``."""
    try:
        return True, step()
    except PeerError as error:
        result["error"] = dict(kind=error.kind, during=during, message=error.message)
        log(f"    {error.kind}: {error.message.splitlines()[0][:200]}")
        return False, None


def run_shape(shape: _cases.Shape, args) -> dict:
    """Writes the shape's random checkpoint to a temporary folder (the real one: its folder) and
    runs every case on it."""
    layers = args.layers or shape.layers
    with contextlib.ExitStack() as stack:
        if shape.real:
            import _real

            folder = _real.model_folder()
            checkpoint = _cases.describe_checkpoint(folder)
        else:
            prefix = f"genjax-bench-{shape.name}-"
            folder = stack.enter_context(tempfile.TemporaryDirectory(prefix=prefix))
            log(f"{shape.name}: writing a random {layers}-layer checkpoint")
            checkpoint = _cases.write_checkpoint(shape, layers, folder)
        cases = {}
        for case in _cases.select_cases(args.cases, args.quick, shape):
            log(f"{shape.name}: {case.name} ({case.title})")
            cases[case.name] = run_case(case, shape, folder, checkpoint, args)
    return dict(
        title=shape.title,
        shape=dict(arch=shape.arch, full_layers=shape.layers, **shape.config),
        checkpoint=checkpoint,
        cases=cases,
    )


def main(argv: list[str] | None = None) -> int:
    """Runs the suite; returns 1 if any library failed (not merely unsupported), else 0."""
    args = parse_args(argv)
    report = dict(
        environment=_machine.environment(),
        settings=dict(
            quick=args.quick,
            runs=args.runs,
            new_tokens=args.new_tokens,
            layers=args.layers,
            libs=args.libs,
            dtypes=args.dtypes,
        ),
    )
    if args.flax_versions:
        report["environment"]["flax446"] = dict(
            python=args.flax_python,
            versions=args.flax_versions,
            call="jax.jit(model.generate) with params, prompts, mask and key as arguments",
        )
    report["bandwidth"] = measure_bandwidth(args.libs)
    report["shapes"] = {}
    _print_header(report)
    for name in args.shapes:
        shape = _cases.SHAPES[name]
        result = run_shape(shape, args)
        # The bandwidth limit counts every weight a decoder-only step reads.
        if "greedy_b1" in result["cases"] and not shape.encoder_decoder:
            remeasure_host_bandwidth(report["bandwidth"])
            result["bandwidth_fraction"] = _report.bandwidth_fractions(
                result["cases"]["greedy_b1"], result["checkpoint"], report["bandwidth"]
            )
        report["shapes"][name] = result
        print(_report.format_shape(result, report["bandwidth"]), flush=True)
        if args.json:
            _write_json(args.json, report)
    failed = _failures(report)
    if failed:
        print(f"\nfailed: {', '.join(failed)}", flush=True)
    return 1 if failed else 0


def _failures(report: dict) -> list[str]:
    """``shape/case/library`` for every library that failed a case (not merely unsupported)."""
    return [
        f"{shape}/{case}/{lib}"
        for shape, result in report["shapes"].items()
        for case, outcome in result["cases"].items()
        for lib, numbers in outcome["libs"].items()
        if numbers.get("error", {}).get("kind") == "failed"
    ]


def _print_header(report: dict) -> None:
    env, settings = report["environment"], report["settings"]
    versions = ", ".join(f"{k} {v}" for k, v in env["versions"].items() if v)
    print(f"{versions}; python {env['python']}")
    print(f"{env['platform']}; {env['processor']}; {env['usable_cpus']} usable CPUs")
    print(f"CPU vector extensions: {', '.join(env['cpu_extensions']) or 'none found'}")
    print(
        f"prompt 32 (prefill512: 512; t5: a 128-token source), {settings['new_tokens']} new "
        f"tokens, "
        f"median (min-max) of {settings['runs']} run(s); ratio = genjax / best torch speed"
    )
    flax = env.get(FLAX_LIB)
    if flax:
        pinned = ", ".join(f"{k} {v}" for k, v in flax["versions"].items())
        print(f"{FLAX_LIB}: {pinned} ({flax['call']}); vs {FLAX_LIB} = genjax / its speed")


def _write_json(path: str, report: dict) -> None:
    """Writes the report atomically: a partial file never replaces a complete one."""
    partial = path + ".partial"
    with open(partial, "w") as file:
        json.dump(report, file, indent=1)
    os.replace(partial, path)


if __name__ == "__main__":
    sys.exit(main())
