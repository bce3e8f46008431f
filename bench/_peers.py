"""The libraries under test, each in a process of its own.

For every case the suite starts one fresh worker process per library (``genjax``, ``torch``
with its default dynamic cache, ``torch-static`` with ``cache_implementation="static"``, and on
request ``flax446``, transformers 4.46 Flax run by another interpreter: ``_flax_peer.py``). A
worker imports only its own library and loads the checkpoint once; the parent then drives the
workers in turn over a pipe, so runs interleave (genjax run, torch run, torch-static run, repeat)
while each process's resident memory belongs to one library and one case only. Idle workers
block on their pipe and use no CPU.

Memory: before each measured call a worker resets the kernel's resident-set high-water mark
(``VmHWM``, by writing ``5`` to ``/proc/self/clear_refs``) and reads it afterwards, so
``peak_rss_mb`` is the true peak RSS of that process during the call: the interpreter, the
library, the float32 weights, the caches and every temporary.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Callable

import _machine
import numpy as np

LIBS = ("genjax", "torch", "torch-static", "flax446")
DEFAULT_LIBS = ("genjax", "torch", "torch-static")  # flax446 needs its own venv: opt in
TORCH_LIBS = ("torch", "torch-static")
FLAX_LIB = "flax446"  # transformers 4.46.3 Flax, in another interpreter (bench/_flax_peer.py)
PAD_TOKEN_ID = 0
DTYPES = ("float32", "bfloat16", "int8")
"""Weight dtypes a column can run: ``int8`` is genjax's weight-only int8 (``quantize="int8"``);
transformers has no CPU int8 weight-only path without extra packages, so it gets no int8
column."""


def column(lib: str, dtype: str = "float32") -> str:
    """The name of a library's column at a dtype: ``lib`` for float32, else ``lib:dtype``."""
    return lib if dtype == "float32" else f"{lib}:{dtype}"


def split_column(name: str) -> tuple[str, str]:
    """``(lib, dtype)`` of a column name (the inverse of :func:`column`)."""
    lib, _, dtype = name.partition(":")
    return lib, dtype or "float32"


def columns(libs: list[str], dtypes: list[str]) -> list[str]:
    """Every column to run: each library at each dtype it has, dtype by dtype."""
    return [
        column(lib, dtype)
        for dtype in dtypes
        for lib in libs
        if not (dtype == "int8" and lib != "genjax")
        and not (dtype != "float32" and lib == FLAX_LIB)
    ]


def genjax_config(genjax, fields: dict, new_tokens: int):
    """The genjax ``GenerationConfig`` of a case: exactly ``new_tokens`` new tokens (no EOS, so
    no row stops early), pad id ``PAD_TOKEN_ID``, and the case's sampling ``fields``."""
    return genjax.GenerationConfig(
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        eos_token_id=None,
        pad_token_id=PAD_TOKEN_ID,
        **fields,
    )


class PeerError(Exception):
    """A worker could not do what it was asked.

    ``kind`` is ``"unavailable"`` when the library raised ``UnsupportedError`` (an option it does
    not support yet), ``"failed"`` for any other error or a worker that died.
    """

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind
        self.message = message


class Peer:
    """The parent's handle on one worker process; ``call`` sends an op and waits for its reply."""

    def __init__(self, lib: str, folder: str | None, python: str | None = None):
        """Starts the worker for column ``lib`` (a library, or ``library:dtype``); ``python`` is
        the Flax venv's interpreter, used for ``flax446`` only (that worker is a subprocess of
        that interpreter, see ``_flax_peer.start``)."""
        self.lib = lib
        if lib == FLAX_LIB:
            import _flax_peer

            self._conn, self._process = _flax_peer.start(folder, _flax_peer.python_path(python))
            self._plain = _flax_peer.plain
            return
        self._plain = None
        context = multiprocessing.get_context("spawn")  # no state inherited from the parent
        self._conn, child = context.Pipe()
        self._process = context.Process(
            target=serve, args=(child, lib, folder), name=f"bench-{lib}", daemon=True
        )
        self._process.start()
        child.close()

    def send(self, op: str, **kwargs) -> None:
        """Asks the worker to run ``op``; collect the answer with :meth:`receive`."""
        self._conn.send((op, self._plain(kwargs) if self._plain else kwargs))

    def receive(self):
        """The result of the last op sent; raises :class:`PeerError` if it failed."""
        try:
            reply = self._conn.recv()
        except EOFError:
            self._process.join(5)
            code = self._process.exitcode
            raise PeerError("failed", f"{self.lib} worker died (exit code {code})") from None
        if reply[0] == "error":
            raise PeerError(reply[1], reply[2])
        return reply[1]

    def call(self, op: str, **kwargs):
        """Runs ``op`` in the worker and returns its result."""
        self.send(op, **kwargs)
        return self.receive()

    def close(self) -> None:
        """Asks the worker to exit; terminates it if it does not within a few seconds."""
        try:
            self._conn.send(("close", {}))
        except (OSError, BrokenPipeError):
            pass
        self._process.join(10)
        if self._process.is_alive():
            self._process.terminate()
            self._process.join(5)
        self._conn.close()


def serve(conn, name: str, folder: str | None) -> None:
    """The worker's main loop for column ``name``: answer ops from the parent until ``close``."""
    lib, dtype = split_column(name)
    if lib in ("genjax", FLAX_LIB):  # leave accelerator memory to the other workers
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    runner = floor = None
    while True:
        op, kwargs = conn.recv()
        if op == "close":
            return
        try:
            if op == "load":
                runner = _runner_class(lib)(folder, lib, dtype)
                result = runner.info()
            elif op == "device_bandwidth":
                result = _machine.device_bandwidth()
            elif op == "floor_prepare":
                floor = _MatmulFloor(**kwargs)
                result = None
            elif op == "floor_run":
                result = floor.run()
            elif op in ("prepare", "warmup", "run", "device_peak_mb"):
                result = getattr(runner, op)(**kwargs)
            else:
                raise ValueError(f"unknown op {op!r}")
        except Exception as error:  # reported to the parent, which decides what to do
            conn.send(("error", _error_kind(error), f"{type(error).__name__}: {error}"))
        else:
            conn.send(("ok", result))


class _MatmulFloor:
    """genjax's products of a decode step alone at one row (``bench/matmul_floor.py``'s loop):
    the floor under a batch-1 step. Compiled once here, in a worker, so the parent holds no jax.

    Args:
        shape: a ``_cases.SHAPES`` name.
        depth: layers, as in the checkpoint the case runs.
        steps: steps per timed loop (the case's new tokens, so a loop lasts about as long as a
            generate call and sees the same share of the machine's noise).
    """

    def __init__(self, shape: str, depth: int, steps: int):
        import _cases
        import matmul_floor

        weights, head = matmul_floor.random_weights(_cases.SHAPES[shape], depth)
        self._loop = matmul_floor.genjax_loop(weights, head, rows=1, steps=steps)
        self._steps = steps

    def run(self) -> float:
        """One timed loop; seconds per step."""
        return _timed(self._loop) / self._steps


def _runner_class(lib: str) -> type[Runner]:
    if lib == FLAX_LIB:  # only ever imported in the Flax venv's interpreter
        from _flax_peer import FlaxRunner

        return FlaxRunner
    return GenjaxRunner if lib == "genjax" else TorchRunner


def _error_kind(error: Exception) -> str:
    names = {cls.__name__ for cls in type(error).__mro__}
    return "unavailable" if "UnsupportedError" in names else "failed"


class Runner:
    """Times one library's generate calls for one case; subclasses build the calls."""

    def __init__(self) -> None:
        self._full: Callable[[], None] | None = None
        self._first: Callable[[], None] | None = None

    def info(self) -> dict:
        """Facts about the loaded library: device, and the RSS after loading."""
        return dict(
            device=self.device_name(),
            accelerator=self.on_accelerator(),
            rss_after_load_mb=_machine.rss_mb(),
        )

    def prepare(self, ids: np.ndarray, fields: dict, new_tokens: int) -> None:
        """Builds the full-length call and the one-token (time-to-first-token) call."""
        self._full = self.make_call(ids, fields, new_tokens)
        self._first = self.make_call(ids, fields, 1) if new_tokens > 1 else None

    def warmup(self) -> dict:
        """Times the first full and first one-token calls (compilation included).

        Returns:
            ``first_s``, ``first_ttft_s``, and ``peak_rss_first_mb``: the peak RSS over loading
            and these first calls. The peak is reset afterwards.
        """
        first = _timed(self._full)
        first_ttft = _timed(self._first) if self._first else first
        peak = _machine.peak_rss_mb()
        _machine.reset_peak_rss()
        self.reset_device_peak()
        return dict(first_s=first, first_ttft_s=first_ttft, peak_rss_first_mb=peak)

    def run(self) -> dict:
        """One measured run: the full call, then the one-token call.

        Returns:
            ``total_s``, ``ttft_s`` (equal to ``total_s`` for one-token cases) and
            ``peak_rss_mb``, the process's peak RSS during the two calls (None where the peak
            cannot be reset).
        """
        exact = _machine.reset_peak_rss()
        total = _timed(self._full)
        ttft = _timed(self._first) if self._first else total
        return dict(
            total_s=total, ttft_s=ttft, peak_rss_mb=_machine.peak_rss_mb() if exact else None
        )

    def make_call(self, ids: np.ndarray, fields: dict, new_tokens: int) -> Callable[[], None]:
        """A no-argument function running one generate call to completion."""
        raise NotImplementedError

    def device_name(self) -> str:
        """The device the library runs on, in words."""
        raise NotImplementedError

    def on_accelerator(self) -> bool:
        """True when the library runs on a GPU or TPU rather than the host CPU."""
        raise NotImplementedError

    def reset_device_peak(self) -> None:
        """Starts a new accelerator-memory peak, where the library allows it."""

    def device_peak_mb(self) -> float | None:
        """Peak accelerator memory in use, in MiB, or None on the CPU."""
        return None


def _timed(call: Callable[[], None]) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def _check_shape(shape, ids: np.ndarray, new_tokens: int, lib: str, encoder_decoder=False):
    """Raises unless ``shape`` is the prompt and its new tokens (an encoder-decoder model: the
    decoder start token and the new tokens)."""
    expected = (ids.shape[0], (1 if encoder_decoder else ids.shape[1]) + new_tokens)
    if tuple(shape) != expected:
        raise RuntimeError(f"{lib} returned sequences of shape {tuple(shape)}, not {expected}")


class GenjaxRunner(Runner):
    """genjax on jax's default device, loaded with ``genjax.models.from_pretrained``: float32,
    bfloat16, or float32 activations with weight-only int8 (``quantize="int8"``)."""

    def __init__(self, folder: str, lib: str = "genjax", dtype: str = "float32"):
        super().__init__()
        import jax

        import genjax

        self._genjax, self._jax = genjax, jax
        if dtype == "int8":
            loaded = genjax.models.from_pretrained(folder, quantize="int8")
        else:
            loaded = genjax.models.from_pretrained(folder, dtype=dtype)
        self.model, self.params = loaded

    def device_name(self) -> str:
        device = self._jax.devices()[0]
        return f"jax {device.platform} ({device.device_kind})"

    def on_accelerator(self) -> bool:
        return self._jax.default_backend() != "cpu"

    def make_call(self, ids, fields, new_tokens):
        config = genjax_config(self._genjax, fields, new_tokens)
        prompts = np.asarray(ids, np.int32)
        key = self._jax.random.key(0)

        def call() -> None:
            out = self._genjax.generate(self.model, self.params, prompts, config, key=key)
            out.sequences.block_until_ready()
            seq2seq = getattr(self.model, "is_encoder_decoder", False)
            _check_shape(out.sequences.shape, prompts, new_tokens, "genjax", seq2seq)

        return call

    def device_peak_mb(self):
        stats = self._jax.devices()[0].memory_stats() or {}
        peak = stats.get("peak_bytes_in_use")
        return None if peak is None else peak / 2**20


class TorchRunner(Runner):
    """transformers PyTorch on CUDA if available, else the CPU with all usable threads."""

    def __init__(self, folder: str, lib: str = "torch", dtype: str = "float32"):
        super().__init__()
        import torch
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        torch.set_num_threads(_machine.cpu_count())
        self._torch = torch
        self.static = lib == "torch-static"
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.encoder_decoder = transformers.AutoConfig.from_pretrained(folder).is_encoder_decoder
        auto = transformers.AutoModelForSeq2SeqLM if self.encoder_decoder else None
        model = (auto or transformers.AutoModelForCausalLM).from_pretrained(
            folder, dtype=getattr(torch, dtype)
        )
        self.model = model.to(self.device).eval()
        self.model.generation_config.eos_token_id = None  # never stop early

    def device_name(self) -> str:
        if self.device.type == "cuda":
            return f"torch cuda ({self._torch.cuda.get_device_name(self.device)})"
        return f"torch cpu ({self._torch.get_num_threads()} threads)"

    def on_accelerator(self) -> bool:
        return self.device.type == "cuda"

    def make_call(self, ids, fields, new_tokens):
        torch = self._torch
        prompts = torch.from_numpy(np.asarray(ids, np.int64)).to(self.device)
        mask = torch.ones_like(prompts)
        kwargs = dict(
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            eos_token_id=None,
            pad_token_id=PAD_TOKEN_ID,
            **fields,
        )
        if self.static:
            kwargs["cache_implementation"] = "static"

        def call() -> None:
            with torch.inference_mode():
                out = self.model.generate(prompts, attention_mask=mask, **kwargs)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            _check_shape(out.shape, ids, new_tokens, "torch", self.encoder_decoder)

        return call

    def reset_device_peak(self) -> None:
        if self.device.type == "cuda":
            self._torch.cuda.reset_peak_memory_stats(self.device)

    def device_peak_mb(self):
        if self.device.type != "cuda":
            return None
        return self._torch.cuda.max_memory_allocated(self.device) / 2**20
