"""Token healing (``token_healing=True``, ``genjax.heal_tokens``) against transformers v5.

The recordings (tests/fixtures/healing, written by make_healing_fixtures.py) hold transformers'
``heal_tokens`` and ``generate(token_healing=True)`` on the bundled draft model with a greedy
generation config; genjax must give the same ids with its own tokenizer here, and with the
transformers tokenizer in the live ``parity`` test (``-m parity``).
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import genjax
from genjax import GenerationConfig
from genjax.errors import InputError
from genjax.generation.healing import ExtensionsTrie, _healed_mask

pytestmark = pytest.mark.usefixtures("fast_compiles")

FIXTURES = Path(__file__).parent / "fixtures" / "healing"


@functools.cache
def _recorded():
    cases = json.loads((FIXTURES / "cases.json").read_text())
    with np.load(FIXTURES / "records.npz") as records:
        return cases, dict(records)


@functools.cache
def _model(greedy: bool = True):
    """The bundled draft model; ``greedy``: its generation config with ``do_sample=False``, as
    the recording sets it, and without the sampling values greedy decoding ignores (they would
    warn); the rest of the checkpoint's file (repetition_penalty=1.1, pad and EOS) stays."""
    cases, _ = _recorded()
    model, params = genjax.models.from_pretrained(genjax.io.bundled.path(cases["model"]))
    if greedy:
        unset = dict(temperature=None, top_p=None, top_k=None)
        greedy_config = model.generation_config.replace(do_sample=False, **unset)
        model = model.with_generation_config(greedy_config)
    return model, params


@functools.cache
def _tokenizer():
    cases, _ = _recorded()
    return genjax.tokenizer.from_pretrained(genjax.io.bundled.path(cases["model"]))


def _ids(i: int) -> np.ndarray:
    return _recorded()[1][f"{i}/input_ids"]


def test_the_recording_heals_some_prompts_and_leaves_one():
    """The fixtures are worth testing: two prompts change their last token, one keeps it, one
    loses its trailing newline."""
    _, records = _recorded()
    changed = [not np.array_equal(records[f"{i}/healed"], _ids(i)) for i in range(4)]
    assert changed == [True, True, False, True]
    assert records["0/healed"][0, -1] != _ids(0)[0, -1] and records["3/healed"].shape[1] == 3


@pytest.mark.parametrize("i", range(4))
def test_heal_tokens_matches_transformers(i):
    model, params = _model()
    healed = genjax.heal_tokens(model, params, _ids(i), _tokenizer())
    assert healed.dtype == np.int32
    np.testing.assert_array_equal(healed, _recorded()[1][f"{i}/healed"])


@pytest.mark.parametrize("i", [0, 3])
def test_generate_with_token_healing_matches_transformers(i):
    cases, records = _recorded()
    model, params = _model()
    out = genjax.generate(
        model,
        params,
        _ids(i),
        token_healing=True,
        tokenizer=_tokenizer(),
        max_new_tokens=cases["new_tokens"],
        do_sample=False,
    )
    np.testing.assert_array_equal(out.sequences, records[f"{i}/sequences"])


def test_token_healing_needs_a_tokenizer():
    model, params = _model()
    with pytest.raises(InputError, match="token_healing=True needs the model's tokenizer"):
        genjax.generate(model, params, _ids(0), token_healing=True, max_new_tokens=2)


def test_token_healing_inside_jit_says_to_heal_first():
    model, params = _model()
    config = GenerationConfig(token_healing=True, max_new_tokens=2)

    @jax.jit
    def run(ids):
        return genjax.generate(model, params, ids, config, tokenizer=_tokenizer()).sequences

    with pytest.raises(InputError, match=r"concrete input_ids.*genjax\.heal_tokens"):
        run(_ids(0))


def test_a_sampling_checkpoint_needs_a_key_to_heal():
    """The healing step merges the checkpoint's config, which samples: a greedy call without a
    key cannot heal (transformers would draw from torch's global generator)."""
    model, params = _model(greedy=False)
    with pytest.raises(InputError, match="needs a PRNG key even when the call itself is greedy"):
        genjax.generate(
            model, params, _ids(0), token_healing=True, tokenizer=_tokenizer(), do_sample=False
        )


def test_a_tokenizer_without_the_needed_methods_is_refused():
    model, params = _model()
    with pytest.raises(InputError, match="lacks get_vocab"):
        genjax.heal_tokens(model, params, _ids(0), _tokenizer().backend)


def test_warmup_with_token_healing_needs_no_tokenizer():
    """It compiles the program generate runs after healing (the generate tests' one)."""
    model, params = _model()
    config = GenerationConfig(token_healing=True, max_new_tokens=_recorded()[0]["new_tokens"])
    (entry,) = genjax.warmup(model, params, config, prompt_lengths=(3,), do_sample=False)
    assert entry.padded_length == 16


def test_extensions_trie_mirrors_transformers_walk():
    trie = ExtensionsTrie(["ab", "abc", "abd", "b", ""])
    assert trie.extensions("ab") == ["ab", "abc", "abd"]
    assert trie.extensions("abc") == ["abc"]
    # transformers' `_get_node` stops at "ab" (no "x" below it) and glues what is below "ab" to
    # the whole prefix: strings that are not tokens.
    assert trie.extensions("abx") == ["abx", "abxc", "abxd"]
    assert trie.extensions("z") == ["zab", "zabc", "zabd", "zb"]


def test_the_mask_after_healing_is_transformers_stale_one():
    ones = np.ones((2, 4), np.int32)
    np.testing.assert_array_equal(_healed_mask(ones, (2, 3)), np.ones((2, 3)))
    padded = np.array([[0, 1, 1, 1], [1, 1, 1, 1]])
    np.testing.assert_array_equal(_healed_mask(padded, (2, 4)), padded)
    with pytest.raises(InputError, match="no longer lines up"):
        _healed_mask(padded, (2, 3))


@pytest.mark.parity
def test_live_matches_transformers_with_its_tokenizer():
    """transformers' own tokenizer through genjax, and a fresh recording equal to the stored
    one; then a padded batch, whose healed rows are right-padded under the stale mask, as
    transformers leaves them."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
    import make_healing_fixtures as make

    cases, records = _recorded()
    live = make.record()
    for key, value in live.items():
        np.testing.assert_array_equal(value, records[key], err_msg=key)
    model, params = _model()
    folder = genjax.io.bundled.path(cases["model"])
    tok = AutoTokenizer.from_pretrained(folder)
    for i in range(4):
        healed = genjax.heal_tokens(model, params, _ids(i), tok)
        np.testing.assert_array_equal(healed, records[f"{i}/healed"])
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    reference.generation_config.do_sample = False
    batch = tok(["import os.pa", "def f"], return_tensors="pt", padding=True, padding_side="left")
    kwargs = dict(token_healing=True, tokenizer=tok, max_new_tokens=4, do_sample=False)
    with torch.no_grad():
        expected = reference.generate(**batch, **kwargs).numpy()
    out = genjax.generate(
        model, params, batch.input_ids.numpy(), attention_mask=batch.attention_mask.numpy(),
        **kwargs,
    )  # fmt: skip
    np.testing.assert_array_equal(out.sequences, expected)
