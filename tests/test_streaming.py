"""Streamers: text rules on a tokenizer built here, and streaming from inside ``generate``.

The model is a tiny random Llama whose vocabulary is a byte-level BPE trained here (no network).
Scripted runs force a chosen token sequence with a processor, so the streamed text is known.
"""

import dataclasses
import functools
import json
import queue
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import genjax
import genjax.testing
from genjax import GenerationConfig
from genjax.cache import KVCache
from genjax.decoding.sampling import DecodeRules, DecodeState, decode, greedy_chooser
from genjax.errors import InputError, UnsupportedError
from genjax.processors import LogitsContext, identity
from genjax.stopping import stopping_rules
from genjax.stopping.stop_strings import _byte_alphabet
from genjax.streaming import (
    BaseStreamer,
    TextIteratorStreamer,
    TextStreamer,
    stream_to,
    token_hook,
)

pytestmark = pytest.mark.usefixtures("fast_compiles")

CORPUS = ["def fibonacci(n):\n    return n", "hello world, hello tokens"] * 20
PAD, BOS, EOS = 0, 1, 2
PROMPT = "def fib"
# Multi-byte characters split over single-byte tokens: 2 bytes (é, ï), 3 (世, 界, →), 4 (🙂).
UTF8_TEXT = "héllo 世界, naïve→ok 🙂 done\nbye"
BYTE_TOKEN = {byte: char for char, byte in _byte_alphabet().items()}  # byte -> token string


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(model, params, tokenizer, prompt ids int32[1, P])."""
    backend = genjax.testing.tiny_bpe_tokenizer(CORPUS)
    path = tmp_path_factory.mktemp("streaming")
    backend.save(str(path / "tokenizer.json"))
    special = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
    (path / "tokenizer_config.json").write_text(json.dumps(special))
    tok = genjax.tokenizer.from_pretrained(path)
    genjax.testing.write_random_checkpoint(path, "llama", vocab_size=tok.vocab_size)
    model, params = genjax.models.from_pretrained(path)
    ids = tok(PROMPT, add_special_tokens=False)["input_ids"]
    return model, params, tok, ids


class Recorder(BaseStreamer):
    """Keeps every put (as a list of ids) and counts the ends."""

    def __init__(self):
        self.puts, self.ends = [], 0

    def put(self, value):
        self.puts.append(np.asarray(value).tolist())

    def end(self):
        self.ends += 1


class Chunks(TextStreamer):
    """A TextStreamer that keeps its chunks instead of printing them."""

    def __init__(self, tokenizer, **kwargs):
        super().__init__(tokenizer, **kwargs)
        self.chunks, self.ended = [], False

    def on_finalized_text(self, text, stream_end=False):
        self.chunks.append(text)
        self.ended = self.ended or stream_end


TRACES = []


def counting(scores, context):
    """An identity processor that counts how often the program is traced."""
    TRACES.append(1)
    return scores


@dataclasses.dataclass(frozen=True)
class Script:
    """Forces the tokens ``ids`` (hashable: equal scripts share a compiled program)."""

    ids: tuple[int, ...]

    def __call__(self, scores, context):
        step = jnp.minimum(context.length - context.prompt_end, len(self.ids) - 1)
        wanted = jnp.asarray(self.ids, jnp.int32)[step]
        return jnp.where(jnp.arange(scores.shape[-1]) == wanted, 0.0, -jnp.inf)


def _byte_ids(tok, text: str) -> list[int]:
    """One token per UTF-8 byte of ``text``."""
    vocab = tok.get_vocab()
    return [vocab[BYTE_TOKEN[b]] for b in text.encode("utf-8")]


SAMPLE = GenerationConfig(max_new_tokens=12, do_sample=True, temperature=0.9, pad_token_id=PAD)


def _sample(setup, **kwargs):
    model, params, _, ids = setup
    return genjax.generate(
        model, params, ids, SAMPLE, key=jax.random.key(3), logits_processor=[counting], **kwargs
    )


def _utf8_script(tok) -> Script:
    """The bytes of UTF8_TEXT, then EOS, then a few tokens that must never be generated."""
    return Script(tuple(_byte_ids(tok, UTF8_TEXT) + [EOS] + _byte_ids(tok, "xyz")))


def _scripted(setup, streamer):
    model, params, tok, ids = setup
    script = _utf8_script(tok)
    config = GenerationConfig(max_new_tokens=len(script.ids), eos_token_id=EOS, pad_token_id=PAD)
    return genjax.generate(model, params, ids, config, logits_processor=[script], streamer=streamer)


# ----------------------------------------------------------------------------- through generate


def test_streamed_tokens_and_text_equal_the_sequences(setup, capsys):
    _, _, tok, ids = setup
    plain = np.asarray(_sample(setup).sequences)
    recorder = Recorder()
    out = _sample(setup, streamer=recorder)
    np.testing.assert_array_equal(out.sequences, plain)  # streaming changes no token
    new = plain[0, ids.shape[1] :].tolist()
    assert recorder.puts == [ids.tolist()] + [[t] for t in new]  # the prompt once, then each
    assert recorder.ends == 1

    capsys.readouterr()
    _sample(setup, streamer=TextStreamer(tok, skip_prompt=True))
    assert capsys.readouterr().out == tok.decode(new) + "\n"
    _sample(setup, streamer=TextStreamer(tok))
    assert capsys.readouterr().out == tok.decode(plain[0].tolist()) + "\n"


def test_iterator_streamer_feeds_a_consumer_thread(setup):
    _, _, tok, ids = setup
    streamer = TextIteratorStreamer(tok, skip_prompt=True, timeout=120)  # a bound only
    chunks, errors = [], []

    def consume():  # ends when it reads the stop signal that generate's end() queues
        try:
            chunks.extend(streamer)
        except Exception as error:  # reported by the main thread
            errors.append(error)

    consumer = threading.Thread(target=consume)
    consumer.start()
    try:
        out = _sample(setup, streamer=streamer)
    except BaseException:
        streamer.text_queue.put(streamer.stop_signal)  # generate failed: let the consumer end
        raise
    finally:
        consumer.join(timeout=120)  # a bound only
    assert not consumer.is_alive() and errors == []
    new = np.asarray(out.sequences)[0, ids.shape[1] :].tolist()
    assert "".join(chunks) == tok.decode(new)


def test_split_utf8_characters_never_stream_a_replacement_character(setup):
    _, _, tok, _ = setup
    streamer = Chunks(tok, skip_prompt=True, skip_special_tokens=True)
    _scripted(setup, streamer)
    assert "".join(streamer.chunks) == UTF8_TEXT
    assert streamer.ended
    assert not any("\ufffd" in chunk for chunk in streamer.chunks)
    assert "世" in streamer.chunks and "界" in streamer.chunks  # CJK flushed at once
    assert " 🙂 " not in streamer.chunks and "🙂 " in streamer.chunks  # a symbol waits for space


def test_eos_ends_the_stream_without_padding(setup):
    _, _, tok, ids = setup
    recorder = Recorder()
    out = _scripted(setup, recorder)
    text_ids = _byte_ids(tok, UTF8_TEXT)
    assert recorder.puts == [ids.tolist()] + [[t] for t in text_ids + [EOS]]
    assert recorder.ends == 1
    sequences = np.asarray(out.sequences)[0, ids.shape[1] :]
    np.testing.assert_array_equal(sequences[: len(text_ids) + 1], text_ids + [EOS])
    np.testing.assert_array_equal(sequences[len(text_ids) + 1 :], PAD)


def test_finished_rows_are_not_streamed():
    """Inside the loop, rows that finished (here row 1 at its first token) stream no padding."""
    table = jnp.array([1, 2, 3, 4, 5, 1])  # the next token after t is table[t]

    def step(params, tokens, positions, cache, mask):
        return jax.nn.one_hot(table[tokens], 6) * 9.0, cache.advance(tokens.shape[1])

    prompt = jnp.array([[1], [3]], jnp.int32)
    tokens = jnp.concatenate([prompt, jnp.zeros((2, 5), jnp.int32)], 1)
    recorder = Recorder()

    @jax.jit
    def run(tokens, stream_id):
        state = DecodeState(
            tokens=tokens,
            length=jnp.asarray(1, jnp.int32),
            positions=jnp.ones((2,), jnp.int32),
            cache=KVCache.create(1, 2, 6, 1, 1).advance(1),
            attention_mask=jnp.ones((2, 6), jnp.int32),
            finished=jnp.zeros((2,), bool),
            key=jax.random.key(0),
            scores=None,
            raw_logits=None,
        )
        rules = DecodeRules(
            process=identity(),
            choose=greedy_chooser(),
            context=LogitsContext.for_prompt(tokens[:, :1]),
            pad_token_id=jnp.asarray(0, jnp.int32),
            stopping=stopping_rules(jnp.array([4], jnp.int32)),
            on_token=token_hook(stream_id),
        )
        first, _ = step(None, tokens[:, :1], None, state.cache, None)
        return decode(step, None, state, first[:, -1], rules).tokens

    with stream_to(recorder, prompt) as stream_id:
        out = jax.block_until_ready(run(tokens, stream_id))
    # Row 0: 2 3 4(EOS); row 1: 4(EOS), then padding that is not streamed.
    np.testing.assert_array_equal(out[:, 1:4], [[2, 3, 4], [4, 0, 0]])
    assert recorder.puts == [[[1], [3]], [2, 4], [3], [4]]


def test_new_streamers_compile_nothing_and_no_streamer_compiles_no_callback(setup):
    model, params, tok, ids = setup
    _sample(setup, streamer=Recorder())
    compiled = len(TRACES)
    _sample(setup, streamer=Recorder())
    _sample(setup, streamer=Chunks(tok))
    _sample(setup, streamer=TextIteratorStreamer(tok))
    assert len(TRACES) == compiled

    generate = jax.jit(functools.partial(genjax.generate, model))
    config = GenerationConfig(max_new_tokens=4, pad_token_id=PAD)
    assert "callback" not in generate.lower(params, ids, config).as_text()
    streaming = jax.jit(lambda p, i, s: _lowered_with_stream(model, p, i, config, s))
    assert "callback" in streaming.lower(params, ids, jnp.int32(0)).as_text()


def _lowered_with_stream(model, params, ids, config, stream_id):
    """The program generate compiles for a streamer (no bucket padding here)."""
    import dataclasses

    from genjax.generation.entry import program
    from genjax.generation.plan import CallRequest, prepare

    mask = jnp.ones(ids.shape, jnp.int32)
    call = prepare(model, params, ids, config, CallRequest(attention_mask=mask))
    plan = dataclasses.replace(call.plan, streaming=True)
    return program(plan)(plan, *call.arguments(stream_id)).sequences


def test_concurrent_streams_each_get_their_own_tokens(setup):
    model, params, _, ids = setup
    recorders, outputs, errors = [Recorder() for _ in range(3)], [None] * 3, []

    def work(i):
        try:
            out = genjax.generate(
                model, params, ids, SAMPLE, key=jax.random.key(i), logits_processor=[counting],
                streamer=recorders[i],
            )  # fmt: skip
            outputs[i] = np.asarray(out.sequences)[0].tolist()
        except Exception as error:  # reported by the main thread
            errors.append(error)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)  # a bound only: each thread ends when its generate returns
    assert not any(thread.is_alive() for thread in threads) and errors == []
    assert len({tuple(o) for o in outputs}) == 3  # three keys, three different samples
    for recorder, out in zip(recorders, outputs, strict=True):
        assert [t for put in recorder.puts for t in np.ravel(put)] == out
        assert recorder.ends == 1


def test_an_exception_in_put_is_raised_by_generate(setup):
    class Failing(Recorder):
        def put(self, value):
            super().put(value)
            if len(self.puts) == 3:
                raise KeyError("the sink is gone")

    streamer = Failing()
    with pytest.raises(KeyError, match="the sink is gone"):
        _sample(setup, streamer=streamer)
    assert len(streamer.puts) == 3 and streamer.ends == 0  # no more puts after it failed


def test_unsupported_calls_fail_before_anything_is_streamed(setup):
    model, params, _, ids = setup
    recorder = Recorder()
    config = GenerationConfig(max_new_tokens=4, pad_token_id=PAD)
    with pytest.raises(InputError, match="batch size 1"):
        genjax.generate(model, params, np.repeat(ids, 2, 0), config, streamer=recorder)
    with pytest.raises(InputError, match="num_return_sequences=2"):
        genjax.generate(
            model, params, ids, config, streamer=recorder, num_return_sequences=2, do_sample=True,
            key=jax.random.key(0),
        )  # fmt: skip
    with pytest.raises(UnsupportedError, match="beam search"):
        genjax.generate(model, params, ids, config, streamer=recorder, num_beams=2)
    with pytest.raises(UnsupportedError, match="jax.jit"):
        jax.jit(lambda p: genjax.generate(model, p, ids, config, streamer=recorder).sequences)(
            params
        )
    with pytest.raises(TypeError, match="put"):
        genjax.generate(model, params, ids, config, streamer=print)
    assert recorder.puts == [] and recorder.ends == 0


# ----------------------------------------------------------------------------- text rules


def test_text_streamer_releases_words_and_characters_when_final(setup):
    _, _, tok, _ = setup
    streamer = Chunks(tok)
    for token in _byte_ids(tok, "ab 世界 x→y z"):
        streamer.put(np.array([token]))
    streamer.end()
    assert [c for c in streamer.chunks if c] == ["a", "b", " ", "世", "界", " ", "x", "→y ", "z"]
    assert streamer.ended and streamer.chunks[-1] == ""


def test_text_streamer_lines_concatenate_to_the_decoded_text(setup):
    _, _, tok, _ = setup
    text = "def fibonacci(n):\n    return n\n\nhello world, hello tokens"
    ids = tok.encode(text, add_special_tokens=False)
    streamer = Chunks(tok, skip_prompt=True)
    streamer.put(np.array([ids[:3]]))  # the prompt, skipped
    for token in ids[3:]:
        streamer.put(np.array([token]))
    streamer.end()
    assert "".join(streamer.chunks) == tok.decode(ids[3:])
    assert any(chunk.endswith("\n") for chunk in streamer.chunks)
    with pytest.raises(ValueError, match="batch size 1"):
        streamer.put(np.zeros((2, 3), np.int32))


class _NoWaitQueue(queue.Queue):
    """A queue whose ``get`` on an empty queue records its timeout and raises ``queue.Empty`` at
    once, as a real queue does when the timeout has passed: the timeout is checked without
    waiting on a clock."""

    def __init__(self):
        super().__init__()
        self.timeouts = []

    def get(self, block=True, timeout=None):
        if self.empty():
            self.timeouts.append((block, timeout))
            raise queue.Empty
        return super().get(block, timeout)


def test_iterator_streamer_stops_at_end_and_times_out():
    class Letters:
        def decode(self, ids, **kwargs):
            return "".join(chr(ord("a") + i) for i in ids)

    streamer = TextIteratorStreamer(Letters(), timeout=30.0)
    streamer.text_queue = empty_waits = _NoWaitQueue()
    streamer.put(np.array([[0, 1]]))
    streamer.put(np.array([2]))
    streamer.end()
    assert list(streamer) == ["ab", "c", ""]
    assert empty_waits.timeouts == []  # every chunk was there: nothing waited
    with pytest.raises(queue.Empty):
        next(streamer)
    assert empty_waits.timeouts == [(True, 30.0)]  # it would have waited 30 s, then raised
