// Cost profile of one kind of hardware + model for the cluster simulator.
// `kvrelay sim calibrate` measures one on the machine it runs on (every number
// records the command and date it came from); profiles for other hardware can
// be written by hand, each number with its source (a `source` string per
// section is required when the file is loaded).
//
// Step-time model of one engine step on one worker (TP 1), in seconds:
//   base_s + per_seq_s * S + per_token_s * N + per_attn_s * A + per_ctx_attn_s * A_c
//          + per_decode_attn_s * A_d
// where S = sequences in the step, N = tokens computed in the step (prefill
// chunk tokens + one per decoding sequence), A = the (token, position) pairs
// of the prefill chunks' causal attention within the chunk (c (c + 1) / 2 per
// chunk of c), A_c the pairs between a chunk and the context cached before
// the step (c x cached) and A_d the pairs of the decoding sequences' one
// token each (context + 1). The three kinds of attention run different loops
// in the engine (measured: cached-context pairs cost more than in-chunk ones),
// so each has its own coefficient.
// base_s is what a step costs regardless of its size (on a CPU: streaming the
// weights once), per_seq_s the LM head and sampling of one sequence,
// per_token_s the layer matmuls of one token, per_attn_s attention per
// (token, position) pair. The fit is linear least squares over `bench engine`
// measurements of prefill (tokens x cached context) and decode (batch x context).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "common/status.h"

namespace kvrelay::sim {

struct StepCost {
  double base_s = 0;
  double per_seq_s = 0;
  double per_token_s = 0;
  double per_attn_s = 0;
  double per_decode_attn_s = 0;
  double per_ctx_attn_s = 0;
  std::string source;
  // A decode-only step (no prefill chunk in it) of b sequences costs
  // decode_batch_s(b) + per_decode_attn_s x A_d instead of the linear terms:
  // measured per batch size (bench engine's batched decode, its decode
  // attention taken out), linear between the measured sizes and beyond the
  // largest along its last segment. The engine's step is not linear in a
  // small batch (this machine: batch 2 costs 1.3x batch 1, the linear fit
  // through batches 1, 4 and 16 said 1.16x). Empty: the linear model.
  std::map<int, double> decode_batch_s;
  std::string decode_batch_source;

  double Seconds(double seqs, double tokens, double attn, double decode_attn = 0,
                 double ctx_attn = 0) const {
    return base_s + per_seq_s * seqs + per_token_s * tokens + per_attn_s * attn +
           per_decode_attn_s * decode_attn + per_ctx_attn_s * ctx_attn;
  }
  // A step of `seqs` decoding sequences and nothing else (decode_batch_s
  // when measured, else the linear model).
  double DecodeOnlySeconds(int64_t seqs, double decode_attn) const;
};

// Bytes -> seconds of one transfer: latency_s + bytes / bytes_per_s.
struct LinkCost {
  double latency_s = 0;
  double bytes_per_s = 1e9;
  std::string source;
  double Seconds(double bytes) const { return latency_s + bytes / bytes_per_s; }
};

// A decode group of TP size T: step time = step_scale * (TP 1 step) + per_step_s.
// For processes sharing a host (ClusterConfig::shared_host_cores): cores is
// what the group keeps busy while it steps (its ranks block in the
// collectives, so less than T; 0 means T), and a step of the group runs
// 1 + busy_alpha x (other busy cores) slower (its ranks synchronise in every
// layer: one that loses its core stalls the others), in place of the
// profile's contention alpha. share_weight is its weight in the host's
// max-min fair sharing (sim::FairLevel): above 1 when the group gets more
// than an even share of an oversubscribed host (its ranks sleep in the
// collectives, and the scheduler favours a thread that wakes).
// prefill_busy_alpha is the prefill worker's busy_alpha next to such a group
// (in place of the prefill role's, measured next to a TP 1 decode worker);
// below 0: not measured, the profile's contention mix.
struct TpCost {
  double step_scale = 1.0;
  double per_step_s = 0;
  std::string source;
  double cores = 0;
  double busy_alpha = 0;
  double share_weight = 1.0;
  double prefill_busy_alpha = -1;
};

// Worker processes slowing each other down on one host (the single-node
// topologies; ClusterConfig::shared_host_cores), beyond sharing its cores:
// while other processes keep c more cores busy, a step's decode (and fixed)
// part runs 1 + decode_alpha x c times slower and its prefill part
// 1 + prefill_alpha x c (shared caches, memory bandwidth). Calibrated by
// running `bench engine` alone and next to another `bench engine`.
struct HostContention {
  double decode_alpha = 0;
  double prefill_alpha = 0;
  std::string source;
};

// What the serving path adds around the engine steps on this hardware (HTTP,
// control plane, the KV hand-off), from low-load `bench serve` runs of the
// real topologies: ttft_s is added to every TTFT without holding the worker
// (for the prefill role: HTTP, routing, the way back to the client, from
// short prompts' TTFT, sim::TtftOutsideWorker; every later token is that
// late too; for the decode role: from the KV landing to its admission into
// the batch); step_scale multiplies the
// step's fixed and decode parts (base, and per_seq / per_token /
// per_decode_attn of its decoding sequences) and prefill_scale its prefill
// part (the same terms of its prefill chunks): a serving process's steps
// differ from `bench engine`'s (other processes on the cores, the TCP
// streaming, f16 conversions), and not by the same factor for both kinds of
// work; step_add_s is added to every step of that role.
//
// busy_alpha (the disaggregated prefill and decode roles; < 0 = not
// measured): on a shared host, a step of that role runs 1 + busy_alpha x
// (other busy cores) slower, in place of the contention alpha (as
// TpCost::busy_alpha for a TP group). Measured in the serving path, next to
// the other role kept busy by a second load: what two bench engine processes
// do to each other (HostContention) is not what the serving roles do to each
// other, whose KV hand-off (the layer-wise stream into a decode worker that is
// stepping, the first token reported once the KV is handed over) waits on the
// other process. Measured in 1P+1D: the prefill's applies in topologies of
// TP 1 decode workers only (next to a TP group TpCost::prefill_busy_alpha).
struct ServingOverhead {
  double ttft_s = 0;
  double step_scale = 1.0;
  double prefill_scale = 1.0;
  double step_add_s = 0;
  std::string source;
  double busy_alpha = -1;
  std::string busy_source;
  // The serving path's request-to-request variation at low load (this VM:
  // requests alone in the cluster range over 0.9-1.5x their median TTFT):
  // sorted ratios of each low-load request's TTFT (TPOT) to the run's
  // median (JitterRatios). A simulated request draws one of each
  // (JitterQuantile at a uniform u from its index: deterministic) and its
  // service part, first chunk scheduled -> first token, runs that factor
  // longer (its later tokens shift with it), and its token intervals that
  // factor longer; a delay seen by that request only, not worker time.
  // The TTFT one applies from the colocated or prefill role, the TPOT one
  // from the colocated or decode role. Empty: no variation.
  std::vector<double> ttft_jitter;
  std::vector<double> tpot_jitter;
};

// Sorted ratios of `samples` (> 0) to their median (see ServingOverhead::
// ttft_jitter); empty for no samples.
std::vector<double> JitterRatios(std::vector<double> samples);
// The u-quantile (u in [0, 1]) of sorted ratios, linear between them; 1 for
// none.
double JitterQuantile(const std::vector<double>& sorted, double u);

// CPU the serving path spends outside the workers, measured by `kvrelay sim
// calibrate` (/proc CPU seconds of the coordinator, getrusage of the client,
// over two bench serve runs that differ only in output length, idle CPU
// subtracted): the coordinator (HTTP, routing, relaying the stream) and the
// load generator (`kvrelay bench serve`), per request (charged at its
// arrival) and per output token (charged when the step that sampled it
// ends). On a shared host (ClusterConfig::shared_host_cores) each of the two
// is a process that keeps a core busy while it has such work and so takes
// its share of the cores from the workers (it is not slowed by their
// contention, nor counted in theirs: it is not an engine step). Its latency
// is not added anywhere: at low load it is part of what the serving
// overheads were calibrated from. Without a shared host it costs nothing
// (the coordinator and the client have machines of their own).
struct ServingCpu {
  double coordinator_per_request_s = 0;
  double coordinator_per_token_s = 0;
  double client_per_request_s = 0;
  double client_per_token_s = 0;
  std::string source;
};

struct Profile {
  std::string name;      // e.g. "this-machine" or "H100-llama8b (hand-written)"
  std::string hardware;  // CPU / accelerator model
  std::string model;     // the model the costs are for
  std::string measured_at;
  int layers = 30;
  int block_tokens = 16;
  int64_t kv_bytes_per_token = 0;  // K and V of one token, all layers and KV heads
  int64_t kv_pool_blocks = 0;      // KV blocks of one worker (and of each TP rank)
  int max_step_tokens = 512;       // the engine's chunked-prefill budget
  int max_running = 64;            // the engine's running-batch limit
  bool layerwise_transfer = true;  // KV streamed layer by layer during the prefill

  StepCost step;
  std::map<std::string, LinkCost> transports;  // "tcp", "mpi", ...
  std::string transport = "tcp";               // the one the cluster uses
  LinkCost store_restore;                      // prefix tier (RocksDB) restore
  std::map<int, TpCost> tp;                    // by T (>= 2; T = 1 is the identity)
  HostContention contention;                   // optional (0 = none); shared hosts only
  ServingCpu serving_cpu;                      // optional (0 = none); shared hosts only
  ServingOverhead colocated;
  ServingOverhead prefill;  // the prefill role of a disaggregated topology
  ServingOverhead decode;   // the decode role (TP 1); TP T adds tp[T]

  Status Validate() const;
  const LinkCost& Link() const;  // transports[transport]
  TpCost Tp(int t) const;        // identity for 1; a missing T is an error at Validate
};

// The serving-path terms (ServingOverhead, TpCost::step_scale) that one
// topology's low-load run (bench serve, one request at a time: its TTFT and
// TPOT p50) fixes, against the step model's prefill pass of those requests
// (`prefill_s`) and their decode step (`decode_s`): TPOT fixes the decode
// part's scale, then TTFT (one prefill step at low load: base x step_scale +
// the rest x prefill_scale) the prefill's. Colocated: colocated.step_scale
// and prefill_scale. 1P+1D (tp 1): decode.step_scale and prefill.
// prefill_scale (the prefill role's step_scale stays 1: its steps have no
// decode part). 1P+1D TP T: tp[T].step_scale over decode.step_scale, and with
// `refit_prefill` the prefill's prefill_scale from this topology's TTFT
// (`sim validate` re-timing a TP topology on its own; `sim calibrate` keeps
// 1P+1D's). The prefill role's ttft_s (calibrated apart: what of the TTFT
// is outside the worker) is taken off the TTFT first. Every scale is at
// least 0.05.
void FitServingTerms(bool colocated, int tp, double ttft_s, double tpot_s, double prefill_s,
                     double decode_s, bool refit_prefill, Profile* p);

Result<Profile> LoadProfile(const std::string& path);
Status SaveProfile(const std::string& path, const Profile& profile);
// JSON text of a profile (the file format).
std::string ProfileToJson(const Profile& profile);
Result<Profile> ProfileFromJson(const std::string& text);

// Linear least squares: the x minimising sum_i w_i (A_i . x - b_i)^2 with x >= 0
// (coordinates that come out negative are fixed at 0 and the rest refitted).
// A is row-major, rows x cols. InvalidArgument when under-determined.
Result<std::vector<double>> NonNegativeLeastSquares(const std::vector<double>& a, size_t cols,
                                                    const std::vector<double>& b,
                                                    const std::vector<double>& w);

}  // namespace kvrelay::sim
