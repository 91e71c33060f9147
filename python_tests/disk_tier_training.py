"""One training run for the disk-tier RSS test, in a fresh process.

usage: python disk_tier_training.py {baseline|disk} SPILL_DIR OUT.pt
Saves the losses, the last step's gradients and the peak RSS to OUT.pt.
"""

import sys

import torch
from models import TinyTransformer

import torch_offload

STEPS = 3  # each step's loss compared bitwise, the weights moving between them


def peak_rss_bytes():
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss over from the parent through
    # vfork + exec, so a child of a large test process would report the parent's peak.
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def main(mode, spill_dir, out_path):
    torch.manual_seed(0)
    model = TinyTransformer(layers=4, width=64)
    generator = torch.Generator().manual_seed(1)
    # 64 x 256 tokens: about 540 MB of saved activations per step, little compute.
    batches = [
        (torch.randn(64, 256, 64, generator=generator), torch.randn(64, 256, 1, generator=generator))
        for _ in range(STEPS)
    ]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    torch_offload.configure_disk_spill(max_in_flight_bytes=64 << 20)
    losses = []
    for x, target in batches:
        optimizer.zero_grad(set_to_none=True)
        if mode == "disk":
            with torch_offload.offload_activations(
                tier="disk",
                offload_cpu_tensors=True,
                min_bytes=1 << 16,
                spill_directory=spill_dir,
                module=model,
                prefetch_bytes=64 << 20,
            ) as context:
                loss = torch.nn.functional.mse_loss(model(x), target)
        else:
            loss = torch.nn.functional.mse_loss(model(x), target)
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        optimizer.step()
        losses.append(loss.detach())
    stats = context.stats() if mode == "disk" else {}
    peak_rss = peak_rss_bytes()
    torch.save({"losses": losses, "grads": grads, "peak_rss": peak_rss, "stats": stats}, out_path)


if __name__ == "__main__":
    main(*sys.argv[1:])
