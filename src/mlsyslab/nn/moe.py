"""A mixture-of-experts MLP: a top-k router over SwiGLU experts (Shazeer et al. 2017; Fedus et al. 2021).

Each token's router logits give probabilities over E experts; the token goes to its k most likely
experts and their outputs are summed weighted by the renormalised probabilities. An expert takes at
most capacity = ⌈capacity_factor · tokens · k / E⌉ tokens; the rest are dropped (they contribute
nothing from that expert and are counted). The auxiliary load-balancing loss (Switch Transformer,
eq. 4) is E · Σ_e f_e · P_e, where f_e is the fraction of routed slots sent to expert e and P_e its
mean router probability: 1 when perfectly balanced. Expert parallelism (parallel/expert.py) runs the
same layer with its experts spread over ranks.
Twin: predict.architecture (active parameters), predict.algorithm.moe_imbalance (drops).
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mlsyslab.nn.llama import SwiGLU


@dataclass
class Routing:
    """Where each of the tokens·k slots goes, in expert order."""

    expert: torch.Tensor  # [slots] expert of each kept slot, ascending
    token: torch.Tensor  # [slots] its token
    weight: torch.Tensor  # [slots] its combine weight
    dropped: int  # slots over capacity
    aux_loss: torch.Tensor


class MixtureOfExperts(nn.Module):
    def __init__(self, hidden: int, ffn_hidden: int, experts: int, top_k: int = 2, capacity_factor: float = 1.25):
        super().__init__()
        self.experts_count, self.top_k, self.capacity_factor = experts, top_k, capacity_factor
        self.router = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(hidden, ffn_hidden) for _ in range(experts))
        self.last_routing: Routing | None = None

    def route(self, tokens: torch.Tensor, logits: torch.Tensor | None = None) -> Routing:
        """Top-k routing of [n, hidden] tokens with per-expert capacity (first come, first served); `logits`: the
        router's product of them, when computed elsewhere (parallel.tensor under sequence parallelism)."""
        probabilities = F.softmax((self.router(tokens) if logits is None else logits).float(), dim=-1)
        weights, experts = probabilities.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        n = tokens.shape[0]
        expert, token, weight = experts.reshape(-1), torch.arange(n).repeat_interleave(self.top_k), weights.reshape(-1)
        order = torch.sort(expert * (n * self.top_k) + torch.arange(expert.numel()), stable=True).indices
        expert, token, weight = expert[order], token[order], weight[order]
        capacity = math.ceil(self.capacity_factor * n * self.top_k / self.experts_count)
        rank_in_expert = torch.arange(expert.numel()) - torch.searchsorted(expert, expert)
        kept = rank_in_expert < capacity
        fraction = torch.bincount(expert, minlength=self.experts_count).float() / expert.numel()
        aux = self.experts_count * (fraction * probabilities.mean(0)).sum()
        return Routing(expert[kept], token[kept], weight[kept], int((~kept).sum()), aux)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The mixture's output for x [..., hidden], plus `residual` when given (as `SwiGLU.forward`)."""
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        routing = self.route(tokens)
        self.last_routing = routing
        out = combine(tokens, routing, run_routed(self.experts, tokens, routing)).reshape(shape)
        return out if residual is None else residual + out


def run_experts(experts: nn.ModuleList, rows: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
    """Each row's output from its expert: `rows` sorted by `expert_ids` (ascending indices into `experts`)."""
    counts = torch.bincount(expert_ids, minlength=len(experts)).tolist()
    return torch.cat([expert(chunk) for expert, chunk in zip(experts, rows.split(counts))])


def run_routed(experts: nn.ModuleList, tokens: torch.Tensor, routing) -> torch.Tensor:
    """One output row per routed copy of `tokens`, in `routing`'s order, from experts all held here (the
    local form of `parallel.expert.ExpertDispatch`)."""
    return run_experts(experts, tokens[routing.token], routing.expert)


AUX_LOSS_WEIGHT = 0.01  # α of the Switch Transformer (Fedus et al. 2021, §2.2), added to the language-model loss


def balancing_losses(module: nn.Module) -> list[torch.Tensor]:
    """The auxiliary losses of the MoE layers inside `module` in their last forward."""
    return [layer.last_routing.aux_loss for layer in module.modules()
            if isinstance(layer, MixtureOfExperts) and layer.last_routing is not None]


def load_balancing_loss(model: nn.Module) -> torch.Tensor | None:
    """The mean auxiliary loss of the model's MoE layers in its last forward (None for a dense model).
    Each layer's is over the tokens it routed: under data parallelism, one rank's (as Megatron-LM and
    DeepSpeed-MoE compute it)."""
    losses = balancing_losses(model)
    return torch.stack(losses).mean() if losses else None


def combine(tokens: torch.Tensor, routing: Routing, expert_outputs: torch.Tensor) -> torch.Tensor:
    """Σ over each token's kept slots of weight · expert output (dropped slots add nothing)."""
    out = torch.zeros_like(tokens)
    return out.index_add(0, routing.token, expert_outputs * routing.weight[:, None].to(expert_outputs.dtype))
