"""The last check before a constrained answer leaves: is it valid under the caller's schema?

The grammar makes a schema-invalid document impossible by construction (``decoding/
schema_normalize.py`` and xgrammar); every response that claims completion is validated
with ``jsonschema`` against the caller's original schema all the same, so a bug anywhere
on that path is a loud error (the server answers 500 and logs a bug report), never a
silently invalid answer. ``format`` is an annotation here, as the JSON Schema spec has it
(2019-09 on); the grammar enforces the formats xgrammar knows. Nothing is fetched: a
reference that leaves the schema reads as a schema nothing satisfies, as the grammar treats
it (``decoding/schema_rewrites.py``), so a document validates only if it never needed it.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
from referencing import Registry

from specrag.decoding.schema_normalize import replace_external_refs


class SchemaViolation(ValueError):
    """A document that does not validate against the schema it was constrained by."""

    def __init__(self, pointer: str, message: str) -> None:
        super().__init__(f"{message} (at {pointer})")
        self.pointer = pointer
        self.message = message


def _never_fetch(uri: str) -> Any:
    raise LookupError(f"{uri!r} is not fetched")  # unreachable: external refs are replaced first


_OFFLINE = Registry(retrieve=_never_fetch)  # type: ignore[call-arg]
_NOTHING = {"not": {}}


def validate_value(value: Any, schema: dict[str, Any]) -> None:
    """Raise SchemaViolation for the first error (its JSON pointer in the document)."""
    validator_class = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    validator = validator_class(replace_external_refs(schema, _NOTHING), registry=_OFFLINE)
    error = jsonschema.exceptions.best_match(validator.iter_errors(value))
    if error is not None:
        pointer = "#" + "".join(f"/{part}" for part in error.absolute_path)
        raise SchemaViolation(pointer, error.message)


def validate_json_text(text: str, schema: dict[str, Any]) -> Any:
    """Parse ``text`` as one JSON document and validate it; returns the value."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise SchemaViolation("#", f"not a JSON document: {error}") from None
    validate_value(value, schema)
    return value
