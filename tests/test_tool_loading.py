"""``--tools module:attr``: what a spec may name, and the clear errors for what it may not."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from specrag.agent import cli
from specrag.tools import Tool
from specrag.tools.loading import ToolLoadError, load_all, load_tools

USER_MODULE = '''
from specrag.tools import ToolRegistry, tool


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@tool(name="shout")
def upper(text: str) -> str:
    """Upper-case a text."""
    return text.upper()


def double(x: float) -> float:
    """Double a number (a plain typed function)."""
    return 2 * x


TOOLS = [add, double]
REGISTRY = ToolRegistry([upper])
NOT_A_TOOL = 42
'''


@pytest.fixture
def user_file(tmp_path: Path) -> Path:
    path = tmp_path / "user_tools.py"
    path.write_text(textwrap.dedent(USER_MODULE))
    return path


def names(tools: list[Tool]) -> list[str]:
    return [item.name for item in tools]


def test_a_file_contributes_every_tool_at_its_top_level(user_file: Path) -> None:
    assert names(load_tools(str(user_file))) == ["add", "shout"]  # the plain function is not a @tool


def test_a_spec_names_one_tool_a_list_or_a_registry(user_file: Path) -> None:
    assert names(load_tools(f"{user_file}:add")) == ["add"]
    assert names(load_tools(f"{user_file}:TOOLS")) == ["add", "double"]  # a plain function is wrapped
    assert names(load_tools(f"{user_file}:REGISTRY")) == ["shout"]
    assert load_tools(f"{user_file}:add")[0](2, 3) == 5


def test_a_module_on_the_working_directory_imports_by_name(user_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(user_file.parent)
    monkeypatch.setattr(sys, "path", [entry for entry in sys.path if entry not in ("", str(user_file.parent))])
    monkeypatch.delitem(sys.modules, "user_tools", raising=False)
    assert names(load_tools("user_tools:upper")) == ["shout"]


@pytest.mark.parametrize(
    ("attr", "message"),
    [
        ("NOT_A_TOOL", "is not a tool"),
        ("missing", "has no attribute 'missing'"),
    ],
)
def test_what_is_not_a_tool_is_refused_naming_the_spec(user_file: Path, attr: str, message: str) -> None:
    with pytest.raises(ToolLoadError, match=message) as raised:
        load_tools(f"{user_file}:{attr}")
    assert f"{user_file}:{attr}" in str(raised.value)


def test_a_module_without_tools_or_that_fails_to_import_is_refused(tmp_path: Path) -> None:
    empty = tmp_path / "empty.py"
    empty.write_text("VALUE = 1\n")
    with pytest.raises(ToolLoadError, match="defines no @tool function"):
        load_tools(str(empty))
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('no database')\n")
    with pytest.raises(ToolLoadError, match="RuntimeError: no database"):
        load_tools(str(broken))
    with pytest.raises(ToolLoadError, match="No module named"):
        load_tools("no_such_module_here:tool")
    with pytest.raises(ToolLoadError, match="no such file"):
        load_tools(str(tmp_path / "absent.py"))


def test_an_untyped_function_is_refused_with_the_reason(tmp_path: Path) -> None:
    path = tmp_path / "untyped.py"
    path.write_text("def vague(x):\n    return x\n")
    with pytest.raises(ToolLoadError, match="'vague' is not a usable tool"):
        load_tools(f"{path}:vague")


def test_two_tools_of_one_name_across_specs_are_refused(user_file: Path) -> None:
    assert names(load_all([f"{user_file}:add", str(user_file)])) == ["add", "shout"]  # the same tool twice is one
    other = user_file.parent / "other.py"
    other.write_text(
        "from tools import tool\n\n@tool\ndef add(a: int) -> int:\n    '''One more.'''\n    return a + 1\n"
    )
    with pytest.raises(ToolLoadError, match="a tool named 'add' is loaded already"):
        load_all([str(user_file), str(other)])


@pytest.mark.parametrize("command", ["serve", "ask"])
def test_the_cli_stops_before_loading_a_model(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_model(*args: object, **kwargs: object) -> None:
        raise AssertionError("a model was loaded")

    monkeypatch.setattr("specrag.agent.runtime.load_model", no_model)
    question = ["a question"] if command == "ask" else []
    assert cli.main([command, *question, "--tools", "no_such_module_here:tool"]) == 2
    assert f"specrag {command}: 'no_such_module_here:tool': importing no_such_module_here failed" in (
        capsys.readouterr().err
    )
    factory = tmp_path / "factory.py"
    factory.write_text("def make():\n    return 'not an agent'\n")
    assert cli.main([command, *question, "--app", f"{factory}:make"]) == 2
    assert "returned str, not an Agent" in capsys.readouterr().err
    assert cli.main([command, *question, "--app", f"{factory}:make", "--tools", f"{factory}:make"]) == 2
    assert "give --tools or --app, not both" in capsys.readouterr().err
