"""What the suite measures: the model shapes, the cases, and the random checkpoints.

A shape is a transformers config with random weights; :func:`write_checkpoint` saves it in
Hugging Face format (``save_pretrained(safe_serialization=True)``) so that genjax and
transformers load the very same weights from disk. A case is one generate call: a strategy, a
batch, a prompt length and a number of new tokens.
"""

from __future__ import annotations

import dataclasses

import numpy as np

SEED = 0


@dataclasses.dataclass(frozen=True)
class Shape:
    """A model shape: a transformers architecture and its config values (full depth)."""

    name: str
    title: str
    arch: str  # "gpt2", "llama" or "t5"
    layers: int  # each stack's layers (T5: the encoder's and the decoder's)
    config: dict
    real: bool = False  # the real checkpoint of bench/_real.py, not random weights
    prompt: int | None = None  # the prompt length of every case (None: each case's own)
    cases: tuple[str, ...] | None = None  # the cases run by default (None: all)

    @property
    def encoder_decoder(self) -> bool:
        """True for a sequence-to-sequence shape (T5): the prompt is the encoder's source."""
        return self.arch == "t5"

    def hf_config(self, layers: int | None = None):
        """The transformers config, with ``layers`` hidden layers (default: full depth)."""
        import transformers

        layers = self.layers if layers is None else layers
        if self.arch == "gpt2":
            return transformers.GPT2Config(n_layer=layers, **self.config)
        if self.arch == "t5":
            return transformers.T5Config(
                num_layers=layers, num_decoder_layers=layers, **self.config
            )
        return transformers.LlamaConfig(num_hidden_layers=layers, **self.config)

    def case(self, case: Case) -> Case:
        """``case`` with this shape's prompt length, when it sets one."""
        return case if self.prompt is None else dataclasses.replace(case, prompt=self.prompt)


_SMOLLM_SIZES = dict(
    hidden_size=576,
    num_attention_heads=9,
    num_key_value_heads=3,
    intermediate_size=1536,
    vocab_size=49152,
)
"""SmolLM-135M's sizes, shared by its random shape and the real SmolLM2-135M-Instruct."""

SHAPES = {
    "gpt2": Shape(
        name="gpt2",
        title="GPT-2 small",
        arch="gpt2",
        layers=12,
        config=dict(n_embd=768, n_head=12, vocab_size=50257, n_positions=1024),
    ),
    "smollm": Shape(
        name="smollm",
        title="SmolLM-135M (Llama)",
        arch="llama",
        layers=30,
        config=dict(
            _SMOLLM_SIZES, tie_word_embeddings=False, rope_theta=1e4, max_position_embeddings=2048
        ),
    ),
    "real": Shape(
        name="real",
        title="SmolLM2-135M-Instruct (real weights)",
        arch="llama",
        layers=30,
        config=dict(
            _SMOLLM_SIZES, tie_word_embeddings=True, rope_theta=1e5, max_position_embeddings=8192
        ),
        real=True,
    ),
    "t5": Shape(
        name="t5",
        title="T5-small (encoder-decoder, 128-token source)",
        arch="t5",
        layers=6,
        config=dict(
            d_model=512,
            d_ff=2048,
            d_kv=64,
            num_heads=8,
            vocab_size=32128,
            feed_forward_proj="relu",
            tie_word_embeddings=True,
            decoder_start_token_id=0,
        ),
        prompt=128,
        cases=("greedy_b1", "greedy_b8"),
    ),
}
RANDOM_SHAPES = ["gpt2", "smollm"]
"""The shapes run by default (random weights, written on the fly); ``--shapes t5`` adds the
encoder-decoder one."""


@dataclasses.dataclass(frozen=True)
class Case:
    """One generate call to time. ``new_tokens=None`` means the suite's default (128)."""

    name: str
    title: str
    batch: int
    prompt: int = 32
    new_tokens: int | None = None
    do_sample: bool = False
    num_beams: int = 1

    @property
    def prefill_only(self) -> bool:
        """True for the time-to-first-token case (one new token, no decode steps)."""
        return self.new_tokens == 1

    def tokens(self, default: int) -> int:
        """The number of new tokens this case generates."""
        return default if self.new_tokens is None else self.new_tokens

    def sampling(self) -> dict:
        """The strategy as generation-config fields shared by both libraries."""
        fields = dict(do_sample=self.do_sample, num_beams=self.num_beams)
        if self.do_sample:
            fields.update(temperature=0.7, top_k=50, top_p=0.9)
        return fields


CASES = {
    case.name: case
    for case in (
        Case("greedy_b1", "greedy, batch 1", batch=1),
        Case("greedy_b8", "greedy, batch 8", batch=8),
        Case("greedy_b32", "greedy, batch 32", batch=32),
        Case("sample_b8", "sampling t=0.7 top_k=50 top_p=0.9, batch 8", batch=8, do_sample=True),
        Case("beam4_b1", "beam search, 4 beams, batch 1", batch=1, num_beams=4),
        Case("prefill512", "prefill of 512 tokens (max_new_tokens=1)", 1, 512, new_tokens=1),
    )
}
QUICK_BATCHES = (1, 8)


def select_cases(names: list[str] | None, quick: bool, shape: Shape | None = None) -> list[Case]:
    """The cases to run, in suite order (default: the shape's own, else all), with the shape's
    prompt length; ``quick`` keeps batches 1 and 8 only."""
    default = shape.cases if shape is not None and shape.cases else CASES
    chosen = [CASES[name] for name in (names or default)]
    if shape is not None:
        chosen = [shape.case(case) for case in chosen]
    if quick:
        chosen = [case for case in chosen if case.batch in QUICK_BATCHES]
    return chosen


def prompt_ids(case: Case, vocab_size: int) -> np.ndarray:
    """Random int64[batch, prompt] token ids, the same for every library and run."""
    rng = np.random.default_rng(SEED)
    return rng.integers(0, vocab_size, size=(case.batch, case.prompt), dtype=np.int64)


def write_checkpoint(shape: Shape, layers: int, folder: str) -> dict:
    """Saves a random-weight model of ``shape`` to ``folder`` in Hugging Face format.

    Returns:
        Facts about the checkpoint: ``params`` (tied weights counted once), ``lookup_params``
        (embedding tables only indexed, never multiplied: a decode step reads one row of them),
        ``vocab_size``, and ``kv_bytes_per_token`` (float32 keys and values, all layers).
    """
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(SEED)
    config = shape.hf_config(layers)
    auto = transformers.AutoModelForSeq2SeqLM if shape.encoder_decoder else None
    auto = auto or transformers.AutoModelForCausalLM
    model = auto.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(folder, safe_serialization=True)
    return _facts(model, config, layers)


def describe_checkpoint(folder: str) -> dict:
    """:func:`write_checkpoint`'s facts about an existing Hugging Face folder (the real model)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return _facts(model, model.config, model.config.num_hidden_layers)


def _facts(model, config, layers: int) -> dict:
    params = sum(p.numel() for p in model.parameters())
    return dict(
        layers=layers,
        params=int(params),
        lookup_params=_lookup_params(model),
        vocab_size=config.vocab_size,
        kv_bytes_per_token=_kv_bytes_per_token(config),
    )


def _lookup_params(model) -> int:
    """Parameters of embedding tables that are not also the output projection (GPT-2's position
    table; a Llama's untied input table)."""
    import torch

    output = model.get_output_embeddings().weight
    tables = [m.weight for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    return int(sum(table.numel() for table in tables if table is not output))


def _kv_bytes_per_token(config) -> int:
    """Bytes of float32 keys and values that one token adds to the cache (all layers)."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = config.hidden_size // heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * 4
