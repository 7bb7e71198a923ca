"""Settings strings read by torch's rules, and Python values turned into settings text."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hybridmem import AllocatorSettingsError
from hybridmem.allocator.grammar import KEYS, format_settings, normalize_value, parse_settings
from hybridmem.allocator.rules import TorchRules

R211 = TorchRules((2, 11))
R29 = TorchRules((2, 9))


def test_parses_the_measured_example() -> None:
    text = "max_split_size_mb:256,garbage_collection_threshold:0.6,roundup_power2_divisions:4"
    assert parse_settings(text, R211) == {
        "max_split_size_mb": "256",
        "garbage_collection_threshold": "0.6",
        "roundup_power2_divisions": "4",
    }


def test_whitespace_duplicates_aliases_and_trailing_commas_like_torch() -> None:
    text = " expandable_segments : True , max_split_size_mb:\t64 ,expandable_segments:False, "
    assert parse_settings(text, R211) == {"max_split_size_mb": "64", "expandable_segments": "False"}
    assert parse_settings("", R211) == {}
    assert parse_settings("release_lock_on_hipmalloc:True", R211) == {
        "release_lock_on_cudamalloc": "True"
    }
    assert parse_settings("roundup_power2_divisions:[256:4, 512:2, >:1,]", R211) == {
        "roundup_power2_divisions": "[256:4,512:2,>:1,]"
    }
    # 2.10+ drops whitespace inside tokens too; 2.9 only spaces, and only where it splits
    assert parse_settings("max_split_size_mb:3 0", R211) == {"max_split_size_mb": "30"}
    with pytest.raises(AllocatorSettingsError, match="expected True or False"):
        parse_settings("expandable_segments:True\t", R29)


@pytest.mark.parametrize(
    ("text", "rules", "message"),
    [
        ("expandable_segments:True,,max_split_size_mb:64", R211, "does not know the setting ','"),
        (",expandable_segments:True", R211, "does not know the setting ','"),
        ("expandable_segments", R211, "ran out of tokens"),
        ("expandable_segments:true", R211, "expected True or False (exactly)"),
        ("max_split_size_mb:19", R211, "must be >= 20"),
        ("max_split_size_mb:20", R29, "must be >= 21"),
        ("max_split_size_mb:abc", R211, "is not a number (torch: stoull)"),
        ("max_split_size_mb:99999999999999999999", R211, "out of range (torch: stoull)"),
        ("garbage_collection_threshold:1.0", R211, "strictly between"),
        ("roundup_power2_divisions:3", R211, "power of 2"),
        ("roundup_power2_divisions:[256:3]", R211, "0 or a power of 2"),
        ("roundup_power2_divisions:[256:4", R211, "out of tokens"),
        ("large_segment_size_mb:64,max_split_size_mb:32", R211, "must be >= 64"),
        ("large_segment_size_mb:64", TorchRules((2, 10)), "does not know the setting"),
        ("pinned_reserve_segment_size_mb:0", R211, "must be > 0"),
        ("pinned_num_register_threads:256", R211, "must be <= 128"),
        ("per_process_memory_fraction:1.5", R211, "[0.0, 1.0]"),
        ("backend:cudaMallocSync", R211, "native and cudaMallocAsync"),
        ("backend:cudaMallocAsync", R211, "chosen at start-up"),
        ("foo:1", R211, "does not know the setting 'foo'"),
    ],
)
def test_strings_torch_refuses_are_refused_with_the_reason(
    text: str, rules: TorchRules, message: str
) -> None:
    with pytest.raises(AllocatorSettingsError, match="MY_ENV") as info:
        parse_settings(text, rules, origin="MY_ENV")
    assert message in str(info.value)
    assert isinstance(info.value, ValueError)


def test_a_cpu_build_skips_keys_it_does_not_know() -> None:
    cpu = TorchRules((2, 13), device=False)
    assert parse_settings("some_future_key:[a:b],expandable_segments:True", cpu) == {
        "some_future_key": "[a:b]",
        "expandable_segments": "True",
    }
    assert TorchRules((2, 13), device=False).run("a:b,,c:d").accepted  # skipped unread


def test_normalize_python_values() -> None:
    assert normalize_value("expandable_segments", True, R211) == "True"
    assert normalize_value("max_split_size_mb", 512, R211) == "512"
    assert normalize_value("garbage_collection_threshold", 0.8, R211) == "0.8"
    assert normalize_value("per_process_memory_fraction", 1, R211) == "1.0"
    assert normalize_value("roundup_power2_divisions", 4, R211) == "4"
    assert normalize_value("roundup_power2_divisions", {256: 4, ">": 1}, R211) == "[256:4,>:1]"
    assert normalize_value("roundup_power2_divisions", "[256:4, >:1]", R211) == "[256:4,>:1]"
    assert normalize_value("expandable_segments", "False", R211) == "False"
    assert normalize_value("large_segment_size_mb", 64, R211) == "64"


def test_an_unknown_setting_lists_this_torchs_settings_only() -> None:
    """torch 2.15's reserve keys are not settings of torch 2.13: never listed as known there."""
    with pytest.raises(ValueError, match="unknown allocator setting") as err:
        normalize_value("max_splt_size_mb", 256, TorchRules((2, 13)))
    said = str(err.value)
    assert said.startswith("unknown allocator setting 'max_splt_size_mb' (did you mean")
    assert "torch 2.13 knows: " in said
    assert "pinned_max_cached_size_mb" in said
    assert "expandable_segments_reserve" not in said
    with pytest.raises(ValueError, match="expandable_segments_reserve"):
        normalize_value("max_splt_size_mb", 256, TorchRules((2, 15)))


@pytest.mark.parametrize(
    ("key", "value", "rules", "error", "message"),
    [
        ("max_split_size", 256, R211, ValueError, "torch 2.11 knows: backend"),
        ("expandable_segments", 1, R211, TypeError, "True or False"),
        ("expandable_segments", "yes", R211, ValueError, "True or False"),
        ("max_split_size_mb", True, R211, TypeError, "bool"),
        ("max_split_size_mb", 2.5, R211, TypeError, "takes a int"),
        ("max_split_size_mb", "-5", R211, ValueError, "whole number"),
        ("max_split_size_mb", 10, R211, ValueError, ">= 20"),
        ("max_split_size_mb", 20, R29, ValueError, ">= 21"),
        ("garbage_collection_threshold", 2.0, R211, ValueError, "strictly between"),
        ("garbage_collection_threshold", "0.5x", R211, ValueError, "a number is needed"),
        ("roundup_power2_divisions", [4], R211, TypeError, "roundup"),
        ("large_segment_size_mb", 64, TorchRules((2, 10)), ValueError, "torch 2.11 added it"),
        ("pinned_free_catch_all", True, R211, ValueError, "torch 2.12 added it"),
    ],
)
def test_normalize_rejects_bad_values(
    key: str, value: object, rules: TorchRules, error: type[Exception], message: str
) -> None:
    with pytest.raises(error) as info:
        normalize_value(key, value, rules)
    assert message in str(info.value)


def test_every_key_is_known_to_the_model_from_its_version() -> None:
    for key, spec in KEYS.items():
        assert key in TorchRules(spec.since).keys, key
        if spec.since > (2, 4):
            before = (spec.since[0], spec.since[1] - 1)
            assert key not in TorchRules(before).keys, key


# --------------------------------------------------------------------------- #
# Property tests
# --------------------------------------------------------------------------- #

_POW2 = st.sampled_from([1, 2, 4, 8, 16, 32, 64, 128])
_VALUES = {
    "expandable_segments": st.sampled_from(["True", "False"]),
    "max_split_size_mb": st.integers(21, 1 << 20).map(str),
    "max_non_split_rounding_mb": st.integers(21, 4096).map(str),
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


@given(settings_dicts, st.data(), st.sampled_from([(2, 9), (2, 10), (2, 11), (2, 13)]))
def test_format_then_parse_round_trips_with_any_whitespace(
    settings: dict[str, str], data: st.DataObject, version: tuple[int, int]
) -> None:
    rules = TorchRules(version)
    text = format_settings(settings.items())
    spaced = "".join(
        ch + data.draw(st.sampled_from(["", " ", "  "] + (["\t"] if version >= (2, 10) else [])))
        if ch in ",:[]"
        else ch
        for ch in text
    )
    assert parse_settings(spaced, rules) == settings
    if settings:  # torch takes a trailing comma (a lone "," is refused)
        assert parse_settings(spaced + ",", rules) == settings


@given(st.integers(max_value=19), st.sampled_from([(2, 9), (2, 11), (2, 13)]))
def test_any_split_size_below_20_is_rejected(value: int, version: tuple[int, int]) -> None:
    if value < 0:  # torch reads a negative size as 2**64 - |n|: unlimited, not refused
        return
    with pytest.raises(AllocatorSettingsError):
        parse_settings(f"max_split_size_mb:{value}", TorchRules(version))


@given(
    st.text(alphabet="abc_:,[]>0123456789 .\t", max_size=40),
    st.sampled_from([(2, 4), (2, 9), (2, 10), (2, 11), (2, 13)]),
    st.booleans(),
)
def test_the_model_never_fails_but_with_a_reason(
    text: str, version: tuple[int, int], device: bool
) -> None:
    outcome = TorchRules(version, device).run(text)
    assert (outcome.error is None) == outcome.accepted
    if outcome.accepted:  # what torch takes reads back the same way, item by item
        again = TorchRules(version, device).run(format_settings(outcome.items))
        assert again.accepted
        assert again.state == outcome.state
