"""hybridmem around TRL's colocated vLLM, in one call: ``colocate(trainer)``.

TRL (1.x) runs vLLM in the trainer's own process in its colocate mode, through one
object every vLLM-using trainer shares (``trl.generation.vllm_generation.VLLMGeneration``,
the trainer's ``vllm_generation``: GRPO, RLOO, distillation and the experimental ones).
With ``vllm_enable_sleep_mode`` it sleeps the engine at level 2 after each generation,
and each step ``sync_weights`` wakes ``["weights"]`` and loads every parameter, then
``generate`` wakes ``["kv_cache"]``, generates and sleeps (TRL 1.16.0). What it leaves
to its users, read in that release:

- nothing touches the allocator settings: the vLLM profile's phases are not applied;
- the trainer's cache is emptied before the weights wake, not before the KV cache
  wakes (the weight sync's gathers leave blocks cached in between);
- a failure in ``generate`` (or in the load of ``sync_weights``) leaves the engine awake,
  holding its KV cache (or half-loaded weights TRL then takes for synced);
- the optimizer state stays on the device while vLLM generates, taking memory the KV
  cache could have.

:func:`colocate` puts hybridmem around that object, on the instance (TRL's classes are
left alone, so a user's own subclass of any of these trainers works the same):

- ``sync_weights`` runs in the vLLM profile's ``weight_sync`` phase, ``generate`` in
  its ``rollout`` phase, each engine ``wake_up`` in ``wake_up`` (the cache released
  first, classic segments for vLLM's pool) and each ``sleep`` in ``sleep``;
- a failure in ``generate`` or ``sync_weights`` puts an awake engine back to sleep at
  TRL's level 2 and marks its weights stale (``_llm_weights_sleeping``), so the next
  ``generate`` syncs them in full; the failure is raised as it was, with a note of
  what was done;
- ``offload_optimizer=True``: before the KV cache wakes, the optimizer state is
  offloaded to pinned host memory *by need* (only what the KV cache's bytes, read
  from vLLM's pool, lack of free memory, plus a margin); it comes back once the engine
  sleeps again, and in any case before the next ``optimizer.step()`` (a step pre-hook).

Why on the instance, not a subclass: seven TRL trainers build the same object, users
subclass them, and the calls to wrap are the generation object's and the engine's,
not the trainer's.

Scope: the process the trainer runs in (where TRL's colocated vLLM runs); one
:class:`Colocated` per generation object. Not thread-safe (TRL calls it from the
training loop).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from hybridmem._format import fmt_bytes
from hybridmem._log import logger
from hybridmem.engine.switch_offload import NEED_MARGIN_BYTES
from hybridmem.integrations.vllm.sleep_state import asleep_bytes
from hybridmem.memory.need_plan import NeedPlan, plan_by_need
from hybridmem.memory.offload import Offloader
from hybridmem.observe.memory import memory_info
from hybridmem.scopes.phases import phase
from hybridmem.scopes.release import release_cache

__all__ = ["SLEEP_LEVEL", "Colocated", "colocate"]

#: The level TRL sleeps its engine at (TRL 1.16.0: ``self.llm.sleep(level=2)``).
SLEEP_LEVEL = 2
_WRAPPED = ("sync_weights", "generate")
_ENGINE_CALLS = ("wake_up", "sleep")
_ATTRIBUTE = "_hybridmem_colocated"


class Colocated:
    """hybridmem's phases, failure handling and optional offload around one TRL engine.

    Made by :func:`colocate`; :meth:`remove` puts TRL's methods back.

    Attributes:
        generation: TRL's ``VLLMGeneration``.
        offload_optimizer: whether the optimizer state is offloaded by need.
        sleeping_engine: whether TRL sleeps the engine (``vllm_enable_sleep_mode``).
        awake: the engine's tags woken since its last sleep, as seen through the calls
            wrapped here (TRL's own; the engine slept at start-up).
        last_plan: the last offload plan (None: none made yet).

    Example:
        >>> handle = colocate(trainer, offload_optimizer=True)   # doctest: +SKIP
        >>> trainer.train()                                        # doctest: +SKIP
        >>> handle.last_plan                                       # doctest: +SKIP
    """

    def __init__(self, generation: Any, trainer: Any, offload_optimizer: bool) -> None:
        self.generation = generation
        self.offload_optimizer = offload_optimizer
        self.sleeping_engine = bool(getattr(generation, "enable_sleep_mode", False))
        self.awake: set[str] = set()
        self.last_plan: NeedPlan | None = None
        self._trainer = trainer
        self._llm = generation.llm
        self._offloader: Offloader | None = None
        self._hooked: Any = None  # the optimizer whose step pre-hook is ours
        self._hook: Any = None
        self._originals: dict[tuple[int, str], Callable[..., Any]] = {}
        self._own: dict[tuple[int, str], Any] = {}
        self._install()

    # -------------------------------------------------------------- install
    def _install(self) -> None:
        generation, llm = self.generation, self._llm
        for owner, name, wrap in (
            (generation, "sync_weights", self._sync_weights),
            (generation, "generate", self._generate),
            (llm, "wake_up", self._wake_up),
            (llm, "sleep", self._sleep),
        ):
            original = getattr(owner, name)
            own = vars(owner).get(name)  # an instance attribute someone set before us
            self._originals[(id(owner), name)] = original
            self._own[(id(owner), name)] = own
            setattr(owner, name, _calling(wrap, original))
        setattr(generation, _ATTRIBUTE, self)
        logger.info(
            "TRL: hybridmem's vLLM phases around %s's sync_weights, generate, wake_up and sleep%s",
            type(generation).__name__,
            "; the optimizer state offloaded by need while vLLM generates"
            if self.offload_optimizer
            else "",
        )

    def remove(self) -> None:
        """Put TRL's methods back (the optimizer state reloaded first, if offloaded).

        Example:
            >>> handle.remove()   # doctest: +SKIP
        """
        self.reload()
        if self._hook is not None:
            self._hook.remove()
            self._hook = self._hooked = None
        for owner in (self.generation, self._llm):
            for name in (*_WRAPPED, *_ENGINE_CALLS):
                key = (id(owner), name)
                if key not in self._originals:
                    continue
                own = self._own[key]
                if own is not None:
                    setattr(owner, name, own)
                elif name in vars(owner):
                    delattr(owner, name)  # the class's method shows through again
        self._originals.clear()
        if getattr(self.generation, _ATTRIBUTE, None) is self:
            delattr(self.generation, _ATTRIBUTE)
        if self._offloader is not None:
            self._offloader.close()
            self._offloader = None

    def _original(self, owner: object, name: str) -> Callable[..., Any]:
        return self._originals[(id(owner), name)]

    # -------------------------------------------------------------- the calls
    def _sync_weights(self, *args: Any, **kwargs: Any) -> Any:
        return self._in_phase("weight_sync", "sync_weights", args, kwargs)

    def _generate(self, *args: Any, **kwargs: Any) -> Any:
        return self._in_phase("rollout", "generate", args, kwargs)

    def _in_phase(self, name: str, method: str, args: Any, kwargs: Any) -> Any:
        """TRL's ``method`` in the vLLM profile's phase ``name``; a failure undone, re-raised."""
        with phase(name, backend="vllm"):
            try:
                return self._original(self.generation, method)(*args, **kwargs)
            except BaseException as exc:
                self._after_failure(exc, method)
                raise

    def _wake_up(self, tags: list[str] | None = None, **kwargs: Any) -> Any:
        waking = {"weights", "kv_cache"} if tags is None else set(tags)
        if self.offload_optimizer and "kv_cache" in waking:
            self._offload_for_kv()
        with phase("wake_up", backend="vllm"):
            result = self._original(self._llm, "wake_up")(tags=tags, **kwargs)
        self.awake |= waking
        return result

    def _sleep(self, *args: Any, **kwargs: Any) -> Any:
        result = self._put_to_sleep(*args, **kwargs)
        self.reload()  # the engine let go: the trainer's state comes back
        return result

    def _put_to_sleep(self, *args: Any, **kwargs: Any) -> Any:
        with phase("sleep", backend="vllm"):
            result = self._original(self._llm, "sleep")(*args, **kwargs)
        self.awake.clear()
        return result

    # -------------------------------------------------------------- failure
    def _after_failure(self, exc: BaseException, where: str) -> None:
        """Put an awake engine back to sleep, mark its weights stale, reload; say so."""
        done: list[str] = []
        if self.awake:
            woken = sorted(self.awake)
            try:
                self._put_to_sleep(level=SLEEP_LEVEL)
            except BaseException as sleep_exc:  # the engine's state is vLLM's to say now
                logger.error(
                    "TRL: %s failed (%s) with vLLM awake (%s); putting it back to sleep "
                    "failed too (%s: %s)",
                    where,
                    type(exc).__name__,
                    ", ".join(woken),
                    type(sleep_exc).__name__,
                    sleep_exc,
                )
                done.append(f"putting vLLM back to sleep failed ({sleep_exc!r}): it may be awake")
            else:
                done.append(f"vLLM, awake ({', '.join(woken)}), was put back to sleep (level 2)")
        if self.sleeping_engine and hasattr(self.generation, "_llm_weights_sleeping"):
            self.generation._llm_weights_sleeping = True  # the next generate syncs in full
            done.append("its weights are marked stale: the next generate syncs them in full")
        try:
            self.reload()
        except BaseException as reload_exc:
            done.append(
                f"the offloaded optimizer state did not come back ({reload_exc!r}): "
                "Colocated.reload() brings it back once there is room"
            )
        message = f"hybridmem: TRL's {where} failed; " + "; ".join(done or ["nothing to undo"])
        logger.warning(message)
        note = getattr(exc, "add_note", None)  # Python 3.11+
        if note is not None:
            note(message)

    # -------------------------------------------------------------- offload
    def _optimizer(self) -> Any:
        """The trainer's torch optimizer (accelerate's wrapper unwrapped), or None."""
        optimizer = getattr(self._trainer, "optimizer", None)
        return getattr(optimizer, "optimizer", optimizer)

    def _offload_for_kv(self) -> None:
        """Offload as much optimizer state as the KV cache lacks of free memory."""
        optimizer = self._optimizer()
        if optimizer is None or not getattr(optimizer, "state", None):
            return  # before train() built it, or before its first step filled it
        offloader = self._offloader_for(optimizer)
        need = asleep_bytes("kv_cache")
        release_cache(collect_garbage=False, ipc_collect=False)
        free = memory_info().free
        if need is None or free is None:
            logger.info(
                "TRL: the KV cache's size is not readable (%s); offloading all the optimizer state",
                "no vLLM sleep-mode pool" if need is None else "no device memory reading",
            )
            offloader.offload("optimizer")
            return
        plan = plan_by_need(
            offloader.resident("optimizer", keep_walk=True), need, free, NEED_MARGIN_BYTES
        )
        self.last_plan = plan
        logger.info("TRL: optimizer offload planned by need: %s", plan)
        if plan.deficit:  # the walk kept above picks the same storages the plan chose
            offloader.offload("optimizer", max_bytes=plan.deficit)
        if plan.short:
            logger.warning(
                "TRL: vLLM's KV cache still lacks %s with the whole optimizer state "
                "offloaded; its wake may run out of memory",
                fmt_bytes(plan.short),
            )

    def _offloader_for(self, optimizer: Any) -> Offloader:
        if self._offloader is None or self._hooked is not optimizer:
            if self._offloader is not None:
                self._offloader.reload()
                self._offloader.close()
            if self._hook is not None:
                self._hook.remove()
            self._offloader = Offloader(optimizer)
            self._hooked = optimizer
            self._hook = optimizer.register_step_pre_hook(self._before_step)
        return self._offloader

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.offloaded_groups():
            logger.info("TRL: the optimizer state comes back before its step")
            self.reload()

    def offloaded_groups(self) -> list[str]:
        """The groups of the trainer's state offloaded now (``["optimizer"]`` or none)."""
        off = self._offloader
        return [] if off is None else list(off.offloaded_groups)

    def reload(self) -> None:
        """Bring the offloaded optimizer state back (nothing when none is offloaded).

        Raises:
            OffloadError: the device has no room yet (the engine holds it); everything
                stays offloaded and retrievable: call again once there is room.
        """
        if self._offloader is not None and self._offloader.offloaded_groups:
            self._offloader.reload()


def _calling(wrap: Callable[..., Any], original: Callable[..., Any]) -> Callable[..., Any]:
    """A plain function that calls ``wrap``, named and documented as ``original``."""

    @functools.wraps(original)
    def call(*args: Any, **kwargs: Any) -> Any:
        return wrap(*args, **kwargs)

    return call


def colocate(target: Any, *, offload_optimizer: bool = False) -> Colocated:
    """Put hybridmem around a TRL trainer's colocated vLLM (see the module).

    Args:
        target: a TRL trainer built with ``use_vllm=True, vllm_mode="colocate"`` (any
            trainer with a ``vllm_generation``), or its ``VLLMGeneration`` itself.
        offload_optimizer: offload the optimizer state by need while vLLM generates
            (needs ``vllm_enable_sleep_mode=True`` and a trainer, not a bare
            generation object).

    Returns:
        The :class:`Colocated`; calling again with the same options returns it.

    Raises:
        TypeError: ``target`` is neither; ``offload_optimizer`` is not a bool.
        ValueError: vLLM runs in server mode (in another process: nothing here to
            phase), ``offload_optimizer`` without sleep mode or without a trainer, or a
            second call with other options.

    Scope: the calling process; once per generation object.

    Example:
        >>> from hybridmem.integrations.trl import colocate      # doctest: +SKIP
        >>> trainer = GRPOTrainer(model, reward_funcs, args=GRPOConfig(
        ...     use_vllm=True, vllm_mode="colocate", vllm_enable_sleep_mode=True))  # doctest: +SKIP
        >>> colocate(trainer, offload_optimizer=True)             # doctest: +SKIP
        >>> trainer.train()                                        # doctest: +SKIP
    """
    if not isinstance(offload_optimizer, bool):
        raise TypeError(f"offload_optimizer must be True or False, got {offload_optimizer!r}")
    trainer = target if hasattr(target, "vllm_generation") else None
    generation = trainer.vllm_generation if trainer is not None else target
    if generation is None and trainer is not None:
        raise ValueError(
            f"{type(trainer).__name__} has no vLLM (vllm_generation is None): build it with "
            "use_vllm=True, vllm_mode='colocate'"
        )
    missing = [n for n in _WRAPPED if not callable(getattr(generation, n, None))]
    if missing or not hasattr(generation, "mode"):
        raise TypeError(
            f"colocate() takes a TRL trainer with use_vllm=True or its VLLMGeneration, got "
            f"{type(target).__name__} (no {', '.join(missing) or 'mode'})"
        )
    if generation.mode != "colocate":
        raise ValueError(
            f"TRL's vLLM runs in {generation.mode!r} mode: the engine is in the server's "
            "process, not this one, so there is nothing here to phase. Use "
            "vllm_mode='colocate', or put hybridmem in the server's process"
        )
    sleeping = bool(getattr(generation, "enable_sleep_mode", False))
    if offload_optimizer and not sleeping:
        raise ValueError(
            "offload_optimizer=True needs vllm_enable_sleep_mode=True: without sleep mode "
            "TRL's vLLM keeps its KV cache between generations, so there is no wake to "
            "make room for"
        )
    if offload_optimizer and trainer is None:
        raise ValueError(
            "offload_optimizer=True needs the trainer (its optimizer), not its "
            "VLLMGeneration: pass the trainer"
        )
    existing = getattr(generation, _ATTRIBUTE, None)
    if isinstance(existing, Colocated):
        if existing.offload_optimizer != offload_optimizer:
            raise ValueError(
                f"hybridmem is already around this engine with offload_optimizer="
                f"{existing.offload_optimizer}; call .remove() on it first"
            )
        return existing
    return Colocated(generation, trainer, offload_optimizer)
