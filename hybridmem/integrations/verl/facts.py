"""What ``hybridmem doctor`` says of verl: its version, the drop-in's switch, what it needs.

Read from package metadata and the import system's finders only: verl is never
imported (its import takes seconds and starts Ray's machinery), so the doctor stays
fast and side-effect free.

Scope: pure reads of the environment; thread-safe.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from typing import Any

from hybridmem.integrations.verl.install import ENV, INSTALL_LINE, asks, install_line, verl_version

__all__ = ["WORKER_MODULES", "VerlFacts", "verl_facts"]

#: What ``verl.workers.engine_workers`` (verl 0.9.1) imports from verl's ``verl-core``
#: extra, which ``pip install verl`` leaves out: import name -> distribution.
WORKER_MODULES = {
    "uvicorn": "uvicorn",
    "fastapi": "fastapi",
    "zmq": "pyzmq",
    "msgspec": "msgspec",
    "transfer_queue": "TransferQueue",
    "nvtx": "nvtx",
}


@dataclass(frozen=True)
class VerlFacts:
    """verl in this environment, as the doctor reports it.

    Attributes:
        version: verl's installed version, or None.
        switch: the value of ``HYBRIDMEM_VERL`` (None: unset).
        missing: distributions verl's workers import that are not installed.
        notes: what to know; problems: what stops the drop-in the user asked for.
    """

    version: str | None
    switch: str | None
    missing: tuple[str, ...] = ()
    notes: tuple[str, ...] = field(default=())
    problems: tuple[str, ...] = field(default=())

    @property
    def asked(self) -> bool:
        """Whether ``HYBRIDMEM_VERL=1`` asks for the drop-in."""
        return asks(self.switch)

    def line(self) -> str:
        """One line for the doctor's text."""
        if self.version is None:
            return f"verl: not installed ({ENV} {_shown(self.switch)})"
        drop_in = (
            "on: installed where install_from_env runs (Ray's worker_process_setup_hook) "
            "and in vLLM's workers (hybridmem's plugin)"
            if self.asked
            else f"off (set {ENV}=1 to install it)"
        )
        return f"verl {self.version}: drop-in {drop_in}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            ENV: self.switch,
            "drop_in_asked": self.asked,
            "missing_for_workers": list(self.missing),
            "install": install_line(self.version) if self.missing else None,
            "said": self.line(),
        }


def _shown(value: str | None) -> str:
    return "unset" if value is None else f"= {value!r}"


def verl_facts() -> VerlFacts:
    """Read verl's version, ``HYBRIDMEM_VERL`` and what verl's workers would miss."""
    switch = os.environ.get(ENV)
    version = verl_version()
    notes: list[str] = []
    problems: list[str] = []
    if version is None:
        if asks(switch):
            problems.append(
                f"{ENV}=1 but verl is not installed here: nothing to put the drop-in into "
                f"({INSTALL_LINE})"
            )
        return VerlFacts(None, switch, (), tuple(notes), tuple(problems))
    missing = tuple(
        dist for name, dist in WORKER_MODULES.items() if importlib.util.find_spec(name) is None
    )
    if missing:
        said = (
            f"verl {version} is installed without its verl-core extra: its workers "
            f"(verl.workers.engine_workers) fail to import without {', '.join(missing)}. "
            f"Install it with {install_line(version)}"
        )
        (problems if asks(switch) else notes).append(said)
    return VerlFacts(version, switch, missing, tuple(notes), tuple(problems))
