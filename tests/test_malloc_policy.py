"""The serving commands' allocator setting (minillm/malloc_policy.py), checked against glibc's own
accounting (mallinfo2) in a fresh interpreter, so this process's allocator is untouched."""

import ctypes
import os
import subprocess
import sys

import pytest

from minillm import cpu_policy, malloc_policy
from minillm.cli import common

GLIBC = malloc_policy._glibc() is not None and hasattr(ctypes.CDLL(None), "mallinfo2")

MALLINFO2 = """
class Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                                               "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Mallinfo2
"""  # glibc's accounting, in a probe's fresh interpreter

# Allocate and free a 16 MiB block (a prefill chunk's activations); print how much of it glibc mapped on its
# own (the change in hblkhd, bytes) and how much free memory its heap then holds (fordblks: a fresh
# interpreter's heap holds little).
PROBE = """
import ctypes, sys
from minillm.malloc_policy import keep_freed_memory

""" + MALLINFO2 + """libc.malloc.restype = ctypes.c_void_p
if sys.argv[1] == "keep":
    assert keep_freed_memory({}) is None
before = libc.mallinfo2()
block = libc.malloc(16 << 20)
mapped = libc.mallinfo2().hblkhd - before.hblkhd
libc.free(ctypes.c_void_p(block))
print(mapped, libc.mallinfo2().fordblks)
"""


def probe(mode: str) -> tuple[int, int]:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True).stdout
    mapped, kept = out.split()
    return int(mapped), int(kept)


@pytest.mark.cli
@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only (mallopt, mallinfo2)")
def test_a_large_block_comes_from_the_heap_and_stays_there_after_free():
    mapped, kept = probe("default")
    assert mapped >= 16 << 20 and kept < 16 << 20  # glibc's default: its own mmap, unmapped at free
    mapped, kept = probe("keep")
    assert mapped == 0 and kept >= 16 << 20  # the policy: from the heap, and kept for the next step


@pytest.mark.parametrize("environ, why", [
    ({"MALLOC_TRIM_THRESHOLD_": "0"}, "MALLOC_TRIM_THRESHOLD_ is set: the allocator is yours"),
    ({"LD_PRELOAD": "/usr/lib/libtcmalloc.so"}, "LD_PRELOAD is set: the allocator is yours"),
    ({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}, "GLIBC_TUNABLES sets glibc.malloc: the allocator is yours"),
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
    monkeypatch.setattr(malloc_policy, "bound_kernel_caches", lambda: applied.append(2))
    common.keep_freed_memory_in_command()
    assert applied == [2, 1][:2 * calls]


class FakeGlibc:
    """mallopt as a glibc before 2.35 answers it: an mmap threshold above 32 MiB refused (returns 0)."""

    def __init__(self, mmap_limit: int = 32 << 20):
        self.calls, self.mmap_limit = [], mmap_limit

    def mallopt(self, param: int, value: int) -> int:
        self.calls.append((param, value))
        return 0 if param == malloc_policy.M_MMAP_THRESHOLD and value > self.mmap_limit else 1


def test_an_older_glibc_accepts_the_thresholds(monkeypatch):
    libc = FakeGlibc()
    monkeypatch.setattr(malloc_policy, "_glibc", lambda: libc)
    assert malloc_policy.keep_freed_memory({"GLIBC_TUNABLES": "glibc.pthread.rseq=0"}) is None  # not malloc's
    assert libc.calls == [(malloc_policy.M_MMAP_THRESHOLD, 32 << 20), (malloc_policy.M_TRIM_THRESHOLD, 1 << 30)]


def test_a_refused_setting_is_named_and_the_other_still_set(monkeypatch, capsys):
    libc = FakeGlibc(mmap_limit=1 << 20)
    monkeypatch.setattr(malloc_policy, "_glibc", lambda: libc)
    assert malloc_policy.keep_freed_memory({}) == "glibc refused mallopt(M_MMAP_THRESHOLD)"
    assert libc.calls[-1] == (malloc_policy.M_TRIM_THRESHOLD, 1 << 30)
    monkeypatch.setattr(cpu_policy, "started_as_command", lambda: True)
    monkeypatch.setattr(malloc_policy.os, "environ", {})
    common.keep_freed_memory_in_command()
    assert capsys.readouterr().err == ("minillm: warning: glibc refused mallopt(M_MMAP_THRESHOLD): each step's large "
                                       "tensors will fault their pages in again (slower, not wrong)\n")


@pytest.mark.parametrize("environ, chosen", [
    ({}, ["ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"]),
    ({"LRU_CACHE_CAPACITY": "1024"}, ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"]),  # the user's own size stays
    ({"MINILLM_MALLOC_POLICY": "off"}, []),
])
def test_the_kernel_caches_are_bounded_unless_the_user_chose(environ, chosen):
    before = dict(environ)
    assert malloc_policy.bound_kernel_caches(environ) == chosen
    assert environ == before | {name: str(malloc_policy.KERNEL_CACHE_ENTRIES) for name in chosen}


# bfloat16 products at 200 row counts (a server's steps), in a fresh interpreter: print the growth of the memory
# glibc holds in use (uordblks, bytes) from the first product on
KERNEL_PROBE = """
import ctypes, random, sys
from minillm.malloc_policy import bound_kernel_caches
import torch
if sys.argv[1] == "bound":
    bound_kernel_caches()
""" + MALLINFO2 + """torch.set_num_threads(1)
ws = [torch.randn(1536, 576, dtype=torch.bfloat16), torch.randn(576, 1536, dtype=torch.bfloat16)]
torch.nn.functional.linear(torch.randn(1, 576, dtype=torch.bfloat16), ws[0])
before = libc.mallinfo2().uordblks
for rows in random.Random(0).sample(range(2, 513), 200):
    for w in ws:
        torch.nn.functional.linear(torch.randn(rows, w.shape[1], dtype=torch.bfloat16), w)
print(libc.mallinfo2().uordblks - before)
"""


@pytest.mark.cli
@pytest.mark.skipif(not GLIBC, reason="glibc's accounting (mallinfo2)")
def test_bounded_kernel_caches_keep_a_servers_memory_from_growing_with_each_row_count():
    def grown(mode: str) -> int:
        env = {k: v for k, v in os.environ.items() if k not in malloc_policy.KERNEL_CACHES}
        run = subprocess.run([sys.executable, "-c", KERNEL_PROBE, mode], capture_output=True, text=True, check=True,
                             env=env)
        return int(run.stdout.split()[-1])

    unbounded = grown("default")
    if unbounded < 32 << 20:
        pytest.skip(f"this CPU's bfloat16 products kept {unbounded >> 20} MiB for 400 shapes: no per-shape kernels")
    assert grown("bound") < unbounded / 8  # 400 kernels kept against 16 in each cache


def vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds ``address`` (/proc/self/smaps)."""
    inside = False
    for line in open("/proc/self/smaps"):
        first = line.split()[0]
        if "-" in first and ":" not in first:
            start, end = (int(x, 16) for x in first.split("-"))
            inside = start <= address < end
        elif inside and first == "VmFlags:":
            return line.split()[1:]
    return []


def transparent_huge_pages() -> str:
    try:
        return open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return "[never]"


@pytest.mark.skipif(not GLIBC or "[never]" in transparent_huge_pages(), reason="Linux with transparent huge pages")
def test_a_serving_commands_kv_pool_is_advised_into_huge_pages_and_holds_zeros(monkeypatch):
    """After use_huge_pages_for_pools (the serving commands call it), a pool's memory carries MADV_HUGEPAGE ("hg" in
    its mapping's flags), set before its zeros touched it; before it (a program that imports minillm), and with
    MINILLM_MALLOC_POLICY=off, it does not. A small tensor (no whole 2 MiB page inside) is left alone."""
    from minillm.serving.paged_cache import PagedKVCache

    def flags(cache):  # each pool is 6 MiB: its own mapping
        return [vm_flags(pool.data_ptr() + pool.numel() * pool.element_size() // 2) for pool in (cache.k, cache.v)]

    monkeypatch.setattr(malloc_policy, "_huge_page_pools", False)
    assert not any("hg" in f for f in flags(PagedKVCache(2, 3, 64, num_blocks=512, block_size=16)))
    assert not malloc_policy.use_huge_pages_for_pools({malloc_policy.OPT_OUT: "off"})
    assert not any("hg" in f for f in flags(PagedKVCache(2, 3, 64, num_blocks=512, block_size=16)))
    assert malloc_policy.use_huge_pages_for_pools({})
    cache = PagedKVCache(2, 3, 64, num_blocks=512, block_size=16)
    assert all("hg" in f for f in flags(cache))
    assert not cache.k.any() and not cache.v.any()
    assert not malloc_policy.advise_huge_pages(4096, 4096)


def test_only_the_serving_commands_process_asks_for_huge_pages(monkeypatch):
    """keep_freed_memory_in_command turns the pools' huge pages on in the command's own process only."""
    monkeypatch.setattr(malloc_policy, "_huge_page_pools", False)
    monkeypatch.setattr(malloc_policy, "keep_freed_memory", lambda environ=None: None)
    monkeypatch.setattr(malloc_policy, "bound_kernel_caches", lambda environ=None: [])
    monkeypatch.setattr(cpu_policy, "started_as_command", lambda: False)
    common.keep_freed_memory_in_command()
    assert not malloc_policy.huge_pages_for_pools()
    monkeypatch.setattr(cpu_policy, "started_as_command", lambda: True)
    monkeypatch.delenv(malloc_policy.OPT_OUT, raising=False)
    common.keep_freed_memory_in_command()
    assert malloc_policy.huge_pages_for_pools()
