"""Record what each torch version's own parser answers for the corpus (dev tool).

    bash tests/torch_parser/build.sh /tmp/tp
    python -m tests.torch_parser.record /tmp/tp      # rewrites recorded.json
    python -m tests.torch_parser.record /tmp/tp --generated 2.13.0 2.14.1 2.15.0
                                                     # rewrites recorded_generated.json.gz

For every case of :func:`tests.torch_parser.corpus.corpus` and every built
version: whether torch took the env (and its state then), and for each setter
call "ok" or torch's message, with torch's state after it (even after a refusal:
what torch kept). States are stored as their differences from torch's defaults.
``tests/test_torch_rules.py`` replays the file against
:class:`hybridmem._torch_rules.TorchRules`.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tests.torch_parser.corpus import corpus
from tests.torch_parser.generate import cases as generated_cases

HERE = Path(__file__).resolve().parent
RECORDED = HERE / "recorded.json"
GENERATED = HERE / "recorded_generated.json.gz"
#: The generated cases recorded: seed and count (each case a chain of 1-6 strings).
GENERATED_SEED, GENERATED_COUNT = 2026_12_01, 7000
VERSIONS = (
    "2.4.1",
    "2.5.1",
    "2.6.0",
    "2.7.1",
    "2.8.0",
    "2.9.1",
    "2.10.0",
    "2.11.0",
    "2.12.0",
    "2.13.0",
    "2.14.1",
    "2.15.0",
)


def _run(
    work: Path, version: str, env: dict[str, str], commands: list[str], *, code: bool = False
) -> Any:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("PYTORCH_")}
    environ.update(env)
    cuda = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    environ["LD_LIBRARY_PATH"] = ":".join(
        [
            str(work / "x" / version / "torch" / "lib"),
            str(work / "rt/nvidia/cuda_runtime/lib"),
            f"{cuda}/lib64",
        ]
    )
    done = subprocess.run(
        [str(work / f"probe-{version}")],
        input="".join(c + "\n" for c in commands).encode(),
        capture_output=True,
        env=environ,
        check=False,
    )
    # Bytes, split at "\n" only: torch's messages quote the string, which may hold "\r"
    # (text mode turns it into a line end) or "\x1c" (str.splitlines() cuts there).
    lines = done.stdout.decode("utf-8", "replace").split("\n")[:-1]
    return (lines, done.returncode) if code else lines


def _state(line: str) -> dict[str, str]:
    return dict(item.split("=", 1) for item in line.removeprefix("state ").split())


def _diff(state: dict[str, str], base: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in state.items() if base.get(k) != v}


def record(work: Path) -> dict[str, Any]:
    cases = corpus()
    results: dict[str, list[Any]] = {}
    for version in VERSIONS:
        base = _state(_run(work, version, {}, [])[0])
        rows: list[Any] = []
        for case in cases:
            commands: list[str] = []
            for text in case["sets"]:
                commands += ["set " + text, "get"]
            out = _run(work, version, case["env"], commands)
            if not out or not out[0].startswith("state "):
                # "envfail": torch refused the env; nothing at all: it aborted at start-up
                aborted = not out or not out[0].startswith("envfail ")
                rows.append({"env": "abort" if aborted else "refused"})
                continue
            row: dict[str, Any] = {"env": _diff(_state(out[0]), base), "sets": []}
            for j in range(len(case["sets"])):
                if len(out) < 3 + 2 * j:  # torch crashed (undefined behaviour): refused
                    row["sets"].append(["crash", None])
                    break
                verdict = out[1 + 2 * j]
                row["sets"].append(
                    ["ok" if verdict == "ok" else "refused", _diff(_state(out[2 + 2 * j]), base)]
                )
            rows.append(row)
        results[version] = [base, rows]
        print(f"recorded torch {version}: {len(rows)} cases", file=sys.stderr)
    return {"cases": cases, "results": results}


def cases_digest(cases: list[dict[str, Any]]) -> str:
    """What the recording was made for: the cases, as a short hash."""
    return hashlib.sha256(json.dumps(cases, sort_keys=True).encode()).hexdigest()[:16]


def _generated_row(work: Path, version: str, base: dict[str, str], case: dict[str, Any]) -> Any:
    commands: list[str] = []
    for text in case["sets"]:
        commands += ["setx " + text.encode().hex(), "get"]
    out = _run(work, version, case["env"], commands)
    if not out or not out[0].startswith(("state ", "envfail ")):
        return {"env": "abort"}  # killed at start-up: torch aborts the interpreter at import
    if out[0].startswith("envfail "):
        return {"env": "refused"}
    row: dict[str, Any] = {"env": _diff(_state(out[0]), base), "sets": []}
    for j in range(len(case["sets"])):
        if len(out) < 3 + 2 * j:  # the process died (undefined behaviour): never taken
            row["sets"].append(["crash", None])
            break
        verdict = out[1 + 2 * j]
        row["sets"].append(
            ["ok" if verdict == "ok" else "refused", _diff(_state(out[2 + 2 * j]), base)]
        )
    return row


def record_generated(work: Path, versions: list[str]) -> dict[str, Any]:
    """The generated cases, answered by each version's parser (8 probes at a time)."""
    cases = generated_cases(GENERATED_SEED, GENERATED_COUNT)
    results: dict[str, Any] = {}
    for version in versions:
        base = _state(_run(work, version, {}, [])[0])
        with ThreadPoolExecutor(8) as pool:
            rows = list(pool.map(functools.partial(_generated_row, work, version, base), cases))
        results[version] = [base, rows]
        strings = sum(len(c["sets"]) for c in cases) + sum(len(c["env"]) for c in cases)
        print(f"recorded torch {version}: {len(rows)} cases, {strings} strings", file=sys.stderr)
    return {
        "seed": GENERATED_SEED,
        "count": GENERATED_COUNT,
        "digest": cases_digest(cases),
        "cases": cases,
        "results": results,
    }


if __name__ == "__main__":
    if "--generated" in sys.argv:
        chosen = sys.argv[sys.argv.index("--generated") + 1 :]
        data = record_generated(Path(sys.argv[1]), chosen)
        blob = json.dumps(data, separators=(",", ":"), sort_keys=True).encode()
        GENERATED.write_bytes(gzip.compress(blob, mtime=0))
        print(f"wrote {GENERATED} ({GENERATED.stat().st_size // 1024} KiB)", file=sys.stderr)
    else:
        data = record(Path(sys.argv[1]))
        RECORDED.write_text(json.dumps(data, separators=(",", ":"), sort_keys=True) + "\n")
        print(f"wrote {RECORDED} ({RECORDED.stat().st_size // 1024} KiB)", file=sys.stderr)
