"""The disk tier: one file per block, named by its hash, safe to share and to crash in.

LMCache's local disk backend and SGLang HiCache's storage tier, in small::

    <folder>/<sha256(key)[:16]>/          one folder per model, dtype, block size and K/V shape
        key.json                          that key, for a human
        3fa9...c1.kv                      one block: its 64-hex-digit chained hash (block_hash.py)
        3fa9...c1.pin                     optional: "kept until" (Unix seconds), a cache point's pin
        .3fa9...c1.kv.<pid>.<rand>.tmp    a write in progress (or a writer's leftover)

A ``.kv`` file::

    b"MLKV0001" | header length, uint32 LE | JSON header, space-padded to 64 bytes | k bytes | v bytes
    header: {"format", "block_hash", "dtype", "shape", "payload_bytes", "sha256"}

Safe in a crash: a block is written to a temp file, then ``os.replace``'d onto its name (atomic on
POSIX), so a reader sees a whole file or none; a writer killed mid-write leaves a temp file that no
reader opens. A flipped or missing byte anyway (a bad disk, a hand edit) fails the sha256 of the
payload or its length: the file is removed and read as a miss, never an exception, never wrong K/V.
(No fsync: a crash of the process is covered, a power cut may lose the newest blocks, never corrupt one.)

Shared: two processes (two servers, a prefill and a decode worker) on one folder see each other's
blocks, since a block's name is its content's name; two writers of one block write the same bytes.

Bounded: with ``capacity_bytes``, each write is followed by a scan that removes the least recently
used files (by mtime: a hit touches its file) until the folder fits, keeping pinned ones until their time
unless the newcomer is pinned too (pins give way to each other, LRU: host.py says why).
A full disk (or any OSError on write): one ``warnings.warn``, then the block is simply not written
(a later miss, recomputed).
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import struct
import time
import warnings
from pathlib import Path
from typing import Callable

import torch

from ...block_hash import model_seed
from ...errors import check_positive_int

MAGIC, FORMAT = b"MLKV0001", "minillm-kv/1"
KV, PIN, TMP = ".kv", ".pin", ".tmp"
STALE_TMP_S = 600.0  # a temp file this old is a killed writer's leftover: the eviction scan removes it


class DiskTier:
    """Blocks by hash as files under ``folder``, keyed by model, dtype, block size and shape.

    Args:
        folder: the tier's folder (created if missing); several models can share it.
        key: {"seed": model seed hex, "dtype": "float32", "block_size": 16,
            "shape": [n_layers, block_size, n_kv_heads, head_dim]}: the blocks of anything else
            live in another subfolder, so they never hit (:meth:`for_model` builds it).
        capacity_bytes: the bound on this key's ``.kv`` files, bytes, or None (no bound).
        clock: seconds now (``time.time``: wall-clock, so processes agree on mtimes and pins).

    Attributes:
        path: ``folder/<sha256(key)[:16]>``, where the files are.
        payload_bytes, file_bytes: one block's K and V bytes, and its file's (with the magic and header):
            a bound of ``capacity_bytes`` holds ``capacity_bytes // file_bytes`` blocks.

    Raises ValueError for an empty folder path, a key without those fields, a capacity that is not a
    positive int, a folder that is a file, or a folder this process cannot write.
    """

    def __init__(self, folder, key: dict, capacity_bytes: int | None = None,
                 clock: Callable[[], float] = time.time):
        if capacity_bytes is not None:
            check_positive_int("capacity_bytes", capacity_bytes)
        if not str(folder).strip():
            raise ValueError("the KV disk tier folder is empty; give a folder path (it is created if missing)")
        missing = {"seed", "dtype", "block_size", "shape"} - set(key)
        if missing:
            raise ValueError(f"a disk tier key needs seed, dtype, block_size and shape; {sorted(missing)} missing")
        self.key, self.capacity_bytes, self.clock = dict(key), capacity_bytes, clock
        self.dtype, self.shape = getattr(torch, key["dtype"]), tuple(key["shape"])
        key_text = json.dumps(self.key, sort_keys=True)
        self.path = Path(folder).expanduser() / hashlib.sha256(key_text.encode()).hexdigest()[:16]
        self.payload_bytes = 2 * self.dtype.itemsize * _numel(self.shape)
        # Every block's file has this size: the hashes are 64 hex digits each, the rest is the key's.
        self.file_bytes = 12 + len(_header("0" * 64, key["dtype"], list(self.shape), self.payload_bytes, "0" * 64)
                                   ) + self.payload_bytes
        self._warned = False
        _make_writable_folder(self.path)
        if not (self.path / "key.json").exists():
            _write_atomic(self.path / "key.json", key_text.encode())

    @classmethod
    def for_model(cls, folder, model, block_size: int, capacity_bytes: int | None = None,
                  clock: Callable[[], float] = time.time) -> "DiskTier":
        """The disk tier of ``model``'s blocks of ``block_size`` (its seed, dtype and K/V shape)."""
        cfg, param = model.config, next(model.parameters())
        key = {"seed": model_seed(model).hex(), "dtype": str(param.dtype).removeprefix("torch."),
               "block_size": block_size, "shape": [cfg.n_layers, block_size, cfg.n_kv_heads, cfg.head_dim]}
        return cls(folder, key, capacity_bytes, clock)

    def file(self, block_hash: bytes) -> Path:
        return self.path / (block_hash.hex() + KV)

    # -- reading --------------------------------------------------------------------------

    def get(self, block_hash: bytes) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(k, v) [n_layers, block_size, n_kv_heads, head_dim] of a block, or None.

        None too for a file that is truncated, corrupt, or not this key's (it is removed): never
        raises. A hit touches the file (its mtime is the LRU order).
        """
        path = self.file(block_hash)
        try:
            data = bytearray(path.read_bytes())
        except OSError:  # not there (or unreadable): a miss
            return None
        kv = self._decode(data, block_hash)
        if kv is None:
            _unlink(path)
            return None
        self._touch(path)
        return kv

    def _decode(self, data: bytearray, block_hash: bytes) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The file's (k, v), or None when anything about it is wrong."""
        if len(data) < 12 or data[:8] != MAGIC:
            return None
        (length,) = struct.unpack_from("<I", data, 8)
        try:
            header = json.loads(bytes(data[12 : 12 + length]))
        except ValueError:
            return None
        payload = memoryview(data)[12 + length :]
        expected = {"format": FORMAT, "block_hash": block_hash.hex(), "dtype": self.key["dtype"],
                    "shape": list(self.shape), "payload_bytes": self.payload_bytes}
        if not isinstance(header, dict) or any(header.get(f) != value for f, value in expected.items()):
            return None
        if len(payload) != self.payload_bytes or hashlib.sha256(payload).hexdigest() != header.get("sha256"):
            return None
        flat = torch.frombuffer(data, dtype=self.dtype, offset=12 + length)  # shares the buffer: no copy
        k, v = flat.view(2, *self.shape).unbind(0)
        return k, v

    def __contains__(self, block_hash: bytes) -> bool:
        """Whether the block's file exists at its full size (a cheap check, one stat: :meth:`get` still
        verifies the checksum). A truncated file is not held, so the block is written again."""
        try:
            return self.file(block_hash).stat().st_size == self.file_bytes
        except OSError:
            return False

    def touch(self, block_hash: bytes) -> None:
        """Make a held block the most recently used (see :meth:`KVOffload.touch_chain
        <minillm.serving.kv_tiers.offload.KVOffload>` for why a chain is touched tail first)."""
        self._touch(self.file(block_hash))

    # -- writing --------------------------------------------------------------------------

    def put(self, block_hash: bytes, k: torch.Tensor, v: torch.Tensor, pinned_until_s: float | None = None) -> bool:
        """Write a block (atomically), pin it if asked, then evict beyond the bound; True when stored.

        A block already on disk is touched (and its pin extended), not written again.
        False on any OSError (a full disk, a folder removed): the first one warns, later ones are silent.
        Raises ValueError for k or v of another shape or dtype than the key's (a caller's bug).
        """
        for name, t in (("k", k), ("v", v)):
            if tuple(t.shape) != self.shape or t.dtype != self.dtype:
                raise ValueError(f"{name} is {tuple(t.shape)} {t.dtype}, but this disk tier holds {self.shape} "
                                 f"{self.dtype}; use the tier of that model and block size")
        path = self.file(block_hash)
        try:
            if block_hash not in self:  # missing, or truncated by a crash or a hand
                self.path.mkdir(parents=True, exist_ok=True)  # a folder removed while we ran comes back
                _write_block(path, block_hash, k, v, self.key["dtype"])
            self._touch(path)
            if pinned_until_s is not None:
                self.pin(block_hash, pinned_until_s)
            pinned = pinned_until_s is not None and pinned_until_s > self.clock()
            # Pinned blocks give way to a pinned newcomer only (the host tier's rule, and why: host.py).
            if not (self._evict(path.name, evict_pinned=False) or pinned and self._evict(path.name, evict_pinned=True)):
                _unlink(path)
                _unlink(path.with_suffix(PIN))
                return False
        except OSError as error:
            if not self._warned:
                self._warned = True
                warnings.warn(f"the KV disk tier in {self.path} cannot write ({error}); blocks it does not store "
                              "are recomputed when needed", RuntimeWarning, stacklevel=2)
            return False
        return True

    def pin(self, block_hash: bytes, pinned_until_s: float) -> bool:
        """Keep a stored block until ``pinned_until_s`` (Unix seconds; never shortened); False when not stored."""
        if not self.file(block_hash).exists():
            return False
        current = self._pinned_until(self.path / (block_hash.hex() + PIN))
        if current is None or current < pinned_until_s:
            _write_atomic(self.path / (block_hash.hex() + PIN), repr(float(pinned_until_s)).encode())
        return True

    def _pinned_until(self, pin_path: Path) -> float | None:
        try:
            return float(pin_path.read_text())
        except (OSError, ValueError):
            return None

    def _touch(self, path: Path) -> None:
        now = self.clock()
        try:
            os.utime(path, (now, now))
        except OSError:  # removed meanwhile by another process's eviction: nothing to touch
            pass

    # -- the bound --------------------------------------------------------------------------

    def _files(self) -> list[os.DirEntry]:
        with os.scandir(self.path) as entries:
            return [e for e in entries if e.name.endswith(KV) and not e.name.startswith(".")]

    @property
    def bytes_used(self) -> int:
        """Bytes of this key's block files now (a scan of the folder: other processes count too)."""
        return sum(_size(e) for e in self._files())

    def __len__(self) -> int:
        return len(self._files())

    def _evict(self, keep: str, evict_pinned: bool) -> bool:
        """Remove least recently used files (unpinned ones only, unless ``evict_pinned``), other than ``keep``
        (the one just put), until the folder fits ``capacity_bytes``; False when it cannot."""
        if self.capacity_bytes is None:
            return True
        now = self.clock()
        self._remove_stale_temp_files(now)
        files = [(_mtime(e), e.name, _size(e)) for e in self._files()]
        total = sum(size for *_, size in files)
        for _, name, size in sorted(f for f in files if f[1] != keep):
            if total <= self.capacity_bytes:
                break
            pin = self.path / (name.removesuffix(KV) + PIN)
            until = self._pinned_until(pin)
            if not evict_pinned and until is not None and until > now:
                continue
            _unlink(self.path / name)
            _unlink(pin)
            total -= size
        return total <= self.capacity_bytes

    def _remove_stale_temp_files(self, now: float) -> None:
        with os.scandir(self.path) as entries:
            for e in entries:
                if e.name.endswith(TMP) and now - _mtime(e) > STALE_TMP_S:
                    _unlink(Path(e.path))

    def __repr__(self) -> str:
        bound = "no bound" if self.capacity_bytes is None else f"bound {self.capacity_bytes} bytes"
        return f"DiskTier({self.path}, {bound})"


def _write_block(path: Path, block_hash: bytes, k: torch.Tensor, v: torch.Tensor, dtype: str) -> None:
    """One block file: magic, header (with the payload's sha256), k bytes, v bytes; via a temp file."""
    parts = [t.detach().cpu().contiguous().view(torch.uint8).reshape(-1).numpy() for t in (k, v)]
    digest = hashlib.sha256(parts[0])
    digest.update(parts[1])
    header = _header(block_hash.hex(), dtype, list(k.shape), parts[0].nbytes + parts[1].nbytes, digest.hexdigest())
    _write_atomic(path, MAGIC + struct.pack("<I", len(header)) + header, *parts)


def _header(hash_hex: str, dtype: str, shape: list, payload_bytes: int, sha256_hex: str) -> bytes:
    """A block file's JSON header, space-padded so that the payload starts 64-byte aligned."""
    header = json.dumps({"format": FORMAT, "block_hash": hash_hex, "dtype": dtype, "shape": shape,
                         "payload_bytes": payload_bytes, "sha256": sha256_hex}).encode()
    return header + b" " * (-(12 + len(header)) % 64)


def _write_atomic(path: Path, *chunks) -> None:
    """Write ``chunks`` to a temp file beside ``path``, then rename it onto ``path`` (atomic on POSIX)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}{TMP}")
    try:
        with open(tmp, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
        os.replace(tmp, path)
    except BaseException:  # an error, or a KeyboardInterrupt: leave no temp file behind
        _unlink(tmp)
        raise


def _make_writable_folder(path: Path) -> None:
    """Create ``path`` (and parents); ValueError, one line, when it cannot be a folder we write in."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise ValueError(f"the KV disk tier folder {path.parent} is a file, or a file is in its path; give a "
                         "folder path (it is created if missing)") from None
    except OSError as error:
        raise ValueError(f"cannot create the KV disk tier folder {path}: {error.strerror}; give a folder you can "
                         "write to") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"cannot write in the KV disk tier folder {path} (permission denied); give a folder you "
                         "can write to")


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _size(entry: os.DirEntry) -> int:
    try:
        return entry.stat().st_size
    except OSError:
        return 0


def _mtime(entry: os.DirEntry) -> float:
    try:
        return entry.stat().st_mtime
    except OSError:
        return 0.0


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass
