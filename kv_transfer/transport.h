// The KV data plane contract: move ranges of KV blocks between processes.
//
// A transfer is described by a TransferDesc: which peer, which (request, tag),
// and a list of KvSlices of caller memory, each one block's layers
// [layer_begin, layer_end) and kv heads [head_begin, head_end) laid out as in
// engine/kv_cache/kv_cache.h (per layer: K slabs of every head, then V slabs;
// head-major, so a head range is one contiguous piece of K and one of V).
// On the wire a transfer is the concatenation, slice by slice and layer by
// layer, of the K piece then the V piece; a send and a receive match when
// they name the same (peer, request_id, tag) and carry the same byte count.
// Sender and receiver may hold different head sets (TP re-sharding): only the
// byte counts have to agree; head_sharding.h plans the ranges.
//
// Lifetimes (the rule every caller must follow): the memory named by a
// posted transfer's slices must stay valid and, for a receive, untouched by
// the caller, until the transport reports the handle finished, i.e. until
// Poll() returns true or an error, Wait() returns, or Cancel() returns.
// After that the transport never reads or writes those buffers again. Each
// handle is consumed by the first of those that reports it finished.
//
// Integrity (checksums, layer bookkeeping) is the job of layer_stream.h on top
// of this; a Transport only guarantees that a receive completes OK when
// exactly the sent bytes landed, and fails otherwise.
//
// Thread-safety: every method is thread-safe.
// Backends: local (in-process), tcp (Asio), mpi (MPI_Isend/Irecv). A CUDA
// build may add nccl: device memory is declared by BufferLayout::memory and
// gated by SupportsDeviceMemory(); callers do not change.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/clock.h"
#include "common/status.h"
#include "engine/kv_cache/kv_cache.h"
#include "protocols/port_counters.h"

namespace kvrelay::kv_transfer {

enum class MemoryKind : uint8_t { kHost = 0, kDevice = 1 };

// One block's piece of KV in caller memory.
struct KvSlice {
  engine::BlockId block = engine::kNoBlock;  // for manifests and errors; not dereferenced
  int layer_begin = 0;
  int layer_end = 0;   // exclusive
  int head_begin = 0;  // in the caller's buffer layout (local head index)
  int head_end = 0;    // exclusive
  // Address of layer `layer_begin` of this block: K slabs of all `kv_heads`
  // heads, then V slabs. Const for sends, written for receives.
  uint8_t* layer_data = nullptr;
  // Bytes from one layer's data to the next; 0 means contiguous (2 * kv_heads * slab_bytes).
  int64_t layer_stride = 0;
};

// Geometry of the caller's buffers.
struct BufferLayout {
  int kv_heads = 0;        // heads present in the caller's buffer (its local heads)
  int64_t slab_bytes = 0;  // engine::KvLayout::SlabBytes()
  MemoryKind memory = MemoryKind::kHost;
};

struct TransferDesc {
  int peer = 0;  // peer index (MPI rank in the transport's communicator, TCP peer id)
  uint64_t request_id = 0;
  uint32_t tag = 0;  // distinguishes transfers of one request (layer_stream uses layer ids)
  BufferLayout layout;
  std::vector<KvSlice> slices;
};

using TransferHandle = uint64_t;

class Transport {
 public:
  virtual ~Transport() = default;

  // --- capabilities ---
  virtual std::string_view name() const = 0;  // "local", "tcp", "mpi", "nccl"
  virtual bool SupportsDeviceMemory() const = 0;
  // Posted and unfinished transfers allowed at once; Post* beyond it fails
  // with ResourceExhausted.
  virtual int max_inflight() const = 0;
  virtual int rank() const = 0;        // this endpoint's peer index
  virtual int world_size() const = 0;  // number of peer indices

  // --- peers (connection info travels inside the contract, as NIXL's
  //     getConnInfo / loadRemoteConnInfo) ---
  // How peers reach this endpoint: an opaque string the control plane carries
  // (tcp: "host:port" of the advertised address; mpi and local: empty, the
  // rank is the address).
  virtual std::string conn_info() const { return {}; }
  // Makes `peer` reachable for sends, given its conn_info(), retrying until
  // `deadline`. Idempotent: a peer already connected with the same info and a
  // live connection returns OK at once; new info (a restarted peer) reconnects.
  virtual Status ConnectPeer(int peer, std::string_view conn_info, Deadline deadline) {
    (void)conn_info;
    (void)deadline;
    if (peer < 0 || peer >= world_size()) {
      return InvalidArgument("peer " + std::to_string(peer) + " is outside world size " +
                             std::to_string(world_size()));
    }
    return Status::Ok();
  }

  // The control plane vouches that `peer` is alive again (it re-registered
  // after a restart, and work that needs its data was just assigned): forget
  // that it was lost, so receives from it can be posted again; the connection
  // it opens replaces its old one. Without this a receiver that saw a
  // sender's connection close refuses every later receive from it, and a
  // restarted sender, which only connects when it has something to send,
  // never gets the chance. A peer that is in fact still gone makes such a
  // receive wait for its deadline (or its cancel), not fail at once.
  virtual void PeerRejoined(int peer) { (void)peer; }

  // The control plane reports `peer` dead (heartbeats, a closed control
  // connection): every unfinished transfer with it ends now with `why`, and
  // PostSend / PostRecv to it fail Unavailable until ConnectPeer is called for
  // it again. A transfer whose buffers the backend cannot take back (an MPI
  // request already handed to MPI) ends with kAborted instead: its buffers
  // stay the backend's for the life of the transport and the caller must
  // quarantine them (never reuse, never free). Returns within milliseconds.
  // The default does nothing: a backend without peer tracking (nccl,
  // cuda_ipc: a dead member breaks the whole communicator, which its owner
  // aborts) ends such transfers at their deadlines.
  virtual void AbandonPeer(int peer, const Status& why) {
    (void)peer;
    (void)why;
  }
  // Bytes of caller memory abandoned to the backend so far (kAborted).
  virtual int64_t quarantined_bytes() const { return 0; }
  // What this endpoint's data port refused so far (backends with a port of
  // their own: tcp); zeros for the others.
  virtual protocols::PortSecurityCounters security_counters() const { return {}; }

  // --- data movement ---
  // Starts sending / receiving. InvalidArgument for a malformed desc (names
  // the bad field), Unavailable for a peer known to be gone.
  virtual Result<TransferHandle> PostSend(const TransferDesc& desc) = 0;
  virtual Result<TransferHandle> PostRecv(const TransferDesc& desc) = 0;
  // true: finished OK. false: still in flight. Error: finished with that error.
  virtual Result<bool> Poll(TransferHandle handle) = 0;
  // Waits until finished or `deadline`; at the deadline the transfer is
  // cancelled (buffers released) and DeadlineExceeded returned — or kAborted
  // when the backend could not take the buffers back (see Cancel).
  virtual Status Wait(TransferHandle handle, Deadline deadline) = 0;
  // Abandons a transfer. When it returns OK, the buffers are released. The peer
  // of a cancelled send sees its receive fail; a cancelled receive's data is dropped.
  // A transfer the backend cannot take back (already ended kAborted by
  // AbandonPeer, or an MPI request not released within the drain timeout)
  // returns kAborted: its buffers are NOT released and must be quarantined.
  virtual Status Cancel(TransferHandle handle) = 0;
  // Posted, unfinished transfers (for leak checks).
  virtual int inflight() const = 0;
};

}  // namespace kvrelay::kv_transfer
