// Control frames after authentication (issue #41): what a registered worker
// — one with a bug, or anyone holding the cluster key — can send the
// coordinator about a live request. A real ClusterBackend on 127.0.0.1 with
// a prefill and a decode worker peer, both authenticated and registered
// afresh for each input; one request is submitted and its reservation and
// task go out; then the input's frames are sent as the workers' own.
//
// Input: records of [sender u8 (bit 0: the decode peer)][type u8]
// [length u16 little-endian][payload] (a short record takes the rest).
// Invariants: the coordinator survives; the request's stream is well formed
// (nothing after its one final event); after Cancel it ends within a
// deadline; the backend still answers Health and Counters.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/logging.h"
#include "fuzz_targets.h"
#include "protocols/messages.h"
#include "tests/testing/control_peer.h"

namespace kvrelay::fuzz {
namespace {

using coordinator::testing::CollectedEvents;
using coordinator::testing::ControlPeer;
using protocols::MessageType;

constexpr uint64_t kId = 1;

[[noreturn]] void Fail(const std::string& what) {
  std::fprintf(stderr, "control_frame fuzz: %s\n", what.c_str());
  std::abort();
}

struct Harness {
  protocols::IoThread io{"control-fuzz-io"};
  protocols::ClusterKey key = std::move(protocols::ClusterKey::Generate()).value();
  std::unique_ptr<coordinator::ClusterBackend> backend;

  Harness() {
    // Every malformed frame is a warning, every peer a registration: the
    // replay runs thousands; only errors are worth printing.
    SetLogLevel(LogLevel::kError);
    coordinator::ClusterBackendOptions o;
    o.config = coordinator::testing::ControlTestConfig();
    o.cluster_key = key;
    // No worker is dropped for silence within an input; nothing waits for
    // a worker; a request may move (the migration paths are reached).
    o.heartbeat_interval = std::chrono::milliseconds(5000);
    o.worker_wait = std::chrono::milliseconds(0);
    o.migration_limit = 3;
    auto b = coordinator::ClusterBackend::Create(o);
    if (!b.ok()) Fail(b.status().ToString());
    backend = std::move(*b);
  }

  std::unique_ptr<ControlPeer> Join(const std::string& id, proto::WorkerRole role, uint32_t rank) {
    auto peer = std::make_unique<ControlPeer>(io, backend->control_port());
    Status s = peer->Join(key, id, role, rank);
    if (!s.ok()) Fail("join " + id + ": " + s.ToString());
    return peer;
  }

  // The received-frame count of `type`, over every worker.
  double Received(const char* type) {
    for (const coordinator::BackendMetric& c : backend->Counters()) {
      if (c.name != "kvrelay_control_messages_total") continue;
      bool received = false, of_type = false;
      for (const auto& [k, v] : c.labels) {
        received = received || (k == "direction" && v == "received");
        of_type = of_type || (k == "type" && v == type);
      }
      if (received && of_type) return c.value;
    }
    return 0;
  }
};

Harness& Get() {
  static Harness* h = new Harness;  // lives for the process: its io thread serves every input
  return *h;
}

// Reads what the coordinator sent `peer` so far (reservations, tasks,
// cancels); false once the coordinator closed the connection.
bool Drain(ControlPeer& peer) {
  while (true) {
    auto f = peer.conn->Receive(Deadline::After(std::chrono::nanoseconds(0)));
    if (f.ok()) continue;
    return !peer.conn->closed() && f.status().code() == StatusCode::kDeadlineExceeded;
  }
}

void CheckWellFormed(CollectedEvents& events) {
  std::lock_guard lock(events.mu);
  for (size_t i = 0; i + 1 < events.got.size(); ++i) {
    if (events.got[i].finished) Fail("an event after the request's final event");
  }
}

std::string Record(bool decode, MessageType type, const std::string& payload) {
  std::string r;
  r.push_back(static_cast<char>(decode ? 1 : 0));
  r.push_back(static_cast<char>(type));
  r.push_back(static_cast<char>(payload.size() & 0xff));
  r.push_back(static_cast<char>((payload.size() >> 8) & 0xff));
  return r + payload;
}

}  // namespace

int FuzzControlFrames(const uint8_t* data, size_t size) {
  Harness& h = Get();
  auto prefill = h.Join("prefill-0", proto::WORKER_ROLE_PREFILL, 10);
  auto decode = h.Join("decode-0", proto::WORKER_ROLE_DECODE, 20);
  CollectedEvents events;
  coordinator::GenerationRequest req;
  req.id = kId;
  req.prompt = {11, 12, 13, 14, 15};
  req.sampling.max_tokens = 4;
  req.sampling.seed = 1;
  if (Status s = h.backend->Submit(req, events.Sink()); !s.ok()) {
    Fail("submit: " + s.ToString());
  }
  bool alive[2] = {true, true};
  ControlPeer* peers[2] = {prefill.get(), decode.get()};
  size_t at = 0;
  while (at + 4 <= size) {
    const int who = data[at] & 1;
    const auto type = static_cast<uint16_t>(data[at + 1]);
    const size_t len = std::min<size_t>(data[at + 2] | (data[at + 3] << 8), size - at - 4);
    const std::string payload(reinterpret_cast<const char*>(data + at + 4), len);
    at += 4 + len;
    if (alive[who] && !peers[who]->conn->Send(static_cast<MessageType>(type), payload).ok()) {
      alive[who] = false;
    }
  }
  // Every frame above is read once a heartbeat sent after it on the same
  // connection is counted (a connection the coordinator closed is not
  // waited for).
  double want = h.Received("Heartbeat");
  for (int w = 0; w < 2; ++w) {
    alive[w] = alive[w] && Drain(*peers[w]);
    if (!alive[w]) continue;
    proto::Heartbeat hb;
    hb.set_worker_id(w == 0 ? "prefill-0" : "decode-0");
    if (peers[w]->Send(MessageType::kHeartbeat, hb).ok()) want += 1;
  }
  const Deadline synced = Deadline::AfterMs(10'000);
  while (h.Received("Heartbeat") < want && !synced.Expired()) {
    bool any = false;
    for (int w = 0; w < 2; ++w) any = any || (alive[w] && !peers[w]->conn->closed());
    if (!any) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));  // a poll, bounded by `synced`
  }
  CheckWellFormed(events);
  h.backend->Cancel(kId);
  if (!events.WaitFinished(Deadline::AfterMs(10'000))) {
    Fail("the request did not end within 10 s of its Cancel");
  }
  CheckWellFormed(events);
  (void)h.backend->Health();
  (void)h.backend->Counters();
  return 0;
}

std::vector<std::string> ControlFrameSeeds() {
  auto s = [](const auto& m) { return m.SerializeAsString(); };
  proto::PrefillDone done;
  done.set_request_id(kId);
  done.set_first_token(100);
  done.set_prompt_tokens(5);
  proto::TokenChunk chunk;
  auto* e = chunk.add_entries();
  e->set_request_id(kId);
  e->add_token_ids(101);
  e->add_token_ids(102);
  e->add_logprobs()->set_logprob(-0.5f);
  proto::Finish length;
  length.set_request_id(kId);
  length.set_reason(proto::Finish::REASON_LENGTH);
  proto::Finish lost = length;
  lost.set_reason(proto::Finish::REASON_ERROR);
  lost.set_status_code(static_cast<uint32_t>(StatusCode::kDataLoss));
  lost.set_message("receiving KV: checksum mismatch");
  proto::ReserveBlocksReply refused;
  refused.set_request_id(kId);
  refused.set_ok(false);
  refused.set_reason("no blocks");
  proto::WorkerLeaving leaving;
  leaving.set_worker_id("decode-0");
  leaving.set_reason("TP rank lost");
  proto::Heartbeat hb;
  hb.set_worker_id("decode-0");
  hb.set_free_blocks(10);
  hb.set_capacity_blocks(1000);
  proto::PrefixCacheEvent cache;
  cache.set_worker_id("prefill-0");
  cache.add_stored_block_hashes(std::string(32, 'h'));
  return {
      // The whole life: first token, two more, the end.
      Record(false, MessageType::kPrefillDone, s(done)) +
          Record(true, MessageType::kTokenChunk, s(chunk)) +
          Record(true, MessageType::kFinish, s(length)),
      // Reports that overtake the PrefillDone, then it.
      Record(true, MessageType::kTokenChunk, s(chunk)) +
          Record(true, MessageType::kFinish, s(length)) +
          Record(false, MessageType::kPrefillDone, s(done)),
      // A corrupt hand-over (the request moves), then a refusal.
      Record(false, MessageType::kPrefillDone, s(done)) +
          Record(true, MessageType::kFinish, s(lost)) +
          Record(true, MessageType::kReserveBlocksReply, s(refused)),
      // Frames for the wrong role, a departure, heartbeats and cache events.
      Record(true, MessageType::kPrefillDone, s(done)) +
          Record(false, MessageType::kTokenChunk, s(chunk)) +
          Record(true, MessageType::kHeartbeat, s(hb)) +
          Record(false, MessageType::kPrefixCacheEvent, s(cache)) +
          Record(true, MessageType::kWorkerLeaving, s(leaving)),
  };
}

}  // namespace kvrelay::fuzz

#ifdef KVRELAY_LIBFUZZER_ENTRY
extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return kvrelay::fuzz::FuzzControlFrames(data, size);
}
#endif
