#include "protocols/peer_handshake.h"

#include "common/logging.h"
#include "protocols/control.pb.h"
#include "protocols/messages.h"

namespace kvrelay::protocols {

Result<PeerConfig> ClientHandshake(FramedConnection& conn, const std::string& name,
                                   const PeerConfig& local, const CompatibilityOptions& options,
                                   Deadline deadline) {
  proto::Hello hello;
  hello.set_peer_name(name);
  ToProto(local, hello.mutable_config());
  std::string payload;
  hello.SerializeToString(&payload);
  RETURN_IF_ERROR(conn.Send(MessageType::kHello, payload));
  ASSIGN_OR_RETURN(Frame frame, conn.Receive(deadline));
  proto::HelloReply reply;
  RETURN_IF_ERROR(DecodeMessage(frame, MessageType::kHelloReply, &reply));
  if (!reply.accepted()) {
    Status st = FailedPrecondition("peer refused the handshake: " + reply.reason());
    conn.Close(st);
    return st;
  }
  auto peer = FromProto(reply.config());
  Status st = peer.ok() ? CheckPeerCompatible(local, *peer, options) : peer.status();
  if (!st.ok()) {
    conn.Close(st);
    return st;
  }
  return peer;
}

Result<PeerConfig> ServerHandshake(FramedConnection& conn, const PeerConfig& local,
                                   const CompatibilityOptions& options, Deadline deadline) {
  ASSIGN_OR_RETURN(Frame frame, conn.Receive(deadline));
  proto::Hello hello;
  Status st = DecodeMessage(frame, MessageType::kHello, &hello);
  Result<PeerConfig> peer = st.ok() ? FromProto(hello.config()) : Result<PeerConfig>(st);
  if (peer.ok())
    st = CheckPeerCompatible(local, *peer, options);
  else
    st = peer.status();
  proto::HelloReply reply;
  reply.set_accepted(st.ok());
  if (!st.ok()) reply.set_reason(st.message());
  ToProto(local, reply.mutable_config());
  std::string payload;
  reply.SerializeToString(&payload);
  Status sent = conn.Send(MessageType::kHelloReply, payload);
  if (!st.ok()) {
    LOG_WARNING << "refusing peer '" << hello.peer_name() << "' on " << conn.name() << ": "
                << st.message();
    conn.CloseAfterFlush(st);
    return st;
  }
  RETURN_IF_ERROR(sent);
  return peer;
}

}  // namespace kvrelay::protocols
