"""Sequence parallelism on Gloo CPU ranks: ulysses_attention on each rank's chunk of the rows equals
segment_attention on the whole rows in one process, values and gradients, in float64."""

import contextlib
import copy
import os

import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks
from test_apply import FAMILIES
from test_attention_block import make_inputs as make_block_inputs
from test_real_batches import MODELS, labelled, make_model, packed, padded
from torch._dynamo.testing import CompileCounterWithBackend
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import torch_offload
import torch_offload.sequence_parallel
from torch_offload.sequence_parallel import ulysses_attention

pytestmark = pytest.mark.gpu_torch


def inputs(heads, kv_heads, tokens=12, batch=2, head_dim=4, value_head_dim=4):
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads, tokens, head_dim, generator=generator, dtype=torch.float64)
    k = torch.randn(batch, kv_heads, tokens, head_dim, generator=generator, dtype=torch.float64)
    v = torch.randn(batch, kv_heads, tokens, value_head_dim, generator=generator, dtype=torch.float64)
    grad_out = torch.randn(batch, heads, tokens, value_head_dim, generator=generator, dtype=torch.float64)
    # Row 0: three packed documents, the second crossing every rank boundary of 2, 3 and 4 ranks;
    # row 1: left padding, then one document.
    segment_ids = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2], [-1, -1, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5]])
    return q, k, v, segment_ids, grad_out


def score_mods(heads, mods):
    """segment_attention's score mods: Gemma 2's soft-cap, GPT-OSS's sinks (a leaf) and a window of 3 tokens,
    shorter than the documents that cross the ranks' boundaries."""
    if not mods:
        return {}
    sinks = torch.randn(heads, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    return dict(softcap=2.0, sinks=sinks.requires_grad_(), window=3)


def whole(heads, kv_heads, mods=False, value_head_dim=4):
    q, k, v, segment_ids, grad_out = inputs(heads, kv_heads, value_head_dim=value_head_dim)
    options = score_mods(heads, mods)
    leaves = [t.requires_grad_() for t in (q, k, v)] + [options[name] for name in options if name == "sinks"]
    groups = heads // kv_heads
    out = torch_offload.segment_attention(
        q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), segment_ids, scale=0.3, **options
    )
    return out.detach(), torch.autograd.grad(out, leaves, grad_out)


def sharded(rank, world_size, cases, path):
    """Each of the cases (ULYSSES_CASES' names) on this rank's chunk of the rows, in one process (a process per
    case took most of the test's time)."""
    results = {}
    for case in cases:
        heads, kv_heads, compiled, mods, value_head_dim = ULYSSES_CASES[case][1:]
        q, k, v, segment_ids, grad_out = inputs(heads, kv_heads, value_head_dim=value_head_dim)
        options = score_mods(heads, mods)
        local = q.shape[2] // world_size
        chunk = [t.narrow(2, rank * local, local).clone().requires_grad_() for t in (q, k, v)]
        # Inductor lowers the collectives in the first compiled case; the score mods' case goes through AOT autograd
        # only, which traces the same graph (as applied_on_ranks does).
        backend = "inductor" if case == cases[0] else "aot_eager"
        attention = torch.compile(ulysses_attention, fullgraph=True, backend=backend) if compiled else ulysses_attention
        out = attention(*chunk, segment_ids, dist.group.WORLD, scale=0.3, **options)
        leaves = chunk + [options[name] for name in options if name == "sinks"]
        grads = torch.autograd.grad(out, leaves, grad_out.narrow(2, rank * local, local))
        results[case] = (out.detach(), grads)
    torch.save(results, f"{path}.{rank}")


# name: (world_size, heads, kv_heads, compiled, mods, value_head_dim)
ULYSSES_CASES = {
    "mha": (2, 4, 4, False, False, 4),
    "gqa": (2, 4, 2, False, False, 4),
    "one_kv_head": (2, 4, 1, False, False, 4),
    "softcap_sinks_window": (2, 4, 2, False, True, 4),
    "narrower_value_heads": (2, 4, 4, False, False, 3),
    "3_ranks_kv_fewer_than_ranks": (3, 6, 2, False, False, 4),
    "4_ranks": (4, 4, 2, False, False, 4),
    "softcap_sinks_window_4_ranks": (4, 4, 1, False, True, 4),
    "compiled": (2, 4, 2, True, False, 4),
    "softcap_sinks_window_compiled": (2, 4, 2, True, True, 4),
}


@pytest.mark.parametrize(
    "world_size, compiled", [(2, False), (3, False), (4, False), (2, True)], ids=["2", "3", "4", "2_compiled"]
)
def test_ulysses_attention_on_each_ranks_chunk_equals_the_whole_rows(world_size, compiled, tmp_path):
    # The cases of one world size (and compilation) share their ranks' processes.
    cases = [name for name, case in ULYSSES_CASES.items() if case[0] == world_size and case[3] == compiled]
    path = str(tmp_path / "result")
    run_ranks(sharded, world_size, cases, path)
    results = [torch.load(f"{path}.{rank}") for rank in range(world_size)]
    for case in cases:
        heads, kv_heads, _, mods, value_head_dim = ULYSSES_CASES[case][1:]
        parts = [result[case] for result in results]
        want_out, want_grads = whole(heads, kv_heads, mods, value_head_dim)
        got_out = torch.cat([out for out, _ in parts], dim=2)
        torch.testing.assert_close(got_out, want_out, msg=lambda m: f"{case}: {m}")
        for i, name in enumerate("qkv"):
            got = torch.cat([grads[i] for _, grads in parts], dim=2)
            torch.testing.assert_close(got, want_grads[i], msg=lambda m: f"{case}: d{name}: {m}")
        if mods:  # the whole sinks gradient on the first rank, zero on the others
            first, *others = [grads[3] for _, grads in parts]
            torch.testing.assert_close(first, want_grads[3], msg=lambda m: f"{case}: dsinks: {m}")
            assert all(torch.equal(grad, torch.zeros_like(grad)) for grad in others), case


def opcheck_on_ranks(rank, world_size, path):
    q, k, v, segment_ids, _ = inputs(4, 2)
    local = q.shape[2] // world_size
    chunk = [t.narrow(2, rank * local, local).clone().requires_grad_() for t in (q, k, v)]
    plain = (*chunk, segment_ids, dist.group.WORLD.group_name, 0.3)
    mods = score_mods(4, True)
    for args in (plain, (*plain, mods["softcap"], mods["sinks"], mods["window"])):
        # Not test_schema nor test_faketensor: they check the ops inside too, and torch's own
        # _c10d_functional.wait_tensor returns its argument (an alias its schema and fake kernel do not
        # have). The fake result's metadata is checked here instead.
        torch.library.opcheck(
            torch.ops.offload.ulysses_attention.default,
            args,
            test_utils=("test_autograd_registration", "test_aot_dispatch_dynamic"),
        )
        with FakeTensorMode() as mode:
            fake = torch.ops.offload.ulysses_attention(
                *(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args)
            )
        real = torch.ops.offload.ulysses_attention(*args)
        assert (fake.shape, fake.stride(), fake.dtype) == (real.shape, real.stride(), real.dtype)
    torch.save(True, f"{path}.{rank}")


def test_opcheck_on_two_ranks(tmp_path):
    path = str(tmp_path / "opcheck")
    run_ranks(opcheck_on_ranks, 2, path)
    assert all(torch.load(f"{path}.{rank}") for rank in range(2))


# attention_block with a group: x, cos and sin are each rank's chunk of the rows, segment_ids the whole rows'.
BLOCK_SEGMENTS = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 2, 2], [-1, -1, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4]])


def block_inputs(heads, kv_heads, bias):
    return make_block_inputs(
        batch=2, tokens=12, h=16, heads=heads, kv_heads=kv_heads, head_dim=4, bias=bias, dtype=torch.float64
    )


def block_on_ranks(rank, world_size, heads, kv_heads, bias, path):
    inputs = block_inputs(heads, kv_heads, bias)
    local = 12 // world_size
    chunk = [
        t.narrow(1, rank * local, local).detach().clone().requires_grad_()
        if i == 0
        else t.narrow(1, rank * local, local)
        if i in (5, 6)
        else t
        for i, t in enumerate(inputs)
    ]
    name = dist.group.WORLD.group_name
    out = torch_offload.attention_block(
        *chunk[:7], b_q=chunk[7], b_k=chunk[8], b_v=chunk[9], b_o=chunk[10], segment_ids=BLOCK_SEGMENTS, group_name=name
    )
    grad_out = torch.randn(2, 12, 16, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    leaves = [t for i, t in enumerate(chunk) if t is not None and i not in (5, 6)]
    grads = torch.autograd.grad(out, leaves, grad_out.narrow(1, rank * local, local))
    # opcheck on every rank (the op's collectives need all of them), in the MHA case only: what it checks (schema,
    # fake kernel, autograd registration, AOT dispatch) does not vary with the ranks' count, and each case cost 5-9 s.
    if world_size == 2 and not bias:
        torch.library.opcheck(
            torch.ops.offload.attention_block.default, (*chunk[:7], *chunk[7:], None, BLOCK_SEGMENTS, name)
        )
    torch.save((out.detach(), grads), f"{path}.{rank}")


@pytest.mark.parametrize(
    "world_size, heads, kv_heads, bias",
    [(2, 4, 4, False), (2, 4, 1, True), (4, 4, 2, False), (3, 6, 3, False)],
    ids=["mha", "one_kv_head_bias", "4_ranks_gqa", "3_ranks"],
)
def test_attention_block_with_a_group_on_each_ranks_chunk_equals_the_whole_rows(
    world_size, heads, kv_heads, bias, tmp_path
):
    path = str(tmp_path / "block")
    run_ranks(block_on_ranks, world_size, heads, kv_heads, bias, path)
    parts = [torch.load(f"{path}.{rank}") for rank in range(world_size)]
    inputs = block_inputs(heads, kv_heads, bias)
    out = torch_offload.attention_block(
        *inputs[:7], b_q=inputs[7], b_k=inputs[8], b_v=inputs[9], b_o=inputs[10], segment_ids=BLOCK_SEGMENTS
    )
    grad_out = torch.randn(2, 12, 16, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    leaves = [t for i, t in enumerate(inputs) if t is not None and i not in (5, 6)]
    want = torch.autograd.grad(out, leaves, grad_out)
    torch.testing.assert_close(torch.cat([o for o, _ in parts], dim=1), out.detach())
    torch.testing.assert_close(torch.cat([g[0] for _, g in parts], dim=1), want[0])  # x: each rank its chunk's
    for i in range(1, len(want)):  # weights and biases: the ranks' shares add up
        torch.testing.assert_close(sum(g[i] for _, g in parts), want[i])


def refused(rank, world_size, path):
    messages = []
    q = torch.zeros(1, 4, 2, 4)
    for args in (
        (q[:, :3], q[:, :3], q[:, :3], torch.zeros(1, 4, dtype=torch.long)),  # 3 heads over 2 ranks
        (q, q, q, torch.zeros(1, 2, dtype=torch.long)),
    ):  # segment ids of this rank's chunk only
        try:
            ulysses_attention(*args, dist.group.WORLD)
        except ValueError as error:
            messages.append(str(error))
    torch.save(messages, f"{path}.{rank}")


def test_heads_not_divisible_by_the_ranks_and_ids_of_a_chunk_are_refused_by_name(tmp_path):
    path = str(tmp_path / "errors")
    run_ranks(refused, 2, path)
    for rank in range(2):
        heads, ids = torch.load(f"{path}.{rank}")
        assert heads.startswith("ulysses_attention: 3 query heads cannot be split over 2 ranks")
        assert ids.startswith(
            "ulysses_attention: segment_ids has shape [1, 2]; expected the whole rows, [batch, 2 ranks x 2 tokens]"
        )


class CountCollectives(TorchDispatchMode):
    """Counts the functional collectives dispatched, from C++ ops too."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func.namespace == "_c10d_functional"
        return func(*args, **(kwargs or {}))


def call_counting_collectives(call):
    """(call's error message, or None, and the functional collectives it dispatched)."""
    with CountCollectives() as counted:
        try:
            call()
        except RuntimeError as error:
            return str(error), counted.calls
    return None, counted.calls


def refused_before_any_exchange(rank, world_size, path):
    q, k, v, segment_ids, _ = inputs(4, 2)
    local = q.shape[2] // world_size
    q, k, v = (t.narrow(2, rank * local, local) for t in (q, k, v))
    group = dist.group.WORLD
    results = {
        "accepted": call_counting_collectives(lambda: ulysses_attention(q, k, v, segment_ids, group)),
        "scale": call_counting_collectives(lambda: ulysses_attention(q, k, v, segment_ids, group, scale=-0.5)),
        "integer_query": call_counting_collectives(
            lambda: ulysses_attention(q.long(), k.long(), v.long(), segment_ids, group)
        ),
    }
    torch.save(results, f"{path}.{rank}")


def test_what_segment_attention_would_refuse_is_refused_on_every_rank_before_any_exchange(tmp_path):
    # segment_attention runs on the exchanged tensors: a rank that threw only there, after the exchanges,
    # would leave the others waiting wherever the ranks' inputs differ.
    path = str(tmp_path / "refused")
    run_ranks(refused_before_any_exchange, 2, path)
    for rank in range(2):
        got = torch.load(f"{path}.{rank}")
        assert got["accepted"][0] is None and got["accepted"][1] > 0  # the count sees the op's exchanges
        for case, message in (
            ("scale", "ulysses_attention: scale is -0.5; expected a finite value > 0"),
            ("integer_query", "ulysses_attention: query has dtype Long; expected a floating point dtype"),
        ):
            error, calls = got[case]
            assert error is not None and error.startswith(message) and calls == 0, (case, error, calls)


def collated(tokens=13):
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 50, (2, tokens), generator=generator)
    labels = ids.clone()
    labels[0, 5:8] = -100  # an ignored run across the boundary of 2 ranks (7 tokens each after padding)
    labels[1, :2] = -100
    return dict(input_ids=ids, labels=labels, attention_mask=torch.ones_like(ids))


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_shard_batch_pads_splits_and_shifts_labels_across_ranks(ranks):
    from transformers.loss.loss_utils import ForCausalLMLoss

    batch = collated()
    parts = [torch_offload.sequence_parallel._shard(batch, rank, ranks) for rank in range(ranks)]
    padded = -13 % ranks + 13
    glued = {
        name: torch.cat([p[name] for p in parts], dim=1)
        for name in ("input_ids", "labels", "shift_labels", "attention_mask", "position_ids")
    }
    assert glued["input_ids"].shape == (2, padded) and torch.equal(glued["input_ids"][:, :13], batch["input_ids"])
    # The padding's positions start again at 0: a document of its own, within the model's position table.
    assert torch.equal(glued["position_ids"], torch.cat([torch.arange(13), torch.arange(padded - 13)])[None])
    assert (glued["attention_mask"][:, 13:] == 0).all() and (glued["labels"][:, 13:] == -100).all()
    # Each token's label is the next token's, across rank boundaries; the last real token's is -100.
    assert torch.equal(glued["shift_labels"][:, :12], batch["labels"][:, 1:])
    assert (glued["shift_labels"][:, 12:] == -100).all()
    # The ranks' losses on their tokens add up to the whole batch's (logits as a whole model gives them).
    logits = torch.randn(2, padded, 50, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    want = ForCausalLMLoss(logits[:, :13], batch["labels"], 50)
    local = padded // ranks
    got = sum(
        ForCausalLMLoss(
            logits[:, r * local : (r + 1) * local].contiguous(),
            p["labels"],
            50,
            num_items_in_batch=p["num_items_in_batch"],
            shift_labels=p["shift_labels"],
        )
        for r, p in enumerate(parts)
    )
    torch.testing.assert_close(got, want)


def test_shard_batch_keeps_packed_positions_and_a_given_count_and_refuses_what_it_cannot_split():
    batch = dict(
        collated(),
        position_ids=torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6, 7]]),
        num_items_in_batch=torch.tensor(40),
    )
    first, second = (torch_offload.sequence_parallel._shard(batch, rank, 2) for rank in range(2))
    assert torch.equal(
        torch.cat([first["position_ids"], second["position_ids"]], 1),
        torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6, 7, 0]]),
    )
    assert first["num_items_in_batch"] == 40
    with pytest.raises(ValueError, match=r"shard_batch: inputs_embeds has shape \[2, 13, 8\]"):
        torch_offload.sequence_parallel._shard(dict(batch, inputs_embeds=torch.zeros(2, 13, 8)), 0, 2)
    with pytest.raises(ValueError, match=r"shard_batch: labels has shape \[2, 12\]; expected \[batch, 13\]"):
        torch_offload.sequence_parallel._shard(dict(batch, labels=batch["labels"][:, 1:]), 0, 2)
    with pytest.raises(ValueError, match="shard_batch: the batch has shift_labels; pass labels"):
        torch_offload.sequence_parallel._shard(dict(batch, shift_labels=batch["labels"]), 0, 2)
    with pytest.raises(ValueError, match="shard_batch: the batch has no input_ids"):
        torch_offload.sequence_parallel._shard({"labels": batch["labels"]}, 0, 2)


def shard_on_ranks(rank, world_size, path):
    torch.save(torch_offload.sequence_parallel.shard_batch(collated(), dist.group.WORLD), f"{path}.{rank}")


def test_shard_batch_takes_the_rank_and_count_from_the_group(tmp_path):
    path = str(tmp_path / "shard")
    run_ranks(shard_on_ranks, 2, path)
    for rank in range(2):
        got, want = torch.load(f"{path}.{rank}"), torch_offload.sequence_parallel._shard(collated(), rank, 2)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


# ---------------------------------------------------------------------------------------------
# apply(model, sequence_parallel=group): a whole model on each rank's chunk of the rows equals one
# process on the whole rows: every rank's loss is the whole batch's, and the ranks' gradients add up
# to the whole batch's.


def documents_crossing_ranks(tokens=24, documents=(5, 9, 4, 6)):
    """Packed documents, the second crossing the boundary of 2 ranks (12) and of 4 (6, 12, 18); a run of
    ignored labels across the boundary of 2 ranks."""
    batch = packed(tokens, documents)
    labels = batch["labels"].clone()
    labels[0, 10:14] = -100
    return dict(batch, labels=labels)


def accumulation_steps():
    """Two micro-batches with num_items_in_batch counted over both, as Trainer does under accumulation."""
    first, second = documents_crossing_ranks(), labelled(padded("right"))
    second["labels"] = second["labels"].masked_fill(second["attention_mask"] == 0, -100)
    count = sum((b["labels"][:, 1:] != -100).sum() for b in (first, second))
    return [dict(first, num_items_in_batch=count), dict(second, num_items_in_batch=count)]


# id: (family, config overrides, batches (one optimizer step; more than one accumulates), apply options)
APPLIED = {
    "llama_mha": ("llama", dict(num_key_value_heads=4), lambda: [documents_crossing_ranks()], {}),
    "llama_one_kv_head": ("llama", dict(num_key_value_heads=1), lambda: [documents_crossing_ranks()], {}),
    "qwen3": ("qwen3", {}, lambda: [documents_crossing_ranks()], {}),
    "mistral": ("mistral", {}, lambda: [documents_crossing_ranks()], {}),
    "qwen2": ("qwen2", {}, lambda: [documents_crossing_ranks()], {}),
    "phi3": ("phi3", {}, lambda: [documents_crossing_ranks()], {}),
    "gpt2": ("gpt2", {}, lambda: [documents_crossing_ranks()], {}),
    "gemma": ("gemma", {}, lambda: [documents_crossing_ranks()], {}),
    # Dense families whose layers differ from Llama's elsewhere (test_apply's FAMILIES).
    "olmo2": ("olmo2", {}, lambda: [documents_crossing_ranks()], {}),
    "granite": ("granite", {}, lambda: [documents_crossing_ranks()], {}),
    "smollm3": ("smollm3", {}, lambda: [documents_crossing_ranks()], {}),
    "cohere": ("cohere", {}, lambda: [documents_crossing_ranks()], {}),
    "glm4": ("glm4", {}, lambda: [documents_crossing_ranks()], {}),
    # The score mods and the value heads ulysses_attention takes: Gemma 2's eager soft-capped attention (packed and
    # right-padded), GPT-OSS's sinks and sliding window (8 tokens, shorter than the 9-token document that crosses
    # the ranks; its masks, built without position_ids, make the packed documents one sequence), Gemma 3 (its
    # window longer than these rows), DeepSeek-V3's latent attention (value heads narrower than the query's); the
    # mixtures of experts without router logits (output_router_logits is refused).
    "gemma2": ("gemma2", {}, lambda: [documents_crossing_ranks()], {}),
    "gemma2_right_padded": ("gemma2", {}, lambda: [padded("right")], dict(offload=None)),
    "gpt_oss": ("gpt_oss", {}, lambda: [documents_crossing_ranks()], {}),
    "gemma3_text": ("gemma3_text", {}, lambda: [documents_crossing_ranks()], {}),
    "deepseek_v3": ("deepseek_v3", {}, lambda: [documents_crossing_ranks()], {}),
    "mixtral": ("mixtral", {}, lambda: [documents_crossing_ranks()], {}),
    "qwen2_moe": ("qwen2_moe", {}, lambda: [documents_crossing_ranks()], {}),
    "qwen3_moe": ("qwen3_moe", {}, lambda: [documents_crossing_ranks()], {}),
    # A window shorter than a document that crosses the ranks: attention_block, which computes no window, leaves
    # each call to the module's own forward, whose attention function computes it over the ranks.
    "window_shorter_than_a_document": ("mistral", dict(sliding_window=8), lambda: [documents_crossing_ranks()], {}),
    # Whole layers checkpointed in place (the default on a CPU is the disk tier, as in the cases above).
    "tokens_1001": (
        "llama",
        dict(max_position_embeddings=1024),
        lambda: [documents_crossing_ranks(1001, (300, 500, 201))],
        dict(offload=None),
    ),
    "right_padded": ("llama", {}, lambda: [padded("right")], dict(offload=None)),
    "left_padded": ("llama", {}, lambda: [padded("left")], dict(offload=None)),
    "accumulation_num_items": ("llama", {}, accumulation_steps, dict(offload=None)),
    "disk_tier": ("llama", {}, lambda: [documents_crossing_ranks()], dict(offload="disk", min_bytes=0)),
    # The GPU default's plan on the CPU: whole layers recomputed, each attention forward run once (ATTENTION_ONCE).
    "cpu_tier": ("llama", {}, lambda: [documents_crossing_ranks()], dict(offload="cpu")),
    "cpu_tier_qwen3_left_padded": ("qwen3", {}, lambda: [padded("left")], dict(offload="cpu")),
    # Sliding windows shorter than the rows that no token reaches past: every document is shorter (9 tokens);
    # the window covers all 25 real tokens, not shard_batch's padding to 26 (a segment of its own, or a
    # padding run where the batch has an attention_mask).
    "window_over_documents": ("mistral", dict(sliding_window=10), lambda: [documents_crossing_ranks()], {}),
    "window_over_the_real_tokens": ("mistral", dict(sliding_window=25), lambda: [packed(25, (25,))], {}),
    "window_over_padded_rows": (
        "mistral",
        dict(sliding_window=25),
        lambda: [padded("right", 25, (25, 18, 10))],
        dict(offload=None),
    ),
}
# What runs each family's attention where attention_block does not compute it (GPT-2's Conv1D, Cohere's interleaved
# rotary, GLM-4's partial rotary, SmolLM3's layers without rotary): their own forwards, the core attention through
# ulysses_attention. Qwen3's per-head norms and OLMo 2's over whole projections are the op's q_norm and k_norm.
THE_MODULES_OWN = {
    "gpt2": {"ulysses_attention"},
    "cohere": {"ulysses_attention"},
    "glm4": {"ulysses_attention"},
    "smollm3": {"attention_block", "ulysses_attention"},
    # Soft-capped scores, sinks and latent attention are not attention_block's: their modules' own forwards.
    "gemma2": {"ulysses_attention"},
    "gpt_oss": {"ulysses_attention"},
    "deepseek_v3": {"ulysses_attention"},
    "gemma3_text": {"ulysses_attention"},
}
# Cases whose every call leaves attention_block for the module's own forward (a window shorter than the rows').
EVERY_CALL_FALLS_BACK = {"window_shorter_than_a_document"}
FOUR_RANKS = ["llama_mha", "llama_one_kv_head", "qwen3", "tokens_1001", "left_padded"]


# Cases whose every layer keeps its attention's output and log-sum-exps from the forward for backward.
ATTENTION_ONCE = {"cpu_tier", "cpu_tier_qwen3_left_padded"}


class CountGroupCalls(TorchDispatchMode):
    """Counts attention_block's forward calls over a group, and attention_block_attend's."""

    def __init__(self):
        super().__init__()
        self.forwards = 0
        self.attends = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        group_name = 13  # its position in the schema; the dispatcher drops trailing arguments left at their defaults
        if (
            func is torch.ops.offload.attention_block.default
            and len(args) > group_name
            and args[group_name] is not None
        ):
            self.forwards += 1
        if func is torch.ops.offload.attention_block_attend.default and len(args) > 11 and args[11] is not None:
            self.attends += 1
        return func(*args, **(kwargs or {}))


def sp_model(case):
    family, overrides, _, _ = APPLIED[case]
    if family in MODELS:
        return make_model(family, **overrides).double()
    torch.manual_seed(0)
    model = FAMILIES[family][0]().double().train()  # GPT-OSS with its 8-token window (test_real_batches widens it)
    model.config.output_router_logits = False  # the mixtures' auxiliary loss is refused under sequence parallelism
    if getattr(model.config, "_experts_implementation", None) == "grouped_mm":  # a float32-only kernel on the CPU
        model.set_experts_implementation("eager")
    return model


def one_process(case):
    """The un-applied model on the whole batches: each batch's loss, and the gradients summed over them."""
    model = sp_model(case)
    losses = [model(**batch, use_cache=False).loss for batch in APPLIED[case][2]()]
    for loss in losses:
        loss.backward()
    return [loss.detach() for loss in losses], {n: p.grad for n, p in model.named_parameters()}


def applied_on_ranks(rank, world_size, cases, path, compiled=False):
    results = {}
    for case in cases:
        model = sp_model(case)
        options = dict(APPLIED[case][3])
        if options.get("offload") == "disk":
            options["spill_directory"] = os.path.dirname(path)
        handle = torch_offload.apply(model, sequence_parallel=dist.group.WORLD, **options)
        # Inductor lowers the collectives in the first case; the other families' graphs go through AOT autograd
        # only, which traces the same graph (no break, the same ops): the test takes about a fifth less time.
        counter = CompileCounterWithBackend("inductor" if case == cases[0] else "aot_eager")
        run = torch.compile(model, fullgraph=True, backend=counter) if compiled else model
        losses, calls = [], CountGroupCalls()
        for batch in APPLIED[case][2]():
            with contextlib.nullcontext() if compiled else calls:
                loss = run(**torch_offload.shard_batch(batch, dist.group.WORLD), use_cache=False).loss
                loss.backward()
            losses.append(loss.detach())
        # A graph's code with its subgraphs' (the checkpointed layers' bodies).
        graphs = ["".join(m.code for m in g.modules() if isinstance(m, torch.fx.GraphModule)) for g in counter.graphs]
        results[case] = (
            losses,
            {n: p.grad for n, p in model.named_parameters()},
            dict(handle.attention),
            graphs,
            calls.forwards,
            handle.report(),
            calls.attends,
        )
        handle.remove()
    torch.save(results, f"{path}.{rank}")


def assert_equals_one_process(case, parts):
    want_losses, want_grads = one_process(case)
    for losses, *_ in parts:  # every rank returns the whole batch's loss
        torch.testing.assert_close(torch.stack(losses), torch.stack(want_losses), rtol=1e-6, atol=1e-6)
    for name, want in want_grads.items():
        got = sum(grads[name] for _, grads, *_ in parts)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{case}, {name}: {m}")


@pytest.mark.parametrize("world_size, cases", [(2, list(APPLIED)), (4, FOUR_RANKS)], ids=["2_ranks", "4_ranks"])
def test_applied_model_on_each_ranks_chunk_equals_one_process_on_the_whole_batch(world_size, cases, tmp_path):
    path = str(tmp_path / "applied")
    run_ranks(applied_on_ranks, world_size, cases, path)
    results = [torch.load(f"{path}.{rank}") for rank in range(world_size)]
    for case in cases:
        parts = [r[case] for r in results]
        family = APPLIED[case][0]
        assert set(parts[0][2].values()) == THE_MODULES_OWN.get(family, {"attention_block"}), case
        report = parts[0][5]  # print(handle)'s rows say the same
        assert {row["attention"] for row in report["layers"]} == set(parts[0][2].values()), case
        assert report["sequence_parallel"] is not None and "sequence_parallel" in report["masks"], case
        calls = parts[0][4]  # every layer's in every step (twice in a layer checkpointed whole), or none
        ops = 0 if case in EVERY_CALL_FALLS_BACK else sum(how == "attention_block" for how in parts[0][2].values())
        assert calls >= ops * len(APPLIED[case][2]()) and (calls > 0) == (ops > 0), case
        # The attention forward once per layer and step where the layers keep it, else never through attend.
        assert parts[0][6] == (ops * len(APPLIED[case][2]()) if case in ATTENTION_ONCE else 0), case
        assert_equals_one_process(case, parts)


def float64_reference(case):
    """The un-applied model's loss of its own float64 logits (transformers' loss is float32 for any model) and
    its gradients: the labelled tokens' summed cross-entropy over their count."""
    model = sp_model(case)
    (batch,) = APPLIED[case][2]()
    logits = model(**{k: v for k, v in batch.items() if k != "labels"}, use_cache=False).logits
    target = torch.nn.functional.pad(batch["labels"][:, 1:], (0, 1), value=-100)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="sum")
    loss = loss / (target != -100).sum()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_a_float64_model_keeps_float64_gradients_over_the_ranks(tmp_path):
    # The count, the division and the ranks' sum in float64: float32 there left 8e-8 relative errors.
    path, case = str(tmp_path / "float64"), "llama_mha"
    run_ranks(applied_on_ranks, 2, [case], path)
    parts = [torch.load(f"{path}.{rank}")[case] for rank in range(2)]
    want_loss, want_grads = float64_reference(case)
    for losses, *_ in parts:  # float32, as transformers' loss of a float64 model
        assert losses[0].dtype == torch.float32
        torch.testing.assert_close(losses[0], want_loss.float(), rtol=2e-7, atol=0)  # one float32 rounding
    for name, want in want_grads.items():
        got = sum(grads[name] for _, grads, *_ in parts)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14, msg=lambda m: f"{name}: {m}")


def test_compiled_applied_model_on_each_ranks_chunk_equals_one_process(tmp_path):
    """torch.compile(fullgraph=True), so with no graph break: the all-to-alls, gathers and the loss's
    all-reduce are in the graph."""
    path, cases = str(tmp_path / "compiled"), ["llama_one_kv_head", "left_padded", "qwen3", "gpt2", "gemma2"]
    run_ranks(applied_on_ranks, 2, cases, path, True)
    results = [torch.load(f"{path}.{rank}") for rank in range(2)]
    for case in cases:
        parts = [r[case] for r in results]
        assert_equals_one_process(case, parts)
        graphs, (op,) = parts[0][3], THE_MODULES_OWN.get(APPLIED[case][0], {"attention_block"})
        # Every layer's op in the one graph of the case's one call. A float dynamo turns into a tensor (Gemma 2's
        # soft-cap) may restart its analysis once (torch 2.13 does): the backend then also saw the first attempt.
        assert len(graphs) <= (2 if case == "gemma2" else 1) and graphs[-1].count(f"offload.{op}") == 3


def refusals_on_ranks(rank, world_size, path):
    from torch.distributed.device_mesh import init_device_mesh

    group, messages = dist.group.WORLD, {}

    def refused(name, call):
        try:
            call()
        except (ValueError, TypeError, NotImplementedError, RuntimeError) as error:
            messages[name] = f"{type(error).__name__}: {error}"

    refused(
        "heads",
        lambda: torch_offload.apply(
            make_model("llama", hidden_size=24, num_attention_heads=3, num_key_value_heads=3), sequence_parallel=group
        ),
    )
    refused("loss", lambda: torch_offload.apply(make_model("llama"), sequence_parallel=group, loss=False))
    refused(
        "mesh",
        lambda: torch_offload.apply(
            make_model("llama"), sequence_parallel=init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "sp"))
        ),
    )
    refused("type", lambda: torch_offload.apply(make_model("llama"), sequence_parallel="sp"))
    refused(
        "rope",
        lambda: torch_offload.apply(
            make_model("llama", rope_parameters=dict(rope_type="dynamic", factor=2.0)), sequence_parallel=group
        ),
    )
    refused(
        "eager", lambda: torch_offload.apply(make_model("llama", attn_implementation="eager"), sequence_parallel=group)
    )
    # Eager attention gives a left-padded row's padding the mean of the row's values: refused at the call.
    eager = make_model("gemma2")
    torch_offload.apply(eager, sequence_parallel=group, offload=None)
    refused("eager_left_padded", lambda: eager(**torch_offload.shard_batch(padded("left"), group)))
    torch.manual_seed(0)
    refused("router_logits", lambda: torch_offload.apply(FAMILIES["mixtral"][0](), sequence_parallel=group))
    model = make_model("llama")
    handle = torch_offload.apply(model, sequence_parallel=init_device_mesh("cpu", (2,), mesh_dim_names=("sp",)))
    batch = torch_offload.shard_batch(documents_crossing_ranks(), group)
    refused("no_shift_labels", lambda: model(**{k: v for k, v in batch.items() if k != "shift_labels"}))
    refused("no_position_ids", lambda: model(**{k: v for k, v in batch.items() if k != "position_ids"}))
    attention = model.model.layers[0].self_attn
    messages["applied"] = (
        str(model.config._attn_implementation),  # a str that pickles as the model's own (see test_apply)
        vars(attention).get(torch_offload.sequence_parallel.GROUP_ATTRIBUTE) == dist.group.WORLD.group_name,
    )
    copied = copy.deepcopy(model)  # the model before apply, in every copy
    handle.remove()
    messages["removed"] = (
        model.config._attn_implementation,
        torch_offload.sequence_parallel.GROUP_ATTRIBUTE in vars(attention),
    )
    whole = documents_crossing_ranks()
    messages["copied"] = (copied.config._attn_implementation, copied(**whole).loss, model(**whole).loss)
    torch.save(messages, f"{path}.{rank}")


def test_apply_refuses_what_sequence_parallelism_cannot_compute_and_remove_restores(tmp_path):
    path = str(tmp_path / "refusals")
    run_ranks(refusals_on_ranks, 2, path)
    got = torch.load(f"{path}.0")
    assert got["heads"] == (
        "ValueError: torch_offload.apply: sequence_parallel: 3 attention heads cannot be split "
        "over 2 ranks; the heads must be a multiple of the number of ranks"
    )
    assert got["loss"].startswith("ValueError: torch_offload.apply: sequence_parallel needs loss=True")
    assert got["mesh"].startswith("ValueError: torch_offload.apply: sequence_parallel is a 2-D DeviceMesh")
    assert got["type"].startswith(
        "TypeError: torch_offload.apply: sequence_parallel must be a torch.distributed "
        "ProcessGroup or DeviceMesh, got str"
    )
    assert got["rope"].startswith(
        "ValueError: torch_offload.apply: sequence_parallel: LlamaConfig's rotary "
        "embedding ('dynamic') scales with the largest position of a call"
    )
    assert got["eager"].startswith(
        "ValueError: torch_offload.apply: sequence_parallel: LlamaConfig has 'eager' attention, which gives a "
        "query with no key to attend (a left-padded row's pads) the mean of its whole row's values"
    )
    assert got["eager_left_padded"].startswith(
        "RuntimeError: torch_offload sequence parallelism: a left-padded row in a model with 'eager' attention"
    )
    assert got["router_logits"].startswith(
        "ValueError: torch_offload.apply: sequence_parallel: MixtralConfig has output_router_logits=True"
    )
    assert "called with labels but no shift_labels; pass torch_offload.shard_batch" in got["no_shift_labels"]
    assert "called without position_ids; pass torch_offload.shard_batch" in got["no_position_ids"]
    assert got["applied"] == (torch_offload.sequence_parallel.IMPLEMENTATION, True)
    assert got["removed"] == ("sdpa", False)
    implementation, copy_loss, loss = got["copied"]
    assert implementation == "sdpa"
    torch.testing.assert_close(copy_loss, loss, rtol=0, atol=0)


# Data x sequence parallelism on a 2-D mesh of 4 ranks: each data rank's pair of sequence ranks shards its own
# batch. One process's gradients are those of the data ranks' mean loss: FSDP2 and DDP average over the ranks
# they reduce over, so the sum over sequence ranks needs FSDP2's divide factor set to the data ranks, or under
# DDP (all 4 ranks) the loss scaled by the sequence ranks.
DATA_BATCHES = [documents_crossing_ranks, lambda: padded("left")]


def data_and_sequence_ranks(rank, world_size, wrapper, path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.nn.parallel import DistributedDataParallel

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "sp"))
    sequence = mesh["sp"]
    model = make_model("llama").double()
    torch_offload.apply(model, sequence_parallel=sequence)
    if wrapper == "fsdp2":  # sharded over the sequence ranks, replicated over the data ranks
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(mesh["dp"].size())
        run, scale = model, 1
    else:
        run, scale = DistributedDataParallel(model), sequence.size()
    batch = DATA_BATCHES[mesh["dp"].get_local_rank()]()
    loss = run(**torch_offload.shard_batch(batch, sequence.get_group()), use_cache=False).loss
    (loss * scale).backward()
    grads = {n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for n, p in model.named_parameters()}
    torch.save((loss.detach(), grads), f"{path}.{rank}")


@pytest.mark.parametrize("wrapper", ["fsdp2", "ddp"])
def test_data_times_sequence_ranks_under_fsdp2_and_ddp_equal_one_process(wrapper, tmp_path):
    path = str(tmp_path / wrapper)
    run_ranks(data_and_sequence_ranks, 4, wrapper, path)
    model = make_model("llama").double()
    losses = [model(**make(), use_cache=False).loss for make in DATA_BATCHES]
    (sum(losses) / len(losses)).backward()
    for rank in range(4):
        loss, grads = torch.load(f"{path}.{rank}")
        torch.testing.assert_close(loss, losses[rank // 2].detach(), rtol=1e-6, atol=1e-6)  # its data rank's batch
        for name, p in model.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{rank} {name}: {m}")
