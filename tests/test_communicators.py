"""suspend_communicators and communicator_memory on one CPU rank: gloo groups seen as NCCL's.

The groups are real ``torch.distributed`` groups (gloo, one rank), so a collective on
one goes through the real ``ProcessGroup`` methods the guard wraps; the seam is told
they are NCCL's and NCCL is the stand-in of :mod:`tests.nccl_standin`. The ranks'
agreement and NCCL's barrier across processes: ``tests/test_communicators_ranks.py``.
The real NCCL: ``tests/gpu/test_communicators_gpu.py``.
"""

from __future__ import annotations

import asyncio
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import hybridmem as hm
from hybridmem import _log
from hybridmem.observe.communicators import describe_communicators
from hybridmem.scopes import comm_guard
from hybridmem.scopes.communicators import held_communicators
from tests.nccl_standin import PERSISTENT, SUSPENDABLE, StandInNccl, as_nccl


@pytest.fixture
def world(tmp_path: Path) -> Iterator[list[Any]]:
    """A one-rank gloo world and two subgroups; destroyed after the test."""
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    groups = [dist.group.WORLD, dist.new_group([0]), dist.new_group([0])]
    _log.reset_once()
    try:
        yield groups
    finally:
        dist.destroy_process_group()
        assert not comm_guard.guarded_groups(), "a test left a group refused"
        assert not held_communicators(), "a test left a communicator held"


@pytest.fixture
def nccl() -> StandInNccl:
    return StandInNccl()


def _all_reduce(group: Any) -> torch.Tensor:
    t = torch.ones(4)
    dist.all_reduce(t, group=group)
    return t


def test_every_nccl_group_is_suspended_inside_and_resumed_after(
    world: list[Any], nccl: StandInNccl, monkeypatch: pytest.MonkeyPatch
) -> None:
    pointers = as_nccl(monkeypatch, nccl, world)
    with hm.suspend_communicators() as scope:
        assert nccl.suspended == set(pointers.values())
        report = scope.report
        assert report is not None
        assert report.released == 3 * SUSPENDABLE
        assert report.freed == 3 * SUSPENDABLE
        assert len(report.suspended) == 3
        assert not report.skipped
    assert nccl.suspended == set()
    assert report.resume_s is not None
    assert [c for c, _ in nccl.calls] == ["suspend"] * 3 + ["resume"] * 3
    # resumed in reverse order of suspension
    assert [p for _, p in nccl.calls][3:] == [p for _, p in nccl.calls][:3][::-1]
    assert torch.equal(_all_reduce(world[1]), torch.ones(4))


def test_a_collective_on_a_suspended_group_is_refused_and_others_run(
    world: list[Any], nccl: StandInNccl, monkeypatch: pytest.MonkeyPatch
) -> None:
    as_nccl(monkeypatch, nccl, world[1:2])
    original = dist.ProcessGroup.__dict__["allreduce"]
    with hm.suspend_communicators(world[1], label="phase('rollout')"):
        with pytest.raises(hm.CommunicatorSuspendedError, match=r"phase\('rollout'\)") as caught:
            _all_reduce(world[1])
        assert caught.value.group in str(caught.value)
        assert torch.equal(_all_reduce(world[2]), torch.ones(4))  # not suspended
        with pytest.raises(hm.CommunicatorSuspendedError):
            dist.barrier(group=world[1])
    assert dist.ProcessGroup.__dict__["allreduce"] is original  # torch's method back
    assert torch.equal(_all_reduce(world[1]), torch.ones(4))


def test_nested_scopes_suspend_once_and_the_outermost_resumes(
    world: list[Any], nccl: StandInNccl, monkeypatch: pytest.MonkeyPatch
) -> None:
    as_nccl(monkeypatch, nccl, world)
    outer = hm.suspend_communicators()
    with outer:
        with hm.suspend_communicators(world[1]) as inner:
            assert inner.report is not None
            assert len(inner.report.nested) == 1
            assert held_communicators()[inner.report.nested[0]] == 2
        assert len(nccl.suspended) == 3  # the inner exit resumed nothing
        with outer:  # the same instance, re-entered
            assert len(nccl.suspended) == 3
        assert len(nccl.suspended) == 3
    assert nccl.suspended == set()
    assert [c for c, _ in nccl.calls].count("suspend") == 3


def test_an_exception_in_the_block_resumes_and_passes_through(
    world: list[Any], nccl: StandInNccl, monkeypatch: pytest.MonkeyPatch
) -> None:
    as_nccl(monkeypatch, nccl, world)
    with pytest.raises(KeyError, match="rollout died"), hm.suspend_communicators():
        raise KeyError("rollout died")
    assert nccl.suspended == set()


@pytest.mark.parametrize("form", ["function", "coroutine", "generator", "class", "async with"])
def test_every_form_suspends_for_its_span(
    world: list[Any], nccl: StandInNccl, monkeypatch: pytest.MonkeyPatch, form: str
) -> None:
    as_nccl(monkeypatch, nccl, world)
    seen: list[int] = []
    scope = hm.suspend_communicators()
    if form == "function":

        @scope
        def rollout() -> None:
            seen.append(len(nccl.suspended))

        rollout()
    elif form == "coroutine":

        @scope
        async def rollout_async() -> None:
            await asyncio.sleep(0)
            seen.append(len(nccl.suspended))

        asyncio.run(rollout_async())
    elif form == "generator":

        @scope
        def stream() -> Iterator[int]:
            seen.append(len(nccl.suspended))
            yield 1

        assert list(stream()) == [1]
    elif form == "class":

        @scope
        class Manager:
            def __enter__(self) -> Manager:
                seen.append(len(nccl.suspended))
                return self

            def __exit__(self, *exc: object) -> None:
                seen.append(len(nccl.suspended))

        with Manager():
            seen.append(len(nccl.suspended))
    else:

        async def main() -> None:
            async with scope:
                seen.append(len(nccl.suspended))

        asyncio.run(main())
    assert seen
    assert all(n == 3 for n in seen)
    assert nccl.suspended == set()


def test_a_failed_resume_names_the_group_and_keeps_it_refused(
    world: list[Any], nccl: StandInNccl, monkeypatch: pytest.MonkeyPatch
) -> None:
    pointers = as_nccl(monkeypatch, nccl, world[1:2])
    nccl.fail_resume.add(pointers[id(world[1])])
    scope = hm.suspend_communicators(world[1])
    with pytest.raises(hm.CommunicatorError, match=r"resuming group .* failed") as caught, scope:
        pass
    assert caught.value.suspended_ranks == (0,)
    with pytest.raises(hm.CommunicatorSuspendedError):
        _all_reduce(world[1])
    # the state said: still held, and a later scope over it resumes it once NCCL can
    nccl.fail_resume.clear()
    assert list(held_communicators().values()) == [0]  # suspended, held by no scope
    with hm.suspend_communicators(world[1]):
        pass
    assert nccl.suspended == set()
    assert not held_communicators()


def test_a_failed_resume_under_an_exception_is_noted_never_raised_over_it(
    world: list[Any], nccl: StandInNccl, monkeypatch: pytest.MonkeyPatch
) -> None:
    pointers = as_nccl(monkeypatch, nccl, world[1:2])
    nccl.fail_resume.add(pointers[id(world[1])])
    with (
        pytest.raises(ValueError, match="block's own") as caught,
        hm.suspend_communicators(world[1]),
    ):
        raise ValueError("block's own")
    notes = getattr(caught.value, "__notes__", None)
    if notes is not None:  # Python 3.11+
        assert any("resuming group" in n for n in notes)
    nccl.fail_resume.clear()
    with hm.suspend_communicators(world[1]):
        pass
    assert not held_communicators()


def test_a_failed_suspend_puts_back_what_the_entry_took(
    world: list[Any], nccl: StandInNccl, monkeypatch: pytest.MonkeyPatch
) -> None:
    pointers = as_nccl(monkeypatch, nccl, world)
    nccl.fail_suspend.add(pointers[id(world[2])])
    ran = False
    with (
        pytest.raises(hm.CommunicatorError, match=r"suspending group .* failed"),
        hm.suspend_communicators(),
    ):
        ran = True
    assert not ran
    assert nccl.suspended == set()
    assert not comm_guard.guarded_groups()


def test_old_nccl_warns_once_with_the_version_and_changes_nothing(
    world: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    old = StandInNccl(version=22809, has_suspend=False)
    as_nccl(monkeypatch, old, world)
    with (
        pytest.warns(hm.HybridMemWarning, match=r"2\.28\.9 has no ncclCommSuspend.*2\.29\.7"),
        hm.suspend_communicators() as scope,
    ):
        assert _all_reduce(world[1]).sum() == 4  # nothing refused
    assert scope.report is not None
    assert len(scope.report.skipped) == 3
    assert old.calls == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with hm.suspend_communicators():  # said once
            pass


def test_a_communicator_suspended_by_another_owner_is_left_to_it(
    world: list[Any], nccl: StandInNccl, monkeypatch: pytest.MonkeyPatch
) -> None:
    pointers = as_nccl(monkeypatch, nccl, world)
    vllm_owned = pointers[id(world[1])]
    nccl.suspended.add(vllm_owned)  # vLLM's enable_nccl_comm_suspend did it
    with hm.suspend_communicators() as scope:
        assert nccl.suspended == set(pointers.values())
        assert scope.report is not None
        assert list(scope.report.skipped.values()) == ["suspended by another owner"]
    assert nccl.suspended == {vllm_owned}  # never resumed by hybridmem
    assert ("suspend", vllm_owned) not in nccl.calls


def test_what_it_is_given_is_checked(
    world: list[Any], nccl: StandInNccl, monkeypatch: pytest.MonkeyPatch
) -> None:
    gloo = dist.new_group([0])
    assert isinstance(gloo, dist.ProcessGroup)
    as_nccl(monkeypatch, nccl, world[1:], gloo=(gloo,))
    with pytest.raises(TypeError, match="ProcessGroup or a list"):
        hm.suspend_communicators("world")
    with pytest.raises(ValueError, match="timeout_s"):
        hm.suspend_communicators(timeout_s=0)
    non_member = dist.GroupMember.NON_GROUP_MEMBER
    with hm.suspend_communicators([gloo, world[1], world[1], non_member]) as scope:
        assert len(nccl.suspended) == 1  # world[1] once
    report = scope.report
    assert report is not None
    assert report.skipped[str(dist.distributed_c10d._world.pg_names[gloo])] == "gloo, not NCCL"
    assert "(not a member)" in report.skipped
    assert [c for c, _ in nccl.calls] == ["suspend", "resume"]
    dist.destroy_process_group(world[2])
    with (
        pytest.raises(ValueError, match="not a live process group"),
        hm.suspend_communicators(world[2]),
    ):
        pass
    # None leaves gloo groups out without a word
    with hm.suspend_communicators() as every:
        assert every.report is not None
        assert every.report.suspended == [str(dist.distributed_c10d._world.pg_names[world[1]])]


def test_a_lazy_group_with_no_communicator_yet_is_left_alone(
    world: list[Any], nccl: StandInNccl, monkeypatch: pytest.MonkeyPatch
) -> None:
    as_nccl(monkeypatch, nccl, world, lazy=(world[2],))
    with hm.suspend_communicators() as scope:
        assert len(nccl.suspended) == 2
    assert scope.report is not None
    assert list(scope.report.skipped.values()) == ["no communicator yet"]


def test_torch_2_12s_own_suspend_is_used_where_torch_has_it(
    world: list[Any], nccl: StandInNccl, monkeypatch: pytest.MonkeyPatch
) -> None:
    as_nccl(monkeypatch, nccl, world, torch_native=True)
    with hm.suspend_communicators():
        pass
    kinds = [c for c, _ in nccl.calls]
    assert kinds.count("torch.suspend") == 3
    assert kinds.count("torch.resume") == 3


def test_communicator_memory_reads_ncclcommmemstats_per_group(
    world: list[Any], nccl: StandInNccl, monkeypatch: pytest.MonkeyPatch
) -> None:
    gloo = dist.new_group([0])
    as_nccl(monkeypatch, nccl, world, gloo=(gloo,), lazy=(world[2],))
    found = hm.communicator_memory()
    assert [c.backend for c in found] == ["nccl", "nccl", "nccl", "gloo"]
    first = found[0]
    assert (first.total, first.suspendable, first.persistent) == (
        PERSISTENT + SUSPENDABLE,
        SUSPENDABLE,
        PERSISTENT,
    )
    assert first.suspended is False
    assert first.source == "ncclCommMemStats"
    assert found[2].created is False
    assert found[2].total == 0
    assert found[3].total is None
    assert found[3].source == "not an NCCL group"
    assert [c.group for c in hm.communicator_memory(device=0)] == [c.group for c in found[:3]]
    lines = describe_communicators(found)
    assert lines[0].startswith("NCCL communicators hold 1.19 GiB (3 group(s)")
    assert "1.00 GiB of it hm.suspend_communicators() can give back" in lines[0]
    with hm.suspend_communicators():
        assert hm.communicator_memory()[0].suspended is True
        assert hm.communicator_memory()[0].total == PERSISTENT


def test_communicator_memory_names_the_groups_where_nccl_cannot_say(
    world: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    as_nccl(monkeypatch, StandInNccl(version=22809, has_suspend=False), world)
    found = hm.communicator_memory()
    assert all(c.total is None for c in found)
    assert "NCCL 2.28.9 has no ncclCommMemStats" in found[0].source
    lines = describe_communicators(found)
    assert "likely hold part of what is not torch's" in lines[0]
    assert all(str(c.group) in lines[0] for c in found)


def test_nothing_to_read_outside_a_process_group() -> None:
    assert hm.communicator_memory() == ()
    with hm.suspend_communicators() as scope:
        pass
    assert scope.report is not None
    assert scope.report.suspended == []


def test_a_rollout_phase_suspends_only_when_asked(
    world: list[Any], nccl: StandInNccl, monkeypatch: pytest.MonkeyPatch
) -> None:
    as_nccl(monkeypatch, nccl, world)
    assert [s.action for s in hm.phase("rollout", backend="vllm").steps] == ["expandable_segments"]
    with hm.phase("rollout", backend="vllm"):
        assert nccl.suspended == set()  # opt-in
    with hm.phase("rollout", backend="vllm", suspend_communicators=True):
        assert len(nccl.suspended) == 3
        with pytest.raises(hm.CommunicatorSuspendedError, match=r"phase\('rollout'"):
            _all_reduce(world[1])
    assert nccl.suspended == set()
    with hm.phase("rollout", backend="sglang", suspend_communicators={"groups": [world[1]]}):
        assert len(nccl.suspended) == 1
    with pytest.raises(TypeError, match="suspend_communicators"):
        hm.phase("rollout", backend="vllm", suspend_communicators={"groups": "all"})


def test_a_profile_can_name_the_step(
    world: list[Any], nccl: StandInNccl, monkeypatch: pytest.MonkeyPatch
) -> None:
    as_nccl(monkeypatch, nccl, world)
    profile = hm.BackendProfile(
        "comm-test",
        "suspends the trainer's groups through the rollout",
        {"rollout": (hm.Step("nccl", "suspend_communicators", "scope", {"timeout_s": 30}),)},
    )
    with hm.phase("rollout", backend=profile):
        assert len(nccl.suspended) == 3
    assert nccl.suspended == set()
    with pytest.raises(ValueError, match="needs when='scope'"):
        hm.Step("nccl", "suspend_communicators", "enter")


def test_memory_info_attributes_what_not_torchs_holds_to_the_groups(
    world: list[Any], nccl: StandInNccl, fake_gpu: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    as_nccl(monkeypatch, nccl, world)
    info = hm.memory_info()
    assert len(info.communicators) == 3
    assert info.nccl == 3 * (PERSISTENT + SUSPENDABLE)
    assert info.as_dict()["nccl"] == info.nccl
    text = str(info)
    assert "NCCL communicators hold 1.78 GiB (3 group(s), ncclCommMemStats)" in text
    with hm.suspend_communicators():
        assert hm.memory_info().nccl == 3 * PERSISTENT
    monkeypatch.setattr(
        "hybridmem._torch.nccl_calls", lambda: StandInNccl(version=22809, has_suspend=False)
    )
    unknown = hm.memory_info()
    assert unknown.nccl is None
    assert "likely hold part of what is not torch's" in str(unknown)


def test_suspended_until_the_next_collective_which_resumes_them_all_and_runs(
    world: list[Any], nccl: StandInNccl, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hybridmem.scopes.comm_pending import resume_communicators, suspend_until_collective

    as_nccl(monkeypatch, nccl, world)
    report = suspend_until_collective(label="verl drop-in")
    assert len(report.suspended) == 3
    assert len(nccl.suspended) == 3
    assert torch.equal(_all_reduce(world[2]), torch.ones(4))  # resumed all, then ran
    assert nccl.suspended == set()
    assert not comm_guard.guarded_groups()
    assert resume_communicators() is None  # nothing left
    # twice, then resumed by hand: both suspensions end
    suspend_until_collective()
    suspend_until_collective([world[1]])
    assert len(nccl.suspended) == 3
    first = resume_communicators()
    assert first is not None
    assert first.resume_s is not None
    assert nccl.suspended == set()
    assert not held_communicators()


#: ProcessGroup's methods that are no collective (torch 2.4 - 2.15): state, hooks, setup.
NOT_COLLECTIVES = {
    "abort", "boxed", "bound_device_id", "get_backend", "get_group_store",
    "get_reconfigure_handle", "group_desc", "group_name", "merge_remote_group", "name",
    "new_window", "rank", "reconfigure", "register_abort_hook", "register_post_hook",
    "register_pre_hook", "set_timeout", "shutdown", "size", "split_group",
    "supports_abort_hooks", "supports_completion_hooks", "supports_reconfigure",
    "supports_window", "unbox", "unregister_abort_hook", "unregister_post_hook",
    "unregister_pre_hook", "use_pg_for_symm_mem_rendezvous",
    "BackendType", "CUSTOM", "GLOO", "MPI", "NCCL", "UCC", "UNDEFINED", "XCCL",
}  # fmt: skip


def test_every_collective_of_this_torchs_process_group_is_guarded() -> None:
    """torch's own class judges: a collective method a new torch adds must be in the list."""
    from hybridmem._torch.nccl import COLLECTIVES

    methods = {
        name
        for name, value in vars(dist.ProcessGroup).items()
        if not name.startswith("__")
        and (not name.startswith("_") or name in ("_allgather_base", "_reduce_scatter_base"))
        and name not in NOT_COLLECTIVES
        and callable(value)
    }
    assert methods, "no methods read: the check would pass by not looking"
    assert methods <= set(COLLECTIVES), sorted(methods - set(COLLECTIVES))
