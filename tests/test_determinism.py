"""Batch invariance on CPU (issue 34): a request's tokens and logprobs are bit for bit the
same alone and inside any batch: others of varied lengths arriving mid-decode, a storm
of aborted requests, chunked prefill, a prefix-cache hit, preemption by recompute and by
swap; greedy and seeded sampling, n > 1, speculative decoding. The C++ step runs every
step (docs/determinism.md), on a tiny GGUF model (its int8-activation GEMVs, the
embedded model's path) and on the embedded model itself."""

from __future__ import annotations

import random

import pytest

from kvflow.engine.args import EngineArgs
from kvflow.engine.llm_engine import LLMEngine
from kvflow.sampling_params import SamplingParams
from kvflow.cpu import step as cpu_step
from tiny_gguf import V, write_tiny_gguf

pytestmark = pytest.mark.skipif(cpu_step.find_compiler() is None,
                                reason="no C++ compiler to build the step with")

OUT = 16  # tokens the request under test generates


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    module, _ = cpu_step.load_extension()
    if not module.q8_gemv_simd():
        pytest.skip("no AVX2 or AVX512-VNNI: the C++ step keeps float32 activations, whose "
                    "GEMV takes up to 16 rows (batch-variant, docs/determinism.md)")
    return write_tiny_gguf(str(tmp_path_factory.mktemp("gguf") / "tiny.gguf"))


def _engine(model: str, **kw) -> LLMEngine:
    args = dict(device="cpu", seed=0)
    if model.endswith(".gguf"):
        args.update(skip_tokenizer_init=True, max_model_len=256, block_size=4)
    args.update(kw)
    eng = LLMEngine.from_engine_args(EngineArgs(model=model, **args))
    assert isinstance(eng.core.executor.runner.graphs, cpu_step.CppDecodeStep)
    return eng


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, V) for _ in range(n)]


def _params(mode: str, n: int = 1, max_tokens: int = OUT) -> SamplingParams:
    if mode == "greedy":
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=2,
                              ignore_eos=True)
    return SamplingParams(max_tokens=max_tokens, temperature=0.9, top_p=0.95, seed=1234,
                          n=n, logprobs=2, ignore_eos=True)


def _drive(eng: LLMEngine, events: list[tuple], aborts: dict[int, list[str]] | None = None
           ) -> dict:
    """Run ``events`` [(step, request id, prompt, params)] through the engine, adding each
    at its step and aborting ``aborts[step]``; the finished outputs of request "T" as
    {index: (token ids, [top logprobs per token])}."""
    pending = sorted(events, key=lambda e: e[0])
    aborts = aborts or {}
    got, step = {}, 0
    while pending or eng.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, rid, prompt, params = pending.pop(0)
            eng.add_request(rid, {"prompt_token_ids": prompt} if isinstance(prompt, list)
                            else prompt, params)
        if step in aborts:
            eng.abort_request(aborts[step])
        for ro in eng.step():
            if ro.request_id == "T" and ro.finished:
                got = {c.index: (list(c.token_ids),
                                 [sorted((t, lp.logprob) for t, lp in d.items())
                                  for d in c.logprobs]) for c in ro.outputs}
        step += 1
        assert step < 5000
    assert got, "the request under test did not finish"
    return got


def _others(kind: str, rng: random.Random) -> tuple[list[tuple], dict]:
    """Other requests sharing the steps of "T" (added at step 0)."""
    if kind == "short":  # decodes and short prompts beside it from the start
        return [(0, f"s{i}", _ids(rng, rng.randrange(2, 12)), _params("greedy"))
                for i in range(6)], {}
    if kind == "long-midway":  # long prompts arriving while it decodes
        return [(2 + 3 * i, f"l{i}", _ids(rng, 90 + 40 * i),
                 SamplingParams(max_tokens=8, temperature=0.7, ignore_eos=True))
                for i in range(3)], {}
    if kind == "storm":  # many requests that start and are dropped (disconnects)
        ev = [(rng.randrange(0, 10), f"d{i}", _ids(rng, rng.randrange(5, 120)),
               SamplingParams(max_tokens=40, temperature=1.0)) for i in range(12)]
        aborts: dict[int, list[str]] = {}
        for i in range(12):
            aborts.setdefault(rng.randrange(3, 14), []).append(f"d{i}")
        return ev, aborts
    raise ValueError(kind)


@pytest.mark.parametrize("mode", ["greedy", "seeded"])
def test_tiny_gguf_alone_equals_batched(tiny_gguf, mode):
    eng = _engine(tiny_gguf)
    prompt = _ids(random.Random(7), 37)
    alone = _drive(eng, [(0, "T", prompt, _params(mode))])
    assert len(alone[0][0]) == OUT
    for kind in ("short", "long-midway", "storm"):
        rng = random.Random(kind)
        events, aborts = _others(kind, rng)
        got = _drive(eng, [(0, "T", prompt, _params(mode))] + events, aborts)
        assert got == alone, kind
    # A prefix-cache hit: the same prompt again, its blocks now cached.
    assert _drive(eng, [(0, "T", prompt, _params(mode))]) == alone
    # The next turn of a chat: a prompt that repeats the answer, on this engine (which
    # has computed that answer as output rows) and on a fresh one.
    turn2 = prompt + alone[0][0] + _ids(random.Random(8), 5)
    again = _drive(eng, [(0, "T", turn2, _params(mode))])
    assert _drive(_engine(tiny_gguf), [(0, "T", turn2, _params(mode))]) == again
    # Chunked prefill (5 tokens a step) and preemption: a cache too small for the load.
    for kw in (dict(max_num_batched_tokens=5),
               dict(num_gpu_blocks_override=64, max_num_batched_tokens=64),
               dict(num_gpu_blocks_override=64, max_num_batched_tokens=64,
                    preemption_mode="swap", swap_space="64MiB")):
        small = _engine(tiny_gguf, **kw)
        rng = random.Random(3)
        crowd = [(i, f"c{i}", _ids(rng, 40 + 9 * i), SamplingParams(
            max_tokens=30, temperature=0.0, ignore_eos=True)) for i in range(4)]
        got = _drive(small, [(0, "T", prompt, _params(mode))] + crowd)
        assert got == alone, kw
        if "num_gpu_blocks_override" in kw:
            sched = small.core.scheduler
            assert sched.num_preemptions > 0, kw


def test_tiny_gguf_n_and_speculative(tiny_gguf):
    """Seeded n = 3 alone and batched; n-gram speculative decoding (greedy and seeded)
    alone and batched, greedy equal to plain decoding."""
    prompt = _ids(random.Random(11), 30) * 2  # repeats give the n-gram proposer matches
    eng = _engine(tiny_gguf)
    rng = random.Random(5)
    crowd = [(1 + i, f"o{i}", _ids(rng, 70), _params("greedy")) for i in range(3)]
    alone = _drive(eng, [(0, "T", prompt, _params("seeded", n=3))])
    assert sorted(alone) == [0, 1, 2]
    assert _drive(eng, [(0, "T", prompt, _params("seeded", n=3))] + crowd) == alone
    plain = _drive(eng, [(0, "T", prompt, _params("greedy"))])
    spec = _engine(tiny_gguf, speculative_config={"method": "ngram",
                                                  "num_speculative_tokens": 3,
                                                  "prompt_lookup_max": 3})
    for mode in ("greedy", "seeded"):
        alone = _drive(spec, [(0, "T", prompt, _params(mode))])
        assert _drive(spec, [(0, "T", prompt, _params(mode))] + crowd) == alone, mode
        if mode == "greedy":
            assert [a[0] for a in alone.values()] == [p[0] for p in plain.values()]


@pytest.mark.parametrize("mode", ["greedy", "seeded"])
def test_embedded_model_alone_equals_batched(tiny_gguf, mode):
    """The issue's case on the embedded model: a chat answer alone, then with prompts of
    a few hundred tokens arriving while it decodes and a crowd of sampled requests."""
    eng = _engine("smollm2-135m", max_model_len=1024)
    prompt = ("<|im_start|>user\nWrite a short story about a lighthouse keeper."
              "<|im_end|>\n<|im_start|>assistant\n")
    alone = _drive(eng, [(0, "T", prompt, _params(mode, max_tokens=24))])
    rng = random.Random(0)
    words = "the of and to in is was for on that with as by at from it an be".split()
    crowd = [(2 + 2 * i, f"l{i}", " ".join(rng.choice(words) for _ in range(150 + 60 * i)),
              SamplingParams(max_tokens=6, temperature=0.8)) for i in range(3)]
    got = _drive(eng, [(0, "T", prompt, _params(mode, max_tokens=24))] + crowd)
    assert got == alone


def test_fingerprint_names_what_changes_outputs(tiny_gguf, tmp_path, monkeypatch):
    import dataclasses
    import shutil

    import kvflow
    from kvflow.engine.determinism import INVARIANT, VARIANT, fingerprint

    def config(path=tiny_gguf, **kw):
        return EngineArgs(model=path, device="cpu", skip_tokenizer_init=True,
                          **kw).create_engine_config()

    base = config()
    fp = fingerprint(base, INVARIANT)
    assert fp.startswith("fp_") and fingerprint(config(), INVARIANT) == fp
    other = str(tmp_path / "other.gguf")
    shutil.copy(tiny_gguf, other)
    changed = [fingerprint(base, VARIANT), fingerprint(config(quantization="int8"), INVARIANT),
               fingerprint(config(kv_cache_dtype="int8"), INVARIANT),
               fingerprint(config(other), INVARIANT),
               fingerprint(dataclasses.replace(base, device=dataclasses.replace(
                   base.device, device="cuda")), INVARIANT)]
    monkeypatch.setattr(kvflow.version, "__version__", "0.0.0-test")
    changed.append(fingerprint(base, INVARIANT))
    assert fp not in changed and len(set(changed)) == len(changed)


def test_deterministic_refused_where_it_cannot_hold(tiny_gguf):
    """--deterministic on a CPU engine whose rows can change with the batch is an error
    that says why: one that decodes eagerly (routed experts are not in the C++ step), one
    with dense float32 linears (a GEMV up to 16 rows, a GEMM above); without the flag the
    engine reports batch-variant. The GGUF model on int8 activations is invariant."""
    from kvflow.errors import InvalidParameterError

    kw = dict(load_format="dummy", max_model_len=64, device="cpu")
    for model, why in (("tiny-mixtral", "eager CPU path"), ("tiny-llama", "dense")):
        eng = LLMEngine.from_engine_args(EngineArgs(model=model, **kw))
        assert eng.core.determinism.mode == "batch-variant"
        with pytest.raises(InvalidParameterError, match=f"--deterministic: .*{why}"):
            LLMEngine.from_engine_args(EngineArgs(model=model, deterministic=True, **kw))
    ok = _engine(tiny_gguf, deterministic=True)
    assert ok.core.determinism.mode == "batch-invariant"


def test_gpu_deterministic_refuses_what_it_does_not_cover():
    """On the GPU the mode follows what the runner switched: everything -> invariant; a
    part left out (MoE experts, other weight formats, ranks elsewhere, LoRA, speculation)
    -> refused with --deterministic, reported batch-variant without it."""
    import dataclasses
    import types

    from kvflow.engine.determinism import determine
    from kvflow.errors import InvalidParameterError

    base = EngineArgs(model="tiny-llama", load_format="dummy",
                      device="cpu").create_engine_config()

    def on_cuda(deterministic: bool):
        return dataclasses.replace(base, device=dataclasses.replace(
            base.device, device="cuda", deterministic=deterministic))

    covered = types.SimpleNamespace(deterministic=True, deterministic_gaps=[])
    assert determine(on_cuda(True), covered).mode == "batch-invariant"
    assert determine(on_cuda(False), covered).mode == "batch-variant"
    moe = types.SimpleNamespace(deterministic=True, deterministic_gaps=["the fused MoE experts"])
    with pytest.raises(InvalidParameterError, match="does not cover the fused MoE experts"):
        determine(on_cuda(True), moe)
    with pytest.raises(InvalidParameterError, match="does not cover several ranks"):
        determine(on_cuda(True), None)
    ngram = EngineArgs(model="tiny-llama", load_format="dummy", device="cpu",
                       speculative_config={"method": "ngram", "num_speculative_tokens": 2}
                       ).create_engine_config()
    spec = dataclasses.replace(on_cuda(True), speculative=ngram.speculative)
    with pytest.raises(InvalidParameterError, match="speculative decoding"):
        determine(spec, covered)
