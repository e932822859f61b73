"""Clock: when each new token arrived, the one measurement every engine of the benchmark makes."""

from __future__ import annotations

import time

import torch


class Clock:
    """Arrival time of each new token, called with the token [B] once it is on the host."""

    def __init__(self):
        self.start = time.perf_counter()
        self.times: list[float] = []
        self.tokens: list[list[int]] = []  # [n][B]

    def __call__(self, token: torch.Tensor) -> None:
        self.tokens.append(token.reshape(-1).tolist())  # .tolist() waits for the device
        self.times.append(time.perf_counter())

    @property
    def ttft_s(self) -> float:
        return self.times[0] - self.start

    @property
    def gaps_s(self) -> list[float]:
        return [b - a for a, b in zip(self.times, self.times[1:])]
