"""Exercise 5: the KV cache, writing new entries and reading the filled part.

The class inherits minillm's KVCache: ``__init__`` preallocates ``self.k`` and ``self.v``,
[n_layers, batch, n_kv_heads, max_seq_len, head_dim], and sets ``self.length = 0``;
``advance(n)`` adds n to ``length`` once every layer has written. Write ``write``,
``keys`` and ``values``::

    self.k[layer]: [batch, n_kv_heads, max_seq_len, head_dim]
                                      |<- length ->|<- T new ->|<-- free -->|

(The docstrings mention rolling layers, an option for sliding-window models in lesson 03: this
cache has none, so ``self.k[layer]`` is layer ``layer``.)

Check:      minillm check ex05   (or: pytest tests/exercises -m ex05 --impl student)
Lesson:     lessons/03-kv-cache.md#writing-and-reading
Reference:  minillm.kv_cache.KVCache
            (peek once your checks pass, or when stuck)
"""

from __future__ import annotations

from minillm.errors import CacheFullError

import torch

from minillm import kv_cache


class KVCache(kv_cache.KVCache):
    """minillm's KVCache (allocation, ``length``, ``advance``); write, keys and values are yours."""

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store new keys/values k, v [B, n_kv_heads, T, head_dim] at positions length..length+T-1.

        Returns the filled views of this layer including the new entries,
        [B, n_kv_heads, length+T, head_dim]. ``length`` itself moves on only in
        :meth:`advance`, once every layer has written. A rolling layer returns less: see
        :meth:`_write_rolling`. Raises CacheFullError (nothing written) if length + T is
        past ``max_seq_len``.
        """
        T = k.shape[2]
        L = self.length
        if L + T > self.max_seq_len:
            raise CacheFullError(f"cache full: {L} + {T} > {self.max_seq_len}")
        self.k[layer][:, :, L:L + T] = k
        self.v[layer][:, :, L:L + T] = v
        return self.k[layer][:, :, :L + T], self.v[layer][:, :, :L + T]

    def keys(self, layer: int) -> torch.Tensor:
        """Filled keys of one layer, [B, n_kv_heads, length, head_dim] (a view, no copy).

        A rolling layer: the last min(length, W) positions, oldest first (a copy once it wrapped).
        """
        return self.k[layer][:, :, :self.length]

    def values(self, layer: int) -> torch.Tensor:
        """Filled values of one layer, [B, n_kv_heads, length, head_dim] (a view, no copy).

        A rolling layer: the last min(length, W) positions, oldest first (a copy once it wrapped).
        """
        return self.v[layer][:, :, :self.length]
