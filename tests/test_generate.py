"""generate against recorded transformers outputs, and the equivalences that must hold."""

import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from matrix import spread

import genjax
from genjax import GenerationConfig
from genjax.cache import KVCache
from genjax.cache.quantized import QuantizedKVCache
from genjax.errors import InputError, UnsupportedError
from genjax.generation.prefill import prefill

pytestmark = pytest.mark.usefixtures("fast_compiles")  # LLVM at -O0: see conftest.py

FIXTURES = Path(__file__).parent / "fixtures"
ARCHS = [
    "llama",
    "llama3_tied",
    "qwen2",
    "mistral",
    "gpt2",
    "qwen3",
    "olmo2",
    "phi3",
    "gemma2",
    "gemma3",
]


@functools.cache
def _load(arch):
    model, params = genjax.models.from_pretrained(FIXTURES / arch)
    meta = json.loads((FIXTURES / arch / "cases.json").read_text())
    records = dict(np.load(FIXTURES / arch / "records.npz"))
    return model, params, meta, records


def _cases():
    """(architecture, case) for every recorded case; two cases per architecture by default,
    the rest under ``-m slow`` (``tests/matrix.py``)."""
    cells = []
    for arch in ARCHS:
        meta = json.loads((FIXTURES / arch / "cases.json").read_text())
        cells += [(arch, case["name"]) for case in meta["cases"]]
    return spread(cells)


def _check_case(model, params, case, records):
    """Runs one recorded transformers case through genjax and compares the outputs."""
    name = case["name"]
    kwargs = dict(case["generate_kwargs"])
    kwargs.pop("return_dict_in_generate", None)
    prefix = case["inputs"]
    ids = records[f"{prefix}/input_ids"]
    mask = records[f"{prefix}/attention_mask"]
    out = genjax.generate(
        model, params, ids, GenerationConfig(**kwargs), attention_mask=mask, key=jax.random.key(0)
    )
    expected_scores = records[f"{name}/scores"]
    expected_logits = records[f"{name}/logits"]
    if kwargs.get("do_sample"):
        # Sampled tokens depend on the RNG; the first step's scores do not.
        np.testing.assert_allclose(out.logits[:, 0], expected_logits[:, 0], atol=1e-4)
        np.testing.assert_allclose(out.scores[:, 0], expected_scores[:, 0], atol=1e-4)
        return
    expected = records[f"{name}/sequences"]
    steps = expected_scores.shape[1]
    np.testing.assert_array_equal(out.sequences[:, : expected.shape[1]], expected)
    # transformers stops when every row finished; genjax's static buffer holds pad after that.
    np.testing.assert_array_equal(out.sequences[:, expected.shape[1] :], kwargs["pad_token_id"])
    np.testing.assert_allclose(out.logits[:, :steps], expected_logits, atol=1e-4)
    np.testing.assert_allclose(out.scores[:, :steps], expected_scores, atol=1e-4)
    np.testing.assert_array_equal(out.scores[:, steps:], 0.0)


@pytest.mark.parametrize("arch, name", _cases())
def test_matches_recorded_transformers(arch, name):
    model, params, meta, records = _load(arch)
    _check_case(model, params, next(c for c in meta["cases"] if c["name"] == name), records)


@pytest.mark.parity
def test_right_padding_warning_is_transformers_own_text():
    import logging

    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(FIXTURES / "llama").eval()
    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logger = logging.getLogger("transformers.generation.utils")
    logger.addHandler(handler)
    try:
        with torch.inference_mode():
            hf.generate(
                torch.tensor([[5, 6, 7], [5, 6, 0]]),
                attention_mask=torch.tensor([[1, 1, 1], [1, 1, 0]]),
                max_new_tokens=2,
                do_sample=False,
                pad_token_id=0,
            )
    finally:
        logger.removeHandler(handler)
    assert RIGHT_PADDING in messages


@pytest.mark.parity
@pytest.mark.parametrize("arch", ARCHS)
def test_matches_live_transformers(arch, tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_fixtures", FIXTURES / "make_fixtures.py")
    make_fixtures = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_fixtures)
    built = make_fixtures.build_case(arch, tmp_path)
    model, params = genjax.models.from_pretrained(tmp_path)
    for case in built["cases"]:
        _check_case(model, params, case, built["arrays"])


def _llama():
    model, params, meta, records = _load("llama")
    return model, params, records["greedy/input_ids"], records["greedy/attention_mask"]


def test_jitted_equals_unjitted_with_config_as_argument():
    model, params, ids, mask = _llama()
    config = GenerationConfig(max_new_tokens=6, do_sample=True, temperature=0.8, top_k=20)
    key = jax.random.key(1)
    eager = genjax.generate(model, params, ids, config, attention_mask=mask, key=key)
    generate = functools.partial(genjax.generate, model)
    jitted = jax.jit(lambda p, i, c, m, k: generate(p, i, c, attention_mask=m, key=k).sequences)
    np.testing.assert_array_equal(jitted(params, ids, config, mask, key), eager.sequences)


def test_cached_decoding_equals_one_full_forward_pass():
    model, params, ids, mask = _llama()
    config = GenerationConfig(max_new_tokens=8, pad_token_id=0, output_logits=True)
    out = genjax.generate(model, params, ids, config, attention_mask=mask)
    full_mask = jnp.concatenate([jnp.asarray(mask), jnp.ones((ids.shape[0], 8), jnp.int32)], 1)
    positions = jnp.maximum(jnp.cumsum(full_mask, -1) - 1, 0)
    total = out.sequences.shape[1]
    logits, _ = model.apply(
        params, out.sequences, positions, model.init_cache(ids.shape[0], total), full_mask
    )
    np.testing.assert_allclose(out.logits, logits[:, ids.shape[1] - 1 : -1], atol=1e-4)


def test_prefill_reads_only_the_prompt_slots_then_grows_the_cache():
    """The prompt is run through a cache of its own P slots, grown to P + N afterwards: same
    logits and cache as prefilling into all P + N slots, and no [P, P + N] scores compiled."""
    model, params, ids, mask = _llama()
    batch, prompt = ids.shape
    new = 40
    slots = prompt + new
    mask = jnp.asarray(mask, jnp.int32)

    def run(params, ids, mask):
        return prefill(model, params, ids, mask, new, 0)

    logits, cache, cache_mask, tokens = jax.jit(run)(params, ids, mask)
    assert cache.length == slots and int(cache.index) == prompt
    assert cache_mask.shape == tokens.shape == (batch, slots)
    full_mask = jnp.concatenate([mask, jnp.ones((batch, new), jnp.int32)], 1)
    positions = jnp.maximum(jnp.cumsum(mask, -1) - 1, 0)
    expected, full = model.apply(
        params, ids, positions, model.init_cache(batch, slots), full_mask, logits_to_keep=1
    )
    np.testing.assert_allclose(logits, expected, atol=1e-5)
    real = np.asarray(full_mask, bool)[:, None, :, None]  # padding slots may hold anything
    # Keys are stored [B, K, H, S]; compare them in the values' axis order [B, K, S, H].
    ours_all = [np.swapaxes(k, 2, 3) for k in cache.keys] + list(cache.values)
    theirs_all = [np.swapaxes(k, 2, 3) for k in full.keys] + list(full.values)
    for ours, theirs in zip(ours_all, theirs_all, strict=True):
        np.testing.assert_allclose(np.where(real, ours, 0), np.where(real, theirs, 0), atol=1e-5)
        assert not np.any(np.asarray(ours[:, :, prompt:]))  # the grown slots are empty
    text = jax.jit(run).lower(params, ids, mask).compile().as_text()
    assert f"{prompt},{prompt}]" in text and f"{prompt},{slots}]" not in text


def test_a_cache_grows_with_empty_slots_and_keeps_its_index():
    cache = KVCache.create(num_layers=2, batch=1, length=3, num_kv_heads=2, head_dim=4)
    new = jnp.ones((1, 3, 2, 4))
    _, _, cache = cache.update_layer(1, new, 2 * new)
    grown = cache.advance(3).with_length(5)
    assert grown.length == 5 and int(grown.index) == 3
    np.testing.assert_array_equal(grown.values[1][:, :, :3], 2 * np.ones((1, 2, 3, 4)))
    assert not np.any(np.asarray(grown.values[1][:, :, 3:]))
    quantized = QuantizedKVCache.like(cache)
    _, _, quantized = quantized.update_layer(0, new, new)
    grown = quantized.with_length(6)
    assert grown.length == 6 and grown.key_scales[0].shape == (1, 2, 6)
    np.testing.assert_array_equal(grown.keys[0][:, :, :3], quantized.keys[0])
    assert not np.any(np.asarray(grown.keys[0][:, :, 3:]))
    assert not np.any(np.asarray(grown.key_scales[0][:, :, 3:]))
    with pytest.raises(ValueError, match="cannot shrink a cache of 3 slots to 2"):
        cache.with_length(2)


def test_top_k_one_sampling_equals_greedy():
    model, params, ids, mask = _llama()
    greedy = genjax.generate(
        model, params, ids, GenerationConfig(max_new_tokens=8, pad_token_id=0), attention_mask=mask
    )
    sampled = genjax.generate(
        model,
        params,
        ids,
        GenerationConfig(max_new_tokens=8, pad_token_id=0, do_sample=True, top_k=1),
        attention_mask=mask,
        key=jax.random.key(5),
    )
    np.testing.assert_array_equal(sampled.sequences, greedy.sequences)


def test_sampling_is_reproducible_per_key_and_returns_r_sequences_per_prompt():
    model, params, ids, mask = _llama()
    config = GenerationConfig(
        max_new_tokens=6, pad_token_id=0, do_sample=True, num_return_sequences=3
    )
    a = genjax.generate(model, params, ids, config, attention_mask=mask, key=jax.random.key(2))
    b = genjax.generate(model, params, ids, config, attention_mask=mask, key=jax.random.key(2))
    c = genjax.generate(model, params, ids, config, attention_mask=mask, key=jax.random.key(3))
    assert a.sequences.shape == (3 * ids.shape[0], ids.shape[1] + 6)
    np.testing.assert_array_equal(a.sequences, b.sequences)
    assert not np.array_equal(a.sequences, c.sequences)
    # Rows b*R .. b*R+R-1 continue prompt b.
    np.testing.assert_array_equal(a.sequences[:, : ids.shape[1]], np.repeat(ids, 3, axis=0))


def test_new_sampling_values_key_and_nearby_prompt_length_compile_nothing():
    model, params, ids, mask = _llama()
    traces = []

    def counting(scores, context):
        traces.append(1)
        return scores

    def run(ids, mask, seed=0, **kw):
        key = jax.random.key(seed)
        config = GenerationConfig(max_new_tokens=4, pad_token_id=0, do_sample=True, **kw)
        genjax.generate(
            model, params, ids, config, attention_mask=mask, key=key, logits_processor=[counting]
        )

    settings = dict(temperature=0.7, top_k=10, top_p=0.9, min_p=0.05, repetition_penalty=1.2)
    run(ids, mask, **settings)
    compiled = len(traces)
    assert compiled > 0
    run(ids, mask, temperature=1.3, top_k=3, top_p=0.5, min_p=0.1, repetition_penalty=1.5)
    run(ids, mask, seed=9, **settings)
    run(ids[:, 2:], mask[:, 2:], **settings)  # 7 tokens instead of 9: same bucket
    assert len(traces) == compiled


@functools.cache
def _transition_records(arch="llama"):
    meta = json.loads((FIXTURES / "transition" / f"{arch}.json").read_text())
    return meta, dict(np.load(FIXTURES / "transition" / f"{arch}.npz"))


def _transition_cases():
    meta, _ = _transition_records()
    return [case["name"] for case in meta["cases"]]


def _check_transition_scores(model, params, case, arrays):
    """genjax's transition scores against transformers' ``compute_transition_scores``: on
    transformers' own outputs (float32 precision), then on genjax's generate outputs for the same
    settings (the generate tolerance; not for sampling, whose tokens come from torch's RNG)."""
    name, kwargs = case["name"], dict(case["generate_kwargs"])
    kwargs.pop("return_dict_in_generate")
    sequences = arrays[f"{name}/sequences"]
    indices = arrays.get(f"{name}/beam_indices")
    for source in case["sources"]:
        steps = arrays[f"{name}/{source}"]
        as_tuple = tuple(steps[:, t] for t in range(steps.shape[1]))  # transformers' form
        for normalize, label in ((False, "raw"), (True, "normalized")):
            expected = arrays[f"{name}/transition/{source}/{label}"]
            length = expected.shape[1]  # transformers cuts beams to the longest hypothesis
            for given in (steps, as_tuple):
                ours = genjax.compute_transition_scores(sequences, given, indices, normalize)
                np.testing.assert_allclose(ours[:, :length], expected, rtol=1e-6, atol=1e-6)
                np.testing.assert_array_equal(ours[:, length:], 0.0)
    if kwargs["do_sample"]:
        return
    ids, mask = arrays["input_ids"], arrays["attention_mask"]
    out = genjax.generate(model, params, ids, GenerationConfig(**kwargs), attention_mask=mask)
    for source in case["sources"]:
        steps = out.scores if source == "scores" else out.logits
        for normalize, label in ((False, "raw"), (True, "normalized")):
            expected = arrays[f"{name}/transition/{source}/{label}"]
            length = expected.shape[1]
            ours = genjax.compute_transition_scores(
                out.sequences, steps, out.beam_indices, normalize_logits=normalize
            )
            assert ours.shape == (sequences.shape[0], out.sequences.shape[1] - ids.shape[1])
            np.testing.assert_allclose(ours[:, :length], expected, atol=1e-4)
            np.testing.assert_array_equal(ours[:, length:], 0.0)


@pytest.mark.parametrize("name", _transition_cases())
def test_transition_scores_match_recorded_transformers(name):
    model, params, _, _ = _load("llama")
    meta, arrays = _transition_records()
    case = next(c for c in meta["cases"] if c["name"] == name)
    _check_transition_scores(model, params, case, arrays)


def test_recorded_transition_scores_cover_ended_rows_and_filtered_scores():
    """The fixtures are only useful if they hold the cases that need care."""
    _, arrays = _transition_records()
    prompt = arrays["input_ids"].shape[1]
    assert (arrays["greedy/sequences"][0, prompt:] == 0).any()  # row 0 ended: pad ids scored
    assert np.isneginf(arrays["sample/scores"]).any()  # top-k filtered entries are -inf
    ended = arrays["beam/beam_indices"] < 0
    assert ended.any() and not ended.all(axis=1).any()  # some hypotheses ended early
    assert arrays["beam/scores"].shape[0] == 2 * arrays["beam/sequences"].shape[0]  # M = 2 R
    normalized = arrays["greedy/transition/scores/normalized"]
    assert not np.allclose(arrays["greedy/transition/scores/raw"], normalized)


@pytest.mark.parity
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_transition_scores_match_live_transformers(arch):
    import importlib.util

    path = FIXTURES / "make_beam_fixtures.py"
    spec = importlib.util.spec_from_file_location("make_beam_fixtures", path)
    make_beam_fixtures = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_beam_fixtures)
    built = make_beam_fixtures.build_transition(arch)
    model, params, _, _ = _load(arch)
    for case in built["cases"]:
        _check_transition_scores(model, params, case, built["arrays"])


@pytest.mark.parametrize(
    "change, error, words",
    [
        (dict(input_ids=np.zeros((2, 3), np.float32)), InputError, "integer"),
        (dict(input_ids=np.zeros((3,), np.int32)), InputError, "ids[None, :]"),
        (dict(input_ids=np.full((1, 3), 999, np.int32)), InputError, "vocabulary"),
        (dict(attention_mask=np.ones((1, 4), np.int32)), InputError, "shape"),
        (dict(max_new_tokens=100), InputError, "max_position_embeddings"),
        (dict(do_sample=True), InputError, "key"),
        (dict(num_beams=4, num_beam_groups=2), UnsupportedError, "group_beam_search"),
        (dict(guidance_scale=2.0, num_beams=2), UnsupportedError, "guidance_scale"),
    ],
)
def test_bad_input_raises_a_clear_error(change, error, words):
    model, params, _, _ = _llama()
    ids = change.pop("input_ids", np.ones((1, 3), np.int32))
    mask = change.pop("attention_mask", None)
    config = GenerationConfig(max_new_tokens=4, pad_token_id=0).replace(**change)
    with pytest.raises(error) as info:
        genjax.generate(model, params, ids, config, attention_mask=mask)
    assert words in str(info.value)


# transformers v5's warning (generation/utils.py), word for word.
RIGHT_PADDING = (
    "A decoder-only architecture is being used, but right-padding was detected! For correct "
    "generation results, please set `padding_side='left'` when initializing the tokenizer."
)


@pytest.mark.parametrize(
    "mask, words",
    [
        ([[1, 1, 1], [0, 0, 0], [0, 1, 1]], "rows [1] are all 0"),
        ([[0, 0, 0], [0, 0, 0], [0, 0, 1]], "rows [0, 1] are all 0"),
        (np.array([[1, 1, 1], [0, 0.5, 1], [0, 1, 1]], np.float32), "float32 values 0.5"),
        (np.array([[1, 1, 1], [0, np.nan, 1], [0, 1, 1]], np.float32), "values nan"),
        ([[1, 2, 1], [1, 1, 1], [0, 1, 1]], "int64 values 2"),
    ],
)
def test_a_mask_with_an_empty_row_or_values_other_than_0_and_1_is_refused(mask, words):
    model, params, _, _ = _llama()
    config = GenerationConfig(max_new_tokens=2, pad_token_id=0)
    with pytest.raises(InputError, match="attention_mask") as info:
        genjax.generate(model, params, np.ones((3, 3), np.int32), config, attention_mask=mask)
    assert words in str(info.value)


def test_right_padding_warns_as_transformers_does_when_values_are_concrete():
    model, params, _, _ = _llama()
    config = GenerationConfig(max_new_tokens=2, pad_token_id=0)
    ids = np.array([[5, 6, 7], [5, 6, 0]], np.int32)
    right = np.array([[1, 1, 1], [1, 1, 0]], np.int32)
    with pytest.warns(UserWarning) as caught:
        genjax.generate(model, params, ids, config, attention_mask=right)
    assert [str(w.message) for w in caught] == [RIGHT_PADDING]
    assert caught[0].filename == __file__  # points at the caller's generate line
    with pytest.warns(UserWarning, match="right-padding was detected"):  # no mask: the last id
        genjax.generate(model, params, ids, config)
    eos_as_pad = GenerationConfig(max_new_tokens=2, eos_token_id=[7, 0])
    with pytest.warns(UserWarning, match="right-padding was detected"):
        genjax.generate(model, params, ids[::-1], eos_as_pad)
    # Left padding, a single row, or values only known inside the user's jit: no warning
    # (warnings are errors in this suite) and no check.
    genjax.generate(model, params, ids[:, ::-1], config, attention_mask=right[:, ::-1])
    genjax.generate(model, params, ids[1:], config, attention_mask=right[1:])
    generate = functools.partial(genjax.generate, model)
    run = jax.jit(lambda p, i, m: generate(p, i, config, attention_mask=m).sequences)
    assert run(params, ids, right).shape == (2, 5)
    assert run(params, ids, np.zeros_like(right)).shape == (2, 5)


@pytest.mark.parametrize("arch", ARCHS)
def test_full_forward_logits_match_recorded_transformers(arch):
    model, params, _, records = _load(arch)
    ids = records["forward/input_ids"]
    mask = records["forward/attention_mask"]
    positions = records["forward/position_ids"]
    cache = model.init_cache(ids.shape[0], ids.shape[1])
    logits, _ = model.apply(params, ids, positions, cache, mask)
    real = mask.astype(bool)  # logits at padded slots carry no meaning in either library
    np.testing.assert_allclose(np.asarray(logits)[real], records["forward/logits"][real], atol=1e-4)
