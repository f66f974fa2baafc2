"""The sampling rank's constrained-decoding state: one matcher per constrained request.

Why here (in the worker, beside the sampler) and not in the scheduler: the worker's
persistent batch already holds every request's tokens, the ones a preempted request
brings back included (it rejoins as a new request with its output tokens, which the
matcher replays), and it is where draft tokens are verified; the scheduler stays
torch-free and never learns that a request is constrained.

Each step, for the sample rows of constrained requests only:
1. the matcher catches up with the request's known output tokens (with overlapped steps
   the previous step's token may still be in flight: the model runner resolves that
   step first, and only when a constrained request needs it);
2. the bitmask row of every sampled position is filled (``fill``): on CUDA on a thread
   while the GPU runs the forward; on CPU before the forward, which then has the cores;
3. the model runner applies it to the logits before sampling (or verification).
Draft tokens are walked through the matcher: position i is masked with the state after
drafts[:i], a draft the grammar forbids ends the walk (it and everything after it can
never be accepted: the target's probability of a masked token is 0), and the matcher is
rolled back to the known tokens, so it only ever holds accepted output.

Candidate trees (Medusa) are walked depth-first: row 0 (the root) gets the current state,
row 1 + n the state after the path from the root to node n (accept each node's token on
the way down, roll it back on the way up). A node whose token the grammar forbids at its
parent's state is judged at the parent's row, which gives it probability 0: it is never
accepted, and neither is anything below it. Its row and its subtree's rows are never read
for an emitted token, so they allow everything (the raw logits: a row of forbidden-only
tokens would be a distribution of nothing for a verifier that draws at every row).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from kvflow.logger import init_logger
from kvflow.structured_output.compiler import CompileStats, GrammarCompiler

logger = init_logger(__name__)

# Longest a step waits for a request's grammar to compile before that request fails (the
# engine's fault isolation then ends it with an error; others go on).
COMPILE_TIMEOUT_S = 10.0
PLACEHOLDER = -1


@dataclass
class StructuredStats:
    """Since start: steps that masked rows, rows masked, seconds filling masks, draft
    tokens cut because the grammar forbids them, and the compiler's counters."""

    num_masked_steps: int = 0
    num_masked_rows: int = 0
    fill_s: float = 0.0
    num_draft_rejections: int = 0
    compile: CompileStats = field(default_factory=CompileStats)


@dataclass
class _Req:
    grammar: Future  # -> xgrammar CompiledGrammar
    eos_token_ids: list[int]
    matcher: object | None = None  # xgrammar GrammarMatcher, once compiled
    num_fed: int = 0  # output tokens the matcher has accepted
    broken: bool = False  # it was handed a token it refuses: no longer masked
    failed: bool = False  # its grammar did not compile (pipeline sampling rank): ends
    # start_after: its token ids, until they appear in the output (then None: constrained
    # from the token after them on).
    start_ids: list[int] | None = None


@dataclass
class _RowPlan:
    """One constrained request's share of a step's mask (plain data for the fill thread)."""

    req: _Req
    req_id: str
    new_tokens: list[int]  # known output tokens the matcher has not seen yet
    first_row: int  # its first sample row (logits row)
    count: int  # its sample rows
    drafts: list[int]
    # A candidate tree's drafts: each node's parent node (-1: the root), in node order
    # (a node's parent comes before it); None: the drafts are a chain.
    parents: list[int] | None = None


@dataclass
class StepMask:
    """The mask of one step: which logits rows, and their bitmask."""

    rows: torch.Tensor  # [M] int64 logits rows
    # [M, W] int32, bit t of a row: token t allowed; W = ceil(grammar vocab / 32), ids past
    # 32 W (a padded vocabulary) are forbidden
    bitmask: torch.Tensor


class StructuredOutputManager:
    def __init__(self, tokenizer_path: str, vocab_size: int, eos_token_ids: list[int],
                 *, fill_threads: int = 1, pin_memory: bool = False,
                 inline_fill: bool = False, isolate_failures: bool = False) -> None:
        """``fill_threads``: threads xgrammar fills one step's rows with (1 on a CPU
        engine, whose cores run the forward meanwhile); ``pin_memory``: the bitmask in
        page-locked memory, so that its copy to a GPU is asynchronous (a copy from
        pageable memory first waits for the queued forward, and the host then stays
        idle instead of preparing the next step); ``inline_fill``: fill in the caller's
        thread before the step runs (a CPU engine: a fill thread beside the forward
        preempts the step's own threads; batch 1 on the embedded model cost +9.3%
        with the thread and +4.5% inline, three alternated runs each)."""
        self._inline = inline_fill
        self._isolate = isolate_failures  # a pipeline's sampling rank: see _matcher
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self.mask_vocab_size = vocab_size  # the grammar's token ids (set with the compiler)
        self.eos_token_ids = list(eos_token_ids)
        self._compiler: GrammarCompiler | None = None  # built at the first constraint
        self.reqs: dict[str, _Req] = {}
        # the fill thread (a GPU engine's: its fill overlaps the queued forward); none inline
        self._fill_pool = None if inline_fill else ThreadPoolExecutor(
            1, thread_name_prefix="kvflow-mask")
        self._fill_threads = max(1, fill_threads)
        self._batch_matcher = None  # xgrammar BatchGrammarMatcher, made at the first fill
        self._pin = pin_memory
        self._lock = threading.Lock()
        self._stats = StructuredStats()

    @property
    def used(self) -> bool:
        """Whether a constrained request ever came (the stats are all zero until then)."""
        return self._compiler is not None

    @property
    def compiler(self) -> GrammarCompiler:
        if self._compiler is None:
            from kvflow.structured_output.vocab import load_tokenizer_info

            start = time.perf_counter()
            info = load_tokenizer_info(self.tokenizer_path, self.vocab_size,
                                       tuple(self.eos_token_ids))
            self._compiler = GrammarCompiler(info)
            # ids past it (a padded vocabulary) are never allowed: apply_token_bitmask
            self.mask_vocab_size = info.vocab_size
            logger.info("structured outputs: grammar vocabulary ready in %.2f s",
                        time.perf_counter() - start)
        return self._compiler

    # --- requests ------------------------------------------------------------------
    def update(self, so) -> None:
        """Follow a SchedulerOutput: constrained requests join (a preempted one rejoins
        and replays its output), finished and preempted ones leave."""
        for rid in so.finished_req_ids:
            self.reqs.pop(rid, None)
        for rid in so.preempted_req_ids:
            self.reqs.pop(rid, None)
        for new in so.new_reqs:
            c = new.sampling_params.structured_outputs
            if c is None:
                continue
            eos = [] if new.sampling_params.ignore_eos else list(new.eos_token_ids)
            req = _Req(self.compiler.submit(c), eos or list(self.eos_token_ids))
            if c.start_after is not None:
                from kvflow.structured_output.vocab import load_tokenizer

                req.start_ids = load_tokenizer(self.tokenizer_path).encode(
                    c.start_after, add_special_tokens=False) or None
            self.reqs[new.req_id] = req

    def plan(self, inputs, batch, tree=None) -> list[_RowPlan] | None:
        """The step's constrained sample rows (None: none), or raise LookupError when a
        constrained request's previous token is still in flight (resolve it, retry).
        ``tree``: the DraftTree the drafts are nodes of (a request's nd drafts are its
        first nd nodes), or None for chains."""
        if not self.reqs:
            return None
        sample = inputs.sample
        plans: list[_RowPlan] = []
        draft_pos = 0
        for j, i in enumerate(sample.req_indices):
            nd = sample.num_draft[j] if sample.num_draft is not None else 0
            rid = inputs.req_ids[int(i)]
            req = self.reqs.get(rid)
            if req is not None and not req.broken:
                out = batch.output_token_ids(int(inputs.rows[int(i)]))
                new = out[req.num_fed:]
                if (new == PLACEHOLDER).any():
                    raise LookupError(rid)
                if req.start_ids is not None:
                    end = _find_end(out, req.start_ids)
                    if end is None:  # still before start_after: sampled freely
                        draft_pos += nd
                        continue
                    req.start_ids, req.num_fed = None, end
                    new = out[end:]
                plans.append(_RowPlan(req, rid, new.tolist(), int(sample.offsets[j]),
                                      int(sample.offsets[j + 1] - sample.offsets[j]),
                                      list(sample.draft_token_ids[draft_pos:draft_pos + nd])
                                      if nd else [],
                                      tree.parents[:nd].tolist()
                                      if nd and tree is not None else None))
            draft_pos += nd
        return plans or None

    def start(self, plans: list[_RowPlan]) -> Future:
        """Fill the step's mask on the mask thread (or here, ``inline_fill``); the future
        gives a StepMask."""
        if self._inline:
            done: Future = Future()
            done.set_result(self._fill(plans))
            return done
        return self._fill_pool.submit(self._fill, plans)

    def _fill(self, plans: list[_RowPlan]) -> StepMask:
        import xgrammar as xgr

        start = time.perf_counter()
        num_rows = sum(p.count for p in plans)
        shape = xgr.get_bitmask_shape(num_rows, self.mask_vocab_size)  # [M, W] int32
        bitmask = torch.empty(shape, dtype=torch.int32, pin_memory=self._pin)
        rows = torch.empty(num_rows, dtype=torch.int64, pin_memory=self._pin)
        # Rows whose state is the matcher's current one (a request without drafts: its
        # single row) are filled together below, by xgrammar's threads.
        batch_matchers, batch_rows = [], []
        k = 0
        rejected = 0
        for p in plans:
            m = self._matcher(p)
            rows[k:k + p.count] = torch.arange(p.first_row, p.first_row + p.count)
            if m is None:  # its grammar did not compile on this rank: end it (_matcher)
                for _ in range(p.count):
                    _allow_only(bitmask[k], p.req.eos_token_ids)
                    k += 1
                continue
            for t in p.new_tokens:
                if not m.accept_token(t):
                    # Only a token the mask allowed is ever sampled; if that breaks, the
                    # request goes on unconstrained rather than failing the step.
                    logger.warning("request %s: the grammar refused token %d; its output "
                                   "is no longer constrained", p.req_id, t)
                    p.req.broken = True
                    break
                p.req.num_fed += 1
            if p.count == 1 and not p.req.broken and not m.is_terminated():
                batch_matchers.append(m)
                batch_rows.append(k)
                k += 1
                continue
            if p.parents is not None:
                rejected += self._fill_tree(m, p, bitmask, k)
                k += p.count
                continue
            consumed, walking = 0, True
            for r in range(p.count):
                if p.req.broken:
                    bitmask[k].fill_(-1)
                else:
                    _fill_row(m, bitmask, k, p.req.eos_token_ids)
                k += 1
                if walking and r < len(p.drafts):
                    if not p.req.broken and not m.is_terminated() \
                            and m.accept_token(p.drafts[r]):
                        consumed += 1
                    else:
                        walking = False
                        rejected += 1
            if consumed:
                m.rollback(consumed)
        if len(batch_matchers) == 1:
            batch_matchers[0].fill_next_token_bitmask(bitmask, batch_rows[0])
        elif batch_matchers:
            if self._batch_matcher is None:
                self._batch_matcher = xgr.BatchGrammarMatcher(self._fill_threads)
            self._batch_matcher.batch_fill_next_token_bitmask(batch_matchers, bitmask,
                                                              batch_rows)
        with self._lock:
            s = self._stats
            s.num_masked_steps += 1
            s.num_masked_rows += num_rows
            s.num_draft_rejections += rejected
            s.fill_s += time.perf_counter() - start
        return StepMask(rows, bitmask)

    @staticmethod
    def _fill_tree(m, p: _RowPlan, bitmask: torch.Tensor, k: int) -> int:
        """Rows k.. of a candidate tree (module docstring); returns the nodes the grammar
        forbids. The matcher ends where it began."""
        rows = bitmask[k:k + p.count]
        rows.fill_(-1)  # allow all: the broken request's rows, and forbidden subtrees'
        if p.req.broken:
            return 0
        children: list[list[int]] = [[] for _ in range(p.count)]  # of row 0 / 1 + n
        for n, par in enumerate(p.parents):
            children[par + 1].append(n)

        def fill(r: int) -> None:  # row r: the matcher's current state
            _fill_row(m, bitmask, k + r, p.req.eos_token_ids)

        rejected = 0
        fill(0)
        # Depth-first: (row, its next child's position in children[row]); the matcher
        # holds the path's tokens down to the row on top of the stack.
        stack = [[0, 0]]
        while stack:
            top = stack[-1]
            row, c = top
            if c == len(children[row]):
                stack.pop()
                if row:
                    m.rollback(1)
                continue
            top[1] += 1
            n = children[row][c]
            if not m.is_terminated() and m.accept_token(p.drafts[n]):
                fill(1 + n)
                stack.append([1 + n, 0])
            else:
                rejected += 1
        return rejected

    def _matcher(self, p: _RowPlan):
        """The request's matcher, made once its grammar is compiled (waiting at most
        COMPILE_TIMEOUT_S). Where the grammar fails or times out, the step raises and the
        engine's fault isolation fails that request alone; on a pipeline's sampling rank
        (``isolate_failures``), a process of its own whose exception would end every
        rank, the request instead gets None: its rows allow only the end of sequence, so
        it finishes at once with what it has, and the error is logged."""
        if p.req.matcher is None and not p.req.failed:
            import xgrammar as xgr

            try:
                compiled = p.req.grammar.result(timeout=COMPILE_TIMEOUT_S)
            except Exception as e:
                if not self._isolate:
                    raise
                logger.error("request %s: its grammar did not compile (%s); it ends now",
                             p.req_id, _describe_compile_error(e))
                p.req.failed = True
                return None
            p.req.matcher = xgr.GrammarMatcher(compiled,
                                               override_stop_tokens=p.req.eos_token_ids)
        return p.req.matcher

    def stats(self) -> StructuredStats:
        with self._lock:
            s = StructuredStats(**{k: getattr(self._stats, k) for k in
                                   ("num_masked_steps", "num_masked_rows", "fill_s",
                                    "num_draft_rejections")})
        if self._compiler is not None:
            c = self._compiler.stats
            s.compile = CompileStats(c.num_compiles, c.compile_s, c.num_cache_hits,
                                     c.num_errors)
        return s

    def shutdown(self) -> None:
        if self._fill_pool is not None:
            self._fill_pool.shutdown(wait=False, cancel_futures=True)
        if self._compiler is not None:
            self._compiler.shutdown()


def _fill_row(m, bitmask: torch.Tensor, row: int, eos_token_ids: list[int]) -> None:
    """Bitmask row ``row``: what the matcher's current state allows (only the end of
    sequence once its grammar is finished)."""
    if m.is_terminated():
        _allow_only(bitmask[row], eos_token_ids)
    else:
        m.fill_next_token_bitmask(bitmask, row)


def _describe_compile_error(e: Exception) -> str:
    if isinstance(e, TimeoutError):
        return f"took longer than {COMPILE_TIMEOUT_S:g} s"
    return f"{type(e).__name__}: {e}"


def _find_end(out: np.ndarray, ids: list[int]) -> int | None:
    """Index just past the first occurrence of ``ids`` in ``out`` (None: not there)."""
    n = len(ids)
    if len(out) < n:
        return None
    hits = np.nonzero(out[: len(out) - n + 1] == ids[0])[0]
    for h in hits:
        if out[h: h + n].tolist() == ids:
            return int(h) + n
    return None


def _allow_only(row: torch.Tensor, token_ids: list[int]) -> None:
    """Bitmask row [W] allowing only ``token_ids`` (a finished grammar: end of sequence)."""
    row.zero_()
    for t in token_ids:
        row[t // 32] |= 1 << (t % 32) if t % 32 < 31 else -(1 << 31)
