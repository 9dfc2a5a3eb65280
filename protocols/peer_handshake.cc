#include "protocols/peer_handshake.h"

#include "common/logging.h"
#include "protocols/control.pb.h"
#include "protocols/messages.h"

namespace kvrelay::protocols {

Status ClientAuthenticate(FramedConnection& conn, const ClusterKey& key, std::string_view channel,
                          const std::string& name, Deadline deadline) {
  AuthInitiator auth(key, channel, name);
  auto run = [&]() -> Status {
    ASSIGN_OR_RETURN(std::string hello, auth.Hello());
    RETURN_IF_ERROR(conn.Send(MessageType::kAuthHello, hello));
    ASSIGN_OR_RETURN(Frame challenge, conn.Receive(deadline));
    ASSIGN_OR_RETURN(std::string proof, auth.OnChallenge(challenge));
    RETURN_IF_ERROR(conn.Send(MessageType::kAuthProof, proof));
    ASSIGN_OR_RETURN(Frame result, conn.Receive(deadline));
    return auth.OnResult(result);
  };
  Status st = run();
  if (!st.ok()) {
    conn.Close(st);
    return st.WithContext("authenticating to " + conn.name());
  }
  conn.MarkAuthenticated();
  return Status::Ok();
}

Result<std::string> ServerAuthenticate(FramedConnection& conn, const ClusterKey& key,
                                       std::string_view channel, Deadline deadline) {
  AuthResponder auth(key, channel);
  auto run = [&]() -> Status {
    ASSIGN_OR_RETURN(Frame hello, conn.Receive(deadline));
    ASSIGN_OR_RETURN(std::string challenge, auth.OnHello(hello));
    RETURN_IF_ERROR(conn.Send(MessageType::kAuthChallenge, challenge));
    ASSIGN_OR_RETURN(Frame proof, conn.Receive(deadline));
    ASSIGN_OR_RETURN(std::string mine, auth.OnProof(proof));
    return conn.Send(MessageType::kAuthProof, mine);
  };
  Status st = run();
  if (!st.ok()) {
    LOG_WARNING << "refusing unauthenticated peer on " << conn.name() << ": " << st.message();
    (void)conn.Send(MessageType::kAuthProof,
                    AuthResponder::RefusalPayload("authentication failed"));
    conn.CloseAfterFlush(st);
    return st;
  }
  conn.MarkAuthenticated();
  return auth.peer_name();
}

Result<PeerConfig> ClientHandshake(FramedConnection& conn, const ClusterKey& key,
                                   const std::string& name, const PeerConfig& local,
                                   const CompatibilityOptions& options, Deadline deadline) {
  RETURN_IF_ERROR(ClientAuthenticate(conn, key, kAuthChannelControl, name, deadline));
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

Result<PeerConfig> ServerHandshake(FramedConnection& conn, const ClusterKey& key,
                                   const PeerConfig& local, const CompatibilityOptions& options,
                                   Deadline deadline) {
  RETURN_IF_ERROR(ServerAuthenticate(conn, key, kAuthChannelControl, deadline).status());
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
