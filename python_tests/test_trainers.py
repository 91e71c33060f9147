"""apply() under the trainers users run: transformers' Trainer and TRL's SFTTrainer, with packed
(padding-free) and padded batches, 4 steps on a tiny model: the losses of every step equal the
un-applied model's."""
import datasets
import pytest
import tokenizers
import torch
import transformers
import trl

import torch_offload
from test_real_batches import make_model

WORDS = [f"w{i}" for i in range(120)]


def tokenizer():
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(WORDS[:125])}}
    model = tokenizers.models.WordLevel(vocab, unk_token="<pad>")
    inner = tokenizers.Tokenizer(model)
    inner.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=inner, pad_token="<pad>", bos_token="<s>",
                                                eos_token="</s>")


def texts(n=16):
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(4, 20, (n,), generator=generator).tolist()
    return [" ".join(WORDS[int(i)] for i in torch.randint(0, 120, (k,), generator=generator)) for k in lengths]


def arguments(tmp_path, cls=transformers.TrainingArguments, **kwargs):
    return cls(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=4, logging_steps=1, optim="sgd",
               learning_rate=0.5, report_to=[], save_strategy="no", use_cpu=True, seed=0, data_seed=0,
               dataloader_num_workers=0, **kwargs)


def losses(trainer):
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def with_and_without_apply(make_trainer):
    runs = []
    for applied in (False, True):
        model = make_model("llama", max_position_embeddings=256)
        model.config.use_cache = False
        # TRL's SFTTrainer then wraps model.forward with its own fused LM head, around apply's.
        handle = torch_offload.apply(model, num_shards=2) if applied else None
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
        return transformers.Trainer(model=model, args=arguments(tmp_path), train_dataset=dataset,
                                    data_collator=collator)

    plain, applied = with_and_without_apply(make_trainer)
    assert len(plain) == 4
    torch.testing.assert_close(applied, plain, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("packing", [True, False], ids=["padding_free_packing", "padding"])
def test_sft_trainer_losses_equal_step_by_step(packing, tmp_path):
    tok = tokenizer()
    dataset = datasets.Dataset.from_dict({"text": texts()})

    def make_trainer(model):
        config = arguments(tmp_path, trl.SFTConfig, packing=packing, padding_free=packing, max_length=64,
                           gradient_checkpointing=False,  # TRL turns it on by default; apply() checkpoints itself
                           dataset_text_field="text")
        return trl.SFTTrainer(model=model, args=config, train_dataset=dataset, processing_class=tok)

    plain, applied = with_and_without_apply(make_trainer)
    assert len(plain) == 4
    torch.testing.assert_close(applied, plain, rtol=1e-4, atol=1e-5)
