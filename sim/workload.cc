#include "sim/workload.h"

#include <cerrno>
#include <cstdlib>
#include <fstream>
#include <random>
#include <sstream>

namespace kvrelay::sim {

Status WorkloadOptions::Validate() const {
  if (!(rate > 0)) return InvalidArgument("workload rate must be > 0 req/s");
  if (num_requests < 1) return InvalidArgument("workload num_requests must be >= 1");
  if (prompt_tokens < 1) return InvalidArgument("workload prompt_tokens must be >= 1");
  if (output_tokens < 1) return InvalidArgument("workload output_tokens must be >= 1");
  if (shared_prefix < 0 || shared_prefix > prompt_tokens) {
    return InvalidArgument("workload shared_prefix must be in [0, prompt_tokens]");
  }
  if (prefix_groups < 1) return InvalidArgument("workload prefix_groups must be >= 1");
  return Status::Ok();
}

Result<std::vector<SimRequest>> GenerateWorkload(const WorkloadOptions& o) {
  RETURN_IF_ERROR(o.Validate());
  std::mt19937_64 rng(o.seed);
  std::exponential_distribution<double> gap(o.rate);
  std::uniform_int_distribution<int64_t> group(0, o.prefix_groups - 1);
  std::vector<SimRequest> out;
  out.reserve(static_cast<size_t>(o.num_requests));
  double t = 0;
  for (int64_t i = 0; i < o.num_requests; ++i) {
    SimRequest r;
    r.arrival_s = t;
    r.prompt_tokens = o.prompt_tokens;
    r.output_tokens = o.output_tokens;
    if (o.shared_prefix > 0) {
      r.prefix_group = group(rng);
      r.prefix_tokens = o.shared_prefix;
    }
    out.push_back(r);
    t += o.arrivals == WorkloadOptions::Arrivals::kPoisson ? gap(rng) : 1.0 / o.rate;
  }
  return out;
}

namespace {

bool ParseDouble(const std::string& s, double* v) {
  errno = 0;
  char* end = nullptr;
  *v = std::strtod(s.c_str(), &end);
  return errno == 0 && end != s.c_str() && *end == '\0';
}

bool ParseInt(const std::string& s, int64_t* v) {
  errno = 0;
  char* end = nullptr;
  *v = std::strtoll(s.c_str(), &end, 10);
  return errno == 0 && end != s.c_str() && *end == '\0';
}

std::string Trim(const std::string& s) {
  size_t b = s.find_first_not_of(" \t\r");
  size_t e = s.find_last_not_of(" \t\r");
  return b == std::string::npos ? "" : s.substr(b, e - b + 1);
}

}  // namespace

Result<std::vector<SimRequest>> LoadTrace(const std::string& path) {
  std::ifstream f(path);
  if (!f) return NotFound("cannot open trace file " + path);
  std::vector<SimRequest> out;
  std::string line;
  int64_t line_no = 0;
  while (std::getline(f, line)) {
    ++line_no;
    line = Trim(line.substr(0, line.find('#')));
    if (line.empty()) continue;
    std::vector<std::string> cols;
    std::stringstream ss(line);
    std::string c;
    while (std::getline(ss, c, ',')) cols.push_back(Trim(c));
    const std::string where = path + ":" + std::to_string(line_no);
    double arrival = 0;
    if (!ParseDouble(cols[0], &arrival)) {
      if (out.empty() && line_no <= 2) continue;  // a header line
      return InvalidArgument(where + ": arrival_s '" + cols[0] + "' is not a number");
    }
    if (cols.size() < 3 || cols.size() > 5) {
      return InvalidArgument(where +
                             ": expected arrival_s,prompt_tokens,output_tokens"
                             "[,prefix_group[,prefix_tokens]]");
    }
    SimRequest r;
    r.arrival_s = arrival;
    if (!ParseInt(cols[1], &r.prompt_tokens) || r.prompt_tokens < 1) {
      return InvalidArgument(where + ": prompt_tokens must be an integer >= 1");
    }
    if (!ParseInt(cols[2], &r.output_tokens) || r.output_tokens < 1) {
      return InvalidArgument(where + ": output_tokens must be an integer >= 1");
    }
    if (cols.size() >= 4 && (!ParseInt(cols[3], &r.prefix_group) || r.prefix_group < -1)) {
      return InvalidArgument(where + ": prefix_group must be an integer >= -1");
    }
    if (cols.size() >= 5 && (!ParseInt(cols[4], &r.prefix_tokens) || r.prefix_tokens < 0 ||
                             r.prefix_tokens > r.prompt_tokens)) {
      return InvalidArgument(where + ": prefix_tokens must be in [0, prompt_tokens]");
    }
    if (r.prefix_group < 0) r.prefix_tokens = 0;
    if (!(arrival >= 0) || (!out.empty() && arrival < out.back().arrival_s)) {
      return InvalidArgument(where + ": arrival_s must be >= 0 and non-decreasing");
    }
    out.push_back(r);
  }
  if (out.empty()) return InvalidArgument("trace file " + path + " has no requests");
  return out;
}

Status SaveTrace(const std::string& path, const std::vector<SimRequest>& requests) {
  std::ofstream f(path);
  if (!f) return InvalidArgument("cannot write trace file " + path);
  f << "arrival_s,prompt_tokens,output_tokens,prefix_group,prefix_tokens\n";
  char buf[128];
  for (const auto& r : requests) {
    std::snprintf(buf, sizeof(buf), "%.9f,%lld,%lld,%lld,%lld\n", r.arrival_s,
                  static_cast<long long>(r.prompt_tokens), static_cast<long long>(r.output_tokens),
                  static_cast<long long>(r.prefix_group), static_cast<long long>(r.prefix_tokens));
    f << buf;
  }
  f.flush();
  if (!f) return DataLoss("short write to trace file " + path);
  return Status::Ok();
}

}  // namespace kvrelay::sim
