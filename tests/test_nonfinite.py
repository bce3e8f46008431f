"""Weights that give NaN or Inf logits raise a clear error instead of returning garbage."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import genjax
from genjax import GenerationConfig
from genjax.errors import InputError
from genjax.testing import tiny_config

pytestmark = pytest.mark.usefixtures("fast_compiles")

PROMPT = np.array([[5, 6, 7]], np.int32)


@functools.cache
def _model():
    model = genjax.models.from_config(tiny_config("llama"))
    return model, model.init_params(jax.random.key(0))


def _poisoned(value):
    """The params with one embedding entry set to ``value`` (token 7's first component)."""
    _, params = _model()
    table = params["embed_tokens"]["embedding"]
    return {**params, "embed_tokens": {"embedding": table.at[7, 0].set(value)}}


@pytest.mark.parametrize(
    "value, options",
    [
        (jnp.nan, {}),
        (jnp.inf, {"num_beams": 2}),
        (jnp.nan, {"prompt_lookup_num_tokens": 2}),
    ],
    ids=["nan-greedy", "inf-beams", "nan-prompt-lookup"],
)
def test_non_finite_logits_raise_after_an_eager_call(value, options):
    model, _ = _model()
    config = GenerationConfig(max_new_tokens=2, **options)
    with pytest.raises(InputError, match="NaN or Inf"):
        genjax.generate(model, _poisoned(value), PROMPT, config)


def test_finite_calls_return_no_flag_and_traced_calls_are_not_checked():
    model, params = _model()
    config = GenerationConfig(max_new_tokens=2)
    out = genjax.generate(model, params, PROMPT, config)
    assert out.first_logits_finite is None and out.sequences.shape == (1, 5)

    @jax.jit
    def run(params, ids):
        return genjax.generate(model, params, ids, config)

    traced = run(_poisoned(jnp.nan), PROMPT)  # inside a user's jit: no host check
    assert traced.first_logits_finite is None and traced.sequences.shape == (1, 5)
