"""A cache point: the prefix a request asks to keep, and for how long.

Anthropic's ``cache_control: {"type": "ephemeral", "ttl": "5m" | "1h"}`` and Bedrock's cache
point mark the end of a prefix a client will send again. The engine pins the full blocks of
that prefix in the host and disk tiers until ``now + ttl_s``: LRU skips them until then, and
marking them again (the next request with the same prefix) extends the time::

    prompt        [ system prompt ......... | document ........... | question ]
    cache point   ^----------- num_tokens = 1,000 -----------------^
    pinned        blocks 0 .. 61 (1,000 // 16 = 62 full blocks of 16), until now + 300 s
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

_TTL_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}


@dataclass(frozen=True)
class CachePoint:
    """Keep the first ``num_tokens`` tokens' K/V for ``ttl_s`` seconds.

    Attributes:
        num_tokens: the prefix to keep, tokens >= 1; only its full blocks are pinned (a block
            holds block_size tokens: a partial block has no hash, so nothing can find it).
        ttl_s: seconds from when the request is added; default 300 (Anthropic's "5m").

    Raises ValueError for a num_tokens that is not a positive int, or a ttl_s that is not a
    finite number > 0.
    """

    num_tokens: int
    ttl_s: float = 300.0

    def __post_init__(self):
        if type(self.num_tokens) is not int or self.num_tokens < 1:
            raise ValueError(f"a cache point's num_tokens must be an int >= 1, got {self.num_tokens!r}")
        if isinstance(self.ttl_s, bool) or not isinstance(self.ttl_s, (int, float)) or not (
                math.isfinite(self.ttl_s) and self.ttl_s > 0):
            raise ValueError(f"a cache point's ttl_s must be a number of seconds > 0, got {self.ttl_s!r}")

    @staticmethod
    def parse_ttl(text: str) -> float:
        """Seconds from a lifetime such as "5m", "1h", "90s" (Anthropic writes "5m" and "1h").

        Raises ValueError for anything else, naming the accepted forms.
        """
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh])\s*", str(text))
        if match is None or float(match.group(1)) <= 0:
            raise ValueError(f"a cache lifetime must be a number > 0 with a unit s, m or h, like \"5m\" or \"1h\"; "
                             f"got {text!r}")
        return float(match.group(1)) * _TTL_UNITS[match.group(2)]
