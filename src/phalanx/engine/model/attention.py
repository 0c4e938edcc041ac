"""Paged attention in plain torch.

This rank's KV pool for one layer is ``kv[num_pages, 2, page_tokens, kv_heads, head_dim]``
(2 = K, V): one page of one layer is contiguous, which is what the disk tier stores.
Position ``p`` of a sequence lives in page ``block_table[p // page_tokens]`` at slot
``p % page_tokens``.

Per layer: the step's new K/V are scattered into their slots (one indexed write for
every chunk), then each chunk attends over positions ``[0, start_pos + q_len)`` gathered
from its pages. Decode chunks (one query token each) are batched into one SDPA call over
their pages padded to the longest context, masked per row; prefill chunks run one SDPA
each (causal, offset by ``start_pos``). :class:`AttnMeta` is built once per step and
shared by every layer.

A :class:`DecodeGather` keeps the decode rows' gathered K/V from step to step: while a
step's decode rows have exactly the previous step's pages (the same sequences, no page
added), each layer writes only the one new position per row into its kept gather instead
of copying every row's whole context again. Under the profiler the copy was 30% of a
batch-16 decode step of the 8x512 model on one thread; keeping it made that batch 7%
faster at TP 2 (docs/design.md, "Kept decode gathers").
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .._errors import EngineError

__all__ = ["AttnMeta", "ChunkMeta", "DecodeGather", "build_meta", "paged_attention"]


@dataclass
class ChunkMeta:
    """One sequence's share of the step: queries ``[q_start, q_start + q_len)`` of the
    flattened tokens, at positions ``start_pos..``."""

    q_start: int
    q_len: int
    start_pos: int
    block_table: torch.Tensor          # LongTensor of page ids covering [0, start_pos + q_len)
    kv_index: torch.Tensor | None = None  # [2 * pages] rows of the pool viewed [pages * 2, -1]
    mask: torch.Tensor | None = None   # [q_len, ctx] additive float (prefill, start_pos > 0)
    # additive masks of sliding-window layers and softcapped ones, by window (0: none),
    # built at the first layer that needs one and shared by the rest of the step
    masks: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def context(self) -> int:
        return self.start_pos + self.q_len


@dataclass
class AttnMeta:
    """Everything a layer needs to write and read the pages at this step."""

    page_tokens: int
    chunks: list[ChunkMeta]
    write_pages: torch.Tensor    # [T] page of each new token
    write_slots: torch.Tensor    # [T] slot in that page
    prefill: list[ChunkMeta] = field(default_factory=list)
    decode_rows: torch.Tensor | None = None    # [B] q index of each decode chunk
    decode_pages: torch.Tensor | None = None   # [B, max_pages] (padded with page 0)
    decode_mask: torch.Tensor | None = None    # [B, 1, 1, max_pages * page_tokens] additive
    decode_kv_index: torch.Tensor | None = None  # [B * 2 * max_pages] (see _kv_rows)
    decode_pos: torch.Tensor | None = None     # [B] position of each decode row's new token
    decode_gather: DecodeGather | None = None  # kept gathers (see DecodeGather.begin)
    decode_masks: dict[int, torch.Tensor] = field(default_factory=dict)  # by window
    mask_dtype: torch.dtype = torch.float32   # the queries' (build_meta's dtype)

    def chunk_mask(self, m: ChunkMeta, window: int) -> torch.Tensor | None:
        """A prefill chunk's additive mask for a layer that sees the last ``window``
        positions (0: all): query at position p sees keys (p - window, p]. None: plain
        causal from position 0 (SDPA's is_causal)."""
        if window == 0 or window >= m.context:
            return m.mask
        mask = m.masks.get(window)
        if mask is None:
            dtype = self.mask_dtype
            qpos = torch.arange(m.start_pos, m.context, device=m.block_table.device).unsqueeze(1)
            keys = torch.arange(m.context, device=qpos.device).unsqueeze(0)
            sees = (keys <= qpos) & (keys > qpos - window)
            mask = m.masks[window] = _additive(sees.cpu(), dtype).to(qpos.device)
        return mask

    def decode_window_mask(self, window: int) -> torch.Tensor | None:
        """The decode rows' mask for a layer that sees the last ``window`` positions."""
        base = self.decode_mask
        if window == 0 or base is None or self.decode_pos is None:
            return base
        mask = self.decode_masks.get(window)
        if mask is None:
            keys = torch.arange(base.shape[-1], device=base.device).view(1, 1, 1, -1)
            old = keys <= (self.decode_pos.view(-1, 1, 1, 1) - window)
            mask = self.decode_masks[window] = base.masked_fill(old, float("-inf"))
        return mask

    def to(self, device: torch.device | str) -> None:
        """Move every tensor to ``device`` (in place)."""
        for m in self.chunks:
            m.block_table = m.block_table.to(device)
            m.mask = None if m.mask is None else m.mask.to(device)
            m.kv_index = None if m.kv_index is None else m.kv_index.to(device)
        for name in ("write_pages", "write_slots", "decode_pages", "decode_rows",
                     "decode_mask", "decode_kv_index", "decode_pos"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.to(device))


def build_meta(chunks: list[tuple[int, int, list[int]]], page_tokens: int,
               device: torch.device | str = "cpu",
               dtype: torch.dtype = torch.float32) -> AttnMeta:
    """Meta for chunks given as ``(start_pos, q_len, block_table)`` in token order, its
    tensors on ``device`` (built on the host, moved once per step). Masks are additive
    (0 where a query sees a key, -inf where not) in ``dtype``, the queries' dtype: SDPA
    turns a bool mask into that with a fresh float tensor in every layer's call (for a
    128-token chunk over 2,048 positions, 1 MiB allocated and filled per layer: 1-3 ms
    a layer under the profiler in a rank process, before the ranks had one malloc
    arena)."""
    metas: list[ChunkMeta] = []
    pages: list[int] = []
    slots: list[int] = []
    q = 0
    for start, n, table in chunks:
        ctx = start + n
        need = -(-ctx // page_tokens)
        if len(table) < need:
            raise EngineError(f"a chunk at positions [{start}, {ctx}) needs {need} pages; its "
                              f"block table has {len(table)}")
        for p in range(start, ctx):
            pages.append(table[p // page_tokens])
            slots.append(p % page_tokens)
        m = ChunkMeta(q, n, start, torch.tensor(table[:need], dtype=torch.long))
        if n > 1:
            m.kv_index = _kv_rows(m.block_table.unsqueeze(0)).view(-1)
        if n > 1 and start > 0:
            qpos = torch.arange(start, ctx).unsqueeze(1)
            m.mask = _additive(torch.arange(ctx).unsqueeze(0) <= qpos, dtype)
        metas.append(m)
        q += n
    meta = AttnMeta(page_tokens, metas, torch.tensor(pages, dtype=torch.long),
                    torch.tensor(slots, dtype=torch.long), mask_dtype=dtype)
    decode = [m for m in metas if m.q_len == 1]
    meta.prefill = [m for m in metas if m.q_len > 1]
    if decode:
        width = max(len(m.block_table) for m in decode)
        padded = torch.zeros((len(decode), width), dtype=torch.long)
        for i, m in enumerate(decode):
            padded[i, :len(m.block_table)] = m.block_table
        meta.decode_pages = padded
        meta.decode_rows = torch.tensor([m.q_start for m in decode], dtype=torch.long)
        meta.decode_pos = torch.tensor([m.start_pos for m in decode], dtype=torch.long)
        lens = torch.tensor([m.context for m in decode]).view(-1, 1, 1, 1)
        meta.decode_mask = _additive(
            torch.arange(width * page_tokens).view(1, 1, 1, -1) < lens, dtype)
        meta.decode_kv_index = _kv_rows(padded).view(-1)
    if torch.device(device).type != "cpu":
        meta.to(device)
    return meta


class DecodeGather:
    """The decode rows' K/V, gathered contiguous per layer, kept across steps.

    :meth:`begin` (once per step, before the layers) keeps the gathers when this step's
    padded decode page table equals the previous step's, else drops them. Equal tables
    mean the same live sequences in the same rows: a page is written only by the one
    sequence whose table ends in it, and a sequence that joins or resumes has a step of
    prefill first, in which the decode rows differ. A step that copies or loads pages
    (:meth:`drop`), or has no decode rows, drops them too. Gathers are kept only while
    every layer's fits in ``budget`` bytes together; above it each step gathers afresh,
    as before.
    """

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self._pages: torch.Tensor | None = None
        self._layers: dict[int, torch.Tensor] = {}
        self.reuse = False
        self.keep = False
        self.steps_reused = 0   # steps whose decode rows wrote into kept gathers

    def begin(self, meta: AttnMeta, layers: int) -> None:
        pages = meta.decode_pages
        meta.decode_gather = self
        if pages is None:
            self.drop()
            return
        prev = self._pages
        self.reuse = (prev is not None and prev.shape == pages.shape
                      and bool(torch.equal(prev, pages)) and len(self._layers) == layers)
        if self.reuse:
            self.steps_reused += 1
        else:
            self.drop()
            self._pages = pages

    def sized(self, one_layer: torch.Tensor, layers: int) -> None:
        """Keep gathers like ``one_layer`` for ``layers`` layers if they fit the budget."""
        self.keep = one_layer.numel() * one_layer.element_size() * layers <= self.budget

    def drop(self) -> None:
        self._pages = None
        self._layers.clear()
        self.reuse = self.keep = False

    def get(self, layer: int) -> torch.Tensor | None:
        return self._layers.get(layer) if self.reuse else None

    def put(self, layer: int, gathered: torch.Tensor) -> None:
        if self.keep:
            self._layers[layer] = gathered


def _additive(sees: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where ``sees``, -inf elsewhere."""
    return torch.zeros(sees.shape, dtype=dtype).masked_fill_(~sees, float("-inf"))


def _kv_rows(pages: torch.Tensor) -> torch.Tensor:
    """[B, 2, w]: for page ids ``pages`` [B, w], the rows of a layer's pool viewed as
    ``[num_pages * 2, page_tokens * kv_heads * d]`` holding their K (0) and V (1). One
    ``index_select`` with them gathers a step's K and V each contiguous per sequence:
    indexing the pool and reshaping its K/V halves copied the same bytes three times and
    was most of a decode step (2 ms of a layer's 2.5 at batch 16)."""
    return (pages * 2).unsqueeze(1) + torch.tensor([0, 1], dtype=torch.long).view(1, 2, 1)


def _attend(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor,
            mask: torch.Tensor | None, scale: float, softcap: float | None) -> torch.Tensor:
    """SDPA, or with the scores soft-capped (``cap * tanh(s / cap)``, Gemma 2), which SDPA
    cannot do: the same math written out. ``keys``/``vals`` have q's heads or divide
    them (GQA); ``mask`` None means causal from position 0."""
    if softcap is None:
        return F.scaled_dot_product_attention(
            q, keys, vals, attn_mask=mask, is_causal=mask is None, scale=scale,
            enable_gqa=q.shape[-3] != keys.shape[-3])
    if q.shape[-3] != keys.shape[-3]:
        rep = q.shape[-3] // keys.shape[-3]
        keys = keys.repeat_interleave(rep, dim=-3)
        vals = vals.repeat_interleave(rep, dim=-3)
    s = torch.matmul(q, keys.transpose(-1, -2)) * scale
    s = torch.tanh(s / softcap) * softcap
    if mask is None:
        n, ctx = q.shape[-2], keys.shape[-2]
        mask = _additive(torch.ones(n, ctx, dtype=torch.bool, device=q.device).tril(ctx - n),
                         s.dtype)
    s = s + mask
    return torch.matmul(torch.softmax(s.float(), dim=-1).to(q.dtype), vals)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor,
                    meta: AttnMeta, scale: float, layer: int = 0, layers: int = 1,
                    window: int = 0, softcap: float | None = None) -> torch.Tensor:
    """Write ``k``/``v`` [T, kv_heads, d] into ``kv``'s pages (layer ``layer`` of
    ``layers``), attend ``q`` [T, heads, d] causally over each chunk's context (its last
    ``window`` positions where a sliding-window layer gives one); returns [T, heads, d].
    Every position stays in the pages: a sliding layer masks the old ones (its KV costs
    what a full layer's does; docs/design.md, "Issue 44: architectures")."""
    kv[meta.write_pages, 0, meta.write_slots] = k
    kv[meta.write_pages, 1, meta.write_slots] = v
    out = torch.empty_like(q)
    heads, d = q.shape[1], q.shape[2]
    kv_heads = kv.shape[3]
    rows_of = kv.view(kv.shape[0] * 2, -1)                # a view: one row per K or V page
    for m in meta.prefill:
        ctx = m.context
        assert m.kv_index is not None  # set for every prefill chunk
        g = rows_of.index_select(0, m.kv_index).view(2, -1, kv_heads, d)
        keys = g[0, :ctx].transpose(0, 1)
        vals = g[1, :ctx].transpose(0, 1)
        qc = q[m.q_start:m.q_start + m.q_len].transpose(0, 1)
        o = _attend(qc.unsqueeze(0), keys.unsqueeze(0), vals.unsqueeze(0),
                    meta.chunk_mask(m, window), scale, softcap)
        out[m.q_start:m.q_start + m.q_len] = o[0].transpose(0, 1)
    if meta.decode_pages is not None:
        b = meta.decode_pages.shape[0]
        assert meta.decode_kv_index is not None  # set with decode_pages
        rows = meta.decode_rows
        assert rows is not None and meta.decode_pos is not None  # set with decode_pages
        kept = meta.decode_gather
        gathered = kept.get(layer) if kept is not None else None
        if gathered is None:
            gathered = rows_of.index_select(0, meta.decode_kv_index).view(b, 2, -1,
                                                                          kv_heads, d)
            if kept is not None:
                if layer == 0:
                    kept.sized(gathered, layers)
                kept.put(layer, gathered)
        else:
            # the same rows on the same pages as the last step: only the new position
            each = torch.arange(b, device=gathered.device)
            gathered[each, 0, meta.decode_pos] = k[rows]
            gathered[each, 1, meta.decode_pos] = v[rows]
        keys = gathered[:, 0].transpose(1, 2)             # [B, kvh, w * pt, d]
        vals = gathered[:, 1].transpose(1, 2)
        # a KV head's group of query heads (head h reads KV head h // group) attends as
        # that many query positions of one head: no GQA expansion. torch's CPU kernel
        # with enable_gqa took 153 us a layer at 128 tokens of context and 1.7 ms at
        # 1,024 in bfloat16 (SmolLM2's 9 / 3 heads), this 60 us and 80 us
        # (docs/design.md, "Decode at batch 1")
        qd = q[rows].view(b, kv_heads, heads // kv_heads, d)
        o = _attend(qd, keys, vals, meta.decode_window_mask(window), scale, softcap)
        out[rows] = o.reshape(b, heads, d)
    return out
