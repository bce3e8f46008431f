"""A terminal chat loop: the conversation goes through the tokenizer's chat template and each
reply streams as it is generated.

The bundled model was trained on Python source code only, so its chat template renders turns
as Python comments and its replies read like code; pass ``--model`` with an instruction-tuned
checkpoint (e.g. ``HuggingFaceTB/SmolLM2-135M-Instruct``) for real answers.

Run:  python examples/chat.py [--model PATH_OR_HUB_ID] [--max-new-tokens 64]
      (type a message and Enter; an empty line or end of input quits)
"""

from __future__ import annotations

import argparse
import sys

import jax
import numpy as np

import genjax


class _Collect(genjax.streaming.TextStreamer):
    """Prints like ``TextStreamer`` and keeps the text, so the reply joins the history."""

    def __init__(self, tokenizer, **kwargs):
        super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True, **kwargs)
        self.text = ""

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        self.text += text
        super().on_finalized_text(text, stream_end)


def main(argv: list[str] | None = None, lines=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="a folder or hub id (default: bundled)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    folder = args.model or genjax.io.bundled.path()
    model, params = genjax.models.from_pretrained(folder)
    tok = genjax.tokenizer.from_pretrained(folder)
    config = genjax.GenerationConfig.from_pretrained(folder).replace(
        max_new_tokens=args.max_new_tokens
    )
    key = jax.random.key(args.seed)
    messages: list[dict] = []
    lines = sys.stdin if lines is None else lines
    print("you> ", end="", flush=True)
    for line in lines:
        if not line.strip():
            break
        messages.append({"role": "user", "content": line.rstrip("\n")})
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        key, step_key = jax.random.split(key)
        streamer = _Collect(tok)
        print("model> ", end="", flush=True)
        prompt = np.asarray([ids], np.int32)  # int32[1, P]
        genjax.generate(model, params, prompt, config, key=step_key, streamer=streamer)
        messages.append({"role": "assistant", "content": streamer.text.strip()})
        print("\nyou> ", end="", flush=True)
    print()
    return messages


if __name__ == "__main__":
    main()
