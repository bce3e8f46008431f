"""The ``flax446`` peer: transformers 4.46.3 Flax (jax 0.4.35, flax 0.10.2), the last release
with Flax generate, run in an interpreter of its own.

Those versions cannot share a virtualenv with genjax (which needs a recent jax), so this worker
runs under the Python of a separate virtualenv made by ``bench/setup_flax_peer.sh``. The parent
(``bench/run.py``) starts it with :func:`start`: a subprocess running this file, connected by a
socket pair that both ends wrap in a ``multiprocessing`` connection, so the parent drives it with
the same ops (``load``, ``prepare``, ``warmup``, ``run``...) and the same interleaving as the
other workers. Only the standard library, numpy and the bench's own ``_peers``/``_machine`` are
imported here besides the Flax stack; nothing from genjax.

How the peer generates: ``FlaxGPT2LMHeadModel`` / ``FlaxLlamaForCausalLM`` load the very same
safetensors checkpoint (transformers 4.46 converts a PyTorch-format safetensors file to Flax
without torch) in float32, and each call is ``jax.jit`` of ``model.generate`` with the params,
prompts, mask and PRNG key as arguments and the generation config closed over, the way
transformers' own Flax tests jit it. Calling ``model.generate`` without ``jax.jit`` runs the
prefill op by op and retraces the loop on every call (about 3x slower on a 2-layer GPT-2 here),
so it would understate the library. The first call of each compiled function is the warm-up
(its compilation shows in the compile column).

What 4.46 Flax cannot do: ``min_new_tokens`` does not exist there (it is not needed: with
``eos_token_id=None`` no row ever finishes, so every call runs to ``max_new_tokens``); beam
sampling and any option outside :data:`SUPPORTED_FIELDS` are reported as unavailable.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from multiprocessing.connection import Connection

import _peers
import numpy as np

LIB = "flax446"
PYTHON_ENV = "GENJAX_BENCH_FLAX_PYTHON"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_PYTHON = os.path.join(REPO, ".flax-peer-venv", "bin", "python")
VERSIONS = {"jax": "0.4.35", "jaxlib": "0.4.35", "flax": "0.10.2", "transformers": "4.46.3"}
SUPPORTED_FIELDS = ("do_sample", "num_beams", "temperature", "top_k", "top_p")
CLASSES = {"gpt2": "FlaxGPT2LMHeadModel", "llama": "FlaxLlamaForCausalLM"}
FLAX_ROPE_THETA = 10000.0  # 4.46 Flax Llama hard-codes this base


class UnsupportedError(Exception):
    """An option transformers 4.46 Flax does not have; the parent reports it as unavailable."""


class FlaxPeerSetupError(RuntimeError):
    """The Flax peer's interpreter is missing or does not have the pinned versions."""


# ---------------------------------------------------------------------------------------------
# Parent side: find and check the interpreter, start the worker.


def python_path(flag: str | None) -> str:
    """The Flax venv's interpreter: ``--flax-python``, else ``$GENJAX_BENCH_FLAX_PYTHON``, else
    ``.flax-peer-venv/bin/python`` at the repository root."""
    return flag or os.environ.get(PYTHON_ENV) or DEFAULT_PYTHON


def check_python(python: str) -> dict:
    """Checks that ``python`` runs and has the pinned Flax stack; returns its versions.

    Raises:
        FlaxPeerSetupError: naming the interpreter, what is wrong and how to fix it.
    """
    fix = (
        "run `bash bench/setup_flax_peer.sh` (it creates .flax-peer-venv), or point "
        f"--flax-python / ${PYTHON_ENV} at the python of a virtualenv with "
        + ", ".join(f"{k}=={v}" for k, v in VERSIONS.items())
    )
    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        raise FlaxPeerSetupError(
            f"--libs {LIB} needs the Flax peer's python, {python!r}: no such executable; {fix}"
        )
    probe = (
        "import importlib.metadata as m, json;"
        f"print(json.dumps({{p: m.version(p) for p in {sorted(VERSIONS)!r}}}))"
    )
    done = subprocess.run([python, "-c", probe], capture_output=True, text=True, env=_child_env())
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise FlaxPeerSetupError(
            f"{python} cannot report its jax/flax/transformers versions ({last}); {fix}"
        )
    found = json.loads(done.stdout)
    wrong = {p: v for p, v in found.items() if v != VERSIONS[p]}
    if wrong:
        raise FlaxPeerSetupError(f"{python} has {wrong}, expected {VERSIONS}; {fix}")
    return found


def _child_env() -> dict:
    """The parent's environment without what would make the child import the parent's
    packages."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share an accelerator
    return env


class _Process:
    """A ``subprocess.Popen`` behind the few ``multiprocessing.Process`` members ``Peer`` uses."""

    def __init__(self, popen: subprocess.Popen):
        self._popen = popen

    def join(self, timeout: float | None = None) -> None:
        try:
            self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    @property
    def exitcode(self) -> int | None:
        return self._popen.poll()

    def is_alive(self) -> bool:
        return self._popen.poll() is None

    def terminate(self) -> None:
        self._popen.send_signal(signal.SIGTERM)


def start(folder: str | None, python: str) -> tuple[Connection, _Process]:
    """Starts the worker under ``python``; returns the parent's connection and process handle.

    The worker's stdout goes to the parent's stderr, so the parent's stdout keeps only tables.
    """
    parent, child = socket.socketpair()
    command = [python, os.path.abspath(__file__), str(child.fileno()), folder or ""]
    popen = subprocess.Popen(
        command, pass_fds=(child.fileno(),), stdout=sys.stderr, env=_child_env(), cwd=REPO
    )
    child.close()
    return Connection(parent.detach()), _Process(popen)


def plain(kwargs: dict) -> dict:
    """Op arguments as plain Python values (numpy arrays become lists), so that the child's
    numpy version does not matter."""
    return {k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in kwargs.items()}


# ---------------------------------------------------------------------------------------------
# Child side: runs in the Flax venv.


def _load_model(folder: str):
    """The Flax model of the checkpoint in ``folder``, float32; rejects configs 4.46 Flax would
    silently misread."""
    import jax.numpy as jnp
    import transformers

    config = transformers.AutoConfig.from_pretrained(folder)
    if config.model_type not in CLASSES:
        raise UnsupportedError(f"model_type {config.model_type!r}: the bench maps {list(CLASSES)}")
    if config.model_type == "llama":
        _check_llama(config)
    cls = getattr(transformers, CLASSES[config.model_type])
    return cls.from_pretrained(folder, config=config, dtype=jnp.float32)


def _check_llama(config) -> None:
    """transformers 5 writes ``rope_parameters``; 4.46 Flax Llama uses base 10000 always and
    derives the head size from the width, so anything else would silently change the model."""
    rope = getattr(config, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(config, "rope_theta", FLAX_ROPE_THETA))
    if rope.get("rope_type", "default") != "default" or theta != FLAX_ROPE_THETA:
        raise UnsupportedError(
            f"rope {rope or theta}: transformers 4.46 Flax Llama supports only the default rope "
            f"with theta {FLAX_ROPE_THETA}"
        )
    head_dim = getattr(config, "head_dim", None)
    if head_dim not in (None, config.hidden_size // config.num_attention_heads):
        raise UnsupportedError(f"head_dim {head_dim}: 4.46 Flax Llama needs hidden/heads")
    if config.tie_word_embeddings:
        raise UnsupportedError("tie_word_embeddings=True: 4.46 Flax Llama has no tied head")


class FlaxRunner(_peers.Runner):
    """transformers 4.46 Flax generate under ``jax.jit`` on jax's default device."""

    def __init__(self, folder: str, lib: str = LIB, dtype: str = "float32"):
        super().__init__()
        import jax
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        self._jax = jax
        self.model = _load_model(folder)

    def info(self) -> dict:
        import importlib.metadata

        versions = {p: importlib.metadata.version(p) for p in sorted(VERSIONS)}
        return dict(super().info(), versions=versions)

    def device_name(self) -> str:
        device = self._jax.devices()[0]
        return f"jax {self._jax.__version__} {device.platform} ({device.device_kind})"

    def on_accelerator(self) -> bool:
        return self._jax.default_backend() != "cpu"

    def make_call(self, ids, fields, new_tokens):
        """One jitted ``model.generate``: params, prompts, mask and key are traced arguments;
        the generation config (strategy, lengths, sampling knobs) is closed over, i.e. static,
        as 4.46 Flax requires (its processors read the numbers in Python)."""
        import transformers

        unknown = sorted(set(fields) - set(SUPPORTED_FIELDS))
        if unknown:
            raise UnsupportedError(f"{unknown}: the Flax peer maps only {SUPPORTED_FIELDS}")
        if fields.get("do_sample") and fields.get("num_beams", 1) > 1:
            raise UnsupportedError("beam sampling is not implemented in 4.46 Flax generate")
        config = transformers.GenerationConfig(
            max_new_tokens=new_tokens, eos_token_id=None, pad_token_id=_peers.PAD_TOKEN_ID, **fields
        )
        prompts = np.asarray(ids, np.int32)  # int32[B, P]
        mask = np.ones_like(prompts)
        key = self._jax.random.PRNGKey(0)
        model = self.model

        @self._jax.jit
        def generate(params, prompts, mask, key):
            out = model.generate(prompts, config, prng_key=key, params=params, attention_mask=mask)
            return out.sequences  # int32[B, P + new_tokens]

        def call() -> None:
            sequences = generate(model.params, prompts, mask, key)
            sequences.block_until_ready()
            _peers._check_shape(sequences.shape, prompts, new_tokens, LIB)

        return call

    def device_peak_mb(self):
        stats = self._jax.devices()[0].memory_stats() or {}
        peak = stats.get("peak_bytes_in_use")
        return None if peak is None else peak / 2**20


def main(argv: list[str]) -> None:
    """Child entry point: ``python _flax_peer.py FD FOLDER``; serves ops on the socket FD."""
    fd, folder = int(argv[1]), argv[2] or None
    _peers.serve(Connection(fd), LIB, folder)


if __name__ == "__main__":
    main(sys.argv)
