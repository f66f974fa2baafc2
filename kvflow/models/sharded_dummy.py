"""Random (dummy) weights for a tensor-parallel rank that equal one rank's weights.

``init_dummy_weights`` fills a model's parameters in order from one seeded generator, so
the values depend on the full parameter shapes. A TP rank holds slices, so it replays
the one-rank fill: for each parameter, in the same order, it draws the full tensor (the
shape the one-rank layer would have) from the same generator and passes it to its own
parameter's weight loader, which keeps this rank's slice. Ranks therefore run exactly
the weights a one-rank engine with the same seed runs, pipeline stages included.
"""

from __future__ import annotations

import torch
from torch import nn

from kvflow.config import ModelConfig
from kvflow.layers.linear import default_weight_loader
from kvflow.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear
from kvflow.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding


def _full_shape(owner: nn.Module, pname: str, param: nn.Parameter) -> tuple[int, ...]:
    """The shape this parameter has in a one-rank model."""
    if hasattr(owner, "full_shape"):  # FusedMoE's stacked experts
        return owner.full_shape(pname)
    if isinstance(owner, ColumnParallelLinear):
        out = sum(owner.full_output_sizes)
        return (out, owner.input_size) if pname == "weight" else (out,)
    if isinstance(owner, RowParallelLinear):
        return ((owner.output_size, owner.full_input_size) if pname == "weight"
                else tuple(param.shape))
    if isinstance(owner, (VocabParallelEmbedding, ParallelLMHead)):
        return (owner.vocab_size, param.shape[1])
    return tuple(param.shape)


def _one_rank_order(model: nn.Module):
    """(name, owner module, parameter name, parameter or None) in the order a one-rank model
    lists its parameters. Layers of other pipeline stages come as this stage's first layer
    with None: their tensors are drawn (to keep the generator in step) and dropped."""
    named = list(model.named_parameters())
    in_layers = [i for i, (n, _) in enumerate(named) if n.startswith("model.layers.")]
    if not in_layers:
        return [(n, model.get_submodule(n.rsplit(".", 1)[0]), n.rsplit(".", 1)[1], p)
                for n, p in named]
    first, last = in_layers[0], in_layers[-1]
    m = model.model
    template = f"model.layers.{m.start_layer}."
    rests = [n[len(template):] for n, _ in named if n.startswith(template)]
    order = []
    for i in range(len(m.layers)):
        own = m.start_layer <= i < m.end_layer
        if own:  # its own names: MoE stacks mix dense and expert layers
            prefix = f"model.layers.{i}."
            order += [(n, True) for n, _ in named if n.startswith(prefix)]
            continue
        for rest in rests:
            order.append((f"model.layers.{m.start_layer}.{rest}", False))
    entries = [(n, True) for n, _ in named[:first]] + order + \
        [(n, True) for n, _ in named[last + 1:]]
    params = dict(named)
    return [(n, model.get_submodule(n.rsplit(".", 1)[0]), n.rsplit(".", 1)[1],
             params[n] if own else None) for n, own in entries]


@torch.no_grad()
def load_sharded_dummy_weights(model: nn.Module, config: ModelConfig,
                               device: torch.device) -> None:
    gen = torch.Generator(device=device).manual_seed(config.seed)
    for name, owner, pname, param in _one_rank_order(model):
        template = param if param is not None else getattr(owner, pname)
        t = torch.empty(_full_shape(owner, pname, template), dtype=template.dtype,
                        device=device)
        if name.endswith("norm.weight"):
            t.uniform_(0.9, 1.1, generator=gen)
        else:
            t.normal_(0.0, 0.02, generator=gen)
        if param is None:
            continue  # a layer of another pipeline stage
        loader = getattr(param, "weight_loader", default_weight_loader)
        if hasattr(owner, "load_full"):  # FusedMoE: this rank's experts or expert slices
            owner.load_full(pname, t)
        elif isinstance(owner, ColumnParallelLinear) and len(owner.full_output_sizes) > 1:
            for shard_id, piece in zip(owner.shard_ids, t.split(owner.full_output_sizes)):
                loader(param, piece, shard_id)  # merged GEMM: shard by shard
        else:
            loader(param, t)
