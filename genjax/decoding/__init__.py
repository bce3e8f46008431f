"""Decoding loops: each runs one ``lax.while_loop`` over a model step function.

``sampling`` (greedy and multinomial sampling), ``beam`` (beam search and beam sampling) and
``assisted`` (speculative decoding and prompt lookup) take a step callable
``(params, tokens, positions, cache, mask) -> (logits, cache)`` and a processor chain, so tests
drive them with fake logits; ``automaton`` is the hook through which structured output masks
tokens. The loops know nothing about a particular model or checkpoint.

Layer:
    Floor 3. Imports :mod:`genjax.cache`, :mod:`genjax.config`, :mod:`genjax.processors`,
    :mod:`genjax.stopping`, :mod:`genjax.errors` and :mod:`genjax.typing`; never
    :mod:`genjax.models` or anything above.

Static or traced:
    Static: loop lengths (``N``), ``num_beams``, the processor chain's structure, output flags.
    Traced: the carry (tokens, cache, lengths, finished rows, scores), the PRNG key, every
    processor value, the automaton's table and states.
"""
