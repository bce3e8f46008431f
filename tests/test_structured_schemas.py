"""Thirty JSON schemas, sampled at batch 8 with a different schema per row on the bundled model:
every output ends, parses with ``json`` and validates with ``jsonschema``.

Marked ``slow`` (run with ``-m slow``): 30 automata and four constrained ``generate`` calls of
160 tokens, each with its own table size, take about a minute on two cores. Strings and arrays
are bounded (``maxLength``, ``maxItems``, enums, patterns) so that every row can end within the
token budget, and numbers through outlines-core's digit-count keywords (``maxDigits`` for
integers, ``min/maxDigitsInteger``, ``...Fraction``, ``...Exponent`` for numbers; other
validators ignore them): unbounded, the bundled model samples digits for hundreds of tokens."""

import json

import jax
import jsonschema
import pytest

import genjax
from genjax import GenerationConfig, constraints

pytestmark = pytest.mark.slow

BATCH = 8
SAMPLING = GenerationConfig(
    max_new_tokens=160,
    do_sample=True,
    temperature=0.7,
    top_k=50,
    eos_token_id=0,
    pad_token_id=0,
)


def _object(properties: dict, required=None) -> dict:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
    }


NAME = {"type": "string", "maxLength": 8}
SHORT = {"type": "string", "maxLength": 4}
INTEGER = {"type": "integer", "maxDigits": 4}
NUMBER = {
    "type": "number",
    "maxDigitsInteger": 3,
    "minDigitsFraction": 1,  # the default 0 would admit "1." (not JSON)
    "maxDigitsFraction": 3,
    "minDigitsExponent": 1,
    "maxDigitsExponent": 2,
}

SCHEMAS = [
    # flat objects of each type
    _object({"name": NAME}),
    _object({"count": INTEGER}),
    _object({"ratio": NUMBER}),
    _object({"ok": {"type": "boolean"}}),
    _object({"nothing": {"type": "null"}}),
    _object({"name": NAME, "age": INTEGER, "admin": {"type": "boolean"}}),
    # required and optional fields
    _object({"id": INTEGER, "note": SHORT}, required=["id"]),
    _object({"a": SHORT, "b": SHORT, "c": SHORT}, required=["b"]),
    _object({"x": INTEGER, "y": INTEGER}, required=[]),
    # enums and constants
    _object({"color": {"enum": ["red", "green", "blue"]}}),
    _object({"size": {"type": "string", "enum": ["S", "M", "L", "XL"]}, "qty": {"enum": [1, 2]}}),
    _object({"version": {"const": 2}, "kind": {"const": "point"}}),
    _object({"answer": {"enum": ["yes", "no", None, True]}}),
    # string patterns and lengths
    _object({"code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"}}),
    _object({"zip": {"type": "string", "pattern": "^[0-9]{5}$"}, "city": NAME}),
    _object({"tag": {"type": "string", "minLength": 2, "maxLength": 5}}),
    _object({"hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}}),
    # arrays with bounds
    _object({"xs": {"type": "array", "items": INTEGER, "minItems": 1, "maxItems": 3}}),
    _object({"tags": {"type": "array", "items": SHORT, "maxItems": 2}}),
    _object(
        {"flags": {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 2}}
    ),
    {"type": "array", "items": INTEGER, "minItems": 1, "maxItems": 4},
    {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    # nesting
    _object({"user": _object({"name": NAME, "active": {"type": "boolean"}})}),
    _object({"point": _object({"x": NUMBER, "y": NUMBER})}),
    _object({"a": _object({"b": _object({"c": INTEGER})})}),
    _object({"items": {"type": "array", "items": _object({"id": INTEGER}), "maxItems": 2}}),
    _object({"meta": _object({"tags": {"type": "array", "items": SHORT, "maxItems": 2}})}),
    # unions
    _object({"value": {"anyOf": [INTEGER, {"type": "boolean"}]}}),
    _object({"id": {"oneOf": [INTEGER, SHORT]}}),
    # a top-level scalar
    {"type": "string", "enum": ["alpha", "beta", "gamma"]},
]


@pytest.fixture(scope="module")
def bundled():
    path = genjax.io.bundled.path()
    model, params = genjax.models.from_pretrained(path)
    model = model.with_generation_config(None)  # the test's sampling config alone
    return model, params, genjax.tokenizer.from_pretrained(path)


def test_thirty_schemas_sampled_at_batch_8_parse_and_validate(bundled):
    model, params, tok = bundled
    assert len(SCHEMAS) == 30
    schemas = SCHEMAS + SCHEMAS[: -len(SCHEMAS) % BATCH]  # 32 rows: four batches of 8
    automata = [constraints.json_schema(schema, tok) for schema in schemas]
    prompts = tok(["{", "The JSON:", "data =", "# result"] * 2)
    ids, mask = prompts["input_ids"], prompts["attention_mask"]
    width = ids.shape[1]
    for start in range(0, len(schemas), BATCH):
        rows = slice(start, start + BATCH)
        out = genjax.generate(
            model,
            params,
            ids,
            SAMPLING,
            attention_mask=mask,
            key=jax.random.key(start),
            constraint=automata[rows],
        )
        for schema, new in zip(schemas[rows], out.sequences[:, width:].tolist(), strict=True):
            assert 0 in new, (schema, tok.decode(new))  # ended within the budget
            text = tok.decode(new[: new.index(0)])
            jsonschema.validate(json.loads(text), schema)
