"""Block hashes: the names under which the prefix cache stores K/V.

A prompt is cut into blocks of ``block_size`` tokens. Block i is named by a chained
hash that covers its own tokens and, through its parent's hash, every token before it::

    seed = sha256(scheme, model identity, dtype, device)
    h0   = sha256(seed, tokens[0:16],  extra_keys)          block_size = 16
    h1   = sha256(h0,   tokens[16:32], extra_keys)
    h2   = sha256(h1,   tokens[32:48], extra_keys)
           tokens[48:53]  a partial block: never hashed, never cached

Equal h_i means equal tokens[0 : 16·(i+1)] on the same model, dtype and device
(barring a sha256 collision, which the prefix cache still catches by comparing tokens).
The same K/V for the same prefix is then a fact, since K/V at a position depend only
on the tokens up to it. Python's ``hash()`` is never used: it is 64 bits and salted
per process for strings.

The seed is what keeps two models apart (vLLM's ``NONE_HASH``, made model-aware):

- a model loaded from a folder (``model.source``): the resolved folder path plus the
  name, size and modification time (ns) of each ``*.safetensors`` file, and the config;
- a model built in memory (no ``source``): the config plus a sha256 of the first
  4096 values of every weight tensor;
- always the parameters' dtype and device (bfloat16 K/V are not float32 K/V).

A tenant's cache salt (vLLM's per-request ``cache_salt``) moves the root itself::

    root = salted_seed(seed, cache_salt) = sha256(seed, b"cache_salt", salt)     (seed when no salt)

so two salts share no block at all, not even the first: whether another tenant's prefix is
cached can no longer be read from a TTFT (the prefix-cache timing side channel: "Leaking Secrets
from Prefix Caches", arXiv 2411.18191; vLLM's CVE-2025-46570).

Loading other weights *into* a model object (``load_state_dict``) is not seen by the
seed: build a new :class:`~minillm.prefix_cache.PrefixCache` (or ``reset()`` it).
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Callable, Sequence

SCHEME = "minillm-prefix-cache/1"
HashFn = Callable[[bytes, Sequence[int], tuple], bytes]


def hash_block(parent: bytes, token_ids: Sequence[int], extra_keys: tuple = ()) -> bytes:
    """sha256(parent hash, the block's token ids, extra keys): 32 bytes.

    ``extra_keys`` separate prefixes that have the same tokens but must not share K/V
    (vLLM uses them for LoRA adapters, images, a per-user cache salt).
    """
    h = hashlib.sha256(parent)
    h.update(struct.pack(f"<I{len(token_ids)}q", len(token_ids), *token_ids))
    h.update(json.dumps(list(extra_keys), default=str).encode())
    return h.digest()


def block_hashes(
    token_ids: Sequence[int], block_size: int, seed: bytes, extra_keys: tuple = (), hash_fn: HashFn = hash_block
) -> list[bytes]:
    """Chained hashes of the full blocks of ``token_ids``, root first (a partial last block has none)."""
    hashes, parent = [], seed
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_fn(parent, token_ids[start : start + block_size], extra_keys)
        hashes.append(parent)
    return hashes


def salted_seed(seed: bytes, cache_salt: str | None) -> bytes:
    """The root of a request's block chain: ``seed`` without a salt, else sha256(seed, b"cache_salt", salt).

    Raises ValueError for a salt that is not a non-empty str (vLLM refuses an empty one too).
    """
    if cache_salt is None:
        return seed
    if not isinstance(cache_salt, str) or not cache_salt:
        raise ValueError(f"cache_salt must be a non-empty string (or None for no salt), got {cache_salt!r}")
    h = hashlib.sha256(seed)
    h.update(b"cache_salt")
    h.update(cache_salt.encode("utf-8", "surrogatepass"))  # any str from JSON, lone surrogates too
    return h.digest()


def model_seed(model) -> bytes:
    """h_{-1}: the sha256 of the model's identity, dtype and device (see the module docstring)."""
    param = next(model.parameters())
    identity = {"scheme": SCHEME, "model": model_identity(model), "dtype": str(param.dtype),
                "device": str(param.device)}
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).digest()


def model_identity(model) -> dict:
    """What names a model's weights: its checkpoint files, or a fingerprint of the tensors."""
    identity = {"config": model.config.to_dict()}
    source = getattr(model, "source", None)
    if source is None:
        identity["weights_sha256"] = _weights_fingerprint(model)
        return identity
    folder = Path(source).resolve()
    identity["source"] = str(folder)
    identity["files"] = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.glob("*.safetensors"))]
    return identity


def _weights_fingerprint(model, n_values: int = 4096) -> str:
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(p.detach().reshape(-1)[:n_values].float().cpu().numpy().tobytes())
    return h.hexdigest()


def short(block_hash: bytes | None, n: int = 8) -> str:
    """The first ``n`` hex digits, for display ("-" for no hash, e.g. the root's parent)."""
    return "-" if block_hash is None else block_hash.hex()[:n]
