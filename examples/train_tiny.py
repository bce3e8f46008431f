"""Train the bundled models: a small Llama on the Python standard library's source code.

What it does, end to end, on a CPU with no network:

1. Corpus: every ``*.py`` file of this Python's standard library (``sysconfig``'s ``stdlib``
   folder), without ``site-packages``, the test suites, ``idlelib`` and ``lib2to3``. Files are
   sorted by path; every ``--holdout-every``-th file is held out for validation.
2. Tokenizer: a byte-level BPE (GPT-2 style pre-tokenization, so any text round-trips) trained
   with the ``tokenizers`` library on the training files, with one special token
   ``<|endoftext|>`` that separates files and serves as BOS, EOS and padding.
3. Model: ``genjax.models.LlamaModel`` (the same code that generates), trained on random windows
   of the concatenated token stream with optax's AdamW, linear warmup then cosine decay, and
   global-norm gradient clipping. The forward pass is ``model.apply`` on a fresh cache, i.e. the
   protocol's full forward pass. ``--init-from FOLDER`` starts from that Hugging Face folder's
   weights (their shapes must be the ``--size``'s) instead of a random init.
4. Distillation (``--distill-from FOLDER``): a teacher model, loaded with
   ``genjax.models.from_pretrained``, runs on the same windows inside the jitted training step
   (its params are an argument under ``stop_gradient``: constants for the gradient). The loss
   is the cross entropy between the teacher's next-token distribution ``softmax(teacher
   logits)`` and the student's (soft labels: the forward KL(teacher || student) up to the
   teacher's entropy, a constant), mixed with the ordinary hard-label loss as
   ``w * soft + (1 - w) * hard`` with ``w = --distill-weight`` (default 1.0: soft only). This
   makes a speculative-decoding draft agree with its target more often, which is what the
   acceptance rate measures. The held-out evaluation then also reports how often the student's
   argmax equals the teacher's (the greedy acceptance rate of one candidate).
5. Resumable: every ``--save-every`` steps, orbax-checkpoint saves the parameters, optimizer
   state and step under ``WORKDIR/checkpoints`` (the last two are kept). Kill the script and run
   it again with the same arguments: it resumes from the last saved step. Batches are a pure
   function of (seed, step), so a resumed run sees the batches an uninterrupted one would.
6. Export: a Hugging Face folder (``config.json``, ``model.safetensors`` in bfloat16,
   ``tokenizer.json``, ``tokenizer_config.json``, ``generation_config.json``), written to a
   temporary folder and renamed into place, loadable by ``genjax.models.from_pretrained`` and
   transformers' ``AutoModelForCausalLM``.
7. Held-out loss over every validation token, in nats/token and bits/byte (the summed loss in
   bits divided by the UTF-8 bytes of the validation text), printed and saved as
   ``WORKDIR/eval.json``.

The bundled models were made with the commands below. The draft reuses the default model's
tokenizer; it was first trained on hard labels, then distilled from the default model starting
from those weights, on other batches (``--seed 1``). The distillation run was planned for 1400
steps and stopped after its step-1000 checkpoint (CPU time); running it again with
``--steps 1000`` resumed there, trained no further, evaluated and exported::

    python examples/train_tiny.py --size default --workdir /tmp/tiny \\
        --out genjax/io/bundled/genjax-tiny
    python examples/train_tiny.py --size draft --workdir /tmp/draft \\
        --tokenizer genjax/io/bundled/genjax-tiny --out /tmp/draft_out
    python examples/train_tiny.py --size draft --workdir /tmp/distill \\
        --init-from /tmp/draft_out --distill-from genjax/io/bundled/genjax-tiny \\
        --tokenizer genjax/io/bundled/genjax-tiny --seed 1 --lr 2e-3 --steps 1400 \\
        --out genjax/io/bundled/genjax-tiny-draft  # stopped after step 1000, then:
    python examples/train_tiny.py --size draft --workdir /tmp/distill \\
        --init-from /tmp/draft_out --distill-from genjax/io/bundled/genjax-tiny \\
        --tokenizer genjax/io/bundled/genjax-tiny --seed 1 --lr 2e-3 --steps 1000 \\
        --out genjax/io/bundled/genjax-tiny-draft

Static or traced: the model shape, batch size and sequence length are static (one compiled
training step); parameters, teacher parameters, optimizer state, batches and the step count are
traced.

References:
    Hinton, Vinyals, Dean, "Distilling the Knowledge in a Neural Network", 2015
    (arXiv:1503.02531): soft targets from a teacher's softmax.
    Zhou et al., "DistillSpec: Improving Speculative Decoding via Knowledge Distillation", 2023
    (arXiv:2310.08461): distilling the draft from the target raises the acceptance rate.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

import genjax
from genjax.models import from_config, save_params

SPECIAL = "<|endoftext|>"
_EXCLUDED_DIRS = {"site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}

# The two bundled shapes. ``steps`` x ``batch`` x ``seq`` tokens are seen in training.
SIZES = {
    "default": {
        "hidden_size": 256,
        "intermediate_size": 704,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "steps": 1400,
        "batch": 16,
        "seq": 256,
        "lr": 2e-3,
    },
    "draft": {
        "hidden_size": 96,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "steps": 600,
        "batch": 16,
        "seq": 256,
        "lr": 3e-3,
    },
}


@dataclasses.dataclass(frozen=True)
class Corpus:
    """The token streams: int32[N] train and validation, and the validation text's byte count."""

    train: np.ndarray
    valid: np.ndarray
    valid_bytes: int


def stdlib_files(holdout_every: int) -> tuple[list[Path], list[Path]]:
    """Returns (train, validation) standard-library source files, sorted by path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        p
        for p in root.rglob("*.py")
        if not _EXCLUDED_DIRS.intersection(p.relative_to(root).parts[:-1])
    )
    if len(files) < holdout_every:
        raise SystemExit(f"found only {len(files)} source files under {root}; is it a stdlib?")
    valid = files[holdout_every // 2 :: holdout_every]
    held = set(valid)
    return [p for p in files if p not in held], valid


def read_texts(files: list[Path]) -> list[str]:
    return [p.read_text(encoding="utf-8", errors="replace") for p in files]


def train_tokenizer(texts: list[str], vocab_size: int):
    """Trains a byte-level BPE on ``texts``; returns a ``tokenizers.Tokenizer``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[SPECIAL],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def encode(tokenizer, texts: list[str]) -> np.ndarray:
    """Encodes ``texts`` into one stream, each text followed by the special token."""
    eos = tokenizer.token_to_id(SPECIAL)
    pieces = []
    for encoding in tokenizer.encode_batch(texts):
        pieces.append(np.asarray(encoding.ids, np.int32))
        pieces.append(np.asarray([eos], np.int32))
    return np.concatenate(pieces)


def hf_config(size: dict, vocab_size: int, eos: int, seq: int) -> dict:
    """The ``config.json`` of the model."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": size["hidden_size"],
        "intermediate_size": size["intermediate_size"],
        "num_hidden_layers": size["num_hidden_layers"],
        "num_attention_heads": size["num_attention_heads"],
        "num_key_value_heads": size["num_key_value_heads"],
        "hidden_act": "silu",
        "max_position_embeddings": 4 * seq,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": True,
        "bos_token_id": eos,
        "eos_token_id": eos,
        "pad_token_id": eos,
        "dtype": "bfloat16",
    }


def batch_at(tokens: np.ndarray, seed: int, step: int, batch: int, seq: int) -> np.ndarray:
    """int32[batch, seq + 1]: random windows, a pure function of (seed, step)."""
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(tokens) - seq - 1, size=batch)
    return np.stack([tokens[s : s + seq + 1] for s in starts])


def _forward(model, params, inputs):
    """float32[B, T, V] logits of int32[B, T] inputs: one full forward pass on a fresh cache."""
    batch, length = inputs.shape
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), inputs.shape)
    cache = model.init_cache(batch, length)
    mask = jnp.ones((batch, length), jnp.int32)
    logits, _ = model.apply(params, inputs, positions, cache, mask)
    return logits.astype(jnp.float32)


def make_loss(model):
    def loss_fn(params, windows):
        """Mean next-token cross entropy of int32[B, T + 1] windows."""
        logits = _forward(model, params, windows[:, :-1])  # [B, T, V]
        return optax.softmax_cross_entropy_with_integer_labels(logits, windows[:, 1:]).mean()

    return loss_fn


def make_distill_loss(model, teacher, weight: float):
    """The distillation loss ``loss_fn(params, teacher_params, windows)``.

    ``weight * soft + (1 - weight) * hard``, where ``soft`` is the mean cross entropy between
    ``softmax(teacher logits)`` and the student's distribution at every position (Hinton et al.
    2015 at temperature 1; the forward KL of DistillSpec, Zhou et al. 2023, up to the teacher's
    entropy) and ``hard`` the ordinary next-token loss. ``model``, ``teacher`` and ``weight`` are
    static; ``teacher_params`` is traced and held constant (``stop_gradient``).
    """

    def loss_fn(params, teacher_params, windows):
        inputs, targets = windows[:, :-1], windows[:, 1:]
        teacher_params = jax.lax.stop_gradient(teacher_params)
        soft_labels = jax.nn.softmax(_forward(teacher, teacher_params, inputs))  # [B, T, V]
        logits = _forward(model, params, inputs)  # [B, T, V]
        soft = optax.softmax_cross_entropy(logits, soft_labels).mean()
        if weight == 1.0:
            return soft
        hard = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
        return weight * soft + (1.0 - weight) * hard

    return loss_fn


def load_teacher(folder: str, vocab_size: int):
    """(model, float32 params) of the ``--distill-from`` teacher, of the student's vocabulary."""
    teacher, teacher_params = genjax.models.from_pretrained(folder, dtype="float32")
    if teacher.vocab_size != vocab_size:
        raise SystemExit(
            f"--distill-from {folder}: the teacher's vocabulary has {teacher.vocab_size} tokens "
            f"but the student's tokenizer has {vocab_size}; distillation compares distributions "
            "over the same tokens. Pass --tokenizer with the teacher's folder."
        )
    return teacher, teacher_params


def load_init(folder: str, size_name: str, expected) -> dict:
    """The float32 params of ``--init-from``, checked leaf by leaf against ``expected``'s shapes."""
    _, params = genjax.models.from_pretrained(folder, dtype="float32")
    want = {jax.tree_util.keystr(k): v.shape for k, v in jax.tree.leaves_with_path(expected)}
    got = {jax.tree_util.keystr(k): v.shape for k, v in jax.tree.leaves_with_path(params)}
    if want != got:
        diff = sorted(
            f"{name}: expected {want.get(name)}, got {got.get(name)}"
            for name in set(want) | set(got)
            if want.get(name) != got.get(name)
        )
        raise SystemExit(
            f"--init-from {folder}: its parameters do not have the shapes of --size {size_name} "
            f"({len(diff)} differ; first: {'; '.join(diff[:3])}). Pass the --size whose shape "
            "matches the folder's config.json (see SIZES), or a folder of that size."
        )
    return params


def make_optimizer(steps: int, lr: float):
    warmup = max(1, steps // 20)
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=lr,
        warmup_steps=warmup,
        decay_steps=max(steps, warmup + 1),  # optax needs a decay phase, even for --steps 1
        end_value=lr / 10,
    )
    return optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.1),
    )


def _windows(tokens: np.ndarray, seq: int, batch: int):
    """Yields int32[b, seq + 1] windows covering ``tokens`` once (b = batch, then the rest one
    by one, so at most two shapes compile); returns how many tokens were covered."""
    usable = (len(tokens) - 1) // seq * seq
    starts = np.arange(0, usable, seq)
    full = len(starts) // batch * batch
    for i in range(0, full, batch):
        yield np.stack([tokens[s : s + seq + 1] for s in starts[i : i + batch]])
    for s in starts[full:]:
        yield tokens[None, s : s + seq + 1]
    return usable


def evaluate(model, params, tokens: np.ndarray, seq: int, batch: int) -> tuple[float, int]:
    """(summed next-token loss in nats, tokens counted) over ``tokens``, in windows of ``seq``."""
    total_fn = jax.jit(lambda p, w: make_loss(model)(p, w) * (w.shape[0] * (w.shape[1] - 1)))
    windows = _windows(tokens, seq, batch)
    total = 0.0
    while True:
        try:
            total += float(total_fn(params, next(windows)))
        except StopIteration as done:
            return total, done.value


def teacher_agreement(model, params, teacher, teacher_params, tokens, seq, batch) -> float:
    """The fraction of ``tokens``' positions where the student's argmax is the teacher's."""

    @jax.jit
    def count(p, tp, w):
        student = jnp.argmax(_forward(model, p, w[:, :-1]), -1)  # [B, T]
        return jnp.sum(student == jnp.argmax(_forward(teacher, tp, w[:, :-1]), -1))

    windows = _windows(tokens, seq, batch)
    same = 0
    while True:
        try:
            same += int(count(params, teacher_params, next(windows)))
        except StopIteration as done:
            return same / done.value


def write_folder(out: Path, model, params, config: dict, tokenizer_json: str, eos: int) -> None:
    """Writes the HF folder atomically (temporary folder next to ``out``, then rename)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_params(model, params, staging, dtype="bfloat16")
        (staging / "tokenizer.json").write_text(tokenizer_json)
        tokenizer_config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": SPECIAL,
            "eos_token": SPECIAL,
            "pad_token": SPECIAL,
            "unk_token": None,
            "add_bos_token": False,
            "model_max_length": config["max_position_embeddings"],
            "clean_up_tokenization_spaces": False,
            # Chat turns become Python comments, the only prose this model has seen.
            "chat_template": (
                "{% for message in messages %}# {{ message['role'] }}: "
                "{{ message['content'] | replace('\\n', '\\n# ') }}\n{% endfor %}"
                "{% if add_generation_prompt %}# assistant:\n{% endif %}"
            ),
        }
        (staging / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
        genjax.GenerationConfig(
            do_sample=True,
            temperature=0.8,
            top_k=50,
            top_p=0.95,
            repetition_penalty=1.1,
            max_new_tokens=128,
            bos_token_id=eos,
            eos_token_id=eos,
            pad_token_id=eos,
        ).save_pretrained(staging)
        staging.chmod(0o755)  # mkdtemp makes it private; a package folder should be readable
        for file in staging.iterdir():
            file.chmod(0o644)
        if out.exists():
            shutil.rmtree(out)
        os.replace(staging, out)
    finally:
        if staging.exists():
            shutil.rmtree(staging)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="default")
    parser.add_argument("--workdir", required=True, help="checkpoints and caches (resumable)")
    parser.add_argument("--out", required=True, help="the Hugging Face folder to write")
    parser.add_argument("--tokenizer", help="a folder with tokenizer.json to reuse (draft)")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--steps", type=int, help="training steps (default: per size)")
    parser.add_argument("--save-every", type=int, default=200)
    parser.add_argument("--holdout-every", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, help="peak learning rate (default: per size)")
    parser.add_argument("--init-from", help="a Hugging Face folder of the --size to start from")
    parser.add_argument("--distill-from", help="a teacher Hugging Face folder (same tokenizer)")
    parser.add_argument(
        "--distill-weight",
        type=float,
        default=1.0,
        help="with --distill-from: weight of the soft-label loss; 1 - it goes to hard labels",
    )
    parser.add_argument(
        "--max-files", type=int, help="use only the first N training files (a quick trial run)"
    )
    args = parser.parse_args(argv)
    if not 0.0 <= args.distill_weight <= 1.0:
        parser.error(f"--distill-weight must be in [0, 1], got {args.distill_weight}")
    if args.distill_weight != 1.0 and not args.distill_from:
        parser.error("--distill-weight needs --distill-from FOLDER (the teacher)")
    size = SIZES[args.size]
    steps = args.steps or size["steps"]
    batch, seq = size["batch"], size["seq"]
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)

    from tokenizers import Tokenizer

    t0 = time.perf_counter()
    train_files, valid_files = stdlib_files(args.holdout_every)
    if args.max_files:
        train_files = train_files[: args.max_files]
        valid_files = valid_files[: max(1, args.max_files // args.holdout_every)]
    train_texts, valid_texts = read_texts(train_files), read_texts(valid_files)
    tokenizer_file = (
        Path(args.tokenizer) / "tokenizer.json" if args.tokenizer else workdir / "tokenizer.json"
    )
    if not tokenizer_file.exists():
        print(f"training a {args.vocab_size}-token BPE on {len(train_files)} files", flush=True)
        train_tokenizer(train_texts, args.vocab_size).save(str(tokenizer_file))
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    corpus = Corpus(
        train=encode(tokenizer, train_texts),
        valid=encode(tokenizer, valid_texts),
        valid_bytes=sum(len(t.encode("utf-8")) for t in valid_texts),
    )
    print(f"corpus ready in {time.perf_counter() - t0:.0f} s", flush=True)
    eos = tokenizer.token_to_id(SPECIAL)
    config = hf_config(size, tokenizer.get_vocab_size(), eos, seq)
    model = from_config(config, dtype="float32")
    print(
        f"corpus: {len(train_files)} train files ({len(corpus.train)} tokens), "
        f"{len(valid_files)} held out ({len(corpus.valid)} tokens, {corpus.valid_bytes} bytes)",
        flush=True,
    )

    optimizer = make_optimizer(steps, args.lr or size["lr"])
    # Without a teacher, its params are an empty tree: the step has one signature either way.
    teacher, teacher_params, loss_fn = None, {}, make_loss(model)
    if args.distill_from:
        teacher, teacher_params = load_teacher(args.distill_from, model.vocab_size)
        loss_fn = make_distill_loss(model, teacher, args.distill_weight)

    @jax.jit
    def train_step(state, teacher_params, windows):
        extra = (teacher_params,) if teacher is not None else ()
        loss, grads = jax.value_and_grad(loss_fn)(state["params"], *extra, windows)
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, loss

    params = model.init_params(jax.random.key(args.seed))
    if args.init_from:
        params = load_init(args.init_from, args.size, params)
    else:
        params = jax.tree.map(lambda x: x * 0.5 if x.ndim == 2 else x, params)  # tamer start
    state = {"params": params, "opt_state": optimizer.init(params), "step": jnp.int32(0)}
    count = sum(x.size for x in jax.tree.leaves(params))
    print(f"model: {count / 1e6:.2f}M parameters, {steps} steps of {batch}x{seq}", flush=True)

    manager = ocp.CheckpointManager(
        (workdir / "checkpoints").absolute(),
        options=ocp.CheckpointManagerOptions(max_to_keep=2, save_interval_steps=args.save_every),
    )
    if manager.latest_step() is not None:
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
        state = manager.restore(manager.latest_step(), args=ocp.args.StandardRestore(abstract))
        print(f"resumed at step {int(state['step'])}", flush=True)

    start, begin = int(state["step"]), time.perf_counter()
    for step in range(start, steps):
        windows = batch_at(corpus.train, args.seed, step, batch, seq)
        state, loss = train_step(state, teacher_params, windows)
        if (step + 1) % 50 == 0 or step == start:
            rate = (step + 1 - start) / (time.perf_counter() - begin)
            print(
                f"step {step + 1}/{steps} loss {float(loss):.3f} ({rate:.2f} steps/s)", flush=True
            )
        if (step + 1) % args.save_every == 0 or step + 1 == steps:
            manager.save(step + 1, args=ocp.args.StandardSave(state))
    manager.wait_until_finished()

    # Evaluate the weights as shipped: rounded to bfloat16.
    shipped = jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(jnp.float32), state["params"])
    print(f"trained in {time.perf_counter() - begin:.0f} s; evaluating", flush=True)
    total_nats, counted = evaluate(model, shipped, corpus.valid, seq, batch)
    nats = total_nats / counted
    covered = corpus.valid_bytes * counted / max(1, len(corpus.valid) - 1)
    result = {
        "size": args.size,
        "parameters": count,
        "steps": steps,
        "train_tokens_seen": steps * batch * seq,
        "valid_tokens": counted,
        "valid_nats_per_token": nats,
        "valid_bits_per_byte": total_nats / math.log(2) / covered,
        "python": sys.version.split()[0],
    }
    if args.init_from:
        result["init_from"] = args.init_from
    if teacher is not None:
        result["distill_from"] = args.distill_from
        result["distill_weight"] = args.distill_weight
        result["valid_teacher_top1_agreement"] = teacher_agreement(
            model, shipped, teacher, teacher_params, corpus.valid, seq, batch
        )
    (workdir / "eval.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2), flush=True)
    write_folder(Path(args.out), model, state["params"], config, tokenizer_file.read_text(), eos)
    print(f"wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
