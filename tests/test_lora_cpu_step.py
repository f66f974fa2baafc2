"""Multi-LoRA in the C++ CPU step (kvflow/cpu/step.cpp's add_lora): steps with adapter
rows stay in C++, which adds each row's delta from the live slots. Greedy tokens equal
transformers with each adapter merged, for batches that mix adapters of different ranks
and targets (merged q/k/v and gate/up slices alone or together) with base requests,
through chunked prefill and slot swaps, and no step runs eager; the delta itself equals
the torch reference in float32 and bfloat16."""

from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("peft")

from lora_utils import ALL_TARGETS, hf_greedy, make_adapters, save_base  # noqa: E402

from kvflow import LLM, SamplingParams  # noqa: E402
from kvflow.cpu import step as cpu_step  # noqa: E402
from kvflow.lora.layers import LoRAWeights  # noqa: E402

pytestmark = pytest.mark.skipif(cpu_step.find_compiler() is None,
                                reason="no C++ compiler to build the step with")

N_TOKENS = 8
# Four adapters: ranks 8, 4, 2 and 5 (not a multiple of the vector width), all of a
# layer's slices, some of them (q and v of qkv, up of gate_up), one slice each.
ADAPTERS = {"a": dict(r=8, alpha=16, targets=ALL_TARGETS, seed=1),
            "b": dict(r=4, alpha=8, targets=["q_proj", "v_proj", "down_proj"], seed=2,
                      rslora=True),
            "c": dict(r=2, alpha=4, targets=["k_proj", "o_proj", "up_proj"], seed=3),
            "d": dict(r=5, alpha=10, targets=["gate_proj", "v_proj"], seed=4)}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("lora-cpp")
    base = save_base("tiny-llama", d / "base")
    loras, refs = make_adapters(base, d, ADAPTERS)
    return d, loras, refs


def _engine(d, caplog, **kw) -> tuple[LLM, dict[str, int]]:
    """An engine on the C++ step that counts its steps: those it ran ("cpp"), those with
    adapter rows among them ("lora") and of several adapters ("mixed"), and any step
    run eagerly ("eager")."""
    args = dict(enable_lora=True, max_lora_rank=8, max_model_len=128, block_size=4,
                max_num_batched_tokens=16, num_gpu_blocks_override=96, device="cpu",
                enable_prefix_caching=False)
    with caplog.at_level(logging.INFO, logger="kvflow"):
        llm = LLM(str(d / "base"), **(args | kw))
    step = llm.engine.core.executor.runner.graphs
    assert isinstance(step, cpu_step.CppDecodeStep), caplog.text
    assert step.num_lora == 2 * 4  # tiny-llama: 2 layers x (qkv, o, gate_up, down)
    assert "LoRA deltas of 8 linears" in caplog.text
    calls = {"cpp": 0, "lora": 0, "mixed": 0, "eager": 0}
    run, run_eager = step.run, step.run_eager
    lora_map = llm.engine.core.executor.runner.lora.slots.step

    def counted(inputs):
        calls["cpp"] += 1
        slots = lora_map.token_slot
        if slots is not None:
            used = set(slots.tolist()) - {-1}
            calls["lora"] += bool(used)
            calls["mixed"] += len(used) > 1 or (bool(used) and -1 in slots.tolist())
        return run(inputs)

    def eager(inputs):
        calls["eager"] += 1
        return run_eager(inputs)
    step.run, step.run_eager = counted, eager
    return llm, calls


def _prompts(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in lengths]


def _generate(llm, loras, names, prompts):
    params = SamplingParams(temperature=0, max_tokens=N_TOKENS, ignore_eos=True)
    reqs = [None if n is None else loras[n] for n in names]
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=reqs)
    return [o.outputs[0].token_ids for o in outs]


def test_adapters_and_base_in_one_cpp_step(setup, caplog):
    """Four adapters and the base model in one batch, prompts longer than the 16-token
    budget prefilled in chunks beside decodes: every step in C++, each request's tokens
    those of transformers with its adapter merged. Without the step's deltas (its map
    withheld) they part from them, so the comparison can fail."""
    d, loras, refs = setup
    llm, calls = _engine(d, caplog, max_loras=4)
    names = [None, "a", "b", "c", "d", "a", None]
    prompts = _prompts([5, 23, 37, 11, 19, 9, 14])
    got = _generate(llm, loras, names, prompts)
    for p, n, g in zip(prompts, names, got):
        assert g == hf_greedy(refs[n], p, N_TOKENS), n
    assert calls["eager"] == 0 and calls["mixed"] > 0, calls
    assert calls["cpp"] >= N_TOKENS + sum(map(len, prompts)) // 16
    step = llm.engine.core.executor.runner.graphs
    step.lora_map = None  # the C++ step adds no deltas: adapter rows get base tokens
    wrong = _generate(llm, loras, names, prompts)
    assert wrong[0] == got[0] and wrong[1:6] != got[1:6]
    llm.shutdown()


def test_slot_swaps_in_cpp(setup, caplog):
    """Four adapters through two slots: adapters move into slots mid-run, over the
    slots the C++ step reads in place, and every request's tokens stay right."""
    d, loras, refs = setup
    llm, calls = _engine(d, caplog, max_loras=2, max_cpu_loras=2)
    names = ["a", "b", None, "c", "d", "b", "a", "d"]
    prompts = _prompts([19, 17, 15, 21, 18, 16, 20, 7], seed=2)
    got = _generate(llm, loras, names, prompts)
    for p, n, g in zip(prompts, names, got):
        assert g == hf_greedy(refs[n], p, N_TOKENS), n
    runner = llm.engine.core.executor.runner
    assert runner.lora.slots.num_swaps >= 4  # c and d moved in over a and b
    assert calls["eager"] == 0 and calls["lora"] > 0, calls
    llm.shutdown()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rank,sizes,k", [(8, [48, 16, 16], 64), (12, [13, 7], 40)])
def test_delta_matches_the_reference(dtype, rank, sizes, k):
    """add_lora against the delta in float64: rows of three slots (one of full rank, two
    lower), some contiguous, some interleaved with base rows, which stay as they were;
    slices whose widths are not multiples of 8, and a rank that is not either."""
    module, _ = cpu_step.load_extension()
    g = torch.Generator().manual_seed(0)
    w = LoRAWeights(k, sizes, 3, rank, dtype, torch.device("cpu"))
    ranks = [rank, rank // 2 - 1, 3]
    for s, r in enumerate(ranks):  # zero past each slot's rank, as slots.py writes them
        w.a[s].view(len(sizes), rank, k)[:, :r] = torch.randn(len(sizes), r, k,
                                                               generator=g).to(dtype)
        w.b_all[s, :, :r] = torch.randn(sum(sizes), r, generator=g).to(dtype)
    t = 23
    x = torch.randn(t, k, generator=g).to(dtype)
    y = torch.randn(t, sum(sizes), generator=g).to(dtype)
    slot = torch.tensor([i % 4 - 1 for i in range(t)], dtype=torch.int32)
    slot[6:14] = 1
    want = y.double()
    for i in range(t):
        s = int(slot[i])
        if s < 0:
            continue
        a = w.a[s].view(len(sizes), rank, k).double()
        for j, (off, n) in enumerate(zip(w.offsets, sizes)):
            want[i, off:off + n] += (x[i].double() @ a[j].T) @ w.b[j][s].double().T
    got = module.add_lora(x, y.clone(), w.a, w.b_all, sizes, slot,
                          torch.tensor(ranks, dtype=torch.int32))
    tol = 1e-6 if dtype == torch.float32 else 8e-3  # one rounding of the output
    assert float((got.double() - want).abs().max() / want.abs().max()) < tol
    assert torch.equal(got[slot < 0], y[slot < 0])


def test_targets_the_step_cannot_run_stay_eager(setup, caplog, monkeypatch):
    """Where the step cannot add the deltas (why_no_lora: here a target it does not run)
    the log says why, steps with adapter rows run eagerly through the LoRA wrapper, and
    the tokens stay right."""
    from types import SimpleNamespace

    from kvflow.cpu import stack

    d, loras, refs = setup
    llm = LLM(str(d / "base"), enable_lora=True, max_lora_rank=8, max_model_len=64,
              block_size=4, device="cpu", enforce_eager=True)
    model = llm.engine.core.executor.runner.model
    llm.shutdown()
    odd = SimpleNamespace(kind="mlp.experts", index=0, layer=None, weights=None)
    assert "mlp.experts" in stack.why_no_lora(model, [odd], torch.float32)
    monkeypatch.setattr(cpu_step, "why_no_lora", lambda *a: "a target it does not run")
    with caplog.at_level(logging.INFO, logger="kvflow"):
        llm = LLM(str(d / "base"), enable_lora=True, max_lora_rank=8, max_model_len=64,
                  block_size=4, device="cpu", max_loras=2)
    assert "LoRA deltas off (a target it does not run)" in caplog.text
    step = llm.engine.core.executor.runner.graphs
    assert isinstance(step, cpu_step.CppDecodeStep) and step.num_lora == 0
    eager = []
    run_eager = step.run_eager
    step.run_eager = lambda inputs: eager.append(1) or run_eager(inputs)
    names, prompts = ["a", None, "c"], _prompts([9, 6, 13], seed=3)
    for p, n, g in zip(prompts, names, _generate(llm, loras, names, prompts)):
        assert g == hf_greedy(refs[n], p, N_TOKENS), n
    assert eager
    llm.shutdown()
