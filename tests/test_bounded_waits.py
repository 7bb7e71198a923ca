"""Nothing hung: no wait on another process without a bound, in the package, examples or benchmarks.

The guarantee (docs/guarantees.md) is the package's, but the examples are what users
copy and the benchmarks are what we run on the GPU: ``hybridmem bench`` read a
child's stderr to its end before its stdout, the examples waited on a rollout
process with a bare ``conn.recv()``, and the benchmarks read their stand-ins'
answers with bare ``readline()``. Read from the source: each rule names a call that
waits forever unless it is given a bound.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.helpers import PACKAGE, REPO, shown

SOURCES = sorted(
    [
        *PACKAGE.rglob("*.py"),
        *(REPO / "examples").glob("*.py"),
        *(REPO / "benchmarks").glob("*.py"),
    ]
)

# Where a line protocol is read, with its deadline: the one place that may.
READS_LINES = {PACKAGE / "bench" / "peers.py"}
# Zero-argument joins of threads of this process (no other process waited for).
THREAD_JOINS = {(PACKAGE / "ipc" / "_probe.py", "warm")}


def _name(node: ast.expr) -> str:
    return node.id if isinstance(node, ast.Name) else ""


def _called(call: ast.Call) -> str:
    """The called name: ``f`` of ``f(...)`` or of ``module.f(...)``."""
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else _name(func)


def _keywords(call: ast.Call) -> set[str]:
    return {k.arg for k in call.keywords if k.arg}


def _calls(tree: ast.AST) -> list[ast.Call]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call)]


def _unbounded(path: Path) -> list[str]:
    found: list[str] = []
    tree = ast.parse(path.read_text(), filename=str(path))
    # An awaitable bounded by asyncio.wait_for(awaitable, timeout) is bounded.
    bounded = {
        id(call.args[0])
        for call in _calls(tree)
        if _called(call) == "wait_for" and call.args and len(call.args) + len(call.keywords) >= 2
    }
    # A ContextVar's get() reads a value; it never waits.
    context_vars = {
        _name(target)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Assign, ast.AnnAssign))
        and isinstance(node.value, ast.Call)
        and _called(node.value) == "ContextVar"
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
    }
    for call in _calls(tree):
        func = call.func
        if not isinstance(func, ast.Attribute) or id(call) in bounded:
            continue
        if func.attr == "get" and _name(func.value) in context_vars:
            continue
        where = f"{shown(path)}:{call.lineno}"
        bare = not call.args and not call.keywords
        owner = _name(func.value)
        if func.attr == "join" and bare and (path, owner) not in THREAD_JOINS:
            found.append(f"{where}: {owner}.join() without a timeout")
        elif func.attr in ("get", "communicate") and bare:
            found.append(f"{where}: {owner}.{func.attr}() without a timeout")
        elif func.attr == "readline" and path not in READS_LINES:
            found.append(f"{where}: readline() from a process (use hybridmem.bench.peers)")
        elif (
            func.attr in ("run", "check_output", "check_call", "call")
            and owner == "subprocess"
            and "timeout" not in _keywords(call)
        ):
            found.append(f"{where}: subprocess.{func.attr}() without timeout=")
    # A Pipe's first end is this side's: where it is made, it is read only through a
    # bound (hybridmem.bench.engine.BoundedConn, or conn.poll(timeout) in a helper),
    # and the other end is closed here or this end wrapped, so a dead child is seen.
    for function in ast.walk(tree):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for stmt in ast.walk(function):
            if not (
                isinstance(stmt, ast.Assign)
                and isinstance(stmt.value, ast.Call)
                and isinstance(stmt.value.func, ast.Attribute)
                and stmt.value.func.attr == "Pipe"
                and isinstance(stmt.targets[0], ast.Tuple)
            ):
                continue
            mine, theirs = (_name(e) for e in stmt.targets[0].elts)
            where = f"{shown(path)}:{stmt.lineno}"
            calls = _calls(function)
            for call in calls:
                func = call.func
                if (
                    isinstance(func, ast.Attribute)
                    and func.attr == "recv"
                    and _name(func.value) == mine
                ):
                    found.append(f"{where}: {mine}.recv() on the line {call.lineno}, unbounded")
            closed = any(
                isinstance(c.func, ast.Attribute)
                and c.func.attr == "close"
                and _name(c.func.value) == theirs
                for c in calls
            )
            wrapped = any(
                _name(c.func) == "BoundedConn" and c.args and _name(c.args[0]) == mine
                for c in calls
            )
            if not (closed or wrapped):
                found.append(f"{where}: neither {theirs}.close() nor BoundedConn({mine}, pid)")
    return found


@pytest.mark.parametrize("path", SOURCES, ids=shown)
def test_no_wait_on_another_process_is_unbounded(path: Path) -> None:
    assert _unbounded(path) == []


def test_the_rules_catch_what_they_are_for(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("tests.test_bounded_waits.REPO", tmp_path)
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import subprocess\n"
        "def main(ctx, queue, process, peer):\n"
        "    conn, child = ctx.Pipe()\n"
        "    conn.recv()\n"
        "    process.join()\n"
        "    queue.get()\n"
        "    peer.stdout.readline()\n"
        "    subprocess.run(['x'])\n"
        "    process.communicate()\n"
        "    asyncio.wait_for(tasks.get())\n"
    )
    found = "\n".join(_unbounded(bad))
    for rule in (
        "conn.recv() on the line 4, unbounded",
        "neither child.close() nor BoundedConn(conn, pid)",
        "process.join() without a timeout",
        "queue.get() without a timeout",
        "readline() from a process",
        "subprocess.run() without timeout=",
        "process.communicate() without a timeout",
        "tasks.get() without a timeout",
    ):
        assert rule in found
    good = tmp_path / "good.py"
    good.write_text(
        "import subprocess\n"
        "def main(ctx, queue, process, BoundedConn):\n"
        "    pipe, child = ctx.Pipe()\n"
        "    conn = BoundedConn(pipe, process.pid)\n"
        "    conn.recv()\n"
        "    process.join(timeout=60)\n"
        "    queue.get(timeout=60)\n"
        "    ', '.join(['a'])\n"
        "    subprocess.run(['x'], timeout=60)\n"
        "    asyncio.wait_for(tasks.get(), 60)\n"
        "    flag = contextvars.ContextVar('flag', default=False)\n"
        "    flag.get()\n"
    )
    assert _unbounded(good) == []
