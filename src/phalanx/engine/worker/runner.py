"""The rank-side runner: this rank's model shard and KV pages, executing one step plan.

Every TP rank holds one :class:`Runner` (opened by a task with :func:`open_runner`, kept
in the rank's service registry under ``engine.runner/<id>`` so the Worker's close closes
it) and executes the same :class:`~phalanx.engine.core.plan.StepPlan` in the same order:
page copies, disk-tier loads into pages, the forward (its collectives), the staging of
saved pages. Rank 0 samples and returns the tokens; other ranks return none. Nothing a
rank holds locally changes which collectives it issues: the plan alone decides, and
where a rank's own disk read fails, one all-gather of every rank's load report (after
the loads, before the forward) makes every rank skip the forward together
(``StepResult.load_failures``).

A page's bytes on this rank are its K/V for every layer, layer-major
(``kv[layer][page]`` one after another), ``Geometry.page_bytes`` long: what the disk
tier stores for this rank.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import psutil
import torch

from phalanx.kvstore import Geometry, PageScatter
from phalanx.runtime import rank_services

from ...lifecycle import PhalanxError
from .._errors import EngineError
from ..core.executor import RankMemory
from ..core.plan import SamplingSpec, StepPlan, StepResult, TokenLogprobs
from ..model.attention import DecodeGather, build_meta
from ..model.config import ModelConfig, load_config
from ..model.parallel import SoloComm, TPComm
from ..model.tokenizer import Tokenizer
from ..model.transformer import CausalLM
from .grammar import Matchers
from .sampler import sample
from .tp import intra_op_threads

__all__ = ["Runner", "Staging", "close_runner", "get_runner", "open_runner"]

_SERVICE = "engine.runner/{}"
# bytes of each rank's load report in the agreement's all-gather (zeros: loaded); a
# longer reason is cut, the parent logs what arrives
_REPORT_BYTES = 512
# what the decode rows' K/V gathers kept from step to step may hold, all layers together
# (attention.DecodeGather); a larger batch or context gathers afresh each step
DECODE_GATHER_BYTES = 64 << 20
# A step whose matmuls are this small (tokens x hidden x hidden / TP multiply-adds per
# projection) runs on one intra-op thread: below it the second thread, spinning between
# the step's many small parallel regions, slows the main thread more than its share of
# the matmuls saves. Measured on the real test model (hidden 576) on 2 cores at TP 1:
# one thread decoded 44 against 37 tok/s at batch 1, 103 against 97 at 4, 125 against
# 129 at 8 and 136 against 164 at 16 (docs/design.md, "One thread for small steps");
# so up to 4 tokens of a 576-wide model, and never for a model twice as wide.
ONE_THREAD_WORK = 4 * 576 * 576


class Staging(Protocol):
    """Where a runner's disk-tier pages come from and go: the rank's staging
    (rank-local; rank 0 decided what it holds)."""

    def load(self, keys: list[bytes], out: torch.Tensor | PageScatter) -> None:
        """Fill ``out`` with the pages of ``keys``: a uint8 tensor [len(keys),
        page_bytes], or the pages' own memory in the pool, each page's layers in order
        (a :class:`~phalanx.kvstore.PageScatter` of ``layers`` parts a page)."""

    def save(self, keys: list[bytes], data: torch.Tensor | PageScatter) -> None:
        """Stage the pages of ``keys`` for storing in the background (copy them): ``data``
        is a uint8 tensor [len(keys), page_bytes] or the pages' own memory in the pool
        (as for ``load``)."""


class Runner:
    """One rank's shard of the model and its KV pool.

    ``staging`` (this rank's :mod:`~phalanx.engine.disk.staging`, attached by
    ``disk.staging.attach_staging``) is where a plan's ``PageLoad`` pages come from and
    its ``PageSave`` pages go.
    """

    def __init__(self, model_dir: str | Path, comm: TPComm | None = None, *,
                 num_pages: int, page_tokens: int = 64, dtype: str | None = None,
                 max_model_len: int | None = None, vocab_parallel: bool = False,
                 staging: Staging | None = None,
                 threads: int | None = None, device: str = "cpu",
                 decode_gather_bytes: int = DECODE_GATHER_BYTES) -> None:
        self.comm: TPComm = comm or SoloComm()
        # "cuda:N" runs the shard on that GPU (TP over TorchDistComm: engine/worker/devices.py);
        # the disk tier's pages pass through host memory then (_load_buffer, read_pages)
        self.device = torch.device(device)
        if self.device.type == "cuda":
            if self.device.index is None:  # plain "cuda": the current GPU, named
                self.device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)  # what allocates without a device lands here
        self.threads = threads or intra_op_threads(self.comm.size)
        if threads:
            torch.set_num_threads(threads)
        self.cfg: ModelConfig = load_config(model_dir, max_model_len=max_model_len,
                                            dtype=dtype)
        self.model, self.report = CausalLM.from_pretrained(model_dir, self.cfg, self.comm,
                                                           vocab_parallel)
        self.model.eval()
        # the most tokens a step may have and still run on one thread (CPU only)
        width = self.cfg.hidden_size
        self._one_thread_tokens = (ONE_THREAD_WORK * self.comm.size // (width * width)
                                   if self.device.type == "cpu" and self.threads > 1 else 0)
        self._threads_now = self.threads
        if self.device.type != "cpu":
            self.model.to(self.device)
        if num_pages < 1 or page_tokens < 1:
            raise EngineError(f"rank {self.comm.rank}: a KV pool needs num_pages >= 1 and "
                              f"page_tokens >= 1 (got {num_pages}, {page_tokens})")
        self.num_pages = num_pages
        self.page_tokens = page_tokens
        self.kv: list[torch.Tensor] = self.model.allocate_kv(num_pages, page_tokens,
                                                             self.device)
        # each layer's pool as flat bytes, for disk loads straight into the pages (host
        # memory only: a device's pages are loaded through a host buffer)
        self._kv_bytes = ([layer.view(-1).view(torch.uint8).numpy().data
                           for layer in self.kv] if self.device.type == "cpu" else [])
        self.staging = staging
        self._load_buf: torch.Tensor | None = None  # see _load_buffer
        # the decode rows' K/V kept gathered between steps (attention.DecodeGather)
        self.decode_gather = DecodeGather(decode_gather_bytes)
        self.model_dir = str(model_dir)
        self._matchers: Matchers | None = None   # rank 0's structured outputs (grammar.py)
        self.closed = False

    # -- what this rank holds ---------------------------------------------------------
    def geometry(self) -> Geometry:
        """The disk tier's geometry of this rank's pages."""
        return Geometry(layers=self.cfg.num_layers, kv_heads=self.model.shard.kv_heads,
                        head_dim=self.cfg.head_dim, dtype=self.cfg.dtype,
                        page_tokens=self.page_tokens)

    def memory(self) -> RankMemory:
        """Bytes this rank holds: weights (read from the checkpoint) and KV pool."""
        return RankMemory(
            rank=self.comm.rank, tp=self.comm.size, weight_bytes=self.model.weight_bytes(),
            bytes_read=self.report.bytes_read,
            kv_bytes=sum(t.numel() * t.element_size() for t in self.kv),
            # the process's resident set now (weights, KV pages written so far, torch)
            rss_bytes=psutil.Process().memory_info().rss,
            kv_heads_local=self.model.shard.kv_heads, heads_local=self.model.shard.heads,
            threads=self.threads, device=str(self.device))

    def read_pages(self, page_ids: Sequence[int]) -> torch.Tensor:
        """The bytes of ``page_ids`` on this rank: uint8 [n, page_bytes]."""
        self._check_pages(page_ids)
        idx = torch.tensor(list(page_ids), dtype=torch.long, device=self.device)
        n = len(page_ids)
        out = torch.cat([layer[idx].view(n, -1).view(torch.uint8) for layer in self.kv], dim=1)
        return out.cpu()

    def write_pages(self, page_ids: Sequence[int], data: torch.Tensor) -> None:
        """Set ``page_ids`` from ``data`` uint8 [n, page_bytes] (the disk tier's bytes)."""
        self._check_pages(page_ids)
        self.decode_gather.drop()
        idx = torch.tensor(list(page_ids), dtype=torch.long, device=self.device)
        n = len(page_ids)
        data = data.to(self.device)
        per = data.shape[1] // len(self.kv)
        for i, layer in enumerate(self.kv):
            # a strided view of this layer's columns (splitting the row is a view): one
            # copy, straight into the pages
            part = data[:, i * per:(i + 1) * per].view(layer.dtype)
            layer[idx] = part.view(n, *layer.shape[1:])

    def _page_scatter(self, page_ids: Sequence[int]) -> PageScatter:
        """``page_ids``' own memory in the pool, each page's layers in order: the disk
        tier's bytes for this rank land there, and are staged from there, with no copy
        in between (docs/design.md, "Disk loads straight into the KV pages")."""
        size = self.kv[0][0].numel() * self.kv[0].element_size()
        return PageScatter([flat[p * size:(p + 1) * size] for p in page_ids
                            for flat in self._kv_bytes], len(self._kv_bytes))

    def _load_buffer(self, n: int) -> torch.Tensor:
        """uint8 [n, page_bytes] for a disk load, reused from step to step (grown when
        short): a fresh one per load cost its page faults on every step."""
        pb = self.geometry().page_bytes
        if self._load_buf is None or self._load_buf.shape[0] < n:
            self._load_buf = torch.empty((n, pb), dtype=torch.uint8)
        return self._load_buf[:n]

    def _check_pages(self, page_ids: Sequence[int]) -> None:
        bad = [p for p in page_ids if not 0 <= p < self.num_pages]
        if bad:
            raise EngineError(f"rank {self.comm.rank}: page ids {bad[:8]} are outside the "
                              f"pool of {self.num_pages} pages")

    # -- one step ---------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        """Run ``plan``: copies, loads, forward, saves; rank 0 samples. If a load failed
        on any rank, no rank runs the forward or the saves: the result carries every
        failed rank's reason and no tokens."""
        grammars = self._grammars(plan)
        failures = self._prepare(plan)
        if failures:
            return StepResult(step=plan.step, tokens={}, load_failures=failures)
        self._copies(plan)
        hidden, rows, specs, seqs = self._step(plan, sample_only=True)
        tokens: dict[int, int] = {}
        logprobs: dict[int, TokenLogprobs] = {}
        # Only rank 0 samples: with a replicated LM head the other ranks skip it (its
        # matmul would take a core from rank 0); a vocab-parallel head is a collective.
        if rows and (self.comm.rank == 0 or self.model.embed_tokens.parallel):
            logits = self._logits(hidden)
            if self.comm.rank == 0:
                allowed = grammars.allowed(seqs, specs) if grammars is not None else None
                picked, lps = sample(logits, specs, allowed=allowed)
                if grammars is not None:
                    grammars.advance(seqs, specs, picked)
                tokens = dict(zip(seqs, picked, strict=True))
                logprobs = {s: lp for s, lp in zip(seqs, lps, strict=True) if lp is not None}
        self._saves(plan)
        return StepResult(step=plan.step, tokens=tokens, logprobs=logprobs)

    def _pick_threads(self, tokens: int) -> None:
        """One intra-op thread for a step too small to share (ONE_THREAD_WORK), all of
        this rank's otherwise; torch's setting is changed only when the choice does."""
        n = 1 if tokens <= self._one_thread_tokens else self.threads
        if n != self._threads_now:
            torch.set_num_threads(n)
            self._threads_now = n

    def _grammars(self, plan: StepPlan) -> Matchers | None:
        """Rank 0's matchers with the plan's grammar table applied (built at the first
        plan that names a grammar); None on other ranks and while none was named."""
        if self.comm.rank != 0:
            return None
        if self._matchers is None:
            if not (plan.grammars or any(c.sampling.grammar for c in plan.chunks)):
                return None
            self.open_grammars()
        assert self._matchers is not None
        self._matchers.update(plan)
        return self._matchers

    def open_grammars(self) -> None:
        """Rank 0's grammar tokenizer, built at start while the model file's parse is
        still at hand (worker/rank.py drops it after): built at the first structured
        request instead, it parsed a GGUF file again (2-4 s) inside a step, and every
        running stream waited (the structured benchmark's 2.7 s p99 token gap)."""
        if self.comm.rank == 0 and self._matchers is None:
            self._matchers = Matchers(Tokenizer(self.model_dir).to_json(),
                                      self.cfg.vocab_size, self.cfg.eos_token_ids)

    @torch.inference_mode()
    def logits(self, plan: StepPlan) -> torch.Tensor:
        """Float32 logits of every token of the plan, in token order, on the host (for
        oracle tests)."""
        failures = self._prepare(plan)
        if failures:
            raise EngineError(f"step {plan.step}: disk loads failed: {failures}")
        self._copies(plan)
        hidden, _, _, _ = self._step(plan, sample_only=False)
        self._saves(plan)
        return self._logits(hidden).cpu()

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        with self._collectives():
            return self.model.compute_logits(hidden)

    def _collectives(self) -> contextlib.AbstractContextManager[None]:
        """The communicator's per-step scope (DomainComm maps its windows once per
        scope)."""
        return self.comm.step()

    def _prepare(self, plan: StepPlan) -> dict[int, str]:
        """The plan's disk loads; {} when every rank loaded every page, else each failed
        rank's reason (the same on every rank: see _agree)."""
        if self.closed:
            raise EngineError(f"rank {self.comm.rank}: the runner was closed")
        if plan.loads:
            self.decode_gather.drop()   # they write pages the kept gathers may hold
        if not plan.loads:
            return {}  # the same on every rank: no agreement, no collective
        if self.staging is None:
            raise EngineError(f"rank {self.comm.rank}: step {plan.step} loads "
                              f"{len(plan.loads[0].keys)} pages but this runner has no "
                              "disk tier")
        why = ""
        for load in plan.loads:
            self._check_pages(load.page_ids)
            # on the host the pages themselves are the destination; a failed load
            # leaves them half written, but they were allocated for this load and are
            # computed again (the scheduler's recompute), never read as they are
            out = (self._page_scatter(load.page_ids) if self._kv_bytes
                   else self._load_buffer(len(load.keys)))
            try:
                self.staging.load(list(load.keys), out)
            except (PhalanxError, OSError) as exc:
                # a record missing, corrupt or unreadable on this rank: a miss, decided
                # with the other ranks below
                why = f"{type(exc).__name__}: {exc}"
                break
            if isinstance(out, torch.Tensor):
                self.write_pages(load.page_ids, out)
        return self._agree(why)

    def _copies(self, plan: StepPlan) -> None:
        """The plan's page copies (after its loads: a source may be a page just loaded)."""
        if not plan.copies:
            return
        self.decode_gather.drop()   # a step that writes pages keeps no gathers (its doc)
        src = [c.src for c in plan.copies]
        dst = [c.dst for c in plan.copies]
        self._check_pages(src + dst)
        s = torch.tensor(src, dtype=torch.long, device=self.device)
        d = torch.tensor(dst, dtype=torch.long, device=self.device)
        for layer in self.kv:
            layer.index_copy_(0, d, layer.index_select(0, s))

    def _agree(self, why: str) -> dict[int, str]:
        """Every rank's load report (rank -> reason, failed ranks only), by one all-gather
        of a fixed-size report: every rank sees the same answer, so all of them run the
        forward or none does, and its collectives stay in step."""
        report = torch.zeros(1, _REPORT_BYTES, dtype=torch.uint8)
        if why:
            data = why.encode()[:_REPORT_BYTES]
            report[0, :len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        with self._collectives():
            every = self.comm.all_gather(report.to(self.device)).cpu()
        return {r: bytes(row.numpy()).rstrip(b"\0").decode(errors="replace")
                for r, row in enumerate(every) if bool(row.any())}

    def _step(self, plan: StepPlan, sample_only: bool
              ) -> tuple[torch.Tensor, list[int], list[SamplingSpec], list[int]]:
        if not plan.chunks:
            return torch.empty(0, self.cfg.hidden_size), [], [], []
        ids: list[int] = []
        pos: list[int] = []
        rows: list[int] = []
        specs: list[SamplingSpec] = []
        seqs: list[int] = []
        spans: list[tuple[int, int, list[int]]] = []
        for c in plan.chunks:
            if not c.tokens:
                raise EngineError(f"step {plan.step}: sequence {c.seq_id} has an empty chunk")
            self._check_pages(c.block_table)
            bad = [t for t in c.tokens if not 0 <= t < self.cfg.vocab_size]
            if bad:
                raise EngineError(f"step {plan.step}: sequence {c.seq_id} has token ids "
                                  f"{bad[:4]} outside the vocabulary of "
                                  f"{self.cfg.vocab_size}")
            ids.extend(c.tokens)
            pos.extend(range(c.start_pos, c.start_pos + len(c.tokens)))
            spans.append((c.start_pos, len(c.tokens), list(c.block_table)))
            if c.sample:
                rows.append(len(ids) - 1)
                specs.append(c.sampling)
                seqs.append(c.seq_id)
        if max(pos) >= self.cfg.max_model_len:
            raise EngineError(f"step {plan.step}: position {max(pos)} is beyond max_model_len "
                              f"{self.cfg.max_model_len}")
        self._pick_threads(len(ids))   # for the forward and, after it, the sampling
        meta = build_meta(spans, self.page_tokens, self.device, self.kv[0].dtype)
        self.decode_gather.begin(meta, len(self.kv))
        dev = self.device
        try:
            with self._collectives():
                hidden = self.model(torch.tensor(ids, dtype=torch.long, device=dev),
                                    torch.tensor(pos, dtype=torch.long, device=dev), meta,
                                    self.kv)
        except BaseException:
            self.decode_gather.drop()  # some layers may have written their new positions
            raise
        if sample_only:
            hidden = (hidden[torch.tensor(rows, dtype=torch.long, device=dev)] if rows
                      else hidden[:0])
        return hidden, rows, specs, seqs

    def _saves(self, plan: StepPlan) -> None:
        for save in plan.saves:
            if self.staging is None:
                continue  # no disk tier: nothing to stage (rank 0 would not plan saves)
            # on the host the staging copies from the pages themselves: one copy, not a
            # gather into a tensor that it then copied again
            self.staging.save(list(save.keys), self._page_scatter(save.page_ids)
                           if self._kv_bytes else self.read_pages(save.page_ids))

    def close(self) -> None:
        """Drop the KV pool and close the communicator's window mappings (idempotent):
        after this the TP domain can be released."""
        self.closed = True
        self.kv = []
        self._kv_bytes = []
        self._load_buf = None
        self.decode_gather.drop()
        self.comm.close()



def open_runner(runner_id: str, model_dir: str | Path, comm: TPComm | None = None,
                **kwargs: Any) -> Runner:
    """Open a runner on this rank and register it as ``engine.runner/<runner_id>`` in the
    rank's service registry (call from a task on the rank)."""
    runner = Runner(model_dir, comm, **kwargs)
    return rank_services().register(_SERVICE.format(runner_id), runner, runner.close)


def get_runner(runner_id: str) -> Runner:
    """This rank's runner ``runner_id`` (opened by :func:`open_runner`)."""
    return rank_services().get(_SERVICE.format(runner_id), Runner)


def close_runner(runner_id: str) -> None:
    rank_services().close(_SERVICE.format(runner_id))
