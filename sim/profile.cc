#include "sim/profile.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <sstream>

namespace kvrelay::sim {

using nlohmann::json;

Status Profile::Validate() const {
  if (layers < 1) return InvalidArgument("profile.layers must be >= 1");
  if (block_tokens < 1) return InvalidArgument("profile.block_tokens must be >= 1");
  if (kv_bytes_per_token < 1) return InvalidArgument("profile.kv_bytes_per_token must be >= 1");
  if (kv_pool_blocks < 1) return InvalidArgument("profile.kv_pool_blocks must be >= 1");
  if (max_step_tokens < 1) return InvalidArgument("profile.max_step_tokens must be >= 1");
  if (max_running < 1) return InvalidArgument("profile.max_running must be >= 1");
  for (double v : {step.base_s, step.per_seq_s, step.per_token_s, step.per_attn_s,
                   step.per_decode_attn_s, step.per_ctx_attn_s}) {
    if (!(v >= 0) || !std::isfinite(v)) return InvalidArgument("profile.step costs must be >= 0");
  }
  if (step.Seconds(1, 1, 1) <= 0) return InvalidArgument("profile.step: a step must cost > 0 s");
  if (step.source.empty()) return InvalidArgument("profile.step.source must say where it is from");
  for (const auto& [b, sec] : step.decode_batch_s) {
    if (b < 1 || !(sec > 0) || !std::isfinite(sec)) {
      return InvalidArgument("profile.step.decode_batch_s: batch sizes >= 1, seconds > 0");
    }
  }
  if (!step.decode_batch_s.empty() && step.decode_batch_source.empty()) {
    return InvalidArgument("profile.step.decode_batch_source must say where it is from");
  }
  auto it = transports.find(transport);
  if (it == transports.end()) {
    return InvalidArgument("profile.transport '" + transport + "' is not in profile.transports");
  }
  for (const auto& [name, l] : transports) {
    if (!(l.latency_s >= 0) || !(l.bytes_per_s > 0)) {
      return InvalidArgument("profile.transports." + name +
                             ": latency_s must be >= 0, bytes_per_s > 0");
    }
    if (l.source.empty()) return InvalidArgument("profile.transports." + name + ".source is empty");
  }
  if (!(store_restore.latency_s >= 0) || !(store_restore.bytes_per_s > 0)) {
    return InvalidArgument("profile.store_restore: latency_s must be >= 0, bytes_per_s > 0");
  }
  for (const auto& [t, c] : tp) {
    if (t < 2 || !(c.step_scale > 0) || !(c.per_step_s >= 0) || !(c.cores >= 0) || c.cores > t ||
        !(c.busy_alpha >= 0) || !std::isfinite(c.busy_alpha) || !(c.share_weight > 0) ||
        !std::isfinite(c.share_weight) || !std::isfinite(c.prefill_busy_alpha)) {
      return InvalidArgument("profile.tp." + std::to_string(t) +
                             ": T >= 2, step_scale > 0, per_step_s >= 0, 0 <= cores <= T, "
                             "busy_alpha >= 0, share_weight > 0, prefill_busy_alpha finite");
    }
  }
  if (!(contention.decode_alpha >= 0) || !(contention.prefill_alpha >= 0) ||
      !std::isfinite(contention.decode_alpha) || !std::isfinite(contention.prefill_alpha)) {
    return InvalidArgument("profile.contention: decode_alpha and prefill_alpha must be >= 0");
  }
  if ((contention.decode_alpha > 0 || contention.prefill_alpha > 0) && contention.source.empty()) {
    return InvalidArgument("profile.contention.source must say where it is from");
  }
  {
    const ServingCpu& s = serving_cpu;
    bool any = false;
    for (double v : {s.coordinator_per_request_s, s.coordinator_per_token_s, s.client_per_request_s,
                     s.client_per_token_s}) {
      if (!(v >= 0) || !std::isfinite(v)) {
        return InvalidArgument("profile.serving_cpu: every cost must be >= 0 seconds");
      }
      any = any || v > 0;
    }
    if (any && s.source.empty()) {
      return InvalidArgument("profile.serving_cpu.source must say where it is from");
    }
  }
  for (const auto* o : {&colocated, &prefill, &decode}) {
    if (!(o->ttft_s >= 0) || !(o->step_scale > 0) || !(o->prefill_scale > 0) ||
        !(o->step_add_s >= 0) || !std::isfinite(o->busy_alpha)) {
      return InvalidArgument(
          "profile overheads: ttft_s >= 0, step_scale > 0, prefill_scale > 0, step_add_s >= 0");
    }
    if (o->busy_alpha >= 0 && o->busy_source.empty()) {
      return InvalidArgument("profile overheads: a busy_alpha needs its busy_source");
    }
    for (const auto* j : {&o->ttft_jitter, &o->tpot_jitter}) {
      if (j->size() > 4096 || !std::is_sorted(j->begin(), j->end()) ||
          std::any_of(j->begin(), j->end(),
                      [](double r) { return !(r > 0) || !std::isfinite(r); })) {
        return InvalidArgument(
            "profile overheads: ttft_jitter / tpot_jitter are at most 4096 sorted ratios > 0");
      }
    }
  }
  if (colocated.busy_alpha >= 0) {
    return InvalidArgument("profile.colocated.busy_alpha: only the disaggregated roles have one");
  }
  return Status::Ok();
}

std::vector<double> JitterRatios(std::vector<double> samples) {
  if (samples.empty()) return {};
  std::sort(samples.begin(), samples.end());
  const size_t n = samples.size();
  const double median = n % 2 ? samples[n / 2] : (samples[n / 2 - 1] + samples[n / 2]) / 2;
  if (!(median > 0)) return {};
  for (double& x : samples) x /= median;
  return samples;
}

double JitterQuantile(const std::vector<double>& sorted, double u) {
  if (sorted.empty()) return 1.0;
  const double pos = std::clamp(u, 0.0, 1.0) * static_cast<double>(sorted.size() - 1);
  const size_t lo = static_cast<size_t>(pos);
  if (lo + 1 >= sorted.size()) return sorted.back();
  return sorted[lo] + (sorted[lo + 1] - sorted[lo]) * (pos - static_cast<double>(lo));
}

void FitServingTerms(bool colocated, int tp, double ttft_s, double tpot_s, double prefill_s,
                     double decode_s, bool refit_prefill, Profile* p) {
  const double base = p->step.base_s, prefill_part = std::max(1e-9, prefill_s - base);
  if (colocated) {
    p->colocated.step_scale = std::max(0.05, tpot_s / decode_s);
    p->colocated.prefill_scale =
        std::max(0.05, (ttft_s - p->colocated.step_scale * base) / prefill_part);
    return;
  }
  if (tp <= 1 || refit_prefill) {
    // The prefill role's ttft_s (outside the worker) is not its steps'.
    p->prefill.prefill_scale = std::max(0.05, (ttft_s - p->prefill.ttft_s - base) / prefill_part);
  }
  if (tp <= 1) {
    p->decode.step_scale = std::max(0.05, tpot_s / decode_s);
  } else {
    p->tp[tp].step_scale = std::max(0.05, tpot_s / (p->decode.step_scale * decode_s));
  }
}

double StepCost::DecodeOnlySeconds(int64_t seqs, double decode_attn) const {
  const double b = static_cast<double>(seqs);
  if (decode_batch_s.empty()) return Seconds(b, b, 0, decode_attn);
  const double attn = per_decode_attn_s * decode_attn;
  auto hi = decode_batch_s.lower_bound(static_cast<int>(std::min<int64_t>(seqs, INT32_MAX)));
  if (hi != decode_batch_s.end() && hi->first == seqs) return hi->second + attn;
  if (decode_batch_s.size() == 1) {
    // One measured size: the linear model's slope through it.
    const auto& [b0, s0] = *decode_batch_s.begin();
    return s0 + (per_seq_s + per_token_s) * (b - b0) + attn;
  }
  if (hi == decode_batch_s.begin()) ++hi;  // below the smallest: its first segment
  if (hi == decode_batch_s.end()) --hi;    // above the largest: its last segment
  auto lo = std::prev(hi);
  const double x0 = lo->first, x1 = hi->first;
  return lo->second + (hi->second - lo->second) * (b - x0) / (x1 - x0) + attn;
}

const LinkCost& Profile::Link() const { return transports.at(transport); }

TpCost Profile::Tp(int t) const {
  if (t <= 1) {
    TpCost identity;
    identity.source = "identity";
    identity.cores = 1.0;
    return identity;
  }
  auto it = tp.find(t);
  return it == tp.end() ? TpCost{} : it->second;
}

namespace {

json LinkJson(const LinkCost& l) {
  return {{"latency_s", l.latency_s}, {"bytes_per_s", l.bytes_per_s}, {"source", l.source}};
}
json OverheadJson(const ServingOverhead& o) {
  json j = {{"ttft_s", o.ttft_s},
            {"step_scale", o.step_scale},
            {"prefill_scale", o.prefill_scale},
            {"step_add_s", o.step_add_s},
            {"source", o.source}};
  if (o.busy_alpha >= 0) {
    j["busy_alpha"] = o.busy_alpha;
    j["busy_source"] = o.busy_source;
  }
  if (!o.ttft_jitter.empty()) j["ttft_jitter"] = o.ttft_jitter;
  if (!o.tpot_jitter.empty()) j["tpot_jitter"] = o.tpot_jitter;
  return j;
}

json DecodeBatchJson(const StepCost& s) {
  json seconds = json::object();
  for (const auto& [b, sec] : s.decode_batch_s) seconds[std::to_string(b)] = sec;
  return {{"seconds", seconds}, {"source", s.decode_batch_source}};
}

// Typed field access that names the field in the error.
template <typename T>
Status Read(const json& j, const std::string& path, const char* key, T* out, bool required) {
  if (!j.contains(key)) {
    if (required) return InvalidArgument("profile: missing " + path + key);
    return Status::Ok();
  }
  try {
    *out = j.at(key).get<T>();
  } catch (const std::exception&) {
    return InvalidArgument("profile: " + path + key + " has the wrong type");
  }
  return Status::Ok();
}

Status ReadLink(const json& j, const std::string& path, LinkCost* l) {
  if (!j.is_object()) return InvalidArgument("profile: " + path + " must be an object");
  RETURN_IF_ERROR(Read(j, path + ".", "latency_s", &l->latency_s, true));
  RETURN_IF_ERROR(Read(j, path + ".", "bytes_per_s", &l->bytes_per_s, true));
  RETURN_IF_ERROR(Read(j, path + ".", "source", &l->source, true));
  return Status::Ok();
}

Status ReadOverhead(const json& j, const char* key, ServingOverhead* o) {
  if (!j.contains(key)) return Status::Ok();
  const json& v = j.at(key);
  const std::string path = std::string(key) + ".";
  if (!v.is_object()) return InvalidArgument("profile: " + std::string(key) + " must be an object");
  RETURN_IF_ERROR(Read(v, path, "ttft_s", &o->ttft_s, false));
  RETURN_IF_ERROR(Read(v, path, "step_scale", &o->step_scale, false));
  RETURN_IF_ERROR(Read(v, path, "prefill_scale", &o->prefill_scale, false));
  RETURN_IF_ERROR(Read(v, path, "step_add_s", &o->step_add_s, false));
  RETURN_IF_ERROR(Read(v, path, "source", &o->source, true));
  RETURN_IF_ERROR(Read(v, path, "busy_alpha", &o->busy_alpha, false));
  RETURN_IF_ERROR(Read(v, path, "busy_source", &o->busy_source, o->busy_alpha >= 0));
  RETURN_IF_ERROR(Read(v, path, "ttft_jitter", &o->ttft_jitter, false));
  RETURN_IF_ERROR(Read(v, path, "tpot_jitter", &o->tpot_jitter, false));
  return Status::Ok();
}

}  // namespace

std::string ProfileToJson(const Profile& p) {
  json transports = json::object();
  for (const auto& [name, l] : p.transports) transports[name] = LinkJson(l);
  json tp = json::object();
  for (const auto& [t, c] : p.tp) {
    json& e = tp[std::to_string(t)];
    e = {{"step_scale", c.step_scale}, {"per_step_s", c.per_step_s},     {"cores", c.cores},
         {"busy_alpha", c.busy_alpha}, {"share_weight", c.share_weight}, {"source", c.source}};
    if (c.prefill_busy_alpha >= 0) e["prefill_busy_alpha"] = c.prefill_busy_alpha;
  }
  json j = {
      {"name", p.name},
      {"hardware", p.hardware},
      {"model", p.model},
      {"measured_at", p.measured_at},
      {"layers", p.layers},
      {"block_tokens", p.block_tokens},
      {"kv_bytes_per_token", p.kv_bytes_per_token},
      {"kv_pool_blocks", p.kv_pool_blocks},
      {"max_step_tokens", p.max_step_tokens},
      {"max_running", p.max_running},
      {"layerwise_transfer", p.layerwise_transfer},
      {"step",
       {{"base_s", p.step.base_s},
        {"per_seq_s", p.step.per_seq_s},
        {"per_token_s", p.step.per_token_s},
        {"per_attn_s", p.step.per_attn_s},
        {"per_decode_attn_s", p.step.per_decode_attn_s},
        {"per_ctx_attn_s", p.step.per_ctx_attn_s},
        {"source", p.step.source}}},
      {"decode_batch", DecodeBatchJson(p.step)},
      {"transport", p.transport},
      {"transports", transports},
      {"store_restore", LinkJson(p.store_restore)},
      {"tp", tp},
      {"contention",
       {{"decode_alpha", p.contention.decode_alpha},
        {"prefill_alpha", p.contention.prefill_alpha},
        {"source", p.contention.source}}},
      {"serving_cpu",
       {{"coordinator_per_request_s", p.serving_cpu.coordinator_per_request_s},
        {"coordinator_per_token_s", p.serving_cpu.coordinator_per_token_s},
        {"client_per_request_s", p.serving_cpu.client_per_request_s},
        {"client_per_token_s", p.serving_cpu.client_per_token_s},
        {"source", p.serving_cpu.source}}},
      {"colocated", OverheadJson(p.colocated)},
      {"prefill", OverheadJson(p.prefill)},
      {"decode", OverheadJson(p.decode)},
  };
  return j.dump(2) + "\n";
}

Result<Profile> ProfileFromJson(const std::string& text) {
  json j = json::parse(text, nullptr, false);
  if (j.is_discarded() || !j.is_object()) return InvalidArgument("profile: not a JSON object");
  Profile p;
  RETURN_IF_ERROR(Read(j, "", "name", &p.name, true));
  RETURN_IF_ERROR(Read(j, "", "hardware", &p.hardware, false));
  RETURN_IF_ERROR(Read(j, "", "model", &p.model, false));
  RETURN_IF_ERROR(Read(j, "", "measured_at", &p.measured_at, false));
  RETURN_IF_ERROR(Read(j, "", "layers", &p.layers, true));
  RETURN_IF_ERROR(Read(j, "", "block_tokens", &p.block_tokens, false));
  RETURN_IF_ERROR(Read(j, "", "kv_bytes_per_token", &p.kv_bytes_per_token, true));
  RETURN_IF_ERROR(Read(j, "", "kv_pool_blocks", &p.kv_pool_blocks, true));
  RETURN_IF_ERROR(Read(j, "", "max_step_tokens", &p.max_step_tokens, false));
  RETURN_IF_ERROR(Read(j, "", "max_running", &p.max_running, false));
  RETURN_IF_ERROR(Read(j, "", "layerwise_transfer", &p.layerwise_transfer, false));
  if (!j.contains("step") || !j["step"].is_object()) {
    return InvalidArgument("profile: missing step (the step-time model)");
  }
  const json& s = j["step"];
  RETURN_IF_ERROR(Read(s, "step.", "base_s", &p.step.base_s, true));
  RETURN_IF_ERROR(Read(s, "step.", "per_seq_s", &p.step.per_seq_s, true));
  RETURN_IF_ERROR(Read(s, "step.", "per_token_s", &p.step.per_token_s, true));
  RETURN_IF_ERROR(Read(s, "step.", "per_attn_s", &p.step.per_attn_s, true));
  p.step.per_decode_attn_s = p.step.per_attn_s;  // one coefficient unless both are given
  RETURN_IF_ERROR(Read(s, "step.", "per_decode_attn_s", &p.step.per_decode_attn_s, false));
  p.step.per_ctx_attn_s = p.step.per_attn_s;
  RETURN_IF_ERROR(Read(s, "step.", "per_ctx_attn_s", &p.step.per_ctx_attn_s, false));
  RETURN_IF_ERROR(Read(s, "step.", "source", &p.step.source, true));
  if (j.contains("decode_batch")) {
    const json& d = j["decode_batch"];
    if (!d.is_object() || !d.contains("seconds") || !d["seconds"].is_object()) {
      return InvalidArgument("profile: decode_batch must be {\"seconds\": {batch: s}, \"source\"}");
    }
    for (const auto& [key, v] : d["seconds"].items()) {
      const int b = std::atoi(key.c_str());
      if (b < 1 || std::to_string(b) != key || !v.is_number()) {
        return InvalidArgument("profile: decode_batch.seconds." + key + " is not batch -> seconds");
      }
      p.step.decode_batch_s[b] = v.get<double>();
    }
    RETURN_IF_ERROR(Read(d, "decode_batch.", "source", &p.step.decode_batch_source, false));
  }
  RETURN_IF_ERROR(Read(j, "", "transport", &p.transport, false));
  if (!j.contains("transports") || !j["transports"].is_object()) {
    return InvalidArgument("profile: missing transports (bytes -> seconds per transport)");
  }
  for (const auto& [name, v] : j["transports"].items()) {
    LinkCost l;
    RETURN_IF_ERROR(ReadLink(v, "transports." + name, &l));
    p.transports[name] = l;
  }
  if (j.contains("store_restore")) {
    RETURN_IF_ERROR(ReadLink(j["store_restore"], "store_restore", &p.store_restore));
  }
  if (j.contains("tp")) {
    if (!j["tp"].is_object()) return InvalidArgument("profile: tp must be an object");
    for (const auto& [key, v] : j["tp"].items()) {
      int t = std::atoi(key.c_str());
      if (t < 2 || !v.is_object()) return InvalidArgument("profile: tp." + key + " is not T >= 2");
      TpCost c;
      RETURN_IF_ERROR(Read(v, "tp." + key + ".", "step_scale", &c.step_scale, true));
      RETURN_IF_ERROR(Read(v, "tp." + key + ".", "per_step_s", &c.per_step_s, false));
      RETURN_IF_ERROR(Read(v, "tp." + key + ".", "cores", &c.cores, false));
      RETURN_IF_ERROR(Read(v, "tp." + key + ".", "busy_alpha", &c.busy_alpha, false));
      RETURN_IF_ERROR(Read(v, "tp." + key + ".", "share_weight", &c.share_weight, false));
      RETURN_IF_ERROR(
          Read(v, "tp." + key + ".", "prefill_busy_alpha", &c.prefill_busy_alpha, false));
      RETURN_IF_ERROR(Read(v, "tp." + key + ".", "source", &c.source, true));
      p.tp[t] = c;
    }
  }
  if (j.contains("contention")) {
    const json& c = j["contention"];
    if (!c.is_object()) return InvalidArgument("profile: contention must be an object");
    RETURN_IF_ERROR(Read(c, "contention.", "decode_alpha", &p.contention.decode_alpha, false));
    RETURN_IF_ERROR(Read(c, "contention.", "prefill_alpha", &p.contention.prefill_alpha, false));
    RETURN_IF_ERROR(Read(c, "contention.", "source", &p.contention.source, false));
  }
  if (j.contains("serving_cpu")) {
    const json& c = j["serving_cpu"];
    if (!c.is_object()) return InvalidArgument("profile: serving_cpu must be an object");
    ServingCpu& s = p.serving_cpu;
    for (auto [key, v] : {std::pair<const char*, double*>{"coordinator_per_request_s",
                                                          &s.coordinator_per_request_s},
                          {"coordinator_per_token_s", &s.coordinator_per_token_s},
                          {"client_per_request_s", &s.client_per_request_s},
                          {"client_per_token_s", &s.client_per_token_s}}) {
      RETURN_IF_ERROR(Read(c, "serving_cpu.", key, v, false));
    }
    RETURN_IF_ERROR(Read(c, "serving_cpu.", "source", &s.source, false));
  }
  RETURN_IF_ERROR(ReadOverhead(j, "colocated", &p.colocated));
  RETURN_IF_ERROR(ReadOverhead(j, "prefill", &p.prefill));
  RETURN_IF_ERROR(ReadOverhead(j, "decode", &p.decode));
  RETURN_IF_ERROR(p.Validate());
  return p;
}

Result<Profile> LoadProfile(const std::string& path) {
  std::ifstream f(path);
  if (!f) return NotFound("cannot open profile " + path);
  std::stringstream ss;
  ss << f.rdbuf();
  auto p = ProfileFromJson(ss.str());
  if (!p.ok()) return p.status().WithContext(path);
  return p;
}

Status SaveProfile(const std::string& path, const Profile& profile) {
  RETURN_IF_ERROR(profile.Validate());
  std::ofstream f(path);
  if (!f) return InvalidArgument("cannot write profile " + path);
  f << ProfileToJson(profile);
  f.flush();
  if (!f) return DataLoss("short write to profile " + path);
  return Status::Ok();
}

Result<std::vector<double>> NonNegativeLeastSquares(const std::vector<double>& a, size_t cols,
                                                    const std::vector<double>& b,
                                                    const std::vector<double>& w) {
  const size_t rows = b.size();
  if (a.size() != rows * cols || w.size() != rows) {
    return InvalidArgument("least squares: shape mismatch");
  }
  std::vector<bool> active(cols, true);
  std::vector<double> x(cols, 0.0);
  for (size_t round = 0; round <= cols; ++round) {
    std::vector<size_t> idx;
    for (size_t c = 0; c < cols; ++c) {
      if (active[c]) idx.push_back(c);
    }
    const size_t n = idx.size();
    if (n == 0) return x;
    if (rows < n) return InvalidArgument("least squares: fewer measurements than unknowns");
    // Normal equations (A^T W A) x = A^T W b over the active columns.
    std::vector<double> m(n * (n + 1), 0.0);
    for (size_t r = 0; r < rows; ++r) {
      for (size_t i = 0; i < n; ++i) {
        const double ai = a[r * cols + idx[i]] * w[r];
        for (size_t k = 0; k < n; ++k) m[i * (n + 1) + k] += ai * a[r * cols + idx[k]];
        m[i * (n + 1) + n] += ai * b[r];
      }
    }
    // Gaussian elimination with partial pivoting.
    for (size_t i = 0; i < n; ++i) {
      size_t piv = i;
      for (size_t k = i + 1; k < n; ++k) {
        if (std::fabs(m[k * (n + 1) + i]) > std::fabs(m[piv * (n + 1) + i])) piv = k;
      }
      if (std::fabs(m[piv * (n + 1) + i]) < 1e-300) {
        return InvalidArgument("least squares: measurements do not determine every coefficient");
      }
      for (size_t k = 0; k <= n; ++k) std::swap(m[i * (n + 1) + k], m[piv * (n + 1) + k]);
      for (size_t r = 0; r < n; ++r) {
        if (r == i) continue;
        const double f = m[r * (n + 1) + i] / m[i * (n + 1) + i];
        for (size_t k = i; k <= n; ++k) m[r * (n + 1) + k] -= f * m[i * (n + 1) + k];
      }
    }
    bool all_nonneg = true;
    std::fill(x.begin(), x.end(), 0.0);
    for (size_t i = 0; i < n; ++i) {
      x[idx[i]] = m[i * (n + 1) + n] / m[i * (n + 1) + i];
      if (x[idx[i]] < 0) all_nonneg = false;
    }
    if (all_nonneg) return x;
    // Drop the most negative coefficient and refit.
    size_t worst = idx[0];
    for (size_t i : idx) {
      if (x[i] < x[worst]) worst = i;
    }
    active[worst] = false;
  }
  std::fill(x.begin(), x.end(), 0.0);
  return x;
}

}  // namespace kvrelay::sim
