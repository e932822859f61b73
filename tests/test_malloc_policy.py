"""The serving commands' allocator setting (minillm/malloc_policy.py), checked against glibc's own
accounting (mallinfo2) in a fresh interpreter, so this process's allocator is untouched."""

import ctypes
import subprocess
import sys

import pytest

from minillm import cpu_policy, malloc_policy
from minillm.cli import common

GLIBC = malloc_policy._glibc() is not None and hasattr(ctypes.CDLL(None), "mallinfo2")

# Allocate and free a 64 MiB block; print how much of it glibc mapped on its own (the change in hblkhd,
# bytes) and how much free memory its heap then holds (fordblks: a fresh interpreter's heap holds little).
PROBE = """
import ctypes, sys
from minillm.malloc_policy import keep_freed_memory

class Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Mallinfo2
libc.malloc.restype = ctypes.c_void_p
if sys.argv[1] == "keep":
    assert keep_freed_memory({}) is None
before = libc.mallinfo2()
block = libc.malloc(64 << 20)
mapped = libc.mallinfo2().hblkhd - before.hblkhd
libc.free(ctypes.c_void_p(block))
print(mapped, libc.mallinfo2().fordblks)
"""


def probe(mode: str) -> tuple[int, int]:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True).stdout
    mapped, kept = out.split()
    return int(mapped), int(kept)


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only (mallopt, mallinfo2)")
def test_a_large_block_comes_from_the_heap_and_stays_there_after_free():
    mapped, kept = probe("default")
    assert mapped >= 64 << 20 and kept < 64 << 20  # glibc's default: its own mmap, unmapped at free
    mapped, kept = probe("keep")
    assert mapped == 0 and kept >= 64 << 20  # the policy: from the heap, and kept for the next step


@pytest.mark.parametrize("environ, why", [
    ({"MALLOC_TRIM_THRESHOLD_": "0"}, "MALLOC_TRIM_THRESHOLD_ is set: the allocator is yours"),
    ({"LD_PRELOAD": "/usr/lib/libtcmalloc.so"}, "LD_PRELOAD is set: the allocator is yours"),
    ({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}, "GLIBC_TUNABLES is set: the allocator is yours"),
    ({"MINILLM_MALLOC_POLICY": "off"}, "MINILLM_MALLOC_POLICY=off"),
    ({"MINILLM_MALLOC_POLICY": "No"}, "MINILLM_MALLOC_POLICY=No"),
])
def test_the_users_own_allocator_settings_win(environ, why, monkeypatch):
    monkeypatch.setattr(malloc_policy, "_glibc", lambda: pytest.fail("mallopt must not be reached"))
    assert malloc_policy.keep_freed_memory(environ) == why


def test_not_glibc_is_named_and_not_an_error(monkeypatch):
    monkeypatch.setattr(malloc_policy, "_glibc", lambda: None)
    assert malloc_policy.keep_freed_memory({}) == "the C library is not glibc"


@pytest.mark.parametrize("as_command, calls", [(True, 1), (False, 0)])
def test_only_the_command_process_changes_its_allocator(as_command, calls, monkeypatch):
    applied = []
    monkeypatch.setattr(cpu_policy, "started_as_command", lambda: as_command)
    monkeypatch.setattr(malloc_policy, "keep_freed_memory", lambda: applied.append(1))
    common.keep_freed_memory_in_command()
    assert len(applied) == calls
