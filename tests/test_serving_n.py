"""``num_return_sequences`` in the continuous-batching engine: sequence ``j`` of a request equals
row ``j`` of ``genjax.generate`` with the same key, the prompt's blocks are shared, and streaming
and cancellation treat the sequences as one request.

One tiny random Llama (vocabulary 101) and one engine of four slots for the file. No test waits
on the clock: cancellations come from a result handler (it runs between steps); timeouts only
bound a broken run.
"""

import functools
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import genjax
from genjax import GenerationConfig
from genjax.decoding.sampling import sample, sample_row
from genjax.errors import GenerationConfigError, InputError, UnsupportedError
from genjax.serving import ContinuousBatchingConfig, RequestStatus, init_continuous_batching
from genjax.testing import count_compiles, write_random_checkpoint

pytestmark = pytest.mark.usefixtures("fast_compiles")

NEW, BLOCK = 8, 4
CB = ContinuousBatchingConfig(
    max_batch_size=4,
    block_size=BLOCK,
    max_length=32,
    prefill_chunk_size=8,
    max_decode_steps=4,
    max_logit_bias=0,
    max_bias_sequence_length=1,
    max_no_repeat_ngram_size=0,
    max_top_logprobs=1,
    max_constraint_states=0,
    poll_interval=0.01,
)


@functools.cache
def _model():
    path = tempfile.mkdtemp(prefix="genjax-serving-n-")
    write_random_checkpoint(path, "llama", num_hidden_layers=1, eos_token_id=None)
    return genjax.models.from_pretrained(path)


@pytest.fixture(scope="module")
def manager():
    model, params = _model()
    m = init_continuous_batching(model, params, GenerationConfig(pad_token_id=0), CB)
    m.start()
    yield m
    m.stop(block=True, timeout=30)


def _prompt(seed, length):
    return np.random.default_rng(seed).integers(3, 101, length).tolist()


def _generate(prompt, config, seed):
    """Each row's new tokens and their raw log-probabilities, from ``genjax.generate``."""
    model, params = _model()
    config = config.replace(output_logits=True)
    ids = np.asarray([prompt], np.int32)
    out = genjax.generate(model, params, ids, config, key=jax.random.key(seed))
    tokens = np.asarray(out.sequences)[:, len(prompt) :]
    logp = np.asarray(jax.nn.log_softmax(out.logits, axis=-1))
    rows = np.arange(tokens.shape[0])[:, None]
    return tokens.tolist(), logp[rows, np.arange(tokens.shape[1])[None], tokens]


@pytest.mark.parametrize("vocab", [101, 4096])
def test_sample_row_draws_what_sample_draws_for_that_row(vocab):
    rng = np.random.default_rng(vocab)
    scores = jnp.asarray(rng.normal(size=(5, vocab)) * 3, jnp.float32)
    truncated = jnp.where(scores > 5.0, scores, -jnp.inf)  # a few kept per row
    rows = jnp.arange(5)
    for step, batch in enumerate((scores, truncated)):
        key = jax.random.fold_in(jax.random.key(9), step)
        each = jax.jit(jax.vmap(sample_row, in_axes=(None, 0, 0)))(key, batch, rows)
        np.testing.assert_array_equal(each, sample(key, batch))


def test_sequences_equal_generate_rows_and_share_the_prompt_blocks(manager):
    prompt = _prompt(1, 10)  # two full blocks of 4, then 2 tokens
    config = GenerationConfig(
        max_new_tokens=NEW, pad_token_id=0, do_sample=True, top_p=0.95, num_return_sequences=3
    )
    want, want_logprobs = _generate(prompt, config, seed=5)
    assert len({tuple(row) for row in want}) == 3  # three different samples
    before = manager.metrics()["prefill_tokens"]
    rid = manager.add_request(prompt, generation_config=config, seed=5, logprobs=1)
    out = manager.get_result(rid, timeout=300)
    assert out.status is RequestStatus.FINISHED
    assert out.sequences == want and out.generated_tokens == want[0]
    assert out.finish_reasons == ["length"] * 3
    np.testing.assert_allclose(out.sequence_logprobs, want_logprobs, atol=1e-5)
    assert out.logprobs == out.sequence_logprobs[0]
    assert [len(top) for top in out.sequence_top_logprobs] == [NEW] * 3
    # The first sequence prefills the prompt; the others take its two full blocks.
    assert manager.metrics()["prefill_tokens"] - before == 10 + 2 * (10 - 2 * BLOCK)
    assert manager.metrics()["blocks_in_use"] == 0


def test_keyword_form_with_eos_ends_each_sequence_on_its_own(manager):
    prompt = _prompt(2, 6)
    config = GenerationConfig(max_new_tokens=NEW, pad_token_id=0, do_sample=True)
    rows, _ = _generate(prompt, config.replace(num_return_sequences=4), seed=11)
    eos = rows[1][2]  # sequence 1 ends at its third token (others wherever they meet it)
    config = config.replace(num_return_sequences=4, eos_token_id=[eos])
    want, _ = _generate(prompt, config, seed=11)
    rid = manager.add_request(
        prompt, max_new_tokens=NEW, do_sample=True, num_return_sequences=4, eos_token_id=[eos],
        seed=11,
    )  # fmt: skip
    out = manager.get_result(rid, timeout=300)
    for row, sequence, reason in zip(want, out.sequences, out.finish_reasons, strict=True):
        ended = eos in row
        assert sequence == (row[: row.index(eos) + 1] if ended else row)
        assert reason == ("stop" if ended else "length")
    assert len(out.sequences[1]) == 3


def test_streaming_and_cancel_end_every_sequence_and_free_every_block(manager):
    prompt = _prompt(3, 5)
    seen = []

    def cancel_after_some_tokens(out):
        if out.request_id == "n-cancel" and not out.is_finished():
            seen.append(out)
            if sum(len(s) for s in out.sequences) >= 6:
                manager.cancel_request("n-cancel")

    manager.register_result_handler(cancel_after_some_tokens)
    manager.add_request(
        prompt, request_id="n-cancel", max_new_tokens=24, do_sample=True,
        num_return_sequences=3, streaming=True, seed=2,
    )  # fmt: skip
    streamed = list(manager.request_id_iter("n-cancel", timeout=300))
    final = manager.get_result("n-cancel", timeout=10)
    assert final.status is RequestStatus.CANCELLED and streamed[-1] == final
    assert sum(o.is_finished() for o in streamed) == 1
    assert len(final.sequences) == 3 and max(len(s) for s in final.sequences) < 24
    for partial in streamed[:-1]:  # each partial's sequences are prefixes of the final ones
        for part, whole in zip(partial.sequences, final.sequences, strict=True):
            assert whole[: len(part)] == part
    assert manager.metrics()["blocks_in_use"] == 0 and manager.metrics()["running"] == 0


def test_no_compilation_for_forked_requests_after_warmup(manager):
    with count_compiles() as compiled:
        ids = [
            manager.add_request(_prompt(10 + n, 3 + n), max_new_tokens=5, do_sample=True,
                                num_return_sequences=n, seed=n, temperature=0.7)
            for n in (2, 4, 1)
        ]  # fmt: skip
        outs = [manager.get_result(i, timeout=300) for i in ids]
    assert [len(o.sequences) for o in outs] == [2, 4, 1]
    assert compiled == []


def test_num_return_sequences_is_checked(manager):
    with pytest.raises(InputError, match="num_return_sequences=5 .* max_batch_size=4"):
        manager.add_request([3, 4], do_sample=True, num_return_sequences=5)
    with pytest.raises(GenerationConfigError, match="num_return_sequences=0"):
        manager.add_request([3, 4], do_sample=True, num_return_sequences=0)
    with pytest.raises(GenerationConfigError, match="num_return_sequences must be 1 with greedy"):
        manager.add_request([3, 4], num_return_sequences=2)  # as generate refuses it
    with pytest.raises(UnsupportedError, match="beam search"):
        manager.add_request([3, 4], num_beams=2, num_return_sequences=2)
