"""How a trained mixture of experts spreads tokens over its experts, measured on held-out text.

Per MoE layer, two shares per expert, each summing to 1 over the experts:
  first choice  the fraction of tokens whose top-ranked expert it is (Switch's routing, top 1): 1 / n_experts at
                perfect balance, up to 1 when one expert takes every token; this is what "the busiest expert takes
                x% of the tokens" means for any top_k
  routed        its share of all routed slots (top_k per token), the `moe/expert_fraction` of metrics.jsonl: an
                expert takes at most one slot per token, so with top_k = 2 no expert can exceed 1/2 of them
Routing is the model's own (MoEMLP.route: with balance=bias the expert bias chooses), on every token given.
"""
from __future__ import annotations

import torch
from torch import nn

from archlab.nn.mlp import MoEMLP

__all__ = ["expert_load", "busiest_share"]


@torch.no_grad()
def expert_load(model: nn.Module, batches: list[torch.Tensor]) -> dict[str, list[list[float]]]:
    """{"first_choice": [[share per expert] per MoE layer], "routed": same} over the tokens of `batches`
    ((b, t) token ids each; every token counts). {} for a model without MoE layers.
    Example: expert_load(model, [ids])["first_choice"][0] -> [0.14, 0.09, ...] (layer 0, n_experts values)"""
    layers = [m for m in model.modules() if isinstance(m, MoEMLP)]
    if not layers:
        return {}
    n = len(layers[0].experts)
    first = torch.zeros(len(layers), n, dtype=torch.float64)            # (layers, n) token counts
    routed = torch.zeros(len(layers), n, dtype=torch.float64)

    def hook(i: int, layer: MoEMLP):
        def count(_module, _inputs, logits: torch.Tensor) -> None:      # logits: (bt, n), the router's output
            _, chosen = layer.route(logits.float().softmax(-1))         # (bt, k)
            first[i] += torch.bincount(chosen[:, 0].cpu(), minlength=n).double()
            routed[i] += torch.bincount(chosen.flatten().cpu(), minlength=n).double()
        return count

    handles = [layer.router.register_forward_hook(hook(i, layer)) for i, layer in enumerate(layers)]
    was_training = model.training
    model.eval()
    try:
        for ids in batches:
            model(ids)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    share = lambda counts: (counts / counts.sum(1, keepdim=True).clamp_min(1)).tolist()  # noqa: E731
    return {"first_choice": share(first), "routed": share(routed)}


def busiest_share(table: list[list[float]]) -> float:
    """The busiest expert's share, per layer, averaged over the layers: one figure for a model.
    Example: busiest_share([[0.5, 0.3, 0.2], [0.4, 0.4, 0.2]]) -> 0.45"""
    return sum(max(row) for row in table) / len(table)
