"""Turns a SchedulerOutput into tensors, runs the model, samples: one step of the worker."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from kvflow.config import GiB, EngineConfig
from kvflow.core.sched_output import LogprobsEntry, ModelRunnerOutput, SchedulerOutput
from kvflow.layers.attention import AttentionMetadata, get_attention_backend
from kvflow.layers.custom_op import use_kernels
from kvflow.layers.sampler import Sampler, SamplingMetadata, gather_logprobs
from kvflow.logger import init_logger
from kvflow.models.loader import load_model
from kvflow.worker import kv_cache
from kvflow.worker.block_table import DeviceBlockTable
from kvflow.worker.input_batch import InputBatch, RequestExtras

logger = init_logger(__name__)


@dataclass
class StepInputs:
    """The tensors and bookkeeping of one step (requests in decode-first order)."""

    req_ids: list[str]
    rows: np.ndarray  # [R] batch rows
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    sample_reqs: np.ndarray  # [S] indices into req_ids of requests that sample this step
    logits_indices: torch.Tensor  # [S] flat token index whose hidden state gives logits
    # Prompt logprobs: flat token indices, target token ids, and per-request spans.
    plp_indices: list[int]
    plp_targets: list[int]
    plp_spans: list[tuple[str, int, int, int]]  # (req_id, start, end, num_logprobs)


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = torch.device(config.device.device)
        self.block_size = config.cache.block_size
        self.use_kernels = self.device.type == "cuda" and _kernels_available()
        backend = get_attention_backend("triton" if self.use_kernels else "torch")
        start = time.perf_counter()
        self.model = load_model(config.model, self.device, backend)
        use_kernels(self.model, self.use_kernels)
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        logger.info("loaded %s (%s, %s) on %s in %.1f s: %.2f GiB of weights, attention: %s",
                    config.model.name, config.model.load_format, config.model.dtype,
                    self.device, time.perf_counter() - start, self.weight_bytes / GiB,
                    backend.name)
        self.sampler = Sampler()
        self.vocab_size = config.model.arch.vocab_size
        self.eos_token_ids = list(config.model.arch.eos_token_ids)
        max_blocks = -(-config.model.max_model_len // self.block_size)
        self.batch = InputBatch(config.scheduler.max_num_seqs, config.model.max_model_len,
                                max_blocks)
        self.extras: dict[str, RequestExtras] = {}
        self.kv_caches: list[torch.Tensor] = []
        self.graphs = None  # CudaGraphRunner once captured
        self.device_block_table = None
        self.num_sms = 1
        if self.device.type == "cuda":
            self.batch.record_ops = True
            self.device_block_table = DeviceBlockTable(config.scheduler.max_num_seqs,
                                                       max_blocks, self.device)
            self.num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count

    # --- KV cache ---------------------------------------------------------------
    def determine_num_blocks(self) -> int:
        cfg = self.config
        if cfg.cache.num_blocks_override is not None:
            return cfg.cache.num_blocks_override
        if cfg.cache.kv_cache_memory is not None:
            return kv_cache.num_blocks_for_budget(cfg, cfg.cache.kv_cache_memory)
        if self.device.type == "cpu":
            return kv_cache.num_blocks_for_budget(cfg, kv_cache.CPU_DEFAULT_KV_BYTES)
        from kvflow.worker.profiler import profile_kv_budget

        return kv_cache.num_blocks_for_budget(cfg, profile_kv_budget(self))

    def init_kv_cache(self, num_blocks: int) -> None:
        kv_cache.check_capacity(self.config, num_blocks)
        self.kv_caches = kv_cache.allocate_kv_cache(self.config, num_blocks, self.device)
        kv_cache.bind_kv_cache(self.model, self.kv_caches)
        kv_cache.log_kv_cache(self.config, num_blocks)

    def warmup(self) -> None:
        """Compile kernels and capture CUDA graphs before serving (GPU only)."""
        if self.device.type != "cuda":
            return
        from kvflow.worker.cuda_graphs import warmup_and_capture

        warmup_and_capture(self)

    # --- one step ---------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        inputs = self.prepare_inputs(so)
        if self.graphs is not None and self.graphs.can_run(inputs):
            hidden = self.graphs.run(inputs)
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta)
        return self._sample(inputs, hidden)

    def _update_states(self, so: SchedulerOutput) -> None:
        for rid in so.finished_req_ids:
            self.batch.remove(rid)
            self.extras.pop(rid, None)
        for rid in so.preempted_req_ids:
            self.batch.remove(rid)  # extras (seeded generator) survive the preemption
        for new in so.new_reqs:
            self.batch.add(new)
            if new.req_id not in self.extras:
                extras = RequestExtras()
                if new.sampling_params.seed is not None:
                    extras.generator = torch.Generator(self.device).manual_seed(
                        new.sampling_params.seed)
                self.extras[new.req_id] = extras
        for cached in so.cached_reqs:
            self.batch.append_blocks(cached.req_id, cached.new_block_ids)
            self.batch.num_computed[self.batch.index[cached.req_id]] = cached.num_computed_tokens

    def prepare_inputs(self, so: SchedulerOutput) -> StepInputs:
        b, bs = self.batch, self.block_size
        ids = list(so.num_scheduled_tokens)
        n = np.fromiter((so.num_scheduled_tokens[r] for r in ids), dtype=np.int64,
                        count=len(ids))
        order = np.argsort(n > 1, kind="stable")  # decodes first
        n = n[order]
        req_ids = [ids[i] for i in order]
        rows = np.fromiter((b.index[r] for r in req_ids), dtype=np.int64, count=len(ids))
        num_reqs = len(req_ids)
        nc = b.num_computed[rows]
        qsl = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(n, out=qsl[1:])
        total = int(qsl[-1])
        tok_req = np.repeat(np.arange(num_reqs), n)
        positions = nc[tok_req] + (np.arange(total) - qsl[:-1][tok_req])
        tok_rows = rows[tok_req]
        input_ids = b.token_ids[tok_rows, positions]
        slots = b.block_table[tok_rows, positions // bs].astype(np.int64) * bs + positions % bs
        seq_lens = nc + n
        max_seq = int(seq_lens.max())
        sample_reqs = np.nonzero(seq_lens == b.num_tokens[rows])[0]
        logits_indices = qsl[1:][sample_reqs] - 1
        plp = self._plan_prompt_logprobs(req_ids, rows, nc, n, qsl)

        dev = self.device
        width = -(-max_seq // bs)
        if self.device_block_table is not None:
            self.device_block_table.apply(b.take_block_table_ops())
            block_tables = self.device_block_table.gather(_to(rows, dev, torch.int64), width)
        else:
            block_tables = torch.from_numpy(b.block_table[rows, :width])
        num_decodes = int((n == 1).sum())
        splits = 1
        if self.use_kernels and num_decodes:
            splits = self._num_kv_splits(num_decodes, max_seq)
        meta = AttentionMetadata(
            num_actual_tokens=total, num_reqs=num_reqs, num_decodes=num_decodes,
            max_query_len=int(n.max()), max_seq_len=max_seq,
            slot_mapping=_to(slots, dev, torch.int64),
            query_start_loc=_to(qsl, dev, torch.int32),
            seq_lens=_to(seq_lens, dev, torch.int32),
            block_tables=block_tables,
            query_start_loc_cpu=qsl.tolist(), seq_lens_cpu=seq_lens.tolist(),
            num_kv_splits=splits)
        return StepInputs(
            req_ids=req_ids, rows=rows, input_ids=_to(input_ids, dev, torch.int64),
            positions=_to(positions, dev, torch.int64), meta=meta, sample_reqs=sample_reqs,
            logits_indices=_to(logits_indices, dev, torch.int64), plp_indices=plp[0],
            plp_targets=plp[1], plp_spans=plp[2])

    def _plan_prompt_logprobs(self, req_ids, rows, nc, n, qsl):
        """Which positions of this step's prompt chunks still owe prompt logprobs.

        The hidden state at position p scores prompt token p + 1.
        """
        indices: list[int] = []
        targets: list[int] = []
        spans: list[tuple[str, int, int, int]] = []
        for i, rid in enumerate(req_ids):
            k = self.batch.params[rows[i]].prompt_logprobs
            if k is None:
                continue
            extras = self.extras[rid]
            num_prompt = int(self.batch.num_prompt_tokens[rows[i]])
            first = max(int(nc[i]), extras.prompt_logprobs_done)
            last = min(int(nc[i] + n[i]), num_prompt - 1)  # exclusive bound on p
            if first >= last:
                continue
            start = len(indices)
            indices.extend(range(int(qsl[i]) + first - int(nc[i]),
                                 int(qsl[i]) + last - int(nc[i])))
            targets.extend(self.batch.token_ids[rows[i], first + 1: last + 1].tolist())
            spans.append((rid, start, len(indices), k))
            extras.prompt_logprobs_done = last
        return indices, targets, spans

    def _num_kv_splits(self, num_decodes: int, max_seq_len: int) -> int:
        from kvflow.kernels.paged_attention import choose_num_kv_splits

        return choose_num_kv_splits(num_decodes, max_seq_len,
                                    self.config.model.arch.num_key_value_heads, self.num_sms)

    def _sample(self, inputs: StepInputs, hidden: torch.Tensor) -> ModelRunnerOutput:
        b = self.batch
        num_reqs = len(inputs.req_ids)
        sampled_lists: list[list[int]] = [[] for _ in range(num_reqs)]
        logprob_lists: list[list[LogprobsEntry] | None] = [None] * num_reqs
        if len(inputs.sample_reqs):
            logits = self.model.compute_logits(hidden[inputs.logits_indices])
            sample_rows = inputs.rows[inputs.sample_reqs]
            meta = self._sampling_metadata(sample_rows, [inputs.req_ids[i]
                                                         for i in inputs.sample_reqs])
            out = self.sampler(logits, meta)
            sampled = out.sampled.tolist()  # the step's one host sync
            lp = None
            if out.logprobs is not None:
                lp = (out.logprob_token_ids.tolist(), out.logprobs.tolist(),
                      out.sampled_ranks.tolist())
            for j, i in enumerate(inputs.sample_reqs):
                row = int(sample_rows[j])
                sampled_lists[i] = [sampled[j]]
                b.append_token(row, sampled[j])
                k = b.params[row].logprobs
                if lp is not None and k is not None:
                    logprob_lists[i] = [(lp[0][j][: k + 1], lp[1][j][: k + 1], lp[2][j])]
        return ModelRunnerOutput(
            req_ids=inputs.req_ids, sampled_token_ids=sampled_lists, logprobs=logprob_lists,
            prompt_logprobs=self._prompt_logprobs(inputs, hidden))

    def _prompt_logprobs(self, inputs: StepInputs,
                         hidden: torch.Tensor) -> dict[str, list[LogprobsEntry]]:
        if not inputs.plp_indices:
            return {}
        dev = self.device
        logits = self.model.compute_logits(hidden[torch.tensor(inputs.plp_indices, device=dev)])
        k_max = max(span[3] for span in inputs.plp_spans)
        ids, lps, ranks = gather_logprobs(logits.log_softmax(dim=-1),
                                          torch.tensor(inputs.plp_targets, device=dev), k_max)
        ids, lps, ranks = ids.tolist(), lps.tolist(), ranks.tolist()
        return {rid: [(ids[j][: k + 1], lps[j][: k + 1], ranks[j]) for j in range(start, end)]
                for rid, start, end, k in inputs.plp_spans}

    def _sampling_metadata(self, rows: np.ndarray, req_ids: list[str]) -> SamplingMetadata:
        b, dev, vocab = self.batch, self.device, self.vocab_size
        params = [b.params[r] for r in rows]
        greedy = [p.greedy for p in params]
        meta = SamplingMetadata(
            temperature=torch.tensor([0.0 if g else p.temperature
                                      for p, g in zip(params, greedy)], device=dev),
            all_greedy=all(greedy), all_random=not any(greedy), top_k=None, top_p=None,
            min_p=None,
            generators={j: self.extras[rid].generator for j, rid in enumerate(req_ids)
                        if self.extras[rid].generator is not None})
        if any(p.top_k > 0 for p in params):
            meta.top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params],
                                      device=dev)
        if any(p.top_p < 1.0 for p in params):
            meta.top_p = torch.tensor([p.top_p for p in params], device=dev)
        if any(p.min_p > 0.0 for p in params):
            meta.min_p = torch.tensor([p.min_p for p in params], device=dev)
        use_freq = any(p.presence_penalty or p.frequency_penalty for p in params)
        use_rep = any(p.repetition_penalty != 1.0 for p in params)
        if use_freq or use_rep:
            meta.output_counts = self._token_counts(
                [b.output_token_ids(r) for r in rows], len(rows))
        if use_freq:
            meta.presence_penalty = torch.tensor([p.presence_penalty for p in params],
                                                 device=dev)
            meta.frequency_penalty = torch.tensor([p.frequency_penalty for p in params],
                                                  device=dev)
        if use_rep:
            meta.repetition_penalty = torch.tensor([p.repetition_penalty for p in params],
                                                   device=dev)
            meta.prompt_mask = self._token_counts(
                [b.prompt_token_ids(r) for r in rows], len(rows)) > 0
        banned_rows, banned_ids = [], []
        for j, (p, r) in enumerate(zip(params, rows)):
            if b.num_tokens[r] - b.num_prompt_tokens[r] < p.min_tokens:
                stop = set(p.all_stop_token_ids)
                if not p.ignore_eos:
                    stop.update(self.eos_token_ids)
                banned_rows += [j] * len(stop)
                banned_ids += sorted(stop)
        if banned_rows:
            meta.banned = (torch.tensor(banned_rows, device=dev),
                           torch.tensor(banned_ids, device=dev))
        asked = [p.logprobs for p in params if p.logprobs is not None]
        meta.max_num_logprobs = max(asked) if asked else None
        return meta

    def _token_counts(self, seqs: list[np.ndarray], num_rows: int) -> torch.Tensor:
        """[rows, vocab] int32 counts of each token id in each sequence."""
        counts = torch.zeros(num_rows, self.vocab_size, dtype=torch.int32, device=self.device)
        lens = [len(s) for s in seqs]
        if sum(lens):
            row_idx = np.repeat(np.arange(num_rows), lens)
            flat = np.concatenate(seqs).astype(np.int64)
            counts.index_put_((_to(row_idx, self.device, torch.int64),
                               _to(flat, self.device, torch.int64)),
                              torch.ones(len(flat), dtype=torch.int32, device=self.device),
                              accumulate=True)
        return counts


def _to(array: np.ndarray, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A host array as a tensor on ``device`` (a small pageable copy on the GPU: it
    waits for no kernel)."""
    return torch.from_numpy(np.ascontiguousarray(array)).to(device=device, dtype=dtype)


def _kernels_available() -> bool:
    from kvflow import envs

    if envs.disable_triton():
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
