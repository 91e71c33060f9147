"""Every family apply() takes, in float64: one sequence, packed documents and padded rows give the un-applied model's
loss and gradients, through the same ops as in float32 (test_real_batches runs the batches in float32, where the
ops' rounding differs from the model's)."""

import pytest
import torch
from test_apply import assert_close_runs
from test_real_batches import BATCHES, CASES, build, step

import torch_offload


def one_sequence():
    ids = torch.randint(3, 128, (1, 24), generator=torch.Generator().manual_seed(7))
    return dict(input_ids=ids, labels=ids)


FLOAT64_BATCHES = {
    "one_sequence": one_sequence,
    **{name: BATCHES[name] for name in ("packed", "right_padded", "left_padded")},
}
FAMILY_NAMES = list(dict.fromkeys(name for name, _ in CASES))


def routes(handle):
    """Which op (or the module's own code) each layer's attention, MLP and the loss went through."""
    return dict(handle.attention), dict(handle.mlp_tiling), handle.loss


def float64_model(name):
    model = build(name).double()
    if getattr(model.config, "_experts_implementation", None) == "grouped_mm":  # a float32-only kernel on the CPU
        model.set_experts_implementation("eager")
    return model


@pytest.mark.parametrize("batch", list(FLOAT64_BATCHES))
@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_every_family_in_float64_gives_the_unapplied_loss_and_gradients_through_the_float32_ops(name, batch):
    handle = torch_offload.apply(build(name), num_shards=2)
    float32_routes = routes(handle)
    handle.remove()
    model, inputs = float64_model(name), FLOAT64_BATCHES[batch]()
    assert next(model.parameters()).dtype == torch.float64
    want = step(model, inputs)
    handle = torch_offload.apply(model, num_shards=2)
    assert routes(handle) == float32_routes
    got = step(model, inputs)
    assert got[0].dtype == want[0].dtype
    assert_same_runs(want, got)
    handle.remove()
    assert_same_runs(want, step(model, inputs))


def assert_same_runs(want, got):
    if not want[0].isnan():
        return assert_close_runs(want, got)
    # Eager Gemma 2 on a left-padded row in float64: a pad's query sees no key, and transformers' softmax in float32
    # turns float64's minimum into -inf: NaN in its own run. The applied model keeps its masks there: the same NaNs.
    assert got[0].isnan() and want[1].keys() == got[1].keys()
    for name in want[1]:
        torch.testing.assert_close(got[1][name], want[1][name], rtol=1e-5, atol=1e-6, equal_nan=True, msg=name)
