"""Assisted generation: speculative decoding with a draft model, and prompt lookup.

Real tiny random models check that the output equals plain greedy decoding (KV-cache holes and
roll-back included); fake models with known logits check the bookkeeping exactly (acceptance
counts, the heuristic schedule, the confidence threshold); a chi-square test checks that
speculative sampling draws from the target's processed distribution.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import genjax
from genjax import GenerationConfig
from genjax import processors as P
from genjax.cache import KVCache
from genjax.decoding import assisted
from genjax.errors import GenerationConfigError, InputError, UnsupportedError
from genjax.testing import chi_square_p_value, write_random_checkpoint

pytestmark = pytest.mark.usefixtures("fast_compiles")  # LLVM at -O0: see conftest.py

# Three left-padded prompts of different lengths, so rows sit at different positions.
IDS = np.array([[0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14], [0, 3, 4, 5, 3, 4]], np.int32)
MASK = (np.arange(6)[None] >= np.array([2, 0, 1])[:, None]).astype(np.int32)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A 2-layer random Llama target and a draft: the same weights plus noise, so that it
    agrees with the target often but not always."""
    folder = tmp_path_factory.mktemp("assisted")
    # No EOS in config.json: the model's generation config would stop rows (as transformers).
    write_random_checkpoint(folder / "target", "llama", seed=0, eos_token_id=None)
    model, params = genjax.models.from_pretrained(str(folder / "target"))
    noise = jax.tree.map(
        lambda x, k: x + 0.35 * jnp.std(x) * jax.random.normal(k, x.shape, x.dtype),
        params,
        _keys_like(params, jax.random.key(7)),
    )
    return model, params, noise


def _keys_like(tree, key):
    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(treedef, list(jax.random.split(key, len(leaves))))


def _plain_and_assisted(model, params, draft_params, config, **kw):
    plain = genjax.generate(model, params, IDS, config, attention_mask=MASK, **kw)
    out = genjax.generate(
        model,
        params,
        IDS,
        config,
        attention_mask=MASK,
        assistant_model=model,
        assistant_params=draft_params,
        **kw,
    )
    return plain, out


def test_greedy_equals_plain_greedy_with_rows_accepting_differently(pair):
    model, params, draft_params = pair
    config = GenerationConfig(
        max_new_tokens=14, pad_token_id=0, num_assistant_tokens=3, output_scores=True
    )
    plain, out = _plain_and_assisted(model, params, draft_params, config)
    np.testing.assert_array_equal(out.sequences, plain.sequences)
    np.testing.assert_allclose(out.scores, plain.scores, atol=1e-4)
    accepted = np.asarray(out.num_accepted_tokens)
    assert accepted.shape == (3,) and accepted.min() > 0 and len(set(accepted.tolist())) > 1


def test_greedy_with_eos_and_stop_criterion_inside_accepted_blocks(pair):
    model, params, draft_params = pair
    base = GenerationConfig(max_new_tokens=14, pad_token_id=0, num_assistant_tokens=3)
    reference = genjax.generate(model, params, IDS, base, attention_mask=MASK).sequences
    eos = int(reference[0, 6 + 5])  # row 0's sixth new token ends it (and maybe others)
    config = base.replace(eos_token_id=eos, num_assistant_tokens_schedule="heuristic")
    stop = _stop_after(int(reference[1, 6 + 3]))
    plain, out = _plain_and_assisted(model, params, draft_params, config, stopping_criteria=[stop])
    np.testing.assert_array_equal(out.sequences, plain.sequences)
    assert (np.asarray(out.sequences)[0, 6 + 6 :] == 0).all()


@dataclasses.dataclass(frozen=True)
class _stop_after:
    token: int

    def __call__(self, tokens, length):
        return tokens[:, length - 1] == self.token


def test_prompt_lookup_greedy_equals_plain_greedy(pair):
    model, params, _ = pair
    config = GenerationConfig(max_new_tokens=24, pad_token_id=0, prompt_lookup_num_tokens=4)
    plain = genjax.generate(model, params, IDS, config.replace(prompt_lookup_num_tokens=None))
    out = genjax.generate(model, params, IDS, config)
    np.testing.assert_array_equal(out.sequences, plain.sequences)
    # Random models fall into loops, which prompt lookup then predicts.
    assert np.asarray(out.num_accepted_tokens).sum() > 0


def test_prompt_lookup_candidates_follow_transformers():
    # Row: padding, then 1 2 3 9 1 2 3 7 1 2 | 3: the last 2-gram "2 3" first occurs at slots
    # 2-3 and is followed by 9 1 2 3 (4 candidates); with EOS 1 the candidates stop before it.
    row = [0, 0, 1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3]
    tokens = jnp.asarray([row + [0] * 8], jnp.int32)
    rules = _lookup_rules(first_valid=2, eos=None)
    state = _lookup_state(tokens, len(row))
    candidates, count = assisted.lookup_candidates(state, rules, jnp.asarray([4]))
    assert candidates[0, : int(count[0])].tolist() == [9, 1, 2, 3]
    candidates, count = assisted.lookup_candidates(state, _lookup_rules(2, eos=1), jnp.asarray([4]))
    assert candidates[0, : int(count[0])].tolist() == [9]
    # No earlier occurrence of "3" or "2 3" in a row without repeats: no candidates.
    state = _lookup_state(jnp.asarray([[0, 0, 1, 2, 3] + [0] * 8], jnp.int32), 5)
    assert int(assisted.lookup_candidates(state, rules, jnp.asarray([4]))[1][0]) == 0


def _lookup_rules(first_valid, eos):
    context = P.LogitsContext.for_prompt(jnp.zeros((1, 4), jnp.int32))
    context = context.replace(first_valid=jnp.asarray([first_valid], jnp.int32))
    return assisted.AssistRules(
        config=None,
        eos_token_ids=None if eos is None else jnp.asarray([eos]),
        pad_token_id=jnp.asarray(0),
        context=context,
        stopping=None,
        threshold=jnp.asarray(0.0),
        num_new_tokens=4,
        num_candidates=4,
        schedule="constant",
        lookup_ngram=2,
        do_sample=False,
    )


def _lookup_state(tokens, length):
    return assisted.AssistState(
        tokens=tokens,
        lengths=jnp.asarray([length], jnp.int32),
        **{f: None for f in ("positions", "cache", "cache_mask", "draft_cache", "draft_mask")},
        **{f: None for f in ("draft_behind", "finished", "stop_lengths", "num_candidates")},
        **{f: None for f in ("num_accepted", "iteration", "key", "scores", "raw_logits")},
    )


# ----------------------------------------------------------------------------- fake models


@dataclasses.dataclass(frozen=True)
class _Counter:
    """A fake model: the next token is ``token + 1`` (mod V), plus one more at positions where
    ``position % period == phase`` (never when period is 0). The draft's confidence is low
    (about 0.1) at positions where ``position % unsure == 0`` (never when unsure is 0)."""

    period: int = 0
    phase: int = 0
    unsure: int = 0
    vocab_size: int = 16
    num_layers: int = 1
    dtype = jnp.float32
    max_position_embeddings = None

    def init_cache(self, batch, max_length, dtype=None):
        return KVCache.create(1, batch, max_length, 1, 1)

    def apply(self, params, tokens, positions, cache, attention_mask):
        step = jnp.ones_like(tokens)
        if self.period:
            step = step + (positions % self.period == self.phase)
        scale = jnp.full(tokens.shape, 10.0)
        if self.unsure:
            scale = jnp.where(positions % self.unsure == 0, 0.5, scale)
        logits = jax.nn.one_hot((tokens + step) % self.vocab_size, self.vocab_size)
        return logits * scale[..., None] * params, cache.advance(tokens.shape[1])


def _fake(target, draft, config, ids=((1, 2, 3),), **kw):
    ids = np.asarray(ids, np.int32)
    return genjax.generate(
        target, 1.0, ids, config, assistant_model=draft, assistant_params=1.0, **kw
    )


def test_fake_models_accept_exactly_the_agreeing_tokens():
    # The target skips a token after positions 4, 9, 14 ...; the draft never does. From position
    # 3 (the first new token), each round of 4 candidates is accepted up to the next skip.
    target, draft = _Counter(period=5, phase=4), _Counter()
    config = GenerationConfig(max_new_tokens=11, num_assistant_tokens=4)
    out = _fake(target, draft, config, ids=((1, 2, 3), (4, 5, 6)))
    plain = genjax.generate(target, 1.0, np.asarray([[1, 2, 3], [4, 5, 6]]), config)
    np.testing.assert_array_equal(out.sequences, plain.sequences)
    # The first token (position 3) comes from the prefill. Round 1 from position 3: 1 accepted,
    # then the target's correction; round 2 from position 5: all 4 accepted plus a bonus token;
    # round 3 from position 10: 3 slots left, so 2 candidates, both accepted, plus a bonus.
    # Row 1 sits at the same positions, so it accepts the same: 1 + 4 + 2 = 7.
    assert out.num_accepted_tokens.tolist() == [7, 7]


def test_heuristic_schedule_and_confidence_threshold_change_only_the_speed():
    target, draft = _Counter(period=5, phase=4), _Counter(unsure=3)
    config = GenerationConfig(max_new_tokens=11, num_assistant_tokens=4)
    plain = genjax.generate(target, 1.0, np.asarray([[1, 2, 3]]), config).sequences
    counts = {}
    for schedule in ("constant", "heuristic"):
        for threshold in (0.0, 0.4):
            cfg = config.replace(
                num_assistant_tokens_schedule=schedule, assistant_confidence_threshold=threshold
            )
            out = _fake(target, draft, cfg)
            np.testing.assert_array_equal(out.sequences, plain)
            counts[schedule, threshold] = int(out.num_accepted_tokens[0])
    # The unsure draft stops after its candidate at positions 6, 9, 12: fewer tokens accepted
    # per round; the heuristic schedule shrinks rounds after each rejection.
    assert counts["constant", 0.4] < counts["constant", 0.0]
    assert counts["heuristic", 0.0] <= counts["constant", 0.0]


def test_new_threshold_temperature_and_key_compile_nothing():
    target, draft = _Counter(period=5, phase=4), _Counter(unsure=3)
    traces = []

    def counting(scores, context):
        traces.append(1)
        return scores

    def run(seed, **kw):
        config = GenerationConfig(
            max_new_tokens=6, do_sample=True, num_assistant_tokens=3, top_k=4, **kw
        )
        _fake(target, draft, config, key=jax.random.key(seed), logits_processor=[counting])

    run(0, temperature=0.7, assistant_confidence_threshold=0.4)
    compiled = len(traces)
    assert compiled > 0
    run(1, temperature=0.9, assistant_confidence_threshold=0.2)
    assert len(traces) == compiled


# ----------------------------------------------------------------------------- sampling


VOCAB = 8


@pytest.fixture(scope="module")
def small_pair(tmp_path_factory):
    """A target and a different draft over 8 tokens, so sampled continuations can be counted."""
    folder = tmp_path_factory.mktemp("assisted_small")
    # No EOS in config.json: the counted continuations must not stop (token 2 is no EOS).
    write_random_checkpoint(folder / "t", "llama", seed=0, vocab_size=VOCAB, eos_token_id=None)
    write_random_checkpoint(
        folder / "d", "llama", seed=3, vocab_size=VOCAB, num_hidden_layers=1, eos_token_id=None
    )
    target = genjax.models.from_pretrained(str(folder / "t"))
    return target, genjax.models.from_pretrained(str(folder / "d"))


SAMPLING = GenerationConfig(
    max_new_tokens=4, do_sample=True, temperature=0.7, top_k=6, num_assistant_tokens=2
)
PROMPT = np.array([[1, 4, 2]], np.int32)


def _exact_joint(model, params):
    """float64[V, V, V, V]: the target's processed probability of each 4-token continuation."""
    grid = np.stack(np.meshgrid(*[np.arange(VOCAB)] * 3, indexing="ij"), -1).reshape(-1, 3)
    seqs = np.concatenate([np.repeat(PROMPT, len(grid), 0), grid], 1)
    n, total = seqs.shape
    positions = np.broadcast_to(np.arange(total), (n, total))
    logits, _ = model.apply(
        params,
        jnp.asarray(seqs),
        jnp.asarray(positions),
        model.init_cache(n, total),
        jnp.ones((n, total), jnp.int32),
    )
    warp = P.chain(P.temperature(0.7), P.top_k(6))
    context = P.LogitsContext.for_prompt(jnp.asarray(seqs))
    steps = [
        np.asarray(jax.nn.softmax(warp(logits[:, 2 + i], context)), np.float64) for i in range(4)
    ]
    p1 = steps[0][0]  # [V]
    p2 = steps[1].reshape(VOCAB, VOCAB, VOCAB, VOCAB)[:, 0, 0]  # [x1, x2]
    p3 = steps[2].reshape(VOCAB, VOCAB, VOCAB, VOCAB)[:, :, 0]  # [x1, x2, x3]
    p4 = steps[3].reshape(VOCAB, VOCAB, VOCAB, VOCAB)  # [x1, x2, x3, x4]
    return p1[:, None, None, None] * p2[:, :, None, None] * p3[:, :, :, None] * p4


def _sampled_p_values(small_pair, samples=8192, seed=0, **kw):
    (model, params), (draft, draft_params) = small_pair
    ids = np.repeat(PROMPT, samples, 0)
    out = genjax.generate(
        model,
        params,
        ids,
        SAMPLING,
        key=jax.random.key(seed),
        assistant_model=draft,
        assistant_params=draft_params,
        **kw,
    )
    new = np.asarray(out.sequences)[:, 3:]
    counts = np.zeros((VOCAB,) * 4)
    np.add.at(counts, tuple(new.T), 1)
    joint = _exact_joint(model, params) * samples
    pairs = [(0, 1), (1, 2), (2, 3)]
    sums = [tuple(a for a in range(4) if a not in pair) for pair in pairs]
    return [chi_square_p_value(counts.sum(s), joint.sum(s)) for s in sums], out


def test_speculative_sampling_draws_from_the_target_distribution(small_pair):
    p_values, out = _sampled_p_values(small_pair)
    assert min(p_values) > 1e-4, p_values
    assert 0 < float(np.mean(out.num_accepted_tokens)) < 2  # candidates both kept and rejected


def test_chi_square_catches_a_broken_acceptance_rule(small_pair, monkeypatch):
    """The test above has power: accepting every candidate must fail it.

    ``generate`` keeps one compiled program per static structure, and the patched rule is not
    part of it. The call therefore passes its own do-nothing processor, a static argument no
    other call shares: it compiles a fresh program with the broken rule in it (``traced``
    proves it), and no later call can be handed that program.
    """
    traced = []

    def broken(rules, scores, proposal, key):
        traced.append(1)
        width = rules.num_candidates
        rows = jnp.arange(scores.shape[0])
        token = jax.random.categorical(key, scores[rows, jnp.minimum(proposal.count, width)])
        return proposal.count, token.astype(jnp.int32)

    def unchanged(scores, context):
        return scores

    monkeypatch.setattr(assisted, "_accept_speculative", broken)
    p_values, _ = _sampled_p_values(small_pair, logits_processor=[unchanged])
    assert traced, "the broken rule was never traced: a cached program ran instead"
    assert min(p_values) < 1e-6, p_values


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "change, error, words",
    [
        (dict(num_beams=2), UnsupportedError, "beam search"),
        (dict(num_return_sequences=2, do_sample=True), UnsupportedError, "num_return_sequences"),
        (dict(prompt_lookup_num_tokens=3), InputError, "one source"),
        (dict(draft=_Counter(vocab_size=17)), InputError, "vocabulary has 17"),
        (dict(streamer=True), UnsupportedError, "streamer"),
        (dict(params=None), InputError, "assistant_params"),
    ],
)
def test_bad_input_raises_a_clear_error(change, error, words):
    change = dict(change)
    draft = change.pop("draft", _Counter())
    params = change.pop("params", 1.0)
    streamer = _Streamer() if change.pop("streamer", False) else None
    config = GenerationConfig(max_new_tokens=4, **change)
    with pytest.raises(error, match=words):
        genjax.generate(
            _Counter(),
            1.0,
            np.asarray([[1, 2]]),
            config,
            key=jax.random.key(0),
            assistant_model=draft,
            assistant_params=params,
            streamer=streamer,
        )


class _Streamer:
    def put(self, ids):
        pass

    def end(self):
        pass


def test_num_assistant_tokens_below_one_is_rejected():
    with pytest.raises(GenerationConfigError, match="num_assistant_tokens"):
        GenerationConfig(num_assistant_tokens=0)


# ----------------------------------------------------------------------------- bundled pair


def _bundled():
    from genjax.io import bundled

    return bundled.path("genjax-tiny"), bundled.path("genjax-tiny-draft")


def test_bundled_pair_greedy_equals_plain_greedy():
    target_path, draft_path = _bundled()
    model, params = genjax.models.from_pretrained(target_path)
    draft, draft_params = genjax.models.from_pretrained(draft_path)
    tok = genjax.tokenizer.from_pretrained(target_path)
    batch = tok(["def fibonacci(n):\n", "import os\nimport sys\n\nclass "])
    ids, mask = batch["input_ids"], batch["attention_mask"]
    # The model's generation_config.json is the base (as in transformers); do_sample=False on
    # top makes it greedy.
    config = dict(max_new_tokens=24, do_sample=False, num_assistant_tokens=4)
    plain = genjax.generate(model, params, ids, attention_mask=mask, **config)
    out = genjax.generate(
        model,
        params,
        ids,
        attention_mask=mask,
        assistant_model=draft,
        assistant_params=draft_params,
        **config,
    )
    np.testing.assert_array_equal(out.sequences, plain.sequences)
    assert np.asarray(out.num_accepted_tokens).sum() > 0
