"""Mixtures of experts in GGUF files, where llama.cpp defines them: Mixtral (architecture
``llama`` with ``llama.expert_count``), ``qwen2moe`` and ``qwen3moe``.

The metadata becomes the Hugging Face config fields ``ModelArchConfig`` reads; llama.cpp's
expert tensors become per-expert Hugging Face names, which ``FusedMoE``'s loader stacks.
What llama.cpp hard-codes in its graph rather than stores is taken as it does: softmax
routing, top-k weights renormalized for Mixtral and Qwen3-MoE and not for Qwen2-MoE
(``build_moe_ffn``'s ``norm_w``). Metadata that asks for anything else (another gating
function, scaled or grouped routing, an expert bias) is refused, naming the key or tensor.
No torch or numpy here: the architecture is read before the model is built.
"""

from __future__ import annotations

import re

from kvflow.errors import ModelLoadError

MOE_ARCHS = {"qwen2moe": "Qwen2MoeForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM"}
# build_moe_ffn's norm_w in llama.cpp's graph of each architecture.
_NORM_TOPK = {"llama": True, "qwen2moe": False, "qwen3moe": True}
_SOFTMAX = 1  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX

# Expert tensors of one layer: llama.cpp's stacked [E, rows, cols] ones and the per-expert
# ones of Mixtral files converted before llama.cpp stacked them (blk.N.ffn_gate.E.weight).
STACKED_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj",
                   "ffn_down_exps": "down_proj"}
PER_EXPERT = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight")
# Layer tensors that are plain (dense) modules of a MoE block.
MOE_LAYER_NAMES = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# Routers stay dense modules (nn.Linear): always dequantized, never kept as blocks.
ROUTERS = ("ffn_gate_inp", "ffn_gate_inp_shexp")
# llama.cpp expert tensors of other architectures, which these models would ignore.
_UNSUPPORTED = re.compile(r"blk\.\d+\.(ffn_gate_up_exps|exp_probs_b|ffn_\w+_chexps|"
                          r"ffn_norm_exps)\.\w+")


def is_moe(h, a: str) -> bool:
    """Whether a GGUF file (header ``h``, architecture ``a``) is a mixture of experts."""
    return a in MOE_ARCHS or (a == "llama" and int(h.field("llama.expert_count", 0)) > 0)


def moe_architecture(a: str) -> str:
    return MOE_ARCHS.get(a, "MixtralForCausalLM")


def moe_config(path: str, h, a: str, cfg: dict) -> dict:
    """The expert fields of a Hugging Face config.json from GGUF metadata (``cfg``: the
    dense fields already read); refuses what kvflow would compute differently."""
    names = {t.name for t in h.tensors}

    def key(k: str, default=None):
        return h.field(f"{a}.{k}", default)

    def refuse(k: str, why: str):
        raise ModelLoadError(f"{path}: GGUF metadata {a}.{k} = {key(k)!r}: {why}")

    experts, used = int(key("expert_count", 0)), int(key("expert_used_count", 0))
    if experts < 1 or used < 1:
        raise ModelLoadError(f"{path}: a {a} mixture of experts needs {a}.expert_count "
                             f"and {a}.expert_used_count (got {experts}, {used})")
    if key("expert_gating_func") not in (None, _SOFTMAX):
        refuse("expert_gating_func", f"llama.cpp routes {a} by softmax (1); kvflow does "
                                     "not run another gating function for it")
    if key("expert_weights_scale") not in (None, 0.0, 1.0):
        refuse("expert_weights_scale", "scaled routing weights are not supported")
    norm = key("expert_weights_norm")
    if norm is not None and bool(norm) != _NORM_TOPK[a]:
        refuse("expert_weights_norm", f"llama.cpp's {a} graph "
               f"{'renormalizes' if _NORM_TOPK[a] else 'does not renormalize'} the top-k "
               "weights whatever this says; kvflow will not guess which is meant")
    for k in ("expert_group_count", "expert_group_used_count"):
        if key(k) not in (None, 0, 1):
            refuse(k, "grouped expert routing is not supported")
    shared_ok = (0, 1) if a == "qwen2moe" else (0,)
    if int(key("expert_shared_count", 0)) not in shared_ok:
        refuse("expert_shared_count", f"{a} has at most {shared_ok[-1]} shared expert")
    for n in sorted(names):
        if _UNSUPPORTED.fullmatch(n) or (a != "qwen2moe" and "_shexp." in n):
            raise ModelLoadError(f"{path}: tensor {n} is not supported in a {a} mixture of "
                                 "experts (kvflow would ignore it and compute another model)")

    layers = cfg["num_hidden_layers"]
    sparse = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" in names]
    if not sparse:
        raise ModelLoadError(f"{path}: {a}.expert_count is {experts} but no layer has a "
                             "router (blk.N.ffn_gate_inp.weight)")
    dense = [i for i in range(layers) if i not in sparse]

    def rows(name: str) -> int | None:  # a matrix's output rows (ggml's second dim)
        t = next((t for t in h.tensors if t.name == name), None)
        return None if t is None else int(t.shape[1])

    first = sparse[0]
    out = dict(num_local_experts=experts, num_experts=experts, num_experts_per_tok=used,
               norm_topk_prob=_NORM_TOPK[a])
    if a == "llama":  # llama.cpp's Mixtral: every layer routed, experts of feed_forward_length
        if dense:
            raise ModelLoadError(f"{path}: layers {dense} of this llama mixture of experts "
                                 "have no router (blk.N.ffn_gate_inp.weight)")
        return out
    expert_ff = key("expert_feed_forward_length") or rows(f"blk.{first}.ffn_gate_exps.weight")
    if not expert_ff:
        raise ModelLoadError(f"{path}: GGUF metadata lacks {a}.expert_feed_forward_length")
    out.update(moe_intermediate_size=int(expert_ff), decoder_sparse_step=1,
               mlp_only_layers=dense)
    if a == "qwen2moe":
        shared = (key("expert_shared_feed_forward_length")
                  or rows(f"blk.{first}.ffn_gate_shexp.weight") or 0)
        if shared and f"blk.{first}.ffn_gate_inp_shexp.weight" not in names:
            raise ModelLoadError(f"{path}: the shared expert's gate "
                                 f"blk.{first}.ffn_gate_inp_shexp.weight is missing")
        out["shared_expert_intermediate_size"] = int(shared)
    return out
