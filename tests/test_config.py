"""Tests for genjax.config: fields and defaults, validation, JSON files, pytree behaviour, modes."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import pathlib
import pickle
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from genjax.config import (
    DEFAULT_GENERATION_PARAMS,
    NEUTRAL_VALUES,
    TRACED_FIELDS,
    TRANSFORMERS_VERSION,
    GenerationConfig,
    GenerationMode,
)
from genjax.config import files as _config_io
from genjax.errors import GenerationConfigError

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "generation_configs"
CASES = sorted(p.name for p in FIXTURES.iterdir() if p.is_dir())
SAMPLING = dict(do_sample=True, temperature=0.7, top_k=40, top_p=0.9, eos_token_id=[2, 7])


def _leaves(config):
    return jax.tree_util.tree_leaves(config)


# --- defaults and fields ---


def test_default_config_is_all_none_and_writes_only_the_version():
    config = GenerationConfig()
    assert all(getattr(config, f.name) is None for f in dataclasses.fields(config)[:-1])
    assert dict(config.extra) == {}
    assert config.to_json_string() == '{\n  "transformers_version": "5.24.0"\n}\n'
    assert TRANSFORMERS_VERSION == "5.24.0"
    assert _leaves(config) == []


def test_with_defaults_fills_only_unset_fields_and_keeps_extra():
    config = GenerationConfig.from_dict(
        {"max_new_tokens": 8, "top_k": 5, "do_sample": True, "custom": 1}
    )
    filled = config.with_defaults()
    assert (filled.max_new_tokens, filled.top_k, filled.custom) == (8, 5, 1)
    assert filled.num_beams == 1 and filled.do_sample is True and filled.max_length == 20
    assert filled.top_p == 1.0 and filled.num_assistant_tokens_schedule == "constant"
    for key, value in DEFAULT_GENERATION_PARAMS.items():
        if key not in ("top_k", "do_sample"):
            assert getattr(filled, key) == value, key
    assert config.top_p is None  # the original is unchanged
    assert filled.with_defaults() is filled


def test_default_generation_params_values():
    assert len(DEFAULT_GENERATION_PARAMS) == 34
    assert DEFAULT_GENERATION_PARAMS["top_k"] == 50
    assert DEFAULT_GENERATION_PARAMS["assistant_confidence_threshold"] == 0.4
    assert DEFAULT_GENERATION_PARAMS["bad_words_ids"] is None


def test_config_is_frozen_and_replace_validates():
    config = GenerationConfig(max_new_tokens=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_new_tokens = 5
    assert config.replace(max_new_tokens=5).max_new_tokens == 5
    with pytest.raises(GenerationConfigError, match="max_new_tokens=0"):
        config.replace(max_new_tokens=0)
    with pytest.raises(TypeError, match="Did you mean 'temperature'"):
        config.replace(tempreature=0.5)


def test_lists_become_tuples_and_to_dict_gives_json_types():
    config = GenerationConfig(
        bad_words_ids=[[5], np.array([6, 7])],
        suppress_tokens=np.array([3, 4]),
        sequence_bias={(8, 9): -2.5, (10,): 1.0},
        stop_strings=["a", "b"],
        exponential_decay_length_penalty=(5, 1.5),
        cache_config={"k": [1, 2]},
        num_beams=np.int64(2),
    )
    assert config.bad_words_ids == ((5,), (6, 7))
    assert config.suppress_tokens == (3, 4)
    assert config.sequence_bias == (((8, 9), -2.5), ((10,), 1.0))
    assert config.cache_config["k"] == (1, 2)
    assert type(config.num_beams) is int
    out = config.to_dict()
    assert out["bad_words_ids"] == [[5], [6, 7]]
    assert out["sequence_bias"] == [[[8, 9], -2.5], [[10], 1.0]]
    assert out["exponential_decay_length_penalty"] == [5, 1.5]
    assert out["cache_config"] == {"k": [1, 2]}
    assert out["stop_strings"] == ["a", "b"]
    json.dumps(out)
    same = GenerationConfig(sequence_bias=[[[8, 9], -2.5], [[10], 1.0]])
    assert same.sequence_bias == config.sequence_bias


def test_to_diff_dict_and_per_row_arrays_serialize():
    config = GenerationConfig(do_sample=True, temperature=np.array([0.5, 1.0], np.float32))
    assert config.to_diff_dict() == {
        "do_sample": True,
        "temperature": [0.5, 1.0],
        "transformers_version": TRANSFORMERS_VERSION,
    }
    text = config.to_json_string(use_diff=False, ignore_metadata=True)
    assert "transformers_version" not in text and '"max_length": null' in text


# --- validation ---


@pytest.mark.parametrize(
    ("kwargs", "fragments"),
    [
        (dict(top_p=1.5), ["top_p=1.5", "in [0, 1]"]),
        (dict(do_sample=True, temperature=0.0), ["temperature=0.0", "> 0 when do_sample=True"]),
        (dict(temperature=-1.0), ["temperature=-1.0", ">= 0"]),
        (dict(temperature="0.7"), ["temperature='0.7'", "a float"]),
        (dict(eos_token_id=2.0), ["eos_token_id=2.0", "not 2.0"]),
        (dict(pad_token_id=1.5), ["pad_token_id=1.5", "int token id"]),
        (dict(eos_token_id=[2, -1]), ["eos_token_id=(2, -1)", ">= 0"]),
        (dict(num_return_sequences=2), ["num_return_sequences=2", "greedy"]),
        (dict(num_beams=4, num_return_sequences=5), ["num_return_sequences=5", "<= num_beams (4)"]),
        (dict(max_length=-1), ["max_length=-1", ">= 0"]),
        (dict(min_new_tokens=-2), ["min_new_tokens=-2", ">= 0"]),
        (dict(max_new_tokens=0), ["max_new_tokens=0", ">= 1"]),
        (dict(top_k=-1), ["top_k=-1", ">= 0"]),
        (dict(top_k=1.5), ["top_k=1.5", "an int"]),
        (dict(min_p=1.5), ["min_p=1.5", "in [0, 1]"]),
        (dict(typical_p=0.0), ["typical_p=0.0", "in (0, 1]"]),
        (dict(typical_p=1.5), ["typical_p=1.5", "in (0, 1]"]),
        (dict(repetition_penalty=0.0), ["repetition_penalty=0.0", "> 0"]),
        (dict(num_beams=0), ["num_beams=0", ">= 1"]),
        (dict(num_beams=True), ["num_beams=True", "an int"]),
        (dict(do_sample="yes"), ["do_sample='yes'", "a bool"]),
        (dict(early_stopping="sometimes"), ["early_stopping='sometimes'", "'never'"]),
        (dict(cache_implementation="magic"), ["cache_implementation='magic'", "one of"]),
        (dict(bad_words_ids=[]), ["bad_words_ids=()", "non-empty"]),
        (dict(sequence_bias=[[8, -1.0]]), ["sequence_bias", "[token_ids, bias]"]),
        (dict(suppress_tokens=[2], forced_eos_token_id=2), ["forced_eos_token_id=2", "suppress"]),
        (dict(do_sample=True, temperature=np.array([0.5, 0.0])), ["temperature=array", "> 0"]),
        (dict(temperature=np.ones((2, 2))), ["temperature=array", "shape [B]"]),
        (dict(extra={"logits_processor": 1}), ["'logits_processor'", "generate()"]),
        (dict(extra={"top_k": 1}), ["'top_k'", "top_k=..."]),
    ],
)
def test_bad_values_raise_with_field_value_and_range(kwargs, fragments):
    with pytest.raises(GenerationConfigError) as info:
        GenerationConfig(**kwargs)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, (fragment, message)


def test_error_messages_say_how_to_fix():
    with pytest.raises(GenerationConfigError, match="set do_sample=False for greedy"):
        GenerationConfig(do_sample=True, temperature=0.0)
    with pytest.raises(GenerationConfigError, match="Use 1.0 to disable top-p"):
        GenerationConfig(top_p=2.0)
    with pytest.raises(ValueError):  # GenerationConfigError is a ValueError
        GenerationConfig(num_beams=-3)


def test_sampling_flags_without_do_sample_warn_or_raise_when_strict():
    with pytest.warns(UserWarning, match="temperature=0.5"):
        config = GenerationConfig(temperature=0.5)
    with pytest.warns(UserWarning, match="temperature"):
        config.validate()
    with pytest.raises(GenerationConfigError, match="do_sample is not True"):
        config.validate(strict=True)
    with pytest.warns(UserWarning, match="length_penalty"):
        GenerationConfig(length_penalty=0.5)


def test_explicit_do_sample_false_on_inherited_flags_does_not_warn():
    loaded = GenerationConfig.from_pretrained(FIXTURES / "sampling")
    greedy = loaded.replace(do_sample=False)  # v5: only do_sample was set by the caller
    assert greedy.generation_mode == GenerationMode.GREEDY_SEARCH
    greedy.validate(user_set_attributes={"do_sample"})


def test_normal_flows_emit_no_warning():
    GenerationConfig().with_defaults().validate(strict=True)
    GenerationConfig(max_new_tokens=8, **SAMPLING).with_defaults().validate(strict=True)
    GenerationConfig(num_beams=4, length_penalty=0.5, early_stopping=True).validate(strict=True)
    for case in CASES:
        GenerationConfig.from_pretrained(FIXTURES / case).with_defaults()


# --- pytree ---


def test_traced_values_are_leaves_and_the_rest_is_static():
    config = GenerationConfig(max_new_tokens=4, **SAMPLING)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(config)]
    assert paths == [".temperature", ".top_k", ".top_p", ".eos_token_id"]
    temperature, top_k, top_p, eos = _leaves(config)
    assert (temperature, top_k, top_p) == (0.7, 40, 0.9)
    assert isinstance(eos, np.ndarray) and eos.dtype == np.int32 and eos.tolist() == [2, 7]
    assert _leaves(GenerationConfig(eos_token_id=3)) == [3]
    as_float = _leaves(GenerationConfig(do_sample=True, temperature=2, top_k=3))
    assert as_float == [2.0, 3] and type(as_float[0]) is float and type(as_float[1]) is int


def test_pickle_and_deepcopy_round_trip():
    config = GenerationConfig.from_dict(
        {"max_new_tokens": 3, "eos_token_id": [1, 2], "k": {"a": 1}}
    )
    for copied in (pickle.loads(pickle.dumps(config)), copy.deepcopy(config)):
        assert copied == config and copied.k == {"a": 1} and copied.eos_token_id == (1, 2)


def test_jit_reads_traced_temperature():
    config = GenerationConfig(do_sample=True, temperature=0.7)
    out = jax.jit(lambda c: c.temperature * 2)(config)
    np.testing.assert_allclose(out, 1.4, rtol=1e-6)


def test_changing_a_traced_value_does_not_recompile():
    traces = []

    @jax.jit
    def scaled(config, logits):
        traces.append(type(config.temperature))
        return logits / config.temperature + config.eos_token_id.sum()

    logits = jnp.ones(3)
    base = GenerationConfig(do_sample=True, temperature=0.7, eos_token_id=[1, 2])
    first = scaled(base, logits)
    second = scaled(base.replace(temperature=0.9, eos_token_id=[4, 5]), logits)
    np.testing.assert_allclose(first, 1 / 0.7 + 3, rtol=1e-6)
    np.testing.assert_allclose(second, 1 / 0.9 + 9, rtol=1e-6)
    assert len(traces) == 1 and issubclass(traces[0], jax.core.Tracer)
    assert scaled._cache_size() == 1


def test_enabling_a_processor_changes_the_treedef_once():
    neutral = GenerationConfig(do_sample=True, temperature=1.0)
    active = neutral.replace(temperature=0.7)
    assert jax.tree_util.tree_structure(neutral) != jax.tree_util.tree_structure(active)
    assert _leaves(neutral) == [] and _leaves(active) == [0.7]
    count = []
    fn = jax.jit(lambda c: count.append(1) or jnp.asarray(c.temperature))
    fn(neutral), fn(active), fn(active.replace(temperature=0.5))
    assert len(count) == 2


def test_per_row_arrays_and_vmap():
    config = GenerationConfig(do_sample=True, temperature=jnp.array([0.5, 2.0]))
    assert config.is_active("temperature")
    out = jax.vmap(lambda t: t * 2)(_leaves(config)[0])
    np.testing.assert_allclose(out, [1.0, 4.0])
    batched = jax.tree_util.tree_map(lambda x: jnp.stack([jnp.asarray(x)] * 2), config)
    rows = jax.vmap(lambda c: c.temperature + 1)(batched)
    np.testing.assert_allclose(rows, [[1.5, 3.0], [1.5, 3.0]])


def test_unflatten_does_not_validate():
    config = GenerationConfig(max_new_tokens=2, **SAMPLING)
    odd = jax.tree_util.tree_map(lambda _: "not a number", config)
    assert odd.temperature == "not a number" and odd.max_new_tokens == 2
    with pytest.raises(GenerationConfigError, match="temperature='not a number'"):
        odd.validate()


def test_with_defaults_and_modes_work_inside_jit():
    @jax.jit
    def run(config):
        full = config.with_defaults()
        assert full.generation_mode == GenerationMode.SAMPLE
        assert full.is_active("top_k") and not full.is_active("typical_p")
        with pytest.raises(TypeError, match="traced value"):
            hash(full)
        return full.top_k * full.temperature

    config = GenerationConfig(do_sample=True, temperature=0.5)
    np.testing.assert_allclose(run(config), 25.0)


@pytest.mark.parametrize(
    ("name", "value", "active"),
    [
        ("temperature", None, False),
        ("temperature", 1.0, False),
        ("temperature", 1, False),
        ("temperature", 0.7, True),
        ("top_k", 0, False),
        ("top_k", 50, True),
        ("top_p", 1.0, False),
        ("repetition_penalty", 1.0, False),
        ("guidance_scale", 1.0, False),
        ("epsilon_cutoff", 0.0, False),
        ("length_penalty", 1.0, True),
        ("min_p", 0.0, True),
        ("pad_token_id", 0, True),
        ("eos_token_id", [2], True),
        ("temperature", np.array([1.0, 1.0]), True),
    ],
)
def test_is_active(name, value, active):
    config = GenerationConfig.from_dict({"do_sample": True, "num_beams": 2, name: value})
    assert config.is_active(name) is active
    assert (name in [jax.tree_util.keystr(p)[1:] for p, _ in _paths(config)]) is active


def _paths(config):
    return jax.tree_util.tree_leaves_with_path(config)


def test_is_active_rejects_static_fields_and_tables_agree():
    with pytest.raises(ValueError, match="'num_beams' is static"):
        GenerationConfig().is_active("num_beams")
    assert set(NEUTRAL_VALUES) <= set(TRACED_FIELDS) and len(TRACED_FIELDS) == 20


# --- hash and equality ---


def test_equality_and_hash_by_content():
    a = GenerationConfig(eos_token_id=[1, 2], top_p=0.9, do_sample=True)
    b = GenerationConfig(eos_token_id=np.array([1, 2]), top_p=0.9, do_sample=True)
    c = dataclasses.replace(a, transformers_version="4.0.0", _from_model_config=True)
    assert a == b == c and hash(a) == hash(b) == hash(c)
    assert a != a.replace(top_p=0.8)
    assert a != GenerationConfig.from_dict({**a.to_dict(), "custom": 1})
    assert len({a, b, c, a.replace(top_p=0.8)}) == 2
    roundtrip = jax.tree_util.tree_map(lambda x: x, a)
    assert roundtrip == a and hash(roundtrip) == hash(a)


# --- generation mode ---


@pytest.mark.parametrize(
    ("kwargs", "mode"),
    [
        ({}, "greedy_search"),
        (dict(do_sample=True), "sample"),
        (dict(num_beams=3), "beam_search"),
        (dict(num_beams=3, do_sample=True), "beam_sample"),
        (dict(num_beams=4, num_beam_groups=2, diversity_penalty=0.5), "group_beam_search"),
        (dict(num_beams=2, force_words_ids=[[1]]), "constrained_beam_search"),
        (dict(penalty_alpha=0.6), "contrastive_search"),
        (dict(penalty_alpha=0.6, top_k=1), "greedy_search"),
        (dict(prompt_lookup_num_tokens=3), "assisted_generation"),
        (dict(do_sample=True, dola_layers="high"), "dola_generation"),
    ],
)
def test_generation_mode(kwargs, mode):
    with warnings.catch_warnings():  # top_k without do_sample warns, as in v5
        warnings.simplefilter("ignore")
        config = GenerationConfig(**kwargs)
    assert config.generation_mode == mode
    assert config.generation_mode is GenerationMode(mode)


def test_generation_mode_with_assistant_model_and_ignored_flags():
    assert GenerationConfig().get_generation_mode(assistant_model=object()) == "assisted_generation"
    with pytest.warns(UserWarning, match="dola_generation only extends"):
        assert GenerationConfig(num_beams=2, dola_layers="low").generation_mode == "beam_search"


# --- dicts and extras ---


def test_unknown_keys_are_kept_in_extra_and_written_back(tmp_path):
    config = GenerationConfig.from_dict({"max_new_tokens": 5, "my_key": [1, {"a": 2}]})
    assert config.my_key == (1, {"a": 2}) and config.extra["my_key"][1]["a"] == 2
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = config.nope
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "generation_config.json").read_text())
    assert saved == {"max_new_tokens": 5, "my_key": [1, {"a": 2}], "transformers_version": "5.24.0"}


def test_from_dict_kwargs_and_unused():
    config = GenerationConfig.from_dict({"max_length": 5}, max_length=7, foo=1)
    assert (config.max_length, config.foo) == (7, 1)
    config, unused = GenerationConfig.from_dict({"max_length": 5}, foo=1, return_unused_kwargs=True)
    assert unused == {"foo": 1} and "foo" not in config.extra
    dropped = GenerationConfig.from_dict({"_from_model_config": True, "vocab_size": 3})
    assert dict(dropped.extra) == {}


def test_updated_returns_new_config_and_unused_kwargs():
    config = GenerationConfig.from_dict({"do_sample": True, "top_k": 5, "custom": 1})
    new, unused = config.updated(top_k=7, top_p=0.5, custom=2, other=3)
    assert (new.top_k, new.top_p, new.custom, unused) == (7, 0.5, 2, {"other": 3})
    assert config.top_k == 5
    new, unused = config.updated(defaults_only=True, top_k=9, max_length=11)
    assert (new.top_k, new.max_length, unused) == (5, 11, {"top_k": 9})
    new, unused = config.updated(allow_custom_entries=True, other=3)
    assert (new.other, unused) == (3, {})


def test_update_refuses_to_pretend_it_mutates():
    # transformers' `unused = cfg.update(top_k=5)` changes cfg; here it must not silently no-op.
    config = GenerationConfig(do_sample=True, top_k=3)
    with pytest.raises(TypeError) as info:
        config.update(top_k=5)
    message = str(info.value)
    assert "immutable" in message
    assert "config.replace(top_k=5)" in message and "config.updated(top_k=5)" in message
    assert config.top_k == 3


def test_from_model_config(tmp_path):
    model_config = {
        "model_type": "t5",
        "vocab_size": 32,
        "bos_token_id": None,
        "eos_token_id": 1,
        "pad_token_id": 0,
        "top_k": 50,
        "temperature": 1.0,
        "output_scores": True,
        "decoder": {"decoder_start_token_id": 0, "eos_token_id": 5, "num_beams": 3},
    }
    (tmp_path / "config.json").write_text(json.dumps(model_config))
    for source in (model_config, tmp_path, str(tmp_path / "config.json")):
        config = GenerationConfig.from_model_config(source)
        assert config._from_model_config is True
        assert (config.eos_token_id, config.pad_token_id, config.bos_token_id) == (1, 0, None)
        assert (config.decoder_start_token_id, config.num_beams) == (0, 3)
        assert config.return_dict_in_generate is True
        assert dict(config.extra) == {}
    assert "_from_model_config" in config.to_diff_dict()


# --- files and I/O ---


@pytest.mark.parametrize("case", CASES)
def test_transformers_files_load_with_identical_values(case):
    expected = json.loads((FIXTURES / case / "expected.json").read_text())
    config = GenerationConfig.from_pretrained(FIXTURES / case)
    assert config.to_dict() == expected


@pytest.mark.parametrize("case", CASES)
def test_saving_a_loaded_file_reproduces_it_byte_for_byte(case, tmp_path):
    GenerationConfig.from_pretrained(FIXTURES / case).save_pretrained(tmp_path)
    original = (FIXTURES / case / "generation_config.json").read_bytes()
    assert (tmp_path / "generation_config.json").read_bytes() == original


def test_fixture_values():
    sampling = GenerationConfig.from_pretrained(FIXTURES / "sampling" / "generation_config.json")
    assert (sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p) == (
        0.7,
        40,
        0.9,
        0.05,
    )
    assert sampling.eos_token_id == (2, 32000) and sampling.pad_token_id == 0
    processors = GenerationConfig.from_pretrained(FIXTURES / "processors")
    assert processors.sequence_bias == (((8, 9), -2.5), ((10,), 1.0))
    assert processors.stop_strings == ("\n\n", "###")
    assert processors.my_custom_key == {"a": (1, 2), "b": "x"}
    assert GenerationConfig.from_pretrained(FIXTURES / "beam").generation_mode == "beam_search"


def test_from_pretrained_kwargs_override_and_subfolder(tmp_path):
    GenerationConfig(max_new_tokens=3, do_sample=True).save_pretrained(tmp_path / "sub", "gen.json")
    config, unused = GenerationConfig.from_pretrained(
        tmp_path, "gen.json", subfolder="sub", top_k=2, zzz=1, return_unused_kwargs=True
    )
    assert (config.max_new_tokens, config.top_k, unused) == (3, 2, {"zzz": 1})


def test_from_pretrained_uses_the_hub_for_repo_ids(monkeypatch, tmp_path):
    import huggingface_hub

    GenerationConfig(max_new_tokens=4).save_pretrained(tmp_path)
    calls = []

    def fake_download(**kwargs):
        calls.append(kwargs)
        return str(tmp_path / kwargs["filename"])

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    config = GenerationConfig.from_pretrained("org/model", revision="v1", token="t")
    assert config.max_new_tokens == 4
    assert calls[0]["repo_id"] == "org/model" and calls[0]["revision"] == "v1"
    assert calls[0]["filename"] == "generation_config.json" and calls[0]["token"] == "t"


def test_missing_files_raise_oserror(tmp_path):
    with pytest.raises(FileNotFoundError, match="has no 'generation_config.json'"):
        GenerationConfig.from_pretrained(tmp_path)
    with pytest.raises(OSError, match="not a local file or directory"):
        GenerationConfig.from_pretrained(str(tmp_path / "missing"), local_files_only=True)


def test_malformed_json_names_file_line_and_column(tmp_path):
    path = tmp_path / "generation_config.json"
    path.write_text('{\n  "top_k": 5,\n  "top_p": ,\n}\n')
    with pytest.raises(GenerationConfigError) as info:
        GenerationConfig.from_pretrained(tmp_path)
    assert str(path) in str(info.value) and "line 3, column 12" in str(info.value)
    path.write_text("[1, 2]")
    with pytest.raises(GenerationConfigError, match="must hold a JSON object"):
        GenerationConfig.from_json_file(path)
    path.write_bytes(b'{"a": "\xff"}')
    with pytest.raises(GenerationConfigError, match="not a UTF-8"):
        GenerationConfig.from_json_file(path)


def test_failed_serialization_leaves_old_file_and_no_temp_file(tmp_path):
    GenerationConfig(max_new_tokens=3).save_pretrained(tmp_path)
    before = (tmp_path / "generation_config.json").read_bytes()
    bad = GenerationConfig(max_new_tokens=4, extra={"handle": object()})
    with pytest.raises(TypeError, match="'handle'"):
        bad.save_pretrained(tmp_path)
    assert (tmp_path / "generation_config.json").read_bytes() == before
    assert os.listdir(tmp_path) == ["generation_config.json"]


def test_failed_write_midway_leaves_old_file_and_no_temp_file(tmp_path, monkeypatch):
    GenerationConfig(max_new_tokens=3).save_pretrained(tmp_path)
    before = (tmp_path / "generation_config.json").read_bytes()
    written = []

    def failing_fsync(fd):
        written.append(os.fstat(fd).st_size)
        raise OSError("disk full")

    monkeypatch.setattr(_config_io.os, "fsync", failing_fsync)
    with pytest.raises(OSError, match="disk full"):
        GenerationConfig(max_new_tokens=9).save_pretrained(tmp_path)
    assert written and written[0] > 0  # the temporary file was partly written
    assert (tmp_path / "generation_config.json").read_bytes() == before
    assert os.listdir(tmp_path) == ["generation_config.json"]


def test_save_refuses_modified_configs_with_issues(tmp_path):
    with pytest.warns(UserWarning):
        config = GenerationConfig(temperature=0.5)
    with pytest.raises(GenerationConfigError, match="Fix these issues to save"):
        config.save_pretrained(tmp_path)
    with pytest.raises(NotADirectoryError):
        GenerationConfig().save_pretrained(FIXTURES / "defaults" / "generation_config.json")


def test_save_drops_compile_config_and_pushes_to_hub(tmp_path, monkeypatch):
    import huggingface_hub

    events = []

    class FakeApi:
        def __init__(self, token=None):
            events.append(("token", token))

        def create_repo(self, repo_id, private=None, exist_ok=False):
            events.append(("create", repo_id, exist_ok))
            return type("Url", (), {"repo_id": f"me/{repo_id}"})()

        def upload_file(self, **kwargs):
            events.append(("upload", kwargs["repo_id"], kwargs["path_in_repo"]))

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    config = GenerationConfig(max_new_tokens=5, compile_config={"fullgraph": True})
    config.save_pretrained(tmp_path / "my-model", push_to_hub=True, token="tok")
    saved = json.loads((tmp_path / "my-model" / "generation_config.json").read_text())
    assert "compile_config" not in saved and saved["max_new_tokens"] == 5
    assert events == [
        ("token", "tok"),
        ("create", "my-model", True),
        ("upload", "me/my-model", "generation_config.json"),
    ]


# --- live parity (needs transformers) ---


def _genjax_written_configs():
    yield from ((case, GenerationConfig.from_pretrained(FIXTURES / case)) for case in CASES)
    yield (
        "built",
        GenerationConfig(
            max_new_tokens=7,
            do_sample=True,
            temperature=0.6,
            top_p=0.95,
            typical_p=0.9,
            eos_token_id=(3, 4),
            sequence_bias={(8, 9): -1.5},
            bad_words_ids=((5,), (6, 7)),
            extra={"custom": {"k": [1]}},
        ),
    )


@pytest.mark.parity
def test_transformers_loads_genjax_files_with_identical_values(tmp_path):
    import transformers

    for name, config in _genjax_written_configs():
        config.save_pretrained(tmp_path / name)
        theirs = transformers.GenerationConfig.from_pretrained(tmp_path / name)
        theirs = json.loads(json.dumps(theirs.to_dict()))
        ours = json.loads(json.dumps(config.to_dict()))
        # Metadata, not a value: transformers stamps its own version on every dict it writes.
        assert theirs.pop("transformers_version") == transformers.__version__
        assert ours.pop("transformers_version") == TRANSFORMERS_VERSION
        assert theirs == ours, name


@pytest.mark.parity
def test_fields_defaults_and_modes_match_transformers():
    import transformers

    theirs = transformers.GenerationConfig
    assert DEFAULT_GENERATION_PARAMS == theirs._get_default_generation_params()
    assert set(GenerationConfig().to_dict()) == set(theirs().to_dict())
    for kwargs in (
        {},
        dict(do_sample=True),
        dict(num_beams=3),
        dict(num_beams=3, do_sample=True),
        dict(penalty_alpha=0.6),
        dict(prompt_lookup_num_tokens=2),
    ):
        reference = theirs(**kwargs)
        reference.update(**theirs._get_default_generation_params(), defaults_only=True)
        assert GenerationConfig(**kwargs).generation_mode == reference.get_generation_mode().value
