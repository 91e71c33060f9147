"""Train a small model twice: once plainly, once with every saved activation moved
through offload_pack / offload_unpack by saved-tensor hooks. Prints the bytes moved
and checks that both runs give the same losses, step by step.

Runs on CUDA when a GPU is present (activations go to pinned host memory), else
on the CPU (the ops copy host to host, which exercises the same path).
"""
import torch

import torch_offload

STEPS = 20
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


class Block(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 4 * width)
        self.down = torch.nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Offloader:
    """Saved-tensor hooks that keep each saved activation on the host until backward."""

    def __init__(self):
        self.packed_bytes = 0
        self.unpacked_bytes = 0

    def pack(self, tensor):
        self.packed_bytes += tensor.numel() * tensor.element_size()
        return tensor.device, torch_offload.offload_pack(tensor, non_blocking=True)

    def unpack(self, saved):
        device, packed = saved
        self.unpacked_bytes += packed.numel() * packed.element_size()
        return torch_offload.offload_unpack(packed, device)


def train(offloader=None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[Block(64) for _ in range(4)], torch.nn.Linear(64, 1)).to(DEVICE)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    data = torch.randn(STEPS, 32, 128, 64, device=DEVICE)
    targets = data.mean(dim=-1, keepdim=True).sin()
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        if offloader is None:
            loss = torch.nn.functional.mse_loss(model(data[step]), targets[step])
        else:
            with torch.autograd.graph.saved_tensors_hooks(offloader.pack, offloader.unpack):
                loss = torch.nn.functional.mse_loss(model(data[step]), targets[step])
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def main():
    baseline = train()
    offloader = Offloader()
    offloaded = train(offloader)
    print(f"device: {DEVICE}, {STEPS} steps")
    print(f"loss: first {baseline[0]:.6f}, last {baseline[-1]:.6f} (baseline)")
    print(f"activation bytes packed: {offloader.packed_bytes:,}, unpacked: {offloader.unpacked_bytes:,}")
    equal = baseline == offloaded
    print(f"losses equal to the baseline at every step: {equal}")
    if not equal:
        raise SystemExit("offloaded training diverged from the baseline")


if __name__ == "__main__":
    main()
