"""Every code block of the README and of docs/ is run or checked, by the rule docs/testing.md states.

- ```python blocks are executed, each distinct block once; a block that names
  ``SPECRAG_BASE_URL`` gets a real server (smollm2, the sample index) there.
- ```sh / ```bash blocks are checked line by line without running anything long: a
  ``specrag`` or ``python -m MODULE`` command must print its ``--help`` (for the
  subcommand it names) and that help must list every option the line uses; ``make T``
  needs a target T in the Makefile; ``curl`` is sent for real to the live server.
  Any other program fails the check, so a new kind of command needs a rule here first.
- ```text blocks are shown, not run (outputs, diagrams, signatures); ```json blocks must parse.
- ```yaml blocks must parse; a Ray Serve config (``applications``), alone or as a KubeRay
  RayService's ``serveConfigV2``, must pass Serve's own schema, and each application's
  ``import_path`` and ``args`` must be what ``serve run`` would import and parse. In shell
  blocks ``serve run MODULE:ATTR key=value`` is checked the same way, and ``ray CMD`` like
  ``specrag`` (its ``--help`` lists every option used).
- Any other fence, an unlabelled one included, fails.

The planted tests at the end show that each rule fails when its block is wrong.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

from specrag.decoding.model import CausalLM

ROOT = Path(__file__).resolve().parent.parent
# docs/reports/ holds run outputs (their report.md files quote model answers), not docs.
DOC_FILES = [
    ROOT / "README.md",
    *sorted(path for path in (ROOT / "docs").rglob("*.md") if "reports" not in path.relative_to(ROOT).parts),
]
RUN = frozenset({"python"})
CHECK = frozenset({"sh", "bash"})
SHOWN = frozenset({"text"})
PARSED = frozenset({"json"})
YAML = frozenset({"yaml"})
# The host the examples address; the tests send those requests to their own live server.
EXAMPLE_HOST = "127.0.0.1:8000"
# A fence, at any indentation (blocks inside list items), up to the same fence closing it.
FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[^\n`]*)\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.M | re.S)
OPTION = re.compile(r"-{1,2}[A-Za-z][\w-]*")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    lang: str
    body: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path}:{self.line}"


def code_blocks(path: Path) -> list[Block]:
    text = path.read_text()
    blocks = []
    for match in FENCE.finditer(text):
        indent = match["indent"]
        # Dedent by the fence's own indentation, so a block inside a list item runs as written.
        body = "".join(line.removeprefix(indent) for line in match["body"].splitlines(keepends=True))
        line = text.count("\n", 0, match.start()) + 1
        blocks.append(Block(path, line, match["lang"].strip(), body))
    return blocks


def all_blocks() -> list[Block]:
    return [block for path in DOC_FILES for block in code_blocks(path)]


def unique(blocks: list[Block]) -> list[Block]:
    """The first of each distinct body: the README repeats a docs example, and it runs once."""
    seen: dict[str, Block] = {}
    for block in blocks:
        seen.setdefault(block.body, block)
    return list(seen.values())


def fence_problems(blocks: list[Block]) -> list[str]:
    return [
        f"{block.where}: fence {block.lang or '(none)'!r} has no rule (use python, sh, bash, text, json or yaml)"
        for block in blocks
        if block.lang not in RUN | CHECK | SHOWN | PARSED | YAML
    ]


def run_python_block(block: Block) -> None:
    exec(compile(block.body, block.where, "exec"), {"__name__": "__docs_example__"})


def command_lines(body: str) -> list[list[str]]:
    """Each command of a shell block as argv: continuations joined, comments and blank lines dropped."""
    joined = re.sub(r"\\\n", " ", body)
    commands = []
    for line in joined.splitlines():
        argv = shlex.split(line, comments=True)
        while argv and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", argv[0]):  # VAR=value prefixes
            argv = argv[1:]
        if argv:
            commands.append(argv)
    return commands


@cache
def help_text(argv: tuple[str, ...]) -> tuple[int, str]:
    result = subprocess.run([*argv, "--help"], capture_output=True, text=True, cwd=ROOT, check=False, timeout=600)
    return result.returncode, result.stdout + result.stderr


def makefile_targets() -> set[str]:
    return set(re.findall(r"^([\w.-]+):", (ROOT / "Makefile").read_text(), flags=re.M))


def check_help(where: str, base: list[str], args: list[str]) -> list[str]:
    """The command's --help runs for the subcommand it names, and lists every option it uses."""
    words: list[str] = []
    for arg in args:  # the subcommand path and positionals: everything before the first option
        if arg.startswith("-"):
            if arg == "--":  # `specrag bench decode -- OPTIONS`: the options are the benchmark's
                words.append(arg)
            break
        words.append(arg)
    status, text = help_text((*base, *words))
    if status != 0:
        return [f"{where}: `{shlex.join([*base, *words])} --help` exited {status}: {text[-500:]}"]
    used = {OPTION.match(arg)[0] for arg in args if arg != "--" and OPTION.match(arg)}
    return [
        f"{where}: {option} is not an option of `{shlex.join(words) or base[-1]}`"
        for option in sorted(used)
        if not re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", text)
    ]


def check_shell_block(block: Block, server: Callable[[], str]) -> list[str]:
    problems = []
    for argv in command_lines(block.body):
        program, args = Path(argv[0]).name, argv[1:]
        if program == "specrag":
            problems += check_help(block.where, [sys.executable, "-m", "specrag.agent.cli"], args)
        elif program in {"python", "python3"} and args[:1] == ["-m"] and len(args) > 1:
            problems += check_help(block.where, [sys.executable, "-m", args[1]], args[2:])
        elif program == "make":
            problems += [f"{block.where}: no Makefile target {t!r}" for t in args if t not in makefile_targets()]
        elif program == "curl":
            problems += run_curl(block.where, args, server())
        elif program == "ray":
            problems += check_help(block.where, [str(Path(sys.executable).with_name("ray"))], args)
        elif program == "serve" and args[:1] == ["run"] and len(args) > 1:
            arguments = dict(arg.split("=", 1) for arg in args[2:] if "=" in arg)
            problems += check_serve_app(block.where, args[1], arguments)
        else:
            problems.append(f"{block.where}: no rule for `{argv[0]}` (add one in tests/test_docs.py, or use ```text)")
    return problems


def run_curl(where: str, args: list[str], url: str) -> list[str]:
    """Sent for real to the tests' server; it must answer 2xx with JSON."""
    host = url.removeprefix("http://")
    argv = ["curl", "--fail", "--max-time", "600", *(arg.replace(EXAMPLE_HOST, host) for arg in args)]
    result = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=660)
    if result.returncode != 0:
        return [f"{where}: {shlex.join(argv)} exited {result.returncode}: {result.stdout[-300:]}{result.stderr[-300:]}"]
    try:
        json.loads(result.stdout)
    except json.JSONDecodeError:
        return [f"{where}: {shlex.join(argv)} did not answer JSON: {result.stdout[:300]}"]
    return []


def check_serve_app(where: str, import_path: str, arguments: dict[str, object]) -> list[str]:
    """What ``serve run`` does first: import the builder and parse its arguments (specrag's
    builder parses them as ``specrag serve`` options); nothing is deployed."""
    import importlib

    module, _, attribute = import_path.partition(":")
    try:
        builder = getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError, ValueError) as error:
        return [f"{where}: cannot import {import_path!r}: {error}"]
    if builder.__module__ == "specrag.agent.ray_serve":
        from specrag.agent.cli_agent import serve_parser
        from specrag.agent.ray_serve import builder_argv

        try:
            serve_parser().parse_args(builder_argv(arguments))
        except SystemExit:
            return [f"{where}: {import_path} does not take {arguments}"]
    return []


def check_yaml_block(block: Block) -> list[str]:
    import yaml
    from ray.serve.schema import ServeDeploySchema

    documents = [document for document in yaml.safe_load_all(block.body) if document is not None]
    configs = [document for document in documents if "applications" in document]
    for document in documents:
        if document.get("kind") == "RayService":
            configs.append(yaml.safe_load(document["spec"]["serveConfigV2"]))
    problems = []
    for config in configs:
        schema = ServeDeploySchema.model_validate(config)
        for app in schema.applications:
            problems += check_serve_app(block.where, app.import_path, dict(app.args or {}))
    return problems


BLOCKS = all_blocks()
PYTHON = unique([block for block in BLOCKS if block.lang in RUN])
SHELL = unique([block for block in BLOCKS if block.lang in CHECK])


def test_the_docs_have_examples_and_every_fence_follows_the_rule() -> None:
    assert PYTHON and SHELL
    assert {block.path.name for block in PYTHON} >= {"README.md", "decoding.md", "retrieval.md"}
    assert fence_problems(BLOCKS) == []


@pytest.fixture(scope="module")
def docs_server(smollm2: CausalLM, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The examples' HTTP calls go to a real server (smollm2 for speed) over the sample index."""
    from tests.server_helpers import sample_server

    with sample_server(smollm2, tmp_path_factory.getbasetemp()) as url:
        yield url


@pytest.mark.slow
@pytest.mark.parametrize("block", PYTHON, ids=[block.where for block in PYTHON])
def test_python_example_runs(
    block: Block, smollm2: CausalLM, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    if "SPECRAG_BASE_URL" in block.body:
        monkeypatch.setenv("SPECRAG_BASE_URL", request.getfixturevalue("docs_server"))
        monkeypatch.delenv("SPECRAG_API_KEY", raising=False)
    run_python_block(block)


@pytest.mark.slow
@pytest.mark.parametrize("block", SHELL, ids=[block.where for block in SHELL])
def test_shell_example_checks(block: Block, request: pytest.FixtureRequest) -> None:
    assert check_shell_block(block, lambda: request.getfixturevalue("docs_server")) == []


def test_json_examples_parse() -> None:
    for block in BLOCKS:
        if block.lang in PARSED:
            json.loads(block.body)


def test_yaml_examples_parse_and_serve_configs_hold() -> None:
    assert any(block.lang in YAML for block in BLOCKS)
    assert [problem for block in BLOCKS if block.lang in YAML for problem in check_yaml_block(block)] == []


def test_a_serve_config_naming_a_missing_builder_or_option_fails() -> None:
    config = "applications:\n- name: a\n  import_path: specrag.agent.ray_serve:no_such_builder\n"
    problems = check_yaml_block(Block(ROOT / "planted.md", 1, "yaml", config))
    assert len(problems) == 1 and "cannot import" in problems[0]
    bad_args = "applications:\n- name: a\n  import_path: specrag.agent.ray_serve:app_builder\n  args: {replicaz: 2}\n"
    problems = check_yaml_block(Block(ROOT / "planted.md", 1, "yaml", bad_args))
    assert len(problems) == 1 and "does not take" in problems[0]


# -- the rule fails where it should: planted blocks ------------------------------------

PLANTED = """# A planted page

```python
total = undefined_name + 1
```

- in a list item:

  ```sh
  .venv/bin/specrag pull --no-such-option smollm2-135m
  make no-such-target
  frobnicate --now
  ```

```
an unlabelled fence
```
"""


@pytest.fixture
def planted(tmp_path: Path) -> list[Block]:
    page = tmp_path / "planted.md"
    page.write_text(PLANTED)
    return code_blocks(page)


def test_a_broken_python_block_fails(planted: list[Block]) -> None:
    with pytest.raises(NameError, match="undefined_name"):
        run_python_block(planted[0])


def test_a_shell_block_with_a_wrong_option_target_or_program_fails(planted: list[Block]) -> None:
    problems = check_shell_block(planted[1], lambda: pytest.fail("no curl in this block"))
    assert len(problems) == 3, problems
    assert "--no-such-option is not an option" in problems[0]
    assert "no Makefile target 'no-such-target'" in problems[1]
    assert "no rule for `frobnicate`" in problems[2]


def test_an_unlabelled_fence_fails(planted: list[Block]) -> None:
    assert [block.lang for block in planted] == ["python", "sh", ""]
    assert len(fence_problems(planted)) == 1 and "'(none)'" in fence_problems(planted)[0]


def test_a_correct_shell_block_passes() -> None:
    block = Block(ROOT / "planted.md", 1, "sh", "make test lint\n.venv/bin/specrag pull smollm2-135m --json  # note\n")
    assert check_shell_block(block, lambda: pytest.fail("no curl in this block")) == []
