"""What a vLLM engine's model takes, from its checkpoint's headers, and the check of a sync.

vLLM's ``load_weights`` takes checkpoint names (``q_proj``, ``k_proj``, ...) and maps
them onto its fused parameters; a wrong name is skipped or fails deep inside, and a
layer loaded in part is rebuilt around uninitialised memory. So a sync is checked
against the checkpoint, name by name and shape by shape, before anything loads.

Stdlib and torch only (no vLLM). Scope: pure functions.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

__all__ = ["Schema", "check_weights", "checkpoint_schema"]

#: What an engine's model takes: checkpoint name -> shape.
Schema = Mapping[str, tuple[int, ...]]


def checkpoint_schema(model_dir: str | os.PathLike[str]) -> dict[str, tuple[int, ...]] | None:
    """Read the tensor names and shapes of a safetensors checkpoint from its headers.

    Only each file's header (8 bytes of length, then JSON) is read, never tensor
    data. This is what a trainer must send: the checkpoint's names (vLLM's
    ``load_weights`` maps them onto its fused parameters) with these shapes.

    Args:
        model_dir: a local model directory (vLLM's ``model_config.model``).

    Returns:
        ``{name: shape}``, or None when ``model_dir`` is not a local directory with
        ``*.safetensors`` files (a hub id, another format): nothing to check against.

    Raises:
        ValueError: a file whose header is not safetensors (the message names it).

    Example:
        >>> import json, pathlib, struct, tempfile
        >>> model = pathlib.Path(tempfile.mkdtemp())  # a checkpoint of one tensor
        >>> header = json.dumps({"lm_head.weight": {
        ...     "dtype": "BF16", "shape": [1024, 128], "data_offsets": [0, 262144]}}).encode()
        >>> _ = (model / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
        >>> checkpoint_schema(model)["lm_head.weight"]
        (1024, 128)
        >>> checkpoint_schema("meta-llama/Llama-3.1-8B") is None  # a hub id: nothing to read
        True
    """
    path = Path(model_dir)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if not files:
        return None
    schema: dict[str, tuple[int, ...]] = {}
    for file in files:
        with open(file, "rb") as handle:
            try:
                (length,) = struct.unpack("<Q", handle.read(8))
                header = json.loads(handle.read(length))
                for name, info in header.items():
                    if name != "__metadata__":
                        schema[name] = tuple(int(d) for d in info["shape"])
            except (struct.error, ValueError, KeyError, TypeError, AttributeError) as exc:
                raise ValueError(f"{file} has no readable safetensors header: {exc}") from None
    return schema


def check_weights(
    schema: Schema | None, weights: Iterable[tuple[str, Sequence[int]]], *, where: str
) -> None:
    """Raise if ``weights`` (names and shapes) do not fit ``schema`` exactly.

    Every name must be the schema's, with its shape, and every schema name must be
    there: a layer loaded in part would be rebuilt from uninitialised memory.

    Args:
        schema: what the model takes (None: nothing to check against).
        weights: ``(name, shape)`` pairs, one per tensor of the sync.
        where: what is checked, for the message (``"the sync"``).

    Raises:
        ValueError: naming the unknown names, the wrong shapes and the missing names.
    """
    if schema is None:
        return
    seen: set[str] = set()
    unknown: list[str] = []
    wrong: list[str] = []
    for name, shape in weights:
        seen.add(name)
        expected = schema.get(name)
        if expected is None:
            unknown.append(name)
        elif tuple(shape) != tuple(expected):
            wrong.append(f"{name!r} is {list(shape)}, the model's is {list(expected)}")
    missing = sorted(set(schema) - seen)
    problems = []
    if unknown:
        problems.append(
            f"unknown names {sorted(unknown)[:8]} (the model's: {sorted(schema)[:4]}...)"
        )
    if wrong:
        problems.append("wrong shapes: " + "; ".join(wrong[:8]))
    if missing:
        problems.append(f"{len(missing)} missing names, e.g. {missing[:8]}")
    if problems:
        raise ValueError(
            f"{where} does not fit the engine's model: {' | '.join(problems)}. Send the "
            "checkpoint's names with its shapes (a full state dict, unsharded); nothing "
            "was loaded"
        )
