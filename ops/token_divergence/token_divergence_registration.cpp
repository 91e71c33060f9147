// token_divergence and its companion ops: their schemas, kernels, autograd, autocast and shared rules. Their tiles
// are ATen's: one kernel serves every dense device.
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include "ops/common/autograd_inputs.h"
#include "ops/common/op_rules.h"
#include "ops/token_divergence/token_divergence.h"
#include "torch_offload/torch_offload.h"

TORCH_LIBRARY_FRAGMENT(offload, m) {
  // Per token, the generalized Jensen-Shannon divergence between the student's and the teacher's softmax(scores)
  // (beta 0: KL(teacher || student), 1: KL(student || teacher)) and the student's entropy, scores =
  // cap(logit_scale * logits) / temperature per head, logits = hidden @ weight^T + bias in tiles (no [tokens, V]),
  // float32 for bf16/fp16; 0 where labels equal ignore_index. Gradients reach the student's tensors only; the
  // entropy has none. The forward op also returns per token both log-sum-exps and the divergence unmasked (beta 0
  // or 1) or KL(student || mixture) (else), for the backward op, which returns the gradients output_mask asks for
  // (student_hidden, student_weight, student_bias).
  m.def(
      "token_divergence(Tensor student_hidden, Tensor student_weight, Tensor teacher_hidden, Tensor teacher_weight, "
      "*, Tensor? student_bias=None, Tensor? teacher_bias=None, Tensor? labels=None, float beta=0.5, "
      "float temperature=1.0, float student_softcap=0.0, float student_logit_scale=1.0, float teacher_softcap=0.0, "
      "float teacher_logit_scale=1.0, int ignore_index=-100) -> (Tensor, Tensor)");
  m.def(
      "token_divergence_forward(Tensor student_hidden, Tensor student_weight, Tensor teacher_hidden, "
      "Tensor teacher_weight, Tensor? student_bias, Tensor? teacher_bias, Tensor? labels, float beta, "
      "float temperature, float student_softcap, float student_logit_scale, float teacher_softcap, "
      "float teacher_logit_scale, int ignore_index) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "token_divergence_backward(Tensor grad_divergence, Tensor student_hidden, Tensor student_weight, "
      "Tensor teacher_hidden, Tensor teacher_weight, Tensor? student_bias, Tensor? teacher_bias, Tensor? labels, "
      "Tensor student_lse, Tensor teacher_lse, Tensor aux, float beta, float temperature, float student_softcap, "
      "float student_logit_scale, float teacher_softcap, float teacher_logit_scale, int ignore_index, "
      "bool[3] output_mask) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(offload, CPU, m) {
  m.impl("token_divergence", &torch_offload::token_divergence_kernel);
  m.impl("token_divergence_forward", &torch_offload::token_divergence_forward_kernel);
  m.impl("token_divergence_backward", &torch_offload::token_divergence_backward_kernel);
}

#ifdef TORCH_OFFLOAD_WITH_CUDA
TORCH_LIBRARY_IMPL(offload, CUDA, m) {
  m.impl("token_divergence", &torch_offload::token_divergence_kernel);
  m.impl("token_divergence_forward", &torch_offload::token_divergence_forward_kernel);
  m.impl("token_divergence_backward", &torch_offload::token_divergence_backward_kernel);
}
#endif

TORCH_LIBRARY_IMPL(offload, Meta, m) {
  m.impl("token_divergence", &torch_offload::token_divergence_meta);
  m.impl("token_divergence_forward", &torch_offload::token_divergence_forward_meta);
  m.impl("token_divergence_backward", &torch_offload::token_divergence_backward_meta);
}

namespace torch_offload {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

TokenDivergenceForward token_divergence_forward(TORCH_OFFLOAD_TOKEN_DIVERGENCE_ARGS) {
  static const auto handle = detail::op<TokenDivergenceForward(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
      const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, double, double, double, double, double,
      double, int64_t)>("offload::token_divergence_forward");
  return handle.call(student_hidden, student_weight, teacher_hidden, teacher_weight, student_bias, teacher_bias, labels,
                     beta, temperature, student_softcap, student_logit_scale, teacher_softcap, teacher_logit_scale,
                     ignore_index);
}

TokenDivergenceGradients token_divergence_backward(TORCH_OFFLOAD_TOKEN_DIVERGENCE_BACKWARD_ARGS) {
  static const auto handle = detail::op<TokenDivergenceGradients(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
      const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
      const at::Tensor&, const at::Tensor&, const at::Tensor&, double, double, double, double, double, double, int64_t,
      std::array<bool, 3>)>("offload::token_divergence_backward");
  return handle.call(grad_divergence, student_hidden, student_weight, teacher_hidden, teacher_weight, student_bias,
                     teacher_bias, labels, student_lse, teacher_lse, aux, beta, temperature, student_softcap,
                     student_logit_scale, teacher_softcap, teacher_logit_scale, ignore_index, output_mask);
}

// token_divergence saves its inputs and per token both log-sum-exps and the backward's term; backward recomputes
// both heads' tiles (the per-token upstream gradients are not known in forward). The teacher's tensors and the
// entropy get no gradient. No double backward.
class TokenDivergenceFunction : public torch::autograd::Function<TokenDivergenceFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& student_hidden, const at::Tensor& student_weight,
                               const at::Tensor& teacher_hidden, const at::Tensor& teacher_weight,
                               const std::optional<at::Tensor>& student_bias,
                               const std::optional<at::Tensor>& teacher_bias, const std::optional<at::Tensor>& labels,
                               double beta, double temperature, double student_softcap, double student_logit_scale,
                               double teacher_softcap, double teacher_logit_scale, int64_t ignore_index) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [divergence, entropy, lse_s, lse_t, aux] = token_divergence_forward(
        student_hidden, student_weight, teacher_hidden, teacher_weight, student_bias, teacher_bias, labels, beta,
        temperature, student_softcap, student_logit_scale, teacher_softcap, teacher_logit_scale, ignore_index);
    ctx->save_for_backward({student_hidden, student_weight, teacher_hidden, teacher_weight, or_undefined(student_bias),
                            or_undefined(teacher_bias), or_undefined(labels), lse_s, lse_t, aux});
    auto& d = ctx->saved_data;
    d["beta"] = beta;
    d["temperature"] = temperature;
    d["student_softcap"] = student_softcap;
    d["student_logit_scale"] = student_logit_scale;
    d["teacher_softcap"] = teacher_softcap;
    d["teacher_logit_scale"] = teacher_logit_scale;
    d["ignore_index"] = ignore_index;
    ctx->mark_non_differentiable({entropy});
    ctx->set_materialize_grads(false);
    return {divergence, entropy};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    variable_list result(14);
    if (!grads[0].defined()) {
      return result;  // only the entropy was used: no gradient
    }
    // Absent optional inputs have no autograd edge: student_bias (input 4) takes one only when given.
    const std::array<bool, 3> output_mask{ctx->needs_input_grad(0), ctx->needs_input_grad(1),
                                          saved[4].defined() && ctx->needs_input_grad(4)};
    const auto& d = ctx->saved_data;
    std::tie(result[0], result[1], result[4]) = token_divergence_backward(
        grads[0], saved[0], saved[1], saved[2], saved[3], or_nullopt(saved[4]), or_nullopt(saved[5]),
        or_nullopt(saved[6]), saved[7], saved[8], saved[9], d.at("beta").toDouble(), d.at("temperature").toDouble(),
        d.at("student_softcap").toDouble(), d.at("student_logit_scale").toDouble(), d.at("teacher_softcap").toDouble(),
        d.at("teacher_logit_scale").toDouble(), d.at("ignore_index").toInt(), output_mask);
    return result;
  }
};

TokenDivergence token_divergence_autograd(TORCH_OFFLOAD_TOKEN_DIVERGENCE_ARGS) {
  const variable_list outputs = TokenDivergenceFunction::apply(
      student_hidden, student_weight, teacher_hidden, teacher_weight, student_bias, teacher_bias, labels, beta,
      temperature, student_softcap, student_logit_scale, teacher_softcap, teacher_logit_scale, ignore_index);
  return {outputs[0], outputs[1]};
}

// Under autocast: the GEMMs in the autocast dtype, the outputs float32.
template <c10::DeviceType kDevice>
TokenDivergence token_divergence_autocast(TORCH_OFFLOAD_TOKEN_DIVERGENCE_ARGS) {
  const BelowAutocast<kDevice> cast;
  return torch_offload::token_divergence(cast(student_hidden), cast(student_weight), cast(teacher_hidden),
                                         cast(teacher_weight), cast(student_bias), cast(teacher_bias), labels, beta,
                                         temperature, student_softcap, student_logit_scale, teacher_softcap,
                                         teacher_logit_scale, ignore_index);
}

const SharedOpRules token_divergence_rules({"token_divergence"}, UnderAutocast::kOwnKernel);
// Called below token_divergence's own autocast kernel, already cast.
const SharedOpRules token_divergence_rules_in_input_dtypes({"token_divergence_forward"}, UnderAutocast::kInputDtypes);
const SharedOpRules token_divergence_rules_without_autocast({"token_divergence_backward"}, UnderAutocast::kOff);

}  // namespace
}  // namespace torch_offload

TORCH_LIBRARY_IMPL(offload, Autograd, m) {
  m.impl("token_divergence", &torch_offload::token_divergence_autograd);
  // Called by the formula above below autograd; gradients of gradients are not supported.
  m.impl("token_divergence_forward", torch::autograd::autogradNotImplementedFallback());
  m.impl("token_divergence_backward", torch::autograd::autogradNotImplementedFallback());
}

TORCH_LIBRARY_IMPL(offload, AutocastCPU, m) {
  m.impl("token_divergence", &torch_offload::token_divergence_autocast<c10::DeviceType::CPU>);
}

TORCH_LIBRARY_IMPL(offload, AutocastCUDA, m) {
  m.impl("token_divergence", &torch_offload::token_divergence_autocast<c10::DeviceType::CUDA>);
}
