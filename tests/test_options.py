"""Every generation option does something, raises, or is documented as inert.

``test_every_field_has_a_decision`` walks ``genjax.config.fields.FIELD_NAMES``: for each field,
a non-default value (:data:`CASES`) must change the output of a small greedy call on a tiny
random model, raise, or be listed in :data:`genjax.generation.options.INERT` (then the tokens
must not change) or :data:`~genjax.generation.options.OTHER_MODES` (acts in a mode this call
does not run; tested where that mode is). A field added later without a decision fails here.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from pathlib import Path

import jax
import numpy as np
import pytest

import genjax
from genjax import GenerationConfig
from genjax.config.fields import FIELD_NAMES
from genjax.errors import UnsupportedError
from genjax.generation.options import INERT, OTHER_MODES
from genjax.models import LlamaModel
from genjax.testing import tiny_config

pytestmark = pytest.mark.usefixtures("fast_compiles")

PROMPT = np.array([[5]], np.int32)  # one token: forced_bos_token_id acts on the first new token
BASE = {"max_new_tokens": 3, "output_scores": True}
SAMPLING = {"do_sample": True}
EOS = "eos"  # stands for the second token greedy decoding gives (so a row finishes early)

# field -> (context, value): the call runs BASE + context + {field: value} and is compared with
# BASE + context. Several fields share a context, so they share its baseline program.
CASES: dict[str, tuple[dict, dict]] = {
    "max_length": ({}, {"max_length": 3, "max_new_tokens": None}),
    "max_new_tokens": ({}, {"max_new_tokens": 2}),
    "min_length": ({"eos_token_id": EOS}, {"min_length": 4}),
    "min_new_tokens": ({"eos_token_id": EOS}, {"min_new_tokens": 3}),
    "early_stopping": ({}, {"early_stopping": True}),
    "max_time": ({}, {"max_time": 100.0}),
    "stop_strings": ({}, {"stop_strings": "ab"}),
    "do_sample": ({}, {"do_sample": True}),
    "num_beams": ({}, {"num_beams": 2}),
    "use_mtp": ({}, {"use_mtp": True}),
    "use_cache": ({}, {"use_cache": False}),
    "cache_implementation": ({}, {"cache_implementation": "quantized"}),
    "cache_config": ({}, {"cache_config": {"nbits": 8}}),
    "max_cache_len": ({}, {"max_cache_len": 8}),
    "temperature": (SAMPLING, {"temperature": 0.5}),
    "top_k": (SAMPLING, {"top_k": 5}),
    "top_p": (SAMPLING, {"top_p": 0.5}),
    "min_p": (SAMPLING, {"min_p": 0.2}),
    "top_h": (SAMPLING, {"top_h": 0.5}),
    "typical_p": (SAMPLING, {"typical_p": 0.5}),
    "epsilon_cutoff": (SAMPLING, {"epsilon_cutoff": 0.02}),
    "eta_cutoff": ({**SAMPLING, "temperature": 0.25}, {"eta_cutoff": 0.02}),  # low entropy
    "repetition_penalty": ({}, {"repetition_penalty": 2.0}),
    "encoder_repetition_penalty": ({}, {"encoder_repetition_penalty": 2.0}),
    "length_penalty": ({}, {"length_penalty": 2.0}),
    "no_repeat_ngram_size": ({}, {"no_repeat_ngram_size": 1}),
    "bad_words_ids": ({}, {"bad_words_ids": [[5]]}),
    "renormalize_logits": ({}, {"renormalize_logits": True}),
    "forced_bos_token_id": ({}, {"forced_bos_token_id": 9}),
    "forced_eos_token_id": ({}, {"forced_eos_token_id": 9}),
    "remove_invalid_values": ({"bad_words_ids": [[5]]}, {"remove_invalid_values": True}),
    "exponential_decay_length_penalty": (
        {"eos_token_id": 9},
        {"exponential_decay_length_penalty": (0, 2.0)},
    ),
    "suppress_tokens": ({}, {"suppress_tokens": [5]}),
    "begin_suppress_tokens": ({}, {"begin_suppress_tokens": [5]}),
    "sequence_bias": ({}, {"sequence_bias": [[[5], 5.0]]}),
    "token_healing": ({}, {"token_healing": True}),
    "guidance_scale": ({}, {"guidance_scale": 2.0}),
    "watermarking_config": ({}, {"watermarking_config": {"greenlist_ratio": 0.25}}),
    "num_return_sequences": (SAMPLING, {"num_return_sequences": 2}),
    "output_attentions": ({}, {"output_attentions": True}),
    "output_hidden_states": ({}, {"output_hidden_states": True}),
    "output_scores": ({}, {"output_scores": False}),
    "output_logits": ({}, {"output_logits": True}),
    "return_dict_in_generate": ({}, {"return_dict_in_generate": True}),
    "pad_token_id": ({"eos_token_id": EOS}, {"pad_token_id": 7}),
    "bos_token_id": ({}, {"bos_token_id": 9}),
    "eos_token_id": ({}, {"eos_token_id": EOS}),
    "encoder_no_repeat_ngram_size": ({}, {"encoder_no_repeat_ngram_size": 1}),
    "decoder_start_token_id": ({}, {"decoder_start_token_id": 9}),
    "is_assistant": ({}, {"is_assistant": True}),
    "num_assistant_tokens": ({}, {"num_assistant_tokens": 3}),
    "num_assistant_tokens_schedule": ({}, {"num_assistant_tokens_schedule": "heuristic"}),
    "assistant_confidence_threshold": ({}, {"assistant_confidence_threshold": 0.1}),
    "prompt_lookup_num_tokens": ({}, {"prompt_lookup_num_tokens": 2}),
    "max_matching_ngram_size": ({}, {"max_matching_ngram_size": 3}),
    "assistant_early_exit": ({}, {"assistant_early_exit": 1}),
    "assistant_lookbehind": ({}, {"assistant_lookbehind": 3}),
    "target_lookbehind": ({}, {"target_lookbehind": 3}),
    "assistant_ensemble_weight": ({}, {"assistant_ensemble_weight": 0.5}),
    "speculation_type": ({}, {"speculation_type": "dflash"}),
    "compile_config": ({}, {"compile_config": {"fullgraph": True}}),
    "disable_compile": ({}, {"disable_compile": True}),
    "continuous_batching_config": ({}, {"continuous_batching_config": {"block_size": 8}}),
    "low_memory": ({}, {"low_memory": True}),
    "penalty_alpha": ({}, {"penalty_alpha": 0.6}),
    "dola_layers": ({}, {"dola_layers": "low"}),
    "diversity_penalty": ({"num_beams": 2}, {"diversity_penalty": 0.5}),
    "num_beam_groups": ({}, {"num_beam_groups": 2}),
    "constraints": ({}, {"constraints": [[5]]}),
    "force_words_ids": ({}, {"force_words_ids": [[5]]}),
    "prefill_chunk_size": ({}, {"prefill_chunk_size": 2}),
    "_from_model_config": ({}, {"_from_model_config": True}),
    "transformers_version": ({}, {"transformers_version": "0.0.1"}),
}


@functools.cache
def _model():
    model = genjax.models.from_config(tiny_config("llama", num_hidden_layers=1))
    return model, model.init_params(jax.random.key(0))


@functools.cache
def _greedy_tokens() -> tuple[int, ...]:
    model, params = _model()
    out = genjax.generate(model, params, PROMPT, GenerationConfig(**BASE))
    return tuple(int(t) for t in np.asarray(out.sequences)[0, 1:])


def _resolve(fields: dict) -> dict:
    return {k: (_greedy_tokens()[1] if v == EOS else v) for k, v in fields.items()}


def _run(fields: dict):
    """The output of ``generate`` with BASE updated by ``fields``, as host arrays (the per-step
    tuples of hidden states and attentions flattened into one)."""
    model, params = _model()
    config = GenerationConfig(**{k: v for k, v in {**BASE, **fields}.items() if v is not None})
    out = genjax.generate(model, params, PROMPT, config, key=jax.random.key(3))
    return {k: None if v is None else _host(v) for k, v in vars(out).items()}


def _host(value) -> np.ndarray:
    if isinstance(value, tuple):
        return np.concatenate([np.ravel(leaf) for leaf in jax.tree.leaves(value)])
    return np.asarray(value)


_BASELINES: dict[str, dict] = {}


def _baseline(context: dict):
    key = repr(sorted(context.items()))
    if key not in _BASELINES:
        _BASELINES[key] = _run(context)
    return _BASELINES[key]


def _same(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for key in a:
        x, y = a[key], b[key]
        if (x is None) != (y is None):
            return False
        if x is not None and not _equal(x, y):
            return False
    return True


def _equal(x, y) -> bool:
    """Tokens exactly; floats up to the noise of another XLA program (1e-5)."""
    if x.shape != y.shape:
        return False
    if np.issubdtype(x.dtype, np.floating):
        return np.allclose(x, y, rtol=1e-5, atol=1e-5)
    return np.array_equal(x, y)


def _outcome(field: str) -> str:
    context, value = CASES[field]
    context, value = _resolve(context), _resolve(value)
    base = _baseline(context)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a config may warn that a flag is ignored
            out = _run({**context, **value})
    except (UnsupportedError, ValueError, TypeError) as err:
        assert field in str(err) or str(value) in str(err) or "mode" in str(err), (field, err)
        return "raises"
    if _same(out, base):
        return "inert"
    same_tokens = _equal(out["sequences"], base["sequences"])
    scores = [x["scores"] for x in (out, base)]
    scores_too = any(x is None for x in scores) or _equal(*scores)
    return "changes_outputs_only" if same_tokens and scores_too else "changes"


def test_the_cases_cover_every_field():
    assert set(CASES) == set(FIELD_NAMES), set(FIELD_NAMES) ^ set(CASES)
    listed = set(INERT) | set(OTHER_MODES)
    assert listed <= set(FIELD_NAMES), listed - set(FIELD_NAMES)
    assert not set(INERT) & set(OTHER_MODES)
    assert all(reason.strip() for reason in {**INERT, **OTHER_MODES}.values())


@pytest.mark.parametrize("field", FIELD_NAMES)
def test_every_field_has_a_decision(field):
    outcome = _outcome(field)
    if field in INERT:  # documented as never changing the tokens: it must not, nor raise
        assert outcome in ("inert", "changes_outputs_only"), (field, outcome)
    elif field in OTHER_MODES:  # acts in another mode: here it changes nothing or raises
        assert outcome in ("inert", "changes_outputs_only", "raises"), (field, outcome)
    else:
        assert outcome in ("changes", "raises"), (
            f"{field}={CASES[field][1]} is accepted and changes nothing: make it work, raise "
            f"UnsupportedError, or list it in genjax.generation.options.INERT with the reason."
        )


SHAPES: list[int] = []


@dataclasses.dataclass(frozen=True)
class _SpyLlama(LlamaModel):
    """The tiny llama, recording the token count of every ``apply`` it is traced with."""

    def apply(self, params, tokens, positions, cache, attention_mask, logits_to_keep=0):
        SHAPES.append(tokens.shape[1])
        return super().apply(params, tokens, positions, cache, attention_mask, logits_to_keep)


@pytest.mark.parametrize("mode", [{}, {"num_beams": 2}, {"max_cache_len": 24}])
def test_prefill_chunk_size_prefills_in_chunks_with_the_same_outputs(mode):
    """A prompt bucketed to 16 slots goes through the model 6 slots at a time (two chunks, then
    the 4 slots left; with max_cache_len the prompt is padded to a multiple of 6), and the
    tokens and scores are those of one pass."""
    model, params = _model()
    spy = _SpyLlama(model.config)
    ids = np.array([[5, 9, 17, 33, 2]], np.int32)
    config = GenerationConfig(max_new_tokens=3, output_scores=True, **mode)
    SHAPES.clear()
    whole = genjax.generate(spy, params, ids, config)
    assert 6 not in SHAPES
    SHAPES.clear()
    chunked = genjax.generate(spy, params, ids, config, prefill_chunk_size=6)
    assert max(SHAPES) == 6, SHAPES  # decoding steps run 1 token
    if "max_cache_len" not in mode:
        assert set(SHAPES) == {6, 4, 1}, SHAPES
    np.testing.assert_array_equal(chunked.sequences, whole.sequences)
    np.testing.assert_allclose(chunked.scores, whole.scores, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "options",
    [
        {"output_attentions": True, "prompt_lookup_num_tokens": 2},
        {"output_hidden_states": True, "max_cache_len": 8},
        {"assistant_early_exit": 1},
        {"use_mtp": True},
        {"assistant_ensemble_weight": 0.5, "prompt_lookup_num_tokens": 2},
        {"speculation_type": "dflash", "prompt_lookup_num_tokens": 2},
        {"low_memory": True, "num_beams": 2},
    ],
    ids=lambda o: "+".join(o),
)
def test_options_genjax_would_ignore_raise_naming_the_option(options):
    model, params = _model()
    name = next(iter(options))
    with pytest.raises(UnsupportedError, match=name):
        genjax.generate(model, params, PROMPT, GenerationConfig(max_new_tokens=2, **options))


INERT_IN_TRANSFORMERS = [
    {"low_memory": True},
    {"num_beam_groups": 2},
    {"diversity_penalty": 0.5, "num_beams": 2},
    {"assistant_ensemble_weight": 0.5},
    {"speculation_type": "dflash"},
]


@pytest.mark.parity
@pytest.mark.parametrize("options", INERT_IN_TRANSFORMERS, ids=lambda o: "+".join(o))
def test_live_transformers_ignores_the_inert_options_too(options):
    """The options INERT lists as ignored by transformers are: its tokens do not change."""
    import torch
    from transformers import AutoModelForCausalLM

    folder = Path(__file__).parent / "fixtures" / "llama"
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor([[5, 9, 17, 33]])
    beams = {"num_beams": options["num_beams"]} if "num_beams" in options else {}
    with torch.no_grad():
        plain = hf.generate(ids, max_new_tokens=4, do_sample=False, **beams)
        with_option = hf.generate(ids, max_new_tokens=4, do_sample=False, **options)
    np.testing.assert_array_equal(with_option.numpy(), plain.numpy())
    assert all(name in INERT for name in options if name != "num_beams")
