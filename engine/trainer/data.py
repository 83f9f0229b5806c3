"""The prompt stream: epochs of seeded shuffles, with a position that checkpoints exactly."""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass


@dataclass
class DataPosition:
    epoch: int = 0
    index: int = 0       # next prompt within this epoch's order
    samples_seen: int = 0


class PromptStream:
    def __init__(self, n: int, seed: int, shuffle: bool = True):
        if n <= 0:
            raise ValueError("empty prompt set")
        self.n, self.seed, self.shuffle = n, seed, shuffle
        self.pos = DataPosition()
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(self.n))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next_indices(self, k: int) -> list[int]:
        out = []
        while len(out) < k:
            if self.pos.index >= self.n:
                self.pos.epoch += 1
                self.pos.index = 0
                self._order = self._epoch_order(self.pos.epoch)
            take = min(k - len(out), self.n - self.pos.index)
            out += self._order[self.pos.index:self.pos.index + take]
            self.pos.index += take
        self.pos.samples_seen += k
        return out

    def state_dict(self) -> dict:
        return asdict(self.pos) | {"n": self.n, "seed": self.seed, "shuffle": self.shuffle}

    def load_state_dict(self, s: dict) -> None:
        self.pos = DataPosition(s["epoch"], s["index"], s["samples_seen"])
        self._order = self._epoch_order(self.pos.epoch)
