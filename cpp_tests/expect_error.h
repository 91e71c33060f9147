#pragma once
// Shared by the op tests: `call` must raise a c10::Error whose message contains `message`.
#include <gtest/gtest.h>

#include <functional>
#include <string>

#include <c10/util/Exception.h>

inline void expect_error(const std::function<void()>& call, const std::string& message) {
  try {
    call();
    ADD_FAILURE() << "no error; expected: " << message;
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
  }
}
