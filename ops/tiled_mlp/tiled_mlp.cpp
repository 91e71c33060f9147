// The sharding loop of tiled_mlp, the same on every device: GEMMs through ATen
// into slices of the result, the elementwise steps by the device's fused kernels.
#include "ops/tiled_mlp/tiled_mlp.h"

#include <algorithm>
#include <string>

#include <ATen/OpMathType.h>
#include <ATen/Version.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/zeros.h>
#include <c10/core/SymBool.h>
#include <c10/util/Exception.h>

#include "ops/common/checks.h"
#include "ops/common/gemm.h"
#include "ops/rms_norm/rms_norm.h"
#include "ops/tiled_mlp/tiled_mlp_cpu_kernel.h"

namespace torch_offload {

// The automatic shard count (num_shards <= 0). A shard's [tokens, I] buffers (gate,
// up and the hidden gradient in backward; two without up) stay within
// kShardBytes, so the MLP's memory no longer grows with the sequence, and a shard
// holds between kMinShardTokens (fewer rows make GEMMs lose efficiency) and
// kMaxShardTokens tokens (~32K per shard is where the field measured tiling at its
// fastest, 3x faster than ceil(tokens / h) shards). The count depends only on the
// shapes and the dtype, so every rank with the same shapes agrees on it.
constexpr int64_t kShardBytes = int64_t{128} << 20;
constexpr int64_t kMinShardTokens = 2048;
constexpr int64_t kMaxShardTokens = 32768;
// A shard's norm in this many chunks of rows: a launch count per shard that does not grow, with float32
// temporaries (a few [rows / 4, h] at once) a fraction of the shard's [rows, I] buffers.
constexpr int64_t kShardNormChunks = 4;

int64_t tiled_mlp_num_shards_kernel(int64_t tokens, int64_t intermediate, bool gated, c10::ScalarType dtype) {
  TORCH_CHECK(tokens >= 0 && intermediate >= 0, "tiled_mlp_num_shards: tokens is ", tokens, " and intermediate is ",
              intermediate, "; expected sizes >= 0");
  const int64_t bytes_per_token = std::max<int64_t>(1, (gated ? 3 : 2) * intermediate * c10::elementSize(dtype));
  const int64_t shard_tokens = std::clamp(kShardBytes / bytes_per_token, kMinShardTokens, kMaxShardTokens);
  return std::max<int64_t>(1, (tokens + shard_tokens - 1) / shard_tokens);
}

namespace {

// Rows per shard: the tokens split evenly over the shards (one row each when
// there are more shards than tokens).
int64_t shard_rows(int64_t tokens, int64_t intermediate, bool gated, c10::ScalarType dtype, int64_t num_shards) {
  const int64_t shards = num_shards > 0 ? num_shards : tiled_mlp_num_shards_kernel(tokens, intermediate, gated, dtype);
  return std::max<int64_t>(1, (tokens + shards - 1) / shards);
}

Activation parse_activation(std::string_view name, const char* op) {
  if (name == "silu") {
    return Activation::kSilu;
  }
  if (name == "gelu") {
    return Activation::kGelu;
  }
  if (name == "gelu_tanh") {
    return Activation::kGeluTanh;
  }
  if (name == "relu") {
    return Activation::kRelu;
  }
  TORCH_CHECK(false, op, ": activation is '", name, "'; expected one of silu, gelu, gelu_tanh, relu");
}

// `t`'s device and dtype are x's, and its shape is `want` (`what` names it in the message).
void check_like_x(const char* op, const char* arg, const at::Tensor& t, const at::Tensor& x, c10::SymIntArrayRef want,
                  const char* what) {
  check_defined(t, op, arg);
  TORCH_CHECK(t.device() == x.device(), op, ": ", arg, " is on ", t.device(), " but x is on ", x.device(),
              "; every tensor must be on x's device");
  TORCH_CHECK(t.scalar_type() == x.scalar_type(), op, ": ", arg, " has dtype ", t.scalar_type(), " but x has ",
              x.scalar_type(), "; every tensor must have x's dtype");
  TORCH_CHECK(t.dim() == static_cast<int64_t>(want.size()), op, ": ", arg, " has shape ", t.sym_sizes(), "; expected ",
              what, " = ", want);
  for (size_t i = 0; i < want.size(); ++i) {
    TORCH_SYM_CHECK(t.sym_size(static_cast<int64_t>(i)).sym_eq(want[i]), op, ": ", arg, " has shape ", t.sym_sizes(),
                    "; expected ", what, " = ", want);
  }
}

// Every tensor of the MLP against x [..., h] and w_gate [I, h].
void check_mlp(const char* op, const at::Tensor& x, const at::Tensor& w_gate, const at::Tensor& w_up,
               const at::Tensor& w_down, const at::Tensor& b_gate, const at::Tensor& b_up, const at::Tensor& b_down) {
  check_defined(x, op, "x");
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble || dtype == at::kBFloat16 || dtype == at::kHalf, op,
              ": x has dtype ", dtype, "; expected float32, float64, bfloat16 or float16");
  TORCH_CHECK(x.dim() >= 1, op, ": x is a 0-d tensor; expected [..., h]");
  check_defined(w_gate, op, "w_gate");
  TORCH_CHECK(w_gate.dim() == 2, op, ": w_gate has shape ", w_gate.sym_sizes(), "; expected [I, h]");
  const c10::SymInt h = x.sym_size(-1);
  const c10::SymInt intermediate = w_gate.sym_size(0);
  check_like_x(op, "w_gate", w_gate, x, {intermediate, h}, "[I, h]");
  if (w_up.defined()) {
    check_like_x(op, "w_up", w_up, x, {intermediate, h}, "[I, h]");
  }
  check_like_x(op, "w_down", w_down, x, {h, intermediate}, "[h, I]");
  if (b_gate.defined()) {
    check_like_x(op, "b_gate", b_gate, x, {intermediate}, "[I]");
  }
  if (b_up.defined()) {
    TORCH_CHECK(w_up.defined(), op, ": b_up is given but w_up is not; b_up is the bias of the up projection");
    check_like_x(op, "b_up", b_up, x, {intermediate}, "[I]");
  }
  if (b_down.defined()) {
    check_like_x(op, "b_down", b_down, x, {h}, "[h]");
  }
}

}  // namespace

const HiddenKernels& cpu_hidden_kernels() {
#ifdef TORCH_OFFLOAD_CPU_AVX_KERNELS
  static const HiddenKernels& kernels = []() -> const HiddenKernels& {
    const std::string capability = at::get_cpu_capability();
    if (capability == "AVX512") {
      return AVX512::hidden_kernels_cpu;
    }
    if (capability == "AVX2") {
      return AVX2::hidden_kernels_cpu;
    }
    return DEFAULT::hidden_kernels_cpu;
  }();
  return kernels;
#else
  return DEFAULT::hidden_kernels_cpu;
#endif
}

namespace {

void check_norm(const char* op, const ShardNorm& norm, const at::Tensor& x) {
  if (norm.weight.defined()) {
    check_like_x(op, "norm_weight", norm.weight, x, {x.sym_size(-1)}, "[h], x's last dimension");
    check_rms_norm_eps(op, "norm_eps", norm.eps);
  }
}

// The shard's MLP input: x's rows, or their RMSNorm written to the top rows of `normed_buffer`.
at::Tensor mlp_input(const at::Tensor& x_rows, const ShardNorm& norm, const at::Tensor& normed_buffer) {
  if (!norm.weight.defined()) {
    return x_rows;
  }
  const at::Tensor normed = normed_buffer.narrow(0, 0, x_rows.size(0));
  rms_norm_rows_into(normed, x_rows, norm.weight, norm.eps, kShardNormChunks);
  return normed;
}

}  // namespace

at::Tensor tiled_mlp_impl(const char* op, const HiddenKernels& kernels, const at::Tensor& x, const ShardNorm& norm,
                          const at::Tensor& w_gate, const std::optional<at::Tensor>& w_up_opt, const at::Tensor& w_down,
                          const std::optional<at::Tensor>& b_gate_opt, const std::optional<at::Tensor>& b_up_opt,
                          const std::optional<at::Tensor>& b_down_opt, std::string_view activation,
                          const c10::SymInt& num_shards) {
  const at::Tensor w_up = value_or_undefined(w_up_opt);
  const at::Tensor b_gate = value_or_undefined(b_gate_opt);
  const at::Tensor b_up = value_or_undefined(b_up_opt);
  const at::Tensor b_down = value_or_undefined(b_down_opt);
  const Activation act = parse_activation(activation, op);
  check_mlp(op, x, w_gate, w_up, w_down, b_gate, b_up, b_down);
  check_norm(op, norm, x);

  const int64_t h = x.size(-1);
  const int64_t intermediate = w_gate.size(0);
  const at::Tensor tokens_x = token_rows(x);
  const int64_t tokens = tokens_x.size(0);
  const at::Tensor out = at::empty({tokens, h}, x.options());
  if (tokens == 0) {
    return out.view(x.sizes());
  }
  const int64_t rows_per_shard =
      shard_rows(tokens, intermediate, w_up.defined(), x.scalar_type(), num_shards.expect_int());
  // One set of shard buffers serves every shard; the last shard uses their top rows.
  const at::Tensor gate_buffer = at::empty({rows_per_shard, intermediate}, x.options());
  const at::Tensor up_buffer = w_up.defined() ? at::empty_like(gate_buffer) : at::Tensor();
  const at::Tensor normed_buffer = norm.weight.defined() ? at::empty({rows_per_shard, h}, x.options()) : at::Tensor();
  for (int64_t start = 0; start < tokens; start += rows_per_shard) {
    const int64_t rows = std::min(rows_per_shard, tokens - start);
    const at::Tensor x_shard = mlp_input(tokens_x.narrow(0, start, rows), norm, normed_buffer);
    const at::Tensor gate = gate_buffer.narrow(0, 0, rows);
    const at::Tensor up = w_up.defined() ? up_buffer.narrow(0, 0, rows) : at::Tensor();
    linear_into(gate, x_shard, w_gate, b_gate);
    if (up.defined()) {
      linear_into(up, x_shard, w_up, b_up);
    }
    kernels.forward(act, gate, up);  // gate now holds the hidden activation
    linear_into(out.narrow(0, start, rows), gate, w_down, b_down);
  }
  return out.view(x.sizes());
}

MlpGradientArray tiled_mlp_backward_impl(const char* op, const HiddenKernels& kernels, const at::Tensor& grad_out,
                                         const at::Tensor& x, const ShardNorm& norm, const at::Tensor& w_gate,
                                         const std::optional<at::Tensor>& w_up_opt, const at::Tensor& w_down,
                                         const std::optional<at::Tensor>& b_gate_opt,
                                         const std::optional<at::Tensor>& b_up_opt,
                                         const std::optional<at::Tensor>& b_down_opt, std::string_view activation,
                                         const c10::SymInt& num_shards, std::array<bool, 8> output_mask) {
  const at::Tensor w_up = value_or_undefined(w_up_opt);
  const at::Tensor b_gate = value_or_undefined(b_gate_opt);
  const at::Tensor b_up = value_or_undefined(b_up_opt);
  const at::Tensor b_down = value_or_undefined(b_down_opt);
  const Activation act = parse_activation(activation, op);
  check_mlp(op, x, w_gate, w_up, w_down, b_gate, b_up, b_down);
  check_norm(op, norm, x);
  check_like_x(op, "grad_out", grad_out, x, x.sym_sizes(), "x's shape");

  const int64_t h = x.size(-1);
  const int64_t intermediate = w_gate.size(0);
  const at::Tensor tokens_x = token_rows(x);
  const at::Tensor tokens_grad = token_rows(grad_out);
  const int64_t tokens = tokens_x.size(0);
  const bool gated = w_up.defined();
  const bool normed = norm.weight.defined();

  // What is asked for, and present. Nothing else is computed.
  const bool want_x = output_mask[0];
  const bool want_norm_weight = output_mask[1] && normed;
  const bool want_w_gate = output_mask[2];
  const bool want_w_up = output_mask[3] && gated;
  const bool want_w_down = output_mask[4];
  const bool want_b_gate = output_mask[5] && b_gate.defined();
  const bool want_b_up = output_mask[6] && b_up.defined();
  const bool want_b_down = output_mask[7] && b_down.defined();
  // The gradient of the MLP's input: x's, or the norm's output's on the way to x's and the norm weight's.
  const bool want_input = want_x || want_norm_weight;
  // Every gradient but w_down's and b_down's goes through d_gate / d_up.
  const bool want_inner = want_input || want_w_gate || want_w_up || want_b_gate || want_b_up;

  // Weight and bias gradients of bf16/fp16 MLPs add up in float32 and are rounded once.
  const at::ScalarType acc_type = at::toOpMathType(x.scalar_type());
  const auto acc_options = x.options().dtype(acc_type);
  at::Tensor grad_x = want_x ? at::empty({tokens, h}, x.options()) : at::Tensor();
  at::Tensor grad_norm_weight = want_norm_weight ? at::zeros({h}, acc_options) : at::Tensor();
  at::Tensor grad_w_gate = want_w_gate ? at::zeros({intermediate, h}, acc_options) : at::Tensor();
  at::Tensor grad_w_up = want_w_up ? at::zeros({intermediate, h}, acc_options) : at::Tensor();
  at::Tensor grad_w_down = want_w_down ? at::zeros({h, intermediate}, acc_options) : at::Tensor();
  at::Tensor grad_b_gate = want_b_gate ? at::zeros({intermediate}, acc_options) : at::Tensor();
  at::Tensor grad_b_up = want_b_up ? at::zeros({intermediate}, acc_options) : at::Tensor();
  // b_down's gradient needs no recompute: it is grad_out summed over the tokens.
  at::Tensor grad_b_down = want_b_down ? at::sum(tokens_grad, {0}, false, acc_type) : at::Tensor();

  if (tokens > 0 && (want_inner || want_w_down)) {
    const int64_t rows_per_shard = shard_rows(tokens, intermediate, gated, x.scalar_type(), num_shards.expect_int());
    const at::Tensor gate_buffer = at::empty({rows_per_shard, intermediate}, x.options());
    const at::Tensor up_buffer = gated ? at::empty_like(gate_buffer) : at::Tensor();
    const at::Tensor d_hidden_buffer = want_inner ? at::empty_like(gate_buffer) : at::Tensor();
    // With a norm: the shard's normalized rows, and their gradient before the norm's backward takes it to x. That
    // gradient is computed after the hidden activation's last use, so it takes d_hidden's memory where it fits.
    const at::Tensor normed_buffer = normed ? at::empty({rows_per_shard, h}, x.options()) : at::Tensor();
    at::Tensor d_normed_buffer;
    if (normed && want_input) {
      d_normed_buffer = h <= intermediate
                            ? d_hidden_buffer.view(-1).narrow(0, 0, rows_per_shard * h).view({rows_per_shard, h})
                            : at::empty_like(normed_buffer);
    }
    for (int64_t start = 0; start < tokens; start += rows_per_shard) {
      const int64_t rows = std::min(rows_per_shard, tokens - start);
      const at::Tensor x_rows = tokens_x.narrow(0, start, rows);
      const at::Tensor x_shard = mlp_input(x_rows, norm, normed_buffer);
      const at::Tensor grad_shard = tokens_grad.narrow(0, start, rows);
      // Recompute the shard's gate and up projections.
      const at::Tensor gate = gate_buffer.narrow(0, 0, rows);
      const at::Tensor up = gated ? up_buffer.narrow(0, 0, rows) : at::Tensor();
      linear_into(gate, x_shard, w_gate, b_gate);
      if (gated) {
        linear_into(up, x_shard, w_up, b_up);
      }
      at::Tensor hidden;
      if (want_inner) {
        hidden = d_hidden_buffer.narrow(0, 0, rows);
        at::mm_out(hidden, grad_shard, w_down);
        kernels.backward(act, gate, up, hidden);  // gate, up <- d_gate, d_up; hidden <- act(gate) * up
      } else {
        kernels.forward(act, gate, up);
        hidden = gate;
      }
      if (want_w_down) {
        accumulate_mm(grad_w_down, grad_shard.t(), hidden);
      }
      // Both weight gradients multiply by x_shard: where accumulate_mm converts operands
      // to float32, convert it once.
      const bool convert_x = want_w_gate && want_w_up && acc_type != x.scalar_type() && !x.is_cuda();
      const at::Tensor x_operand = convert_x ? x_shard.to(acc_type) : x_shard;
      if (want_w_gate) {
        accumulate_mm(grad_w_gate, gate.t(), x_operand);
      }
      if (want_w_up) {
        accumulate_mm(grad_w_up, up.t(), x_operand);
      }
      if (want_b_gate) {
        grad_b_gate.add_(at::sum(gate, {0}, false, acc_type));
      }
      if (want_b_up) {
        grad_b_up.add_(at::sum(up, {0}, false, acc_type));
      }
      if (want_input) {
        const at::Tensor grad_x_shard = want_x ? grad_x.narrow(0, start, rows) : at::Tensor();
        at::Tensor grad_input = normed ? d_normed_buffer.narrow(0, 0, rows) : grad_x_shard;
        at::mm_out(grad_input, gate, w_gate);
        if (gated) {
          grad_input.addmm_(up, w_up);
        }
        if (normed) {
          rms_norm_backward_rows(grad_input, x_rows, norm.weight, norm.eps, grad_x_shard, grad_norm_weight,
                                 kShardNormChunks);
        }
      }
    }
  }

  const auto to_dtype = [&](const at::Tensor& t) { return t.defined() ? t.to(x.scalar_type()) : t; };
  return {want_x ? grad_x.view(x.sizes()) : grad_x,
          to_dtype(grad_norm_weight),
          to_dtype(grad_w_gate),
          to_dtype(grad_w_up),
          to_dtype(grad_w_down),
          to_dtype(grad_b_gate),
          to_dtype(grad_b_up),
          to_dtype(grad_b_down)};
}

std::array<bool, 8> with_norm_mask(std::array<bool, 7> mlp_mask) {
  return {mlp_mask[0], false, mlp_mask[1], mlp_mask[2], mlp_mask[3], mlp_mask[4], mlp_mask[5], mlp_mask[6]};
}

TiledMlpGradients without_norm_gradient(const MlpGradientArray& g) {
  return {g[0], g[2], g[3], g[4], g[5], g[6], g[7]};
}

at::Tensor tiled_mlp_cpu(const at::Tensor& x, const at::Tensor& w_gate, const std::optional<at::Tensor>& w_up,
                         const at::Tensor& w_down, const std::optional<at::Tensor>& b_gate,
                         const std::optional<at::Tensor>& b_up, const std::optional<at::Tensor>& b_down,
                         c10::string_view activation, c10::SymInt num_shards) {
  return tiled_mlp_impl("tiled_mlp", cpu_hidden_kernels(), x, {}, w_gate, w_up, w_down, b_gate, b_up, b_down,
                        activation, num_shards);
}

TiledMlpGradients tiled_mlp_backward_cpu(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& w_gate,
                                         const std::optional<at::Tensor>& w_up, const at::Tensor& w_down,
                                         const std::optional<at::Tensor>& b_gate, const std::optional<at::Tensor>& b_up,
                                         const std::optional<at::Tensor>& b_down, c10::string_view activation,
                                         c10::SymInt num_shards, std::array<bool, 7> output_mask) {
  return without_norm_gradient(tiled_mlp_backward_impl("tiled_mlp_backward", cpu_hidden_kernels(), grad_out, x, {},
                                                       w_gate, w_up, w_down, b_gate, b_up, b_down, activation,
                                                       num_shards, with_norm_mask(output_mask)));
}

// Meta: the same checks (on symbolic shapes), then results shaped like the real ones.
at::Tensor tiled_mlp_meta_impl(const char* op, const at::Tensor& x, const ShardNorm& norm, const at::Tensor& w_gate,
                               const std::optional<at::Tensor>& w_up, const at::Tensor& w_down,
                               const std::optional<at::Tensor>& b_gate, const std::optional<at::Tensor>& b_up,
                               const std::optional<at::Tensor>& b_down, std::string_view activation) {
  parse_activation(activation, op);
  check_mlp(op, x, w_gate, value_or_undefined(w_up), w_down, value_or_undefined(b_gate), value_or_undefined(b_up),
            value_or_undefined(b_down));
  check_norm(op, norm, x);
  return at::empty_symint(x.sym_sizes(), x.options());
}

MlpGradientArray tiled_mlp_backward_meta_impl(const char* op, const at::Tensor& grad_out, const at::Tensor& x,
                                              const ShardNorm& norm, const at::Tensor& w_gate,
                                              const std::optional<at::Tensor>& w_up, const at::Tensor& w_down,
                                              const std::optional<at::Tensor>& b_gate,
                                              const std::optional<at::Tensor>& b_up,
                                              const std::optional<at::Tensor>& b_down, std::string_view activation,
                                              std::array<bool, 8> output_mask) {
  tiled_mlp_meta_impl(op, x, norm, w_gate, w_up, w_down, b_gate, b_up, b_down, activation);
  check_like_x(op, "grad_out", grad_out, x, x.sym_sizes(), "x's shape");
  const MlpGradientArray inputs{x,
                                norm.weight,
                                w_gate,
                                value_or_undefined(w_up),
                                w_down,
                                value_or_undefined(b_gate),
                                value_or_undefined(b_up),
                                value_or_undefined(b_down)};
  MlpGradientArray grads;
  for (size_t i = 0; i < grads.size(); ++i) {
    if (output_mask[i] && inputs[i].defined()) {
      grads[i] = at::empty_symint(inputs[i].sym_sizes(), inputs[i].options());
    }
  }
  return grads;
}

at::Tensor tiled_mlp_meta(const at::Tensor& x, const at::Tensor& w_gate, const std::optional<at::Tensor>& w_up,
                          const at::Tensor& w_down, const std::optional<at::Tensor>& b_gate,
                          const std::optional<at::Tensor>& b_up, const std::optional<at::Tensor>& b_down,
                          c10::string_view activation, c10::SymInt /*num_shards*/) {
  return tiled_mlp_meta_impl("tiled_mlp", x, {}, w_gate, w_up, w_down, b_gate, b_up, b_down, activation);
}

TiledMlpGradients tiled_mlp_backward_meta(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& w_gate,
                                          const std::optional<at::Tensor>& w_up, const at::Tensor& w_down,
                                          const std::optional<at::Tensor>& b_gate,
                                          const std::optional<at::Tensor>& b_up,
                                          const std::optional<at::Tensor>& b_down, c10::string_view activation,
                                          c10::SymInt /*num_shards*/, std::array<bool, 7> output_mask) {
  return without_norm_gradient(tiled_mlp_backward_meta_impl("tiled_mlp_backward", grad_out, x, {}, w_gate, w_up, w_down,
                                                            b_gate, b_up, b_down, activation,
                                                            with_norm_mask(output_mask)));
}

}  // namespace torch_offload
