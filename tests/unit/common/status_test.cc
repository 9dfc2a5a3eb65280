#include "common/status.h"

#include <gtest/gtest.h>

namespace kvrelay {
namespace {

Result<int> ParsePositive(int v) {
  if (v <= 0) return InvalidArgument("value must be positive, got " + std::to_string(v));
  return v;
}

Result<int> Doubled(int v) {
  ASSIGN_OR_RETURN(int x, ParsePositive(v));
  return 2 * x;
}

TEST(StatusTest, OkAndErrorsCarryCodeAndMessage) {
  EXPECT_TRUE(Status::Ok().ok());
  Status s = NotFound("model 'x'");
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  EXPECT_EQ(s.ToString(), "NOT_FOUND: model 'x'");
  EXPECT_EQ(s.WithContext("loading").message(), "loading: model 'x'");
}

TEST(StatusTest, AssignOrReturnPropagates) {
  EXPECT_EQ(*Doubled(4), 8);
  auto r = Doubled(-1);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvrelay
