"""Stopping rules: when a row is finished, as pure functions of the token buffer.

transformers checks its ``StoppingCriteriaList`` after appending each new token, the first one
included, and a row is finished once any criterion says so. genjax does the same inside the
decoding loop, on the fixed token buffer ``tokens`` int32[B, S] whose slot ``length - 1`` holds the
newest token. The rules are:

* **Max length**: the buffer is full (:func:`should_continue`).
* **EOS**: the newest token is one of the EOS ids (:func:`is_eos`).
* **Custom criteria**: pure functions ``fn(tokens int32[B, S], length int32[]) -> bool[B]``, True
  where that row is done (:data:`StopCriterion`).
* **Stop strings**: a stop string ends within the newest token's text, found through tables
  built once on the host from the tokenizer's vocabulary (:func:`stop_string_table`,
  :func:`stop_string_hits`).
* **Max time**: the call has run longer than ``max_time`` seconds, read from the host clock
  through a callback inside the compiled loop (:func:`start_timer`, :func:`time_is_up`).

:class:`StoppingRules` carries all of them through a call; :func:`finished_rows` applies them.

Axes (besides those of :mod:`genjax.typing`): ``U`` rows of a stop-string table (token ids, then
one spare row), ``X`` stop strings, ``W`` the window of newest tokens a stop string can span,
``Q`` positions per token, ``O`` end overlaps per token, ``E`` EOS ids.

Static or traced:
    Static: which rules are present, the custom criteria (hashable callables), the number of stop
    strings and the shapes of their tables (``U``, ``X``, ``W``, ``Q``, ``O``), the clock and how
    often it is read. Traced: the EOS ids, the stop-string table values, ``max_time`` and the
    start time.

Differences from transformers:
    * Custom criteria see the fixed buffer and ``length`` rather than a growing ``input_ids``
      (and no scores); slots from ``length`` on hold pad, and genjax's bucket padding may come
      before the prompt.
    * ``max_time`` counts from the start of the compiled program (before the prefill, as
      transformers starts before its prefill), so input checks and compilation are not counted;
      the clock is ``time.monotonic``, not ``time.time``.
    * Besides a transformers tokenizer, stop strings accept a ``tokenizers.Tokenizer``, any
      object exposing one as ``backend_tokenizer`` (genjax's own :class:`genjax.tokenizer.
      Tokenizer`), read the same way, and a tokenizer with only ``get_vocab()``, whose tokens
      are taken as their text. A ``tokenizers.Tokenizer`` with no decoder but a ByteLevel
      pre-tokenizer is matched on bytes too.
    * A stop string no sequence of tokens can spell raises :class:`~genjax.errors.InputError`
      naming it (transformers raises only when no token can end any of the stop strings).

References:
    Hugging Face transformers' ``generation/stopping_criteria.py`` (``StopStringCriteria``,
    ``MaxTimeCriteria``, ``EosTokenCriteria``, ``StoppingCriteriaList``) defines the semantics.

Layer:
    Floor 2. Imports only :mod:`genjax.errors` and :mod:`genjax.typing`; ``rules`` holds the
    rules and ``stop_strings`` the stop-string tables.
"""

from genjax.stopping.rules import (
    MAX_TIME_CHECK_EVERY,
    Clock,
    StopCriterion,
    StoppingRules,
    as_criteria,
    finished_rows,
    is_eos,
    read_clock,
    seconds_since,
    should_continue,
    start_timer,
    stopping_rules,
    time_is_up,
)
from genjax.stopping.stop_strings import StopStringTable, stop_string_hits, stop_string_table

__all__ = [
    "MAX_TIME_CHECK_EVERY",
    "Clock",
    "StopCriterion",
    "StopStringTable",
    "StoppingRules",
    "as_criteria",
    "finished_rows",
    "is_eos",
    "read_clock",
    "seconds_since",
    "should_continue",
    "start_timer",
    "stop_string_hits",
    "stop_string_table",
    "stopping_rules",
    "time_is_up",
]
