"""chunk_recurrent_loss: the loss and every gradient of the model's own step, in float64 to rounding, for the
families it takes, one row, several, packed documents and padded rows, chunks that do and do not divide the
sequence, tied heads, frozen weights and a scaled loss; nothing left open; bad input refused by name."""

import gc
import os
import re
import time

import pytest
import torch
import torch.nn.functional as F
import transformers
from test_apply import assert_close_runs, make_model

import torch_offload
from torch_offload.integrations.chunk_attention import Segments

TOKENS = 23


def tokens_and_labels():
    ids = torch.randint(3, 128, (1, TOKENS), generator=torch.Generator().manual_seed(3))
    labels = ids.clone()
    labels[0, 4:9] = -100  # a prompt's tokens, not counted
    return ids, labels


def batches():
    """Each kind of batch the step reads, as keyword arguments of the model's call (and chunk_recurrent_loss's)."""
    ids = torch.randint(3, 128, (2, TOKENS), generator=torch.Generator().manual_seed(4))
    labels = ids.clone()
    labels[:, 4:9] = -100
    padding = torch.ones_like(ids)
    padding[0, :6] = 0  # left padding: its queries see no key
    padding[1, -7:] = 0  # right padding: its queries see the row's text
    documents = torch.cat([torch.arange(7), torch.arange(10), torch.arange(6)])  # across chunks of 5 and 7
    return {
        "one row": dict(input_ids=ids[:1], labels=labels[:1]),
        "two rows": dict(input_ids=ids, labels=labels),
        "padded rows": dict(input_ids=ids, labels=ids, attention_mask=padding),  # the pads' labels counted
        "padded rows, pads ignored": dict(
            input_ids=ids, labels=ids.masked_fill(padding == 0, -100), attention_mask=padding
        ),
        "packed documents": dict(input_ids=ids[:1], labels=labels[:1], position_ids=documents[None]),
        "packed rows": dict(input_ids=ids, labels=labels, position_ids=torch.stack([documents, documents.roll(5)])),
        "num_items_in_batch": dict(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(17)),
        "ignore_index": dict(input_ids=ids[:1], labels=labels[:1].masked_fill(labels[:1] == -100, 7), ignore_index=7),
    }


def build(name, **overrides):
    if name == "mistral":
        overrides.setdefault("sliding_window", None)
    return make_model(name, **overrides)


def reference(model, ids, labels, *, num_items_in_batch=None, ignore_index=-100, **call):
    """Plain PyTorch's loss and gradients: transformers' shifted cross-entropy on the model's logits, in the logits'
    dtype (transformers' own loss is float32 even for a float64 model)."""
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, use_cache=False, **call).logits
    targets = F.pad(labels, (0, 1), value=ignore_index)[:, 1:]
    reduction = "mean" if num_items_in_batch is None else "sum"
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=ignore_index, reduction=reduction)
    if num_items_in_batch is not None:
        loss = loss / num_items_in_batch
    loss.backward()
    return loss.detach(), gradients(model)


def chunked(model, ids, labels, directory, scale=1.0, **options):
    model.zero_grad(set_to_none=True)
    loss = torch_offload.chunk_recurrent_loss(model, ids, labels, directory=directory, **options)
    (loss * scale if scale != 1.0 else loss).backward()
    return loss.detach(), gradients(model)


def gradients(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_equal_to_rounding(want, got):
    torch.testing.assert_close(got[0], want[0], rtol=1e-12, atol=1e-13)
    assert got[1].keys() == want[1].keys()
    for name in want[1]:
        torch.testing.assert_close(got[1][name], want[1][name], rtol=1e-10, atol=1e-12, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("chunk_tokens", [1, 5, TOKENS, 64])
@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2", "qwen3", "mistral_window"])
def test_float64_loss_and_gradients_equal_plain_pytorch(name, chunk_tokens, tmp_path):
    # mistral_window: a sliding window of 6 tokens, shorter than the chunks of 23 and 64 and longer than those of 5
    model = (build("mistral", sliding_window=6) if name == "mistral_window" else build(name)).double()
    ids, labels = tokens_and_labels()
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # grouped queries
    want = reference(model, ids, labels)
    got = chunked(model, ids, labels, tmp_path, chunk_tokens=chunk_tokens)
    assert got[0].dtype == torch.float64
    assert_equal_to_rounding(want, got)


@pytest.mark.parametrize("chunk_tokens", [5, 2 * TOKENS])
@pytest.mark.parametrize("kind", list(batches()))
def test_float64_batches_equal_plain_pytorch(kind, chunk_tokens, tmp_path):
    model, call = build("qwen3" if kind == "packed rows" else "llama").double(), batches()[kind]
    want = reference(model, call.pop("input_ids"), call.pop("labels"), **call)
    assert torch.isfinite(want[0])
    model.zero_grad(set_to_none=True)
    loss = torch_offload.chunk_recurrent_loss(model, **batches()[kind], chunk_tokens=chunk_tokens, directory=tmp_path)
    loss.backward()
    assert_equal_to_rounding(want, (loss.detach(), gradients(model)))


def blocks(segments, queries_chunk, keys_chunk):
    """(queries, keys, causal, first query's place, first key's place) of each block."""
    return [(b.rows, b.keys, b.causal, b.query_start, b.key_start) for b in segments.blocks(queries_chunk, keys_chunk)]


def test_pairs_of_chunks_are_cut_into_blocks_by_segment():
    """Two documents of one chunk each: the second's queries never read the first's keys, a chunk against itself
    runs causal; padded rows: a left pad's queries see nothing, a right pad's the text of its row."""
    bounds = [(0, 4), (4, 8)]
    documents = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    segments = Segments(bounds, documents, documents)
    assert blocks(segments, 1, 0) == [] and blocks(segments, 1, 1) == [(slice(0, 4), slice(0, 4), True, 4, 4)]
    # Row 0: two pads, then six tokens; row 1 (from token 8): five tokens, then three pads.
    keys = torch.tensor([-1, -1, 0, 0, 0, 0, 0, 0, 9, 9, 9, 9, 9, -1, -1, -1])
    queries = torch.tensor([-1, -1, 0, 0, 0, 0, 0, 0, 9, 9, 9, 9, 9, 9, 9, 9])
    padded = Segments([(0, 6), (6, 12), (12, 16)], queries, keys)
    assert blocks(padded, 0, 0) == [(slice(2, 6), slice(2, 6), True, 2, 2)]
    assert blocks(padded, 1, 0) == [(slice(0, 2), slice(2, 6), False, 6, 2)]
    assert blocks(padded, 1, 1) == [(slice(0, 2), slice(0, 2), True, 6, 6), (slice(2, 6), slice(2, 6), True, 8, 8)]
    assert blocks(padded, 2, 1) == [(slice(0, 4), slice(2, 6), False, 12, 8)]  # the pads see their row's text
    assert blocks(padded, 2, 2) == [(slice(0, 4), slice(0, 1), True, 12, 12)]


def test_the_padding_tokens_embedding_row_gets_no_gradient(tmp_path):
    """The embedding's gradient is added row by row (no dense gradient per chunk): its padding_idx row stays zero, as
    nn.Embedding's backward leaves it, and a row seen in several chunks adds up."""
    model, (ids, labels) = build("llama").double(), tokens_and_labels()
    ids[0, ::4] = model.model.embed_tokens.padding_idx
    ids[0, 1::7] = 5
    want = reference(model, ids, labels)
    assert torch.count_nonzero(want[1]["model.embed_tokens.weight"][model.model.embed_tokens.padding_idx]) == 0
    assert_equal_to_rounding(want, chunked(model, ids, labels, tmp_path, chunk_tokens=5))


def test_tied_head_frozen_weights_and_a_scaled_loss(tmp_path):
    model, (ids, labels) = build("llama", tie_word_embeddings=True).double(), tokens_and_labels()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    for parameter in (*model.model.layers[0].parameters(), model.model.norm.weight):
        parameter.requires_grad_(False)
    loss, grads = reference(model, ids, labels)
    got = chunked(model, ids, labels, tmp_path, scale=3.0, chunk_tokens=4)
    assert "model.layers.0.mlp.up_proj.weight" not in got[1] and "model.norm.weight" not in got[1]
    assert_equal_to_rounding((loss, {n: 3 * g for n, g in grads.items()}), got)


def test_a_kept_graph_runs_backward_again_and_a_freed_one_says_so(tmp_path):
    model, (ids, labels) = build("llama").double(), tokens_and_labels()
    loss, grads = reference(model, ids, labels)
    model.zero_grad(set_to_none=True)
    got = torch_offload.chunk_recurrent_loss(model, ids, labels, chunk_tokens=5, directory=tmp_path)
    got.backward(retain_graph=True)
    got.backward()
    assert_equal_to_rounding((loss, {n: 2 * g for n, g in grads.items()}), (got.detach(), gradients(model)))
    with pytest.raises(RuntimeError, match="chunk_recurrent_loss: a second backward through the step"):
        got.backward()


def test_a_gradient_of_the_gradients_raises_rather_than_reads_them_as_constants(tmp_path):
    model, (ids, labels) = build("llama").double(), tokens_and_labels()
    loss = torch_offload.chunk_recurrent_loss(model, ids, labels, chunk_tokens=5, directory=tmp_path)
    with pytest.raises(RuntimeError, match="the step's gradients have no graph of their own"):
        torch.autograd.grad(loss, [model.lm_head.weight], create_graph=True)  # as a gradient penalty takes them


def test_a_batch_without_a_counted_label_gives_plain_pytorchs_nan_loss_and_zero_gradients(tmp_path):
    """Every label ignored (a completion truncated away): a NaN loss and zero gradients, not 0 x 1/0 = NaN ones."""
    model, (ids, _) = build("llama").double(), tokens_and_labels()
    labels = torch.full_like(ids, -100)
    want, got = reference(model, ids, labels), chunked(model, ids, labels, tmp_path, chunk_tokens=5)
    assert want[0].isnan() and got[0].isnan() and want[1].keys() == got[1].keys()
    for name, gradient in want[1].items():
        assert not gradient.any() and not got[1][name].any(), name


def test_frozen_embeddings_and_one_trained_projection(tmp_path):
    model, (ids, labels) = build("qwen2").double(), tokens_and_labels()
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(name == "model.layers.1.self_attn.q_proj.weight")  # as LoRA leaves a base model
    want = reference(model, ids, labels)
    assert list(want[1]) == ["model.layers.1.self_attn.q_proj.weight"]
    assert_equal_to_rounding(want, chunked(model, ids, labels, tmp_path, chunk_tokens=7))


def test_float32_equals_the_models_own_step(tmp_path):
    model, (ids, labels) = build("llama"), tokens_and_labels()
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=labels, use_cache=False).loss
    loss.backward()
    want = loss.detach(), gradients(model)
    got = chunked(model, ids, labels, tmp_path, chunk_tokens=6)
    assert got[0].dtype == torch.float32
    assert_close_runs(want, got)


GRADCHECK_BATCHES = {
    "one row": dict(rows=1),
    "padded rows": dict(rows=2, attention_mask=torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0, 0]])),
    "packed documents": dict(rows=1, position_ids=torch.tensor([[0, 1, 2, 0, 1, 2, 3]])),
}


@pytest.mark.parametrize("kind", list(GRADCHECK_BATCHES))
def test_gradcheck_float64(kind, tmp_path):
    # Small enough for the slow mode's column per parameter on one row (about 150 of them).
    config = transformers.LlamaConfig(
        vocab_size=5, hidden_size=4, intermediate_size=4, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=16,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).double().train()
    for norm in (m for m in model.modules() if isinstance(m, transformers.models.llama.modeling_llama.LlamaRMSNorm)):
        norm.forward = float64_rms_norm(norm)  # transformers' computes in float32: too coarse for finite differences
    call = dict(GRADCHECK_BATCHES[kind])
    ids = torch.randint(0, 5, (call.pop("rows"), 7), generator=torch.Generator().manual_seed(1))
    parameters = [p for p in model.parameters()]

    def step(*_parameters):  # the model's own parameters: gradcheck perturbs them in place
        return torch_offload.chunk_recurrent_loss(model, ids, ids, chunk_tokens=3, directory=tmp_path, **call)

    assert torch.autograd.gradcheck(step, parameters, eps=1e-6, atol=1e-6, fast_mode=kind != "one row")


def float64_rms_norm(norm):
    def forward(hidden):
        return norm.weight * hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)

    return forward


def test_without_gradients_and_without_backward_nothing_stays_open(tmp_path):
    model, (ids, labels) = build("llama").double(), tokens_and_labels()
    want = reference(model, ids, labels)[0]
    gc.collect()
    descriptors = len(os.listdir("/proc/self/fd"))
    with torch.no_grad():
        loss = torch_offload.chunk_recurrent_loss(model, ids, labels, chunk_tokens=5, directory=tmp_path)
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-13)
    assert not loss.requires_grad
    loss = torch_offload.chunk_recurrent_loss(model, ids, labels, chunk_tokens=5, directory=tmp_path)
    assert len(os.listdir("/proc/self/fd")) == descriptors + 1  # the step's chunk file, kept for backward
    del loss  # a graph dropped without backward
    gc.collect()
    assert open_descriptors(descriptors) == descriptors
    chunked(model, ids, labels, tmp_path, chunk_tokens=5)
    assert open_descriptors(descriptors) == descriptors and os.listdir(tmp_path) == []


def open_descriptors(expected, seconds=10.0):
    """The process's open descriptors once they are ``expected`` or ``seconds`` have passed: the disk tier closes a
    file on its I/O thread, after the last ticket in it is freed."""
    deadline = time.monotonic() + seconds
    while (count := len(os.listdir("/proc/self/fd"))) != expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return count


def with_dropout(model):
    model.model.layers[0].mlp.dropout = torch.nn.Dropout(0.1)  # as LoRA's, which its forward would call
    return model


def skip_a_layer(model):
    model.model.layers[1].forward = lambda hidden_states, **_: hidden_states  # its modules as before
    return model


BAD_MODELS = {
    "dropout": (lambda: with_dropout(build("llama")), "model.layers.0.mlp.dropout drops out in training mode"),
    "dynamic_rope": (
        lambda: build("llama", rope_parameters=dict(rope_type="dynamic", factor=2.0)),
        "rotary embedding ('dynamic') depends on a call's longest position",
    ),
    "attention_dropout": (lambda: build("llama", attention_dropout=0.1), "attention dropout"),
    "a_layer_without_attention": (
        lambda: skip_a_layer(build("llama")),
        "layer 1's attention did not call the attention implementation",
    ),
    "bfloat16": (lambda: build("llama").bfloat16(), "parameters in torch.bfloat16: the step would round"),
}


@pytest.mark.parametrize("case", list(BAD_MODELS))
def test_a_model_it_does_not_compute_exactly_is_refused(case, tmp_path):
    make, message = BAD_MODELS[case]
    ids, labels = tokens_and_labels()
    with pytest.raises(ValueError, match="chunk_recurrent_loss: model: .*" + re.escape(message)):
        torch_offload.chunk_recurrent_loss(make(), ids, labels, directory=tmp_path)
    assert os.listdir(tmp_path) == []


BAD_INPUTS = {
    "float_ids": (dict(input_ids=torch.ones(1, 8)), TypeError, "input_ids must be an int64 CPU tensor"),
    "int32_labels": (dict(labels=torch.ones(1, 8, dtype=torch.int32)), TypeError, "labels must be an int64"),
    "three_dimensions": (dict(input_ids=torch.ones(1, 2, 4, dtype=torch.long)), ValueError, r"input_ids must be \["),
    "empty": (dict(input_ids=torch.ones(1, 0, dtype=torch.long)), ValueError, "input_ids must be"),
    "shapes": (dict(labels=torch.ones(1, 7, dtype=torch.long)), ValueError, r"labels: shape \[1, 7\]"),
    "mask_shape": (dict(attention_mask=torch.ones(2, 8, dtype=torch.long)), ValueError, "attention_mask: shape"),
    "float_mask": (dict(attention_mask=torch.ones(1, 8)), TypeError, "attention_mask must be an int64"),
    "mask_holes": (
        dict(attention_mask=torch.tensor([[1, 1, 0, 1, 1, 1, 1, 1]])),
        ValueError,
        "attention_mask: a row's real tokens are not contiguous",
    ),
    "positions_shape": (dict(position_ids=torch.arange(7)[None]), ValueError, "position_ids: shape"),
    "zero_chunk": (dict(chunk_tokens=0), ValueError, "chunk_tokens must be None or a positive int"),
    "bool_chunk": (dict(chunk_tokens=True), ValueError, "chunk_tokens must be None or a positive int"),
    "float_chunk": (dict(chunk_tokens=4.0), ValueError, "chunk_tokens must be None or a positive int"),
    "no_directory": (dict(directory="/nonexistent/chunks"), ValueError, "directory '/nonexistent/chunks'"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_refused_by_name(case, tmp_path):
    overrides, error, message = BAD_INPUTS[case]
    ids = torch.ones(1, 8, dtype=torch.long)
    arguments = {**dict(input_ids=ids, labels=ids, directory=tmp_path), **overrides}
    with pytest.raises(error, match="chunk_recurrent_loss: " + message):
        torch_offload.chunk_recurrent_loss(build("llama"), **arguments)


def test_autocast_is_refused(tmp_path):
    # Its forward would run in bfloat16 where backward's recomputation, outside the context, would not.
    ids = torch.ones(1, 8, dtype=torch.long)
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(RuntimeError, match="autocast is on"):
        torch_offload.chunk_recurrent_loss(build("llama"), ids, ids, directory=tmp_path)
    assert os.listdir(tmp_path) == []


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")
def test_a_ram_directory_is_refused():
    ids = torch.ones(1, 8, dtype=torch.long)
    with pytest.raises(ValueError, match="directory '/dev/shm' is on a RAM file system"):
        torch_offload.chunk_recurrent_loss(build("llama"), ids, ids, directory="/dev/shm")


def dense_attention(q, k, v, heads, allowed):
    """Plain PyTorch's attention with the score mods of ``heads`` ([heads, T, d] q; [kv heads, T, d] k and v;
    ``allowed`` [T, T] the keys each query sees), a sink a column of the softmax with no value."""
    k, v = (t.repeat_interleave(heads.groups, 0) for t in (k, v))
    scores = q @ k.transpose(-1, -2) * heads.scaling
    if heads.softcap is not None:
        scores = heads.softcap * torch.tanh(scores / heads.softcap)
    scores = scores.masked_fill(~allowed, float("-inf"))
    if heads.sinks is not None:
        scores = torch.cat([scores, heads.sinks[:, None, None].expand(-1, scores.shape[1], 1)], -1)
    probabilities = torch.softmax(scores, -1).nan_to_num()  # a query that sees nothing: 0
    return probabilities[..., : k.shape[1]] @ v


@pytest.mark.parametrize("pieces", ["whole blocks", "a query at a time"])
@pytest.mark.parametrize("mods", ["none", "softcap", "window", "sinks", "all"])
@pytest.mark.parametrize("kind", ["one sequence", "documents and padding"])
def test_attention_over_chunks_with_score_mods_equals_plain_pytorch(mods, kind, pieces, monkeypatch):
    """attend and attend_backward (the seam's math) against dense attention in float64: soft-capped scores, a
    sliding window shorter than a chunk and longer, sinks, grouped queries, a value head narrower than the query's,
    documents and padding across chunk bounds; a block's scores whole, or a query's at a time."""
    from torch_offload.integrations import chunk_attention
    from torch_offload.integrations.chunk_attention import Heads, attend, attend_backward

    if pieces == "a query at a time":
        monkeypatch.setattr(chunk_attention, "_PIECE_BYTES", 1)

    generator = torch.Generator().manual_seed(0)
    tokens, bounds = 17, [(0, 5), (5, 10), (10, 15), (15, 17)]
    q = torch.randn(4, tokens, 6, dtype=torch.float64, generator=generator, requires_grad=True)
    k = torch.randn(2, tokens, 6, dtype=torch.float64, generator=generator, requires_grad=True)
    v = torch.randn(2, tokens, 4, dtype=torch.float64, generator=generator, requires_grad=True)
    sinks = torch.randn(4, dtype=torch.float64, generator=generator, requires_grad=True)
    heads = Heads(
        0.4,
        2,
        softcap=2.0 if mods in ("softcap", "all") else None,
        window=3 if mods in ("window", "all") else None,
        sinks=sinks if mods in ("sinks", "all") else None,
    )
    index = torch.arange(tokens)
    if kind == "one sequence":
        query_segments = key_segments = None
        allowed = index[None, :] <= index[:, None]
    else:  # two pads, a document of 7, one of 6 across a bound, two pads seeing the last
        key_segments = torch.tensor([-1, -1] + [0] * 7 + [1] * 6 + [-1, -1])
        query_segments = torch.tensor([-1, -1] + [0] * 7 + [1] * 8)
        allowed = (index[None, :] <= index[:, None]) & (key_segments[None, :] == query_segments[:, None])
        allowed &= query_segments[:, None] >= 0
    if heads.window is not None:
        allowed &= index[None, :] > index[:, None] - heads.window
    segments = Segments(bounds, query_segments, key_segments)
    want = dense_attention(q, k, v, heads, allowed)
    grad_out = torch.randn(want.shape, dtype=torch.float64, generator=generator)
    want_grads = torch.autograd.grad(want, [q, k, v, sinks], grad_out, allow_unused=True)

    def keys_and_values(chunk):
        start, end = bounds[chunk]
        return k.detach()[:, start:end], v.detach()[:, start:end]

    grads = [torch.zeros_like(t) for t in (q, k, v)]
    grad_sinks = torch.zeros_like(sinks)
    for chunk, (start, end) in enumerate(bounds):
        out, log_sum_exp = attend(heads, segments, chunk, q.detach()[:, start:end], keys_and_values)
        torch.testing.assert_close(out, want.detach()[:, start:end], rtol=1e-10, atol=1e-12)

        def add_share(earlier, grad_k, grad_v):
            grads[1][:, slice(*bounds[earlier])] += grad_k
            grads[2][:, slice(*bounds[earlier])] += grad_v

        grad_q, chunk_grad_sinks = attend_backward(
            heads,
            segments,
            chunk,
            q.detach()[:, start:end],
            grad_out[:, start:end],
            out,
            log_sum_exp,
            keys_and_values,
            add_share,
        )
        grads[0][:, start:end] = grad_q
        if chunk_grad_sinks is not None:
            grad_sinks += chunk_grad_sinks
    for got, expected in zip([*grads, grad_sinks], want_grads):
        torch.testing.assert_close(got, torch.zeros_like(got) if expected is None else expected, rtol=1e-10, atol=1e-12)
