"""The processor type and small helpers shared by the logits processors (:mod:`genjax.processors`).

Token-id validation here runs in Python on the settings a processor is built from, before
anything is traced, and raises errors that name the setting, the value and the fix.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from genjax.typing import INT32_MAX, Array

NEG_INF = -jnp.inf


def per_row(value: Any) -> Array:
    """A scalar stays a scalar; a per-row value ``[B]`` becomes ``[B, 1]`` to broadcast on V."""
    value = jnp.asarray(value)
    return value[:, None] if value.ndim == 1 else value


def token_mask(token_ids: Any, vocab: int) -> Array:
    """bool[V]: True at each of ``token_ids`` (an id or a list of ids int[K]; may be traced)."""
    ids = jnp.atleast_1d(jnp.asarray(token_ids, jnp.int32))
    return jnp.any(jnp.arange(vocab)[:, None] == ids[None, :], axis=-1)


def row_token_mask(token_id: Any, vocab: int) -> Array:
    """bool[V] for one id, or bool[B, V] for one id per row int[B]."""
    ids = jnp.asarray(token_id, jnp.int32)
    if ids.ndim == 1:
        return jnp.arange(vocab)[None, :] == ids[:, None]
    return jnp.arange(vocab) == ids


def is_concrete(value: Any) -> bool:
    """False for tracers (and containers holding one): their values cannot be checked."""
    return not any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree_util.tree_leaves(value))


def _is_id(value: Any) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool) and value >= 0


def check_id_list(name: str, ids: Any, *, allow_empty: bool = True) -> tuple[int, ...]:
    """Returns ``ids`` as a tuple of ints after checking it is a flat list of ids >= 0.

    Raises:
        ValueError: naming ``name``, the value and the expected form.
    """
    if isinstance(ids, np.ndarray) and ids.ndim == 1:
        ids = ids.tolist()
    if not isinstance(ids, Sequence) or isinstance(ids, str) or not all(_is_id(i) for i in ids):
        raise ValueError(
            f"{name}={ids!r} is invalid: expected a flat list of token ids (ints >= 0), e.g. "
            f"[5, 17]. Pass the ids your tokenizer gives."
        )
    if not allow_empty and not ids:
        raise ValueError(f"{name}=[] is invalid: it needs at least one token id, e.g. [5].")
    return tuple(int(i) for i in ids)


def check_id_lists(name: str, lists: Any) -> tuple[tuple[int, ...], ...]:
    """Returns a non-empty list of non-empty id lists as tuples, or raises naming ``name``."""
    example = "[[5], [6, 7]]"
    if isinstance(lists, np.ndarray):
        lists = lists.tolist()
    if not isinstance(lists, Sequence) or isinstance(lists, str) or not lists:
        raise ValueError(
            f"{name}={lists!r} is invalid: expected a non-empty list of token-id lists, e.g. "
            f"{example}."
        )
    out = []
    for i, ids in enumerate(lists):
        if _is_id(ids):
            raise ValueError(
                f"{name}={lists!r} is invalid: entry {i} is the bare id {ids}, but each entry "
                f"must be a list of ids (one token sequence), e.g. {example}; wrap it as [{ids}]."
            )
        out.append(check_id_list(f"{name}[{i}]", ids, allow_empty=False))
    return tuple(out)


def check_vocab(name: str, ids: Sequence[int], vocab_size: int | None) -> None:
    """Raises ValueError when an id in ``ids`` is outside ``[0, vocab_size)``."""
    if vocab_size is None:
        return
    bad = sorted({i for i in ids if i >= vocab_size})
    if bad:
        raise ValueError(
            f"{name} holds token ids {bad} outside the vocabulary [0, {vocab_size - 1}] "
            f"(vocab_size={vocab_size}). Use ids from the model's own tokenizer."
        )


@struct.dataclass
class LogitsContext:
    """What a processor may look at besides the scores: the token buffer and its bookkeeping.

    The buffer holds, per row, optional extra left padding added by genjax (``offset`` slots,
    e.g. to reach a prompt-length bucket), then the ``input_ids`` the user gave (themselves
    possibly left-padded), then generated tokens. Transformers' processors see
    ``tokens[:, offset:length]`` as their ``input_ids``::

        slot     0   1   2   3   4   5   6   7   8
        row 0    .   .   p   a   b   c   x   y   _      offset = 2 (genjax padding)
        row 1    .   .   d   e   f   g   z   w   _      prompt_end = 6, length = 8
                         |<- user input_ids ->|  new     first_valid = [3, 2]

    Here transformers' prompt length (``input_ids_seq_length``) is ``prompt_end - offset = 4``,
    its current length ``length - offset = 6``, and its ``max_length`` ``S - offset = 7`` unless
    ``max_length`` says otherwise.
    """

    tokens: Array  # int32[B, S]: the token buffer
    length: Array  # int32[]: slots filled so far; the next token goes to slot `length`
    offset: Array  # int32[]: slots of genjax padding before the user's input_ids
    prompt_end: Array  # int32[]: the slot where new tokens start
    first_valid: Array  # int32[B]: each row's first slot holding a real (unpadded) token
    max_length: Array | None = None  # int32[] or None: transformers' max_length; None: S - offset
    # int32[B, Se] or None: an encoder-decoder model's source ids, one row per decoder row (-1 in
    # slots genjax padded), the "encoder input" of the encoder_* processors; None: the prompt.
    encoder_tokens: Array | None = None

    @classmethod
    def for_prompt(
        cls,
        input_ids: Array,
        attention_mask: Array | None = None,
        max_length: int | Array | None = None,
    ) -> LogitsContext:
        """Returns the context before the first new token, for ``input_ids`` int32[B, P].

        ``max_length`` is transformers' ``max_length`` (prompt plus new tokens), used only by
        :func:`forced_eos_token_id`; None means ``P``.
        """
        batch, prompt_length = input_ids.shape
        if attention_mask is None:
            first_valid = jnp.zeros((batch,), jnp.int32)
        else:
            first_valid = jnp.argmax(attention_mask != 0, axis=-1).astype(jnp.int32)
        return cls(
            tokens=jnp.asarray(input_ids, jnp.int32),
            length=jnp.asarray(prompt_length, jnp.int32),
            offset=jnp.zeros((), jnp.int32),
            prompt_end=jnp.asarray(prompt_length, jnp.int32),
            first_valid=first_valid,
            max_length=None if max_length is None else jnp.asarray(max_length, jnp.int32),
        )

    @property
    def input_length(self) -> Array:
        """int32[]: the length of transformers' ``input_ids`` (user prompt plus new tokens)."""
        return self.length - self.offset

    @property
    def prompt_length(self) -> Array:
        """int32[]: transformers' ``input_ids_seq_length``: the user's prompt, padding included."""
        return self.prompt_end - self.offset

    @property
    def max_input_length(self) -> Array:
        """int32[]: transformers' ``max_length``, the longest ``input_ids`` of the call."""
        if self.max_length is not None:
            return jnp.asarray(self.max_length, jnp.int32)
        return self.tokens.shape[1] - self.offset

    @property
    def num_new_tokens(self) -> Array:
        """int32[]: tokens generated so far."""
        return self.length - self.prompt_end


Processor = Callable[[Array, LogitsContext], Array]
"""Any ``fn(scores float32[B, V], context) -> float32[B, V]``; genjax's own are :class:`Transform`
pytrees (and :class:`~genjax.processors.SortedFilter`, ``chain``), so they can be traced."""


@jax.tree_util.register_pytree_node_class
class Transform:
    """A processor as a pytree: ``rule(scores, context, **values, **settings)``.

    ``values`` (strengths, cut-offs, token ids: arrays, numbers or None) are the pytree's leaves,
    so they are traced when the processor is passed to a jitted function; ``rule`` (a
    module-level function) and ``settings`` (hashable) form its structure, which is static. Two
    transforms made by the same factory with the same settings therefore share one compiled
    program whatever their values: ``temperature(0.5)`` and ``temperature(0.7)`` have the same
    tree structure.

    Example:
        >>> import jax
        >>> from genjax import processors
        >>> t5, t7 = processors.temperature(0.5), processors.temperature(0.7)
        >>> jax.tree.structure(t5) == jax.tree.structure(t7)
        True
    """

    __slots__ = ("rule", "settings", "values")

    def __init__(
        self,
        rule: Callable[..., Array],
        values: Mapping[str, Any] | None = None,
        settings: Mapping[str, Any] | None = None,
    ):
        self.rule = rule
        self.values = dict(values or {})
        self.settings = tuple(sorted((settings or {}).items()))

    def run(self, *args: Any) -> Any:
        """``rule(*args, **values, **settings)``."""
        return self.rule(*args, **self.values, **dict(self.settings))

    def __call__(self, scores: Array, context: LogitsContext | None = None) -> Array:
        return self.run(scores, context)

    def tree_flatten(self):
        return (self.values,), (self.rule, self.settings)

    @classmethod
    def tree_unflatten(cls, aux, children):
        out = object.__new__(cls)
        out.rule, out.settings = aux
        out.values = children[0]
        return out

    def __repr__(self) -> str:
        name = getattr(self.rule, "__name__", repr(self.rule)).lstrip("_")
        args = [f"{k}={v!r}" for k, v in (*self.values.items(), *self.settings)]
        return f"{name}({', '.join(args)})"


def as_float(value: Any) -> Array:
    """float32 (scalar or [B]) for a traced strength, so Python ints and floats share a program."""
    return jnp.asarray(value, jnp.float32)


def as_int(value: Any) -> Array | None:
    """int32 (scalar or [K]) for traced ids or counts; None stays None."""
    return None if value is None else jnp.asarray(value, jnp.int32)


def as_count(value: Any) -> Array:
    """int32 for a traced count or threshold (top-k's ``k``, a minimum length, where a penalty
    starts): a Python or NumPy value past int32 is held as int32's largest, which no length or
    vocabulary reaches, so the rule reads the same."""
    if isinstance(value, int | np.integer | list | tuple | np.ndarray):
        value = np.minimum(np.asarray(value, np.int64), INT32_MAX)
    return jnp.asarray(value, jnp.int32)
