// Stop strings over a stream of text pieces: one matcher for the coordinator
// (OpenAI `stop`) and the engine's own text stream (kvrelay generate).
#include "common/stop_matcher.h"

#include <gtest/gtest.h>

namespace kvrelay {
namespace {

std::string RunMatcher(std::vector<std::string> stops, const std::vector<std::string>& pieces,
                       bool* stopped) {
  StopMatcher m(std::move(stops));
  std::string out;
  *stopped = false;
  for (const auto& p : pieces) {
    auto o = m.Push(p);
    out += o.text;
    if (o.stopped) {
      *stopped = true;
      return out;
    }
  }
  return out + m.Flush();
}

TEST(StopMatcherTest, StopsAcrossPiecesAndNeverLeaksThePrefix) {
  bool stopped;
  EXPECT_EQ(RunMatcher({"END"}, {"abc E", "N", "Dxyz"}, &stopped), "abc ");
  EXPECT_TRUE(stopped);
  // A partial match that does not complete is released.
  EXPECT_EQ(RunMatcher({"END"}, {"E", "N", "x"}, &stopped), "ENx");
  EXPECT_FALSE(stopped);
  // Held-back text is released at the end of the stream.
  EXPECT_EQ(RunMatcher({"END"}, {"abcEN"}, &stopped), "abcEN");
  EXPECT_FALSE(stopped);
  // Earliest of several stops wins.
  EXPECT_EQ(RunMatcher({"zz", "b"}, {"aabzz"}, &stopped), "aa");
  EXPECT_TRUE(stopped);
  // No stops: everything passes straight through.
  StopMatcher none({});
  EXPECT_EQ(none.Push("E").text, "E");
}

TEST(StopMatcherTest, HoldsBackOnlyWhatCouldMatch) {
  StopMatcher m({"\n\n"});
  EXPECT_EQ(m.Push("ab\n").text, "ab");  // "\n" could start "\n\n"
  EXPECT_EQ(m.Push("c").text, "\nc");
  auto o = m.Push("\n\nrest");
  EXPECT_EQ(o.text, "");
  EXPECT_TRUE(o.stopped);
  EXPECT_EQ(m.Push("more").text, "");
}

TEST(StopMatcherTest, HoldsBackPossiblePrefixAndCutsAtStop) {
  StopMatcher m({"</end>", "STOP"});
  auto o = m.Push("hello <");
  EXPECT_EQ(o.text, "hello ");
  EXPECT_FALSE(o.stopped);
  EXPECT_EQ(m.Push("/e").text, "");
  EXPECT_EQ(m.Push("x").text, "</ex");  // no longer a prefix
  EXPECT_EQ(m.Push(" ST").text, " ");
  o = m.Push("OP and more");
  EXPECT_EQ(o.text, "");
  EXPECT_TRUE(o.stopped);
  StopMatcher n({"ab"});
  EXPECT_EQ(n.Push("xa").text, "x");
  EXPECT_EQ(n.Flush(), "a");
}

}  // namespace
}  // namespace kvrelay
