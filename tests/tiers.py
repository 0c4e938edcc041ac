"""A prefix tier over a set of keys: the scheduler's tests' model of the disk tier's
contract (``phalanx.engine.core.scheduler.PrefixTier``), kept out of the product."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["InMemoryTier"]


class InMemoryTier:
    """A PrefixTier over a set of keys.

    A saved chain is stored at once (``accept``: False refuses every store)."""

    def __init__(self, keys: Sequence[bytes] = (), accept: bool = True) -> None:
        self.keys: set[bytes] = set(keys)
        self.pins: dict[bytes, int] = {}
        self.accept = accept
        self.asked: list[bytes] = []
        self.saves: list[list[bytes]] = []

    def lookup(self, keys: Sequence[bytes], start: int) -> int:
        n = 0
        for k in keys[start:]:
            if k not in self.keys:
                break
            n += 1
        for k in keys[start : start + n]:
            self.pins[k] = self.pins.get(k, 0) + 1
        return n

    def unpin(self, keys: Sequence[bytes]) -> None:
        for k in keys:
            left = self.pins[k] - 1
            if left:
                self.pins[k] = left
            else:
                del self.pins[k]

    def wants(self, keys: Sequence[bytes], start: int) -> list[bool]:
        self.asked.extend(keys[start:])
        return [self.accept and k not in self.keys for k in keys[start:]]

    def saved(self, keys: Sequence[bytes]) -> None:
        self.saves.append(list(keys))
        if self.accept:
            self.keys.update(keys)
