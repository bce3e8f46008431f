"""Time to the first new token of a real generate call, against the number of new tokens asked.

``bench/run.py``'s prefill512 case asks for one new token, so every cache there has ``P + 1``
slots. A real call asks for ``N`` new tokens and allocates ``P + N`` slots before its first
token; this script measures what the wait for that first token becomes as ``N`` grows. Each
call stops right after its first token (a stopping criterion that is always true), so the
timed call is the prefill, one token choice and the allocation of the whole cache.

    genjax        ``genjax.generate`` with ``stopping_criteria=[always]``
    torch         ``model.generate`` (default dynamic cache) with a ``StoppingCriteria`` that is
                  always true
    torch-static  the same with ``cache_implementation="static"`` (``P + N`` slots up front)

Same random weights for all (``_cases.write_checkpoint``), batch 1, a 512-token prompt, float32;
every variant is compiled or warmed first, then the libraries run interleaved ``--runs`` times.
The table gives the median milliseconds (min-max), genjax's speed against the best torch, and
each library's time at ``N`` over its own time at ``N = 1``.

Run:  python bench/first_token.py [--shapes gpt2 smollm] [--new-tokens 1 512] [--runs 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import _cases
import _machine
import numpy as np

PROMPT = 512
LIBS = ("genjax", "torch", "torch-static")


def _genjax_call(folder: str, ids: np.ndarray, new_tokens: int):
    import jax.numpy as jnp

    import genjax

    model, params = genjax.models.from_pretrained(folder)
    config = genjax.GenerationConfig(max_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0)

    def always(tokens, length):  # int32[B, S], int32[] -> bool[B]: every row stops now
        return jnp.ones((tokens.shape[0],), bool)

    prompt = ids.astype(np.int32)

    def call():
        out = genjax.generate(model, params, prompt, config, stopping_criteria=[always])
        np.asarray(out.sequences)

    return call


def _torch_call(folder: str, ids: np.ndarray, new_tokens: int, static: bool):
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

    class Always(transformers.StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.ones(input_ids.shape[0], dtype=torch.bool)

    prompt = torch.as_tensor(ids)
    extra = {"cache_implementation": "static"} if static else {}

    def call():
        with torch.inference_mode():
            model.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                max_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
                stopping_criteria=transformers.StoppingCriteriaList([Always()]),
                **extra,
            )

    return call


def _timed(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def bench_shape(shape: _cases.Shape, new_tokens: list[int], runs: int) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        facts = _cases.write_checkpoint(shape, shape.layers, folder)
        rng = np.random.default_rng(_cases.SEED)
        ids = rng.integers(0, facts["vocab_size"], size=(1, PROMPT), dtype=np.int64)
        calls = {}
        for n in new_tokens:
            calls[("genjax", n)] = _genjax_call(folder, ids, n)
            calls[("torch", n)] = _torch_call(folder, ids, n, static=False)
            calls[("torch-static", n)] = _torch_call(folder, ids, n, static=True)
        for call in calls.values():  # compile (genjax) and warm up (torch)
            call()
        times = {key: [] for key in calls}
        for _ in range(runs):
            for key, call in calls.items():
                times[key].append(_timed(call))
    return times


def _row(label: str, xs: list[float]) -> str:
    ms = [x * 1e3 for x in xs]
    return f"{label:14s} {statistics.median(ms):8.0f} ({min(ms):.0f}-{max(ms):.0f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["gpt2", "smollm"], choices=_cases.SHAPES)
    parser.add_argument("--new-tokens", nargs="+", type=int, default=[1, 512])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(_machine.cpu_count())  # as run.py's torch peers
    print(
        f"prompt {PROMPT}, batch 1, float32; each call stops after its first new token; "
        f"median (min-max) of {args.runs} runs, milliseconds"
    )
    for name in args.shapes:
        shape = _cases.SHAPES[name]
        times = bench_shape(shape, args.new_tokens, args.runs)
        print(f"\n== {shape.title}: {shape.layers} layers ==")
        print(
            f"{'N (new tokens)':14s} {'library':14s} {'first token ms':>22s}  vs best torch  vs N=1"
        )
        for n in args.new_tokens:
            best = min(statistics.median(times[(lib, n)]) for lib in LIBS[1:])
            for lib in LIBS:
                median = statistics.median(times[(lib, n)])
                versus = f"{best / median:.2f}x" if lib == "genjax" else ""
                growth = median / statistics.median(times[(lib, args.new_tokens[0])])
                print(f"{n:<14d} {_row(lib, times[(lib, n)])}  {versus:>13s}  {growth:5.2f}")


if __name__ == "__main__":
    main()
