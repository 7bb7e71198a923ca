"""Every docstring example runs, or says it cannot (``# doctest: +SKIP`` on each of its lines).

A docstring's ``>>>`` lines are a promise to the reader: pasted, they work and print
what the docstring shows. Examples that need a GPU, an engine or another process carry
``# doctest: +SKIP`` on every ``>>>`` line (a directive covers one example, not the
lines after it). The rest run here, as ``python -m pytest --doctest-modules hybridmem``
would run them, in one fresh interpreter (examples change process-global allocator
settings), with only the names each module defines: an example imports what else it
uses, as a reader's paste must.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from tests.helpers import REPO, run_python

#: Modules that cannot be imported without an optional package (the package named).
OPTIONAL = {
    "hybridmem.integrations.vllm.backend": "vllm",
    "hybridmem.integrations.vllm.sleep_backend": "vllm",
}

#: What both runners share: every example of a module run in one fresh namespace each.
_RUN_EXAMPLES = """
import doctest, json, sys

found = {"failures": [], "ran": [], "unimported": {}}
flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
finder = doctest.DocTestFinder(exclude_empty=True)

def run_examples(module, name, label=""):
    for test in finder.find(module, name):
        said = []
        runner = doctest.DocTestRunner(optionflags=flags, verbose=False)
        result = runner.run(test, out=said.append, clear_globs=True)
        if result.attempted:
            found["ran"].append(label + test.name)
        if result.failed:
            found["failures"].append(f"{test.filename}:{test.lineno}: {''.join(said)}")
"""

_RUNNER = (
    _RUN_EXAMPLES
    + """
import importlib, pkgutil
import hybridmem

for info in pkgutil.walk_packages(hybridmem.__path__, "hybridmem."):
    try:
        module = importlib.import_module(info.name)
    except ImportError as exc:
        found["unimported"][info.name] = str(exc)
        continue
    run_examples(module, info.name)
print(json.dumps(found))
"""
)

#: The same for scripts and helpers outside the package, each loaded from its file.
_SCRIPTS_RUNNER = (
    _RUN_EXAMPLES
    + """
import importlib.util, os

for path in sys.argv[1:]:
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))  # as `python PATH` has it
    name = "docstring_example_" + path.replace("/", "_").removesuffix(".py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    run_examples(module, name, label=f"{path}:")
print(json.dumps(found))
"""
)

_EXAMPLE_LINE = re.compile(r"^\s*>>> ", re.MULTILINE)


def _run() -> dict[str, list[str] | dict[str, str]]:
    done = run_python("-c", _RUNNER, env={"CUDA_VISIBLE_DEVICES": ""}, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    found: dict[str, list[str] | dict[str, str]] = json.loads(done.stdout.splitlines()[-1])
    return found


def test_every_docstring_example_runs_or_is_skipped_line_by_line() -> None:
    found = _run()
    failures = found["failures"]
    assert not failures, "docstring examples that fail:\n" + "\n".join(failures)
    # Only the modules of an optional package are left unread, each for that package.
    unimported = found["unimported"]
    assert isinstance(unimported, dict)
    assert set(unimported) <= set(OPTIONAL), unimported
    for module, message in unimported.items():
        assert OPTIONAL[module] in message, message
    # The examples did run: one that computes, and one that packs on the CPU.
    ran = found["ran"]
    assert "hybridmem.bench.plan.need_kv_target" in ran
    assert "hybridmem.packing.core.pack" in ran


def test_the_examples_in_benchmarks_examples_and_tests_run_too() -> None:
    # Scripts a reader runs and helpers a test reads: the same promise as the package's.
    files = sorted(
        str(path.relative_to(REPO))
        for folder in ("benchmarks", "examples", "tests")
        for path in (REPO / folder).rglob("*.py")
        if _EXAMPLE_LINE.search(path.read_text()) and path != Path(__file__).resolve()
    )
    assert "benchmarks/alloc_scatter.py" in files  # found by the same rule as the rest
    done = run_python("-c", _SCRIPTS_RUNNER, *files, env={"CUDA_VISIBLE_DEVICES": ""}, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.splitlines()[-1])
    assert not found["failures"], "examples that fail:\n" + "\n".join(found["failures"])
    assert any(name.endswith("kept_indices") for name in found["ran"]), found["ran"]
