"""The backend registry: profiles, validation, lookup, env default, entry points."""

from __future__ import annotations

import json
import textwrap
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

import hybridmem as hm
from hybridmem.scopes import profiles, registry
from hybridmem.scopes.profiles import PHASES
from hybridmem.scopes.registry import list_backends
from tests.helpers import run_python

PLUGIN = hm.BackendProfile(
    "plugin",
    "from an entry point",
    {"rollout": (hm.Step("off", "expandable_segments", "scope", {"enabled": False}),)},
)


def make_plugin() -> hm.BackendProfile:
    return hm.BackendProfile("factory", "from a factory entry point", {})


def test_builtin_profiles_are_registered_and_documented() -> None:
    assert list_backends() == ["default", "sglang", "vllm"]
    for name in ("vllm", "sglang", "default"):
        profile = hm.get_backend(name)
        assert set(profile.recipes) == set(PHASES)
        for phase, steps in profile.recipes.items():
            for step in steps:
                assert step.why, f"{name}.{phase}.{step.name} has no evidence"
                assert step.versions, f"{name}.{phase}.{step.name} names no versions"


def test_recipes_follow_the_design() -> None:
    for name in ("vllm", "sglang"):
        recipes = hm.get_backend(name).recipes
        assert [(s.action, dict(s.args)) for s in recipes["train"]] == [
            ("expandable_segments", {"enabled": True})
        ]
        assert [s.action for s in recipes["wake_up"]] == ["release_cache", "expandable_segments"]
        assert [s.action for s in recipes["weight_sync"]] == ["ipc_safe", "release_cache"]
        assert recipes["weight_sync"][1].args["ipc_collect"] is True
        assert [(s.action, dict(s.args), s.opt_in) for s in recipes["rollout"]] == [
            ("expandable_segments", {"enabled": False}, False),
            ("suspend_communicators", {}, True),  # opt-in: collective
        ]
    assert [s.action for s in hm.get_backend("sglang").recipes["sleep"]] == [
        "release_cache",
        "await_free",
    ]
    assert [s.action for s in hm.get_backend("vllm").recipes["sleep"]] == ["release_cache"]


def test_unknown_backend_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown backend 'trt'; known: default, sglang, vllm"):
        hm.get_backend("trt")
    with pytest.raises(TypeError, match="backend must be a str"):
        hm.get_backend(3)  # type: ignore[arg-type]


def test_default_backend_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    assert hm.get_backend().name == "default"
    monkeypatch.setenv("HYBRIDMEM_BACKEND", "sglang")
    assert hm.get_backend().name == "sglang"
    assert hm.phase("sleep").profile.name == "sglang"
    monkeypatch.setenv("HYBRIDMEM_BACKEND", "nope")
    with pytest.raises(ValueError, match="HYBRIDMEM_BACKEND=nope names an unknown backend"):
        hm.phase("sleep")
    # the variable's misspelling: named as the variable, with the backend meant
    monkeypatch.setenv("HYBRIDMEM_BACKEND", "VLLM")
    with pytest.raises(ValueError, match="names an unknown backend") as err:
        hm.phase("rollout")
    said = str(err.value)
    assert said.startswith("HYBRIDMEM_BACKEND=VLLM names an unknown backend (did you mean 'vllm'?)")
    assert "set HYBRIDMEM_BACKEND to one of them or unset it" in said
    # the keyword's own message stays the keyword's
    with pytest.raises(ValueError, match=r"^unknown backend 'VLLM' \(did you mean 'vllm'\?\)"):
        hm.phase("rollout", backend="VLLM")


def test_misspelled_phase_gets_the_phase_meant() -> None:
    with pytest.raises(ValueError, match=r"unknown phase 'rollot' \(did you mean 'rollout'\?\)"):
        hm.phase("rollot")
    with pytest.raises(ValueError, match=r"unknown phase 'wakeup_' \(did you mean 'wakeup'\?\)"):
        hm.phase("wakeup_")
    with pytest.raises(ValueError, match=r"^unknown phase 'zzz'; phases:"):
        hm.phase("zzz")


def test_register_and_replace() -> None:
    mine = hm.BackendProfile("mine", "test", {})
    assert hm.register_backend(mine) is mine
    assert hm.get_backend("mine") is mine
    with pytest.raises(ValueError, match="registered already; pass replace=True"):
        hm.register_backend(hm.BackendProfile("mine", "again", {}))
    again = hm.register_backend(hm.BackendProfile("mine", "again", {}), replace=True)
    assert hm.get_backend("mine") is again
    with pytest.raises(TypeError, match="takes a BackendProfile"):
        hm.register_backend("mine")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: hm.BackendProfile("", "x", {}), "non-empty name"),
        (lambda: hm.BackendProfile("x", "x", {"decode": ()}), "unknown phase 'decode'; phases"),
        (lambda: hm.Step("s", "teleport", "enter"), "unknown action 'teleport'; known"),
        (lambda: hm.Step("s", "release_cache", "scope"), "needs when='enter' or 'exit'"),
        (lambda: hm.Step("s", "ipc_safe", "enter"), "needs when='scope'"),
        (
            lambda: hm.BackendProfile(
                "x",
                "x",
                {"sleep": (hm.Step("a", "release_cache", "exit"),) * 2},
            ),
            "step names repeat",
        ),
    ],
)
def test_profile_validation(build: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build()


def test_profiles_are_immutable() -> None:
    profile = hm.get_backend("vllm")
    with pytest.raises(AttributeError):
        profile.name = "x"  # type: ignore[misc]
    with pytest.raises(TypeError):
        profile.recipes["train"] = ()  # type: ignore[index]
    with pytest.raises(TypeError):
        profile.recipes["train"][0].args["enabled"] = False  # type: ignore[index]


def test_phase_names_and_aliases() -> None:
    assert profiles.canonical_phase("generate") == "rollout"
    assert profiles.canonical_phase("update_weights") == "weight_sync"
    assert hm.phase("generation", backend="vllm").name == "rollout"
    with pytest.raises(ValueError, match="unknown phase 'decode'; phases: train, wake_up"):
        hm.phase("decode")
    with pytest.raises(TypeError, match="phase name must be a str"):
        hm.phase(None)  # type: ignore[arg-type]


def test_entry_points(monkeypatch: pytest.MonkeyPatch) -> None:
    points = [
        metadata.EntryPoint("plugin", "tests.test_backends:PLUGIN", registry.ENTRY_POINT_GROUP),
        metadata.EntryPoint(
            "factory", "tests.test_backends:make_plugin", registry.ENTRY_POINT_GROUP
        ),
        metadata.EntryPoint("broken", "tests.no_such_module:X", registry.ENTRY_POINT_GROUP),
    ]

    def entry_points(group: str) -> list[metadata.EntryPoint]:
        return points if group == registry.ENTRY_POINT_GROUP else []

    monkeypatch.setattr(metadata, "entry_points", entry_points)
    with pytest.warns(hm.HybridMemWarning, match="backend plugin 'broken' .* was not loaded"):
        names = list_backends()
    assert names == ["default", "factory", "plugin", "sglang", "vllm"]
    assert hm.phase("rollout", backend="plugin").steps[0].name == "off"
    list_backends()  # loaded once: no second warning


def _install_plugin(
    site: Path, dist: str, entry_points: dict[str, str], module: str, source: str
) -> None:
    """Lay out an installed distribution in ``site``, as pip would: code and dist-info."""
    (site / f"{module}.py").write_text(textwrap.dedent(source))
    info = site / f"{dist}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    lines = "".join(f"{name} = {target}\n" for name, target in entry_points.items())
    # The group the docs name, spelled out (not the code's constant): see issue #22.
    (info / "entry_points.txt").write_text(f"[hybridmem.backends]\n{lines}")


_PLUGIN_SOURCE = """
    import hybridmem as hm

    PROFILE = hm.BackendProfile(
        "myengine",
        "a plugin's engine",
        {"rollout": (hm.Step("classic", "expandable_segments", "scope", {"enabled": False}),)},
    )
    TAKEN = hm.BackendProfile("vllm", "a second vllm", {})
    NOT_A_PROFILE = 42
"""

_CHECK = """
import json, warnings
import hybridmem as hm
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    names = hm.list_backends()
    hm.list_backends()  # loaded once: no second warning
    with hm.phase("rollout", backend="myengine") as scope:
        state = [hm.allocator_state()["expandable_segments"], *hm.allocator_state().scopes]
print(json.dumps({
    "names": names,
    "steps": [s.name for s in hm.get_backend("myengine").recipe("rollout")],
    "state": state,
    "warnings": [str(w.message) for w in caught],
}))
"""


def test_a_plugin_installed_as_a_distribution_loads_by_the_documented_group(
    tmp_path: Path,
) -> None:
    _install_plugin(
        tmp_path,
        "hybridmem_myengine",
        {"myengine": "hm_myengine:PROFILE"},
        "hm_myengine",
        _PLUGIN_SOURCE,
    )
    result = run_python("-c", _CHECK, env={"PYTHONPATH": f"{tmp_path}"})
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["names"] == ["default", "myengine", "sglang", "vllm"]
    assert out["steps"] == ["classic"]
    assert out["state"] == ["False", "expandable_segments(False)"]
    assert out["warnings"] == []


def test_broken_plugins_are_one_warning_each_naming_the_distribution_and_the_fix(
    tmp_path: Path,
) -> None:
    _install_plugin(
        tmp_path,
        "hybridmem_myengine",
        {
            "myengine": "hm_myengine:PROFILE",
            "missing": "hm_no_such_module:PROFILE",
            "wrongtype": "hm_myengine:NOT_A_PROFILE",
            "duplicate": "hm_myengine:TAKEN",
        },
        "hm_myengine",
        _PLUGIN_SOURCE,
    )
    result = run_python("-c", _CHECK, env={"PYTHONPATH": f"{tmp_path}"})
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["names"] == ["default", "myengine", "sglang", "vllm"]  # the good one loads
    messages = out["warnings"]
    assert len(messages) == 3, messages
    for message in messages:
        assert "from the distribution hybridmem_myengine 0.1" in message
        assert "'hybridmem.backends'" in message
        assert "Fix: " in message
    missing, wrongtype, duplicate = sorted(
        messages,
        key=lambda m: [n in m for n in ("'missing'", "'wrongtype'", "'duplicate'")],
        reverse=True,
    )
    assert "No module named 'hm_no_such_module'" in missing
    assert "install what it needs" in missing
    assert "it gave a int, not a BackendProfile" in wrongtype
    assert "'vllm' is taken" in duplicate
    assert "another name" in duplicate
