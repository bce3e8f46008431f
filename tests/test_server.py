"""``genjax serve``: the OpenAI wire format, the app over a fake manager, and the real server.

The real server runs the bundled model in a subprocess on a free port of 127.0.0.1 (one per
session; ready when it prints its URL), driven by the official ``openai`` client with
``max_retries=0``. Its teardown sends SIGTERM during a stream and checks the stream still ends
and the process exits 0. Error paths that need an engine in a given state (a full queue, an
internal fault, draining) run in-process against a fake manager. ``-m load`` adds 32 concurrent
streams. Every wait has a safety bound.
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import httpx
import jax
import jsonschema
import numpy as np
import openai
import pytest

import genjax
from genjax.io import bundled
from genjax.io import tokenizer as tokenizers
from genjax.serving.guided import GuidedSpec, guided_spec
from genjax.serving.logprobs import TokenTexts
from genjax.serving.protocol import (
    APIError,
    ChatRequest,
    CompletionRequest,
    derive_seed,
    engine_options,
    generation_options,
    parse_request,
)
from genjax.serving.responses import StopText, make_choices
from genjax.serving.scheduler import RequestStatus
from genjax.serving.server import build_app

pytestmark = pytest.mark.usefixtures("fast_compiles")

MODEL = bundled.DEFAULT_MODEL
KEY = "sk-test-key"
CONTEXT = 256
READY_TIMEOUT = 600  # seconds: the subprocess loads and compiles the engine on 2 busy cores
PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:\n", "for i in range("]
COLOUR = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]}, "size": {"type": "integer"}},
    "required": ["color", "size"],
}


# ---------------------------------------------------------------------------- the wire format


def test_stop_text_holds_back_a_possible_stop_and_cuts_a_found_one():
    text = StopText(lambda ids: "".join(map(chr, ids)), ("<END>", "xyz"))
    steps = ["ab<", "ab<EN", "ab<EN!", "ab<EN!x", "ab<EN!<END>tail"]
    shown = [text.advance([ord(c) for c in s], final=False) for s in steps]
    assert shown == ["ab", "", "<EN!", "", ""]
    assert text.stopped and text.text == "ab<EN!"


def test_stop_text_final_flushes_what_was_held_and_waits_for_whole_characters():
    text = StopText(lambda ids: "".join(map(chr, ids)), ("<END>",))
    assert text.advance([ord(c) for c in "ok<E"], final=False) == "ok"
    assert text.advance([ord(c) for c in "ok<E"], final=True) == "<E"
    partial = StopText(lambda ids: "é\ufffd" if len(ids) == 1 else "éè", ())
    assert partial.advance([1], final=False) == "é"
    assert partial.advance([1, 2], final=False) == "è"


def test_stop_text_keeps_the_stop_string_when_asked_the_earliest_first():
    chars = lambda ids: "".join(map(chr, ids))
    text = StopText(chars, ("xyz", "<END>", "<E"), keep_stop=True)
    assert text.advance([ord(c) for c in "ab<END>xyz tail"], final=False) == "ab<END>"
    assert text.stopped  # "<END>" and "<E" start together: the first listed of the two


def test_a_choice_shows_its_ending_token_only_when_asked():
    end = SimpleNamespace(generated_tokens=[5, 6, 2], finish_reason="stop")
    end.is_finished = lambda: True
    length = SimpleNamespace(**{**vars(end), "finish_reason": "length"})
    chars = lambda ids: "".join(map(chr, ids))
    (plain,) = make_choices("t", [3], 1, chars, (), [2, 9], keep_stop=False)
    (kept,) = make_choices("t", [3], 1, chars, (), 2, keep_stop=True)
    assert plain.request_id == "t-0" and plain.stop_ids == {2, 9}
    assert plain.shown(end) == [5, 6] and kept.shown(end) == [5, 6, 2]
    assert plain.shown(length) == [5, 6, 2]  # a length limit: the last token is text


def test_derive_seed_is_stable_distinct_and_in_int32():
    seeds = [derive_seed(2**40 + 3, i) for i in range(4)]
    assert seeds == [derive_seed(2**40 + 3, i) for i in range(4)]
    assert len(set(seeds)) == 4 and all(0 <= s < 2**31 - 1 for s in seeds)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "x"}, "model"),
        ({"model": "m", "prompt": "x", "max_tokens": "9"}, "max_tokens"),
        ({"model": "m", "prompt": "x", "stream": 1}, "stream"),
        ({"model": "m", "prompt": "x", "best_effort": True}, "best_effort"),
        ({"model": "m", "prompt": [[1], "a"]}, "prompt"),
        ({"model": "m", "prompt": "x", "bad_words": "one"}, "bad_words"),  # a list of strings
    ],
)
def test_parse_request_names_the_bad_field(body, param):
    with pytest.raises(APIError) as error:
        parse_request(CompletionRequest, body)
    assert error.value.status == 400 and error.value.param == param


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 0}, "n"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": ""}, "stop"),
        ({"logit_bias": {"5": 100.5}}, "logit_bias"),
        ({"logit_bias": {"4096": 1.0}}, "logit_bias"),  # outside the vocabulary
        ({"logit_bias": {"-5": 1.0}}, "logit_bias"),
        ({"logit_bias": {str(i): 1.0 for i in range(301)}}, "logit_bias"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.01}, "frequency_penalty"),
        ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"stop_token_ids": [5, 4096]}, "stop_token_ids"),
        ({"ignore_eos": True, "guided_regex": "a+"}, "ignore_eos"),
        ({"ignore_eos": True, "response_format": {"type": "json_object"}}, "ignore_eos"),
    ],
)
def test_generation_options_refuses_by_name(extra, param):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}
    request = parse_request(ChatRequest, body)
    with pytest.raises(APIError) as error:
        generation_options(request, genjax.GenerationConfig(), max_n=8, vocab_size=4096)
        engine_options(request)
    assert error.value.status == 400 and error.value.param == param


def test_openai_penalties_bias_and_logprobs_map_onto_the_engine():
    base = genjax.GenerationConfig(sequence_bias=[[[7], 1.0], [[8], 2.0]])
    body = {"model": "m", "prompt": "x", "logprobs": 3, "frequency_penalty": -1.5}
    body["logit_bias"] = {"8": -100, "12": 5.5}
    request = parse_request(CompletionRequest, body)
    config, *_ = generation_options(request, base, max_n=8, vocab_size=4096)
    assert config.sequence_bias == (((7,), 1.0), ((8,), -100.0), ((12,), 5.5))
    assert engine_options(request) == {
        "presence_penalty": 0.0, "frequency_penalty": -1.5, "logprobs": 3
    }  # fmt: skip
    for logprobs in (-1, 6):
        with pytest.raises(APIError, match="logprobs must be between 0 and 5"):
            engine_options(parse_request(CompletionRequest, {**body, "logprobs": logprobs}))
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert engine_options(parse_request(ChatRequest, {**chat, "logprobs": True}))["logprobs"] == 0
    assert engine_options(parse_request(ChatRequest, chat))["logprobs"] is None
    with pytest.raises(APIError) as error:  # completions name it logprobs, not top_logprobs
        parse_request(CompletionRequest, {**body, "top_logprobs": 2})
    assert error.value.param == "top_logprobs"


def test_generation_options_maps_openai_names_onto_the_config():
    base = genjax.GenerationConfig(do_sample=True, temperature=0.8, top_k=50, max_new_tokens=9)
    fields = {"temperature": 0.5, "top_p": 0.9, "min_p": 0.1, "repetition_penalty": 1.2}
    body = {"model": "m", "prompt": "x", "n": 3, "stop": "\n", "max_tokens": 7, **fields}
    body.update(logit_bias={}, presence_penalty=0, frequency_penalty=0.0, user="u")
    config, max_tokens, n, stop = generation_options(
        parse_request(CompletionRequest, body), base, max_n=8
    )
    assert (max_tokens, n, stop) == (7, 3, ("\n",))
    assert config.do_sample and config.top_k == 50 and config.max_new_tokens is None
    assert [getattr(config, k) for k in fields] == pytest.approx(list(fields.values()))
    greedy, *_ = generation_options(
        parse_request(CompletionRequest, {"model": "m", "prompt": "x", "temperature": 0}), base, 8
    )
    assert not greedy.do_sample and greedy.temperature is None and greedy.top_k is None


def test_vllm_end_fields_map_onto_the_eos_ids_and_min_new_tokens():
    base = genjax.GenerationConfig(eos_token_id=[2, 7], min_new_tokens=1)

    def mapped(**extra):
        body = {"model": "m", "prompt": "x", **extra}
        config, *_ = generation_options(
            parse_request(CompletionRequest, body), base, 8, vocab_size=64
        )
        eos = config.eos_token_id
        return np.atleast_1d(eos).tolist(), config.min_new_tokens

    assert mapped() == ([2, 7], 1)  # the checkpoint's
    assert mapped(min_tokens=3, stop_token_ids=[9, 7, 9]) == ([2, 7, 9], 3)
    assert mapped(ignore_eos=True) == ([], 1)  # no EOS (None would be the checkpoint's)
    assert mapped(ignore_eos=True, stop_token_ids=[5]) == ([5], 1)
    assert mapped(ignore_eos=False, stop_token_ids=[]) == ([2, 7], 1)


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_regex, guided_choice"),
        (
            {"response_format": {"type": "json_object"}, "guided_json": {"type": "object"}},
            "response_format, guided_json",
        ),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_choice": ["a", ""]}, "guided_choice"),
    ],
)  # fmt: skip
def test_guided_fields_are_refused_by_name(extra, param):
    with pytest.raises(APIError) as error:
        guided_spec(parse_request(CompletionRequest, {"model": "m", "prompt": "x", **extra}))
    assert error.value.status == 400 and error.value.param == param


def test_guided_fields_map_onto_one_constraint_spec():
    def spec(**extra):
        return guided_spec(parse_request(CompletionRequest, {"model": "m", "prompt": "x", **extra}))

    named = {"name": "colour", "schema": COLOUR, "strict": True}
    by_format = spec(response_format={"type": "json_schema", "json_schema": named})
    assert by_format == GuidedSpec("response_format", "json_schema", json.dumps(COLOUR,
        sort_keys=True, separators=(",", ":")))  # fmt: skip
    assert spec(guided_json=json.dumps(COLOUR)).pattern == by_format.pattern
    assert spec(response_format={"type": "text"}) is None and spec() is None
    assert spec(response_format={"type": "json_object"}).kind == "json_object"
    assert spec(guided_regex="[0-9]+") == GuidedSpec("guided_regex", "regex", "[0-9]+")


# ---------------------------------------------------------------------------- a fake manager


class FakeManager:
    """The manager's public surface; requests stay running until ``finish`` is called."""

    def __init__(self, fail: bool = False):
        self.cb_config = SimpleNamespace(max_batch_size=1, max_logit_bias=300, max_top_logprobs=20)
        self.shape = SimpleNamespace(max_length=64)
        self.model = SimpleNamespace(vocab_size=4096)
        self.generation_config = genjax.GenerationConfig(max_new_tokens=4)
        self.handlers, self.added, self.cancelled, self.fail = [], [], [], fail
        self._arrivals = threading.Condition()

    async def requests_added(self, count: int) -> None:
        """Returns once ``count`` requests have reached ``add_request`` (the server tokenizes in
        a worker thread, so arrival is an event, not a number of event-loop turns)."""

        def wait():
            with self._arrivals:
                assert self._arrivals.wait_for(lambda: len(self.added) >= count, timeout=60)

        await asyncio.to_thread(wait)

    def is_running(self):
        return True

    def register_result_handler(self, handler):
        self.handlers.append(handler)

    def add_request(self, input_ids, request_id, **kwargs):
        if self.fail:
            self.fail = False
            raise RuntimeError("an internal fault")
        with self._arrivals:
            self.added.append(request_id)
            self._arrivals.notify_all()
        return request_id

    def cancel_request(self, request_id):
        self.cancelled.append(request_id)

    def finish(self, request_id, tokens):
        output = SimpleNamespace(
            request_id=request_id,
            generated_tokens=tokens,
            status=RequestStatus.FINISHED,
            finish_reason="length",
            error=None,
            is_finished=lambda: True,
        )
        for handler in self.handlers:
            handler(output)

    def metrics(self):
        return {"steps": 0, "running": len(self.added)}


@pytest.fixture(scope="module")
def tokenizer():
    return tokenizers.from_pretrained(bundled.path())


def _fake_client(app) -> openai.AsyncOpenAI:
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    return openai.AsyncOpenAI(
        base_url="http://fake/v1",
        api_key="unused",
        max_retries=0,
        http_client=httpx.AsyncClient(transport=transport, timeout=30),
    )


def test_a_full_queue_answers_429_with_retry_after(tokenizer):
    manager = FakeManager()
    app = build_app(manager, tokenizer, "fake", max_waiting=0)

    async def scenario():
        async with _fake_client(app) as client:
            return await steps(client)

    async def steps(client):
        first = asyncio.create_task(
            client.completions.create(model="fake", prompt="a", max_tokens=2)
        )
        await manager.requests_added(1)
        with pytest.raises(openai.RateLimitError) as error:
            await client.completions.create(model="fake", prompt="b", max_tokens=2)
        manager.finish(manager.added[0], tokenizer.encode(" ok"))
        done = await asyncio.wait_for(first, 30)
        later = client.completions.create(model="fake", prompt="c", max_tokens=2)
        task = asyncio.create_task(later)
        await manager.requests_added(2)
        manager.finish(manager.added[1], tokenizer.encode("!"))
        return error.value, done, await asyncio.wait_for(task, 30)

    error, done, later = asyncio.run(scenario())
    assert error.status_code == 429 and error.response.headers["retry-after"] == "1"
    assert error.body["code"] == "queue_full"
    assert done.choices[0].text == " ok" and later.choices[0].text == "!"


def test_more_choices_than_the_server_ever_holds_is_a_400(tokenizer):
    app = build_app(FakeManager(), tokenizer, "fake", max_waiting=0)

    async def scenario():
        async with _fake_client(app) as client:
            with pytest.raises(openai.BadRequestError) as error:
                await client.completions.create(model="fake", prompt=["a", "b"])
            return error.value

    assert asyncio.run(scenario()).body["param"] == "n"


def test_an_internal_fault_is_a_500_and_the_server_keeps_serving(tokenizer):
    manager = FakeManager(fail=True)
    app = build_app(manager, tokenizer, "fake")

    async def scenario():
        async with _fake_client(app) as client:
            return await steps(client)

    async def steps(client):
        with pytest.raises(openai.InternalServerError) as error:
            await client.completions.create(model="fake", prompt="a", max_tokens=2)
        models = await client.models.list()
        task = asyncio.create_task(client.completions.create(model="fake", prompt="a"))
        await manager.requests_added(1)
        manager.finish(manager.added[0], tokenizer.encode("fine"))
        return error.value, models, await asyncio.wait_for(task, 30)

    error, models, answer = asyncio.run(scenario())
    assert error.status_code == 500 and error.body["type"] == "server_error"
    assert [m.id for m in models.data] == ["fake"] and answer.choices[0].text == "fine"


def test_draining_answers_503_with_retry_after(tokenizer):
    app = build_app(FakeManager(), tokenizer, "fake")
    app.state.genjax.draining = True

    async def scenario():
        async with _fake_client(app) as client:
            with pytest.raises(openai.APIStatusError) as error:
                await client.completions.create(model="fake", prompt="a")
            return error.value

    error = asyncio.run(scenario())
    assert error.status_code == 503 and "retry-after" in error.response.headers


# ---------------------------------------------------------------------------- the real server


class _Server:
    def __init__(self, process, url, pump):
        self.process, self.url, self.pump = process, url, pump
        self.clients: list[openai.OpenAI] = []  # closed at teardown: no socket left to the GC

    def client(self, **kwargs) -> openai.OpenAI:
        client = openai.OpenAI(base_url=self.url, api_key=KEY, max_retries=0, timeout=120, **kwargs)
        self.clients.append(client)
        return client

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.url.removesuffix("/v1") + "/metrics", timeout=30).text
        return {m[1]: float(m[2]) for m in re.finditer(r"^(genjax_\w+) ([-0-9.e+]+)$", text, re.M)}

    def wait_idle(self, bound: float = 60.0) -> dict[str, float]:
        """Polls /metrics (safety bound ``bound`` seconds) until nothing runs or holds blocks."""
        deadline = time.monotonic() + bound
        while True:
            metrics = self.metrics()
            idle = metrics["genjax_running"] == 0 and metrics["genjax_blocks_in_use"] == 0
            if idle or time.monotonic() > deadline:
                return metrics
            time.sleep(0.05)


def _start_server(tmp_dir) -> _Server:
    stderr_path = os.path.join(tmp_dir, "server.stderr")
    env = {**os.environ, "JAX_DISABLE_MOST_OPTIMIZATIONS": "1", "GENJAX_COMPILE_CACHE": "0"}
    args = ["serve", "--port", "0", "--api-key", KEY, "--max-length", str(CONTEXT)]
    args += ["--max-batch-size", "4", "--max-waiting", "64", "--log-level", "warning"]
    # One prompt prefilled at a time, in chunks of 8, 16 or 32 tokens: 3 prefill programs to
    # compile, not 9 (several prompts a step: tests/test_serving_engine.py).
    args += ["--max-prefill-requests", "1"]
    with open(stderr_path, "w") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "genjax.cli", *args],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=env,
        )
    lines: queue.Queue = queue.Queue()

    def pump():  # read stdout to the end, so the server never blocks on a full pipe
        for line in process.stdout:
            lines.put(line)
        lines.put(None)

    pumping = threading.Thread(target=pump, daemon=True)
    pumping.start()
    deadline = time.monotonic() + READY_TIMEOUT
    while True:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            line = None
        if line is None:
            process.kill()
            with open(stderr_path) as f:
                pytest.fail(f"genjax serve did not get ready:\n{f.read()[-3000:]}")
        found = re.search(r"ready at (http://\S+)", line)
        if found:
            return _Server(process, found[1], pumping)


def _stop_server_gracefully(server: _Server) -> None:
    """SIGTERM during a stream: the stream still ends, a new request is refused, exit code 0."""
    client = server.client()
    stream = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=60, temperature=0, stream=True
    )
    chunks = iter(stream)
    first = next(chunks)
    server.process.send_signal(signal.SIGTERM)
    rest = list(chunks)
    try:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2)
        refused = None
    except (openai.APIStatusError, openai.APIConnectionError) as error:
        refused = error
    code = server.process.wait(timeout=120)
    assert first.choices and rest[-1].choices[0].finish_reason in ("stop", "length")
    assert refused is not None
    assert code == 0


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    running = _start_server(str(tmp_path_factory.mktemp("serve")))
    try:
        yield running
        _stop_server_gracefully(running)
    finally:
        if running.process.poll() is None:
            running.process.kill()
            running.process.wait(timeout=60)
        running.pump.join(timeout=60)
        running.process.stdout.close()
        for client in running.clients:
            client.close()


@pytest.fixture(scope="module")
def model_and_params():
    return genjax.models.from_pretrained(bundled.path())


REFERENCE_TOKENS = 24
LOGPROB_TOKENS = 10
PENALTIES = {"presence_penalty": 0.6, "frequency_penalty": 0.9}
CHAT = [{"role": "user", "content": "Write a function that adds two numbers."}]


@pytest.fixture(scope="module")
def scored_reference(model_and_params, tokenizer):
    """One greedy ``genjax.generate`` call with the raw logits kept, for three rows: PROMPTS[0],
    the chat prompt, and PROMPTS[0] with OpenAI's penalties (per-row processor values). Greedy
    as an override, as transformers takes it: the checkpoint's sampling values stay inert.

    Returns, per row, ``(tokens, log_softmax of the raw logits float[N, V])``."""
    model, params = model_and_params
    rows = [tokenizer.encode(PROMPTS[0]), tokenizer.apply_chat_template(CHAT, True)]
    rows.append(rows[0])
    batch = tokenizer.pad(rows)
    penalties = genjax.processors.count_penalties(
        presence=[0.0, 0.0, PENALTIES["presence_penalty"]],
        frequency=[0.0, 0.0, PENALTIES["frequency_penalty"]],
    )
    out = genjax.generate(
        model,
        params,
        batch["input_ids"],
        attention_mask=batch["attention_mask"],
        max_new_tokens=REFERENCE_TOKENS,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        logits_processor=[penalties],
    )
    new = np.asarray(out.sequences)[:, batch["input_ids"].shape[1] :]
    logp = np.asarray(jax.nn.log_softmax(out.logits, axis=-1))
    return [(new[i].tolist(), logp[i]) for i in range(3)]


def _greedy_text(tokenizer, tokens: list[int], new: int) -> str:
    """The text of the first ``new`` reference tokens up to EOS, special tokens off."""
    eos = genjax.GenerationConfig.from_pretrained(bundled.path()).eos_token_id
    tokens = tokens[:new]
    if eos in tokens:
        tokens = tokens[: tokens.index(eos)]
    return tokenizer.decode(tokens, skip_special_tokens=True)


def test_models_list(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert server.client().models.retrieve(MODEL).id == MODEL


def test_greedy_completion_equals_generate(server, tokenizer, scored_reference):
    answer = server.client().completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0
    )
    ids = tokenizer.encode(PROMPTS[0])
    expected = _greedy_text(tokenizer, scored_reference[0][0], 24)
    assert answer.choices[0].text == expected
    assert answer.usage.prompt_tokens == len(ids) and answer.usage.completion_tokens <= 24
    assert answer.choices[0].finish_reason in ("stop", "length")


def test_greedy_chat_equals_generate_with_the_chat_template(server, tokenizer, scored_reference):
    messages = CHAT
    answer = server.client().chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=20, temperature=0
    )
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    expected = _greedy_text(tokenizer, scored_reference[1][0], 20)
    assert answer.choices[0].message.content == expected
    assert answer.choices[0].message.role == "assistant"
    assert answer.usage.prompt_tokens == len(ids)


def test_streams_give_the_same_text_and_end_with_usage(server):
    client = server.client()
    kwargs = {"model": MODEL, "max_tokens": 20, "temperature": 0}
    whole = client.completions.create(prompt=PROMPTS[1], **kwargs).choices[0].text
    chunks = list(
        client.completions.create(
            prompt=PROMPTS[1], stream=True, stream_options={"include_usage": True}, **kwargs
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert chunks[-2].choices[0].finish_reason in ("stop", "length")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0

    messages = [{"role": "user", "content": "hello"}]
    chat = client.chat.completions.create(messages=messages, **kwargs).choices[0].message.content
    # OpenAI fields at values that ask for nothing the server lacks change nothing.
    neutral = {"store": False, "service_tier": "auto", "tool_choice": "none", "tools": []}
    stream = client.chat.completions.create(messages=messages, stream=True, **neutral, **kwargs)
    deltas = list(stream)
    assert deltas[0].choices[0].delta.role == "assistant"
    assert "".join(d.choices[0].delta.content or "" for d in deltas) == chat
    assert deltas[-1].choices[0].finish_reason in ("stop", "length")


def test_n_choices_and_seeds(server):
    client = server.client()
    kwargs = {"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 16, "temperature": 1.0}
    first = client.completions.create(n=2, seed=1234, **kwargs)
    again = client.completions.create(n=2, seed=1234, **kwargs)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    other = client.completions.create(seed=99, **kwargs)
    solo = client.completions.create(seed=1234, **kwargs)
    assert solo.choices[0].text == first.choices[0].text
    assert len({first.choices[0].text, first.choices[1].text, other.choices[0].text}) > 1

    two_prompts = client.completions.create(
        model=MODEL, prompt=PROMPTS[:2], n=2, max_tokens=4, temperature=0
    )
    assert [c.index for c in two_prompts.choices] == [0, 1, 2, 3]
    assert two_prompts.choices[0].text == two_prompts.choices[1].text


def test_a_stop_string_split_across_tokens_and_chunks_is_caught(server):
    client = server.client()
    kwargs = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 48, "temperature": 0}
    pieces = [
        c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices
    ]
    pieces = [p for p in pieces if p]
    assert len(pieces) >= 3, pieces
    whole = "".join(pieces)
    # A stop string made of the end of one chunk and the start of the next.
    boundary = len(pieces[0]) + len(pieces[1])
    stop = whole[boundary - 3 : boundary + 3]
    assert len(stop) == 6
    expected = whole[: whole.find(stop)]
    stopped = list(client.completions.create(stream=True, stop=[stop, "\x00never"], **kwargs))
    assert "".join(c.choices[0].text for c in stopped) == expected
    assert stopped[-1].choices[0].finish_reason == "stop"
    answer = client.completions.create(stop=stop, **kwargs)
    assert answer.choices[0].text == expected and answer.choices[0].finish_reason == "stop"


def test_structured_output_follows_the_schema_the_choices_or_the_regex(server):
    client = server.client()
    named = {"name": "colour", "schema": COLOUR, "strict": True}
    answer = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        temperature=0,
        max_completion_tokens=64,
        response_format={"type": "json_schema", "json_schema": named},
    )
    jsonschema.validate(json.loads(answer.choices[0].message.content), COLOUR)
    assert answer.choices[0].finish_reason == "stop"
    choices = ["yes", "no", "maybe"]
    picked = client.completions.create(  # sampled: the checkpoint's settings, n = 3
        model=MODEL, prompt=PROMPTS[0], max_tokens=8, n=3, seed=5,
        extra_body={"guided_choice": choices},
    )  # fmt: skip
    assert [c.text in choices for c in picked.choices] == [True] * 3
    kwargs = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 16, "temperature": 0}
    phone = {"guided_regex": r"[0-9]{3}-[0-9]{4}"}
    streamed = client.completions.create(stream=True, extra_body=phone, **kwargs)
    text = "".join(c.choices[0].text for c in streamed if c.choices)
    assert re.fullmatch(phone["guided_regex"], text), text
    assert client.completions.create(extra_body=phone, **kwargs).choices[0].text == text


@pytest.mark.slow  # compiles a constrained engine (24 s): runs with -m slow
def test_json_object_chat_equals_generate_with_the_same_constraint(
    server, tokenizer, model_and_params, scored_reference
):
    """``response_format: json_object`` is genjax.generate with ``constraints.json_object``:
    the same greedy text, which opens an object where the unconstrained reply does not."""
    model, params = model_and_params
    answer = server.client().chat.completions.create(
        model=MODEL,
        messages=CHAT,
        temperature=0,
        max_completion_tokens=20,
        response_format={"type": "json_object"},
    )
    ids = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)
    out = genjax.generate(
        model,
        params,
        np.asarray([ids], np.int32),
        constraint=genjax.constraints.json_object(tokenizer),
        max_new_tokens=20,
        do_sample=False,
    )
    expected = _greedy_text(tokenizer, np.asarray(out.sequences)[0, len(ids) :].tolist(), 20)
    assert answer.choices[0].message.content == expected and expected.startswith("{")
    assert not _greedy_text(tokenizer, scored_reference[1][0], 20).startswith("{")


def test_structured_output_errors_name_the_field(server):
    client = server.client()
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
          "schema": {"type": "nonsense"}}}}, "response_format"),
        ({"guided_regex": "[0-9"}, "guided_regex"),
        ({"guided_json": {"type": "object", "properties": 5}}, "guided_json"),
        ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_regex, guided_choice"),
        # Automata over the pool's sizes: refused before outlines-core builds them.
        ({"guided_regex": "(a|b)*a(a|b){20}"}, "guided_regex"),
        ({"guided_json": {"type": "string", "maxLength": 100000}}, "guided_json"),
    ]  # fmt: skip
    for body, param in cases:
        error = _status(
            lambda b=body: client.completions.create(model=MODEL, prompt="x", extra_body=b)
        )
        assert error.status_code == 400 and error.body["param"] == param, error.body


def _status(call) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as error:
        call()
    return error.value


def test_error_statuses(server):
    client = server.client()
    bad = _status(lambda: client.completions.create(model=MODEL, prompt="x", temperature=-1))
    assert bad.status_code == 400 and bad.body["param"] == "temperature"
    for field, value in [
        ("logit_bias", {"5": 101}),
        ("logit_bias", {"999999": 1}),
        ("presence_penalty", -2.5),
        ("frequency_penalty", 2.5),
        ("logprobs", 6),
        ("top_logprobs", 2),  # a chat field
        ("echo", True),
        ("best_of", 2),
        ("suffix", "x"),
        ("made_up_field", 1),
    ]:
        error = _status(
            lambda f=field, v=value: client.completions.create(
                model=MODEL, prompt="x", extra_body={f: v}
            )
        )
        assert error.status_code == 400 and error.body["param"] == field, error.body
    chat = lambda **kw: client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], **kw
    )
    assert _status(lambda: chat(logprobs=True, top_logprobs=21)).body["param"] == "top_logprobs"
    assert _status(lambda: chat(top_logprobs=2)).body["param"] == "top_logprobs"
    too_long = _status(lambda: client.completions.create(model=MODEL, prompt="a " * CONTEXT))
    assert too_long.status_code == 400 and too_long.body["code"] == "context_length_exceeded"
    wrong_key = server.client()
    wrong_key.api_key = "sk-wrong"
    assert isinstance(_status(lambda: wrong_key.models.list()), openai.AuthenticationError)
    missing = _status(lambda: client.completions.create(model="gpt-4o", prompt="x"))
    assert isinstance(missing, openai.NotFoundError) and missing.body["param"] == "model"


def _check_logprobs(tokens, logprobs, want, top=None, top_ids=None):
    """Server entries (token texts, values, and top entries as (text, value) lists) equal the
    reference row ``want`` = (tokens, logp) on their length (an early EOS ends the server's)."""
    ids, logp = want
    texts = TokenTexts(tokenizers.from_pretrained(bundled.path()))
    count = len(tokens)
    assert 0 < count <= len(ids)
    assert tokens == [texts(t)[0] for t in ids[:count]]
    np.testing.assert_allclose(logprobs, logp[np.arange(count), ids[:count]], atol=1e-4)
    if top is not None:
        best = np.argsort(-logp[:count], axis=-1)[:, :top_ids]
        assert [[t for t, _ in row] for row in top] == [[texts(i)[0] for i in r] for r in best]
        values = np.take_along_axis(logp[:count], best, -1)
        np.testing.assert_allclose([[v for _, v in row] for row in top], values, atol=1e-4)


def test_completion_logprobs_equal_generate_streamed_or_not(server, scored_reference):
    client = server.client()
    kwargs = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": LOGPROB_TOKENS}
    answer = client.completions.create(temperature=0, logprobs=2, **kwargs)
    lp = answer.choices[0].logprobs
    _check_logprobs(lp.tokens, lp.token_logprobs, scored_reference[0])
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert top[token] == value and len(top) in (2, 3)  # the chosen token always, + top 2
    assert lp.text_offset == np.cumsum([0] + [len(t) for t in lp.tokens[:-1]]).tolist()
    assert answer.usage.completion_tokens == len(lp.tokens)
    chunks = list(client.completions.create(temperature=0, logprobs=2, stream=True, **kwargs))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs is not None]
    assert sum((s.tokens for s in streamed), []) == lp.tokens
    assert sum((s.token_logprobs for s in streamed), []) == lp.token_logprobs
    assert sum((s.text_offset for s in streamed), []) == lp.text_offset
    # The penalties change the greedy text, exactly as generate's processors change it.
    penalized = client.completions.create(temperature=0, logprobs=0, **kwargs, **PENALTIES)
    lp = penalized.choices[0].logprobs
    _check_logprobs(lp.tokens, lp.token_logprobs, scored_reference[2])
    assert scored_reference[2][0] != scored_reference[0][0]
    assert all(len(top) == 1 for top in lp.top_logprobs)


def test_chat_logprobs_equal_generate_streamed_or_not(server, scored_reference):
    kwargs = {"model": MODEL, "messages": CHAT, "max_completion_tokens": LOGPROB_TOKENS}
    kwargs.update(temperature=0, logprobs=True)
    answer = server.client().chat.completions.create(top_logprobs=3, **kwargs)
    content = answer.choices[0].logprobs.content
    top = [[(t.token, t.logprob) for t in c.top_logprobs] for c in content]
    tokens = [c.token for c in content]
    _check_logprobs(tokens, [c.logprob for c in content], scored_reference[1], top, 3)
    assert all(bytes(c.bytes).decode(errors="replace") == c.token for c in content)
    chunks = list(server.client().chat.completions.create(stream=True, top_logprobs=3, **kwargs))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in
                c.choices[0].logprobs.content]  # fmt: skip
    assert [(e.token, e.logprob, e.top_logprobs) for e in streamed] == [
        (e.token, e.logprob, e.top_logprobs) for e in content
    ]
    plain = server.client().chat.completions.create(**{**kwargs, "logprobs": False})
    assert plain.choices[0].logprobs is None


def test_logit_bias_bans_and_forces_tokens(server, tokenizer, scored_reference):
    client = server.client()
    kwargs = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0}
    first = scored_reference[0][0][0]
    banned = client.completions.create(logit_bias={str(first): -100}, logprobs=0, **kwargs)
    assert banned.choices[0].logprobs.tokens[0] != TokenTexts(tokenizer)(first)[0]
    forced = tokenizer.encode(" zebra")[0]
    answer = client.completions.create(logit_bias={str(forced): 100}, **kwargs)
    assert answer.choices[0].text == tokenizer.decode([forced] * 6)


def test_vllm_stop_token_ids_min_tokens_and_ignore_eos(server, tokenizer, scored_reference):
    client = server.client()
    tokens = scored_reference[0][0]
    stop = tokens[2]
    first = tokens.index(stop)  # where greedy decoding first makes it
    kwargs = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0}
    ended = client.completions.create(extra_body={"stop_token_ids": [stop]}, **kwargs)
    assert ended.choices[0].finish_reason == "stop"
    assert ended.usage.completion_tokens == first + 1
    assert ended.choices[0].text == _greedy_text(tokenizer, tokens, first)  # as vLLM: not shown
    shown = {"stop_token_ids": [stop], "include_stop_str_in_output": True}
    kept = client.completions.create(extra_body=shown, **kwargs)
    assert kept.choices[0].text == _greedy_text(tokenizer, tokens, first + 1)
    held = {"stop_token_ids": [stop], "min_tokens": first + 2}
    later = client.completions.create(extra_body=held, **kwargs)
    assert later.usage.completion_tokens >= first + 2
    assert later.choices[0].text.startswith(_greedy_text(tokenizer, tokens, first))
    # vLLM's bad_words: the greedy run's first word, banned as a word (a leading space).
    at = next(k for k, t in enumerate(tokens) if tokenizer.decode([t])[1:].isalpha())
    word = tokenizer.decode([tokens[at]])
    assert word.startswith(" ") and tokenizer.encode(word, add_special_tokens=False) == [tokens[at]]
    banned = client.completions.create(extra_body={"bad_words": [word.strip()]}, **kwargs)
    assert banned.choices[0].text.startswith(_greedy_text(tokenizer, tokens, at))
    assert not banned.choices[0].text.startswith(_greedy_text(tokenizer, tokens, at + 1))
    # truncate_prompt_tokens: the prompt's last k tokens, as if sent alone.
    ids = tokenizer.encode(PROMPTS[0])
    short = {**kwargs, "prompt": ids[-4:]}
    alone = client.completions.create(**short)
    cut = client.completions.create(extra_body={"truncate_prompt_tokens": 4}, **kwargs)
    assert (cut.choices[0].text, cut.usage.prompt_tokens) == (alone.choices[0].text, 4)
    whole = client.completions.create(extra_body={"truncate_prompt_tokens": -1}, **kwargs)
    assert whole.choices[0].text == _greedy_text(tokenizer, tokens, 12) != alone.choices[0].text
    assert whole.usage.prompt_tokens == len(ids)
    with pytest.raises(openai.BadRequestError, match="truncate_prompt_tokens"):
        client.completions.create(extra_body={"truncate_prompt_tokens": 0}, **kwargs)
    # The model's EOS, forced by a bias: it ends the choice at once unless EOS is ignored.
    eos = genjax.GenerationConfig.from_pretrained(bundled.path()).eos_token_id
    eos = np.atleast_1d(eos).tolist()[0]
    forced = {**kwargs, "max_tokens": 5, "logit_bias": {str(eos): 100}}
    assert client.completions.create(**forced).usage.completion_tokens == 1
    ignored = client.completions.create(extra_body={"ignore_eos": True}, **forced)
    assert ignored.usage.completion_tokens == 5
    assert ignored.choices[0].finish_reason == "length" and ignored.choices[0].text == ""
    special = {"ignore_eos": True, "skip_special_tokens": False}
    spelled = client.completions.create(extra_body=special, **forced).choices[0].text
    assert spelled == tokenizer.decode([eos] * 5) and spelled
    shown = {"include_stop_str_in_output": True, "skip_special_tokens": False}
    assert client.completions.create(extra_body=shown, **forced).choices[0].text == (
        tokenizer.decode([eos])
    )


@pytest.mark.parametrize(
    "path, content, status",
    [
        ("/v1/completions", b"{not json", 400),
        ("/v1/completions", b"[1, 2]", 400),
        ("/v1/completions", {"model": MODEL, "prompt": 5}, 400),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 10**30}, 400),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 10**6}, 400),
        ("/v1/completions", {"model": MODEL, "prompt": [-1, 5]}, 400),
        ("/v1/completions", {"model": MODEL, "prompt": []}, 400),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": "hot"}, 400),
        ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "robot"}]}, 400),
        ("/v1/completions", {"model": MODEL, "prompt": "y" * (1 << 20)}, 400),
        ("/v1/nothing", {}, 404),
    ],
)
def test_malformed_bodies_get_4xx(server, path, content, status):
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    if not isinstance(content, bytes):
        content = json.dumps(content).encode()
    url = server.url.removesuffix("/v1") + path
    response = httpx.post(url, content=content, headers=headers, timeout=60)
    assert response.status_code == status, response.text
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(server.url.removesuffix("/v1") + "/health", timeout=30).status_code == 200


def test_a_client_leaving_mid_stream_cancels_its_request(server):
    url = server.url + "/completions"
    budget = CONTEXT - 16
    body = {"model": MODEL, "prompt": PROMPTS[3], "max_tokens": budget, "stream": True}
    body.update(temperature=1.5, top_k=0, top_p=1.0)  # an early EOS is unlikely
    headers = {"Authorization": f"Bearer {KEY}"}
    before = server.wait_idle()["genjax_tokens_total"]
    with httpx.stream("POST", url, json=body, headers=headers, timeout=60) as response:
        assert response.status_code == 200
        next(response.iter_lines())
    metrics = server.wait_idle()
    assert metrics["genjax_running"] == 0 and metrics["genjax_blocks_in_use"] == 0
    assert metrics["genjax_tokens_total"] - before < budget


def _rss_mb(pid: int) -> float:
    """The resident set of process ``pid`` in MiB (``VmRSS``)."""
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


LOAD_STREAMS = 64


@pytest.mark.load
def test_load_64_streams_with_a_fifth_leaving_twice_without_growing(server):
    """Two rounds of 64 concurrent streams, every fifth leaving after its first text: the rest
    get their solo text, the engine ends idle, and the second round leaves the server no bigger
    than the first (a leak per request would grow it by the round's 64 requests)."""
    kwargs = {"model": MODEL, "max_tokens": 40, "temperature": 0}
    solo = {
        p: server.client().completions.create(prompt=p, **kwargs).choices[0].text for p in PROMPTS
    }

    async def one(client, i):
        prompt = PROMPTS[i % len(PROMPTS)]
        stream = await client.completions.create(prompt=prompt, stream=True, **kwargs)
        text = []
        async for chunk in stream:
            text.append(chunk.choices[0].text)
            if i % 5 == 0 and "".join(text):
                await stream.close()
                return None
        return prompt, "".join(text)

    async def run():
        client = openai.AsyncOpenAI(base_url=server.url, api_key=KEY, max_retries=0, timeout=300)
        async with client:
            streams = asyncio.gather(*(one(client, i) for i in range(LOAD_STREAMS)))
            return await asyncio.wait_for(streams, 600)

    resident = []
    for _ in range(2):
        results = asyncio.run(run())
        finished = [r for r in results if r is not None]
        assert len(finished) == LOAD_STREAMS - len(range(0, LOAD_STREAMS, 5))
        for prompt, text in finished:
            assert text == solo[prompt]
        metrics = server.wait_idle()
        assert metrics["genjax_running"] == 0 and metrics["genjax_blocks_in_use"] == 0
        resident.append(_rss_mb(server.process.pid))
    assert resident[1] <= resident[0] * 1.05 + 16, resident  # MiB: allocator noise only


def test_serve_flags_are_checked_before_anything_loads(capsys):
    from genjax.cli import main

    assert main(["serve", "--max-batch-size", "0"]) == 2
    assert "must be at least 1" in capsys.readouterr().err
    assert main(["serve", "--help"]) == 0
    assert "--served-model-name" in capsys.readouterr().out
    assert main(["serve", "--max-constraint-edges", "0"]) == 2
    assert "must be at least 1" in capsys.readouterr().err


def test_serve_keeps_compiled_programs_in_the_user_cache_dir_unless_turned_off(
    monkeypatch, tmp_path
):
    from genjax.cli import main
    from genjax.serving import runner

    served = []
    monkeypatch.setattr(runner, "serve", lambda options: served.append(options) or 0)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("GENJAX_COMPILE_CACHE", raising=False)
    try:
        for off, env in ((["--no-compile-cache"], None), ([], "0"), ([], None)):
            genjax.disable_compile_cache()
            if env is not None:
                monkeypatch.setenv("GENJAX_COMPILE_CACHE", env)
            assert main(["serve", "--max-batch-size", "2", *off]) == 0
            used = jax.config.values["jax_compilation_cache_dir"]
            assert used == (None if off or env else str(tmp_path / "genjax" / "xla"))
            monkeypatch.delenv("GENJAX_COMPILE_CACHE", raising=False)
    finally:
        genjax.disable_compile_cache()
    assert [options.max_batch_size for options in served] == [2, 2, 2]


def test_serve_pool_flags_size_the_engine(model_and_params):
    from genjax.serving.runner import ServeOptions, engine_sizes

    model, _ = model_and_params
    sizes = engine_sizes(ServeOptions(max_constraint_states=0, max_constraint_edges=64), model)
    assert (sizes.max_constraint_states, sizes.max_constraint_edges) == (0, 64)
    default = engine_sizes(ServeOptions(max_length=128), model)
    assert (default.max_constraint_states, default.max_constraint_edges) == (4096, 2**20)
    assert default.max_length == 128 and default.max_batch_size == 8
