"""Rules the test suite keeps so that it passes or fails for a reason, never by timing."""

from __future__ import annotations

import ast

from hypothesis import settings

from tests.helpers import REPO


def test_no_property_test_has_a_deadline() -> None:
    """A deadline fails an example for taking long on a loaded machine, not for being wrong."""
    assert settings.default is not None
    assert settings.default.deadline is None
    named = []
    for path in sorted((REPO / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "settings":
                for keyword in node.keywords:
                    given = keyword.value
                    if keyword.arg == "deadline" and not (
                        isinstance(given, ast.Constant) and given.value is None
                    ):
                        named.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert named == [], f"property tests with a deadline: {named}"
