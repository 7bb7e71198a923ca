"""The settings strings the recorded answers cover: curated ones and random ones (fixed seed).

Each case is ``{"env": {variable: text}, "sets": [string, ...]}``: a process started
with that env, then each string given to torch's setter in turn (so that what a
call keeps from the one before is covered too).
"""

from __future__ import annotations

import random
from typing import Any

__all__ = ["CURATED", "corpus"]

CURATED_STRINGS = [
    "",
    ",",
    "expandable_segments:True,",
    ",expandable_segments:True",
    "expandable_segments:True,,max_split_size_mb:64",
    "expandable_segments : True",
    "expandable_segments:Tr ue",
    "expandable_segments,True",
    "expandable_segments:True\t",
    "max_split_size_mb:3 0",
    "max_split_size_mb:-5",
    "max_split_size_mb:25.5",
    "max_split_size_mb:+30",
    "max_split_size_mb:0x20",
    "max_split_size_mb:20",
    "max_split_size_mb:21",
    "max_split_size_mb:19",
    "max_split_size_mb:99999999999999999999",
    "max_split_size_mb:18446744073709551615",
    "max_split_size_mb:abc",
    "max_non_split_rounding_mb:19",
    "max_non_split_rounding_mb:20",
    "max_non_split_rounding_mb:64",
    "garbage_collection_threshold:0",
    "garbage_collection_threshold:1",
    "garbage_collection_threshold:0.5",
    "garbage_collection_threshold:.5",
    "garbage_collection_threshold:5e-1",
    "garbage_collection_threshold:nan",
    "garbage_collection_threshold:0.5abc",
    "garbage_collection_threshold:-0.5",
    "roundup_power2_divisions:4",
    "roundup_power2_divisions:3",
    "roundup_power2_divisions:0",
    "roundup_power2_divisions:1",
    "roundup_power2_divisions:[256:4,>:1]",
    "roundup_power2_divisions:[256:4,>:1,]",
    "roundup_power2_divisions:[]",
    "roundup_power2_divisions:[,]",
    "roundup_power2_divisions:[256:3]",
    "roundup_power2_divisions:[255:4]",
    "roundup_power2_divisions:[>:2]",
    "roundup_power2_divisions:[256:0,512:2]",
    "roundup_power2_divisions:[1:4,65536:2,131072:8]",
    "roundup_power2_divisions:[256:4",
    "roundup_power2_divisions:[256:4,>:1]x",
    "roundup_power2_divisions:4,roundup_power2_divisions:[]",
    "large_segment_size_mb:10",
    "large_segment_size_mb:11",
    "large_segment_size_mb:20",
    "large_segment_size_mb:64",
    "large_segment_size_mb:64,max_split_size_mb:32",
    "max_split_size_mb:32,large_segment_size_mb:64",
    "large_segment_size_mb:64,max_split_size_mb:64",
    "large_segment_size_mb:64,max_non_split_rounding_mb:32",
    "pinned_use_background_threads:True",
    "release_lock_on_cudamalloc:True",
    "release_lock_on_hipmalloc:True",
    "pinned_use_cuda_host_register:True",
    "pinned_use_hip_host_register:True",
    "pinned_num_register_threads:1",
    "pinned_num_register_threads:0",
    "pinned_num_register_threads:3",
    "pinned_num_register_threads:128",
    "pinned_num_register_threads:256",
    "pinned_reserve_segment_size_mb:0",
    "pinned_reserve_segment_size_mb:64",
    "graph_capture_record_stream_reuse:True",
    "per_process_memory_fraction:0.5",
    "per_process_memory_fraction:0",
    "per_process_memory_fraction:1",
    "per_process_memory_fraction:1.5",
    "pinned_free_catch_all:True",
    "throw_on_cudamalloc_oom:True",
    "pinned_max_cached_size:64",
    "expandable_segments_reserve:0.5",
    "backend:native",
    "backend:foo",
    "foo:1",
    "expandable_segments:True,foo:1",
    "expandable_segments",
    "expandable_segments:",
    ":True",
    "expandable_segments:True:False",
    "expandable_segments:[True]",
    "max_split_size_mb:64,max_split_size_mb:128",
    "expandable_segments:True;max_split_size_mb:64",
    "garbage_collection_threshold:0.5,expandable_segments:True,max_split_size_mb:5",
    "max_split_size_mb:64,release_lock_on_cudamalloc:True,pinned_num_register_threads:3",
    "pinned_num_register_threads:4,release_lock_on_cudamalloc:True,max_split_size_mb:5",
]

CURATED: list[dict[str, Any]] = [{"env": {}, "sets": [s]} for s in CURATED_STRINGS] + [
    {
        "env": {
            "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512,garbage_collection_threshold:0.6",
            "PYTORCH_ALLOC_CONF": "expandable_segments:True",
        },
        "sets": ["expandable_segments:False", "expandable_segments:True"],
    },
    {"env": {"PYTORCH_ALLOC_CONF": "expandable_segments:True"}, "sets": [""]},
    {
        "env": {"PYTORCH_CUDA_ALLOC_CONF": "", "PYTORCH_ALLOC_CONF": "expandable_segments:True"},
        "sets": [],
    },
    {"env": {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:abc"}, "sets": []},
    {"env": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:yes"}, "sets": []},
    {
        "env": {
            "PYTORCH_CUDA_ALLOC_CONF": "max_non_split_rounding_mb:64,pinned_num_register_threads:4"
        },
        "sets": ["release_lock_on_cudamalloc:True", "pinned_reserve_segment_size_mb:64", ""],
    },
    {
        "env": {},
        "sets": ["large_segment_size_mb:64", "max_split_size_mb:32", "max_split_size_mb:64"],
    },
]

_KEYS = [
    "max_split_size_mb",
    "max_non_split_rounding_mb",
    "garbage_collection_threshold",
    "roundup_power2_divisions",
    "expandable_segments",
    "pinned_use_background_threads",
    "large_segment_size_mb",
    "backend",
    "release_lock_on_cudamalloc",
    "release_lock_on_hipmalloc",
    "pinned_use_cuda_host_register",
    "pinned_use_hip_host_register",
    "pinned_num_register_threads",
    "pinned_reserve_segment_size_mb",
    "graph_capture_record_stream_reuse",
    "per_process_memory_fraction",
    "pinned_free_catch_all",
    "throw_on_cudamalloc_oom",
    "foo",
]
_INTS = [
    "0",
    "1",
    "2",
    "3",
    "4",
    "8",
    "10",
    "11",
    "16",
    "19",
    "20",
    "21",
    "32",
    "64",
    "100",
    "128",
    "256",
    "512",
    "1024",
    "-5",
    "-1",
    "+30",
    "25.5",
    "0x20",
    "30abc",
    "abc",
]
_INTS += ["", "99999999999", "18446744073709551615", "3 0"]
_FLOATS = [
    "0",
    "0.5",
    "0.6",
    ".5",
    "5e-1",
    "1",
    "1.0",
    "1.5",
    "-0.5",
    "nan",
    "inf",
    "0.5abc",
    "abc",
    "0.999999",
    "1e-5",
]
_BOOLS = ["True", "False", "true", "1", "yes", "True ", "Tr ue", ""]
_LISTS = [
    "[256:4,>:1]",
    "[256:4,>:1,]",
    "[]",
    "[>:2]",
    "[256:3]",
    "[255:4]",
    "[1:4,65536:2,131072:8]",
    "[64:8,128:2,256:4,512:2,1024:4,>:1]",
    "[256:4",
    "[,]",
    "[256:4,512]",
    "[>:1,256:4]",
    "[2048:0,>:4]",
    "[256,4]",
]
_SIZES = {
    "max_split_size_mb",
    "max_non_split_rounding_mb",
    "large_segment_size_mb",
    "pinned_num_register_threads",
    "pinned_reserve_segment_size_mb",
}


def _value(key: str, r: random.Random) -> str:
    if key in ("garbage_collection_threshold", "per_process_memory_fraction"):
        return r.choice(_FLOATS)
    if key == "roundup_power2_divisions":
        return r.choice(_LISTS + _INTS[:10])
    if key == "backend":
        return r.choice(["native", "cudaMallocAsync", "foo"])
    if key in _SIZES:
        return r.choice(_INTS)
    return r.choice(_BOOLS)


def _item(r: random.Random) -> str:
    key = r.choice(_KEYS)
    sep = r.choices([":", ",", "", ": ", " :"], [20, 1, 1, 1, 1])[0]
    return f"{key}{sep}{_value(key, r)}"


def _string(r: random.Random) -> str:
    items = [_item(r) for _ in range(r.choice([0, 1, 1, 2, 2, 3, 4]))]
    text = r.choices([",", ", ", ",,", ";"], [20, 2, 1, 1])[0].join(items)
    if r.random() < 0.05:
        text += ","
    if r.random() < 0.03:
        text = "," + text
    if r.random() < 0.05:
        text = " " + text + "\t"
    return text


def corpus(seed: int = 1234, count: int = 240) -> list[dict[str, Any]]:
    """The curated cases, then ``count`` random setter cases and ``count // 3`` env cases."""
    r = random.Random(seed)
    cases = list(CURATED)
    for _ in range(count):
        cases.append({"env": {}, "sets": [_string(r) for _ in range(r.choice([1, 2, 3]))]})
    for _ in range(count // 3):
        env: dict[str, str] = {}
        if r.random() < 0.8:
            env["PYTORCH_CUDA_ALLOC_CONF"] = _string(r) if r.random() < 0.9 else ""
        if r.random() < 0.5:
            env["PYTORCH_ALLOC_CONF"] = _string(r)
        if "cudaMallocAsync" in "".join(env.values()):
            continue  # the probe has no driver, whose version torch checks for this backend
        cases.append({"env": env, "sets": [_string(r)]})
    return cases
