// kvrelay bench transfer: KV data-plane bandwidth between two processes on
// this machine, beside memcpy of the same size, plus a layer-wise overlap
// measurement for a 1,024-token prompt of the default model's KV layout.
//
//   kvrelay bench transfer --backend tcp          (forks the receiving process)
//   mpirun -np 2 kvrelay bench transfer --backend mpi
//   kvrelay bench transfer --backend local        (two endpoints in one process)
//   --backend all: local + tcp, and mpi when launched under mpirun -np 2.
//   --model PATH: the overlap is measured with the real engine (a 1,024-token
//   prefill whose layer hook sends each layer as soon as it is written)
//   instead of the modelled per-layer compute (--layer-ms).
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <semaphore>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "cli/command.h"
#include "common/clock.h"
#include "common/flags.h"
#include "common/logging.h"
#include "engine/runtime/engine.h"
#include "engine/runtime/model.h"
#include "kv_transfer/layer_stream.h"
#include "kv_transfer/local_transport.h"
#include "kv_transfer/mpi_transport.h"
#include "kv_transfer/tcp_transport.h"

namespace kvrelay::cli {
namespace {

// The save side of the engine's KV connector for the overlap benchmark:
// forwards each saved layer to `on_layer` (layer-wise mode) and keeps a
// finished request's prompt blocks (send-after-prefill mode).
class BenchConnector : public engine::KvConnector {
 public:
  void SaveLayer(int layer, const engine::StepPlan& plan) override {
    if (on_layer) on_layer(layer, plan);
  }
  bool RequestFinished(const engine::TokenEvent&, engine::BlockTable& blocks) override {
    kept = std::move(blocks);
    return true;
  }
  std::function<void(int, const engine::StepPlan&)> on_layer;
  engine::BlockTable kept;
};

using kv_transfer::BufferLayout;
using kv_transfer::KvSlice;
using kv_transfer::MemoryKind;
using kv_transfer::TransferDesc;
using kv_transfer::Transport;

// A one-byte signal channel between the two sides (pipes, MPI or semaphores).
class Signal {
 public:
  virtual ~Signal() = default;
  virtual void Post() = 0;
  virtual void Take() = 0;
};

class PipeSignal : public Signal {
 public:
  PipeSignal(int write_fd, int read_fd) : w_(write_fd), r_(read_fd) {}
  void Post() override {
    char c = 1;
    if (write(w_, &c, 1) != 1) std::abort();
  }
  void Take() override {
    char c;
    if (read(r_, &c, 1) != 1) std::abort();
  }
  void PostU16(uint16_t v) {
    if (write(w_, &v, 2) != 2) std::abort();
  }
  uint16_t TakeU16() {
    uint16_t v;
    if (read(r_, &v, 2) != 2) std::abort();
    return v;
  }

 private:
  int w_, r_;
};

// Signals as 2-byte transfers over the transport itself (request id 2), so
// neither side blocks in a spinning MPI call while the progress threads work.
class TransportSignal : public Signal {
 public:
  explicit TransportSignal(Transport* t) : t_(t) {}
  void Post() override { Move(/*send=*/true, sent_++); }
  void Take() override { Move(/*send=*/false, taken_++); }

 private:
  void Move(bool send, uint32_t seq) {
    TransferDesc d;
    d.peer = 1 - t_->rank();
    d.request_id = 2;
    d.tag = seq;
    d.layout = BufferLayout{1, 1, MemoryKind::kHost};
    d.slices.push_back(KvSlice{0, 0, 1, 0, 1, byte_, 0});
    auto h = send ? t_->PostSend(d) : t_->PostRecv(d);
    Status st = h.ok() ? t_->Wait(*h, Deadline::AfterMs(120000)) : h.status();
    if (!st.ok()) LOG_ERROR << "bench signal: " << st.ToString();
  }
  Transport* t_;
  uint8_t byte_[2] = {0, 0};
  uint32_t sent_ = 0, taken_ = 0;
};

class SemSignal : public Signal {
 public:
  SemSignal(std::binary_semaphore* post, std::binary_semaphore* take) : p_(post), t_(take) {}
  void Post() override { p_->release(); }
  void Take() override {
    while (!t_->try_acquire_for(std::chrono::seconds(60))) {
    }
  }

 private:
  std::binary_semaphore* p_;
  std::binary_semaphore* t_;
};

// One opaque byte buffer as a transfer (a one-head, one-layer slice).
TransferDesc BytesDesc(int peer, uint32_t tag, uint8_t* data, size_t n) {
  TransferDesc d;
  d.peer = peer;
  d.request_id = 1;
  d.tag = tag;
  d.layout = BufferLayout{1, static_cast<int64_t>(n / 2), MemoryKind::kHost};
  d.slices.push_back(KvSlice{0, 0, 1, 0, 1, data, 0});
  return d;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

int Iterations(size_t bytes) {
  return static_cast<int>(
      std::clamp<size_t>((size_t{2} << 30) / std::max<size_t>(bytes, 1), 5, 50));
}

std::vector<size_t> Sizes(size_t lo, size_t hi) {
  std::vector<size_t> s;
  for (size_t n = lo; n <= hi; n *= 4) s.push_back(n);
  return s;
}

// Rank 0 sends, rank 1 receives. Per iteration: receiver posts, signals
// ready; sender times PostSend -> receiver's ack (one-way + one signal).
// Returns the median GB/s on rank 0 (0 on rank 1).
// memcpy of the same size is timed on rank 0 in the same iterations
// (interleaved), so both see the same machine load.
double MeasureSize(Transport* t, Signal* sig, size_t n, uint32_t* tag, double* memcpy_gbps) {
  std::vector<uint8_t> buf(n, static_cast<uint8_t>(t->rank() + 1));
  std::vector<uint8_t> copy_src, copy_dst;
  if (t->rank() == 0) {
    copy_src.assign(n, 3);
    copy_dst.assign(n, 0);
  }
  std::vector<double> times, copy_times;
  const int iters = Iterations(n);
  for (int i = 0; i < iters; ++i, ++*tag) {
    if (t->rank() == 1) {
      auto h = t->PostRecv(BytesDesc(0, *tag, buf.data(), n));
      if (!h.ok()) LOG_ERROR << h.status().ToString();
      sig->Post();
      Status st = t->Wait(*h, Deadline::AfterMs(60000));
      if (!st.ok()) LOG_ERROR << "receive: " << st.ToString();
      sig->Post();
    } else {
      auto c0 = Clock::now();
      std::memcpy(copy_dst.data(), copy_src.data(), n);
      copy_times.push_back(SecondsSince(c0));
      copy_src[i % n] ^= copy_dst[(i * 7) % n];  // keep the copy observable
      sig->Take();
      auto t0 = Clock::now();
      auto h = t->PostSend(BytesDesc(1, *tag, buf.data(), n));
      if (!h.ok()) LOG_ERROR << h.status().ToString();
      sig->Take();
      times.push_back(SecondsSince(t0));
      Status st = t->Wait(*h, Deadline::AfterMs(60000));
      if (!st.ok()) LOG_ERROR << "send: " << st.ToString();
    }
  }
  if (t->rank() != 0) return 0;
  *memcpy_gbps = static_cast<double>(n) / Median(copy_times) / 1e9;
  return static_cast<double>(n) / Median(times) / 1e9;
}

// The ceiling of a backend's mechanism without the transport: the same
// one-way transfer and ack with plain blocking calls (osu-style MPI_Send /
// MPI_Recv; send()/recv() on one loopback TCP socket). Rank 0 sends; returns
// the median GB/s on rank 0 (0 on rank 1).
class RawChannel {
 public:
  virtual ~RawChannel() = default;
  double Measure(size_t n, int rank) {
    std::vector<uint8_t> buf(n, static_cast<uint8_t>(rank + 1));
    std::vector<double> times;
    for (int i = 0; i < Iterations(n); ++i) {
      if (rank == 1) {
        Byte(/*send=*/true);
        Bulk(/*send=*/false, buf.data(), n);
        Byte(/*send=*/true);
      } else {
        Byte(/*send=*/false);
        auto t0 = Clock::now();
        Bulk(/*send=*/true, buf.data(), n);
        Byte(/*send=*/false);
        times.push_back(SecondsSince(t0));
      }
    }
    return rank == 0 ? static_cast<double>(n) / Median(times) / 1e9 : 0;
  }

 protected:
  virtual void Byte(bool send) = 0;
  virtual void Bulk(bool send, uint8_t* data, size_t n) = 0;
};

class RawMpi : public RawChannel {
 public:
  explicit RawMpi(int rank) : peer_(1 - rank) {}

 private:
  void Byte(bool send) override {
    char b = 0;
    if (send) {
      MPI_Send(&b, 1, MPI_BYTE, peer_, 90, MPI_COMM_WORLD);
    } else {
      MPI_Recv(&b, 1, MPI_BYTE, peer_, 90, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    }
  }
  void Bulk(bool send, uint8_t* data, size_t n) override {
    if (send) {
      MPI_Send(data, static_cast<int>(n), MPI_BYTE, peer_, 91, MPI_COMM_WORLD);
    } else {
      MPI_Recv(data, static_cast<int>(n), MPI_BYTE, peer_, 91, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    }
  }
  int peer_;
};

class RawTcp : public RawChannel {
 public:
  // Takes ownership of a connected socket.
  RawTcp(int fd, int socket_buffer) : fd_(fd) {
    int one = 1;
    setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    if (socket_buffer > 0) {
      setsockopt(fd_, SOL_SOCKET, SO_SNDBUF, &socket_buffer, sizeof(socket_buffer));
      setsockopt(fd_, SOL_SOCKET, SO_RCVBUF, &socket_buffer, sizeof(socket_buffer));
    }
  }
  ~RawTcp() override { close(fd_); }
  // Loopback listener on an ephemeral port; -1 on failure.
  static int Listen(uint16_t* port) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(a);
    if (fd < 0 || bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 || listen(fd, 1) != 0 ||
        getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
      if (fd >= 0) close(fd);
      return -1;
    }
    *port = ntohs(a.sin_port);
    return fd;
  }
  static int Connect(uint16_t port) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(port);
    if (fd < 0 || connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
      if (fd >= 0) close(fd);
      return -1;
    }
    return fd;
  }

 private:
  void Byte(bool send) override {
    char b = 0;
    Bulk(send, reinterpret_cast<uint8_t*>(&b), 1);
  }
  void Bulk(bool send, uint8_t* data, size_t n) override {
    size_t done = 0;
    while (done < n) {
      ssize_t k = send ? ::send(fd_, data + done, n - done, MSG_NOSIGNAL)
                       : ::recv(fd_, data + done, n - done, 0);
      if (k <= 0) {
        LOG_ERROR << "bench raw tcp: " << (send ? "send" : "recv") << " failed";
        std::exit(1);
      }
      done += static_cast<size_t>(k);
    }
  }
  int fd_;
};

// Stand-in for one layer's prefill compute: a timed busy loop (CPU prefill,
// competes with the transport threads for cores) or a sleep (prefill on an
// accelerator, CPU free).
void ComputeFor(double ms, bool busy) {
  auto end = Clock::now() + std::chrono::microseconds(static_cast<int64_t>(ms * 1000));
  if (!busy) {
    std::this_thread::sleep_until(end);
    return;
  }
  volatile uint64_t x = 0;
  while (Clock::now() < end) x = x + 1;
}

struct OverlapResult {
  double compute_s = 0, transfer_s = 0, sequential_s = 0, layerwise_s = 0;
};

// The default model's KV for a 1,024-token prompt: 30 layers, 3 kv heads,
// head_dim 64, f16, 16-token blocks -> 64 blocks, 768 KiB per layer.
OverlapResult MeasureOverlap(Transport* t, Signal* sig, double layer_ms, int repeats, bool busy) {
  constexpr int kLayers = 30, kHeads = 3, kHeadDim = 64, kBlockTokens = 16, kTokens = 1024;
  constexpr int kBlocks = kTokens / kBlockTokens;
  const int64_t slab = kBlockTokens * kHeadDim * 2;
  const size_t block_bytes = static_cast<size_t>(kLayers * 2 * kHeads * slab);
  std::vector<uint8_t> mem(block_bytes * kBlocks, static_cast<uint8_t>(7 + t->rank()));
  kv_transfer::StreamSpec spec;
  spec.request_id = 1000;
  spec.layers = kLayers;
  for (int i = 0; i < kBlocks; ++i) spec.blocks.push_back(i);
  spec.global_heads = {0, kHeads};
  spec.block_tokens = kBlockTokens;
  spec.head_dim = kHeadDim;
  spec.dtype = engine::KvDtype::kF16;
  kv_transfer::StreamBuffers buffers;
  buffers.layout = {kHeads, slab, MemoryKind::kHost};
  buffers.local_heads = {0, kHeads};
  for (int i = 0; i < kBlocks; ++i) buffers.block_layer0.push_back(mem.data() + i * block_bytes);

  // mode 0: transfer only; 1: compute all then transfer; 2: layer-wise.
  std::vector<double> times[3];
  uint32_t stream = 0;
  for (int r = 0; r < repeats; ++r) {
    for (int mode = 0; mode < 3; ++mode, ++stream) {
      spec.stream_id = stream;
      if (t->rank() == 1) {
        kv_transfer::LayerStreamReceiver rx(t, 0, spec, buffers);
        if (!rx.Start().ok()) LOG_ERROR << rx.status().ToString();
        sig->Post();
        Status st = rx.WaitAll(Deadline::AfterMs(120000));
        if (!st.ok()) LOG_ERROR << "overlap receive: " << st.ToString();
        sig->Post();
        continue;
      }
      sig->Take();
      kv_transfer::LayerStreamSender tx(t, 1, spec, buffers);
      auto t0 = Clock::now();
      if (mode == 1) {
        for (int l = 0; l < kLayers; ++l) ComputeFor(layer_ms, busy);
      }
      for (int l = 0; l < kLayers; ++l) {
        if (mode == 2) ComputeFor(layer_ms, busy);
        Status st = tx.SendLayer(l);
        if (!st.ok()) LOG_ERROR << st.ToString();
      }
      sig->Take();  // every layer arrived and verified
      times[mode].push_back(SecondsSince(t0));
      (void)tx.Finish(Deadline::AfterMs(60000));
    }
  }
  OverlapResult res;
  res.compute_s = kLayers * layer_ms / 1000;
  res.transfer_s = Median(times[0]);
  res.sequential_s = Median(times[1]);
  res.layerwise_s = Median(times[2]);
  return res;
}

struct Config {
  size_t min_bytes, max_bytes;
  double layer_ms;
  int overlap_repeats;
  bool overlap;
  bool busy;
  size_t tcp_chunk_bytes;
  int tcp_socket_buffer;
  std::string model;  // non-empty: overlap with the real engine
  std::string kv_dtype;
  int threads;
  bool raw;  // also measure the plain-call ceiling (RawChannel)
  protocols::ClusterKey
      cluster_key;  // shared by both ranks (generated once, then forked/broadcast)
};

kv_transfer::TcpTransport::Options TcpOptions(const Config& cfg, int rank) {
  kv_transfer::TcpTransport::Options o;
  o.rank = rank;
  o.chunk_bytes = cfg.tcp_chunk_bytes;
  o.socket_buffer_bytes = cfg.tcp_socket_buffer;
  o.cluster_key = cfg.cluster_key;
  return o;
}

// Layer-wise overlap with the real engine: rank 0 prefills a 1,024-token
// prompt (one step) and sends each layer of its KV from the engine's layer
// hook, right after the layer is written; rank 1 receives into buffers of the
// same layout and verifies every layer. Per repetition, three timed runs:
//   compute: the prefill alone (Submit .. finished event);
//   transfer: the same KV streamed with no compute running (after a prefill);
//   layer-wise: Submit .. the receiver's "every layer verified" signal; within
//   it, the prefill's own duration and the tail after it (exposed transfer).
// hidden = 1 - (layer-wise - compute) / transfer (across runs: noisy when the
// transfer is a small fraction of the prefill); hidden_tail = 1 - tail /
// transfer (within one run).
double ProcessCpuSeconds() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  auto sec = [](const timeval& tv) { return static_cast<double>(tv.tv_sec) + tv.tv_usec * 1e-6; };
  return sec(ru.ru_utime) + sec(ru.ru_stime);
}

struct EngineOverlap {
  double compute_s = 0, transfer_s = 0, layerwise_s = 0, layerwise_prefill_s = 0, tail_s = 0;
  double transfer_cpu_s = 0;  // CPU time of the sending process during "transfer alone"
  double paired_extra_s = 0;  // median over repetitions of (layer-wise - prefill alone)
  double cpu_extra_s = 0;     // the same for the sending process's CPU time
  int64_t layer_bytes = 0;
  int layers = 0;
};

EngineOverlap MeasureEngineOverlap(Transport* t, Signal* sig, const Config& cfg) {
  constexpr int kTokens = 1024;
  EngineOverlap res;
  engine::EngineOptions eo;
  eo.model_path = cfg.model;
  auto dtype = engine::ParseKvDtype(cfg.kv_dtype);
  if (!dtype.ok()) {
    LOG_ERROR << dtype.status().ToString();
    std::exit(2);
  }
  eo.kv_dtype = *dtype;
  eo.max_step_tokens = kTokens;
  eo.max_running = 1;
  eo.max_context = 2 * kTokens;
  eo.threads = cfg.threads;
  auto created = engine::Engine::Create(eo);
  if (!created.ok()) {
    LOG_ERROR << "bench transfer: engine: " << created.status().ToString();
    std::exit(2);
  }
  std::unique_ptr<engine::Engine> eng = std::move(created).value();
  // The connector below streams one table of every layer.
  if (eng->kv_groups().size() > 1) {
    LOG_ERROR << "bench transfer: the model's KV cache has " << eng->kv_groups().DebugString()
              << "; this bench streams one KV cache group";
    std::exit(2);
  }
  BenchConnector connector;
  eng->SetKvConnector(&connector);
  const engine::KvLayout layout = eng->pool()->layout();
  const int blocks = (kTokens + layout.block_tokens - 1) / layout.block_tokens;
  res.layers = layout.layers;
  res.layer_bytes = layout.LayerBytes() * blocks;

  kv_transfer::StreamSpec spec;
  spec.request_id = 2000;
  spec.layers = layout.layers;
  for (int i = 0; i < blocks; ++i) spec.blocks.push_back(i);
  spec.global_heads = {0, layout.kv_heads};
  spec.block_tokens = layout.block_tokens;
  spec.head_dim = layout.head_dim;
  spec.dtype = layout.dtype;
  spec.model_fingerprint = eng->model().fingerprint();
  kv_transfer::StreamBuffers rx_buffers;
  std::vector<uint8_t> rx_mem;
  if (t->rank() == 1) {
    rx_mem.assign(static_cast<size_t>(layout.BlockBytes()) * blocks, 0);
    rx_buffers.layout = {layout.kv_heads, layout.SlabBytes(), MemoryKind::kHost};
    rx_buffers.local_heads = {0, layout.kv_heads};
    for (int i = 0; i < blocks; ++i) {
      rx_buffers.block_layer0.push_back(rx_mem.data() + i * layout.BlockBytes());
    }
  }
  auto tx_buffers = [&](std::span<const engine::BlockId> ids) {
    kv_transfer::StreamBuffers b;
    b.layout = {layout.kv_heads, layout.SlabBytes(), MemoryKind::kHost};
    b.local_heads = {0, layout.kv_heads};
    for (int i = 0; i < blocks; ++i) {
      b.block_layer0.push_back(eng->pool()->LayerData(ids[static_cast<size_t>(i)], 0).data());
    }
    return b;
  };
  std::mt19937 rng(1234);
  const int vocab = eng->model().config().vocab;
  int request = 0;
  // Runs one prefill-only request to completion; returns its id.
  auto prefill = [&]() {
    engine::RequestSpec rs;
    rs.id = static_cast<engine::RequestId>(++request);
    for (int i = 0; i < kTokens; ++i) rs.prompt.push_back(static_cast<int32_t>(rng() % vocab));
    rs.tenant_salt = std::to_string(rs.id);  // no prefix-cache hits between runs
    rs.sampling.max_tokens = 1;
    rs.mode = engine::RequestMode::kPrefillOnly;
    Status st = eng->Submit(rs);
    if (!st.ok()) LOG_ERROR << "submit: " << st.ToString();
    while (eng->HasWork()) {
      auto ev = eng->Step();
      if (!ev.ok()) {
        LOG_ERROR << "step: " << ev.status().ToString();
        break;
      }
    }
    return rs.id;
  };

  std::vector<double> times[3], cpu[3], lw_prefill, tails, transfer_cpu, paired, cpu_extra;
  uint32_t stream = 100;
  for (int r = 0; r < cfg.overlap_repeats; ++r) {
    for (int mode = 0; mode < 3; ++mode, ++stream) {
      spec.stream_id = stream;
      if (t->rank() == 1) {
        std::unique_ptr<kv_transfer::LayerStreamReceiver> rx;
        if (mode > 0) {
          rx = std::make_unique<kv_transfer::LayerStreamReceiver>(t, 0, spec, rx_buffers);
          if (!rx->Start().ok()) LOG_ERROR << rx->status().ToString();
        }
        sig->Post();
        if (rx) {
          Status st = rx->WaitAll(Deadline::AfterMs(300000));
          if (!st.ok()) LOG_ERROR << "engine overlap receive: " << st.ToString();
        }
        sig->Post();
        continue;
      }
      sig->Take();
      std::unique_ptr<kv_transfer::LayerStreamSender> tx;
      if (mode == 0) {
        const double cpu0 = ProcessCpuSeconds();
        auto t0 = Clock::now();
        prefill();
        times[0].push_back(SecondsSince(t0));
        cpu[0].push_back(ProcessCpuSeconds() - cpu0);
        sig->Take();
      } else if (mode == 1) {
        prefill();
        const double cpu0 = ProcessCpuSeconds();
        auto t0 = Clock::now();
        tx = std::make_unique<kv_transfer::LayerStreamSender>(t, 1, spec,
                                                              tx_buffers(connector.kept.ids()));
        for (int l = 0; l < layout.layers; ++l) {
          Status st = tx->SendLayer(l);
          if (!st.ok()) LOG_ERROR << st.ToString();
        }
        sig->Take();
        times[1].push_back(SecondsSince(t0));
        transfer_cpu.push_back(ProcessCpuSeconds() - cpu0);
      } else {
        connector.on_layer = [&](int layer, const engine::StepPlan& plan) {
          if (plan.seqs.empty()) return;
          if (!tx) {
            tx = std::make_unique<kv_transfer::LayerStreamSender>(t, 1, spec,
                                                                  tx_buffers(plan.seqs[0].blocks));
          }
          Status st = tx->SendLayer(layer);
          if (!st.ok()) LOG_ERROR << st.ToString();
        };
        const double cpu0 = ProcessCpuSeconds();
        auto t0 = Clock::now();
        prefill();
        const double prefill_s = SecondsSince(t0);
        sig->Take();
        times[2].push_back(SecondsSince(t0));
        cpu[2].push_back(ProcessCpuSeconds() - cpu0);
        std::printf(
            "  rep %d: prefill alone %.1f ms (cpu %.1f ms) | layer-wise %.1f ms (cpu %.1f ms)\n", r,
            times[0].back() * 1e3, cpu[0].back() * 1e3, times[2].back() * 1e3, cpu[2].back() * 1e3);
        std::fflush(stdout);
        paired.push_back(times[2].back() - times[0].back());
        cpu_extra.push_back(cpu[2].back() - cpu[0].back());
        lw_prefill.push_back(prefill_s);
        tails.push_back(times[2].back() - prefill_s);
        connector.on_layer = nullptr;
      }
      if (tx) {
        Status st = tx->Finish(Deadline::AfterMs(60000));
        if (!st.ok()) LOG_ERROR << "engine overlap send: " << st.ToString();
      }
      connector.kept.Release();
    }
  }
  res.compute_s = Median(times[0]);
  res.transfer_s = Median(times[1]);
  res.layerwise_s = Median(times[2]);
  res.layerwise_prefill_s = Median(lw_prefill);
  res.tail_s = Median(tails);
  res.transfer_cpu_s = Median(transfer_cpu);
  res.paired_extra_s = Median(paired);
  res.cpu_extra_s = Median(cpu_extra);
  return res;
}

// `raw` (may be null): the plain-call ceiling of the backend's mechanism,
// measured right after the transport at each size.
void Report(const std::string& backend, Transport* t, Signal* sig, const Config& cfg,
            RawChannel* raw = nullptr) {
  if (t->rank() == 0) {
    std::printf("\n== backend %s ==\n%12s %14s %14s %8s", backend.c_str(), "bytes", "memcpy GB/s",
                (backend + " GB/s").c_str(), "ratio");
    if (raw) std::printf(" %14s %8s %10s", ("raw " + backend + " GB/s").c_str(), "raw", "of raw");
    std::printf("\n");
  }
  uint32_t tag = 0;
  for (size_t n : Sizes(cfg.min_bytes, cfg.max_bytes)) {
    double mc = 0;
    double gbps = MeasureSize(t, sig, n, &tag, &mc);
    double raw_gbps = raw ? raw->Measure(n, t->rank()) : 0;
    if (t->rank() == 0) {
      std::printf("%12zu %14.2f %14.2f %7.0f%%", n, mc, gbps, 100 * gbps / mc);
      if (raw) {
        std::printf(" %14.2f %7.0f%% %9.0f%%", raw_gbps, 100 * raw_gbps / mc,
                    100 * gbps / raw_gbps);
      }
      std::printf("\n");
      std::fflush(stdout);
    }
  }
  if (!cfg.overlap || backend == "local") return;
  if (!cfg.model.empty()) {
    EngineOverlap e = MeasureEngineOverlap(t, sig, cfg);
    if (t->rank() == 0) {
      const double hidden = e.transfer_s > 0 ? 1 - (e.layerwise_s - e.compute_s) / e.transfer_s : 0;
      const double hidden_tail = e.transfer_s > 0 ? 1 - e.tail_s / e.transfer_s : 0;
      std::printf(
          "layer-wise overlap, real engine (1024-token prefill, %d layers x %.0f KiB, %s KV, "
          "medians of %d):\n  transfer alone %.2f ms | prefill alone %.1f ms | prefill with "
          "layer-wise send %.1f ms (prefill part %.1f ms, tail after it %.2f ms)\n"
          "  hidden %.0f%% = 1 - (layer-wise - prefill) / transfer; hidden by tail %.0f%% = "
          "1 - tail / transfer; sender CPU during transfer alone %.2f ms\n"
          "  paired per repetition: layer-wise - prefill alone = %.1f ms wall (hidden %.0f%%), "
          "%+.1f ms sender CPU\n",
          e.layers, static_cast<double>(e.layer_bytes) / 1024, cfg.kv_dtype.c_str(),
          cfg.overlap_repeats, e.transfer_s * 1e3, e.compute_s * 1e3, e.layerwise_s * 1e3,
          e.layerwise_prefill_s * 1e3, e.tail_s * 1e3, 100 * hidden, 100 * hidden_tail,
          e.transfer_cpu_s * 1e3, e.paired_extra_s * 1e3,
          100 * (e.transfer_s > 0 ? 1 - e.paired_extra_s / e.transfer_s : 0), e.cpu_extra_s * 1e3);
      std::fflush(stdout);
    }
    return;
  }
  OverlapResult o = MeasureOverlap(t, sig, cfg.layer_ms, cfg.overlap_repeats, cfg.busy);
  if (t->rank() == 0) {
    double hidden = o.transfer_s > 0 ? (o.sequential_s - o.layerwise_s) / o.transfer_s : 0;
    std::printf(
        "layer-wise overlap (1024 tokens, 30 layers x 768 KiB, %.1f ms %s compute/layer):\n"
        "  transfer alone %.2f ms | compute %.1f ms | compute-then-transfer %.1f ms | "
        "layer-wise %.1f ms\n  hidden %.0f%% of the transfer; exposed after compute %.2f ms\n",
        cfg.layer_ms, cfg.busy ? "busy-loop" : "sleep", o.transfer_s * 1e3, o.compute_s * 1e3,
        o.sequential_s * 1e3, o.layerwise_s * 1e3, 100 * std::clamp(hidden, 0.0, 1.0),
        (o.layerwise_s - o.compute_s) * 1e3);
  }
}

int RunLocal(const Config& cfg) {
  auto fabric = kv_transfer::LocalFabric::Create({.world_size = 2});
  auto a = std::move(fabric->CreateEndpoint(0)).value();
  auto b = std::move(fabric->CreateEndpoint(1)).value();
  std::binary_semaphore to_a(0), to_b(0);
  SemSignal sig_a(&to_b, &to_a), sig_b(&to_a, &to_b);
  std::thread receiver([&] { Report("local", b.get(), &sig_b, cfg); });
  Report("local", a.get(), &sig_a, cfg);
  receiver.join();
  return 0;
}

int RunTcpForked(const Config& cfg) {
  int p2c[2], c2p[2];
  if (pipe(p2c) != 0 || pipe(c2p) != 0) return 1;
  uint16_t raw_port = 0;
  const int raw_listener = cfg.raw ? RawTcp::Listen(&raw_port) : -1;
  std::fflush(stdout);
  pid_t child = fork();
  if (child < 0) return 1;
  const int rank = child == 0 ? 1 : 0;
  std::unique_ptr<RawTcp> raw;
  if (raw_listener >= 0) {
    int fd = rank == 1 ? RawTcp::Connect(raw_port) : accept(raw_listener, nullptr, nullptr);
    close(raw_listener);
    if (fd >= 0) raw = std::make_unique<RawTcp>(fd, cfg.tcp_socket_buffer);
  }
  PipeSignal sig(rank == 0 ? p2c[1] : c2p[1], rank == 0 ? c2p[0] : p2c[0]);
  auto t = kv_transfer::TcpTransport::Create(TcpOptions(cfg, rank));
  if (!t.ok()) {
    LOG_ERROR << t.status().ToString();
    if (rank == 1) _exit(1);
    return 1;
  }
  sig.PostU16((*t)->port());
  uint16_t peer_port = sig.TakeU16();
  Status st = (*t)->ConnectPeer(1 - rank, "127.0.0.1", peer_port, Deadline::AfterMs(10000));
  if (!st.ok()) LOG_ERROR << st.ToString();
  Report("tcp", t->get(), &sig, cfg, raw.get());
  (*t)->Shutdown();
  if (rank == 1) _exit(0);
  int wstatus = 0;
  waitpid(child, &wstatus, 0);
  return 0;
}

int RunUnderMpi(const Config& cfg, bool mpi, bool tcp, bool local) {
  Status st = kv_transfer::InitMpiThreadMultiple(nullptr, nullptr);
  if (!st.ok()) {
    LOG_ERROR << st.ToString();
    return 1;
  }
  int rank = 0, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (size != 2) {
    if (rank == 0) std::fprintf(stderr, "bench transfer: run under mpirun -np 2\n");
    MPI_Finalize();
    return 2;
  }
  if (local && rank == 0) RunLocal(cfg);
  MPI_Barrier(MPI_COMM_WORLD);
  if (mpi) {
    auto t = kv_transfer::MpiTransport::Create({});
    if (!t.ok()) {
      LOG_ERROR << t.status().ToString();
      MPI_Abort(MPI_COMM_WORLD, 1);
    }
    TransportSignal tsig(t->get());
    RawMpi raw(rank);
    Report("mpi", t->get(), &tsig, cfg, cfg.raw ? &raw : nullptr);
    MPI_Barrier(MPI_COMM_WORLD);
    (*t)->Shutdown();
  }
  if (tcp) {
    // Both ranks use rank 0's freshly generated cluster key.
    Config keyed = cfg;
    char secret[64] = {};
    if (rank == 0) std::memcpy(secret, cfg.cluster_key.secret().data(), sizeof(secret));
    MPI_Bcast(secret, sizeof(secret), MPI_CHAR, 0, MPI_COMM_WORLD);
    keyed.cluster_key =
        std::move(protocols::ClusterKey::FromSecret(std::string(secret, sizeof(secret)))).value();
    auto t = std::move(kv_transfer::TcpTransport::Create(TcpOptions(keyed, rank))).value();
    int port = t->port(), peer_port = 0;
    MPI_Sendrecv(&port, 1, MPI_INT, 1 - rank, 98, &peer_port, 1, MPI_INT, 1 - rank, 98,
                 MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    Status cs = t->ConnectPeer(1 - rank, "127.0.0.1", static_cast<uint16_t>(peer_port),
                               Deadline::AfterMs(10000));
    if (!cs.ok()) LOG_ERROR << cs.ToString();
    std::unique_ptr<RawTcp> raw;
    if (cfg.raw) {
      uint16_t raw_port = 0;
      int listener = rank == 0 ? RawTcp::Listen(&raw_port) : -1;
      int p = raw_port;
      MPI_Bcast(&p, 1, MPI_INT, 0, MPI_COMM_WORLD);
      int fd = rank == 0 ? accept(listener, nullptr, nullptr)
                         : RawTcp::Connect(static_cast<uint16_t>(p));
      if (listener >= 0) close(listener);
      if (fd >= 0) raw = std::make_unique<RawTcp>(fd, cfg.tcp_socket_buffer);
    }
    MPI_Barrier(MPI_COMM_WORLD);
    TransportSignal tsig(t.get());
    Report("tcp", t.get(), &tsig, cfg, raw.get());
    MPI_Barrier(MPI_COMM_WORLD);
    t->Shutdown();
  }
  MPI_Finalize();
  return 0;
}

const FlagSpec kSpec = {
    "kvrelay bench transfer",
    "KV transfer bandwidth and latency per backend, raw and overlapped with compute.",
    "",
    0,
    {{"backend", "all", "mpi|tcp|local|all"},
     {"min-bytes", "65536", "smallest message"},
     {"max-bytes", "268435456", "largest message"},
     {"layer-ms", "140", "simulated compute per layer in the overlap run"},
     {"overlap-repeats", "3", "repeats of the overlap run"},
     {"compute", "busy", "simulated compute: busy|sleep"},
     {"tcp-chunk-bytes", "1048576", "TCP transport chunk size"},
     {"tcp-socket-buffer", std::to_string(kv_transfer::TcpTransport::Options().socket_buffer_bytes),
      "TCP socket buffer bytes"},
     {"model", "", "measure the overlap with the real engine on this model"},
     {"kv-dtype", "f16", "KV dtype of the model's blocks"},
     {"threads", "0", "compute threads (0 = all cores)"},
     {"no-overlap", "", "skip the overlap run", true},
     {"no-raw", "", "skip the raw bandwidth run", true}}};

int BenchTransfer(const std::vector<std::string>& args) {
  int exit_code = 0;
  auto flags = ParseCommandFlags(args, kSpec, &exit_code);
  if (!flags) return exit_code;
  std::string backend = flags->Get("backend", "all");
  if (backend != "all" && backend != "mpi" && backend != "tcp" && backend != "local") {
    std::fprintf(stderr, "bench transfer: --backend must be mpi, tcp, local or all\n");
    return 2;
  }
  Config cfg;
  {
    auto key = protocols::ClusterKey::Generate();
    if (!key.ok()) {
      std::fprintf(stderr, "bench transfer: %s\n", key.status().ToString().c_str());
      return 1;
    }
    cfg.cluster_key = std::move(key).value();
  }
  auto lo = flags->GetInt("min-bytes", 64 << 10);
  auto hi = flags->GetInt("max-bytes", 256 << 20);
  // Default compute per layer: the default model's layer for 1,024 tokens is
  // ~8.4 GFLOP (7.25 GFLOP of weights + causal attention); see docs/BENCHMARKS.md.
  auto layer_ms = flags->GetDouble("layer-ms", 140.0);
  auto repeats = flags->GetInt("overlap-repeats", 3);
  if (!lo.ok() || !hi.ok() || !layer_ms.ok() || !repeats.ok() || *lo < 2 || *hi < *lo ||
      *hi > (1ll << 30) || *repeats < 1) {
    std::fprintf(stderr,
                 "bench transfer: bad --min-bytes/--max-bytes/--layer-ms/--overlap-repeats\n");
    return 2;
  }
  cfg.min_bytes = static_cast<size_t>(*lo) & ~size_t{1};
  cfg.max_bytes = static_cast<size_t>(*hi);
  cfg.layer_ms = *layer_ms;
  cfg.overlap_repeats = static_cast<int>(*repeats);
  cfg.overlap = !flags->Has("no-overlap");
  cfg.raw = !flags->Has("no-raw");
  const std::string compute = flags->Get("compute", "busy");
  if (compute != "busy" && compute != "sleep") {
    std::fprintf(stderr, "bench transfer: --compute must be busy or sleep\n");
    return 2;
  }
  cfg.busy = compute == "busy";
  auto chunk = flags->GetInt("tcp-chunk-bytes", 1 << 20);
  auto sockbuf =
      flags->GetInt("tcp-socket-buffer", kv_transfer::TcpTransport::Options().socket_buffer_bytes);
  auto threads = flags->GetInt("threads", 0);
  if (!chunk.ok() || !sockbuf.ok() || !threads.ok() || *chunk < 1 || *chunk > (64 << 20) ||
      *sockbuf < 0 || *sockbuf > (1 << 30) || *threads < 0) {
    std::fprintf(stderr, "bench transfer: bad --tcp-chunk-bytes/--tcp-socket-buffer/--threads\n");
    return 2;
  }
  cfg.tcp_chunk_bytes = static_cast<size_t>(*chunk);
  cfg.tcp_socket_buffer = static_cast<int>(*sockbuf);
  cfg.threads = static_cast<int>(*threads);
  cfg.model = flags->Get("model", "");
  cfg.kv_dtype = flags->Get("kv-dtype", "f16");
  const bool under_mpirun = std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr;
  std::printf("kvrelay bench transfer: backend=%s sizes %zu..%zu, median of 5-50 iterations\n",
              backend.c_str(), cfg.min_bytes, cfg.max_bytes);
  if (under_mpirun) {
    return RunUnderMpi(cfg, backend == "mpi" || backend == "all",
                       backend == "tcp" || backend == "all",
                       backend == "local" || backend == "all");
  }
  if (backend == "mpi") {
    std::fprintf(stderr,
                 "bench transfer: the mpi backend needs: mpirun -np 2 kvrelay bench transfer "
                 "--backend mpi\n");
    return 2;
  }
  if (backend == "local" || backend == "all") RunLocal(cfg);
  if (backend == "tcp" || backend == "all") RunTcpForked(cfg);
  if (backend == "all") std::printf("\n(mpi: run under mpirun -np 2)\n");
  return 0;
}

}  // namespace

KVRELAY_COMMAND(bench_transfer, "bench transfer",
                "bench transfer [--backend mpi|tcp|local|all] [--min-bytes N] [--max-bytes N] "
                "[--layer-ms MS] [--compute busy|sleep] [--overlap-repeats N] [--no-overlap] "
                "[--model GGUF [--kv-dtype f16] [--threads N]] [--tcp-chunk-bytes N] "
                "[--tcp-socket-buffer N] [--no-raw]",
                BenchTransfer);

}  // namespace kvrelay::cli
