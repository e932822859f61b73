"""How minillm writes bytes, times and other measured numbers: one convention, one place.

Byte amounts (weights, KV cache, memory needed) use binary IEC units: 1 KiB = 1024 B,
1 MiB = 1024 KiB, 1 GiB = 1024 MiB, the units of ``torch.cuda.memory_summary``,
llama.cpp's and vLLM's memory logs, and the KV cache's repr. So the same 538,060,032
weights bytes read "513.1 MiB" in ``info``, the trace and ``whatif`` alike.

Rates stay in the units their sources give: bandwidth in GB/s (1e9 bytes/s) and compute
in GFLOP/s or TFLOP/s (1e9, 1e12 FLOP/s), as on every hardware datasheet.

Numbers never use scientific notation ("1.84e+03 ms" reads badly in a lesson):
:func:`fmt_num` keeps a few significant digits in plain decimals.
"""

from __future__ import annotations

import math

IEC_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def fmt_bytes(n_bytes: float) -> str:
    """Bytes in IEC units with one decimal: 46080 -> '45.0 KiB', 538060032 -> '513.1 MiB', 512 -> '512 B'."""
    n, unit = float(n_bytes), 0
    while abs(n) >= 1024 and unit < len(IEC_UNITS) - 1:
        n, unit = n / 1024, unit + 1
    return f"{n:.0f} B" if unit == 0 else f"{n:.1f} {IEC_UNITS[unit]}"


def fmt_num(value: float, digits: int = 3) -> str:
    """``digits`` significant digits in plain decimals, never scientific notation.

    1842.3 -> '1,842'; 12.34 -> '12.3'; 0.5034 -> '0.503'; 0.000123 -> '0.000123'.
    """
    if value == 0 or not math.isfinite(value):
        return f"{value:g}"
    magnitude = math.floor(math.log10(abs(value)))
    decimals = max(digits - 1 - magnitude, 0)
    return f"{value:,.{decimals}f}"


def fmt_ms(ms: float) -> str:
    """A duration in milliseconds: '1,842 ms', '44.3 ms', '0.0123 ms' (three significant digits)."""
    return f"{fmt_num(ms)} ms"
