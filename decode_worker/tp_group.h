// The TCP link inside one tensor-parallel decode group (engine/runtime/
// tensor_parallel.h describes what the ranks do; this is how they talk).
//
// Star topology: rank 0 listens, ranks 1..T-1 connect and introduce
// themselves (TpHello: rank, model/KV config, KV data-plane address); rank 0
// answers TpSetup (its pool size) or refuses naming the mismatch. After that
// one connection per follower carries, in order: step plans and KV
// expectations from rank 0, KV completions from followers, and the collective
// payloads. Collectives are gathered at rank 0, combined in rank order and
// sent back, so every rank holds bit-identical results.
//
// Messages on the wire: [magic "KVTP" u32][type u32][length u64][payload];
// payloads over kMaxMessageBytes are refused and the link is closed.
//
// Threading: one owner thread per TcpTpGroup (the worker's Run thread; the
// engine calls the collective from inside Step on that same thread).
// Deadlines: every receive takes one; a collective waits at most
// `timeout` for a peer, so a dead rank is an error, never a hang.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "common/clock.h"
#include "common/status.h"
#include "engine/runtime/tp_collective.h"
#include "protocols/cluster_auth.h"
#include "protocols/port_counters.h"

namespace kvrelay::decode_worker {

enum class TpMsg : uint32_t {
  kHello = 1,     // proto::TpHello, follower -> rank 0
  kSetup = 2,     // proto::TpSetup, rank 0 -> follower
  kPlan = 3,      // proto::TpStepPlan
  kExpectKv = 4,  // proto::TpExpectKv
  kCancelKv = 5,  // proto::TpCancelKv
  kKvDone = 6,    // proto::TpKvDone, follower -> rank 0
  kData = 7,      // collective payload: raw floats
  kShutdown = 8,  // empty: rank 0 is stopping
  kPing = 9,      // u64 sequence number, rank 0 -> follower: are you there?
  kPong = 10,     // EncodePong, follower -> rank 0, at once
};
inline constexpr uint32_t kLastTpMsg = static_cast<uint32_t>(TpMsg::kPong);

struct TpMessage {
  TpMsg type = TpMsg::kShutdown;
  std::string payload;
};

inline constexpr uint64_t kMaxTpMessageBytes = 256ull << 20;

// A pong: the ping's sequence number (its payload), then what the follower's
// KV data port refused so far (four u64: auth failures, refused connections,
// oversized frames, foreign frames). A follower has no coordinator link:
// rank 0's heartbeat carries these for it.
std::string EncodePong(const std::string& ping, const protocols::PortSecurityCounters& kv_port);
// False when `payload` is not a pong.
bool DecodePong(const std::string& payload, uint64_t* seq,
                protocols::PortSecurityCounters* kv_port);

// One connected socket with whole-message send/receive and deadlines.
class TpLink {
 public:
  explicit TpLink(int fd);  // takes ownership
  ~TpLink();
  TpLink(const TpLink&) = delete;
  TpLink& operator=(const TpLink&) = delete;

  // Sends header + a + b (b may be empty) as one message.
  Status Send(TpMsg type, const void* a, size_t a_len, const void* b, size_t b_len,
              Deadline deadline);
  Status Send(TpMsg type, const std::string& payload, Deadline deadline) {
    return Send(type, payload.data(), payload.size(), nullptr, 0, deadline);
  }
  // The next whole message; DeadlineExceeded when none completed in time (a
  // partial message is kept for the next call); Unavailable when the peer
  // closed; DataLoss for a bad header (the link is unusable afterwards).
  Result<TpMessage> Receive(Deadline deadline);
  int fd() const { return fd_; }
  bool has_buffered_message() const;
  // Messages announcing more are refused (the link breaks with DataLoss and
  // refused_oversized() turns true). kMaxTpMessageBytes unless lowered: rank 0
  // lowers it to the auth messages' size until a follower authenticated.
  void set_max_message_bytes(uint64_t bytes) { max_message_bytes_ = bytes; }
  bool refused_oversized() const { return oversized_; }
  const Status& status() const { return broken_; }  // OK until the link failed

 private:
  int fd_;
  std::string rbuf_;  // bytes received but not yet returned
  Status broken_;
  uint64_t max_message_bytes_ = kMaxTpMessageBytes;
  bool oversized_ = false;
};

struct TpGroupOptions {
  int tp_rank = 0;
  int tp_size = 1;
  std::string leader_host = "127.0.0.1";
  uint16_t leader_port = 0;  // rank 0 listens here (0 = ephemeral, see port())
  // Any single wait for a peer inside one step: a collective's
  // contribution, a send the peer must drain (WorkerOptions::tp_step_timeout).
  std::chrono::milliseconds timeout{2000};
  // Followers prove it to rank 0 and rank 0 to them (protocols/cluster_auth.h)
  // before any TP message; a connection that cannot is dropped, not joined.
  protocols::ClusterKey cluster_key;
  // Rank 0 authenticates every connection concurrently, each within 5 s;
  // beyond this many still unauthenticated, the oldest of them is dropped
  // for each new one and counted (refused_connections), as the KV port does
  // (its 32; protocols/preauth_slots.h): a real follower authenticates within
  // a round trip, so silent connections held open cannot keep it out.
  size_t max_unauthenticated = 16;
};

class TcpTpGroup : public engine::TpCollective {
 public:
  // Rank 0: binds leader_host:leader_port now; Accept() waits for followers.
  static Result<std::unique_ptr<TcpTpGroup>> Listen(const TpGroupOptions& options);
  // Follower: connects (retrying until `deadline`) and sends `hello`.
  static Result<std::unique_ptr<TcpTpGroup>> Connect(const TpGroupOptions& options,
                                                     const std::string& hello, Deadline deadline);
  ~TcpTpGroup() override;

  uint16_t port() const { return port_; }  // rank 0's listening port
  // Rank 0: what the TP port refused while the group formed (auth failures,
  // oversized messages before authentication, a follower naming another rank
  // than the one it authenticated as, connections dropped for
  // max_unauthenticated).
  // Thread-safe.
  protocols::PortSecurityCounters security_counters() const;
  // OK while every link works; else the first link's error (the group is
  // then unusable: a TP group cannot continue without one of its ranks).
  Status status() const;

  // Rank 0: accepts the tp_size - 1 followers; returns their TpHello payloads
  // indexed by rank (entry 0 empty). `setup` validates one hello and returns
  // the follower's rank and the TpSetup payload to answer; when it refuses,
  // the follower is sent `refusal(error)` and Accept fails with that error.
  struct SetupAnswer {
    int rank = 0;
    std::string payload;
  };
  Result<std::vector<std::string>> Accept(
      Deadline deadline, const std::function<Result<SetupAnswer>(const std::string&)>& setup,
      const std::function<std::string(const Status&)>& refusal);

  // Rank 0 -> every follower, each send within `timeout` (or `deadline`).
  Status Broadcast(TpMsg type, const std::string& payload);
  Status Broadcast(TpMsg type, const std::string& payload, Deadline deadline);
  // Rank 0: the next non-collective message from any follower (queued ones
  // first); nullopt when none arrived by the deadline. Unavailable when a
  // follower is gone.
  Result<std::optional<std::pair<int, TpMessage>>> PollFollowers(Deadline deadline);

  // Follower: where pongs read the KV data port's refusals (the follower's
  // transport's security_counters); pongs carry zeros without it.
  void SetKvPortCounters(std::function<protocols::PortSecurityCounters()> counters) {
    kv_port_counters_ = std::move(counters);
  }
  // Follower: the pong that answers ping `ping` (EncodePong).
  std::string Pong(const std::string& ping) const;

  // Follower <-> rank 0.
  Status SendToLeader(TpMsg type, const std::string& payload);
  Result<TpMessage> ReceiveFromLeader(Deadline deadline);

  // engine::TpCollective
  int rank() const override { return options_.tp_rank; }
  int size() const override { return options_.tp_size; }
  Status AllReduceSum(float* data, int64_t n) override;
  Status AllGather(const float* local, int64_t n_local, float* out, int64_t n_out) override;

 private:
  explicit TcpTpGroup(TpGroupOptions options) : options_(std::move(options)) {}
  // Rank 0: the next kData message of follower r (other messages are queued).
  Result<std::string> ReceiveData(int r, Deadline deadline);
  Status Collective(const float* in, int64_t n_in, float* out, int64_t n_out, bool reduce);
  Status CollectiveOnce(const float* in, int64_t n_in, float* out, int64_t n_out, bool reduce);

  TpGroupOptions options_;
  mutable std::mutex counters_mu_;
  protocols::PortSecurityCounters counters_;  // guarded by counters_mu_
  int listen_fd_ = -1;
  uint16_t port_ = 0;
  std::vector<std::unique_ptr<TpLink>>
      links_;  // rank 0: index = rank (0 unused); else [0] = leader
  std::deque<std::pair<int, TpMessage>> inbox_;  // rank 0: follower messages seen mid-collective
  std::vector<float> scratch_;
  Status broken_;  // the first failed collective: the group cannot step again
  std::function<protocols::PortSecurityCounters()> kv_port_counters_;  // follower
};

}  // namespace kvrelay::decode_worker
