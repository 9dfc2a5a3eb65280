#include "kv_transfer/cuda_ipc_transport.h"

#include <cuda_runtime.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "engine/cuda/cuda_util.h"
#include "kv_transfer/regions.h"

namespace kvrelay::kv_transfer {
namespace {

using engine::cuda::CudaStatus;

constexpr uint32_t kMagic = 0x4B564950;  // "KVIP"
enum MsgType : uint32_t { kOffer = 1, kDone = 2, kCancelOffer = 3 };

struct Header {
  uint32_t magic = kMagic;
  uint32_t type = 0;
  uint64_t request_id = 0;
  uint32_t tag = 0;
  uint32_t n_pieces = 0;
  uint64_t total = 0;
  int32_t code = 0;  // StatusCode of a kDone
  uint32_t text_len = 0;
};
struct WirePiece {
  uint8_t handle[64];
  uint64_t offset;
  uint64_t bytes;
};
static_assert(sizeof(cudaIpcMemHandle_t) == 64);

// Reads exactly n bytes, waiting at most `timeout_ms` for each chunk.
Status ReadExact(int fd, void* dst, size_t n, int timeout_ms) {
  uint8_t* p = static_cast<uint8_t*>(dst);
  while (n > 0) {
    pollfd pfd{fd, POLLIN, 0};
    const int r = ::poll(&pfd, 1, timeout_ms);
    if (r == 0) return DeadlineExceeded("cuda_ipc control socket: message truncated");
    if (r < 0) {
      if (errno == EINTR) continue;
      return Unavailable(std::string("cuda_ipc control socket: ") + std::strerror(errno));
    }
    const ssize_t got = ::read(fd, p, n);
    if (got == 0) return Unavailable("cuda_ipc peer closed the control socket");
    if (got < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      return Unavailable(std::string("cuda_ipc control socket: ") + std::strerror(errno));
    }
    p += got;
    n -= static_cast<size_t>(got);
  }
  return Status::Ok();
}

Status WriteAll(int fd, const void* src, size_t n) {
  const uint8_t* p = static_cast<const uint8_t*>(src);
  while (n > 0) {
    const ssize_t put = ::send(fd, p, n, MSG_NOSIGNAL);
    if (put < 0) {
      if (errno == EINTR) continue;
      return Unavailable(std::string("cuda_ipc control socket: ") + std::strerror(errno));
    }
    p += put;
    n -= static_cast<size_t>(put);
  }
  return Status::Ok();
}

}  // namespace

struct CudaIpcTransport::Op {
  TransferHandle handle = 0;
  bool is_send = false;
  Key key;
  std::vector<Region> regions;
  size_t total = 0;
  std::vector<Piece> pieces;    // sends: what was offered
  cudaEvent_t event = nullptr;  // receives: the copies' completion
  bool copying = false;
  bool sender_cancelled = false;
  bool done = false;
  Status status;
};

Result<std::unique_ptr<CudaIpcTransport>> CudaIpcTransport::Create(
    const CudaIpcTransportOptions& options) {
  if (options.rank != 0 && options.rank != 1)
    return InvalidArgument("cuda_ipc rank must be 0 or 1");
  if (options.control_fd < 0) return InvalidArgument("cuda_ipc needs a connected control_fd");
  if (options.max_inflight < 1) return InvalidArgument("cuda_ipc max_inflight must be >= 1");
  RETURN_IF_ERROR(CudaStatus(cudaSetDevice(options.device), "cudaSetDevice"));
  std::unique_ptr<CudaIpcTransport> t(new CudaIpcTransport(options));
  cudaStream_t s = nullptr;
  RETURN_IF_ERROR(
      CudaStatus(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate"));
  t->stream_ = s;
  t->reader_ = std::thread([p = t.get()] { p->ReaderLoop(); });
  return t;
}

CudaIpcTransport::CudaIpcTransport(const CudaIpcTransportOptions& options)
    : options_(options), fd_(options.control_fd) {}

CudaIpcTransport::~CudaIpcTransport() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (fd_ >= 0) ::shutdown(fd_, SHUT_RDWR);
  }
  stop_.store(true);
  if (reader_.joinable()) reader_.join();
  std::lock_guard<std::mutex> lock(mu_);
  // Receives still copying: let the copies land before unmapping.
  for (auto& op : copying_) {
    if (op->event != nullptr) cudaEventSynchronize(op->event);
  }
  for (auto& [h, op] : ops_) {
    if (op->event != nullptr) cudaEventDestroy(op->event);
  }
  for (auto& [h, p] : opened_) cudaIpcCloseMemHandle(p);
  if (stream_ != nullptr) cudaStreamDestroy(static_cast<cudaStream_t>(stream_));
  if (fd_ >= 0) ::close(fd_);
}

Status CudaIpcTransport::RegisterMemory(const void* base, size_t bytes) {
  if (base == nullptr || bytes == 0) return InvalidArgument("cuda_ipc RegisterMemory: empty range");
  cudaIpcMemHandle_t h;
  RETURN_IF_ERROR(
      CudaStatus(cudaIpcGetMemHandle(&h, const_cast<void*>(base)), "cudaIpcGetMemHandle"));
  Registered r;
  r.base = reinterpret_cast<uintptr_t>(base);
  r.bytes = bytes;
  std::memcpy(r.handle.data(), &h, 64);
  std::lock_guard<std::mutex> lock(mu_);
  registered_.push_back(r);
  return Status::Ok();
}

Status CudaIpcTransport::SendMessageLocked(uint32_t type, const Key& key, uint64_t total,
                                           const Status& status, const std::vector<Piece>& pieces) {
  if (!lost_.ok()) return lost_;
  Header h;
  h.type = type;
  h.request_id = key.first;
  h.tag = key.second;
  h.n_pieces = static_cast<uint32_t>(pieces.size());
  h.total = total;
  h.code = static_cast<int32_t>(status.code());
  h.text_len = static_cast<uint32_t>(status.message().size());
  std::vector<uint8_t> buf(sizeof(h) + pieces.size() * sizeof(WirePiece) + h.text_len);
  std::memcpy(buf.data(), &h, sizeof(h));
  uint8_t* p = buf.data() + sizeof(h);
  for (const Piece& pc : pieces) {
    WirePiece w;
    std::memcpy(w.handle, pc.handle.data(), 64);
    w.offset = pc.offset;
    w.bytes = pc.bytes;
    std::memcpy(p, &w, sizeof(w));
    p += sizeof(w);
  }
  std::memcpy(p, status.message().data(), h.text_len);
  Status st = WriteAll(fd_, buf.data(), buf.size());
  if (!st.ok()) PeerLostLocked(st);
  return st;
}

Result<TransferHandle> CudaIpcTransport::PostSend(const TransferDesc& desc) {
  return Post(desc, true);
}
Result<TransferHandle> CudaIpcTransport::PostRecv(const TransferDesc& desc) {
  return Post(desc, false);
}

Result<TransferHandle> CudaIpcTransport::Post(const TransferDesc& desc, bool is_send) {
  RETURN_IF_ERROR(ValidateDesc(desc, 2));
  if (desc.peer != 1 - options_.rank) {
    return InvalidArgument("cuda_ipc peer must be " + std::to_string(1 - options_.rank));
  }
  if (is_send && desc.layout.memory != MemoryKind::kDevice) {
    return InvalidArgument("cuda_ipc sends read device memory (layout.memory = kDevice)");
  }
  auto op = std::make_shared<Op>();
  op->is_send = is_send;
  op->key = {desc.request_id, desc.tag};
  op->regions = ResolveRegions(desc);
  op->total = TotalBytes(op->regions);
  std::unique_lock<std::mutex> lock(mu_);
  if (!lost_.ok()) return lost_;
  if (static_cast<int>(ops_.size()) >= options_.max_inflight) {
    return ResourceExhausted("cuda_ipc: " + std::to_string(ops_.size()) + " transfers in flight");
  }
  auto& table = is_send ? sends_ : recvs_;
  const bool copying = std::any_of(copying_.begin(), copying_.end(),
                                   [&](const auto& o) { return o->key == op->key; });
  if (table.count(op->key) > 0 || (!is_send && copying)) {
    return AlreadyExists("cuda_ipc: request " + std::to_string(desc.request_id) + " tag " +
                         std::to_string(desc.tag) + " is already posted");
  }
  if (is_send) {
    for (const Region& r : op->regions) {
      const uintptr_t a = reinterpret_cast<uintptr_t>(r.data);
      const Registered* reg = nullptr;
      for (const Registered& g : registered_) {
        if (a >= g.base && a + r.bytes <= g.base + g.bytes) reg = &g;
      }
      if (reg == nullptr) {
        return InvalidArgument(
            "cuda_ipc send: a slice lies outside registered device memory "
            "(RegisterMemory the pool slab first)");
      }
      op->pieces.push_back({reg->handle, a - reg->base, r.bytes});
    }
  }
  op->handle = next_handle_++;
  ops_[op->handle] = op;
  if (is_send) {
    sends_[op->key] = op;
    Status st = SendMessageLocked(kOffer, op->key, op->total, Status::Ok(), op->pieces);
    if (!st.ok()) {
      ops_.erase(op->handle);
      sends_.erase(op->key);
      return st;
    }
  } else {
    auto it = offers_.find(op->key);
    if (it != offers_.end()) {
      Offer offer = std::move(it->second);
      offers_.erase(it);
      StartCopyLocked(op, offer);
    } else {
      recvs_[op->key] = op;
    }
  }
  return op->handle;
}

void CudaIpcTransport::StartCopyLocked(const std::shared_ptr<Op>& op, const Offer& offer) {
  if (offer.total != op->total) {
    Status st = InvalidArgument("cuda_ipc request " + std::to_string(op->key.first) + " tag " +
                                std::to_string(op->key.second) + ": sender offers " +
                                std::to_string(offer.total) + " bytes, the receive holds " +
                                std::to_string(op->total));
    static_cast<void>(SendMessageLocked(kDone, op->key, 0, st, {}));
    FinishLocked(op, st);
    return;
  }
  cudaStream_t s = static_cast<cudaStream_t>(stream_);
  Status st;
  // Walk the offered pieces and the receive regions together (both in wire order).
  size_t ri = 0, rin = 0;
  for (const Piece& pc : offer.pieces) {
    void*& mapped = opened_[pc.handle];
    if (mapped == nullptr) {
      cudaIpcMemHandle_t h;
      std::memcpy(&h, pc.handle.data(), 64);
      st = CudaStatus(cudaIpcOpenMemHandle(&mapped, h, cudaIpcMemLazyEnablePeerAccess),
                      "cudaIpcOpenMemHandle");
      if (!st.ok()) {
        opened_.erase(pc.handle);
        break;
      }
    }
    const uint8_t* src = static_cast<const uint8_t*>(mapped) + pc.offset;
    uint64_t left = pc.bytes;
    while (left > 0 && st.ok()) {
      const Region& r = op->regions[ri];
      const size_t n = std::min<size_t>(left, r.bytes - rin);
      st = CudaStatus(cudaMemcpyAsync(r.data + rin, src, n, cudaMemcpyDefault, s),
                      "cudaMemcpyAsync");
      src += n;
      left -= n;
      rin += n;
      if (rin == r.bytes) {
        ++ri;
        rin = 0;
      }
    }
    if (!st.ok()) break;
  }
  if (st.ok())
    st =
        CudaStatus(cudaEventCreateWithFlags(&op->event, cudaEventDisableTiming), "cudaEventCreate");
  if (st.ok()) st = CudaStatus(cudaEventRecord(op->event, s), "cudaEventRecord");
  if (!st.ok()) {
    // Copies already enqueued must land before the buffers are released.
    cudaStreamSynchronize(s);
    static_cast<void>(SendMessageLocked(kDone, op->key, 0, st, {}));
    FinishLocked(op, st);
    return;
  }
  op->copying = true;
  copying_.push_back(op);
}

void CudaIpcTransport::ProgressLocked() {
  for (size_t i = 0; i < copying_.size();) {
    std::shared_ptr<Op> op = copying_[i];
    const cudaError_t e = cudaEventQuery(op->event);
    if (e == cudaErrorNotReady) {
      ++i;
      continue;
    }
    copying_.erase(copying_.begin() + static_cast<std::ptrdiff_t>(i));
    op->copying = false;
    Status st = e == cudaSuccess ? Status::Ok() : CudaStatus(e, "cuda_ipc copy");
    if (st.ok() && op->sender_cancelled) st = Cancelled("cuda_ipc sender cancelled the transfer");
    static_cast<void>(SendMessageLocked(kDone, op->key, 0, st, {}));
    FinishLocked(op, st);
  }
}

void CudaIpcTransport::FinishLocked(const std::shared_ptr<Op>& op, Status status) {
  if (op->done) return;
  op->done = true;
  op->status = std::move(status);
  if (op->is_send) {
    sends_.erase(op->key);
  } else {
    auto it = recvs_.find(op->key);
    if (it != recvs_.end() && it->second == op) recvs_.erase(it);
  }
  cv_.notify_all();
}

void CudaIpcTransport::PeerLostLocked(const Status& why) {
  if (!lost_.ok()) return;
  lost_ = Unavailable("cuda_ipc peer lost: " + why.message());
  if (fd_ >= 0) ::shutdown(fd_, SHUT_RDWR);
  // Receives that are copying keep going (their data is local); everything
  // else fails now.
  for (auto& [h, op] : ops_) {
    if (!op->done && !op->copying) FinishLocked(op, lost_);
  }
  offers_.clear();
  cv_.notify_all();
}

void CudaIpcTransport::ReaderLoop() {
  const int fd = options_.control_fd;
  while (!stop_.load()) {
    bool lost;
    {
      std::lock_guard<std::mutex> lock(mu_);
      ProgressLocked();
      lost = !lost_.ok();
    }
    if (lost) {  // nothing more can arrive; keep driving local copies
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      continue;
    }
    pollfd pfd{fd, POLLIN, 0};
    const int r = ::poll(&pfd, 1, 1);  // 1 ms: also the copy-progress tick
    if (r == 0) continue;
    if (r < 0) {
      if (errno == EINTR) continue;
      std::lock_guard<std::mutex> lock(mu_);
      PeerLostLocked(Unavailable(std::strerror(errno)));
      continue;
    }
    Header h;
    Status st = ReadExact(fd, &h, sizeof(h), 5000);
    if (st.ok() && h.magic != kMagic) st = DataLoss("cuda_ipc control socket: bad magic");
    std::vector<Piece> pieces;
    std::string text;
    if (st.ok() && h.n_pieces > (1u << 20)) st = DataLoss("cuda_ipc: absurd piece count");
    for (uint32_t i = 0; st.ok() && i < h.n_pieces; ++i) {
      WirePiece w;
      st = ReadExact(fd, &w, sizeof(w), 5000);
      Piece p;
      std::memcpy(p.handle.data(), w.handle, 64);
      p.offset = w.offset;
      p.bytes = w.bytes;
      pieces.push_back(p);
    }
    if (st.ok() && h.text_len > 0) {
      text.resize(std::min<uint32_t>(h.text_len, 1 << 16));
      st = ReadExact(fd, text.data(), text.size(), 5000);
    }
    std::lock_guard<std::mutex> lock(mu_);
    if (!st.ok()) {
      PeerLostLocked(st);
      continue;
    }
    const Key key{h.request_id, h.tag};
    if (h.type == kOffer) {
      auto it = recvs_.find(key);
      Offer offer{h.total, std::move(pieces)};
      if (it != recvs_.end()) {
        std::shared_ptr<Op> op = it->second;
        recvs_.erase(it);
        StartCopyLocked(op, offer);
      } else {
        offers_[key] = std::move(offer);
      }
    } else if (h.type == kDone) {
      auto it = sends_.find(key);
      if (it != sends_.end()) {
        std::shared_ptr<Op> op = it->second;
        FinishLocked(op, h.code == 0 ? Status::Ok()
                                     : Status(static_cast<StatusCode>(h.code),
                                              "cuda_ipc receiver: " + text));
      }
    } else if (h.type == kCancelOffer) {
      if (offers_.erase(key) > 0) {
        static_cast<void>(
            SendMessageLocked(kDone, key, 0, Cancelled("receive not posted yet"), {}));
      } else {
        bool copying = false;
        for (auto& op : copying_) {
          if (op->key == key) {
            op->sender_cancelled = true;  // answered when its copy lands
            copying = true;
          }
        }
        if (!copying)
          static_cast<void>(SendMessageLocked(kDone, key, 0, Cancelled("nothing to cancel"), {}));
      }
    }
  }
}

Result<bool> CudaIpcTransport::Poll(TransferHandle handle) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = ops_.find(handle);
  if (it == ops_.end())
    return NotFound("cuda_ipc: unknown transfer handle " + std::to_string(handle));
  ProgressLocked();
  std::shared_ptr<Op> op = it->second;
  if (!op->done) return false;
  if (op->event != nullptr) cudaEventDestroy(op->event);
  ops_.erase(it);
  if (!op->status.ok()) return op->status;
  return true;
}

Status CudaIpcTransport::Wait(TransferHandle handle, Deadline deadline) {
  for (;;) {
    Result<bool> r = Poll(handle);
    if (!r.ok()) return r.status();
    if (*r) return Status::Ok();
    if (deadline.Expired()) {
      Status c = Cancel(handle);
      return DeadlineExceeded("cuda_ipc transfer did not finish by its deadline" +
                              (c.ok() ? std::string() : " (cancel: " + c.message() + ")"));
    }
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, std::chrono::microseconds(200));
  }
}

Status CudaIpcTransport::Cancel(TransferHandle handle) {
  std::unique_lock<std::mutex> lock(mu_);
  auto it = ops_.find(handle);
  if (it == ops_.end())
    return NotFound("cuda_ipc: unknown transfer handle " + std::to_string(handle));
  std::shared_ptr<Op> op = it->second;
  if (!op->done) {
    if (op->is_send) {
      // The receiver may be reading our memory: ask it to stop and wait for
      // its answer before the buffers count as released.
      if (SendMessageLocked(kCancelOffer, op->key, 0, Status::Ok(), {}).ok()) {
        const Deadline d = Deadline::After(options_.cancel_timeout);
        while (!op->done && lost_.ok() && !d.Expired())
          cv_.wait_for(lock, std::chrono::milliseconds(1));
      }
      if (!op->done) {
        PeerLostLocked(DeadlineExceeded("no answer to a cancel"));
        FinishLocked(op, lost_);
      }
    } else {
      if (op->copying) {
        cudaEventSynchronize(op->event);  // device copies finish; then drop the data
        copying_.erase(std::remove(copying_.begin(), copying_.end(), op), copying_.end());
        op->copying = false;
        static_cast<void>(
            SendMessageLocked(kDone, op->key, 0, Cancelled("receiver cancelled"), {}));
      }
      FinishLocked(op, Cancelled("cancelled"));
    }
  }
  if (op->event != nullptr) cudaEventDestroy(op->event);
  ops_.erase(op->handle);
  return Status::Ok();
}

int CudaIpcTransport::inflight() const {
  std::lock_guard<std::mutex> lock(mu_);
  int n = 0;
  for (const auto& [h, op] : ops_) n += op->done ? 0 : 1;
  return n;
}

}  // namespace kvrelay::kv_transfer
