"""hybridmem's binding of the NCCL library in the process, against compiled stand-ins.

Each stand-in is a small C library named ``libnccl.so.2`` exporting NCCL's own
signatures (``src/nccl.h.in`` of NCCL 2.30.7): one with suspend, resume and memory
statistics, one of 2.28.9 without them. A child loads it as torch would (by path,
``RTLD_GLOBAL``) and hybridmem must find that one already-loaded library, pass the
arguments NCCL's ABI takes, and turn its error codes into errors that name the call.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hybridmem._platform.nccl import version_text
from tests.helpers import REPO, clean_env

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler (cc)")

_COMMON = r"""
#include <stdint.h>
#include <stddef.h>
typedef struct { int suspended; } comm_t;
int ncclGetVersion(int* v) { *v = VERSION; return 0; }
const char* ncclGetErrorString(int r) { return r == 5 ? "invalid usage" : "other error"; }
const char* ncclGetLastError(void* comm) { return "MemManager: Already suspended"; }
"""
_SUSPEND = r"""
int ncclCommSuspend(comm_t* c, int flags) {
  if (flags != 1) return 4;            /* ncclInvalidArgument: NCCL_SUSPEND_MEM only */
  if (c->suspended) return 5;          /* ncclInvalidUsage, as mem_manager.cc */
  c->suspended = 1; return 0;
}
int ncclCommResume(comm_t* c) { if (!c->suspended) return 5; c->suspended = 0; return 0; }
int ncclCommMemStats(comm_t* c, int stat, uint64_t* value) {
  if (value == NULL) return 4;
  switch (stat) {
    case 0: *value = 512ull << 20; return 0;
    case 1: *value = (uint64_t)c->suspended; return 0;
    case 2: *value = 96ull << 20; return 0;
    case 3: *value = (96ull << 20) + (c->suspended ? 0 : 512ull << 20); return 0;
    default: return 4;
  }
}
"""


def _build(tmp_path: Path, version: int, suspend: bool) -> Path:
    src = tmp_path / f"nccl{version}.c"
    src.write_text(f"#define VERSION {version}\n" + _COMMON + (_SUSPEND if suspend else ""))
    lib = tmp_path / str(version) / "libnccl.so.2"
    lib.parent.mkdir()
    subprocess.run(
        ["cc", "-shared", "-fPIC", "-Wl,-soname,libnccl.so.2", "-o", str(lib), str(src)],
        check=True,
    )
    return lib


def _child(code: str, lib: Path | None) -> str:
    prelude = "import ctypes, os\n"
    if lib is not None:
        prelude += f"ctypes.CDLL({str(lib)!r}, mode=ctypes.RTLD_GLOBAL)\n"
    result = subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
        cwd=REPO,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_suspend_resume_and_stats_go_through_the_loaded_library(tmp_path: Path) -> None:
    lib = _build(tmp_path, 23007, suspend=True)
    out = _child(
        """
        import ctypes
        from hybridmem._platform.nccl import MemStat, NcclCallError, loaded_nccl
        nccl = loaded_nccl()
        print(nccl.version, nccl.version_text, nccl.has_suspend)
        comm = ctypes.create_string_buffer(8)          # an ncclComm_t's stand-in
        ptr = ctypes.addressof(comm)
        print([nccl.mem_stat(ptr, s) for s in MemStat])
        nccl.suspend(ptr)
        print([nccl.mem_stat(ptr, s) for s in MemStat])
        try:
            nccl.suspend(ptr)
        except NcclCallError as e:
            print("error", e.call, e.code, e)
        nccl.resume(ptr)
        print(nccl.mem_stat(ptr, MemStat.SUSPENDED))
        """,
        lib,
    ).splitlines()
    assert out[0] == "23007 2.30.7 True"
    mib = 1 << 20
    assert out[1] == str([512 * mib, 0, 96 * mib, 608 * mib])
    assert out[2] == str([512 * mib, 1, 96 * mib, 96 * mib])
    assert out[3] == (
        "error ncclCommSuspend 5 ncclCommSuspend returned 5 (invalid usage; "
        "NCCL: MemManager: Already suspended)"
    )
    assert out[4] == "0"


def test_an_nccl_without_suspend_is_found_and_said_to_lack_it(tmp_path: Path) -> None:
    lib = _build(tmp_path, 22809, suspend=False)
    out = _child(
        """
        from hybridmem._platform.nccl import loaded_nccl
        nccl = loaded_nccl()
        print(nccl.version_text, nccl.has_suspend, nccl.path)
        """,
        lib,
    )
    assert out.split()[:2] == ["2.28.9", "False"]


def test_no_library_is_loaded_by_hybridmem() -> None:
    out = _child(
        """
        from hybridmem._platform.nccl import loaded_nccl
        print(loaded_nccl())
        print(any("libnccl" in l for l in open("/proc/self/maps")))
        """,
        None,
    )
    assert out.split() == ["None", "False"]


@pytest.mark.parametrize(
    ("code", "text"), [(23007, "2.30.7"), (22907, "2.29.7"), (21805, "2.18.5"), (2708, "2.7.8")]
)
def test_version_codes_read_as_nccl_writes_them(code: int, text: str) -> None:
    assert version_text(code) == text
