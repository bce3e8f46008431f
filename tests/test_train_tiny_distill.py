"""examples/train_tiny.py's distillation loss, --init-from and --distill-from."""

from __future__ import annotations

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import genjax
import genjax.testing
from genjax.models import from_config

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import train_tiny  # noqa: E402

pytestmark = pytest.mark.usefixtures("fast_compiles")


def _tiny_pair():
    """A student and a teacher (tiny Llamas of different widths, one vocabulary), their params
    and a batch of int32[2, 9] windows."""
    student = from_config(genjax.testing.tiny_config("llama", num_hidden_layers=1))
    teacher = from_config(genjax.testing.tiny_config("llama"))
    params = student.init_params(jax.random.key(0))
    teacher_params = teacher.init_params(jax.random.key(1))
    windows = np.random.default_rng(0).integers(0, student.vocab_size, (2, 9)).astype(np.int32)
    return student, params, teacher, teacher_params, windows


def test_distill_loss_is_soft_cross_entropy_mixed_with_hard_labels():
    student, params, teacher, teacher_params, windows = _tiny_pair()

    @jax.jit  # one compiled program for every quantity below
    def quantities(params, teacher_params, windows):
        soft_fn = train_tiny.make_distill_loss(student, teacher, 1.0)
        self_fn = train_tiny.make_distill_loss(student, student, 1.0)
        p_teacher = jax.nn.softmax(train_tiny._forward(teacher, teacher_params, windows[:, :-1]))
        log_q = jax.nn.log_softmax(train_tiny._forward(student, params, windows[:, :-1]))
        return {
            "hard": train_tiny.make_loss(student)(params, windows),
            "soft": soft_fn(params, teacher_params, windows),
            "mixed": train_tiny.make_distill_loss(student, teacher, 0.25)(
                params, teacher_params, windows
            ),
            "only_hard": train_tiny.make_distill_loss(student, teacher, 0.0)(
                params, teacher_params, windows
            ),
            # The definition: mean over positions of -sum_v p_teacher(v) log p_student(v).
            "soft_by_hand": -jnp.sum(p_teacher * log_q, -1).mean(),
            "teacher_grads": jax.grad(soft_fn, argnums=1)(params, teacher_params, windows),
            "self": self_fn(params, params, windows),
            "entropy": -jnp.sum(jnp.exp(log_q) * log_q, -1).mean(),
            "self_grads": jax.grad(self_fn)(params, params, windows),
        }

    q = quantities(params, teacher_params, windows)
    np.testing.assert_allclose(q["soft"], q["soft_by_hand"], rtol=1e-6)
    np.testing.assert_allclose(q["mixed"], 0.25 * q["soft"] + 0.75 * q["hard"], rtol=1e-6)
    np.testing.assert_allclose(q["only_hard"], q["hard"], rtol=1e-6)
    assert q["soft"] > q["hard"] / 10  # not a degenerate zero
    # The teacher is a constant: no gradient reaches its params.
    assert all(not np.any(np.asarray(g)) for g in jax.tree.leaves(q["teacher_grads"]))
    # A student distilled from itself is at the minimum (KL = 0): the loss is its entropy and
    # the gradient vanishes.
    np.testing.assert_allclose(q["self"], q["entropy"], rtol=1e-6)
    assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(q["self_grads"])) < 1e-6


def _base_folder(folder):
    """A random draft-size model with a 300-token BPE of the first 3 stdlib files, as an HF
    folder (what ``train_tiny.main`` would export, without training it)."""
    train_files, _ = train_tiny.stdlib_files(40)
    tokenizer = train_tiny.train_tokenizer(train_tiny.read_texts(train_files[:3]), 300)
    eos = tokenizer.token_to_id(train_tiny.SPECIAL)
    config = train_tiny.hf_config(train_tiny.SIZES["draft"], tokenizer.get_vocab_size(), eos, 256)
    model = from_config(config, dtype="float32")
    params = model.init_params(jax.random.key(0))
    train_tiny.write_folder(folder, model, params, config, tokenizer.to_str(), eos)


@pytest.mark.slow  # the example end to end (25 s): runs with -m slow
def test_init_from_and_distill_from_end_to_end(tmp_path):
    base = tmp_path / "base"
    _base_folder(base)
    # One step from base's weights, distilled from base itself: the first step's learning rate
    # is 0 (warmup), so the exported weights are base's, and the student agrees with the
    # teacher everywhere.
    args = ["--size", "draft", "--max-files", "3", "--holdout-every", "40", "--steps", "1"]
    args += ["--tokenizer", str(base), "--init-from", str(base)]
    distill = ["--distill-from", str(base), "--distill-weight", "0.5"]
    out = ["--workdir", str(tmp_path / "w"), "--out", str(tmp_path / "d")]
    train_tiny.main([*args, *distill, *out])
    result = json.loads((tmp_path / "w" / "eval.json").read_text())
    assert result["valid_teacher_top1_agreement"] == 1.0
    assert result["distill_from"] == str(base) and result["distill_weight"] == 0.5
    assert result["init_from"] == str(base) and np.isfinite(result["valid_nats_per_token"])
    _, want = genjax.models.from_pretrained(base)
    _, got = genjax.models.from_pretrained(tmp_path / "d")
    jax.tree.map(np.testing.assert_array_equal, got, want)

    # A folder of another shape, or a teacher with another vocabulary: clear errors.
    wrong_size = [*args[2:], "--workdir", str(tmp_path / "w2"), "--out", str(tmp_path)]
    with pytest.raises(SystemExit, match="--init-from .* shapes of --size default"):
        train_tiny.main(wrong_size)
    other = tmp_path / "other"
    genjax.testing.write_random_checkpoint(other, "llama")  # vocabulary of 101 tokens
    with pytest.raises(SystemExit, match="--distill-from .* 101 tokens .* 300"):
        train_tiny.main([*args, "--distill-from", str(other), *out])
