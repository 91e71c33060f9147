"""What the GPU memory tests share: the size of every allocation a function makes on the device."""

import torch


def allocation_sizes(fn):
    """Bytes of each CUDA caching-allocator allocation that fn makes, in order (freed or not)."""
    device = torch.cuda.current_device()
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    try:
        already = len(torch.cuda.memory._snapshot()["device_traces"][device])
        fn()
        torch.cuda.synchronize()
        trace = torch.cuda.memory._snapshot()["device_traces"][device][already:]
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    return [event["size"] for event in trace if event["action"] == "alloc"]
