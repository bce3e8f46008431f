"""The machine: thread count, memory bandwidth, resident memory, and the software versions."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

COPY_BYTES = 512 * 2**20
COPY_REPEATS = 5


def cpu_count() -> int:
    """The CPUs this process may run on (``os.cpu_count()`` unless an affinity mask limits it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def host_bandwidth(nbytes: int = COPY_BYTES, repeats: int = COPY_REPEATS) -> dict:
    """Host memory bandwidth from a numpy copy of ``nbytes``: (read + write bytes) / time.

    The copy is split across ``cpu_count()`` threads (numpy releases the GIL while copying) and
    also timed on one thread; the best of ``repeats`` of each is kept.

    Returns:
        ``{"bytes_per_s", "single_thread_bytes_per_s", "threads", "copy_bytes", "repeats"}``;
        ``bytes_per_s`` is the better of the two.
    """
    src = np.ones(nbytes // 8, np.float64)
    dst = np.zeros_like(src)  # both touched, so no page faults are timed
    threads = cpu_count()
    single = _best_copy_rate(src, dst, 1, repeats)
    multi = _best_copy_rate(src, dst, threads, repeats) if threads > 1 else single
    return dict(
        bytes_per_s=max(single, multi),
        single_thread_bytes_per_s=single,
        threads=threads,
        copy_bytes=src.nbytes,
        repeats=repeats,
    )


def _best_copy_rate(src: np.ndarray, dst: np.ndarray, threads: int, repeats: int) -> float:
    """The best (read + write bytes) / second of copying ``src`` into ``dst`` on ``threads``."""
    edges = np.linspace(0, src.size, threads + 1).astype(int)
    parts = list(zip(edges[:-1], edges[1:], strict=True))
    copy = lambda part: np.copyto(dst[part[0] : part[1]], src[part[0] : part[1]])
    best = float("inf")
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(repeats):
            start = time.perf_counter()
            list(pool.map(copy, parts))
            best = min(best, time.perf_counter() - start)
    return 2 * src.nbytes / best


def device_bandwidth(nbytes: int = COPY_BYTES, repeats: int = 10) -> float | None:
    """Accelerator memory bandwidth from a jitted ``x + 1`` on ``nbytes`` of float32 (read +
    write bytes / best time), or None when jax runs on the CPU. Imports jax: call it only in a
    process that may own the accelerator."""
    import jax
    import jax.numpy as jnp

    if jax.default_backend() == "cpu":
        return None
    x = jnp.ones(nbytes // 4, jnp.float32)
    bump = jax.jit(lambda x: x + 1)
    bump(x).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        bump(x).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * x.nbytes / best


def rss_mb() -> float:
    """This process's resident set size now, in MiB (from /proc/self/status; Linux only)."""
    return _status_kib("VmRSS") / 1024


def peak_rss_mb() -> float:
    """This process's resident-set high-water mark (``VmHWM``) in MiB: since it started, or
    since the last :func:`reset_peak_rss`."""
    return _status_kib("VmHWM") / 1024


def reset_peak_rss() -> bool:
    """Resets ``VmHWM`` to the current RSS (Linux >= 4.0); False where that is not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as file:
            file.write("5")
        return True
    except OSError:
        return False


def _status_kib(field: str) -> float:
    try:
        with open("/proc/self/status") as file:
            for line in file:
                if line.startswith(field + ":"):
                    return float(line.split()[1])
    except OSError:
        pass
    return float("nan")


def environment() -> dict:
    """Versions and machine facts for the JSON report (imports nothing heavy)."""
    versions = {}
    for package in ("jax", "jaxlib", "torch", "transformers", "numpy", "genjax"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    return dict(
        versions=versions,
        python=sys.version.split()[0],
        platform=platform.platform(),
        machine=platform.machine(),
        processor=cpu_model(),
        cpu_extensions=cpu_extensions(),
        cpu_count=os.cpu_count(),
        usable_cpus=cpu_count(),
        git_commit=_git_commit(),
    )


EXTENSIONS = {
    "avx2": "AVX2",
    "fma": "FMA",
    "avx512f": "AVX-512",
    "avx512_vnni": "AVX-512 VNNI",
    "avx_vnni": "AVX-VNNI",
    "avx512_bf16": "AVX-512 BF16",
    "avx512_fp16": "AVX-512 FP16",
    "amx_tile": "AMX",
    "amx_bf16": "AMX BF16",
    "amx_int8": "AMX INT8",
}
"""The /proc/cpuinfo flags that decide which kernels the libraries can use, with their names."""


def cpu_extensions() -> list[str]:
    """The vector and matrix extensions of :data:`EXTENSIONS` this CPU reports (Linux only)."""
    try:
        with open("/proc/cpuinfo") as file:
            for line in file:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return [name for flag, name in EXTENSIONS.items() if flag in flags]
    except OSError:
        pass
    return []


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what ``platform`` says."""
    try:
        with open("/proc/cpuinfo") as file:
            for line in file:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _git_commit() -> str | None:
    """The repository's HEAD commit, with ``+dirty`` when the tree has changes."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain"], cwd=here, capture_output=True, text=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return commit + ("+dirty" if dirty else "")
