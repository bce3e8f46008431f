"""generate with logits processors against transformers' generate, recorded and live.

The recordings (``tests/fixtures/processors/generate.*``, written by
``tests/fixtures/make_processor_fixtures.py``) run transformers' ``model.generate`` on the tiny
llama and gpt2 checkpoints with left-padded prompts. Each case enables several processors at
once, so that one compiled program covers many of them.
"""

import functools
import importlib.util
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from matrix import spread

import genjax
from genjax import GenerationConfig
from genjax.errors import GenerationConfigError, UnsupportedError

pytestmark = pytest.mark.usefixtures("fast_compiles")  # LLVM at -O0: see conftest.py

FIXTURES = Path(__file__).parent / "fixtures"
RECORDS = FIXTURES / "processors"
ARCHS = ["llama", "gpt2"]


@functools.cache
def _model(arch):
    model, params = genjax.models.from_pretrained(FIXTURES / arch)
    records = np.load(FIXTURES / arch / "records.npz")
    return model, params, records["greedy/input_ids"], records["greedy/attention_mask"]


@functools.cache
def _recorded():
    meta = json.loads((RECORDS / "generate.json").read_text())
    return meta["cases"], dict(np.load(RECORDS / "generate.npz"))


@functools.cache
def allowed_rule(rule, vocab):
    """The jittable twin of the fixture script's ``allowed_by_rule`` (static: cached per rule)."""
    if rule != "mod3":
        raise ValueError(rule)

    def allowed(tokens, length):
        last = jax.lax.dynamic_index_in_dim(tokens, length - 1, axis=1)  # int32[B, 1]
        return (jnp.arange(vocab)[None, :] + last) % 3 != 0

    return allowed


TRACES = []


def count_traces(scores, context):
    """An identity processor that counts how often the chain is traced (compiled)."""
    TRACES.append(1)
    return scores


def _assert_scores_equal(got, expected):
    got = np.asarray(got)
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(expected))
    finite = np.isfinite(expected)
    np.testing.assert_allclose(got[finite], expected[finite], atol=1e-4, rtol=0)


def _check_case(arch, case, arrays):
    """Runs one recorded case through genjax.generate and compares tokens and scores."""
    model, params, ids, mask = _model(arch)
    kwargs = dict(case["generate_kwargs"])
    rule = case["allowed_rule"]
    out = genjax.generate(
        model,
        params,
        ids,
        GenerationConfig(output_scores=True, **kwargs),
        attention_mask=mask,
        key=jax.random.key(0),
        logits_processor=[count_traces],
        allowed_tokens_fn=None if rule is None else allowed_rule(rule, model.vocab_size),
    )
    expected_scores = arrays[f"{arch}/{case['name']}/scores"]
    if kwargs["do_sample"]:
        _assert_scores_equal(out.scores[:, 0], expected_scores[:, 0])
        return out
    expected = arrays[f"{arch}/{case['name']}/sequences"]
    steps = expected_scores.shape[1]
    np.testing.assert_array_equal(out.sequences[:, : expected.shape[1]], expected)
    np.testing.assert_array_equal(out.sequences[:, expected.shape[1] :], kwargs["pad_token_id"])
    _assert_scores_equal(out.scores[:, :steps], expected_scores)
    np.testing.assert_array_equal(out.scores[:, steps:], 0.0)
    return out


def _case_ids():
    cases, _ = json.loads((RECORDS / "generate.json").read_text())["cases"], None
    return spread([(a, c["name"]) for a in ARCHS for c in cases[a]])  # the rest: -m slow


@pytest.mark.parametrize("arch, name", _case_ids())
def test_generate_matches_recorded_transformers(arch, name):
    cases, arrays = _recorded()
    _check_case(arch, next(c for c in cases[arch] if c["name"] == name), arrays)


def test_new_processor_values_compile_nothing():
    cases, arrays = _recorded()
    case = next(c for c in cases["llama"] if c["name"] == "sample_truncation")
    _check_case("llama", case, arrays)  # compiled here, or already by the recorded test
    compiled = len(TRACES)
    values = dict(top_h=0.7, typical_p=0.8, epsilon_cutoff=0.02, eta_cutoff=0.1, temperature=0.5)
    changed = {**case, "generate_kwargs": {**case["generate_kwargs"], **values}}
    with pytest.raises(AssertionError):  # other values, other scores: yet the same program
        _check_case("llama", changed, arrays)
    assert len(TRACES) == compiled


@pytest.mark.parametrize(
    "change, error, words",
    [
        (
            dict(bad_words_ids=[[5], [200]]),
            GenerationConfigError,
            "bad_words_ids holds token ids [200]",
        ),
        (dict(sequence_bias=[[[1, 999], 1.0]]), GenerationConfigError, "sequence_bias"),
        (dict(suppress_tokens=[128]), GenerationConfigError, "vocab_size=128"),
        (dict(begin_suppress_tokens=[300]), GenerationConfigError, "begin_suppress_tokens"),
        (dict(forced_bos_token_id=128), GenerationConfigError, "forced_bos_token_id"),
        (
            dict(exponential_decay_length_penalty=(2, 1.5), eos_token_id=None),
            GenerationConfigError,
            "eos_token_id",
        ),
        (dict(watermarking_config={"ngram_len": 5, "keys": [7, 8]}), UnsupportedError, "SynthID"),
    ],
)
def test_bad_processor_settings_raise_before_tracing(change, error, words):
    model, params, ids, mask = _model("llama")
    # Without the checkpoint's generation config: its EOS id (config.json's) would fill an
    # eos_token_id=None, as in transformers.
    model = model.with_generation_config(None)
    config = GenerationConfig(max_new_tokens=2, pad_token_id=0, eos_token_id=2).replace(**change)
    with pytest.raises(error) as info:
        genjax.generate(model, params, ids, config, attention_mask=mask)
    assert words in str(info.value)


def test_transformers_logits_processor_raises_before_tracing():
    class LogitsWarper:  # transformers' names, without importing it
        def __call__(self, input_ids, scores):
            return scores

    class TemperatureLogitsWarper(LogitsWarper):
        pass

    model, params, ids, mask = _model("llama")
    config = GenerationConfig(max_new_tokens=2, pad_token_id=0)
    with pytest.raises(TypeError, match="TemperatureLogitsWarper is a transformers"):
        genjax.generate(
            model, params, ids, config, attention_mask=mask,
            logits_processor=[TemperatureLogitsWarper()],
        )  # fmt: skip


@pytest.mark.parity
def test_generate_matches_live_transformers():
    spec = importlib.util.spec_from_file_location(
        "make_processor_fixtures", FIXTURES / "make_processor_fixtures.py"
    )
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    built = script.build_generate_records(ARCHS)
    for arch in ARCHS:
        for case in built["cases"][arch]:
            _check_case(arch, case, built["arrays"])
