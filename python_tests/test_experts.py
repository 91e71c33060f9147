"""A mixture of experts' experts in shards of tokens (integrations/experts.py): the gradients of the shards' formula,
and the experts apply must leave whole. Whole models (Qwen2-MoE, Qwen3-MoE, Mixtral, GPT-OSS, DeepSeek-V3) are
compared with their un-applied selves in test_apply.py's family tests."""

import warnings

import pytest
import torch
from test_apply import FAMILIES
from torch import nn

import torch_offload


def applied_qwen2_moe():
    torch.manual_seed(0)
    model = FAMILIES["qwen2_moe"][0]().double().train()
    model.config._experts_implementation = "eager"  # transformers' default, grouped_mm, has no float64
    handle = torch_offload.apply(model, offload=None, checkpoint=False, loss=False, num_shards=3)
    return model, handle, model.model.layers[1].mlp.experts


def routed_rows(experts, tokens=7, dtype=torch.float64):
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(tokens, experts.hidden_dim, generator=generator, dtype=dtype, requires_grad=True)
    index = torch.randint(0, experts.num_experts, (tokens, 2), generator=generator)
    weights = torch.rand(tokens, 2, generator=generator, dtype=dtype, requires_grad=True)
    return hidden, index, weights


def test_the_shards_give_the_whole_calls_output_and_gradients():
    model, handle, experts = applied_qwen2_moe()
    assert handle.mlp_tiling["model.layers.1.mlp"] == "tiled_experts"
    hidden, index, weights = routed_rows(experts)
    out = experts(hidden, index, weights)
    assert type(out.grad_fn).__name__.startswith("_TiledApply")
    own = type(experts).forward(experts, hidden, index, weights)  # the class's forward: the whole call
    torch.testing.assert_close(out, own, rtol=1e-12, atol=1e-12)
    # Rows and routing weights, then the experts' own weights, in float64 against finite differences.
    assert torch.autograd.gradcheck(lambda h, w: experts(h, index, w), (hidden, weights), fast_mode=True)
    # The experts' own weights as gradcheck's inputs: it perturbs them in place, where the module reads them.
    assert torch.autograd.gradcheck(
        lambda *_: experts(hidden, index, weights), tuple(experts.parameters()), fast_mode=True
    )
    with torch.no_grad():  # nothing saved: the whole call
        assert experts(hidden, index, weights).grad_fn is None
    handle.remove()
    assert "forward" not in vars(experts)


class Router(nn.Module):
    def __init__(self, h, experts):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(experts, h) / h**0.5)
        self.hidden_dim = h

    def forward(self, x):
        logits = nn.functional.linear(x, self.weight)
        weights, index = logits.softmax(-1).topk(2, dim=-1)
        return logits, weights, index


class MixingExperts(nn.Module):
    """Experts whose output for a token depends on the other tokens (a mean over the rows): not shardable."""

    def __init__(self, h, experts):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(experts, h, h) / h**0.5)
        self.hidden_dim = h

    def forward(self, hidden_states, top_k_index, top_k_weights):
        per_expert = torch.einsum("th,ekh->tek", hidden_states, self.weight)
        chosen = per_expert.gather(1, top_k_index[..., None].expand(-1, -1, hidden_states.shape[1]))
        return (chosen * top_k_weights[..., None]).sum(1) - hidden_states.mean(0)


class Mixture(nn.Module):
    def __init__(self, h=8, experts=4):
        super().__init__()
        self.gate, self.experts = Router(h, experts), MixingExperts(h, experts)

    def forward(self, x):
        rows = x.reshape(-1, x.shape[-1])
        _, weights, index = self.gate(rows)
        return self.experts(rows, index, weights).reshape(x.shape)


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = Mixture()

    def forward(self, x):
        return x + self.mlp(x)


class RecordingModel(nn.Module):
    _can_record_outputs = {"router_logits": Router}  # as transformers' mixture-of-experts models declare it

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Layer(), Layer()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_experts_whose_output_mixes_tokens_stay_whole():
    torch.manual_seed(0)
    model, x = RecordingModel(), torch.randn(2, 5, 8)
    want = model(x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handle = torch_offload.apply(model, offload=None, loss=False)
    assert set(handle.mlp_tiling.values()) == {
        "untiled: the model records its router_logits, and its experts' output for a token depends on the other tokens"
    }
    assert any("stay untiled" in str(w.message) for w in caught)
    torch.testing.assert_close(model(x), want)
    assert "forward" not in vars(model.layers[0].mlp.experts)
    handle.remove()


def test_a_second_apply_on_layers_whose_experts_the_first_patched_is_refused():
    torch.manual_seed(0)
    model = FAMILIES["mixtral"][0]().float().train()  # no shared expert: only the experts' forward is patched
    handle = torch_offload.apply(model, offload=None, checkpoint=False, loss=False, attention_block=False)
    assert set(handle.mlp_tiling.values()) == {"tiled_experts"}
    with pytest.raises(ValueError, match="model.layers.0 is already changed by an earlier apply"):
        torch_offload.apply(model, offload=None, checkpoint=False, loss=False, attention_block=False)
    handle.remove()
    assert str(handle).splitlines()[0].endswith("(removed: the model is as it was before apply)")
    torch_offload.apply(model, offload=None, checkpoint=False, loss=False, attention_block=False).remove()
