"""Building and loading genjax's native CPU kernels (XLA FFI custom calls).

A kernel is a C++ source file in this folder (``<name>.cc``, which may include the headers
beside it: its own ``<name>_*.h`` and shared ones such as ``team.h``), compiled on first use
with the machine's C++ compiler against the XLA FFI headers that jaxlib ships
(``jax.ffi.include_dir()``), for this CPU (``-march=native``), into ``$GENJAX_KERNEL_CACHE``
(default ``~/.cache/genjax/kernels``). The library's name carries a hash of the source and of
every header in the folder, the flags, jaxlib's version and the CPU's model and flags, so a
changed source or another machine sharing the folder builds its own copy.
A build is written to a temporary file and renamed into place, so concurrent processes (test
workers) never load a half-written library; nothing else in the folder is touched.

Why compiled at first use rather than at install: ``pip install genjax`` stays pure Python
(no build step, no wheel per platform), and ``-march=native`` can use the vector instructions
of the CPU that runs the kernel. The cost is one compile (about 5 seconds) per machine and
source version.

When no compiler is found or the build fails, :func:`load` returns None and :func:`problem`
says why; callers then take their pure-XLA path (slower, same results up to rounding).

Static or traced: nothing here is traced; it runs on the host when a program is traced.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile

import jax
import jaxlib

SOURCE_DIR = pathlib.Path(__file__).resolve().parent
_FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w")
_BUILD_TIMEOUT_S = 300
_problems: dict[str, str] = {}


def cache_dir() -> pathlib.Path:
    """The folder built kernels are kept in: ``$GENJAX_KERNEL_CACHE``, else
    ``~/.cache/genjax/kernels``."""
    configured = os.environ.get("GENJAX_KERNEL_CACHE")
    if configured:
        return pathlib.Path(configured)
    return pathlib.Path.home() / ".cache" / "genjax" / "kernels"


def compiler() -> str | None:
    """The C++ compiler to build with: ``$CXX``, else the first of ``c++``, ``g++``, ``clang++``
    on the PATH; None when there is none."""
    configured = os.environ.get("CXX")
    if configured:
        return shutil.which(configured) or configured
    for name in ("c++", "g++", "clang++"):
        found = shutil.which(name)
        if found:
            return found
    return None


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags as Linux's ``/proc/cpuinfo`` lists them (``avx512_bf16``,
    ``amx_bf16``...); empty where the file cannot be read (other systems)."""
    try:
        return flags_in(pathlib.Path("/proc/cpuinfo").read_text())
    except OSError:
        return frozenset()


def flags_in(cpuinfo: str) -> frozenset[str]:
    """The feature flags named on the ``flags`` lines of a ``/proc/cpuinfo`` text."""
    lines = cpuinfo.splitlines()
    named = (line.split(":", 1)[-1].split() for line in lines if line.startswith("flags"))
    return frozenset(flag for flags in named for flag in flags)


def _cpu_identity() -> str:
    """The CPU's model name and feature flags (``-march=native`` builds for exactly these)."""
    try:
        lines = pathlib.Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = [line for line in lines if line.startswith(("model name", "flags", "Features"))]
    return "\n".join(dict.fromkeys(wanted))  # one copy per distinct line, not one per core


@functools.cache
def load(name: str) -> ctypes.CDLL | None:
    """The library built from ``<name>.cc``, built first if needed; None if it cannot be built
    (see :func:`problem`). Cached per process."""
    source = SOURCE_DIR / f"{name}.cc"
    texts = [path.read_bytes() for path in [source, *sorted(SOURCE_DIR.glob("*.h"))]]
    identity = b"\0".join(
        [*texts, " ".join(_FLAGS).encode(), jaxlib.__version__.encode(), _cpu_identity().encode()]
    )
    digest = hashlib.sha256(identity).hexdigest()[:16]
    target = cache_dir() / f"{name}-{digest}.so"
    if not target.exists():
        error = _build(source, target)
        if error is not None:
            _problems[name] = error
            return None
    try:
        return ctypes.CDLL(str(target))
    except OSError as error:
        _problems[name] = f"the built library {target} could not be loaded: {error}"
        return None


def problem(name: str) -> str | None:
    """Why :func:`load` returned None for ``name`` (None if it did not, or was not called)."""
    return _problems.get(name)


def _build(source: pathlib.Path, target: pathlib.Path) -> str | None:
    """Compiles ``source`` into ``target``; returns None, or why it failed."""
    cxx = compiler()
    if cxx is None:
        return "no C++ compiler was found (set CXX, or install g++ or clang++)"
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        handle, partial = tempfile.mkstemp(suffix=".so.partial", dir=target.parent)
        os.close(handle)
    except OSError as error:
        return (
            f"the kernel folder {target.parent} is not writable ({error}); set GENJAX_KERNEL_CACHE"
        )
    command = [cxx, *_FLAGS, f"-I{jax.ffi.include_dir()}", str(source), "-o", partial]
    try:
        result = subprocess.run(
            command, capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S, check=False
        )
        if result.returncode != 0:
            return f"{' '.join(command)} failed:\n{result.stderr.strip()[-2000:]}"
        os.replace(partial, target)  # atomic: other processes see no file or a whole one
        return None
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"{' '.join(command)} failed: {error}"
    finally:
        if os.path.exists(partial):
            os.remove(partial)
