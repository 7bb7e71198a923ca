"""Bad calls to the public API: each one a typed, clear refusal from hybridmem itself.

Every public constructor and function is called with every value of a pool of wrong
ones in each of its arguments, the others valid. A value the argument does not take
must raise ``TypeError`` or ``ValueError`` (or a hybridmem error deriving from them),
raised by hybridmem's own code (never a traceback from deep inside Python or torch),
naming the argument or the value. A value it does take may pass, or be refused the
same way. No call may raise anything else (``AttributeError``, ``OverflowError``, a
generic ``expected str, bytes or os.PathLike``).
"""

from __future__ import annotations

import difflib
import inspect
import math
import re
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import hybridmem as hm

PACKAGE = Path(hm.__file__).parent
API: Any = hm  # the calls below are wrong on purpose: no type checking of them


def _fn() -> None:
    """A function: what a bare decorator passes."""


class _Opaque:
    def __repr__(self) -> str:
        return "<opaque>"


#: The pool: label -> value. Each is wrong for most arguments.
POOL: dict[str, object] = {
    "None": None,
    "True": True,
    "-5": -5,
    "0": 0,
    "2**70": 2**70,
    "1.5": 1.5,
    "nan": math.nan,
    "str": "bogus",
    "bytes": b"x",
    "list": [],
    "dict": {},
    "object": _Opaque(),
    "function": _fn,
}


class Arg(NamedTuple):
    """One argument of one public call: how to call with a value, which values it takes."""

    call: Callable[[object], object]
    takes: frozenset[str]
    skip: frozenset[str] = frozenset()  # values this call cannot even be written with


def _engine() -> Any:
    class Engine:
        def sleep(self) -> None:
            pass

        def wake_up(self, tags: Any = None) -> None:
            pass

    return API.VLLMEngine(Engine())


def _step(**kw: object) -> Callable[[object], object]:
    base: dict[str, object] = {"name": "s", "action": "release_cache", "when": "enter"}

    def call(value: object) -> object:
        return API.Step(**{**base, **dict.fromkeys(kw, value)})

    return call


def _profile(field: str) -> Callable[[object], object]:
    base: dict[str, object] = {"name": "x", "description": "d", "recipes": {}}
    return lambda value: API.BackendProfile(**{**base, field: value})


def _switch(field: str) -> Callable[[object], object]:
    return lambda value: API.HybridSwitch(_engine(), "vllm", **{field: value})


def _bucket(field: str) -> Callable[[object], object]:
    base: dict[str, object] = {"nbytes": 1024, "transport": "host", "fallback": "host"}
    return lambda value: API.WeightBucket(**{**base, field: value})


def _leak(field: str) -> Callable[[object], object]:
    return lambda value: API.LeakWatch(**{field: value})


BOOL = frozenset({"True"})
DEVICE = frozenset({"None", "0"})  # the current device, device 0
STR = frozenset({"str"})
NOTHING: frozenset[str] = frozenset()

#: "name.argument" -> the call and what it takes.
ARGS: dict[str, Arg] = {
    # the card's scopes
    "expandable_segments.enabled": Arg(lambda v: API.expandable_segments(v), BOOL),
    "expandable_segments.release_cache": Arg(
        lambda v: API.expandable_segments(True, release_cache=v),
        BOOL,
    ),
    "expandable_segments.force": Arg(lambda v: API.expandable_segments(True, force=v), BOOL),
    "allocator_settings.max_split_size_mb": Arg(
        lambda v: API.allocator_settings(max_split_size_mb=v), frozenset({"None", "2**70"})
    ),
    "allocator_settings.garbage_collection_threshold": Arg(
        lambda v: API.allocator_settings(garbage_collection_threshold=v), NOTHING
    ),
    "allocator_settings.expandable_segments": Arg(
        lambda v: API.allocator_settings(expandable_segments=v), BOOL
    ),
    "allocator_settings.positional": Arg(lambda v: API.allocator_settings(v), NOTHING),
    "set_allocator_defaults.force": Arg(
        lambda v: API.set_allocator_defaults(force=v),
        BOOL,
    ),
    "aggressive_cache_release.on": Arg(lambda v: API.aggressive_cache_release(on=v), NOTHING),
    "aggressive_cache_release.device": Arg(
        lambda v: API.aggressive_cache_release(device=v),
        DEVICE,
    ),
    "aggressive_cache_release.sync": Arg(lambda v: API.aggressive_cache_release(sync=v), BOOL),
    "ipc_safe.fallback": Arg(lambda v: API.ipc_safe(fallback=v), NOTHING),
    "ipc_safe.positional": Arg(lambda v: API.ipc_safe(v), frozenset({"None", "function"})),
    "release_cache.device": Arg(lambda v: API.release_cache(v), DEVICE),
    "release_cache.sync": Arg(lambda v: API.release_cache(sync=v), BOOL),
    "release_cache.collect_garbage": Arg(
        lambda v: API.release_cache(collect_garbage=v),
        BOOL,
    ),
    "release_cache.ipc_collect": Arg(lambda v: API.release_cache(ipc_collect=v), BOOL),
    # phases and the registry
    "phase.name": Arg(lambda v: API.phase(v), NOTHING),
    "phase.backend": Arg(lambda v: API.phase("rollout", backend=v), frozenset({"None"})),
    "phase.override": Arg(
        lambda v: API.phase("sleep", backend="vllm", release_cache=v),
        frozenset({"None", "True", "dict"}),
    ),
    "phase.override_key": Arg(
        lambda v: API.phase("sleep", backend="vllm", release_cache={v: True}),
        NOTHING,
        frozenset({"list", "dict"}),  # unhashable: no dict key
    ),
    "Step.name": Arg(_step(name=1), STR),
    "Step.action": Arg(_step(action=1), NOTHING),
    "Step.when": Arg(_step(when=1), NOTHING),
    "Step.args": Arg(_step(args=1), frozenset({"dict"})),
    "Step.why": Arg(_step(why=1), STR),
    "Step.versions": Arg(_step(versions=1), STR),
    "BackendProfile.name": Arg(_profile("name"), STR),
    "BackendProfile.description": Arg(_profile("description"), STR),
    "BackendProfile.recipes": Arg(_profile("recipes"), frozenset({"dict"})),
    "BackendProfile.notes": Arg(_profile("notes"), frozenset({"dict"})),
    "BackendProfile.adapter": Arg(_profile("adapter"), frozenset({"None", "function"})),
    "BackendProfile.recipe": Arg(
        lambda v: _profile("recipes")({"rollout": v}), frozenset({"list"})
    ),
    "register_backend.profile": Arg(lambda v: API.register_backend(v), NOTHING),
    "get_backend.name": Arg(lambda v: API.get_backend(v), frozenset({"None"})),
    "EngineAdapter.methods": Arg(lambda v: API.EngineAdapter(object(), v), frozenset({"list"})),
    "VLLMEngine.llm": Arg(lambda v: API.VLLMEngine(v), NOTHING),
    "VLLMEngine.level": Arg(lambda v: API.VLLMEngine(_engine().engine, level=v), frozenset({"0"})),
    "SGLangEngine.engine": Arg(lambda v: API.SGLangEngine(v), NOTHING),
    # the switch
    "HybridSwitch.engine": Arg(lambda v: API.HybridSwitch(v, "vllm"), NOTHING),
    "HybridSwitch.backend": Arg(lambda v: API.HybridSwitch(_engine(), v), frozenset({"None"})),
    "HybridSwitch.offloader": Arg(
        lambda v: API.HybridSwitch(_engine(), "vllm", v),
        frozenset({"None"}),
    ),
    "HybridSwitch.sync_weights": Arg(_switch("sync_weights"), frozenset({"None", "function"})),
    "HybridSwitch.barrier": Arg(_switch("barrier"), frozenset({"None", "function"})),
    "HybridSwitch.confirm_timeout_s": Arg(_switch("confirm_timeout_s"), frozenset({"0", "1.5"})),
    "HybridSwitch.device": Arg(_switch("device"), DEVICE),
    "HybridSwitch.collect_garbage": Arg(_switch("collect_garbage"), BOOL),
    "HybridSwitch.reload_early": Arg(_switch("reload_early"), BOOL),
    "HybridSwitch.reload_by": Arg(_switch("reload_by"), NOTHING),
    "HybridSwitch.weights_under_offload": Arg(_switch("weights_under_offload"), BOOL),
    "HybridSwitch.kv_under_offload": Arg(_switch("kv_under_offload"), BOOL),
    # weight transfer
    "WeightBucket.nbytes": Arg(_bucket("nbytes"), NOTHING),
    "WeightBucket.device": Arg(_bucket("device"), DEVICE),
    "WeightBucket.fallback": Arg(_bucket("fallback"), NOTHING),
    "WeightBucket.buffers": Arg(_bucket("buffers"), NOTHING),
    "WeightBucket.transport": Arg(_bucket("transport"), NOTHING),
    "WeightBucket.for_tensors": Arg(lambda v: API.WeightBucket.for_tensors(v), NOTHING),
    "BucketReceiver.handle": Arg(lambda v: API.BucketReceiver(v), NOTHING),
    "ipc_shareable.tensor": Arg(lambda v: API.ipc_shareable(v), NOTHING),
    "ipc_export.tensor": Arg(lambda v: API.ipc_export(v), NOTHING),
    "ipc_export.consumer_pid": Arg(
        lambda v: API.ipc_export(torch.zeros(1), consumer_pid=v),
        frozenset({"None"}),  # then the host tensor is refused: the test is the pid's
    ),
    "ipc_capabilities.refresh": Arg(lambda v: API.ipc_capabilities(refresh=v), BOOL),
    # offload
    # an empty list or dict: an optimizer before its first step holds nothing either
    "Offloader.targets": Arg(lambda v: API.Offloader(v), frozenset({"list", "dict"})),
    "Offloader.pin_memory": Arg(
        lambda v: API.Offloader(torch.zeros(1), pin_memory=v),
        BOOL,
    ),
    "Offloader.grads": Arg(lambda v: API.Offloader(torch.zeros(1), grads=v), NOTHING),
    "Offloader.max_host_bytes": Arg(
        lambda v: API.Offloader(torch.zeros(1), max_host_bytes=v),
        frozenset({"None", "0", "2**70"}),
    ),
    "offloaded.targets": Arg(lambda v: API.offloaded(v), frozenset({"list", "dict"})),
    "compact.into": Arg(lambda v: API.compact(torch.zeros(1), into=v), NOTHING),
    "one_segment.sizes": Arg(lambda v: API.one_segment(v), frozenset({"0", "dict", "list"})),
    # observability
    "record.path": Arg(lambda v: API.record(v), frozenset({"None", "str", "function"})),
    "record.process": Arg(lambda v: API.record(process=v), frozenset({"None", "str"})),
    "memory_info.device": Arg(lambda v: API.memory_info(v), DEVICE),
    "LeakWatch.boundary": Arg(_leak("boundary"), NOTHING),
    "LeakWatch.metric": Arg(_leak("metric"), NOTHING),
    "LeakWatch.window": Arg(_leak("window"), NOTHING),
    "LeakWatch.slope_bytes": Arg(_leak("slope_bytes"), frozenset({"0", "1.5", "2**70"})),
    "LeakWatch.device": Arg(_leak("device"), DEVICE),
}


def _cases() -> Iterator[Any]:
    for name, arg in ARGS.items():
        for label in POOL:
            if label not in arg.skip:
                yield pytest.param(name, label, id=f"{name}={label}")


def _raised_by_hybridmem(exc: BaseException) -> bool:
    """The innermost Python frame of the traceback is a hybridmem module's."""
    frames = traceback.extract_tb(exc.__traceback__)
    return bool(frames) and Path(frames[-1].filename).is_relative_to(PACKAGE)


def _outcome(arg: Arg, value: object) -> tuple[object, BaseException | None]:
    """What the call made, or what it raised."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a fallback's warning is not the point here
        try:
            return arg.call(value), None
        except Exception as exc:
            return None, exc


@pytest.mark.parametrize(("name", "label"), list(_cases()))
def test_a_bad_value_is_a_typed_refusal_from_hybridmem(name: str, label: str) -> None:
    arg = ARGS[name]
    value = POOL[label]
    made, error = _outcome(arg, value)
    if error is None:
        close = getattr(made, "close", None)
        if callable(close):
            close()
        assert label in arg.takes, f"{name}={label} was accepted: {made!r}"
        return
    told = "".join(traceback.format_exception(error))
    assert isinstance(error, (TypeError, ValueError)), told
    assert _raised_by_hybridmem(error), told
    if label not in arg.takes:  # refused for this value: the message must say so
        message = str(error)
        named = (name.split(".")[1], repr(value), type(value).__name__, "Write")
        assert any(word in message for word in named), message


# --------------------------------------------------------------------------- #
# Misspelled names: a keyword, a backend, an allocator setting                 #
# --------------------------------------------------------------------------- #

_KEYWORD = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def _keywords(obj: Any) -> list[str]:
    return [p.name for p in inspect.signature(obj).parameters.values() if p.kind in _KEYWORD]


def _takes_any_keyword(obj: Any) -> bool:
    kinds = [p.kind for p in inspect.signature(obj).parameters.values()]
    return inspect.Parameter.VAR_KEYWORD in kinds


#: Every public function and class (but the exceptions), by name, but those that take
#: any keyword (settings, a phase's overrides): they name the nearest themselves (below).
CALLABLES = sorted(
    name
    for name in hm.__all__
    if callable(getattr(hm, name))
    and not (isinstance(getattr(hm, name), type) and issubclass(getattr(hm, name), BaseException))
    and not _takes_any_keyword(getattr(hm, name))
)


@st.composite
def _typo(draw: st.DrawFn, word: str) -> str:
    """``word`` with one slip of the hand: a letter dropped, doubled or swapped, or its case."""
    at = draw(st.integers(0, len(word) - 1))
    kind = draw(st.sampled_from(["drop", "double", "swap", "upper"]))
    if kind == "drop" and len(word) > 1:
        return word[:at] + word[at + 1 :]
    if kind == "swap" and at < len(word) - 1:
        return word[:at] + word[at + 1] + word[at] + word[at + 2 :]
    if kind == "upper":
        return word.upper()
    return word[:at] + word[at] + word[at:]


def _ratio(a: str, b: str) -> float:
    return difflib.SequenceMatcher(None, a, b).ratio()


@pytest.mark.parametrize("name", CALLABLES)
@given(data=st.data())
def test_a_misspelled_keyword_names_the_nearest_one(name: str, data: st.DataObject) -> None:
    obj = getattr(hm, name)
    keywords = _keywords(obj)
    if keywords:
        meant = data.draw(st.sampled_from(keywords), label="meant")
        typo = data.draw(_typo(meant).filter(lambda t: t not in keywords), label="typo")
    else:
        meant, typo = "", "bogus"
    with pytest.raises(TypeError) as raised:
        obj(**{typo: None})
    message = str(raised.value)
    assert f"unexpected keyword argument {typo!r}" in message, message
    assert _raised_by_hybridmem(raised.value), message  # said by hybridmem, not bare
    if not keywords:
        assert message.endswith("it takes no keywords"), message
        return
    assert message.endswith(f"it takes: {', '.join(keywords)}"), message
    suggested = re.search(r"\(did you mean '(\w+)'\?\)", message)
    if len(meant) >= 4 or typo == meant.upper():  # one slip in four letters: always close
        assert suggested is not None, message
    if suggested is not None:  # the nearest: at least as close as the keyword meant
        assert suggested.group(1) in keywords
        assert _ratio(typo, suggested.group(1)) >= _ratio(typo, meant) or (
            suggested.group(1).lower() == typo.lower()
        ), message
    if typo == meant.upper():
        assert suggested is not None
        assert suggested.group(1) == meant


def test_a_keyword_error_inside_a_call_is_not_rewritten(monkeypatch: pytest.MonkeyPatch) -> None:
    # A TypeError about a keyword raised inside the function is the function's own:
    # it passes through as it was, not dressed as the caller's misspelling.
    from hybridmem._names import suggests_keywords

    def inner(**kwargs: object) -> None:
        raise TypeError("g() got an unexpected keyword argument 'deep'")

    @suggests_keywords
    def outer(*, shallow: int = 0) -> None:
        inner(deep=1)

    with pytest.raises(TypeError, match=r"^g\(\) got an unexpected keyword argument 'deep'$"):
        outer(shallow=1)
    assert inspect.signature(outer) == inspect.signature(outer.__wrapped__)  # type: ignore[attr-defined]


@given(backend=st.sampled_from(["vllm", "sglang", "default"]).flatmap(_typo))
def test_a_misspelled_backend_names_the_nearest_one(backend: str) -> None:
    if backend in hm.list_backends():
        return
    with pytest.raises(ValueError, match="unknown backend") as raised:
        hm.get_backend(backend)
    message = str(raised.value)
    assert "known: default, sglang, vllm" in message
    assert "case-sensitive" in message
    if backend.lower() in hm.list_backends():  # another case of a known name: that name
        assert f"(did you mean {backend.lower()!r}?)" in message
    with pytest.raises(ValueError, match="unknown backend"):
        hm.phase("rollout", backend=backend)


@given(backend=st.sampled_from(["vllm", "sglang", "default"]).flatmap(_typo))
def test_a_misspelled_backend_in_the_env_names_the_variable(backend: str) -> None:
    """HYBRIDMEM_BACKEND's value, refused as the variable's: the name meant, how to fix it."""
    if backend in hm.list_backends() or not backend.strip():
        return
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HYBRIDMEM_BACKEND", backend)
        with pytest.raises(ValueError, match="names an unknown backend") as raised:
            hm.phase("rollout")
    message = str(raised.value)
    assert message.startswith(f"HYBRIDMEM_BACKEND={backend.strip()} names an unknown backend")
    assert "set HYBRIDMEM_BACKEND to one of them or unset it" in message
    if backend.strip().lower() in hm.list_backends():
        assert f"(did you mean {backend.strip().lower()!r}?)" in message


@given(name=st.sampled_from(["train", "wake_up", "weight_sync", "rollout", "sleep"]).flatmap(_typo))
def test_a_misspelled_phase_names_the_nearest_one(name: str) -> None:
    from hybridmem._phase_names import ALIASES, PHASES

    if name in PHASES or name in ALIASES:
        return
    with pytest.raises(ValueError, match="unknown phase") as raised:
        hm.phase(name)
    message = str(raised.value)
    assert "phases: train, wake_up, weight_sync, rollout, sleep" in message
    if name.lower() in PHASES:
        assert f"(did you mean {name.lower()!r}?)" in message


@pytest.mark.parametrize(
    ("wrong", "meant"),
    [
        ("max_split_size", "max_split_size_mb"),
        ("expandable_segment", "expandable_segments"),
        ("garbage_collection_treshold", "garbage_collection_threshold"),
        ("roundup_power2_division", "roundup_power2_divisions"),
    ],
)
def test_a_misspelled_setting_names_the_nearest_one(wrong: str, meant: str) -> None:
    for call in (API.allocator_settings, API.set_allocator_defaults):
        with pytest.raises(ValueError, match="unknown allocator setting") as raised:
            call(**{wrong: 1})
        assert f"(did you mean {meant!r}?)" in str(raised.value)


def test_the_callables_that_take_any_keyword_are_the_ones_tested_by_name() -> None:
    takes_any = sorted(n for n in hm.__all__ if callable(getattr(hm, n)) and n not in CALLABLES)
    exceptions = [
        n
        for n in takes_any
        if isinstance(getattr(hm, n), type) and issubclass(getattr(hm, n), BaseException)
    ]
    assert sorted(set(takes_any) - set(exceptions)) == [
        "allocator_settings",  # settings: the test above
        "phase",  # overrides of its recipe's steps: tests/test_phase.py names the nearest
        "set_allocator_defaults",
    ]
