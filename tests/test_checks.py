"""The one argument-checking helper: bools are never numbers, bounds name the value."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hybridmem._checks import check_bool, check_number


@pytest.mark.parametrize("value", [True, False, "1", None, 1.5, [1]])
def test_only_ints_are_ints(value: object) -> None:
    with pytest.raises(TypeError, match=r"n must be an int, got"):
        check_number("n", value, integer=True)


@pytest.mark.parametrize("value", [True, "1", None])
def test_bools_and_strings_are_not_numbers(value: object) -> None:
    with pytest.raises(TypeError, match=r"t must be a number, got"):
        check_number("t", value)


def test_bounds_and_words() -> None:
    assert check_number("b", 8, integer=True, minimum=1, maximum=8) == 8
    with pytest.raises(ValueError, match="b must be between 1 and 8, got 9"):
        check_number("b", 9, integer=True, minimum=1, maximum=8)
    with pytest.raises(ValueError, match="t must be >= 0, got -1"):
        check_number("t", -1, minimum=0)
    with pytest.raises(ValueError, match="t must be > 0, got 0"):
        check_number("t", 0, above=0)
    with pytest.raises(ValueError, match="w must be an int >= 3, got 2"):
        check_number("w", 2, integer=True, minimum=3, expected="an int >= 3")
    with pytest.raises(ValueError, match="w must be an int >= 3, got 'x'"):
        check_number(
            "w", "x", integer=True, minimum=3, expected="an int >= 3", wrong_type=ValueError
        )
    with pytest.raises(TypeError, match="flag must be True or False"):
        check_bool("flag", 1)


@given(st.integers(-100, 100), st.integers(-100, 100))
def test_minimum_is_inclusive(value: int, minimum: int) -> None:
    if value >= minimum:
        assert check_number("n", value, integer=True, minimum=minimum) == value
    else:
        with pytest.raises(ValueError, match=f"n must be >= {minimum}, got {value}"):
            check_number("n", value, integer=True, minimum=minimum)
