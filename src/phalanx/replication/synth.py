"""Synthetic records written through the replicated store path (runs on rank 0).

What ``phalanx cache synth`` and the tests use to make the directories a TP-N job
would have left: every record is a real ``Leader.store_chain`` (decided on rank 0,
stored on every rank from its own KV source, acked), only the tokens are made up.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from phalanx.kvstore.keys import KeyChain

from .leader import Leader

__all__ = ["SHAPES", "SynthReport", "synthesize"]

SHAPES = ("chain", "tree")


@dataclass
class SynthReport:
    records: int
    redundant_rows: int  # rows whose every byte a later row also holds (thinnable)
    seconds: float


def synthesize(leader: Leader, records: int, shape: str, seed: int, group: int) -> SynthReport:
    """``records`` records of one new page each: a linear ``chain``, or a branchy
    ``tree`` (each record extends a random earlier one). With ``group`` > 1 each row
    starts where its group of ``group`` records starts (redundant rows)."""
    if shape not in SHAPES:
        raise ValueError(f"shape {shape!r}: choose one of {SHAPES}")
    t0 = time.monotonic()
    rng = np.random.default_rng(seed)
    pt = leader.store.geometry.page_tokens
    fp = leader.store.fingerprint
    root = KeyChain([], pt, fp)
    # chain: only the previous prefix is kept (a 10,000-page chain must not keep 10,000
    # key lists); tree: every prefix, whose depth is logarithmic on average
    chains: list[KeyChain] = []
    starts: list[int] = []
    redundant = 0
    for i in range(records):
        if shape == "chain":
            parent = i - 1
            base = chains[-1] if chains else root
        else:
            parent = int(rng.integers(-1, i)) if i else -1
            base = chains[parent] if parent >= 0 else root
        chain = base.extend(rng.integers(0, 50_000, pt))
        first = len(chain) - 1
        p_start = (starts[-1] if shape == "chain" else starts[parent]) if parent >= 0 else 0
        start = p_start if group > 1 and len(chain) - p_start <= group else first
        redundant += start < first and shape == "chain"
        leader.wait_room()  # flow control: a bulk writer waits for the slowest peer
        leader.store_chain(chain, start, wait=False)
        if shape == "chain":
            chains[:] = [chain]
            starts[:] = [start]
        else:
            chains.append(chain)
            starts.append(start)
    undrained = leader.drain(None)  # a stalled peer fails its link: no deadline needed
    assert not undrained, undrained
    return SynthReport(records, redundant, time.monotonic() - t0)
