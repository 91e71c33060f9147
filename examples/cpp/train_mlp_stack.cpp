// Trains a small stack of gated MLP blocks from C++, no Python in the process:
// each block is torch_offload::tiled_mlp, and each block's input waits on the host
// (offload_pack / offload_unpack) between forward and backward. Prints the loss
// going down and fails if it does not.
#include <cmath>
#include <cstdio>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>

#include <torch_offload/torch_offload.h>

int main() {
  at::manual_seed(0);
  const int64_t tokens = 256, hidden = 32, intermediate = 96, blocks = 3, steps = 30;
  const double learning_rate = 0.05;

  std::vector<at::Tensor> parameters;
  auto weight = [&](int64_t rows, int64_t cols) {
    parameters.push_back((at::randn({rows, cols}) / std::sqrt(static_cast<double>(cols))).requires_grad_(true));
    return parameters.back();
  };
  struct Block {
    at::Tensor gate, up, down;
  };
  std::vector<Block> stack;
  for (int64_t i = 0; i < blocks; ++i) {
    at::Tensor gate = weight(intermediate, hidden), up = weight(intermediate, hidden);
    stack.push_back(Block{gate, up, weight(hidden, intermediate)});
  }

  const at::Tensor x = at::randn({tokens, hidden});
  const at::Tensor target = at::sin(x.matmul(at::randn({hidden, hidden}))) * 0.5;
  double first = 0, last = 0;
  for (int64_t step = 0; step < steps; ++step) {
    at::Tensor h = x;
    for (const Block& block : stack) {
      // The block input goes to the host and comes back: differentiable both ways.
      const at::Tensor saved = torch_offload::offload_unpack(torch_offload::offload_pack(h), h.device());
      h = saved + torch_offload::tiled_mlp(saved, block.gate, block.up, block.down, std::nullopt, std::nullopt,
                                           std::nullopt, "silu", /*num_shards=*/4);
    }
    const at::Tensor loss = (h - target).pow(2).mean();
    const auto grads = torch::autograd::grad({loss}, parameters);
    {
      at::NoGradGuard no_grad;
      for (size_t i = 0; i < parameters.size(); ++i) {
        parameters[i].sub_(grads[i] * learning_rate);
      }
    }
    last = loss.item<double>();
    if (step == 0) {
      first = last;
    }
    if (step % 5 == 0 || step == steps - 1) {
      std::printf("step %2lld  loss %.6f\n", static_cast<long long>(step), last);
    }
  }
  if (!(last < 0.9 * first)) {
    std::fprintf(stderr, "the loss did not go down: %.6f -> %.6f\n", first, last);
    return 1;
  }
  std::printf("loss went down: %.6f -> %.6f\n", first, last);
  return 0;
}
