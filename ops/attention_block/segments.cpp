// segments.h: the runs of segment_ids and a head group's attention within them.
#include "ops/attention_block/segments.h"

#include <algorithm>
#include <cstring>
#include <optional>

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros_like.h>
#include <c10/core/Stream.h>
#include <c10/core/TensorImpl.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/intrusive_ptr.h>

#include "ops/common/checks.h"

namespace torch_offload {
namespace {

SegmentRuns read_segment_runs(const at::Tensor& segment_ids) {
  const at::Tensor ids = segment_ids.to(at::kCPU, at::kLong).contiguous();
  const int64_t rows = ids.size(0), tokens = ids.size(1);
  const int64_t* data = ids.const_data_ptr<int64_t>();
  SegmentRuns runs;
  bool any_padding = false;
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t* id = data + row * tokens;
    int64_t start = 0, last_sequence = -1;
    for (int64_t t = 1; t <= tokens; ++t) {
      if (t == tokens || id[t] != id[t - 1]) {
        const bool padding = id[start] < 0;
        const int64_t index = static_cast<int64_t>(runs.size());
        runs.push_back({row, start, t - start, padding, padding ? last_sequence : index});
        last_sequence = padding ? last_sequence : index;
        any_padding |= padding;
        start = t;
      }
    }
  }
  return static_cast<int64_t>(runs.size()) == rows && !any_padding ? SegmentRuns{} : runs;
}

// The runs of the CUDA ids tensor read last on this thread (forward's, or backward's), while that same
// tensor is unchanged (same version and memory): every layer of a step passes the same ids, and each
// read is a blocking device-to-host copy, so a step reads them once per thread, not once or twice per
// layer. CPU ids are read each time: that costs no copy, and no write through an alias that no version
// counter sees (x.data) can make it stale.
struct ReadRuns {
  c10::weak_intrusive_ptr<c10::TensorImpl> ids{c10::intrusive_ptr<c10::TensorImpl>()};
  uint32_t version = 0;
  const void* data = nullptr;
  SegmentRuns runs;
};

// t [B, H, T, ...] restricted to one run: [1, H, length, ...].
at::Tensor run_of(const at::Tensor& t, const SegmentRun& run) {
  return t.narrow(0, run.row, 1).narrow(2, run.start, run.length);
}

// The runs of one kind packed for one variable-length call, over the group's tokens laid out as
// [B * T] rows: the queries' rows and their keys' rows (undefined: every row, in order) and the
// cuts between the sequences.
struct PackedRuns {
  at::Tensor queries, keys;
  VarlenSequences sequences;
};

// The sequences (causal, their own keys) or, with `padding`, the padding runs that see keys
// (each over the sequence before it; those that see none are left out: their output is 0).
// nullopt when there are none.
std::optional<PackedRuns> pack_runs(const SegmentRuns& runs, bool padding, int64_t tokens, c10::Device device) {
  std::vector<int64_t> queries, keys;
  std::vector<int32_t> cut_q{0}, cut_k{0};
  int64_t max_q = 0, max_k = 0;
  bool every_row = true;  // the runs of this kind cover every token: no index is needed
  for (const SegmentRun& run : runs) {
    if (run.padding != padding || run.keys < 0) {
      every_row = false;
      continue;
    }
    const SegmentRun& key_run = runs[run.keys];
    for (int64_t t = 0; t < run.length; ++t) {
      queries.push_back(run.row * tokens + run.start + t);
    }
    for (int64_t t = 0; t < key_run.length; ++t) {
      keys.push_back(key_run.row * tokens + key_run.start + t);
    }
    cut_q.push_back(cut_q.back() + static_cast<int32_t>(run.length));
    cut_k.push_back(cut_k.back() + static_cast<int32_t>(key_run.length));
    max_q = std::max(max_q, run.length);
    max_k = std::max(max_k, key_run.length);
  }
  if (cut_q.size() == 1) {
    return std::nullopt;
  }
  const auto on_device = [&](const auto& values, at::ScalarType dtype) {
    const at::Tensor host = at::empty({static_cast<int64_t>(values.size())}, at::TensorOptions(dtype));
    std::memcpy(host.mutable_data_ptr(), values.data(), values.size() * sizeof(values[0]));
    return host.to(device);
  };
  PackedRuns packed;
  packed.sequences = {on_device(cut_q, at::kInt), padding ? on_device(cut_k, at::kInt) : at::Tensor(), max_q, max_k};
  if (!padding) {
    packed.sequences.cut_k = packed.sequences.cut_q;
  }
  if (!every_row) {
    packed.queries = on_device(queries, at::kLong);
    packed.keys = padding ? on_device(keys, at::kLong) : packed.queries;
  }
  return packed;
}

// pack_runs' result, made once per thread for the runs read last: every layer and head group of a step packs the same
// runs, and each packing copies its indices to the device (from pageable memory: a stream sync each). Read-only
// tensors, used only on the stream they were made on: the caching allocator may hand their memory to that stream's
// later work once they are replaced.
std::optional<PackedRuns> packed_runs(const SegmentRuns& runs, bool padding, int64_t tokens, c10::Device device) {
  struct Packed {
    SegmentRuns runs;
    int64_t tokens = 0;
    std::optional<c10::Stream> stream;
    std::optional<PackedRuns> kinds[2];  // the sequences', the padding's
    bool made[2] = {false, false};
  };
  thread_local Packed last;
  const c10::Stream stream = c10::impl::VirtualGuardImpl(device.type()).getStream(device);
  if (last.runs != runs || last.tokens != tokens || last.stream != stream) {
    last = Packed();
    last.runs = runs;
    last.tokens = tokens;
    last.stream = stream;
  }
  if (!last.made[padding]) {
    last.kinds[padding] = pack_runs(runs, padding, tokens, device);
    last.made[padding] = true;
  }
  return last.kinds[padding];
}

// t [B, H, T, D] as [B * T, H, D] rows (a view when t is token-major).
at::Tensor as_rows(const at::Tensor& t) {
  return t.transpose(1, 2).reshape({-1, t.size(1), t.size(3)});
}

// [B * T, H, D] rows back as [B, H, T, D] (token-major memory).
at::Tensor as_heads(const at::Tensor& rows, const at::Tensor& like) {
  return rows.view({like.size(0), like.size(2), like.size(1), like.size(3)}).transpose(1, 2);
}

at::Tensor rows_of(const at::Tensor& rows, const at::Tensor& index) {
  return index.defined() ? rows.index_select(0, index) : rows;
}

// One variable-length call for all the sequences and one for the padding that sees keys, rather
// than one call per run: packed batches have hundreds of short documents, each call a launch.
// pieces: the sequences' result, then the padding's (empty when there is none).
AttentionResult attend_packed(const AttentionKernels& kernels, const at::Tensor& q, const at::Tensor& k,
                              const at::Tensor& v, double scale, const SegmentRuns& runs) {
  const at::Tensor q_rows = as_rows(q), k_rows = as_rows(k), v_rows = as_rows(v);
  const bool any_padding = std::any_of(runs.begin(), runs.end(), [](const SegmentRun& r) { return r.padding; });
  // Padding that sees no key keeps its 0.
  at::Tensor out = any_padding ? at::zeros_like(q_rows) : at::Tensor();
  AttentionResult whole;
  for (const bool padding : {false, true}) {
    const std::optional<PackedRuns> packed = packed_runs(runs, padding, q.size(2), q.device());
    if (!packed) {
      whole.pieces.emplace_back();
      continue;
    }
    AttentionResult piece =
        kernels.varlen_forward(rows_of(q_rows, packed->queries), rows_of(k_rows, packed->keys),
                               rows_of(v_rows, packed->keys), packed->sequences, scale, /*causal=*/!padding);
    out = out.defined() ? out.index_copy_(0, packed->queries, piece.out) : piece.out;
    piece.out = at::Tensor();
    piece.rows = packed->queries;
    whole.pieces.push_back(std::move(piece));
  }
  whole.out = as_heads(out, q);
  return whole;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attend_packed_backward(const AttentionKernels& kernels,
                                                                      const at::Tensor& grad_out, const at::Tensor& q,
                                                                      const at::Tensor& k, const at::Tensor& v,
                                                                      const AttentionResult& result, double scale,
                                                                      const SegmentRuns& runs) {
  const at::Tensor q_rows = as_rows(q), k_rows = as_rows(k), v_rows = as_rows(v);
  const at::Tensor grad_rows = as_rows(grad_out), out_rows = as_rows(result.out);
  // Without padding, the sequences' call covers every row in order and its gradients are returned whole.
  const bool any_padding = std::any_of(runs.begin(), runs.end(), [](const SegmentRun& r) { return r.padding; });
  at::Tensor dq, dk, dv;
  if (any_padding) {
    dq = at::zeros_like(q_rows);
    dk = at::zeros_like(k_rows);
    dv = at::zeros_like(v_rows);
  }
  for (const bool padding : {false, true}) {
    const std::optional<PackedRuns> packed = packed_runs(runs, padding, q.size(2), q.device());
    if (!packed) {
      continue;
    }
    AttentionResult piece = result.pieces[padding ? 1 : 0];
    piece.out = rows_of(out_rows, packed->queries);
    // A log-sum-exp handed back by attention_block_attend has every row's (restored_result): this call's queries'.
    if (packed->queries.defined() && piece.logsumexp.size(1) != packed->queries.numel()) {
      piece.logsumexp = piece.logsumexp.index_select(1, packed->queries);
    }
    const auto [piece_dq, piece_dk, piece_dv] = kernels.varlen_backward(
        rows_of(grad_rows, packed->queries), rows_of(q_rows, packed->queries), rows_of(k_rows, packed->keys),
        rows_of(v_rows, packed->keys), piece, packed->sequences, scale, /*causal=*/!padding);
    if (!any_padding) {
      return {as_heads(piece_dq, q), as_heads(piece_dk, k), as_heads(piece_dv, v)};
    }
    dq.index_copy_(0, packed->queries, piece_dq);
    // Two padding runs may see one sequence: their key gradients add up.
    dk.index_add_(0, packed->keys, piece_dk);
    dv.index_add_(0, packed->keys, piece_dv);
  }
  return {as_heads(dq, q), as_heads(dk, k), as_heads(dv, v)};
}

}  // namespace

SegmentRuns segment_runs([[maybe_unused]] const char* op, const at::Tensor& segment_ids) {
  if (!segment_ids.defined() || segment_ids.numel() == 0) {
    return {};
  }
  const c10::VariableVersion& counter = segment_ids.unsafeGetTensorImpl()->version_counter();
  if (!segment_ids.is_cuda() || !counter.enabled()) {  // CPU, or an inference tensor, with no version
    return read_segment_runs(segment_ids);
  }
  // Every call: the copy would fail mid-capture, and a replay would not read them again.
  check_not_capturing(op, segment_ids.device(), "it reads segment_ids on the host");
  thread_local ReadRuns last;
  if (last.ids.lock().get() != segment_ids.unsafeGetTensorImpl() || last.version != counter.current_version() ||
      last.data != segment_ids.const_data_ptr()) {
    last.runs = read_segment_runs(segment_ids);
    last.ids = c10::weak_intrusive_ptr<c10::TensorImpl>(segment_ids.getIntrusivePtr());
    last.version = counter.current_version();
    last.data = segment_ids.const_data_ptr();
  }
  return last.runs;
}

AttentionResult attend(const AttentionKernels& kernels, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       double scale, const SegmentRuns& runs) {
  if (runs.empty()) {
    return kernels.forward(q, k, v, scale, /*causal=*/true);
  }
  if (kernels.has_varlen != nullptr && kernels.has_varlen(q)) {
    return attend_packed(kernels, q, k, v, scale, runs);
  }
  // One kernel call per run, causal within a sequence, over all of its keys' run for padding.
  // Token-major [B, T, H, D] memory, as the kernels' own outputs: CUDA's memory-efficient backward reads
  // out with a token stride of heads * head_dim whatever its strides say.
  AttentionResult whole{
      at::empty({q.size(0), q.size(2), q.size(1), q.size(3)}, q.options()).transpose(1, 2), at::Tensor(), {}, {}};
  whole.pieces.reserve(runs.size());
  for (const auto& run : runs) {
    if (run.keys < 0) {
      run_of(whole.out, run).zero_();
      whole.pieces.emplace_back();
      continue;
    }
    const SegmentRun& keys = runs[run.keys];
    AttentionResult piece = kernels.forward(run_of(q, run), run_of(k, keys), run_of(v, keys), scale, !run.padding);
    run_of(whole.out, run).copy_(piece.out);
    piece.out = at::Tensor();
    whole.pieces.push_back(std::move(piece));
  }
  return whole;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attend_backward(const AttentionKernels& kernels,
                                                               const at::Tensor& grad_out, const at::Tensor& q,
                                                               const at::Tensor& k, const at::Tensor& v,
                                                               const AttentionResult& result, double scale,
                                                               const SegmentRuns& runs) {
  if (runs.empty()) {
    return kernels.backward(grad_out, q, k, v, result, scale, /*causal=*/true);
  }
  if (kernels.has_varlen != nullptr && kernels.has_varlen(q)) {
    return attend_packed_backward(kernels, grad_out, q, k, v, result, scale, runs);
  }
  // Each run's backward with its own log-sum-exp; padding's key gradients add to its keys' run,
  // padding itself gets none as keys.
  at::Tensor dq = at::empty_like(q), dk = at::zeros_like(k), dv = at::zeros_like(v);
  for (size_t i = 0; i < runs.size(); ++i) {
    const SegmentRun& run = runs[i];
    if (run.keys < 0) {  // a constant output: no gradient
      run_of(dq, run).zero_();
      continue;
    }
    const SegmentRun& keys = runs[run.keys];
    AttentionResult piece = result.pieces[i];
    piece.out = run_of(result.out, run);
    const auto [piece_dq, piece_dk, piece_dv] = kernels.backward(run_of(grad_out, run), run_of(q, run), run_of(k, keys),
                                                                 run_of(v, keys), piece, scale, !run.padding);
    run_of(dq, run).copy_(piece_dq);
    run_of(dk, keys).add_(piece_dk);
    run_of(dv, keys).add_(piece_dv);
  }
  return {dq, dk, dv};
}

namespace {

// Whether attend() took q's runs in variable-length calls (attend_packed).
bool packed_call(const AttentionKernels& kernels, const at::Tensor& q) {
  return kernels.has_varlen != nullptr && kernels.has_varlen(q);
}

// A variable-length call's log-sum-exp [heads, its queries' rows], checked: the layout flash attention's
// variable-length kernels return.
const at::Tensor& checked_varlen_logsumexp(const at::Tensor& lse, const at::Tensor& q, int64_t queries) {
  TORCH_CHECK(lse.dim() == 2 && lse.size(0) == q.size(1) && lse.size(1) == queries,
              "attention_block_attend: the variable-length attention kernel returned a log-sum-exp of shape ",
              lse.sizes(), "; expected [heads, queries] = [", q.size(1), ", ", queries, "]");
  return lse;
}

}  // namespace

void store_logsumexp(const at::Tensor& lse, const AttentionResult& result, const AttentionKernels& kernels,
                     const at::Tensor& q, const SegmentRuns& runs) {
  const int64_t tokens = q.size(2);
  if (runs.empty()) {  // [B, H, T or more] (CUDA's memory-efficient kernel pads the tokens)
    lse.copy_(result.logsumexp.narrow(2, 0, tokens).transpose(0, 1));
    return;
  }
  if (packed_call(kernels, q)) {
    const at::Tensor rows = lse.view({lse.size(0), -1});  // [H, B * T]
    for (const AttentionResult& piece : result.pieces) {
      if (!piece.logsumexp.defined()) {  // no run of its kind
        continue;
      }
      const int64_t queries = piece.rows.defined() ? piece.rows.numel() : rows.size(1);
      const at::Tensor& piece_lse = checked_varlen_logsumexp(piece.logsumexp, q, queries);
      if (piece.rows.defined()) {
        rows.index_copy_(1, piece.rows, piece_lse);
      } else {
        rows.copy_(piece_lse);
      }
    }
    return;
  }
  for (size_t i = 0; i < runs.size(); ++i) {
    const SegmentRun& run = runs[i];
    if (run.keys >= 0) {  // [1, H, length or more]
      lse.select(1, run.row)
          .narrow(1, run.start, run.length)
          .copy_(result.pieces[i].logsumexp[0].narrow(1, 0, run.length));
    }
  }
}

AttentionResult restored_result(const at::Tensor& lse, const at::Tensor& out, const AttentionKernels& kernels,
                                const at::Tensor& q, const SegmentRuns& runs) {
  // Token-major [B, T, H, D] memory, as attend() gives it: CUDA's memory-efficient backward reads out with a token
  // stride of H * D whatever its strides say, and a head group's columns of attention_block_attend's output (or an
  // exchange's result) have another.
  const bool token_major = out.transpose(1, 2).is_contiguous();
  const at::Tensor whole_out = token_major
                                   ? out
                                   : at::empty({out.size(0), out.size(2), out.size(1), out.size(3)}, out.options())
                                         .copy_(out.transpose(1, 2))
                                         .transpose(1, 2);
  AttentionResult result{whole_out, at::Tensor(), {}, {}};
  if (runs.empty()) {
    result.logsumexp = lse.transpose(0, 1).contiguous();
    return result;
  }
  if (packed_call(kernels, q)) {
    // Every row's for both calls (sequences, padding): attend_packed_backward takes its queries', as it packs the
    // runs anyway (each packing copies its indices to the device).
    const at::Tensor rows = lse.reshape({lse.size(0), -1}).contiguous();
    result.pieces.resize(2);
    result.pieces[0].logsumexp = result.pieces[1].logsumexp = rows;
    return result;
  }
  result.pieces.reserve(runs.size());
  for (const SegmentRun& run : runs) {
    AttentionResult& piece = result.pieces.emplace_back();
    if (run.keys >= 0) {
      piece.logsumexp = lse.select(1, run.row).narrow(1, run.start, run.length).unsqueeze(0).contiguous();
    }
  }
  return result;
}

}  // namespace torch_offload
