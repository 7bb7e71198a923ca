"""Record what each torch version's own parser answers for the corpus (dev tool).

    bash tests/torch_parser/build.sh /tmp/tp
    python -m tests.torch_parser.record /tmp/tp      # rewrites recorded.json

For every case of :func:`tests.torch_parser.corpus.corpus` and every built
version: whether torch took the env (and its state then), and for each setter
call "ok" or torch's message, with torch's state after it (even after a refusal:
what torch kept). States are stored as their differences from torch's defaults.
``tests/test_torch_rules.py`` replays the file against
:class:`hybridmem._torch_rules.TorchRules`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.torch_parser.corpus import corpus

HERE = Path(__file__).resolve().parent
RECORDED = HERE / "recorded.json"
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
)


def _run(work: Path, version: str, env: dict[str, str], commands: list[str]) -> list[str]:
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
        input="".join(c + "\n" for c in commands),
        capture_output=True,
        text=True,
        env=environ,
        check=False,
    )
    return done.stdout.splitlines()


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
                rows.append({"env": "refused"})
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


if __name__ == "__main__":
    data = record(Path(sys.argv[1]))
    RECORDED.write_text(json.dumps(data, separators=(",", ":"), sort_keys=True) + "\n")
    print(f"wrote {RECORDED} ({RECORDED.stat().st_size // 1024} KiB)", file=sys.stderr)
