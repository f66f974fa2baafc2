"""Mixtral, Qwen2-MoE and Qwen3-MoE from GGUF files, against transformers on the same weights.

The files are written here the way llama.cpp's convert_hf_to_gguf.py writes them: Mixtral
as architecture ``llama`` (q/k rows permuted, ``llama.expert_count`` /
``expert_used_count``), Qwen as ``qwen2moe`` / ``qwen3moe`` with
``expert_feed_forward_length`` (and ``expert_shared_feed_forward_length``); experts stacked
[E, rows, cols] as ``ffn_{gate,up,down}_exps``, the router as ``ffn_gate_inp``, Qwen2-MoE's
shared expert as ``ffn_*_shexp`` behind ``ffn_gate_inp_shexp``. Mixtral is also written
the older way, one tensor per expert (``ffn_gate.E``). Quantized files hold Q8_0 blocks
where a row fits them (routers, norms and the 48-wide shared expert's down stay F32, as
llama.cpp leaves them); their reference is transformers with every quantized weight
replaced by its dequantized value.

The Qwen2-MoE preset keeps a dense first layer (``mlp_only_layers=[0]``), which llama.cpp's
qwen2moe cannot hold but kvflow reads from the tensors present; Qwen3-MoE is written with
every layer routed, as llama.cpp's qwen3moe has it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from kvflow import LLM, SamplingParams  # noqa: E402
from kvflow.errors import ModelLoadError  # noqa: E402
from kvflow.models.registry import PRESETS  # noqa: E402
from kvflow.plan.cli import stored_bytes_per_param  # noqa: E402

from test_models_dense import check  # noqa: E402
from test_models_moe import save_hf_model  # noqa: E402
from tiny_gguf import _permute, add_shape  # noqa: E402

Q = gguf.GGMLQuantizationType
ARCH = {"MixtralForCausalLM": "llama", "Qwen2MoeForCausalLM": "qwen2moe",
        "Qwen3MoeForCausalLM": "qwen3moe"}
LAYER = {"input_layernorm.weight": "attn_norm.weight",
         "post_attention_layernorm.weight": "ffn_norm.weight",
         "self_attn.q_norm.weight": "attn_q_norm.weight",
         "self_attn.k_norm.weight": "attn_k_norm.weight",
         "mlp.gate.weight": "ffn_gate_inp.weight",
         "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
         "mlp.experts.down_proj": "ffn_down_exps.weight"}
for _p, _g in (("q", "attn_q"), ("k", "attn_k"), ("v", "attn_v"), ("o", "attn_output")):
    LAYER[f"self_attn.{_p}_proj.weight"] = f"{_g}.weight"
    LAYER[f"self_attn.{_p}_proj.bias"] = f"{_g}.bias"
for _p in ("gate", "up", "down"):
    LAYER[f"mlp.{_p}_proj.weight"] = f"ffn_{_p}.weight"
    LAYER[f"mlp.shared_expert.{_p}_proj.weight"] = f"ffn_{_p}_shexp.weight"
GLOBAL = {"model.embed_tokens.weight": "token_embd.weight",
          "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}


def quantizable(gguf_name: str, x: np.ndarray) -> bool:
    """Q8_0 where llama.cpp's quantizer would put it: matrices whose rows are whole
    32-blocks, never a router."""
    return x.ndim >= 2 and x.shape[-1] % 32 == 0 and "ffn_gate_inp" not in gguf_name


def llama_cpp_tensors(hf, cfg: dict, per_expert: bool) -> dict[str, tuple[str, np.ndarray]]:
    """llama.cpp name -> (Hugging Face name, float32 data in llama.cpp's row order)."""
    mixtral = ARCH[cfg["architectures"][0]] == "llama"
    out = {}
    for name, t in hf.state_dict().items():
        x = t.float().numpy().copy()
        if name in GLOBAL:
            out[GLOBAL[name]] = name, x
            continue
        layer, rest = name.removeprefix("model.layers.").split(".", 1)
        blk = f"blk.{layer}."
        if rest == "mlp.experts.gate_up_proj":  # [E, 2I, H]: gate rows, then up rows
            gate, up = np.split(x, 2, axis=1)
            for kind, part in (("gate", gate), ("up", up)):
                out[blk + f"ffn_{kind}_exps.weight"] = name, np.ascontiguousarray(part)
            continue
        if rest == "mlp.shared_expert_gate.weight":
            x = x.reshape(-1)  # llama.cpp's {n_embd}
        if mixtral and rest in ("self_attn.q_proj.weight", "self_attn.k_proj.weight"):
            heads = cfg["num_attention_heads" if ".q_proj" in rest else "num_key_value_heads"]
            x = _permute(x, heads)
        out[blk + LAYER[rest]] = name, x
    if per_expert:  # Mixtral files converted before llama.cpp stacked the experts
        for key in [k for k in out if k.endswith("_exps.weight")]:
            name, x = out.pop(key)
            for e in range(x.shape[0]):
                out[key.replace("_exps.weight", f".{e}.weight")] = name, x[e]
    return out


def write_gguf(hf, cfg: dict, path: str, qtype=Q.F32, per_expert: bool = False,
               extra: dict | None = None, extra_tensors: dict | None = None,
               types: dict | None = None) -> None:
    """Write ``hf`` as llama.cpp would; with a quantized ``qtype``, replace each quantized
    weight of ``hf`` by its dequantized value (the reference for the file). ``types``:
    GGUF tensor kind (``ffn_down_exps``) -> its own type, as Q4_K_M files mix them."""
    a = ARCH[cfg["architectures"][0]]
    w = gguf.GGUFWriter(path, a)
    add_shape(w, cfg)
    w.add_expert_count(cfg.get("num_local_experts") or cfg["num_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    if a != "llama":
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if a == "qwen2moe":
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    for key, value in (extra or {}).items():
        add = (w.add_bool if isinstance(value, bool) else
               w.add_float32 if isinstance(value, float) else w.add_uint32)
        add(f"{a}.{key}", value)
    dequantized: dict[str, object] = {}
    for gname, (hf_name, x) in llama_cpp_tensors(hf, cfg, per_expert).items():
        kind = gname.split(".")[2] if gname.startswith("blk.") else ""
        q = (types or {}).get(kind, qtype)
        if q == Q.F32 or not quantizable(gname, x):
            w.add_tensor(gname, x)
            continue
        w.add_tensor(gname, gguf.quants.quantize(x, q), raw_dtype=q)
        assert dequantized.setdefault(hf_name, q) == q  # gate and up share HF's tensor
    for gname, x in (extra_tensors or {}).items():
        w.add_tensor(gname, x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with torch.no_grad():  # blocks run along rows, so HF's layout rounds the same values
        params = dict(hf.named_parameters())
        for hf_name, q in dequantized.items():
            x = params[hf_name].numpy()
            params[hf_name].copy_(torch.from_numpy(
                gguf.quants.dequantize(gguf.quants.quantize(x, q), q)))


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(2)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in (6, 27)]


PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0,
                        prompt_logprobs=0)
QWEN3_ALL_MOE = dict(decoder_sparse_step=1)


def make(tmp_path, preset: str, **kw):
    extra = QWEN3_ALL_MOE if preset == "tiny-qwen3-moe" else {}
    hf = save_hf_model(preset, tmp_path / "hf", **extra)
    cfg = {**PRESETS[preset], **extra}
    path = str(tmp_path / "model.gguf")
    write_gguf(hf, cfg, path, **kw)
    return hf, cfg, path


def llm(path: str, **kw) -> LLM:
    return LLM(path, max_model_len=64, block_size=4, max_num_batched_tokens=16,
               kv_cache_memory="16MiB", device="cpu", skip_tokenizer_init=True, **kw)


@pytest.mark.parametrize("preset,per_expert", [
    ("tiny-mixtral", False), ("tiny-mixtral", True), ("tiny-qwen2-moe", False),
    ("tiny-qwen3-moe", False)], ids=["mixtral", "mixtral-per-expert", "qwen2-moe", "qwen3-moe"])
def test_f32_gguf_matches_transformers(tmp_path, preset, per_expert):
    hf, cfg, path = make(tmp_path, preset, per_expert=per_expert)
    engine = llm(path)
    arch = engine.engine.config.model.arch
    assert arch.architecture == cfg["architectures"][0]
    assert arch.num_experts == 8 and arch.num_experts_per_tok == cfg["num_experts_per_tok"]
    assert arch.norm_topk_prob == (preset != "tiny-qwen2-moe")
    if preset == "tiny-qwen2-moe":
        assert arch.mlp_only_layers == (0,) and arch.shared_expert_intermediate_size == 48
    ps = prompts()
    check(hf, ps, engine.generate(ps, PARAMS, use_tqdm=False))


@pytest.mark.parametrize("preset", ["tiny-mixtral", "tiny-qwen2-moe"])
def test_q8_0_gguf_matches_dequantized_transformers(tmp_path, preset):
    """Dense (--quantization none): the file's values exactly. The default on CPU keeps
    every block, the experts' too (bf16 activations): the prompt logprobs close to the
    dense ones, and ``kvflow plan`` counts the file's bytes."""
    hf, _, path = make(tmp_path, preset, qtype=Q.Q8_0)
    ps = prompts()
    dense = llm(path, quantization="none")
    outs = dense.generate(ps, PARAMS, use_tqdm=False)
    check(hf, ps, outs)
    del dense
    blocks = llm(path)
    model = blocks.engine.core.executor.runner.model
    layer = model.model.layers[1]
    moe = layer.block_sparse_moe if preset == "tiny-mixtral" else layer.mlp
    assert hasattr(layer.self_attn.qkv_proj, "qweight")  # the file's blocks
    assert moe.experts.w13_q.dtype == torch.uint8  # the experts' blocks too
    # Q8_0 is 34 bytes per 32 weights; the F32 routers and norms add a little
    assert 34 / 32 < stored_bytes_per_param(path) < 1.3
    got = blocks.generate(ps, PARAMS, use_tqdm=False)
    for a, b in zip(outs, got):  # bf16 activations: about 1% of logprobs near -8
        ref = [next(iter(d.values())).logprob for d in a.prompt_logprobs[1:]]
        new = [next(iter(d.values())).logprob for d in b.prompt_logprobs[1:]]
        torch.testing.assert_close(torch.tensor(new), torch.tensor(ref), atol=0.05,
                                   rtol=0.02)


def experts_of(engine: LLM, preset: str):
    layer = engine.engine.core.executor.runner.model.model.layers[1]
    return (layer.block_sparse_moe if preset == "tiny-mixtral" else layer.mlp).experts


def dequantize_experts(monkeypatch) -> None:
    """Engines built from here on dequantize a GGUF file's experts into the model dtype at
    load (what every GGUF MoE did before the experts kept their blocks, and what CUDA
    still does with 8-bit ones); everything else keeps its blocks as before."""
    from kvflow.layers.moe import methods

    plain = methods.moe_method
    monkeypatch.setattr(methods, "moe_method", lambda config, prefix: (
        methods.GGUFMoEMethod(dense=True) if config is not None and config.method == "gguf"
        else plain(config, prefix)))


def logprobs(out) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt logprobs, the greedy tokens' logprobs) of one request."""
    c = out.outputs[0]
    return (torch.tensor([next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]]),
            torch.tensor([d[t].logprob for t, d in zip(c.token_ids, c.logprobs)]))


# Bytes per expert weight as kept: aten's int4 pack (half a byte) plus a bfloat16
# (scale, zero) per 32 inputs; 8-bit blocks are two nibbles over a doubled input.
KEPT_BYTES = {"int4": 0.5 + 4 / 32, "int8": 1 + 8 / 32}


EXPERTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
TOP2 = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2,
                      prompt_logprobs=0)


@pytest.mark.parametrize("preset,qtype,down,layouts", [
    ("tiny-mixtral", Q.Q4_0, None, ("int4", "int4")),
    ("tiny-qwen3-moe", Q.Q4_1, None, ("int4", "int4")),
    ("tiny-mixtral", Q.Q8_0, None, ("int8", "int8")),
    ("tiny-qwen3-moe", Q.Q8_0, None, ("int8", "int8")),
    ("tiny-qwen3-moe", Q.Q4_0, Q.Q8_0, ("int4", "int8")),
], ids=["mixtral-q4_0", "qwen3-q4_1", "mixtral-q8_0", "qwen3-q8_0", "qwen3-q4_0-down-q8_0"])
def test_experts_kept_in_blocks(tmp_path, monkeypatch, preset, qtype, down, layouts):
    """The experts keep the file's blocks (packed int4; 8-bit blocks doubled), at the
    packed size, and give the logprobs and greedy tokens of the same file with its experts
    dequantized at load. Only the experts are quantized (the rest F32, so float32 logits),
    and the two engines differ only in the experts' two matmuls, which the packed op
    computes from bfloat16 activations with bfloat16 group scales and a bfloat16 output
    (each a relative rounding of at most 2^-9: up to about 1% of an expert's output). On
    these random models, whose logits span several units, that moves logprobs by up to
    0.021 (measured over these cases); atol 0.04 allows for it, where a wrong nibble,
    scale, zero or expert moves them by whole units. Greedy tokens agree until the
    reference's top two are closer than twice that (random tiny models have near-ties),
    after which the sequences may part."""
    types = {k: qtype for k in EXPERTS} | ({"ffn_down_exps": down} if down else {})
    _, cfg, path = make(tmp_path, preset, types=types)
    ps = prompts()
    kept = llm(path)
    moe = experts_of(kept, preset)
    assert (moe.quant_method.layouts["w13"], moe.quant_method.layouts["w2"]) == layouts
    assert not hasattr(moe, "w13_weight") and not hasattr(moe, "w2_weight")
    h, i, e = cfg["hidden_size"], moe.local_intermediate, moe.num_local_experts
    stored = sum(t.numel() * t.element_size() for t in [*moe.parameters(), *moe.buffers()])
    assert stored == e * h * i * (2 * KEPT_BYTES[layouts[0]] + KEPT_BYTES[layouts[1]])
    if layouts == ("int4", "int4"):
        assert stored < e * 3 * h * i * 2 / 2  # under half of bfloat16
    got = kept.generate(ps, TOP2, use_tqdm=False)
    del kept
    dequantize_experts(monkeypatch)
    dense = llm(path)
    assert experts_of(dense, preset).w13_weight.dtype == torch.float32
    want = dense.generate(ps, TOP2, use_tqdm=False)
    atol = 0.04
    for a, b in zip(got, want):
        torch.testing.assert_close(logprobs(a)[0], logprobs(b)[0], atol=atol, rtol=0)
        for ta, tb, la, lb in zip(a.outputs[0].token_ids, b.outputs[0].token_ids,
                                  a.outputs[0].logprobs, b.outputs[0].logprobs):
            top = sorted((x.logprob for x in lb.values()), reverse=True)
            if ta != tb:
                assert top[0] - top[1] < 2 * atol  # a near-tie: the sequences part here
                break
            assert abs(la[ta].logprob - lb[tb].logprob) <= atol


def test_expert_parallel_ranks_keep_their_experts_blocks(tmp_path):
    """Two gloo ranks, each holding half of the experts in their Q4_0 blocks, give one
    rank's tokens and logprobs. The ranks' partial sums are added in another order than
    one rank's (float32 ulps apart), and the next layer's bfloat16 activations may round
    such an ulp a bfloat16 step (2^-8) apart: 0.005 measured, 0.02 allowed (F32 experts
    agree to 2e-6; a rank running the wrong experts is off by whole units)."""
    _, _, path = make(tmp_path, "tiny-qwen3-moe", types={k: Q.Q4_0 for k in EXPERTS})
    ps = prompts()
    one = llm(path)
    want = one.generate(ps, TOP2, use_tqdm=False)
    del one
    with llm(path, tensor_parallel_size=2, enable_expert_parallel=True,
             distributed_timeout=30) as ep:
        moe = experts_of(ep, "tiny-qwen3-moe")
        assert (moe.num_local_experts, moe.expert_start) == (4, 0)
        assert moe.w13_q.shape[0] == 4 and moe.quant_method.layouts["w13"] == "int4"
        got = ep.generate(ps, TOP2, use_tqdm=False)
    for a, b in zip(got, want):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(logprobs(a), logprobs(b)):
            torch.testing.assert_close(x, y, atol=0.02, rtol=0)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q4_K], ids=["q4_0", "q4_1", "q4_k"])
def test_4bit_blocks_map_onto_the_fused_kernels_int4_layout(qtype):
    """CUDA's layout for 4-bit experts (``pack_int4_experts``: w = v * scale + offset,
    offset = zero - 8 scale) holds GGUF's blocks: in float32 it dequantizes to gguf-py's
    values (to float32 rounding of the offset; the model dtype rounds scales and offsets
    further on the GPU)."""
    from kvflow.kernels.fused_moe import dequantize_int4_experts
    from kvflow.layers.moe.methods import GGUFMoEMethod
    from kvflow.layers.quantization.ggml_blocks import to_int4_groups

    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(0)
    if qtype == Q.Q4_K:  # no gguf-py quantizer: random blocks with sane d and dmin
        raw = rng.integers(0, 256, (8, 512 // block * size), np.uint8)
        blocks = raw.reshape(-1, size)
        blocks[:, :4] = np.frombuffer(np.float16([0.01, 0.02]).tobytes(), np.uint8)
    else:
        raw = gguf.quants.quantize(rng.normal(0, 0.2, (8, 512)).astype(np.float32), qtype)
    groups, exact = to_int4_groups(raw, 512, int(qtype))
    method = GGUFMoEMethod()
    method.dtype = torch.float32
    half = [to_int4_groups(r, 512, int(qtype))[0] for r in (raw[:4], raw[4:])]
    p = method._pack(half, "int4", cuda=True)  # two experts of 4 rows
    got = dequantize_int4_experts(p["q"], p["scale"], p["offset"], 32).reshape(8, 512)
    want = torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(8, 512))
    assert exact
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("extra,tensors,field", [
    ({"expert_gating_func": 2}, {}, "expert_gating_func"),
    ({"expert_weights_scale": 2.5}, {}, "expert_weights_scale"),
    ({"expert_weights_norm": False}, {}, "expert_weights_norm"),
    ({}, {"blk.0.exp_probs_b.bias": np.zeros(8, np.float32)}, "exp_probs_b"),
], ids=["gating-sigmoid", "weights-scale", "weights-norm", "expert-bias"])
def test_unsupported_moe_metadata_refused(tmp_path, extra, tensors, field):
    cfg = {**PRESETS["tiny-qwen3-moe"], **QWEN3_ALL_MOE}
    hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(
        "qwen3_moe", **cfg), dtype=torch.float32)
    path = str(tmp_path / "bad.gguf")
    write_gguf(hf, cfg, path, extra=extra, extra_tensors=tensors)
    with pytest.raises(ModelLoadError, match=field):
        llm(path)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K])
def test_stacked_k_quant_experts_dequantize_one_at_a_time(tmp_path, qtype):
    """K-quant rows are 256 wide, too wide for the tiny models: a stacked [E, rows, 256]
    expert tensor of random blocks, each expert read alone equals its slice of the whole."""
    from kvflow.models.gguf_file import _dequantize, _file_bytes
    from kvflow.models.gguf_header import read_gguf_header

    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = np.random.default_rng(0).integers(0, 256, (3, 4, 256 // block * size), np.uint8)
    blocks = raw.reshape(-1, size)  # finite fp16 super-block scales (no NaN to compare)
    if qtype == Q.Q4_K:  # d and dmin lead the block
        blocks[:, :4] = np.frombuffer(np.float16([0.01, 0.02]).tobytes(), np.uint8)
    else:  # Q6_K: d ends it
        blocks[:, -2:] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    path = str(tmp_path / "k.gguf")
    w = gguf.GGUFWriter(path, "qwen3moe")
    w.add_tensor("blk.0.ffn_up_exps.weight", raw, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    (t,) = read_gguf_header(path).tensors
    whole = gguf.quants.dequantize(raw, qtype)  # [3, 4, 256]
    for e in range(3):
        got = _dequantize(path, _file_bytes(path), t, e)
        assert got.shape == (4, 256) and np.isfinite(got).all()
        np.testing.assert_array_equal(got, whole[e])
