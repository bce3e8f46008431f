"""Numbers from raw timings, the ratio to transformers, the bandwidth fraction, and the table."""

from __future__ import annotations

import statistics

from _peers import FLAX_LIB, TORCH_LIBS, column, split_column


def summarize(raw: dict, batch: int, new_tokens: int) -> dict:
    """Medians and ranges of one library's runs of one case.

    Args:
        raw: ``{"warmup": {...}, "runs": [{"total_s", "ttft_s", "peak_rss_mb"}, ...]}`` from
            the worker.
        batch: prompts per call (the returned sequences; beams are not counted).
        new_tokens: tokens generated per sequence.

    Returns:
        ``tok_s``, ``step_ms`` and ``ttft_ms`` as ``{"median", "min", "max", "values"}`` (
        ``tok_s`` and ``step_ms`` are None for one-token cases), ``compile_s`` (first call minus
        the median call) and ``peak_rss_mb`` (the highest peak over the runs).
    """
    runs = raw["runs"]
    totals = [run["total_s"] for run in runs]
    ttfts = [run["ttft_s"] for run in runs]
    decoding = new_tokens > 1
    steps = [(t - f) / max(new_tokens - 1, 1) * 1e3 for t, f in zip(totals, ttfts, strict=True)]
    peaks = [run["peak_rss_mb"] for run in runs if run["peak_rss_mb"] is not None]
    return dict(
        tok_s=spread([batch * new_tokens / t for t in totals]) if decoding else None,
        step_ms=spread(steps) if decoding else None,
        ttft_ms=spread([f * 1e3 for f in ttfts]),
        total_s=spread(totals),
        compile_s=raw["warmup"]["first_s"] - statistics.median(totals),
        peak_rss_mb=max(peaks) if peaks else None,
    )


def spread(values: list[float]) -> dict:
    """``{"median", "min", "max", "values"}`` of a list of measurements."""
    return dict(median=statistics.median(values), min=min(values), max=max(values), values=values)


def speed(summary: dict) -> float:
    """The number compared across libraries: new tokens/s, or 1/TTFT for a one-token case."""
    if summary["tok_s"] is not None:
        return summary["tok_s"]["median"]
    return 1e3 / summary["ttft_ms"]["median"]


def ratio(libs: dict, against: tuple[str, ...] = TORCH_LIBS) -> dict | None:
    """genjax speed over the best speed among ``against`` (default the transformers PyTorch
    variants; ``("flax446",)`` for the Flax peer); >1: genjax is faster. None when genjax or
    all of ``against`` were not measured."""
    genjax = libs.get("genjax", {}).get("summary")
    peers = {lib: libs[lib]["summary"] for lib in against if libs.get(lib, {}).get("summary")}
    if not genjax or not peers:
        return None
    best = max(peers, key=lambda lib: speed(peers[lib]))
    return dict(value=speed(genjax) / speed(peers[best]), against=best)


def dtype_ratios(libs: dict) -> dict:
    """For each narrow genjax column (``genjax:bfloat16``, ``genjax:int8``): its speed over
    genjax float32's (``vs_float32``) and over the best transformers column at the same dtype
    (``vs_torch``, with ``against``); a value is None when its peer was not measured."""

    def measured(name: str):
        return libs.get(name, {}).get("summary")

    out = {}
    for name in libs:
        lib, dtype = split_column(name)
        if lib != "genjax" or dtype == "float32" or not measured(name):
            continue
        mine = speed(measured(name))
        base = measured("genjax")
        peers = {column(t, dtype): measured(column(t, dtype)) for t in TORCH_LIBS}
        peers = {peer: summary for peer, summary in peers.items() if summary}
        best = max(peers, key=lambda peer: speed(peers[peer])) if peers else None
        out[name] = dict(
            vs_float32=mine / speed(base) if base else None,
            vs_torch=mine / speed(peers[best]) if best else None,
            against=best,
        )
    return out


WEIGHT_BYTES = {"float32": 4, "bfloat16": 2, "int8": 1}
"""Bytes per weight a decode step reads, by column dtype."""


def bandwidth_fractions(case: dict, checkpoint: dict, bandwidth: dict) -> dict | None:
    """How close batch-1 greedy decoding gets to the memory-bandwidth limit.

    A decode step must read every weight matrix (all parameters except embedding tables that are
    only indexed: one row of those is read), at its column's width (float32 4 bytes, bfloat16 2,
    int8 1), and the keys and values of the tokens so far; the figures printed are float32's.
    Over the decode steps (new tokens 2..N, the i-th attending to P + i slots) the cache read
    averages ``P + (N + 2) / 2`` tokens. Achieved bytes/s is that total over the measured median
    ms per step; the fraction divides it by the measured bandwidth of the device the library ran
    on.

    Returns:
        ``{"bytes_per_step", "param_bytes", "all_param_bytes", "kv_bytes", "libs": {lib:
        {"achieved_bytes_per_s", "limit_bytes_per_s", "fraction"}}}``, or None when the case
        has no decode steps.
    """
    prompt, new_tokens = case["prompt"], case["new_tokens"]
    if new_tokens < 2:
        return None
    param_bytes = 4 * (checkpoint["params"] - checkpoint["lookup_params"])
    kv_bytes = checkpoint["kv_bytes_per_token"] * (prompt + (new_tokens + 2) / 2)
    per_step = param_bytes + kv_bytes
    libs = {}
    for lib, result in case["libs"].items():
        summary = result.get("summary")
        if not summary:
            continue
        on_device = result["load"]["accelerator"]
        limit = bandwidth["device_bytes_per_s"] if on_device else bandwidth["host"]["bytes_per_s"]
        step_s = summary["step_ms"]["median"] / 1e3
        # A narrow column reads its matrices at their own width (int8: one byte, its float32
        # scales a rounding error); the cache stays in the activation dtype.
        width = WEIGHT_BYTES[split_column(lib)[1]]
        kv_width = 2 if split_column(lib)[1] == "bfloat16" else 4
        step_bytes = param_bytes * width / 4 + kv_bytes * kv_width / 4
        achieved = step_bytes / step_s if step_s > 0 else None  # None: lost in the noise
        libs[lib] = dict(
            achieved_bytes_per_s=achieved,
            limit_bytes_per_s=limit,
            fraction=achieved / limit if achieved and limit else None,
        )
    return dict(
        bytes_per_step=per_step,
        param_bytes=param_bytes,
        all_param_bytes=4 * checkpoint["params"],
        kv_bytes=kv_bytes,
        libs=libs,
    )


def _num(value: float | None) -> str:
    """A number with about three significant figures, or ``-``."""
    if value is None:
        return "-"
    if abs(value) >= 100:
        return f"{value:.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def _range(measured: dict | None) -> str:
    if measured is None:
        return "-"
    return f"{_num(measured['median'])} ({_num(measured['min'])}-{_num(measured['max'])})"


COLUMNS = (
    ("case", 11, "<"),
    ("library", 21, "<"),
    ("new tok/s", 20, ">"),
    ("ms/step", 20, ">"),
    ("TTFT ms", 20, ">"),
    ("compile s", 9, ">"),
    ("peak RSS MB", 11, ">"),
    ("vs torch", 17, "<"),
    (f"vs {FLAX_LIB}", 10, ">"),  # printed only when some case measured the Flax peer
)


def _line(cells: list[str]) -> str:
    columns = COLUMNS[: len(cells)]
    parts = [
        f"{cell:{align}{width}}" for cell, (_, width, align) in zip(cells, columns, strict=True)
    ]
    return "  ".join(parts).rstrip()


def format_shape(result: dict, bandwidth: dict) -> str:
    """The readable table of one model shape, then its bandwidth fractions."""
    checkpoint = result["checkpoint"]
    lines = [
        "",
        f"== {result['title']}: {checkpoint['layers']} layers, "
        f"{checkpoint['params'] / 1e6:.1f} M params (float32) ==",
        _devices(result["cases"]),
    ]
    flax = any(case.get("ratio_flax446") for case in result["cases"].values())
    columns = COLUMNS if flax else COLUMNS[:-1]
    lines.append(_line([name for name, _, _ in columns]))
    for name, case in result["cases"].items():
        lines.extend(_case_lines(name, case, flax))
    fractions = result.get("bandwidth_fraction")
    if fractions:
        lines.extend(_bandwidth_lines(fractions, bandwidth))
    for case in result["cases"].values():
        if case.get("matmul_floor"):
            lines.extend(_floor_lines(case["matmul_floor"]))
    return "\n".join(lines)


def _devices(cases: dict) -> str:
    """Where each library ran, from the first case that loaded it."""
    devices = {}
    for case in cases.values():
        for lib, result in case["libs"].items():
            if "load" in result:
                devices.setdefault(lib, result["load"]["device"])
    return "devices: " + "; ".join(f"{lib} on {device}" for lib, device in devices.items())


def _case_lines(name: str, case: dict, flax: bool = False) -> list[str]:
    lines = []
    for index, (lib, result) in enumerate(case["libs"].items()):
        label = name if index == 0 else ""
        if "error" in result:
            error = result["error"]
            lines.append(f"{label:<11}  {lib:<21}  {error['kind']}: {_short(error['message'])}")
            continue
        summary = result["summary"]
        versus = versus_flax = ""
        if lib == "genjax" and case.get("ratio"):
            versus = f"{case['ratio']['value']:.2f}x {case['ratio']['against']}"
        narrow = case.get("dtype_ratios", {}).get(lib)
        if narrow:
            versus = "; ".join(
                f"{narrow[key]:.2f}x {label}"
                for key, label in (("vs_float32", "genjax"), ("vs_torch", narrow["against"]))
                if narrow[key] is not None
            )
        if lib == "genjax" and case.get("ratio_flax446"):
            versus_flax = f"{case['ratio_flax446']['value']:.2f}x"
        cells = [
            label,
            lib,
            _range(summary["tok_s"]),
            _range(summary["step_ms"]),
            _range(summary["ttft_ms"]),
            _num(summary["compile_s"]),
            _num(summary["peak_rss_mb"]),
            versus,
        ]
        if flax:
            cells.append(versus_flax)
        lines.append(_line(cells))
    return lines


def _short(message: str, limit: int = 110) -> str:
    message = " ".join(message.split())
    return message if len(message) <= limit else message[: limit - 3] + "..."


def _achieved(numbers: dict) -> str:
    """``"9.9 GB/s = 12.3% of the limit"``, or why there is no fraction."""
    if numbers["achieved_bytes_per_s"] is None:
        return "-: ms/step is not positive (too few new tokens for the timing noise)"
    rate = f"{numbers['achieved_bytes_per_s'] / 1e9:6.1f} GB/s"
    if numbers["fraction"] is None:
        return rate + ", device bandwidth unknown"
    return f"{rate} = {100 * numbers['fraction']:5.1f}% of the limit"


def _bandwidth_lines(fractions: dict, bandwidth: dict) -> list[str]:
    host = bandwidth["host"]
    mb = {key: fractions[key] / 1e6 for key in ("bytes_per_step", "param_bytes", "kv_bytes")}
    limit = (
        f"memory bandwidth: host {host['bytes_per_s'] / 1e9:.1f} GB/s (numpy copy of "
        f"{host['copy_bytes'] / 2**20:.0f} MB, {host['threads']} threads, best of "
        f"{host['repeats']} x {len(bandwidth['host_samples'])} measurements)"
    )
    if bandwidth.get("device_bytes_per_s"):
        limit += f"; device {bandwidth['device_bytes_per_s'] / 1e9:.1f} GB/s (jitted x + 1)"
    lines = [
        limit,
        f"batch-1 greedy must read {mb['bytes_per_step']:.1f} MB per step: weights "
        f"{mb['param_bytes']:.1f} MB (all params {fractions['all_param_bytes'] / 1e6:.1f} MB, "
        f"less embedding tables that are only indexed) + KV cache {mb['kv_bytes']:.2f} MB on "
        f"average",
    ]
    for lib, numbers in fractions["libs"].items():
        lines.append(f"  {lib:<12} {_achieved(numbers)}")
    return lines


def floor_shares(floor_ms: list[float], results: dict) -> dict:
    """The matmul-only floor's ms per step, one sample per round of a case's runs, and each
    library's floor / step per round (its step from the run of the same round), for the libraries
    that ran every round.

    Returns:
        ``{"ms": spread, "share": {lib: spread}}`` (see :func:`spread`).
    """
    shares = {}
    for lib, result in results.items():
        step = (result.get("summary") or {}).get("step_ms")
        if step and len(step["values"]) == len(floor_ms):
            shares[lib] = spread([f / s for f, s in zip(floor_ms, step["values"], strict=True)])
    return dict(ms=spread(floor_ms), share=shares)


def _floor_lines(floor: dict) -> list[str]:
    """Each library's batch-1 step against genjax's products alone at one row: floor / step,
    so 100% means a step costs no more than its matrix products."""
    lines = [
        "matmul-only floor at 1 row (bench/matmul_floor.py's loop, genjax's products, one loop "
        f"per round of runs): {_range(floor['ms'])} ms per step"
    ]
    for lib, share in floor["share"].items():
        lines.append(
            f"  {lib:<12} floor / step, paired by round: {share['median']:.1%} "
            f"({share['min']:.1%}-{share['max']:.1%})"
        )
    return lines
