"""What a set of targets holds on the device: their tensors, grouped, and their storages.

The walk behind :class:`hybridmem.Offloader` and :func:`hybridmem.compact`. A target
is an ``nn.Module`` (its parameters, buffers and gradients), a
``torch.optim.Optimizer`` (its state tensors), a tensor, or a dict, list or tuple of
these; containers are walked each time, so an entry replaced in a dict is followed.

Scope: pure reads of the targets (no device work); thread-safe as far as the targets
are not changed meanwhile.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal

import torch

from hybridmem import _torch

__all__ = [
    "GROUPS",
    "Group",
    "StorageEntry",
    "Target",
    "device_storages",
    "drop_grads",
    "flatten",
    "select_groups",
    "tensors",
]

Group = Literal["parameters", "buffers", "gradients", "optimizer", "tensors"]
#: One storage of a walk (:func:`device_storages`): its name (the first that reaches it),
#: the storage, its group and its device.
StorageEntry = tuple[str, torch.UntypedStorage, Group, torch.device]
#: The groups of state, in the order they are collected (a storage reached twice
#: belongs to the first group that reaches it).
GROUPS: tuple[Group, ...] = ("parameters", "buffers", "gradients", "optimizer", "tensors")

Target = Any  # nn.Module | Optimizer | Tensor | Mapping | Sequence of these


def select_groups(groups: str | Iterable[str] | None) -> list[Group]:
    """The named groups in collection order (``None``: all of them).

    Raises:
        ValueError: an unknown group name (the message lists the groups).
    """
    if groups is None:
        return list(GROUPS)
    names = [groups] if isinstance(groups, str) else list(groups)
    for name in names:
        if name not in GROUPS:
            raise ValueError(f"unknown group {name!r}; groups are {', '.join(GROUPS)}")
    return [g for g in GROUPS if g in names]


def flatten(target: Target, path: str) -> Iterator[tuple[str, Any]]:
    """The modules, optimizers and tensors inside ``target``, each with its path.

    Raises:
        TypeError: something that is none of these (the message names its path).
    """
    if isinstance(target, (torch.nn.Module, torch.optim.Optimizer, torch.Tensor)):
        yield path, target
    elif isinstance(target, Mapping):
        for key, value in target.items():
            yield from flatten(value, f"{path}[{key!r}]")
    elif isinstance(target, (list, tuple)):
        for index, value in enumerate(target):
            yield from flatten(value, f"{path}[{index}]")
    else:
        raise TypeError(
            f"{path} is a {type(target).__name__}; the targets are nn.Module, "
            "torch.optim.Optimizer, Tensor, and dicts/lists/tuples of them"
        )


def tensors(
    targets: Iterable[Target], *, gradients: bool = True
) -> Iterator[tuple[str, torch.Tensor, Group]]:
    """Every tensor of ``targets`` with its name and group (duplicates included)."""
    for index, target in enumerate(targets):
        for path, item in flatten(target, f"targets[{index}]"):
            if isinstance(item, torch.nn.Module):
                grads: list[tuple[str, torch.Tensor]] = []  # after the buffers, one walk
                for name, param in item.named_parameters():
                    yield f"{path}.{name}", param, "parameters"
                    if gradients and param.grad is not None:
                        grads.append((f"{path}.{name}.grad", param.grad))
                for name, buf in item.named_buffers():
                    yield f"{path}.{name}", buf, "buffers"
                for name, grad in grads:
                    yield name, grad, "gradients"
            elif isinstance(item, torch.optim.Optimizer):
                for number, state in enumerate(item.state.values()):
                    for key, value in state.items():
                        if isinstance(value, torch.Tensor):
                            yield f"{path}.state[{number}].{key}", value, "optimizer"
            else:
                yield path, item, "tensors"


def device_storages(
    targets: Iterable[Target],
    *,
    gradients: bool = True,
    who: str = "Offloader",
    action: str = "offload",
) -> Iterator[StorageEntry]:
    """Each distinct device storage of ``targets``, in a stable order.

    Views and tied weights share one storage, yielded once (under the first name
    that reaches it). A DTensor yields its local shard's storage; a sparse tensor
    (``nn.Embedding(sparse=True)``'s gradient) the storages of its indices and
    values. CPU tensors (Adam's ``step``) are left out.

    Args:
        targets: as for :class:`hybridmem.Offloader`.
        gradients: include the modules' gradients.
        who, action: the caller and what it does, for the error message.

    Raises:
        TypeError: a target tensor has no storage of its own, refused before the
            caller changes anything.
    """
    seen: set[int] = set()
    for name, tensor, group in tensors(targets, gradients=gradients):
        local = _torch.local_tensor(tensor)
        if not _torch.is_device_tensor(local):
            continue
        try:
            parts = _torch.dense_parts(local)
            storages = [_torch.storage_of(part) for part in parts]
        except TypeError as exc:
            raise TypeError(
                f"{who} cannot {action} {name}: {exc}. Leave it out of the targets "
                f"(or, for a gradient, use grads='drop'); nothing was {action}ed"
            ) from None
        for index, storage in enumerate(storages):
            key = _torch.storage_key(storage)
            if key in seen:
                continue
            seen.add(key)
            part = name if len(storages) == 1 else f"{name}[{local.layout} part {index}]"
            yield part, storage, group, local.device


def drop_grads(targets: Sequence[Target]) -> int:
    """Free the gradients of the modules among ``targets`` (``grads="drop"``); their bytes."""
    dropped = 0
    for index, item in enumerate(targets):
        for _, target in flatten(item, f"targets[{index}]"):
            if not isinstance(target, torch.nn.Module):
                continue
            for param in target.parameters():
                if param.grad is None:
                    continue
                local = _torch.local_tensor(param.grad)
                if _torch.is_device_tensor(local):
                    with contextlib.suppress(TypeError):  # counted where it can be
                        dropped += sum(
                            _torch.storage_of(part).nbytes() for part in _torch.dense_parts(local)
                        )
                param.grad = None
    return dropped
