"""``output_hidden_states`` / ``output_attentions`` against recorded transformers runs.

The fixtures (``tests/fixtures/hidden_states``, by ``make_hidden_states_fixtures.py``) hold
transformers' per-step hidden states and attention weights of a left-padded batch of two (three
pads, none; P = 9) on the tiny llama, gpt2 and mistral (sliding window 4 < P) checkpoints. genjax
pads that prompt to a 16-slot bucket and must return none of those slots. Query rows of the
user's padding are compared only for the embeddings (see :mod:`genjax.generation.outputs`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import genjax
from genjax import GenerationConfig
from genjax.errors import UnsupportedError
from genjax.models import LlamaModel

pytestmark = pytest.mark.usefixtures("fast_compiles")

FIXTURES = Path(__file__).parent / "fixtures"
RECORDED = [("llama", "greedy"), ("llama", "beam"), ("gpt2", "greedy"), ("mistral", "greedy")]
ATOL = 1e-4


@functools.cache
def _model(arch: str):
    return genjax.models.from_pretrained(FIXTURES / arch)


@functools.cache
def _recorded(arch: str):
    meta = json.loads((FIXTURES / "hidden_states" / f"{arch}.json").read_text())
    return meta, dict(np.load(FIXTURES / "hidden_states" / f"{arch}.npz"))


def _config(kwargs: dict, **changes) -> GenerationConfig:
    kwargs = {k: v for k, v in kwargs.items() if k != "return_dict_in_generate"}
    return GenerationConfig(**{**kwargs, **changes})


@functools.cache
def _generate(arch: str, case: str, **changes):
    """genjax's output of a recorded case (shared by the tests: one program per case)."""
    meta, arrays = _recorded(arch)
    (kwargs,) = [c["generate_kwargs"] for c in meta["cases"] if c["name"] == case]
    model, params = _model(arch)
    ids, mask = arrays["input_ids"], arrays["attention_mask"]
    config = _config(kwargs, **changes)
    return genjax.generate(model, params, ids, config, attention_mask=mask, key=jax.random.key(0))


def _as_arrays(out, name: str) -> dict[str, np.ndarray]:
    """``out.<name>`` (a tuple per step of a tuple per layer) keyed like the fixtures."""
    return {
        f"{name}/{t}/{layer}": np.asarray(value)
        for t, step in enumerate(getattr(out, name))
        for layer, value in enumerate(step)
    }


def _check(out, arrays: dict, case: str, mask: np.ndarray, rows_per_prompt: int) -> None:
    """Every recorded array of ``case`` against ``out``: tokens exactly, the rest to ATOL. At
    the first step the queries of padding slots are compared for the embeddings only."""
    real = np.repeat(mask, rows_per_prompt, axis=0).astype(bool)  # [rows, P]
    steps = arrays[f"{case}/scores"].shape[1]
    np.testing.assert_array_equal(out.sequences[:, : 9 + steps], arrays[f"{case}/sequences"])
    np.testing.assert_allclose(out.scores[:, :steps], arrays[f"{case}/scores"], atol=ATOL)
    for name in ("hidden_states", "attentions"):
        got = _as_arrays(out, name)
        expected = {k[len(case) + 1 :]: v for k, v in arrays.items() if k.startswith(f"{case}/")}
        expected = {k: v for k, v in expected.items() if k.startswith(name)}
        assert set(got) == set(expected), set(got) ^ set(expected)
        for key, want in expected.items():
            have = got[key]
            assert have.shape == want.shape, (key, have.shape, want.shape)
            if key.startswith(f"{name}/0/") and key != "hidden_states/0/0":
                query_axis = 1 if name == "hidden_states" else 2
                have = np.moveaxis(have, query_axis, 1)[real]  # the real queries only
                want = np.moveaxis(want, query_axis, 1)[real]
            np.testing.assert_allclose(have, want, atol=ATOL, err_msg=key)


@pytest.mark.parametrize("arch,case", RECORDED, ids=lambda x: x)
def test_matches_recorded_transformers(arch, case):
    meta, arrays = _recorded(arch)
    (kwargs,) = [c["generate_kwargs"] for c in meta["cases"] if c["name"] == case]
    out = _generate(arch, case)
    _check(out, arrays, case, arrays["attention_mask"], kwargs.get("num_beams", 1))


def test_prefill_attention_rows_sum_to_one_over_the_prompt_without_bucket_slots():
    out = _generate("llama", "greedy")
    mask = _recorded("llama")[1]["attention_mask"]
    first = np.asarray(out.attentions[0][0])  # [B, N, P, P]
    sums = first.sum(-1)  # real queries: all weight on the prompt as given
    np.testing.assert_allclose(sums[:, :, mask[0] == 1][0], 1.0, atol=1e-6)
    np.testing.assert_array_equal(first[0][..., mask[0] == 0][:, mask[0] == 1], 0.0)


def test_flags_off_change_nothing():
    """The same tokens and scores without the flags, and no hidden states or attentions."""
    plain = _generate("llama", "greedy", output_hidden_states=False, output_attentions=False)
    recorded = _generate("llama", "greedy")
    assert plain.hidden_states is None and plain.attentions is None
    np.testing.assert_array_equal(plain.sequences, recorded.sequences)
    np.testing.assert_array_equal(plain.scores, recorded.scores)


def test_model_apply_returns_two_values_without_flags():
    model, params = _model("gpt2")
    ids, positions = np.array([[5, 6, 7]], np.int32), np.arange(3)[None]
    cache, mask = model.init_cache(1, 3), np.ones((1, 3), np.int32)
    plain = jax.jit(model.apply)(params, ids, positions, cache, mask)
    assert len(plain) == 2
    hidden = jax.jit(functools.partial(model.apply, output_hidden_states=True))
    logits, _, outputs = hidden(params, ids, positions, cache, mask)
    assert set(outputs) == {"hidden_states"}
    assert outputs["hidden_states"].shape == (model.num_layers + 1, 1, 3, 32)
    np.testing.assert_array_equal(logits, plain[0])


def test_jitted_equals_plain():
    """Inside a user's jit (no bucket padding) the same values at every real position."""
    meta, arrays = _recorded("llama")
    model, params = _model("llama")
    ids, mask = arrays["input_ids"], arrays["attention_mask"]
    config = _config(meta["cases"][0]["generate_kwargs"])

    @jax.jit
    def generate(params, ids, mask):
        return genjax.generate(model, params, ids, config, attention_mask=mask)

    _check(generate(params, ids, mask), arrays, "greedy", mask, 1)


def test_sampling_records_the_same_forward_passes_as_greedy_for_its_tokens():
    """Sampling records too: its first step (the prefill) is greedy's, and its tokens are those
    of the same call without the flags."""
    sampled = _generate("llama", "greedy", do_sample=True, top_k=5)
    plain = _generate(
        "llama", "greedy", do_sample=True, top_k=5, output_hidden_states=False,
        output_attentions=False,
    )  # fmt: skip
    greedy = _generate("llama", "greedy")
    np.testing.assert_array_equal(sampled.sequences, plain.sequences)
    for a, b in zip(sampled.hidden_states[0], greedy.hidden_states[0], strict=True):
        np.testing.assert_array_equal(a, b)
    assert len(sampled.attentions) == 4 and sampled.attentions[3][1].shape == (2, 4, 1, 12)


def test_steps_after_every_row_finished_hold_zeros():
    """With each row's second greedy token as EOS, both rows end at step 1: steps 2 and 3 never
    run, and hold zeros (as ``scores`` does); steps 0 and 1 are recorded."""
    meta, arrays = _recorded("llama")
    model, params = _model("llama")
    eos = [int(token) for token in arrays["greedy/sequences"][:, 10]]
    config = _config(meta["cases"][0]["generate_kwargs"], eos_token_id=eos)
    out = genjax.generate(
        model, params, arrays["input_ids"], config, attention_mask=arrays["attention_mask"]
    )
    assert len(out.hidden_states) == len(out.attentions) == 4
    for name in ("hidden_states", "attentions"):
        steps = getattr(out, name)
        assert all(np.asarray(layer).any() for step in steps[:2] for layer in step), name
        assert not any(np.asarray(layer).any() for step in steps[2:] for layer in step), name


@dataclasses.dataclass(frozen=True)
class _PlainApply(LlamaModel):
    """A model whose ``apply`` takes no output flags (as a user's own model may)."""

    def apply(self, params, tokens, positions, cache, attention_mask, logits_to_keep=0):
        return super().apply(params, tokens, positions, cache, attention_mask, logits_to_keep)


@pytest.mark.parametrize(
    "options",
    [
        {"prompt_lookup_num_tokens": 2},
        {"max_cache_len": 32},
        {"prefill_chunk_size": 4},
        {"model": "without flags"},
    ],
    ids=lambda o: "+".join(f"{k}={v}" for k, v in o.items()),
)
@pytest.mark.parametrize("flag", ["output_hidden_states", "output_attentions"])
def test_combinations_not_recorded_raise_naming_the_option(flag, options):
    model, params = _model("llama")
    options = dict(options)
    kind = options.pop("model", None)
    if kind == "without flags":
        model = _PlainApply(model.config)
    ids = np.array([[5, 6, 7]], np.int32)
    with pytest.raises(UnsupportedError, match=flag) as error:
        genjax.generate(model, params, ids, GenerationConfig(max_new_tokens=2, **{flag: True}),
                        **options)  # fmt: skip
    assert "supported" in str(error.value)


@pytest.mark.parity
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_live_transformers(arch):
    """The recorded cases, run by the installed transformers now."""
    sys.path.insert(0, str(FIXTURES))
    try:
        from make_hidden_states_fixtures import build
    finally:
        sys.path.remove(str(FIXTURES))
    record = build(arch)
    arrays = record["arrays"]
    for case in record["cases"]:
        out = _generate(arch, case["name"])
        rows = case["generate_kwargs"].get("num_beams", 1)
        _check(out, arrays, case["name"], arrays["attention_mask"], rows)
