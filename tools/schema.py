"""From a typed Python function to a description and a pydantic arguments model.

Descriptions come from the docstring (Google, NumPy or reST, detected by
``docstring-parser``); the JSON schema comes from the type hints through pydantic, so
Literal, Enum, Optional, defaults, nested models, lists and ``Annotated[..., Field(...)]``
constraints all work as they do in pydantic itself.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable
from typing import Annotated, Any

import docstring_parser
import pydantic
from pydantic import BaseModel, ConfigDict, Field


class ToolDefinitionError(TypeError):
    """A function cannot become a tool (names the function and the parameter)."""


def describe(function: Callable[..., Any]) -> tuple[str, dict[str, str]]:
    """(tool description, {argument: description}) from the function's docstring."""
    parsed = docstring_parser.parse(inspect.getdoc(function) or "")
    parts = [part.strip() for part in (parsed.short_description, parsed.long_description) if part]
    arguments = {param.arg_name: " ".join(param.description.split()) for param in parsed.params if param.description}
    return "\n\n".join(parts), arguments


def arguments_model(function: Callable[..., Any], name: str, descriptions: dict[str, str]) -> type[BaseModel]:
    """A pydantic model of the function's parameters; extra arguments are refused."""
    try:
        hints = typing.get_type_hints(function, include_extras=True)
    except NameError as error:
        raise ToolDefinitionError(f"tool {name!r}: cannot resolve a type hint ({error})") from None
    fields: dict[str, Any] = {}
    for parameter in inspect.signature(function).parameters.values():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            raise ToolDefinitionError(f"tool {name!r}: *{parameter.name} is not supported, name every argument")
        if parameter.kind is parameter.POSITIONAL_ONLY:
            raise ToolDefinitionError(f"tool {name!r}: argument {parameter.name!r} must be passable by keyword")
        if parameter.name not in hints:
            raise ToolDefinitionError(f"tool {name!r}: argument {parameter.name!r} needs a type hint")
        annotation = hints[parameter.name]
        if parameter.name in descriptions:  # pydantic merges this with any Field in the hint
            annotation = Annotated[annotation, Field(description=descriptions[parameter.name])]
        default = ... if parameter.default is parameter.empty else parameter.default
        fields[parameter.name] = (annotation, default)
    model_name = "".join(part.capitalize() for part in name.split("_")) + "Arguments"
    try:
        return pydantic.create_model(model_name, __config__=ConfigDict(extra="forbid"), **fields)
    except (pydantic.PydanticSchemaGenerationError, TypeError) as error:
        raise ToolDefinitionError(f"tool {name!r}: {error}") from None


def parameters_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The JSON schema of the arguments object, without pydantic's cosmetic titles."""
    schema = model.model_json_schema()
    _drop_titles(schema)
    return schema


def _drop_titles(node: Any, in_properties: bool = False) -> None:
    if isinstance(node, dict):
        if not in_properties:
            node.pop("title", None)
        for key, value in node.items():
            # Under "properties" and "$defs" the keys are names (a field may be called "title").
            _drop_titles(value, in_properties=key in ("properties", "$defs") and not in_properties)
    elif isinstance(node, list):
        for item in node:
            _drop_titles(item)
