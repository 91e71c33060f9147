"""apply() under the trainers users run: transformers' Trainer and TRL's SFTTrainer, with packed
(padding-free) and padded batches, 4 steps on a tiny model: the losses of every step equal the
un-applied model's; the same through TorchOffloadCallback, and TRL's GRPO, RLOO, DPO, KTO and SFT trainers with it
(3 steps: losses and every gradient; in float32 and under their configurations' default bf16)."""

import copy
import warnings
from unittest import mock

import datasets
import pytest
import tokenizers
import torch
import transformers
import trl
from test_real_batches import make_model

import torch_offload
from torch_offload.integrations import chunk_recurrent_route, layer_loop

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
            bf16=False,  # TRL's default bf16 autocast would round differently ordered float32 sums apart
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


def own_attributes(model):
    """The patched attributes themselves (patches() gives their names), to compare by identity."""
    return {
        (name, key): value
        for name, module in model.named_modules()
        for key, value in vars(module).items()
        if key in ("forward", "__getstate__")
    }


class TiledProbe(transformers.TrainerCallback):
    """Whether apply's TiledMLP was in the model at the end of each step."""

    def __init__(self):
        self.tiled = []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.tiled.append(isinstance(model.model.layers[0].mlp, torch_offload.TiledMLP))


class Interrupt(transformers.TrainerCallback):
    """Raises inside step 2's forward, between two decoder layers, as running out of memory would."""

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if state.global_step == 1:

            def fail(module, inputs):
                hook.remove()
                raise RuntimeError("out of memory in step 2")

            hook = model.model.layers[1].register_forward_pre_hook(fail)


def tiny_model():
    model = make_model("llama", max_position_embeddings=256)
    model.config.use_cache = False
    return model


def packed_trainer(tmp_path):
    """make_trainer(model, callbacks): a Trainer on packed (padding-free) batches of texts()."""
    tok = tokenizer()
    dataset = datasets.Dataset.from_dict({"text": texts()}).map(lambda row: tok(row["text"]), remove_columns=["text"])
    collator = transformers.DataCollatorWithFlattening()

    def make_trainer(model, callbacks):
        return transformers.Trainer(
            model=model, args=arguments(tmp_path), train_dataset=dataset, data_collator=collator, callbacks=callbacks
        )

    return make_trainer


def with_and_without_callback(make_trainer, **apply_options):
    """Losses of training without and with TorchOffloadCallback; after training, the model carries the same
    patches either way (the callback removed apply's)."""
    runs, after, probe = [], [], TiledProbe()
    for applied in (False, True):
        model = tiny_model()
        callback = torch_offload.TorchOffloadCallback(num_shards=2, **apply_options)
        runs.append(losses(make_trainer(model, [callback, probe] if applied else [probe])))
        after.append(patches(model))
        assert callback.handle is None
    assert probe.tiled == [False] * 4 + [True] * 4  # applied for every step of training, and only then
    assert after[1] == after[0]
    return runs


def test_trainer_callback_applies_for_training_only_with_equal_losses(tmp_path):
    plain, applied = with_and_without_callback(packed_trainer(tmp_path))
    assert len(plain) == 4
    torch.testing.assert_close(applied, plain, rtol=1e-4, atol=1e-5)


# What each step of a Trainer with the callback runs: the chunk-recurrent step (apply's default for training calls
# with labels on a CPU), or with it off, apply's loop over the layers; patched to count the calls with gradients.
STEPS = {
    "chunk-recurrent step": ({}, chunk_recurrent_route, "chunk_recurrent_step", 1),
    "layer loop": (dict(chunk_recurrent=False, num_shards=2), layer_loop, "_run_layer", "layers"),
}


@pytest.mark.parametrize("step", list(STEPS))
def test_trainer_callback_runs_applys_step_at_every_step(step, tmp_path):
    """A model as transformers makes it (config.use_cache true; the Trainer sets it from its arguments, false by
    default): every training step runs apply's chunk-recurrent step, or with it off apply's loop over the layers,
    with the un-applied model's losses."""
    options, module, name, per_step = STEPS[step]
    make_trainer, runs, with_gradients = packed_trainer(tmp_path), [], []
    original = getattr(module, name)

    def counted(*args, **kwargs):
        with_gradients.append(torch.is_grad_enabled())  # apply's probes run them without
        return original(*args, **kwargs)

    for applied in (False, True):
        model = make_model("llama", max_position_embeddings=256)
        assert model.config.use_cache
        callbacks = [torch_offload.TorchOffloadCallback(**options)] if applied else []
        with mock.patch.object(module, name, counted):
            runs.append(losses(make_trainer(model, callbacks)))
    calls = model.config.num_hidden_layers if per_step == "layers" else per_step
    assert with_gradients.count(True) == 4 * calls  # 4 steps
    assert len(runs[0]) == 4
    torch.testing.assert_close(runs[1], runs[0], rtol=1e-4, atol=1e-5)


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
            bf16=False,
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


def test_trainer_callback_refuses_sequence_parallel_at_once():
    # By the option alone, before its group is looked at: a Trainer never shards the batches.
    with pytest.raises(
        ValueError,
        match=r"TorchOffloadCallback: sequence_parallel cannot work under a Trainer.*"
        r"call torch_offload.apply\(model, sequence_parallel=group\) yourself and train on shard_batch's",
    ):
        torch_offload.TorchOffloadCallback(sequence_parallel=object())
    torch_offload.TorchOffloadCallback(sequence_parallel=None)  # apply's default: no sequence parallelism


def test_trainer_callback_trains_a_model_a_raising_train_left_applied(tmp_path):
    make_trainer = packed_trainer(tmp_path)
    model = tiny_model()
    plain, before = copy.deepcopy(model), own_attributes(model)
    interrupted = torch_offload.TorchOffloadCallback(num_shards=2)
    for trained, callbacks in ((model, [interrupted, Interrupt()]), (plain, [Interrupt()])):
        with pytest.raises(RuntimeError, match="out of memory in step 2"):
            make_trainer(trained, callbacks).train()
    assert interrupted.handle is not None  # applied still, as the docstring says

    callback, probe = torch_offload.TorchOffloadCallback(num_shards=2), TiledProbe()
    applied = losses(make_trainer(model, [callback, probe]))  # a new callback removes the stale apply() first
    torch.testing.assert_close(applied, losses(make_trainer(plain, [])), rtol=1e-4, atol=1e-5)
    assert probe.tiled == [True] * 4
    assert interrupted.handle is None and callback.handle is None
    assert own_attributes(model) == before


def test_trainer_callback_moves_from_the_model_its_raising_train_left_applied(tmp_path):
    make_trainer = packed_trainer(tmp_path)
    first, second = tiny_model(), tiny_model()
    first_before, second_before = own_attributes(first), own_attributes(second)
    callback, probe = torch_offload.TorchOffloadCallback(num_shards=2), TiledProbe()
    with pytest.raises(RuntimeError, match="out of memory in step 2"):
        make_trainer(first, [callback, Interrupt()]).train()

    trainer = make_trainer(second, [callback, probe])
    assert own_attributes(first) == first_before  # removed when the callback joined its next trainer
    losses(trainer)
    assert probe.tiled == [True] * 4  # the second model applied, not left as it was
    assert callback.handle is None and own_attributes(second) == second_before


class Gradients(transformers.TrainerCallback):
    """Every parameter's gradient at every optimizer step."""

    def __init__(self):
        self.steps = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.steps.append({name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None})


def logged_metrics(trainer):
    """Every step's logged figures but timings."""
    timing = ("step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second")
    return [{k: v for k, v in entry.items() if k not in timing} for entry in trainer.state.log_history]


# TRL 1.16's fused LM head, which the callback's stand-in replaces while training; TRL 1.9 (axolotl's venv, which
# runs the GRPO and DPO tests too) has none: its trainers score tokens from the whole logits, which the callback
# leaves alone with a warning.
FUSED_HEAD = hasattr(trl.trainer.utils, "add_fused_lm_head")


# TRL's configurations turn bf16 mixed precision on by default (accelerate then wraps the model's forward in
# autocast and a float32 cast of its outputs); the tests run each trainer in float32 and under that default.
PRECISIONS = ("float32", "bf16 by default")


def precision_options(precision):
    """The trainer's arguments for ``precision``: float32 (bf16 off), or the configuration's own default."""
    return {"bf16": False} if precision == "float32" else {}


def trl_losses_and_gradients(make_trainer, precision="float32"):
    """Losses, logged figures and gradients per step of ``make_trainer(model, callbacks, precision)`` without and
    with TorchOffloadCallback, and no warning about the head; returns the callback. In float32 they are equal. Under
    bf16 mixed precision the op and TRL's kernel round differently, so each is measured against the float32 run of
    TRL's own: the callback's error at most twice TRL's own bf16 error (plus 2^-10 of the terms' size)."""
    runs, applied_callback = {}, None
    original = getattr(trl.trainer.utils, "_ChunkedLogProbFunction", None)
    kinds = [("plain", precision), ("applied", precision)]
    if precision != "float32":
        kinds.append(("plain", "float32"))
    for kind in kinds:
        torch.manual_seed(0)
        gradients = Gradients()
        callback = torch_offload.TorchOffloadCallback(num_shards=2) if kind[0] == "applied" else None
        applied_callback = callback or applied_callback
        trainer = make_trainer(tiny_model(), [gradients] + ([callback] if callback else []), kind[1])
        assert trainer.args.bf16 == (kind[1] != "float32")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            runs[kind] = (losses(trainer), gradients.steps, logged_metrics(trainer))
        said = [str(w.message) for w in caught if "fused LM head" in str(w.message)]
        # Said only where TRL has no fused head (TRL 1.9), and then that it has none.
        assert len(said) == (callback is not None and not FUSED_HEAD), said
        assert all("no fused LM head" in message for message in said), said
        assert getattr(trl.trainer.utils, "_ChunkedLogProbFunction", None) is original  # TRL's own after training
    (plain, plain_gradients, plain_metrics) = runs["plain", precision]
    (applied, applied_gradients, applied_metrics) = runs["applied", precision]
    truth = runs.get(("plain", "float32"))
    assert len(plain) == 3 and len(plain_gradients) == 3

    def close(got, want, truth, name):
        if precision == "float32":
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=name)
            return
        got, want, truth = (torch.as_tensor(x, dtype=torch.float64) for x in (got, want, truth))
        error, trls_error = (got - truth).abs().max().item(), (want - truth).abs().max().item()
        assert error <= 2 * trls_error + 2**-10 * max(truth.abs().max().item(), 1.0), (name, error, trls_error)

    steps = range(len(plain))
    for step in steps:
        close(applied[step], plain[step], truth and truth[0][step], f"loss of step {step}")
        # The logged figures too (entropy, DPO's mean logits and accuracies): the same keys, the same values.
        assert applied_metrics[step].keys() == plain_metrics[step].keys()
        for name in plain_metrics[step]:
            want = plain_metrics[step][name]
            close(applied_metrics[step][name], want, truth and truth[2][step][name], f"{name} of step {step}")
        assert applied_gradients[step].keys() == plain_gradients[step].keys()
        for name in plain_gradients[step]:
            want = plain_gradients[step][name]
            close(applied_gradients[step][name], want, truth and truth[1][step][name], f"{name} of step {step}")
    return applied_callback


def trl_arguments(tmp_path, cls, precision="float32", **kwargs):
    config = arguments(tmp_path, cls, gradient_checkpointing=False, **precision_options(precision), **kwargs)
    config.max_steps = 3
    return config


@pytest.mark.parametrize("precision", PRECISIONS)
def test_grpo_trainer_callback_losses_and_gradients_equal(precision, tmp_path):
    tok = tokenizer()
    dataset = datasets.Dataset.from_dict({"prompt": texts(8)})

    def reward(completions, **kwargs):  # in-process: longer completions score higher
        return [len(completion) / 10 for completion in completions]

    def make_trainer(model, callbacks, precision):
        config = trl_arguments(
            tmp_path, trl.GRPOConfig, precision, num_generations=2, max_completion_length=8, beta=0.0, temperature=0.7
        )
        return trl.GRPOTrainer(
            model=model,
            args=config,
            reward_funcs=reward,
            train_dataset=dataset,
            processing_class=tok,
            callbacks=callbacks,
        )

    callback = trl_losses_and_gradients(make_trainer, precision)
    # Each step scores its completions with gradients (and the old policy's without): every call went through
    # the op.
    assert_scored_through_the_op(callback, calls=3)


@pytest.mark.skipif(not FUSED_HEAD, reason="TRL's RLOO and KTO trainers have a fused LM head from 1.16 on")
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("trainer", ["RLOO", "KTO"])
def test_rloo_and_kto_trainer_callback_losses_and_gradients_equal(trainer, precision, tmp_path):
    tok = tokenizer()

    def make_trainer(model, callbacks, precision):
        if trainer == "RLOO":
            config = trl_arguments(
                tmp_path, trl.RLOOConfig, precision, num_generations=2, max_completion_length=8, beta=0.0
            )
            return trl.RLOOTrainer(
                model=model,
                args=config,
                reward_funcs=lambda completions, **kwargs: [len(c) / 10 for c in completions],
                train_dataset=datasets.Dataset.from_dict({"prompt": texts(8)}),
                processing_class=tok,
                callbacks=callbacks,
            )
        rows = {"prompt": texts(8), "completion": texts(16)[8:], "label": [True, False] * 4}
        reference = copy.deepcopy(model)
        with torch.no_grad():
            for parameter in reference.parameters():
                parameter.add_(torch.randn_like(parameter), alpha=0.01)
        return trl.KTOTrainer(
            model=model,
            ref_model=reference,
            args=trl_arguments(tmp_path, trl.KTOConfig, precision, max_length=64),
            train_dataset=datasets.Dataset.from_dict(rows),
            processing_class=tok,
            callbacks=callbacks,
        )

    callback = trl_losses_and_gradients(make_trainer, precision)
    assert_scored_through_the_op(callback, calls=3)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_dpo_trainer_callback_losses_and_gradients_equal(precision, tmp_path):
    tok = tokenizer()
    prompts, chosen, rejected = texts(8), texts(16)[:8], texts(16)[8:]
    dataset = datasets.Dataset.from_dict({"prompt": prompts, "chosen": chosen, "rejected": rejected})

    def make_trainer(model, callbacks, precision):
        config = trl_arguments(tmp_path, trl.DPOConfig, precision, max_length=64)
        # A reference model that is not the policy: with the two equal, the first step's rewards are 0 in plain
        # training and rounding noise (1e-7) through the op, and DPO's accuracy (chosen > rejected) is a coin toss.
        reference = copy.deepcopy(model)
        with torch.no_grad():
            for parameter in reference.parameters():
                parameter.add_(torch.randn_like(parameter), alpha=0.01)
        return trl.DPOTrainer(
            model=model,
            ref_model=reference,
            args=config,
            train_dataset=dataset,
            processing_class=tok,
            callbacks=callbacks,
        )

    callback = trl_losses_and_gradients(make_trainer, precision)
    # The policy's calls (with DPO's metrics: mean logits, top-1) and the reference model's, each step.
    assert_scored_through_the_op(callback, calls=6)


def assert_scored_through_the_op(callback, calls):
    """At least ``calls`` calls of TRL's fused head went through the op; none where TRL has no fused head."""
    if not FUSED_HEAD:
        assert callback.fused_head is None
    else:
        assert callback.fused_head.calls >= calls


def distilling_trainer(tmp_path, beta):
    """make_trainer(model, callbacks, precision): TRL's DistillationTrainer from a tiny Llama teacher unlike the
    student (its weights moved), on-policy on texts() as prompts."""
    tok = tokenizer()
    dataset = datasets.Dataset.from_dict({"prompt": texts(8)})
    teacher = tiny_model()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in teacher.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.05)

    def make_trainer(model, callbacks, precision):
        config = trl_arguments(
            tmp_path, trl.DistillationConfig, precision, max_completion_length=8, beta=beta, temperature=0.7
        )
        return trl.DistillationTrainer(
            model=model,
            teacher_model=copy.deepcopy(teacher),
            args=config,
            train_dataset=dataset,
            processing_class=tok,
            callbacks=callbacks,
        )

    return make_trainer


@pytest.mark.skipif(not hasattr(trl, "DistillationTrainer"), reason="TRL's DistillationTrainer from 1.16 on")
@pytest.mark.parametrize(
    "beta, precision", [(0.0, "float32"), (0.5, "float32"), (1.0, "float32"), (1.0, "bf16 by default")]
)
def test_distillation_trainer_callback_losses_and_gradients_equal(beta, precision, tmp_path):
    import trl.trainer.distillation_trainer as distillation_trainer

    original = distillation_trainer.ChunkedDivergenceFunction
    callback = trl_losses_and_gradients(distilling_trainer(tmp_path, beta), precision)
    # Each step's divergence between the heads went through token_divergence, and TRL's own is back after training.
    assert callback.divergence.calls >= 3
    assert distillation_trainer.ChunkedDivergenceFunction is original


@pytest.mark.skipif(not FUSED_HEAD, reason="TRL's SFTTrainer has a fused LM head from 1.16 on")
@pytest.mark.parametrize("precision", PRECISIONS)
def test_sft_trainer_callback_serves_its_fused_head(precision, tmp_path):
    # TRL 1.16's SFTTrainer computes its loss, entropy and token accuracy through the fused head.
    tok = tokenizer()
    dataset = datasets.Dataset.from_dict({"text": texts()})

    def make_trainer(model, callbacks, precision):
        config = trl_arguments(
            tmp_path,
            trl.SFTConfig,
            precision,
            packing=True,
            padding_free=True,
            max_length=64,
            dataset_text_field="text",
        )
        return trl.SFTTrainer(
            model=model, args=config, train_dataset=dataset, processing_class=tok, callbacks=callbacks
        )

    callback = trl_losses_and_gradients(make_trainer, precision)
    assert_scored_through_the_op(callback, calls=3)
    if FUSED_HEAD:
        # Loss, entropy and accuracy from one pass over the vocabulary, not token_logprobs and then the summaries.
        assert set(callback.fused_head.ops) == {"linear_cross_entropy_with_statistics"}


def test_fused_head_of_an_untested_trl_is_left_alone_with_a_warning(monkeypatch):
    from torch_offload import trl_fused_head

    original = trl.trainer.utils._ChunkedLogProbFunction
    assert trl_fused_head.install(tiny_model(), "caller") == (None, None)  # no TRL head on it: nothing to say
    model = tiny_model()
    trl.trainer.utils.add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    monkeypatch.setattr(trl, "__version__", "1.17.0")
    with pytest.warns(UserWarning, match=r"caller: TRL 1.17.0's fused LM head is left as it is"):
        assert trl_fused_head.install(model, "caller") == (None, None)
    assert trl.trainer.utils._ChunkedLogProbFunction is original
    monkeypatch.undo()
    head, undo = trl_fused_head.install(model, "caller")
    assert trl.trainer.utils._ChunkedLogProbFunction is head
    undo()
    assert trl.trainer.utils._ChunkedLogProbFunction is original


@pytest.mark.skipif(not FUSED_HEAD, reason="TRL has a fused LM head from 1.16 on")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_head_under_mixed_precision_wrappers_goes_through_the_op(dtype):
    # Mixed precision wraps the forward TRL patched (accelerate: autocast, then a float32 cast of the outputs),
    # and a user's functools.wraps decorator around that: the head is found through them all and serves the call.
    import functools
    import types

    from accelerate.utils import convert_outputs_to_fp32

    from torch_offload import trl_fused_head

    model = tiny_model()
    trl.trainer.utils.add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    ids = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(0))
    truth = model(input_ids=ids, labels=ids, fused_lm_head=True)  # float32
    with torch.autocast("cpu", dtype=dtype):
        want = model(input_ids=ids, labels=ids, fused_lm_head=True)
    patched = model.forward.__func__
    autocast = convert_outputs_to_fp32(torch.autocast("cpu", dtype=dtype)(patched))

    @functools.wraps(autocast)
    def users_wrapper(*args, **kwargs):
        return autocast(*args, **kwargs)

    model.forward = types.MethodType(users_wrapper, model)
    head, undo = trl_fused_head.install(model, "caller")
    try:
        got = model(input_ids=ids, labels=ids, fused_lm_head=True)
    finally:
        undo()
    assert head is not None and head.calls == 1
    # As close to float32's as TRL's own kernel under the same autocast (which rounds each logit to bf16/fp16; the
    # op does not).
    for name in ("log_probs", "entropy"):
        error = (getattr(got, name) - getattr(truth, name)).abs().max()
        assert error <= 2 * (getattr(want, name) - getattr(truth, name)).abs().max(), name


def scored_by_trl_then_by_the_stand_in(model):
    """TRL's fused head's outputs on a batch of 2 x 9 ids, then the same call with the callback's stand-in in place
    (taken out after), and the stand-in."""
    from torch_offload import trl_fused_head

    ids = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(0))
    want = model(input_ids=ids, labels=ids, fused_lm_head=True)
    head, undo = trl_fused_head.install(model, "caller")
    try:
        got = model(input_ids=ids, labels=ids, fused_lm_head=True)
    finally:
        undo()
    return want, got, head


def test_fused_head_cast_to_float32_keeps_trls_kernel():
    # GRPOConfig(cast_lm_head_to_fp32=True): float32 hidden states against a bf16 head, which the op (one dtype)
    # would refuse; TRL's kernel serves those calls, with the same result.
    model = tiny_model().to(torch.bfloat16)
    trl.trainer.utils.add_fused_lm_head(model, temperature=0.7, cast_lm_head_to_fp32=True, outputs=("log_probs",))
    want, got, head = scored_by_trl_then_by_the_stand_in(model)
    assert head.calls == 0
    torch.testing.assert_close(got.log_probs, want.log_probs)


def test_fused_head_on_a_peft_models_base_model_goes_through_the_op():
    # TRL patches a PEFT model's base model (get_base_model()), the callback is handed the PEFT model.
    import peft

    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = peft.get_peft_model(tiny_model(), config)
    trl.trainer.utils.add_fused_lm_head(model.get_base_model(), temperature=0.7, outputs=("log_probs", "entropy"))
    want, got, head = scored_by_trl_then_by_the_stand_in(model)
    assert head.calls == 1
    torch.testing.assert_close(got.log_probs, want.log_probs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.entropy, want.entropy, rtol=1e-5, atol=1e-5)


def test_rl_trainer_scoring_from_whole_logits_is_warned_about(tmp_path):
    # TRL before 1.16 (axolotl's 1.9) scores GRPO's and DPO's tokens from the model's logits, with no fused head to
    # stand in for: said under an RL trainer's configuration, silent under others.
    from torch_offload import trl_fused_head

    grpo = trl_arguments(tmp_path, trl.GRPOConfig, num_generations=2)
    with pytest.warns(UserWarning, match=r"caller: under TRL \S+'s GRPOConfig the model has no fused LM head"):
        assert trl_fused_head.install(tiny_model(), "caller", grpo) == (None, None)

    class MyDPOConfig(trl.DPOConfig):  # a user's subclass is still DPO
        pass

    with pytest.warns(UserWarning, match=r"under TRL \S+'s DPOConfig"):
        trl_fused_head.install(tiny_model(), "caller", trl_arguments(tmp_path, MyDPOConfig))
    others = (arguments(tmp_path), arguments(tmp_path, trl.SFTConfig, bf16=False), None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for args in others:
            assert trl_fused_head.install(tiny_model(), "caller", args) == (None, None)


def test_rl_trainers_calls_take_the_layers_path_unless_asked(tmp_path):
    # An RL trainer's calls carry no labels, which the chunk-recurrent step does not take: the callback's apply()
    # gives them the layers' path, unless chunk_recurrent is given; a plain Trainer's keep the step.
    from torch_offload.integrations.plan import LAYERS, STEP

    grpo = trl_arguments(tmp_path, trl.GRPOConfig, num_generations=2)
    for options, args, route in (({}, grpo, LAYERS), ({"chunk_recurrent": True}, grpo, STEP), ({}, None, STEP)):
        model = tiny_model()
        callback = torch_offload.TorchOffloadCallback(**options)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # TRL's version without a fused head on this model: said elsewhere
            callback.on_train_begin(args, None, None, model=model)
        try:
            assert callback.handle.route == route, (options, args)
        finally:
            callback.on_train_end(args, None, None)


@pytest.mark.skipif(not FUSED_HEAD, reason="TRL has a fused LM head from 1.16 on")
@pytest.mark.parametrize("config", [dict(final_logit_softcapping=5.0), dict(logit_scale=3.0)], ids=str)
def test_fused_head_with_soft_capping_or_a_logit_scale_goes_through_the_op(config):
    # Gemma 2's final soft-capping and Cohere's logit scale, which TRL reads off the model's configuration and
    # applies in its kernel: the op applies them too, with every output TRL's head can ask for.
    model = tiny_model()
    for name, value in config.items():
        setattr(model.config, name, value)
    outputs = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
    trl.trainer.utils.add_fused_lm_head(model, temperature=0.7, outputs=outputs)
    want, got, head = scored_by_trl_then_by_the_stand_in(model)
    assert head.calls == 1
    for name in outputs:
        torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.skipif(not FUSED_HEAD, reason="TRL has a fused LM head from 1.16 on")
def test_sfts_one_pass_head_equals_trls_and_refuses_a_gradient_through_its_entropy():
    # SFT's call (log-probabilities, entropy, top-1) goes through linear_cross_entropy's statistics, whose entropy
    # has no gradient: a backward through it raises rather than giving none (TRL's entropy has one).
    from torch_offload import trl_fused_head

    original = trl.trainer.utils._ChunkedLogProbFunction
    head = trl_fused_head.TokenLogprobsHead(original)
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 16, generator=generator, requires_grad=True)  # float32: TRL's kernel computes in it
    weight = torch.randn(50, 16, generator=generator) / 4
    targets = torch.randint(0, 50, (37,), generator=generator)
    weight[7] = weight[3]  # tied logits: top-1 is argmax's first
    targets[::4] = 7
    outputs = ("log_probs", "entropy", "is_top1")
    got = head.apply(hidden, weight, None, targets, 1.0, 4096, 30.0, 1.0, outputs)
    want = original.apply(hidden, weight, None, targets, 1.0, 4096, 30.0, 1.0, outputs)
    assert head.ops == {"linear_cross_entropy_with_statistics": 1}
    for name, g, w in zip(["log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1"], got, want):
        assert (g is None) == (w is None), name
        if g is not None:
            assert g.dtype == w.dtype, name
            torch.testing.assert_close(g, w, msg=name)
    torch.testing.assert_close(
        torch.autograd.grad(got[0].sum(), hidden, retain_graph=True)[0], torch.autograd.grad(want[0].sum(), hidden)[0]
    )
    with pytest.raises(RuntimeError, match="the entropy of TRL's fused LM head has no gradient"):
        torch.autograd.grad(got[1].sum(), hidden)
