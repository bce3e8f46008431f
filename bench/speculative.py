"""What assisted generation buys: plain greedy vs speculative greedy vs prompt lookup.

On the bundled pair (``genjax.io.bundled.path("genjax-tiny")`` as target, ``"genjax-tiny-draft"``
as draft, or the folder ``--draft`` names), with ``--random`` on random Llamas written by
``genjax.testing`` (a target of ``--layers`` layers and a 1-layer draft sharing its embeddings
and first layer, so they agree often), or with ``--real`` on the real SmolLM2-135M-Instruct
(``bench/_real.py``; its draft is the same model with weight-only int8 params, which reads a
quarter of the weight bytes per pass: self-speculative decoding), this times greedy generation
of ``--new-tokens`` tokens at each batch size of ``--batches``:

* ``plain``: ordinary greedy decoding of the target;
* ``draft``: speculative greedy decoding with the draft (``--candidates`` per round);
* ``lookup``: prompt-lookup decoding (``prompt_lookup_num_tokens=--candidates``), on an
  input-grounded task: continuing a file whose text repeats (a Python source file with a
  repeated block, cut mid-way through the second copy); with ``--real``, a chat turn asking the
  model to rewrite a function from the standard library with clearer names (the ``plain`` task
  asks it to write one from a description).

No EOS stops a row, so every variant makes the same number of tokens (and greedy outputs are
checked to be equal). Every variant is compiled first, then the variants run interleaved
``--runs`` times (at least 3) so a shared machine's drift cancels; the table gives the median
tokens/s (new tokens of all rows over the whole call, prefill included), the ratio to ``plain``
and the acceptance rate (accepted candidates / new tokens after the first).

A second table gives the costs that set the speedup (the cost model of Leviathan et al. 2023,
section 3.4), each pass over a cache of the size its loop uses (``P`` prompt slots, ``N`` new
tokens, ``T = G + 1``): one forward pass of the target over one token in plain decoding's cache
of ``P + N`` slots (``target``); the target over ``T`` tokens in the assisted target cache
(the verification pass, ``verify``); and the draft over two tokens (``draft2``: an iteration's
first draft pass re-reads the token before the newest) and over one token (``draft``) in the
draft's cache. Each is the median of passes run back to back in one compiled loop, every slot
attended. With ``c2 = draft2 / target``, ``c = draft / target``, ``v = verify / target`` and an
acceptance rate ``a`` (accepted candidates over new tokens after the first, so an iteration
commits ``1 / (1 - a)`` tokens on average), an iteration costs ``c2 + (G - 1) * c + v``
target passes, so speculative greedy runs about ``1 / ((1 - a) * (c2 + (G - 1) * c + v))``
times as fast as plain greedy; the ``estimate`` column gives that figure for the acceptance
measured above (prompt lookup: ``1 / ((1 - a) * v)``, its candidates cost no model pass). It
counts model passes only, not the bookkeeping of either loop (choosing tokens, stopping rules)
nor a draft that stops early. It is printed for batch 1 only: with more rows, rows accept
different numbers of tokens and the caches hold holes (see :mod:`genjax.decoding.assisted`),
which the passes measured here do not include.

Run:  python bench/speculative.py [--random | --real] [--draft FOLDER] [--runs 5] [--new-tokens 128]
      [--candidates 4] [--batches 1,8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import genjax
import genjax.io.bundled
import genjax.testing
from genjax.decoding.assisted import cache_lengths

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _machine  # noqa: E402


def _models(args):
    """(target, target params, draft, draft params, tokenizer or None)."""
    if args.real:
        import _real

        folder = _real.model_folder()
        model, params = genjax.models.from_pretrained(folder)
        model = model.with_generation_config(None)
        draft_params = genjax.quantize_params(model, params, "int8")
        return model, params, model, draft_params, genjax.tokenizer.from_pretrained(folder)
    if not args.random:
        from genjax import bundled

        target_path, draft_path = bundled.path("genjax-tiny"), args.draft
        model, params = genjax.models.from_pretrained(target_path)
        draft, draft_params = genjax.models.from_pretrained(draft_path)
        return model, params, draft, draft_params, genjax.tokenizer.from_pretrained(target_path)
    folder = tempfile.mkdtemp()
    sizes = dict(hidden_size=args.width, intermediate_size=2 * args.width, vocab_size=1024)
    sizes.update(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    genjax.testing.write_random_checkpoint(
        f"{folder}/t", "llama", num_hidden_layers=args.layers, **sizes
    )
    model, params = genjax.models.from_pretrained(f"{folder}/t")
    genjax.testing.write_random_checkpoint(f"{folder}/d", "llama", num_hidden_layers=1, **sizes)
    draft, draft_params = genjax.models.from_pretrained(f"{folder}/d")
    shared = {k: v for k, v in params.items() if k != "layers"}
    draft_params = {**draft_params, **shared, "layers": {"0": params["layers"]["0"]}}
    return model, params, draft, draft_params, None


def _chat_prompts(tokenizer, batch: int, grounded: bool):
    """Left-padded chat prompts: rewrite a standard-library function (``grounded``), or write
    one from a short description."""
    import inspect
    import textwrap

    functions = [json.dumps, json.loads, os.path.join, os.path.splitext, textwrap.dedent]
    messages = []
    for b in range(batch):
        function = functions[b % len(functions)]
        if grounded:
            source = inspect.getsource(function)[:1500]
            text = f"Rewrite this function with clearer variable names:\n```python\n{source}```"
        else:
            text = f"Write a Python function like `{function.__name__}`, with a docstring."
        messages.append([{"role": "user", "content": text}])
    rows = [tokenizer.apply_chat_template(m, add_generation_prompt=True) for m in messages]
    padded = tokenizer.pad(rows)
    return np.asarray(padded["input_ids"]), np.asarray(padded["attention_mask"])


def _prompts(tokenizer, batch: int, vocab: int, repeated: bool):
    """Left-padded prompts: Python source (or random ids); ``repeated`` doubles a block and cuts
    the copy short, so the continuation is in the prompt."""
    path = os.path.join(os.path.dirname(json.__file__), "decoder.py")
    text = open(path, encoding="utf-8").read()
    rng = np.random.default_rng(0)
    texts = []
    for b in range(batch):
        start = 200 + 300 * b
        block = text[start : start + 600]
        texts.append(block + "\n" + block[:300] if repeated else block)
    if tokenizer is not None:
        enc = tokenizer(texts)
        return np.asarray(enc["input_ids"]), np.asarray(enc["attention_mask"])
    ids = rng.integers(3, vocab, (batch, 96))
    if repeated:
        ids = np.concatenate([ids, ids[:, :48]], 1)
    return ids.astype(np.int32), np.ones_like(ids, np.int32)


def _time(fn):
    start = time.perf_counter()
    out = jax.block_until_ready(fn())
    return time.perf_counter() - start, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--random", action="store_true", help="random models, not the bundled")
    parser.add_argument(
        "--real", action="store_true", help="SmolLM2-135M-Instruct, its int8 self as the draft"
    )
    parser.add_argument(
        "--draft",
        default=genjax.io.bundled.path("genjax-tiny-draft"),
        help="the draft Hugging Face folder (default: the bundled draft); not with --random",
    )
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--candidates", type=int, default=4)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    args = parser.parse_args()
    if (args.random or args.real) and args.draft != parser.get_default("draft"):
        parser.error("--draft names the bundled target's draft; --random and --real bring theirs")
    if args.random and args.real:
        parser.error("--random and --real choose different models: give one")
    model, params, draft, draft_params, tok = _models(args)
    config = genjax.GenerationConfig(
        max_new_tokens=args.new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        num_assistant_tokens=args.candidates,
        assistant_confidence_threshold=0.0,
    )
    which = "real SmolLM2-135M-Instruct" if args.real else "random" if args.random else "bundled"
    cpu = f"{_machine.cpu_model()} ({', '.join(_machine.cpu_extensions())})"
    print(f"{cpu}, {_machine.cpu_count()} usable CPUs; device: {jax.devices()[0].device_kind}")
    print(f"{which} models")
    print(f"{args.new_tokens} new tokens, greedy, up to {args.candidates} candidates")
    print(f"{'batch':>5} {'task':>9} {'variant':>7} {'tok/s':>9} {'vs plain':>8} {'accept':>7}")
    models = (model, params, draft, draft_params)
    rates, prompt_lengths = {}, {}
    for batch in [int(b) for b in args.batches.split(",")]:
        for task in ("plain", "repeating"):
            if args.real:
                ids, mask = _chat_prompts(tok, batch, task == "repeating")
            else:
                ids, mask = _prompts(tok, batch, model.vocab_size, task == "repeating")
            rates[batch, task] = _measure(args, models, config, ids, mask, task)
            prompt_lengths[batch] = max(ids.shape[1], prompt_lengths.get(batch, 0))
    _print_costs(args, models, rates, prompt_lengths)


def _print_costs(args, models, rates: dict, prompt_lengths: dict) -> None:
    """Prints the per-pass costs at each batch size and, at batch 1, the speedup they predict
    for each measured acceptance rate (see the module docstring)."""
    model, params, draft, draft_params = models
    g, n = args.candidates, args.new_tokens
    print(f"\nper-pass ms; at batch 1 the speedup they predict (G = {g})")
    print(
        f"{'batch':>5} {'target':>8} {'verify':>8} {'draft2':>8} {'draft':>8} "
        f"{'c2':>5} {'c':>5} {'v':>5}  estimate"
    )
    for batch in [int(b) for b in args.batches.split(",")]:
        p = prompt_lengths[batch]
        target_slots, draft_slots = cache_lengths(p, n, batch, g)
        one = _pass_ms(model, params, batch, 1, p + n)
        verify = _pass_ms(model, params, batch, g + 1, target_slots)
        first = _pass_ms(draft, draft_params, batch, 2, draft_slots)
        small = _pass_ms(draft, draft_params, batch, 1, draft_slots)
        c2, c, v = first / one, small / one, verify / one
        estimates = []
        for (at, task), accept in rates.items():
            for name, a in accept.items():
                if at == batch == 1:
                    cost = v if name == "lookup" else c2 + (g - 1) * c + v
                    estimates.append(f"{task} {name} {1 / ((1 - a) * cost):.2f}x")
        row = f"{batch:>5} {one:8.3f} {verify:8.3f} {first:8.3f} {small:8.3f} {c2:5.2f} {c:5.2f}"
        print(f"{row} {v:5.2f}  " + (", ".join(estimates) or "-"))


def _pass_ms(model, params, batch: int, tokens: int, slots: int, passes: int = 50) -> float:
    """Median milliseconds of one forward pass over ``tokens`` tokens per row, ``batch`` rows,
    written half-way into a cache of ``slots`` slots (every slot attended), over 5 timed loops
    of ``passes`` back-to-back passes in one compiled program."""
    written = slots // 2
    cache = model.init_cache(batch, slots).advance(written)
    mask = jnp.ones((batch, slots), jnp.int32)
    positions = jnp.broadcast_to(written + jnp.arange(tokens), (batch, tokens))

    @jax.jit
    def loop(params, cache):
        def body(i, carry):
            cache, total = carry
            # The token depends on the last pass, so no pass can be hoisted or dropped; the
            # cache is carried (each pass writes the same slots), as in a decoding loop.
            ids = jnp.full((batch, tokens), 3, jnp.int32) + (total > 1e30).astype(jnp.int32)
            logits, written_cache = model.apply(params, ids, positions, cache, mask)
            return written_cache.replace(index=cache.index), total + logits[0, -1, 0]

        return jax.lax.fori_loop(0, passes, body, (cache, jnp.float32(0)))[1]

    jax.block_until_ready(loop(params, cache))
    samples = [_time(lambda: loop(params, cache))[0] for _ in range(5)]
    return statistics.median(samples) / passes * 1e3


def _measure(args, models, config, ids, mask, task: str) -> dict[str, float]:
    """Compiles, checks and times the variants on one batch of prompts; prints their rows and
    returns each assisted variant's acceptance rate."""
    model, params, draft, draft_params = models
    batch = ids.shape[0]

    def run(**kw):
        return lambda: genjax.generate(model, params, ids, config, attention_mask=mask, **kw)

    variants = {
        "plain": run(),
        "draft": run(assistant_model=draft, assistant_params=draft_params),
    }
    if task == "repeating":
        variants["lookup"] = run(prompt_lookup_num_tokens=args.candidates)
    outs = {name: _time(fn)[1] for name, fn in variants.items()}  # compiles
    for name, out in outs.items():
        same = np.array_equal(np.asarray(out.sequences), np.asarray(outs["plain"].sequences))
        assert same, f"{name} differs from plain greedy"
    times = {name: [] for name in variants}
    for _ in range(max(args.runs, 3)):
        for name, fn in variants.items():
            times[name].append(_time(fn)[0])
    base = statistics.median(times["plain"])
    rates = {}
    for name in variants:
        rate = batch * args.new_tokens / statistics.median(times[name])
        accepted = outs[name].num_accepted_tokens
        accept = ""
        if accepted is not None:
            rates[name] = float(np.mean(accepted)) / (args.new_tokens - 1)
            accept = f"{rates[name]:.2f}"
        speedup = base / statistics.median(times[name])
        print(f"{batch:>5} {task:>9} {name:>7} {rate:>9.1f} {speedup:>7.2f}x {accept:>7}")
    return rates


if __name__ == "__main__":
    main()
