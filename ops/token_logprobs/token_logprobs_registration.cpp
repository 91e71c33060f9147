// token_logprobs, its companion ops and token_logprob_summaries: their schemas, kernels, autograd, autocast and
// shared rules. Their tiles are ATen's: one kernel serves every dense device.
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include "ops/common/op_rules.h"
#include "ops/token_logprobs/token_logprobs.h"
#include "torch_offload/torch_offload.h"

TORCH_LIBRARY_FRAGMENT(offload, m) {
  // Each token's log-probability of its id (ids [...]) or of each of its K ids (ids [..., K]) under
  // softmax(scores) and, with entropy=True, its entropy ([...]; else an empty [0] tensor), scores =
  // cap(logit_scale * logits) / temperature (cap: softcap * tanh(x / softcap) where softcap > 0), logits =
  // hidden @ weight^T + bias in tiles (no [tokens, V]), float32 for bf16/fp16 inputs; 0 for ids equal to
  // ignore_index (an entropy: where every id of the token is). The forward op also returns each token's log-sum-exp of
  // the scores (float64) for the backward op, which takes either upstream gradient (or both) and returns the gradients
  // output_mask asks for (hidden, weight, bias); it needs the forward's entropies with grad_entropy.
  m.def(
      "token_logprobs(Tensor hidden, Tensor weight, Tensor ids, *, Tensor? bias=None, float temperature=1.0, "
      "bool entropy=False, float softcap=0.0, float logit_scale=1.0, int ignore_index=-100) -> (Tensor, Tensor)");
  m.def(
      "token_logprobs_forward(Tensor hidden, Tensor weight, Tensor ids, Tensor? bias, float temperature, "
      "bool entropy, float softcap, float logit_scale, int ignore_index) -> (Tensor, Tensor, Tensor)");
  m.def(
      "token_logprobs_backward(Tensor? grad_logprobs, Tensor? grad_entropy, Tensor hidden, Tensor weight, "
      "Tensor ids, Tensor? bias, Tensor lse, Tensor? entropy, float temperature, float softcap, "
      "float logit_scale, int ignore_index, bool[3] output_mask) -> (Tensor, Tensor, Tensor)");
  // Per token, without gradients: the mean of the scores, whether the id is the first maximum, and log sum p^2
  // (float32 for bf16/fp16; the second bool); 0 (False) for ids equal to ignore_index.
  m.def(
      "token_logprob_summaries(Tensor hidden, Tensor weight, Tensor ids, *, Tensor? bias=None, "
      "float temperature=1.0, float softcap=0.0, float logit_scale=1.0, int ignore_index=-100) "
      "-> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(offload, CPU, m) {
  m.impl("token_logprobs", &torch_offload::token_logprobs_kernel);
  m.impl("token_logprobs_forward", &torch_offload::token_logprobs_forward_kernel);
  m.impl("token_logprobs_backward", &torch_offload::token_logprobs_backward_kernel);
  m.impl("token_logprob_summaries", &torch_offload::token_logprob_summaries_kernel);
}

#ifdef TORCH_OFFLOAD_WITH_CUDA
TORCH_LIBRARY_IMPL(offload, CUDA, m) {
  m.impl("token_logprobs", &torch_offload::token_logprobs_kernel);
  m.impl("token_logprobs_forward", &torch_offload::token_logprobs_forward_kernel);
  m.impl("token_logprobs_backward", &torch_offload::token_logprobs_backward_kernel);
  m.impl("token_logprob_summaries", &torch_offload::token_logprob_summaries_kernel);
}
#endif

TORCH_LIBRARY_IMPL(offload, Meta, m) {
  m.impl("token_logprobs", &torch_offload::token_logprobs_meta);
  m.impl("token_logprobs_forward", &torch_offload::token_logprobs_forward_meta);
  m.impl("token_logprobs_backward", &torch_offload::token_logprobs_backward_meta);
  m.impl("token_logprob_summaries", &torch_offload::token_logprob_summaries_meta);
}

namespace torch_offload {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// token_logprobs saves its inputs, each token's log-sum-exp and, when computed, its entropy; backward
// recomputes the tiles for whichever outputs got a gradient (the per-token upstream gradients are not
// known in forward). No double backward.
class TokenLogprobsFunction : public torch::autograd::Function<TokenLogprobsFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& hidden, const at::Tensor& weight,
                               const at::Tensor& ids, const std::optional<at::Tensor>& bias, double temperature,
                               bool entropy, double softcap, double logit_scale, int64_t ignore_index) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [logprobs, entropies, lse] =
        token_logprobs_forward(hidden, weight, ids, bias, temperature, entropy, softcap, logit_scale, ignore_index);
    // A copy of the entropies ([tokens]): callers mask or clean the output in place (masked_fill_, nan_to_num_),
    // which must not invalidate the backward.
    ctx->save_for_backward(
        {hidden, weight, bias.value_or(at::Tensor()), ids, lse, entropy ? entropies.clone() : at::Tensor()});
    ctx->saved_data["temperature"] = temperature;
    ctx->saved_data["softcap"] = softcap;
    ctx->saved_data["logit_scale"] = logit_scale;
    ctx->saved_data["ignore_index"] = ignore_index;
    // An output without a gradient (entropy kept for logging) gets none: its tiles' term is skipped.
    ctx->set_materialize_grads(false);
    if (!entropy) {
      ctx->mark_non_differentiable({entropies});  // the empty placeholder
    }
    return {logprobs, entropies};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const bool has_bias = saved[2].defined(), has_entropy = saved[5].defined();
    const auto present = [](bool has, const at::Tensor& t) {
      return has && t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
    };
    // Absent optional inputs have no autograd edge: bias (input 3) takes one only when given.
    const std::array<bool, 3> output_mask{ctx->needs_input_grad(0), ctx->needs_input_grad(1),
                                          has_bias && ctx->needs_input_grad(3)};
    const auto [grad_hidden, grad_weight, grad_bias] = token_logprobs_backward(
        present(true, grads[0]), present(has_entropy, grads[1]), saved[0], saved[1], saved[3],
        present(has_bias, saved[2]), saved[4], present(has_entropy, saved[5]),
        ctx->saved_data.at("temperature").toDouble(), output_mask, ctx->saved_data.at("softcap").toDouble(),
        ctx->saved_data.at("logit_scale").toDouble(), ctx->saved_data.at("ignore_index").toInt());
    return {grad_hidden,  grad_weight,  at::Tensor(), grad_bias,   at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

std::tuple<at::Tensor, at::Tensor> token_logprobs_autograd(const at::Tensor& hidden, const at::Tensor& weight,
                                                           const at::Tensor& ids, const std::optional<at::Tensor>& bias,
                                                           double temperature, bool entropy, double softcap,
                                                           double logit_scale, int64_t ignore_index) {
  const variable_list outputs =
      TokenLogprobsFunction::apply(hidden, weight, ids, bias, temperature, entropy, softcap, logit_scale, ignore_index);
  return {outputs[0], outputs[1]};
}

// Summaries carry no gradient: computed below autograd, their outputs never require one.
TokenLogprobSummaries token_logprob_summaries_autograd(const at::Tensor& hidden, const at::Tensor& weight,
                                                       const at::Tensor& ids, const std::optional<at::Tensor>& bias,
                                                       double temperature, double softcap, double logit_scale,
                                                       int64_t ignore_index) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return token_logprob_summaries(hidden, weight, ids, bias, temperature, softcap, logit_scale, ignore_index);
}

// Under autocast: the GEMMs in the autocast dtype, the outputs float32.
template <c10::DeviceType kDevice>
std::tuple<at::Tensor, at::Tensor> token_logprobs_autocast(const at::Tensor& hidden, const at::Tensor& weight,
                                                           const at::Tensor& ids, const std::optional<at::Tensor>& bias,
                                                           double temperature, bool entropy, double softcap,
                                                           double logit_scale, int64_t ignore_index) {
  const BelowAutocast<kDevice> cast;
  return token_logprobs(cast(hidden), cast(weight), ids, cast(bias), temperature, entropy, softcap, logit_scale,
                        ignore_index);
}

// The summaries likewise (TRL asks for them beside token_logprobs, under the same autocast).
template <c10::DeviceType kDevice>
TokenLogprobSummaries token_logprob_summaries_autocast(const at::Tensor& hidden, const at::Tensor& weight,
                                                       const at::Tensor& ids, const std::optional<at::Tensor>& bias,
                                                       double temperature, double softcap, double logit_scale,
                                                       int64_t ignore_index) {
  const BelowAutocast<kDevice> cast;
  return token_logprob_summaries(cast(hidden), cast(weight), ids, cast(bias), temperature, softcap, logit_scale,
                                 ignore_index);
}

const SharedOpRules token_logprobs_rules({"token_logprobs", "token_logprob_summaries"}, UnderAutocast::kOwnKernel);
// Called below token_logprobs' own autocast kernel, already cast.
const SharedOpRules token_logprobs_rules_in_input_dtypes({"token_logprobs_forward"}, UnderAutocast::kInputDtypes);
const SharedOpRules token_logprobs_rules_without_autocast({"token_logprobs_backward"}, UnderAutocast::kOff);

}  // namespace
}  // namespace torch_offload

TORCH_LIBRARY_IMPL(offload, Autograd, m) {
  m.impl("token_logprobs", &torch_offload::token_logprobs_autograd);
  // Called by the formula above below autograd; gradients of gradients are not supported.
  m.impl("token_logprobs_forward", torch::autograd::autogradNotImplementedFallback());
  m.impl("token_logprobs_backward", torch::autograd::autogradNotImplementedFallback());
  m.impl("token_logprob_summaries", &torch_offload::token_logprob_summaries_autograd);
}

TORCH_LIBRARY_IMPL(offload, AutocastCPU, m) {
  m.impl("token_logprobs", &torch_offload::token_logprobs_autocast<c10::DeviceType::CPU>);
  m.impl("token_logprob_summaries", &torch_offload::token_logprob_summaries_autocast<c10::DeviceType::CPU>);
}

TORCH_LIBRARY_IMPL(offload, AutocastCUDA, m) {
  m.impl("token_logprobs", &torch_offload::token_logprobs_autocast<c10::DeviceType::CUDA>);
  m.impl("token_logprob_summaries", &torch_offload::token_logprob_summaries_autocast<c10::DeviceType::CUDA>);
}
