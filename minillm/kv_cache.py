"""The KV cache: every layer's keys and values for the positions seen so far.

Without it, producing token n would recompute K and V for all n-1 earlier tokens.
With it, each forward pass computes K and V only for its new tokens and writes them
here; attention reads the whole filled part.

Layout (preallocated once, never grown, so decode never reallocates)::

    k[layer]: [batch, n_kv_heads, max_seq_len, head_dim]
                                 |<- length ->|<-- free -->|
                                  filled       written next at `length`
"""

from __future__ import annotations

import torch

from .errors import CacheFullError


class KVCache:
    """Preallocated K and V for all layers, filled from position 0 up to ``length``.

    Args:
        n_layers, batch_size, n_kv_heads, max_seq_len, head_dim: the shape.
        dtype, device: of the K/V tensors (match the model's).

    Attributes:
        k, v: [n_layers, batch, n_kv_heads, max_seq_len, head_dim] tensors.
        length: positions filled (the next write goes there).
        attn_mask: None: :meth:`write` returns exactly the filled positions, and attention
            masks causally by position. (The static view of :mod:`minillm.compile` returns
            the whole buffer instead, and sets a mask hiding the unfilled end.)
    """

    attn_mask = None

    def __init__(self, n_layers, batch_size, n_kv_heads, max_seq_len, head_dim, dtype=torch.float32, device="cpu"):
        shape = (n_layers, batch_size, n_kv_heads, max_seq_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.length = 0

    @classmethod
    def for_model(cls, model, batch_size: int = 1, max_seq_len: int | None = None) -> "KVCache":
        """A cache shaped for ``model`` (its dtype and device).

        ``max_seq_len`` defaults to the model's context length; see ``repr`` for the
        memory it takes. Raises ValueError if it is < 1 or beyond the model's context.
        """
        cfg = model.config
        max_seq_len = cfg.max_seq_len if max_seq_len is None else max_seq_len
        if not 1 <= max_seq_len <= cfg.max_seq_len:
            raise ValueError(f"max_seq_len must be in [1, {cfg.max_seq_len}] (the model's context), got {max_seq_len}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        param = next(model.parameters())
        return cls(cfg.n_layers, batch_size, cfg.n_kv_heads, max_seq_len, cfg.head_dim, param.dtype, param.device)

    # -- shape and memory -------------------------------------------------------------

    @property
    def n_layers(self) -> int:
        return self.k.shape[0]

    @property
    def batch_size(self) -> int:
        return self.k.shape[1]

    @property
    def max_seq_len(self) -> int:
        return self.k.shape[3]

    @property
    def bytes_per_token(self) -> int:
        """2 (K and V) · n_layers · n_kv_heads · head_dim · dtype bytes, per sequence in the batch."""
        n_layers, _, n_kv_heads, _, head_dim = self.k.shape
        return 2 * n_layers * n_kv_heads * head_dim * self.k.element_size()

    @property
    def bytes_used(self) -> int:
        """Bytes holding filled positions (all sequences of the batch)."""
        return self.bytes_per_token * self.batch_size * self.length

    @property
    def bytes_capacity(self) -> int:
        """Bytes allocated (all sequences, all ``max_seq_len`` positions)."""
        return self.bytes_per_token * self.batch_size * self.max_seq_len

    # -- reading and writing ----------------------------------------------------------

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store new keys/values k, v [B, n_kv_heads, T, head_dim] at positions length..length+T-1.

        Returns the filled views of this layer including the new entries,
        [B, n_kv_heads, length+T, head_dim]. ``length`` itself moves on only in
        :meth:`advance`, once every layer has written.
        """
        end = self.length + k.shape[2]
        self.k[layer, :, :, self.length : end] = k
        self.v[layer, :, :, self.length : end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def check_room(self, n_tokens: int) -> None:
        """Raise CacheFullError if ``n_tokens`` more positions do not fit."""
        if self.length + n_tokens > self.max_seq_len:
            raise CacheFullError(
                f"KV cache full: {self.length} + {n_tokens} tokens > max_seq_len {self.max_seq_len}; "
                "use a larger max_seq_len or a shorter prompt"
            )

    def advance(self, n_tokens: int) -> None:
        """Mark ``n_tokens`` more positions as filled (after all layers wrote them)."""
        self.length += n_tokens

    def keys(self, layer: int) -> torch.Tensor:
        """Filled keys of one layer, [B, n_kv_heads, length, head_dim] (a view, no copy)."""
        return self.k[layer, :, :, : self.length]

    def values(self, layer: int) -> torch.Tensor:
        """Filled values of one layer, [B, n_kv_heads, length, head_dim] (a view, no copy)."""
        return self.v[layer, :, :, : self.length]

    def reset(self) -> None:
        """Forget everything (the memory stays allocated)."""
        self.length = 0

    def truncate(self, n: int) -> None:
        """Keep only the first ``n`` positions (0 <= n <= length); raises ValueError otherwise."""
        if not 0 <= n <= self.length:
            raise ValueError(f"truncate: n must be in [0, {self.length}] (the cache length), got {n}")
        self.length = n

    # -- display ----------------------------------------------------------------------

    def __repr__(self) -> str:
        n_layers, batch, n_kv_heads, max_seq_len, head_dim = self.k.shape
        return (
            f"KVCache(layers={n_layers}, batch={batch}, kv_heads={n_kv_heads}, head_dim={head_dim}, "
            f"length={self.length}/{max_seq_len}, dtype={str(self.k.dtype).removeprefix('torch.')}, "
            f"device={self.k.device}, used={_fmt_bytes(self.bytes_used)}, "
            f"capacity={_fmt_bytes(self.bytes_capacity)}, per_token={_fmt_bytes(self.bytes_per_token)})"
        )

    def _repr_html_(self) -> str:
        n_layers, batch, n_kv_heads, max_seq_len, head_dim = self.k.shape
        fill = 100 * self.length / max_seq_len
        rows = [
            ("K and V per layer", f"[{batch}, {n_kv_heads}, {max_seq_len}, {head_dim}] × {n_layers} layers"),
            ("length", f"{self.length} / {max_seq_len} positions ({fill:.1f}%)"),
            ("dtype, device", f"{str(self.k.dtype).removeprefix('torch.')}, {self.k.device}"),
            ("bytes per token", _fmt_bytes(self.bytes_per_token)),
            ("used / capacity", f"{_fmt_bytes(self.bytes_used)} / {_fmt_bytes(self.bytes_capacity)}"),
        ]
        body = "".join(f"<tr><td>{k}</td><td>{v}</td></tr>" for k, v in rows)
        bar = f"<div style='background:#ddd;width:300px'><div style='background:#4a8;width:{fill:.1f}%;height:8px'></div></div>"
        return f"<b>KVCache</b><table>{body}</table>{bar}"


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
