"""Decoding loops: each runs one ``lax.while_loop`` over a model step function."""
