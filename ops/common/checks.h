#pragma once
// Argument checks shared by every op: each error names the op and the argument.
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

namespace torch_offload {

// `op` and `arg` appear in the message, e.g. "offload_pack: src is undefined".
void check_defined(const at::Tensor& t, const char* op, const char* arg);

// `t` is on `ref`'s device with `dtype`, shaped `want`: `ref_name` names ref and `what`
// the expected shape in the messages. Works on symbolic shapes.
void check_tensor(const char* op, const char* arg, const at::Tensor& t, const at::Tensor& ref, const char* ref_name,
                  c10::ScalarType dtype, c10::SymIntArrayRef want, const char* what);

// Errors unless `device` exists in this process (CPU always does; CUDA needs a
// CUDA build of torch and a visible GPU with that index).
void check_device_available(c10::Device device, const char* op, const char* arg);

// The _assert_all op: a copy of `value` once every element of `condition` is true, else `message` as
// the error. A runtime check that torch.compile keeps in the graph as a pure op (torch 2.11's
// partitioner refuses aten::_assert_async in a graph with activation checkpointing); it waits for
// `condition` on a GPU.
at::Tensor assert_all_kernel(const at::Tensor& value, const at::Tensor& condition, c10::string_view message);
at::Tensor assert_all_meta(const at::Tensor& value, const at::Tensor& condition, c10::string_view message);

// Whether `device`'s current stream is recording a CUDA graph. The CUDA build sets it
// (capture_query_cuda.cpp), so that this file needs no CUDA header; without it, never.
// Returns the query it replaces (tests set a fake one and put the real one back).
using StreamCaptureQuery = bool (*)(c10::Device device);
StreamCaptureQuery set_stream_capture_query(StreamCaptureQuery query);

// Refuses, naming `op`, while `device`'s current stream captures a CUDA graph (torch.cuda.graph,
// torch.compile's mode="reduce-overhead"): `why` says what the op does that a capture cannot
// hold, e.g. a value read on the host (an .item(), which would end the capture with CUDA's own
// error, far from the op).
void check_not_capturing(const char* op, c10::Device device, const char* why);

// Bytes of physical host memory; byte budgets above it are rejected as absurd.
int64_t physical_host_bytes();

}  // namespace torch_offload
