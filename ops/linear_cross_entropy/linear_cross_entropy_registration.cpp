// linear_cross_entropy and its companion ops: their schemas, kernels, autograd, autocast and shared rules.
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/library.h>

#include "ops/common/op_rules.h"
#include "ops/linear_cross_entropy/linear_cross_entropy.h"
#include "torch_offload/torch_offload.h"

TORCH_LIBRARY_FRAGMENT(offload, m) {
  // The LM head's cross-entropy in tiles of tokens x vocabulary (no [tokens, V]
  // logits). The loss, and the log-sum-exp per token that linear_cross_entropy_forward
  // also returns for the backward op, are float32 (float64 for float64 inputs); the backward
  // op returns the gradients output_mask asks for (hidden, weight, bias). filter_eps > 0
  // turns on gradient filtering in backward (tiles whose gradient is negligible are skipped).
  m.def(
      "linear_cross_entropy(Tensor hidden, Tensor weight, Tensor? bias, Tensor target, int ignore_index=-100, "
      "float label_smoothing=0.0, float softcap=0.0, float z_loss=0.0, str reduction=\"mean\", "
      "SymInt tile_tokens=0, SymInt tile_vocab=0, float filter_eps=0.0, bool? gradients_in_forward=None) -> Tensor");
  // The same loss with, from the same pass, the z-loss term, token accuracy and entropy, reduced as the loss
  // (no gradient).
  m.def(
      "linear_cross_entropy_with_statistics(Tensor hidden, Tensor weight, Tensor? bias, Tensor target, "
      "int ignore_index=-100, float label_smoothing=0.0, float softcap=0.0, float z_loss=0.0, str reduction=\"mean\", "
      "SymInt tile_tokens=0, SymInt tile_vocab=0, float filter_eps=0.0, bool? gradients_in_forward=None) "
      "-> (Tensor loss, Tensor z_loss, Tensor accuracy, Tensor entropy)");
  // statistics=True: a third output [3, tokens] of each token's z-loss term, top-1 (1 or 0) and entropy (0 where
  // ignored); else an empty [0] tensor.
  m.def(
      "linear_cross_entropy_forward(Tensor hidden, Tensor weight, Tensor? bias, Tensor target, int ignore_index, "
      "float label_smoothing, float softcap, float z_loss, str reduction, SymInt tile_tokens, SymInt tile_vocab, "
      "bool statistics=False) -> (Tensor, Tensor, Tensor)");
  m.def(
      "linear_cross_entropy_backward(Tensor grad_loss, Tensor hidden, Tensor weight, Tensor? bias, Tensor target, "
      "Tensor lse, int ignore_index, float label_smoothing, float softcap, float z_loss, str reduction, "
      "SymInt tile_tokens, SymInt tile_vocab, bool[3] output_mask, float filter_eps=0.0) -> (Tensor, Tensor, Tensor)");
  // For a scalar loss ("mean", "sum"): the loss and its gradients by (hidden, weight, bias) for a unit
  // grad_loss, those output_mask asks for (undefined otherwise), in the loss's dtype, computed in forward
  // (3 GEMMs; the autograd formula then only scales them). tile_tokens: the tokens of a whole-vocabulary
  // slab of logits, <= 0 for a 64 MiB budget (at least 512 tokens). statistics as linear_cross_entropy_forward's.
  m.def(
      "linear_cross_entropy_with_gradients(Tensor hidden, Tensor weight, Tensor? bias, Tensor target, "
      "int ignore_index, float label_smoothing, float softcap, float z_loss, str reduction, SymInt tile_tokens, "
      "bool[3] output_mask, bool statistics=False) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  // The automatic tile [tokens, vocabulary columns]; takes no tensor, so one kernel serves every backend.
  m.def("linear_cross_entropy_tile(int tokens, int vocab, ScalarType dtype) -> int[]",
        &torch_offload::linear_cross_entropy_tile_kernel);
}

TORCH_LIBRARY_IMPL(offload, CPU, m) {
  m.impl("linear_cross_entropy", &torch_offload::linear_cross_entropy_cpu);
  m.impl("linear_cross_entropy_forward", &torch_offload::linear_cross_entropy_forward_cpu);
  m.impl("linear_cross_entropy_backward", &torch_offload::linear_cross_entropy_backward_cpu);
  m.impl("linear_cross_entropy_with_gradients", &torch_offload::linear_cross_entropy_with_gradients_cpu);
}

#ifdef TORCH_OFFLOAD_WITH_CUDA
TORCH_LIBRARY_IMPL(offload, CUDA, m) {
  m.impl("linear_cross_entropy", &torch_offload::linear_cross_entropy_cuda);
  m.impl("linear_cross_entropy_forward", &torch_offload::linear_cross_entropy_forward_cuda);
  m.impl("linear_cross_entropy_backward", &torch_offload::linear_cross_entropy_backward_cuda);
  m.impl("linear_cross_entropy_with_gradients", &torch_offload::linear_cross_entropy_with_gradients_cuda);
}
#endif

TORCH_LIBRARY_IMPL(offload, Meta, m) {
  m.impl("linear_cross_entropy", &torch_offload::linear_cross_entropy_meta);
  m.impl("linear_cross_entropy_forward", &torch_offload::linear_cross_entropy_forward_meta);
  m.impl("linear_cross_entropy_backward", &torch_offload::linear_cross_entropy_backward_meta);
  m.impl("linear_cross_entropy_with_gradients", &torch_offload::linear_cross_entropy_with_gradients_meta);
}

namespace torch_offload {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Gradients in forward keep none of the inputs, so autograd cannot see one changed in place before backward.
// A 0-element tensor that shares the input's version counter, and holds none of its memory, lets backward
// refuse gradients computed at the old values, as autograd does for the inputs it saves.
void record_version(AutogradContext* ctx, const std::string& name, const at::Tensor& input) {
  const c10::VariableVersion& counter = torch::autograd::impl::version_counter(input);
  if (!counter.enabled()) {
    return;  // an inference tensor: changed in place only in inference mode, which does not count versions
  }
  at::Tensor watch = at::empty({0}, input.options());
  torch::autograd::impl::set_version_counter(watch, counter);
  ctx->saved_data[name + " watch"] = watch;
  ctx->saved_data[name + " version"] = static_cast<int64_t>(counter.current_version());
}

void check_version(AutogradContext* ctx, const std::string& name) {
  const auto watch = ctx->saved_data.find(name + " watch");
  if (watch == ctx->saved_data.end()) {
    return;
  }
  const int64_t version = watch->second.toTensor()._version(), expected = ctx->saved_data.at(name + " version").toInt();
  TORCH_CHECK(version == expected, "linear_cross_entropy: ", name,
              " was modified by an inplace operation between forward and backward; the gradients computed in "
              "forward are those at its old value (its version is ",
              version, ", expected ", expected, ")");
}

// linear_cross_entropy takes one of two paths when a gradient is needed:
// - gradients in forward (linear_cross_entropy_with_gradients, 3 GEMMs): forward keeps the loss's
//   gradients for a unit grad_loss, and backward hands them out scaled by grad_loss;
// - recompute (4 GEMMs): forward saves its inputs and each token's log-sum-exp ([tokens], float32) from
//   linear_cross_entropy_forward, and backward is the linear_cross_entropy_backward op.
// Either way AOTAutograd traces the ops like any other. Gradients nobody needs are not computed. No
// double backward. Outputs: the loss and the per-token statistics (empty unless `statistics`), which have no
// gradient.
class LinearCrossEntropyFunction : public torch::autograd::Function<LinearCrossEntropyFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& hidden, const at::Tensor& weight,
                               const std::optional<at::Tensor>& bias, const at::Tensor& target, int64_t ignore_index,
                               double label_smoothing, double softcap, double z_loss, c10::string_view reduction,
                               c10::SymInt tile_tokens, c10::SymInt tile_vocab, double filter_eps,
                               std::optional<std::array<bool, 3>> gradients_in_forward, bool statistics) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto& d = ctx->saved_data;
    d["gradients_in_forward"] = gradients_in_forward.has_value();
    if (gradients_in_forward.has_value()) {
      auto [loss, grad_hidden, grad_weight, grad_bias, per_token] =
          linear_cross_entropy_with_gradients(hidden, weight, bias, target, ignore_index, label_smoothing, softcap,
                                              z_loss, reduction, tile_tokens, *gradients_in_forward, statistics);
      d["grad_hidden"] = grad_hidden;
      d["grad_weight"] = grad_weight;
      d["grad_bias"] = grad_bias;
      d["dtype"] = hidden.scalar_type();
      // Every input enters every gradient (target too), needed or not.
      record_version(ctx, "hidden", hidden);
      record_version(ctx, "weight", weight);
      if (bias.has_value()) {
        record_version(ctx, "bias", *bias);
      }
      record_version(ctx, "target", target);
      ctx->mark_non_differentiable({per_token});
      return {loss, per_token};
    }
    auto [loss, lse, per_token] =
        linear_cross_entropy_forward(hidden, weight, bias, target, ignore_index, label_smoothing, softcap, z_loss,
                                     reduction, tile_tokens, tile_vocab, statistics);
    ctx->save_for_backward({hidden, weight, bias.value_or(at::Tensor()), target, lse});
    d["ignore_index"] = ignore_index;
    d["label_smoothing"] = label_smoothing;
    d["softcap"] = softcap;
    d["z_loss"] = z_loss;
    d["reduction"] = std::string(reduction);
    d["tile_tokens"] = tile_tokens;
    d["tile_vocab"] = tile_vocab;
    d["filter_eps"] = filter_eps;
    ctx->mark_non_differentiable({per_token});
    return {loss, per_token};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto& d = ctx->saved_data;
    if (d.at("gradients_in_forward").toBool()) {
      TORCH_CHECK(d.count("grad_hidden"),
                  "linear_cross_entropy: trying to backward through the graph a second "
                  "time; the gradients its forward computed were handed out by the first backward (specify "
                  "retain_graph=True if you need to backward through the graph a second time)");
      // The kept gradients are constants: a gradient of them would be silently wrong.
      TORCH_CHECK(!at::GradMode::is_enabled(),
                  "linear_cross_entropy: double backward (create_graph=True) is not "
                  "supported");
      for (const char* name : {"hidden", "weight", "bias", "target"}) {
        check_version(ctx, name);
      }
      // The last backward through the node scales the kept gradients in place; one that keeps the graph
      // (retain_graph=True) scales copies. hidden's is kept in its dtype: a grad_loss other than 1 scales its
      // rounded rows (for bf16/fp16 one rounding more than scaling float32 ones; 1 and powers of 2 are exact).
      const bool last = !torch::autograd::get_current_graph_task_keep_graph();
      const auto dtype = d.at("dtype").toScalarType();
      const auto scaled = [&](const char* key) {
        at::Tensor gradient = d.at(key).toTensor();
        if (last) {
          d.erase(key);
        }
        if (!gradient.defined()) {
          return gradient;
        }
        return (last ? gradient.mul_(grads[0]) : gradient.mul(grads[0])).to(dtype);
      };
      const at::Tensor grad_hidden = scaled("grad_hidden"), grad_weight = scaled("grad_weight"),
                       grad_bias = scaled("grad_bias");
      return with_no_other_gradients(grad_hidden, grad_weight, grad_bias);
    }
    const variable_list saved = ctx->get_saved_variables();
    const bool has_bias = saved[2].defined();
    // Absent optional inputs have no autograd edge: bias takes one only when given.
    const std::array<bool, 3> output_mask{ctx->needs_input_grad(0), ctx->needs_input_grad(1),
                                          has_bias && ctx->needs_input_grad(2)};
    const auto [grad_hidden, grad_weight, grad_bias] = linear_cross_entropy_backward(
        grads[0], saved[0], saved[1], has_bias ? std::optional<at::Tensor>(saved[2]) : std::nullopt, saved[3], saved[4],
        d.at("ignore_index").toInt(), d.at("label_smoothing").toDouble(), d.at("softcap").toDouble(),
        d.at("z_loss").toDouble(), d.at("reduction").toStringRef(), d.at("tile_tokens").toSymInt(),
        d.at("tile_vocab").toSymInt(), output_mask, d.at("filter_eps").toDouble());
    return with_no_other_gradients(grad_hidden, grad_weight, grad_bias);
  }

 private:
  // The gradients of forward's 14 inputs: hidden's, weight's and bias's, none for the others.
  static variable_list with_no_other_gradients(const at::Tensor& grad_hidden, const at::Tensor& grad_weight,
                                               const at::Tensor& grad_bias) {
    variable_list gradients(14);
    gradients[0] = grad_hidden;
    gradients[1] = grad_weight;
    gradients[2] = grad_bias;
    return gradients;
  }
};

// Through LinearCrossEntropyFunction, on the path the arguments pick: (loss, per-token statistics).
variable_list linear_cross_entropy_through_function(const at::Tensor& hidden, const at::Tensor& weight,
                                                    const std::optional<at::Tensor>& bias, const at::Tensor& target,
                                                    int64_t ignore_index, double label_smoothing, double softcap,
                                                    double z_loss, c10::string_view reduction, c10::SymInt tile_tokens,
                                                    c10::SymInt tile_vocab, double filter_eps,
                                                    std::optional<bool> gradients_in_forward, bool statistics) {
  check_filter_eps("linear_cross_entropy", filter_eps, label_smoothing);  // before the work, not in backward
  const std::array<bool, 3> wanted{hidden.requires_grad(), weight.requires_grad(),
                                   bias.has_value() && bias->requires_grad()};
  const bool any_wanted = at::GradMode::is_enabled() && (wanted[0] || wanted[1] || wanted[2]);
  std::optional<std::array<bool, 3>> in_forward;
  const bool by_default = gradients_in_forward_by_default("linear_cross_entropy", hidden, softcap, reduction,
                                                          filter_eps, gradients_in_forward);
  if (gradients_in_forward.value_or(by_default) && any_wanted) {
    in_forward = wanted;
  }
  return LinearCrossEntropyFunction::apply(hidden, weight, bias, target, ignore_index, label_smoothing, softcap, z_loss,
                                           reduction, std::move(tile_tokens), std::move(tile_vocab), filter_eps,
                                           in_forward, statistics);
}

at::Tensor linear_cross_entropy_autograd(TORCH_OFFLOAD_LCE_ARGS, double filter_eps,
                                         std::optional<bool> gradients_in_forward) {
  return linear_cross_entropy_through_function(hidden, weight, bias, target, ignore_index, label_smoothing, softcap,
                                               z_loss, reduction, std::move(tile_tokens), std::move(tile_vocab),
                                               filter_eps, gradients_in_forward, /*statistics=*/false)[0];
}

LinearCrossEntropyStatistics linear_cross_entropy_with_statistics_autograd(TORCH_OFFLOAD_LCE_ARGS, double filter_eps,
                                                                           std::optional<bool> gradients_in_forward) {
  const variable_list outputs = linear_cross_entropy_through_function(
      hidden, weight, bias, target, ignore_index, label_smoothing, softcap, z_loss, reduction, std::move(tile_tokens),
      std::move(tile_vocab), filter_eps, gradients_in_forward, /*statistics=*/true);
  auto [z_loss_term, accuracy, entropy] = reduce_cross_entropy_statistics(outputs[1], target, ignore_index, reduction);
  return {outputs[0], z_loss_term, accuracy, entropy};
}

// Below autograd, on every backend (CPU, CUDA, Meta): the forward companion with statistics, reduced.
LinearCrossEntropyStatistics linear_cross_entropy_with_statistics_kernel(TORCH_OFFLOAD_LCE_ARGS, double filter_eps,
                                                                         std::optional<bool> gradients_in_forward) {
  check_filter_eps("linear_cross_entropy", filter_eps, label_smoothing);
  gradients_in_forward_by_default("linear_cross_entropy", hidden, softcap, reduction, filter_eps, gradients_in_forward);
  auto [loss, lse, per_token] =
      linear_cross_entropy_forward(hidden, weight, bias, target, ignore_index, label_smoothing, softcap, z_loss,
                                   reduction, std::move(tile_tokens), std::move(tile_vocab), /*statistics=*/true);
  auto [z_loss_term, accuracy, entropy] = reduce_cross_entropy_statistics(per_token, target, ignore_index, reduction);
  return {loss, z_loss_term, accuracy, entropy};
}

// linear_cross_entropy runs its GEMMs in the autocast dtype, as the linear layer it replaces would; its loss is
// float32, as F.cross_entropy's under autocast (the op itself already returns float32 for the bf16/fp16 it runs in
// there).
at::Tensor float32_unless_float64(const at::Tensor& t) {
  return t.scalar_type() == at::kDouble ? t : t.to(at::kFloat);  // autocast leaves float64 alone
}

template <c10::DeviceType kDevice>
at::Tensor linear_cross_entropy_autocast(TORCH_OFFLOAD_LCE_ARGS, double filter_eps,
                                         std::optional<bool> gradients_in_forward) {
  const BelowAutocast<kDevice> cast;
  return float32_unless_float64(linear_cross_entropy(
      cast(hidden), cast(weight), cast(bias), target, ignore_index, label_smoothing, softcap, z_loss, reduction,
      std::move(tile_tokens), std::move(tile_vocab), filter_eps, gradients_in_forward));
}

template <c10::DeviceType kDevice>
LinearCrossEntropyStatistics linear_cross_entropy_with_statistics_autocast(TORCH_OFFLOAD_LCE_ARGS, double filter_eps,
                                                                           std::optional<bool> gradients_in_forward) {
  const BelowAutocast<kDevice> cast;
  auto [loss, z_loss_term, accuracy, entropy] = linear_cross_entropy_with_statistics(
      cast(hidden), cast(weight), cast(bias), target, ignore_index, label_smoothing, softcap, z_loss, reduction,
      std::move(tile_tokens), std::move(tile_vocab), filter_eps, gradients_in_forward);
  return {float32_unless_float64(loss), float32_unless_float64(z_loss_term), float32_unless_float64(accuracy),
          float32_unless_float64(entropy)};
}

const SharedOpRules linear_cross_entropy_rules({"linear_cross_entropy", "linear_cross_entropy_with_statistics"},
                                               UnderAutocast::kOwnKernel);
// The companions are called below linear_cross_entropy's own autocast kernel, already cast.
const SharedOpRules linear_cross_entropy_rules_in_input_dtypes({"linear_cross_entropy_forward",
                                                                "linear_cross_entropy_with_gradients"},
                                                               UnderAutocast::kInputDtypes);
const SharedOpRules linear_cross_entropy_rules_without_autocast({"linear_cross_entropy_backward"}, UnderAutocast::kOff);

}  // namespace
}  // namespace torch_offload

TORCH_LIBRARY_IMPL(offload, Autograd, m) {
  m.impl("linear_cross_entropy", &torch_offload::linear_cross_entropy_autograd);
  m.impl("linear_cross_entropy_with_statistics", &torch_offload::linear_cross_entropy_with_statistics_autograd);
  // Called by the formula above below autograd; gradients of gradients are not supported.
  m.impl("linear_cross_entropy_forward", torch::autograd::autogradNotImplementedFallback());
  m.impl("linear_cross_entropy_backward", torch::autograd::autogradNotImplementedFallback());
  m.impl("linear_cross_entropy_with_gradients", torch::autograd::autogradNotImplementedFallback());
}

TORCH_LIBRARY_IMPL(offload, CompositeExplicitAutograd, m) {
  m.impl("linear_cross_entropy_with_statistics", &torch_offload::linear_cross_entropy_with_statistics_kernel);
}

TORCH_LIBRARY_IMPL(offload, AutocastCPU, m) {
  m.impl("linear_cross_entropy", &torch_offload::linear_cross_entropy_autocast<c10::DeviceType::CPU>);
  m.impl("linear_cross_entropy_with_statistics",
         &torch_offload::linear_cross_entropy_with_statistics_autocast<c10::DeviceType::CPU>);
}

TORCH_LIBRARY_IMPL(offload, AutocastCUDA, m) {
  m.impl("linear_cross_entropy", &torch_offload::linear_cross_entropy_autocast<c10::DeviceType::CUDA>);
  m.impl("linear_cross_entropy_with_statistics",
         &torch_offload::linear_cross_entropy_with_statistics_autocast<c10::DeviceType::CUDA>);
}
