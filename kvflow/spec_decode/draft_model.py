"""A draft model: a second, smaller model with the target's vocabulary proposes k tokens
autoregressively; the target verifies them in one pass (Leviathan et al. 2023).

The draft keeps its own paged KV cache in the worker (``DraftBlocks``), sized like the
target's (the engine's KV budget pays for both, worker/kv_cache.py). The scheduler never
sees it: it only allocates the target's slots for the drafts it schedules.

Keeping the two in step costs no bookkeeping about verdicts. For each request the draft
remembers which tokens its cache holds K/V for, in order (``_fed``). Before proposing it
compares them with the request's known tokens: the common prefix is still valid (an
accepted draft is the very token the draft fed, so its K/V stays), everything after it
is stale and simply overwritten (rolled back). The draft then catches up on the known
tokens it has not seen (usually the one token the target emitted after the accepted
drafts; a whole prompt when the request is new, was preempted or ran with drafting
switched off), all requests in one forward, and takes k - 1 more one-token steps.

Sampling: a greedy request's drafts are the draft's argmax. A random request's drafts
are drawn from the draft's distribution q (its logits through the request's
temperature, top-k, top-p and min-p) and q is kept for the rejection sampler, which then
keeps each draft with probability min(1, p / q): the output is exactly the target's.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from kvflow.config import EngineConfig, GiB, torch_dtype
from kvflow.cpu.memory import zeroed_host_tensor
from kvflow.layers.attention import AttentionMetadata, AttentionSpec, model_rotary
from kvflow.layers.custom_op import use_kernels
from kvflow.layers.sampler import (SamplingMetadata, apply_top_k_top_p_min_p, greedy_argmax,
                                   random_sample)
from kvflow.logger import init_logger
from kvflow.models.loader import load_model
from kvflow.sampling_params import SamplingParams
from kvflow.spec_decode.proposer import Proposer
from kvflow.utils import cdiv
from kvflow.worker import kv_cache as kvc
from kvflow.worker.transfer import to_device

logger = init_logger(__name__)


class DraftBlocks:
    """The draft cache's block tables: a free list and each request's blocks, in order.

    Freed blocks are reused first (a stack), so a request's blocks stay mostly
    consecutive and the CPU attention reads plain views."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.free = list(range(num_blocks - 1, -1, -1))  # pop() hands out 0, 1, 2, ...
        self.tables: dict[str, list[int]] = {}

    def ensure(self, req_id: str, num_tokens: int) -> bool:
        """Give ``req_id`` blocks for positions 0..num_tokens-1; False if the pool is out
        (the request then drafts nothing this step)."""
        table = self.tables.setdefault(req_id, [])
        need = cdiv(num_tokens, self.block_size) - len(table)
        if need > len(self.free):
            return False
        for _ in range(need):
            table.append(self.free.pop())
        return True

    def release(self, req_id: str) -> None:
        table = self.tables.pop(req_id, None)
        if table:
            self.free.extend(reversed(table))

    @property
    def num_free(self) -> int:
        return len(self.free)


class DraftModelProposer(Proposer):
    def __init__(self, config: EngineConfig, device: torch.device, backend,
                 kernels: bool = False) -> None:
        spec, draft = config.speculative, config.draft_model
        assert spec is not None and draft is not None
        self.num_speculative_tokens = spec.num_speculative_tokens
        self.device = device
        self.block_size = config.cache.block_size
        self.max_model_len = config.model.max_model_len
        self.vocab_size = draft.arch.vocab_size
        self.config = config
        self.model = load_model(draft, device, backend)
        use_kernels(self.model, kernels)
        self.attn_spec = AttentionSpec(
            block_size=self.block_size, num_kv_heads=draft.arch.num_key_value_heads,
            dtype=torch_dtype(draft.dtype), device=device, rotary=model_rotary(self.model),
            num_sms=torch.cuda.get_device_properties(device).multi_processor_count
            if device.type == "cuda" else 1)
        self.attn_builder = backend.metadata_builder(self.attn_spec)
        # On CPU, the draft's own C++ step (cpu/step.py), built in warmup() when
        # the target runs one: a draft token then costs what a plain decode step of the
        # draft costs, not an eager forward (~180 aten calls per layer).
        self.cpp_step = None
        logger.info("draft model %s: %d layers, %.2f GiB of weights", draft.model,
                    draft.arch.num_hidden_layers,
                    sum(p.numel() * p.element_size() for p in self.model.parameters()) / GiB)
        self.blocks: DraftBlocks | None = None
        self.kv_caches: torch.Tensor | None = None  # [L, 2, NB, BS, KVH, D]
        self._fed: dict[str, np.ndarray] = {}  # tokens the draft cache holds K/V for
        self._generators: dict[str, torch.Generator] = {}
        self._probs: dict[str, tuple[list[int], torch.Tensor]] = {}  # drafts, q [d, V]

    # --- cache ------------------------------------------------------------------------
    def init_cache(self, num_blocks: int) -> None:
        """As many blocks as the target's, plus one per running request for the k - 1
        positions the draft writes past the target's allocation."""
        cfg, draft = self.config, self.config.draft_model
        total = num_blocks + cfg.scheduler.max_num_seqs * cdiv(self.num_speculative_tokens,
                                                               self.block_size)
        arch = draft.arch
        shape = (arch.num_hidden_layers, 2, total, self.block_size, arch.num_key_value_heads,
                 arch.head_dim)
        dtype = torch_dtype(draft.dtype)
        if self.device.type == "cpu":
            self.kv_caches = zeroed_host_tensor(shape, dtype)
        else:
            self.kv_caches = torch.zeros(shape, dtype=dtype, device=self.device)
        kvc.bind_kv_cache(self.model, self.kv_caches)
        self.blocks = DraftBlocks(total, self.block_size)
        logger.info("draft KV cache: %d blocks, %.2f GiB", total,
                    self.kv_caches.numel() * self.kv_caches.element_size() / GiB)

    def warmup(self, target_step) -> None:
        """On CPU, give the draft the C++ step the target runs (``target_step``; same
        switches: none when the target decodes eagerly), built from the draft's own
        parts and the engine config, and checked against its eager forward like the
        target's; its forwards of up to 64 new tokens per request then run in C++."""
        from kvflow.cpu.parts import StepParts
        from kvflow.cpu.step import CppDecodeStep, cpu_decode_step

        if self.device.type != "cpu" or self.kv_caches is None or \
                not isinstance(target_step, CppDecodeStep):
            return
        self.cpp_step = cpu_decode_step(StepParts(
            self.model, self.attn_builder, self.kv_caches, None, self.attn_spec,
            self.config), label="draft model: ")
        if self.cpp_step is not None:  # its builder marks the steps it takes
            self.attn_builder = self.cpp_step.attn_builder

    def release(self, req_id: str) -> None:
        """The request finished or was preempted: its draft blocks go back."""
        if self.blocks is not None:
            self.blocks.release(req_id)
        self._fed.pop(req_id, None)
        self._generators.pop(req_id, None)
        self._probs.pop(req_id, None)

    # --- proposing --------------------------------------------------------------------
    def propose(self, token_ids: list[np.ndarray], max_drafts: list[int],
                req_ids: list[str] | None = None,
                params: list[SamplingParams] | None = None) -> list[list[int]]:
        assert req_ids is not None and params is not None and self.blocks is not None
        out: list[list[int]] = [[] for _ in req_ids]
        todo = []  # (index, req id, tokens, first position to feed, k, params)
        for i, (rid, toks, m, sp) in enumerate(zip(req_ids, token_ids, max_drafts, params)):
            self._probs.pop(rid, None)
            length = len(toks)
            k = min(m, self.num_speculative_tokens, self.max_model_len - length)
            if k <= 0 or length == 0:
                continue
            fed = self._fed.get(rid)
            valid = 0
            if fed is not None and len(fed):
                n = min(len(fed), length - 1)  # the last known token is always fed again
                diff = np.flatnonzero(fed[:n] != toks[:n])
                valid = int(diff[0]) if len(diff) else n
            if not self.blocks.ensure(rid, length + k - 1):
                continue
            todo.append((i, rid, toks, valid, k, sp))
        if not todo:
            return out
        # Catch-up (one to many tokens per request) first: decodes first, as every
        # attention backend expects.
        todo.sort(key=lambda t: len(t[2]) - t[3] > 1)
        chunks = [t[2][t[3]:] for t in todo]
        starts = [t[3] for t in todo]
        logits = self._forward([t[1] for t in todo], starts, chunks)
        drafts: list[list[int]] = [[] for _ in todo]
        probs: list[list[torch.Tensor]] = [[] for _ in todo]
        live = list(range(len(todo)))
        step = 0
        while True:
            tok, q = self._choose(logits, [todo[j] for j in live])
            tok_list = tok.tolist()
            for r, j in enumerate(live):
                drafts[j].append(tok_list[r])
                if q is not None and not todo[j][5].greedy:
                    probs[j].append(q[r])
            step += 1
            live = [j for j in live if todo[j][4] > step]
            if not live:
                break
            logits = self._forward([todo[j][1] for j in live],
                                   [len(todo[j][2]) + step - 1 for j in live],
                                   [np.array([drafts[j][-1]]) for j in live])
        for j, (i, rid, toks, _, k, sp) in enumerate(todo):
            out[i] = drafts[j]
            # Fed: the known tokens and every draft but the last.
            self._fed[rid] = np.concatenate([toks, np.asarray(drafts[j][:-1], dtype=toks.dtype)])
            if probs[j]:
                self._probs[rid] = (drafts[j], torch.stack(probs[j]))
        return out

    def draft_probs(self, req_id: str, drafts: list[int]) -> torch.Tensor | None:
        """q [d, V] of the drafts ``drafts`` (a prefix of what was proposed), or None for a
        greedy request's (deterministic) drafts."""
        entry = self._probs.pop(req_id, None)
        if entry is None:
            return None
        proposed, q = entry
        if proposed[: len(drafts)] != list(drafts):
            raise RuntimeError(f"request {req_id}: the scheduled drafts are not the proposed "
                               "ones")
        return q[: len(drafts)]

    def _choose(self, logits: torch.Tensor, reqs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each row's draft token: argmax for greedy requests, a draw from q for random
        ones (q returned [R, V], None when every request is greedy)."""
        greedy = [t[5].greedy for t in reqs]
        if all(greedy):
            return greedy_argmax(logits), None
        params = [t[5] for t in reqs]
        dev, vocab = logits.device, logits.shape[-1]
        meta = SamplingMetadata(
            temperature=to_device([1.0 if g else p.temperature for p, g in zip(params, greedy)],
                                  dev, torch.float32),
            all_greedy=False, all_random=not any(greedy),
            top_k=to_device([p.top_k if 0 < p.top_k < vocab else vocab for p in params], dev,
                            torch.int64) if any(0 < p.top_k < vocab for p in params) else None,
            top_p=to_device([p.top_p for p in params], dev, torch.float32)
            if any(p.top_p < 1.0 for p in params) else None,
            min_p=to_device([p.min_p for p in params], dev, torch.float32)
            if any(p.min_p > 0.0 for p in params) else None,
            generators={})
        q = apply_top_k_top_p_min_p(logits / meta.temperature[:, None], meta).softmax(dim=-1)
        generators = {}
        for r, t in enumerate(reqs):
            seed = t[5].seed
            if seed is not None and not greedy[r]:
                gen = self._generators.get(t[1])
                if gen is None:  # the draft's own stream: the target's stays untouched
                    gen = torch.Generator(dev).manual_seed((seed + 0x5EED) % (1 << 64))
                    self._generators[t[1]] = gen
                generators[r] = gen
        sampled = random_sample(q, generators)  # the sampler's exact draw (CPU: one uniform)
        tok = torch.where(torch.tensor(greedy, device=dev), greedy_argmax(logits), sampled)
        return tok, q

    @torch.inference_mode()
    def _forward(self, req_ids: list[str], starts: list[int], chunks: list[np.ndarray]
                 ) -> torch.Tensor:
        """Run the draft over ``chunks[i]`` at positions starts[i].. of request i (those
        with one token first) -> logits [R, V] at each chunk's last token."""
        bs, dev = self.block_size, self.device
        n = np.fromiter((len(c) for c in chunks), dtype=np.int64, count=len(chunks))  # [R]
        qsl = np.zeros(len(chunks) + 1, dtype=np.int64)
        np.cumsum(n, out=qsl[1:])
        start = np.asarray(starts, dtype=np.int64)
        tok_req = np.repeat(np.arange(len(chunks)), n)  # [T]
        positions = start[tok_req] + np.arange(int(qsl[-1])) - qsl[:-1][tok_req]  # [T]
        seq_lens = start + n  # [R]
        width = cdiv(int(seq_lens.max()), bs)
        tables = np.zeros((len(chunks), width), dtype=np.int32)  # [R, W]
        for i, rid in enumerate(req_ids):
            t = self.blocks.tables[rid][:width]
            tables[i, : len(t)] = t
        slots = tables[tok_req, positions // bs].astype(np.int64) * bs + positions % bs
        positions_dev = to_device(positions, dev, torch.int64)
        meta = AttentionMetadata(
            num_actual_tokens=int(qsl[-1]), num_reqs=len(chunks),
            num_decodes=int((n == 1).sum()), max_query_len=int(n.max()),
            max_seq_len=int(seq_lens.max()), slot_mapping=to_device(slots, dev, torch.int64),
            query_start_loc=to_device(qsl, dev, torch.int32),
            seq_lens=to_device(seq_lens, dev, torch.int32),
            block_tables=torch.from_numpy(tables).to(dev),
            query_start_loc_cpu=qsl.tolist(), seq_lens_cpu=seq_lens.tolist())
        self.attn_builder.build(meta, positions_dev)
        input_ids = to_device(np.concatenate(chunks).astype(np.int64), dev, torch.int64)
        # prompt_rows None: the draft's C++ step runs every row of its GGUF linears on int8
        # activations (the draft's rounding only moves the acceptance rate)
        inputs = SimpleNamespace(input_ids=input_ids, positions=positions_dev, meta=meta,
                                 prompt_rows=None)
        last = to_device(qsl[1:] - 1, dev, torch.int64)

        # (All intra-op threads: an adaptive thread count of the draft's own, as the
        # target's steps have (cpu/threads.py), measured 1.4x slower drafts on two
        # cores, switching the thread count twice per draft token.)
        if self.cpp_step is not None and self.cpp_step.can_run(inputs):
            hidden = self.cpp_step.run(inputs)  # [T, hidden]
        else:
            hidden = self.model(input_ids, positions_dev, meta)  # [T, hidden]
        return self.model.compute_logits(hidden[last])  # [R, V]
