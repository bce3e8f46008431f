"""Encoder-decoder ``output_hidden_states`` / ``output_attentions`` against recorded transformers
runs.

The fixtures (``tests/fixtures/encoder_decoder_outputs.{json,npz}``, by
``make_encoder_decoder_outputs_fixtures.py``) hold transformers' ``encoder_hidden_states``,
``encoder_attentions`` and per-step ``decoder_hidden_states``, ``decoder_attentions`` and
``cross_attentions`` of greedy decoding, beam search (3 beams, 2 returned, beams reordered) and
a forced decoder prefix, on tiny random T5 v1.1 and BART checkpoints that the test rebuilds from
their seeds. The source (P = 7, one row right-padded by three) goes into genjax's 16-slot
bucket; none of those slots may come back.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from matrix import spread

import genjax
from genjax import GenerationConfig
from genjax.errors import UnsupportedError
from genjax.testing import write_random_checkpoint

pytestmark = pytest.mark.usefixtures("fast_compiles")

FIXTURES = Path(__file__).parent / "fixtures"
RECORDED = [
    ("t5_v1_1", "greedy"),
    ("t5_v1_1", "beam"),
    ("bart", "greedy"),
    ("bart", "beam"),
    ("bart", "prefix"),
]
TOLERANCE = dict(rtol=1e-5, atol=1e-5)
ENCODER = ("encoder_hidden_states", "encoder_attentions")
PER_STEP = ("decoder_hidden_states", "decoder_attentions", "cross_attentions")
FLAGS_OFF = dict(output_hidden_states=False, output_attentions=False)


@functools.cache
def _recorded():
    meta = json.loads((FIXTURES / "encoder_decoder_outputs.json").read_text())
    return meta, dict(np.load(FIXTURES / "encoder_decoder_outputs.npz"))


def _kwargs(name: str, case: str) -> dict:
    (kwargs,) = [c["generate_kwargs"] for c in _recorded()[0]["models"][name]["cases"]
                 if c["name"] == case]  # fmt: skip
    return {k: v for k, v in kwargs.items() if k != "return_dict_in_generate"}


class _Runs:
    """The rebuilt checkpoints and genjax's output of each case, computed once per module (one
    compiled program per case)."""

    def __init__(self, folder: Path):
        self.models = {}
        for name, spec in _recorded()[0]["models"].items():
            path = folder / name
            write_random_checkpoint(
                path, spec["model_type"], seed=spec["seed"], **spec["overrides"]
            )
            self.models[name] = genjax.models.from_pretrained(path)

    def source(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        arrays = _recorded()[1]
        return arrays[f"{name}/source_ids"], arrays[f"{name}/source_mask"]

    @functools.cache  # noqa: B019 - one instance per module
    def run(self, name: str, case: str, **changes):
        model, params = self.models[name]
        ids, mask = self.source(name)
        prefix = _recorded()[1].get(f"{name}/{case}/decoder_input_ids")
        config = GenerationConfig(**{**_kwargs(name, case), **changes})
        return genjax.generate(
            model, params, ids, config, attention_mask=mask, decoder_input_ids=prefix,
            key=jax.random.key(0),
        )  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> _Runs:
    return _Runs(tmp_path_factory.mktemp("encoder_decoder_outputs"))


def _check_encoder(out, arrays: dict, name: str) -> None:
    """``out``'s encoder outputs against the recorded ones of model ``name``."""
    for field in ENCODER:
        got = getattr(out, field)
        count = len([k for k in arrays if k.startswith(f"{name}/{field}/")])
        assert isinstance(got, tuple) and len(got) == count, (field, type(got))
        for layer, have in enumerate(got):
            want = arrays[f"{name}/{field}/{layer}"]
            assert have.shape == want.shape, (field, layer, have.shape, want.shape)
            np.testing.assert_allclose(have, want, **TOLERANCE, err_msg=f"{field}/{layer}")


def _check(out, arrays: dict, name: str, case: str) -> None:
    """Every recorded array of ``name``/``case`` against ``out``: tokens exactly, the rest to
    :data:`TOLERANCE`, shapes equal (no bucket slot left)."""
    prefix = f"{name}/{case}/"
    sequences = arrays[prefix + "sequences"]
    np.testing.assert_array_equal(np.asarray(out.sequences), sequences)  # every step ran
    np.testing.assert_allclose(out.scores, arrays[prefix + "scores"], **TOLERANCE)
    if prefix + "beam_indices" in arrays:
        np.testing.assert_array_equal(out.beam_indices, arrays[prefix + "beam_indices"])
        np.testing.assert_allclose(
            out.sequences_scores, arrays[prefix + "sequences_scores"], **TOLERANCE
        )
    assert out.hidden_states is None and out.attentions is None  # decoder-only fields
    _check_encoder(out, arrays, name)
    steps = arrays[prefix + "scores"].shape[1]
    for field in PER_STEP:
        got = getattr(out, field)
        assert len(got) == steps, (field, len(got))
        for t, layers in enumerate(got):
            count = len([k for k in arrays if k.startswith(f"{prefix}{field}/{t}/")])
            assert len(layers) == count, (field, t, len(layers))
            for layer, have in enumerate(layers):
                want = arrays[f"{prefix}{field}/{t}/{layer}"]
                key = f"{field}/{t}/{layer}"
                assert have.shape == want.shape, (key, have.shape, want.shape)
                np.testing.assert_allclose(have, want, **TOLERANCE, err_msg=key)


@pytest.mark.parametrize("name,case", spread(RECORDED, per_row=1))  # the rest: -m slow
def test_matches_recorded_transformers(runs, name, case):
    _check(runs.run(name, case), _recorded()[1], name, case)


def test_inside_a_users_jit(runs):
    """Inside a user's ``jax.jit`` (the source is not padded to a bucket) the same values."""
    model, params = runs.models["t5_v1_1"]
    config = GenerationConfig(**_kwargs("t5_v1_1", "greedy"))

    @jax.jit
    def generate(params, ids, mask):
        return genjax.generate(model, params, ids, config, attention_mask=mask)

    _check(generate(params, *runs.source("t5_v1_1")), _recorded()[1], "t5_v1_1", "greedy")


def test_first_step_is_the_prefix_and_attention_rows_sum_to_one(runs):
    """Step 0 is the decoder's prefill over its prefix (``q = Pd``: 3 with decoder_input_ids),
    causal over it; every cross-attention row puts all its weight on the real source tokens."""
    out = runs.run("bart", "prefix")
    mask = runs.source("bart")[1].astype(bool)
    first = np.asarray(out.decoder_attentions[0][0])  # [B, N, Pd, Pd]
    assert first.shape == (2, 4, 3, 3)
    np.testing.assert_array_equal(np.triu(first[0, 0], 1), 0.0)  # causal
    assert out.decoder_hidden_states[0][0].shape == (2, 3, 32)
    for step in out.cross_attentions:
        for layer in step:
            weights = np.asarray(layer)  # [B, N, q, P]
            np.testing.assert_allclose(weights.sum(-1), 1.0, atol=1e-6)
            np.testing.assert_array_equal(weights[1][..., ~mask[1]], 0.0)


def test_flags_off_change_nothing(runs):
    """Sampling (R = 2) with and without the flags: the same tokens and scores, and without
    them no forward outputs. It records as greedy does: the same encoder outputs (one row per
    source row), and its first step (the prefill) is greedy's, repeated per returned row."""
    sample = dict(do_sample=True, top_k=5, num_return_sequences=2)
    recorded = runs.run("t5_v1_1", "greedy", **sample)
    plain = runs.run("t5_v1_1", "greedy", **sample, **FLAGS_OFF)
    np.testing.assert_array_equal(recorded.sequences, plain.sequences)
    np.testing.assert_array_equal(recorded.scores, plain.scores)
    for field in (*ENCODER, *PER_STEP, "hidden_states", "attentions"):
        assert getattr(plain, field) is None, field
    greedy = runs.run("t5_v1_1", "greedy")
    _check_encoder(recorded, _recorded()[1], "t5_v1_1")
    for field in PER_STEP:
        for have, want in zip(getattr(recorded, field)[0], getattr(greedy, field)[0], strict=True):
            np.testing.assert_array_equal(have, np.repeat(np.asarray(want), 2, axis=0))
        assert len(getattr(recorded, field)) == 4


def test_encoder_outputs_given_are_passed_through(runs):
    """With ``encoder_outputs=`` the encoder does not run: as transformers, its
    ``encoder_hidden_states`` / ``encoder_attentions`` are the given object's (None when it has
    none); the decoder's are recorded as usual."""
    arrays = _recorded()[1]
    model, params = runs.models["bart"]
    ids, mask = runs.source("bart")
    hidden = tuple(arrays[f"bart/encoder_hidden_states/{layer}"] for layer in range(4))
    attentions = tuple(arrays[f"bart/encoder_attentions/{layer}"] for layer in range(3))
    config = GenerationConfig(**_kwargs("bart", "greedy"))
    given = {"last_hidden_state": hidden[-1], "hidden_states": hidden, "attentions": attentions}
    out = genjax.generate(model, params, ids, config, attention_mask=mask, encoder_outputs=given)
    _check(out, arrays, "bart", "greedy")
    bare = genjax.generate(
        model, params, ids, config, attention_mask=mask, encoder_outputs=hidden[-1]
    )
    assert bare.encoder_hidden_states is None and bare.encoder_attentions is None
    np.testing.assert_array_equal(bare.cross_attentions[2][1], out.cross_attentions[2][1])


def test_model_protocol_without_flags_returns_what_it_did(runs):
    """``encode`` returns the states and ``apply`` two values without the flags; with them the
    states and logits do not change, and the hidden states cover every position whatever
    ``logits_to_keep``."""
    model, params = runs.models["t5_v1_1"]
    ids, mask = runs.source("t5_v1_1")
    states = jax.jit(model.encode)(params, ids, mask)
    encode = jax.jit(functools.partial(model.encode, output_attentions=True))
    states_too, outputs = encode(params, ids, mask)
    np.testing.assert_array_equal(states, states_too)
    assert {k: v.shape for k, v in outputs.items()} == {"encoder_attentions": (3, 2, 4, 7, 7)}
    tokens, slots = np.array([[0, 5], [0, 6]], np.int32), np.ones((2, 2), np.int32)
    cache = model.init_cache(2, 2, states, mask, params)
    plain = jax.jit(model.apply)(params, tokens, tokens, cache, slots)
    assert len(plain) == 2
    hidden = jax.jit(model.apply, static_argnames=("logits_to_keep", "output_hidden_states"))
    logits, _, outputs = hidden(
        params, tokens, tokens, cache, slots, logits_to_keep=1, output_hidden_states=True
    )
    np.testing.assert_allclose(logits[:, 0], plain[0][:, -1], rtol=1e-6, atol=1e-6)
    assert {k: v.shape for k, v in outputs.items()} == {"decoder_hidden_states": (3, 2, 2, 32)}


@pytest.mark.parametrize(
    "options",
    [{"max_cache_len": 32}, {"prompt_lookup_num_tokens": 2}],
    ids=lambda o: next(iter(o)),
)
def test_what_is_not_recorded_raises_naming_it(runs, options):
    model, params = runs.models["t5_v1_1"]
    ids, mask = runs.source("t5_v1_1")
    config = GenerationConfig(max_new_tokens=2, output_hidden_states=True)
    name = next(iter(options))
    with pytest.raises(UnsupportedError, match="output_hidden_states") as error:
        genjax.generate(model, params, ids, config, attention_mask=mask, **options)
    assert name.split("_num")[0] in str(error.value)


@pytest.mark.parity
def test_live_transformers(runs):
    """The recorded cases, run by the installed transformers now."""
    sys.path.insert(0, str(FIXTURES))
    try:
        from make_encoder_decoder_outputs_fixtures import build
    finally:
        sys.path.remove(str(FIXTURES))
    record = build()
    for name, spec in record["models"].items():
        for case in spec["cases"]:
            _check(runs.run(name, case["name"]), record["arrays"], name, case["name"])
