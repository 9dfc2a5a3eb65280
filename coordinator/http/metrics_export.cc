// The coordinator's /metrics: its own series (HTTP, admission, throughput,
// the process) and every worker's, from the snapshots their heartbeats carry,
// rendered in the Prometheus text format. Cumulative worker figures become
// counters that advance by the increase since the last scrape.
#include <algorithm>
#include <initializer_list>
#include <string>
#include <tuple>

#include "common/process_stats.h"
#include "coordinator/http/server_internal.h"

namespace kvrelay::coordinator::internal {

void Core::AdvanceWorkerCounter(const std::string& name, const std::string& help,
                                const std::string& worker, double total) {
  double delta = 0;
  {
    std::lock_guard<std::mutex> lock(worker_totals_mutex);
    double& last = worker_totals[name + '\0' + worker];
    // A worker that restarted reports from 0 again: all of it is new.
    delta = total >= last ? total - last : total;
    last = total;
  }
  registry->GetCounter(name, help, Labels({{"worker", worker}}))->Increment(delta);
}

void Core::ExportBackendMetrics() {
  for (const BackendMetric& c : backend->Counters()) {
    double delta = 0;
    {
      std::lock_guard<std::mutex> lock(worker_totals_mutex);
      std::string key = c.name;
      for (const auto& [k, v] : c.labels) key += "|" + k + "=" + v;
      double& last = worker_totals[key];
      delta = c.value >= last ? c.value - last : c.value;
      last = c.value;
    }
    registry->GetCounter(c.name, c.help, Labels(c.labels))->Increment(delta);
  }
  for (const BackendMetric& g : backend->Gauges()) {
    registry->GetGauge(g.name, g.help, Labels(g.labels))->Set(g.value);
  }
}

void Core::UpdateAdmissionGauges() {
  queue_depth->Set(admission.queued());
  running->Set(admission.running());
}

std::string Core::RenderMetrics() {
  ExportProcessMetrics();
  ExportWorkerMetrics();
  UpdateAdmissionGauges();
  ExportBackendMetrics();
  return registry->RenderPrometheus();
}

// The coordinator process itself, named as Prometheus client libraries do.
void Core::ExportProcessMetrics() {
  MetricsRegistry* m = registry;
  const ProcessStats self = ReadProcessStats();
  {
    double delta = 0;
    {
      std::lock_guard<std::mutex> lock(worker_totals_mutex);
      double& last = worker_totals["process_cpu_seconds_total"];
      delta = std::max(0.0, self.cpu_seconds - last);
      last = std::max(last, self.cpu_seconds);
    }
    m->GetCounter("process_cpu_seconds_total", "Total user and system CPU time spent in seconds.",
                  Labels())
        ->Increment(delta);
  }
  for (const auto& [name, help, value] :
       std::initializer_list<std::tuple<const char*, const char*, double>>{
           {"process_resident_memory_bytes", "Resident memory size in bytes.",
            static_cast<double>(self.resident_bytes)},
           {"process_virtual_memory_bytes", "Virtual memory size in bytes.",
            static_cast<double>(self.virtual_bytes)},
           {"process_open_fds", "Number of open file descriptors.",
            static_cast<double>(self.open_fds)},
           {"process_start_time_seconds", "Start time of the process since the Unix epoch.",
            self.start_time_seconds}}) {
    m->GetGauge(name, help, Labels())->Set(value);
  }
}

// Every worker's series, from its last heartbeat's snapshot.
void Core::ExportWorkerMetrics() {
  MetricsRegistry* m = registry;
  const auto now = backend->Workers();
  {
    // A worker that left (died, or its group broke) reads unhealthy and idle,
    // not its last values.
    std::lock_guard<std::mutex> lock(worker_totals_mutex);
    for (const std::string& id : scraped_workers) {
      const bool present =
          std::any_of(now.begin(), now.end(), [&](const auto& w) { return w.id == id; });
      if (present) continue;
      const MetricLabels l = Labels({{"worker", id}});
      m->GetGauge("kvrelay_worker_healthy", "1 when the worker is healthy.", l)->Set(0);
      m->GetGauge("kvrelay_worker_running", "Sequences in the worker's running batch.", l)->Set(0);
    }
    for (const auto& w : now) scraped_workers.insert(w.id);
  }
  for (const auto& w : now) {
    const MetricLabels l = Labels({{"worker", w.id}});
    double util = w.total_kv_blocks > 0 ? 1.0 - static_cast<double>(w.free_kv_blocks) /
                                                    static_cast<double>(w.total_kv_blocks)
                                        : 0.0;
    m->GetGauge("kvrelay_worker_kv_utilization", "Fraction of the worker's KV blocks in use.", l)
        ->Set(util);
    m->GetGauge("kvrelay_worker_running", "Sequences in the worker's running batch.", l)
        ->Set(static_cast<double>(w.running));
    m->GetGauge("kvrelay_worker_queued_tokens", "Prompt tokens queued at the worker.", l)
        ->Set(static_cast<double>(w.queued_tokens));
    m->GetGauge("kvrelay_worker_healthy", "1 when the worker is healthy.", l)
        ->Set(w.healthy ? 1 : 0);
    m->GetGauge("kvrelay_worker_kv_quarantined_blocks",
                "KV blocks the worker keeps forever because a dead peer's MPI request still "
                "references them.",
                l)
        ->Set(static_cast<double>(w.quarantined_kv_blocks));
    for (size_t g = 0; g < w.kv_group_peak_blocks.size() && g < w.kv_group_window.size(); ++g) {
      const MetricLabels lg = Labels({{"worker", w.id},
                                      {"group", std::to_string(g)},
                                      {"window", std::to_string(w.kv_group_window[g])}});
      m->GetGauge("kvrelay_worker_kv_group_peak_blocks",
                  "Most KV blocks one sequence held in this KV cache group between steps "
                  "(window 0: full attention).",
                  lg)
          ->Set(static_cast<double>(w.kv_group_peak_blocks[g]));
    }
    // Cumulative figures are counters (#18), fed from the snapshots.
    AdvanceWorkerCounter("kvrelay_worker_prefix_hit_tokens_total",
                         "Prompt tokens the worker served from its prefix cache.", w.id,
                         static_cast<double>(w.prefix_hit_tokens));
    AdvanceWorkerCounter("kvrelay_worker_transfer_bytes_total", "KV bytes the worker transferred.",
                         w.id, static_cast<double>(w.transfer_bytes));
    // Prefix cache queries and hits in prompt tokens, preemptions and the
    // worker process, under vLLM's names where it has one.
    AdvanceWorkerCounter(
        "kvrelay_worker_prefix_cache_queries_total",
        "Prompt tokens the worker looked up in its prefix cache (computed + cached).", w.id,
        static_cast<double>(w.prompt_tokens_computed + w.prefix_hit_tokens));
    AdvanceWorkerCounter("kvrelay_worker_prefix_cache_hits_total",
                         "Prompt tokens the worker found in its prefix cache.", w.id,
                         static_cast<double>(w.prefix_hit_tokens));
    AdvanceWorkerCounter("kvrelay_worker_generation_tokens_total", "Tokens the worker generated.",
                         w.id, static_cast<double>(w.generated_tokens));
    AdvanceWorkerCounter("kvrelay_worker_preemptions_total",
                         "Sequences the worker's scheduler preempted (KV ran short).", w.id,
                         static_cast<double>(w.preemptions));
    AdvanceWorkerCounter("kvrelay_worker_process_cpu_seconds_total",
                         "User and system CPU seconds of the worker process.", w.id,
                         w.process_cpu_seconds);
    m->GetGauge("kvrelay_worker_process_resident_memory_bytes",
                "Resident memory of the worker process in bytes.", l)
        ->Set(static_cast<double>(w.process_resident_bytes));
    AdvanceWorkerCounter(
        "kvrelay_worker_kv_integrity_failures_total",
        "KV streams the worker refused because a block checksum, the manifest or the model "
        "fingerprint did not check out (the request failed or was re-run; never decoded).",
        w.id, static_cast<double>(w.kv_integrity_failures));
    AdvanceWorkerCounter("kvrelay_worker_transfer_seconds_total",
                         "Seconds the worker spent in KV transfer.", w.id, w.transfer_seconds);
    // What the worker's internal ports refused, named as the control port's.
    for (const auto& [port, c] : {std::pair{"kv", &w.kv_port}, std::pair{"tp", &w.tp_port}}) {
      const std::string p = std::string("kvrelay_worker_") + port + "_";
      const std::string what =
          std::string(port) == "kv" ? "KV data ports (every rank of a TP group)" : "TP link";
      AdvanceWorkerCounter(p + "auth_failures_total",
                           "Connections to the worker's " + what +
                               " that failed the cluster-key challenge-response.",
                           w.id, static_cast<double>(c->auth_failures));
      AdvanceWorkerCounter(
          p + "refused_connections_total",
          "Connections to the worker's " + what + " refused at accept (connection limits).", w.id,
          static_cast<double>(c->refused_connections));
      AdvanceWorkerCounter(
          p + "oversized_frames_total",
          "Connections to the worker's " + what + " closed at a header over its size limit.", w.id,
          static_cast<double>(c->oversized_frames));
      AdvanceWorkerCounter(p + "foreign_frames_total",
                           "Authenticated peers of the worker's " + what +
                               " that spoke for another identity, refused.",
                           w.id, static_cast<double>(c->foreign_frames));
    }
    // Its prefix store (--kv-store-path): restores, write-through, the disk.
    if (w.prefix_store) {
      const WorkerInfo::PrefixStore& ps = *w.prefix_store;
      for (const auto& [name, help, value] :
           std::initializer_list<std::tuple<const char*, const char*, int64_t>>{
               {"restored_blocks_total", "KV blocks loaded back from the prefix store's tiers.",
                ps.restored_blocks_ram + ps.restored_blocks_disk},
               {"restored_disk_blocks_total", "KV blocks loaded back from the disk tier.",
                ps.restored_blocks_disk},
               {"restored_bytes_total", "Bytes of KV loaded back from the prefix store.",
                ps.restored_bytes},
               {"restores_total", "Requests that loaded KV from the prefix store.", ps.restores},
               {"restore_misses_total",
                "Stored KV blocks not served (absent, unverified, another model or tenant).",
                ps.restore_misses},
               {"spills_total", "Evicted pool blocks handed to a tier.", ps.spills},
               {"write_through_blocks_total", "Committed KV blocks queued to the disk tier.",
                ps.write_through_blocks},
               {"write_through_dropped_total",
                "Committed KV blocks not written (backlog full or the disk refused).",
                ps.write_through_dropped},
               {"disk_written_blocks_total", "KV blocks the disk tier's writer stored.",
                ps.disk_written_blocks},
               {"disk_written_bytes_total", "Bytes of KV the disk tier's writer stored.",
                ps.disk_written_bytes},
               {"disk_write_failures_total",
                "KV blocks lost to a failed write or refused by a read-only disk tier.",
                ps.disk_write_failures}}) {
        AdvanceWorkerCounter(std::string("kvrelay_worker_kvstore_") + name, help, w.id,
                             static_cast<double>(value));
      }
      const MetricLabels lw = Labels({{"worker", w.id}});
      m->GetGauge("kvrelay_worker_kvstore_write_backlog_blocks",
                  "Committed KV blocks waiting for the disk tier's queue.", lw)
          ->Set(static_cast<double>(ps.write_backlog));
      m->GetGauge("kvrelay_worker_kvstore_disk_entries", "KV blocks in the disk tier.", lw)
          ->Set(static_cast<double>(ps.disk_entries));
      m->GetGauge("kvrelay_worker_kvstore_disk_used_bytes", "Bytes of KV in the disk tier.", lw)
          ->Set(static_cast<double>(ps.disk_used_bytes));
    }
  }
}

}  // namespace kvrelay::coordinator::internal
