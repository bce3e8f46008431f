"""``max_cache_len`` for encoder-decoder models: the decoder's buffer and self-attention cache
get ``M`` slots and ``N`` becomes traced (:mod:`genjax.generation.encoder_decoder`).

On the recorded tiny T5 v1.0 and BART checkpoints of ``tests/test_encdec_generate.py``: greedy
and beam search give transformers' recorded tokens and scores (what genjax returns without
``max_cache_len``) in their first ``Pd + N`` columns, ``pad_token_id`` after; new lengths reuse
the program; beams with fewer new tokens than the buffer, sampling and the int8 cache equal the
calls without ``max_cache_len``; a call that does not fit raises before anything compiles; the
warm-up counts the decoder's prefix. The recorded cases' programs are shared through a module
fixture.
"""

from __future__ import annotations

import functools
import json
import os

import jax
import numpy as np
import pytest
from encdec_models import recorded_model as _model

import genjax
from genjax.errors import GenerationConfigError, InputError, UnsupportedError
from genjax.testing import count_compiles

pytestmark = pytest.mark.usefixtures("fast_compiles")

HERE = os.path.dirname(__file__)
SIZE = 16  # M: the decoder's start token and up to 15 new tokens
SCORES = dict(rtol=1e-5, atol=5e-5)
QUANTIZED = {"cache_implementation": "quantized", "cache_config": {"nbits": 8}}


@functools.cache
def _recorded(name: str, case: str):
    """``(generate kwargs, arrays)`` of a recorded transformers case."""
    folder = os.path.join(HERE, "fixtures", "encdec_generate")
    with open(os.path.join(folder, f"{name}.json")) as f:
        kwargs = {c["name"]: c for c in json.load(f)["cases"]}[case]["generate_kwargs"]
    with np.load(os.path.join(folder, f"{name}.npz")) as records:
        arrays = {k.split("/", 1)[1]: v for k, v in records.items() if k.startswith(f"{case}/")}
    return kwargs, arrays


def _generate(name: str, kwargs: dict, **extra):
    model, params, src, mask = _model(name)
    key = jax.random.key(0) if kwargs.get("do_sample") else None
    options = {**kwargs, **extra}
    return genjax.generate(
        model, params, src, attention_mask=mask, key=key, output_scores=True, **options
    )


@pytest.fixture(scope="module")
def fixed():
    """(name, case, extra options) -> the recorded case run with ``max_cache_len=SIZE``,
    computed on first use (its program then serves other lengths)."""

    @functools.cache
    def run(name, case, quantized=False):
        extra = QUANTIZED if quantized else {}
        return _generate(name, _recorded(name, case)[0], max_cache_len=SIZE, **extra)

    return run


def _pad(name: str) -> int:
    return int(_model(name)[0].generation_config.pad_token_id)


@pytest.mark.parametrize("case", ["greedy", "beam"])
@pytest.mark.parametrize("name", ["t5_v1_0", "bart"])
def test_the_first_columns_are_the_recorded_call_and_pad_follows(fixed, name, case):
    kwargs, expected = _recorded(name, case)
    out = fixed(name, case)
    end = kwargs.get("max_length") or 1 + kwargs["max_new_tokens"]  # Pd + N, Pd = 1
    got = np.asarray(out.sequences)
    assert got.shape == (expected["sequences"].shape[0], SIZE)
    np.testing.assert_array_equal(got[:, : expected["sequences"].shape[1]], expected["sequences"])
    np.testing.assert_array_equal(got[:, end:], _pad(name))  # slots the call never wrote
    scores, recorded = np.asarray(out.scores), expected["scores"]
    assert scores.shape[:2] == (recorded.shape[0], SIZE - 1)  # M - Pd steps
    finite = np.isfinite(recorded)
    steps = recorded.shape[1]
    np.testing.assert_array_equal(np.isfinite(scores[:, :steps]), finite)
    np.testing.assert_allclose(scores[:, :steps][finite], recorded[finite], **SCORES)
    np.testing.assert_array_equal(scores[:, end - 1 :], 0.0)
    if case == "beam":
        np.testing.assert_allclose(out.sequences_scores, expected["sequences_scores"], **SCORES)
        indices = np.asarray(out.beam_indices)
        assert indices.shape == (got.shape[0], SIZE - 1)
        width = expected["beam_indices"].shape[1]
        np.testing.assert_array_equal(indices[:, :width], expected["beam_indices"])
        assert (indices[:, width:] == -1).all()


def test_new_lengths_reuse_the_program(fixed):
    """``max_new_tokens`` and ``max_length`` are traced: fewer greedy tokens are the first ones
    of the longer call, and no program (not even a small one) compiles."""
    kwargs, _ = _recorded("t5_v1_0", "greedy")
    first = fixed("t5_v1_0", "greedy")
    model, params, src, mask = _model("t5_v1_0")
    call = functools.partial(genjax.generate, model, params, src, attention_mask=mask)
    options = dict(kwargs, output_scores=True, max_cache_len=SIZE)
    with count_compiles() as compiled:
        fewer = call(**{**options, "max_new_tokens": 4})
        by_max_length = call(**{**options, "max_new_tokens": None, "max_length": 5})
    assert compiled == []
    np.testing.assert_array_equal(fewer.sequences[:, :5], first.sequences[:, :5])
    np.testing.assert_array_equal(fewer.sequences[:, 5:], 0)
    np.testing.assert_array_equal(fewer.scores[:, :4], first.scores[:, :4])
    np.testing.assert_array_equal(fewer.scores[:, 4:], 0.0)
    np.testing.assert_array_equal(by_max_length.sequences, fewer.sequences)


def test_beams_stop_at_the_calls_length_not_the_buffers():
    """Beam search with ``N = 4`` of the buffer's 15 slots and ``early_stopping="never"``, whose
    heuristic bounds a hypothesis' score at the full length ``N`` (here it ends the search after
    3 steps, as with ``N = 4`` slots, where a bound at 15 tokens would not): the outputs of the
    call without ``max_cache_len``. Another ``N`` compiles nothing."""
    never = dict(
        max_new_tokens=4,
        num_beams=2,
        num_return_sequences=2,
        eos_token_id=[18, 36, 55],  # tokens the tiny BART picks early: hypotheses end soon
        early_stopping="never",
        length_penalty=1.0,
    )
    got = _generate("bart", never, max_cache_len=SIZE)
    with count_compiles() as compiled:
        longer = _generate("bart", {**never, "max_new_tokens": 6}, max_cache_len=SIZE)
    assert compiled == []
    np.testing.assert_array_equal(longer.sequences[:, 7:], _pad("bart"))
    assert (np.asarray(got.scores)[:, 3] == 0).all()  # the 4th step never ran
    expected = _generate("bart", never)
    np.testing.assert_array_equal(got.sequences[:, :5], expected.sequences)
    np.testing.assert_array_equal(got.sequences[:, 5:], _pad("bart"))
    np.testing.assert_allclose(got.sequences_scores, expected.sequences_scores, **SCORES)
    np.testing.assert_array_equal(got.beam_indices[:, :4], expected.beam_indices)
    np.testing.assert_allclose(got.scores[:, :4], expected.scores, **SCORES)


def test_sampling_draws_the_tokens_of_the_call_without_max_cache_len(fixed):
    """The recorded sampling case (``num_return_sequences=2``, top-k, temperature), key 0."""
    kwargs, _ = _recorded("t5_v1_0", "sample")
    kwargs = {**kwargs, "max_new_tokens": 6}
    expected = _generate("t5_v1_0", kwargs)
    got = _generate("t5_v1_0", kwargs, max_cache_len=SIZE)
    np.testing.assert_array_equal(got.sequences[:, :7], expected.sequences)
    np.testing.assert_array_equal(got.sequences[:, 7:], 0)
    np.testing.assert_allclose(got.scores[:, :6], expected.scores, **SCORES)


@pytest.mark.parametrize(("name", "case"), [("t5_v1_0", "greedy"), ("bart", "beam")])
def test_the_int8_cache_gives_the_recorded_tokens(fixed, name, case):
    """``cache_implementation="quantized"``: the int8 self-attention slots give the float
    cache's tokens (here transformers' recorded ones), as without ``max_cache_len``."""
    _, expected = _recorded(name, case)
    out = fixed(name, case, quantized=True)
    width = expected["sequences"].shape[1]
    np.testing.assert_array_equal(np.asarray(out.sequences)[:, :width], expected["sequences"])
    first = np.asarray(fixed(name, case).scores)[:, 0]
    np.testing.assert_allclose(np.asarray(out.scores)[:, 0], first, atol=1e-5)


def test_calls_that_do_not_fit_raise_naming_max_cache_len_before_compiling():
    model, params, src, mask = _model("t5_v1_0")
    call = functools.partial(genjax.generate, model, params, src, attention_mask=mask)
    prefix = np.full((len(src), SIZE), 7, np.int32)  # the start token goes in front: Pd = 17
    with count_compiles() as compiled:
        with pytest.raises(InputError, match=r"decoder prefix length 1 \+ 16 new tokens = 17 "):
            call(max_new_tokens=16, max_cache_len=SIZE)
        with pytest.raises(InputError, match="lower max_new_tokens to at most 15"):
            call(max_length=17, max_cache_len=SIZE)
        with pytest.raises(InputError, match="shorten the decoder prefix to under 16 tokens"):
            call(max_new_tokens=1, max_cache_len=SIZE, decoder_input_ids=prefix)
        with pytest.raises(GenerationConfigError, match="max_cache_len"):
            call(max_new_tokens=1, max_cache_len=0)
        with pytest.raises(UnsupportedError, match="max_cache_len"):  # as for decoder-only
            call(max_new_tokens=1, max_cache_len=SIZE, output_hidden_states=True)
    assert compiled == []


def test_warmup_counts_the_decoder_prefix_not_the_source():
    """A source longer than ``max_cache_len`` is fine (the cross-attention cache has its own
    length): warm-up compiles the program of its bucket, which the real call then runs."""
    kwargs, _ = _recorded("t5_v1_0", "greedy")
    model, params, src, mask = _model("t5_v1_0")
    config = genjax.GenerationConfig(**kwargs)
    (entry,) = genjax.warmup(model, params, config, len(src), 40, max_cache_len=SIZE)
    assert entry.padded_length == 64  # the source's bucket
    long_src = np.pad(src, ((0, 0), (0, 31)))  # 40 slots, the last 31 masked
    long_mask = np.pad(mask, ((0, 0), (0, 31)))
    with count_compiles() as compiled:
        out = genjax.generate(
            model, params, long_src, config, attention_mask=long_mask, max_cache_len=SIZE
        )
    assert compiled == []
    expected = _recorded("t5_v1_0", "greedy")[1]["sequences"]
    np.testing.assert_array_equal(np.asarray(out.sequences)[:, : expected.shape[1]], expected)
