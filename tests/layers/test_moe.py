"""MoE layer: routers against transformers' routers, grouped experts against a per-token
reference, token statistics, config validation."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from ember.layers.moe import FusedExperts, MoEConfig, Router, SparseMoeBlock

HIDDEN, EXPERTS, TOKENS = 32, 16, 64


def routed(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows sorted by expert id, so selections compare regardless of top-k order."""
    order = ids.argsort(dim=-1)
    return ids.gather(1, order), weights.float().gather(1, order)


def hf_router(kind: str, **overrides):
    from transformers import DeepseekV2Config, DeepseekV3Config, Qwen3MoeConfig
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    common = dict(hidden_size=HIDDEN, num_experts_per_tok=4, **overrides)
    if kind == "deepseek_v3":
        return DeepseekV3TopkRouter(DeepseekV3Config(n_routed_experts=EXPERTS, **common))
    if kind == "deepseek_v2":
        return DeepseekV2TopkRouter(DeepseekV2Config(n_routed_experts=EXPERTS, **common))
    return Qwen3MoeTopKRouter(Qwen3MoeConfig(num_experts=EXPERTS, **common))


CASES = {
    # (transformers router, its config, ember's routing settings)
    "sigmoid noaux_tc grouped, bias": (
        "deepseek_v3", dict(n_group=4, topk_group=2, norm_topk_prob=True,
                            routed_scaling_factor=2.5),
        dict(scoring_func="sigmoid", topk_method="noaux_tc", n_group=4, topk_group=2,
             norm_topk_prob=True, routed_scaling_factor=2.5, correction_bias=True)),
    "softmax group_limited_greedy": (
        "deepseek_v2", dict(topk_method="group_limited_greedy", n_group=4, topk_group=2,
                            routed_scaling_factor=16.0),
        dict(scoring_func="softmax", topk_method="group_limited_greedy", n_group=4,
             topk_group=2, routed_scaling_factor=16.0)),
    "softmax greedy": (
        "deepseek_v2", dict(topk_method="greedy", n_group=4, topk_group=2),
        dict(scoring_func="softmax", topk_method="greedy", n_group=4, topk_group=2)),
    "softmax greedy, normalised (qwen3_moe)": (
        "qwen3_moe", dict(norm_topk_prob=True),
        dict(scoring_func="softmax", topk_method="greedy", norm_topk_prob=True)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_router_matches_transformers(case):
    kind, hf_kwargs, ours = CASES[case]
    torch.manual_seed(0)
    ref = hf_router(kind, **hf_kwargs)
    router = Router(MoEConfig(HIDDEN, EXPERTS, 4, 8, **ours))
    with torch.no_grad():
        ref.weight.normal_(0, 0.3)
        router.weight.copy_(ref.weight)
        if router.e_score_correction_bias is not None:
            ref.e_score_correction_bias.normal_(0, 0.2)
            router.e_score_correction_bias.copy_(ref.e_score_correction_bias)
    x = torch.randn(TOKENS, HIDDEN)
    _, ref_weights, ref_indices = ref(x)
    ref_ids, ref_w = routed(ref_weights, ref_indices)
    ids, w = routed(*router(x))
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w, atol=1e-6, rtol=1e-6)


def test_correction_bias_picks_experts_but_does_not_weight_them():
    cfg = MoEConfig(HIDDEN, EXPERTS, 4, 8, scoring_func="sigmoid", topk_method="noaux_tc",
                    norm_topk_prob=False, correction_bias=True)
    router = Router(cfg)
    torch.manual_seed(1)
    with torch.no_grad():
        router.weight.normal_(0, 0.3)
        router.e_score_correction_bias.zero_()
        router.e_score_correction_bias[5] = 10.0  # always chosen
    x = torch.randn(TOKENS, HIDDEN)
    weights, ids = router(x)
    assert (ids == 5).any(dim=-1).all()
    col = (ids == 5).float().argmax(dim=-1, keepdim=True)
    expected = torch.sigmoid(x @ router.weight[5])
    torch.testing.assert_close(weights.gather(1, col).squeeze(1), expected)


def grouped_limit_respected(ids: torch.Tensor, n_group: int, topk_group: int) -> bool:
    groups = ids // (EXPERTS // n_group)
    return all(len(set(row.tolist())) <= topk_group for row in groups)


def test_group_limited_routing_stays_in_topk_groups():
    cfg = MoEConfig(HIDDEN, EXPERTS, 4, 8, scoring_func="sigmoid", topk_method="noaux_tc",
                    n_group=8, topk_group=2, correction_bias=True)
    router = Router(cfg)
    with torch.no_grad():
        router.weight.normal_(0, 1.0)
    _, ids = router(torch.randn(TOKENS, HIDDEN))
    assert grouped_limit_respected(ids, 8, 2)
    ungrouped = Router(dataclasses.replace(cfg, topk_method="greedy"))
    ungrouped.load_state_dict(router.state_dict())
    _, free_ids = ungrouped(torch.randn(TOKENS, HIDDEN))
    assert not grouped_limit_respected(free_ids, 8, 2)  # the limit is what made the difference


def reference_experts(experts: FusedExperts, x: torch.Tensor, weights: torch.Tensor,
                      ids: torch.Tensor) -> torch.Tensor:
    """Token by token, expert by expert: the definition."""
    out = torch.zeros_like(x, dtype=torch.float32)
    i = experts.intermediate_size
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), ids[t].tolist(), strict=True):
            gu = experts.gate_up_proj[e].float() @ x[t].float()
            h = F.silu(gu[:i]) * gu[i:]
            out[t] += w * (experts.down_proj[e].float() @ h)
    return out


@pytest.mark.parametrize("use_grouped_mm", [True, False, None],
                         ids=["grouped_mm", "slices", "policy"])
@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_fused_experts_match_per_token_reference(use_grouped_mm, tokens):
    torch.manual_seed(tokens)
    experts = FusedExperts(EXPERTS, HIDDEN, 8)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.2)
        experts.down_proj.normal_(0, 0.2)
    x = torch.randn(tokens, HIDDEN)
    ids = torch.stack([torch.randperm(EXPERTS - 3)[:4] for _ in range(tokens)])  # 13..15 idle
    weights = torch.rand(tokens, 4)
    out, counts = experts(x, weights, ids, use_grouped_mm=use_grouped_mm)
    torch.testing.assert_close(out, reference_experts(experts, x, weights, ids),
                               atol=1e-5, rtol=1e-5)
    assert torch.equal(counts, torch.bincount(ids.flatten(), minlength=EXPERTS))
    assert counts[-3:].sum() == 0


def test_fused_experts_bf16_close_to_fp32():
    torch.manual_seed(3)
    experts = FusedExperts(EXPERTS, HIDDEN, 8)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.2)
        experts.down_proj.normal_(0, 0.2)
    x = torch.randn(24, HIDDEN)
    ids = torch.stack([torch.randperm(EXPERTS)[:4] for _ in range(24)])
    weights = torch.rand(24, 4)
    ref = reference_experts(experts, x, weights, ids)
    out, _ = experts.to(torch.bfloat16)(x.bfloat16(), weights, ids)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=0.05 * ref.abs().max().item(), rtol=0)


def test_block_matches_transformers_moe_and_counts_tokens():
    """DeepseekV3MoE's in-memory (stacked) tensors load into the block by name; outputs match;
    expert_counts accumulate over calls until reset."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    hf_cfg = DeepseekV3Config(hidden_size=HIDDEN, moe_intermediate_size=8, n_routed_experts=EXPERTS,
                              num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=2,
                              routed_scaling_factor=2.5, norm_topk_prob=True)
    torch.manual_seed(4)
    ref = DeepseekV3MoE(hf_cfg)
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.3)
        ref.gate.e_score_correction_bias.normal_(0, 0.2)
    block = SparseMoeBlock(MoEConfig.from_hf(
        hf_cfg.to_dict(), scoring_func="sigmoid", topk_method="noaux_tc", correction_bias=True,
        norm_topk_prob=True))
    state = {**dict(ref.named_parameters()), **dict(ref.named_buffers())}
    loaded = {block.load(name, t) for name, t in state.items()}
    assert loaded == set(dict(block.named_parameters()))
    x = torch.randn(TOKENS, HIDDEN)
    with torch.no_grad():
        torch.testing.assert_close(block(x), ref(x.unsqueeze(0)).squeeze(0), atol=1e-5, rtol=1e-5)
        block(x[:10])
    _, ids = block.gate(torch.cat((x, x[:10])))
    assert torch.equal(block.expert_counts, torch.bincount(ids.flatten(), minlength=EXPERTS))
    assert int(block.expert_counts.sum()) == 4 * (TOKENS + 10)
    block.reset_expert_counts()
    assert int(block.expert_counts.sum()) == 0


@pytest.mark.parametrize("bad, field", [
    (dict(n_group=3), "n_group"),
    (dict(n_group=4, topk_group=5), "topk_group"),
    (dict(scoring_func="relu"), "scoring_func"),
    (dict(topk_method="random"), "topk_method"),
    (dict(top_k=0), "num_experts_per_tok"),
    (dict(n_group=16, topk_group=2, top_k=2, topk_method="noaux_tc"), "n_group"),
    (dict(n_group=8, topk_group=1, top_k=4, topk_method="noaux_tc"), "num_experts_per_tok"),
])
def test_config_validation_names_the_field(bad, field):
    kwargs = dict(hidden_size=HIDDEN, num_experts=EXPERTS, top_k=4, intermediate_size=8)
    with pytest.raises(ValueError, match=field):
        MoEConfig(**{**kwargs, **bad})
