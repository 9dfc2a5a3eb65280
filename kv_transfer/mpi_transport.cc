#include "kv_transfer/mpi_transport.h"

#include <pthread.h>

#include <algorithm>
#include <cstdlib>
#include <list>

#include "common/logging.h"

namespace kvrelay::kv_transfer {
namespace {

constexpr int kBound = 1;  // Op::backend_state: an MPI receive/send writes/reads the buffers

struct WireHeader {
  uint64_t request_id;
  uint32_t tag;
  uint32_t reserved;
  uint64_t total;
};
static_assert(sizeof(WireHeader) == 24);

std::string MpiError(int code) {
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(code, msg, &len);
  return std::string(msg, static_cast<size_t>(len));
}

// A datatype covering `regions` at absolute addresses (use with MPI_BOTTOM).
MPI_Datatype MakeType(const std::vector<Region>& regions) {
  std::vector<int> lengths(regions.size());
  std::vector<MPI_Aint> displs(regions.size());
  for (size_t i = 0; i < regions.size(); ++i) {
    lengths[i] = static_cast<int>(regions[i].bytes);
    MPI_Get_address(regions[i].data, &displs[i]);
  }
  MPI_Datatype type;
  MPI_Type_create_hindexed(static_cast<int>(regions.size()), lengths.data(), displs.data(),
                           MPI_BYTE, &type);
  MPI_Type_commit(&type);
  return type;
}

}  // namespace

Status InitMpiThreadMultiple(int* argc, char*** argv) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  int provided = 0;
  if (!initialized) {
    int rc = MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided);
    if (rc != MPI_SUCCESS) return Unavailable("MPI_Init_thread failed: " + MpiError(rc));
  } else {
    MPI_Query_thread(&provided);
  }
  if (provided < MPI_THREAD_SERIALIZED) {
    return FailedPrecondition("MPI provides thread level " + std::to_string(provided) +
                              "; kv_transfer needs at least MPI_THREAD_SERIALIZED");
  }
  return Status::Ok();
}

struct MpiTransport::Active {
  enum class Kind { kSend, kDirectRecv, kStagedRecv } kind;
  OpPtr op;             // send or direct receive
  TransferKey key;      // staged receive
  WireHeader header{};  // send: must outlive the Isend
  MPI_Request reqs[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
  MPI_Datatype type = MPI_DATATYPE_NULL;
  std::vector<uint8_t> staging;
};

Result<std::unique_ptr<MpiTransport>> MpiTransport::Create(Options options) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) return FailedPrecondition("mpi transport: MPI is not initialised");
  int provided = 0;
  MPI_Query_thread(&provided);
  if (provided < MPI_THREAD_SERIALIZED) {
    return FailedPrecondition("mpi transport: MPI thread level " + std::to_string(provided) +
                              " is below MPI_THREAD_SERIALIZED");
  }
  auto t = std::unique_ptr<MpiTransport>(new MpiTransport(options));
  MPI_Comm_rank(options.comm, &t->rank_);
  MPI_Comm_size(options.comm, &t->world_size_);
  MpiTransport* raw = t.get();
  t->progress_ = std::thread([raw] {
    pthread_setname_np(pthread_self(), "kv-mpi-progress");
    raw->ProgressLoop();
  });
  return t;
}

MpiTransport::MpiTransport(Options options)
    : TransportBase(std::make_shared<SyncDomain>(), options.max_inflight,
                    options.max_unexpected_bytes),
      options_(options) {}

MpiTransport::~MpiTransport() { Shutdown(); }

void MpiTransport::Shutdown() {
  std::unique_lock lock(domain_->mu);
  if (stopping_) return;
  stopping_ = true;
  domain_->cv.notify_all();
  if (!progress_.joinable()) return;
  const auto limit = options_.cancel_drain_timeout + options_.shutdown_grace;
  if (!domain_->cv.wait_for(lock, limit, [&] { return progress_exited_; })) {
    LOG_ERROR << "mpi transport: the progress thread is still inside an MPI call "
              << std::chrono::duration_cast<std::chrono::milliseconds>(limit).count()
              << " ms after shutdown began (MPI no longer progresses in this process, as after a "
                 "peer died while this process sent to it); ending the process without MPI";
    std::_Exit(options_.stuck_exit_code);
  }
  lock.unlock();
  progress_.join();
}

Status MpiTransport::StartSendLocked(const OpPtr& op, std::unique_lock<std::mutex>&) {
  if (stopping_) return Cancelled("mpi transport shut down");
  if (op->total > kMaxMessageBytes) {
    return InvalidArgument("mpi transport: transfer of " + std::to_string(op->total) +
                           " bytes exceeds the per-transfer maximum of " +
                           std::to_string(kMaxMessageBytes));
  }
  op->backend_state = kBound;
  send_queue_.push_back(op);
  domain_->cv.notify_all();
  return Status::Ok();
}

void MpiTransport::RecvPostedLocked(const OpPtr& op, std::unique_lock<std::mutex>&) {
  if (op->total > kMaxMessageBytes) {
    CompleteLocked(op, InvalidArgument("mpi transport: receive of " + std::to_string(op->total) +
                                       " bytes exceeds the per-transfer maximum"));
  }
}

void MpiTransport::CancelLocked(const OpPtr& op, std::unique_lock<std::mutex>& lock) {
  if (op->is_send && std::erase(send_queue_, op) > 0) {
    op->backend_state = 0;  // never handed to MPI
    return;
  }
  if (op->backend_state != kBound) {
    TransportBase::CancelLocked(op, lock);
    return;
  }
  // MPI owns the buffers until the matched message completes.
  bool drained = domain_->cv.wait_for(lock, options_.cancel_drain_timeout,
                                      [&] { return op->backend_state != kBound; });
  if (!drained) {
    // A dead or stuck peer: MPI keeps the buffers, the caller must too.
    LOG_WARNING << "mpi transport: " << KeyString(op->key)
                << " still owned by MPI after the cancel drain timeout; quarantined";
    QuarantineLocked(op, "not released by MPI within the cancel drain timeout");
  }
}

void MpiTransport::AbandonPeerLocked(int peer, const Status& why, std::unique_lock<std::mutex>&) {
  // Sends not yet handed to MPI: their buffers are still ours to give back.
  for (auto it = send_queue_.begin(); it != send_queue_.end();) {
    if ((*it)->key.peer == peer) {
      (*it)->backend_state = 0;
      CompleteLocked(*it, why);
      it = send_queue_.erase(it);
    } else {
      ++it;
    }
  }
}

Status MpiTransport::ConnectPeer(int peer, std::string_view, Deadline) {
  if (peer < 0 || peer >= world_size_) {
    return InvalidArgument("mpi transport: peer " + std::to_string(peer) +
                           " is outside world size " + std::to_string(world_size_));
  }
  std::lock_guard lock(domain_->mu);
  PeerBackLocked(peer);
  return Status::Ok();
}

void MpiTransport::ProgressLoop() {
  MPI_Comm comm = options_.comm;
  WireHeader incoming{};
  MPI_Request header_req = MPI_REQUEST_NULL;
  MPI_Irecv(&incoming, sizeof(incoming), MPI_BYTE, MPI_ANY_SOURCE, options_.header_tag, comm,
            &header_req);
  std::list<std::unique_ptr<Active>> active;
  auto sleep = options_.idle_sleep_min;
  TimePoint last_progress = Clock::now();
  std::vector<OpPtr> new_sends;

  auto finish = [&](Active& a) {
    if (a.type != MPI_DATATYPE_NULL) MPI_Type_free(&a.type);
    std::lock_guard lock(domain_->mu);
    switch (a.kind) {
      case Active::Kind::kSend:
      case Active::Kind::kDirectRecv:
        a.op->backend_state = 0;
        if (!a.op->is_send) a.op->received = a.op->total;
        CompleteLocked(a.op, a.op->cancel_requested ? Cancelled("cancelled") : Status::Ok());
        break;
      case Active::Kind::kStagedRecv:
        if (a.key.tag == ~0u) break;  // payload of a size-mismatched receive: dropped
        DeliverLocked(a.key, 0, a.staging.size(), a.staging.data(), a.staging.size());
        break;
    }
  };

  for (;;) {
    {
      std::unique_lock lock(domain_->mu);
      if (stopping_) break;
      new_sends.assign(send_queue_.begin(), send_queue_.end());
      send_queue_.clear();
    }
    bool progressed = !new_sends.empty();
    for (OpPtr& op : new_sends) {
      auto a = std::make_unique<Active>();
      a->kind = Active::Kind::kSend;
      a->op = op;
      a->header = {op->key.request_id, op->key.tag, 0, op->total};
      MPI_Isend(&a->header, sizeof(a->header), MPI_BYTE, op->key.peer, options_.header_tag, comm,
                &a->reqs[0]);
      if (op->regions.size() == 1) {
        MPI_Isend(op->regions[0].data, static_cast<int>(op->total), MPI_BYTE, op->key.peer,
                  options_.data_tag, comm, &a->reqs[1]);
      } else {
        a->type = MakeType(op->regions);
        MPI_Isend(MPI_BOTTOM, 1, a->type, op->key.peer, options_.data_tag, comm, &a->reqs[1]);
      }
      active.push_back(std::move(a));
    }
    new_sends.clear();

    // Headers: each announces one payload from its source, in order.
    for (;;) {
      int flag = 0;
      MPI_Status status;
      MPI_Test(&header_req, &flag, &status);
      if (!flag) break;
      progressed = true;
      const int source = status.MPI_SOURCE;
      TransferKey key{source, incoming.request_id, incoming.tag};
      const size_t total = incoming.total;
      auto a = std::make_unique<Active>();
      OpPtr op;
      {
        std::lock_guard lock(domain_->mu);
        op = TakePostedRecvLocked(key);
        if (op && op->total != total) {
          CompleteLocked(op, DataLoss(KeyString(key) + ": sender sent " + std::to_string(total) +
                                      " bytes, receive expects " + std::to_string(op->total)));
          op.reset();
          key.tag = ~0u;  // staged under an unmatchable key, then dropped
        }
        if (op) op->backend_state = kBound;
      }
      if (op) {
        a->kind = Active::Kind::kDirectRecv;
        a->op = op;
        if (op->regions.size() == 1) {
          MPI_Irecv(op->regions[0].data, static_cast<int>(total), MPI_BYTE, source,
                    options_.data_tag, comm, &a->reqs[0]);
        } else {
          a->type = MakeType(op->regions);
          MPI_Irecv(MPI_BOTTOM, 1, a->type, source, options_.data_tag, comm, &a->reqs[0]);
        }
      } else {
        a->kind = Active::Kind::kStagedRecv;
        a->key = key;
        a->staging.resize(total);
        MPI_Irecv(a->staging.data(), static_cast<int>(total), MPI_BYTE, source, options_.data_tag,
                  comm, &a->reqs[0]);
      }
      active.push_back(std::move(a));
      MPI_Irecv(&incoming, sizeof(incoming), MPI_BYTE, MPI_ANY_SOURCE, options_.header_tag, comm,
                &header_req);
    }

    for (auto it = active.begin(); it != active.end();) {
      int flag = 0;
      MPI_Testall(2, (*it)->reqs, &flag, MPI_STATUSES_IGNORE);
      if (flag) {
        finish(**it);
        it = active.erase(it);
        progressed = true;
      } else {
        ++it;
      }
    }

    if (progressed) {
      sleep = options_.idle_sleep_min;
      last_progress = Clock::now();
      continue;
    }
    // Moving: an active message that someone still waits for. A quarantined
    // one (its peer was abandoned) may never complete: it is tested on the
    // idle backoff below, not spun on, or every dead peer would cost this
    // process a core for the rest of its life.
    bool moving = false;
    if (!active.empty()) {
      std::lock_guard lock(domain_->mu);
      moving = std::any_of(active.begin(), active.end(),
                           [](const auto& a) { return !(a->op && a->op->quarantined); });
    }
    if (moving || Clock::now() - last_progress < options_.spin_after_progress) {
      // A message is moving: MPI only advances (e.g. shared-memory fragments)
      // inside MPI_Test, so keep testing; yield so oversubscribed ranks run.
      std::this_thread::yield();
      continue;
    }
    std::unique_lock lock(domain_->mu);
    domain_->cv.wait_for(lock, sleep, [&] { return stopping_ || !send_queue_.empty(); });
    const auto cap = HasPostedRecvsLocked() ? options_.posted_sleep_max : options_.idle_sleep_max;
    sleep = std::min(sleep * 2, cap);
  }

  // Shutdown: withdraw the header receive; give in-flight messages a moment.
  auto deadline = Deadline::After(options_.cancel_drain_timeout);
  MPI_Cancel(&header_req);
  for (int flag = 0; !flag && !deadline.Expired();) {
    MPI_Test(&header_req, &flag, MPI_STATUS_IGNORE);
    if (!flag) std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  // Requests to abandoned peers never complete: do not wait for them.
  auto waiting = [&] {
    std::lock_guard lock(domain_->mu);
    return std::any_of(active.begin(), active.end(),
                       [](const auto& a) { return !(a->op && a->op->quarantined); });
  };
  while (waiting() && !deadline.Expired()) {
    for (auto it = active.begin(); it != active.end();) {
      int flag = 0;
      MPI_Testall(2, (*it)->reqs, &flag, MPI_STATUSES_IGNORE);
      if (flag) {
        finish(**it);
        it = active.erase(it);
      } else {
        ++it;
      }
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  std::lock_guard lock(domain_->mu);
  const auto stuck = std::count_if(active.begin(), active.end(),
                                   [](const auto& a) { return !(a->op && a->op->quarantined); });
  if (stuck > 0) {
    LOG_ERROR << "mpi transport: " << stuck << " transfers still in flight at shutdown";
  }
  for (auto& a : active) {
    if (a->op) CompleteLocked(a->op, Cancelled("mpi transport shut down"));
  }
  for (auto& op : send_queue_) CompleteLocked(op, Cancelled("mpi transport shut down"));
  send_queue_.clear();
  progress_exited_ = true;
  domain_->cv.notify_all();
}

}  // namespace kvrelay::kv_transfer
