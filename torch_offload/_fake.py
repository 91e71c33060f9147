"""FakeTensor implementations of the device-moving ops.

FakeTensor would run the C++ Meta kernels with the inputs' device, which is
wrong for ops whose result lives elsewhere; these put the result on its device.
"""
import torch


@torch.library.register_fake("offload::offload_pack", allow_override=True)
def _offload_pack_fake(src, non_blocking=False):
    return torch.empty(src.shape, dtype=src.dtype, device="cpu")


@torch.library.register_fake("offload::offload_unpack", allow_override=True)
def _offload_unpack_fake(packed, device):
    return torch.empty(packed.shape, dtype=packed.dtype, device=device)


@torch.library.register_fake("offload::disk_spill", allow_override=True)
def _disk_spill_fake(src, directory=None, allow_tmpfs=False):
    return torch.empty(2, dtype=torch.int64, device="cpu")


@torch.library.register_fake("offload::disk_restore", allow_override=True)
def _disk_restore_fake(ticket, size, dtype, device):
    return torch.empty(size, dtype=dtype, device=device)


@torch.library.register_fake("offload::disk_prefetch")
def _disk_prefetch_fake(ticket):
    return None


@torch.library.register_fake("offload::disk_wait")
def _disk_wait_fake(ticket):
    return None
