"""The docs are the truth: every Python block in README.md and docs/ runs (issue #22).

Each document's blocks run in order in one fresh interpreter (allocator state is
process-global), in a scratch directory, on the names :mod:`tests.docs_prelude`
builds for what docs leave to the reader (a model, an engine, prompts). A block
marked ``<!-- docs: gpu -->`` on the line before its fence needs a GPU (or a second
process): here it is compiled and its imports run, but for those of an optional package
it names (``<!-- docs: gpu needs=torch_memory_saver -->``; a module of ours that imports
one, such as ``hybridmem.integrations.vllm.backend``, may be named too) that is not
installed. A block marked ``<!-- docs: needs=ray -->`` runs whole where every package
it names is installed, and is compiled with its other imports run where one is not
(CI's ``trl`` job installs Ray and sets ``HYBRIDMEM_DOCS_REQUIRE=ray``, which makes a
missing one fail). A block that fails names its file and line.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import REPO, clean_env

GPU_MARK = re.compile(r"<!-- docs: gpu(?: needs=([\w.,]+))? -->")
NEEDS_MARK = re.compile(r"<!-- docs: needs=([\w.,]+) -->")
DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


@dataclass(frozen=True)
class Block:
    line: int  # of the fence
    code: str
    gpu: bool
    needs: tuple[str, ...] = ()  # optional packages the block imports
    cpu: bool = False  # needs= alone: runs whole where they are installed


def blocks(path: Path) -> list[Block]:
    """The ```python blocks of ``path``, with their line and GPU mark."""
    lines = path.read_text().splitlines()
    found: list[Block] = []
    index = 0
    while index < len(lines):
        if lines[index].strip() == "```python":
            end = next(j for j in range(index + 1, len(lines)) if lines[j].startswith("```"))
            before = lines[index - 1].strip() if index else ""
            mark = GPU_MARK.fullmatch(before) or NEEDS_MARK.fullmatch(before)
            needs = tuple(mark.group(1).split(",")) if mark and mark.group(1) else ()
            cpu = mark is not None and mark.re is NEEDS_MARK
            code = "\n".join(lines[index + 1 : end]) + "\n"
            found.append(Block(index + 1, code, mark is not None and not cpu, needs, cpu))
            index = end
        index += 1
    return found


# Runs in the child: the blocks of one document, one namespace, stop at the first failure.
_RUNNER = """
import ast, importlib.util, json, sys, traceback
from tests.docs_prelude import namespace
doc, blocks, required = json.loads(sys.stdin.read())
names = namespace(doc)
done = []
for block in blocks:
    where = f"{doc}:{block['line']}"
    try:
        tree = compile(block["code"], where, "exec", flags=ast.PyCF_ONLY_AST)
        missing = [p for p in block["needs"] if importlib.util.find_spec(p) is None]
        if block["cpu"] and set(missing) & set(required):  # CI's job that installs them
            raise ModuleNotFoundError(f"HYBRIDMEM_DOCS_REQUIRE names {missing}: not installed")
        if block["gpu"] or (block["cpu"] and missing):  # compiled; only its imports run
            def runs(node):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [
                    node.module
                ]
                needs = block["needs"]  # a package, or a module of ours that imports one
                optional = [n for n in names if n.split(".")[0] in needs or n in needs]
                packages = [p for p in needs if "." not in p]
                return not optional or all(importlib.util.find_spec(p) for p in packages)
            imports = (ast.Import, ast.ImportFrom)
            tree = ast.Module([n for n in tree.body if isinstance(n, imports) and runs(n)], [])
        exec(compile(tree, where, "exec"), names)
    except BaseException:
        print(json.dumps({"done": done, "failed": where, "error": traceback.format_exc()}))
        sys.exit(1)
    done.append(where)
print(json.dumps({"done": done, "failed": None, "error": None}))
"""


def test_every_doc_with_python_has_its_blocks_found() -> None:
    counted = {path.relative_to(REPO).as_posix(): len(blocks(path)) for path in DOCS}
    fences = {
        path.relative_to(REPO).as_posix(): len(re.findall(r"^```python$", path.read_text(), re.M))
        for path in DOCS
    }
    assert counted == fences
    assert sum(counted.values()) >= 25


def _required() -> list[str]:
    """Packages a ``needs=`` block must find here (``HYBRIDMEM_DOCS_REQUIRE``, comma-separated)."""
    return [p for p in os.environ.get("HYBRIDMEM_DOCS_REQUIRE", "").split(",") if p]


def run_blocks(name: str, found: list[Block], scratch: Path) -> dict[str, Any]:
    """Run ``found`` as the blocks of document ``name``; the runner's verdict."""
    script = scratch / "run_doc.py"
    script.write_text(_RUNNER)
    result = subprocess.run(
        [sys.executable, str(script)],
        input=json.dumps([name, [dataclasses.asdict(block) for block in found], _required()]),
        capture_output=True,
        text=True,
        cwd=scratch,  # what a block writes (a timeline) lands here
        env=clean_env(),
        timeout=300,
        check=False,
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    assert lines, result.stderr[-3000:]
    outcome: dict[str, Any] = json.loads(lines[-1])
    outcome["stderr"] = result.stderr
    return outcome


@pytest.mark.parametrize(
    "doc",
    [path for path in DOCS if blocks(path)],
    ids=lambda path: path.relative_to(REPO).as_posix(),
)
def test_the_python_blocks_of_a_doc_run(doc: Path, tmp_path: Path) -> None:
    found = blocks(doc)
    outcome = run_blocks(doc.relative_to(REPO).as_posix(), found, tmp_path)
    assert outcome["failed"] is None, f"{outcome['failed']}:\n{outcome['error']}"
    assert len(outcome["done"]) == len(found)
    assert "Traceback" not in outcome["stderr"], outcome["stderr"][-3000:]


def test_a_gpu_block_is_compiled_and_imported_and_a_failing_block_is_named(
    tmp_path: Path,
) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text(
        "```python\nx = 1\n```\n\n<!-- docs: gpu needs=not_installed_pkg -->\n```python\n"
        "import json\nimport not_installed_pkg\ntorch.ones(1, device='cuda:7')\n```\n\n"
        "```python\nassert json and x == 1\n```\n"
    )
    found = blocks(doc)
    assert [(b.line, b.gpu, b.needs) for b in found] == [
        (1, False, ()),
        (6, True, ("not_installed_pkg",)),
        (12, False, ()),
    ]
    outcome = run_blocks("doc.md", found, tmp_path)
    assert outcome["failed"] is None, outcome["error"]  # json was imported, cuda:7 not run
    broken = [Block(3, "import json\n", True), Block(9, "y = undefined_name\n", False)]
    outcome = run_blocks("doc.md", broken, tmp_path)
    assert outcome["failed"] == "doc.md:9"
    assert "NameError: name 'undefined_name' is not defined" in outcome["error"]
    assert outcome["done"] == ["doc.md:3"]
    unmarked = [Block(1, "import not_installed_pkg\n", True)]  # no needs=: must import
    assert run_blocks("doc.md", unmarked, tmp_path)["failed"] == "doc.md:1"


def test_a_needs_block_runs_whole_where_its_packages_are_and_is_compiled_where_not(
    tmp_path: Path,
) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text(
        "<!-- docs: needs=not_installed_pkg -->\n```python\nimport json\n"
        "import not_installed_pkg\nraise SystemExit('ran')\n```\n\n"
        "<!-- docs: needs=json -->\n```python\nimport json\nassert json.loads('1') == 2\n```\n"
    )
    missing, present = blocks(doc)
    assert (missing.gpu, missing.cpu, missing.needs) == (False, True, ("not_installed_pkg",))
    assert (present.gpu, present.cpu, present.needs) == (False, True, ("json",))
    assert run_blocks("doc.md", [missing], tmp_path)["failed"] is None  # imports only
    assert run_blocks("doc.md", [present], tmp_path)["failed"] == "doc.md:9"  # ran whole


def test_the_readmes_first_snippet_runs_as_pasted(tmp_path: Path) -> None:
    """A new user copies the README's first block into a file and runs it: no stand-ins."""
    first = blocks(REPO / "README.md")[0]
    assert not first.gpu
    script = tmp_path / "snippet.py"
    script.write_text(first.code)
    done = subprocess.run(
        [sys.executable, "-W", "error::Warning", str(script)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=clean_env(),
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    printed = done.stdout.splitlines()
    # On this CPU machine too, each phase shows the string torch's allocator was given:
    # the toggle taking effect, and the user's own setting (from the env) kept.
    train = "train:    torch's allocator gets max_split_size_mb:256,expandable_segments:True"
    generate = "generate: torch's allocator gets max_split_size_mb:256,expandable_segments:False"
    assert printed[0] == train
    assert printed[1].startswith("sync weights; active: ('expandable_segments(False)'")
    assert printed[2] == generate
    assert printed[3] == "engine sleeps"
    assert printed[4:6] == [train, printed[1]]
    assert printed[-1].startswith("release_cache")
    readme = (REPO / "README.md").read_text()  # what the README says the lines are
    assert "`max_split_size_mb:256,expandable_segments:True` to train" in readme
    assert done.stderr == ""
