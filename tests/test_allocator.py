"""Allocator control: merged settings, toggles, env respect, non-LIFO, all forms."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import subprocess
import sys
import threading
import warnings
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hybridmem as hm
from hybridmem import _torch
from tests.conftest import FakeTorch
from tests.conftest import settings_of as parse_settings

USER_ENV = "max_split_size_mb:256,garbage_collection_threshold:0.6,roundup_power2_divisions:4"
USER_KEYS = {
    "max_split_size_mb": "256",
    "garbage_collection_threshold": "0.6",
    "roundup_power2_divisions": "4",
}


def last_applied(fake: FakeTorch) -> dict[str, str]:
    return parse_settings(fake.applied[-1])


# --------------------------------------------------------------------------- #
# The evidence rows of DESIGN.md, against the fake seam
# --------------------------------------------------------------------------- #


def test_toggle_keeps_the_users_settings_and_restores_explicitly(
    fake: FakeTorch, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", USER_ENV)
    with hm.expandable_segments(True):
        assert last_applied(fake) == {"expandable_segments": "True", **USER_KEYS}
    # Restoring writes expandable_segments:False explicitly: re-applying the user's
    # string alone would leave expandable segments on (torch keeps omitted keys).
    assert last_applied(fake) == {"expandable_segments": "False", **USER_KEYS}
    assert len(fake.applied) == 2


def test_restores_on_error(fake: FakeTorch, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", USER_ENV)
    with pytest.raises(KeyboardInterrupt), hm.expandable_segments(True):
        raise KeyboardInterrupt
    assert last_applied(fake)["expandable_segments"] == "False"
    assert not hm.allocator_state().expandable_segments


def test_nests(fake: FakeTorch) -> None:
    with hm.expandable_segments(True):
        with hm.expandable_segments(False):
            assert not hm.allocator_state().expandable_segments
            with hm.expandable_segments(True):
                assert hm.allocator_state().expandable_segments
            assert not hm.allocator_state().expandable_segments
        assert hm.allocator_state().expandable_segments
    assert not hm.allocator_state().expandable_segments
    assert [parse_settings(s)["expandable_segments"] for s in fake.applied] == [
        "True",
        "False",
        "True",
        "False",
        "True",
        "False",
    ]


def test_no_change_calls_no_setter(fake: FakeTorch) -> None:
    with hm.expandable_segments(False), hm.allocator_settings(expandable_segments=False):
        pass
    assert fake.applied == []
    with hm.expandable_segments(True), hm.expandable_segments(True):
        pass
    assert len(fake.applied) == 2  # on once, off once


def test_allocator_settings_merge_and_restore(
    fake: FakeTorch, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", USER_ENV)
    with hm.expandable_segments(True):
        with hm.allocator_settings(max_split_size_mb=512, pinned_use_background_threads=True):
            assert last_applied(fake) == {
                **USER_KEYS,
                "expandable_segments": "True",
                "max_split_size_mb": "512",
                "pinned_use_background_threads": "True",
            }
            cfg = hm.allocator_state()
            assert cfg.source("max_split_size_mb") == "runtime"
            assert cfg.get("max_split_size_mb").origin.startswith("allocator_settings(")
            assert cfg.source("garbage_collection_threshold") == "env"
        # a key that torch keeps when omitted is written back to its default
        assert last_applied(fake)["pinned_use_background_threads"] == "False"
        assert last_applied(fake)["max_split_size_mb"] == "256"
    assert fake.torch_state == {
        **USER_KEYS,
        "expandable_segments": "False",
        "pinned_use_background_threads": "False",
    }


# --------------------------------------------------------------------------- #
# Respecting the user
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("var", ["PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"])
def test_explicit_env_false_is_never_overridden_by_an_enable(
    fake: FakeTorch,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    var: str,
) -> None:
    monkeypatch.setenv(var, "expandable_segments:False")
    caplog.set_level(logging.INFO, logger="hybridmem")
    for _ in range(2):
        with hm.expandable_segments(True):
            assert not hm.allocator_state().expandable_segments
        with hm.allocator_settings(expandable_segments=True):
            assert not hm.allocator_state().expandable_segments
    assert fake.applied == []
    messages = [r.getMessage() for r in caplog.records if "explicitly" in r.getMessage()]
    assert len(messages) == 1  # logged once
    assert var in messages[0]
    assert "force=True" in messages[0]


def test_force_overrides_and_disabling_is_always_allowed(
    fake: FakeTorch, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    with hm.expandable_segments(False):
        assert last_applied(fake)["expandable_segments"] == "False"
    assert last_applied(fake)["expandable_segments"] == "True"

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    from hybridmem.scopes.allocator import _reset_state_for_tests

    _reset_state_for_tests()
    fake.last = None
    with hm.expandable_segments(True, force=True):
        assert hm.allocator_state().expandable_segments
    assert last_applied(fake)["expandable_segments"] == "False"


ISSUE_CUDA_ENV = "max_split_size_mb:512,garbage_collection_threshold:0.6"


@pytest.mark.parametrize("version", [(2, 10), (2, 11), (2, 13)])
def test_torch_2_10_and_later_read_only_the_cuda_variable_when_both_are_set(
    fake: FakeTorch, monkeypatch: pytest.MonkeyPatch, version: tuple[int, int]
) -> None:
    """The issue's H200 case: torch never had expandable segments on; hybridmem neither."""
    fake.version = version
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", ISSUE_CUDA_ENV)
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True")
    fake.last = ISSUE_CUDA_ENV  # what torch read
    fake.torch_state = {"max_split_size_mb": "512", "garbage_collection_threshold": "0.6"}
    with pytest.warns(hm.HybridMemWarning, match="PYTORCH_ALLOC_CONF is set but torch") as seen:
        cfg = hm.allocator_state()
    assert len(seen) == 1
    assert cfg.env_variable == "PYTORCH_CUDA_ALLOC_CONF"
    assert cfg.ignored_env == ("PYTORCH_ALLOC_CONF",)
    assert not cfg.expandable_segments
    assert cfg.get("max_split_size_mb").origin == "PYTORCH_CUDA_ALLOC_CONF"
    with hm.expandable_segments(False):
        assert fake.torch_state == {
            "max_split_size_mb": "512",
            "garbage_collection_threshold": "0.6",
        }
    assert fake.applied == []  # nothing to change: torch had it off all along
    with hm.expandable_segments(True):
        assert fake.torch_state["expandable_segments"] == "True"
    assert fake.torch_state == {
        "max_split_size_mb": "512",
        "garbage_collection_threshold": "0.6",
        "expandable_segments": "False",
    }
    hm.allocator_state()  # warned once only


def test_an_empty_cuda_variable_still_shadows_the_generic_one(
    fake: FakeTorch, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:False")
    with pytest.warns(hm.HybridMemWarning, match="ignores it"):
        cfg = hm.allocator_state()
    assert cfg.env_variable == "PYTORCH_CUDA_ALLOC_CONF"
    assert cfg.settings == {}
    with hm.expandable_segments(True):  # torch ignores that False: so does hybridmem
        assert hm.allocator_state().expandable_segments


def test_generic_variable_alone_is_read_on_2_10_and_ignored_on_2_9(
    fake: FakeTorch, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_torch, "last_allocator_settings", lambda: None)  # no getter before 2.12
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "max_split_size_mb:128,expandable_segments:False")
    fake.version = (2, 10)
    cfg = hm.allocator_state()
    assert cfg["max_split_size_mb"] == "128"
    assert cfg.env_variable == "PYTORCH_ALLOC_CONF"
    _reset_state()
    fake.version = (2, 9)
    with pytest.warns(hm.HybridMemWarning, match="torch 2.9 reads only PYTORCH_CUDA_ALLOC_CONF"):
        cfg = hm.allocator_state()
    assert "max_split_size_mb" not in cfg
    assert cfg.env_variable is None
    with hm.expandable_segments(True):  # 2.9 never read that False
        assert hm.allocator_state().expandable_segments


def test_env_values_torch_misreads_are_read_its_way_with_one_warning(
    fake: FakeTorch, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(
        "PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:25.5,garbage_collection_threshold:0.5x"
    )
    with pytest.warns(hm.HybridMemWarning) as seen:
        cfg = hm.allocator_state()
    messages = [str(w.message) for w in seen]
    assert len(messages) == 2
    assert "max_split_size_mb:25.5 is read as 25" in messages[0]
    assert "garbage_collection_threshold:0.5x is read as 0.5" in messages[1]
    assert cfg["max_split_size_mb"] == "25.5"  # written back as given: torch reads it the same
    hm.allocator_state()


def test_the_215_reserves_warn_refuse_and_restore_as_torch_reads_them(
    fake: FakeTorch, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake.version = (2, 15)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments_reserve:0")
    with pytest.warns(hm.HybridMemWarning, match=r"expandable_segments_reserve:0 is ignored"):
        hm.allocator_state()
    with pytest.raises(hm.AllocatorSettingsError, match="is ignored by torch"):
        hm.allocator_settings(expandable_segments_reserve=0)
    with hm.allocator_settings(expandable_segments_reserve_by_class={"capture": 0.25}):
        assert "expandable_segments_reserve_by_class:[capture:0.25]" in fake.applied[-1]
    assert "expandable_segments_reserve_by_class:[]" in fake.applied[-1]  # the default back
    # no settings string unsets a reserve (the env's 0 is ignored, so it never set one):
    # a scope may not set one, and says so before anything is applied
    with pytest.raises(hm.AllocatorSettingsError, match=r"cannot go back to its default: .*0\.5"):
        hm.allocator_settings(expandable_segments_reserve=0.5).__enter__()
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    _reset_state()
    with pytest.raises(hm.AllocatorSettingsError, match="cannot go back to its default"):
        hm.allocator_settings(expandable_segments_reserve="40G").__enter__()
    assert not [text for text in fake.applied if "reserve:0.5" in text or "reserve:40G" in text]


def _reset_state() -> None:
    from hybridmem import _log
    from hybridmem.scopes.allocator import _reset_state_for_tests

    _reset_state_for_tests()
    _log.reset_once()


def test_malformed_env_is_a_clear_error(fake: FakeTorch, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:ten")
    with pytest.raises(
        hm.AllocatorSettingsError,
        match=r"ALLOC_CONF='max_split_size_mb:ten': 'ten' is not a number.*fix it or unset",
    ):
        hm.allocator_state()
    with pytest.raises(hm.AllocatorSettingsError), hm.expandable_segments(True):
        pass
    assert fake.applied == []


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("garbage_collection_threshold:0x1p2000", "out of range (torch: stod)"),
        ("max_split_size_mb:\uff16\uff14", "is not a number (torch: stoull)"),
        ("max_split_size_mb:\u0663\u0660", "is not a number (torch: stoull)"),
        ("expandable_segments:True\x1f", "expected True or False"),
        ("expandable_segments:True\xa0", "expected True or False"),
        ("pinned_max_round_threshold_mb:abc", "is not a number (torch: stoull)"),
        ("max_split_size_mb:" + "9" * 5000, "out of range (torch: stoull)"),
    ],
)
def test_every_env_value_torch_refuses_is_an_allocator_settings_error(
    fake: FakeTorch, monkeypatch: pytest.MonkeyPatch, value: str, why: str
) -> None:
    """The families the generated strings found (issue #23): never a raw exception."""
    fake.version = (2, 14)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", value)
    with pytest.raises(hm.AllocatorSettingsError, match=re.escape(why)):
        hm.allocator_state()


def test_the_new_host_allocator_keys_of_2_13_are_known(
    fake: FakeTorch, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake.version = (2, 13)
    # Unlimited until set, and no string gives that back: a scope may not change it...
    with (
        pytest.raises(hm.AllocatorSettingsError, match=r"default \(unlimited\): no settings"),
        hm.allocator_settings(pinned_max_round_threshold_mb=64),
    ):
        pass
    # ...unless the process defaults own it; then it is set and put back like any other.
    hm.set_allocator_defaults(pinned_max_round_threshold_mb=128)
    with hm.allocator_settings(pinned_max_round_threshold_mb=64):
        assert hm.allocator_state()["pinned_max_round_threshold_mb"] == "64"
    assert hm.allocator_state()["pinned_max_round_threshold_mb"] == "128"
    fake.version = (2, 12)
    _reset_state()
    with pytest.raises(ValueError, match="pinned_max_round_threshold_mb"):
        hm.allocator_settings(pinned_max_round_threshold_mb=64).__enter__()


# --------------------------------------------------------------------------- #
# set_allocator_defaults
# --------------------------------------------------------------------------- #


def test_set_allocator_defaults_sets_defaults_under_scopes(fake: FakeTorch) -> None:
    cfg = hm.set_allocator_defaults(expandable_segments=True, max_split_size_mb=512)
    assert cfg.expandable_segments
    assert cfg.get("max_split_size_mb").origin == "set_allocator_defaults"
    assert last_applied(fake) == {"expandable_segments": "True", "max_split_size_mb": "512"}
    with hm.expandable_segments(False):
        assert last_applied(fake) == {"expandable_segments": "False", "max_split_size_mb": "512"}
    assert hm.allocator_state().expandable_segments


def test_set_allocator_defaults_respects_explicit_env_keys(
    fake: FakeTorch, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:256,expandable_segments:False")
    caplog.set_level(logging.INFO, logger="hybridmem")
    cfg = hm.set_allocator_defaults(
        expandable_segments=True, max_split_size_mb=512, roundup_power2_divisions=8
    )
    assert cfg["max_split_size_mb"] == "256"
    assert not cfg.expandable_segments
    assert cfg["roundup_power2_divisions"] == "8"
    assert sum("set_allocator_defaults: kept" in r.getMessage() for r in caplog.records) == 2
    cfg = hm.set_allocator_defaults(force=True, expandable_segments=True, max_split_size_mb=512)
    assert cfg.expandable_segments
    assert cfg["max_split_size_mb"] == "512"


def test_set_allocator_defaults_after_cuda_init_releases_on_mode_change(
    fake_gpu: FakeTorch,
) -> None:
    hm.set_allocator_defaults(expandable_segments=True)
    assert fake_gpu.events[:2] == ["sync:0", "empty_cache"]
    assert fake_gpu.events[2].startswith("set:expandable_segments:True")
    assert fake_gpu.devices[0].reserved == fake_gpu.devices[0].allocated


# --------------------------------------------------------------------------- #
# Cache release around mode changes
# --------------------------------------------------------------------------- #


def test_mode_change_releases_cached_blocks_first(fake_gpu: FakeTorch) -> None:
    with hm.expandable_segments(True):
        assert fake_gpu.events == [
            "sync:0",
            "empty_cache",
            "set:expandable_segments:True",
        ]
        with hm.expandable_segments(True):  # no change, no release
            pass
        assert len(fake_gpu.events) == 3
    assert fake_gpu.events[3:] == ["sync:0", "empty_cache", "set:expandable_segments:False"]


def test_release_cache_false_skips_the_release(fake_gpu: FakeTorch) -> None:
    with hm.expandable_segments(True, release_cache=False):
        pass
    assert [e for e in fake_gpu.events if not e.startswith("set:")] == []


def test_no_release_before_cuda_is_initialised(fake: FakeTorch) -> None:
    with hm.expandable_segments(True):
        pass
    assert fake.events == ["set:expandable_segments:True", "set:expandable_segments:False"]


def test_other_settings_do_not_release(fake_gpu: FakeTorch) -> None:
    with hm.allocator_settings(max_split_size_mb=64):
        pass
    assert [e for e in fake_gpu.events if not e.startswith("set:")] == []


# --------------------------------------------------------------------------- #
# Non-LIFO, threads, failures
# --------------------------------------------------------------------------- #


def test_non_lifo_exit_warns_once_naming_both_and_ends_correct(fake: FakeTorch) -> None:
    outer = hm.expandable_segments(True)
    inner = hm.allocator_settings(max_split_size_mb=64)
    outer.__enter__()
    inner.__enter__()
    with pytest.warns(hm.HybridMemWarning) as record:
        outer.__exit__(None, None, None)
    assert len(record) == 1
    message = str(record[0].message)
    assert "expandable_segments(True)" in message
    assert "allocator_settings(max_split_size_mb=64)" in message
    # the outer change is gone, the inner one is still in force
    assert fake.torch_state == {"expandable_segments": "False", "max_split_size_mb": "64"}
    inner.__exit__(None, None, None)
    assert fake.torch_state == {"expandable_segments": "False"}
    assert hm.allocator_state().scopes == ()


def test_two_threads_interleaving_end_in_the_right_state(fake: FakeTorch) -> None:
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    caught: list[str] = []

    def thread_a() -> None:
        with pytest.warns(hm.HybridMemWarning) as record, hm.expandable_segments(True):  # noqa: PT031
            a_in.set()
            b_in.wait()
        caught.extend(str(w.message) for w in record)
        a_out.set()

    def thread_b() -> None:
        a_in.wait()
        with hm.expandable_segments(False):
            b_in.set()
            a_out.wait()
            assert not hm.allocator_state().expandable_segments

    threads = [threading.Thread(target=thread_a), threading.Thread(target=thread_b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(caught) == 1
    assert "expandable_segments(True)" in caught[0]
    assert "expandable_segments(False)" in caught[0]
    assert not hm.allocator_state().expandable_segments
    assert hm.allocator_state().scopes == ()


def test_a_string_torch_refuses_after_reading_part_of_it_is_rolled_back(
    fake: FakeTorch, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch keeps part of a refused string: the settings before it are written back."""
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", USER_ENV)
    with hm.allocator_settings(pinned_use_background_threads=True):
        before = fake.meaning()
        fake.reject_next = 1  # torch refuses the next string after taking its first item
        with (
            pytest.raises(hm.AllocatorSettingsError, match="put the settings before it back"),
            hm.expandable_segments(True),
        ):
            pytest.fail("the scope must not be entered")
        assert fake.events[-2].startswith("refused:")
        assert fake.meaning() == before  # the half-applied string is gone
        assert hm.allocator_state().scopes == (
            "allocator_settings(pinned_use_background_threads=True)",
        )
        with hm.expandable_segments(True):  # and the next entry works
            assert fake.torch_state["expandable_segments"] == "True"
    assert fake.meaning() == fake.rules.run(USER_ENV).state


def test_a_string_the_model_refuses_never_reaches_torch(
    fake: FakeTorch, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake.version = (2, 11)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "large_segment_size_mb:64")
    with (
        pytest.raises(
            hm.AllocatorSettingsError,
            match=r"max_split_size_mb:32: must be >= 64 \(large_segment_size_mb",
        ),
        hm.allocator_settings(max_split_size_mb=32),
    ):
        pytest.fail("the scope must not be entered")
    assert fake.applied == []
    assert hm.allocator_state().scopes == ()


def test_a_default_torch_refuses_is_never_needed_at_an_exit(
    fake: FakeTorch, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``pinned_reserve_segment_size_mb:0`` (its default) is refused by torch 2.10+."""
    with (
        pytest.raises(hm.AllocatorSettingsError, match="cannot go back to its default"),
        hm.allocator_settings(pinned_reserve_segment_size_mb=64),
    ):
        pytest.fail("the scope must not be entered")
    assert fake.applied == []
    hm.set_allocator_defaults(pinned_reserve_segment_size_mb=64)  # a process default may set it
    with hm.allocator_settings(pinned_reserve_segment_size_mb=128):  # and scopes then vary it
        assert fake.torch_state["pinned_reserve_segment_size_mb"] == "128"
    assert fake.torch_state["pinned_reserve_segment_size_mb"] == "64"
    with hm.expandable_segments(True):
        pass
    assert "pinned_reserve_segment_size_mb:0" not in ",".join(fake.applied)


def test_settings_changed_outside_hybridmem_are_adopted(
    fake: FakeTorch, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", USER_ENV)
    fake.last = USER_ENV
    hm.allocator_state()
    # a framework calls torch's setter itself, dropping the user's settings
    fake.last = "expandable_segments:True"
    with hm.expandable_segments(False):
        # hybridmem notices, keeps the user's settings, and applies the merge
        assert last_applied(fake) == {**USER_KEYS, "expandable_segments": "False"}
    assert last_applied(fake) == {**USER_KEYS, "expandable_segments": "True"}
    assert any("written outside hybridmem" in r.getMessage() for r in caplog.records)


def test_external_change_inside_a_scope_is_repaired_at_the_next_entry(
    fake: FakeTorch, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", USER_ENV)
    fake.torch_state = dict(USER_KEYS)
    with hm.expandable_segments(True):
        # an engine toggles with torch's own setter: the user's three keys are reset
        fake.set_allocator_settings("expandable_segments:True")
        assert fake.torch_state == {"expandable_segments": "True"}
        with hm.expandable_segments(True):  # no change in hybridmem's view...
            # ...but torch lost the user's settings: they are written back
            assert fake.torch_state == {**USER_KEYS, "expandable_segments": "True"}
    # the engine's write changed nothing of hybridmem's view (expandable segments were
    # on already): the scope's exit goes back to the env's settings
    assert fake.torch_state == {**USER_KEYS, "expandable_segments": "False"}
    assert any("written outside hybridmem" in r.getMessage() for r in caplog.records)


# --------------------------------------------------------------------------- #
# Degraded builds and the kill switch
# --------------------------------------------------------------------------- #


def test_cuda_malloc_async_backend_is_a_noop_with_one_warning(fake: FakeTorch) -> None:
    fake.backend = "cudaMallocAsync"
    with pytest.warns(hm.HybridMemWarning, match="cudaMallocAsync") as record:  # noqa: PT031
        for _ in range(3):
            with hm.expandable_segments(True):
                assert hm.allocator_state().expandable_segments  # intended state is reported
    assert len(record) == 1
    assert fake.applied == []


def test_no_setter_is_a_noop_with_one_warning(fake: FakeTorch) -> None:
    fake.has_setter = False
    with pytest.warns(hm.HybridMemWarning, match="no allocator-settings setter") as record:  # noqa: PT031
        for _ in range(2):
            with hm.expandable_segments(True):
                pass
    assert len(record) == 1
    assert fake.applied == []


def test_kill_switch(fake: FakeTorch, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYBRIDMEM_DISABLE", "1")

    @hm.expandable_segments(True)
    def work() -> str:
        return "ran"

    assert work() == "ran"
    with hm.allocator_settings(max_split_size_mb=64):
        pass
    assert hm.set_allocator_defaults(expandable_segments=True).expandable_segments is False
    assert fake.applied == []


# --------------------------------------------------------------------------- #
# Every form of the base, for the real toggles
# --------------------------------------------------------------------------- #


def test_every_decorator_form(fake: FakeTorch) -> None:
    on = hm.expandable_segments(True)

    def state() -> bool:
        return hm.allocator_state().expandable_segments

    @on
    def fn() -> bool:
        return state()

    @on
    async def coro() -> bool:
        await asyncio.sleep(0)
        return state()

    @on
    def gen() -> Iterator[bool]:
        yield state()
        yield state()

    @on
    async def agen() -> AsyncIterator[bool]:
        yield state()

    @on
    class Manager:
        def __enter__(self) -> bool:
            return state()

        def __exit__(self, *exc: object) -> None:
            assert state()

    @on
    class AsyncManager:
        async def __aenter__(self) -> bool:
            return state()

        async def __aexit__(self, *exc: object) -> None:
            assert state()

    async def run_async() -> list[bool]:
        results = [await coro()]
        results += [value async for value in agen()]
        async with AsyncManager() as inside_async:
            results.append(inside_async and state())
        async with on:
            results.append(state())
        return results

    assert fn()
    for value in gen():
        assert value
        assert not state()  # restored at each yield
    with Manager() as inside:
        assert inside
        assert state()
    assert asyncio.run(run_async()) == [True, True, True, True]
    assert not state()


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: hm.expandable_segments("True"), TypeError, "enabled must be True or False"),  # type: ignore[arg-type]
        (lambda: hm.expandable_segments(1), TypeError, "enabled must be"),  # type: ignore[arg-type]
        (lambda: hm.expandable_segments(True, release_cache=None), TypeError, "release_cache"),  # type: ignore[arg-type]
        (lambda: hm.expandable_segments(True, force="yes"), TypeError, "force"),  # type: ignore[arg-type]
        (lambda: hm.allocator_settings(max_split=1), ValueError, r"torch 2\.\d+ knows: "),
        (
            lambda: hm.allocator_settings(backend="native"),
            ValueError,
            "cannot change after start-up",
        ),
        (
            lambda: hm.allocator_settings(max_split_size_mb=4),
            ValueError,
            ">= 2[01]",
        ),  # 21 before torch 2.10
        (lambda: hm.allocator_settings(expandable_segments="on"), ValueError, "True or False"),
        (lambda: hm.set_allocator_defaults(force=1), TypeError, "force"),  # type: ignore[arg-type]
        (lambda: hm.set_allocator_defaults(garbage_collection_threshold=3), ValueError, "between"),
    ],
)
def test_bad_input(call: object, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        call()  # type: ignore[operator]


def test_allocator_state_reports_sources_and_renders(
    fake: FakeTorch, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", USER_ENV)
    with hm.expandable_segments(True):
        cfg = hm.allocator_state()
    assert cfg.source("expandable_segments") == "runtime"
    assert cfg.source("max_split_size_mb") == "env"
    assert cfg.source("pinned_use_background_threads") == "default"
    assert cfg.scopes == ("expandable_segments(True)",)
    assert cfg.setter == "fake.setter"
    assert cfg.applied == fake.applied[0]
    assert "max_split_size_mb" in cfg
    assert "backend" not in cfg
    assert list(cfg) == [
        "max_split_size_mb",
        "garbage_collection_threshold",
        "roundup_power2_divisions",
        "expandable_segments",
    ]
    assert parse_settings(cfg.to_settings_string()) == {**USER_KEYS, "expandable_segments": "True"}
    data = cfg.as_dict()
    assert data["settings"]["max_split_size_mb"] == {
        "value": "256",
        "reads": "256",  # what torch reads: the same, so shown as it is
        "shown": "256",
        "source": "env",
        "origin": "PYTORCH_CUDA_ALLOC_CONF",
    }
    assert data["settings"]["backend"]["source"] == "default"
    text = str(cfg)
    assert "[env: PYTORCH_CUDA_ALLOC_CONF]" in text
    assert "active scopes: expandable_segments(True)" in text
    with pytest.raises(KeyError):
        cfg.get("no_such_key")


# --------------------------------------------------------------------------- #
# The real CPU build of torch: its setter and getter exist and parse
# --------------------------------------------------------------------------- #


@pytest.mark.skipif(
    not callable(getattr(torch._C, "_accelerator_getAllocatorSettings", None)),
    reason="torch < 2.12 has no settings getter",
)
def test_real_torch_setter_receives_the_merged_string(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", USER_ENV)
    getter = torch._C._accelerator_getAllocatorSettings
    with hm.expandable_segments(True):
        assert parse_settings(getter()) == {**USER_KEYS, "expandable_segments": "True"}
    assert parse_settings(getter()) == {**USER_KEYS, "expandable_segments": "False"}


def test_real_torch_rejection_maps_to_one_error() -> None:
    with pytest.raises(hm.AllocatorSettingsError, match="torch rejected"):
        _torch.set_allocator_settings("max_split_size_mb:10")


# --------------------------------------------------------------------------- #
# Property: random nesting with exceptions always restores exactly
# --------------------------------------------------------------------------- #

_SCOPES = st.one_of(
    st.booleans().map(lambda b: ("expandable_segments", str(b))),
    st.sampled_from(["64", "128", "512"]).map(lambda v: ("max_split_size_mb", v)),
)
_TREES: st.SearchStrategy[list[Any]] = st.recursive(
    st.just([]),
    lambda children: st.lists(st.tuples(_SCOPES, st.booleans(), children), max_size=3),
    max_leaves=12,
)


class Boom(Exception):
    pass


def _meaning(settings: dict[str, str]) -> dict[str, str]:
    from hybridmem.allocator.grammar import KEYS

    return {k: v for k, v in settings.items() if KEYS[k].default != v}


@given(tree=_TREES, env_split=st.sampled_from([None, "256"]))
@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_random_nesting_with_exceptions_restores(
    fake: FakeTorch, monkeypatch: pytest.MonkeyPatch, tree: list[object], env_split: str | None
) -> None:
    from hybridmem.scopes.allocator import _reset_state_for_tests

    _reset_state_for_tests()
    fake.applied.clear()
    fake.last = None
    if env_split is None:
        monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
        base: dict[str, str] = {}
    else:
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", f"max_split_size_mb:{env_split}")
        base = {"max_split_size_mb": env_split}

    fake.torch_state = dict(base)  # what torch parsed from the env at start-up

    def torch_state() -> dict[str, str]:
        return _meaning(fake.torch_state)

    def run(nodes: list[Any], expected: dict[str, str]) -> None:
        for node in nodes:
            (key, value), fail, children = node
            scope = (
                hm.expandable_segments(value == "True")
                if key == "expandable_segments"
                else hm.allocator_settings(max_split_size_mb=int(value))
            )
            inner = {**expected, key: value}
            try:
                with scope:
                    assert torch_state() == _meaning(inner)
                    run(children, inner)
                    if fail:
                        raise Boom
            except Boom:
                pass
            assert torch_state() == _meaning(expected)

    run(tree, base)
    assert torch_state() == _meaning(base)
    assert hm.allocator_state().scopes == ()


# --------------------------------------------------------------------------- #
# Issue #11: torch's rules exactly, and nothing said that is not so
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("first", ["allocator_state", "allocator_settings", "expandable_segments"])
def test_plain_env_settings_are_not_reported_as_changed_outside_hybridmem(
    fake: FakeTorch, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, first: str
) -> None:
    """torch 2.12+'s getter reports the env string: that is the user's, not a change."""
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", USER_ENV)
    caplog.set_level(logging.INFO, logger="hybridmem")
    if first == "allocator_state":  # the very first call of any kind
        hm.allocator_state()
    elif first == "allocator_settings":
        with hm.allocator_settings(max_split_size_mb=512):
            pass
    else:
        with hm.expandable_segments(True):
            pass
    hm.allocator_state()
    assert not [r for r in caplog.records if "outside hybridmem" in r.getMessage()]


def test_an_out_of_order_exit_applies_the_right_settings_before_it_warns(
    fake: FakeTorch,
) -> None:
    outer, inner = hm.expandable_segments(True), hm.allocator_settings(max_split_size_mb=64)
    outer.__enter__()
    inner.__enter__()
    with warnings.catch_warnings():
        warnings.simplefilter("error", hm.HybridMemWarning)  # as under `python -W error`
        with pytest.raises(hm.HybridMemWarning, match="exited out of order"):
            outer.__exit__(None, None, None)
    # the warning came after torch was given the settings of the scope still active
    assert fake.torch_state == {"expandable_segments": "False", "max_split_size_mb": "64"}
    inner.__exit__(None, None, None)
    assert fake.torch_state == {"expandable_segments": "False"}


def test_a_managers_scopes_exiting_out_of_order_warn_once_naming_no_thread(
    fake: FakeTorch,
) -> None:
    # Two managers of two scopes each, the first exited first, in one thread: one
    # warning, in one line, with no thread named (one thread was involved).
    first = [hm.expandable_segments(False), hm.ipc_safe()]
    second = [hm.expandable_segments(False), hm.ipc_safe()]
    for scope in (*first, *second):
        scope.__enter__()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for scope in reversed(first):
            scope.__exit__(None, None, None)
    said = [str(w.message) for w in record if issubclass(w.category, hm.HybridMemWarning)]
    assert len(said) == 1, said
    assert "exited out of order" in said[0]
    assert "thread" not in said[0]
    assert "\n" not in said[0]
    for scope in reversed(second):
        scope.__exit__(None, None, None)


def test_scopes_of_two_threads_exiting_out_of_order_name_the_threads(fake: FakeTorch) -> None:
    import threading

    outer = hm.expandable_segments(True)
    inner = hm.allocator_settings(max_split_size_mb=64)
    entered = threading.Thread(target=outer.__enter__)
    entered.start()
    entered.join()
    inner.__enter__()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        left = threading.Thread(target=outer.__exit__, args=(None, None, None))
        left.start()
        left.join()
    said = [str(w.message) for w in record if issubclass(w.category, hm.HybridMemWarning)]
    assert len(said) == 1, said
    assert said[0].count("(thread ") == 2
    inner.__exit__(None, None, None)


def test_the_real_torch_here_reads_the_variable_hybridmem_says(tmp_path: Path) -> None:
    """A fresh interpreter, both variables set: this torch's getter against hybridmem."""
    if _torch.last_allocator_settings() is None:
        pytest.skip("needs torch 2.12+ (its getter says what torch read)")
    script = (
        "import warnings, logging, json, torch, hybridmem as hm\n"
        "logging.basicConfig(level=logging.INFO)\n"
        "with warnings.catch_warnings(record=True) as seen:\n"
        "    warnings.simplefilter('always')\n"
        "    cfg = hm.allocator_state()\n"
        "    with hm.expandable_segments(True):\n"
        "        pass\n"
        "print(json.dumps({'torch_read': torch._C._accelerator_getAllocatorSettings(),\n"
        "    'variable': cfg.env_variable, 'ignored': cfg.ignored_env,\n"
        "    'warnings': [str(w.message) for w in seen],\n"
        "    'max_split': cfg['max_split_size_mb'], 'expandable': cfg.expandable_segments}))\n"
    )
    env = {
        **os.environ,
        "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512,garbage_collection_threshold:0.6",
        "PYTORCH_ALLOC_CONF": "expandable_segments:True",
    }
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True
    )
    out = json.loads(done.stdout.splitlines()[-1])
    assert out["variable"] == "PYTORCH_CUDA_ALLOC_CONF"
    assert out["ignored"] == ["PYTORCH_ALLOC_CONF"]
    assert out["max_split"] == "512"
    assert out["expandable"] is False  # torch never read the other variable
    assert len(out["warnings"]) == 1
    assert "PYTORCH_ALLOC_CONF is set but torch" in out["warnings"][0]
    assert "outside hybridmem" not in done.stderr


def test_a_malformed_env_in_a_fresh_process_is_hybridmems_error_not_torchs() -> None:
    """torch 2.12+'s getter parses the env on its first call and raises its own error."""
    script = (
        "import hybridmem as hm\n"
        "try:\n"
        "    hm.allocator_state()\n"
        "except hm.AllocatorSettingsError as exc:\n"
        "    print(exc)\n"
    )
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:abc"}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True
    )
    assert done.stdout.startswith(
        "PYTORCH_CUDA_ALLOC_CONF='max_split_size_mb:abc': 'abc' is not a number"
    ), done.stdout + done.stderr
