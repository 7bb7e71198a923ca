"""Skip reasons speak of the hardware and packages a user has, never of our machines or docs."""

from __future__ import annotations

import ast
import re

from tests.helpers import REPO

# A user reading `pytest -ra` knows nothing of the project's own machines or papers.
_INTERNAL = re.compile(r"H200|DEVELOPERS|device tool|\bCI\b|CI's|issue #|run on the", re.IGNORECASE)


def _skip_texts() -> list[tuple[str, int, str]]:
    found: list[tuple[str, int, str]] = []
    for path in sorted((REPO / "tests").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            parts: list[ast.AST] = []
            if isinstance(node, ast.Call):
                name = getattr(node.func, "attr", getattr(node.func, "id", ""))
                if name in ("skip", "importorskip", "xfail"):
                    parts += node.args
                parts += [k.value for k in node.keywords if k.arg == "reason"]
            elif isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id.endswith("REASON") for t in node.targets
            ):
                parts.append(node.value)
            for part in parts:
                text = "".join(
                    c.value
                    for c in ast.walk(part)
                    if isinstance(c, ast.Constant) and isinstance(c.value, str)
                )
                if text:
                    line = getattr(node, "lineno", 0)
                    found.append((path.relative_to(REPO).as_posix(), line, text))
    return found


def test_skip_reasons_name_hardware_not_our_machines() -> None:
    texts = _skip_texts()
    assert any("needs a CUDA GPU" in text for _, _, text in texts)
    bad = [f"{path}:{line}: {text!r}" for path, line, text in texts if _INTERNAL.search(text)]
    assert bad == []
