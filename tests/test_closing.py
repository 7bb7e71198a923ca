"""``ClosesOnExit``: ``with`` closes, error or not, and says when ``close`` is missing."""

from __future__ import annotations

import pytest

import hybridmem as hm
from hybridmem._closing import ClosesOnExit
from hybridmem.integrations.vllm.trainer import TrainerLink


class Held(ClosesOnExit):
    def __init__(self) -> None:
        self.closes = 0

    def close(self) -> None:
        self.closes += 1


def test_with_returns_the_object_and_closes_it() -> None:
    held = Held()
    with held as entered:
        assert entered is held
        assert held.closes == 0
    assert held.closes == 1


def test_with_closes_on_an_error_and_lets_it_through() -> None:
    held = Held()
    with pytest.raises(KeyError, match="boom"), held:
        raise KeyError("boom")
    assert held.closes == 1


def test_a_class_without_close_says_so() -> None:
    class Forgot(ClosesOnExit):
        pass

    with pytest.raises(NotImplementedError, match=r"Forgot must define close\(\)"), Forgot():
        pass


@pytest.mark.parametrize("cls", [hm.WeightBucket, hm.BucketReceiver, TrainerLink])
def test_the_closeable_classes_close_on_exit(cls: type) -> None:
    assert issubclass(cls, ClosesOnExit)
    assert "close" in vars(cls)  # their own, not the mixin's
