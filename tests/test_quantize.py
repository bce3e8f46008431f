"""Weight-only int8 (``genjax.quantize``): the rounding bound, the int8 layers computing exactly
the dequantized model, the logit error and greedy agreement against float32, errors, and a mesh."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec

import genjax
import genjax.io.bundled
from genjax.errors import InputError, UnsupportedError
from genjax.kernels import rows as rows_kernel
from genjax.models import quantize as Q
from genjax.testing import write_random_checkpoint

pytestmark = pytest.mark.usefixtures("fast_compiles")

SHAPE = (4, 32)  # [B, T] of every forward pass, so that the tests share compiled programs
NEW = 24  # new tokens per row in the greedy test
ARCHS = {
    "llama": {},
    "llama_tied": {"tie_word_embeddings": True},
    "gpt2": {},  # tied wte head
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """name -> (model, float params, int8 params), from tiny random HF checkpoints."""
    models = {}
    for name, overrides in ARCHS.items():
        folder = tmp_path_factory.mktemp(name)
        write_random_checkpoint(folder, name.split("_")[0], seed=3, **overrides)
        model, params = genjax.models.from_pretrained(folder)
        models[name] = (model, params, genjax.quantize_params(model, params, "int8"))
    return models


@functools.partial(jax.jit, static_argnums=0)
def _jit_forward(model, params, ids, mask):
    positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)
    return model.apply(params, ids, positions, model.init_cache(*ids.shape), mask)[0]


def _forward(model, params, ids, mask=None):
    """float32[B, T, V] logits of one full forward pass: one program per model and param
    structure (float and int8), shared by the tests."""
    mask = np.ones(ids.shape, np.int32) if mask is None else mask
    return np.asarray(_jit_forward(model, params, jnp.asarray(ids, jnp.int32), jnp.asarray(mask)))


def _paths(tree) -> dict:
    """ "/"-joined path -> leaf."""
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    return {"/".join(k.key for k in path): x for path, x in leaves}


def _ids(vocab, shape=SHAPE, seed=0):
    return np.random.default_rng(seed).integers(0, vocab, shape)


def test_round_trip_error_is_at_most_half_a_step_per_channel():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((5, 64)).astype(np.float32)  # a kernel [out, in]
    w[1] *= 1e-3  # a small channel keeps its own fine scale
    w[2, 7] = 40.0  # an outlier only coarsens its own channel
    w[3] = 0.0  # an all-zero channel
    q, scale = Q.quantize_weight(w)
    q, scale = np.asarray(q), np.asarray(scale)
    assert q.dtype == np.int8 and scale.dtype == np.float32 and scale.shape == (5,)
    assert np.abs(q).max() <= 127
    np.testing.assert_allclose(scale, np.where(w.any(1), np.abs(w).max(1) / 127, 1.0), rtol=1e-6)
    error = np.abs(w - np.asarray(Q.dequantize_weight(q, scale)))
    assert np.all(error <= scale[:, None] / 2 * (1 + 1e-5))  # round to nearest: half a step
    top = np.abs(w).argmax(1)
    np.testing.assert_allclose(np.abs(q[range(5), top])[[0, 1, 2, 4]], 127)  # absmax exact
    np.testing.assert_array_equal(q[3], 0)
    # Another axis (axis=0) shares a scale along the columns instead.
    q_cols, col_scale = Q.quantize_weight(w.T, axis=0)
    np.testing.assert_array_equal(np.asarray(q_cols), q.T)
    np.testing.assert_array_equal(np.asarray(col_scale), scale)


def test_which_leaves_are_quantized(tiny):
    for name, (_, params, qparams) in tiny.items():
        flat = _paths(qparams)
        for path, x in _paths(params).items():
            if path.endswith("/kernel"):
                assert flat[path].dtype == jnp.int8 and flat[path].shape == x.shape
                assert flat[path + "_scale"].shape == (x.shape[0],)  # [out, in]: per row
            elif path in ("embed_tokens/embedding", "wte/embedding") and name != "llama":
                assert flat[path].dtype == jnp.int8, path  # the tied head, per vocab row
                assert flat[path + "_scale"].shape == (x.shape[0],)
            else:  # norms, biases, untied input table, GPT-2 positions: as they were
                assert flat[path] is x, path
    model, params, _ = tiny["gpt2"]
    kept = genjax.quantize_params(model, params, tied_head=False)
    assert kept["wte"]["embedding"] is params["wte"]["embedding"]
    assert Q.is_quantized(kept) and not Q.is_quantized(params)


@pytest.mark.parametrize("name", ["llama", "gpt2"])  # tied heads: GPT-2's wte, Llama's same Embed
def test_int8_layers_compute_the_dequantized_model(tiny, name):
    """int8 params give the logits of the float model whose weights are ``q * scale``: every
    dense layer and the tied head/lookup use the scales on the right axis."""
    model, _, qparams = tiny[name]

    def dequantize(tree):
        out = {}
        for key, value in tree.items():
            if isinstance(value, dict):
                out[key] = dequantize(value)
            elif key in ("kernel", "embedding") and key + "_scale" in tree:
                out[key] = Q.dequantize_weight(value, tree[key + "_scale"])
            elif not key.endswith("_scale"):
                out[key] = value
        return out

    ids = _ids(model.vocab_size)
    np.testing.assert_allclose(
        _forward(model, qparams, ids), _forward(model, dequantize(qparams), ids), atol=2e-5
    )


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's fusion of one-row products")
def test_one_row_int8_product_converts_in_place_inside_a_loop():
    """At batch 1 the int8 matrix is converted where the product reads it: the compiled decode-
    like loop holds no float copy of the matrix (a float copy is what made int8 decoding 2x
    slower than float32 on CPU). Several rows may still convert to a buffer first."""
    out_features, in_features = 1536, 576
    weight = jnp.ones((out_features, in_features), jnp.int8)
    scale = jnp.ones((out_features,), jnp.float32)
    float_copy = out_features * in_features * 4

    def loop(x, weight, scale):
        def step(_, x):
            y = genjax.models.layers.linear(x, weight, scale, jnp.float32)
            return x + jnp.tanh(y[..., :in_features])

        return jax.lax.fori_loop(0, 4, step, x)

    x = jnp.ones((1, 1, in_features), jnp.float32)  # one row, one position: batch-1 decoding
    compiled = jax.jit(loop).lower(x, weight, scale).compile()
    # (the values are test_int8_layers_compute_the_dequantized_model's)
    assert compiled.memory_analysis().temp_size_in_bytes < float_copy // 16


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's fusion of one-row products")
@pytest.mark.parametrize(
    "narrow, scaled, dtype",
    [("s8", True, jnp.float32), ("bf16", False, jnp.bfloat16)],
    ids=["int8", "bfloat16"],
)
def test_one_row_narrow_product_reads_activations_computed_once(narrow, scaled, dtype):
    """Where genjax's CPU kernel does not run (traced under ``rows.disabled()``; also widths not a
    multiple of 16, no compiler), the fused one-row product of int8 (or bfloat16) weights holds
    only the matrix's conversion and the product, so it reads the narrow matrix: the cheap
    elementwise ops that make its activations (here a norm-like scale and a GELU-like multiply)
    run once before it, not once per output inside its loop (GPT-2's int8 MLP down-projection
    was 2.3x slower that way), and no widened copy of the matrix is written (bfloat16's plain
    one-row product did that)."""
    out_features, in_features = 768, 3072
    weight = jnp.ones((out_features, in_features), {"s8": jnp.int8, "bf16": jnp.bfloat16}[narrow])
    scale = jnp.ones((out_features,), jnp.float32) if scaled else None
    gain = jnp.full((in_features,), 0.5, dtype)

    def loop(x, weight, scale):
        def step(_, x):
            activations = (x * gain + 1.0) * (x - 2.0)  # cheap ops, fusible into the product
            y = genjax.models.layers.linear(activations, weight, scale, dtype)
            return x + jnp.tanh(jnp.tile(y, 4))

        return jax.lax.fori_loop(0, 4, step, x)

    x = jnp.ones((1, 1, in_features), dtype)
    with rows_kernel.disabled():  # XLA's product, where genjax's CPU kernel does not run
        text = jax.jit(loop).lower(x, weight, scale).compile().as_text()
    products = [
        body
        for body in re.findall(r"\n(%fused_computation[^\n]*\{.*?\n\})", text, re.S)
        if " dot(" in body and f"{narrow}[{out_features},{in_features}]" in body
    ]
    assert products, f"no fused one-row {narrow} product found"
    for body in products:
        ops = set(re.findall(r"= \w+\[[\d,]*\]\{[\d,]*\} ([\w-]+)\(", body))
        assert ops <= {"parameter", "convert", "transpose", "copy", "bitcast", "dot"}, ops


def test_one_row_bfloat16_product_rounds_the_float32_sum_once():
    """The widened one-row bfloat16 product is the float32 sum of the exact products, rounded to
    bfloat16 once (as the plain bfloat16 product accumulated in float32), and agrees with the
    plain product that two rows take."""
    rng = np.random.default_rng(0)
    weight = jnp.asarray(rng.standard_normal((96, 256)), jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((2, 256)), jnp.bfloat16)
    linear = jax.jit(genjax.models.layers.linear, static_argnums=3)
    one_row = np.asarray(linear(x[:1], weight, None, jnp.bfloat16), np.float32)
    two_rows = np.asarray(linear(x, weight, None, jnp.bfloat16), np.float32)
    wide = np.asarray(x, np.float64)[:1] @ np.asarray(weight, np.float64).T
    half_step = np.abs(wide) * 2.0**-8 + 1e-5  # bfloat16 keeps 8 significant bits
    assert np.all(np.abs(one_row - wide) <= half_step)
    assert np.all(np.abs(one_row - two_rows[:1]) <= 2 * half_step)
    assert np.abs(one_row - two_rows[:1]).mean() < 1e-3  # nearly always the same rounding


def test_logits_stay_close_to_float32(tiny):
    """Each weight moves by at most half a step, 1/254 of its channel's absmax, with random
    signs, so each layer's output moves by a fraction of a percent and the errors of the layers
    and the head add up: these random 2-layer models measure 1.5% (Llama) and 1.0% (GPT-2) of
    max |logit| (the full-size bench shapes: 2-4%). 4% leaves margin for this fixed input
    without hiding a scale on the wrong axis (which moves logits by tens of percent)."""
    for name in ("llama", "gpt2"):
        model, params, qparams = tiny[name]
        ids = _ids(model.vocab_size)
        ref, got = _forward(model, params, ids), _forward(model, qparams, ids)
        assert np.abs(got - ref).max() <= 0.04 * np.abs(ref).max(), name
        assert np.abs(got - ref).max() > 0, name  # the int8 path did run


def test_greedy_generate_mostly_agrees_with_float32(tiny):
    """int8 params go through ``generate`` unchanged; its cached decoding picks the int8 model's
    full-forward argmax at every step; and float32 picks the same next token at nearly every
    position of that continuation (teacher forced, so one early flip does not count against
    every later token). Measured 95 of 96 (99%; 98-100% over seeds and both architectures): a
    flip needs a near tie that the ~1% logit error breaks, so 90% leaves margin while a wrong
    scale (logits off by tens of percent) fails it."""
    model, params, qparams = tiny["llama"]
    model = model.with_generation_config(None)  # no EOS from config.json: every step decodes
    prompt = SHAPE[1] - NEW
    ids = _ids(model.vocab_size, (SHAPE[0], prompt))
    config = genjax.GenerationConfig(max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    mask = np.ones(ids.shape, np.int32)  # (random ids may hold pad_token_id)
    seqs = np.asarray(genjax.generate(model, qparams, ids, config, attention_mask=mask).sequences)
    new = seqs[:, prompt:]
    window = slice(prompt - 1, -1)  # the logits that chose each new token
    np.testing.assert_array_equal(_forward(model, qparams, seqs)[:, window].argmax(-1), new)
    agreement = np.mean(_forward(model, params, seqs)[:, window].argmax(-1) == new)
    assert agreement >= 0.9, agreement


def test_several_rows_of_int8_compile_with_library_dots(tiny):
    """generate compiles int8 params at more rows than the rows kernel takes (33) with
    LIBRARY_DOT_OPTIONS, and XLA still knows them (its program holds YNNPACK fusions: a renamed
    option would drop them silently); rows the kernel takes (2), one row and float params keep
    the plain program, and so would 2 rows on a mesh, where the kernel stands aside. The greedy
    test above checks the library-dot program's tokens against the plain full forward."""
    from genjax.generation.entry import lower_program
    from genjax.generation.plan import CallRequest, prepare
    from genjax.kernels import rows as rows_kernel

    model, params, qparams = tiny["llama"]
    config = genjax.GenerationConfig(max_new_tokens=2, do_sample=False, pad_token_id=0)

    def plan_and_program(params, rows):
        ids = _ids(model.vocab_size - 1, (rows, 8)) + 1  # no padding (0)
        call = prepare(model, params, ids, config, CallRequest())
        return call.plan.library_dots, lower_program(call)

    dots, lowered = plan_and_program(qparams, rows_kernel.MAX_ROWS[jnp.dtype(jnp.int8)] + 1)
    assert dots and "__ynn_fusion" in lowered.compile().as_text()
    assert rows_kernel.kernel_available()
    assert not plan_and_program(qparams, 2)[0]
    assert not plan_and_program(qparams, 1)[0]
    assert not plan_and_program(params, 33)[0]
    assert Q.library_dots(qparams, 2, meshed=True) and not Q.library_dots(qparams, 1, True)
    with rows_kernel.disabled():  # GENJAX_KERNELS_OFF=rows's state
        assert Q.library_dots(qparams, 2)


def test_unsupported_modes_and_double_quantization_raise(tiny, tmp_path):
    model, params, qparams = tiny["llama"]
    with pytest.raises(UnsupportedError, match=r"mode='nf4'.*'int8'.*'int4'"):
        genjax.quantize_params(model, params, "nf4")
    # Checked before anything is read: a missing folder is not reached.
    with pytest.raises(UnsupportedError, match=r"quantize='nf4'.*quantize=None"):
        genjax.models.from_pretrained("/no/such/folder", quantize="nf4")
    with pytest.raises(InputError, match="already quantized"):
        genjax.quantize_params(model, qparams)
    with pytest.raises(InputError, match="params must be the nested dict"):
        genjax.quantize_params(model, [params])
    with pytest.raises(UnsupportedError, match="params are quantized"):
        genjax.models.save_params(model, qparams, tmp_path)


def test_sharded_int8_params_equal_one_device(tiny):
    """Scales shard like their kernel's output axis (column-parallel: on ``model``;
    row-parallel: replicated), and the sharded forward gives the single-device logits."""
    model, _, qparams = tiny["llama"]
    mesh = genjax.sharding.make_mesh((2, 4))
    sharded = genjax.sharding.shard_params(qparams, mesh)
    layer = sharded["layers"]["0"]
    assert layer["self_attn"]["q_proj"]["kernel"].sharding.spec == PartitionSpec("model", None)
    assert layer["self_attn"]["q_proj"]["kernel_scale"].sharding.spec == PartitionSpec("model")
    assert layer["mlp"]["down_proj"]["kernel_scale"].sharding.spec == PartitionSpec(None)
    axes = genjax.sharding.logical_axes(qparams)
    assert axes["layers/0/mlp/up_proj/kernel_scale"] == ("mlp",)
    assert axes["lm_head/kernel_scale"] == ("vocab",)
    ids = _ids(model.vocab_size)
    np.testing.assert_allclose(
        _forward(model, sharded, ids), _forward(model, qparams, ids), atol=1e-5
    )
