#include "ops/common/device_event.h"

#include <c10/core/DeviceGuard.h>
#include <c10/util/Exception.h>

namespace torch_offload {

DeviceEvent::DeviceEvent(const c10::Stream& stream) : device_(stream.device()) {
  const c10::DeviceGuard guard(device_);
  event_.emplace(device_.type());
  event_->record(stream);
}

DeviceEvent::~DeviceEvent() {
  try {
    const c10::DeviceGuard guard(device_);
    event_.reset();
  } catch (const c10::Error&) {  // the runtime is shutting down: no context left to make
    event_.reset();
  }
}

bool DeviceEvent::done() const {
  const c10::DeviceGuard guard(device_);
  return event_->query();
}

void DeviceEvent::wait() const {
  const c10::DeviceGuard guard(device_);
  event_->synchronize();
}

void DeviceEvent::make_wait(const c10::Stream& stream) const {
  const c10::DeviceGuard guard(device_);
  event_->block(stream);
}

}  // namespace torch_offload
