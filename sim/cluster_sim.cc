#include "sim/cluster_sim.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <deque>
#include <limits>
#include <list>
#include <memory>
#include <unordered_map>

#include "coordinator/http/admission.h"
#include "sim/event_queue.h"

namespace kvrelay::sim {

using coordinator::PrefixBlockHash;
using coordinator::PrefixBlockHashHasher;
using coordinator::WorkerInfo;
using coordinator::WorkerRole;

Status ClusterConfig::Validate() const {
  if (colocated < 0 || prefill < 0 || decode < 0) {
    return InvalidArgument("cluster: worker counts must be >= 0");
  }
  if (tp < 1) return InvalidArgument("cluster: tp must be >= 1");
  if (colocated == 0 && (prefill == 0 || decode == 0)) {
    return InvalidArgument("cluster: need colocated workers or both prefill and decode workers");
  }
  if (colocated > 0 && (prefill > 0 || decode > 0)) {
    return InvalidArgument("cluster: mixing colocated and disaggregated workers is not modelled");
  }
  if (coordinator_max_running < 1) return InvalidArgument("cluster: max_running must be >= 1");
  if (coordinator_max_queue < 0) return InvalidArgument("cluster: max_queue must be >= 0");
  if (store_blocks < 0) return InvalidArgument("cluster: store_blocks must be >= 0");
  if (shared_host_cores < 0) return InvalidArgument("cluster: shared_host_cores must be >= 0");
  if (!(heartbeat_s >= 0) || !std::isfinite(heartbeat_s)) {
    return InvalidArgument("cluster: heartbeat_s must be >= 0");
  }
  if (heartbeat_phase_s != 0 && !(heartbeat_phase_s > 0 && heartbeat_phase_s < heartbeat_s)) {
    return InvalidArgument("cluster: heartbeat_phase_s must be in [0, heartbeat_s)");
  }
  return Status::Ok();
}

std::string ClusterConfig::Name() const {
  if (colocated > 0) return "colocated x" + std::to_string(colocated);
  std::string s = std::to_string(prefill) + "P+" + std::to_string(decode) + "D";
  if (tp > 1) s += " TP" + std::to_string(tp);
  return s;
}

std::string ClusterConfig::NameWithRouter() const {
  if (router == coordinator::RouterPolicy::kPrefixAware) return Name();
  return Name() + " (" + std::string(coordinator::RouterPolicyName(router)) + ")";
}

namespace {

enum EventKind : uint32_t { kArrival, kStart, kStepEnd, kKvReady, kRestoreDone, kServiceDone };

uint64_t SplitMix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// Stand-in for the SHA-256 chain hash of a full prompt block: equal for the
// blocks a group shares, distinct otherwise (the router only compares them).
PrefixBlockHash BlockHash(uint64_t owner, bool shared, int64_t index) {
  PrefixBlockHash h;
  uint64_t x = SplitMix(owner * 2 + (shared ? 1 : 0)) ^ SplitMix(static_cast<uint64_t>(index) + 7);
  for (int w = 0; w < 4; ++w) {
    x = SplitMix(x + static_cast<uint64_t>(w));
    std::memcpy(h.data() + 8 * w, &x, 8);
  }
  return h;
}

// LRU set of block hashes (a worker's pool cache or its store tier).
class BlockLru {
 public:
  explicit BlockLru(int64_t capacity) : capacity_(capacity) {}
  bool Contains(const PrefixBlockHash& h) const { return map_.count(h) > 0; }
  void Touch(const PrefixBlockHash& h) {
    auto it = map_.find(h);
    if (it != map_.end()) lru_.splice(lru_.begin(), lru_, it->second);
  }
  // Inserts (or touches) h; returns true and sets *evicted when that pushed
  // the least recently used entry out.
  bool Insert(const PrefixBlockHash& h, PrefixBlockHash* evicted) {
    auto it = map_.find(h);
    if (it != map_.end()) {
      lru_.splice(lru_.begin(), lru_, it->second);
      return false;
    }
    if (capacity_ <= 0) return false;
    lru_.push_front(h);
    map_.emplace(h, lru_.begin());
    if (static_cast<int64_t>(map_.size()) <= capacity_) return false;
    *evicted = lru_.back();
    map_.erase(lru_.back());
    lru_.pop_back();
    return true;
  }

 private:
  int64_t capacity_;
  std::list<PrefixBlockHash> lru_;
  std::unordered_map<PrefixBlockHash, std::list<PrefixBlockHash>::iterator, PrefixBlockHashHasher>
      map_;
};

struct Seq {
  uint32_t req = 0;
  uint64_t order = 0;        // engine arrival order ("oldest first")
  int64_t prompt = 0;        // prompt tokens
  int64_t tokens = 0;        // prompt + generated tokens so far
  int64_t computed = 0;      // positions in the KV cache
  int64_t generated = 0;     // tokens sampled so far
  int64_t max_generate = 0;  // finishes when generated reaches it
  int64_t own_blocks = 0;    // blocks allocated for it (prefix hits are shared, not counted)
  int64_t shared_blocks = 0;
  int64_t committed = 0;  // prompt blocks committed to the prefix cache
  int64_t chunk = 0;      // tokens computed in the current step
  bool reserved = false;  // decode side: blocks reserved up front, no allocation
};

struct Worker {
  enum class Kind { kColocated, kPrefill, kDecode };
  Kind kind = Kind::kColocated;
  std::string id;
  size_t info = 0;  // index into Simulator::infos_
  std::deque<Seq> waiting;
  std::vector<Seq> running;
  int64_t capacity_blocks = 0;
  int64_t used_blocks = 0;  // allocated + reserved
  bool stepping = false;
  double step_scale = 1;     // fixed + decode part of a step
  double prefill_scale = 1;  // prefill part
  double step_add_s = 0;
  double ttft_add_s = 0;
  double link_free_s = 0;  // prefill: egress link busy until
  // Shared host (fluid model): cores kept busy while stepping, the solo
  // seconds of the current step still to do, its rate since `since`, its
  // contention alpha, and the generation of its pending step-end event.
  double cores = 1;
  double work_left = 0;
  double rate = 1;
  double since = 0;
  double alpha = 0;
  // A TP group's busy_alpha, or a disaggregated role's (ServingOverhead::
  // busy_alpha), replaces the contention mix; NaN: the mix.
  double tp_alpha = std::numeric_limits<double>::quiet_NaN();
  double share_weight = 1;  // in the host's fair sharing (TpCost::share_weight)
  uint64_t version = 0;
  // Heartbeat staleness (ClusterConfig::heartbeat_s): the state the worker
  // last published (after a step, as the real loop does before it reads new
  // tasks; a prefill or colocated worker also at a step's start, as
  // PrefillRole::SaveLayer does during one) and the latest publication at or
  // before the heartbeat tick that preceded it.
  struct Snapshot {
    double time = -1e300;
    int64_t queued_tokens = 0, running = 0, queued_requests = 0, free_kv_blocks = 0;
  };
  Snapshot published, at_tick;
  // The coordinator's own accounting on top of the last heartbeat ("queue
  // accounting until the next heartbeat refreshes it"): prompt tokens it
  // routed here and KV blocks it reserved here since the tick `routed_tick`.
  double routed_tick = -1;
  int64_t routed_tokens = 0;
  int64_t reserved_blocks = 0;
  bool view_dirty = false;  // in Simulator::dirty_views_: its router view is recomputed
  // Prompt tokens / requests submitted during the current step: the real
  // loop has not read them yet when it publishes after the step.
  int64_t submitted_in_step = 0;
  int64_t requests_in_step = 0;
  int64_t queued_tokens = 0;
  std::unique_ptr<BlockLru> cache;  // pool prefix cache (prefill / colocated)
  std::unique_ptr<BlockLru> store;  // spill tier
  std::vector<std::pair<std::pair<int, uint64_t>, size_t>> keys_scratch;
  std::vector<Seq> running_scratch;
};

}  // namespace

double FairLevel(std::vector<CoreDemand>& demands, double cores) {
  // By the level at which each one is satisfied (cores / weight), ascending:
  // while the next one is satisfied below the even level of what is left,
  // it takes its cores whole.
  std::sort(demands.begin(), demands.end(), [](const CoreDemand& a, const CoreDemand& b) {
    return a.cores / a.weight < b.cores / b.weight;
  });
  double left = cores, weights = 0;
  for (const CoreDemand& d : demands) weights += d.weight;
  for (const CoreDemand& d : demands) {
    const double even = left / weights;
    if (d.cores / d.weight > even) return even;
    left -= d.cores;
    weights -= d.weight;
  }
  return std::numeric_limits<double>::infinity();
}

namespace {

// Prompt tokens of s not computed yet (what a worker reports as queued).
int64_t PendingPrompt(const Seq& s) { return s.prompt - std::min(s.computed, s.prompt); }

struct ReqState {
  RequestTiming t;
  int64_t kept_blocks = 0;  // prefill side: blocks held until the KV has landed
  int64_t reserved_blocks = 0;
  double restore_s = 0;
  double restore_until_s = 0;  // restore-before-submit: not admitted before this
};

class Simulator {
 public:
  Simulator(const Profile& p, const ClusterConfig& c, const std::vector<SimRequest>& w,
            const SimOptions& o)
      : profile_(p),
        config_(c),
        workload_(w),
        options_(o),
        router_(coordinator::RouterOptions{c.router}),
        admission_({c.coordinator_max_running, c.coordinator_max_queue}) {}

  Result<SimResult> Run();

 private:
  void Setup();
  void ApplyJitter(size_t i, RequestTiming* t) const;
  void OnArrival(uint32_t r);
  void OnStart(uint32_t r);
  void Submit(Worker& w, uint32_t r);
  void MaybeStep(size_t wi);
  bool Schedule(Worker& w);
  void OnStepEnd(size_t wi, uint64_t version);
  void Rerate();
  // The serving path's CPU (Profile::serving_cpu) on a shared host: `seconds`
  // more solo work for service i (0 the coordinator, 1 the client).
  void AddServiceWork(size_t i, double seconds);
  void OnServiceDone(size_t i, uint64_t version);
  void OnKvReady(uint32_t r);
  void Finish(uint32_t r, double t);
  void Reject(uint32_t r);
  void ReleaseFollowers(uint32_t r);  // closed-loop ones (SimRequest::after)
  PrefixBlockHash HashOf(uint32_t r, int64_t block) const;
  int64_t MatchPrefix(Worker& w, uint32_t r, int64_t prompt, double* restore_s);
  bool EnsureBlocks(Worker& w, Seq& s, int64_t chunk);
  void Preempt(Worker& w, size_t index);
  void Commit(Worker& w, Seq& s);
  void SyncInfo(Worker& w);
  void Publish(Worker& w);
  // The last heartbeat tick at or before t.
  double LastTick(double t) const {
    const double hb = config_.heartbeat_s, phase = config_.heartbeat_phase_s;
    return phase + std::floor((t - phase) / hb) * hb;
  }
  void RefreshViews();
  void RefreshView(Worker& w, double tick);
  void MarkViewDirty(size_t wi) {
    if (workers_[wi].view_dirty) return;
    workers_[wi].view_dirty = true;
    dirty_views_.push_back(wi);
  }
  int64_t BlocksFor(int64_t tokens) const {
    return (tokens + profile_.block_tokens - 1) / profile_.block_tokens;
  }

  const Profile& profile_;
  const ClusterConfig& config_;
  const std::vector<SimRequest>& workload_;
  const SimOptions& options_;
  coordinator::Router router_;
  coordinator::AdmissionQueue admission_;
  EventQueue events_;
  std::vector<Worker> workers_;
  std::vector<WorkerInfo> infos_;  // what the router sees, updated in place
  std::vector<const WorkerInfo*> prefill_candidates_, decode_candidates_;
  std::unordered_map<std::string, size_t> by_id_;
  std::vector<ReqState> reqs_;
  uint64_t next_order_ = 0;
  // Heartbeats: the tick the router views were last computed for, and the
  // workers whose view may have changed since (a publication, a routing).
  double views_tick_ = -1e300;
  std::vector<size_t> dirty_views_;
  std::vector<size_t> stepping_;  // workers inside a step (shared_host_cores only)
  double busy_cores_ = 0;         // the cores they keep busy
  // The coordinator and the client as fluid processes of one core each, busy
  // while they have serving work left (shared_host_cores and a profile with
  // serving_cpu only).
  struct Service {
    double per_request_s = 0, per_token_s = 0;
    bool busy = false;
    double work_left = 0, rate = 0, since = 0;
    uint64_t version = 0;
  };
  Service services_[2];
  std::vector<CoreDemand> demands_;  // Rerate's scratch: the busy services and workers
  // Closed-loop requests (SimRequest::after), empty when there are none:
  // (predecessor, follower) sorted, and each open-loop request's next one.
  std::vector<std::pair<uint32_t, uint32_t>> follows_;
  std::vector<uint32_t> next_open_;
  double worker_cpu_s_ = 0, serving_cpu_s_ = 0;
  int64_t preemptions_ = 0, transfers_ = 0;
  double transfer_bytes_ = 0;
};

// ServingOverhead::ttft_jitter / tpot_jitter: request i's factors, drawn at
// uniforms hashed from its index and SimOptions::jitter_seed (the same run
// gives the same figures).
void Simulator::ApplyJitter(size_t i, RequestTiming* t) const {
  const bool colocated =
      t->prefill_worker >= 0 &&
      workers_[static_cast<size_t>(t->prefill_worker)].kind == Worker::Kind::kColocated;
  const auto& ttft = colocated ? profile_.colocated.ttft_jitter : profile_.prefill.ttft_jitter;
  const auto& tpot = colocated ? profile_.colocated.tpot_jitter : profile_.decode.tpot_jitter;
  if (ttft.empty() && tpot.empty()) return;
  auto uniform = [](uint64_t x) {  // splitmix64 finaliser -> [0, 1)
    x += 0x9e3779b97f4a7c15ULL;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    x ^= x >> 31;
    return static_cast<double>(x >> 11) * 0x1.0p-53;
  };
  const double service =
      t->prefill_start_s >= 0 ? std::max(0.0, t->first_token_s - t->prefill_start_s) : 0;
  const double decode = std::max(0.0, t->finish_s - t->first_token_s);
  const uint64_t key = 2 * i + (options_.jitter_seed << 40);
  const double ttft_extra = (JitterQuantile(ttft, uniform(key)) - 1) * service;
  const double tpot_extra = (JitterQuantile(tpot, uniform(key + 1)) - 1) * decode;
  t->first_token_s += ttft_extra;
  t->finish_s += ttft_extra + tpot_extra;
}

void Simulator::Setup() {
  auto add = [&](Worker::Kind kind, const std::string& id, const ServingOverhead& o, double scale,
                 double add_s, int64_t capacity) {
    Worker w;
    w.kind = kind;
    w.id = id;
    w.capacity_blocks = capacity;
    w.step_scale = o.step_scale * scale;
    w.prefill_scale = o.prefill_scale * scale;
    w.step_add_s = o.step_add_s + add_s;
    w.ttft_add_s = o.ttft_s;
    // The roles' busy_alpha was measured in 1P+1D (TP 1): next to a TP group
    // (its ranks block in the collectives) the prefill's is the group's
    // TpCost::prefill_busy_alpha (the contention mix when not measured); a
    // TP group has its own busy_alpha (TpCost).
    const double alpha = kind == Worker::Kind::kPrefill && config_.tp > 1
                             ? profile_.Tp(config_.tp).prefill_busy_alpha
                             : o.busy_alpha;
    if (alpha >= 0 && kind != Worker::Kind::kColocated) w.tp_alpha = alpha;
    if (kind != Worker::Kind::kDecode) {
      w.cache = std::make_unique<BlockLru>(capacity);
      w.store = std::make_unique<BlockLru>(config_.store_blocks);
    }
    WorkerInfo info;
    info.id = id;
    info.role = kind == Worker::Kind::kColocated ? WorkerRole::kColocated
                : kind == Worker::Kind::kPrefill ? WorkerRole::kPrefill
                                                 : WorkerRole::kDecode;
    info.block_tokens = profile_.block_tokens;
    info.total_kv_blocks = capacity;
    info.free_kv_blocks = capacity;
    w.info = infos_.size();
    infos_.push_back(info);
    w.published.free_kv_blocks = w.at_tick.free_kv_blocks = capacity;  // as registered
    by_id_[id] = workers_.size();
    workers_.push_back(std::move(w));
  };
  char id[64];
  for (int i = 0; i < config_.colocated; ++i) {
    std::snprintf(id, sizeof(id), "worker-%05d", i);
    add(Worker::Kind::kColocated, id, profile_.colocated, 1.0, 0.0, profile_.kv_pool_blocks);
  }
  for (int i = 0; i < config_.prefill; ++i) {
    std::snprintf(id, sizeof(id), "prefill-%05d", i);
    add(Worker::Kind::kPrefill, id, profile_.prefill, 1.0, 0.0, profile_.kv_pool_blocks);
  }
  const TpCost tp = profile_.Tp(config_.tp);
  for (int i = 0; i < config_.decode; ++i) {
    std::snprintf(id, sizeof(id), "decode-%05d", i);
    add(Worker::Kind::kDecode, id, profile_.decode, tp.step_scale, tp.per_step_s,
        profile_.kv_pool_blocks);
    workers_.back().cores = tp.cores > 0 ? tp.cores : config_.tp;
    if (config_.tp > 1) {
      workers_.back().tp_alpha = tp.busy_alpha;
      workers_.back().share_weight = tp.share_weight;
    }
  }
  if (config_.shared_host_cores > 0) {
    const ServingCpu& s = profile_.serving_cpu;
    services_[0].per_request_s = s.coordinator_per_request_s;
    services_[0].per_token_s = s.coordinator_per_token_s;
    services_[1].per_request_s = s.client_per_request_s;
    services_[1].per_token_s = s.client_per_token_s;
  }
  prefill_candidates_ = coordinator::RoutingCandidates(infos_, WorkerRole::kPrefill);
  decode_candidates_ = coordinator::RoutingCandidates(infos_, WorkerRole::kDecode);
  reqs_.resize(workload_.size());
  for (size_t i = 0; i < workload_.size(); ++i) {
    reqs_[i].t.arrival_s = workload_[i].arrival_s;
    if (workload_[i].after >= 0) {
      follows_.emplace_back(static_cast<uint32_t>(workload_[i].after), static_cast<uint32_t>(i));
    }
  }
  if (follows_.empty()) return;
  std::sort(follows_.begin(), follows_.end());
  next_open_.assign(workload_.size(), static_cast<uint32_t>(workload_.size()));
  uint32_t next = static_cast<uint32_t>(workload_.size());
  for (size_t i = workload_.size(); i-- > 0;) {
    next_open_[i] = next;
    if (workload_[i].after < 0) next = static_cast<uint32_t>(i);
  }
}

// Request r has finished or was refused: its closed-loop followers arrive.
void Simulator::ReleaseFollowers(uint32_t r) {
  const double done = std::max(events_.now(), reqs_[r].t.finish_s);
  auto it = std::lower_bound(follows_.begin(), follows_.end(), std::pair<uint32_t, uint32_t>{r, 0});
  for (; it != follows_.end() && it->first == r; ++it) {
    const double at = done + workload_[it->second].arrival_s;
    reqs_[it->second].t.arrival_s = at;
    events_.Push(at, kArrival, 0, it->second);
  }
}

PrefixBlockHash Simulator::HashOf(uint32_t r, int64_t block) const {
  const SimRequest& q = workload_[r];
  const bool shared = q.prefix_group >= 0 && (block + 1) * profile_.block_tokens <= q.prefix_tokens;
  return BlockHash(shared ? static_cast<uint64_t>(q.prefix_group) : r, shared, block);
}

// Heartbeats: a worker publishes its state after each step (a prefill or
// colocated worker also at its start, MaybeStep); every
// heartbeat_s (ticks at multiples of it) the coordinator receives the latest
// publication. Publish keeps `at_tick` = the latest publication at or before
// the last tick preceding `published`.
void Simulator::Publish(Worker& w) {
  const double now = events_.now();
  if (LastTick(now) >= w.published.time) w.at_tick = w.published;
  w.published.time = now;
  w.published.queued_tokens = std::max<int64_t>(0, w.queued_tokens - w.submitted_in_step);
  w.published.running = static_cast<int64_t>(w.running.size());
  w.published.queued_requests =
      std::max<int64_t>(0, static_cast<int64_t>(w.waiting.size()) - w.requests_in_step);
  w.published.free_kv_blocks = w.capacity_blocks - w.used_blocks;
}

// The router's view now, as coordinator/cluster/cluster_backend_state.h keeps it:
// what the last heartbeat tick carried, plus the prompt tokens routed to and
// the blocks reserved on each worker since that tick.
// A view is a function of the tick, the worker's publications and the
// coordinator's accounting since the tick, so only a new tick (every worker)
// or a worker's publication or routing (that worker) changes it: recomputing
// those alone is the same as recomputing all of them at every decision
// (O(workers) per tick instead of per request).
void Simulator::RefreshViews() {
  const double tick = LastTick(events_.now());
  if (tick != views_tick_) {
    views_tick_ = tick;
    for (Worker& w : workers_) RefreshView(w, tick);
  } else {
    for (size_t wi : dirty_views_) RefreshView(workers_[wi], tick);
  }
  for (size_t wi : dirty_views_) workers_[wi].view_dirty = false;
  dirty_views_.clear();
}

void Simulator::RefreshView(Worker& w, double tick) {
  if (w.routed_tick != tick) {  // a heartbeat since: it replaced the accounting
    w.routed_tick = tick;
    w.routed_tokens = 0;
    w.reserved_blocks = 0;
  }
  const Worker::Snapshot& v = tick >= w.published.time ? w.published : w.at_tick;
  WorkerInfo& info = infos_[w.info];
  info.queued_tokens = v.queued_tokens + w.routed_tokens;
  info.running = v.running;
  info.queued_requests = v.queued_requests;
  info.free_kv_blocks = v.free_kv_blocks - w.reserved_blocks;
}

void Simulator::SyncInfo(Worker& w) {
  if (config_.heartbeat_s > 0) return;  // the router sees heartbeats (RefreshViews)
  WorkerInfo& info = infos_[w.info];
  info.queued_tokens = w.queued_tokens;
  info.running = static_cast<int64_t>(w.running.size());
  info.queued_requests = static_cast<int64_t>(w.waiting.size());
  info.free_kv_blocks = w.capacity_blocks - w.used_blocks;
}

void Simulator::OnArrival(uint32_t r) {
  if (workload_[r].after < 0) {  // the next open-loop request
    const uint32_t next = next_open_.empty() ? r + 1 : next_open_[r];
    if (next < workload_.size()) events_.Push(workload_[next].arrival_s, kArrival, 0, next);
  }
  for (size_t i = 0; i < 2; ++i) AddServiceWork(i, services_[i].per_request_s);
  // Admission runs `start` inline when a slot is free and from Release()
  // otherwise; the start itself is an event at the same instant so a routing
  // failure's Release never recurses.
  Status s = admission_.Enqueue(r, [this, r] { events_.Push(events_.now(), kStart, 0, r); });
  if (!s.ok()) Reject(r);
}

void Simulator::Reject(uint32_t r) {
  reqs_[r].t.rejected = true;
  reqs_[r].t.finish_s = events_.now();
  if (!follows_.empty()) ReleaseFollowers(r);
}

void Simulator::OnStart(uint32_t r) {
  ReqState& st = reqs_[r];
  const SimRequest& q = workload_[r];
  st.t.start_s = events_.now();
  std::vector<PrefixBlockHash> chain;
  chain.reserve(static_cast<size_t>(q.prompt_tokens / profile_.block_tokens));
  for (int64_t b = 0; b < q.prompt_tokens / profile_.block_tokens; ++b) {
    chain.push_back(HashOf(r, b));
  }
  if (config_.heartbeat_s > 0) RefreshViews();
  coordinator::RouteRequest route;
  route.prefix_blocks = chain;
  route.prompt_tokens = q.prompt_tokens;
  route.max_new_tokens = q.output_tokens;
  auto p = router_.PickPrefillAmong(route, prefill_candidates_);
  if (!p.ok()) {
    Reject(r);
    admission_.Release(r);
    return;
  }
  const size_t pw = by_id_.at(*p);
  st.t.prefill_worker = static_cast<int32_t>(pw);
  if (config_.heartbeat_s > 0) {
    workers_[pw].routed_tokens += q.prompt_tokens;
    MarkViewDirty(pw);
  }
  if (workers_[pw].kind != Worker::Kind::kColocated) {
    auto d = router_.PickDecodeAmong(route, decode_candidates_);
    if (!d.ok()) {
      Reject(r);
      admission_.Release(r);
      return;
    }
    const size_t dw = by_id_.at(*d);
    st.t.decode_worker = static_cast<int32_t>(dw);
    // One hop (issue #39): the decode reservation and the prefill task leave
    // together, so the prefill starts now and the decode group's blocks for
    // prompt + output are held from now; no reply is waited for.
    st.reserved_blocks = BlocksFor(q.prompt_tokens + q.output_tokens);
    workers_[dw].used_blocks += st.reserved_blocks;
    if (config_.heartbeat_s > 0) {
      workers_[dw].reserved_blocks += st.reserved_blocks;
      MarkViewDirty(dw);
    }
    SyncInfo(workers_[dw]);
  } else {
    st.t.decode_worker = static_cast<int32_t>(pw);
  }
  Submit(workers_[pw], r);
}

void Simulator::Submit(Worker& w, uint32_t r) {
  const SimRequest& q = workload_[r];
  Seq s;
  s.req = r;
  s.order = next_order_++;
  s.prompt = q.prompt_tokens;
  s.tokens = q.prompt_tokens;
  s.max_generate = w.kind == Worker::Kind::kPrefill ? 1 : q.output_tokens;
  w.queued_tokens += q.prompt_tokens;
  if (w.stepping) {
    w.submitted_in_step += q.prompt_tokens;
    ++w.requests_in_step;
  }
  w.waiting.push_back(s);
  SyncInfo(w);
  MaybeStep(by_id_.at(w.id));
}

int64_t Simulator::MatchPrefix(Worker& w, uint32_t r, int64_t prompt, double* restore_s) {
  *restore_s = 0;
  if (!w.cache) return 0;
  // At least one prompt token is computed (its logits sample the first token).
  const int64_t max_blocks = (prompt - 1) / profile_.block_tokens;
  int64_t n = 0;
  while (n < max_blocks) {
    PrefixBlockHash h = HashOf(r, n);
    if (!w.cache->Contains(h)) break;
    w.cache->Touch(h);
    ++n;
  }
  int64_t restored = 0;
  while (n + restored < max_blocks && w.store->Contains(HashOf(r, n + restored))) ++restored;
  if (restored > 0) {
    *restore_s = profile_.store_restore.Seconds(
        static_cast<double>(restored * profile_.block_tokens * profile_.kv_bytes_per_token));
    for (int64_t b = n; b < n + restored; ++b) {
      PrefixBlockHash evicted;
      PrefixBlockHash h = HashOf(r, b);
      if (w.cache->Insert(h, &evicted)) {
        router_.prefix_index().OnEvicted(w.id, evicted);
        PrefixBlockHash spilled;
        w.store->Insert(evicted, &spilled);
      }
      router_.prefix_index().OnStored(w.id, h);
    }
  }
  return n + restored;
}

bool Simulator::EnsureBlocks(Worker& w, Seq& s, int64_t chunk) {
  if (s.reserved) return true;
  const int64_t need = BlocksFor(s.computed + chunk) - s.shared_blocks - s.own_blocks;
  if (need <= 0) return true;
  if (w.used_blocks + need > w.capacity_blocks) return false;
  w.used_blocks += need;
  s.own_blocks += need;
  return true;
}

void Simulator::Preempt(Worker& w, size_t index) {
  Seq s = w.running[index];
  w.running.erase(w.running.begin() + static_cast<long>(index));
  w.used_blocks -= s.own_blocks;
  s.own_blocks = 0;
  s.shared_blocks = 0;
  s.committed = 0;
  w.queued_tokens += s.prompt - PendingPrompt(s);
  s.computed = 0;  // recomputed later: prompt + the tokens generated so far
  s.chunk = 0;
  w.waiting.push_front(s);
  ++preemptions_;
}

// engine::Engine::Impl::Schedule, on the model's sequences.
bool Simulator::Schedule(Worker& w) {
  int64_t budget = profile_.max_step_tokens;
  for (auto& s : w.running) s.chunk = 0;
  // Decoding sequences (one pending token) first, then prefill chunks; oldest
  // first within each.
  auto& keys = w.keys_scratch;
  keys.clear();
  for (size_t i = 0; i < w.running.size(); ++i) {
    const Seq& s = w.running[i];
    keys.push_back({{s.tokens - s.computed <= 1 ? 0 : 1, s.order}, i});
  }
  std::sort(keys.begin(), keys.end());
  bool mutated = false;  // a preemption moved the sequences: look them up by order
  auto find = [&](uint64_t ord) -> long {
    for (size_t i = 0; i < w.running.size(); ++i) {
      if (w.running[i].order == ord) return static_cast<long>(i);
    }
    return -1;
  };
  for (const auto& k : keys) {
    if (budget <= 0) break;
    const uint64_t ord = k.first.second;
    long i = mutated ? find(ord) : static_cast<long>(k.second);
    if (i < 0) continue;  // preempted for an older one
    const int64_t chunk = std::min<int64_t>(w.running[i].tokens - w.running[i].computed, budget);
    bool ok = EnsureBlocks(w, w.running[i], chunk);
    while (!ok) {
      size_t youngest = 0;
      for (size_t j = 1; j < w.running.size(); ++j) {
        if (w.running[j].order > w.running[youngest].order) youngest = j;
      }
      if (w.running[youngest].order == ord) break;
      budget += w.running[youngest].chunk;
      Preempt(w, youngest);
      mutated = true;
      i = find(ord);
      ok = EnsureBlocks(w, w.running[i], chunk);
    }
    if (!ok) {
      Preempt(w, static_cast<size_t>(i));
      mutated = true;
      continue;
    }
    w.running[i].chunk = chunk;
    budget -= chunk;
  }
  // Admit waiting sequences (FCFS) while there is room; no preemption for
  // admission: a new request waits until blocks free up.
  while (budget > 0 && !w.waiting.empty() &&
         static_cast<int64_t>(w.running.size()) < profile_.max_running) {
    Seq& s = w.waiting.front();
    ReqState& st = reqs_[s.req];
    if (events_.now() < st.restore_until_s) break;  // its prefix is still being restored
    if (s.computed == 0 && s.shared_blocks == 0 && w.cache) {
      double restore_s = 0;
      const int64_t hit = MatchPrefix(w, s.req, s.tokens, &restore_s);
      if (restore_s > 0) {
        // Restore-before-submit: the request enters the engine once its
        // blocks are back in the pool; it keeps its place at the queue head.
        st.restore_s += restore_s;
        st.restore_until_s = events_.now() + restore_s;
        events_.Push(st.restore_until_s, kRestoreDone, static_cast<uint32_t>(w.info), s.req);
        break;
      }
      s.shared_blocks = hit;
      s.committed = std::min(hit, s.prompt / profile_.block_tokens);
      const int64_t before = PendingPrompt(s);
      s.computed = hit * profile_.block_tokens;
      w.queued_tokens -= before - PendingPrompt(s);
      if (st.t.prefill_start_s < 0) st.t.cached_tokens = s.computed;
    }
    const int64_t chunk = std::min<int64_t>(s.tokens - s.computed, budget);
    if (!EnsureBlocks(w, s, chunk)) {
      // Wait for blocks; the match is redone at the next try.
      w.queued_tokens += s.prompt - PendingPrompt(s);
      s.computed = 0;
      s.committed = 0;
      s.shared_blocks = 0;
      break;
    }
    s.chunk = chunk;
    budget -= chunk;
    w.running.push_back(s);
    w.waiting.pop_front();
  }
  return std::any_of(w.running.begin(), w.running.end(), [](const Seq& s) { return s.chunk > 0; });
}

void Simulator::MaybeStep(size_t wi) {
  Worker& w = workers_[wi];
  if (w.stepping) return;
  if (!Schedule(w)) {
    SyncInfo(w);
    return;
  }
  double decode_seqs = 0, prefill_seqs = 0, prefill_tokens = 0, attn = 0, ctx_attn = 0,
         decode_attn = 0;
  const double now = events_.now();
  for (const auto& s : w.running) {
    if (s.chunk == 0) continue;
    const double c = static_cast<double>(s.chunk);
    const double cached = c * static_cast<double>(s.computed), own = c * (c + 1) / 2;
    if (s.tokens - s.computed <= 1) {
      decode_seqs += 1;
      decode_attn += cached + own;
    } else {
      prefill_seqs += 1;
      prefill_tokens += c;
      attn += own;
      ctx_attn += cached;
    }
    ReqState& st = reqs_[s.req];
    if (st.t.prefill_start_s < 0) st.t.prefill_start_s = now;
  }
  const StepCost& k = profile_.step;
  // A decode-only step costs what the engine measured for its batch size
  // (StepCost::decode_batch_s); with a prefill chunk, its decode tokens ride
  // in the chunk's matmuls (the linear model).
  const double fixed =
      w.step_scale * (prefill_seqs == 0
                          ? k.DecodeOnlySeconds(static_cast<int64_t>(decode_seqs), decode_attn)
                          : k.Seconds(decode_seqs, decode_seqs, 0, decode_attn)) +
      w.step_add_s;
  const double prefill =
      w.prefill_scale * (k.per_seq_s * prefill_seqs + k.per_token_s * prefill_tokens +
                         k.per_attn_s * attn + k.per_ctx_attn_s * ctx_attn);
  const double d = fixed + prefill;
  worker_cpu_s_ += d * w.cores;
  w.stepping = true;
  w.submitted_in_step = 0;
  w.requests_in_step = 0;
  SyncInfo(w);
  if (config_.heartbeat_s > 0 && w.kind != Worker::Kind::kDecode) {
    // A prefill or colocated worker's role is its engine's KV connector and
    // publishes again after every layer of a step (PrefillRole::SaveLayer):
    // a heartbeat during a prefill carries the prompt it is computing. Taken
    // at the step's start (the real one comes after the first layer).
    Publish(w);
    MarkViewDirty(wi);
  }
  if (config_.shared_host_cores <= 0) {
    events_.Push(now + d, kStepEnd, static_cast<uint32_t>(wi), w.version);
    return;
  }
  w.work_left = d;
  w.since = now;
  w.rate = 0;  // Rerate schedules its end
  if (!std::isnan(w.tp_alpha)) {
    w.alpha = w.tp_alpha;
  } else {
    const double mixed =
        fixed * profile_.contention.decode_alpha + prefill * profile_.contention.prefill_alpha;
    w.alpha = d > 0 ? mixed / d : 0;
  }
  stepping_.push_back(wi);
  busy_cores_ += w.cores;
  Rerate();
}

// The fluid model of ClusterConfig::shared_host_cores: brings every stepping
// worker's remaining work up to now at its old rate, then gives each its new
// rate and (when that changed) a new step-end event; the superseded event
// carries an old version and is ignored.
void Simulator::Rerate() {
  const double now = events_.now();
  const double n = config_.shared_host_cores;
  demands_.clear();
  for (const Service& s : services_) {
    if (s.busy) demands_.push_back({1.0, 1.0});
  }
  for (size_t wi : stepping_) demands_.push_back({workers_[wi].cores, workers_[wi].share_weight});
  const double level = FairLevel(demands_, n);
  for (size_t i = 0; i < 2; ++i) {
    Service& s = services_[i];
    if (!s.busy) continue;
    s.work_left = std::max(0.0, s.work_left - s.rate * (now - s.since));
    s.since = now;
    const double share = std::min(1.0, level);
    if (share == s.rate) continue;
    s.rate = share;
    ++s.version;
    events_.Push(now + s.work_left / share, kServiceDone, static_cast<uint32_t>(i), s.version);
  }
  for (size_t wi : stepping_) {
    Worker& w = workers_[wi];
    w.work_left = std::max(0.0, w.work_left - w.rate * (now - w.since));
    w.since = now;
    const double others = std::max(0.0, std::min(busy_cores_ - w.cores, n - w.cores));
    const double rate = std::min(1.0, w.share_weight * level / w.cores) / (1 + w.alpha * others);
    if (rate == w.rate) continue;
    w.rate = rate;
    ++w.version;
    events_.Push(now + w.work_left / rate, kStepEnd, static_cast<uint32_t>(wi), w.version);
  }
}

void Simulator::AddServiceWork(size_t i, double seconds) {
  if (!(seconds > 0)) return;  // none, or not on a shared host (Setup left it 0)
  Service& s = services_[i];
  serving_cpu_s_ += seconds;
  const double now = events_.now();
  if (s.busy) {
    s.work_left = std::max(0.0, s.work_left - s.rate * (now - s.since)) + seconds;
    s.since = now;
    ++s.version;
    events_.Push(now + s.work_left / s.rate, kServiceDone, static_cast<uint32_t>(i), s.version);
    return;
  }
  s.busy = true;
  s.work_left = seconds;
  s.since = now;
  s.rate = 0;  // Rerate schedules its end
  Rerate();
}

void Simulator::OnServiceDone(size_t i, uint64_t version) {
  Service& s = services_[i];
  if (!s.busy || version != s.version) return;  // more work or a new rate since
  s.busy = false;
  s.work_left = 0;
  Rerate();
}

void Simulator::Commit(Worker& w, Seq& s) {
  if (!w.cache) return;
  const int64_t full = std::min(s.computed, s.prompt) / profile_.block_tokens;
  for (; s.committed < full; ++s.committed) {
    PrefixBlockHash h = HashOf(s.req, s.committed);
    PrefixBlockHash evicted;
    if (w.cache->Insert(h, &evicted)) {
      router_.prefix_index().OnEvicted(w.id, evicted);
      PrefixBlockHash spilled;
      w.store->Insert(evicted, &spilled);
    }
    router_.prefix_index().OnStored(w.id, h);
  }
}

void Simulator::OnStepEnd(size_t wi, uint64_t version) {
  Worker& w = workers_[wi];
  if (!w.stepping || version != w.version) return;  // re-rated since: a later event ends it
  w.stepping = false;
  if (config_.shared_host_cores > 0) {
    stepping_.erase(std::find(stepping_.begin(), stepping_.end(), wi));
    busy_cores_ -= w.cores;
    if (stepping_.empty()) busy_cores_ = 0;  // no drift from the sums
    Rerate();
  }
  const double now = events_.now();
  std::vector<Seq>& still = w.running_scratch;
  still.clear();
  int64_t tokens = 0;  // sampled in this step (each one streamed to the client)
  for (auto& s : w.running) {
    if (s.chunk > 0) {
      const int64_t before = PendingPrompt(s);
      s.computed += s.chunk;
      w.queued_tokens -= before - PendingPrompt(s);
      Commit(w, s);
      s.chunk = 0;
      if (s.computed == s.tokens) {
        ++s.generated;
        ++tokens;
        ReqState& st = reqs_[s.req];
        if (s.generated == 1 && w.kind != Worker::Kind::kDecode && st.t.first_token_s < 0) {
          st.t.first_token_s = now + w.ttft_add_s;
        }
        st.t.output_tokens = std::max(st.t.output_tokens, s.generated);
        if (s.generated >= s.max_generate) {
          if (w.kind == Worker::Kind::kPrefill) {
            st.kept_blocks = s.own_blocks;  // held until the KV has landed
            const SimRequest& q = workload_[s.req];
            if (q.output_tokens <= 1) {
              w.used_blocks -= st.kept_blocks;
              st.kept_blocks = 0;
              Worker& d = workers_[static_cast<size_t>(st.t.decode_worker)];
              d.used_blocks -= st.reserved_blocks;
              SyncInfo(d);
              Finish(s.req, st.t.first_token_s);
              continue;
            }
            // KV transfer over this worker's link.
            const LinkCost& link = profile_.Link();
            const double bytes = static_cast<double>(q.prompt_tokens) *
                                 static_cast<double>(profile_.kv_bytes_per_token);
            const double busy = bytes / link.bytes_per_s;
            double done;
            if (profile_.layerwise_transfer) {
              const double start = std::max(w.link_free_s, st.t.prefill_start_s);
              w.link_free_s = start + busy;
              done = std::max(now + link.latency_s + busy / profile_.layers,
                              w.link_free_s + link.latency_s);
            } else {
              const double start = std::max(w.link_free_s, now);
              w.link_free_s = start + busy;
              done = w.link_free_s + link.latency_s;
            }
            ++transfers_;
            transfer_bytes_ += bytes;
            // The first token travels with the KV (the hand-over frame): the
            // decode group admits it after its own calibrated hand-off
            // latency, with no coordinator hop in between.
            done += workers_[static_cast<size_t>(st.t.decode_worker)].ttft_add_s;
            events_.Push(done, kKvReady, 0, s.req);
          } else {
            w.used_blocks -= s.own_blocks;
            if (s.reserved) w.used_blocks -= reqs_[s.req].reserved_blocks;
            // The prefill (or colocated) side's ttft_s, what of a TTFT does
            // not hold its worker (HTTP, routing, the way back to the client),
            // delays every token the client sees, not only the first: without
            // it here a calibration's ttft_s of 101 ms took 3.3 ms off every
            // simulated 1P+1D TPOT of 32 tokens (validation round 12).
            const int32_t pw = reqs_[s.req].t.prefill_worker;
            Finish(s.req, now + (pw >= 0 ? workers_[static_cast<size_t>(pw)].ttft_add_s : 0.0));
          }
          continue;
        }
        ++s.tokens;  // the sampled token is the next one to compute
      }
    }
    still.push_back(s);
  }
  w.running.swap(still);
  for (size_t i = 0; i < 2; ++i) {
    AddServiceWork(i, services_[i].per_token_s * static_cast<double>(tokens));
  }
  SyncInfo(w);
  if (config_.heartbeat_s > 0) {
    Publish(w);
    MarkViewDirty(wi);
  }
  MaybeStep(wi);
}

void Simulator::OnKvReady(uint32_t r) {
  ReqState& st = reqs_[r];
  Worker& p = workers_[static_cast<size_t>(st.t.prefill_worker)];
  p.used_blocks -= st.kept_blocks;
  st.kept_blocks = 0;
  SyncInfo(p);
  MaybeStep(static_cast<size_t>(st.t.prefill_worker));
  const size_t dw = static_cast<size_t>(st.t.decode_worker);
  Worker& d = workers_[dw];
  const double now = events_.now();
  st.t.kv_ready_s = now;
  const SimRequest& q = workload_[r];
  Seq s;
  s.req = r;
  s.order = next_order_++;
  s.prompt = q.prompt_tokens;
  s.tokens = q.prompt_tokens + 1;  // + the first token, sampled by the prefill side
  s.computed = q.prompt_tokens;
  s.generated = 1;
  s.max_generate = q.output_tokens;
  s.reserved = true;
  d.running.push_back(s);
  SyncInfo(d);
  MaybeStep(dw);
}

void Simulator::Finish(uint32_t r, double t) {
  ReqState& st = reqs_[r];
  st.t.finish_s = std::max(t, st.t.first_token_s);
  admission_.Release(r);
  if (!follows_.empty()) ReleaseFollowers(r);
}

Result<SimResult> Simulator::Run() {
  RETURN_IF_ERROR(profile_.Validate());
  RETURN_IF_ERROR(config_.Validate());
  if (config_.tp > 1 && !profile_.tp.count(config_.tp)) {
    return InvalidArgument("profile has no cost for decode TP " + std::to_string(config_.tp) +
                           " (profile.tp." + std::to_string(config_.tp) + ")");
  }
  if (workload_.empty()) return InvalidArgument("empty workload");
  if (workload_.size() > UINT32_MAX) return InvalidArgument("workload too large");
  for (size_t i = 0; i < workload_.size(); ++i) {
    const SimRequest& q = workload_[i];
    if (q.after >= static_cast<int64_t>(i) || (q.after >= 0 && !(q.arrival_s >= 0))) {
      return InvalidArgument("workload: request " + std::to_string(i) +
                             " follows a later request or itself, or after a negative delay");
    }
    if (q.prompt_tokens < 1 || q.output_tokens < 1) {
      return InvalidArgument("workload: prompt and output tokens must be >= 1");
    }
    if (BlocksFor(q.prompt_tokens + q.output_tokens) > profile_.kv_pool_blocks) {
      return InvalidArgument("workload: a request of " + std::to_string(q.prompt_tokens) + "+" +
                             std::to_string(q.output_tokens) +
                             " tokens does not fit one worker's KV pool");
    }
  }
  Setup();
  events_.Push(workload_[0].arrival_s, kArrival, 0, 0);
  while (!events_.empty()) {
    const Event e = events_.Pop();
    switch (e.kind) {
      case kArrival:
        OnArrival(static_cast<uint32_t>(e.arg));
        break;
      case kStart:
        OnStart(static_cast<uint32_t>(e.arg));
        break;
      case kStepEnd:
        OnStepEnd(e.target, e.arg);
        break;
      case kKvReady:
        OnKvReady(static_cast<uint32_t>(e.arg));
        break;
      case kRestoreDone:
        MaybeStep(e.target);
        break;
      case kServiceDone:
        OnServiceDone(e.target, e.arg);
        break;
    }
  }
  SimResult out;
  std::vector<double> ttft, tpot, e2e;
  double first = workload_.front().arrival_s, last = first;
  int64_t out_tokens = 0;
  for (size_t i = 0; i < reqs_.size(); ++i) {
    RequestTiming& t = reqs_[i].t;
    if (t.rejected || t.finish_s < 0) {
      ++out.rejected;
      continue;
    }
    ApplyJitter(i, &t);
    ++out.completed;
    last = std::max(last, t.finish_s);
    out_tokens += t.output_tokens;
    out.prompt_tokens += workload_[i].prompt_tokens;
    out.cached_tokens += t.cached_tokens;
    ttft.push_back(t.ttft_s() * 1e3);
    tpot.push_back(t.tpot_s() * 1e3);
    e2e.push_back(t.e2e_s() * 1e3);
    const bool good = (options_.ttft_slo_s <= 0 || t.ttft_s() <= options_.ttft_slo_s) &&
                      (options_.tpot_slo_s <= 0 || t.tpot_s() <= options_.tpot_slo_s);
    if (good) ++out.good;
  }
  out.duration_s = last - first;
  const double dur = out.duration_s > 0 ? out.duration_s : 1e-9;
  out.ttft_ms = Summarize(std::move(ttft));
  out.tpot_ms = Summarize(std::move(tpot));
  out.e2e_ms = Summarize(std::move(e2e));
  out.request_throughput = static_cast<double>(out.completed) / dur;
  out.output_token_throughput = static_cast<double>(out_tokens) / dur;
  out.goodput_rps = static_cast<double>(out.good) / dur;
  out.preemptions = preemptions_;
  out.transfers = transfers_;
  out.transfer_bytes = transfer_bytes_;
  out.events = events_.popped();
  out.worker_cpu_s = worker_cpu_s_;
  out.serving_cpu_s = serving_cpu_s_;
  if (options_.keep_requests) {
    out.requests.reserve(reqs_.size());
    for (const auto& r : reqs_) out.requests.push_back(r.t);
  }
  return out;
}

}  // namespace

Result<SimResult> Simulate(const Profile& profile, const ClusterConfig& config,
                           const std::vector<SimRequest>& workload, const SimOptions& options) {
  Simulator sim(profile, config, workload, options);
  return sim.Run();
}

}  // namespace kvrelay::sim
