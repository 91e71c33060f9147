#pragma once
// A Fence made of an event recorded on a device stream, through c10's device-generic
// Event, so this file needs no CUDA header and is unit-tested with a fake device.
//
// It is queried, waited for and destroyed on any thread (the spill workers, whoever
// frees a packed tensor): each call sets the event's device first, since a CUDA call on
// a thread that never set one makes a context on device 0 (hundreds of MB there for
// every DDP rank).
#include <optional>

#include <c10/core/Event.h>
#include <c10/core/Stream.h>

#include "ops/common/pinned_arena.h"

namespace torch_offload {

class DeviceEvent final : public Fence {
 public:
  // Recorded on `stream` now: done once the work queued there so far has finished.
  explicit DeviceEvent(const c10::Stream& stream);
  ~DeviceEvent() override;
  DeviceEvent(const DeviceEvent&) = delete;
  DeviceEvent& operator=(const DeviceEvent&) = delete;

  bool done() const override;
  void wait() const override;
  // Work queued on `stream` after this call starts only once the event completed.
  void make_wait(const c10::Stream& stream) const;
  c10::Device device() const { return device_; }

 private:
  const c10::Device device_;
  std::optional<c10::Event> event_;  // reset under the device guard, in the destructor's body
};

}  // namespace torch_offload
