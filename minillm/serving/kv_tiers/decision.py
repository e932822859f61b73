"""Load or recompute: the engine's choice for each run of blocks it finds beyond the pool.

    pool hits     host          disk             miss
    [0 1 2 3]     [4 5 6]       [7 8 9 10 11]    [12 ...]
                  one run:      one run:
                  load 3 blocks from host, or prefill them again?   (then the same for disk)

For each run the engine asks :func:`minillm.whatif.load_or_recompute` with the tier's
bandwidth as measured by the loads done so far (:class:`BandwidthMeter`) and the roofline
fraction its own prefills reached (a floor alone would flatter recompute: a 2-core CPU prefills
at a tenth of its roofline), and records both predicted times (:class:`TierDecision`) in the
step trace. The first "recompute" ends the
lookup: the scheduler holds a request's cached tokens as one prefix, so what follows it is
prefilled too.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TierDecision:
    """One run of consecutive blocks of one request found in one tier, and what the engine did.

    Attributes:
        request_id: the request.
        tier: "host" or "disk".
        first_block: logical index of the run's first block in the request (its tokens start at
            first_block · block_size).
        num_blocks, num_bytes: the run's blocks and their K/V bytes.
        load_ms: predicted time to read them (bytes / the tier's measured bandwidth).
        recompute_ms: predicted time to prefill them again: the roofline floor (:mod:`minillm.whatif`)
            divided by the fraction of it this engine's prefills reached so far (1 before any).
        choice: "load" or "recompute".
        loaded_blocks: blocks loaded (fewer than num_blocks when a read failed: a removed or
            corrupt file ends the run there); 0 for "recompute".
    """

    request_id: str
    tier: str
    first_block: int
    num_blocks: int
    num_bytes: int
    load_ms: float
    recompute_ms: float
    choice: str
    loaded_blocks: int = 0


class BandwidthMeter:
    """A tier's read bandwidth: bytes / seconds over every load so far, or a first estimate before any.

    Args:
        initial_bytes_per_s: the estimate used until a load is measured (> 0).
    """

    def __init__(self, initial_bytes_per_s: float):
        if not initial_bytes_per_s > 0:
            raise ValueError(f"initial_bytes_per_s must be > 0, got {initial_bytes_per_s}")
        self.initial_bytes_per_s = initial_bytes_per_s
        self.total_bytes, self.total_s = 0, 0.0

    def record(self, n_bytes: int, seconds: float) -> None:
        """One measured load of ``n_bytes`` that took ``seconds``."""
        self.total_bytes += n_bytes
        self.total_s += seconds

    @property
    def bytes_per_s(self) -> float:
        if self.total_bytes == 0 or self.total_s <= 0:
            return self.initial_bytes_per_s
        return self.total_bytes / self.total_s

    def __repr__(self) -> str:
        source = "measured" if self.total_bytes else "estimate"
        return f"BandwidthMeter({self.bytes_per_s / 1e9:.3g} GB/s, {source})"
