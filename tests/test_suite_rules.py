"""Rules the test suite keeps so that it passes or fails for a reason, never by timing."""

from __future__ import annotations

import ast
import os
import socket
import sys
from multiprocessing import shared_memory

import pytest
from hypothesis import settings

from tests.helpers import REPO, fds_opened_since, mappings_added_since, open_fds, shared_mappings


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


def test_no_test_in_the_shared_process_compares_descriptor_or_mapping_counts() -> None:
    """Counts of a test process's fds or shared mappings move with other threads' closes.

    An earlier test's watcher thread ending, or the garbage collector finalising a socket,
    closes descriptors at any moment; a test asserts that nothing *new* is left open
    (``fds_opened_since``, ``mappings_added_since``), never that a count is unchanged.
    """
    counted = []
    for path in sorted((REPO / "tests").glob("test_*.py")):
        if path.name == "test_suite_rules.py":
            continue
        text = path.read_text()
        for needle in ('listdir("/proc/self/fd")', '"/dev/shm/" in line'):
            if needle in text:
                counted.append(f"{path.relative_to(REPO)}: {needle}")
    assert counted == [], f"use tests.helpers' census instead: {counted}"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs Linux /proc")
def test_the_fd_census_names_what_was_opened_and_ignores_what_was_closed() -> None:
    closed_later = socket.socket()
    before = open_fds()
    closed_later.close()  # another thread closing its own: not a leak
    assert fds_opened_since(before) == {}
    left_open = socket.socket()
    try:
        opened = fds_opened_since(before)
        assert list(opened) == [left_open.fileno()]
        assert opened[left_open.fileno()].startswith("socket:")
    finally:
        left_open.close()
    # A number reused for another file is a new descriptor, not the old one.
    reused = os.open(os.devnull, os.O_RDONLY)
    try:
        assert reused in fds_opened_since(before)
    finally:
        os.close(reused)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs Linux /proc")
def test_the_mapping_census_names_what_is_still_mapped() -> None:
    unmapped_later = shared_memory.SharedMemory(create=True, size=4096)
    before = shared_mappings()
    unmapped_later.close()
    unmapped_later.unlink()
    assert mappings_added_since(before) == {}
    kept = shared_memory.SharedMemory(create=True, size=4096)
    try:
        added = mappings_added_since(before)
        assert [name.rsplit("/", 1)[-1].split()[0] for name in added] == [kept.name.lstrip("/")]
    finally:
        kept.close()
        kept.unlink()
