"""--deterministic on the GPU (docs/determinism.md): a request's tokens and logprobs are
the same bits whatever shares its steps.

Kernel checks on real shapes (the tensor-core instructions the interpreter cannot run):
the batch-invariant matmul's rows across M (both tile shapes), and the prefill attention
launch's rows however a prompt is cut into chunks. Then a tiny random Llama in bf16 with
CUDA graphs: one greedy request with logprobs alone, against the same request in a batch,
with long prompts arriving mid-decode under a 64-token step budget (its prompt chunked
differently), after a prefix-cache hit (down to a one-token chunk), and on an eager engine
that takes its prompt in one chunk.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu

BLOCK = 16
P_LEN = 37 * BLOCK + 1  # a cache hit leaves one prompt token; decode spans 2 splits of 512


def test_matmul_rows_across_m_on_gpu():
    from kvflow.kernels.batch_invariant import matmul, matmul_config

    torch.manual_seed(0)
    x = torch.randn(300, 4096, device="cuda", dtype=torch.bfloat16)
    for n in (1024, 1000):  # an N tail too
        w = torch.randn(n, 4096, device="cuda", dtype=torch.bfloat16) * 0.02
        full = matmul(x, w)
        torch.testing.assert_close(full.float(), F.linear(x.float(), w.float()),
                                   atol=2e-2, rtol=2e-2)
        for m in (1, 3, 8, 17, 64, 65, 130, 256):
            assert matmul_config(m, x.dtype).block_k == matmul_config(300, x.dtype).block_k
            for start in {0, 7, 300 - m}:
                assert torch.equal(matmul(x[start: start + m], w), full[start: start + m]), \
                    (n, m, start)


def test_prefill_rows_do_not_depend_on_chunking():
    from kvflow.kernels.paged_attention import paged_attention

    torch.manual_seed(1)
    t, h, kvh, d = 700, 32, 8, 128
    nb = t // BLOCK + 1
    cache = torch.randn(2, nb, BLOCK, kvh, d, device="cuda", dtype=torch.bfloat16)
    table = torch.randperm(nb, device="cuda").to(torch.int32)[None, :]
    q = torch.randn(t, h, d, device="cuda", dtype=torch.bfloat16)

    def chunk(a: int, b: int) -> torch.Tensor:  # prompt rows [a, b), keys [0, b)
        qsl = torch.tensor([0, b - a], dtype=torch.int32, device="cuda")
        sl = torch.tensor([b], dtype=torch.int32, device="cuda")
        return paged_attention(q[a:b].contiguous(), cache, table, qsl, sl, d ** -0.5,
                               num_decodes=0, max_query_len=b - a, max_seq_len=b,
                               split_tokens=512)

    whole = chunk(0, t)
    for cuts in ([0, 100, 101, 700], [0, 64, 333, 699, 700], [0, 1, 2, 350, 700]):
        parts = torch.cat([chunk(a, b) for a, b in zip(cuts, cuts[1:])])
        assert torch.equal(parts, whole), cuts


def _engine(**kw):
    from kvflow import LLM

    args = dict(load_format="dummy", dtype="bfloat16", device="cuda", deterministic=True,
                max_model_len=2048, block_size=BLOCK, num_gpu_blocks_override=1024,
                max_num_seqs=16, max_num_batched_tokens=64)
    args.update(kw)
    return LLM("tiny-llama", **args)


def _prompts(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in lengths]


class Runner:
    """Steps an engine by hand: requests join at given steps; returns each request's
    (token ids, logprobs as [(token, logprob, rank)] per position)."""

    def __init__(self, llm) -> None:
        self.llm = llm
        self.count = 0

    def run(self, schedule: dict[int, list[list[int]]], max_tokens=24):
        from kvflow import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                                logprobs=5)
        eng, step, names, done = self.llm.engine, 0, [], {}
        while True:
            for prompt in schedule.get(step, []):
                rid = f"r{self.count}"
                self.count += 1
                names.append(rid)
                eng.add_request(rid, {"prompt_token_ids": prompt}, params)
            if not eng.has_unfinished_requests() and step > max(schedule):
                break
            for out in eng.step():
                if out.finished:
                    c = out.outputs[0]
                    done[out.request_id] = (c.token_ids, [
                        sorted((t, lp.logprob, lp.rank) for t, lp in pos.items())
                        for pos in c.logprobs])
            step += 1
        return [done[r] for r in names]


def test_one_request_alone_equals_it_in_any_batch():
    p = _prompts([P_LEN], seed=0)[0]
    others = _prompts([700, 5, 130, 1, 64, 300, 17, 900], seed=1)
    llm = _engine()
    run = Runner(llm).run
    alone = run({0: [p]})[0]
    assert len(alone[0]) == 24 and len(alone[1]) == 24
    cases = {
        # all at once: P's prompt chunked beside other prompts under the 64-token budget
        # (a prefix-cache hit for P: its prompt blocks are cached from the first run)
        "together": {0: [others[0], p, *others[1:4]]},
        # others arriving mid-decode with long prompts, some finishing in between
        "mid-decode": {0: [p, others[3]], 3: [others[0], others[6]], 9: [others[7]],
                       10: others[1:3]},
        # P's prompt with a cache miss (a new prefix) arriving into busy decodes
        "late": {0: others[4:7], 5: [others[7][:40] + p[40:]]},
    }
    for name, schedule in cases.items():
        outs = run(schedule)
        flat = [q for step in sorted(schedule) for q in schedule[step]]
        mine = outs[flat.index(p if name != "late" else schedule[5][0])]
        if name == "late":  # another prompt: compare with it alone
            assert mine == run({0: [schedule[5][0]]})[0], name
        else:
            assert mine == alone, name
    # An eager engine (no CUDA graphs, its own weights from the same seed) taking P's
    # prompt in one chunk gives the same bits.
    del llm
    eager = _engine(enforce_eager=True, max_num_batched_tokens=2048)
    assert Runner(eager).run({0: [p]})[0] == alone
