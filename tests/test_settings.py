"""torch's allocator settings grammar: parsing, validation, normalisation."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hybridmem import AllocatorSettingsError
from hybridmem._settings import KEYS, format_settings, normalize_value, parse_settings


def test_parses_the_measured_example() -> None:
    text = "max_split_size_mb:256,garbage_collection_threshold:0.6,roundup_power2_divisions:4"
    assert parse_settings(text) == {
        "max_split_size_mb": "256",
        "garbage_collection_threshold": "0.6",
        "roundup_power2_divisions": "4",
    }


def test_whitespace_empty_items_and_duplicates_like_torch() -> None:
    text = " expandable_segments : True ,, max_split_size_mb:\t64 ,expandable_segments:False, "
    assert parse_settings(text) == {"max_split_size_mb": "64", "expandable_segments": "False"}
    assert parse_settings("") == {}
    assert parse_settings(" , ") == {}


def test_bracketed_roundup_list() -> None:
    parsed = parse_settings("roundup_power2_divisions:[256:4, 512:2, >:1],backend:native")
    assert parsed == {"roundup_power2_divisions": "[256:4,512:2,>:1]", "backend": "native"}


def test_unknown_keys_are_kept_verbatim() -> None:
    # A newer torch may know keys hybridmem does not; torch judges them.
    assert parse_settings("some_future_key:[a:b],expandable_segments:True") == {
        "some_future_key": "[a:b]",
        "expandable_segments": "True",
    }


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("expandable_segments", "expected ':'"),
        ("expandable_segments:", "missing value"),
        ("expandable_segments:True max_split_size_mb:30", "expected ','"),
        ("max_split_size_mb:30 40", "expected ','"),
        ("a:b:c", "expected ','"),
        ("roundup_power2_divisions:[256:4", "missing ']'"),
        ("roundup_power2_divisions:[[256:4]]", "nested"),
        ("9key:1", "setting name"),
        (":True", "setting name"),
        ("expandable_segments:true", "True or False"),
        ("expandable_segments:1", "True or False"),
        ("max_split_size_mb:19", ">= 20"),
        ("max_split_size_mb:-5", "whole number"),
        ("max_split_size_mb:25.5", "whole number"),
        ("max_non_split_rounding_mb:10", ">= 20"),
        ("garbage_collection_threshold:1.0", "strictly between"),
        ("garbage_collection_threshold:0", "strictly between"),
        ("garbage_collection_threshold:abc", "expected a number"),
        ("garbage_collection_threshold:nan", "finite"),
        ("roundup_power2_divisions:3", "power of 2"),
        ("roundup_power2_divisions:[256:3]", "0 or a power of 2"),
        ("roundup_power2_divisions:[300:4]", "power of 2"),
        ("roundup_power2_divisions:[256]", "SIZE_MB:DIVISIONS"),
        ("roundup_power2_divisions:[]", "empty"),
        ("backend:cudaMallocSync", "native or cudaMallocAsync"),
        ("pinned_num_register_threads:3", "power of 2"),
        ("pinned_num_register_threads:256", "no larger than 128"),
        ("per_process_memory_fraction:1.5", "(0.0, 1.0]"),
    ],
)
def test_bad_strings_are_rejected_with_the_reason(text: str, message: str) -> None:
    with pytest.raises(AllocatorSettingsError, match="MY_ENV") as info:
        parse_settings(text, origin="MY_ENV")
    assert message in str(info.value)
    assert isinstance(info.value, ValueError)


def test_normalize_python_values() -> None:
    assert normalize_value("expandable_segments", True) == "True"
    assert normalize_value("max_split_size_mb", 512) == "512"
    assert normalize_value("garbage_collection_threshold", 0.8) == "0.8"
    assert normalize_value("per_process_memory_fraction", 1) == "1.0"
    assert normalize_value("roundup_power2_divisions", 4) == "4"
    assert normalize_value("roundup_power2_divisions", {256: 4, ">": 1}) == "[256:4,>:1]"
    assert normalize_value("roundup_power2_divisions", "[256:4, >:1]") == "[256:4,>:1]"
    assert normalize_value("expandable_segments", "False") == "False"


@pytest.mark.parametrize(
    ("key", "value", "error", "message"),
    [
        ("max_split_size", 256, ValueError, "known settings: backend"),
        ("expandable_segments", 1, TypeError, "True or False"),
        ("expandable_segments", "yes", ValueError, "True or False"),
        ("max_split_size_mb", True, TypeError, "bool"),
        ("max_split_size_mb", 2.5, TypeError, "takes a int"),
        ("max_split_size_mb", 10, ValueError, ">= 20"),
        ("garbage_collection_threshold", 2.0, ValueError, "strictly between"),
        ("roundup_power2_divisions", [4], TypeError, "roundup"),
    ],
)
def test_normalize_rejects_bad_values(
    key: str, value: object, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        normalize_value(key, value)


# --------------------------------------------------------------------------- #
# Property tests
# --------------------------------------------------------------------------- #

_POW2 = st.sampled_from([1, 2, 4, 8, 16, 32, 64, 128])
_VALUES = {
    "expandable_segments": st.sampled_from(["True", "False"]),
    "max_split_size_mb": st.integers(20, 1 << 20).map(str),
    "max_non_split_rounding_mb": st.integers(20, 4096).map(str),
    "garbage_collection_threshold": st.floats(0.01, 0.99).map(repr),
    "roundup_power2_divisions": st.one_of(
        _POW2.map(str),
        st.lists(
            st.tuples(st.sampled_from(["64", "256", "1024", ">"]), _POW2.map(str)),
            min_size=1,
            max_size=4,
        ).map(lambda items: "[" + ",".join(f"{a}:{b}" for a, b in items) + "]"),
    ),
    "pinned_use_background_threads": st.sampled_from(["True", "False"]),
    "release_lock_on_cudamalloc": st.sampled_from(["True", "False"]),
    "pinned_num_register_threads": _POW2.map(str),
}

settings_dicts = st.dictionaries(
    st.sampled_from(sorted(_VALUES)), st.just(""), min_size=0, max_size=len(_VALUES)
).flatmap(lambda d: st.fixed_dictionaries({k: _VALUES[k] for k in d}))


@given(settings_dicts, st.data())
def test_format_then_parse_round_trips_with_any_whitespace(
    settings: dict[str, str], data: st.DataObject
) -> None:
    text = format_settings(settings.items())
    # torch drops whitespace between and inside tokens' surroundings
    spaced = "".join(
        ch + data.draw(st.sampled_from(["", " ", "  ", "\t"])) if ch in ",:[]" else ch
        for ch in text
    )
    assert parse_settings(spaced) == settings
    assert parse_settings(spaced + ",") == settings


@given(st.integers(max_value=19))
def test_any_split_size_below_20_is_rejected(value: int) -> None:
    with pytest.raises(AllocatorSettingsError):
        parse_settings(f"max_split_size_mb:{value}")


@given(st.text(alphabet="abc_:,[]>0123456789 .", max_size=40))
def test_parser_never_fails_with_anything_but_a_settings_error(text: str) -> None:
    try:
        result = parse_settings(text)
    except AllocatorSettingsError:
        return
    for key, value in result.items():
        assert key
        if key in KEYS:
            assert KEYS[key].validate(value) == value  # canonical values are fixed points
