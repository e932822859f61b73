"""How the serving commands' process keeps the memory it frees: glibc's malloc, told to hold on to it.

Every step of the serving engine allocates and frees the same large tensors (a batch's activations,
its [rows, vocab] logits, a prefill chunk's [512, 3072] gate|up output). By default glibc's malloc
hands a block above its mmap threshold (128 KiB, rising with what is freed up to 32 MiB) its own
``mmap`` and unmaps it at ``free``, and gives the heap's free top back to the OS past its trim
threshold (128 KiB, rising with the mmap threshold). The next step's tensors then fault their pages
in again: the kernel zeroes every 4 KiB page, and with two threads both wait. Measured on the issue
32 workload in process (``minillm bench-serving --policies continuous+chunked``, 32 prompts of 32-512
tokens, 2 threads, SmolLM2-135M float32, 2026-12-03): 125-126 output tok/s with this module off
(``MINILLM_MALLOC_POLICY=off``), 148-149 with it on; a batch-32 decode step 100-250 ms (varying step
to step) against 94-98 ms. Either threshold alone did not help (the trim threshold alone made it
worse). vLLM's CPU guide recommends tcmalloc for the same reason; this keeps glibc and sets two of
its documented knobs (``mallopt(3)``).

So ``minillm serve`` and ``minillm bench-serving`` (the command, not a program that imports minillm)
call :func:`keep_freed_memory` at start: blocks up to MMAP_BYTES (32 MiB, the largest mmap threshold
every glibc accepts; a thread's own heap holds up to 64 MiB, so the engine thread's blocks fit too)
come from the heap, and up to TRIM_BYTES of freed memory stays mapped for the next step. The cost:
the process's resident memory stays near its peak instead of shrinking between steps (~20 MB more for
SmolLM2-135M after a few requests). A program that runs the engine itself can call it too. Left
alone where the user chose an allocator or its settings (the variables in :data:`USER_SETTINGS`, a
``glibc.malloc`` tunable), with ``MINILLM_MALLOC_POLICY=off``, and where the C library is not glibc
(macOS, musl).

The same commands bound two caches inside torch that grow with every new row count
(:func:`bound_kernel_caches`). A bfloat16 product runs on oneDNN, which compiles a kernel for each
(rows, matrix) shape and keeps it: in oneDNN's primitive cache and in ideep's (the wrapper torch calls
it through), 1,024 entries each by default. A server's row counts change every step (a batch's
decodes plus a prefill chunk), so both fill: 1,600 bfloat16 products of SmolLM2-135M's four matrix
shapes at random row counts 1-512 left 575 MiB more in use (2 threads, 2026-12-05, the Intel Xeon),
and the batching engine's memory in use grew 117 MiB over one 32-request workload (issue 32's: prompts
of 32-512 tokens; SmolLM2-135M bfloat16), and more with the next. At KERNEL_CACHE_ENTRIES each, the
same 1,600 products left 9 MiB, and the workload grew 48 MiB and ran in 10.6 against 10.5 s: a step
meets about 5 new shapes, and compiling one takes a fraction of a millisecond.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from typing import Mapping, MutableMapping

from .cpu_policy import opted_out

OPT_OUT = "MINILLM_MALLOC_POLICY"  # "off" (or 0, no, false): glibc's defaults
USER_SETTINGS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_ARENA_MAX",
                 "LD_PRELOAD")  # the user tuned glibc, or preloaded tcmalloc / jemalloc
MMAP_BYTES = 32 << 20  # glibc before 2.35 refuses a larger M_MMAP_THRESHOLD (HEAP_MAX_SIZE / 2 on 64-bit)
TRIM_BYTES = 1 << 30
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's <malloc.h>
KERNEL_CACHES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")  # oneDNN's and ideep's, read at first use
KERNEL_CACHE_ENTRIES = 16  # a few steps' shapes (the module docstring)
MADV_HUGEPAGE, HUGE_PAGE_BYTES = 14, 2 << 20  # Linux's <sys/mman.h>; x86-64's transparent huge page
_huge_page_pools = False  # set by use_huge_pages_for_pools (the serving commands)


def keep_freed_memory(environ: Mapping[str, str] | None = None) -> str | None:
    """Tell glibc's malloc to serve blocks up to MMAP_BYTES from its heap and to keep up to TRIM_BYTES
    of freed memory instead of returning it to the OS (the module docstring says why).

    Returns None when applied, else why not (one phrase: the user's own setting, the opt-out, not
    glibc, or which setting glibc refused). Never raises: the allocator's defaults are slower, not wrong.
    """
    environ = os.environ if environ is None else environ
    if opted_out(environ, OPT_OUT):
        return f"{OPT_OUT}={environ[OPT_OUT]}"
    if users := [name for name in USER_SETTINGS if environ.get(name)]:
        return f"{users[0]} is set: the allocator is yours"
    if "glibc.malloc." in environ.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES sets glibc.malloc: the allocator is yours"
    libc = _glibc()
    if libc is None:
        return "the C library is not glibc"
    refused = [name for name, param, value in (("M_MMAP_THRESHOLD", M_MMAP_THRESHOLD, MMAP_BYTES),
                                               ("M_TRIM_THRESHOLD", M_TRIM_THRESHOLD, TRIM_BYTES))
               if not libc.mallopt(param, value)]
    return f"glibc refused mallopt({', '.join(refused)})" if refused else None


def bound_kernel_caches(environ: MutableMapping[str, str] | None = None) -> list[str]:
    """Set oneDNN's and ideep's kernel caches to KERNEL_CACHE_ENTRIES entries each (the module docstring
    says why), each unless the user set it. Must run before the process's first oneDNN product: both
    read their variable once. Returns the variables set."""
    environ = os.environ if environ is None else environ
    if opted_out(environ, OPT_OUT):
        return []
    chosen = [name for name in KERNEL_CACHES if name not in environ]
    environ.update({name: str(KERNEL_CACHE_ENTRIES) for name in chosen})
    return chosen


def give_back_freed_memory() -> bool:
    """glibc's ``malloc_trim(0)``: hand the free memory of every heap back to the OS now.

    For after a one-off large allocation (a server tokenising megabytes of a prompt it then
    refuses): :func:`keep_freed_memory`'s threshold would keep it all, for a next step that never
    needs that much. Costs a walk over the heaps' free blocks (milliseconds). Returns whether glibc
    gave any memory back; False where the C library is not glibc.
    """
    libc = _glibc()
    return libc is not None and bool(libc.malloc_trim(0))


def use_huge_pages_for_pools(environ: Mapping[str, str] | None = None) -> bool:
    """From now on in this process, the serving engine's KV pools ask for 2 MiB pages (:func:`advise_huge_pages`,
    whose docstring says what they buy and what they cost). The serving commands call it at start, with the
    allocator's setting; a program that imports minillm (a notebook, a test) keeps 4 KiB pages, and so builds an
    engine in a tenth of the time, unless it calls this. Off with MINILLM_MALLOC_POLICY=off. Returns whether it
    is on."""
    global _huge_page_pools
    _huge_page_pools = not opted_out(os.environ if environ is None else environ, OPT_OUT)
    return _huge_page_pools


def huge_pages_for_pools() -> bool:
    """Whether :func:`use_huge_pages_for_pools` was called (and not opted out) in this process."""
    return _huge_page_pools


def advise_huge_pages(address: int, nbytes: int) -> bool:
    """Ask Linux to back the memory at ``address`` (``nbytes`` long, not yet touched) with 2 MiB pages:
    ``madvise(MADV_HUGEPAGE)`` on the whole 2 MiB pages inside it, which the kernel then fills at the first
    touch where transparent huge pages are "madvise" (the common default) or "always".

    For the serving engine's KV pool: a decode step reads every running request's blocks, scattered over the
    pool, and with 4 KiB pages each block's rows cost the CPU's page-table walks. SmolLM2-135M bfloat16, 32
    requests of 32-512 prompt tokens, a batch-32 decode step's attention (2 threads, the Intel Xeon, 2026-12-05,
    1 GiB pool): 16.2-16.7 -> 14.7-15.1 ms, the step 51.3-51.9 -> 50.0-50.1 ms. The cost is at the first touch:
    where memory is fragmented the kernel compacts it to find each 2 MiB page, and making a 512 MiB pool took
    1.0-4.2 s there against 0.13 s (1 GiB: 3.1-3.2 against 0.33-0.40 s). Returns whether the kernel took the
    advice; False elsewhere (not Linux, a region under 2 MiB). Never raises: the pages are a speed, not the
    values."""
    start = -(-address // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    end = (address + nbytes) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    libc = _glibc()
    if libc is None or end <= start or not sys.platform.startswith("linux"):
        return False
    return libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_HUGEPAGE) == 0


def _glibc() -> ctypes.CDLL | None:
    """This process's C library when it is glibc (it has gnu_get_libc_version), else None."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018  (only glibc has it)
    except (OSError, AttributeError):
        return None
    libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return libc
