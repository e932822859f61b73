"""The KV cache: every layer's keys and values for the positions seen so far.

Without it, producing token n would recompute K and V for all n-1 earlier tokens.
With it, each forward pass computes K and V only for its new tokens and writes them
here; attention reads the whole filled part.

Layout (preallocated once, never grown, so decode never reallocates)::

    k[layer]: [batch, n_kv_heads, max_seq_len, head_dim]
                                 |<- length ->|<-- free -->|
                                  filled       written next at `length`

A sliding-window layer (Mistral's ``sliding_window`` W) never reads a key more than W - 1
positions back, so its cache can be a *rolling buffer* of W slots (``rolling=True``):
position p goes to slot p % W, overwriting position p - W, which no later query sees::

    k_roll[i]: [batch, n_kv_heads, W, head_dim]      W = 4, length 6:
               slot:      0    1    2    3
               position:  4    5    2    3         (0 and 1 overwritten by 4 and 5)

Memory then stays W positions for those layers however long the sequence. The price: it
cannot go back (``truncate``) to before what it holds, which speculative decoding, the
prefix cache and chat need; so the default keeps every position and masks instead.
"""

from __future__ import annotations

import torch

from .errors import CacheFullError, check_positive_int
from .units import fmt_bytes


class KVCache:
    """Preallocated K and V for all layers, filled from position 0 up to ``length``.

    Args:
        n_layers, batch_size, n_kv_heads, max_seq_len, head_dim: the shape.
        dtype, device: of the K/V tensors (match the model's).
        window, rolling_layers: layers (0-based) whose K/V is a rolling buffer of ``window``
            positions (see the module docstring); none by default.

    Attributes:
        k, v: [n_layers, batch, n_kv_heads, max_seq_len, head_dim] tensors; with rolling
            layers, only the other layers, in layer order ([n_layers - n_rolling, ...]).
        k_roll, v_roll: [n_rolling, batch, n_kv_heads, window, head_dim], the rolling layers.
        length: positions filled (the next write goes there); max_seq_len bounds it for
            rolling layers too.
    """

    def __init__(self, n_layers, batch_size, n_kv_heads, max_seq_len, head_dim, dtype=torch.float32, device="cpu",
                 window: int | None = None, rolling_layers=()):
        shape = (n_layers, batch_size, n_kv_heads, max_seq_len, head_dim)
        for name, value in zip(("n_layers", "batch_size", "n_kv_heads", "max_seq_len", "head_dim"), shape):
            check_positive_int(name, value)
        if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"dtype must be a floating torch.dtype (e.g. torch.float32), got {dtype!r}")
        self.rolling_layers = tuple(sorted(set(rolling_layers)))
        if self.rolling_layers:
            check_positive_int("window", window)
            if not all(_is_int(layer) and 0 <= layer < n_layers for layer in self.rolling_layers):
                raise ValueError(f"rolling_layers must be layers in [0, {n_layers}), got {rolling_layers}")
        self.window = window if self.rolling_layers else None
        full = [layer for layer in range(n_layers) if layer not in self.rolling_layers]
        # model layer -> its row in k/v (full attention) or in k_roll/v_roll (rolling buffer)
        self._row = {layer: i for rows in (full, self.rolling_layers) for i, layer in enumerate(rows)}
        self._n_layers = n_layers
        self.k = torch.zeros((len(full), *shape[1:]), dtype=dtype, device=device)
        self.v = torch.zeros((len(full), *shape[1:]), dtype=dtype, device=device)
        roll_shape = (len(self.rolling_layers), batch_size, n_kv_heads, self.window or 0, head_dim)
        self.k_roll = torch.zeros(roll_shape, dtype=dtype, device=device)
        self.v_roll = torch.zeros(roll_shape, dtype=dtype, device=device)
        self.length = 0

    @classmethod
    def for_model(cls, model, batch_size: int = 1, max_seq_len: int | None = None, rolling: bool = False) -> "KVCache":
        """A cache shaped for ``model`` (its dtype and device).

        ``max_seq_len`` defaults to the model's context length; see ``repr`` for the
        memory it takes. ``rolling``: sliding-window layers whose window W is shorter than
        max_seq_len get a rolling buffer of W positions instead of max_seq_len (less memory;
        no ``truncate`` to before what it holds). Raises ValueError if ``batch_size`` or
        ``max_seq_len`` is not a positive int, or ``max_seq_len`` is beyond the model's context.
        """
        cfg = model.config
        max_seq_len = cfg.max_seq_len if max_seq_len is None else max_seq_len
        check_positive_int("max_seq_len", max_seq_len)
        check_positive_int("batch_size", batch_size)
        if max_seq_len > cfg.max_seq_len:
            raise ValueError(f"max_seq_len must be in [1, {cfg.max_seq_len}] (the model's context), got {max_seq_len}")
        if not isinstance(rolling, bool):
            raise ValueError(f"rolling must be True or False, got {rolling!r}")
        param = next(model.parameters())
        windows = [cfg.window(layer) for layer in range(cfg.n_layers)]
        rolling_layers = [layer for layer, w in enumerate(windows) if rolling and w is not None and w < max_seq_len]
        return cls(cfg.n_layers, batch_size, cfg.n_kv_heads, max_seq_len, cfg.head_dim, param.dtype, param.device,
                   cfg.sliding_window, rolling_layers)

    def check_matches(self, model) -> None:
        """Raise ValueError naming every way this cache does not fit ``model``.

        A cache built for another model (layers, KV heads, head_dim), in another dtype or on
        another device would otherwise fail deep inside attention (an IndexError in
        :meth:`write`, a dtype error in a matmul). :func:`~minillm.phases.prefill` and
        :func:`~minillm.phases.decode_step` call this before every pass.
        """
        cfg, param = model.config, next(model.parameters())
        expected = {"n_layers": cfg.n_layers, "n_kv_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
                    "dtype": param.dtype, "device": param.device,
                    "rolling window": {layer: cfg.window(layer) for layer in self.rolling_layers}}
        _, _, n_kv_heads, _, head_dim = self.k.shape
        got = {"n_layers": self.n_layers, "n_kv_heads": n_kv_heads, "head_dim": head_dim,
               "dtype": self.k.dtype, "device": self.k.device,
               "rolling window": {layer: self.window for layer in self.rolling_layers}}
        wrong = [f"{name} {got[name]} (the model's: {want})" for name, want in expected.items() if got[name] != want]
        if wrong:
            raise ValueError(f"this KV cache does not fit the model: {', '.join(wrong)}; "
                             "build it with KVCache.for_model(model, max_seq_len=...)")

    # -- shape and memory -------------------------------------------------------------

    @property
    def n_layers(self) -> int:
        return self._n_layers

    @property
    def batch_size(self) -> int:
        return self.k.shape[1]

    @property
    def max_seq_len(self) -> int:
        return self.k.shape[3]

    @property
    def bytes_per_token(self) -> int:
        """2 (K and V) · n_layers · n_kv_heads · head_dim · dtype bytes, per sequence in the batch."""
        _, _, n_kv_heads, _, head_dim = self.k.shape
        return 2 * self.n_layers * n_kv_heads * head_dim * self.k.element_size()

    @property
    def bytes_used(self) -> int:
        """Bytes holding filled positions (all sequences of the batch); a rolling layer holds at most W."""
        return self._bytes(self.length)

    @property
    def bytes_capacity(self) -> int:
        """Bytes allocated (all sequences; ``max_seq_len`` positions a layer, W for a rolling one)."""
        return self._bytes(self.max_seq_len)

    def _bytes(self, positions: int) -> int:
        """Bytes of K and V for ``positions`` positions in every layer (rolling ones capped at W)."""
        per_layer_position = self.bytes_per_token // self.n_layers
        n_rolling = len(self.rolling_layers)
        layer_positions = (self.n_layers - n_rolling) * positions + n_rolling * min(positions, self.window or 0)
        return per_layer_position * self.batch_size * layer_positions

    # -- reading and writing ----------------------------------------------------------

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store new keys/values k, v [B, n_kv_heads, T, head_dim] at positions length..length+T-1.

        Returns the filled views of this layer including the new entries,
        [B, n_kv_heads, length+T, head_dim]. ``length`` itself moves on only in
        :meth:`advance`, once every layer has written. A rolling layer returns less: see
        :meth:`_write_rolling`. Raises CacheFullError (nothing written) if length + T is
        past ``max_seq_len``.
        """
        self.check_room(k.shape[2])
        if layer in self.rolling_layers:
            return self._write_rolling(self._row[layer], k, v)
        row, end = self._row[layer], self.length + k.shape[2]
        self.k[row, :, :, self.length : end] = k
        self.v[row, :, :, self.length : end] = v
        return self.k[row, :, :, :end], self.v[row, :, :, :end]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention,
               window: int | None = None) -> torch.Tensor:
        """Store this pass's k, v [B, n_kv_heads, T, head_dim] (:meth:`write`), then return
        ``attention(q, keys, values, None)`` over every position held so far: the queries are the
        last T of them, so the causal mask (and the sliding ``window``'s) follows from the positions.

        This is what :class:`~minillm.model.Attention` asks of a cache; another cache (a serving
        batch, the compiled step's static view) stores and masks in its own way.
        """
        keys, values = self.write(layer, k, v)
        return attention(q, keys, values, None)

    def _write_rolling(self, row: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write into rolling buffer ``row``; return the keys and values the new queries may need.

        Decode (T = 1): the slot of position ``length`` is overwritten (it held length - W,
        which the new query no longer sees); returns the filled slots [B, Hkv, min(length+1, W), D]
        in slot order, every one inside the query's window, so no mask and no order are needed.

        Prefill (T > 1): the chunk's first queries still need old keys its own keys will
        overwrite, so the old ones are read first: returns held + new keys in position order
        [B, Hkv, min(length, W) + T, D] (a copy; a window mask on it is exact), then only the
        chunk's last W positions are stored.
        """
        buf_k, buf_v, W, L, T = self.k_roll[row], self.v_roll[row], self.window, self.length, k.shape[2]
        if T == 1:
            buf_k[:, :, L % W] = k[:, :, 0]
            buf_v[:, :, L % W] = v[:, :, 0]
            return buf_k[:, :, : min(L + 1, W)], buf_v[:, :, : min(L + 1, W)]
        keys = torch.cat((self._in_position_order(buf_k), k), dim=2)
        values = torch.cat((self._in_position_order(buf_v), v), dim=2)
        kept = min(T, W)
        slots = torch.arange(L + T - kept, L + T, device=k.device) % W
        buf_k.index_copy_(2, slots, k[:, :, T - kept :])
        buf_v.index_copy_(2, slots, v[:, :, T - kept :])
        return keys, values

    def _in_position_order(self, buf: torch.Tensor) -> torch.Tensor:
        """The positions a rolling buffer holds, oldest first: [B, Hkv, min(length, W), D]."""
        W, L = self.window, self.length
        if L <= W:
            return buf[:, :, :L]
        return torch.cat((buf[:, :, L % W :], buf[:, :, : L % W]), dim=2)

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
        """Filled keys of one layer, [B, n_kv_heads, length, head_dim] (a view, no copy).

        A rolling layer: the last min(length, W) positions, oldest first (a copy once it wrapped).
        """
        if layer in self.rolling_layers:
            return self._in_position_order(self.k_roll[self._row[layer]])
        return self.k[self._row[layer], :, :, : self.length]

    def values(self, layer: int) -> torch.Tensor:
        """Filled values of one layer, [B, n_kv_heads, length, head_dim] (a view, no copy).

        A rolling layer: the last min(length, W) positions, oldest first (a copy once it wrapped).
        """
        if layer in self.rolling_layers:
            return self._in_position_order(self.v_roll[self._row[layer]])
        return self.v[self._row[layer], :, :, : self.length]

    def reset(self) -> None:
        """Forget everything (the memory stays allocated)."""
        self.length = 0

    def truncate(self, n: int) -> None:
        """Keep only the first ``n`` positions (an int, 0 <= n <= length); raises ValueError otherwise.

        A rolling buffer that has wrapped (length > W) no longer holds the keys position n - 1
        would attend to, so it can only reset (n = 0) or stay (n = length): anything else
        raises ValueError rather than attend to overwritten keys.
        """
        if not _is_int(n) or not 0 <= n <= self.length:
            raise ValueError(f"truncate: n must be in [0, {self.length}] (the cache length), got {n}")
        if self.rolling_layers and self.length > self.window and 0 < n < self.length:
            raise ValueError(
                f"truncate: this KV cache's rolling layers hold only positions {self.length - self.window}.."
                f"{self.length - 1} (window {self.window}), not the {self.window} before position {n}; "
                "build the cache with KVCache.for_model(model, rolling=False) to truncate"
            )
        self.length = n

    # -- display ----------------------------------------------------------------------

    def _rolling_text(self) -> str:
        """e.g. "layers 0-31 roll (window 4096)", or "" without rolling layers."""
        layers = self.rolling_layers
        if not layers:
            return ""
        contiguous = layers == tuple(range(layers[0], layers[-1] + 1)) and len(layers) > 2
        names = f"{layers[0]}-{layers[-1]}" if contiguous else ",".join(map(str, layers))
        return f"layers {names} roll (window {self.window})"

    def __repr__(self) -> str:
        _, batch, n_kv_heads, max_seq_len, head_dim = self.k.shape
        rolling = f"rolling={self._rolling_text()!r}, " if self.rolling_layers else ""
        return (
            f"KVCache(layers={self.n_layers}, batch={batch}, kv_heads={n_kv_heads}, head_dim={head_dim}, "
            f"length={self.length}/{max_seq_len}, {rolling}dtype={str(self.k.dtype).removeprefix('torch.')}, "
            f"device={self.k.device}, used={fmt_bytes(self.bytes_used)}, "
            f"capacity={fmt_bytes(self.bytes_capacity)}, per_token={fmt_bytes(self.bytes_per_token)})"
        )

    def _repr_html_(self) -> str:
        _, batch, n_kv_heads, max_seq_len, head_dim = self.k.shape
        n_layers = self.n_layers
        fill = 100 * self.length / max_seq_len
        rows = [
            ("K and V per layer", f"[{batch}, {n_kv_heads}, {max_seq_len}, {head_dim}] × {n_layers} layers"),
            *([("rolling buffers", f"{self._rolling_text()}: [{batch}, {n_kv_heads}, {self.window}, {head_dim}]")]
              if self.rolling_layers else []),
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
