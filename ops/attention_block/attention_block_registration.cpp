// attention_block and segment_attention: their schemas, kernels, autograd, autocast and shared rules.
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include "ops/attention_block/attention_block.h"
#include "ops/common/autograd_inputs.h"
#include "ops/common/op_rules.h"
#include "torch_offload/torch_offload.h"

TORCH_LIBRARY_FRAGMENT(offload, m) {
  // A decoder layer's attention from its normalized input x [batch, tokens, h] to its
  // output projection: q/k/v projections, the rotary embedding (cos, sin [1 or batch,
  // tokens, head_dim]), causal attention (grouped-query when w_k has fewer heads than
  // w_q) and w_o, one group of heads at a time; backward saves only the inputs and
  // recomputes each group. The backward op returns the gradients output_mask asks for
  // (x, w_q, w_k, w_v, w_o, b_q, b_k, b_v, b_o, q_norm, k_norm), undefined where not asked or absent.
  // q_norm and k_norm [head_dim] (Qwen3's): each head's q and k through an RMSNorm (norm_eps) before the
  // rotary embedding; [heads * head_dim] and [kv_heads * head_dim] (OLMo 2's): over each token's whole
  // q and k projection.
  // With group_name (sequence parallelism), x and cos/sin are this rank's contiguous chunk of the
  // rows, segment_ids the whole rows', and each head group's attention runs over the whole rows
  // for a share of its heads, between two all-to-alls (ops/sequence_parallel).
  // attention and logsumexp (attention_block_attend's outputs for the same arguments): the forward computes the
  // output projection alone, and backward hands them to the attention kernels' backward instead of recomputing the
  // attention: the plan that runs each layer's attention forward once. They get no gradient.
  m.def(
      "attention_block(Tensor x, Tensor w_q, Tensor w_k, Tensor w_v, Tensor w_o, Tensor cos, Tensor sin, "
      "Tensor? b_q=None, Tensor? b_k=None, Tensor? b_v=None, Tensor? b_o=None, float? scale=None, "
      "Tensor? segment_ids=None, str? group_name=None, Tensor? q_norm=None, Tensor? k_norm=None, "
      "float norm_eps=1e-06, Tensor? attention=None, Tensor? logsumexp=None) -> Tensor");
  m.def(
      "attention_block_backward(Tensor grad_out, Tensor x, Tensor w_q, Tensor w_k, Tensor w_v, Tensor w_o, "
      "Tensor cos, Tensor sin, Tensor? b_q, Tensor? b_k, Tensor? b_v, Tensor? b_o, float? scale, "
      "Tensor? segment_ids, bool[11] output_mask, str? group_name=None, Tensor? q_norm=None, Tensor? k_norm=None, "
      "float norm_eps=1e-06, Tensor? attention=None, Tensor? logsumexp=None) -> (Tensor, Tensor, Tensor, Tensor, "
      "Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  // attention_block's forward up to its output projection: (attention [batch, tokens, heads * head_dim] in x's
  // dtype, logsumexp [heads / ranks, batch, tokens * ranks] in its op-math type). Not differentiable.
  m.def(
      "attention_block_attend(Tensor x, Tensor w_q, Tensor w_k, Tensor w_v, Tensor cos, Tensor sin, "
      "Tensor? b_q=None, Tensor? b_k=None, Tensor? b_v=None, float? scale=None, Tensor? segment_ids=None, "
      "str? group_name=None, Tensor? q_norm=None, Tensor? k_norm=None, float norm_eps=1e-06) "
      "-> (Tensor attention, Tensor logsumexp)");

  // attention_block's attention alone, for attention modules it does not replace: query and key
  // [batch, heads, tokens, head_dim], value [batch, heads, tokens, value_head_dim] (the output's),
  // causal within the segments of segment_ids [batch, tokens]. Backward saves only the inputs; it returns (query, key,
  // value)'s gradients, undefined where output_mask does not ask. softcap caps the scores (softcap * tanh(s /
  // softcap)); sinks [heads] add one logit per head to each query's softmax, with no value; window is a sliding window
  // within each sequence. The backward also returns sinks' gradient.
  m.def(
      "segment_attention(Tensor query, Tensor key, Tensor value, Tensor segment_ids, float? scale=None, "
      "float? softcap=None, Tensor? sinks=None, int? window=None) -> Tensor");
  m.def(
      "segment_attention_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor segment_ids, "
      "float? scale, bool[4] output_mask, float? softcap=None, Tensor? sinks=None, int? window=None) "
      "-> (Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(offload, CPU, m) {
  m.impl("attention_block", &torch_offload::attention_block_cpu);
  m.impl("attention_block_backward", &torch_offload::attention_block_backward_cpu);
  m.impl("attention_block_attend", &torch_offload::attention_block_attend_cpu);
  m.impl("segment_attention", &torch_offload::segment_attention_cpu);
  m.impl("segment_attention_backward", &torch_offload::segment_attention_backward_cpu);
}

#ifdef TORCH_OFFLOAD_WITH_CUDA
TORCH_LIBRARY_IMPL(offload, CUDA, m) {
  m.impl("attention_block", &torch_offload::attention_block_cuda);
  m.impl("attention_block_backward", &torch_offload::attention_block_backward_cuda);
  m.impl("attention_block_attend", &torch_offload::attention_block_attend_cuda);
  m.impl("segment_attention", &torch_offload::segment_attention_cuda);
  m.impl("segment_attention_backward", &torch_offload::segment_attention_backward_cuda);
}
#endif

TORCH_LIBRARY_IMPL(offload, Meta, m) {
  m.impl("attention_block", &torch_offload::attention_block_meta);
  m.impl("attention_block_backward", &torch_offload::attention_block_backward_meta);
  m.impl("attention_block_attend", &torch_offload::attention_block_attend_meta);
  m.impl("segment_attention", &torch_offload::segment_attention_meta);
  m.impl("segment_attention_backward", &torch_offload::segment_attention_backward_meta);
}

namespace torch_offload {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// attention_block saves its inputs only; its backward is one node computed by the
// attention_block_backward op (each head group recomputed), which AOTAutograd traces
// like any other op. Gradients nobody needs are not computed. No double backward.
class AttentionBlockFunction : public torch::autograd::Function<AttentionBlockFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w_q, const at::Tensor& w_k,
                            const at::Tensor& w_v, const at::Tensor& w_o, const at::Tensor& cos, const at::Tensor& sin,
                            const std::optional<at::Tensor>& b_q, const std::optional<at::Tensor>& b_k,
                            const std::optional<at::Tensor>& b_v, const std::optional<at::Tensor>& b_o,
                            std::optional<double> scale, const std::optional<at::Tensor>& segment_ids,
                            std::optional<c10::string_view> group_name, const std::optional<at::Tensor>& q_norm,
                            const std::optional<at::Tensor>& k_norm, double norm_eps,
                            const std::optional<at::Tensor>& attention, const std::optional<at::Tensor>& logsumexp) {
    check_rotary_needs_no_grad(cos, sin);
    TORCH_CHECK(!or_undefined(attention).requires_grad() && !or_undefined(logsumexp).requires_grad(),
                "attention_block: attention or logsumexp requires grad; they are attention_block_attend's outputs, "
                "which get no gradient (detach them)");
    ctx->save_for_backward({x, w_q, w_k, w_v, w_o, cos, sin, or_undefined(b_q), or_undefined(b_k), or_undefined(b_v),
                            or_undefined(b_o), or_undefined(segment_ids), or_undefined(q_norm), or_undefined(k_norm),
                            or_undefined(attention), or_undefined(logsumexp)});
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["norm_eps"] = norm_eps;
    ctx->saved_data["group_name"] = group_name.has_value() ? c10::IValue(std::string(*group_name)) : c10::IValue();
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return attention_block(x, w_q, w_k, w_v, w_o, cos, sin, b_q, b_k, b_v, b_o, scale, segment_ids, group_name, q_norm,
                           k_norm, norm_eps, attention, logsumexp);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    // Edges: x, the four weights, cos and sin, then the biases, segment_ids and norms given (absent ones
    // have none).
    std::array<bool, 11> output_mask{};
    for (size_t i = 0; i < 5; ++i) {
      output_mask[i] = ctx->needs_input_grad(i);
    }
    size_t edge = 7;
    for (size_t i = 5; i < output_mask.size(); ++i) {
      const size_t saved_index = i < 9 ? i + 2 : i + 3;  // segment_ids (saved[11]) gets no gradient
      if (i == 9 && saved[11].defined()) {
        ++edge;
      }
      if (saved[saved_index].defined()) {
        output_mask[i] = ctx->needs_input_grad(edge++);
      }
    }
    const auto scale = ctx->saved_data["scale"].toOptional<double>();
    const c10::IValue& group = ctx->saved_data["group_name"];
    const auto group_name = group.isNone() ? std::nullopt : std::optional<c10::string_view>(group.toStringRef());
    const auto [x, w_q, w_k, w_v, w_o, b_q, b_k, b_v, b_o, q_norm, k_norm] = attention_block_backward(
        grads[0], saved[0], saved[1], saved[2], saved[3], saved[4], saved[5], saved[6], or_nullopt(saved[7]),
        or_nullopt(saved[8]), or_nullopt(saved[9]), or_nullopt(saved[10]), scale, or_nullopt(saved[11]), output_mask,
        group_name, or_nullopt(saved[12]), or_nullopt(saved[13]), ctx->saved_data["norm_eps"].toDouble(),
        or_nullopt(saved[14]), or_nullopt(saved[15]));
    // One per forward argument: none for cos, sin, scale, segment_ids, group_name, norm_eps, attention and
    // logsumexp.
    return {x,      w_q,    w_k,          w_v,          w_o,          at::Tensor(), at::Tensor(),
            b_q,    b_k,    b_v,          b_o,          at::Tensor(), at::Tensor(), at::Tensor(),
            q_norm, k_norm, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor attention_block_autograd(const at::Tensor& x, const at::Tensor& w_q, const at::Tensor& w_k,
                                    const at::Tensor& w_v, const at::Tensor& w_o, const at::Tensor& cos,
                                    const at::Tensor& sin, const std::optional<at::Tensor>& b_q,
                                    const std::optional<at::Tensor>& b_k, const std::optional<at::Tensor>& b_v,
                                    const std::optional<at::Tensor>& b_o, std::optional<double> scale,
                                    const std::optional<at::Tensor>& segment_ids,
                                    std::optional<c10::string_view> group_name, const std::optional<at::Tensor>& q_norm,
                                    const std::optional<at::Tensor>& k_norm, double norm_eps,
                                    const std::optional<at::Tensor>& attention,
                                    const std::optional<at::Tensor>& logsumexp) {
  return AttentionBlockFunction::apply(x, w_q, w_k, w_v, w_o, cos, sin, b_q, b_k, b_v, b_o, scale, segment_ids,
                                       group_name, q_norm, k_norm, norm_eps, attention, logsumexp);
}

// attention_block_attend is not differentiable: its outputs are constants for autograd (attention_block given them
// computes every gradient itself).
std::tuple<at::Tensor, at::Tensor> attention_block_attend_autograd(
    const at::Tensor& x, const at::Tensor& w_q, const at::Tensor& w_k, const at::Tensor& w_v, const at::Tensor& cos,
    const at::Tensor& sin, const std::optional<at::Tensor>& b_q, const std::optional<at::Tensor>& b_k,
    const std::optional<at::Tensor>& b_v, std::optional<double> scale, const std::optional<at::Tensor>& segment_ids,
    std::optional<c10::string_view> group_name, const std::optional<at::Tensor>& q_norm,
    const std::optional<at::Tensor>& k_norm, double norm_eps) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return attention_block_attend(x, w_q, w_k, w_v, cos, sin, b_q, b_k, b_v, scale, segment_ids, group_name, q_norm,
                                k_norm, norm_eps);
}

// segment_attention saves its inputs only; segment_attention_backward recomputes. No double backward.
class SegmentAttentionFunction : public torch::autograd::Function<SegmentAttentionFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& segment_ids, std::optional<double> scale, std::optional<double> softcap,
                            const std::optional<at::Tensor>& sinks, std::optional<int64_t> window) {
    ctx->save_for_backward({q, k, v, segment_ids, sinks.value_or(at::Tensor())});
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["softcap"] = softcap;
    ctx->saved_data["window"] = window;
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return segment_attention(q, k, v, segment_ids, scale, softcap, sinks, window);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const bool has_sinks = saved[4].defined();
    // Edges: query, key, value, segment_ids, then sinks when given.
    const std::array<bool, 4> output_mask{ctx->needs_input_grad(0), ctx->needs_input_grad(1), ctx->needs_input_grad(2),
                                          has_sinks && ctx->needs_input_grad(4)};
    const auto [q, k, v, sinks] = segment_attention_backward(
        grads[0], saved[0], saved[1], saved[2], saved[3], ctx->saved_data["scale"].toOptional<double>(), output_mask,
        ctx->saved_data["softcap"].toOptional<double>(), has_sinks ? std::optional<at::Tensor>(saved[4]) : std::nullopt,
        ctx->saved_data["window"].toOptional<int64_t>());
    return {q, k, v, at::Tensor(), at::Tensor(), at::Tensor(), sinks, at::Tensor()};
  }
};

at::Tensor segment_attention_autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                      const at::Tensor& segment_ids, std::optional<double> scale,
                                      std::optional<double> softcap, const std::optional<at::Tensor>& sinks,
                                      std::optional<int64_t> window) {
  return SegmentAttentionFunction::apply(q, k, v, segment_ids, scale, softcap, sinks, window);
}

// attention_block runs in the autocast dtype, as the linear layers and the attention it replaces would (the
// rotary tables included).
template <c10::DeviceType kDevice>
at::Tensor attention_block_autocast(const at::Tensor& x, const at::Tensor& w_q, const at::Tensor& w_k,
                                    const at::Tensor& w_v, const at::Tensor& w_o, const at::Tensor& cos,
                                    const at::Tensor& sin, const std::optional<at::Tensor>& b_q,
                                    const std::optional<at::Tensor>& b_k, const std::optional<at::Tensor>& b_v,
                                    const std::optional<at::Tensor>& b_o, std::optional<double> scale,
                                    const std::optional<at::Tensor>& segment_ids,
                                    std::optional<c10::string_view> group_name, const std::optional<at::Tensor>& q_norm,
                                    const std::optional<at::Tensor>& k_norm, double norm_eps,
                                    const std::optional<at::Tensor>& attention,
                                    const std::optional<at::Tensor>& logsumexp) {
  const BelowAutocast<kDevice> cast;
  // The log-sum-exps keep their op-math dtype.
  return attention_block(cast(x), cast(w_q), cast(w_k), cast(w_v), cast(w_o), cast(cos), cast(sin), cast(b_q),
                         cast(b_k), cast(b_v), cast(b_o), scale, segment_ids, group_name, cast(q_norm), cast(k_norm),
                         norm_eps, cast(attention), logsumexp);
}

template <c10::DeviceType kDevice>
std::tuple<at::Tensor, at::Tensor> attention_block_attend_autocast(
    const at::Tensor& x, const at::Tensor& w_q, const at::Tensor& w_k, const at::Tensor& w_v, const at::Tensor& cos,
    const at::Tensor& sin, const std::optional<at::Tensor>& b_q, const std::optional<at::Tensor>& b_k,
    const std::optional<at::Tensor>& b_v, std::optional<double> scale, const std::optional<at::Tensor>& segment_ids,
    std::optional<c10::string_view> group_name, const std::optional<at::Tensor>& q_norm,
    const std::optional<at::Tensor>& k_norm, double norm_eps) {
  const BelowAutocast<kDevice> cast;
  return attention_block_attend(cast(x), cast(w_q), cast(w_k), cast(w_v), cast(cos), cast(sin), cast(b_q), cast(b_k),
                                cast(b_v), scale, segment_ids, group_name, cast(q_norm), cast(k_norm), norm_eps);
}

// segment_attention runs in the autocast dtype, as the SDPA it stands for does.
template <c10::DeviceType kDevice>
at::Tensor segment_attention_autocast(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                      const at::Tensor& segment_ids, std::optional<double> scale,
                                      std::optional<double> softcap, const std::optional<at::Tensor>& sinks,
                                      std::optional<int64_t> window) {
  const BelowAutocast<kDevice> cast;
  // The sinks keep their dtype: one logit per head, added in the scores' float32.
  return segment_attention(cast(q), cast(k), cast(v), segment_ids, scale, softcap, sinks, window);
}

const SharedOpRules attention_block_rules({"attention_block", "attention_block_attend", "segment_attention"},
                                          UnderAutocast::kOwnKernel);
const SharedOpRules attention_block_rules_without_autocast({"attention_block_backward", "segment_attention_backward"},
                                                           UnderAutocast::kOff);

}  // namespace
}  // namespace torch_offload

TORCH_LIBRARY_IMPL(offload, Autograd, m) {
  m.impl("attention_block", &torch_offload::attention_block_autograd);
  m.impl("attention_block_attend", &torch_offload::attention_block_attend_autograd);
  m.impl("segment_attention", &torch_offload::segment_attention_autograd);
  // Computing gradients of gradients is not supported: an error if backward reaches it.
  m.impl("attention_block_backward", torch::autograd::autogradNotImplementedFallback());
  m.impl("segment_attention_backward", torch::autograd::autogradNotImplementedFallback());
}

TORCH_LIBRARY_IMPL(offload, AutocastCPU, m) {
  m.impl("attention_block", &torch_offload::attention_block_autocast<c10::DeviceType::CPU>);
  m.impl("attention_block_attend", &torch_offload::attention_block_attend_autocast<c10::DeviceType::CPU>);
  m.impl("segment_attention", &torch_offload::segment_attention_autocast<c10::DeviceType::CPU>);
}

TORCH_LIBRARY_IMPL(offload, AutocastCUDA, m) {
  m.impl("attention_block", &torch_offload::attention_block_autocast<c10::DeviceType::CUDA>);
  m.impl("attention_block_attend", &torch_offload::attention_block_attend_autocast<c10::DeviceType::CUDA>);
  m.impl("segment_attention", &torch_offload::segment_attention_autocast<c10::DeviceType::CUDA>);
}
