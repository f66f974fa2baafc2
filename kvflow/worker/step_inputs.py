"""Building one step's input tensors from the persistent batch (vectorized numpy)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvflow.core.sched_output import SchedulerOutput
from kvflow.layers.attention import AttentionMetadata
from kvflow.worker.transfer import to_device

# Token id marking a sampled token whose value is still on the GPU (overlapped steps).
PLACEHOLDER = -1


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


def build_step_inputs(runner, so: SchedulerOutput) -> StepInputs:
    b, bs, dev = runner.batch, runner.block_size, runner.device
    ids = list(so.num_scheduled_tokens)
    n = np.fromiter((so.num_scheduled_tokens[r] for r in ids), dtype=np.int64, count=len(ids))
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
    plp = _plan_prompt_logprobs(runner, req_ids, rows, nc, n, qsl)

    width = -(-max_seq // bs)
    if runner.device_block_table is not None:
        runner.device_block_table.apply(b.take_block_table_ops())
        block_tables = runner.device_block_table.gather(to_device(rows, dev, torch.int64),
                                                        width)
    else:
        block_tables = torch.from_numpy(b.block_table[rows, :width])
    num_decodes = int((n == 1).sum())
    splits = runner.num_kv_splits(num_decodes, max_seq) if num_decodes else 1
    meta = AttentionMetadata(
        num_actual_tokens=total, num_reqs=num_reqs, num_decodes=num_decodes,
        max_query_len=int(n.max()), max_seq_len=max_seq,
        slot_mapping=to_device(slots, dev, torch.int64),
        query_start_loc=to_device(qsl, dev, torch.int32),
        seq_lens=to_device(seq_lens, dev, torch.int32), block_tables=block_tables,
        query_start_loc_cpu=qsl.tolist(), seq_lens_cpu=seq_lens.tolist(),
        num_kv_splits=splits)
    input_ids_dev = to_device(input_ids, dev, torch.int64)
    unknown = np.nonzero(input_ids == PLACEHOLDER)[0]
    if len(unknown):  # tokens sampled by the step still in flight: take them on device
        src = [runner.pending_source(req_ids[tok_req[i]], int(positions[i])) for i in unknown]
        input_ids_dev[to_device(unknown, dev, torch.int64)] = \
            runner.last_sampled[to_device(src, dev, torch.int64)]
    return StepInputs(
        req_ids=req_ids, rows=rows, input_ids=input_ids_dev,
        positions=to_device(positions, dev, torch.int64), meta=meta, sample_reqs=sample_reqs,
        logits_indices=to_device(logits_indices, dev, torch.int64), plp_indices=plp[0],
        plp_targets=plp[1], plp_spans=plp[2])


def _plan_prompt_logprobs(runner, req_ids, rows, nc, n, qsl):
    """Which positions of this step's prompt chunks still owe prompt logprobs.

    The hidden state at position p scores prompt token p + 1.
    """
    b = runner.batch
    indices: list[int] = []
    targets: list[int] = []
    spans: list[tuple[str, int, int, int]] = []
    for i, rid in enumerate(req_ids):
        k = b.params[rows[i]].prompt_logprobs
        if k is None:
            continue
        extras = runner.extras[rid]
        num_prompt = int(b.num_prompt_tokens[rows[i]])
        first = max(int(nc[i]), extras.prompt_logprobs_done)
        last = min(int(nc[i] + n[i]), num_prompt - 1)  # exclusive bound on p
        if first >= last:
            continue
        start = len(indices)
        indices.extend(range(int(qsl[i]) + first - int(nc[i]), int(qsl[i]) + last - int(nc[i])))
        targets.extend(b.token_ids[rows[i], first + 1: last + 1].tolist())
        spans.append((rid, start, len(indices), k))
        extras.prompt_logprobs_done = last
    return indices, targets, spans
