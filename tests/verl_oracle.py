"""verl's own ``verl/models/mcore/util.py``, loaded as an oracle without verl or Megatron.

The file is read from verl's wheel, found as :mod:`tests.wheels` says
(``HYBRIDMEM_VERL_WHEEL``, a ``.whl`` or a ``util.py``, else ``tests/wheels/``), or from
an installed verl. Its imports of Megatron and of the rest of verl are answered by
stand-ins (:class:`FakeMegatron`): the parallel state is what the test sets, and
``PackedSeqParams`` is a plain dataclass of Megatron's seven fields. Nothing of verl is
copied into this project: the code is read from the user's copy at test time.

``HYBRIDMEM_REQUIRE_VERL=1`` (CI sets it) turns "not found" into an error instead of
a skip, so the equivalence tests cannot pass by not running.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import types
from collections.abc import Iterator
from typing import Any

from tests import wheels

UTIL = "verl/models/mcore/util.py"


def verl_source() -> tuple[str, str] | None:
    """(verl's util.py text, where it came from), or None where none is found."""
    return wheels.read_source("verl", UTIL)


def missing_reason() -> str:
    return wheels.missing_reason("verl")


def required() -> bool:
    return wheels.required("verl")


@dataclasses.dataclass
class FakePackedSeqParams:
    """Megatron's PackedSeqParams fields (megatron/core/packed_seq_params.py)."""

    qkv_format: Any = None
    cu_seqlens_q: Any = None
    cu_seqlens_kv: Any = None
    cu_seqlens_q_padded: Any = None
    cu_seqlens_kv_padded: Any = None
    max_seqlen_q: Any = None
    max_seqlen_kv: Any = None


class FakeMegatron:
    """``megatron.core.parallel_state`` and ``megatron.core.packed_seq_params`` stand-ins."""

    def __init__(self) -> None:
        self.tp_size, self.cp_size, self.cp_rank, self.cp_group = 1, 1, 0, None
        self.mpu = types.ModuleType("megatron.core.parallel_state")
        self.mpu.get_tensor_model_parallel_world_size = lambda: self.tp_size  # type: ignore[attr-defined]
        self.mpu.get_context_parallel_world_size = lambda: self.cp_size  # type: ignore[attr-defined]
        self.mpu.get_context_parallel_rank = lambda: self.cp_rank  # type: ignore[attr-defined]
        self.mpu.get_context_parallel_group = lambda: self.cp_group  # type: ignore[attr-defined]
        self.params = types.ModuleType("megatron.core.packed_seq_params")
        self.params.PackedSeqParams = FakePackedSeqParams  # type: ignore[attr-defined]

    def set(self, tp: int, cp: int, rank: int, group: Any = None) -> None:
        self.tp_size, self.cp_size, self.cp_rank, self.cp_group = tp, cp, rank, group

    def modules(self) -> dict[str, types.ModuleType]:
        """The sys.modules entries that make ``import megatron...`` find these."""
        megatron, core = types.ModuleType("megatron"), types.ModuleType("megatron.core")
        megatron.__path__ = []  # a package
        core.__path__ = []
        core.parallel_state = self.mpu  # type: ignore[attr-defined]
        core.packed_seq_params = self.params  # type: ignore[attr-defined]
        megatron.core = core  # type: ignore[attr-defined]
        return {
            "megatron": megatron,
            "megatron.core": core,
            "megatron.core.parallel_state": self.mpu,
            "megatron.core.packed_seq_params": self.params,
        }


def _verl_stubs() -> dict[str, types.ModuleType]:
    verl, utils = types.ModuleType("verl"), types.ModuleType("verl.utils")
    verl.__path__, utils.__path__ = [], []
    device, model = types.ModuleType("verl.utils.device"), types.ModuleType("verl.utils.model")
    device.is_npu_available = False  # type: ignore[attr-defined]
    model.CausalLMOutputForPPO = object  # type: ignore[attr-defined]
    return {
        "verl": verl,
        "verl.utils": utils,
        "verl.utils.device": device,
        "verl.utils.model": model,
    }


def load(fake: FakeMegatron) -> types.ModuleType | None:
    """verl's util module, its Megatron calls answered by ``fake``; None where not found."""
    found = verl_source()
    if found is None:
        return None
    text, origin = found
    with installed({**fake.modules(), **_verl_stubs()}):
        module = types.ModuleType("verl_mcore_util_oracle")
        module.__file__ = origin
        exec(compile(text, origin, "exec"), module.__dict__)  # verl's code, the user's copy
    return module


@contextlib.contextmanager
def installed(modules: dict[str, types.ModuleType]) -> Iterator[None]:
    """``modules`` in ``sys.modules`` for the block (``fake.modules()``: an installed Megatron)."""
    saved = {name: sys.modules.get(name) for name in modules}
    sys.modules.update(modules)
    try:
        yield
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old
