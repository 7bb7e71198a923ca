"""``hybridmem doctor`` on verl: its version, the drop-in's switch, what its workers need."""

from __future__ import annotations

import importlib.util
import re
from importlib import metadata

import pytest

from hybridmem.cli import doctor_report
from hybridmem.integrations.verl import facts
from hybridmem.integrations.verl.install import ENV, INSTALL_LINE
from tests import wheels
from tests.helpers import REPO


@pytest.fixture
def verl_at(monkeypatch: pytest.MonkeyPatch) -> dict[str, object]:
    """verl's metadata and the worker modules' finders, as a test sets them."""
    world: dict[str, object] = {"version": "0.9.1", "missing": set()}
    real_version, real_find = metadata.version, importlib.util.find_spec

    def version(name: str) -> str:
        if name == "verl":
            if world["version"] is None:
                raise metadata.PackageNotFoundError(name)
            return str(world["version"])
        return real_version(name)

    def find_spec(name: str, *args: object) -> object:
        if name in facts.WORKER_MODULES:
            return None if name in world["missing"] else object()  # type: ignore[operator]
        return real_find(name, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(metadata, "version", version)  # read by facts and install alike
    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    monkeypatch.delenv(ENV, raising=False)
    return world


def test_verl_not_installed_says_so_and_blocks_only_when_asked_for(
    verl_at: dict[str, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    verl_at["version"] = None
    found = facts.verl_facts()
    assert found.line() == "verl: not installed (HYBRIDMEM_VERL unset)"
    assert not found.problems
    monkeypatch.setenv(ENV, "1")
    found = facts.verl_facts()
    (problem,) = found.problems
    assert problem.startswith("HYBRIDMEM_VERL=1 but verl is not installed here")
    assert INSTALL_LINE in problem


def test_the_drop_ins_switch_is_named_with_what_turns_it_on(
    verl_at: dict[str, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    off = "verl 0.9.1: drop-in off (set HYBRIDMEM_VERL=1 to install it)"
    assert facts.verl_facts().line() == off
    monkeypatch.setenv(ENV, "1")
    line = facts.verl_facts().line()
    assert line.startswith("verl 0.9.1: drop-in on: installed where install_from_env runs")


def test_a_verl_without_its_verl_core_extra_names_the_line_that_installs_it(
    verl_at: dict[str, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    verl_at["missing"] = {"uvicorn", "zmq"}
    found = facts.verl_facts()
    assert found.missing == ("uvicorn", "pyzmq")
    (note,) = found.notes
    assert "fail to import without uvicorn, pyzmq" in note
    assert 'pip install "verl[verl-core]==0.9.1"' in note
    assert not found.problems  # not asked for: a note
    monkeypatch.setenv(ENV, "1")
    assert facts.verl_facts().problems == (note,)  # asked for: it blocks


def test_the_doctor_reports_verl_in_its_text_and_json(
    verl_at: dict[str, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV, "1")
    verl_at["missing"] = {"uvicorn"}
    report = doctor_report(probe=False)
    assert report["verl"]["version"] == "0.9.1"
    assert report["verl"][ENV] == "1"
    assert report["verl"]["drop_in_asked"] is True
    assert report["verl"]["missing_for_workers"] == ["uvicorn"]
    assert report["verl"]["install"] == 'pip install "verl[verl-core]==0.9.1"'
    assert report["verl"]["said"].startswith("verl 0.9.1: drop-in on")
    assert any("verl-core" in p for p in report["problems"])
    assert report["ok"] is False


def test_the_worker_modules_are_what_verls_workers_import_from_its_extra() -> None:
    """Against verl's wheel: each module is imported by a worker file and is verl-core's."""
    found = wheels.find_wheel("verl")
    if found is None:
        if wheels.required("verl"):
            pytest.fail(wheels.missing_reason("verl"))
        pytest.skip(wheels.missing_reason("verl"))
    import zipfile

    with zipfile.ZipFile(found) as wheel:
        requires = [
            line for line in wheel.read(next(n for n in wheel.namelist() if n.endswith("METADATA")))
            .decode().splitlines() if line.startswith("Requires-Dist:")
        ]  # fmt: skip
        sources = "\n".join(
            wheel.read(n).decode(errors="replace")
            for n in wheel.namelist()
            if n.startswith("verl/") and n.endswith(".py")
        )
    core = {
        re.split(r"[<>=!;\[ ]", line.split(":", 1)[1].strip())[0].lower()
        for line in requires
        if 'extra == "verl-core"' in line
    }
    base = {
        re.split(r"[<>=!;\[ ]", line.split(":", 1)[1].strip())[0].lower()
        for line in requires
        if "extra ==" not in line
    }
    for module, dist in facts.WORKER_MODULES.items():
        assert dist.lower() in core - base, dist
        assert re.search(rf"^\s*(?:import|from)\s+{module}\b", sources, re.M), module


def test_the_install_line_is_the_docs_own() -> None:
    assert INSTALL_LINE in (REPO / "docs" / "backends" / "verl.md").read_text()
