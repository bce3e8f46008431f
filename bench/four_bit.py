"""4-bit weights against llama.cpp on the real checkpoint: batch-1 greedy decoding speed, and
token agreement with transformers on the dequantized weights.

The checkpoint is the parity suite's SmolLM2-135M-Instruct Q4_1 GGUF (``tests/real_model.py``).
Columns, timed interleaved run by run in this one process, each a chat prompt then exactly
``--new-tokens`` greedy tokens (EOS suppressed), prompt processing included:

* ``llama.cpp``: llama-cpp-python on the Q4_1 file, ``n_threads`` = this process's CPUs
  (skipped with the reason when ``llama_cpp`` does not import; ``pip install llama-cpp-python``
  builds it from source; on CPUs where its native build crashes, build it for AVX2:
  ``CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=OFF -DGGML_AMX_TILE=OFF
  -DGGML_AMX_INT8=OFF"``);
* ``genjax:int4``: ``from_pretrained(gguf, quantize="int4")``, the file's Q4_1 kernels kept
  packed (the tied Q8_0 head becomes int8 per row);
* ``genjax:int8`` and ``genjax:float32``: the same file, requantized per channel or dequantized;
* ``torch:float32``: transformers on the dequantized weights (``bench/_real.py``), when torch
  is installed.

Then the accuracy of the 4-bit path: for each of a few chat prompts genjax int4 generates
``--new-tokens`` greedy tokens, and transformers (float32, dequantized weights) predicts the
next token at every position of that continuation (teacher forced): the rate of positions where
both pick the same token, and the length of the free-running common prefix.

Run:  python bench/four_bit.py [--runs 3] [--new-tokens 128] [--json out.json]
Needs the `parity` extra for the torch column and the agreement check.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _machine  # noqa: E402

PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a short poem about the sea.",
    "Explain what a hash table is to a beginner.",
    "List three uses of a paperclip.",
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="measured runs of each (default 3)")
    parser.add_argument("--new-tokens", type=int, default=128, help="default 128")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.new_tokens < 2:
        parser.error("--runs must be at least 1 and --new-tokens at least 2")
    return args


def _llama_cpp(path: str, prompt_ids: list[int], new_tokens: int):
    """A timed run of llama.cpp, or the reason it cannot run."""
    try:
        from llama_cpp import Llama
    except ImportError as error:
        return None, f"llama_cpp does not import ({error}); pip install llama-cpp-python"
    llm = Llama(model_path=path, n_threads=_machine.cpu_count(), n_ctx=1024, verbose=False)

    def run() -> float:
        llm.reset()
        start = time.perf_counter()
        produced = 0
        for _ in llm.generate(prompt_ids, temp=0.0, top_k=1, reset=True):
            produced += 1
            if produced == new_tokens:
                break
        return time.perf_counter() - start

    return run, None


def _genjax(path: str, quantize: str | None, prompt_ids: list[int], new_tokens: int):
    import jax.numpy as jnp

    import genjax

    model, params = genjax.models.from_pretrained(path, quantize=quantize)
    ids = jnp.asarray([prompt_ids], jnp.int32)
    config = genjax.GenerationConfig(
        max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False
    )

    def run() -> float:
        start = time.perf_counter()
        genjax.generate(model, params, ids, config).sequences.block_until_ready()
        return time.perf_counter() - start

    return run, (model, params)


def _torch(prompt_ids: list[int], new_tokens: int):
    try:
        import torch
        import transformers
    except ImportError as error:
        return None, None, f"torch/transformers do not import ({error})"
    import _real

    folder = _real.model_folder()
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = torch.tensor([prompt_ids])

    def run() -> float:
        start = time.perf_counter()
        with torch.no_grad():
            hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
            )
        return time.perf_counter() - start

    return run, hf, None


def _agreement(model, params, hf, tokenizer, new_tokens: int) -> list[dict]:
    """Per prompt: teacher-forced agreement of transformers' argmax with genjax int4's greedy
    tokens, and the free-running common prefix."""
    import jax.numpy as jnp
    import numpy as np
    import torch

    import genjax

    config = genjax.GenerationConfig(max_new_tokens=new_tokens, do_sample=False)
    rows = []
    for prompt in PROMPTS:
        ids = chat_ids(tokenizer, prompt)
        out = genjax.generate(model, params, jnp.asarray([ids], jnp.int32), config)
        sequence = np.asarray(out.sequences)[0]
        new = sequence[len(ids) :]
        eos = tokenizer.eos_token_id
        if eos in new.tolist():  # compare up to and including the first EOS
            new = new[: new.tolist().index(eos) + 1]
        full = torch.tensor([ids + new.tolist()])
        with torch.no_grad():
            logits = hf(full).logits[0, len(ids) - 1 : len(ids) - 1 + len(new)].numpy()
            free = hf.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=len(new),
                do_sample=False,
            )[0, len(ids) :].numpy()
        same = logits.argmax(-1) == new
        prefix = next((i for i, (a, b) in enumerate(zip(free, new, strict=False)) if a != b), None)
        rows.append(
            dict(
                prompt=prompt,
                tokens=int(len(new)),
                teacher_forced_agree=int(same.sum()),
                free_running_prefix=len(new) if prefix is None else prefix,
                text=tokenizer.decode(new.tolist(), skip_special_tokens=True),
            )
        )
    return rows


def real_checkpoint():
    """``(path, tokenizer)`` of the parity suite's SmolLM2 Q4_1 GGUF, downloaded on first use."""
    warnings.filterwarnings("ignore", category=UserWarning)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    import real_model

    import genjax

    path = str(real_model.smollm2_gguf())
    return path, genjax.tokenizer.from_pretrained(path)


def chat_ids(tokenizer, prompt: str) -> list[int]:
    """The token ids of ``prompt`` as one user message, ready for the assistant's reply."""
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    path, tokenizer = real_checkpoint()
    prompt_ids = chat_ids(tokenizer, PROMPTS[0])
    runners, notes = {}, {}
    runners["llama.cpp"], notes["llama.cpp"] = _llama_cpp(path, prompt_ids, args.new_tokens)
    loaded = {}
    for quantize in ("int4", "int8", None):
        name = f"genjax:{quantize or 'float32'}"
        runners[name], loaded[name] = _genjax(path, quantize, prompt_ids, args.new_tokens)
    runners["torch:float32"], hf, notes["torch:float32"] = _torch(prompt_ids, args.new_tokens)
    runners = {name: run for name, run in runners.items() if run is not None}
    for run in runners.values():
        run()  # compile / warm up
    times = {name: [] for name in runners}
    for _ in range(args.runs):
        for name, run in runners.items():
            times[name].append(run())
    env = _machine.environment()
    print(f"# {_machine.cpu_model()} ({', '.join(_machine.cpu_extensions())}), "
          f"{_machine.cpu_count()} threads")  # fmt: skip
    print(f"SmolLM2-135M-Instruct Q4_1, batch 1, prompt {len(prompt_ids)} tokens, "
          f"{args.new_tokens} new tokens, medians of {args.runs} (min-max)")  # fmt: skip
    results = {}
    base = statistics.median(times["llama.cpp"]) if "llama.cpp" in times else None
    for name, values in times.items():
        tok_s = [args.new_tokens / t for t in values]
        median = statistics.median(tok_s)
        ratio = (
            f"  {statistics.median(values) and base / statistics.median(values):.2f}x llama.cpp"
            if base
            else ""
        )
        print(f"  {name:14s} {median:7.1f} tok/s ({min(tok_s):.1f}-{max(tok_s):.1f}){ratio}")
        results[name] = dict(tok_s=tok_s, median_tok_s=median)
    for name, note in notes.items():
        if note:
            print(f"  {name:14s} skipped: {note}")
    agreement = None
    if hf is not None:
        model, params = loaded["genjax:int4"]
        agreement = _agreement(model, params, hf, tokenizer, args.new_tokens)
        agree = sum(row["teacher_forced_agree"] for row in agreement)
        total = sum(row["tokens"] for row in agreement)
        print(f"int4 greedy tokens = transformers float32 argmax (teacher forced): "
              f"{agree}/{total} ({agree / total:.1%})")  # fmt: skip
        for row in agreement:
            agreed, free = row["teacher_forced_agree"], row["free_running_prefix"]
            print(f"  {row['prompt']!r}: {agreed}/{row['tokens']}, free-running prefix "
                  f"{free}: {row['text'][:60]!r}")  # fmt: skip
    if args.json:
        with open(args.json + ".partial", "w") as file:
            json.dump(
                dict(env=env, results=results, skipped=notes, agreement=agreement), file, indent=1
            )
        os.replace(args.json + ".partial", args.json)


if __name__ == "__main__":
    main()
