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
from .units import fmt_bytes


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
        for name, value in zip(("n_layers", "batch_size", "n_kv_heads", "max_seq_len", "head_dim"), shape):
            _check_positive_int(name, value)
        if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"dtype must be a floating torch.dtype (e.g. torch.float32), got {dtype!r}")
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.length = 0

    @classmethod
    def for_model(cls, model, batch_size: int = 1, max_seq_len: int | None = None) -> "KVCache":
        """A cache shaped for ``model`` (its dtype and device).

        ``max_seq_len`` defaults to the model's context length; see ``repr`` for the
        memory it takes. Raises ValueError if ``batch_size`` or ``max_seq_len`` is not a
        positive int, or ``max_seq_len`` is beyond the model's context.
        """
        cfg = model.config
        max_seq_len = cfg.max_seq_len if max_seq_len is None else max_seq_len
        _check_positive_int("max_seq_len", max_seq_len)
        _check_positive_int("batch_size", batch_size)
        if max_seq_len > cfg.max_seq_len:
            raise ValueError(f"max_seq_len must be in [1, {cfg.max_seq_len}] (the model's context), got {max_seq_len}")
        param = next(model.parameters())
        return cls(cfg.n_layers, batch_size, cfg.n_kv_heads, max_seq_len, cfg.head_dim, param.dtype, param.device)

    def check_matches(self, model) -> None:
        """Raise ValueError naming every way this cache does not fit ``model``.

        A cache built for another model (layers, KV heads, head_dim), in another dtype or on
        another device would otherwise fail deep inside attention (an IndexError in
        :meth:`write`, a dtype error in a matmul). :func:`~minillm.phases.prefill` and
        :func:`~minillm.phases.decode_step` call this before every pass.
        """
        cfg, param = model.config, next(model.parameters())
        expected = {"n_layers": cfg.n_layers, "n_kv_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
                    "dtype": param.dtype, "device": param.device}
        _, _, n_kv_heads, _, head_dim = self.k.shape
        got = {"n_layers": self.n_layers, "n_kv_heads": n_kv_heads, "head_dim": head_dim,
               "dtype": self.k.dtype, "device": self.k.device}
        wrong = [f"{name} {got[name]} (the model's: {want})" for name, want in expected.items() if got[name] != want]
        if wrong:
            raise ValueError(f"this KV cache does not fit the model: {', '.join(wrong)}; "
                             "build it with KVCache.for_model(model, max_seq_len=...)")

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
        """Keep only the first ``n`` positions (an int, 0 <= n <= length); raises ValueError otherwise."""
        if not _is_int(n) or not 0 <= n <= self.length:
            raise ValueError(f"truncate: n must be in [0, {self.length}] (the cache length), got {n}")
        self.length = n

    # -- display ----------------------------------------------------------------------

    def __repr__(self) -> str:
        n_layers, batch, n_kv_heads, max_seq_len, head_dim = self.k.shape
        return (
            f"KVCache(layers={n_layers}, batch={batch}, kv_heads={n_kv_heads}, head_dim={head_dim}, "
            f"length={self.length}/{max_seq_len}, dtype={str(self.k.dtype).removeprefix('torch.')}, "
            f"device={self.k.device}, used={fmt_bytes(self.bytes_used)}, "
            f"capacity={fmt_bytes(self.bytes_capacity)}, per_token={fmt_bytes(self.bytes_per_token)})"
        )

    def _repr_html_(self) -> str:
        n_layers, batch, n_kv_heads, max_seq_len, head_dim = self.k.shape
        fill = 100 * self.length / max_seq_len
        rows = [
            ("K and V per layer", f"[{batch}, {n_kv_heads}, {max_seq_len}, {head_dim}] × {n_layers} layers"),
            ("length", f"{self.length} / {max_seq_len} positions ({fill:.1f}%)"),
            ("dtype, device", f"{str(self.k.dtype).removeprefix('torch.')}, {self.k.device}"),
            ("bytes per token", fmt_bytes(self.bytes_per_token)),
            ("used / capacity", f"{fmt_bytes(self.bytes_used)} / {fmt_bytes(self.bytes_capacity)}"),
        ]
        body = "".join(f"<tr><td>{k}</td><td>{v}</td></tr>" for k, v in rows)
        bar = f"<div style='background:#ddd;width:300px'><div style='background:#4a8;width:{fill:.1f}%;height:8px'></div></div>"
        return f"<div style='font-family:system-ui,sans-serif'><b>KVCache</b><table>{body}</table>{bar}</div>"



def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_positive_int(name: str, value) -> None:
    """ValueError unless ``value`` is an int >= 1 (a float such as 256.0 would fail inside torch)."""
    if not _is_int(value) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
