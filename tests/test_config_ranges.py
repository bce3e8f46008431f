"""Values a program cannot hold are refused by name, and counts past int32 keep their meaning:
float fields checked in float32 (what the logits use), token ids below 2**31, no NaN bias;
``top_k``, minimum lengths and a penalty's start past int32 behave as "never reached"."""

import jax
import numpy as np
import pytest

import genjax
from genjax import GenerationConfig
from genjax.errors import GenerationConfigError, InputError
from genjax.processors import validate_config
from genjax.testing import write_random_checkpoint


@pytest.mark.parametrize(
    "fields, message",
    [
        (
            {"do_sample": True, "temperature": 1e-300},
            "temperature=1e-300 .* > 0 when do_sample=True \\(in float32",
        ),
        ({"repetition_penalty": 1e-300}, "repetition_penalty=1e-300 .* > 0 in float32"),
        ({"encoder_repetition_penalty": 1e-300}, "> 0 in float32"),
        ({"length_penalty": 1e300}, "length_penalty=1e\\+300 .* finite in float32"),
        ({"guidance_scale": 1e300}, "finite in float32"),
        ({"eos_token_id": 2**31}, "eos_token_id=2147483648 .* below 2\\*\\*31"),
        ({"eos_token_id": [2, 2**31]}, "below 2\\*\\*31"),
        ({"pad_token_id": 2**31}, "below 2\\*\\*31"),
        ({"decoder_start_token_id": 2**31}, "below 2\\*\\*31"),
        ({"suppress_tokens": [1, 2**31]}, "below 2\\*\\*31"),
        ({"bad_words_ids": [[1, 2**31]]}, "below 2\\*\\*31"),
        ({"sequence_bias": [[[2**31], 1.0]]}, "below 2\\*\\*31"),
        ({"sequence_bias": [[[3], float("nan")]]}, "no bias NaN"),
        ({"exponential_decay_length_penalty": (3, float("nan"))}, "a finite decay_factor"),
    ],
)
def test_values_a_program_cannot_hold_are_refused_by_name(fields, message):
    with pytest.raises(GenerationConfigError, match=message):
        GenerationConfig(**fields)


def test_values_that_fit_are_kept():
    config = GenerationConfig(
        sequence_bias=[[[3], float("-inf")], [[4], 2**40]],  # a ban, and an int bias
        eos_token_id=[2, 2**31 - 1],
        length_penalty=1e30,
        num_beams=2,
        repetition_penalty=1e-30,
    )
    assert config.sequence_bias == (((3,), float("-inf")), ((4,), 2**40))
    assert config.eos_token_id == (2, 2**31 - 1) and config.repetition_penalty == 1e-30


def test_a_decoder_start_id_outside_the_vocabulary_is_refused():
    validate_config(GenerationConfig(decoder_start_token_id=63).with_defaults(), vocab_size=64)
    with pytest.raises(GenerationConfigError, match="decoder_start_token_id"):
        validate_config(GenerationConfig(decoder_start_token_id=64).with_defaults(), 64)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny"))
    write_random_checkpoint(path, "llama", num_hidden_layers=1, eos_token_id=None)
    return genjax.models.from_pretrained(path)


def _run(tiny, **fields):
    model, params = tiny
    config = GenerationConfig(max_new_tokens=4, pad_token_id=0, **fields)
    out = genjax.generate(model, params, np.asarray([[3, 4, 5]]), config, key=jax.random.key(0))
    return np.asarray(out.sequences)[0, 3:]


def test_counts_past_int32_read_as_never_reached(tiny):
    sampled = _run(tiny, do_sample=True, top_k=0)
    np.testing.assert_array_equal(_run(tiny, do_sample=True, top_k=2**40), sampled)
    eos = int(_run(tiny)[0])  # greedy's first token: as EOS it ends the request at once
    assert (_run(tiny, eos_token_id=eos)[1:] == 0).all()
    held = _run(tiny, eos_token_id=eos, min_new_tokens=4)
    assert held[0] != eos
    np.testing.assert_array_equal(_run(tiny, eos_token_id=eos, min_new_tokens=2**40), held)
    np.testing.assert_array_equal(_run(tiny, eos_token_id=eos, min_length=2**40), held)
    late = _run(tiny, eos_token_id=eos, exponential_decay_length_penalty=(2**40, 1.5))
    np.testing.assert_array_equal(late, _run(tiny, eos_token_id=eos))


def test_assistant_params_without_an_assistant_model_is_refused(tiny):
    model, params = tiny
    with pytest.raises(InputError, match="assistant_params is given without assistant_model"):
        genjax.generate(model, params, np.asarray([[3, 4]]), assistant_params=params)


def test_a_matching_ngram_longer_than_the_sequence_unrolls_nothing_more(tiny):
    lookup = dict(prompt_lookup_num_tokens=2, eos_token_id=None)
    whole = _run(tiny, max_matching_ngram_size=6, **lookup)  # 3 prompt + 4 new tokens: at most 6
    np.testing.assert_array_equal(_run(tiny, max_matching_ngram_size=10**6, **lookup), whole)
    np.testing.assert_array_equal(whole, _run(tiny))  # greedy lookup changes no token


def test_ints_past_int64_are_range_checked_as_python_ints():
    # numpy holds them only as objects; the range rule still reads the value
    assert GenerationConfig(do_sample=True, top_k=10**20, max_new_tokens=10**20).top_k == 10**20
    with pytest.raises(GenerationConfigError, match="top_k=-1000.* must be >= 0"):
        GenerationConfig(top_k=-(10**20))
    with pytest.raises(GenerationConfigError, match="max_new_tokens=-1000.* must be >= 1"):
        GenerationConfig(max_new_tokens=-(10**20))
