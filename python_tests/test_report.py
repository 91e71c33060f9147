"""print(handle) and handle.report(): each row says what runs in its layers, checked against the ops the dispatcher
sees and the modules' own calls in one training step, family by family."""

import collections
import logging
import warnings

import peft
import pytest
import torch
import transformers
from test_apply import FAMILIES, batch, make_model
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import torch_offload
from torch_offload.integrations.layers import _attention_of

SHARDS = 3
# The fused loss's forward, by the path it takes: gradients in forward (a training step), or not (soft-capped logits).
LOSS_OPS = ("linear_cross_entropy", "linear_cross_entropy_with_gradients", "linear_cross_entropy_forward")


def phi3_with_lora():
    model = make_model("phi3")
    return peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["qkv_proj", "gate_up_proj"]))


def family(name):
    torch.manual_seed(0)
    return FAMILIES[name][0]().float().train()


BUILDERS = {
    "llama": lambda: make_model("llama"),
    "qwen3": lambda: make_model("qwen3"),
    "gpt2": lambda: make_model("gpt2"),
    "gemma2": lambda: make_model("gemma2"),
    "phi3_lora": phi3_with_lora,
    "qwen2_moe": lambda: family("qwen2_moe"),
    "qwen2_vl": lambda: family("qwen2_vl"),
    "qwen2_moe_layer_checkpoint": lambda: family("qwen2_moe"),  # recomputed whole: its experts in shards
}
OPTIONS = {"qwen2_moe_layer_checkpoint": dict(checkpoint="layer")}


class Observe(TorchDispatchMode):
    """Per decoder layer and phase ("forward", "backward"): the calls of torch_offload's ops, and the most calls
    of any one module inside its MLP and inside its attention module. An op is the layer's whose parameters it takes,
    else the layer whose module ran last (its recomputation in backward included). Module calls are counted
    in nn.Module.__call__ itself: a hook on a module would send it off the ops (they honour hooks)."""

    def __init__(self, layers):
        super().__init__()
        self.phase, self.layer = "forward", None
        self.ops = collections.Counter()
        self.module_calls = collections.Counter()
        self.owner = {p.untyped_storage().data_ptr(): i for i, layer in enumerate(layers) for p in layer.parameters()}
        self.where = {}  # id(module) -> (layer index, "mlp" / "attention" / None for the layer itself)
        self.experts = {id(layer.mlp.experts): i for i, layer in enumerate(layers) if hasattr(layer.mlp, "experts")}
        self.experts_output = {}
        for index, layer in enumerate(layers):
            self.where[id(layer)] = index, None
            attention = _attention_of(layer)
            for part, module in (("mlp", layer.mlp), ("attention", getattr(layer, attention or "", None))):
                for child in [] if module is None else module.modules():
                    if next(child.children(), None) is None:  # a leaf: its own calls
                        self.where[id(child)] = index, part

    def __enter__(self):
        call, observe = nn.Module.__call__, self

        def counted(module, *args, **kwargs):
            where = observe.where.get(id(module))
            if where is not None:
                observe.layer = where[0]
                if where[1] is not None:
                    observe.module_calls[observe.phase, where[0], where[1], id(module)] += 1
            out = call(module, *args, **kwargs)
            if id(module) in observe.experts:  # which autograd node made a mixture's experts' output
                observe.experts_output[observe.phase, observe.experts[id(module)]] = type(out.grad_fn).__name__
            return out

        self.restore = call
        nn.Module.__call__ = counted
        return super().__enter__()

    def __exit__(self, *exc):
        nn.Module.__call__ = self.restore
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "offload":
            tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            owner = next(
                (
                    self.owner[t.untyped_storage().data_ptr()]
                    for t in tensors
                    if t.untyped_storage().data_ptr() in self.owner
                ),
                self.layer,
            )
            self.ops[self.phase, owner, func._opname] += 1
        return func(*args, **(kwargs or {}))

    def most_calls(self, phase, index, part):
        return max((n for (p, i, q, _), n in self.module_calls.items() if (p, i, q) == (phase, index, part)), default=0)


def run_step(model, handle, ids, attention_mask):
    """One step under Observe, forward and backward apart."""
    with Observe(handle.layers) as seen:
        loss = model(input_ids=ids, labels=ids, attention_mask=attention_mask, use_cache=False).loss
        seen.phase = "backward"
        loss.backward()
    return seen


def observed_mlp(seen, index):
    if seen.experts_output.get(("forward", index), "").startswith("_TiledApply"):
        return "tiled_experts"
    calls = seen.most_calls("forward", index, "mlp")
    if seen.ops["forward", index, "tiled_mlp"] == 1 and calls == 0:
        return "tiled_mlp"
    return {SHARDS: "tiled_apply", 1: "own"}.get(calls, f"{calls} calls")


def observed_attention(seen, index):
    if seen.ops["forward", index, "attention_block"] == 1 and seen.most_calls("forward", index, "attention") == 0:
        return "attention_block"
    return "segment_attention" if seen.ops["forward", index, "segment_attention"] else "own"


def observed_recompute(seen, index, mlp):
    """What backward ran of the layer's forward again: its MLP ("layer"), its attention alone, or nothing."""
    own_recompute = SHARDS if mlp == "tiled_apply" else 0  # tiled_apply recomputes its shards in its backward
    mlp_again = seen.ops["backward", index, "tiled_mlp"] or seen.most_calls("backward", index, "mlp") > own_recompute
    if mlp == "tiled_experts":  # its experts' module is called again only where the layer is recomputed
        mlp_again = ("backward", index) in seen.experts_output
    attention_again = seen.ops["backward", index, "attention_block"] or seen.most_calls("backward", index, "attention")
    return "layer" if mlp_again else "attention" if attention_again else "none"


def expected(row, masks_are_segment_ids, masked, eager):
    """What one layer of `row` is seen to run, on a batch with (left) padding (`masked`) or without, its model's
    attention implementation eager_attention's (`eager`) or masking's."""
    attention = row["attention"]
    if attention == "segment_attention" and not masked and not eager:
        attention = "own"  # without a mask its core attention is SDPA's
    if attention == "segment_attention" and masked and eager:
        attention = "own"  # left padding keeps eager attention's dense mask and function
    if attention == "attention_block" and masked and not masks_are_segment_ids:
        attention = "own"  # a dense mask: the module's own forward
    recompute = row["recompute"]
    if recompute == "attention" and attention == "attention_block":
        recompute = "none"  # the op recomputes inside attention_block_backward, not by running forward again
    return row["mlp"], attention, recompute


@pytest.mark.parametrize("name", list(BUILDERS))
def test_each_row_says_what_runs_in_its_layers(name, tmp_path):
    model = BUILDERS[name]()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # The rows say what the layers' path runs: the chunk-recurrent step, which would take this test's training
        # calls on some of the models, off (its line in the report: test_chunk_recurrent_route.py).
        options = dict(OPTIONS.get(name, {}), chunk_recurrent=False)
        handle = torch_offload.apply(model, spill_directory=str(tmp_path), min_bytes=0, num_shards=SHARDS, **options)
    report = handle.report()
    assert [i for row in report["layers"] for i in row["layers"]] == list(range(len(handle.layers)))
    text = str(handle)
    assert all(why in text for row in report["layers"] for why in row["why"].values())
    segment_masks = report["masks"].startswith("segment ids")
    eager = model.config._attn_implementation == torch_offload.eager_attention.IMPLEMENTATION
    ids = batch()
    padded = torch.ones_like(ids)
    padded[0, :5] = 0
    for attention_mask in (None, padded):
        seen = run_step(model, handle, ids, attention_mask)
        for row in report["layers"]:
            for index in row["layers"]:
                mlp, attention = observed_mlp(seen, index), observed_attention(seen, index)
                got = mlp, attention, observed_recompute(seen, index, mlp)
                want = expected(row, segment_masks, attention_mask is not None, eager)
                assert got == want, f"layer {index} of {name}, mask {attention_mask is not None}: {row}"
                assert seen.ops["backward", index, "attention_block_backward"] == (attention == "attention_block")
        fused = sum(
            n for (phase, _, op), n in seen.ops.items() if op.startswith("linear_cross_entropy") and phase == "forward"
        )
        assert fused == (report["loss"] == "linear_cross_entropy"), report["loss"]
    assert (handle.stats()["disk_bytes"] > 0) == any(row["saved"] == "disk" for row in report["layers"])
    mlps = {row["mlp"] for row in report["layers"]}
    assert ("tiled_experts" in mlps) == (name == "qwen2_moe_layer_checkpoint")
    handle.remove()


def test_rows_and_reasons_follow_the_options(tmp_path, caplog):
    model = make_model("llama")
    with caplog.at_level(logging.INFO, logger="torch_offload"):
        handle = torch_offload.apply(model, offload=None, checkpoint=False, attention_block=False, loss=False)
    (row,) = handle.report()["layers"]
    assert row == {
        "layers": [0, 1, 2],
        "mlp": "tiled_mlp",
        "attention": "own",
        "recompute": "none",
        "saved": "in place",
        "why": {"attention": "attention_block=False", "saved": "neither checkpointed nor offloaded"},
    }
    assert handle.report()["loss"] == "off" and "attention_block=False" in handle.report()["masks"]
    (record,) = [r for r in caplog.records if r.name.startswith("torch_offload")]
    assert record.getMessage() == "; ".join(
        [
            "torch_offload.apply(LlamaForCausalLM): 3 layers at model.layers",
            "layers 0-2: mlp tiled_mlp, attention own (attention_block=False), recompute none, "
            "saved in place (neither checkpointed nor offloaded)",
            "route: layers' path",
            "loss: off",
            "norms: 7 of 7 through rms_norm",
            "masks: the model's own (attention_block=False)",
            "layer loop: the model's own: no layer is offloaded",
            "chunk-recurrent step: off: loss=False (the step computes the fused loss)",
        ]
    )
    handle.remove()

    handle = torch_offload.apply(model, tiled_mlp=False, offload="disk", spill_directory=str(tmp_path), keep_last=2)
    rows = handle.report()["layers"]
    assert [(r["layers"], r["saved"]) for r in rows] == [([0], "disk"), ([1, 2], "in place")]
    assert all(r["mlp"] == "own" and r["why"]["mlp"] == "tiled_mlp=False" for r in rows)
    assert "keep_last=2" in rows[1]["why"]["saved"]
    text = str(handle).splitlines()
    assert text[0] == "torch_offload.apply(LlamaForCausalLM): 3 layers at model.layers"
    assert text[1].split() == ["layers", "mlp", "attention", "recomputed", "saved", "to"]
    assert text[2].split() == ["0", "own", "[1]", "attention_block", "attention", "disk"]
    # Recomputed whole beside a tier, they keep their attention's output from the forward.
    assert text[3].split() == ["1-2", "own", "[1]", "attention_block", "layer", "[2]", "in", "place", "[3]"]
    assert rows[1]["why"]["recompute"].startswith("not its attention forward")
    notes = ["tiled_mlp=False", rows[1]["why"]["recompute"], rows[1]["why"]["saved"]]
    assert text[4:7] == [f"  [{number}] {note}" for number, note in enumerate(notes, 1)]
    handle.remove()

    # keep_last's default: none kept under attention-only recompute (a last layer recomputed whole would be the
    # step's peak), one where whole layers are recomputed anyway.
    for checkpoint, kept in (("attention", []), (True, []), ("layer", [2])):
        handle = torch_offload.apply(model, offload="disk", checkpoint=checkpoint, spill_directory=str(tmp_path))
        in_place = [i for r in handle.report()["layers"] if r["saved"] == "in place" for i in r["layers"]]
        assert in_place == kept, checkpoint
        handle.remove()


def test_a_model_without_segment_masks_says_why(tmp_path):
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4
    )
    config._attn_implementation = "eager"
    model = transformers.LlamaForCausalLM(config).train()
    handle = torch_offload.apply(model, offload=None)
    report = handle.report()
    assert report["masks"] == "the model's own (llama has 'eager' attention)"
    assert report["layers"][0]["why"]["attention"] == "its attention implementation is 'eager', not 'sdpa'"
    handle.remove()
