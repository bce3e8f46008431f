"""The Python API in one page, on the bundled model (no network, no download).

Loads the model, its tokenizer and its ``generation_config.json`` from the package, then:

1. streams a sampled continuation of one prompt to the terminal (``TextStreamer``);
2. decodes a left-padded batch of two prompts greedily, under ``jax.jit``;
3. samples again with a new temperature and key: the compiled program is reused.

Run:  python examples/quickstart.py [--max-new-tokens 48]
"""

from __future__ import annotations

import argparse
import functools

import jax

import genjax


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args(argv)

    folder = genjax.io.bundled.path()  # or any Hugging Face folder / hub id
    model, params = genjax.models.from_pretrained(folder)
    tok = genjax.tokenizer.from_pretrained(folder)
    config = genjax.GenerationConfig.from_pretrained(folder).replace(
        max_new_tokens=args.max_new_tokens
    )

    print("1. streamed, sampled with the model's generation config:")
    prompt = "def fibonacci(n):"
    print(prompt, end="", flush=True)
    streamer = genjax.streaming.TextStreamer(tok, skip_prompt=True, skip_special_tokens=True)
    ids = tok(prompt)["input_ids"]
    genjax.generate(model, params, ids, config, key=jax.random.key(0), streamer=streamer)

    print("\n2. a left-padded batch, greedy, under jax.jit:")
    # do_sample=False on top of the model's generation config, as transformers'
    # model.generate(do_sample=False): the file's sampling values are then not used.
    greedy = jax.jit(functools.partial(genjax.generate, model, do_sample=False))
    batch = tok(["import os\n", "class Stack:\n    def push(self, item):"])
    out = greedy(params, batch["input_ids"], config, attention_mask=batch["attention_mask"])
    texts = tok.batch_decode(out.sequences, skip_special_tokens=True)
    for text in texts:
        print("---\n" + text)

    print("---\n3. new sampling values and key, same compiled program:")
    generate = jax.jit(functools.partial(genjax.generate, model))
    sampled = config.replace(temperature=0.6)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    first = generate(params, ids, sampled, attention_mask=mask, key=jax.random.key(1))
    hotter = sampled.replace(temperature=0.9)
    second = generate(params, ids, hotter, attention_mask=mask, key=jax.random.key(2))
    print(tok.decode(second.sequences[1], skip_special_tokens=True))
    return {"greedy": texts, "first": first.sequences, "second": second.sequences}


if __name__ == "__main__":
    main()
