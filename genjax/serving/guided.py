"""Structured output in ``genjax serve``: a request's ``response_format`` or vLLM's ``guided_*``
fields turned into a :class:`genjax.constraints.Constraint` for the engine.

Fields (one per request; two or more are a 400 naming them):

* ``response_format``: ``{"type": "text"}`` (no constraint), ``{"type": "json_object"}`` (any
  JSON object: :func:`genjax.constraints.json_object`), ``{"type": "json_schema",
  "json_schema": {"name": ..., "schema": {...}}}`` (OpenAI's shape; ``strict`` and
  ``description`` are accepted, and the output always follows the schema).
* ``guided_json``: a JSON schema (an object, or a JSON string of one); ``guided_regex``: a
  regular expression the whole output matches; ``guided_choice``: a list of strings, the output
  being one of them (vLLM's names and meanings).

An invalid schema or pattern, or an automaton larger than the engine's constraint pool, is a 400
naming the field. The pool's sizes bound the build itself: a pattern whose automaton would not
fit (``(a|b)*a(a|b){20}``, ``maxLength: 100000``) is refused by
:mod:`genjax.constraints.limits` before outlines-core starts, in well under a second. Building an
admitted automaton can take seconds (a JSON schema over a large vocabulary; outlines-core's
native build cannot be interrupted, but it releases the GIL), so it runs in a worker thread,
never on the event loop; built ones are kept in memory per (kind, pattern, EOS id), the last 64.

The constraint's EOS id is the tokenizer's when that is one of the request's EOS ids, else the
request's first; a request with no EOS id gets the tokenizer's, so that a row ends where the
automaton accepts.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import threading
from typing import Any

import numpy as np

from genjax import constraints
from genjax.config import GenerationConfig
from genjax.errors import InputError, UnsupportedError
from genjax.serving.constraint_pool import check_constraint
from genjax.serving.protocol import APIError, invalid

__all__ = ["ConstraintCache", "GuidedSpec", "constraint_eos", "guided_spec"]

_CACHE_SIZE = 64


@dataclasses.dataclass(frozen=True)
class GuidedSpec:
    """What a request asks its output to follow."""

    param: str  # the request field that asked it (named in errors)
    kind: str  # "regex", "json_schema", "json_object" or "choice"
    pattern: str  # the regex, the schema as canonical JSON, or the choices as a JSON list


def guided_spec(request: Any) -> GuidedSpec | None:
    """The request's structured-output field, checked; None when it has none.

    Raises:
        APIError: 400 naming the fields when more than one is set, or naming the field whose
            value is malformed.

    Example:
        >>> from genjax.serving.protocol import CompletionRequest, parse_request
        >>> body = {"model": "m", "prompt": "Hi", "guided_choice": ["yes", "no"]}
        >>> guided_spec(parse_request(CompletionRequest, body))
        GuidedSpec(param='guided_choice', kind='choice', pattern='["yes", "no"]')
    """
    given = []
    response_format = request.response_format
    if response_format is not None and response_format.type != "json_schema":
        if response_format.json_schema is not None:  # OpenAI reads it only with json_schema
            raise invalid(
                "response_format",
                f'response_format of type "{response_format.type}" takes no "json_schema"; '
                'for output that follows the schema set "type": "json_schema".',
            )
    if response_format is not None and response_format.type == "json_object":
        given.append(GuidedSpec("response_format", "json_object", ""))
    elif response_format is not None and response_format.type == "json_schema":
        named = response_format.json_schema
        if named is None or named.schema_ is None:
            raise invalid(
                "response_format",
                'response_format of type "json_schema" needs "json_schema": {"name": ..., '
                '"schema": {...}}.',
            )
        given.append(GuidedSpec("response_format", "json_schema", _canonical(named.schema_)))
    if request.guided_json is not None:
        schema = request.guided_json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as error:
                raise invalid("guided_json", f"guided_json is not valid JSON: {error}.") from None
        given.append(GuidedSpec("guided_json", "json_schema", _canonical(schema)))
    if request.guided_regex is not None:
        given.append(GuidedSpec("guided_regex", "regex", request.guided_regex))
    if request.guided_choice is not None:
        choices = request.guided_choice
        if not choices or not all(choices):
            raise invalid("guided_choice", "guided_choice must be a list of non-empty strings.")
        given.append(GuidedSpec("guided_choice", "choice", json.dumps(choices)))
    if len(given) > 1:
        names = ", ".join(g.param for g in given)
        raise APIError(
            400,
            f"a request may set one of response_format (json_object or json_schema), "
            f"guided_json, guided_regex and guided_choice; this one sets {names}.",
            param=names,
            code="conflicting_fields",
        )
    return given[0] if given else None


def _canonical(schema: Any) -> str:
    return json.dumps(schema, sort_keys=True, separators=(",", ":"))


def constraint_eos(config: GenerationConfig, tokenizer: Any) -> tuple[int | None, GenerationConfig]:
    """The EOS id a request's constraint allows in accepting states, and the request's config
    (with that id as its EOS when it had none): see the module docstring.

    Example:
        >>> from types import SimpleNamespace
        >>> tokenizer = SimpleNamespace(eos_token_id=7)
        >>> constraint_eos(GenerationConfig(eos_token_id=[2, 7]), tokenizer)[0]
        7
    """
    ids = config.eos_token_id
    ids = [] if ids is None else [int(i) for i in np.atleast_1d(np.asarray(ids)).tolist()]
    own = getattr(tokenizer, "eos_token_id", None)
    if not ids:
        return own, config if own is None else config.replace(eos_token_id=own)
    return (own if own in ids else ids[0]), config


class ConstraintCache:
    """Builds and keeps the constraints of requests (thread-safe; call :meth:`build` from a
    worker thread).

    Args:
        tokenizer: the server's tokenizer (the automata are over its vocabulary).
        manager: the engine (its constraint pool's sizes and the model's vocabulary).
    """

    def __init__(self, tokenizer: Any, manager: Any):
        self.tokenizer, self.manager = tokenizer, manager
        self._lock = threading.Lock()
        self._built: collections.OrderedDict[tuple, constraints.Constraint] = (
            collections.OrderedDict()
        )

    def build(self, spec: GuidedSpec, eos: int | None) -> constraints.Constraint:
        """The constraint of ``spec`` with EOS id ``eos``, checked against the engine.

        Raises:
            APIError: 400 naming ``spec.param``: an invalid schema or pattern, one that admits
                no output, or an automaton the engine's pool cannot hold.
        """
        key = (spec.kind, spec.pattern, eos)
        with self._lock:
            found = self._built.get(key)
            if found is not None:
                self._built.move_to_end(key)
        try:
            constraint = found or self._new(spec, eos)
            shape = self.manager.shape
            check_constraint(
                constraint,
                shape.constraint_states,
                shape.constraint_edges,
                self.manager.model.vocab_size,
                [] if eos is None else [eos],
            )
        except (InputError, UnsupportedError) as error:
            raise invalid(spec.param, f"{spec.param}: {error}") from None
        with self._lock:
            self._built[key] = constraint
            if len(self._built) > _CACHE_SIZE:
                self._built.popitem(last=False)
        return constraint

    def _new(self, spec: GuidedSpec, eos: int | None) -> constraints.Constraint:
        """Builds ``spec``'s automaton bounded by the pool's sizes, so that one the pool cannot
        hold is refused before outlines-core builds it (:mod:`genjax.constraints.limits`)."""
        tok, shape = self.tokenizer, self.manager.shape
        bounds = {"eos_token_id": eos}
        if shape.constraint_states > 1:  # else check_constraint says the engine has no pool
            bounds.update(
                max_states=shape.constraint_states - 1, max_transitions=shape.constraint_edges
            )
        if spec.kind == "regex":
            return constraints.regex(spec.pattern, tok, **bounds)
        if spec.kind == "choice":
            return constraints.choice(json.loads(spec.pattern), tok, **bounds)
        if spec.kind == "json_object":
            return constraints.json_object(tok, **bounds)
        return constraints.json_schema(spec.pattern, tok, **bounds)
