"""The mixture-of-experts layer against transformers' (top-2 of 8 experts), and every path of
gapless::moe_experts against a token-by-token reference, for a batch that routes to every
expert and one that routes to a single expert."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gapless.common.families import arch_from_config
from gapless.gpu_runner.model import fuse_weights
from gapless.gpu_runner.model.moe import (
    MoE,
    experts_grouped,
    experts_loop,
    experts_masked,
    moe_experts,
)

transformers = pytest.importorskip("transformers")

E, TOP, H, INTER = 8, 2, 32, 48


def _weights(seed: int):
    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(E, 2 * INTER, H, generator=g) / H**0.5
    down = torch.randn(E, H, INTER, generator=g) / INTER**0.5
    return gate_up, down


def _by_token(x, ids, weights, gate_up, down) -> torch.Tensor:
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = F.linear(x[t], gate_up[e]).chunk(2)
            out[t] += weights[t, j] * F.linear(F.silu(gate) * up, down[e])
    return out


@pytest.mark.parametrize("routing", ["every-expert", "one-expert"])
@pytest.mark.parametrize("path", [experts_loop, experts_grouped, experts_masked, moe_experts])
def test_every_experts_path_equals_the_token_by_token_sum(routing, path):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(24, H, generator=g)
    if routing == "every-expert":
        ids = torch.stack([torch.randperm(E, generator=g)[:TOP] for _ in range(24)])
        assert set(ids.flatten().tolist()) == set(range(E))
    else:  # a single expert takes the whole batch (top-1 routing)
        ids = torch.full((24, 1), 5)
    weights = torch.rand(ids.shape, generator=g)
    gate_up, down = _weights(2)
    want = _by_token(x, ids, weights, gate_up, down)
    args = (x, ids, weights, gate_up, down, "silu")
    got = path(*args) if path is not moe_experts else torch.ops.gapless.moe_experts(*args)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _pair(family: str, cls: str, **extra):
    """transformers' MoE block and ours on the same random weights."""
    cfg = getattr(transformers, cls)(
        vocab_size=64, hidden_size=H, intermediate_size=INTER, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=TOP, **extra,
    )  # fmt: skip
    torch.manual_seed(3)
    ref = transformers.AutoModelForCausalLM.from_config(cfg).model.layers[0].mlp.eval()
    arch = arch_from_config({**cfg.to_dict(), "model_type": family}, family)
    ours = MoE(arch)
    state = {f"mlp.{k}": v for k, v in ref.state_dict().items()}
    ours.load_state_dict({k[4:]: v for k, v in fuse_weights(state).items()})
    return ref, ours.eval()


FAMILIES = {
    "mixtral": ("MixtralConfig", dict(num_local_experts=E)),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        dict(num_experts=E, moe_intermediate_size=INTER, shared_expert_intermediate_size=40),
    ),  # fmt: skip
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(num_experts=E, moe_intermediate_size=INTER, norm_topk_prob=True),
    ),  # fmt: skip
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_moe_layer_equals_transformers(family):
    cls, extra = FAMILIES[family]
    ref, ours = _pair(family, cls, **extra)
    x = torch.randn(40, H, generator=torch.Generator().manual_seed(4))
    ids, _ = ours.route(x)
    assert set(ids.flatten().tolist()) == set(range(E)), "the batch routes to every expert"
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref(x[None])[0], atol=1e-5, rtol=1e-5)
        one = x[:1].expand(6, H).contiguous()  # six copies of a token: one pair of experts
        assert len(set(ours.route(one)[0].flatten().tolist())) == TOP
        torch.testing.assert_close(ours(one), ref(one[None])[0], atol=1e-5, rtol=1e-5)


def test_a_compiled_moe_layer_keeps_the_experts_whole():
    """The experts are one operator to the compiler: no graph break whatever the routing."""
    _, ours = _pair("mixtral", "MixtralConfig", num_local_experts=E)
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(5))
    explained = torch._dynamo.explain(ours)(x)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
