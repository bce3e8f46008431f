"""OpenAI-compatible serving under load: `genjax serve` against `transformers serve
--continuous-batching` on the same model folder, through the official `openai` client.

For each server and each concurrency C (default 1, 8, 32), C client tasks stream chat
completions (temperature 0, ``--max-tokens`` each, no early stop beyond the model's EOS) from a
shared queue of ``max(2 C, 8)`` requests; ``--rounds`` rounds per level, the first a warm-up,
the last reported. Per level: requests/s and output tokens/s over the round's wall time, time to
first token, and time per output token after the first (each request's (last - first content
chunk) / (tokens - 1); p50 and p99 over requests). A chunk may carry several tokens (genjax runs
several decode steps per host round trip), so tokens come from the stream's usage chunk when the
server sends one, else from the folder's tokenizer on the request's text (transformers serve
sends none). Ratios are genjax over transformers.

The default folder is the parity suite's real checkpoint, SmolLM2-135M-Instruct from the
registry's Q4_1 GGUF (``tests/real_model.py``), dequantized once by transformers into a float32
Hugging Face folder in the same cache, so both servers load the very same weights. Both bind to
127.0.0.1; each server runs alone, the other stopped, and is stopped at the end.

Run:  python bench/serve_load.py [--folder PATH] [--concurrency 1 8 32] [--max-tokens 64]
                                 [--rounds 2] [--servers genjax transformers] [--json out.json]
Needs the `parity` extra (torch, transformers) and `pip install fastapi uvicorn` for
transformers serve.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import re
import socket
import statistics
import subprocess
import sys
import threading
import time

import _machine
import _real
import httpx
import openai

READY_TIMEOUT = 600  # seconds a server may take to load and warm up
MAX_LENGTH = 256  # genjax serve's tokens per request (prompt + completion): sizes its KV pool
PROMPTS = [
    "Write a short poem about the sea.",
    "Explain what a hash table is.",
    "Give three tips for learning a language.",
    "Describe the water cycle in simple words.",
    "What is the capital of France, and why is it famous?",
    "List some uses of a paperclip.",
    "Summarize the plot of a fairy tale you like.",
    "How does a bicycle stay upright?",
]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", help="a Hugging Face model folder (default: the real model)")
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--servers", nargs="+", choices=["genjax", "transformers"], default=None)
    parser.add_argument("--json", metavar="PATH", help="also write every number here")
    args = parser.parse_args(argv)
    args.servers = args.servers or ["genjax", "transformers"]
    if min(args.concurrency) < 1 or args.rounds < 1 or args.max_tokens < 2:
        parser.error("--concurrency and --rounds must be at least 1, --max-tokens at least 2")
    return args


class Server:
    """A server process on 127.0.0.1; ``url`` ends in ``/v1``."""

    def __init__(self, kind: str, folder: str, max_batch: int):
        self.kind, self.folder = kind, folder
        if kind == "genjax":
            argv = [sys.executable, "-m", "genjax.cli", "serve", "--model", folder, "--port", "0"]
            argv += ["--max-batch-size", str(max_batch), "--max-waiting", "1024"]
            argv += ["--max-length", str(MAX_LENGTH)]
            argv += ["--log-level", "warning"]
        else:
            port = _free_port()
            argv = ["transformers", "serve", folder, "--continuous-batching", "--host"]
            argv += ["127.0.0.1", "--port", str(port), "--dtype", "float32"]
            self.url = f"http://127.0.0.1:{port}/v1"
        self.process = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self._lines: queue.Queue = queue.Queue()
        self._tail: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()
        if kind == "genjax":
            self.url = self._await_line(r"ready at (http://\S+)")
        self._await_health()

    def _pump(self) -> None:
        for line in self.process.stdout:  # read to the end, so the server never blocks
            self._lines.put(line)
            self._tail = (self._tail + [line])[-40:]
        self._lines.put(None)

    def _await_line(self, pattern: str) -> str:
        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline:
            try:
                line = self._lines.get(timeout=1)
            except queue.Empty:
                continue
            if line is None:
                break
            found = re.search(pattern, line)
            if found:
                return found[1]
        self.stop()
        raise RuntimeError(f"{self.kind} server did not get ready:\n{''.join(self._tail)}")

    def _await_health(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline and self.process.poll() is None:
            try:
                if httpx.get(self.url.removesuffix("/v1") + "/health", timeout=5).is_success:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        self.stop()
        raise RuntimeError(f"{self.kind} server is not healthy:\n{''.join(self._tail)}")

    def model_name(self) -> str:
        models = httpx.get(self.url + "/models", timeout=30).json()["data"]
        names = [m["id"] for m in models]
        return self.folder if self.folder in names or not names else names[0]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


async def _one(client, model: str, prompt: str, max_tokens: int) -> dict:
    start = time.perf_counter()
    stream = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    times, text, tokens = [], [], None
    async for chunk in stream:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        if chunk.choices and chunk.choices[0].delta.content:
            times.append(time.perf_counter())
            text.append(chunk.choices[0].delta.content)
    return dict(start=start, times=times, text="".join(text), tokens=tokens)


async def _level(url: str, model: str, concurrency: int, max_tokens: int, count) -> dict:
    """One round at ``concurrency``: returns the raw per-request timings and the wall time."""
    requests = asyncio.Queue()
    for i in range(max(2 * concurrency, 8)):
        requests.put_nowait(PROMPTS[i % len(PROMPTS)])
    done = []
    client = openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=900)

    async def worker():
        while not requests.empty():
            prompt = requests.get_nowait()
            done.append(await _one(client, model, prompt, max_tokens))

    async with client:
        start = time.perf_counter()
        await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(concurrency))), 3600)
        wall = time.perf_counter() - start
    return _summary(done, wall, count)


def _summary(done: list[dict], wall: float, count) -> dict:
    """Per-level numbers; ``count(text)`` gives a request's tokens when it sent no usage."""
    for r in done:
        r["tokens"] = r["tokens"] if r["tokens"] is not None else count(r["text"])
    ttft = [(r["times"][0] - r["start"]) * 1e3 for r in done if r["times"]]
    per_token = [
        (r["times"][-1] - r["times"][0]) * 1e3 / (r["tokens"] - 1)
        for r in done
        if r["times"] and r["tokens"] > 1
    ]
    tokens = sum(r["tokens"] for r in done)
    return dict(
        requests=len(done),
        wall_s=wall,
        requests_per_s=len(done) / wall,
        output_tok_s=tokens / wall,
        output_tokens=tokens,
        ttft_ms=_percentiles(ttft),
        tpot_ms=_percentiles(per_token),
    )


def _percentiles(values: list[float]) -> dict:
    if not values:
        return dict(p50=None, p99=None)
    ordered = sorted(values)
    return dict(
        p50=statistics.median(ordered), p99=ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    )


def run_server(kind: str, folder: str, args) -> dict:
    print(f"[{time.strftime('%H:%M:%S')}] starting {kind} serve", file=sys.stderr, flush=True)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)

    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    server = Server(kind, folder, max(args.concurrency))
    try:
        model = server.model_name()
        levels = {}
        for concurrency in args.concurrency:
            for round_ in range(args.rounds):
                print(
                    f"[{time.strftime('%H:%M:%S')}] {kind}: concurrency {concurrency}, round "
                    f"{round_ + 1}/{args.rounds}",
                    file=sys.stderr,
                    flush=True,
                )
                level = _level(server.url, model, concurrency, args.max_tokens, count)
                result = asyncio.run(level)
            levels[concurrency] = result
        return levels
    finally:
        server.stop()


def _cell(value, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def print_table(results: dict, args) -> None:
    print(f"{_machine.cpu_model()} ({', '.join(_machine.cpu_extensions())}); "
          f"{_machine.cpu_count()} usable CPUs; chat completions, {args.max_tokens} max tokens, "
          f"temperature 0, round {args.rounds} of {args.rounds}")  # fmt: skip
    header = f"{'server':<13}{'C':>4}{'req/s':>8}{'out tok/s':>11}"
    header += f"{'TTFT p50':>10}{'p99':>8}{'TPOT p50':>10}{'p99':>8}  (ms)"
    print(header)
    for kind, levels in results.items():
        for concurrency, r in levels.items():
            print(
                f"{kind:<13}{concurrency:>4}{r['requests_per_s']:>8.2f}{r['output_tok_s']:>11.1f}"
                f"{_cell(r['ttft_ms']['p50']):>10}{_cell(r['ttft_ms']['p99']):>8}"
                f"{_cell(r['tpot_ms']['p50']):>10}{_cell(r['tpot_ms']['p99']):>8}"
            )
    if {"genjax", "transformers"} <= set(results):
        for concurrency in args.concurrency:
            mine, peer = results["genjax"][concurrency], results["transformers"][concurrency]
            print(
                f"C={concurrency}: genjax / transformers serve: output tok/s "
                f"{mine['output_tok_s'] / peer['output_tok_s']:.2f}x, requests/s "
                f"{mine['requests_per_s'] / peer['requests_per_s']:.2f}x"
            )


def main(argv=None) -> int:
    args = parse_args(argv)
    folder = args.folder or _real.model_folder()
    results = {}
    for kind in args.servers:
        try:
            results[kind] = run_server(kind, folder, args)
        except (RuntimeError, OSError) as error:
            print(f"{kind} serve not measured: {error}", file=sys.stderr)
    print_table(results, args)
    if args.json:
        report = dict(environment=_machine.environment(), folder=folder, results=results)
        partial = args.json + ".partial"
        with open(partial, "w") as file:
            json.dump(report, file, indent=1)
        os.replace(partial, args.json)
    return 0 if len(results) == len(args.servers) else 1


if __name__ == "__main__":
    sys.exit(main())
