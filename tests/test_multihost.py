"""Two processes on localhost, one global 8-device mesh, the single-process tokens: a
decoder-only model with the ``model`` axis across the processes, and an encoder-decoder one with
the ``data`` axis across them.

Starts ``examples/multihost.py`` twice (process 0 and 1, 4 virtual CPU devices each, joined by
``jax.distributed.initialize`` with gloo collectives) on a ``(1, 8)`` mesh: the ``model`` axis
spans both processes, so every layer's row-parallel reductions (after ``o_proj`` and
``down_proj``) go between the processes. Both processes must write the greedy tokens and scores
that this single process computes from the same checkpoint and prompts. (Sampling with a fixed
key is not repeated here: it would compile a second program in each process; one process'
meshes give the single-device samples in ``tests/test_sharding.py``, and the two-process
example run with ``--strategies greedy,sample`` gives them too.)
"""

from __future__ import annotations

import json
import os
import queue
import socket
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import genjax
from genjax.testing import write_random_checkpoint

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import multihost  # noqa: E402

TIMEOUT_S = 300  # bound on each exit; a normal run takes 8 to 35 s on 2 loaded cores
ARGS = ["--mesh", "1,8", "--strategies", "greedy", "--output-scores"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _log(path: Path) -> str:
    """A process' stderr without gloo's connection chatter, last 3000 characters."""
    lines = path.read_text().splitlines() if path.exists() else []
    return "\n".join(line for line in lines if not line.startswith("[Gloo]"))[-3000:]


def _run_two_processes(checkpoint: Path, folder: Path, args: list[str]) -> list[dict]:
    """Runs the example as processes 0 and 1 and returns their JSON outputs.

    Fails (with both processes' stderr) as soon as one exits with an error, killing the other,
    which would otherwise wait for its peer in a collective. A thread per process waits for it
    to exit and queues its rank, so the test reacts to each exit when it happens; ``TIMEOUT_S``
    only bounds a run that hangs.
    """
    coordinator = f"localhost:{_free_port()}"
    env = {**os.environ, "JAX_DISABLE_MOST_OPTIMIZATIONS": "1"}  # compile at -O0: faster
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.pop("XLA_FLAGS", None)  # the script sets its own device count
    procs, logs = [], []
    for rank in range(2):
        logs.append(folder / f"stderr{rank}.txt")
        command = [
            sys.executable, str(ROOT / "examples" / "multihost.py"),
            "--process-id", str(rank), "--num-processes", "2", "--coordinator", coordinator,
            "--checkpoint", str(checkpoint), "--out", str(folder / f"out{rank}.json"), *args,
        ]  # fmt: skip
        with open(logs[rank], "w") as err:
            procs.append(subprocess.Popen(command, env=env, stdout=err, stderr=err))
    exits: queue.Queue[int] = queue.Queue()  # each rank, put when its process has exited
    waiters = [
        threading.Thread(target=lambda p=p, rank=rank: (p.wait(), exits.put(rank)), daemon=True)
        for rank, p in enumerate(procs)
    ]
    for waiter in waiters:
        waiter.start()
    try:
        for _ in procs:
            rank = exits.get(timeout=TIMEOUT_S)  # a bound only: raises queue.Empty when passed
            if procs[rank].returncode != 0:
                break  # its peer would wait for it in a collective: stop both now
    except queue.Empty:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for waiter in waiters:
            waiter.join()
    codes = [p.returncode for p in procs]
    if codes != [0, 0]:
        report = "\n".join(
            f"--- process {rank} (exit code {code}) stderr:\n{_log(log)}"
            for rank, (code, log) in enumerate(zip(codes, logs, strict=True))
        )
        raise AssertionError(
            f"the two-process run on {coordinator} failed or passed {TIMEOUT_S} s (a negative "
            f"exit code is the signal that killed it):\n{report}"
        )
    return [json.loads((folder / f"out{rank}.json").read_text()) for rank in range(2)]


pytestmark = pytest.mark.usefixtures("fast_compiles")  # LLVM at -O0: see conftest.py


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """8 query and 8 KV heads, so the (1, 8) mesh splits both, the cache included. (The same
    shape as tests/test_shard_map.py's: the single-device reference compiles once for both.)"""
    folder = tmp_path_factory.mktemp("multihost")
    write_random_checkpoint(
        folder, "llama", num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=8,
        head_dim=4,
    )  # fmt: skip
    return folder


def _single_process(checkpoint: Path, args: list[str], mesh_shape=None):
    """What one process' ``genjax.generate`` gives for the example's prompts and config, on one
    device or on a mesh of this process' 8 devices."""
    parsed = multihost.parse_args(["--checkpoint", str(checkpoint), "--out", "-", *args])
    ids, mask = multihost.prompts(parsed)
    model, params = genjax.models.from_pretrained(checkpoint)
    config = genjax.GenerationConfig(
        max_new_tokens=parsed.max_new_tokens, pad_token_id=parsed.pad_token_id, output_scores=True
    )
    mesh = None if mesh_shape is None else genjax.sharding.make_mesh(mesh_shape)
    return genjax.generate(model, params, ids, config, attention_mask=mask, mesh=mesh)


def _assert_same(results: list[dict], expected, mesh: dict, processes: list) -> None:
    for rank, result in enumerate(results):
        assert result["process_id"] == rank
        assert (result["num_processes"], result["local_devices"]) == (2, 4)
        assert result["mesh"] == mesh
        assert result["mesh_processes"] == processes
        np.testing.assert_array_equal(result["greedy"]["sequences"], expected.sequences)
        # Float32 tolerance: the processes' all-reduces may add the partial sums in another
        # order than one process's (on the AMD EPYC, T5's scores moved by up to 2.6e-5).
        np.testing.assert_allclose(
            result["greedy"]["scores"], expected.scores, atol=1e-4, rtol=1e-4
        )


def test_two_processes_get_the_single_process_tokens(checkpoint, tmp_path):
    results = _run_two_processes(checkpoint, tmp_path, ARGS)
    expected = _single_process(checkpoint, ARGS)
    # "model" spans both processes
    _assert_same(results, expected, {"data": 1, "model": 8}, [[0, 0, 0, 0, 1, 1, 1, 1]])


@pytest.mark.slow  # two processes (14 s): runs with -m slow
def test_two_processes_split_the_batch_as_one_process_splits_it(checkpoint, tmp_path):
    """The example's default (2, 4) mesh: each process holds half the prompt rows (a global
    array no process can read whole, padded to its bucket on the devices)."""
    args = ["--mesh", "2,4", *ARGS[2:]]
    results = _run_two_processes(checkpoint, tmp_path, args)
    expected = _single_process(checkpoint, args, (2, 4))
    np.testing.assert_array_equal(expected.sequences, _single_process(checkpoint, args).sequences)
    _assert_same(results, expected, {"data": 2, "model": 4}, [[0, 0, 0, 0], [1, 1, 1, 1]])


@pytest.mark.slow  # two processes compiling T5 (21 s): runs with -m slow
def test_two_processes_run_an_encoder_decoder_model_as_one(tmp_path):
    """T5 v1.1 (relative position bias, gated feed-forward; tests/fixtures/encdec) on a (2, 4)
    mesh: each process holds one ``data`` row of the source batch, its 4 heads split over
    ``model``; the encoder runs once and the decoder reads its cross-attention cache, the tokens
    and scores those of one process."""
    checkpoint = ROOT / "tests" / "fixtures" / "encdec" / "t5_v1_1"
    rng = np.random.default_rng(3)
    sources = [rng.integers(2, 64, n).tolist() for n in rng.integers(2, 7, 8)]  # vocabulary 64
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(sources))
    args = ["--mesh", "2,4", "--strategies", "greedy", "--output-scores"]
    args += ["--prompts", str(prompts), "--max-new-tokens", "5"]
    results = _run_two_processes(checkpoint, tmp_path, args)
    # The same program on this process' own (2, 4) mesh: the same sums in the same order. (Its
    # scores differ from one device's by up to about 7e-5 here: the model axis splits the
    # products' sums; tests/test_encdec_sharding.py compares meshes with one device.)
    expected = _single_process(checkpoint, args, (2, 4))
    alone = _single_process(checkpoint, args)
    assert expected.sequences.shape == (8, 6)  # the decoder start token, then 5 new tokens
    np.testing.assert_array_equal(expected.sequences, alone.sequences)
    _assert_same(results, expected, {"data": 2, "model": 4}, [[0, 0, 0, 0], [1, 1, 1, 1]])
