"""Multi-host generate: one process per host, one global mesh, the same tokens everywhere.

Start this script once per process. Each process joins the others with
``jax.distributed.initialize``, sees its own local devices, and all of them together build one
global ``(data, model)`` mesh over every device of every process. Each loads the same checkpoint
and the same prompts, places its share of the parameters and of the prompt rows on its own
devices, and runs the same ``genjax.generate(..., mesh=mesh)`` call: a single SPMD program whose
collectives cross process boundaries (on CPU through gloo). At the end every process gathers the
whole output and writes it to its ``--out`` JSON file.

Everything that shapes or feeds the program must be identical on every process: the checkpoint,
the prompts, the generation config, the mesh shape and the PRNG seed. Nothing checks this
across processes; a difference gives wrong tokens or a hang.

Run on one machine with two CPU processes of 4 devices each (an 8-device mesh of shape 2 x 4,
so each process holds one ``data`` row and the tensor-parallel ``model`` axis stays inside it):

    python examples/multihost.py --process-id 0 --num-processes 2 \\
        --coordinator localhost:12355 --checkpoint CKPT --out out0.json &
    python examples/multihost.py --process-id 1 --num-processes 2 \\
        --coordinator localhost:12355 --checkpoint CKPT --out out1.json

(``CKPT`` is a Hugging Face folder, e.g. one written by
``genjax.testing.write_random_checkpoint``.) On a TPU pod, run the same command on every host
with ``--coordinator auto``: ``jax.distributed.initialize()`` then finds the coordinator, the
process count and the process id itself. On GPU clusters pass the coordinator's address and each
process' id (from SLURM: ``SLURM_PROCID``, ``SLURM_NTASKS`` and the first host of
``SLURM_STEP_NODELIST``; ``jax.distributed.initialize()`` with no arguments reads these itself,
so ``--coordinator auto`` works under ``srun`` too).

The script builds global arrays explicitly (``shard_params``, ``jax.make_array_from_callback``)
to show how; ``genjax.generate(..., mesh=mesh)`` also takes the host arrays and the unplaced
params and places them itself, giving the same tokens.

The output JSON holds, under each of ``--strategies`` (``greedy``, ``sample``), ``sequences``
(int[B, P+N], the left-padded prompt then the new tokens) and, with ``--output-scores``,
``scores`` (float[B, N, V]); and the process id and count, its local device count and the mesh.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--process-id", type=int, default=None, help="this process' index")
    parser.add_argument("--num-processes", type=int, default=None, help="processes in all")
    parser.add_argument(
        "--coordinator",
        default="auto",
        help="host:port of process 0's coordinator service; 'auto' lets "
        "jax.distributed.initialize() find it (TPU pods, SLURM)",
    )
    parser.add_argument("--checkpoint", required=True, help="a Hugging Face model folder")
    parser.add_argument("--out", required=True, help="the JSON file this process writes")
    parser.add_argument(
        "--local-devices",
        type=int,
        default=4,
        help="CPU only: the virtual devices this process creates (ignored on GPU/TPU)",
    )
    parser.add_argument(
        "--platform", default="cpu", help="cpu, gpu or tpu; '' lets JAX pick (its default)"
    )
    parser.add_argument("--mesh", default="2,4", help="global mesh shape: data,model")
    parser.add_argument(
        "--prompts",
        default=None,
        help="a JSON file holding a list of token-id lists (left-padded here); default: "
        "--batch random prompts of 2 to --prompt-length tokens from --prompt-seed",
    )
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-length", type=int, default=5)
    parser.add_argument("--prompt-seed", type=int, default=0)
    parser.add_argument("--max-new-tokens", type=int, default=4)
    parser.add_argument("--pad-token-id", type=int, default=0)
    parser.add_argument(
        "--strategies",
        default="greedy",
        help="comma-separated runs to make, each written under its name: greedy, sample",
    )
    parser.add_argument("--temperature", type=float, default=0.8, help="when sampling")
    parser.add_argument("--seed", type=int, default=0, help="the PRNG key, when sampling")
    parser.add_argument("--output-scores", action="store_true")
    args = parser.parse_args(argv)
    unknown = set(args.strategies.split(",")) - {"greedy", "sample"}
    if unknown:
        parser.error(f"--strategies takes greedy and/or sample, got {sorted(unknown)}")
    return args


def _start_jax(args: argparse.Namespace):
    """Sets the platform and local device count, then imports jax and joins the other
    processes. Must run before anything else imports jax."""
    if args.platform == "cpu":
        # Each process makes its own virtual CPU devices; gloo carries the collectives between
        # processes (jax's default on CPU; set it explicitly, as older releases had none).
        flags = os.environ.get("XLA_FLAGS", "")
        flags = " ".join(f for f in flags.split() if "host_platform_device_count" not in f)
        count = f"--xla_force_host_platform_device_count={args.local_devices}"
        os.environ["XLA_FLAGS"] = f"{flags} {count}".strip()
    if args.platform:
        os.environ["JAX_PLATFORMS"] = args.platform
    import jax

    if args.platform == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if args.coordinator == "auto":
        jax.distributed.initialize()
    else:
        jax.distributed.initialize(
            coordinator_address=args.coordinator,
            num_processes=args.num_processes,
            process_id=args.process_id,
        )
    return jax


def prompts(args: argparse.Namespace):
    """The prompt ids int32[B, P] and mask int32[B, P], left-padded; identical on every
    process (read from --prompts, or drawn from --prompt-seed), given the same arguments."""
    import numpy as np

    if args.prompts is not None:
        with open(args.prompts) as f:
            rows = [list(map(int, row)) for row in json.load(f)]
    else:
        rng = np.random.default_rng(args.prompt_seed)
        lengths = rng.integers(2, args.prompt_length + 1, args.batch)
        rows = [rng.integers(3, 100, n).tolist() for n in lengths]
    width = max(len(row) for row in rows)
    ids = np.full((len(rows), width), args.pad_token_id, np.int32)
    mask = np.zeros((len(rows), width), np.int32)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = row
        mask[i, width - len(row) :] = 1
    return ids, mask


def _gather(x) -> list:
    """A global array's whole value as nested lists, on every process (a collective: every
    process must call it)."""
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(x, tiled=True).tolist()


def main(argv=None) -> dict:
    args = parse_args(argv)
    jax = _start_jax(args)
    import genjax
    from genjax import sharding

    shape = tuple(int(s) for s in args.mesh.split(","))
    mesh = sharding.make_mesh(shape)  # over jax.devices(): every device of every process
    model, params = genjax.models.from_pretrained(args.checkpoint)
    params = sharding.shard_params(params, mesh)  # each process fills its own devices' blocks
    ids, mask = prompts(args)
    rows = sharding.batch_sharding(mesh)  # [B, P] with rows on "data"

    def global_array(local):  # every process holds all rows; each device takes its block
        return jax.make_array_from_callback(local.shape, rows, lambda index: local[index])

    greedy = genjax.GenerationConfig(
        max_new_tokens=args.max_new_tokens,
        pad_token_id=args.pad_token_id,
        output_scores=args.output_scores,
    )
    configs = {
        "greedy": greedy,
        "sample": greedy.replace(do_sample=True, temperature=args.temperature),
    }
    result = {
        "process_id": jax.process_index(),
        "num_processes": jax.process_count(),
        "local_devices": jax.local_device_count(),
        "mesh": dict(mesh.shape),
        # which process owns each mesh position: the rows of a (hosts, devices) mesh
        "mesh_processes": jax.tree.map(lambda d: d.process_index, mesh.devices.tolist()),
    }
    for name in args.strategies.split(","):
        out = genjax.generate(
            model,
            params,
            global_array(ids),
            configs[name],
            attention_mask=global_array(mask),
            key=jax.random.key(args.seed),
            mesh=mesh,
        )
        # The outputs are global arrays: each process holds only its devices' rows; gather.
        result[name] = {"sequences": _gather(out.sequences)}
        if args.output_scores:
            result[name]["scores"] = _gather(out.scores)
    with open(args.out, "w") as f:
        json.dump(result, f)
    jax.distributed.shutdown()
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
