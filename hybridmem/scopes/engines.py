"""Duck-typed adapters over inference engines' sleep/wake APIs (no engine is imported)."""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from hybridmem._errors import EngineAsleepError
from hybridmem._log import logger
from hybridmem._names import suggests_keywords

__all__ = ["TAGS", "VLLM_TAGS", "EngineAdapter", "SGLangEngine", "VLLMEngine", "call_sync"]

#: What an engine wakes in stages: its weights first, then its KV cache.
TAGS = ("weights", "kv_cache")
#: vLLM's ``wake_up`` tags (0.11 on): the stages, and ``"scheduling"`` (level 0's).
VLLM_TAGS = (*TAGS, "scheduling")


def call_sync(result: object, what: str) -> None:
    """Refuse a coroutine where a sync call was made (it would never run)."""
    if inspect.isawaitable(result):
        if inspect.iscoroutine(result):
            result.close()
        raise TypeError(
            f"{what} returned an awaitable: this engine is async; use the async API "
            "(`async with switch.rollout():`)"
        )


def _accepts(fn: Callable[..., Any], name: str) -> bool:
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # builtins, C extensions, remote proxies
        return True
    return name in parameters or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()
    )


def _check_tags(tags: Sequence[str], allowed: Sequence[str] = TAGS) -> list[str]:
    if isinstance(tags, str):
        raise TypeError(f"tags must be a list of tags, not the string {tags!r}: pass [{tags!r}]")
    bad = [t for t in tags if t not in allowed]
    if bad or not tags:
        raise ValueError(f"tags must be a non-empty subset of {tuple(allowed)}, got {list(tags)!r}")
    return list(tags)


@suggests_keywords
class EngineAdapter:
    """The two calls a hybrid switch needs from an engine: ``sleep()`` and ``wake_up(tags)``.

    Each returns None or an awaitable (async engines). Subclass it for another engine.
    """

    name = "engine"

    def __init__(self, engine: object, methods: Sequence[str]) -> None:
        if isinstance(methods, str) or not isinstance(methods, (list, tuple)):
            raise TypeError(
                f"{type(self).__name__}: methods must be a list of the engine's method names "
                f"(['sleep', 'wake_up']), got {methods!r} ({type(methods).__name__})"
            )
        bad = [m for m in methods if not isinstance(m, str)]
        if bad:
            raise TypeError(f"{type(self).__name__}: method names are str, got {bad[0]!r}")
        missing = [m for m in methods if not callable(getattr(engine, m, None))]
        if missing:
            raise TypeError(
                f"{type(self).__name__} needs an engine with {', '.join(methods)}; "
                f"{type(engine).__name__} lacks {', '.join(missing)}"
            )
        self.engine = engine
        self._methods = tuple(methods)

    @property
    def is_async(self) -> bool:
        """Whether the engine's methods are coroutine functions (use the async API)."""
        return any(
            inspect.iscoroutinefunction(getattr(self.engine, m, None)) for m in self._methods
        )

    def sleep(self) -> Awaitable[Any] | None:
        """Give the engine's device memory back."""
        raise NotImplementedError

    def wake_up(self, tags: Sequence[str]) -> Awaitable[Any] | bool | None:
        """Take memory back for ``tags`` (``"weights"``, ``"kv_cache"``).

        Returns what the engine returns: None, an awaitable (async engines), or
        vLLM's answer to whether it is fully awake (0.11 on).
        """
        raise NotImplementedError

    def awake_bytes(self, total_bytes: int) -> int | None:
        """What the engine takes on a device of ``total_bytes`` when awake, as it says.

        Read from the engine's own memory setting where it has one (vLLM's
        ``gpu_memory_utilization``, SGLang's ``mem_fraction_static``); None where it
        does not say. ``HybridSwitch(rollout_need="engine")`` plans the hand-back by it.

        Example:
            >>> hm.VLLMEngine(llm).awake_bytes(141 << 30)   # doctest: +SKIP
            136279140761
        """
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({type(self.engine).__name__})"


def _share_of(engine: object, paths: Sequence[str], total_bytes: int) -> int | None:
    """``total_bytes`` times the first fraction found at one of ``paths`` (dotted), or None."""
    for path in paths:
        value: object = engine
        for name in path.split("."):
            value = getattr(value, name, None)
            if value is None:
                break
        if isinstance(value, int | float) and not isinstance(value, bool) and 0 < value <= 1:
            return int(value * total_bytes)
    return None


class _StagedWake(EngineAdapter):
    """An engine that wakes by tags when its resume method takes ``tags``.

    Versions whose resume method takes none wake everything at the first call after
    a sleep; the later stages of that wake-up are then no-ops.
    """

    tags: tuple[str, ...] = TAGS

    def __init__(self, engine: object, methods: Sequence[str], resume: str) -> None:
        super().__init__(engine, methods)
        self._resume_name = resume
        self._tags = _accepts(getattr(engine, resume), "tags")
        self._awake = False

    def _slept(self) -> None:
        self._awake = False

    def wake_up(self, tags: Sequence[str]) -> Awaitable[Any] | bool | None:
        tags = _check_tags(tags, self.tags)
        resume = getattr(self.engine, self._resume_name)
        if self._tags:
            return resume(tags=tags)  # type: ignore[no-any-return]
        if self._awake:
            return None
        self._awake = True
        return resume()  # type: ignore[no-any-return]


# Where a vllm.LLM (llm_engine) or an AsyncLLM keeps its engine config.
_VLLM_UTILIZATION = (
    "llm_engine.vllm_config.cache_config.gpu_memory_utilization",
    "vllm_config.cache_config.gpu_memory_utilization",
    "llm_engine.cache_config.gpu_memory_utilization",
)


@suggests_keywords
class VLLMEngine(_StagedWake):
    """vLLM: ``LLM.sleep(level)`` and ``LLM.wake_up(tags)``.

    Args:
        llm: a ``vllm.LLM`` (or ``AsyncLLMEngine``) created with ``enable_sleep_mode=True``
            (levels 1 and 2; vLLM on CPU accepts the calls and frees nothing).
        level: 1 offloads weights to CPU and drops the KV cache; 2 drops both (weights
            must then be synced in full after waking); 0 (vLLM 0.11 on) only pauses
            scheduling: no memory moves, and the last wake-up stage resumes it
            (``wake_up(tags=["scheduling"])``).

    Waking takes vLLM's tags: ``"weights"``, ``"kv_cache"`` and ``"scheduling"``.
    vLLM versions whose ``wake_up`` takes no ``tags`` wake everything at the first call;
    the adapter then makes the ``kv_cache`` stage a no-op.

    Once it has slept the engine, the adapter keeps vLLM's lifecycle in order: a second
    ``sleep()`` before any wake is a no-op (at level 2 vLLM would back up its buffers
    again from memory it has unmapped), and waking a tag already woken since that
    sleep is a no-op (vLLM would put back the buffers saved at sleep over the synced
    ones). Both log an INFO line. :meth:`generate` refuses while ``weights`` or
    ``kv_cache`` sleep (vLLM would read unmapped memory, or at level 0 queue the
    request behind paused scheduling). Before its first ``sleep()`` the adapter passes
    every call through (the engine may have been slept by other code).

    Example:
        >>> adapter = hm.VLLMEngine(llm, level=1)   # doctest: +SKIP
        >>> adapter.sleep()                          # doctest: +SKIP
        >>> adapter.wake_up(["weights"]); adapter.wake_up(["kv_cache"])  # doctest: +SKIP
    """

    name = "vllm"
    tags = VLLM_TAGS

    def __init__(self, llm: object, *, level: int = 1) -> None:
        super().__init__(llm, ("sleep", "wake_up"), "wake_up")
        if level not in (0, 1, 2) or isinstance(level, bool):
            raise ValueError(
                f"vLLM sleep level must be 0, 1 or 2, got {level!r} (1: offload weights, "
                "drop the KV cache; 2: drop both; 0: pause scheduling only)"
            )
        self.level = level
        # Tags woken since this adapter last slept the engine; None: it never did.
        self._woken: set[str] | None = None

    def sleep(self) -> Awaitable[Any] | None:
        if self._woken is not None and not self._woken:
            logger.info("%r: the engine is asleep already; sleep() does nothing", self)
            return None
        self._slept()
        result = self.engine.sleep(level=self.level)  # type: ignore[attr-defined]
        self._woken = set()  # once vLLM took the call (a failed one changes nothing)
        return result  # type: ignore[no-any-return]

    def awake_bytes(self, total_bytes: int) -> int | None:
        """``gpu_memory_utilization`` x ``total_bytes``: all vLLM sizes itself to when awake.

        Its weights, activations and KV cache together; an upper bound of what a wake
        takes, since what it keeps asleep (its CUDA context) counts in it too.
        """
        return _share_of(self.engine, _VLLM_UTILIZATION, total_bytes)

    def wake_up(self, tags: Sequence[str]) -> Awaitable[Any] | bool | None:
        if self._woken is not None:
            tags = _check_tags(tags, self.tags)
            fresh = [t for t in tags if t not in self._woken]
            if tags and not fresh:
                logger.info("%r: %s woke already since the last sleep; nothing to do", self, tags)
                return None
            result = self._wake(fresh)
            self._woken.update(fresh)  # once vLLM took the call (a failed one: retried)
            return result
        return self._wake(tags)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """``llm.generate(*args, **kwargs)``, refused while this adapter has the engine asleep.

        Raises:
            EngineAsleepError: the adapter slept the engine and has not woken both
                ``weights`` and ``kv_cache`` since; vLLM was not called. After a level-2
                sleep, sync the weights after waking them: woken, they hold no data.

        Example:
            >>> adapter.wake_up(["weights"]); adapter.wake_up(["kv_cache"])  # doctest: +SKIP
            >>> outputs = adapter.generate(prompts, sampling_params)  # doctest: +SKIP
        """
        if self._woken is not None:
            asleep = [t for t in ("weights", "kv_cache") if t not in self._woken]
            if asleep:
                wake = ", ".join(f"wake_up([{t!r}])" for t in asleep)
                verb = "sleeps" if len(asleep) == 1 else "sleep"
                raise EngineAsleepError(
                    f"generate came while {', '.join(asleep)} {verb}"
                    f" (this adapter slept the engine at level {self.level}): vLLM was not "
                    f"called. Wake first: {wake}"
                    + (", syncing the weights after waking them" if self.level == 2 else "")
                )
        return self.engine.generate(*args, **kwargs)  # type: ignore[attr-defined]

    def _wake(self, tags: Sequence[str]) -> Awaitable[Any] | bool | None:
        if self.level == 0 and self._tags:
            # Level 0 moved no memory: the memory stages have nothing to wake, and the
            # last one (the KV cache's) resumes scheduling.
            tags = _check_tags(tags, self.tags)
            if "scheduling" in tags or "kv_cache" in tags:
                return self.engine.wake_up(tags=["scheduling"])  # type: ignore[attr-defined, no-any-return]
            return None
        return super().wake_up(tags)


@suggests_keywords
class SGLangEngine(_StagedWake):
    """SGLang: ``release_memory_occupation()`` and ``resume_memory_occupation(tags)``.

    Args:
        engine: an ``sglang.Engine`` (sync or async methods) created with
            ``enable_memory_saver=True``.

    SGLang versions whose methods take no ``tags`` resume everything at once; the
    ``kv_cache`` stage is then a no-op.
    """

    name = "sglang"

    def __init__(self, engine: object) -> None:
        methods = ("release_memory_occupation", "resume_memory_occupation")
        super().__init__(engine, methods, "resume_memory_occupation")

    def sleep(self) -> Awaitable[Any] | None:
        self._slept()
        return self.engine.release_memory_occupation()  # type: ignore[attr-defined, no-any-return]

    def awake_bytes(self, total_bytes: int) -> int | None:
        """``mem_fraction_static`` x ``total_bytes``: SGLang's weights and KV pool.

        Its activations and CUDA graphs use memory beyond that share: where the
        trainer's resident state would leave them too little, pass the need in bytes.
        """
        return _share_of(self.engine, ("server_args.mem_fraction_static",), total_bytes)
