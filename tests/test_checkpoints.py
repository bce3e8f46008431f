"""Orbax checkpoints: exact round trips, sharded restore, atomic writes, clear errors."""

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
from types import SimpleNamespace

import jax
import numpy as np
import pytest

import genjax
from genjax.errors import CheckpointError
from genjax.io import checkpoints
from genjax.io.abandoned_reads import quiet_abandoned_reads
from genjax.testing import write_random_checkpoint


def assert_trees_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf")
    write_random_checkpoint(path, "llama", seed=3)
    (path / "generation_config.json").write_text(
        json.dumps({"max_new_tokens": 4, "eos_token_id": 2})
    )
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return path


@pytest.fixture(scope="module")
def converted(hf_folder, tmp_path_factory):
    return checkpoints.convert(hf_folder, tmp_path_factory.mktemp("ox") / "ckpt")


def test_convert_restores_identical_params_and_tokens(hf_folder, converted):
    model, params = genjax.models.from_pretrained(hf_folder)
    restored_model, restored = checkpoints.restore(converted)
    assert restored_model == model
    assert_trees_equal(restored, params)
    files = sorted(os.listdir(converted))
    assert files == [
        "config.json",
        "generation_config.json",
        checkpoints.LAYOUT_FILE,
        "params",
        "tokenizer_config.json",
    ]
    assert not [f for f in os.listdir(os.path.dirname(converted)) if f.startswith(".")]

    config = genjax.GenerationConfig.from_pretrained(converted)
    assert config == genjax.GenerationConfig.from_pretrained(hf_folder)
    ids = np.array([[5, 6, 7, 8]], np.int32)
    expected = genjax.generate(model, params, ids, config).sequences
    np.testing.assert_array_equal(genjax.generate(model, restored, ids, config).sequences, expected)
    # from_pretrained reads the orbax folder transparently.
    model_again, params_again = genjax.models.from_pretrained(converted)
    assert model_again == model
    assert_trees_equal(params_again, params)


def test_restore_into_shards_and_dtype(hf_folder, converted):
    _, params = genjax.models.from_pretrained(hf_folder)
    mesh = genjax.sharding.make_mesh((2, 4))
    model, sharded = checkpoints.restore(converted, mesh=mesh, dtype="bfloat16")
    assert model.dtype == np.dtype("bfloat16")
    expected = genjax.sharding.param_shardings(sharded, mesh)
    for leaf, sharding in zip(jax.tree.leaves(sharded), jax.tree.leaves(expected), strict=True):
        assert leaf.sharding == sharding and leaf.dtype == np.dtype("bfloat16")
    kernel = sharded["layers"]["0"]["mlp"]["up_proj"]["kernel"]
    assert kernel.addressable_shards[0].data.shape == (16, 32)  # [F, D], F=64 split 4 ways
    cast = jax.tree.map(lambda x: np.asarray(x).astype("bfloat16"), params)
    assert_trees_equal(jax.tree.map(np.asarray, sharded), cast)

    one = jax.sharding.SingleDeviceSharding(jax.devices()[3])
    _, placed = checkpoints.restore(converted, shardings=one)
    assert all(leaf.sharding == one for leaf in jax.tree.leaves(placed))
    assert_trees_equal(placed, params)


def test_save_refuses_to_overwrite_and_replaces_with_overwrite(hf_folder, tmp_path):
    model, params = genjax.models.from_pretrained(hf_folder)
    target = tmp_path / "ckpt"
    target.mkdir()  # an empty folder may be written into
    checkpoints.save(target, params, model_config=hf_folder)
    assert sorted(os.listdir(target)) == ["config.json", checkpoints.LAYOUT_FILE, "params"]
    with pytest.raises(CheckpointError, match="already exists and is not empty"):
        checkpoints.save(target, params, model_config=hf_folder)
    doubled = jax.tree.map(lambda x: 2 * x, params)
    checkpoints.save(target, doubled, model_config=hf_folder, overwrite=True)
    assert_trees_equal(checkpoints.restore(target)[1], doubled)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no temporary or old folder left


def test_failed_save_leaves_nothing_partial(hf_folder, tmp_path, monkeypatch):
    model, params = genjax.models.from_pretrained(hf_folder)
    target = tmp_path / "ckpt"

    def fail(path, params):
        os.makedirs(path)
        open(os.path.join(path, "half-written"), "w").close()
        raise OSError("disk full")

    monkeypatch.setattr(checkpoints, "_save_params", fail)
    with pytest.raises(OSError, match="disk full"):
        checkpoints.save(target, params, model_config=hf_folder)
    assert os.listdir(tmp_path) == []
    monkeypatch.undo()

    checkpoints.save(target, params, model_config=hf_folder)
    monkeypatch.setattr(checkpoints, "_save_params", fail)
    doubled = jax.tree.map(lambda x: 2 * x, params)
    with pytest.raises(OSError, match="disk full"):
        checkpoints.save(target, doubled, model_config=hf_folder, overwrite=True)
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["ckpt"]
    assert_trees_equal(checkpoints.restore(target)[1], params)  # the old checkpoint is intact


def test_save_checks_params_against_config_before_writing(hf_folder, tmp_path):
    _, params = genjax.models.from_pretrained(hf_folder)
    del params["layers"]["1"]
    with pytest.raises(CheckpointError, match=r"missing arrays \['layers/1/"):
        checkpoints.save(tmp_path / "ckpt", params, model_config=hf_folder)
    assert os.listdir(tmp_path) == []


def test_restore_errors_name_the_path_and_what_is_missing(hf_folder, converted, tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint folder at"):
        checkpoints.restore(tmp_path / "absent")
    with pytest.raises(CheckpointError, match=r"has no config.json and no params/.*safetensors"):
        checkpoints.restore(_copy_safetensors(hf_folder, tmp_path))
    layout = json.dumps(checkpoints.LAYOUT)
    broken = tmp_path / "broken"
    os.makedirs(broken / "params")
    (broken / "config.json").write_text((hf_folder / "config.json").read_text())
    (broken / checkpoints.LAYOUT_FILE).write_text(layout)
    with pytest.raises(CheckpointError, match="not a complete orbax checkpoint"):
        checkpoints.restore(broken)
    # A checkpoint from before kernels were stored [out, in]: refused, never loaded transposed.
    old = tmp_path / "old"
    os.makedirs(old)
    os.symlink(os.path.join(converted, "params"), old / "params")
    (old / "config.json").write_text((hf_folder / "config.json").read_text())
    with pytest.raises(CheckpointError, match=r"older genjax .*missing.*Convert the Hugging Face"):
        checkpoints.restore(old)
    other = tmp_path / "other"
    os.makedirs(other)
    os.symlink(os.path.join(converted, "params"), other / "params")
    config = json.loads((hf_folder / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    (other / checkpoints.LAYOUT_FILE).write_text(layout)
    with pytest.raises(CheckpointError, match=str(other) + r".*missing arrays \['layers/2/"):
        checkpoints.restore(other)


def test_overwrite_replaces_only_a_checkpoint_folder(hf_folder, tmp_path):
    _, params = genjax.models.from_pretrained(hf_folder)
    target = tmp_path / "mine"
    target.mkdir()
    (target / "notes.txt").write_text("keep me")
    for write in (
        lambda: checkpoints.save(target, params, model_config=hf_folder, overwrite=True),
        lambda: checkpoints.convert(hf_folder, target, overwrite=True),
    ):
        with pytest.raises(CheckpointError, match="is not a genjax checkpoint.*left as it is"):
            write()
        assert os.listdir(target) == ["notes.txt"] and sorted(os.listdir(tmp_path)) == ["mine"]


def test_a_killed_write_leaves_a_folder_the_next_write_removes(hf_folder, tmp_path):
    # kill -9 in the middle of a convert: the hidden folder holds what was written so far.
    target = tmp_path / "ckpt"
    stale = tmp_path / ".ckpt.genjax-tmp"
    os.makedirs(stale / "params")
    (stale / checkpoints.LAYOUT_FILE).write_text("{")
    checkpoints.convert(hf_folder, target)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    os.makedirs(stale)  # killed right after makedirs: empty, also ours
    checkpoints.convert(hf_folder, target, overwrite=True)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    # A folder of that name that genjax did not write is refused, not deleted.
    os.makedirs(stale)
    (stale / "mine.txt").write_text("keep me")
    with pytest.raises(CheckpointError, match=r"genjax-tmp.* is in the way.*remove it yourself"):
        checkpoints.convert(hf_folder, target, overwrite=True)
    assert os.listdir(stale) == ["mine.txt"]


@pytest.mark.parametrize(
    "sig, raised", [(signal.SIGTERM, SystemExit), (signal.SIGINT, KeyboardInterrupt)]
)
def test_sigterm_or_ctrl_c_during_a_write_removes_the_temporary_folder(
    hf_folder, tmp_path, monkeypatch, sig, raised
):
    _, params = genjax.models.from_pretrained(hf_folder)
    before = signal.getsignal(sig)
    seen = []

    def interrupted(path, params):
        os.makedirs(path)
        open(os.path.join(path, "half-written"), "w").close()
        seen.extend(os.listdir(tmp_path))
        signal.raise_signal(sig)  # the handler runs before the next line
        raise AssertionError("the signal did not interrupt the write")

    monkeypatch.setattr(checkpoints, "_save_params", interrupted)
    with pytest.raises(raised) as info:
        checkpoints.save(tmp_path / "ckpt", params, model_config=hf_folder)
    assert seen == [".ckpt.genjax-tmp"]
    assert os.listdir(tmp_path) == []
    assert signal.getsignal(sig) is before
    if raised is SystemExit:
        assert info.value.code == 128 + signal.SIGTERM


def test_restore_names_the_folder_when_a_data_file_is_missing(converted, tmp_path):
    # In a subprocess: orbax's abandoned reads may fail later on its threads, after the test.
    code = (
        "import sys; from genjax.io import checkpoints\n"
        "try: checkpoints.restore(sys.argv[1])\n"
        "except checkpoints.CheckpointError as e: print(e)\n"
    )
    for sub in ("d", "ocdbt.process_0/d"):
        copy = tmp_path / sub.replace("/", "_")
        shutil.copytree(converted, copy)
        data = copy / "params" / sub
        for name in os.listdir(data):
            os.remove(data / name)
        done = subprocess.run(
            [sys.executable, "-c", code, str(copy)], capture_output=True, text=True, timeout=300
        )
        message = done.stdout
        assert f"cannot read the params in {str(copy / 'params')!r}" in message, done.stderr
        assert "missing or corrupt" in message and "genjax convert" in message


def _copy_safetensors(source, tmp_path):
    folder = tmp_path / "hf_only"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes((source / "model.safetensors").read_bytes())
    return folder


def _report_through_hooks():
    """Reports one repeat and one unrelated error on each channel; returns what got through."""
    seen = []
    excepthook, unraisablehook = sys.excepthook, sys.unraisablehook
    sys.excepthook = lambda kind, error, tb: seen.append(("except", str(error)))
    sys.unraisablehook = lambda u: seen.append(("unraisable", str(u.exc_value)))
    return seen, excepthook, unraisablehook


def test_quiet_abandoned_reads_drops_only_the_repeats_and_keeps_its_filters_after_a_failure():
    seen, excepthook, unraisablehook = _report_through_hooks()
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("asyncio")
    logger.addHandler(handler)
    read_failure = Exception("Encountered error while reading array index: (slice(0, 4, 1),)")
    try:
        with pytest.raises(ValueError), quiet_abandoned_reads():
            raise ValueError("the restore failed")
        # After the failed restore, the abandoned reads report on every channel.
        sys.excepthook(RuntimeError, RuntimeError("Event loop is closed"), None)
        sys.excepthook(KeyError, KeyError("other"), None)
        sys.unraisablehook(SimpleNamespace(exc_value=read_failure))
        sys.unraisablehook(SimpleNamespace(exc_value=OSError("disk")))
        logger.error("Task exception was never retrieved", exc_info=(Exception, read_failure, None))
        logger.error("an unrelated asyncio error")
    finally:
        sys.excepthook, sys.unraisablehook = excepthook, unraisablehook
        logger.removeHandler(handler)
        for log_filter in list(logger.filters):
            logger.removeFilter(log_filter)
    assert seen == [("except", "'other'"), ("unraisable", "disk")]
    assert [r.getMessage() for r in records] == ["an unrelated asyncio error"]


def test_quiet_abandoned_reads_removes_its_filters_after_a_success():
    seen, excepthook, unraisablehook = _report_through_hooks()
    try:
        installed = (sys.excepthook, sys.unraisablehook)
        with quiet_abandoned_reads():
            pass
        assert (sys.excepthook, sys.unraisablehook) == installed
        assert logging.getLogger("asyncio").filters == []
    finally:
        sys.excepthook, sys.unraisablehook = excepthook, unraisablehook
    assert seen == []
