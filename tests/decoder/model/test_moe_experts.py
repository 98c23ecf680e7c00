"""The mixture-of-experts layer (model/moe.py) against the dense reference and transformers' routers.

The dense reference computes every expert for every row and masks the results by the routing, in float64:
the grouped dispatch must equal it at any row count, top-k and expert count, in fp32 and bf16, with the C++
SiLU*up and torch's, and over int8 experts against their dequantized weights. An expert no row chose is
filled with NaN, so an expert path that read it would return NaN.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig
from transformers.models.mixtral.modeling_mixtral import MixtralExperts, MixtralTopKRouter
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from services.common.plan import ExecutionPlan
from services.decoder.kernels import gemv_cpu
from services.decoder.model.linear import Linear
from services.decoder.model.matmul_choice import choose_gemv
from services.decoder.model.moe import Experts, Router, Routing, time_gemv
from services.decoder.model.moe_config import MoeConfig
from services.decoder.model.quantization import dequantize
from tests.tolerance import assert_close

pytestmark = pytest.mark.numerics

HIDDEN = 64


def moe(experts: int, top_k: int, size: int, norm_topk: bool = True, fp32: bool = False) -> MoeConfig:
    return MoeConfig(experts, top_k, size, norm_topk, fp32, (True,))


def make_experts(cfg: MoeConfig, dtype: torch.dtype, seed: int = 0) -> Experts:
    g = torch.Generator().manual_seed(seed)
    m = Experts(HIDDEN, cfg)
    with torch.no_grad():
        m.gate_up_proj.data = (0.2 * torch.randn(m.gate_up_proj.shape, generator=g)).to(dtype)
        m.down_proj.data = (0.2 * torch.randn(m.down_proj.shape, generator=g)).to(dtype)
    return m


def random_routing(rows: int, cfg: MoeConfig, dtype: torch.dtype, seed: int) -> Routing:
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(cfg.num_experts, generator=g)[:cfg.top_k] for _ in range(rows)])
    weights = torch.rand(rows, cfg.top_k, generator=g) + 0.1
    return Routing(ids, (weights / weights.sum(1, keepdim=True)).to(dtype))


def dense_reference(x, gate_up, down, routing: Routing) -> torch.Tensor:
    """Every expert for every row in float64, each result times the row's weight for it (0 where unchosen)."""
    x, gate_up, down = x.double(), gate_up.double(), down.double()
    mask = torch.zeros(x.shape[0], gate_up.shape[0], dtype=torch.float64)
    mask.scatter_(1, routing.experts, routing.weights.double())
    gate, up = torch.einsum("nh,eoh->neo", x, gate_up).chunk(2, dim=2)
    y = torch.einsum("nei,ehi->neh", F.silu(gate) * up, down)
    return (y * mask[:, :, None]).sum(1)


def poison_unchosen(m: Experts, routing: Routing) -> None:
    unused = sorted(set(range(m.num_experts)) - set(routing.experts.flatten().tolist()))
    with torch.no_grad():
        for e in unused:
            m.gate_up_proj[e] = float("nan")
            m.down_proj[e] = float("nan")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("native,gemv", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("rows,experts,top_k,size", [(1, 8, 2, 32), (1, 128, 8, 48), (2, 8, 2, 32), (3, 4, 1, 16),
                                                      (7, 8, 8, 32), (64, 16, 4, 96), (200, 128, 8, 48)])
def test_grouped_dispatch_equals_the_dense_reference(dtype, native, gemv, rows, experts, top_k, size):
    """gemv: the few-row kernel for expert calls of up to MAX_ROWS rows (all of them at these row counts but
    the largest, where experts get many rows and some few)."""
    cfg = moe(experts, top_k, size)
    m = make_experts(cfg, dtype, seed=rows)
    m.native = native
    m.gemv_rows = gemv_cpu.MAX_ROWS if gemv else 0
    routing = random_routing(rows, cfg, dtype, seed=rows + 1)
    x = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(rows + 2)).to(dtype)
    want = dense_reference(x, m.gate_up_proj, m.down_proj, routing)
    poison_unchosen(m, routing)
    got = m(x, routing)
    assert got.dtype == dtype and got.shape == (rows, HIDDEN) and bool(got.isfinite().all())
    assert_close(got, want, dtype=dtype, k=max(HIDDEN, size), depth=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp32_routing_weights_scale_in_fp32(dtype):
    """Mixtral's fp32 weights: output * weight in fp32, summed, then rounded once (as transformers)."""
    cfg = moe(8, 2, 32, fp32=True)
    m = make_experts(cfg, dtype)
    routing = random_routing(5, cfg, torch.float32, seed=3)
    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(4)).to(dtype)
    assert_close(m(x, routing), dense_reference(x, m.gate_up_proj, m.down_proj, routing), dtype=dtype,
                 k=HIDDEN, depth=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 33])
def test_matches_transformers_experts(dtype, rows):
    """The same stacked weights in transformers' MixtralExperts (its default experts path)."""
    ref = MixtralExperts(MixtralConfig(hidden_size=HIDDEN, intermediate_size=32, num_local_experts=8)).to(dtype)
    cfg = moe(8, 2, 32, fp32=True)
    m = make_experts(cfg, dtype, seed=rows)
    with torch.no_grad():
        ref.gate_up_proj.copy_(m.gate_up_proj)
        ref.down_proj.copy_(m.down_proj)
    routing = random_routing(rows, cfg, torch.float32, seed=rows)
    x = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(9)).to(dtype)
    with torch.no_grad():
        want = ref(x, routing.experts, routing.weights)
    assert_close(m(x, routing), want, dtype=dtype, k=HIDDEN, depth=2)


@pytest.mark.parametrize("gemv", [False, True])
@pytest.mark.parametrize("rows,experts,top_k", [(1, 8, 2), (4, 16, 4), (40, 8, 2)])
def test_int8_experts_match_their_dequantized_weights(rows, experts, top_k, gemv):
    cfg = moe(experts, top_k, 48)
    m = make_experts(cfg, torch.float32, seed=rows)
    m.gemv_rows = gemv_cpu.MAX_ROWS if gemv else 0
    routing = random_routing(rows, cfg, torch.float32, seed=rows)
    x = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(rows)).float()
    m.quantize()
    assert m.quantized and m.gate_up_proj.numel() == 0 and m.gate_up_q.dtype == torch.int8
    gate_up = torch.stack([dequantize(q, s) for q, s in zip(m.gate_up_q, m.gate_up_scale, strict=True)])
    down = torch.stack([dequantize(q, s) for q, s in zip(m.down_q, m.down_scale, strict=True)])
    assert_close(m(x, routing), dense_reference(x, gate_up, down, routing), dtype=torch.int8, k=HIDDEN, depth=2)


ROUTERS = {   # family -> (transformers' router, its config with 16 experts, fp32 weights)
    "qwen3_moe": (Qwen3MoeTopKRouter, lambda **kw: Qwen3MoeConfig(num_experts=16, **kw), False),
    "qwen2_moe": (Qwen2MoeTopKRouter, lambda **kw: Qwen2MoeConfig(num_experts=16, **kw), False),
    "mixtral": (MixtralTopKRouter, lambda **kw: MixtralConfig(num_local_experts=16, **kw), True),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family,norm_topk", [("qwen3_moe", False), ("qwen3_moe", True), ("qwen2_moe", False),
                                              ("qwen2_moe", True), ("mixtral", True)])
def test_router_equals_transformers_router(family, norm_topk, dtype):
    """Same ops in the same dtypes: the experts and their weights are equal exactly, dtype included.
    (Mixtral has no norm_topk_prob: it always normalises.)"""
    cls, config, fp32 = ROUTERS[family]
    extra = {} if family == "mixtral" else {"norm_topk_prob": norm_topk}
    ref = cls(config(hidden_size=HIDDEN, num_experts_per_tok=3, **extra))
    assert ref.weight.shape == (16, HIDDEN)
    with torch.no_grad():
        ref.weight.data = torch.randn(16, HIDDEN, generator=torch.Generator().manual_seed(1)).to(dtype)
    ours = Router(HIDDEN, moe(16, 3, 32, norm_topk=norm_topk, fp32=fp32))
    ours.weight.data = ref.weight.data
    x = torch.randn(23, HIDDEN, generator=torch.Generator().manual_seed(2)).to(dtype)
    with torch.no_grad():
        _, weights, ids = ref(x)
    routing = ours(x)
    assert torch.equal(routing.experts, ids)
    assert routing.weights.dtype == weights.dtype and torch.equal(routing.weights, weights)
    assert routing.weights.dtype == (torch.float32 if fp32 else dtype)
    if norm_topk:
        assert_close(routing.weights.float().sum(1), torch.ones(23), dtype=dtype, k=3)


def test_expert_gemv_rows_follow_the_measurements_and_the_pins():
    """choose_gemv times the experts apart from the Linears, one choice per expert shape."""
    layers = [make_experts(moe(8, 2, 32), torch.float32, seed=i) for i in range(2)]
    model = torch.nn.ModuleList([Linear(HIDDEN, 96), *layers, make_experts(moe(4, 1, 48), torch.float32)])

    def linear_timer(group, rows):
        return (1e-6, 1.5e-6)                       # the library path wins every Linear

    def expert_timer(group, rows):                  # gemv_cpu wins the 8-expert shape up to 2 rows
        return (2e-6, 1e-6) if group[0].num_experts == 8 and rows <= 2 else (1e-6, 1.5e-6)
    record = ExecutionPlan()
    summary = choose_gemv(model, record, linear_timer, expert_timer)
    assert [m.gemv_rows for m in model] == [0, 2, 2, 0]
    assert summary == "gemv rows<=2 on experts 8x64x64"
    assert [(c.name, c.chosen) for c in record.choices] == [
        ("gemv 96x64+b", "off"), ("gemv experts 8x64x64", "on rows<=2"), ("gemv experts 4x96x64", "off")]
    assert choose_gemv(model, ExecutionPlan("gemv=on")).startswith(f"gemv rows<={gemv_cpu.MAX_ROWS}")
    assert [m.gemv_rows for m in model] == [gemv_cpu.MAX_ROWS] * 4
    choose_gemv(model, ExecutionPlan("gemv=off"))
    assert [m.gemv_rows for m in model] == [0, 0, 0, 0]


def test_the_expert_timer_times_both_paths_and_leaves_the_choice_alone():
    group = [make_experts(moe(8, 2, 32), torch.bfloat16, seed=i) for i in range(2)]
    own, kernel = time_gemv(group, 3)
    assert own > 0 and kernel > 0 and all(m.gemv_rows == 0 for m in group)
