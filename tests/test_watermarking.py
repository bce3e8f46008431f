"""Green-list watermarking against transformers: green lists (torch's CPU randperm), generate
with ``watermarking_config``, and :class:`genjax.watermarking.WatermarkDetector`.

The recordings (``tests/fixtures/watermark/``) are written by
``tests/fixtures/make_watermark_fixtures.py`` on the tiny llama checkpoint; the ``parity`` test
rebuilds them live. Sampled cases are compared step by step along transformers' own sampled path
(its raw logits in, its processed scores out), since torch's sampler cannot be reproduced.
"""

import dataclasses
import functools
import importlib.util
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import genjax
from genjax import GenerationConfig
from genjax.errors import GenerationConfigError, UnsupportedError
from genjax.processors import LogitsContext, from_config, watermark
from genjax.processors import greenlist as wm
from genjax.testing import count_compiles
from genjax.watermarking import WatermarkDetector, WatermarkDetectorOutput

pytestmark = pytest.mark.usefixtures("fast_compiles")

FIXTURES = Path(__file__).parent / "fixtures"
RECORDS = FIXTURES / "watermark"
FIELDS = tuple(field.name for field in dataclasses.fields(WatermarkDetectorOutput))


@functools.cache
def _recorded():
    data = json.loads((RECORDS / "watermark.json").read_text())
    return data["meta"], data["cases"], dict(np.load(RECORDS / "watermark.npz"))


@functools.cache
def _model():
    model, params = genjax.models.from_pretrained(FIXTURES / "llama")
    records = np.load(FIXTURES / "llama" / "records.npz")
    # Without the checkpoint's generation config: its EOS would fill the recorded settings' gaps.
    model = model.with_generation_config(None)
    return model, params, records["greedy/input_ids"], records["greedy/attention_mask"]


def _config(meta, case, **extra):
    return GenerationConfig(
        max_new_tokens=meta["max_new_tokens"],
        pad_token_id=0,
        eos_token_id=meta["eos_token_id"],
        watermarking_config=case["watermarking_config"],
        output_scores=True,
        **case["generate_kwargs"],
        **extra,
    )


def _assert_scores_equal(got, expected):
    got = np.asarray(got)
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(expected))
    finite = np.isfinite(expected)
    np.testing.assert_allclose(got[finite], expected[finite], atol=1e-4, rtol=0)


# --- green lists ---------------------------------------------------------------------------


def test_green_lists_are_torch_cpu_randperm():
    _, cases, arrays = _recorded()
    green_lists = jax.jit(wm.green_lists, static_argnums=(1, 2))  # one program per (V, G)
    for i, case in enumerate(cases["greenlists"]):
        cfg = wm.check_watermarking(case["config"])
        vocab, key = case["vocab_size"], cfg["hashing_key"]
        window = jnp.asarray(arrays[f"greenlist/{i}/window"][-cfg["context_width"] :])
        if cfg["seeding_scheme"] == "selfhash":
            table = jnp.asarray(wm.fixed_table(key, vocab))
            seed = _selfhash_seed(window, wm.key_words(key), table)
        else:
            seed = wm.lefthash_seed(window, wm.key_words(key)[1])
        got = green_lists(seed[None], vocab, int(vocab * cfg["greenlist_ratio"]))[0]
        np.testing.assert_array_equal(got, arrays[f"greenlist/{i}/ids"], err_msg=str(case))


_selfhash_seed = jax.jit(wm.selfhash_seed)


def test_selfhash_table_is_torch_randperm_prefix():
    _, _, arrays = _recorded()
    for name in (k for k in arrays if k.startswith("fixed_table/")):
        key = int(name.split("/")[1])
        np.testing.assert_array_equal(wm.fixed_table(key, 3000), arrays[name])


def test_green_lists_follow_the_swaps_one_by_one():
    """The vectorized green lists equal the first swaps of the shuffle run one at a time."""
    vocab, size = 700, 650  # many repeated swap targets
    seeds = jnp.asarray([987654321, 5, 2**32 - 1], jnp.uint32)
    offsets, green = jax.jit(
        lambda seeds: (
            jax.vmap(lambda seed: wm.shuffle_offsets(seed, vocab, size))(seeds),
            wm.green_lists(seeds, vocab, size),
        )
    )(seeds)
    for row, got in zip(np.asarray(offsets), np.asarray(green), strict=True):
        perm = np.arange(vocab)
        for i, offset in enumerate(row):
            perm[[i, i + offset]] = perm[[i + offset, i]]
        np.testing.assert_array_equal(got, perm[:size])


# --- generate ------------------------------------------------------------------------------


# The other greedy cases (plain lefthash, selfhash with width 1) run in the live parity test.
@pytest.mark.parametrize("name", ["greedy_lefthash_wide", "greedy_selfhash_wide", "beam_lefthash"])
def test_generate_matches_recorded_transformers(name):
    meta, cases, arrays = _recorded()
    _check_greedy(meta, next(c for c in cases["generate"] if c["name"] == name), arrays)


def _check_greedy(meta, case, arrays):
    model, params, ids, mask = _model()
    out = genjax.generate(model, params, ids, _config(meta, case), attention_mask=mask)
    prefix = f"generate/{case['name']}"
    np.testing.assert_array_equal(out.sequences, arrays[f"{prefix}/sequences"])
    _assert_scores_equal(out.scores, arrays[f"{prefix}/scores"])


def test_sampled_generate_is_watermarked():
    """The sampling loop applies the watermark: most new tokens are green for their context."""
    meta, cases, _ = _recorded()
    case = next(c for c in cases["generate"] if c["name"] == "sample_lefthash")
    model, params, ids, mask = _model()
    config = _config(meta, case)
    out = genjax.generate(model, params, ids, config, attention_mask=mask, key=jax.random.key(3))
    seqs, width = np.asarray(out.sequences), case["watermarking_config"]["context_width"]
    starts = range(ids.shape[1] - width, seqs.shape[1] - width)
    ngrams = np.concatenate([seqs[:, t : t + width + 1] for t in starts])  # [B * N, width + 1]
    detector = WatermarkDetector(
        {"vocab_size": model.vocab_size}, watermarking_config=case["watermarking_config"]
    )
    assert detector._is_green(ngrams).mean() > 0.6  # 0.25 without the watermark


@pytest.mark.parametrize("name", ["sample_selfhash"])  # sample_lefthash: in the parity test
def test_sampled_path_scores_match_recorded_transformers(name):
    """Along transformers' sampled path, genjax's chain turns its raw logits into its scores."""
    meta, cases, arrays = _recorded()
    case = next(c for c in cases["generate"] if c["name"] == name)
    _check_sampled_path(meta, case, arrays, _model()[3])


def _check_sampled_path(meta, case, arrays, mask):
    prefix = f"generate/{case['name']}"
    sequences, logits = arrays[f"{prefix}/sequences"], arrays[f"{prefix}/logits"]
    steps, prompt = logits.shape[1], sequences.shape[1] - logits.shape[1]
    config = _config(meta, case).with_defaults()
    chain = from_config(config, jnp.asarray([meta["eos_token_id"]], jnp.int32))

    @jax.jit
    def process(chain, step):
        context = LogitsContext.for_prompt(jnp.asarray(sequences), jnp.asarray(mask))
        context = context.replace(length=prompt + step, prompt_end=jnp.int32(prompt))
        return chain(jnp.asarray(logits)[:, step], context)

    got = np.stack([process(chain, jnp.int32(t)) for t in range(steps)], 1)
    _assert_scores_equal(got, arrays[f"{prefix}/scores"])


# --- detector ------------------------------------------------------------------------------


def test_detector_matches_recorded_transformers():
    meta, cases, arrays = _recorded()
    _check_detector(meta, cases, arrays)


def _check_detector(meta, cases, arrays):
    model_config = json.loads((FIXTURES / "llama" / "config.json").read_text())
    plain = arrays["detector/plain"]
    bos = np.concatenate([np.full((len(plain), 1), meta["bos_token_id"]), plain], 1)
    for case in cases["detector"]:
        detector = WatermarkDetector(
            model_config,
            watermarking_config=case["watermarking_config"],
            ignore_repeated_ngrams=case["ignore_repeated_ngrams"],
        )
        generated = arrays[f"generate/{case['name'].split('/')[0]}/sequences"]
        text = {"own": generated, "plain": plain, "bos": bos}[case["text"]]
        out = detector(text, return_dict=True)
        for field in FIELDS:
            expected, got = arrays[f"detector/{case['name']}/{field}"], getattr(out, field)
            assert got.dtype == expected.dtype, (case["name"], field)
            if field in ("p_value", "confidence"):  # erfc: math's against torch's
                np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-15)
            else:
                np.testing.assert_array_equal(got, expected, err_msg=f"{case['name']} {field}")
        np.testing.assert_array_equal(detector(text), out.prediction)


def test_detector_errors_as_transformers():
    detector = WatermarkDetector(
        {"vocab_size": 128, "bos_token_id": 1}, watermarking_config={"context_width": 3}
    )
    with pytest.raises(ValueError, match="inconsistent leading BOS"):
        detector(np.array([[1, 5, 6, 7, 8], [2, 5, 6, 7, 8]]))
    with pytest.raises(ValueError, match="at least `1` token to score"):
        detector(np.array([[1, 5, 6, 7]]))
    with pytest.raises(genjax.errors.InputError, match="outside the vocabulary"):
        detector(np.array([[5, 6, 7, 128]]))


@pytest.mark.parametrize(
    "watermarking_config, error, words",
    [
        ({"ngram_len": 5, "keys": [1, 2, 3]}, UnsupportedError, "SynthID"),
        ({"seeding_scheme": "midhash"}, GenerationConfigError, "seeding_scheme='midhash'"),
        ({"greenlist_ratio": 1.0}, GenerationConfigError, "greenlist_ratio=1.0"),
        ({"context_width": 0}, GenerationConfigError, "context_width=0"),
        ({"hashing_key": 2**63}, GenerationConfigError, "below 2**63"),
        ({"greenlist": 0.5}, GenerationConfigError, "unknown keys ['greenlist']"),
        ({"greenlist_ratio": 0.005}, GenerationConfigError, "empty green list"),
    ],
)
def test_bad_watermarking_config_raises_before_tracing(watermarking_config, error, words):
    model, params, ids, mask = _model()
    config = GenerationConfig(max_new_tokens=2, pad_token_id=0, eos_token_id=2)
    config = config.replace(watermarking_config=watermarking_config)
    with count_compiles() as compiled, pytest.raises(error) as info:
        genjax.generate(model, params, ids, config, attention_mask=mask)
    assert words in str(info.value)
    assert compiled == []


def test_watermark_bias_is_traced():
    scores = jnp.zeros((2, 128))
    context = LogitsContext.for_prompt(jnp.asarray([[5, 9], [7, 3]], jnp.int32))
    run = jax.jit(lambda process, scores, context: process(scores, context))
    first = run(watermark(2.0, context_width=2), scores, context)
    with count_compiles() as compiled:
        second = run(watermark(1.0, context_width=2), scores, context)
    assert compiled == []
    np.testing.assert_array_equal(np.asarray(second) * 2, np.asarray(first))
    assert (np.asarray(first) == 2.0).sum(-1).tolist() == [32, 32]


@pytest.mark.parity
def test_watermarking_matches_live_transformers():
    spec = importlib.util.spec_from_file_location(
        "make_watermark_fixtures", FIXTURES / "make_watermark_fixtures.py"
    )
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    built = script.build_generate_records()
    meta, cases, arrays = built["meta"], built["cases"], built["arrays"]
    import transformers  # a transformers WatermarkingConfig object is read as its mapping

    ported = transformers.WatermarkingConfig(bias=1.5, seeding_scheme="selfhash")
    config = GenerationConfig(watermarking_config=ported).watermarking_config
    assert wm.check_watermarking(config) == {
        **wm.DEFAULTS,
        "bias": 1.5,
        "seeding_scheme": "selfhash",
    }
    detector = WatermarkDetector({"vocab_size": 128}, "cpu", ported)
    assert detector.config["seeding_scheme"] == "selfhash"
    for case in cases["generate"]:
        if case["generate_kwargs"]["do_sample"]:
            _check_sampled_path(meta, case, arrays, _model()[3])
        else:
            _check_greedy(meta, case, arrays)
    _check_detector(meta, cases, arrays)


@pytest.mark.parity
def test_green_lists_match_live_torch_at_large_vocabularies():
    """Llama 3's vocabulary, and a whole permutation (G = V - 1) of Qwen2's, against torch."""
    import torch

    green_lists = jax.jit(wm.green_lists, static_argnums=(1, 2))
    seeds = np.array([15485863 * 50000 % 2**32, 7, 2**32 - 2], np.uint32)
    for vocab, size in ((128256, 32064), (152064, 152063)):
        got = np.asarray(green_lists(jnp.asarray(seeds), vocab, size))
        for seed, row in zip(seeds.tolist(), got, strict=True):
            generator = torch.Generator().manual_seed(seed)
            expected = torch.randperm(vocab, generator=generator).numpy()[:size]
            np.testing.assert_array_equal(row, expected, err_msg=f"V={vocab} seed={seed}")
