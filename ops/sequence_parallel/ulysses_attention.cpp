#include "ops/sequence_parallel/ulysses_attention.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>

#include "ops/attention_block/attention_block.h"
#include "torch_offload/torch_offload.h"

namespace torch_offload {
namespace {

// all_to_all_single over dim 0 of `chunks` [ranks, ...] (rank r gets chunks[r], and its dim 0 is the
// source rank), waited for.
at::Tensor exchange(const at::Tensor& chunks, const std::string& group_name) {
  static const auto all_to_all =
      c10::Dispatcher::singleton().findSchemaOrThrow("_c10d_functional::all_to_all_single", "");
  static const auto wait = detail::op<at::Tensor(const at::Tensor&)>("_c10d_functional::wait_tensor");
  const c10::List<int64_t> one_each(std::vector<int64_t>(chunks.size(0), 1));
  torch::jit::Stack stack{chunks, one_each, one_each.copy(), group_name};
  all_to_all.callBoxed(&stack);  // boxed: the group's argument type differs across torch versions
  return wait.call(stack.back().toTensor());
}

// exchange() with its gradient, which is the same exchange of the output's gradient: the chunk rank r
// sent to rank s comes back from s. In C++ so that C++ callers get gradients without Python's
// registrations of the functional collectives' autograd.
class ExchangeFunction : public torch::autograd::Function<ExchangeFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& chunks,
                            const std::string& group_name) {
    ctx->saved_data["group_name"] = group_name;
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return exchange(chunks, group_name);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return {exchange(grads[0].contiguous(), ctx->saved_data["group_name"].toStringRef()), at::Tensor()};
  }
};

at::Tensor all_to_all(const at::Tensor& chunks, const std::string& group_name, bool differentiable) {
  return differentiable ? ExchangeFunction::apply(chunks, group_name) : exchange(chunks, group_name);
}

}  // namespace

int64_t group_size(const std::string& group_name) {
  return c10d::resolve_process_group(group_name)->getSize();
}

at::Tensor heads_to_tokens(const at::Tensor& t, int64_t ranks, const std::string& group_name, bool differentiable) {
  const auto batch = t.sym_size(0), heads = t.sym_size(1), local = t.sym_size(2), dim = t.sym_size(3);
  const auto chunks = t.reshape_symint({batch, ranks, heads / ranks, local, dim}).transpose(0, 1).contiguous();
  // [ranks (source), B, heads / ranks, local, D]
  const auto exchanged = all_to_all(chunks, group_name, differentiable);
  return exchanged.permute({1, 2, 0, 3, 4}).reshape_symint({batch, heads / ranks, local * ranks, dim});
}

at::Tensor tokens_to_heads(const at::Tensor& t, int64_t ranks, const std::string& group_name, bool differentiable) {
  const auto batch = t.sym_size(0), heads = t.sym_size(1), tokens = t.sym_size(2), dim = t.sym_size(3);
  const auto chunks =
      t.reshape_symint({batch, heads, ranks, tokens / ranks, dim}).permute({2, 0, 1, 3, 4}).contiguous();
  // [ranks (source), B, heads / ranks, local, D]
  const auto exchanged = all_to_all(chunks, group_name, differentiable);
  return exchanged.transpose(0, 1).reshape_symint({batch, heads * ranks, tokens / ranks, dim});
}

at::Tensor ulysses_attention_composite(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                       const at::Tensor& segment_ids, const std::string& group_name,
                                       std::optional<double> scale, std::optional<double> softcap,
                                       const std::optional<at::Tensor>& sinks, std::optional<int64_t> window) {
  constexpr const char* op = "ulysses_attention";
  TORCH_CHECK_VALUE(query.dim() == 4 && key.dim() == 4 && value.dim() == 4, op, ": query, key and value have shapes ",
                    query.sym_sizes(), ", ", key.sym_sizes(), ", ", value.sym_sizes(),
                    "; expected [batch, heads, tokens / ranks, head_dim] each");
  const int64_t ranks = group_size(group_name);
  const int64_t heads = query.size(1), kv_heads = key.size(1);
  TORCH_CHECK_VALUE(heads % ranks == 0, op, ": ", heads, " query heads cannot be split over ", ranks,
                    " ranks; the query heads must be a multiple of the number of ranks");
  TORCH_CHECK_VALUE(kv_heads > 0 && heads % kv_heads == 0 && value.size(1) == kv_heads, op, ": ", heads,
                    " query heads are not a multiple of key's ", kv_heads, " heads (value has ", value.size(1), ")");
  // Everything checked before the first exchange: a rank that threw after it would leave the others waiting.
  // Value's head dimension may differ from query's and key's (multi-head latent attention).
  TORCH_CHECK_VALUE(key.sym_size(0) == query.sym_size(0) && key.sym_size(2) == query.sym_size(2) &&
                        key.sym_size(3) == query.sym_size(3) && value.sym_size(0) == key.sym_size(0) &&
                        value.sym_size(2) == key.sym_size(2),
                    op, ": key and value have shapes ", key.sym_sizes(), " and ", value.sym_sizes(),
                    "; expected query's batch and tokens (", query.sym_sizes(), "), key its head_dim too");
  TORCH_CHECK_VALUE(key.scalar_type() == query.scalar_type() && value.scalar_type() == query.scalar_type() &&
                        key.device() == query.device() && value.device() == query.device(),
                    op, ": query, key and value must share a dtype and device");
  TORCH_CHECK_VALUE(segment_ids.dim() == 2 && segment_ids.sym_size(0) == query.sym_size(0) &&
                        segment_ids.sym_size(1) == query.sym_size(2) * ranks,
                    op, ": segment_ids has shape ", segment_ids.sym_sizes(), "; expected the whole rows, [batch, ",
                    ranks, " ranks x ", query.sym_size(2), " tokens]");
  // segment_attention's checks, on the exchanged tensors; the sinks against all the query's heads.
  check_segment_attention_inputs(op, query, segment_ids, scale, softcap, sinks, window);
  at::Tensor k = key, v = value;
  if (kv_heads % ranks != 0) {  // fewer key/value heads than ranks (or not a multiple): give each query head its own
    k = k.repeat_interleave(heads / kv_heads, 1);
    v = v.repeat_interleave(heads / kv_heads, 1);
  }
  const auto q_share = heads_to_tokens(query, ranks, group_name, true);
  k = heads_to_tokens(k, ranks, group_name, true);
  v = heads_to_tokens(v, ranks, group_name, true);
  const int64_t repeats = q_share.size(1) / k.size(1);  // query heads of this rank's share per key/value head
  if (repeats > 1) {
    k = k.repeat_interleave(repeats, 1);
    v = v.repeat_interleave(repeats, 1);
  }
  // This rank attends its share of the heads over the whole rows, so a window is computed exactly. Its heads'
  // sinks come through an exchange, not a slice at this rank's offset: the graph torch.compile makes of this
  // composite is then the same on every rank (its cache hands one rank's graph to the others). Each rank keeps
  // the first rank's copy, so that rank gets the whole sinks gradient and the others zero.
  std::optional<at::Tensor> share_sinks;
  if (sinks.has_value() && sinks->defined()) {
    const auto copies = heads_to_tokens(sinks->view({1, heads, 1, 1}), ranks, group_name, true);
    share_sinks = copies.select(2, 0).reshape({heads / ranks});  // [1, heads / ranks, ranks (source), 1]
  }
  const at::Tensor out = segment_attention(q_share, k, v, segment_ids, scale, softcap, share_sinks, window);
  return tokens_to_heads(out, ranks, group_name, true);
}

}  // namespace torch_offload
