"""A request's options reach the engine as set, or are refused by name: the server's mapping of
OpenAI fields (``generation_options``, ``guided_spec``) and the engine's per-request checks
(``request_config``, ``build_request``). No model runs here."""

import numpy as np
import pytest

from genjax import GenerationConfig
from genjax.errors import GenerationConfigError, InputError, UnsupportedError
from genjax.generation.inputs import resolve_config
from genjax.serving import ContinuousBatchingConfig
from genjax.serving.guided import guided_spec
from genjax.serving.options import build_request, request_config
from genjax.serving.protocol import (
    SAMPLING_EPS,
    APIError,
    ChatRequest,
    CompletionRequest,
    generation_options,
    parse_request,
)

GREEDY = GenerationConfig(do_sample=False, stop_strings=["END"], eos_token_id=2)
SHAPE = ContinuousBatchingConfig(max_length=64, max_logit_bias=4).engine_shape()
VOCAB = 100


def _options(base=GREEDY, max_logit_bias=300, **fields):
    request = parse_request(CompletionRequest, {"model": "m", "prompt": "x", **fields})
    config, _, _, stop = generation_options(
        request, base, max_n=8, vocab_size=VOCAB, max_logit_bias=max_logit_bias
    )
    return config, stop


@pytest.mark.parametrize("cutoff", [{"top_p": 0.5}, {"top_k": 5}, {"min_p": 0.1}])
def test_a_sampling_cutoff_without_temperature_samples(cutoff):
    config, _ = _options(**cutoff, n=3, seed=1)
    ((name, value),) = cutoff.items()
    assert config.do_sample and config.temperature is None and getattr(config, name) == value


@pytest.mark.parametrize("neutral", [{"top_p": 1.0}, {"top_k": 0}, {"min_p": 0.0}, {}])
def test_neutral_cutoffs_and_temperature_zero_keep_greedy_decoding(neutral):
    config, _ = _options(**neutral)
    assert not config.do_sample and config.top_p is None and config.top_k is None
    config, _ = _options(temperature=0, top_p=0.5)
    assert not config.do_sample and config.top_p is None


def test_a_temperature_below_the_sampling_epsilon_decodes_greedily():
    config, _ = _options(temperature=SAMPLING_EPS / 10, top_k=5)
    assert not config.do_sample and config.temperature is None and config.top_k is None
    config, _ = _options(temperature=SAMPLING_EPS)
    assert config.do_sample and config.temperature == SAMPLING_EPS


def test_stop_unset_or_empty_means_the_checkpoints_stop_strings_and_a_request_replaces_them():
    assert _options()[1] == ("END",)
    assert _options(stop=[])[1] == ("END",)
    assert _options(stop=["\n", "x"])[1] == ("\n", "x")
    assert _options(base=GenerationConfig())[1] == ()


@pytest.mark.parametrize(
    "fields, param, message",
    [
        ({"top_k": 2**31}, "top_k", "top_k must be in \\[0, 2147483647\\]"),
        ({"repetition_penalty": 1e-300}, "repetition_penalty", "is 0 in float32"),
        ({"top_p": 1e-300}, "top_p", "is 0 in float32"),
    ],
)
def test_values_the_engine_cannot_hold_are_a_400_naming_the_field(fields, param, message):
    with pytest.raises(APIError, match=message) as error:
        _options(**fields)
    assert error.value.status == 400 and error.value.param == param


def test_logit_bias_counts_with_the_checkpoints_own_biased_and_banned_tokens():
    base = GenerationConfig(suppress_tokens=[1, 2], sequence_bias=[[[4], 1.0]], eos_token_id=9)
    config, _ = _options(base=base, max_logit_bias=4, logit_bias={"5": 1.0})
    assert config.sequence_bias == (((4,), 1.0), ((5,), 1.0))
    config, _ = _options(base=base, max_logit_bias=4, logit_bias={"4": -1.0})  # replaces 4's
    assert config.sequence_bias == (((4,), -1.0),)
    with pytest.raises(APIError, match="generation config biases or bans 3 more.*at most 1") as e:
        _options(base=base, max_logit_bias=4, logit_bias={"5": 1.0, "6": 2.0})
    assert e.value.param == "logit_bias"


@pytest.mark.parametrize("kind", ["json_object", "text"])
def test_a_schema_beside_another_response_format_type_is_refused(kind):
    schema = {"name": "x", "schema": {"type": "object"}}
    body = {"model": "m", "prompt": "x", "response_format": {"type": kind, "json_schema": schema}}
    with pytest.raises(APIError, match='"json_schema"') as error:
        guided_spec(parse_request(CompletionRequest, body))
    assert error.value.param == "response_format"


FOUR = GenerationConfig(max_new_tokens=4)


def _request(config=FOUR, seed=0, **overrides):
    config = request_config(GenerationConfig(pad_token_id=0), config, overrides)
    return build_request("r", [3, 4], config, SHAPE, VOCAB, seed=seed, streaming=False)


def test_an_override_of_top_k_none_turns_top_k_off_as_in_generate():
    sampled = dict(do_sample=True, max_new_tokens=4)
    _, resolved = resolve_config(GenerationConfig(**sampled), {"top_k": None})
    assert resolved.top_k is None  # generate: no top-k warper
    assert int(_request(GenerationConfig(**sampled), top_k=None).row.top_k[0]) == 0  # off
    assert int(_request(GenerationConfig(**sampled)).row.top_k[0]) == 50  # the library default


@pytest.mark.parametrize(
    "field, value",
    [
        ("output_scores", False),
        ("token_healing", False),
        ("low_memory", False),
        ("is_assistant", False),
        ("use_mtp", False),
        ("guidance_scale", 1.0),
    ],
)
def test_neutral_values_of_unsupported_fields_are_accepted_and_others_refused(field, value):
    assert _request(**{field: value}).max_new_tokens == 4
    other = True if isinstance(value, bool) else 1.5
    with pytest.raises(UnsupportedError, match=f"{field}={other!r} is not supported"):
        _request(**{field: other})


@pytest.mark.parametrize(
    "seed, message",
    [(2**31, "seed must be in \\[-2147483648, 2147483647\\]"), (1.7, "seed must be an int"),
     (True, "seed must be an int")],
)  # fmt: skip
def test_a_seed_the_engine_cannot_hold_is_refused(seed, message):
    with pytest.raises(InputError, match=message):
        _request(seed=seed)


def test_seeds_in_range_are_kept_exactly():
    for seed in (-(2**31), -5, np.int64(7), 2**31 - 1):
        assert int(_request(seed=seed).row.seed[0]) == seed


def test_large_limits_and_ids_are_held_or_refused_not_overflowed():
    row = _request(min_new_tokens=2**40).row  # past max_new_tokens: no EOS before the end
    assert int(row.min_new_tokens[0]) == 2**31 - 1
    with pytest.raises(GenerationConfigError, match="eos_token_id=.* below 2\\*\\*31"):
        _request(eos_token_id=[2, 2**31])
    for name in ("temperature", "repetition_penalty"):
        with pytest.raises(GenerationConfigError, match=f"{name}=1e-300 .*in float32"):
            _request(do_sample=True, **{name: 1e-300})


def _chat(**fields):
    data = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    request = parse_request(ChatRequest, data)
    return generation_options(request, GREEDY, max_n=8, vocab_size=VOCAB)[0].to_dict()


@pytest.mark.parametrize(
    "fields",
    [{"tools": []}, {"tools": None}, {"tool_choice": "none"}, {"tool_choice": "auto"},
     {"parallel_tool_calls": False}, {"store": False}, {"service_tier": "auto"},
     {"service_tier": "default"}],
)  # fmt: skip
def test_openai_chat_fields_that_ask_for_nothing_missing_are_accepted(fields):
    assert _chat(**fields) == _chat()


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
        ({"store": True}, "store"),
        ({"service_tier": "priority"}, "service_tier"),
    ],
)
def test_openai_chat_fields_asking_for_what_the_server_lacks_are_a_400_naming_them(fields, param):
    with pytest.raises(APIError, match=f"{param}=.* is not supported by this server") as error:
        _chat(**fields)
    assert error.value.status == 400 and error.value.param == param


def test_a_content_part_that_is_not_text_is_a_400_naming_the_part():
    parts = [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "x"}}]
    data = {"model": "m", "messages": [{"role": "user", "content": parts}]}
    with pytest.raises(APIError, match="type 'image_url' are not supported") as error:
        parse_request(ChatRequest, data)
    assert error.value.status == 400 and error.value.param == "messages.0.content.1.type"
    data["messages"][0]["content"] = parts[:1]
    assert parse_request(ChatRequest, data).messages[0].content[0].text == "hi"
