"""Every import outside the standard library is torch, or optional and declared.

The family of defect behind issue #11's red CI: `hybridmem/bench/run.py` imported
transformers, which nothing declared, and mypy passed only where someone had installed
it by hand. Here: the package imports nothing at module level but torch; anything else
is imported inside a function (or by name through importlib) and belongs to an extra;
tests and benchmarks use only what the `dev` extra installs.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

from tests.helpers import PACKAGE, REPO

ALWAYS = {"torch", "hybridmem", "tests", "benchmarks", "examples", "__future__"}
#: A benchmark script may import a sibling script by its name (its folder is on the
#: path when it runs): that is no dependency.
SIBLINGS = {p.stem for p in (REPO / "benchmarks").glob("*.py")}


def _extras() -> dict[str, set[str]]:
    """``[project.optional-dependencies]`` of pyproject.toml: extra -> distribution names.

    Read with a pattern, not tomllib (Python 3.11+; the project supports 3.10): each
    extra is one ``name = [...]`` line there.
    """
    text = (REPO / "pyproject.toml").read_text()
    block = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    extras: dict[str, set[str]] = {}
    for name, listed in re.findall(r"^(\w+)\s*=\s*\[(.*)\]\s*$", block, re.M):
        requirements = re.findall(r'"([^"]+)"', listed)
        extras[name] = {
            re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower().replace("-", "_")
            for r in requirements
        }
    return extras


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(top-level module, imported at module level?) for every import in ``path``."""
    tree = ast.parse(path.read_text())
    found: list[tuple[str, bool]] = []
    top_level = {id(node) for node in tree.body}
    guarded = set()
    for statement in tree.body:  # `if TYPE_CHECKING:` blocks only serve the type checker
        if isinstance(statement, ast.If) and "TYPE_CHECKING" in ast.unparse(statement.test):
            guarded |= {id(n) for n in ast.walk(statement)}
    for node in ast.walk(tree):
        if id(node) in guarded:
            continue
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        for name in names:
            found.append((name.split(".")[0], id(node) in top_level))
    return found


def _third_party(module: str) -> bool:
    return module not in sys.stdlib_module_names and module not in ALWAYS


#: Modules only their engine loads (through its plugin entry point), which subclass its
#: classes and so import it at module level; nothing else imports them.
ENGINE_MODULES = {
    "hybridmem/integrations/vllm/backend.py": "vllm",
    "hybridmem/integrations/vllm/sleep_backend.py": "vllm",
}
#: What tests/vllm/ may import besides the dev extra: vLLM and what vllm 0.32 requires.
VLLM_TESTS = {"vllm", "transformers", "tokenizers", "safetensors", "psutil"}
# TRL's real trainer, run in a child where trl is installed (CI's trl job); its "vllm" is
# the recording stand-in the script writes
TRL_RUN = {"tests/trl_grpo_run.py": {"trl", "transformers", "tokenizers", "datasets", "vllm"}}


def test_the_package_needs_only_torch_and_declares_the_rest() -> None:
    extras = _extras()
    optional = set().union(*(v for k, v in extras.items() if k != "dev"))
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for module, at_top in _imports(path):
            if not _third_party(module):
                continue
            where = path.relative_to(PACKAGE.parent)
            if at_top and ENGINE_MODULES.get(str(where)) == module:
                continue
            if at_top:
                problems.append(f"{where}: imports {module} at module level (only torch may)")
            if module not in optional:
                problems.append(f"{where}: imports {module}, which no extra declares")
    assert not problems, "\n".join(problems)


def test_tests_and_benchmarks_use_only_the_dev_extra() -> None:
    dev = _extras()["dev"] | {"pytest", "hypothesis", "xdist", "matplotlib"}
    problems = []
    for folder in ("tests", "benchmarks", "examples"):
        for path in sorted((REPO / folder).rglob("*.py")):
            allowed = dev | VLLM_TESTS if "vllm" in path.relative_to(REPO).parts else dev
            allowed = allowed | TRL_RUN.get(path.relative_to(REPO).as_posix(), set())
            if folder == "benchmarks":
                allowed = allowed | SIBLINGS
            for module, _ in _imports(path):
                if _third_party(module) and module not in allowed:
                    problems.append(f"{path.relative_to(REPO)}: imports {module} (not in dev)")
    assert not problems, "\n".join(problems)


def test_only_the_engine_modules_import_their_engine_and_nothing_imports_them() -> None:
    for name, engine in ENGINE_MODULES.items():
        assert engine in _extras(), f"{engine} has no extra"
        module = name.removesuffix(".py").replace("/", ".")
        for path in sorted(PACKAGE.rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                names = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module or ""]
                    if isinstance(node, ast.ImportFrom)
                    else []
                )
                # (the plugin names it as a string: vLLM imports it, lazily)
                assert module not in names, f"{path} imports {module}"


def test_the_bench_model_imports_transformers_by_name_only() -> None:
    text = (PACKAGE / "bench" / "run.py").read_text()
    assert 'importlib.import_module("transformers")' in text
    assert "bench" in _extras()
    assert "transformers" in _extras()["bench"]


def test_ci_newest_job_tests_at_least_the_newest_recorded_torch() -> None:
    """CI's newest job is floored at the newest torch release recorded (issue #25's CI).

    This workplace's pip was capped at torch 2.14.1 while users' ``pip install torch``
    gave 2.15.0: a plain ``pip install torch`` in the job tested the older one and
    passed. The floor in ``.ci/requirements-newest.txt`` must follow the recorded
    parsers: a release recorded (so supported) is a release CI's newest job runs on.
    """
    from hybridmem.allocator.rules import RECORDED_VERSIONS

    floor = re.findall(
        r"^torch>=([\d.]+)\s*$", (REPO / ".ci/requirements-newest.txt").read_text(), re.M
    )
    assert floor == [RECORDED_VERSIONS[-1]], (floor, RECORDED_VERSIONS[-1])
    script = (REPO / ".ci/run").read_text()
    assert re.search(r"^\s*venv_for newest -r \.ci/requirements-newest\.txt\s*$", script, re.M), (
        "the newest job must install torch from .ci/requirements-newest.txt"
    )
    readme = (REPO / "README.md").read_text()
    assert f"newest torch that installs ({RECORDED_VERSIONS[-1]}" in readme
