"""TRL's own ``trl/generation/vllm_generation.py``, read from its wheel as data.

The engine calls TRL's ``VLLMGeneration`` makes, in the order its source makes them
(the colocated engine's, ``self.llm.*``, and the calls around them the drop-in relies
on), are what :mod:`hybridmem.integrations.trl` wraps; the tests' stand-in of that
class is checked against them with the same reading. Nothing of TRL is copied into this
project, and TRL is never imported here: the file is parsed.

The wheel is found as :mod:`tests.wheels` says (``HYBRIDMEM_TRL_WHEEL``, a ``.whl`` or
the ``.py`` itself, else ``tests/wheels/``), or in an installed TRL.
``HYBRIDMEM_REQUIRE_TRL=1`` (CI sets it) turns "not found" into a failure.
"""

from __future__ import annotations

import ast

from tests import wheels

GENERATION = "trl/generation/vllm_generation.py"
#: The methods whose calls the drop-in wraps, and the one that sleeps at start-up.
METHODS = ("_init_vllm", "sync_weights", "generate")


def trl_source() -> tuple[str, str] | None:
    """(TRL's vllm_generation.py text, where it came from), or None where none is found."""
    return wheels.read_source("trl", GENERATION)


def _dotted(node: ast.expr) -> str | None:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def _literal(node: ast.expr) -> object:
    try:
        return ast.literal_eval(node)
    except ValueError:
        return "..."


def engine_calls(source: str, class_name: str = "VLLMGeneration") -> dict[str, list[str]]:
    """Each method of :data:`METHODS`: its calls on the engine, in source order.

    A call is kept when it is made on ``self.llm`` (the colocated engine, any depth:
    ``self.llm.llm_engine...load_weights``), is ``self.sync_weights()`` or is
    ``empty_cache()``; it reads ``name(keyword=literal, ...)``, a keyword whose value
    is not a literal as ``...``, positional arguments left out.

    Example:
        >>> engine_calls(trl_source()[0])["generate"]   # doctest: +SKIP
        ['self.sync_weights()', "self.llm.wake_up(tags=['kv_cache'])", ...]
    """
    tree = ast.parse(source)
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == class_name)
    found: dict[str, list[str]] = {}
    for method in cls.body:
        if not isinstance(method, ast.FunctionDef) or method.name not in METHODS:
            continue
        calls = [n for n in ast.walk(method) if isinstance(n, ast.Call)]
        calls.sort(key=lambda n: (n.lineno, n.col_offset))
        kept = []
        for call in calls:
            name = _dotted(call.func)
            if name is None or not (
                name.startswith("self.llm.") or name in ("self.sync_weights", "empty_cache")
            ):
                continue
            if name.endswith(".load_weights"):
                name = "self.llm.<model>.load_weights"
            keywords = ", ".join(f"{k.arg}={_literal(k.value)!r}" for k in call.keywords)
            kept.append(f"{name}({keywords})")
        found[method.name] = kept
    return found


def missing_reason() -> str:
    return wheels.missing_reason("trl")


def required() -> bool:
    return wheels.required("trl")
