"""What streaming costs: decode time per token with and without a streamer.

A streamer receives each new token from inside the compiled loop through an ordered host
callback, which the loop waits for (see :mod:`genjax.streaming`). This script builds a small
random Llama (by default 4 layers, width 256, vocabulary 1024, with
``genjax.testing.write_random_checkpoint``) and a byte-level BPE tokenizer of the same
vocabulary size, then times greedy generation at batch 1, all tokens forced to full length (no
EOS), for three variants:

* ``none``: no streamer (the program has no callback);
* ``callback``: a streamer whose ``put`` only counts (the callback's own cost);
* ``text``: a :class:`~genjax.streaming.TextIteratorStreamer` decoding the tokens, read by a
  consumer thread (the cost a real user pays).

Each variant is compiled first, then the variants run interleaved ``--runs`` times, so the drift
of a shared machine cancels; the table gives the median ms per new token (whole call divided by
the number of new tokens, prefill included), the best, and the ratio to ``none``.

Run:  python bench/streaming.py [--runs 5] [--new-tokens 128] [--layers 4] [--width 256]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time

import jax
import numpy as np

import genjax
import genjax.testing
from genjax.streaming import BaseStreamer, TextIteratorStreamer


class _Count(BaseStreamer):
    """Counts the ids it is given and does nothing else."""

    def __init__(self):
        self.count = 0

    def put(self, value):
        self.count += np.asarray(value).size

    def end(self):
        pass


def _tokenizer(folder: str, vocab_size: int):
    """A byte-level BPE with exactly ``vocab_size`` ids, trained on genjax's own source."""
    package = os.path.dirname(genjax.__file__)
    corpus = [
        open(os.path.join(package, name), encoding="utf-8").read()
        for name in sorted(os.listdir(package))
        if name.endswith(".py")
    ]
    backend = genjax.testing.tiny_bpe_tokenizer(corpus, vocab_size)
    backend.save(os.path.join(folder, "tokenizer.json"))
    special = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(special, f)
    tok = genjax.tokenizer.from_pretrained(folder)
    if tok.vocab_size != vocab_size:
        raise SystemExit(f"the tokenizer has {tok.vocab_size} ids, not {vocab_size}")
    return tok


def _timed(run) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=1024)
    args = parser.parse_args()
    if args.runs < 3:
        parser.error("--runs must be at least 3 (the median of fewer says little)")

    with tempfile.TemporaryDirectory() as folder:
        tok = _tokenizer(folder, args.vocab)
        genjax.testing.write_random_checkpoint(
            folder,
            "llama",
            hidden_size=args.width,
            intermediate_size=args.width * 11 // 4,
            num_hidden_layers=args.layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=args.vocab,
            max_position_embeddings=max(1024, 2 * (args.prompt + args.new_tokens)),
            eos_token_id=None,
        )
        model, params = genjax.models.from_pretrained(folder)
    config = genjax.GenerationConfig(max_new_tokens=args.new_tokens, pad_token_id=0)
    ids = np.random.default_rng(0).integers(3, args.vocab, size=(1, args.prompt), dtype=np.int32)

    def plain():
        genjax.generate(model, params, ids, config).sequences.block_until_ready()

    def callback():
        streamer = _Count()
        genjax.generate(model, params, ids, config, streamer=streamer)
        assert streamer.count == args.prompt + args.new_tokens

    def text():
        streamer = TextIteratorStreamer(tok, skip_prompt=True, timeout=600)
        chunks: list[str] = []
        consumer = threading.Thread(target=lambda: chunks.extend(streamer))
        consumer.start()
        genjax.generate(model, params, ids, config, streamer=streamer)
        consumer.join()

    variants = {"none": plain, "callback": callback, "text": text}
    for run in variants.values():
        run()  # compile
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.runs):  # interleaved
        for name, run in variants.items():
            seconds[name].append(_timed(run))

    device = jax.devices()[0]
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(
        f"jax {jax.__version__} on {device.platform} ({device.device_kind}), "
        f"{os.cpu_count()} CPUs, load average {load}"
    )
    print(
        f"model: random Llama, {args.layers} layers, width {args.width}, vocab {args.vocab}; "
        f"batch 1, prompt {args.prompt}, {args.new_tokens} new tokens, greedy; median of "
        f"{args.runs} interleaved runs"
    )
    header = (
        f"{'streamer':>9} | {'ms/token (best)':>17} | {'vs none (best)':>16} | "
        f"{'extra ms/token':>14}"
    )
    print(header)
    print("-" * len(header))
    per_token = {n: [s * 1e3 / args.new_tokens for s in v] for n, v in seconds.items()}
    base, base_best = statistics.median(per_token["none"]), min(per_token["none"])
    for name, values in per_token.items():
        median, best = statistics.median(values), min(values)
        print(
            f"{name:>9} | {median:7.3f} ({best:7.3f}) | {median / base:6.3f}x "
            f"({best / base_best:5.3f}x) | {median - base:+14.3f}"
        )


if __name__ == "__main__":
    main()
