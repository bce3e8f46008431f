"""Structured output: regex / JSON-schema / choice constraints as token automata on the device.

A constraint is built once on the host by ``outlines-core`` (its ``Index`` over a ``Vocabulary``
read from the tokenizer; JSON schemas through its schema-to-regex builder) and becomes a table on
the device (:mod:`genjax.constraints.tables`: dense ``int32[S, V]`` next-state ids up to 64 MiB,
a bitmask plus CSR transitions beyond). ``genjax.generate(..., constraint=c)`` carries each
row's automaton state in the decoding loop: the allowed-token mask is one gather per step and the
next state another, so nothing leaves the device (:mod:`genjax.decoding.automaton`).

Builds are bounded: a pattern whose automaton would exceed ``max_states`` states or
``max_transitions`` transitions (keywords of every builder; defaults
:data:`~genjax.constraints.limits.MAX_STATES` and
:data:`~genjax.constraints.limits.MAX_TRANSITIONS`) raises InputError, most before
``outlines-core`` starts (:mod:`genjax.constraints.limits`).

Rules: the output matches the pattern in full; EOS is allowed only in accepting states (and a
row in a state whose only continuation is EOS therefore ends); a row whose every allowed token
was removed by another processor gets EOS. The constraint's EOS id must be one of the call's EOS
ids. Context-free grammars are not supported (:func:`grammar` raises UnsupportedError).

Example:
    >>> tok = genjax.tokenizer.from_pretrained(genjax.io.bundled.path())  # doctest: +SKIP
    >>> c = genjax.constraints.regex(r"\\d{3}-\\d{4}", tok)  # doctest: +SKIP
    >>> out = genjax.generate(model, params, ids, cfg, constraint=c)  # doctest: +SKIP

Works with greedy decoding, sampling (every warper applies after the mask), beam search (each
beam's state follows its beam), ``num_return_sequences``, ``max_cache_len``, streaming and
meshes; a list of constraints gives one per input row. Encoder-decoder models: the new
decoder tokens follow the constraint (not the decoder's start token or forced prefix).
Assisted generation raises UnsupportedError.

Layer:
    Floor 4. Imports :mod:`genjax.errors`, :mod:`genjax.typing`, :mod:`genjax.stopping` (the
    vocabulary's token texts) and implements :class:`genjax.decoding.automaton.TokenAutomaton`.

References:
    Willard & Louf 2023, "Efficient Guided Generation for Large Language Models",
    arXiv:2307.09702 (the regex-to-token-automaton index); ``outlines-core``.
"""

from genjax.constraints.automata import (
    Constraint,
    choice,
    grammar,
    json_object,
    json_schema,
    regex,
)
from genjax.constraints.limits import MAX_STATES, MAX_TRANSITIONS
from genjax.constraints.tables import (
    DENSE_LIMIT_BYTES,
    CompressedTable,
    DenseTable,
    device_automaton,
)

__all__ = [
    "DENSE_LIMIT_BYTES",
    "MAX_STATES",
    "MAX_TRANSITIONS",
    "CompressedTable",
    "Constraint",
    "DenseTable",
    "choice",
    "device_automaton",
    "grammar",
    "json_object",
    "json_schema",
    "regex",
]
