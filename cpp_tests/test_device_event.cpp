// DeviceEvent sets its own device around every call, whatever the calling thread's
// current device: checked on a fake device type whose guard records the device that
// was current at each event call (a CUDA call there would make a context on device 0).
#include <gtest/gtest.h>

#include <string>
#include <thread>
#include <vector>

#include <c10/core/impl/DeviceGuardImplInterface.h>

#include "ops/common/device_event.h"

namespace torch_offload {
namespace {

constexpr c10::DeviceType kFake = c10::DeviceType::PrivateUse1;

thread_local c10::DeviceIndex t_current_device = 0;
std::vector<std::string> g_calls;  // "<call>@<device current then>"

struct FakeEventsGuardImpl final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kFake; }
  c10::Device exchangeDevice(c10::Device device) const override {
    const c10::Device old = getDevice();
    t_current_device = device.index();
    return old;
  }
  c10::Device getDevice() const override { return c10::Device(kFake, t_current_device); }
  void setDevice(c10::Device device) const override { t_current_device = device.index(); }
  void uncheckedSetDevice(c10::Device device) const noexcept override { t_current_device = device.index(); }
  c10::Stream getStream(c10::Device device) const override { return c10::Stream(c10::Stream::DEFAULT, device); }
  c10::Stream exchangeStream(c10::Stream stream) const override { return stream; }
  c10::DeviceIndex deviceCount() const noexcept override { return 4; }

  void record(void** event, const c10::Stream& /*stream*/, const c10::DeviceIndex /*device*/,
              const c10::EventFlag /*flag*/) const override {
    static int events = 0;
    *event = &events;  // any non-null handle
    log("record");
  }
  void block(void* /*event*/, const c10::Stream& /*stream*/) const override { log("block"); }
  bool queryEvent(void* /*event*/) const override {
    log("query");
    return true;
  }
  void synchronizeEvent(void* /*event*/) const override { log("synchronize"); }
  void destroyEvent(void* /*event*/, const c10::DeviceIndex /*device*/) const noexcept override { log("destroy"); }

  static void log(const char* call) { g_calls.push_back(std::string(call) + "@" + std::to_string(t_current_device)); }
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, FakeEventsGuardImpl);

TEST(DeviceEvent, EveryCallRunsOnTheEventsDeviceOnAnyThread) {
  g_calls.clear();
  const c10::Stream stream(c10::Stream::DEFAULT, c10::Device(kFake, 2));
  std::vector<c10::DeviceIndex> current_after;
  {
    auto event = std::make_unique<DeviceEvent>(stream);
    EXPECT_EQ(event->device(), c10::Device(kFake, 2));
    // A worker thread that never set a device (its current one is 0) queries, waits, orders
    // a stream behind the event and frees it, as the spill workers and finish_job do.
    std::thread worker([&] {
      EXPECT_TRUE(event->done());
      event->wait();
      event->make_wait(c10::Stream(c10::Stream::DEFAULT, c10::Device(kFake, 2)));
      event.reset();
      current_after.push_back(t_current_device);
    });
    worker.join();
  }
  current_after.push_back(t_current_device);
  const std::vector<std::string> want = {"record@2", "query@2", "synchronize@2", "block@2", "destroy@2"};
  EXPECT_EQ(g_calls, want);
  // Each guard put the thread's own device back.
  EXPECT_EQ(current_after, (std::vector<c10::DeviceIndex>{0, 0}));
}

}  // namespace
}  // namespace torch_offload
