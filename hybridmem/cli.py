"""The ``hybridmem`` command: ``hybridmem doctor [--json]``.

``doctor`` reports what decides GPU memory behaviour in this environment: torch
and CUDA versions, the allocator backend, the effective allocator settings with
the source of each, and the version-dependent torch APIs found. It never
initialises CUDA. Exit code 0 when nothing blocks hybridmem, 1 when something
does (a malformed allocator env variable, say), 2 for bad command-line usage.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from collections.abc import Sequence
from typing import Any

import hybridmem
from hybridmem import _torch
from hybridmem._env import DISABLE_ENV, disabled
from hybridmem._errors import AllocatorSettingsError
from hybridmem.allocator import ENV_VARS, allocator_config

__all__ = ["doctor_report", "main"]


def doctor_report() -> dict[str, Any]:
    """Collect the doctor's findings as a JSON-ready dict (no CUDA initialisation)."""
    problems: list[str] = []
    notes: list[str] = []
    report: dict[str, Any] = {
        "hybridmem": hybridmem.__version__,
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
        config = allocator_config()
    except AllocatorSettingsError as exc:
        problems.append(str(exc))
        report["allocator"] = {
            "env": {n: os.environ[n] for n in ENV_VARS if n in os.environ},
            "error": str(exc),
        }
    else:
        report["allocator"] = config.as_dict()
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
    report["notes"] = notes
    report["problems"] = problems
    report["ok"] = not problems
    return report


def _print_human(report: dict[str, Any]) -> None:
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
        print(f"  backend: {alloc['backend']}   setter: {alloc['setter'] or 'none'}")
        for key, item in alloc["settings"].items():
            print(f"  {key:34} {item['value']:>18}  [{item['source']}: {item['origin']}]")
    if report["notes"]:
        print("\nnotes:")
        for note in report["notes"]:
            print(f"  - {note}")
    if report["problems"]:
        print("\nproblems:")
        for problem in report["problems"]:
            print(f"  - {problem}")
    print("\nverdict:", "ok" if report["ok"] else "something blocks hybridmem (see problems)")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``hybridmem`` command line; return the process exit code."""
    parser = argparse.ArgumentParser(
        prog="hybridmem", description="GPU memory phase switching for hybrid RL engines."
    )
    parser.add_argument("--version", action="version", version=f"hybridmem {hybridmem.__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    doctor = commands.add_parser(
        "doctor", help="report versions, allocator settings and their sources, torch APIs"
    )
    doctor.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    report = doctor_report()
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
    else:
        _print_human(report)
    return 0 if report["ok"] else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
