// tiled_mlp and rms_norm_tiled_mlp: their schemas, kernels, autograd, autocast and shared rules.
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include "ops/common/autograd_inputs.h"
#include "ops/common/op_rules.h"
#include "ops/tiled_mlp/tiled_mlp.h"
#include "torch_offload/torch_offload.h"

TORCH_LIBRARY_FRAGMENT(offload, m) {
  // The MLP down(act(x w_gate^T + b_gate) * (x w_up^T + b_up)) + b_down, or
  // down(act(x w_gate^T + b_gate)) + b_down without w_up, computed in shards of
  // tokens. The backward op returns the gradients output_mask asks for (x, w_gate,
  // w_up, w_down, b_gate, b_up, b_down), undefined where not asked or absent.
  m.def(
      "tiled_mlp(Tensor x, Tensor w_gate, Tensor? w_up, Tensor w_down, Tensor? b_gate=None, Tensor? b_up=None, "
      "Tensor? b_down=None, str activation=\"silu\", SymInt num_shards=0) -> Tensor");
  m.def(
      "tiled_mlp_backward(Tensor grad_out, Tensor x, Tensor w_gate, Tensor? w_up, Tensor w_down, Tensor? b_gate, "
      "Tensor? b_up, Tensor? b_down, str activation, SymInt num_shards, bool[7] output_mask) "
      "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  // tiled_mlp of rms_norm(x, norm_weight, norm_eps), the norm computed per shard: the norm's output is never
  // whole nor saved. The backward's output_mask and results: (x, norm_weight, w_gate, w_up, w_down, b_gate, b_up,
  // b_down).
  m.def(
      "rms_norm_tiled_mlp(Tensor x, Tensor norm_weight, float norm_eps, Tensor w_gate, Tensor? w_up, Tensor w_down, "
      "Tensor? b_gate=None, Tensor? b_up=None, Tensor? b_down=None, str activation=\"silu\", SymInt num_shards=0) "
      "-> Tensor");
  m.def(
      "rms_norm_tiled_mlp_backward(Tensor grad_out, Tensor x, Tensor norm_weight, float norm_eps, Tensor w_gate, "
      "Tensor? w_up, Tensor w_down, Tensor? b_gate, Tensor? b_up, Tensor? b_down, str activation, SymInt num_shards, "
      "bool[8] output_mask) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  // tiled_mlp's automatic shard count for these shapes; takes no tensor, so one kernel serves every backend.
  m.def("tiled_mlp_num_shards(int tokens, int intermediate, bool gated, ScalarType dtype) -> int",
        &torch_offload::tiled_mlp_num_shards_kernel);
}

TORCH_LIBRARY_IMPL(offload, CPU, m) {
  m.impl("tiled_mlp", &torch_offload::tiled_mlp_cpu);
  m.impl("tiled_mlp_backward", &torch_offload::tiled_mlp_backward_cpu);
  m.impl("rms_norm_tiled_mlp", &torch_offload::rms_norm_tiled_mlp_cpu);
  m.impl("rms_norm_tiled_mlp_backward", &torch_offload::rms_norm_tiled_mlp_backward_cpu);
}

#ifdef TORCH_OFFLOAD_WITH_CUDA
TORCH_LIBRARY_IMPL(offload, CUDA, m) {
  m.impl("tiled_mlp", &torch_offload::tiled_mlp_cuda);
  m.impl("tiled_mlp_backward", &torch_offload::tiled_mlp_backward_cuda);
  m.impl("rms_norm_tiled_mlp", &torch_offload::rms_norm_tiled_mlp_cuda);
  m.impl("rms_norm_tiled_mlp_backward", &torch_offload::rms_norm_tiled_mlp_backward_cuda);
}
#endif

// The results live on x's device, which FakeTensor derives by itself.
TORCH_LIBRARY_IMPL(offload, Meta, m) {
  m.impl("tiled_mlp", &torch_offload::tiled_mlp_meta);
  m.impl("tiled_mlp_backward", &torch_offload::tiled_mlp_backward_meta);
  m.impl("rms_norm_tiled_mlp", &torch_offload::rms_norm_tiled_mlp_meta);
  m.impl("rms_norm_tiled_mlp_backward", &torch_offload::rms_norm_tiled_mlp_backward_meta);
}

namespace torch_offload {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

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

// Under torch.autocast, tiled_mlp runs in the autocast dtype, as the linear layers it replaces would.
template <c10::DeviceType kDevice>
at::Tensor tiled_mlp_autocast(const at::Tensor& x, const at::Tensor& w_gate, const std::optional<at::Tensor>& w_up,
                              const at::Tensor& w_down, const std::optional<at::Tensor>& b_gate,
                              const std::optional<at::Tensor>& b_up, const std::optional<at::Tensor>& b_down,
                              c10::string_view activation, c10::SymInt num_shards) {
  const BelowAutocast<kDevice> cast;
  return tiled_mlp(cast(x), cast(w_gate), cast(w_up), cast(w_down), cast(b_gate), cast(b_up), cast(b_down), activation,
                   std::move(num_shards));
}

const SharedOpRules tiled_mlp_rules({"tiled_mlp"}, UnderAutocast::kOwnKernel);
// rms_norm_tiled_mlp runs in its inputs' dtypes under autocast, as rms_norm does (where rms_norm then
// tiled_mlp would run the MLP in the autocast dtype): its norm is not a matrix product to cast.
const SharedOpRules tiled_mlp_rules_without_autocast({"rms_norm_tiled_mlp", "tiled_mlp_backward",
                                                      "rms_norm_tiled_mlp_backward"},
                                                     UnderAutocast::kOff);

}  // namespace
}  // namespace torch_offload

TORCH_LIBRARY_IMPL(offload, Autograd, m) {
  m.impl("tiled_mlp", &torch_offload::tiled_mlp_autograd);
  // Computing gradients of gradients is not supported: an error if backward reaches it.
  m.impl("tiled_mlp_backward", torch::autograd::autogradNotImplementedFallback());
  m.impl("rms_norm_tiled_mlp", &torch_offload::rms_norm_tiled_mlp_autograd);
  m.impl("rms_norm_tiled_mlp_backward", torch::autograd::autogradNotImplementedFallback());
}

TORCH_LIBRARY_IMPL(offload, AutocastCPU, m) {
  m.impl("tiled_mlp", &torch_offload::tiled_mlp_autocast<c10::DeviceType::CPU>);
}

TORCH_LIBRARY_IMPL(offload, AutocastCUDA, m) {
  m.impl("tiled_mlp", &torch_offload::tiled_mlp_autocast<c10::DeviceType::CUDA>);
}
