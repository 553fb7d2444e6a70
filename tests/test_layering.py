"""Dependencies flow one way: decoding <- retrieval, tools <- agent <- evals.

Every import statement of every module counts, lazy ones inside functions too: a lazy
import is still a dependency, only a later one. The check itself is tested on a planted
violation, so it cannot pass by finding nothing.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# What each package may import, of the project's packages.
ALLOWED: dict[str, frozenset[str]] = {
    "decoding": frozenset(),
    "retrieval": frozenset({"decoding"}),
    "tools": frozenset({"decoding"}),
    "agent": frozenset({"decoding", "retrieval", "tools"}),
    "evals": frozenset({"decoding", "retrieval", "tools", "agent"}),
}


def imported_packages(source: str) -> set[str]:
    packages = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            packages.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            packages.add(node.module.split(".")[0])
    return packages


def violations(root: Path) -> list[str]:
    found = []
    for package, allowed in ALLOWED.items():
        for path in sorted((root / package).rglob("*.py")):
            for imported in sorted(imported_packages(path.read_text()) & ALLOWED.keys()):
                if imported != package and imported not in allowed:
                    found.append(f"{path.relative_to(root)} imports {imported}")
    return found


def test_dependencies_flow_one_way() -> None:
    assert violations(ROOT) == []


def test_the_check_finds_a_planted_violation(tmp_path: Path) -> None:
    for package in ALLOWED:
        (tmp_path / package).mkdir()
    (tmp_path / "decoding" / "engine.py").write_text("def f():\n    from agent.loop import AgentLoop\n")
    (tmp_path / "agent" / "cli.py").write_text("import evals.run\nimport decoding\n")
    (tmp_path / "evals" / "run.py").write_text("from agent import cli\n")
    assert violations(tmp_path) == ["decoding/engine.py imports agent", "agent/cli.py imports evals"]
