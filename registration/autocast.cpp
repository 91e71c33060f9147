// Under torch.autocast, tiled_mlp runs in the autocast dtype, as the linear layers it
// replaces would: every floating tensor is cast to it (the weights through autocast's
// cast cache), then the op runs below autocast. The backward ops run without autocast
// (the end of this file): the tensors forward saved are already cast.
#include <ATen/autocast_mode.h>
#include <torch/library.h>

#include "torch_offload/torch_offload.h"

namespace torch_offload {
namespace {

template <c10::DeviceType kDevice>
at::Tensor tiled_mlp_autocast(const at::Tensor& x, const at::Tensor& w_gate, const std::optional<at::Tensor>& w_up,
                              const at::Tensor& w_down, const std::optional<at::Tensor>& b_gate,
                              const std::optional<at::Tensor>& b_up, const std::optional<at::Tensor>& b_down,
                              c10::string_view activation, c10::SymInt num_shards) {
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(
      at::autocast::get_autocast_dispatch_key_from_device_type(kDevice));
  const at::ScalarType dtype = at::autocast::get_autocast_dtype(kDevice);
  const auto cast = [&](const auto& t) { return at::autocast::cached_cast(dtype, t, kDevice); };
  return tiled_mlp(cast(x), cast(w_gate), cast(w_up), cast(w_down), cast(b_gate), cast(b_up), cast(b_down), activation,
                   std::move(num_shards));
}

}  // namespace
}  // namespace torch_offload

TORCH_LIBRARY_IMPL(offload, AutocastCPU, m) {
  m.impl("tiled_mlp", &torch_offload::tiled_mlp_autocast<c10::DeviceType::CPU>);
}

TORCH_LIBRARY_IMPL(offload, AutocastCUDA, m) {
  m.impl("tiled_mlp", &torch_offload::tiled_mlp_autocast<c10::DeviceType::CUDA>);
}

namespace torch_offload {
namespace {

// linear_cross_entropy runs its GEMMs in the autocast dtype, as the linear layer it
// replaces would; its loss is float32, as F.cross_entropy's under autocast (the op
// itself already returns float32 for the bf16/fp16 it runs in there).
template <c10::DeviceType kDevice>
at::Tensor linear_cross_entropy_autocast(const at::Tensor& hidden, const at::Tensor& weight,
                                         const std::optional<at::Tensor>& bias, const at::Tensor& target,
                                         int64_t ignore_index, double label_smoothing, double softcap, double z_loss,
                                         c10::string_view reduction, c10::SymInt tile_tokens, c10::SymInt tile_vocab,
                                         double filter_eps, std::optional<bool> gradients_in_forward) {
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(
      at::autocast::get_autocast_dispatch_key_from_device_type(kDevice));
  const at::ScalarType dtype = at::autocast::get_autocast_dtype(kDevice);
  const auto cast = [&](const auto& t) { return at::autocast::cached_cast(dtype, t, kDevice); };
  at::Tensor loss = linear_cross_entropy(cast(hidden), cast(weight), cast(bias), target, ignore_index, label_smoothing,
                                         softcap, z_loss, reduction, std::move(tile_tokens), std::move(tile_vocab),
                                         filter_eps, gradients_in_forward);
  return loss.scalar_type() == at::kDouble ? loss : loss.to(at::kFloat);  // autocast leaves float64 alone
}

// token_logprobs likewise: its GEMMs in the autocast dtype, its outputs float32.
template <c10::DeviceType kDevice>
std::tuple<at::Tensor, at::Tensor> token_logprobs_autocast(const at::Tensor& hidden, const at::Tensor& weight,
                                                           const at::Tensor& ids, const std::optional<at::Tensor>& bias,
                                                           double temperature, bool entropy, double softcap,
                                                           double logit_scale, int64_t ignore_index) {
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(
      at::autocast::get_autocast_dispatch_key_from_device_type(kDevice));
  const at::ScalarType dtype = at::autocast::get_autocast_dtype(kDevice);
  const auto cast = [&](const auto& t) { return at::autocast::cached_cast(dtype, t, kDevice); };
  return token_logprobs(cast(hidden), cast(weight), ids, cast(bias), temperature, entropy, softcap, logit_scale,
                        ignore_index);
}

// token_logprob_summaries likewise (TRL asks for them beside token_logprobs, under the same autocast).
template <c10::DeviceType kDevice>
std::tuple<at::Tensor, at::Tensor, at::Tensor> token_logprob_summaries_autocast(
    const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& ids, const std::optional<at::Tensor>& bias,
    double temperature, double softcap, double logit_scale, int64_t ignore_index) {
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(
      at::autocast::get_autocast_dispatch_key_from_device_type(kDevice));
  const at::ScalarType dtype = at::autocast::get_autocast_dtype(kDevice);
  const auto cast = [&](const auto& t) { return at::autocast::cached_cast(dtype, t, kDevice); };
  return token_logprob_summaries(cast(hidden), cast(weight), ids, cast(bias), temperature, softcap, logit_scale,
                                 ignore_index);
}

}  // namespace
}  // namespace torch_offload

TORCH_LIBRARY_IMPL(offload, AutocastCPU, m) {
  m.impl("linear_cross_entropy", &torch_offload::linear_cross_entropy_autocast<c10::DeviceType::CPU>);
  m.impl("token_logprobs", &torch_offload::token_logprobs_autocast<c10::DeviceType::CPU>);
  m.impl("token_logprob_summaries", &torch_offload::token_logprob_summaries_autocast<c10::DeviceType::CPU>);
}

TORCH_LIBRARY_IMPL(offload, AutocastCUDA, m) {
  m.impl("linear_cross_entropy", &torch_offload::linear_cross_entropy_autocast<c10::DeviceType::CUDA>);
  m.impl("token_logprobs", &torch_offload::token_logprobs_autocast<c10::DeviceType::CUDA>);
  m.impl("token_logprob_summaries", &torch_offload::token_logprob_summaries_autocast<c10::DeviceType::CUDA>);
}

namespace torch_offload {
namespace {

// attention_block runs in the autocast dtype, as the linear layers and the attention
// it replaces would (the rotary tables included).
template <c10::DeviceType kDevice>
at::Tensor attention_block_autocast(const at::Tensor& x, const at::Tensor& w_q, const at::Tensor& w_k,
                                    const at::Tensor& w_v, const at::Tensor& w_o, const at::Tensor& cos,
                                    const at::Tensor& sin, const std::optional<at::Tensor>& b_q,
                                    const std::optional<at::Tensor>& b_k, const std::optional<at::Tensor>& b_v,
                                    const std::optional<at::Tensor>& b_o, std::optional<double> scale,
                                    const std::optional<at::Tensor>& segment_ids,
                                    std::optional<c10::string_view> group_name, const std::optional<at::Tensor>& q_norm,
                                    const std::optional<at::Tensor>& k_norm, double norm_eps) {
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(
      at::autocast::get_autocast_dispatch_key_from_device_type(kDevice));
  const at::ScalarType dtype = at::autocast::get_autocast_dtype(kDevice);
  const auto cast = [&](const auto& t) { return at::autocast::cached_cast(dtype, t, kDevice); };
  return attention_block(cast(x), cast(w_q), cast(w_k), cast(w_v), cast(w_o), cast(cos), cast(sin), cast(b_q),
                         cast(b_k), cast(b_v), cast(b_o), scale, segment_ids, group_name, cast(q_norm), cast(k_norm),
                         norm_eps);
}

// segment_attention runs in the autocast dtype, as the SDPA it stands for does.
template <c10::DeviceType kDevice>
at::Tensor segment_attention_autocast(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                      const at::Tensor& segment_ids, std::optional<double> scale,
                                      std::optional<double> softcap, const std::optional<at::Tensor>& sinks,
                                      std::optional<int64_t> window) {
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(
      at::autocast::get_autocast_dispatch_key_from_device_type(kDevice));
  const at::ScalarType dtype = at::autocast::get_autocast_dtype(kDevice);
  const auto cast = [&](const at::Tensor& t) { return at::autocast::cached_cast(dtype, t, kDevice); };
  // The sinks keep their dtype: one logit per head, added in the scores' float32.
  return segment_attention(cast(q), cast(k), cast(v), segment_ids, scale, softcap, sinks, window);
}

}  // namespace
}  // namespace torch_offload

TORCH_LIBRARY_IMPL(offload, AutocastCPU, m) {
  m.impl("attention_block", &torch_offload::attention_block_autocast<c10::DeviceType::CPU>);
  m.impl("segment_attention", &torch_offload::segment_attention_autocast<c10::DeviceType::CPU>);
}

TORCH_LIBRARY_IMPL(offload, AutocastCUDA, m) {
  m.impl("attention_block", &torch_offload::attention_block_autocast<c10::DeviceType::CUDA>);
  m.impl("segment_attention", &torch_offload::segment_attention_autocast<c10::DeviceType::CUDA>);
}

namespace torch_offload {
namespace {

// rms_norm_tiled_mlp runs in its inputs' dtypes under autocast, as rms_norm does (where rms_norm then
// tiled_mlp would run the MLP in the autocast dtype): its norm is not a matrix product to cast.
// The backward ops run in the dtypes their forward chose. Gradients asked for inside an
// autocast region (`loss.backward()` under `with torch.autocast(...)`) run them with autocast
// on, which recast the formulas' own operations: CUDA's autocast sums in float32 and CPU's
// multiplies matrices in bf16, and attention_block's backward then met mixed dtypes.
void without_autocast(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  op.callBoxed(stack);
}

void register_ops_without_autocast(torch::Library& m) {
  for (const char* op :
       {"rms_norm_tiled_mlp", "tiled_mlp_backward", "rms_norm_tiled_mlp_backward", "linear_cross_entropy_backward",
        "token_logprobs_backward", "rms_norm_backward", "attention_block_backward", "segment_attention_backward"}) {
    m.impl(op, torch::CppFunction::makeFromBoxedFunction<&without_autocast>());
  }
}

}  // namespace
}  // namespace torch_offload

TORCH_LIBRARY_IMPL(offload, AutocastCPU, m) {
  torch_offload::register_ops_without_autocast(m);
}

TORCH_LIBRARY_IMPL(offload, AutocastCUDA, m) {
  torch_offload::register_ops_without_autocast(m);
}
