"""The benchmarks' helper processes: every wait on them ends, with an error that says why.

``hybridmem.bench.peers``: :class:`LinePeer` (a line protocol over a child's stdin and
stdout, each answer awaited with a deadline) and :func:`run_child` (a child run to its
end with both pipes read at once, killed when it falls silent). The children here
are tiny Python programs; none needs a GPU.
"""

from __future__ import annotations

import sys
import time
import types
from dataclasses import replace
from typing import Any

import pytest

from hybridmem.bench import run as bench_run
from hybridmem.bench.peers import ChildOutput, LinePeer, PeerError, run_child
from hybridmem.bench.plan import ALL_STRATEGIES, BenchPlan, plan
from tests.helpers import run_python

ECHO = (
    "import sys\n"
    "print('ready', flush=True)\n"
    "for line in sys.stdin:\n"
    "    word = line.strip()\n"
    "    if word == 'exit':\n"
    "        sys.exit(3)\n"
    "    if word != 'mute':\n"
    "        print(word, flush=True)\n"
)


def test_a_line_peer_answers_each_line_in_turn() -> None:
    peer = LinePeer(ECHO, what="echo")
    peer.ask("hello", expect="hello")
    peer.send("a")
    peer.send("b")  # two answers queued: read one at a time, in order
    assert peer.answer() == "a"
    assert peer.answer() == "b"
    assert peer.close() == 0


def test_a_peer_that_exits_is_an_error_at_once_not_at_the_timeout() -> None:
    peer = LinePeer(ECHO, what="echo", timeout_s=60)
    started = time.monotonic()
    with pytest.raises(PeerError, match=r"the echo \(pid \d+\) exited \(code 3\)"):
        peer.ask("exit")
    assert time.monotonic() - started < 30  # its end of file, not the 60 s deadline
    assert peer.process.poll() == 3


def test_a_peer_that_does_not_answer_is_an_error_after_its_timeout() -> None:
    peer = LinePeer(ECHO, what="echo")  # started with room to start, however loaded the host
    peer.timeout_s = 0.3  # then this answer, which never comes, is waited for 0.3 s
    with pytest.raises(
        PeerError,
        match=r"printed no answer for 0.3 s: it is stuck \(or needs more than timeout_s=0.3\)",
    ):
        peer.ask("mute")
    assert peer.close() == 0


def test_a_wrong_answer_names_both_words() -> None:
    peer = LinePeer(ECHO, what="echo")
    with pytest.raises(PeerError, match="the echo answered 'hi', not 'done'"):
        peer.ask("hi")
    peer.close()


def test_a_peer_that_never_starts_is_an_error() -> None:
    with pytest.raises(PeerError, match=r"exited \(code 7\)"):
        LinePeer("import sys; sys.exit(7)", what="starter")


def test_a_peer_that_never_says_ready_is_killed_not_left_behind(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    made: list[LinePeer] = []
    real_expect = LinePeer.expect

    def expect(self: LinePeer, word: str) -> None:
        made.append(self)
        real_expect(self, word)

    monkeypatch.setattr(LinePeer, "expect", expect)
    with pytest.raises(PeerError, match=r"printed no answer for 0\.3 s"):
        LinePeer("import time; time.sleep(600)", what="mute", timeout_s=0.3)
    assert made[0].process.poll() is not None


def test_a_peer_that_ignores_its_closed_input_is_killed_and_said_so() -> None:
    code = "import time\nprint('ready', flush=True)\ntime.sleep(600)\n"
    peer = LinePeer(code, what="sleeper")  # room to start, however loaded the host
    peer.timeout_s = 0.3
    with pytest.raises(PeerError, match=r"did not exit within 0.3 s of its input closing: killed"):
        peer.close()
    assert peer.process.poll() is not None  # gone, not left behind


@pytest.mark.parametrize("bad", [0, -1.0, float("nan")])
def test_a_peer_timeout_must_be_positive(bad: float) -> None:
    with pytest.raises(ValueError, match=r"timeout_s=.*expected a number of seconds > 0"):
        LinePeer(ECHO, timeout_s=bad)
    with pytest.raises(ValueError, match=r"silence_s=.*expected a number of seconds > 0"):
        run_child([sys.executable, "-c", "pass"], silence_s=bad)


def test_run_child_reads_both_pipes_so_a_large_stdout_cannot_block_it() -> None:
    # 1 MiB on stdout, well past a pipe's 64 KiB, while stderr stays open: a parent
    # that read stderr to its end first would wait on a child blocked on stdout.
    code = (
        "import sys\n"
        "for i in range(3):\n"
        "    print(f'progress {i} 3', file=sys.stderr, flush=True)\n"
        "sys.stdout.write('x' * (1 << 20) + '\\n'); sys.stdout.flush()\n"
        "print('last', file=sys.stderr, end='')\n"
    )
    lines: list[str] = []
    out = run_child([sys.executable, "-c", code], on_line=lines.append, silence_s=60)
    assert out.returncode == 0
    assert out.silent_s is None
    assert out.stdout == "x" * (1 << 20) + "\n"
    assert lines == ["progress 0 3", "progress 1 3", "progress 2 3", "last"]


def test_run_child_kills_a_silent_child_and_says_how_long_it_was_silent() -> None:
    code = "import time\nprint('started', flush=True)\ntime.sleep(600)\n"
    started = time.monotonic()
    out = run_child([sys.executable, "-c", code], silence_s=0.5)
    assert time.monotonic() - started < 60
    assert out.returncode is None
    assert out.silent_s is not None
    assert out.silent_s >= 0.5
    assert out.stdout == "started\n"


def test_run_child_returns_a_failing_childs_code() -> None:
    out = run_child([sys.executable, "-c", "import sys; sys.exit(5)"], silence_s=60)
    assert out == ChildOutput(5, "")


def _child_run_with(monkeypatch: pytest.MonkeyPatch, output: ChildOutput) -> dict[str, Any]:
    def fake_run_child(command: list[str], **kw: Any) -> ChildOutput:
        assert command[1:4] == ["-m", "hybridmem.bench.run", "hybridmem"]
        kw["on_line"]("progress 1 4")
        kw["on_line"]("Traceback (most recent call last):")
        kw["on_line"]("RuntimeError: engine answered ('error', 'boom')")
        return output

    monkeypatch.setattr(bench_run, "run_child", fake_run_child)
    p = plan(80 << 30, quick=True)
    result: dict[str, Any] = bench_run.child_run("hybridmem", p, None)
    return result


def test_the_bench_reports_a_strategy_killed_for_its_silence(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    result = _child_run_with(monkeypatch, ChildOutput(None, "", 900.0))
    errors = result["summary"]["errors"]
    assert errors[0] == "no output for 900 s: killed (stuck?)"
    assert "engine answered ('error', 'boom')" in errors[1]
    assert result["summary"]["strategy"] == "hybridmem"


def test_the_bench_reports_a_failed_strategy_with_its_last_lines(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    result = _child_run_with(monkeypatch, ChildOutput(1, ""))
    assert "RuntimeError: engine answered" in result["summary"]["errors"][0]
    assert "progress" not in result["summary"]["errors"][0]  # the bar's lines are not errors


def test_the_bench_reads_a_strategys_figures_from_its_last_stdout_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    result = _child_run_with(monkeypatch, ChildOutput(0, 'noise\n{"summary": {"x": 1}}\n'))
    assert result == {"summary": {"x": 1}}
    empty = _child_run_with(monkeypatch, ChildOutput(0, ""))
    assert empty["summary"]["errors"] == ["exited 0 but printed no figures"]


def test_the_bench_ends_each_strategys_bar_with_its_wall_time(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    clock = iter([100.0, 137.4])  # the child's start, its end
    monkeypatch.setattr(bench_run, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
    _child_run_with(monkeypatch, ChildOutput(0, '{"summary": {"x": 1}}\n'))
    bar = capsys.readouterr().err
    assert bar.endswith("] 1/4  37 s\n"), bar


@pytest.mark.parametrize("name", ALL_STRATEGIES)
def test_every_strategy_reaches_its_run_through_the_child_process(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """What ``child_run`` starts, the child's entry accepts: every strategy, the plan intact.

    The command is run in this process (``child_main`` on its arguments) with the run
    itself faked; a name the parent runs but the child refused would fail here.
    """
    ran: list[tuple[str, BenchPlan, str | None]] = []

    def fake_run_strategy(n: str, p: BenchPlan, timeline: str | None = None) -> dict[str, Any]:
        ran.append((n, p, timeline))
        return {"summary": {"strategy": n, "errors": []}}

    def run_child_here(command: list[str], **kw: Any) -> ChildOutput:
        assert command[1:3] == ["-m", "hybridmem.bench.run"]
        try:
            printed = bench_run.child_main(command[3:])
        except SystemExit:  # what the real child exits with: the parent reports it
            return ChildOutput(1, "")
        return ChildOutput(0, printed + "\n")

    monkeypatch.setattr(bench_run, "run_strategy", fake_run_strategy)
    monkeypatch.setattr(bench_run, "run_child", run_child_here)
    # tms's child runs preloaded with torch_memory_saver's library, not installed here
    monkeypatch.setattr("hybridmem.bench.engine_memory.preloaded", lambda env: dict(env))
    p = replace(plan(80 << 30, quick=True), need=0.5)
    result = bench_run.child_run(name, p, "tl")
    assert result == {"summary": {"strategy": name, "errors": []}}
    assert ran == [(name, p, f"tl.{name}")]


def test_the_child_refuses_an_unknown_strategy_before_anything_runs() -> None:
    with pytest.raises(SystemExit, match="unknown strategy 'nope'; strategies are naive, "):
        bench_run.child_main(["nope", "{}"])


def test_a_trainer_that_fails_exits_though_its_engine_still_waits() -> None:
    """The engine process is daemonic: the failing trainer's exit ends it, not waits on it.

    The traceback keeps the trainer's end of the pipe open, so the engine never sees
    EOF; multiprocessing joins children that are not daemonic at exit, and the
    strategy would hang until the bench killed it for its silence, its error lost.
    """
    script = (
        "import multiprocessing as mp\n"
        "from hybridmem.bench.engine import start_engine\n"
        "from tests.helpers import answer_then_wait\n"
        "ctx = mp.get_context('spawn')\n"
        "conn, child = ctx.Pipe()\n"
        "start_engine(ctx, answer_then_wait, (child,), 'handmade')\n"
        "assert conn.recv() == 'up'\n"
        "raise RuntimeError('the trainer failed mid-cycle')\n"
    )
    done = run_python("-c", script, timeout=240)  # a hang fails here, by TimeoutExpired
    assert done.returncode == 1, done.stderr
    assert "RuntimeError: the trainer failed mid-cycle" in done.stderr
