#include "prefill_worker/prefill_role.h"

#include <algorithm>

#include "common/logging.h"
#include "engine/kv_cache/kv_codec.h"
#include "kv_transfer/head_sharding.h"
#include "protocols/messages.h"
#include "protocols/sampling_codec.h"
#include "worker/kv_streams.h"

namespace kvrelay::prefill_worker {

using engine::BlockId;
using engine::RequestId;
using protocols::MessageType;
using worker::Request;
using worker::RequestState;

PrefillRole::~PrefillRole() { Shutdown(); }

Status PrefillRole::Init(worker::WorkerContext& ctx) {
  ctx_ = ctx;
  const worker::WorkerOptions& o = *ctx_.options;
  // The engine's KV cache groups stay, with a prefix store or without (a
  // sliding-window group holds only its window of a long generation): the
  // layer streams gather each model layer from its group's block
  // (SaveLayer), and the store keeps one entry per group block
  // (TieredCache::SetKvGroups). A device engine has one group anyway.
  ASSIGN_OR_RETURN(engine_, engine::Engine::Create(o.engine, ctx_.model));
  // Read by the streams in place of a sliding-window block the engine never
  // held (a prefix hit needs only in-window blocks): positions before every
  // later query's window, which the decode side never reads.
  if (engine_->kv_groups().size() > 1) {
    hole_layer_.assign(static_cast<size_t>(engine_->pool()->layout().LayerBytes()), 0);
  }
  if (!o.kv_store_path.empty()) {
    kv_store::HostRamTier::Options ram;
    ram.capacity_bytes = o.kv_ram_tier_bytes;
    ASSIGN_OR_RETURN(ram_tier_, kv_store::HostRamTier::Create(ram));
    kv_store::RocksDbTier::Options disk;
    disk.path = o.kv_store_path;
    disk.capacity_bytes = o.kv_store_capacity_bytes;
    // After a restart (or a reboot) the newest blocks, as many as the RAM
    // tier holds, are read from disk in the background before any request
    // asks for them.
    disk.prefetch_bytes = o.kv_ram_tier_bytes;
    // The tiered cache verifies every block it reads (codec checksum, and
    // the seal's tag) and erases what fails: RocksDB's own value checksums
    // would only repeat that, slowly (rocksdb_tier.h).
    disk.verify_value_checksums = false;
    ASSIGN_OR_RETURN(disk_tier_, kv_store::RocksDbTier::Open(disk));
    // Blocks on disk are sealed with keys derived from the cluster key and
    // each tenant's salt: a copied store is unreadable without the key.
    kv_store::TieredCache::Options cache_options;
    ASSIGN_OR_RETURN(cache_options.sealer, kv_store::BlockSealer::Create(o.cluster_key.secret()));
    tiered_ =
        std::make_unique<kv_store::TieredCache>(cache_options, ram_tier_.get(), disk_tier_.get());
    tiered_->Attach(
        engine_->pool(),
        [this](const kv_store::TierEvent& e) {
          // The router keeps one set per worker: stored in any tier, evicted
          // only when no tier of this worker holds the block any more.
          if (e.kind == kv_store::TierEvent::Kind::kStored) {
            ctx_.control->OnKvEvent({engine::KvEvent::Kind::kStored, e.hash});
          } else if (!e.held_anywhere) {
            ctx_.control->OnKvEvent({engine::KvEvent::Kind::kEvicted, e.hash});
          }
        },
        /*own_pool_listener=*/false);
    tiered_->SetKvGroups(engine_->kv_groups());
  }
  engine_->SetKvConnector(this);
  ctx_.requests->SetRelease([this](Request& r) { Retire(r); });
  return Status::Ok();
}

bool PrefillRole::polling() const {
  return parked_ || ctx_.requests->Count({RequestState::kStreaming}) > 0;
}

bool PrefillRole::FillPrefixStore(proto::PrefixStoreCounters* out) const {
  if (!tiered_) return false;
  const kv_store::TieredCache::Stats s = tiered_->stats();
  const kv_store::TierStats d = tiered_->disk_stats();
  auto u = [](int64_t v) { return static_cast<uint64_t>(std::max<int64_t>(0, v)); };
  int64_t misses = 0;  // every reason but the first (kNone)
  for (size_t r = 1; r < s.misses.size(); ++r) misses += s.misses[r];
  out->set_restored_blocks_ram(u(s.restored_blocks_ram));
  out->set_restored_blocks_disk(u(s.restored_blocks_disk));
  out->set_restored_bytes(u(s.restored_bytes));
  out->set_restores(u(s.restores));
  out->set_restore_misses(u(misses));
  out->set_spills(u(s.spills));
  out->set_write_through_blocks(u(s.write_through_blocks));
  out->set_write_through_dropped(u(s.write_through_dropped));
  out->set_write_backlog(u(s.write_backlog));
  out->set_disk_written_blocks(u(d.written));
  out->set_disk_written_bytes(u(d.written_bytes));
  out->set_disk_write_failures(u(d.write_failures));
  out->set_disk_entries(u(d.entries));
  out->set_disk_used_bytes(u(d.used_bytes));
  return true;
}

void PrefillRole::Shutdown() {
  // Cancels unfinished sends before their blocks go back; the table must
  // not call into this role after it.
  if (ctx_.requests != nullptr) {
    ctx_.requests->Clear();
    ctx_.requests->SetRelease(nullptr);
  }
  if (tiered_) {
    Status d = tiered_->Drain(Deadline::After(std::chrono::seconds(10)));
    if (!d.ok()) LOG_WARNING << "prefix store drain: " << d.ToString();
    tiered_->Detach();
  }
}

Status PrefillRole::OnControlFrame(const protocols::Frame& frame) {
  const auto type = static_cast<MessageType>(frame.type);
  switch (type) {
    case MessageType::kPrefillTask: {
      proto::PrefillTask task;
      RETURN_IF_ERROR(protocols::DecodeMessage(frame, type, &task));
      OnPrefillTask(task);
      return Status::Ok();
    }
    case MessageType::kCancel: {
      proto::Cancel c;
      RETURN_IF_ERROR(protocols::DecodeMessage(frame, type, &c));
      OnCancel(c);
      return Status::Ok();
    }
    default:
      return InvalidArgument("a prefill worker does not take control frames of type " +
                             std::to_string(frame.type));
  }
}

Result<std::vector<int>> PrefillRole::ConnectDecodeGroup(const proto::DecodeTarget& target,
                                                         bool* refused) {
  *refused = false;
  if (target.ranks_size() == 0) return InvalidArgument("decode target has no ranks");
  std::vector<int> ranks;
  for (int i = 0; i < target.ranks_size(); ++i) {
    const int peer = static_cast<int>(target.ranks(i));
    const std::string& info =
        i < target.kv_addresses_size() ? target.kv_addresses(i) : target.kv_address();
    // The coordinator routes only to registered (so listening) decode ranks:
    // one that does not accept within kv_progress_timeout is gone (its
    // process died after the task was sent) or cut off. The wait blocks this
    // worker's loop, so it is short, and an address that just timed out
    // fails at once for as long again (tasks queued for a dead group do not
    // each wait; a restarted rank listens on a new port, or is back by then).
    // One that refused or reset the connection (a cut link, a rank
    // restarting) is tried again soon: until then *refused, without a try.
    const auto now = Clock::now();
    std::erase_if(unreachable_, [&](const auto& kv) { return now >= kv.second.until; });
    std::erase_if(failing_, [&](const auto& kv) { return now - kv.second.last > kFailingTtl; });
    if (auto u = unreachable_.find(info); u != unreachable_.end()) {
      *refused = u->second.refused;
      if (auto f = failing_.find(info); f != failing_.end()) f->second.last = now;
      return Unavailable("decode rank " + std::to_string(peer) + " at " + info +
                         (u->second.refused ? " refused a data connection moments ago"
                                            : " did not accept a data connection moments ago"));
    }
    Status s =
        ctx_.transport->ConnectPeer(peer, info, Deadline::After(ctx_.options->kv_progress_timeout));
    if (!s.ok()) {
      const auto took = Clock::now() - now;
      Failing& f = failing_[info];
      if (f.rank < 0) f.since = now;
      f.rank = peer;
      f.last = Clock::now();
      f.error = s.ToString();
      *refused = s.code() != StatusCode::kDeadlineExceeded;
      // A refusal is tried again after twice what this try took (at least
      // kConnectRetry), so retries hold this loop a third of the time at most.
      unreachable_[info] = {
          Clock::now() + (*refused ? std::max<std::chrono::nanoseconds>(kConnectRetry, 2 * took)
                                   : std::chrono::nanoseconds(ctx_.options->kv_progress_timeout)),
          *refused};
      return s.WithContext("connecting to decode rank " + std::to_string(peer));
    }
    failing_.erase(info);
    ranks.push_back(peer);
  }
  return ranks;
}

std::string PrefillRole::data_plane_error() const {
  const auto now = Clock::now();
  for (const auto& [info, f] : failing_) {
    if (now - f.last > kFailingTtl || f.last - f.since < ctx_.options->kv_progress_timeout)
      continue;
    return "cannot reach decode rank " + std::to_string(f.rank) + " at " + info + " for " +
           std::to_string(
               std::chrono::duration_cast<std::chrono::milliseconds>(f.last - f.since).count()) +
           " ms: " + f.error.substr(0, 200);
  }
  return {};
}

namespace {
engine::RequestSpec SpecOf(const proto::PrefillTask& task) {
  engine::RequestSpec spec;
  spec.id = task.request_id();
  spec.prompt.assign(task.prompt_token_ids().begin(), task.prompt_token_ids().end());
  spec.sampling = protocols::FromProto(task.sampling());
  spec.tenant_salt = task.tenant_salt();
  // Every report of this attempt names it (PrefillDone, Finish): the
  // coordinator drops one of an attempt the request has moved away from.
  spec.kv_transfer_id = task.kv_transfer_id();
  spec.want_text = false;  // the coordinator detokenizes
  spec.mode = task.has_decode() ? engine::RequestMode::kPrefillOnly : engine::RequestMode::kFull;
  return spec;
}
}  // namespace

void PrefillRole::OnPrefillTask(const proto::PrefillTask& task) {
  const RequestId id = task.request_id();
  const int64_t prompt_tokens = task.prompt_token_ids_size();
  Request& r = ctx_.requests->Add(id, RequestState::kQueued, prompt_tokens);
  if (!task.has_decode()) {
    Submit(r, task);
    return;
  }
  auto out = std::make_unique<Outgoing>();
  out->pinned = engine::BlockTable(engine_->pool());
  out->transfer_id = task.kv_transfer_id() != 0 ? task.kv_transfer_id() : id;
  out->prompt_tokens = prompt_tokens;
  const int64_t B = ctx_.layout.block_tokens;
  const int64_t need = (prompt_tokens + B - 1) / B;
  out->prompt_blocks = need;
  out->senders.resize(static_cast<size_t>(worker::StreamSegments(need)));
  out->tables.assign(static_cast<size_t>(engine_->kv_groups().size()),
                     std::vector<BlockId>(static_cast<size_t>(need), engine::kNoBlock));
  r.work = std::move(out);
  ConnectAndSubmit(r, task);
}

void PrefillRole::ConnectAndSubmit(Request& r, const proto::PrefillTask& task) {
  Outgoing& out = *r.work_as<Outgoing>();
  bool refused = false;
  Result<std::vector<int>> ranks = ConnectDecodeGroup(task.decode(), &refused);
  if (!ranks.ok()) {
    // A decode group that refuses connections for a moment (a link cut and
    // back, a rank restarting) gets the task a little later: it waits here,
    // tried again (ConnectDecodeGroup spaces the tries per address) until
    // kv_progress_timeout after the first refusal, instead of failing at
    // once (a request moving on to the same group would meet the same
    // refusal).
    if (refused && (out.parked == nullptr || !out.connect_by.Expired())) {
      if (out.parked == nullptr) {
        LOG_INFO << "request " << r.id << ": " << ranks.status().ToString()
                 << "; trying again for up to " << ctx_.options->kv_progress_timeout.count()
                 << " ms";
        out.parked = std::make_unique<proto::PrefillTask>(task);
        out.connect_by = Deadline::After(ctx_.options->kv_progress_timeout);
        parked_ = true;
      }
      return;
    }
    ctx_.control->SendFinish(r.id, proto::Finish::REASON_ERROR, ranks.status(), r.prompt_tokens, 0,
                             out.transfer_id);
    ctx_.requests->Finish(r.id);
    return;
  }
  r.peers = std::move(*ranks);
  r.created = Clock::now();  // its sends use the data connections of this time on
  // The parked copy (which `task` may be) goes once the engine has the request.
  std::unique_ptr<proto::PrefillTask> parked = std::move(out.parked);
  Submit(r, task);
}

void PrefillRole::Submit(Request& r, const proto::PrefillTask& task) {
  const RequestId id = r.id;
  if (Status s = engine_->Submit(SpecOf(task)); !s.ok()) {
    ctx_.requests->Finish(id);
    ctx_.control->SendFinish(id, proto::Finish::REASON_ERROR, s, task.prompt_token_ids_size(), 0,
                             task.kv_transfer_id());
  }
}

void PrefillRole::RetryParked() {
  if (!parked_) return;
  parked_ = false;
  for (RequestId id : ctx_.requests->IdsIn(RequestState::kQueued)) {
    Request* r = ctx_.requests->Find(id);
    auto* out = r->work_as<Outgoing>();
    if (out == nullptr || out->parked == nullptr) continue;
    ConnectAndSubmit(*r, *out->parked);
    // Still parked (ConnectAndSubmit left it), or gone.
    if (Request* still = ctx_.requests->Find(id); still != nullptr) {
      const auto* o = still->work_as<Outgoing>();
      parked_ = parked_ || (o != nullptr && o->parked != nullptr);
    }
  }
}

void PrefillRole::LoadPrefix(const engine::RequestSpec& request, const engine::PrefixLookup& prefix,
                             const engine::KvCacheGroups& /*groups*/,
                             std::span<engine::BlockTable> tables) {
  if (tiered_) tiered_->LoadPrefix(prefix, ctx_.model->fingerprint(), request.tenant_salt, tables);
}

Status PrefillRole::AddSenders(
    std::span<const int> ranks, Outgoing& out, int64_t g,
    const std::function<kv_transfer::StreamBuffers(const kv_transfer::HeadRange&)>& buffers) {
  // Decode rank k of a TP group of T receives only its heads.
  const int tp = static_cast<int>(ranks.size());
  auto& senders = out.senders[static_cast<size_t>(g)];
  for (int k = 0; k < tp; ++k) {
    ASSIGN_OR_RETURN(kv_transfer::HeadRange heads,
                     kv_transfer::ShardHeads(ctx_.layout.kv_heads, tp, k));
    senders.push_back(std::make_unique<kv_transfer::LayerStreamSender>(
        ctx_.transport, ranks[static_cast<size_t>(k)],
        worker::MakeStreamSpec(ctx_.layout, ctx_.model->fingerprint(), out.transfer_id, g,
                               out.prompt_blocks, heads),
        buffers(heads)));
  }
  return Status::Ok();
}

void PrefillRole::RecordGroupBlocks(const engine::SeqStep& seq, Outgoing& out) {
  // The step's tables name the blocks its layers write (and the earlier
  // blocks still in each window); what a sliding-window table dropped was
  // recorded by the step that still had it. Each block recorded is pinned
  // until the streams end, so the engine's drop cannot free it.
  for (size_t g = 0; g < out.tables.size(); ++g) {
    const std::vector<BlockId>& plan_table = g == 0 ? seq.blocks : seq.group_blocks[g - 1];
    std::vector<BlockId>& table = out.tables[g];
    const size_t n = std::min(plan_table.size(), table.size());
    for (size_t i = 0; i < n; ++i) {
      const BlockId b = plan_table[i];
      if (b == engine::kNoBlock || b == table[i]) continue;
      engine_->pool()->Ref(b);
      out.pinned.Adopt(b);
      table[i] = b;  // a re-written block (copy-on-write, recompute) replaces the old
    }
  }
}

Status PrefillRole::StartSegment(const Request& req, Outgoing& out, int64_t g) {
  const RequestId id = req.id;
  const worker::BlockRange r = worker::StreamSegment(out.prompt_blocks, g);
  for (int64_t i = r.first; i < r.first + r.count; ++i) {
    if (out.tables[0][static_cast<size_t>(i)] == engine::kNoBlock) {
      return Internal("request " + std::to_string(id) + ": block " + std::to_string(i) +
                      " of its full-attention group was never computed");
    }
  }
  // The stream carries every model layer of each block (ctx_.layout); each
  // layer is read from its group's block.
  return AddSenders(req.peers, out, g, [&](const kv_transfer::HeadRange& heads) {
    return worker::MakeStreamBuffers(worker::StreamSide::kSend, engine_->pool(),
                                     engine_->kv_groups(), out.tables, r, heads,
                                     hole_layer_.empty() ? nullptr : hole_layer_.data());
  });
}

void PrefillRole::SealLayer(const Outgoing& out, worker::BlockRange r, int layer) {
  const engine::KvBlockPool& pool = *engine_->pool();
  if (!engine::kvcodec::IsKivi(pool.layout().dtype)) return;  // nothing is staged
  const engine::KvCacheGroups& groups = engine_->kv_groups();
  const std::vector<engine::BlockId>& table =
      out.tables[static_cast<size_t>(groups.group_of[static_cast<size_t>(layer)])];
  for (int64_t i = r.first; i < r.first + r.count; ++i) {
    const engine::BlockId b = table[static_cast<size_t>(i)];
    // The const LayerData quantizes a staged layer in place; it writes no
    // new values, so a device mirror is not told (no host-write hook).
    if (b != engine::kNoBlock) (void)pool.LayerData(b, groups.slot_of[static_cast<size_t>(layer)]);
  }
}

void PrefillRole::SaveLayer(int layer, const engine::StepPlan& plan) {
  // Heartbeats go out from the link's own thread; keep what they report fresh
  // in the middle of a long step.
  ctx_.control->PublishHeartbeat();
  const int64_t B = ctx_.layout.block_tokens;
  for (const engine::SeqStep& seq : plan.seqs) {
    Request* req = ctx_.requests->Find(seq.request);
    if (req == nullptr) continue;
    if (layer == 0 && req->state == RequestState::kQueued) {
      ctx_.requests->Move(*req, RequestState::kComputing);
    }
    Outgoing* o = req->work_as<Outgoing>();
    if (o == nullptr) continue;
    Outgoing& out = *o;
    const int64_t n = out.prompt_blocks;
    if (layer == 0) RecordGroupBlocks(seq, out);
    for (int64_t g = 0; g < static_cast<int64_t>(out.senders.size()); ++g) {
      const worker::BlockRange r = worker::StreamSegment(n, g);
      // The segment is streamed from the step whose chunk completes it.
      if (seq.end() < std::min((r.first + r.count) * B, out.prompt_tokens)) break;
      auto& senders = out.senders[static_cast<size_t>(g)];
      if (senders.empty()) {
        if (layer != 0) continue;  // became ready mid-step: impossible, the step is one chunk
        const Status s = StartSegment(*req, out, g);
        if (!s.ok()) {
          LOG_ERROR << "KV stream of request " << seq.request << ": " << s.ToString();
          continue;
        }
      }
      if (senders.front()->layers_sent() != layer) continue;  // sent in an earlier step
      // The step that ends the prompt wrote its partial tail block: a KIVI
      // pool holds that layer in f32 staging, its slab bytes stale until
      // quantized. The hook runs after this step's attention of the layer,
      // so quantizing it now changes nothing the step computes; it is what
      // the engine does at every prompt's end, so the decode side continues
      // from the same bytes.
      SealLayer(out, r, layer);
      for (auto& sender : senders) {
        // A full transport defers the layer (back-pressure); any other error
        // fails the stream, which its delivery then reports for the request.
        Status s = sender->SendLayer(layer);
        if (!s.ok()) {
          LOG_WARNING << "KV layer " << layer << " of request " << seq.request << ": "
                      << s.ToString();
        }
      }
      ctx_.counters->transfer_bytes += ctx_.layout.LayerBytes() * r.count;
    }
  }
}

bool PrefillRole::RequestFinished(const engine::TokenEvent& ev, engine::BlockTable& prompt_blocks) {
  Request* r = ctx_.requests->Find(ev.id);
  Outgoing* out = r != nullptr ? r->work_as<Outgoing>() : nullptr;
  if (out == nullptr) return false;
  if (ev.finish_reason != engine::FinishReason::kPrefilled || ev.token < 0) {
    // Ended at its first token (end of generation, max_tokens 1): nothing
    // is handed over, and the coordinator cancels the decode side.
    ctx_.requests->DropWork(*r);
    return false;
  }
  // Read by the senders until the delivery ends.
  out->blocks = std::move(prompt_blocks);
  // (ConnectDecodeGroup refused a target without ranks: peers[0] exists.)
  out->hand_over = kv_transfer::HandOverFrame::ToSend(ctx_.transport, r->peers[0], out->transfer_id,
                                                      ev.token, out->prompt_tokens);
  out->deliver_by = Deadline::After(ctx_.options->kv_timeout);
  out->deliver_start = Clock::now();
  // Polled from the next loop turn (Progress), after the EventReporter sent
  // the first token to the coordinator.
  ctx_.requests->Move(*r, RequestState::kStreaming);
  return true;
}

void PrefillRole::Progress() {
  if (tiered_) tiered_->Pump();
  RetryParked();
  PostDeferredSends();
  PollDeliveries();
  ExpireDelivered();
}

void PrefillRole::PostDeferredSends() {
  // Sends the transport had no room for (back-pressure, LayerStreamSender)
  // of requests still computing leave as soon as room frees, not only at
  // their hand-over; an error is kept by the sender and reported there.
  for (RequestState state : {RequestState::kQueued, RequestState::kComputing}) {
    for (RequestId id : ctx_.requests->IdsIn(state)) {
      Outgoing* out = ctx_.requests->Find(id)->work_as<Outgoing>();
      if (out == nullptr) continue;
      for (auto& segment : out->senders) {
        for (auto& sender : segment) {
          if (sender->deferred() > 0) (void)sender->Poll();
        }
      }
    }
  }
}

Status PrefillRole::PollDelivery(const Request& r, Outgoing& out, bool* done) {
  const RequestId id = r.id;
  bool all_done = true;
  std::map<int, int> unfinished;
  bool all_posted = true;  // no layer waits for room in the transport
  for (auto& segment : out.senders) {
    if (segment.empty()) {
      return Internal("a KV segment of request " + std::to_string(id) + " was never streamed");
    }
    for (auto& sender : segment) {
      ASSIGN_OR_RETURN(bool sent, sender->Poll());
      all_done = all_done && sent;
      all_posted = all_posted && sender->deferred() == 0;
      unfinished[sender->peer()] += sender->unfinished();
    }
  }
  // The hand-over frame follows every layer onto the wire: once it is in,
  // the decode side knows the rest moves at link speed.
  if (all_posted) {
    ASSIGN_OR_RETURN(bool sent, out.hand_over->Poll());
    all_done = all_done && sent;
  } else {
    all_done = false;
  }
  // A send to a peer finished (or a delivery to it started): it moves.
  const auto now = Clock::now();
  for (const auto& [peer, n] : unfinished) {
    auto prev = out.unfinished.find(peer);
    if (prev == out.unfinished.end() ? !peer_progress_.count(peer) : n < prev->second) {
      peer_progress_[peer] = now;
    }
  }
  out.unfinished = unfinished;
  *done = all_done;
  if (all_done) return Status::Ok();
  if (out.deliver_by.Expired()) {
    return DeadlineExceeded("KV of request " + std::to_string(id) + " not delivered within " +
                            std::to_string(ctx_.options->kv_timeout.count()) + " ms");
  }
  // No-progress deadline: a peer none of whose sends finished for
  // kv_progress_timeout (while this delivery waited on it) is behind a cut
  // path that reports no error. Its data connection is dropped — every send
  // queued on it fails now, instead of at kv_timeout — and the next request
  // for it connects again.
  std::vector<int> stuck;
  for (const auto& [peer, n] : unfinished) {
    if (n > 0 && now - std::max(peer_progress_[peer], out.deliver_start) >
                     ctx_.options->kv_progress_timeout) {
      stuck.push_back(peer);
    }
  }
  if (stuck.empty()) return Status::Ok();
  Status s = DeadlineExceeded("KV of request " + std::to_string(id) +
                              " made no progress to decode rank " + std::to_string(stuck.front()) +
                              " for " + std::to_string(ctx_.options->kv_progress_timeout.count()) +
                              " ms (--kv-progress-timeout-ms; the KV path is cut?)");
  if (!died_mid_send_.empty() && wedged_.ok()) {
    wedged_ = FailedPrecondition(
        "the " + std::string(ctx_.transport->name()) +
        " KV data plane moves nothing to live decode rank " + std::to_string(stuck.front()) +
        " since " + died_mid_send_ + " while the transport still owned sends to it" +
        (ctx_.transport->name() == "mpi" ? " (Open MPI leaves such a process in an undefined state)"
                                         : "") +
        "; this prefill worker leaves the cluster");
    LOG_ERROR << wedged_.ToString();
  }
  for (int peer : stuck) AbandonStalledPeer(peer, s);
  return s;
}

void PrefillRole::PollDeliveries() {
  for (RequestId id : ctx_.requests->IdsIn(RequestState::kStreaming)) {
    Request* r = ctx_.requests->Find(id);
    Outgoing* out = r->work_as<Outgoing>();
    if (out == nullptr) continue;  // its decode group was lost (OnPeersLost)
    bool done = false;
    const Status s = PollDelivery(*r, *out, &done);
    if (s.ok() && !done) continue;
    ctx_.counters->transfer_seconds += SecondsSince(out->deliver_start);
    const uint64_t transfer_id = out->transfer_id;
    if (!s.ok()) {
      LOG_WARNING << "KV stream of request " << id << " failed: " << s.ToString();
      ctx_.control->SendFinish(id, proto::Finish::REASON_ERROR,
                               s.WithContext("KV transfer to decode"), r->prompt_tokens, 0,
                               transfer_id);
      ctx_.requests->Finish(id);  // senders first, then the blocks (Outgoing's member order)
      continue;
    }
    ctx_.requests->DropWork(*r);
    ctx_.requests->Move(*r, RequestState::kDelivered);
  }
}

void PrefillRole::ExpireDelivered() {
  for (RequestId id : ctx_.requests->IdsIn(RequestState::kDelivered)) {
    if (Clock::now() - ctx_.requests->Find(id)->since > ctx_.options->kv_timeout) {
      ctx_.requests->Finish(id);
    }
  }
}

void PrefillRole::Retire(Request& r) {
  auto* out = r.work_as<Outgoing>();
  if (out == nullptr) return;
  bool quarantined = false;
  for (auto& segment : out->senders) {
    for (auto& sender : segment) {
      sender->CancelAll();
      quarantined = quarantined || sender->quarantined();
    }
  }
  if (out->hand_over != nullptr) {
    if (out->hand_over->quarantined()) {
      quarantined = true;
    } else {
      out->hand_over.reset();  // cancels an unfinished send
    }
  }
  if (quarantined) {
    std::vector<BlockId> ids(out->pinned.ids().begin(), out->pinned.ids().end());
    ids.insert(ids.end(), out->blocks.ids().begin(), out->blocks.ids().end());
    std::sort(ids.begin(), ids.end());
    const auto n = std::unique(ids.begin(), ids.end()) - ids.begin();
    ctx_.counters->quarantined_blocks += n;
    LOG_WARNING << "request " << r.id << ": " << n
                << " KV blocks quarantined (a send to a dead decode peer still owns them)";
    quarantine_.push_back(std::move(r.work));
  }
}

void PrefillRole::OnPeersLost(std::span<const int> ranks) {
  const int64_t quarantined_before = ctx_.counters->quarantined_blocks;
  std::erase_if(failing_, [&](const auto& kv) {
    return std::find(ranks.begin(), ranks.end(), kv.second.rank) != ranks.end();
  });
  auto lost = [&](const Request& r) {
    auto in = [&](int p) { return std::find(ranks.begin(), ranks.end(), p) != ranks.end(); };
    if (std::any_of(r.peers.begin(), r.peers.end(), in)) return true;
    // A parked task has no peers yet: its target's ranks.
    const auto* out = r.work_as<Outgoing>();
    return out != nullptr && out->parked != nullptr &&
           std::any_of(out->parked->decode().ranks().begin(), out->parked->decode().ranks().end(),
                       [&](uint32_t p) { return in(static_cast<int>(p)); });
  };
  // The coordinator re-runs or fails these requests itself (it announced the
  // loss before its cancels and re-runs): they end here reporting nothing.
  // A first token sampled for a decode group that is gone would only reach
  // the coordinator as a stale report.
  for (RequestState state :
       {RequestState::kQueued, RequestState::kComputing, RequestState::kStreaming}) {
    for (RequestId id : ctx_.requests->IdsIn(state)) {
      Request* r = ctx_.requests->Find(id);
      if (r->work == nullptr || !lost(*r)) continue;
      ctx_.requests->DropWork(*r);  // its streams end before the engine lets go of the blocks
      ctx_.requests->Cancelled(id, engine_->Cancel(id).ok());
    }
  }
  // Retire quarantined what the transport still owned: the peers died mid-send.
  if (ctx_.counters->quarantined_blocks > quarantined_before && died_mid_send_.empty()) {
    died_mid_send_ = "decode rank";
    for (size_t i = 0; i < ranks.size(); ++i) {
      died_mid_send_ += (i == 0 ? " " : ", ") + std::to_string(ranks[i]);
    }
    died_mid_send_ += " died";
  }
}

void PrefillRole::AbandonStalledPeer(int peer, const Status& why) {
  ctx_.transport->AbandonPeer(peer, why);
  peer_progress_.erase(peer);
  abandoned_at_[peer] = Clock::now();
}

void PrefillRole::OnCancel(const proto::Cancel& c) {
  // Delivered (or still delivering) here, then timed out on the decode side:
  // the bytes went into a connection that is cut without a reset. Drop it
  // (every send queued on it fails now); the next request to that group
  // connects again. Not when the request used a connection dropped since:
  // that would drop the new one, with the requests that moved onto it.
  const RequestId id = c.request_id();
  const bool stalled = c.reason().rfind("peer failed: DEADLINE_EXCEEDED", 0) == 0;
  if (const Request* r = ctx_.requests->Find(id);
      r != nullptr && stalled &&
      (r->state == RequestState::kDelivered || r->state == RequestState::kStreaming)) {
    for (int peer : r->peers) {
      auto a = abandoned_at_.find(peer);
      if (a != abandoned_at_.end() && r->created <= a->second) continue;
      AbandonStalledPeer(peer, Unavailable("decode rank " + std::to_string(peer) +
                                           " never received the KV of request " +
                                           std::to_string(id) + ": dropping its data connection"));
    }
  }
  // Its streams end (the table's Release) before the engine lets go of its blocks.
  if (Request* r = ctx_.requests->Find(id); r != nullptr) ctx_.requests->DropWork(*r);
  ctx_.requests->Cancelled(id, engine_->Cancel(id).ok());
}

}  // namespace kvrelay::prefill_worker
