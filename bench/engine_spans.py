"""The serving engine's decode loop per attention span: what reading fewer blocks saves.

The engine's decode loop gathers each decoding row's blocks of keys and values and attends over
them (``ContinuousBatchingConfig.attention_spans``; :func:`genjax.serving.config.attention_spans`).
This times one decode iteration of the jitted step (``max_decode_steps`` iterations in one
call, divided) with every row decoding and ``--fill`` tokens in each, the rows' block tables
cut to each span given, interleaved over repeats in one process; the best of the repeats in
wall time and in process CPU time (less sensitive to a shared machine). Random SmolLM-135M-shape
weights (float32), no bias, n-gram, log-probability or constraint tables.

With ``--kv-cache-dtypes auto int8`` it times the int8 pool too (codes with one scale per head
vector, dequantized where read), against the float one.

Run:  python bench/engine_spans.py --rows 8 --fill 128 --spans 256 768 [--kv-cache-dtypes auto int8]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _cases  # noqa: E402
import _machine  # noqa: E402
import numpy as np  # noqa: E402

STEPS = 8  # decode iterations per call


def _programs(model, params, rows: int, fill: int, spans: list[int], kv_cache_dtype: str):
    """span -> (jitted step, a fresh-state maker, the step input): every row decoding, the
    pool in ``kv_cache_dtype`` ("auto": the model's float dtype, or "int8")."""
    import jax
    import jax.numpy as jnp

    from genjax.serving import ContinuousBatchingConfig, compile_step
    from genjax.serving import engine as engine_module
    from genjax.serving.scheduler import Scheduler

    config = ContinuousBatchingConfig(
        max_batch_size=rows,
        block_size=16,
        max_length=max(spans),
        prefill_chunk_size=64,
        max_decode_steps=STEPS,
        attention_spans=tuple(spans),
        max_logit_bias=0,
        max_no_repeat_ngram_size=0,
        max_top_logprobs=0,
        max_constraint_states=0,
        kv_cache_dtype=kv_cache_dtype,
    )
    shape = config.engine_shape(model)
    blocks = shape.max_blocks_per_row
    tables = np.arange(rows * blocks, dtype=np.int32).reshape(rows, blocks)
    tables = tables % (shape.num_blocks - 1) + 1
    lengths = np.full((rows,), fill, np.int32)

    def fresh():
        state = engine_module.init_state(model, shape)
        settings = state.settings.replace(max_new_tokens=jnp.full((rows,), 2**30, jnp.int32))
        return state.replace(
            cache=state.cache.replace(block_tables=tables, index=jnp.asarray(lengths - 1)),
            tokens=jnp.ones((rows, shape.max_length), jnp.int32),
            lengths=jnp.asarray(lengths),
            prompt_lengths=jnp.asarray(lengths // 2),
            decoding=jnp.ones((rows,), bool),
            settings=settings,
        )

    step = compile_step(model, STEPS)
    programs = {}
    for span in spans:
        blocks_in_span = -(-span // shape.block_size)
        if blocks_in_span * shape.block_size < fill + STEPS:
            raise SystemExit(f"--spans {span} does not hold --fill {fill} + {STEPS} tokens")
        work = Scheduler(shape)._step_input(STEPS, rows, blocks_in_span)
        work = work.replace(
            block_tables=tables,
            decode_rows=np.arange(rows, dtype=np.int32),
            decode_tables=tables[:, :blocks_in_span],
        )
        jax.block_until_ready(step(params, fresh(), work))  # compile
        programs[span] = (step, fresh, work)
    return programs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--fill", type=int, default=128, help="tokens in each row")
    parser.add_argument("--spans", type=int, nargs="+", default=[256, 768], help="tokens")
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument(
        "--kv-cache-dtypes", nargs="+", choices=["auto", "int8"], default=["auto"],
        help="the pools timed (auto: float32; int8: codes with scales)",
    )  # fmt: skip
    args = parser.parse_args(argv)

    import jax

    import genjax

    folder = tempfile.mkdtemp(prefix="genjax-spans-")
    shape = _cases.SHAPES["smollm"]
    _cases.write_checkpoint(shape, shape.layers, folder)
    model, params = genjax.models.from_pretrained(folder)
    programs = {
        (kind, span): program
        for kind in args.kv_cache_dtypes
        for span, program in _programs(
            model, params, args.rows, args.fill, sorted(args.spans), kind
        ).items()
    }
    measured = {key: [] for key in programs}
    for _ in range(args.repeats):
        for key, (step, fresh, work) in programs.items():
            state = jax.block_until_ready(fresh())
            wall, cpu = time.perf_counter(), time.process_time()
            jax.block_until_ready(step(params, state, work))
            measured[key].append(
                ((time.perf_counter() - wall) / STEPS, (time.process_time() - cpu) / STEPS)
            )
    print(f"engine decode iteration, SmolLM-135M shape float32, {args.rows} rows of {args.fill}")
    print(f"CPU: {_machine.cpu_model()} ({_machine.cpu_count()} usable)")
    shortest = min(measured)  # the first pool's shortest span
    base = np.asarray(measured[shortest])[:, 1].min() * 1e3
    for (kind, span), times in measured.items():
        times = np.asarray(times) * 1e3
        wall, cpu = times[:, 0].min(), times[:, 1].min()
        print(
            f"pool {kind:4s} span {span:5d} tokens: wall {wall:7.1f} ms, cpu {cpu:7.1f} ms "
            f"({cpu / base:.2f}x pool {shortest[0]} span {shortest[1]}, cpu)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
