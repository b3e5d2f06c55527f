"""Mixture-of-experts pieces with TorchTitan's parameter names and math.

A MoE layer is ``moe.router.gate`` (a ``[num_experts, dim]`` linear), ``moe.experts.{w1,w2,w3}``
(every expert's weights stacked: ``w1``/``w3`` ``[num_experts, hidden, dim]``, ``w2``
``[num_experts, dim, hidden]``), optional ``moe.shared_experts.{w1,w2,w3}`` (a dense FFN every
token goes through) and, with auxiliary-loss-free load balancing, the ``moe.expert_bias``
buffer: a per-expert bias added to the scores when choosing experts (never to the weights),
moved after each step towards even expert load; a checkpoint must keep it.

Under expert parallelism the stacked weights are DTensors sharded by expert; tokens are gathered
over the expert-parallel ranks, each rank runs its own experts on every token routed to them,
and the partial outputs are summed back to the ranks that own the tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dcpkit.models.llama3 import FeedForward, RMSNorm


@dataclass(frozen=True)
class MoEArgs:
    """Routing and expert shapes of one MoE layer."""

    num_experts: int = 8
    """Routed experts per MoE layer."""
    hidden_dim: int = 256
    """Hidden size of each expert (and, times ``num_shared_experts``, of the shared FFN)."""
    top_k: int = 2
    """Experts chosen per token."""
    num_shared_experts: int = 0
    """Experts every token goes through (one FFN of ``hidden_dim * num_shared_experts``)."""
    score_func: str = "softmax"
    """``softmax`` over all experts (Qwen 3) or per-expert ``sigmoid`` (DeepSeek-V3)."""
    route_norm: bool = False
    """Renormalize the chosen experts' scores to sum to one."""
    route_scale: float = 1.0
    """Factor on the routing weights (DeepSeek-V3's ``routed_scaling_factor``)."""
    num_expert_groups: int | None = None
    """Group-limited routing: experts split into this many groups..."""
    num_limited_groups: int | None = None
    """...of which each token may use the best this many (ranked by their top-2 scores' sum)."""
    load_balance_coeff: float | None = None
    """Step size of the auxiliary-loss-free ``expert_bias`` update; None: no bias."""

    def __post_init__(self) -> None:
        if self.score_func not in ("softmax", "sigmoid"):
            raise ValueError(f"score_func must be softmax or sigmoid, got {self.score_func!r}")
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"top_k ({self.top_k}) must be in 1..num_experts")
        if self.num_expert_groups and self.num_experts % self.num_expert_groups:
            raise ValueError(
                f"num_experts ({self.num_experts}) must be divisible by num_expert_groups "
                f"({self.num_expert_groups})"
            )


class Router(nn.Module):
    """Token-choice top-k routing; ``forward`` -> (chosen experts, their weights)."""

    def __init__(self, dim: int, args: MoEArgs) -> None:
        super().__init__()
        self.args = args
        self.gate = nn.Linear(dim, args.num_experts, bias=False)

    def forward(
        self, x: torch.Tensor, expert_bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        a = self.args
        logits = F.linear(x.float(), self.gate.weight.float())
        scores = logits.sigmoid() if a.score_func == "sigmoid" else logits.softmax(dim=-1)
        choice = scores if expert_bias is None else scores + expert_bias
        if a.num_expert_groups and a.num_limited_groups:
            groups = choice.view(-1, a.num_expert_groups, a.num_experts // a.num_expert_groups)
            group_scores = groups.topk(min(2, groups.shape[-1]), dim=-1)[0].sum(dim=-1)
            keep = group_scores.topk(a.num_limited_groups, dim=-1, sorted=False)[1]
            mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
            mask = mask.unsqueeze(-1).expand_as(groups).reshape(-1, a.num_experts)
            choice = choice.masked_fill(~mask, float("-inf"))
        chosen = choice.topk(a.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(-1, chosen)
        if a.route_norm:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return chosen, weights * a.route_scale

    def init_weights(self, std: float) -> None:
        nn.init.trunc_normal_(self.gate.weight, mean=0.0, std=std)


# torch 2.13 renamed all_gather_into_tensor (which now warns); 2.11 has only the old name.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class _GatherTokens(torch.autograd.Function):
    """All-gather along dim 0 over ``group``; the gradient is summed, each rank keeps its part."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        ctx.n = x.shape[0]
        out = x.new_empty((x.shape[0] * dist.get_world_size(group), *x.shape[1:]))
        _all_gather(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        me = dist.get_rank(ctx.group)
        return grad[me * ctx.n : (me + 1) * ctx.n].clone(), None


class _SumToOwners(torch.autograd.Function):
    """Sum the ranks' partial outputs of all tokens and keep this rank's tokens; the gradient is
    gathered (every rank's experts contributed to every token)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        n = x.shape[0] // dist.get_world_size(group)
        me = dist.get_rank(group)
        return x[me * n : (me + 1) * n].clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        out = grad.new_empty((grad.shape[0] * dist.get_world_size(ctx.group), *grad.shape[1:]))
        _all_gather(out, grad, group=ctx.group)
        return out, None


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class GroupedExperts(nn.Module):
    """Every expert's SwiGLU FFN, stacked: ``w1``/``w3`` ``[E, hidden, dim]``, ``w2``
    ``[E, dim, hidden]``. Under expert parallelism (``ep_group`` set) this rank holds experts
    ``first_expert ..`` of the stack."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.ep_group: Any = None
        self.first_expert = 0

    def init_weights(self, init_std: float) -> None:
        nn.init.trunc_normal_(self.w1, mean=0.0, std=0.02)
        for w in (self.w2, self.w3):
            nn.init.trunc_normal_(w, mean=0.0, std=init_std)

    def forward(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``x`` ``[tokens, dim]``, ``chosen``/``weights`` ``[tokens, top_k]``."""
        group = self.ep_group
        if group is not None:
            x = _GatherTokens.apply(x, group)
            weights = _GatherTokens.apply(weights, group)
            gathered = chosen.new_empty((x.shape[0], chosen.shape[1]))
            _all_gather(gathered, chosen.contiguous(), group=group)
            chosen = gathered
        w1, w2, w3 = _local(self.w1), _local(self.w2), _local(self.w3)
        top_k = chosen.shape[1]
        flat = chosen.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        token = order // top_k
        scale = weights.flatten()[order].unsqueeze(-1)
        out = torch.zeros_like(x)
        start = sum(counts[: self.first_expert])
        for local in range(w1.shape[0]):
            n = counts[self.first_expert + local]
            if n == 0:
                continue
            rows = token[start : start + n]
            h = x[rows]
            h = F.silu(F.linear(h, w1[local])) * F.linear(h, w3[local])
            y = F.linear(h, w2[local]) * scale[start : start + n].to(h.dtype)
            out = out.index_add(0, rows, y)
            start += n
        if group is not None:
            out = _SumToOwners.apply(out, group)
        return out


class MoE(nn.Module):
    """Router, routed experts, optional shared experts and expert bias (TorchTitan's ``moe``)."""

    def __init__(self, dim: int, args: MoEArgs) -> None:
        super().__init__()
        self.args = args
        self.router = Router(dim, args)
        self.experts = GroupedExperts(dim, args.hidden_dim, args.num_experts)
        self.shared_experts = (
            FeedForward(dim, args.hidden_dim * args.num_shared_experts)
            if args.num_shared_experts
            else None
        )
        if args.load_balance_coeff is not None:
            self.register_buffer("expert_bias", torch.zeros(args.num_experts), persistent=True)
        else:
            self.expert_bias = None
        # Tokens routed to each expert since the last bias update (not checkpointed: it is
        # reset every step).
        self.register_buffer("tokens_per_expert", torch.zeros(args.num_experts), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        chosen, weights = self.router(flat, self.expert_bias)
        if self.expert_bias is not None:
            with torch.no_grad():
                self.tokens_per_expert += torch.bincount(
                    chosen.flatten(), minlength=self.args.num_experts
                ).to(self.tokens_per_expert.dtype)
        out = self.experts(flat, chosen, weights.to(flat.dtype))
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out.reshape(shape)

    def init_weights(self, init_std: float) -> None:
        self.router.init_weights(init_std)
        self.experts.init_weights(init_std)
        if self.shared_experts is not None:
            self.shared_experts.init_weights(init_std)
        with torch.no_grad():
            if self.expert_bias is not None:
                self.expert_bias.zero_()
            self.tokens_per_expert.zero_()


class MoEBlock(nn.Module):
    """A decoder block whose FFN is a MoE (``moe``), or a dense ``feed_forward`` in the first
    ``n_dense_layers`` layers. Subclasses choose the attention (``attention_cls``)."""

    attention_cls: type[nn.Module]

    def __init__(self, layer_id: int, args: Any) -> None:
        super().__init__()
        self.attention = self.attention_cls(args)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        if layer_id < args.n_dense_layers:
            self.feed_forward: nn.Module | None = FeedForward(args.dim, args.hidden_dim)
            self.moe: MoE | None = None
        else:
            self.feed_forward = None
            self.moe = MoE(args.dim, args.moe)
        self.weight_init_std = 0.02 / (2 * (layer_id + 1)) ** 0.5

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope)
        ffn = self.moe if self.moe is not None else self.feed_forward
        return h + ffn(self.ffn_norm(h))

    def init_weights(self) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.weight_init_std)
        (self.moe or self.feed_forward).init_weights(self.weight_init_std)


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


@torch.no_grad()
def update_expert_bias(model: nn.Module, groups: list[Any] | None = None) -> None:
    """TorchTitan's auxiliary-loss-free load balancing, once per optimizer step: each expert's
    bias moves by ``load_balance_coeff`` towards the mean load (token counts summed over the
    data-parallel ``groups``), centred; the counts restart at zero."""
    for moe in moe_layers(model):
        if moe.expert_bias is None:
            continue
        counts = moe.tokens_per_expert.clone()
        for group in groups or []:
            dist.all_reduce(counts, group=group)
        delta = moe.args.load_balance_coeff * torch.sign(counts.mean() - counts)
        moe.expert_bias.add_(delta - delta.mean())
        moe.tokens_per_expert.zero_()
