"""Compiling ahead of time: :func:`warmup` and an opt-in persistent compilation cache.

``genjax.generate`` compiles one program per static structure (model, batch size, prompt
bucket, ``max_new_tokens`` or ``max_cache_len``, enabled processors, output flags...; see
:mod:`genjax.generate`). A server knows these shapes before its first request: :func:`warmup`
compiles them all up front (``jax.jit(...).lower(...).compile()``, which fills the same cache
``generate`` looks in), so the first real call compiles nothing. :func:`enable_compile_cache`
makes the compiled programs outlive the process: a second process with the same cache
directory loads them from disk instead of compiling.

Compiling is not all of a first call's extra time. XLA:CPU builds the runtime of each of its
library matrix products (YNNPACK) when a program first runs, which adds 2-3 s to the first call
of a SmolLM-135M-sized program on a 2-core CPU even after :func:`warmup` compiled it.
``warmup(..., run_once=True)`` also runs each program once on a dummy batch, so that cost is paid
up front as well.

Example:
    >>> import tempfile
    >>> genjax.enable_compile_cache(tempfile.mkdtemp())
    PosixPath('/tmp/...')
    >>> report = genjax.warmup(model, params, config, batch_sizes=(2,), prompt_lengths=(3,))
    >>> sum(entry.seconds for entry in report) > 0  # compile time paid now, not by a user
    True
    >>> genjax.disable_compile_cache()
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Sequence
from pathlib import Path

import jax
import numpy as np
from jax.experimental.compilation_cache import compilation_cache

from genjax.config import GenerationConfig
from genjax.errors import InputError, UnsupportedError
from genjax.generation import buckets
from genjax.generation.encoder_decoder import is_encoder_decoder
from genjax.generation.entry import lower_program
from genjax.generation.inputs import effective_config
from genjax.generation.plan import CallRequest, PreparedCall, prepare
from genjax.typing import PyTree

__all__ = ["WarmupEntry", "disable_compile_cache", "enable_compile_cache", "warmup"]


@dataclasses.dataclass(frozen=True)
class WarmupEntry:
    """One program :func:`warmup` prepared.

    Attributes:
        batch: the batch size ``B`` of the calls it serves.
        prompt_length: the prompt length it was built for.
        padded_length: the padded prompt slots (the bucket), or with ``max_cache_len`` the
            token buffer's slots, which every prompt length shares.
        seconds: the time spent tracing, lowering and compiling; near 0 when an earlier entry
            (or an earlier call) already built the same program.
        compiled: the ``jax.stages.Compiled`` program: ``as_text()``, ``memory_analysis()``,
            ``cost_analysis()``.
        run_seconds: with ``run_once=True``, the time of the dummy run; None otherwise.
    """

    batch: int
    prompt_length: int
    padded_length: int
    seconds: float
    compiled: jax.stages.Compiled
    run_seconds: float | None = None


def warmup(
    model,
    params: PyTree,
    config: GenerationConfig | None = None,
    batch_sizes: Sequence[int] = (1,),
    prompt_lengths: Sequence[int] = (16,),
    *,
    key: jax.Array | None = None,
    prompt_buckets=None,
    run_once: bool = False,
    **generate_kwargs,
) -> list[WarmupEntry]:
    """Compiles ahead of time the programs ``generate`` will run, so its first call compiles
    nothing.

    For each batch size and prompt length, it plans a call on a batch of zeros exactly as
    ``genjax.generate`` does (:func:`genjax.generation.plan.prepare`, with the same config and
    keyword arguments), then lowers and compiles that plan's program
    (``jax.jit(...).lower(...).compile()``, which fills the cache ``generate`` looks in); it
    runs nothing unless ``run_once``. Prompt lengths in one bucket share a program, and with
    ``max_cache_len`` every prompt length and ``max_new_tokens`` share one per batch size, so
    the later entries cost nearly nothing. For an encoder-decoder model the prompt lengths are
    the source's, and ``max_cache_len`` counts the decoder's prefix and new tokens only. Pass
    the same config, ``prompt_buckets`` and keyword arguments (``mesh``, ``logits_processor``...)
    that the real calls will use: anything static that differs compiles a new program at the
    call.

    With ``run_once=True`` the compiled program also runs once, on a batch of zeros, so the
    one-off work of a program's first execution (on CPU, building XLA's matrix-product
    runtimes: seconds for a 135M model) is done before the first real call too. A bucketed
    program runs the config's ``max_new_tokens`` (a full generation: its length is static); a
    ``max_cache_len`` program runs 2 new tokens, enough to run the decoding loop's body, since
    its length is traced.

    Static or traced: the values of traced config fields (temperature, top_p, EOS ids...) and
    of the key do not matter; their presence does (a config with ``temperature=1.0`` compiles
    no temperature processor). The params' shapes, dtypes and shardings matter, not their
    values.

    Args:
        model: the model (static).
        params: its parameters (only their shapes, dtypes and shardings are used).
        config: the generation config of the real calls; None means ``GenerationConfig()``.
        batch_sizes: the batch sizes ``B`` to compile for (ints >= 1).
        prompt_lengths: the prompt lengths ``P`` to compile for (ints >= 1), e.g. the bucket
            lengths themselves.
        key: a PRNG key like the calls' (any typed key works; one is made when sampling).
        prompt_buckets: the bucket policy of the calls (see :mod:`genjax.buckets`).
        run_once: also run each program once (see above); False only compiles.
        **generate_kwargs: the other keyword arguments of the calls, including config
            overrides such as ``max_new_tokens=`` or ``max_cache_len=``. ``attention_mask``,
            ``input_ids`` and ``streamer`` are not accepted.

    Returns:
        One :class:`WarmupEntry` per (batch size, prompt length), in that order.

    Raises:
        InputError: a batch size or prompt length that is not an int >= 1, or arguments
            ``generate`` rejects (e.g. ``P + N > max_cache_len``).
        UnsupportedError: ``streamer=`` (a streamed call compiles its program the first time).

    Example:
        >>> report = genjax.warmup(model, params, config, batch_sizes=(2,), prompt_lengths=(3,))
        >>> [(e.batch, e.prompt_length, e.padded_length) for e in report]
        [(2, 3, 16)]
        >>> out = genjax.generate(model, params, ids, config, attention_mask=mask)  # no compile
    """
    if not isinstance(run_once, bool):
        raise InputError(f"warmup() needs run_once to be True or False; got {run_once!r}.")
    batch_sizes = _positive_ints("batch_sizes", batch_sizes)
    prompt_lengths = _positive_ints("prompt_lengths", prompt_lengths)
    for name in ("input_ids", "attention_mask", "streamer"):
        if name in generate_kwargs:
            raise (UnsupportedError if name == "streamer" else InputError)(
                f"warmup() got {name}=, which it makes itself (or, for a streamer, cannot "
                f"compile ahead of time: a streamed call compiles its program the first time). "
                f"Drop {name}= from the warm-up."
            )
    config = effective_config(config, {}, getattr(model, "generation_config", None))
    fixed = generate_kwargs.get("max_cache_len", config.max_cache_len)
    buckets.resolve(prompt_buckets)  # a bad policy fails before anything is traced
    if key is None:
        key = jax.random.key(0)
    entries = []
    for batch in batch_sizes:
        for length in prompt_lengths:
            kwargs = dict(generate_kwargs, key=key, prompt_buckets=prompt_buckets)
            wanted = kwargs.get("max_new_tokens", config.max_new_tokens)
            counted = _counted_length(model, length, kwargs)
            if fixed is not None and (wanted is None or counted + wanted > fixed):
                kwargs["max_new_tokens"] = max(fixed - counted, 1)  # traced: any N that fits
            call = _dummy_call(model, params, config, (batch, length), kwargs)
            start = time.perf_counter()
            compiled = lower_program(call).compile()
            seconds = time.perf_counter() - start
            run_seconds = None
            if run_once:
                if fixed is not None:  # its length is traced: 2 new tokens run the loop body
                    kwargs["max_new_tokens"] = min(2, fixed - counted)
                    call = _dummy_call(model, params, config, (batch, length), kwargs)
                start = time.perf_counter()
                jax.block_until_ready(compiled(*call.arguments()).sequences)
                run_seconds = time.perf_counter() - start
            padded = call.plan.width
            entries.append(WarmupEntry(batch, length, padded, seconds, compiled, run_seconds))
    return entries


def enable_compile_cache(
    path: str | os.PathLike,
    *,
    min_compile_time_secs: float = 1.0,
    min_entry_size_bytes: int = 0,
) -> Path:
    """Turns on JAX's persistent compilation cache in ``path``, for this whole process.

    Compiled programs that took at least ``min_compile_time_secs`` to build are written to
    ``path``; a later process (or this one, after its in-memory caches are gone) with the same
    directory, the same JAX/jaxlib version, backend and flags loads them instead of compiling.
    It wraps JAX's settings ``jax_compilation_cache_dir``,
    ``jax_persistent_cache_min_compile_time_secs`` and
    ``jax_persistent_cache_min_entry_size_bytes``, and resets JAX's cache state so that it
    takes effect even after something was already compiled.

    Programs with host callbacks (``streamer=``, ``max_time``) are not cached by JAX.

    Args:
        path: the cache directory (created if missing). It may be shared by several processes.
        min_compile_time_secs: only programs whose compilation took at least this long are
            written (JAX's default 1.0; 0 writes every program).
        min_entry_size_bytes: only entries at least this large are written (0: all).

    Returns:
        The cache directory, as an absolute path.

    Raises:
        InputError: a negative threshold, or a path that exists and is not a directory.

    Example:
        >>> import tempfile
        >>> genjax.enable_compile_cache(tempfile.mkdtemp()).is_dir()
        True
        >>> genjax.disable_compile_cache()
    """
    if min_compile_time_secs < 0 or min_entry_size_bytes < 0:
        raise InputError(
            f"enable_compile_cache thresholds must be >= 0; got min_compile_time_secs="
            f"{min_compile_time_secs!r}, min_entry_size_bytes={min_entry_size_bytes!r}."
        )
    path = Path(path).expanduser().absolute()
    if path.exists() and not path.is_dir():
        raise InputError(
            f"enable_compile_cache(path) needs a directory; {str(path)!r} is a file. Pass a "
            f"directory path (it is created if missing)."
        )
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_time_secs))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", int(min_entry_size_bytes))
    compilation_cache.reset_cache()  # JAX decides once per process whether the cache is on
    return path


def disable_compile_cache() -> None:
    """Turns the persistent compilation cache off again (the files stay on disk)."""
    jax.config.update("jax_compilation_cache_dir", None)
    compilation_cache.reset_cache()


def _counted_length(model, length: int, kwargs) -> int:
    """The tokens before the new ones that ``max_cache_len`` counts: the prompt's ``length``,
    or an encoder-decoder model's decoder prefix (the start token and any
    ``decoder_input_ids``), not its source."""
    if not is_encoder_decoder(model):
        return length
    forced = kwargs.get("decoder_input_ids")
    return 1 + (0 if forced is None else np.shape(forced)[1])


def _dummy_call(model, params, config, shape, kwargs) -> PreparedCall:
    """The prepared ``generate`` call on a batch of zeros of ``shape`` (int32[B, P]) with every
    slot attended; ``kwargs`` are ``generate``'s keyword arguments."""
    ids = np.zeros(shape, np.int32)
    request = CallRequest.of(attention_mask=np.ones(shape, np.int32), **kwargs)
    return prepare(model, params, ids, config, request)


def _positive_ints(name: str, values) -> tuple[int, ...]:
    """``values`` as a tuple of ints >= 1, or an InputError naming the argument ``name``."""
    if isinstance(values, int):
        values = (values,)
    values = tuple(values)
    bad = [v for v in values if not isinstance(v, (int, np.integer)) or v < 1]
    if not values or bad:
        raise InputError(
            f"warmup() needs {name} to be one or more ints >= 1; got {list(values)!r}. E.g. "
            f"{name}=(1, 8)."
        )
    return tuple(int(v) for v in values)
