"""The disk tier: exact round trips, keys that never cross, and every way a file can be bad.

The oracle for "never wrong data" is the block's own tensors: a read gives exactly them or None.
"""

import errno
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import warnings

import pytest
import torch

from minillm.serving.kv_tiers import DiskTier, disk as disk_module

SHAPE = [2, 4, 1, 8]
KEY = {"seed": "ab" * 32, "dtype": "float32", "block_size": 4, "shape": SHAPE}
H = bytes(range(32))


def block(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(SHAPE, generator=g).to(dtype), torch.randn(SHAPE, generator=g).to(dtype)


def same(got, want) -> bool:
    return got is not None and all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_is_exact_and_shared_by_a_second_tier_object(tmp_path, dtype):
    key = dict(KEY, dtype=str(dtype).removeprefix("torch."))
    writer, reader = DiskTier(tmp_path, key), DiskTier(tmp_path, key)  # two processes' views of one folder
    assert writer.put(H, *block(1, dtype)) and H in reader
    assert same(reader.get(H), block(1, dtype))
    assert reader.get(bytes(32)) is None and bytes(32) not in reader
    files = sorted(p.name for p in writer.path.iterdir())
    assert files == [H.hex() + ".kv", "key.json"]  # no temp file left


@pytest.mark.parametrize("field, value", [("seed", "cd" * 32), ("dtype", "bfloat16"), ("block_size", 8),
                                          ("shape", [3, 4, 1, 8])])
def test_another_model_dtype_or_block_size_never_hits(tmp_path, field, value):
    DiskTier(tmp_path, KEY).put(H, *block())
    other = DiskTier(tmp_path, dict(KEY, **{field: value}))
    assert H not in other and other.get(H) is None and other.path != DiskTier(tmp_path, KEY).path


def corrupt_truncated(path):
    path.write_bytes(path.read_bytes()[:-5])


def corrupt_payload_byte(path):
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x40
    path.write_bytes(bytes(data))


def corrupt_header(path):
    data = bytearray(path.read_bytes())
    data[14] ^= 0x01
    path.write_bytes(bytes(data))


def corrupt_empty(path):
    path.write_bytes(b"")


def corrupt_wrong_name(path):  # another block's (valid) file under this name
    other = path.with_name(bytes(32).hex() + ".kv")
    os.replace(other, path)


@pytest.mark.parametrize("corrupt", [corrupt_truncated, corrupt_payload_byte, corrupt_header, corrupt_empty,
                                     corrupt_wrong_name])
def test_a_bad_file_is_a_miss_and_is_removed(tmp_path, corrupt):
    tier = DiskTier(tmp_path, KEY)
    tier.put(H, *block(1))
    tier.put(bytes(32), *block(2))
    corrupt(tier.file(H))
    assert tier.get(H) is None
    assert not tier.file(H).exists()
    assert tier.put(H, *block(1)) and same(tier.get(H), block(1))  # written again, read again


def test_a_leftover_temp_file_is_never_read(tmp_path):
    tier = DiskTier(tmp_path, KEY)
    tier.put(bytes(32), *block(2))
    whole = tier.file(bytes(32)).read_bytes()
    (tier.path / f".{H.hex()}.kv.999.dead.tmp").write_bytes(whole[: len(whole) // 2])  # a killed writer's
    assert H not in tier and tier.get(H) is None


def test_a_stale_temp_file_is_removed_by_the_next_bounded_write(tmp_path):
    now = [1e9]
    tier = DiskTier(tmp_path, KEY, capacity_bytes=10**6, clock=lambda: now[0])
    stale = tier.path / f".{H.hex()}.kv.999.dead.tmp"
    stale.write_bytes(b"half")
    os.utime(stale, (now[0], now[0]))
    now[0] += disk_module.STALE_TMP_S + 1
    tier.put(bytes(32), *block())
    assert not stale.exists()


def test_a_full_disk_warns_once_then_misses(tmp_path, monkeypatch):
    tier = DiskTier(tmp_path, KEY)

    def no_space(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_module, "_write_block", no_space)
    with pytest.warns(RuntimeWarning, match="cannot write"):
        assert tier.put(H, *block()) is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second warning would raise here
        assert tier.put(bytes(32), *block()) is False
    assert tier.get(H) is None and len(tier) == 0


def test_pinned_files_survive_lru_until_their_time(tmp_path):
    now = [1e9]
    tier = DiskTier(tmp_path, KEY, clock=lambda: now[0])
    tier.put(H, *block(1), pinned_until_s=now[0] + 100)
    size = tier.bytes_used
    tier.capacity_bytes = 2 * size
    for i in range(5):  # the pinned block is the oldest: plain LRU would evict it first
        now[0] += 1
        tier.put(bytes([i + 1]) * 32, *block(i + 2))
    assert H in tier and len(tier) == 2
    now[0] += 100  # the pin has expired: LRU again
    tier.put(bytes([9]) * 32, *block(9))
    assert H not in tier and not (tier.path / (H.hex() + ".pin")).exists()


def test_re_pinning_extends_and_never_shortens(tmp_path):
    tier = DiskTier(tmp_path, KEY)
    tier.put(H, *block(), pinned_until_s=500.0)
    tier.pin(H, 300.0)
    assert tier._pinned_until(tier.path / (H.hex() + ".pin")) == 500.0
    tier.pin(H, 900.0)
    assert tier._pinned_until(tier.path / (H.hex() + ".pin")) == 900.0
    assert tier.pin(bytes(32), 900.0) is False  # not stored: nothing to pin


def test_bad_folders_and_keys_are_one_line_errors(tmp_path, monkeypatch):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    for folder in (a_file, a_file / "below"):
        with pytest.raises(ValueError, match="is a file"):
            DiskTier(folder, KEY)
    with pytest.raises(ValueError, match="missing"):
        DiskTier(tmp_path, {"seed": "00"})
    with pytest.raises(ValueError, match="capacity_bytes"):
        DiskTier(tmp_path, KEY, capacity_bytes=0)
    monkeypatch.setattr(disk_module.os, "access", lambda *a: False)  # (root may write anywhere: simulate)
    with pytest.raises(ValueError, match="permission denied"):
        DiskTier(tmp_path / "locked", KEY)


def test_a_block_of_the_wrong_shape_is_refused(tmp_path):
    with pytest.raises(ValueError, match="holds"):
        DiskTier(tmp_path, KEY).put(H, torch.zeros(1, 4, 1, 8), torch.zeros(1, 4, 1, 8))


WRITER = textwrap.dedent("""
    import sys, torch
    from minillm.serving.kv_tiers import DiskTier
    tier = DiskTier(sys.argv[1], {key!r})
    big = torch.arange({n}, dtype=torch.float32).reshape({shape!r})
    print("ready", flush=True)
    i = 0
    while True:  # rewrite the same few blocks for ever, until killed
        tier.put(bytes([i % 4]) * 32, big + i % 4, big - i % 4)
        i += 1
""")


@pytest.mark.cli
def test_a_writer_killed_mid_write_leaves_no_corrupt_block(tmp_path):
    shape = [8, 64, 4, 64]  # 512 KiB a tensor: a write takes long enough to be caught in the middle
    n = 8 * 64 * 4 * 64
    key = dict(KEY, shape=shape, block_size=64)
    code = WRITER.format(key=key, n=n, shape=shape)
    for attempt in range(3):
        proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE)
        assert proc.stdout.readline().strip() == b"ready"
        time.sleep(0.3 + 0.1 * attempt)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    reader = DiskTier(tmp_path, key)
    big = torch.arange(n, dtype=torch.float32).reshape(shape)
    for i in range(4):
        got = reader.get(bytes([i]) * 32)
        assert got is None or same(got, (big + i, big - i))  # a whole block or nothing


def test_a_truncated_file_is_not_held_and_is_written_again(tmp_path):
    tier = DiskTier(tmp_path, KEY)
    tier.put(H, *block(1))
    path = tier.file(H)
    path.write_bytes(path.read_bytes()[:100])  # a crash, or a hand
    assert H not in tier
    assert tier.put(H, *block(1)) and H in tier and same(tier.get(H), block(1))


def test_a_folder_removed_while_running_comes_back_on_the_next_write(tmp_path):
    tier = DiskTier(tmp_path / "tier", KEY)
    shutil.rmtree(tmp_path / "tier")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "cannot write" warning: the folder is made again
        assert tier.put(H, *block(2))
    assert same(tier.get(H), block(2))


@pytest.mark.parametrize("folder", ["", "  "])
def test_an_empty_folder_path_is_refused(folder):
    with pytest.raises(ValueError, match="folder is empty; give a folder path"):
        DiskTier(folder, KEY)
