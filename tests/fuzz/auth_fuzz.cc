#include <cstdlib>

#include "fuzz_targets.h"
#include "protocols/cluster_auth.h"
#include "protocols/control.pb.h"
#include "protocols/handshake.h"
#include "protocols/messages.h"

namespace kvrelay::fuzz {
namespace {

using protocols::AuthInitiator;
using protocols::AuthResponder;
using protocols::ClusterKey;
using protocols::Frame;
using protocols::FrameDecoder;
using protocols::MessageType;

const ClusterKey& Key() {
  static const ClusterKey key = std::move(ClusterKey::FromSecret(std::string(64, 'k'))).value();
  return key;
}

protocols::PeerConfig LocalConfig() {
  protocols::PeerConfig c;
  c.model_fingerprint.fill(5);
  c.layers = 30;
  c.kv_heads = 3;
  c.head_dim = 64;
  return c;
}

std::string Framed(MessageType t, const std::string& payload) {
  return std::move(protocols::EncodeFrame(static_cast<uint16_t>(t), payload)).value();
}

}  // namespace

int FuzzAuthHandshake(const uint8_t* data, size_t size) {
  FrameDecoder decoder(FrameDecoder::Options{protocols::kMaxUnauthenticatedPayload});
  (void)decoder.Feed(data, size);
  AuthResponder responder(Key(), protocols::kAuthChannelControl);
  AuthInitiator initiator(Key(), protocols::kAuthChannelControl, "fuzz-peer");
  bool initiator_live = initiator.Hello().ok();
  int responder_step = 0, initiator_step = 0;
  const protocols::PeerConfig local = LocalConfig();
  while (auto frame = decoder.Next()) {
    // As the accepting side: hello, then proof.
    if (responder_step == 0) {
      responder_step = responder.OnHello(*frame).ok() ? 1 : 2;
    } else if (responder_step == 1) {
      (void)responder.OnProof(*frame);
      responder_step = 2;
    }
    // As the connecting side: challenge, then the peer's proof.
    if (initiator_live && initiator_step == 0) {
      initiator_live = initiator.OnChallenge(*frame).ok();
      initiator_step = 1;
    } else if (initiator_live && initiator_step == 1) {
      (void)initiator.OnResult(*frame);
      initiator_live = false;
    }
    // The configuration Hello that follows a successful authentication.
    proto::Hello hello;
    if (protocols::DecodeMessage(*frame, MessageType::kHello, &hello).ok()) {
      auto peer = protocols::FromProto(hello.config());
      if (peer.ok()) (void)protocols::CheckPeerCompatible(local, *peer);
    }
  }
  // Both sides' nonces are fresh randomness and the key is not in the input:
  // authenticating would mean a forged HMAC.
  if (responder.authenticated() || initiator.authenticated()) std::abort();
  return 0;
}

std::vector<std::string> AuthSeeds() {
  std::vector<std::string> seeds;
  AuthInitiator i(Key(), protocols::kAuthChannelControl, "prefill-0");
  AuthResponder r(Key(), protocols::kAuthChannelControl);
  const std::string hello = *i.Hello();
  const std::string challenge =
      *r.OnHello(Frame{static_cast<uint16_t>(MessageType::kAuthHello), hello});
  const std::string proof =
      *i.OnChallenge(Frame{static_cast<uint16_t>(MessageType::kAuthChallenge), challenge});
  proto::Hello config_hello;
  config_hello.set_peer_name("prefill-0");
  protocols::ToProto(LocalConfig(), config_hello.mutable_config());
  seeds.push_back(Framed(MessageType::kAuthHello, hello) + Framed(MessageType::kAuthProof, proof) +
                  Framed(MessageType::kHello, config_hello.SerializeAsString()));
  seeds.push_back(Framed(MessageType::kAuthHello, hello));
  seeds.push_back(Framed(MessageType::kAuthChallenge, challenge) +
                  Framed(MessageType::kAuthProof, proof));
  seeds.push_back(Framed(MessageType::kHello, ""));  // the report's empty Hello
  seeds.push_back(Framed(MessageType::kHello, config_hello.SerializeAsString()));
  seeds.push_back(Framed(MessageType::kAuthProof, AuthResponder::RefusalPayload("no")));
  return seeds;
}

}  // namespace kvrelay::fuzz

#ifdef KVRELAY_LIBFUZZER_ENTRY
extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return kvrelay::fuzz::FuzzAuthHandshake(data, size);
}
#endif
