"""The int8 KV cache (``cache_implementation="quantized"``) against the float cache.

One tiny random GQA Llama (8 query heads, 4 KV heads, head dimension 8, so the cache and its
scales split on ``model`` of a (2, 4) mesh). Programs compile with
``jax_disable_most_optimizations`` as in ``tests/test_sharding.py``; the model, inputs and beam
config are those of ``tests/test_sharding.py``'s single-device beam reference, so in a full run
that float program compiles once for both files.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import genjax
from genjax.cache import KVCache
from genjax.cache.quantized import QuantizedKVCache, check_cache_options, dequantize, quantize
from genjax.errors import GenerationConfigError, UnsupportedError
from genjax.testing import MESH_LLAMA, left_padded_batch, write_random_checkpoint

BATCH, PROMPT, NEW = 8, 5, 24
QUANTIZED = {"cache_implementation": "quantized", "cache_config": {"nbits": 8}}
GREEDY = genjax.GenerationConfig(
    max_new_tokens=NEW, pad_token_id=0, eos_token_id=None, output_logits=True
)
BEAM = genjax.GenerationConfig(
    max_new_tokens=4, pad_token_id=0, output_scores=True, num_beams=2, num_return_sequences=2
)  # = tests/test_sharding.py's BEAM


pytestmark = pytest.mark.usefixtures("fast_compiles")  # LLVM at -O0: see conftest.py


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("quantized") / "llama"
    write_random_checkpoint(
        path,
        "llama",
        **MESH_LLAMA,
    )
    return genjax.models.from_pretrained(path)


@pytest.fixture(scope="module")
def inputs():
    return left_padded_batch(BATCH, PROMPT, 101)


@pytest.fixture(scope="module")
def run(llama, inputs):
    """(config name, quantized, mesh shape or None) -> output, computed once."""
    model, params = llama
    ids, mask = inputs
    configs = {"greedy": GREEDY, "beam": BEAM}

    @functools.cache
    def go(name, quantized, mesh_shape=None):
        mesh = None if mesh_shape is None else genjax.sharding.make_mesh(mesh_shape)
        extra = QUANTIZED if quantized else {}
        key = jax.random.key(7)
        out = genjax.generate(
            model, params, ids, configs[name], attention_mask=mask, key=key, mesh=mesh, **extra
        )
        return jax.tree.map(np.asarray, out)

    return go


# --- the code itself (no model) ---------------------------------------------------------------


@jax.jit
def _round_trip(x):
    """(codes, scales, dequantized) for float32 and bfloat16 scales, in one program."""
    out = {}
    for name, dtype in (("float32", jnp.float32), ("bfloat16", jnp.bfloat16)):
        codes, scales = quantize(x, dtype)
        out[name] = (codes, scales.astype(jnp.float32), dequantize(codes, scales, jnp.float32))
    return out


def test_round_trip_error_is_at_most_half_a_step():
    magnitudes = np.array([0.01, 1.0, 30.0, 1e3], np.float32)[:, None, None, None]
    x = np.random.default_rng(0).normal(size=(4, 5, 3, 16)).astype(np.float32) * magnitudes
    x[0, 0, 0] = 0.0  # an all-zero vector: scale 0, exact
    absmax = np.max(np.abs(x), axis=-1, keepdims=True)
    for name, (codes, scales, back) in jax.tree.map(np.asarray, _round_trip(x)).items():
        assert codes.dtype == np.int8, name
        np.testing.assert_array_equal(np.max(np.abs(codes), -1).ravel()[1:], 127)  # absmax
        error = np.abs(back - x)
        assert np.max(error - scales[..., None] / 2) <= 1e-6 * np.max(scales), name
        # So relative to its vector's largest number, at most 1/254 (plus the scale's rounding).
        relative = error / np.where(absmax > 0, absmax, 1)
        assert np.max(relative) <= (1 / 254) * (1 + 2**-8), name
        np.testing.assert_array_equal(back[0, 0, 0], 0.0)


@jax.jit
def _cache_ops(new, beams):
    """Writes 3 slots at index 1 of layer 1, then 1 slot at index 4; repeats rows 3 times and
    gathers beams. Returns the blocks update_layer gave and the dequantized caches."""
    batch, heads, dim = new.shape[1], new.shape[3], new.shape[4]
    cache = QuantizedKVCache.like(KVCache.create(2, batch, 6, heads, dim)).advance(1)
    keys, values, cache = cache.update_layer(1, new[0], new[1])
    later, _, _ = cache.advance(3).update_layer(1, new[0][:, :1], new[1][:, :1])
    repeated = cache.repeat_rows(beams.shape[1])

    def dequantized(c):  # float32[L, B, K, S, H]
        pairs = zip(c.keys, c.key_scales, strict=True)
        return jnp.stack([dequantize(k, s, jnp.float32) for k, s in pairs])

    return {
        "keys": keys,
        "values": values,
        "later": later,
        "stored": dequantized(cache),
        "repeated": dequantized(repeated),
        "gathered": dequantized(repeated.gather_beams(beams)),
    }


def test_update_returns_new_slots_exactly_and_rows_move_with_their_scales():
    batch, num_beams = 4, 3
    new = np.random.default_rng(1).normal(size=(2, batch, 3, 2, 8)).astype(np.float32)
    beams = np.array([[2, 2, 0], [1, 0, 1], [0, 0, 0], [2, 1, 0]], np.int32)  # [B, M]
    out = jax.tree.map(np.asarray, _cache_ops(new, beams))
    new_keys, new_values = new[0].swapaxes(1, 2), new[1].swapaxes(1, 2)  # [B, K, T, H]
    out["keys"], out["later"] = out["keys"].swapaxes(2, 3), out["later"].swapaxes(2, 3)  # [B,K,S,H]
    np.testing.assert_array_equal(out["keys"][:, :, 1:4], new_keys)  # the call's own slots: exact
    np.testing.assert_array_equal(out["values"][:, :, 1:4], new_values)
    stored = out["stored"]  # [L, B, K, S, H]
    np.testing.assert_allclose(stored[1, :, :, 1:4], new_keys, atol=np.max(np.abs(new)) / 254)
    assert not np.any(stored[0])  # the other layer is untouched
    np.testing.assert_array_equal(out["later"][:, :, 1:4], stored[1, :, :, 1:4])  # dequantized
    np.testing.assert_array_equal(out["repeated"], np.repeat(stored, num_beams, axis=1))
    rows = (np.arange(batch)[:, None] * num_beams + beams).reshape(-1)
    np.testing.assert_array_equal(out["gathered"], out["repeated"][:, rows])


def test_cache_options_are_honoured_or_rejected_by_name():
    assert check_cache_options("quantized", {"nbits": 8}) is True
    assert check_cache_options("quantized", {"nbits": 8, "residual_length": 0}) is True
    assert check_cache_options(None, None) is False
    assert check_cache_options("static", None) is False
    for options, pattern in [
        (None, r"needs cache_config\['nbits'\] = 8.*default is 4"),
        ({"nbits": 4}, r"cache_config\['nbits'\]=4 is not supported.*int8"),
        ({"nbits": 8, "backend": "hqq"}, r"cache_config\['backend'\]='hqq'"),
        ({"nbits": 8, "q_group_size": 64}, r"'q_group_size'\]=64 .*one head vector"),
        ({"nbits": 8, "axis_key": 0}, r"'axis_key'\]=0"),
        ({"nbits": 8, "residual_length": 128}, r"'residual_length'\]=128 .*set it to 0"),
    ]:
        with pytest.raises(UnsupportedError, match=pattern):
            check_cache_options("quantized", options)
    with pytest.raises(GenerationConfigError, match=r"unknown keys \['bits'\]"):
        check_cache_options("quantized", {"nbits": 8, "bits": 8})
    with pytest.raises(GenerationConfigError, match="only read with cache_implementation"):
        check_cache_options("static", {"nbits": 8})
    with pytest.raises(UnsupportedError, match="'offloaded'.*host memory"):
        check_cache_options("offloaded", None)


def test_generate_rejects_unsupported_cache_config_before_tracing(llama, inputs):
    model, params = llama
    with pytest.raises(UnsupportedError, match=r"cache_config\['nbits'\]=2"):
        genjax.generate(
            model, params, inputs[0], GREEDY, **{**QUANTIZED, "cache_config": {"nbits": 2}}
        )


# --- generate with the int8 cache ----------------------------------------------------------------


def _first_divergence(a, b):
    """Per row, the first step whose token differs (the length when none does)."""
    same = np.asarray(a) == np.asarray(b)
    return np.where(same.all(1), same.shape[1], np.argmin(same, axis=1))


def test_greedy_mostly_agrees_with_the_float_cache(run):
    exact, quantized = run("greedy", False), run("greedy", True)
    new_exact, new_quant = exact.sequences[:, PROMPT:], quantized.sequences[:, PROMPT:]
    # Measured on this model: 8 of 8 rows identical over 24 steps (0.999+ over seeds 0-4).
    assert np.mean(np.asarray(new_exact) == np.asarray(new_quant)) >= 0.9
    # The first step's logits come from the prefill, where every token attends to the exact
    # keys and values of its own call: they equal the float cache's to float32 rounding.
    logits_exact, logits_quant = np.asarray(exact.logits), np.asarray(quantized.logits)
    np.testing.assert_allclose(logits_quant[:, 0], logits_exact[:, 0], atol=1e-5)
    # Later steps read dequantized keys and values, each number within 1/254 of its head
    # vector's largest one; through two layers of attention that moves the logits by far less
    # than 1% of their range (measured: 0.1%). Compared up to each row's first divergence,
    # while both runs see the same tokens.
    limit = _first_divergence(new_exact, new_quant)
    spread = np.abs(logits_exact).max()
    for row in range(BATCH):
        steps = slice(0, min(limit[row] + 1, NEW))
        diff = np.abs(logits_quant[row, steps] - logits_exact[row, steps]).max()
        assert diff <= 0.01 * spread, (row, diff, spread)
    assert np.abs(logits_quant[:, 1:] - logits_exact[:, 1:]).max() > 0  # it does quantize


def test_beam_search_and_return_sequences_with_the_int8_cache(run):
    exact, quantized = run("beam", False), run("beam", True)
    assert quantized.sequences.shape == (BATCH * 2, PROMPT + 4)
    # Beams move codes and scales together (exact); the hypotheses are the float cache's, and
    # their scores (sums of 4 log-probabilities) move by the int8 error of later steps.
    np.testing.assert_array_equal(quantized.sequences, exact.sequences)
    np.testing.assert_allclose(quantized.scores[:, 0], exact.scores[:, 0], atol=1e-5)
    np.testing.assert_allclose(quantized.sequences_scores, exact.sequences_scores, atol=5e-3)
    assert np.abs(quantized.sequences_scores - exact.sequences_scores).max() > 0


def test_sharded_int8_cache_equals_one_device(run):
    one = run("greedy", True)
    sharded = run("greedy", True, (2, 4))
    np.testing.assert_array_equal(sharded.sequences, one.sequences)
    np.testing.assert_allclose(sharded.logits, one.logits, atol=1e-4, rtol=1e-5)
