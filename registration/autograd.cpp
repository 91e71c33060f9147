// Autograd formulas, registered in C++ so that C++ callers get gradients too.
// Each forward re-dispatches below autograd; each backward calls the ops again,
// so higher-order gradients work as well.
#include <ATen/core/grad_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/library.h>

#include "ops/attention_block/attention_block.h"
#include "ops/linear_cross_entropy/linear_cross_entropy.h"
#include "ops/rms_norm/rms_norm.h"
#include "torch_offload/torch_offload.h"

namespace torch_offload {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// pack moves to the CPU: its gradient moves back to the source device.
class PackFunction : public torch::autograd::Function<PackFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& src, bool non_blocking) {
    ctx->saved_data["device"] = src.device();
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return offload_pack(src, non_blocking);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor& grad = grads[0];
    const c10::Device device = ctx->saved_data["device"].toDevice();
    return {grad.defined() ? offload_unpack(grad, device) : grad, at::Tensor()};
  }
};

// unpack moves from packed's device: its gradient is packed back to the CPU, or
// copied back to packed's device when that is not the CPU.
class UnpackFunction : public torch::autograd::Function<UnpackFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& packed, c10::Device device) {
    ctx->saved_data["device"] = packed.device();
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return offload_unpack(packed, device);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor& grad = grads[0];
    const c10::Device device = ctx->saved_data["device"].toDevice();
    if (!grad.defined()) {
      return {grad, at::Tensor()};
    }
    return {device.is_cpu() ? offload_pack(grad) : offload_unpack(grad, device), at::Tensor()};
  }
};

at::Tensor offload_pack_autograd(const at::Tensor& src, bool non_blocking) {
  return PackFunction::apply(src, non_blocking);
}

at::Tensor offload_unpack_autograd(const at::Tensor& packed, c10::Device device) {
  return UnpackFunction::apply(packed, device);
}

std::optional<at::Tensor> or_nullopt(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

// The output mask of a backward whose saved tensors are its forward's tensor inputs in order, undefined where
// an optional one was absent: absent inputs have no autograd edge, so count the edges of those given.
template <size_t N>
std::array<bool, N> mask_of_given(AutogradContext* ctx, const variable_list& saved) {
  std::array<bool, N> output_mask{};
  size_t edge = 0;
  for (size_t i = 0; i < N; ++i) {
    if (saved[i].defined()) {
      output_mask[i] = ctx->needs_input_grad(edge++);
    }
  }
  return output_mask;
}

// tiled_mlp saves x and the weights only. Its backward is one node that returns
// each gradient once (what DDP's and FSDP's hooks expect), computed by the
// tiled_mlp_backward op, which AOTAutograd traces like any other op. Gradients
// nobody needs are not computed. No double backward: tiled_mlp_backward has none.
class TiledMlpFunction : public torch::autograd::Function<TiledMlpFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w_gate,
                            const std::optional<at::Tensor>& w_up, const at::Tensor& w_down,
                            const std::optional<at::Tensor>& b_gate, const std::optional<at::Tensor>& b_up,
                            const std::optional<at::Tensor>& b_down, c10::string_view activation,
                            c10::SymInt num_shards) {
    const auto or_undefined = [](const std::optional<at::Tensor>& t) { return t.value_or(at::Tensor()); };
    ctx->save_for_backward(
        {x, w_gate, or_undefined(w_up), w_down, or_undefined(b_gate), or_undefined(b_up), or_undefined(b_down)});
    ctx->saved_data["activation"] = std::string(activation);
    ctx->saved_data["num_shards"] = num_shards;
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return tiled_mlp(x, w_gate, w_up, w_down, b_gate, b_up, b_down, activation, num_shards);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const std::string activation = ctx->saved_data["activation"].toStringRef();
    const auto [x, w_gate, w_up, w_down, b_gate, b_up, b_down] = tiled_mlp_backward(
        grads[0], saved[0], saved[1], or_nullopt(saved[2]), saved[3], or_nullopt(saved[4]), or_nullopt(saved[5]),
        or_nullopt(saved[6]), activation, ctx->saved_data["num_shards"].toSymInt(), mask_of_given<7>(ctx, saved));
    return {x, w_gate, w_up, w_down, b_gate, b_up, b_down, at::Tensor(), at::Tensor()};
  }
};

// rms_norm_tiled_mlp likewise: it saves x (the norm's input) and the weights, never the norm's output.
class RmsNormTiledMlpFunction : public torch::autograd::Function<RmsNormTiledMlpFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& norm_weight, double norm_eps,
                            const at::Tensor& w_gate, const std::optional<at::Tensor>& w_up, const at::Tensor& w_down,
                            const std::optional<at::Tensor>& b_gate, const std::optional<at::Tensor>& b_up,
                            const std::optional<at::Tensor>& b_down, c10::string_view activation,
                            c10::SymInt num_shards) {
    const auto or_undefined = [](const std::optional<at::Tensor>& t) { return t.value_or(at::Tensor()); };
    ctx->save_for_backward({x, norm_weight, w_gate, or_undefined(w_up), w_down, or_undefined(b_gate),
                            or_undefined(b_up), or_undefined(b_down)});
    ctx->saved_data["norm_eps"] = norm_eps;
    ctx->saved_data["activation"] = std::string(activation);
    ctx->saved_data["num_shards"] = num_shards;
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return rms_norm_tiled_mlp(x, norm_weight, norm_eps, w_gate, w_up, w_down, b_gate, b_up, b_down, activation,
                              num_shards);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const std::string activation = ctx->saved_data["activation"].toStringRef();
    const auto [x, norm_weight, w_gate, w_up, w_down, b_gate, b_up, b_down] = rms_norm_tiled_mlp_backward(
        grads[0], saved[0], saved[1], ctx->saved_data["norm_eps"].toDouble(), saved[2], or_nullopt(saved[3]), saved[4],
        or_nullopt(saved[5]), or_nullopt(saved[6]), or_nullopt(saved[7]), activation,
        ctx->saved_data["num_shards"].toSymInt(), mask_of_given<8>(ctx, saved));
    return {x, norm_weight, at::Tensor(), w_gate, w_up, w_down, b_gate, b_up, b_down, at::Tensor(), at::Tensor()};
  }
};

at::Tensor rms_norm_tiled_mlp_autograd(const at::Tensor& x, const at::Tensor& norm_weight, double norm_eps,
                                       const at::Tensor& w_gate, const std::optional<at::Tensor>& w_up,
                                       const at::Tensor& w_down, const std::optional<at::Tensor>& b_gate,
                                       const std::optional<at::Tensor>& b_up, const std::optional<at::Tensor>& b_down,
                                       c10::string_view activation, c10::SymInt num_shards) {
  return RmsNormTiledMlpFunction::apply(x, norm_weight, norm_eps, w_gate, w_up, w_down, b_gate, b_up, b_down,
                                        activation, std::move(num_shards));
}

at::Tensor tiled_mlp_autograd(const at::Tensor& x, const at::Tensor& w_gate, const std::optional<at::Tensor>& w_up,
                              const at::Tensor& w_down, const std::optional<at::Tensor>& b_gate,
                              const std::optional<at::Tensor>& b_up, const std::optional<at::Tensor>& b_down,
                              c10::string_view activation, c10::SymInt num_shards) {
  return TiledMlpFunction::apply(x, w_gate, w_up, w_down, b_gate, b_up, b_down, activation, std::move(num_shards));
}

}  // namespace
}  // namespace torch_offload

TORCH_LIBRARY_IMPL(offload, Autograd, m) {
  m.impl("offload_pack", &torch_offload::offload_pack_autograd);
  m.impl("offload_unpack", &torch_offload::offload_unpack_autograd);
  // Tickets carry no gradient: run below autograd, nothing to record.
  m.impl("disk_spill", torch::autograd::autogradNotImplementedFallback());
  m.impl("disk_restore", torch::autograd::autogradNotImplementedFallback());
  m.impl("disk_read", torch::autograd::autogradNotImplementedFallback());
  m.impl("tiled_mlp", &torch_offload::tiled_mlp_autograd);
  // Computing gradients of gradients is not supported: an error if backward reaches it.
  m.impl("tiled_mlp_backward", torch::autograd::autogradNotImplementedFallback());
  m.impl("rms_norm_tiled_mlp", &torch_offload::rms_norm_tiled_mlp_autograd);
  m.impl("rms_norm_tiled_mlp_backward", torch::autograd::autogradNotImplementedFallback());
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
// double backward.
class LinearCrossEntropyFunction : public torch::autograd::Function<LinearCrossEntropyFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& hidden, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias, const at::Tensor& target, int64_t ignore_index,
                            double label_smoothing, double softcap, double z_loss, c10::string_view reduction,
                            c10::SymInt tile_tokens, c10::SymInt tile_vocab, double filter_eps,
                            std::optional<std::array<bool, 3>> gradients_in_forward) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto& d = ctx->saved_data;
    d["gradients_in_forward"] = gradients_in_forward.has_value();
    if (gradients_in_forward.has_value()) {
      auto [loss, grad_hidden, grad_weight, grad_bias] =
          linear_cross_entropy_with_gradients(hidden, weight, bias, target, ignore_index, label_smoothing, softcap,
                                              z_loss, reduction, tile_tokens, *gradients_in_forward);
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
      return loss;
    }
    auto [loss, lse] = linear_cross_entropy_forward(hidden, weight, bias, target, ignore_index, label_smoothing,
                                                    softcap, z_loss, reduction, tile_tokens, tile_vocab);
    ctx->save_for_backward({hidden, weight, bias.value_or(at::Tensor()), target, lse});
    d["ignore_index"] = ignore_index;
    d["label_smoothing"] = label_smoothing;
    d["softcap"] = softcap;
    d["z_loss"] = z_loss;
    d["reduction"] = std::string(reduction);
    d["tile_tokens"] = tile_tokens;
    d["tile_vocab"] = tile_vocab;
    d["filter_eps"] = filter_eps;
    return loss;
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
      // (retain_graph=True) scales copies.
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
      return {grad_hidden,  grad_weight,  grad_bias,    at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(),
              at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
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
    return {grad_hidden,  grad_weight,  grad_bias,    at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor linear_cross_entropy_autograd(const at::Tensor& hidden, const at::Tensor& weight,
                                         const std::optional<at::Tensor>& bias, const at::Tensor& target,
                                         int64_t ignore_index, double label_smoothing, double softcap, double z_loss,
                                         c10::string_view reduction, c10::SymInt tile_tokens, c10::SymInt tile_vocab,
                                         double filter_eps, std::optional<bool> gradients_in_forward) {
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
                                           in_forward);
}

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

// Whether x's gradient may be written over `grad`, the gradient coming in: nothing else can see it (this is
// its only reference and its memory's), it is a plain dense tensor shaped as x, no graph is being recorded
// (create_graph), and no dispatch mode, tensor subclass or functionalization (torch.compile's tracing) would
// have to see the write.
bool can_overwrite(const at::Tensor& grad, const at::Tensor& x) {
  constexpr c10::DispatchKeySet kTraced(
      {c10::DispatchKey::Python, c10::DispatchKey::Functionalize, c10::DispatchKey::PythonTLSSnapshot});
  return !at::GradMode::is_enabled() && grad.defined() && grad.layout() == at::kStrided && grad.use_count() == 1 &&
         grad.storage().use_count() == 1 && !grad.is_view() && !grad.requires_grad() && !grad.is_inference() &&
         !grad.is_neg() && !grad._is_zerotensor() && grad.is_contiguous() && grad.sizes() == x.sizes() &&
         grad.scalar_type() == x.scalar_type() && grad.device() == x.device() && !grad.key_set().has_any(kTraced) &&
         !c10::impl::dispatch_mode_enabled() && !c10::impl::tls_local_dispatch_key_set().included_.has_any(kTraced);
}

// rms_norm saves x and weight; backward recomputes each row's scale from x. No double backward. Where the
// incoming gradient is the autograd engine's alone (the usual case: the norm's output feeds one module),
// x's gradient is written over it, so the backward allocates no [tokens, h] tensor: one hidden vector per
// token less while a decoder layer's norm runs backward (not yet at an applied step's peak, the MLP's
// backward: BENCHMARKS.md, "Live tensors at the peak"). `grads` by reference: a copy would hold a second one.
class RmsNormFunction : public torch::autograd::Function<RmsNormFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight, double eps) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    ctx->save_for_backward({x, weight});
    ctx->saved_data["eps"] = eps;
    return rms_norm(x, weight, eps);
  }
  static variable_list backward(AutogradContext* ctx, variable_list& grads) {
    const variable_list saved = ctx->get_saved_variables();
    const double eps = ctx->saved_data.at("eps").toDouble();
    at::Tensor grad = std::move(grads[0]);
    if (ctx->needs_input_grad(0) && can_overwrite(grad, saved[0])) {
      // The kernel's own code, called directly: with the dispatcher's autocast keys it would recast its steps.
      const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
      at::Tensor grad_weight = rms_norm_backward_into_grad(grad, saved[0], saved[1], eps, ctx->needs_input_grad(1));
      return {std::move(grad), std::move(grad_weight), at::Tensor()};
    }
    const auto [grad_x, grad_weight] =
        rms_norm_backward(grad, saved[0], saved[1], eps, {ctx->needs_input_grad(0), ctx->needs_input_grad(1)});
    return {grad_x, grad_weight, at::Tensor()};
  }
};

at::Tensor rms_norm_autograd(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return RmsNormFunction::apply(x, weight, eps);
}

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

}  // namespace
}  // namespace torch_offload

TORCH_LIBRARY_IMPL(offload, Autograd, m) {
  m.impl("rms_norm", &torch_offload::rms_norm_autograd);
  m.impl("rms_norm_backward", torch::autograd::autogradNotImplementedFallback());
  m.impl("token_logprobs", &torch_offload::token_logprobs_autograd);
  m.impl("token_logprobs_forward", torch::autograd::autogradNotImplementedFallback());
  m.impl("token_logprobs_backward", torch::autograd::autogradNotImplementedFallback());
  m.impl("token_logprob_summaries", &torch_offload::token_logprob_summaries_autograd);
  m.impl("linear_cross_entropy", &torch_offload::linear_cross_entropy_autograd);
  // Called by the formula above below autograd; gradients of gradients are not supported.
  m.impl("linear_cross_entropy_forward", torch::autograd::autogradNotImplementedFallback());
  m.impl("linear_cross_entropy_backward", torch::autograd::autogradNotImplementedFallback());
  m.impl("linear_cross_entropy_with_gradients", torch::autograd::autogradNotImplementedFallback());
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
                            const std::optional<at::Tensor>& k_norm, double norm_eps) {
    check_rotary_needs_no_grad(cos, sin);
    const auto or_undefined = [](const std::optional<at::Tensor>& t) { return t.value_or(at::Tensor()); };
    ctx->save_for_backward({x, w_q, w_k, w_v, w_o, cos, sin, or_undefined(b_q), or_undefined(b_k), or_undefined(b_v),
                            or_undefined(b_o), or_undefined(segment_ids), or_undefined(q_norm), or_undefined(k_norm)});
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["norm_eps"] = norm_eps;
    ctx->saved_data["group_name"] = group_name.has_value() ? c10::IValue(std::string(*group_name)) : c10::IValue();
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return attention_block(x, w_q, w_k, w_v, w_o, cos, sin, b_q, b_k, b_v, b_o, scale, segment_ids, group_name, q_norm,
                           k_norm, norm_eps);
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
        group_name, or_nullopt(saved[12]), or_nullopt(saved[13]), ctx->saved_data["norm_eps"].toDouble());
    // One per forward argument: none for cos, sin, scale, segment_ids, group_name and norm_eps.
    return {x,   w_q, w_k,          w_v,          w_o,          at::Tensor(), at::Tensor(), b_q,         b_k,
            b_v, b_o, at::Tensor(), at::Tensor(), at::Tensor(), q_norm,       k_norm,       at::Tensor()};
  }
};

at::Tensor attention_block_autograd(const at::Tensor& x, const at::Tensor& w_q, const at::Tensor& w_k,
                                    const at::Tensor& w_v, const at::Tensor& w_o, const at::Tensor& cos,
                                    const at::Tensor& sin, const std::optional<at::Tensor>& b_q,
                                    const std::optional<at::Tensor>& b_k, const std::optional<at::Tensor>& b_v,
                                    const std::optional<at::Tensor>& b_o, std::optional<double> scale,
                                    const std::optional<at::Tensor>& segment_ids,
                                    std::optional<c10::string_view> group_name, const std::optional<at::Tensor>& q_norm,
                                    const std::optional<at::Tensor>& k_norm, double norm_eps) {
  return AttentionBlockFunction::apply(x, w_q, w_k, w_v, w_o, cos, sin, b_q, b_k, b_v, b_o, scale, segment_ids,
                                       group_name, q_norm, k_norm, norm_eps);
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

}  // namespace
}  // namespace torch_offload

TORCH_LIBRARY_IMPL(offload, Autograd, m) {
  m.impl("attention_block", &torch_offload::attention_block_autograd);
  m.impl("segment_attention", &torch_offload::segment_attention_autograd);
  m.impl("segment_attention_backward", torch::autograd::autogradNotImplementedFallback());
  // Computing gradients of gradients is not supported: an error if backward reaches it.
  m.impl("attention_block_backward", torch::autograd::autogradNotImplementedFallback());
}
