#include "protocols/frame_codec.h"

#include <gtest/gtest.h>

#include <random>
#include <string>

#include "protocols/control.pb.h"
#include "protocols/messages.h"

namespace kvrelay::protocols {
namespace {

std::string MakeFrame(uint16_t type, const std::string& payload) {
  auto f = EncodeFrame(type, payload);
  EXPECT_TRUE(f.ok());
  return *f;
}

TEST(FrameCodec, HeaderLayoutIsLittleEndianMagicVersionTypeLength) {
  std::string f = MakeFrame(0x0102, "abc");
  ASSERT_EQ(f.size(), 15u);
  // "KVRL" as bytes: 'K' 'V' 'R' 'L'.
  EXPECT_EQ(f.substr(0, 4), "KVRL");
  EXPECT_EQ(static_cast<uint8_t>(f[4]), 1);  // version 1, little endian
  EXPECT_EQ(static_cast<uint8_t>(f[5]), 0);
  EXPECT_EQ(static_cast<uint8_t>(f[6]), 0x02);
  EXPECT_EQ(static_cast<uint8_t>(f[7]), 0x01);
  EXPECT_EQ(static_cast<uint8_t>(f[8]), 3);
  EXPECT_EQ(f.substr(12), "abc");
}

TEST(FrameCodec, DecodesFramesSplitAtEveryByte) {
  std::string stream =
      MakeFrame(1, "hello") + MakeFrame(2, "") + MakeFrame(3, std::string(1000, 'x'));
  FrameDecoder d;
  for (char c : stream) ASSERT_TRUE(d.Feed(&c, 1).ok());
  auto a = d.Next();
  auto b = d.Next();
  auto c = d.Next();
  ASSERT_TRUE(a && b && c);
  EXPECT_EQ(a->type, 1);
  EXPECT_EQ(a->payload, "hello");
  EXPECT_EQ(b->type, 2);
  EXPECT_EQ(b->payload, "");
  EXPECT_EQ(c->payload, std::string(1000, 'x'));
  EXPECT_FALSE(d.Next());
  EXPECT_TRUE(d.Finish().ok());
}

TEST(FrameCodec, RejectsOversizeBeforeBufferingPayload) {
  FrameDecoder d(FrameDecoder::Options{1024});
  std::string f = MakeFrame(1, std::string(1025, 'a'));
  Status st = d.Feed(f.data(), kFrameHeaderBytes);
  EXPECT_EQ(st.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(st.message().find("over the maximum of 1024"), std::string::npos) << st.ToString();
  EXPECT_LE(d.buffered_bytes(), kFrameHeaderBytes);
  // Sticky.
  EXPECT_FALSE(d.Feed(f.data() + kFrameHeaderBytes, 10).ok());
  EXPECT_EQ(EncodeFrame(1, std::string(1025, 'a'), 1024).status().code(),
            StatusCode::kInvalidArgument);
}

TEST(FrameCodec, RejectsBadMagicAndVersion) {
  std::string f = MakeFrame(1, "x");
  std::string bad_magic = f;
  bad_magic[0] = 'X';
  FrameDecoder d1;
  Status st = d1.Feed(bad_magic.data(), bad_magic.size());
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("bad frame magic"), std::string::npos);
  std::string bad_version = f;
  bad_version[4] = 9;
  FrameDecoder d2;
  st = d2.Feed(bad_version.data(), bad_version.size());
  EXPECT_NE(st.message().find("unsupported frame version 9"), std::string::npos) << st.ToString();
}

TEST(FrameCodec, TruncatedStreamIsDataLossAtFinish) {
  std::string f = MakeFrame(7, "payload");
  for (size_t cut = 1; cut < f.size(); ++cut) {
    FrameDecoder d;
    ASSERT_TRUE(d.Feed(f.data(), cut).ok());
    EXPECT_FALSE(d.Next());
    Status st = d.Finish();
    EXPECT_EQ(st.code(), StatusCode::kDataLoss) << "cut at " << cut;
  }
}

TEST(FrameCodec, RandomGarbageNeverCrashesAndStaysBounded) {
  std::mt19937 rng(42);
  for (int iter = 0; iter < 200; ++iter) {
    std::string junk(1 + rng() % 4096, '\0');
    for (auto& c : junk) c = static_cast<char>(rng());
    FrameDecoder d(FrameDecoder::Options{512});
    Status st = d.Feed(junk.data(), junk.size());
    while (d.Next()) {
    }
    EXPECT_LE(d.buffered_bytes(), 512 + kFrameHeaderBytes);
    // Random bytes essentially never start with the magic.
    EXPECT_FALSE(st.ok());
  }
}

TEST(Messages, TypedRoundTripAndTypeMismatch) {
  proto::Heartbeat hb;
  hb.set_worker_id("decode-0");
  hb.set_free_blocks(123);
  auto bytes = EncodeMessage(MessageType::kHeartbeat, hb);
  ASSERT_TRUE(bytes.ok());
  FrameDecoder d;
  ASSERT_TRUE(d.Feed(bytes->data(), bytes->size()).ok());
  auto frame = d.Next();
  ASSERT_TRUE(frame);
  proto::Heartbeat out;
  ASSERT_TRUE(DecodeMessage(*frame, MessageType::kHeartbeat, &out).ok());
  EXPECT_EQ(out.worker_id(), "decode-0");
  EXPECT_EQ(out.free_blocks(), 123u);
  proto::Cancel wrong;
  Status st = DecodeMessage(*frame, MessageType::kCancel, &wrong);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  // Unparseable payload: a lone field tag with no value.
  Frame garbage{static_cast<uint16_t>(MessageType::kHeartbeat), std::string("\x0a\xff", 2)};
  st = DecodeMessage(garbage, MessageType::kHeartbeat, &out);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("unparseable"), std::string::npos);
}

}  // namespace
}  // namespace kvrelay::protocols
