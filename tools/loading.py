"""The user's own tools, named on a command line as ``module:attr`` (``specrag serve --tools``).

A spec names a module (``my_tools``, ``pkg.tools``) or a Python file (``./my_tools.py``),
optionally followed by ``:attr``. What it names may be a ``@tool`` function, a plain typed
function (wrapped by ``tool()``, as ``Agent(tools=[...])`` does), a list or tuple of those,
or a ``ToolRegistry``; a bare module contributes every ``Tool`` at its top level. This is
uvicorn's ``module:app`` convention, and the working directory is importable as it is for
uvicorn, so a ``my_tools.py`` beside the user imports as ``my_tools``.

Anything that does not import, or names nothing that is a tool, raises ``ToolLoadError``
with the spec in its message: a server must not start with fewer tools than asked for.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from specrag.tools.registry import Tool, ToolRegistry, tool


class ToolLoadError(ValueError):
    """A ``module:attr`` spec that cannot be imported or holds no tool."""


def import_target(spec: str) -> Any:
    """The object ``spec`` (``module``, ``module:attr``, ``path.py`` or ``path.py:attr``) names."""
    module_part, _, attr_path = spec.partition(":")
    if not module_part:
        raise ToolLoadError(f"{spec!r}: expected module:attr or path/to/file.py:attr")
    module = _import_module(spec, module_part)
    target: Any = module
    for name in attr_path.split(".") if attr_path else []:
        if not hasattr(target, name):
            raise ToolLoadError(f"{spec!r}: {module.__name__} has no attribute {attr_path!r}")
        target = getattr(target, name)
    return target


def load_tools(spec: str) -> list[Tool]:
    """The tools ``spec`` names, each a ``Tool``; at least one, or ``ToolLoadError``."""
    target = import_target(spec)
    if isinstance(target, ModuleType):
        found = [value for value in vars(target).values() if isinstance(value, Tool)]
        if not found:
            raise ToolLoadError(f"{spec!r}: module {target.__name__} defines no @tool function")
        return found
    if isinstance(target, ToolRegistry):
        items: list[Any] = list(target)
    elif isinstance(target, list | tuple):
        items = list(target)
    else:
        items = [target]
    if not items:
        raise ToolLoadError(f"{spec!r} is empty: it names no tool")
    return [_as_tool(spec, item) for item in items]


def load_all(specs: list[str]) -> list[Tool]:
    """Every spec's tools, in order; two tools of one name is a ``ToolLoadError``."""
    loaded: dict[str, Tool] = {}
    for spec in specs:
        for item in load_tools(spec):
            if item.name in loaded and loaded[item.name] is not item:
                raise ToolLoadError(f"{spec!r}: a tool named {item.name!r} is loaded already")
            loaded[item.name] = item
    return list(loaded.values())


def _as_tool(spec: str, item: Any) -> Tool:
    if isinstance(item, Tool):
        return item
    if callable(item) and not isinstance(item, type):
        try:
            return tool(item)
        except (TypeError, ValueError) as error:
            name = getattr(item, "__name__", item)
            raise ToolLoadError(f"{spec!r}: {name!r} is not a usable tool: {error}") from error
    raise ToolLoadError(f"{spec!r}: {item!r} is not a tool (a @tool function, a list of them or a ToolRegistry)")


def _import_module(spec: str, module_part: str) -> ModuleType:
    try:
        if module_part.endswith(".py") or "/" in module_part:
            return _import_file(Path(module_part))
        if "" not in sys.path and str(Path.cwd()) not in sys.path:
            sys.path.insert(0, str(Path.cwd()))  # uvicorn's convention: the working directory imports
        return importlib.import_module(module_part)
    except ToolLoadError:
        raise
    except Exception as error:  # the user's module failed: say which and why, with its type
        raise ToolLoadError(f"{spec!r}: importing {module_part} failed: {type(error).__name__}: {error}") from error


def _import_file(path: Path) -> ModuleType:
    if not path.is_file():
        raise ToolLoadError(f"{path}: no such file")
    name = f"specrag_user_{path.stem}"
    loaded = sys.modules.get(name)
    if loaded is not None and Path(getattr(loaded, "__file__", "")).resolve() == path.resolve():
        return loaded  # two specs into one file name the same tool objects
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise ToolLoadError(f"{path}: not an importable Python file")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # pydantic resolves the argument models' annotations through it
    module_spec.loader.exec_module(module)
    return module
