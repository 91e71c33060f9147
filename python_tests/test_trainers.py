"""apply() under the trainers users run: transformers' Trainer and TRL's SFTTrainer, with packed
(padding-free) and padded batches, 4 steps on a tiny model: the losses of every step equal the
un-applied model's; the same through TorchOffloadCallback."""

import datasets
import pytest
import tokenizers
import torch
import transformers
import trl
from test_real_batches import make_model

import torch_offload

WORDS = [f"w{i}" for i in range(120)]


def tokenizer():
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(WORDS[:125])}}
    model = tokenizers.models.WordLevel(vocab, unk_token="<pad>")
    inner = tokenizers.Tokenizer(model)
    inner.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=inner, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )


def texts(n=16):
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(4, 20, (n,), generator=generator).tolist()
    return [" ".join(WORDS[int(i)] for i in torch.randint(0, 120, (k,), generator=generator)) for k in lengths]


def arguments(tmp_path, cls=transformers.TrainingArguments, **kwargs):
    return cls(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        max_steps=4,
        logging_steps=1,
        optim="sgd",
        learning_rate=0.5,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        seed=0,
        data_seed=0,
        dataloader_num_workers=0,
        **kwargs,
    )


def losses(trainer):
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def with_and_without_apply(make_trainer):
    runs = []
    for applied in (False, True):
        model = make_model("llama", max_position_embeddings=256)
        model.config.use_cache = False
        # TRL's SFTTrainer then wraps model.forward with its own fused LM head, around apply's. Whole layers
        # checkpointed in place here; TorchOffloadCallback's tests below take the default (the disk tier).
        handle = torch_offload.apply(model, offload=None, num_shards=2) if applied else None
        runs.append(losses(make_trainer(model)))
    assert handle.attention_blocks == 3 and handle.mask_fallbacks == {}  # every batch took the segment ids
    return runs


@pytest.mark.parametrize("batches", ["packed", "padded"])
def test_trainer_losses_equal_step_by_step(batches, tmp_path):
    tok = tokenizer()
    dataset = datasets.Dataset.from_dict({"text": texts()}).map(lambda row: tok(row["text"]), remove_columns=["text"])
    if batches == "packed":  # padding-free: one row, position_ids restarting per example
        collator = transformers.DataCollatorWithFlattening()
    else:
        collator = transformers.DataCollatorForLanguageModeling(tok, mlm=False)

    def make_trainer(model):
        return transformers.Trainer(
            model=model, args=arguments(tmp_path), train_dataset=dataset, data_collator=collator
        )

    plain, applied = with_and_without_apply(make_trainer)
    assert len(plain) == 4
    torch.testing.assert_close(applied, plain, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("packing", [True, False], ids=["padding_free_packing", "padding"])
def test_sft_trainer_losses_equal_step_by_step(packing, tmp_path):
    tok = tokenizer()
    dataset = datasets.Dataset.from_dict({"text": texts()})

    def make_trainer(model):
        config = arguments(
            tmp_path,
            trl.SFTConfig,
            packing=packing,
            padding_free=packing,
            max_length=64,
            gradient_checkpointing=False,  # TRL turns it on by default; apply() checkpoints itself
            dataset_text_field="text",
        )
        return trl.SFTTrainer(model=model, args=config, train_dataset=dataset, processing_class=tok)

    plain, applied = with_and_without_apply(make_trainer)
    assert len(plain) == 4
    torch.testing.assert_close(applied, plain, rtol=1e-4, atol=1e-5)


def patches(model):
    """Each module's instance attributes that replace class ones (a patched forward, apply's __getstate__), by
    what they are: the trainers' own (accelerate's, TRL's) and, while applied, apply's."""
    return {
        (name, key): getattr(value, "__qualname__", type(value).__qualname__)
        for name, module in model.named_modules()
        for key, value in vars(module).items()
        if key in ("forward", "__getstate__")
    }


def with_and_without_callback(make_trainer, **apply_options):
    """Losses of training without and with TorchOffloadCallback; after training, the model carries the same
    patches either way (the callback removed apply's)."""
    runs, after, tiled_during = [], [], []

    class Probe(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            tiled_during.append(isinstance(model.model.layers[0].mlp, torch_offload.TiledMLP))

    for applied in (False, True):
        model = make_model("llama", max_position_embeddings=256)
        model.config.use_cache = False
        callback = torch_offload.TorchOffloadCallback(num_shards=2, **apply_options)
        runs.append(losses(make_trainer(model, [callback, Probe()] if applied else [Probe()])))
        after.append(patches(model))
        assert callback.handle is None
    assert tiled_during == [False] * 4 + [True] * 4  # applied for every step of training, and only then
    assert after[1] == after[0]
    return runs


def test_trainer_callback_applies_for_training_only_with_equal_losses(tmp_path):
    tok = tokenizer()
    dataset = datasets.Dataset.from_dict({"text": texts()}).map(lambda row: tok(row["text"]), remove_columns=["text"])
    collator = transformers.DataCollatorWithFlattening()

    def make_trainer(model, callbacks):
        return transformers.Trainer(
            model=model, args=arguments(tmp_path), train_dataset=dataset, data_collator=collator, callbacks=callbacks
        )

    plain, applied = with_and_without_callback(make_trainer)
    assert len(plain) == 4
    torch.testing.assert_close(applied, plain, rtol=1e-4, atol=1e-5)


def test_sft_trainer_callback_losses_equal(tmp_path):
    tok = tokenizer()
    dataset = datasets.Dataset.from_dict({"text": texts()})

    def make_trainer(model, callbacks):
        config = arguments(
            tmp_path,
            trl.SFTConfig,
            packing=True,
            padding_free=True,
            max_length=64,
            gradient_checkpointing=False,
            dataset_text_field="text",
        )
        return trl.SFTTrainer(
            model=model, args=config, train_dataset=dataset, processing_class=tok, callbacks=callbacks
        )

    plain, applied = with_and_without_callback(make_trainer)
    assert len(plain) == 4
    torch.testing.assert_close(applied, plain, rtol=1e-4, atol=1e-5)


def test_trainer_callback_refuses_unknown_options_at_once():
    with pytest.raises(
        TypeError,
        match=r"TorchOffloadCallback: unknown option 'max_host_byte' \(did you mean "
        r"'max_host_bytes'\?\)",
    ):
        torch_offload.TorchOffloadCallback(max_host_byte=1)
    with pytest.raises(TypeError, match="unknown option 'model'"):  # apply's model comes from the trainer
        torch_offload.TorchOffloadCallback(model=None)
    torch_offload.TorchOffloadCallback(offload="disk", min_bytes=0, checkpoint="layer")  # apply's and the tier's


def test_trainer_callback_refuses_an_option_the_tier_would_ignore_when_training_begins(tmp_path):
    # Which tier offload="auto" picks depends on where the trainer puts the model: checked when it has.
    tok = tokenizer()
    dataset = datasets.Dataset.from_dict({"text": texts()}).map(lambda row: tok(row["text"]), remove_columns=["text"])
    model = make_model("llama", max_position_embeddings=256)
    before = patches(model)
    callback = torch_offload.TorchOffloadCallback(offload="cpu", spill_directory=str(tmp_path))
    trainer = transformers.Trainer(
        model=model,
        args=arguments(tmp_path),
        train_dataset=dataset,
        data_collator=transformers.DataCollatorWithFlattening(),
        callbacks=[callback],
    )
    with pytest.raises(ValueError, match=r"'spill_directory' would be ignored with offload='cpu'"):
        trainer.train()
    assert callback.handle is None and patches(model) == before  # nothing left applied
