"""FakeTensor implementations of the device-moving ops.

FakeTensor would run the C++ Meta kernels with the inputs' device, which is
wrong for ops whose result lives elsewhere; these put the result on its device.
``register_fake`` also installs them as the ops' Meta kernels, so they run on
real meta tensors too: meta inputs give meta results, as the C++ Meta kernels
do, and nothing is ever allocated.
"""

import torch


def _device(input, device):
    return torch.device("meta") if input.device.type == "meta" else device


@torch.library.register_fake("offload::offload_pack", allow_override=True)
def _offload_pack_fake(src, non_blocking=False):
    return torch.empty(src.shape, dtype=src.dtype, device=_device(src, "cpu"))


@torch.library.register_fake("offload::offload_unpack", allow_override=True)
def _offload_unpack_fake(packed, device):
    return torch.empty(packed.shape, dtype=packed.dtype, device=_device(packed, device))


@torch.library.register_fake("offload::disk_spill", allow_override=True)
def _disk_spill_fake(src, directory=None, allow_tmpfs=False):
    return torch.empty(2, dtype=torch.int64, device=_device(src, "cpu"))


@torch.library.register_fake("offload::disk_read", allow_override=True)
def _disk_read_fake(ticket, size, dtype, device):
    return torch.empty(size, dtype=dtype, device=_device(ticket, device))


@torch.library.register_fake("offload::disk_restore", allow_override=True)
def _disk_restore_fake(ticket, size, dtype, device):
    if ticket.device.type != "meta" and torch.device(device).type == "meta":
        # As the CPU kernel: restoring consumes the ticket.
        raise RuntimeError(
            "disk_restore: device is meta, which would drop the ticket's data; expected a cpu or cuda device"
        )
    return torch.empty(size, dtype=dtype, device=_device(ticket, device))
