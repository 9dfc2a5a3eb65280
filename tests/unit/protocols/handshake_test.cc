#include "protocols/handshake.h"

#include <gtest/gtest.h>

#include "protocols/common.pb.h"

namespace kvrelay::protocols {
namespace {

PeerConfig Base() {
  PeerConfig c;
  c.model_fingerprint.fill(0xAB);
  c.kv_dtype = engine::KvDtype::kF16;
  c.block_tokens = 16;
  c.layers = 30;
  c.kv_heads = 3;
  c.head_dim = 64;
  c.tp_size = 1;
  return c;
}

TEST(Handshake, IdenticalConfigsAgreeAndTpMayDiffer) {
  PeerConfig a = Base(), b = Base();
  b.tp_size = 2;
  b.tp_rank = 1;
  EXPECT_TRUE(CheckPeerCompatible(a, b).ok());
  Status st = CheckPeerCompatible(a, b, {.require_same_tp = true});
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(st.message().find("tp_size mismatch: local 1, peer 2"), std::string::npos);
}

TEST(Handshake, EveryMismatchNamesItsField) {
  struct Case {
    const char* field;
    void (*mutate)(PeerConfig&);
  };
  const Case cases[] = {
      {"model_fingerprint", [](PeerConfig& c) { c.model_fingerprint[31] ^= 1; }},
      {"kv_dtype mismatch: local f16, peer f32",
       [](PeerConfig& c) { c.kv_dtype = engine::KvDtype::kF32; }},
      {"block_tokens mismatch: local 16, peer 32", [](PeerConfig& c) { c.block_tokens = 32; }},
      {"layers mismatch: local 30, peer 24", [](PeerConfig& c) { c.layers = 24; }},
      {"kv_heads mismatch: local 3, peer 6", [](PeerConfig& c) { c.kv_heads = 6; }},
      {"head_dim mismatch: local 64, peer 128", [](PeerConfig& c) { c.head_dim = 128; }},
      {"protocol_version", [](PeerConfig& c) { c.protocol_version = 2; }},
  };
  for (const auto& tc : cases) {
    PeerConfig peer = Base();
    tc.mutate(peer);
    Status st = CheckPeerCompatible(Base(), peer);
    EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition) << tc.field;
    EXPECT_NE(st.message().find(tc.field), std::string::npos) << st.ToString();
    // Both sides refuse (symmetric check).
    EXPECT_FALSE(CheckPeerCompatible(peer, Base()).ok()) << tc.field;
  }
}

TEST(Handshake, InvalidConfigNamesField) {
  PeerConfig bad = Base();
  bad.tp_rank = 1;  // tp_size 1
  Status st = CheckPeerCompatible(Base(), bad);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("tp_rank"), std::string::npos) << st.ToString();
}

// More TP ranks than KV heads is valid when the heads replicate evenly.
TEST(Handshake, TpSizeMayReplicateKvHeads) {
  PeerConfig a = Base();  // 3 KV heads
  a.tp_size = 6;
  a.tp_rank = 5;
  EXPECT_TRUE(ValidatePeerConfig(a).ok());
  a.tp_size = 4;
  a.tp_rank = 0;
  Status st = ValidatePeerConfig(a);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("tp_size"), std::string::npos) << st.ToString();
}

TEST(Handshake, ProtoRoundTripAndBadProto) {
  PeerConfig a = Base();
  a.tp_size = 3;
  a.tp_rank = 2;
  proto::PeerConfig m;
  ToProto(a, &m);
  auto back = FromProto(m);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->model_fingerprint, a.model_fingerprint);
  EXPECT_EQ(back->kv_dtype, a.kv_dtype);
  EXPECT_EQ(back->tp_rank, 2);
  EXPECT_TRUE(CheckPeerCompatible(a, *back, {.require_same_tp = true}).ok());
  m.set_model_fingerprint("short");
  EXPECT_NE(FromProto(m).status().message().find("model_fingerprint"), std::string::npos);
  ToProto(a, &m);
  m.set_kv_dtype(proto::KV_DTYPE_UNSPECIFIED);
  EXPECT_NE(FromProto(m).status().message().find("kv_dtype"), std::string::npos);
}

}  // namespace
}  // namespace kvrelay::protocols
