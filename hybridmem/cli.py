"""The ``hybridmem`` command: ``doctor``, ``plot`` and ``bench``.

``hybridmem doctor [--json] [--no-probe]`` reports what decides GPU memory behaviour
in this environment: torch and CUDA versions, the allocator backend, the effective
allocator settings with the source of each, the version-dependent torch APIs found,
what CUDA IPC can do here (classic and expandable segments, pidfd_getfd, ptrace
scope, container hints; probed in child processes), whether expandable segments can
be toggled at runtime, the installed vLLM / SGLang / torch_memory_saver with the
known incompatibilities for them, and verl: its version, whether ``HYBRIDMEM_VERL=1``
asks for the drop-in, and what its workers would fail to import. It never initialises
CUDA in its own process. Exit code 0 when nothing blocks, 1 when something does (a
malformed allocator env variable, CUDA IPC broken, the verl drop-in asked for where
verl's workers cannot import), 2 for bad command-line usage.

``hybridmem plot TIMELINE... -o out.png`` draws a recorded timeline (see
:func:`hybridmem.record`): memory over time, phases shaded and annotated.

``hybridmem bench [--quick] [--cycles N] [--json F] [--plot F] [--timeline PREFIX]``
runs a synthetic hybrid engine under four strategies on a GPU (see
:mod:`hybridmem.bench`); exit 2 without one. ``hybridmem bench --from-json F...
[--plot P]`` prints (and draws) saved results anywhere. ``hybridmem bench --scale
[GIB...]`` times the switch at trainer states of 8, 32 and 64 GiB against the
pinned-copy ceiling, and plots time against size.

Why this module is long: it is the one place that says what each command accepts,
the bench's flags with the checks between them (``--scale`` with ``--need``, the
engine with ``--vllm-files``) refused before any work starts, with argparse's usage.
The work itself lives in :mod:`hybridmem.bench` and :mod:`hybridmem.observe`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import warnings
from collections.abc import Sequence
from importlib import metadata
from typing import TYPE_CHECKING, Any

from hybridmem._env import DISABLE_ENV, disabled
from hybridmem._errors import AllocatorSettingsError, HybridMemWarning
from hybridmem._files import FileProblem, timeline_env_problem

# Nothing here imports torch at module level: `hybridmem doctor` starts its IPC probe
# first, so the probe's interpreters import torch while this one does.
from hybridmem._version import __version__
from hybridmem.allocator.import_check import env_kills_torch
from hybridmem.engine.memory_saver import memory_saver_facts
from hybridmem.integrations.verl.facts import verl_facts
from hybridmem.ipc import _launch as _probe_launch

if TYPE_CHECKING:
    from hybridmem.ipc.capabilities import IpcCapabilities

__all__ = ["doctor_report", "main"]


ENGINES = ("vllm", "sglang", "torch_memory_saver")


def engine_versions() -> dict[str, str | None]:
    """Installed versions of the inference engines, read from metadata (never imported)."""
    versions: dict[str, str | None] = {}
    for name in ENGINES:
        try:
            versions[name] = metadata.version(name.replace("_", "-"))
        except metadata.PackageNotFoundError:
            try:
                versions[name] = metadata.version(name)
            except metadata.PackageNotFoundError:
                versions[name] = None
    return versions


def _engine_notes(engines: dict[str, str | None]) -> list[str]:
    """What applies to the installed engines, and their known incompatibilities here."""
    from hybridmem.integrations.vllm.releases import pool_notes

    vllm = engines.get("vllm")
    return pool_notes(vllm, os.environ) if vllm else []


def ipc_capabilities() -> IpcCapabilities:
    """The IPC probe's result for the current device (adopts a probe started early)."""
    from hybridmem.ipc.capabilities import ipc_capabilities as probe

    return probe()


def _ipc_section(caps: IpcCapabilities) -> dict[str, Any]:
    data = caps.as_dict()
    facts = caps.details
    if caps.cuda:
        toggles = facts.get("expandable_legacy_ipc") is False and facts.get("classic_legacy_ipc")
        data["expandable_toggle_works"] = bool(toggles)
    else:
        data["expandable_toggle_works"] = None
    return data


def _rules_checked() -> str:
    """How this torch's allocator-settings rules are known: recorded, live, or neither."""
    from hybridmem import _torch
    from hybridmem.allocator.rules import RECORDED_VERSIONS, TorchRules

    rules = TorchRules(_torch.torch_version(), _torch.cuda_built())
    last = RECORDED_VERSIONS[-1]
    if rules.recorded:
        return (
            f"recorded: the model agrees with {rules.label}'s own parser on every recorded string"
        )
    if _torch.settings_setter_name() is not None:
        return (
            f"{rules.label} is newer than the recorded ones (last: {last}): read by {last}'s "
            "rules, and every string is judged by torch's own setter (applied, read back, "
            "rolled back on refusal)"
        )
    return f"neither recorded nor checkable live here (last recorded: {last})"


def _cuda_build_refusal(variable: str | None, text: str) -> str | None:
    """On a CPU build: why the CUDA build of this torch would refuse the env, or None.

    A CPU build has no CUDA parser and skips keys it does not know, so a typo
    (``expandable_segment:True``) passes here and fails on every GPU machine.
    """
    from hybridmem import _torch
    from hybridmem.allocator.rules import TorchRules

    if variable is None or _torch.cuda_built():
        return None
    error = TorchRules(_torch.torch_version(), True, None).run(text).error
    if error is None:
        return None
    return (
        f"{variable}={text!r}: {error}. This CPU build of torch skips what it does not know, "
        "but its CUDA build refuses the value at the first CUDA allocation; fix it or unset "
        f"{variable}"
    )


def _nccl_section() -> tuple[dict[str, Any], str | None]:
    """What NCCL this torch loaded and whether it can suspend communicators (a note if not)."""
    from hybridmem import _torch

    if not _torch.cuda_built():
        return {"version": None, "suspend": False, "library": None}, None
    calls = _torch.nccl_calls()
    section = {
        "version": _torch.nccl_version(),
        "suspend": bool(calls is not None and calls.has_suspend),
        "library": getattr(calls, "path", None),
    }
    if section["suspend"] or section["version"] is None:
        return section, None
    return section, (
        f"NCCL {section['version']} cannot suspend communicators (ncclCommSuspend came "
        "in 2.29.7): the process groups' buffers stay on the device through the rollout "
        "(verl#6266: 7-10 GB a rank), and hm.suspend_communicators() says so once and "
        "changes nothing; docs/communicators.md says how to get a newer NCCL"
    )


def doctor_report(*, probe: bool = True) -> dict[str, Any]:
    """Collect the doctor's findings as a JSON-ready dict (no CUDA in this process).

    Args:
        probe: run the CUDA IPC probe (child processes; a few seconds with a GPU).
    """
    from hybridmem import _torch
    from hybridmem.allocator.effective import ENV_VARS
    from hybridmem.allocator.state import allocator_state

    problems: list[str] = []
    notes: list[str] = []
    report: dict[str, Any] = {
        "hybridmem": __version__,
        "python": platform.python_version(),
        "torch": {
            "version": _torch.torch_version_string(),
            "cuda_build": _torch.cuda_version(),
            "cuda_available": _torch.cuda_available(),
            "device_count": _torch.device_count(),
            "cuda_initialized": _torch.cuda_initialized(),
        },
        "kill_switch": {DISABLE_ENV: os.environ.get(DISABLE_ENV), "active": disabled()},
        "torch_apis": _torch.api_report(),
    }
    try:
        # What hybridmem warns about once (an env variable torch ignores, a value it
        # misreads) belongs in the report, not in a traceback-looking warning.
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always", HybridMemWarning)
            config = allocator_state()
        notes.extend(str(w.message) for w in seen if issubclass(w.category, HybridMemWarning))
    except AllocatorSettingsError as exc:
        problems.append(str(exc))
        report["allocator"] = {
            "env": {n: os.environ[n] for n in ENV_VARS if n in os.environ},
            "error": str(exc),
        }
    else:
        report["allocator"] = config.as_dict()
        report["allocator"]["rules"] = _rules_checked()
        variable = config.env_variable
        refusal = _cuda_build_refusal(variable, config.env.get(variable or "", ""))
        if refusal is not None:
            problems.append(refusal)
            report["allocator"]["cuda_build_refuses"] = refusal
        if config.backend == "cudaMallocAsync":
            notes.append(
                "backend is cudaMallocAsync: expandable segments and caching-allocator "
                "settings do not apply; hybridmem's allocator toggles are no-ops"
            )
    if _torch.settings_setter_name() is None:
        notes.append("this torch has no allocator-settings setter: allocator toggles are no-ops")
    if not _torch.cuda_built():
        notes.append("CPU-only torch build: nothing to manage on a GPU here")
    elif not _torch.cuda_available():
        notes.append("CUDA build, but no usable GPU is visible (driver or CUDA_VISIBLE_DEVICES?)")
    if disabled():
        notes.append(f"{DISABLE_ENV} is on: every hybridmem primitive is a no-op")
    engines = engine_versions()
    report["engines"] = engines
    expandable_env = "allocator" in report and bool(
        report["allocator"].get("settings", {}).get("expandable_segments", {}).get("value")
        == "True"
    )
    notes.extend(_engine_notes(engines))
    report["nccl"], nccl_note = _nccl_section()
    if nccl_note is not None:
        notes.append(nccl_note)
    verl = verl_facts()
    report["verl"] = verl.as_dict()
    notes.extend(verl.notes)
    problems.extend(verl.problems)
    saver = memory_saver_facts(
        expandable_effective=expandable_env, version=engines.get("torch_memory_saver")
    )
    report["torch_memory_saver"] = saver.as_dict() if saver else None
    if saver is not None:
        problems.extend(saver.problems)
        notes.extend(saver.notes)
    if probe:
        caps = ipc_capabilities()
        report["ipc"] = _ipc_section(caps)
        if caps.blocking:
            problems.append(f"CUDA IPC does not work here: {caps.reason}. {caps.advice}")
        elif caps.cuda and not caps.expandable_ipc:
            if caps.fd_passing:
                notes.append(
                    "torch cannot share tensors in expandable segments here "
                    f"({caps.reason}), but fd passing can: hm.ipc_export, "
                    "hm.ipc_fd_sharing() or WeightBucket(transport='fd')"
                )
            else:
                notes.append(f"tensors in expandable segments cannot be shared: {caps.reason}")
        if report["ipc"]["expandable_toggle_works"] is False:
            notes.append(
                "a tensor allocated after switching expandable segments on at runtime was "
                "not in an expandable segment: runtime toggles have no effect here"
            )
    report["notes"] = notes
    report["problems"] = problems
    report["ok"] = not problems
    return report


def _print_human(report: dict[str, Any]) -> None:
    from hybridmem.allocator.effective import ENV_VARS

    t = report["torch"]
    print(f"hybridmem {report['hybridmem']}  (python {report['python']})")
    print(
        f"torch {t['version']}  CUDA build: {t['cuda_build'] or 'none (CPU-only)'}  "
        f"GPUs visible: {t['device_count']}  CUDA initialised: {t['cuda_initialized']}"
    )
    print("\ntorch APIs:")
    for name, found in report["torch_apis"].items():
        print(f"  {'found  ' if found else 'missing'}  {name}")
    alloc = report["allocator"]
    print("\nallocator:")
    for name in ENV_VARS:
        print(f"  {name}={alloc['env'].get(name, '(unset)')}")
    if "error" in alloc:
        print(f"  ERROR: {alloc['error']}")
    else:
        reads = alloc["env_variable"] or "neither (none is set)"
        print(f"  {alloc['torch']} reads: {reads}")
        print(f"  rules: {alloc['rules']}")
        for name in alloc["ignored_env"]:
            print(f"  IGNORED: {name} is set, but this torch does not read it")
        print(f"  backend: {alloc['backend']}   setter: {alloc['setter'] or 'none'}")
        for key, item in alloc["settings"].items():
            print(f"  {key:34} {item['shown']:>18}  [{item['source']}: {item['origin']}]")
        if alloc.get("cuda_build_refuses"):
            print(f"  ERROR: {alloc['cuda_build_refuses']}")
    engines = report.get("engines", {})
    print("\nengines: " + ", ".join(f"{k} {v or '(not installed)'}" for k, v in engines.items()))
    nccl = report.get("nccl") or {}
    if nccl.get("version"):
        can = "can" if nccl["suspend"] else "cannot"
        print(f"NCCL {nccl['version']}: {can} suspend communicators ({nccl['library']})")
    print(report["verl"]["said"])
    saver = report.get("torch_memory_saver")
    if saver:
        library = saver["preload_library"] or "none in LD_PRELOAD"
        print(f"torch_memory_saver {saver['version']}: hook mode {saver['hook_mode']} ({library})")
    ipc = report.get("ipc")
    if ipc is not None:

        def word(value: object) -> str:
            return "not probed" if value is None else ("works" if value else "FAILS")

        print(f"\nCUDA IPC (device {ipc['device']}, probed in {ipc['elapsed_s']:.1f} s):")
        print(f"  classic segments:      {word(ipc['classic_ipc'])}")
        handle = f" (handle {ipc['expandable_handle']})" if ipc["expandable_handle"] else ""
        print(f"  expandable segments:   {word(ipc['expandable_ipc'])}{handle}")
        print(f"  fd passing:            {word(ipc.get('fd_passing'))}")
        denied = f" (by {ipc['denied_by']})" if ipc["denied_by"] else ""
        print(f"  pidfd_getfd:           {ipc['pidfd_getfd']}{denied}")
        print(f"  expandable toggle:     {word(ipc['expandable_toggle_works'])}")
        scope = ipc["ptrace_scope"]
        print(f"  Yama ptrace_scope:     {'none' if scope is None else scope}")
        print(f"  seccomp (consumer):    {ipc['seccomp']}")
        print(f"  container:             {'; '.join(ipc['container_hints']) or 'no signs'}")
        if ipc["reason"]:
            print(f"  reason: {ipc['reason']}")
        print(f"  advice: {ipc['advice']}")
    if report["notes"]:
        print("\nnotes:")
        for note in report["notes"]:
            print(f"  - {note}")
    if report["problems"]:
        print("\nproblems:")
        for problem in report["problems"]:
            print(f"  - {problem}")
    print("\nverdict:", "ok" if report["ok"] else "something blocks hybridmem (see problems)")


def _plot(timelines: list[str], output: str | None, title: str, trace: str | None) -> int:
    from hybridmem.observe.plot import PlotError, plot_timeline, write_merged_trace

    try:
        if trace:
            print(f"wrote {write_merged_trace(timelines, trace)}")
        if output:
            print(f"wrote {plot_timeline(timelines, output, title=title)}")
    except PlotError as exc:
        print(f"hybridmem plot: {exc}", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``hybridmem`` command line; return the process exit code."""
    parser = argparse.ArgumentParser(
        prog="hybridmem", description="GPU memory phase switching for hybrid RL engines."
    )
    parser.add_argument("--version", action="version", version=f"hybridmem {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    doctor = commands.add_parser(
        "doctor", help="report versions, allocator settings and their sources, torch APIs"
    )
    doctor.add_argument("--json", action="store_true", help="print one JSON object")
    doctor.add_argument(
        "--no-probe", action="store_true", help="skip the CUDA IPC probe (child processes)"
    )
    plot = commands.add_parser(
        "plot", help="draw recorded timelines: memory over time by phase, one row per process"
    )
    plot.add_argument(
        "timeline",
        nargs="+",
        help="JSON-lines timeline file(s), one per process (trainer, engine, ranks): merged",
    )
    plot.add_argument("-o", "--output", help="the PNG to write")
    plot.add_argument(
        "--trace", help="also write the files merged as one Chrome trace (one row per process)"
    )
    plot.add_argument("--title", default="", help="the figure's title")
    bench = commands.add_parser(
        "bench", help="run a synthetic hybrid engine several ways and compare (needs a GPU)"
    )
    bench.add_argument("--quick", action="store_true", help="a small model, 6 cycles (< 2 min)")
    bench.add_argument(
        "--json", dest="json_path", help="write every figure here (and after each strategy)"
    )
    bench.add_argument("--plot", dest="plot_path", help="write a PNG of the figures")
    bench.add_argument(
        "--strategies",
        nargs="+",
        default=None,
        choices=["naive", "handrolled", "tms", "hybridmem", "planned", "fraction"],
        help="which strategies to run (default: all; tms where torch_memory_saver is "
        "installed; with --need: hybridmem, planned and fraction)",
    )
    bench.add_argument(
        "--cycles",
        type=int,
        help="cycles per strategy, at least 6: the first is a warm-up, each figure the "
        "median of the rest (default: 6 with --quick and --scale, else 100)",
    )
    bench.add_argument(
        "--model",
        choices=["auto", "torch", "transformers"],
        default="auto",
        help="the trainer's model: a transformers Llama if importable (auto), or torch modules",
    )
    bench.add_argument(
        "--engine",
        choices=["auto", "tms", "tms-torch", "vllm", "vllm-l1", "handmade"],
        default="auto",
        help="the rollout engine's memory: torch_memory_saver regions in preload (tms) or "
        "torch (tms-torch) hook mode (SGLang's), vLLM's sleep-mode pool slept at level 2 "
        "(vllm) or 1 (vllm-l1) as verl drives it, or by hand; auto: tms where it is installed",
    )
    bench.add_argument(
        "--vllm-files",
        metavar="PATH",
        help="with --engine vllm/vllm-l1 where vLLM is not installed: a vLLM wheel "
        "(pip download --no-deps vllm==0.33.0) or a folder of its allocator's files "
        "(sets HYBRIDMEM_VLLM_FILES for the engine process)",
    )
    bench.add_argument(
        "--sleep-backend",
        choices=["cumem", "hybridmem"],
        help="with --engine vllm/vllm-l1: the vLLM sleep-mode backend the engine sleeps "
        "through, vLLM's default (cumem) or hybridmem's (--sleep-mode-backend hybridmem); "
        "default cumem",
    )
    bench.add_argument(
        "--anatomy",
        action="store_true",
        help="record, at each KV wake, what each process's cache is made of and which "
        "allocations hold it (into --json; slower)",
    )
    bench.add_argument(
        "--scale",
        nargs="*",
        type=float,
        metavar="GIB",
        help="the switch at model scale: trainer states of these sizes in GiB (default 8 32 "
        "64), each strategy's switch seconds against the pinned-copy ceiling",
    )
    bench.add_argument(
        "--need",
        nargs="+",
        type=float,
        metavar="SHARE",
        help="with --scale: size the rollout's KV cache so that, with the whole trainer "
        "state on the device, it lacks this share (0 to 1) of the optimizer state; each "
        "share runs offload-all (hybridmem), planned by need (planned) and a fixed half "
        "(fraction)",
    )
    bench.add_argument(
        "--communicators",
        type=int,
        default=0,
        metavar="N",
        help="the trainer holds N NCCL process groups of one rank (made after the engine "
        "starts); runs hybridmem with them held and 'suspended' with them suspended "
        "through the rollout (NCCL 2.29.7+; docs/communicators.md)",
    )
    bench.add_argument(
        "--rollout-s",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="let each rollout last this much longer (a real one generates for seconds; "
        "the bench's own takes about 18 ms), untimed, before the switch back",
    )
    bench.add_argument(
        "--train-s",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="let each cycle's training last this much longer (a real step computes for "
        "seconds), untimed, before the switch to the rollout",
    )
    bench.add_argument(
        "--from-json",
        nargs="+",
        metavar="FILE",
        help="no run: print (and --plot) results saved with --json; several files merge",
    )
    bench.add_argument(
        "--timeline",
        metavar="PREFIX",
        help="record each strategy's cycles: the trainer to PREFIX.<strategy>.jsonl, the "
        "engine to PREFIX.<strategy>.engine.jsonl (hybridmem plot merges them)",
    )
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    if args.command == "plot" and not (args.output or args.trace):
        # The plot subcommand's usage; a timeline that is not there is named first.
        missing = [path for path in args.timeline if not os.path.exists(path)]
        first = f"cannot read timeline {missing[0]}: no such file; and " if missing else ""
        plot.error(f"{first}nothing to write: pass -o FILE.png, --trace FILE.json, or both")
    if args.command == "bench" and args.scale is not None:
        clash = [
            flag
            for flag, given in (
                ("--quick", args.quick),
                ("--from-json", args.from_json),
                ("--timeline", args.timeline),
            )
            if given
        ]
        if clash:
            parser.error(f"--scale runs plans of its own: leave out {', '.join(clash)}")
        bad = [size for size in args.scale if not size > 0]
        if bad:
            parser.error(f"--scale sizes are GiB of trainer state (> 0), got {bad[0]:g}")
    if args.command == "bench" and args.need is not None:
        if args.scale is None:
            parser.error("--need sizes the rollout at model scale: pass --scale too")
        bad_share = [share for share in args.need if not 0 <= share <= 1]
        if bad_share:
            parser.error(f"--need shares are from 0 to 1, got {bad_share[0]:g}")
        plain = [s for s in args.strategies or [] if s in ("naive", "handrolled", "tms")]
        if plain:
            parser.error(
                f"--need compares hybridmem, planned and fraction: leave out {', '.join(plain)}"
            )
    elif args.command == "bench" and {"planned", "fraction"} & set(args.strategies or []):
        parser.error("strategies planned and fraction run with --scale SIZES --need SHARES")
    if args.command == "bench" and args.sleep_backend is not None:
        if not args.engine.startswith("vllm"):
            parser.error(f"--sleep-backend is for --engine vllm or vllm-l1, not {args.engine}")
        # the engine process is started with this process's environment
        os.environ["HYBRIDMEM_BENCH_SLEEP_BACKEND"] = args.sleep_backend
    if args.command == "bench" and args.vllm_files is not None:
        if not args.engine.startswith("vllm"):
            parser.error(f"--vllm-files is for --engine vllm or vllm-l1, not {args.engine}")
        if not os.path.exists(args.vllm_files):
            parser.error(
                f"--vllm-files {args.vllm_files}: no such wheel or folder "
                "(pip download --no-deps vllm==0.33.0)"
            )
        # the engine process is started with this process's environment
        os.environ["HYBRIDMEM_VLLM_FILES"] = os.path.abspath(args.vllm_files)
    if args.command == "bench":
        from hybridmem.bench.plan import MAX_COMMUNICATORS, MAX_PHASE_S, MIN_CYCLES

        for flag, seconds in (("--rollout-s", args.rollout_s), ("--train-s", args.train_s)):
            if not 0 <= seconds <= MAX_PHASE_S:
                parser.error(f"{flag} must be seconds from 0 to {MAX_PHASE_S:g}, got {seconds:g}")
        if not 0 <= args.communicators <= MAX_COMMUNICATORS:
            parser.error(
                f"--communicators must be 0 to {MAX_COMMUNICATORS} process groups, "
                f"got {args.communicators}"
            )
        if args.communicators and (args.scale is not None or args.from_json):
            parser.error("--communicators runs the default plan: leave out --scale/--from-json")
        if args.cycles is not None and args.cycles < MIN_CYCLES:
            parser.error(
                f"--cycles must be at least {MIN_CYCLES} (the first is a warm-up, the figures "
                f"are medians of the rest), got {args.cycles}"
            )
    problem = timeline_env_problem()
    if problem is not None:  # checked before any work, not when the process exits
        print(f"hybridmem: {problem}", file=sys.stderr)
        return 2
    try:
        return _run(args)
    except (FileProblem, AllocatorSettingsError) as exc:  # misuse: one line, no traceback
        print(f"hybridmem {args.command}: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    if args.command == "bench":
        from hybridmem.bench.run import bench as run_bench
        from hybridmem.bench.run import report as bench_report

        if args.from_json:
            return bench_report(args.from_json, json_path=args.json_path, plot_path=args.plot_path)
        if args.scale is not None:
            from hybridmem.bench.scale import bench_scale

            return bench_scale(
                sizes=args.scale or None,
                json_path=args.json_path,
                plot_path=args.plot_path,
                strategies=args.strategies,
                cycles=args.cycles,
                model=args.model,
                engine=args.engine,
                rollout_s=args.rollout_s,
                train_s=args.train_s,
                needs=args.need,
                anatomy=args.anatomy,
            )
        return run_bench(
            quick=args.quick,
            json_path=args.json_path,
            plot_path=args.plot_path,
            strategies=args.strategies,
            timeline=args.timeline,
            cycles=args.cycles,
            model=args.model,
            engine=args.engine,
            anatomy=args.anatomy,
            rollout_s=args.rollout_s,
            train_s=args.train_s,
            communicators=args.communicators,
        )
    if args.command == "plot":
        return _plot(args.timeline, args.output, args.title, args.trace)
    if "torch" not in sys.modules:
        fatal = env_kills_torch()
        if fatal is not None:  # importing torch here would end this process
            if args.json:
                print(json.dumps({"ok": False, "problems": [fatal], "torch_aborts": True}))
            else:
                print(f"ERROR: {fatal}")
                print("\nverdict: something blocks hybridmem (torch was not imported)")
            return 1
    probe = not args.no_probe
    if probe and "torch" not in sys.modules:
        # Device 0: this process never initialises CUDA, so that is its current device.
        _probe_launch.start_early(0)
    try:
        report = doctor_report(probe=probe)
    finally:
        _probe_launch.discard_pending()
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
    else:
        _print_human(report)
    return 0 if report["ok"] else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
