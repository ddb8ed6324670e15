"""Mixture-of-Experts: router, stacked routed experts, shared experts, per-expert statistics.

Routing follows the DeepSeek family (which GLM-4 MoE, Kimi K2 and Qwen3-MoE are special cases
of): scores are the softmax or sigmoid of the router logits; an optional score-correction bias
is added for *selecting* experts only; selection can first keep the best `topk_group` of
`n_group` expert groups (`group_limited_greedy` ranks groups by their best expert, `noaux_tc` by
the sum of their best two); the chosen experts' unbiased scores are optionally renormalised and
scaled by `routed_scaling_factor`.

Routed experts live in two stacked tensors (`gate_up_proj` [E, 2I, H], `down_proj` [E, H, I],
the layout transformers keeps in memory). A forward pass sorts the (token, expert) pairs by
expert so each expert's tokens are contiguous, then runs one grouped matmul per projection (or,
for CPU steps that route few pairs over many experts, a loop over the non-empty experts' row
slices, which measures faster there).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ember.distributed.comm import GroupComm
from ember.layers.linear import (
    MergedColumnParallelLinear,
    RowParallelLinear,
    WeightSource,
    copy_weight,
)

SCORING_FUNCS = ("softmax", "sigmoid")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class MoEConfig:
    hidden_size: int
    num_experts: int
    top_k: int
    intermediate_size: int  # per routed expert
    num_shared_experts: int = 0  # shared MLP width = num_shared_experts * intermediate_size
    scoring_func: str = "softmax"
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    correction_bias: bool = False  # e_score_correction_bias, used for selection only

    def __post_init__(self) -> None:
        if self.num_experts < 1:
            raise ValueError(f"n_routed_experts must be >= 1, got {self.num_experts}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must be in 1..{self.num_experts}, "
                             f"got {self.top_k}")
        if self.scoring_func not in SCORING_FUNCS:
            raise ValueError(f"scoring_func {self.scoring_func!r} is not supported "
                             f"(supported: {', '.join(SCORING_FUNCS)})")
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(f"topk_method {self.topk_method!r} is not supported "
                             f"(supported: {', '.join(TOPK_METHODS)})")
        if self.n_group < 1 or self.num_experts % self.n_group:
            raise ValueError(f"n_group ({self.n_group}) must divide n_routed_experts "
                             f"({self.num_experts})")
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"topk_group must be in 1..n_group ({self.n_group}), "
                             f"got {self.topk_group}")
        group_size = self.num_experts // self.n_group
        if self.grouped and self.top_k > self.topk_group * group_size:
            raise ValueError(f"num_experts_per_tok ({self.top_k}) exceeds the experts in "
                             f"topk_group ({self.topk_group}) groups of {group_size}")
        if self.grouped and self.topk_method == "noaux_tc" and group_size < 2:
            raise ValueError("n_group: noaux_tc ranks groups by their best two experts, "
                             f"so groups need >= 2 experts (got {group_size})")

    @property
    def grouped(self) -> bool:
        return self.topk_method != "greedy" and self.n_group > 1

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], *, scoring_func: str, topk_method: str,
                correction_bias: bool, norm_topk_prob: bool) -> MoEConfig:
        """Read a Hugging Face config; keyword arguments are the model family's defaults."""
        num_experts = (cfg.get("n_routed_experts") or cfg.get("num_experts")
                       or cfg.get("num_local_experts"))
        if not num_experts:
            raise ValueError("n_routed_experts: the config names no routed experts")
        topk_method = cfg.get("topk_method") or topk_method
        return cls(
            hidden_size=cfg["hidden_size"],
            num_experts=num_experts,
            top_k=cfg["num_experts_per_tok"],
            intermediate_size=cfg["moe_intermediate_size"],
            num_shared_experts=cfg.get("n_shared_experts") or 0,
            scoring_func=cfg.get("scoring_func") or scoring_func,
            topk_method=topk_method,
            n_group=cfg.get("n_group") or 1,
            topk_group=cfg.get("topk_group") or 1,
            norm_topk_prob=cfg.get("norm_topk_prob", norm_topk_prob),
            routed_scaling_factor=cfg.get("routed_scaling_factor") or 1.0,
            correction_bias=correction_bias or topk_method == "noaux_tc",
        )


class Router(nn.Module):
    """Picks top_k experts per token; returns (weights [T, k] fp32, expert ids [T, k]).

    Its parameters stay fp32 whatever dtype the model is cast to (as in transformers): a
    rounded correction bias or gate would pick different experts.
    """

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.zeros(cfg.num_experts, cfg.hidden_size))
        self.e_score_correction_bias = (nn.Parameter(torch.zeros(cfg.num_experts))
                                        if cfg.correction_bias else None)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Router:
        super()._apply(fn, recurse)
        for p in self.parameters(recurse=False):
            p.data = p.data.float()
        return self

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        logits = F.linear(x.float(), self.weight.float())
        scores = logits.sigmoid() if cfg.scoring_func == "sigmoid" else logits.softmax(-1)
        choice = scores
        if self.e_score_correction_bias is not None:
            choice = scores + self.e_score_correction_bias.float()
        if cfg.grouped:
            grouped = choice.view(x.shape[0], cfg.n_group, -1)
            if cfg.topk_method == "noaux_tc":
                group_scores = grouped.topk(2, dim=-1).values.sum(-1)
            else:
                group_scores = grouped.amax(-1)
            keep = group_scores.topk(cfg.topk_group, dim=-1).indices
            drop = torch.ones_like(group_scores, dtype=torch.bool).scatter_(1, keep, False)
            choice = grouped.masked_fill(drop.unsqueeze(-1), float("-inf")).flatten(1)
        ids = choice.topk(cfg.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * cfg.routed_scaling_factor, ids


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor,
                   host_counts: list[int] | None = None) -> torch.Tensor:
    """x [N, in] sorted by group, weight [G, out, in] -> [N, out]; group g owns its rows.

    `offsets` [G] int32 are the groups' end rows. Without `host_counts` this is torch's grouped
    GEMM (kernels exist on CPU and for CUDA bf16); with them it loops over the non-empty groups'
    contiguous row slices, for devices and dtypes that lack the kernel.
    """
    if host_counts is None:
        return F.grouped_mm(x, weight.transpose(1, 2), offs=offsets)
    out = x.new_empty(x.shape[0], weight.shape[1])
    start = 0
    for g, n in enumerate(host_counts):
        if n:
            out[start:start + n] = x[start:start + n] @ weight[g].t()
            start += n
    return out


class FusedExperts(nn.Module):
    """E SwiGLU experts as stacked weights; tokens grouped by expert, one grouped GEMM each."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size,
                                                     hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                use_grouped_mm: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H], weights/ids [T, k] -> (out [T, H], tokens per expert [E])."""
        t, k = ids.shape
        rows = torch.arange(t * k, device=ids.device) // k
        y, counts = self.expert_outputs(x, rows, ids.flatten(), use_grouped_mm)
        out = torch.bmm(weights.to(x.dtype).unsqueeze(1), y.view(t, k, -1)).squeeze(1)
        return out, counts

    def expert_outputs(self, x: torch.Tensor, rows: torch.Tensor, experts: torch.Tensor,
                       use_grouped_mm: bool | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pair i is (token x[rows[i]], expert experts[i]) -> (each pair's unweighted expert
        output [P, H], pairs per expert [E])."""
        order = experts.argsort(stable=True)
        counts = torch.bincount(experts, minlength=self.num_experts)
        if use_grouped_mm is None:
            use_grouped_mm = self.prefers_grouped_mm(x, experts.numel())
        host_counts = None if use_grouped_mm else counts.tolist()
        offsets = counts.cumsum(0).to(torch.int32)
        xs = x[rows[order]]
        gate, up = grouped_linear(xs, self.gate_up_proj, offsets, host_counts).chunk(2, dim=-1)
        ys = grouped_linear(F.silu(gate) * up, self.down_proj, offsets, host_counts)
        y = torch.empty_like(ys)
        y[order] = ys
        return y, counts

    def prefers_grouped_mm(self, x: torch.Tensor, pairs: int) -> bool:
        """CUDA: grouped GEMM for bf16 (its kernel's dtype). CPU: torch's grouped GEMM pays for
        every group, empty or not, so when a step routes few (token, expert) pairs, as small
        decode batches over hundreds of experts do, looping over the non-empty groups is
        faster; the crossover, measured with benchmarks/moe_layer.py, is near pairs = E / 4."""
        if x.device.type == "cuda":
            return x.dtype == torch.bfloat16
        return x.device.type == "cpu" and 4 * pairs >= self.num_experts

    def load_expert(self, expert: int, proj: str, tensor: WeightSource) -> None:
        """Copy one checkpoint matrix (`experts.{expert}.{proj}.weight`) into stack slot
        `expert`."""
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert index {expert} out of range 0..{self.num_experts - 1}")
        i = self.intermediate_size
        target = {"gate_proj": self.gate_up_proj[expert, :i],
                  "up_proj": self.gate_up_proj[expert, i:],
                  "down_proj": self.down_proj[expert]}[proj]
        copy_weight(target, tensor, f"experts.{expert}.{proj}.weight")


class GatedMLP(nn.Module):
    """SwiGLU MLP with gate and up stacked in one matrix (dense layers and shared experts),
    tensor-parallel over `group` (the down projection's sum all-reduced unless
    reduce_output=False)."""

    def __init__(self, hidden_size: int, intermediate_size: int, group: GroupComm | None = None,
                 reduce_output: bool = True) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2,
                                                       group=group)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, group=group,
                                           reduce_output=reduce_output)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)

    def load(self, name: str, tensor: WeightSource) -> str:
        """Copy checkpoint `gate_proj.weight`, `up_proj.weight` or `down_proj.weight` (this
        rank's shard); returns the parameter written."""
        proj, _, leaf = name.partition(".")
        if proj not in EXPERT_PROJS or leaf != "weight":
            raise ValueError(f"checkpoint tensor 'mlp.{name}' has no place in a gated MLP")
        if proj == "down_proj":
            self.down_proj.load_weight(leaf, tensor)
            return "down_proj.weight"
        self.gate_up_proj.load_weight(leaf, tensor, 0 if proj == "gate_proj" else 1)
        return "gate_up_proj.weight"


class SparseMoeBlock(nn.Module):
    """Router + routed experts (+ shared experts), with per-expert token counts.

    `expert_counts[e]` accumulates how many tokens were routed to expert e since the last
    `reset_expert_counts()`; load balancing and metrics read it.
    """

    def __init__(self, cfg: MoEConfig, experts: FusedExperts | None = None,
                 shared_experts: GatedMLP | None = None) -> None:
        """`experts` / `shared_experts`: sharded replacements (expert parallelism); by default
        all experts, whole."""
        super().__init__()
        self.cfg = cfg
        self.gate = Router(cfg)
        self.experts = experts or FusedExperts(cfg.num_experts, cfg.hidden_size,
                                               cfg.intermediate_size)
        if shared_experts is None and cfg.num_shared_experts:
            shared_experts = GatedMLP(cfg.hidden_size,
                                      cfg.intermediate_size * cfg.num_shared_experts)
        self.shared_experts = shared_experts
        # A plain attribute, not a buffer: models are built on the meta device and then
        # materialised uninitialised, which a buffer's zeros would not survive.
        self.expert_counts = torch.zeros(cfg.num_experts, dtype=torch.int64, device="cpu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out, counts = self.experts(x, weights, ids)
        if self.expert_counts.device != counts.device:
            self.expert_counts = self.expert_counts.to(counts.device)
        self.expert_counts += counts
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

    def reset_expert_counts(self) -> None:
        # a new tensor, not zero_(): counts moved to a device under inference mode are
        # inference tensors, which cannot be updated in place outside it
        self.expert_counts = torch.zeros_like(self.expert_counts)

    def load(self, name: str, tensor: WeightSource) -> str:
        """Copy a checkpoint tensor named relative to the block (`gate.weight`,
        `experts.3.up_proj.weight`, `experts.gate_up_proj`, `shared_experts.down_proj.weight`);
        returns the parameter written."""
        parts = name.split(".")
        has_bias = self.gate.e_score_correction_bias is not None
        if name == "gate.weight" or (name == "gate.e_score_correction_bias" and has_bias):
            copy_weight(self.get_parameter(name), tensor, name)
            return name
        if name in ("experts.gate_up_proj", "experts.down_proj"):
            self.load_stacked_experts(name.split(".")[1], tensor)
            return name
        if (len(parts) == 4 and parts[0] == "experts" and parts[1].isdigit()
                and parts[2] in EXPERT_PROJS and parts[3] == "weight"):
            self.load_expert(int(parts[1]), parts[2], tensor)
            return "experts.down_proj" if parts[2] == "down_proj" else "experts.gate_up_proj"
        if parts[0] == "shared_experts" and self.shared_experts is not None:
            return "shared_experts." + self.shared_experts.load(".".join(parts[1:]), tensor)
        raise ValueError(f"checkpoint tensor 'mlp.{name}' has no place in a MoE block")

    def load_expert(self, expert: int, proj: str, tensor: WeightSource) -> None:
        """One expert's checkpoint matrix (`experts.{expert}.{proj}.weight`)."""
        self.experts.load_expert(expert, proj, tensor)

    def load_stacked_experts(self, param: str, tensor: WeightSource) -> None:
        """All experts' `gate_up_proj` [E, 2I, H] or `down_proj` [E, H, I] in one tensor."""
        copy_weight(self.experts.get_parameter(param), tensor, f"experts.{param}")
