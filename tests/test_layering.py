"""Dependencies flow one way: decoding <- retrieval, tools <- agent <- evals.

The distribution is one namespace: each top-level folder is a layer, installed as
``specrag.<folder>`` (``agent/`` is ``specrag.agent``; pyproject.toml maps them). Every
import statement of every module counts, lazy ones inside functions too: a lazy import is
still a dependency, only a later one. Three more rules: no code imports a layer by its bare
folder name (with the repository root on ``sys.path``, as under pytest, ``import decoding``
would load a second copy of every module it reaches); inside ``evals`` the eval libraries
import none of the script subpackages (benchmarks, studies, checks); and pyproject.toml
installs every package folder, each under the namespace. Each check is tested on a planted
violation, so it cannot pass by finding nothing.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NAMESPACE = "specrag"
# What each layer may import, of the project's layers.
ALLOWED: dict[str, frozenset[str]] = {
    "decoding": frozenset(),
    "retrieval": frozenset({"decoding"}),
    "tools": frozenset({"decoding"}),
    "agent": frozenset({"decoding", "retrieval", "tools"}),
    "evals": frozenset({"decoding", "retrieval", "tools", "agent"}),
}
# Code outside the layers that must import them through the namespace too.
OTHER_CODE = ("tests", "examples")
# The subpackages of evals that are scripts: no eval library imports them. Only the CLI
# wiring (evals/cli_commands.py) reaches into them.
EVALS_SCRIPTS = frozenset({"bench", "studies", "checks"})
EVALS_WIRING = frozenset({"cli_commands.py"})


def imported_modules(source: str) -> set[str]:
    """Every module an import statement names; ``from a import b`` counts ``a`` and ``a.b``."""
    modules = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules.add(node.module)
            modules.update(f"{node.module}.{alias.name}" for alias in node.names)
    return modules


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == NAMESPACE and parts[1] in ALLOWED else None


def violations(root: Path) -> list[str]:
    found = []
    for layer, allowed in ALLOWED.items():
        for path in sorted((root / layer).rglob("*.py")):
            imported = {layer_of(module) for module in imported_modules(path.read_text())} - {None}
            found += [
                f"{path.relative_to(root)} imports {other}"
                for other in sorted(imported)
                if other != layer and other not in allowed
            ]
    return found


def old_style_imports(root: Path) -> list[str]:
    found = []
    for folder in (*ALLOWED, *OTHER_CODE):
        for path in sorted((root / folder).rglob("*.py")):
            tops = {module.split(".")[0] for module in imported_modules(path.read_text())}
            found += [f"{path.relative_to(root)} imports {top}" for top in sorted(tops & ALLOWED.keys())]
    return found


def evals_library_violations(root: Path) -> list[str]:
    found = []
    evals = root / "evals"
    for path in sorted(evals.rglob("*.py")):
        inside = path.relative_to(evals).parts
        if inside[0] in EVALS_SCRIPTS or (len(inside) == 1 and inside[0] in EVALS_WIRING):
            continue
        scripts = {
            parts[2]
            for parts in (module.split(".") for module in imported_modules(path.read_text()))
            if len(parts) > 2 and parts[:2] == [NAMESPACE, "evals"] and parts[2] in EVALS_SCRIPTS
        }
        found += [f"{path.relative_to(root)} imports evals.{script}" for script in sorted(scripts)]
    return found


def package_folders(root: Path) -> list[str]:
    """Every folder with an ``__init__.py`` in a layer, named as it is installed."""
    return sorted(
        ".".join((NAMESPACE, *init.parent.relative_to(root).parts))
        for layer in ALLOWED
        for init in (root / layer).rglob("__init__.py")
    )


def test_dependencies_flow_one_way() -> None:
    assert violations(ROOT) == []


def test_no_code_imports_a_layer_by_its_folder_name() -> None:
    assert old_style_imports(ROOT) == []


def test_eval_libraries_import_no_script() -> None:
    assert evals_library_violations(ROOT) == []


def test_the_distribution_is_one_namespace_with_every_package() -> None:
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setuptools["package-dir"] == {f"{NAMESPACE}.{layer}": layer for layer in ALLOWED}
    assert sorted(setuptools["packages"]) == package_folders(ROOT)
    # The namespace is implicit: an __init__.py at the root would make pytest import the
    # repository itself as a package.
    assert not (ROOT / "__init__.py").exists()


def test_the_check_finds_a_planted_violation(tmp_path: Path) -> None:
    for layer in ALLOWED:
        (tmp_path / layer).mkdir()
    (tmp_path / "decoding" / "engine.py").write_text("def f():\n    from specrag.agent.loop import AgentLoop\n")
    (tmp_path / "agent" / "cli.py").write_text("import specrag.evals.groundedness.run\nfrom specrag import decoding\n")
    (tmp_path / "evals" / "run.py").write_text("from specrag.agent import cli\n")
    assert violations(tmp_path) == ["decoding/engine.py imports agent", "agent/cli.py imports evals"]


def test_the_check_finds_a_planted_old_style_import(tmp_path: Path) -> None:
    for folder in (*ALLOWED, *OTHER_CODE):
        (tmp_path / folder).mkdir()
    (tmp_path / "agent" / "loop.py").write_text("def f():\n    from decoding.engine import Engine\n")
    (tmp_path / "tests" / "test_x.py").write_text("import retrieval\nfrom specrag import tools\n")
    assert old_style_imports(tmp_path) == ["agent/loop.py imports decoding", "tests/test_x.py imports retrieval"]


def test_the_check_finds_a_planted_eval_library_importing_a_script(tmp_path: Path) -> None:
    for folder in ("groundedness", "bench"):
        (tmp_path / "evals" / folder).mkdir(parents=True)
    (tmp_path / "evals" / "groundedness" / "run.py").write_text("from specrag.evals.bench import runs\n")
    (tmp_path / "evals" / "bench" / "decode.py").write_text("from specrag.evals.groundedness import run\n")
    (tmp_path / "evals" / "cli_commands.py").write_text("from specrag.evals.bench.decode import main\n")
    assert evals_library_violations(tmp_path) == ["evals/groundedness/run.py imports evals.bench"]
