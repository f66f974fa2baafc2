"""``FusedMoE``: a layer of routed experts (the gated MLPs of one MoE decoder layer).

It owns the experts' weights as two stacked parameters, ``w13_weight`` [E_local, 2I_local,
H] (each expert's gate rows, then its up rows) and ``w2_weight`` [E_local, H, I_local],
filled by its own weight loader from per-expert checkpoint tensors (``experts.{e}.w1``
or ``gate_proj`` ...) or from transformers' stacked ``gate_up_proj`` / ``down_proj``.

Parallelism over the tensor-parallel group (the activations are replicated on every
rank, as everywhere in kvflow), the last step always one all-reduce of [T, H]:

- tensor parallelism (default): every rank holds every expert, a 1/tp slice of its
  intermediate dimension (w1/w3 rows, w2 columns), like a row/column-parallel MLP;
- expert parallelism (``expert_parallel``): rank r holds experts [r E/tp, (r+1) E/tp)
  whole; the router runs everywhere, each rank computes only the (token, expert) pairs
  of its own experts, and the all-reduce combines them.

How the weights are stored and multiplied is the quantization method's business
(``kvflow.layers.moe.methods``), as for linear layers.
"""

from __future__ import annotations

import torch
from torch import nn

from kvflow.distributed.parallel_state import GroupCoordinator
from kvflow.errors import ModelLoadError
from kvflow.layers.moe.router import route

# Checkpoint shard kinds: one expert's gate (w1), up (w3), down (w2), or every expert's
# stacked [gate; up] (w13) / down (w2s) tensor.
SHARD_KINDS = ("w1", "w3", "w2", "w13", "w2s")


class FusedMoE(nn.Module):
    def __init__(self, num_experts: int, top_k: int, hidden_size: int,
                 intermediate_size: int, dtype: torch.dtype, *, scoring: str = "softmax",
                 renormalize: bool = True, tp: GroupCoordinator | None = None,
                 expert_parallel: bool = False, quant_config=None, prefix: str = "",
                 reduce_results: bool = True) -> None:
        """``reduce_results``: all-reduce the output here (False: the caller adds it to
        another partial sum first and reduces once)."""
        super().__init__()
        from kvflow.layers.moe.methods import moe_method

        self.tp = tp or GroupCoordinator.single(torch.get_default_device())
        self.num_experts, self.top_k = num_experts, top_k
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.scoring, self.renormalize = scoring, renormalize
        self.expert_parallel = expert_parallel and self.tp.world_size > 1
        self.reduce_results = reduce_results
        self.prefix = prefix
        n, r = self.tp.world_size, self.tp.rank_in_group
        if self.expert_parallel:
            if num_experts % n:
                raise ModelLoadError(f"{prefix}: {num_experts} experts cannot be split "
                                     f"evenly over {n} expert-parallel ranks")
            self.num_local_experts, self.expert_start = num_experts // n, r * num_experts // n
            self.local_intermediate, self.inter_start = intermediate_size, 0
        else:
            if intermediate_size % n:
                raise ModelLoadError(f"{prefix}: the experts' intermediate size "
                                     f"{intermediate_size} is not divisible by the "
                                     f"tensor-parallel size {n} (try "
                                     f"--enable-expert-parallel)")
            self.num_local_experts, self.expert_start = num_experts, 0
            self.local_intermediate = intermediate_size // n
            self.inter_start = r * self.local_intermediate
        self.quant_method = moe_method(quant_config, prefix)
        self.quant_method.create_weights(self, dtype)

    # --- loading ----------------------------------------------------------------
    def local_expert(self, expert: int) -> int | None:
        """This rank's index of global expert ``expert`` (None: another rank holds it)."""
        e = expert - self.expert_start
        return e if 0 <= e < self.num_local_experts else None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: tuple[int | None, str]) -> None:
        """Place a checkpoint tensor: ``shard_id`` = (expert, w1 | w3 | w2) for one
        expert's [I, H] / [H, I] weight, or (None, w13 | w2s) for all experts stacked."""
        expert, kind = shard_id
        if kind == "w13" or kind == "w2s":
            if loaded.shape[0] != self.num_experts:
                raise ModelLoadError(f"{self.prefix}: stacked expert tensor has "
                                     f"{loaded.shape[0]} experts, expected {self.num_experts}")
            for g in range(self.num_experts):
                if kind == "w13":
                    gate, up = loaded[g].chunk(2, dim=0)
                    self.weight_loader(param, gate, (g, "w1"))
                    self.weight_loader(param, up, (g, "w3"))
                else:
                    self.weight_loader(param, loaded[g], (g, "w2"))
            return
        e = self.local_expert(expert)
        if e is None:
            return
        i, s, h = self.local_intermediate, self.inter_start, self.hidden_size
        if kind in ("w1", "w3"):
            want, piece = (self.intermediate_size, h), loaded[s:s + i]
            rows = slice(0, i) if kind == "w1" else slice(i, 2 * i)
            target = param.data[e, rows]
        elif kind == "w2":
            want, piece = (h, self.intermediate_size), loaded[:, s:s + i]
            target = param.data[e]
        else:
            raise ModelLoadError(f"unknown expert shard {kind!r} (one of {SHARD_KINDS})")
        if tuple(loaded.shape) != want:
            raise ModelLoadError(f"{self.prefix}: expert {expert} {kind} has shape "
                                 f"{tuple(loaded.shape)}, expected {want}")
        target.copy_(piece)

    def full_shape(self, name: str) -> tuple[int, ...]:
        """A parameter's shape in a one-rank model (sharded dummy weights)."""
        if name == "w13_weight":
            return (self.num_experts, 2 * self.intermediate_size, self.hidden_size)
        return (self.num_experts, self.hidden_size, self.intermediate_size)

    def load_full(self, name: str, t: torch.Tensor) -> None:
        """Load a one-rank model's stacked tensor (sharded dummy weights)."""
        param = getattr(self, name)
        self.weight_loader(param, t, (None, "w13" if name == "w13_weight" else "w2s"))

    # --- compute ----------------------------------------------------------------
    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """x [T, H], router_logits [T, E] -> the weighted sum of each token's experts
        [T, H] (summed over the ranks unless ``reduce_results`` is off)."""
        weights, ids = route(router_logits, self.top_k, self.scoring, self.renormalize)
        if self.expert_parallel:  # pairs of other ranks' experts -> -1 (skipped)
            local = ids - self.expert_start
            ids = torch.where((local >= 0) & (local < self.num_local_experts), local, -1)
        out = self.quant_method.apply(self, x, weights, ids)
        if self.reduce_results and self.tp.world_size > 1:
            out = self.tp.all_reduce(out)
        return out

    def extra_repr(self) -> str:
        mode = "expert-parallel" if self.expert_parallel else "tensor-parallel"
        return (f"experts={self.num_local_experts}/{self.num_experts}, top_k={self.top_k}, "
                f"hidden={self.hidden_size}, intermediate={self.local_intermediate}, "
                f"{mode}, {self.quant_method.name}")
