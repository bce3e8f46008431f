"""Shared test settings: 8 virtual CPU devices, set before JAX starts; shared fixtures."""

import gc
import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# `genjax generate` turns on JAX's persistent compilation cache (in the user's cache folder) for
# its whole process; tests that run the CLI in-process would leave it on for the rest of the
# session. Tests of the cache turn it on themselves, in a temporary folder.
os.environ["GENJAX_COMPILE_CACHE"] = "0"

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_enable_x64", False)


def _map_limit() -> int:
    try:
        with open("/proc/sys/vm/max_map_count") as file:
            return int(file.read())
    except (OSError, ValueError):
        return 65530  # Linux's default


def _map_count() -> int:
    try:
        with open("/proc/self/maps") as file:
            return sum(1 for _ in file)
    except OSError:
        return 0


@pytest.fixture(autouse=True, scope="module")
def release_compiled_programs():
    """Drops JAX's caches after a module once this process holds half the kernel's memory-map
    limit. XLA:CPU maps memory for every compiled program's code (about 3 maps per program,
    held while JAX caches the program); the suite compiles thousands, and at
    ``vm.max_map_count`` (65530 by default) the next compile segfaults inside LLVM
    (``tests/test_options.py`` alone leaves about 17,000 maps). Below half the limit nothing is
    dropped, so modules still share the programs of session fixtures."""
    yield
    if _map_count() > _map_limit() // 2:
        jax.clear_caches()
        gc.collect()


@pytest.fixture(scope="module")
def fast_compiles():
    """LLVM at -O0 (``jax_disable_most_optimizations``) for the rest of a module: about half of
    XLA's CPU compile time, while SPMD partitioning and the HLO passes still run (so the
    collectives, copies and loop carries tests look for are an optimized build's). A module opts
    in with ``pytestmark = pytest.mark.usefixtures("fast_compiles")``."""
    previous = jax.config.values["jax_disable_most_optimizations"]
    jax.config.update("jax_disable_most_optimizations", True)
    yield
    jax.config.update("jax_disable_most_optimizations", previous)
