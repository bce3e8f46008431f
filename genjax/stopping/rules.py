"""The stopping rules as pure functions of the token buffer (see :mod:`genjax.stopping`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.experimental import io_callback

from genjax.stopping.stop_strings import StopStringTable, stop_string_hits
from genjax.typing import Array

StopCriterion = Callable[[Array, Array], Array]
"""``fn(tokens int32[B, S], length int32[]) -> bool[B]``: True where a row is done.

``tokens`` is the whole buffer: possibly some pad slots, the prompt, the tokens generated so far
(the newest at slot ``length - 1``), then pad. It must be pure and jittable, and hashable (it is
static: pass the same object to reuse a compiled program)."""

Clock = Callable[[], float]
"""A host clock: seconds as a float, never going backwards (``time.monotonic``)."""

MAX_TIME_CHECK_EVERY = 1
"""Default number of new tokens between two clock reads when ``max_time`` is set.

1 reads after every token, as transformers does, so a call ends within one step of its budget.
A read is a synchronous host callback, a fixed cost per read that the loop waits for: it slows
models whose steps take about a millisecond noticeably, and those whose steps take several
milliseconds or more by a few percent at most (``bench/max_time.py`` measures it; figures in
``bench/README.md``). A larger value reads less often and may overrun the budget by up to that
many steps. The value is read when a program is traced and is not part of the jit
cache key (call ``jax.clear_caches()`` after changing it); :func:`stopping_rules` takes it per
call as ``check_time_every``."""


# ----------------------------------------------------------------------------- EOS and max length


def is_eos(tokens: Array, eos_token_ids: Array | None) -> Array:
    """bool[B]: True where ``tokens`` (int32[B]) is one of ``eos_token_ids`` (int32[E]).

    With no EOS ids, nothing is EOS.

    Example:
        >>> is_eos(jnp.array([2, 5]), jnp.array([2, 3])).tolist()
        [True, False]
    """
    if eos_token_ids is None:
        return jnp.zeros(tokens.shape, bool)
    eos = jnp.atleast_1d(jnp.asarray(eos_token_ids, jnp.int32))
    return jnp.any(tokens[:, None] == eos[None, :], axis=-1)


def should_continue(length: Array, max_length: int, finished: Array) -> Array:
    """bool[]: keep decoding while the buffer has room and some row is unfinished.

    Args:
        length: int32[], slots of the buffer filled so far.
        max_length: the buffer length ``S`` (static).
        finished: bool[B], rows that are done.

    Example:
        >>> bool(should_continue(jnp.int32(5), 8, jnp.array([True, False])))
        True
    """
    return (length < max_length) & ~jnp.all(finished)


# ----------------------------------------------------------------------------- max time


def _now_host(clock: Clock) -> np.ndarray:
    """The clock as int32[2] (whole seconds, nanoseconds): exact, unlike one float32."""
    seconds, fraction = divmod(float(clock()), 1.0)
    return np.array([seconds, round(fraction * 1e9)], np.int32)


def _elapsed_host(clock: Clock, start: np.ndarray) -> np.ndarray:
    start = np.asarray(start, np.float64)
    return np.float32(float(clock()) - (start[0] + start[1] * 1e-9))


def read_clock(clock: Clock = time.monotonic) -> Array:
    """int32[2]: the host clock now (whole seconds, nanoseconds), read through a callback, so
    inside a jitted function it is read when the program runs, not when it is traced.

    Example:
        >>> start = read_clock()
    """
    shape = jax.ShapeDtypeStruct((2,), jnp.int32)
    return io_callback(lambda: _now_host(clock), shape)


def seconds_since(start: Array, clock: Clock = time.monotonic, after: Any = None) -> Array:
    """float32[]: host seconds elapsed since ``start`` (from :func:`read_clock`).

    Args:
        start: int32[2], from :func:`read_clock`.
        clock: the same clock as for ``start``.
        after: arrays the read must wait for (it is their consumer, so XLA cannot run it first).
    """
    shape = jax.ShapeDtypeStruct((), jnp.float32)
    return io_callback(lambda s, _: _elapsed_host(clock, s), shape, start, after)


# ----------------------------------------------------------------------------- all rules


@struct.dataclass
class StoppingRules:
    """Everything that decides when rows finish, fixed for a whole call.

    Build it with :func:`stopping_rules`; inside the compiled program call :func:`start_timer`
    before any work that should count against ``max_time``.
    """

    eos_token_ids: Array | None  # int32[E], or None when nothing is EOS
    stop_strings: StopStringTable | None  # tables of the stop strings, or None
    max_time: Array | None  # float32[] or float32[B]: seconds allowed, or None for no limit
    start_time: Array | None  # int32[2]: the clock when the call began (after start_timer)
    first_slot: Array  # int32[]: the buffer slot where the text begins (bucket padding before)
    criteria: tuple[StopCriterion, ...] = struct.field(pytree_node=False, default=())
    clock: Clock = struct.field(pytree_node=False, default=time.monotonic)
    check_time_every: int = struct.field(pytree_node=False, default=MAX_TIME_CHECK_EVERY)


def stopping_rules(
    eos_token_ids: Array | None = None,
    *,
    criteria: Sequence[StopCriterion] = (),
    stop_strings: StopStringTable | None = None,
    max_time: float | Array | None = None,
    first_slot: Array | int = 0,
    clock: Clock = time.monotonic,
    check_time_every: int | None = None,
) -> StoppingRules:
    """Collects the stopping rules of one call, checking the static ones.

    Args:
        eos_token_ids: int32[E] or an int (traced), or None.
        criteria: custom :data:`StopCriterion` functions (static; hashable).
        stop_strings: a table from :func:`stop_string_table`, or None.
        max_time: seconds (traced; a float or float32[B]), or None for no limit.
        first_slot: int32[] (traced), where the text begins in the buffer (see
            :func:`stop_string_hits`).
        clock: the host clock for ``max_time`` (static), ``time.monotonic`` by default; a test may
            pass a fake one.
        check_time_every: read the clock after every ``k``-th new token (static; the first token
            is always checked), so a call may run up to ``k - 1`` tokens past ``max_time``. None
            means :data:`MAX_TIME_CHECK_EVERY`.

    Raises:
        TypeError: a criterion that is not a hashable callable.
        ValueError: ``check_time_every < 1``.

    Example:
        >>> rules = stopping_rules(jnp.array([2]), criteria=[lambda t, n: t[:, n - 1] == 7])
    """
    criteria = as_criteria(criteria)
    if check_time_every is None:
        check_time_every = MAX_TIME_CHECK_EVERY
    if not isinstance(check_time_every, int) or check_time_every < 1:
        raise ValueError(f"check_time_every must be an int >= 1; got {check_time_every!r}.")
    eos = None if eos_token_ids is None else jnp.atleast_1d(jnp.asarray(eos_token_ids, jnp.int32))
    return StoppingRules(
        eos_token_ids=eos,
        stop_strings=stop_strings,
        max_time=None if max_time is None else jnp.asarray(max_time, jnp.float32),
        start_time=None,
        first_slot=jnp.asarray(first_slot, jnp.int32),
        criteria=criteria,
        clock=clock,
        check_time_every=check_time_every,
    )


def as_criteria(criteria: Sequence[StopCriterion] | StopCriterion) -> tuple[StopCriterion, ...]:
    """Checks custom criteria before tracing and returns them as a tuple (a static value).

    Raises:
        TypeError: an entry that is not callable, or not hashable.

    Example:
        >>> as_criteria([lambda tokens, length: tokens[:, length - 1] == 7])
        (<function <lambda> at 0x...>,)
    """
    if callable(criteria):
        criteria = (criteria,)
    elif isinstance(criteria, str) or not isinstance(criteria, Sequence | tuple):
        raise TypeError(
            f"stopping_criteria must be a list of functions fn(tokens, length) -> bool[B]; got "
            f"{type(criteria).__name__}."
        )
    criteria = tuple(criteria)
    for fn in criteria:
        _check_criterion(fn)
    return criteria


def _check_criterion(fn: Any) -> None:
    if any(cls.__name__ == "StoppingCriteria" for cls in type(fn).__mro__):
        raise TypeError(
            f"{type(fn).__name__} is a transformers StoppingCriteria, which runs torch code on "
            f"input_ids. genjax needs a jittable JAX function fn(tokens int32[B, S], length "
            f"int32[]) -> bool[B]; the newest token is tokens[:, length - 1]."
        )
    if not callable(fn):
        raise TypeError(
            f"stopping_criteria must hold functions fn(tokens int32[B, S], length int32[]) -> "
            f"bool[B]; got {type(fn).__name__} {fn!r}. Wrap it in such a function."
        )
    try:
        hash(fn)
    except TypeError:
        raise TypeError(
            f"stopping criterion {fn!r} is not hashable, but criteria are static (part of the "
            f"compiled program). Use a function or a frozen dataclass instead."
        ) from None


def start_timer(rules: StoppingRules, *operands: Any) -> tuple[StoppingRules, tuple]:
    """Reads the start time for ``max_time`` and ties ``operands`` to come after the read.

    Call it first thing in the compiled program and use the returned ``operands`` (e.g. the
    prompt) for the work that follows, so XLA cannot move that work before the clock read. With
    no ``max_time`` it changes nothing.

    Returns:
        (the rules with ``start_time`` set, the operands).

    Example:
        >>> rules = stopping_rules(jnp.array([2]), max_time=5.0)
        >>> rules, (input_ids,) = start_timer(rules, jnp.array([[5, 6]]))
        >>> rules.start_time is not None
        True
    """
    if rules.max_time is None:
        return rules, operands
    start, operands = jax.lax.optimization_barrier((read_clock(rules.clock), operands))
    return rules.replace(start_time=start), operands


def time_is_up(rules: StoppingRules, step: Array, after: Any) -> Array:
    """bool[] or bool[B]: whether ``max_time`` has passed, read after new-token index ``step``.

    The clock is read (a host callback) when ``step % check_time_every == 0`` and only after
    ``after`` is computed; transformers reads it after every token.

    Args:
        rules: with ``start_time`` set by :func:`start_timer`.
        step: int32[], index of the newest token among the new ones (0 for the first).
        after: arrays the clock read waits for (e.g. a scalar computed from the newest tokens;
            it is sent to the host, so keep it small and unsharded).
    """
    if rules.max_time is None:
        return jnp.zeros((), bool)
    if rules.start_time is None:
        raise ValueError("max_time is set but the timer was not started: call start_timer first.")

    def read(after):
        return seconds_since(rules.start_time, rules.clock, after)

    if rules.check_time_every == 1:
        elapsed = read(after)
    else:
        due = step % rules.check_time_every == 0
        elapsed = jax.lax.cond(due, read, lambda _: jnp.zeros((), jnp.float32), after)
    return elapsed > rules.max_time


def finished_rows(
    rules: StoppingRules, finished: Array, tokens: Array, length: Array, step: Array
) -> Array:
    """bool[B]: ``finished`` updated after the token at slot ``length - 1`` was written.

    A row is finished once any rule says so (transformers' ``StoppingCriteriaList``): EOS, a
    custom criterion, a stop string, or ``max_time`` (which finishes every row).

    Args:
        rules: the call's :class:`StoppingRules`.
        finished: bool[B], rows finished before this token.
        tokens: int32[B, S], the buffer with the newest token at ``length - 1``.
        length: int32[], slots filled.
        step: int32[], the newest token's index among the new tokens (0 for the first).

    Example:
        >>> rules = stopping_rules(jnp.array([2]))  # EOS id 2
        >>> tokens = jnp.array([[5, 2, 0], [5, 6, 0]])  # slot 1 was just written
        >>> done = jnp.array([False, False])
        >>> finished_rows(rules, done, tokens, jnp.int32(2), jnp.int32(0)).tolist()
        [True, False]
    """
    newest = jax.lax.dynamic_index_in_dim(tokens, length - 1, axis=1, keepdims=False)
    done = finished | is_eos(newest, rules.eos_token_ids)
    for fn in rules.criteria:
        done = done | _criterion_result(fn, tokens, length)
    if rules.stop_strings is not None:
        done = done | stop_string_hits(rules.stop_strings, tokens, length, rules.first_slot)
    # The clock read waits on a scalar of the newest tokens: one value, so no gather on a mesh.
    return done | time_is_up(rules, step, jnp.max(newest))


def _criterion_result(fn: StopCriterion, tokens: Array, length: Array) -> Array:
    result = jnp.asarray(fn(tokens, length))
    batch = tokens.shape[0]
    if result.dtype != jnp.bool_ or result.shape not in ((), (batch,)):
        raise TypeError(
            f"stopping criterion {fn!r} returned {result.dtype}{list(result.shape)}; it must "
            f"return bool[{batch}] (one flag per row) or a bool scalar. Compare, e.g. "
            f"tokens[:, length - 1] == 7."
        )
    return jnp.broadcast_to(result, (batch,))
