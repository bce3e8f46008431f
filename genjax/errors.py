"""The named exceptions genjax raises.

Each subclasses a built-in exception, so ordinary ``except ValueError`` clauses keep working.
Messages say what was expected, what was received, and how to fix it.
"""

from __future__ import annotations


class GenerationConfigError(ValueError):
    """A generation config field holds a value that is not allowed."""


class InputError(ValueError):
    """An array passed to ``generate`` (input ids, attention mask, key) is malformed."""


class UnsupportedError(NotImplementedError):
    """An option that genjax does not support yet, named in the message."""


class CheckpointError(ValueError):
    """A model checkpoint is missing, malformed, or of an unsupported kind."""


class ShardingError(ValueError):
    """A size does not divide over the mesh axis a sharding rule puts it on."""


class CacheMemoryError(InputError):
    """The KV cache a ``generate`` call would allocate does not fit in its devices' memory."""
