"""A training step's time split by what it spent it on, from one step run under torch.profiler.

The step marks its phases with record_function ("step.forward", "step.backward"); apply()'s checkpointed layers mark
backward's recomputation ("torch_offload.recompute"). Each profiled op's own time goes to one part:
- copies: on a GPU, the host-device memcpys (their device time, whichever stream ran them);
- recompute: ops under "torch_offload.recompute";
- attention backward: attention's backward ops and what they run (`*attention*backward*`);
- forward, backward (the rest of it): by when the op started (the autograd engine runs a GPU's backward in a thread
  of its own, outside the "step.backward" range's tree), and rest (the optimizer, between the phases).
On a GPU the time is each op's kernels' device time; on the CPU, each op's own CPU time (copies are not told apart
there: a host copy is CPU work of the phase it ran in). The parts add up to the busy time, not to the step's wall
time: a copy stream's work overlaps compute.
"""

import torch

PARTS = ("forward", "recompute", "attention backward", "backward, the rest", "copies", "rest")
RECOMPUTE = "torch_offload.recompute"


def _is_attention_backward(name):
    return "attention" in name and "backward" in name


def _part(event, phases):
    """The part of an op's own time, from its ancestors and when it started."""
    names = [event.name]
    parent = event.cpu_parent
    while parent is not None:
        names.append(parent.name)
        parent = parent.cpu_parent
    if RECOMPUTE in names:
        return "recompute"
    if any(_is_attention_backward(name) for name in names):
        return "attention backward"
    start = event.time_range.start
    for phase, (begin, end) in phases.items():
        if begin <= start <= end:
            return "forward" if phase == "step.forward" else "backward, the rest"
    return "rest"


def profiled_split(forward, backward, rest, gpu):
    """Runs forward() -> loss, backward(loss) and rest() once under the profiler; milliseconds per part."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if gpu:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as profile:
        with torch.profiler.record_function("step.forward"):
            loss = forward()
        with torch.profiler.record_function("step.backward"):
            backward(loss)
        rest()
        if gpu:
            torch.cuda.synchronize()
    events = [e for e in profile.events() if e.device_type == torch.autograd.DeviceType.CPU and not e.is_async]
    phases = {e.name: (e.time_range.start, e.time_range.end) for e in events if e.name.startswith("step.")}
    split = dict.fromkeys(PARTS, 0.0)
    for event in events:
        if event.name.startswith("step."):
            continue
        if not gpu:
            split[_part(event, phases)] += event.self_cpu_time_total / 1e3
            continue
        for kernel in event.kernels:
            part = "copies" if kernel.name.startswith("Memcpy") and "DtoD" not in kernel.name else None
            split[part or _part(event, phases)] += kernel.duration / 1e3
    return split
