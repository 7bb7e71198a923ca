"""SGLang's own flattened-bucket code, read from its wheel, as the SGLang drop-in's oracle.

SGLang 0.5.23's wheel is found as :mod:`tests.wheels` says (``HYBRIDMEM_SGLANG_WHEEL``,
else ``tests/wheels/``). From it: ``sglang/srt/weight_sync/tensor_bucket.py`` (its
``FlattenedTensorBucket`` and ``FlattenedTensorMetadata``, pure torch), run as it is;
and, from ``sglang/srt/model_executor/model_runner_components/weight_updater.py``, the
server's ``_update_weights_from_flattened_bucket`` (what SGLang does with a
``flattened_bucket`` payload) and ``_unwrap_tensor`` (what it does with the per-tensor
one), taken out of the file by name and run with a stand-in model that records what it
is asked to load. SGLang's other imports (its engine, its runtime) are not needed by
those functions. ``HYBRIDMEM_REQUIRE_SGLANG=1`` (CI) turns "not found" into a failure.
Nothing of SGLang is copied into this project.
"""

from __future__ import annotations

import ast
import functools
import sys
import types
import zipfile
from typing import Any

import torch

from tests import wheels

BUCKET = "sglang/srt/weight_sync/tensor_bucket.py"
UPDATER = "sglang/srt/model_executor/model_runner_components/weight_updater.py"
_FUNCTIONS = ("_update_weights_from_flattened_bucket", "_unwrap_tensor")


def wheel() -> str | None:
    found = wheels.find_wheel("sglang")
    return None if found is None else str(found)


def required() -> bool:
    return wheels.required("sglang")


def missing_reason() -> str:
    return wheels.missing_reason("sglang")


@functools.cache
def load() -> types.SimpleNamespace:
    """SGLang's bucket module and the server's two functions (see the module)."""
    path = wheel()
    if path is None:
        raise FileNotFoundError(missing_reason())
    with zipfile.ZipFile(path) as archive:
        bucket_source = archive.read(BUCKET).decode()
        updater_source = archive.read(UPDATER).decode()
    bucket = types.ModuleType("sglang_tensor_bucket")
    sys.modules[bucket.__name__] = bucket  # dataclasses look their module up there
    exec(compile(bucket_source, BUCKET, "exec"), bucket.__dict__)
    tree = ast.parse(updater_source)
    chosen = [
        node
        for node in ast.walk(tree)  # module-level, or a method taken out of its class
        if isinstance(node, ast.FunctionDef) and node.name in _FUNCTIONS
    ]
    assert sorted(n.name for n in chosen) == sorted(_FUNCTIONS), "SGLang moved them"
    namespace: dict[str, Any] = {
        "torch": torch,
        "FlattenedTensorBucket": bucket.FlattenedTensorBucket,
        "FlattenedTensorMetadata": bucket.FlattenedTensorMetadata,
        "LocalSerializedTensor": type("LocalSerializedTensor", (), {}),
        "WeightUpdater": object,
        "Optional": Any,
        "List": list,
        "Tuple": tuple,
        "Union": Any,
    }
    module = ast.Module(body=list[ast.stmt](chosen), type_ignores=[])
    exec(compile(module, UPDATER, "exec"), namespace)
    return types.SimpleNamespace(
        FlattenedTensorBucket=bucket.FlattenedTensorBucket,
        FlattenedTensorMetadata=bucket.FlattenedTensorMetadata,
        from_flattened=namespace["_update_weights_from_flattened_bucket"],
        unwrap=namespace["_unwrap_tensor"],
    )


class RecordingModel:
    """What SGLang's server loads into: records each ``load_weights`` call's tensors."""

    def __init__(self) -> None:
        self.loaded: list[tuple[str, torch.Tensor]] = []

    def load_weights(self, named: list[tuple[str, torch.Tensor]]) -> None:
        self.loaded += [(name, tensor.clone()) for name, tensor in named]


def server_loads(
    oracle: types.SimpleNamespace, payload: dict[str, Any]
) -> list[tuple[str, torch.Tensor]]:
    """What SGLang's server loads from a ``flattened_bucket`` payload, by its own code."""
    model = RecordingModel()
    updater = types.SimpleNamespace(get_model=lambda: model)
    ok, message = oracle.from_flattened(updater, payload)
    assert ok, message
    return model.loaded
