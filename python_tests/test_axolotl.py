"""TorchOffloadPlugin under axolotl's own training (its YAML config and validation, model loader, trainer and
final save), on the CPU with a tiny local Llama and a local jsonl data set, 4 steps: every step's loss and the
saved weights equal those of the same training without the plugin. Runs where axolotl is installed: its own venv,
since axolotl pins other transformers, peft and trl releases than the main one."""

import collections
import json
import os
from unittest import mock

import pydantic
import pytest

# Before axolotl reads them: its telemetry is opt-out, and nothing here may reach the Hugging Face hub.
os.environ["AXOLOTL_DO_NOT_TRACK"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"
if os.environ.get("TORCH_OFFLOAD_REQUIRE_AXOLOTL") != "1":  # make test's axolotl venv sets it: no silent skip there
    pytest.importorskip("axolotl")

import safetensors.torch
import torch
import yaml
from axolotl.cli.config import load_cfg
from axolotl.common.datasets import load_datasets
from axolotl.integrations.base import PluginManager
from axolotl.train import train
from test_apply import make_model
from test_trainers import patches, texts, tokenizer

import torch_offload
from torch_offload.integrations import axolotl as plugin_module
from torch_offload.integrations import layer_loop

PLUGIN = "torch_offload.integrations.axolotl.TorchOffloadPlugin"


@pytest.fixture
def run(tmp_path, monkeypatch):
    """run(**config) -> (losses, saved weights, model): axolotl's training as its CLI's train command runs it, from
    a YAML file; plugins registered in one test stay out of the next (axolotl keeps them in a singleton)."""
    monkeypatch.setattr(PluginManager.get_instance(), "plugins", collections.OrderedDict())
    model_dir = tmp_path / "model"
    make_model("llama", max_position_embeddings=256).save_pretrained(model_dir)
    tokenizer().save_pretrained(model_dir)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts(32)))
    runs = 0

    def run(**config):
        nonlocal runs
        runs += 1
        output_dir = tmp_path / f"out{runs}"
        path = tmp_path / f"config{runs}.yml"
        path.write_text(
            yaml.safe_dump(
                dict(
                    base_model=str(model_dir),
                    datasets=[dict(path=str(data), type="completion", ds_type="json")],
                    dataset_prepared_path=str(tmp_path / "prepared"),
                    dataset_num_proc=1,
                    output_dir=str(output_dir),
                    sequence_len=64,
                    micro_batch_size=4,
                    gradient_accumulation_steps=1,
                    max_steps=4,
                    optimizer="sgd",
                    learning_rate=0.5,
                    logging_steps=1,
                    save_strategy="no",
                    val_set_size=0,
                    seed=0,
                    bf16=False,  # float32: without a GPU axolotl's default is float16, which fails on the CPU
                    fp16=False,
                    tf32=False,
                    dataloader_num_workers=0,
                    **config,
                )
            )
        )
        cfg = load_cfg(str(path))
        model, _, trainer = train(cfg=cfg, dataset_meta=load_datasets(cfg=cfg))
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        return losses, safetensors.torch.load_file(output_dir / "model.safetensors"), model

    return run


@pytest.mark.parametrize("chunk_recurrent", [True, False], ids=["chunk-recurrent step", "layers' path"])
def test_plugin_losses_and_saved_weights_equal_step_by_step(chunk_recurrent, run, tmp_path, monkeypatch):
    tiled_during, handles, layers_run = [], [], []

    class Recording(torch_offload.TorchOffloadCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            layers_run.append(layer_loop._run_layer.call_count)

        def on_step_end(self, args, state, control, model=None, **kwargs):
            tiled_during.append(isinstance(model.model.layers[0].mlp, torch_offload.TiledMLP))
            layers_run[-1] = layer_loop._run_layer.call_count - layers_run[-1]

        def on_train_end(self, args, state, control, **kwargs):
            handles.append((self.handle, self.handle.mask_fallbacks))
            super().on_train_end(args, state, control, **kwargs)

    monkeypatch.setattr(plugin_module, "TorchOffloadCallback", Recording)
    plain_losses, plain_weights, plain_model = run()
    (tmp_path / "spill").mkdir()
    options = dict(offload="disk", spill_directory=str(tmp_path / "spill"), chunk_recurrent=chunk_recurrent)
    if not chunk_recurrent:
        options.update(min_bytes=0, num_shards=2)
    with mock.patch.object(layer_loop, "_run_layer", wraps=layer_loop._run_layer):  # counted by Recording
        losses, weights, model = run(plugins=[PLUGIN], torch_offload=options)

    assert len(plain_losses) == 4
    torch.testing.assert_close(losses, plain_losses, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(weights, plain_weights, rtol=1e-5, atol=1e-6)
    ((handle, mask_fallbacks),) = handles
    assert handle.loss == "linear_cross_entropy"
    if chunk_recurrent:  # every step the whole step in chunks, the model's own modules: nothing on the layers
        assert handle.route == "chunk-recurrent step" and handle.chunk_recurrent_calls == 4
        assert tiled_during == [False] * 4 and layers_run == [0] * 4
    else:
        assert tiled_during == [True] * 4 and handle.layer_loop == "apply's"  # applied for every step
        # transformers 5.16's SDPA masks are read as segment ids too: attention recomputed, no dense mask built.
        assert handle.attention_blocks > 0 and mask_fallbacks == {}
        assert handle.stats()["disk_bytes"] > 0
        # apply's loop over the layers ran at every step, as on transformers 5.24 (its cache argument's name differs).
        assert layers_run == [model.config.num_hidden_layers] * 4
    assert patches(model) == patches(plain_model)  # removed: axolotl returns the model as it was given


def test_unknown_option_is_a_config_error_naming_it(run):
    with pytest.raises(
        pydantic.ValidationError, match=r"unknown option 'max_host_byte' \(did you mean 'max_host_bytes'\?\)"
    ):
        run(plugins=[PLUGIN], torch_offload=dict(offload="disk", max_host_byte=1))


def test_an_option_the_tier_would_ignore_is_an_error_when_training_begins(run):
    # Which tier "auto" picks depends on the model's device, known once the trainer has placed it.
    with pytest.raises(ValueError, match=r"'spill_directory' would be ignored"):
        run(plugins=[PLUGIN], torch_offload=dict(offload="cpu", spill_directory="/tmp"))
