"""``genjax generate``: prompts in; text, or one JSON object per result, out.

Randomness: prompt ``i`` of the run (arguments first, then ``--input`` lines) samples with the key
``jax.random.fold_in(key(seed), i)``, so its tokens do not depend on ``--batch-size``, on the
other prompts of its batch, or on whether it streams; two copies of one prompt sample
differently. ``genjax.generate`` takes one key per batch, so sampled batches run as
``jax.vmap`` over rows of batch-1 ``generate`` calls (one compiled program per batch size and
prompt bucket, as the batched call has).

Encoder-decoder models (T5, BART, Marian): each prompt is a source; the output is the decoded new
decoder tokens, never echoing the source, and sampled batches pad the sources on the right, as
``generate`` does.

Floor 6 (the command line): imports anything below it. Nothing here is public API.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from genjax.cli import options
from genjax.errors import InputError
from genjax.streaming import TextStreamer

MIN_BUCKET = 16  # sampled batches pad prompts to a power of two, at least this, as generate does


def run(args) -> int:
    """Runs ``genjax generate`` (parsed ``args``) and returns the exit code."""
    from genjax import models
    from genjax.io import bundled
    from genjax.io import tokenizer as tokenizers

    prompts = read_prompts(args.prompts, args.input)
    if args.model is not None and models.gguf.is_gguf(args.model):
        folder = args.model  # a GGUF file holds the config, tokenizer and weights
    else:
        folder = bundled.path() if args.model is None else models.loading.resolve(args.model)
        options.check_json(os.path.join(folder, "config.json"))
    config = options.generation_config(folder, args)
    rows = None
    if args.dtype == "auto":  # the rows each decode step will carry
        resolved = config.with_defaults()
        batch = min(args.batch_size, len(prompts))
        rows = batch * resolved.num_return_sequences * max(resolved.num_beams, 1)
    model, params = models.from_pretrained(
        folder, dtype=args.dtype, quantize=args.quantize, batch_size=rows
    )
    tokenizer = tokenizers.from_pretrained(folder)
    # `config` is already the folder's generation config with the flags on top; the model must not
    # fill back what a flag unset (--greedy drops the file's sampling values).
    model = model.with_generation_config(None)
    resolved = config.with_defaults()
    copies = resolved.num_return_sequences
    runner = Runner(model, params, config, tokenizer, options.seed_key(args.seed), args.chat)
    # Text continues the prompt, so the prompt is echoed; a chat reply stands alone, and so does
    # an encoder-decoder model's output (a translation, a summary), which its decoder starts anew.
    echo = not args.chat and not runner.encoder_decoder

    if len(prompts) == 1 and not args.json and resolved.num_beams == 1 and copies == 1:
        runner(prompts, 0, streamer=_EchoStreamer(tokenizer, prompts[0] if echo else ""))
        return 0
    style = "json" if args.json else "headed" if len(prompts) * copies > 1 else "plain"
    # A tqdm bar on stderr when it is a terminal (disable=None) and there are several prompts.
    progress = tqdm(total=len(prompts), unit="prompt", disable=None if len(prompts) > 1 else True)
    done = 0
    for start in range(0, len(prompts), args.batch_size):
        batch = prompts[start : start + args.batch_size]
        filled = batch
        if len(prompts) > args.batch_size:  # same shape as the other batches: no new program
            filled = batch + [batch[-1]] * (args.batch_size - len(batch))
        results = runner(filled, start)[: len(batch) * copies]
        with progress.external_write_mode():  # the bar steps aside while results print
            for row, (ids, text) in enumerate(results):
                prompt = batch[row // copies]
                _print_result(prompt, ids, text, style, first=done + row == 0, echo=echo)
        done += len(batch) * copies
        progress.update(len(batch))
    progress.close()
    return 0


class Runner:
    """Tokenizes a batch of prompts, generates, and returns each row's new ids and text."""

    def __init__(self, model, params, config, tokenizer, key, chat: bool):
        from genjax.stopping import stop_string_table

        self.model, self.params, self.config = model, params, config
        self.tokenizer, self.key, self.chat = tokenizer, key, chat
        # An encoder-decoder model's sequences are its decoder's: the start token, then the new
        # tokens; its source is padded on the right (as generate pads it).
        self.encoder_decoder = bool(getattr(model, "is_encoder_decoder", False))
        self.sampling = bool(config.with_defaults().do_sample)
        # Token healing needs the tokenizer on the host: each prompt is healed alone before its
        # batch is padded (genjax.heal_tokens), then generated without it.
        self.heal = bool(config.with_defaults().token_healing)
        if self.heal:
            self.config = config = config.replace(token_healing=False)
        eos, pad = config.eos_token_id, config.pad_token_id
        eos_ids = [] if eos is None else np.atleast_1d(eos).tolist()
        self.eos_ids = set(eos_ids)
        # generate's pad id: pad_token_id, else the first EOS id, else 0.
        self.pad_id = pad if pad is not None else eos_ids[0] if eos_ids else 0
        self.stop_vocab = tokenizer.backend if config.stop_strings is not None else None
        self.stop_table = None
        if config.stop_strings is not None:
            self.stop_table = stop_string_table(tokenizer.backend, config.stop_strings)
        self._sample_rows = None  # jit(vmap(one row)), built on first use

    def __call__(
        self, prompts: list[str], first_index: int, streamer=None
    ) -> list[tuple[list[int], str]]:
        """(new ids, text) per output row; prompt ``j`` is prompt ``first_index + j`` of the run."""
        import jax

        from genjax.generation import generate

        batch = self._encode(prompts)
        ids, mask = batch["input_ids"], batch["attention_mask"]
        if self.sampling and streamer is None:
            new = self._sample(ids, mask, first_index)
        else:  # greedy and beam search take no key; one streamed prompt takes its own
            out = generate(
                self.model,
                self.params,
                ids,
                self.config,
                attention_mask=mask,
                key=jax.random.fold_in(self.key, first_index),
                tokenizer=self.stop_vocab,
                streamer=streamer,
            )
            new = np.asarray(out.sequences)[:, self._prefix_length(ids) :]
        copies = new.shape[0] // len(prompts)
        rows = []
        for row, tokens in enumerate(new.tolist()):
            prompt = ids[row // copies][mask[row // copies] == 1].tolist()
            if self.encoder_decoder:  # the decoder's prefix, which its stop strings read
                prompt = [self.start_id]
            rows.append(self._trim(prompt, tokens))
        return [(r, self.tokenizer.decode(r, skip_special_tokens=True)) for r in rows]

    def _sample(self, ids: np.ndarray, mask: np.ndarray, first_index: int) -> np.ndarray:
        """int32[B*R, N], the new tokens: each row generated alone, with the key of its place
        in the run."""
        import jax

        from genjax.generation import generate

        def one_row(params, row_ids, row_mask, key):  # -> int32[R, S]
            return generate(
                self.model,
                params,
                row_ids[None],
                self.config,
                attention_mask=row_mask[None],
                key=key,
                tokenizer=self.stop_vocab,
            ).sequences

        if self._sample_rows is None:
            self._sample_rows = jax.jit(jax.vmap(one_row, in_axes=(None, 0, 0, 0)))
        width = _bucket(ids.shape[1]) - ids.shape[1]  # padding, masked
        side = (0, width) if self.encoder_decoder else (width, 0)
        ids = np.pad(ids, ((0, 0), side), constant_values=self.pad_id)
        mask = np.pad(mask, ((0, 0), side))
        indices = np.arange(first_index, first_index + len(ids))
        keys = jax.vmap(lambda i: jax.random.fold_in(self.key, i))(indices)
        sequences = np.asarray(self._sample_rows(self.params, ids, mask, keys))  # [B, R, S]
        return sequences.reshape(-1, sequences.shape[-1])[:, self._prefix_length(ids) :]

    @property
    def start_id(self) -> int:
        """An encoder-decoder model's decoder start token, as generate picks it."""
        from genjax.generation.encoder_decoder import start_token_id

        return int(start_token_id(self.config.with_defaults(), self.model))

    def _prefix_length(self, ids: np.ndarray) -> int:
        """The columns of ``sequences`` before the new tokens: the prompt's (as padded), or
        the decoder start token's."""
        return 1 if self.encoder_decoder else ids.shape[1]

    def _encode(self, prompts: list[str]) -> dict:
        batch = self._tokenize(prompts)
        if not self.heal:
            return batch
        from genjax.generation import heal_tokens

        rows = [
            heal_tokens(self.model, self.params, ids[mask == 1][None], self.tokenizer, key=self.key)
            for ids, mask in zip(batch["input_ids"], batch["attention_mask"], strict=True)
        ]
        return self.tokenizer.pad([np.asarray(row)[0].tolist() for row in rows])

    def _tokenize(self, prompts: list[str]) -> dict:
        if not self.chat:
            return self.tokenizer(prompts)
        if self.tokenizer.chat_template is None:
            raise InputError(
                "--chat needs a chat template, but this model's tokenizer has none (no "
                "chat_template in tokenizer_config.json and no chat_template.jinja). Drop --chat."
            )
        rows = [
            self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True
            )
            for prompt in prompts
        ]
        return self.tokenizer.pad(rows)

    def _trim(self, prompt: list[int], ids: list[int]) -> list[int]:
        """The new tokens up to the end of the row: the first EOS (included) or the end of the
        first stop string, whichever comes first; what follows is padding, even when the pad id
        is an EOS id. A row that neither hit ends at ``max_new_tokens``, or earlier when
        ``max_time`` ran out (its trailing padding dropped)."""
        end = next((k + 1 for k, token in enumerate(ids) if token in self.eos_ids), None)
        stop = self._stop_end(prompt, ids if end is None else ids[:end])
        if stop is not None:
            return ids[:stop]
        if end is not None:
            return ids[:end]
        if self.config.max_time is not None:
            while ids and ids[-1] == self.pad_id:
                ids = ids[:-1]
        return ids

    def _stop_end(self, prompt: list[int], ids: list[int]) -> int | None:
        """How many of ``ids`` end at the first stop string, as generate's criterion finds it
        (it may begin in the prompt); None when none ends there."""
        if self.stop_table is None or not ids:
            return None
        import jax
        import jax.numpy as jnp

        from genjax.stopping import stop_string_hits

        tokens = jnp.asarray([prompt + ids], jnp.int32)
        lengths = jnp.arange(len(prompt) + 1, len(prompt) + len(ids) + 1)
        hits = jax.vmap(lambda n: stop_string_hits(self.stop_table, tokens, n))(lengths)
        hits = np.asarray(hits)[:, 0]
        return int(np.argmax(hits)) + 1 if hits.any() else None


class _EchoStreamer(TextStreamer):
    """Streams the new text to stdout, after ``echo`` (the prompt), which is written when
    generate puts the prompt: after its checks, so an error leaves stdout empty."""

    def __init__(self, tokenizer, echo: str):
        super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
        self.echo = echo

    def put(self, value: Any) -> None:
        if self.next_tokens_are_prompt and self.echo:
            sys.stdout.write(self.echo)
            sys.stdout.flush()
        super().put(value)


def _bucket(length: int) -> int:
    return max(MIN_BUCKET, 1 << (length - 1).bit_length())


def read_prompts(prompts: list[str], input_file: str | None) -> list[str]:
    prompts = list(prompts)
    if input_file is not None:
        if input_file != "-" and not os.path.isfile(input_file):
            raise InputError(f"--input file {input_file!r} does not exist.")
        try:
            if input_file == "-":
                lines = sys.stdin.read().splitlines()
            else:
                with open(input_file, encoding="utf-8") as f:
                    lines = f.read().splitlines()
        except UnicodeDecodeError as error:
            name = "standard input" if input_file == "-" else repr(input_file)
            raise InputError(
                f"--input {name} is not UTF-8 text (byte {error.object[error.start]:#04x} at "
                f"offset {error.start}). Convert it, e.g. iconv -f LATIN1 -t UTF-8."
            ) from None
        prompts += [line for line in lines if line.strip()]
    if not prompts:
        raise InputError(
            "no prompt: give one or more PROMPT arguments, or --input FILE with one per line."
        )
    return prompts


def _print_result(prompt: str, ids: list[int], text: str, style: str, first: bool, echo: bool):
    """Prints one output sequence; ``style`` is "json", "headed" (``==> PROMPT <==`` first,
    blank lines between results) or "plain" (a single result). With ``echo``, text results
    start with the prompt they continue."""
    if style == "json":
        record = {"prompt": prompt, "completion": text, "token_ids": ids}
        record["num_new_tokens"] = len(ids)
        print(json.dumps(record, ensure_ascii=False), flush=True)
        return
    if style == "headed":
        print(("" if first else "\n") + f"==> {prompt} <==")
    print((prompt if echo else "") + text, flush=True)
