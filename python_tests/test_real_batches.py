"""apply() on the batches users train on: packed documents (position_ids restarting at 0) and padded rows
(attention_mask), exact against the un-applied model, with no [T, T] tensor in the step."""

import peft
import pytest
import torch
import transformers
from functorch.compile import make_boxed_func
from op_recording import CountCalls
from test_apply import FAMILIES, MODELS, assert_close_runs, make_model, tier_options
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.testing import CompileCounterWithBackend
from torch.utils._python_dispatch import TorchDispatchMode

import torch_offload
from torch_offload import masking
from torch_offload.integrations import implementations

SDPA_FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "phi3", "gpt2"]


def packed(tokens=24, documents=(5, 9, 4, 6)):
    """One row of documents of these lengths, as TRL's padding-free packing gives them."""
    ids = torch.randint(3, 128, (1, tokens), generator=torch.Generator().manual_seed(5))
    position_ids = torch.cat([torch.arange(n) for n in documents])[None]
    return dict(input_ids=ids, labels=ids, position_ids=position_ids)


def padded(side, tokens=24, lengths=(24, 18, 10)):
    """Rows of these real lengths, padded on `side`, labels -100 on the padding."""
    ids = torch.randint(3, 128, (len(lengths), tokens), generator=torch.Generator().manual_seed(6))
    mask = (torch.arange(tokens)[None] < torch.tensor(lengths)[:, None]).long()
    if side == "left":
        mask = mask.flip(1)
    return dict(input_ids=ids, labels=ids.masked_fill(mask == 0, -100), attention_mask=mask)


BATCHES = {
    "packed": packed,
    "right_padded": lambda: padded("right"),
    "left_padded": lambda: padded("left"),
    "packed_num_items": lambda: dict(packed(), num_items_in_batch=torch.tensor(17)),
    # Labels on the padding too: the padding's own outputs count, and are transformers' as well.
    "right_padded_labelled": lambda: labelled(padded("right")),
    "left_padded_labelled": lambda: labelled(padded("left")),
}


def labelled(batch):
    return dict(batch, labels=batch["input_ids"])


def step(model, batch):
    model.zero_grad(set_to_none=True)
    loss = model(**batch, use_cache=False).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def build(name):
    if name in MODELS:
        return make_model(name)
    torch.manual_seed(0)
    model = FAMILIES[name][0]().float().train()
    if name == "gpt_oss":  # its sliding layers' window (8 tokens) keeps their dense mask on padded batches
        model.config.sliding_window = 1024
        for module in model.modules():
            if getattr(module, "sliding_window", None) is not None:
                module.sliding_window = 1024  # what its attention passes the attention function
    return model


# Every batch on every tested family; the mixtures of experts (their attention and masks as Llama's or Qwen3's)
# and the dense families whose masks are Llama's on one packed and two padded batches.
CASES = [(name, batch) for name in MODELS for batch in BATCHES]
CASES += [
    (name, batch)
    for name in (
        "qwen3_moe",
        "mixtral",
        "olmo2",
        "granite",
        "smollm3",
        "cohere",
        "glm4",
        "gemma3_text",
        "llama4",
        "gpt_oss",
        "deepseek_v3",
        "qwen2_moe",
    )
    for batch in ("packed", "left_padded", "right_padded")
]


@pytest.mark.parametrize("name, batch", CASES)
def test_packed_and_padded_batches_give_the_unapplied_loss_and_gradients(name, batch):
    model, inputs = build(name), BATCHES[batch]()
    implementation = model.config._attn_implementation
    want = step(model, inputs)
    handle = torch_offload.apply(model, num_shards=2)
    assert_close_runs(want, step(model, inputs))
    # A tested family's SDPA gets segment ids, and so does the eager attention of Gemma 2 (eager in transformers
    # 5.24, SDPA in 5.16, where it keeps its own) and GPT-OSS, but for left padding: there eager attention gives
    # a query that sees no key the mean of the row's values.
    eager = implementation == "eager" and implementations.masks_of(model.config) == "eager"
    left_padding = "left padding (eager attention gives a query that sees no key the mean of the row's values)"
    assert set(handle.mask_fallbacks) == ({left_padding} if eager and batch.startswith("left") else set())
    if implementation == "sdpa" and implementations.masks_of(model.config) == "sdpa":
        assert model.config._attn_implementation == torch_offload.masking.IMPLEMENTATION
    elif eager:
        assert model.config._attn_implementation == torch_offload.eager_attention.IMPLEMENTATION
    else:
        assert model.config._attn_implementation == implementation
    handle.remove()
    assert model.config._attn_implementation == implementation
    assert_close_runs(want, step(model, inputs))


@pytest.mark.parametrize("offload", ["disk", None])
def test_packed_documents_through_the_op_with_offloading(offload, tmp_path):
    model, inputs = make_model("llama"), packed()
    want = step(model, inputs)
    # The layers' path (with the disk tier, training calls with labels take the chunk-recurrent step).
    options = dict(tier_options(offload, tmp_path), chunk_recurrent=False)
    handle = torch_offload.apply(model, offload=offload, num_shards=2, **options)
    calls = []
    op = torch.ops.offload.attention_block.default

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is op:
                calls.append(args[12] if len(args) > 12 else (kwargs or {}).get("segment_ids"))
            return func(*args, **(kwargs or {}))

    with Record():
        got = step(model, inputs)
    assert_close_runs(want, got)
    assert handle.attention_blocks == 3 and len(calls) >= 3
    assert all(c is not None and c.shape == (1, 24) for c in calls)  # every layer's op call took the segments
    handle.remove()


def test_flash_attention_kwargs_of_packed_documents_keep_the_op():
    # DataCollatorWithFlattening(return_flash_attn_kwargs=True) describes the documents twice: position_ids
    # and flash attention's cumulative lengths, which SDPA ignores.
    collator = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)
    ids = packed()["input_ids"][0].tolist()
    inputs = collator([{"input_ids": ids[a:b]} for a, b in ((0, 5), (5, 14), (14, 18), (18, 24))])
    assert {"cu_seq_lens_q", "max_length_k", "seq_idx"} <= set(inputs)
    model = make_model("llama")
    want = step(model, inputs)
    handle = torch_offload.apply(model, num_shards=2)
    op = torch.ops.offload.attention_block.default
    with CountCalls(op) as calls:
        got = step(model, inputs)
    assert_close_runs(want, got)
    # Every layer's attention through the op.
    assert calls.counts[op] == 3
    assert handle.attention_blocks == 3
    handle.remove()


def keeps_its_own_masks(model):
    """transformers 5.16 (axolotl's) gives Gemma 2 SDPA, ignoring its soft-cap: it is not among the families
    tested with segment ids there, and keeps its own dense masks and attention."""
    return model.config.model_type == "gemma2" and model.config._attn_implementation != "eager"


def windowed(name):
    """A family's model whose sliding layers' window (8 tokens) is shorter than the batches' rows (24)."""
    if name in ("qwen2", "qwen3"):  # every layer a sliding one
        return make_model(name, sliding_window=8, use_sliding_window=True, max_window_layers=0)
    if name in MODELS:
        return make_model(name, sliding_window=8)
    torch.manual_seed(0)
    model = FAMILIES[name][0]().float().train()
    assert model.config.sliding_window == 8
    return model


@pytest.mark.parametrize("name", ["mistral", "qwen2", "qwen3", "phi3", "gemma2", "gpt_oss"])
@pytest.mark.parametrize("batch", ["packed", "packed_num_items", "right_padded"])
def test_a_sliding_window_shorter_than_the_row_is_a_band_in_each_document_and_padding_keeps_the_dense_mask(name, batch):
    # SDPA (Mistral: through the module's own forward, attention_block taking no window) and eager attention
    # (Gemma 2's soft-capped, GPT-OSS's with sinks): segment_attention with the window on packed documents. Padding
    # that would see its sequence past the window is not the op's: the dense mask, counted.
    model, inputs = windowed(name), BATCHES[batch]()
    own = keeps_its_own_masks(model)
    want = step(model, inputs)
    handle = torch_offload.apply(model, num_shards=2)
    calls = CountCalls(torch.ops.offload.segment_attention.default)
    with calls:
        got = step(model, inputs)
    assert_close_runs(want, got)
    padded = batch == "right_padded"
    window = "a sliding window (8 tokens) shorter than the sequence (24)"
    assert set(handle.mask_fallbacks) == ({window} if padded and not own else set())
    assert (calls.counts[torch.ops.offload.segment_attention.default] > 0) == (
        not own and (not padded or name in ("gemma2", "gpt_oss"))
    )
    handle.remove()


def test_a_window_shorter_than_the_row_gets_ids_only_for_families_that_pass_it_to_their_attention():
    from types import SimpleNamespace

    from transformers import masking_utils as mu

    masking.register()
    for model_type, ids in (("mistral", True), ("llama", False)):  # Llama's attention passes no sliding_window
        config = SimpleNamespace(model_type=model_type)
        window = mu.sliding_window_causal_mask_function(8)
        got = masking.mask(1, 24, 24, mask_function=window, config=config, local_size=8)  # as transformers calls it
        assert (got.shape == (1, 24) and not got.any()) if ids else got.shape == (1, 1, 24, 24)
        assert masking.fallbacks(config) == (
            {} if ids else {"a sliding window (8 tokens) shorter than the sequence (24)": 1}
        )
        masking.forget(config)


@pytest.mark.parametrize("batch", ["packed", "left_padded", "right_padded"])
@pytest.mark.parametrize("chunk", [24, 8], ids=["as_long_as_the_row", "shorter"])
def test_attention_chunks_are_segments_in_unpadded_rows_and_padded_rows_with_shorter_ones_say_so(chunk, batch):
    # Llama 4's chunked layers: a chunk as long as the row is causal attention (counted from a left-padded row's first
    # real token); a shorter one cuts the documents at its boundaries, which segment ids describe in a row without
    # padding. Padding past a chunk sees no real key in transformers' mask, its run's sequence in segment ids.
    model, inputs = build("llama4"), BATCHES[batch]()
    assert "chunked_attention" in model.config.layer_types
    model.config.attention_chunk_size = chunk
    want = step(model, inputs)
    handle = torch_offload.apply(model, num_shards=2)
    assert model.config._attn_implementation == torch_offload.masking.IMPLEMENTATION
    got = step(model, inputs)
    assert_close_runs(want, got)
    if chunk == 8 and batch == "packed":  # the chunks change the result: segment ids without them would not give it
        model.config.attention_chunk_size = 24
        with pytest.raises(AssertionError):
            assert_close_runs(got, step(model, inputs))
    reasons = handle.mask_fallbacks
    if chunk == 8 and batch != "packed":
        assert list(reasons) == ["an attention chunk (8 tokens) shorter than the sequence (24)"]
    else:
        assert not reasons
    handle.remove()


def test_padding_with_holes_falls_back_to_the_dense_mask():
    model = make_model("llama")
    inputs = padded("right")
    inputs["attention_mask"][0, 5] = 0  # a real token masked in the middle of a row
    inputs["labels"][0, 5] = -100
    want = step(model, inputs)
    handle = torch_offload.apply(model, num_shards=2)
    assert_close_runs(want, step(model, inputs))
    assert list(handle.mask_fallbacks) == ["an attention_mask whose real tokens are not contiguous in a row"]
    handle.remove()


def test_peft_lora_on_packed_documents():
    model = make_model("llama")
    model = peft.get_peft_model(
        model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "up_proj"], init_lora_weights=False)
    )
    inputs = packed()
    want = step(model, inputs)
    handle = torch_offload.apply(model, num_shards=2)
    assert_close_runs(want, step(model, inputs))
    handle.remove()


class LargestTensor(TorchDispatchMode):
    """The most elements of any tensor an op returns while active."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


# The families whose masks are Llama's code on packed documents (Mixtral's experts hold [rows x top-k, 2I] > T^2;
# Gemma 3's windows are shorter than T), and the eager ones: Gemma 2's and GPT-OSS's scores are [T, T] per head.
@pytest.mark.parametrize(
    "name, batch",
    [
        (name, batch)
        for name in [*SDPA_FAMILIES, "qwen3_moe", "qwen2_moe"]
        for batch in ("packed", "right_padded", "left_padded")
    ]
    + [
        (name, "packed")
        for name in ("olmo2", "granite", "smollm3", "cohere", "glm4", "llama4", "gemma2", "gpt_oss", "deepseek_v3")
    ],
)
def test_no_tensor_of_tokens_squared_elements_in_an_applied_step(name, batch):
    # 512 tokens: T * T = 262,144 elements, more than any weight or activation of these models
    # (GPT-2's MLP, [3 x 512, 128], is the largest); the un-applied step's mask has 3 x T * T.
    tokens = 512
    model = make_model(name, max_position_embeddings=1024) if name in MODELS else build(name)
    own = keeps_its_own_masks(model)
    inputs = (
        packed(tokens, documents=(200, 112, 140, 60))
        if batch == "packed"
        else padded(batch.split("_")[0], tokens, lengths=(512, 400, 128))
    )
    with LargestTensor() as plain:
        step(model, inputs)
    assert plain.largest >= tokens * tokens  # the test sees a dense mask where there is one
    handle = torch_offload.apply(model, num_shards=2)
    with LargestTensor() as applied:
        step(model, inputs)
    assert (applied.largest < tokens * tokens) != own, applied.largest
    handle.remove()


def test_latent_attention_on_one_unmasked_sequence_is_exact_with_no_tensor_of_tokens_squared_elements():
    # DeepSeek-V3's value heads are narrower than its query and key heads. A row with no padding gets no mask, and
    # SDPA's fused CPU kernel takes one head dimension: its math kernel writes out every head's [T, T] scores.
    tokens = 512
    model = build("deepseek_v3")
    ids = torch.randint(3, 128, (2, tokens), generator=torch.Generator().manual_seed(7))
    inputs = dict(input_ids=ids, labels=ids)
    with LargestTensor() as plain:
        want = step(model, inputs)
    assert plain.largest >= tokens * tokens
    handle = torch_offload.apply(model, num_shards=2)
    with LargestTensor() as applied:
        got = step(model, inputs)
    assert applied.largest < tokens * tokens, applied.largest
    assert_close_runs(want, got)
    handle.remove()


@pytest.mark.parametrize("name", ["mistral", "gpt_oss"])
def test_no_tensor_of_tokens_squared_elements_with_windows_shorter_than_the_row(name):
    tokens = 512
    model = make_model(name, sliding_window=64, max_position_embeddings=1024) if name in MODELS else windowed(name)
    inputs = packed(tokens, documents=(200, 112, 140, 60))
    with LargestTensor() as plain:
        step(model, inputs)
    assert plain.largest >= tokens * tokens
    handle = torch_offload.apply(model, num_shards=2)
    with LargestTensor() as applied:
        step(model, inputs)
    assert applied.largest < tokens * tokens, applied.largest
    assert handle.mask_fallbacks == {}
    handle.remove()


def test_a_family_not_tested_with_segment_ids_keeps_transformers_mask():
    from test_apply_exactness import tiny_olmo

    model, inputs = tiny_olmo(), packed()
    assert model.config._attn_implementation == "sdpa"
    want = step(model, inputs)
    handle = torch_offload.apply(model, num_shards=2)
    assert model.config._attn_implementation == "sdpa"
    assert_close_runs(want, step(model, inputs))
    handle.remove()


def compiled_step(model, inputs, dynamic=False):
    """step() through torch.compile(fullgraph=True) (a graph break fails), and the forward and backward
    graphs AOTAutograd made, run as they are."""
    graphs = []

    def keep(graph, _):
        graphs.append(graph)
        return make_boxed_func(graph.forward)

    compiled = torch.compile(
        model, fullgraph=True, dynamic=dynamic, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep)
    )
    model.zero_grad(set_to_none=True)
    loss = compiled(**inputs, use_cache=False).loss
    loss.backward()
    return (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}), graphs


def forward_calls(graphs, *ops):
    return sum(node.target in ops for node in graphs[0].graph.nodes)


def calls_and_largest(graphs):
    """(forward calls of attention_block or segment_attention, the most elements of any tensor) in the graphs."""
    calls = forward_calls(
        graphs, torch.ops.offload.attention_block.default, torch.ops.offload.segment_attention.default
    )
    largest = max(
        node.meta["val"].numel()
        for graph in graphs
        for node in graph.graph.nodes
        if isinstance(node.meta.get("val"), torch.Tensor)
    )
    return calls, largest


@pytest.mark.parametrize(
    "name, batch",
    [(name, batch) for name in SDPA_FAMILIES for batch in ("packed", "right_padded", "left_padded")]
    + [("llama4", "packed")],  # its chunked layers' mask read under compile (its padded rows' activations exceed T^2)
)
def test_compiled_applied_step_equals_the_unapplied_with_no_tensor_of_tokens_squared(name, batch):
    torch._dynamo.reset()
    tokens = 512
    model = make_model(name, max_position_embeddings=1024) if name in MODELS else build(name)
    inputs = (
        packed(tokens, documents=(200, 112, 140, 60))
        if batch == "packed"
        else padded(batch.split("_")[0], tokens, lengths=(512, 400, 128))
    )
    want = step(model, inputs)
    handle = torch_offload.apply(model, num_shards=2)
    got, graphs = compiled_step(model, inputs)
    assert_close_runs(want, got)
    calls, largest = calls_and_largest(graphs)
    assert calls == 3  # every layer's attention through the op, with the segments
    assert largest < tokens * tokens, largest
    # And every MLP through tiled_mlp (GPT-2's: tiled_apply; Llama 4's mixture: its own forward under compile).
    if handle.tiled_mlps:
        tiled = 3 if name in MODELS else 2
        assert handle.tiled_mlps == forward_calls(graphs, torch.ops.offload.tiled_mlp.default) == tiled
    handle.remove()


def test_compiled_bidirectional_config_keeps_transformers_dense_mask():
    torch._dynamo.reset()
    model = make_model("mistral", is_causal=False, sliding_window=1024)
    inputs = padded("right")
    want = step(model, inputs)
    handle = torch_offload.apply(model, num_shards=2)
    got, graphs = compiled_step(model, inputs)
    assert_close_runs(want, got)
    assert calls_and_largest(graphs)[0] == 0
    handle.remove()


def test_compiled_dynamic_over_changing_tokens_and_document_counts_without_recompiling():
    torch._dynamo.reset()
    model = make_model("qwen3")
    batches = [
        packed(tokens, documents) for tokens, documents in ((24, (5, 9, 4, 6)), (31, (20, 11)), (40, (3, 7, 10, 12, 8)))
    ]
    wants = [step(model, inputs) for inputs in batches]
    handle = torch_offload.apply(model, offload="disk", num_shards=2, min_bytes=0)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, fullgraph=True, dynamic=True, backend=counter)
    compiles = []
    for inputs, want in zip(batches, wants):
        model.zero_grad(set_to_none=True)
        loss = compiled(**inputs, use_cache=False).loss
        loss.backward()
        assert_close_runs(want, (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        compiles.append(counter.frame_count)
    assert compiles[0] > 0 and compiles[-1] == compiles[0]
    handle.remove()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_attention_chunks_shorter_than_packed_rows_are_exact_with_no_tensor_of_tokens_squared(compiled):
    # Llama 4's chunked layers at 8192 tokens a chunk: longer rows cut each document where a chunk starts, as ids.
    torch._dynamo.reset()
    tokens = 512
    model, inputs = build("llama4"), packed(tokens, documents=(200, 112, 140, 60))
    model.config.attention_chunk_size = 128
    want = step(model, inputs)
    handle = torch_offload.apply(model, num_shards=2)
    if compiled:
        got, graphs = compiled_step(model, inputs)
        calls, largest = calls_and_largest(graphs)
        assert calls == 3
    else:
        with LargestTensor() as applied:
            got = step(model, inputs)
        largest = applied.largest
    assert_close_runs(want, got)
    assert largest < tokens * tokens, largest
    assert handle.mask_fallbacks == {}
    handle.remove()


@pytest.mark.parametrize("window, dense", [(1024, False), (256, True)], ids=["longer_than_the_row", "shorter"])
def test_compiled_sliding_window_within_reach_keeps_transformers_dense_mask(window, dense):
    torch._dynamo.reset()
    tokens = 512
    model = make_model("mistral", sliding_window=window, max_position_embeddings=1024)
    inputs = packed(tokens, documents=(200, 112, 140, 60))
    want = step(model, inputs)
    handle = torch_offload.apply(model, num_shards=2)
    got, graphs = compiled_step(model, inputs)
    assert_close_runs(want, got)
    calls, largest = calls_and_largest(graphs)
    assert (calls, largest >= tokens * tokens) == ((0, True) if dense else (3, False))
    handle.remove()


@pytest.mark.parametrize("checkpoint", [False, True], ids=["saved", "recomputed"])
def test_compiled_padding_with_holes_is_refused_at_run_time(checkpoint):
    # Recomputed: the check sits in a graph with activation checkpointing (torch 2.11 refuses an assert there).
    torch._dynamo.reset()
    model = make_model("llama")
    handle = torch_offload.apply(model, num_shards=2, checkpoint=checkpoint)
    inputs = padded("right")
    compiled_step(model, inputs)  # compiles, and runs a batch without holes
    inputs["attention_mask"][0, 5] = 0
    with pytest.raises(RuntimeError, match="real tokens must be contiguous in each row"):
        compiled_step(model, inputs)
    handle.remove()


def test_compiled_attention_dropout_takes_the_dense_mask_the_segments_stand_for():
    from test_attention_block import SEGMENTS, segment_mask

    allowed, has_keys = torch_offload.segment_sdpa.dense_mask(SEGMENTS)
    assert torch.equal(has_keys, segment_mask(SEGMENTS).any(-1)[:, 0])
    assert torch.equal(allowed & has_keys[:, None, :, None], segment_mask(SEGMENTS))
    torch._dynamo.reset()
    model = make_model("gpt2", attn_pdrop=0.5)
    handle = torch_offload.apply(model, num_shards=2)
    (loss, grads), graphs = compiled_step(model, packed())
    assert torch.isfinite(loss) and all(torch.isfinite(g).all() for g in grads.values())
    assert calls_and_largest(graphs)[0] == 0  # SDPA with dropout, not the op
    handle.remove()


def test_the_mask_compositions_of_the_installed_transformers_are_read_or_refused():
    # transformers 5.24 remaps positions under the packed factory, 5.16 (axolotl's venv) does not: the same mask
    # within each document. Compositions it cannot read (an or-overlay, packing twice) are refused: a dense mask.
    from transformers import masking_utils as mu

    factories = masking._find_factories()
    ids = torch.tensor([[0, 0, 0, 1, 1, 2]])
    positions = torch.tensor([[0, 1, 2, 0, 1, 0]])
    remap = getattr(mu, "remap_positions_for_packed_sequence", None)

    def packed(function, packed_ids=ids):
        inner = function if remap is None else remap(function, positions)
        return mu.and_masks(inner, mu.packed_sequence_mask_function(packed_ids))

    window, segments = masking._describe(packed(mu.causal_mask_function), factories)
    assert window is None and segments is ids
    window, segments = masking._describe(packed(mu.sliding_window_causal_mask_function(3)), factories)
    assert window == ("a sliding window", 3) and segments is ids
    chunked = mu.and_masks(mu.chunked_overlay(16, torch.zeros(1, dtype=torch.long)), mu.causal_mask_function)
    reach, segments = masking._describe(packed(chunked), factories)
    assert reach[:2] == ("an attention chunk", 16) and segments is ids
    # Remapped, a chunk's boundaries count each document's own positions.
    assert reach[2:] == (() if remap is None else (positions,))
    overlay = mu.or_masks(mu.causal_mask_function, mu.bidirectional_mask_function)
    for unknown in (
        packed(overlay),
        mu.and_masks(packed(mu.causal_mask_function), mu.packed_sequence_mask_function(ids)),
    ):
        with pytest.raises(masking._Unknown):
            masking._describe(unknown, factories)
