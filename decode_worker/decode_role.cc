#include "decode_worker/decode_role.h"

#include <algorithm>

#include "common/logging.h"
#include "kv_transfer/mpi_session.h"
#include "protocols/messages.h"
#include "protocols/sampling_codec.h"
#include "worker/kv_streams.h"

namespace kvrelay::decode_worker {

using engine::BlockId;
using engine::RequestId;
using protocols::MessageType;
using worker::Request;
using worker::RequestState;

DecodeRole::~DecodeRole() {
  Shutdown();
  engine_.reset();
}

Status DecodeRole::Init(worker::WorkerContext& ctx) {
  ctx_ = ctx;
  const worker::WorkerOptions& o = *ctx_.options;
  // The KV streams land in every group's blocks (StartRemoteLoad); TP
  // followers mirror the groups (TpSetup) and get every group's table.
  ASSIGN_OR_RETURN(engine_, engine::Engine::Create(o.engine, ctx_.model));
  engine_->SetKvConnector(this);
  ctx_.requests->SetRelease([this](Request& r) { DropIncoming(r); });
  if (o.tp_size > 1) {
    if (o.tp_over_mpi()) {
      ASSIGN_OR_RETURN(mpi_collective_, MpiTpCollective::Create(kv_transfer::MpiSession::tp_comm(),
                                                                o.tp_step_timeout));
    }
    ASSIGN_OR_RETURN(tp_, TpLeader::Start(o, ctx_.peer_config, ctx_.transport->conn_info(), o.rank,
                                          engine_.get(), mpi_collective_.get()));
    LOG_INFO << "TP collectives over " << (mpi_collective_ ? "the MPI sub-communicator" : "TCP");
  }
  return Status::Ok();
}

void DecodeRole::DescribeRegistration(proto::RegisterWorker* reg) const {
  if (tp_ == nullptr) return;
  for (uint32_t r : tp_->data_ranks()) reg->add_tp_ranks(r);
  for (const std::string& a : tp_->kv_conn_infos()) reg->add_tp_kv_addresses(a);
}

Status DecodeRole::OnControlFrame(const protocols::Frame& frame) {
  const auto type = static_cast<MessageType>(frame.type);
  switch (type) {
    case MessageType::kReserveBlocks: {
      proto::ReserveBlocks m;
      RETURN_IF_ERROR(protocols::DecodeMessage(frame, type, &m));
      OnReserveBlocks(m);
      return Status::Ok();
    }
    case MessageType::kHandOverDue: {
      proto::HandOverDue m;
      RETURN_IF_ERROR(protocols::DecodeMessage(frame, type, &m));
      const Request* r = ctx_.requests->Find(m.request_id());
      auto* in = r != nullptr ? r->work_as<Incoming>() : nullptr;
      if (in != nullptr && in->due_at == TimePoint{}) in->due_at = Clock::now();
      return Status::Ok();  // (loaded, cancelled or failed meanwhile otherwise)
    }
    case MessageType::kCancel: {
      proto::Cancel c;
      RETURN_IF_ERROR(protocols::DecodeMessage(frame, type, &c));
      // A load in flight is cancelled through us (CancelRemoteLoad).
      ctx_.requests->Cancelled(c.request_id(), engine_->Cancel(c.request_id()).ok());
      return Status::Ok();
    }
    default:
      return InvalidArgument("a decode worker does not take control frames of type " +
                             std::to_string(frame.type));
  }
}

void DecodeRole::OnReserveBlocks(const proto::ReserveBlocks& m) {
  const RequestId id = m.request_id();
  engine::RequestSpec spec;
  spec.id = id;
  spec.prompt.assign(m.prompt_token_ids().begin(), m.prompt_token_ids().end());
  spec.sampling = protocols::FromProto(m.sampling());
  spec.mode = engine::RequestMode::kRemotePrompt;
  spec.want_text = false;  // the coordinator detokenizes
  spec.kv_peer = static_cast<int>(m.prefill_rank());
  spec.kv_transfer_id = m.kv_transfer_id() != 0 ? m.kv_transfer_id() : id;
  // The coordinator routes this request's prefill to that rank: it is
  // registered, so alive, even if its previous process's connection closed
  // (a restarted prefill worker connects only when it first sends).
  ctx_.transport->PeerRejoined(spec.kv_peer);
  Request& r =
      ctx_.requests->Add(id, RequestState::kReserved, static_cast<int64_t>(spec.prompt.size()));
  r.peers = {spec.kv_peer};
  Status s = engine_->Submit(std::move(spec));
  if (s.ok()) return;  // one hop: the prefill side already streams
  ctx_.requests->Finish(id);
  proto::ReserveBlocksReply reply;
  reply.set_request_id(id);
  reply.set_ok(false);
  reply.set_reason(s.ToString());
  reply.set_status_code(static_cast<uint32_t>(s.code()));
  ctx_.control->Send(MessageType::kReserveBlocksReply, reply);
}

namespace {
// The id the request's KV streams and hand-over frame use.
uint64_t TransferId(const engine::RequestSpec& r) {
  return r.kv_transfer_id != 0 ? r.kv_transfer_id : r.id;
}
}  // namespace

Status DecodeRole::StartRemoteLoad(const engine::RequestSpec& request,
                                   const engine::KvCacheGroups& groups,
                                   std::span<const std::vector<BlockId>> tables) {
  if (request.kv_peer < 0) {
    return InvalidArgument("request " + std::to_string(request.id) + " names no KV peer");
  }
  Request* r = ctx_.requests->Find(request.id);
  if (r == nullptr || r->state != RequestState::kReserved) {
    return Internal("request " + std::to_string(request.id) + " was not reserved here");
  }
  const kv_transfer::HeadRange own{ctx_.model->kv_head_range().begin,
                                   ctx_.model->kv_head_range().end};
  auto in = std::make_unique<Incoming>();
  ASSIGN_OR_RETURN(in->receivers, worker::StartSegmentReceivers(
                                      ctx_.transport, request.kv_peer, engine_->pool(), groups,
                                      ctx_.model->fingerprint(), TransferId(request), tables, own));
  r->work = std::move(in);
  if (Status s = PostRest(request, *r->work_as<Incoming>(), tables); !s.ok()) {
    ctx_.requests->DropWork(*r);  // its receives are cancelled now
    return s;
  }
  r->generated = 1;  // the prefill side's first token, which arrives with the KV
  ctx_.requests->Move(*r, RequestState::kReceiving);
  return Status::Ok();
}

Status DecodeRole::PostRest(const engine::RequestSpec& request, Incoming& in,
                            std::span<const std::vector<BlockId>> tables) {
  in.blocks = static_cast<int64_t>(tables[0].size());
  in.deadline = Deadline::After(ctx_.options->kv_timeout);
  ASSIGN_OR_RETURN(in.hand_over, kv_transfer::HandOverFrame::Receive(
                                     ctx_.transport, request.kv_peer, TransferId(request),
                                     static_cast<int64_t>(request.prompt.size())));
  if (tp_ != nullptr) {
    RETURN_IF_ERROR(tp_->ExpectKv(request.id, TransferId(request),
                                  static_cast<uint32_t>(request.kv_peer), tables));
    in.follower_acks_pending = ctx_.options->tp_size - 1;
  }
  return Status::Ok();
}

void DecodeRole::DropIncoming(Request& r) {
  auto* in = r.work_as<Incoming>();
  if (in == nullptr) return;
  in->receivers.clear();  // cancels outstanding receives before the blocks go back
  if (in->hand_over != nullptr && in->hand_over->quarantined()) {
    quarantined_frames_.push_back(std::move(in->hand_over));
  }
  in->hand_over.reset();
  if (tp_ != nullptr) tp_->CancelKv(r.id);
}

bool DecodeRole::polling() const { return ctx_.requests->Count({RequestState::kReceiving}) > 0; }

void DecodeRole::ApplyFollowerAcks() {
  if (tp_ == nullptr) return;
  for (const TpLeader::KvAck& ack : tp_->PollAcks()) {
    const Request* r = ctx_.requests->Find(ack.request);
    auto* in = r != nullptr ? r->work_as<Incoming>() : nullptr;
    if (in == nullptr) continue;  // cancelled meanwhile
    if (!ack.status.ok()) {
      in->follower_error = ack.status;
    } else {
      --in->follower_acks_pending;
    }
  }
}

Status DecodeRole::PollLoad(Request& r, Incoming& in, int32_t* first_token) {
  const RequestId id = r.id;
  bool all_here = in.follower_acks_pending == 0;
  int64_t layers = 0;
  for (auto& receiver : in.receivers) {
    RETURN_IF_ERROR(receiver->Progress());
    all_here = all_here && receiver->complete();
    layers += receiver->layers_complete();
  }
  RETURN_IF_ERROR(in.follower_error);
  const auto now = Clock::now();
  if (in.first_token < 0) {
    ASSIGN_OR_RETURN(bool frame, in.hand_over->Poll());
    if (frame) {
      in.first_token = in.hand_over->first_token();
      in.first_token_at = now;
    }
  }
  // Progress: a layer of ours verified, or a follower's heads all here.
  const int64_t progress = layers - in.follower_acks_pending;
  if (progress != in.progress) {
    // kv_timeout counts from the last progress (or the reservation): a
    // long prompt that keeps streaming while its prefill computes (chunk
    // by chunk, on a loaded host) is not cut; a silent one still is.
    if (in.progress >= 0) in.deadline = Deadline::After(ctx_.options->kv_timeout);
    in.progress = progress;
    in.progress_at = now;
  }
  const bool complete = all_here && in.first_token >= 0;
  if (complete) {
    *first_token = in.first_token;
    return Status::Ok();
  }
  if (in.deadline.Expired()) {
    return DeadlineExceeded("KV of request " + std::to_string(id) + " did not arrive within " +
                            std::to_string(ctx_.options->kv_timeout.count()) +
                            " ms of its reservation or its last layer");
  }
  // After the hand-over frame every layer is in the prefill side's
  // transport (it posts the frame only then), and after a HandOverDue the
  // coordinator knows the prefill is done: the rest moves at link speed,
  // so silence for kv_progress_timeout is a path cut without a reset.
  const TimePoint handed = std::max(in.first_token_at, in.due_at);
  const auto stalled_since = std::max(in.progress_at, handed);
  if (handed != TimePoint{} && now - stalled_since > ctx_.options->kv_progress_timeout) {
    return DeadlineExceeded("KV of request " + std::to_string(id) + " made no progress for " +
                            std::to_string(ctx_.options->kv_progress_timeout.count()) +
                            " ms after the prefill side handed it over (--kv-progress-timeout-ms; "
                            "the KV path is cut?)");
  }
  return Status::Ok();
}

std::vector<engine::KvConnector::RemoteLoadDone> DecodeRole::PollRemoteLoads() {
  ApplyFollowerAcks();
  std::vector<RemoteLoadDone> done;
  for (RequestId id : ctx_.requests->IdsIn(RequestState::kReceiving)) {
    Request* r = ctx_.requests->Find(id);
    auto* in = r->work_as<Incoming>();
    if (in == nullptr) continue;  // failed; the engine's error event ends it
    int32_t first_token = -1;
    const Status s = PollLoad(*r, *in, &first_token);
    if (!s.ok()) {
      if (s.code() == StatusCode::kDataLoss) kv_integrity_failures_.fetch_add(1);
      ctx_.requests->DropWork(*r);
      done.push_back({id, s.WithContext("receiving KV"), -1});
      continue;
    }
    if (first_token < 0) continue;
    ctx_.counters->transfer_bytes += ctx_.layout.BlockBytes() * in->blocks;
    ctx_.counters->transfer_seconds += SecondsSince(in->first_token_at);
    ctx_.requests->DropWork(*r);
    ctx_.requests->Move(*r, RequestState::kRunning);
    done.push_back({id, Status::Ok(), first_token});
  }
  return done;
}

void DecodeRole::CancelRemoteLoad(RequestId id) {
  // No write into the blocks after this.
  if (Request* r = ctx_.requests->Find(id); r != nullptr) ctx_.requests->DropWork(*r);
}

void DecodeRole::Progress() {
  if (tp_ == nullptr) return;
  // A follower that died while the group was idle shows up as a closed link,
  // one that stopped as an unanswered ping (health() then fails and the
  // worker leaves).
  tp_->CheckFollowers();
  if (!polling()) ApplyFollowerAcks();
}

Status DecodeRole::health() const {
  if (tp_ == nullptr) return Status::Ok();
  return tp_->status().WithContext("tensor-parallel group broken");
}

void DecodeRole::OnRegistrationEnded() {
  const Status why = Unavailable(
      "the decode worker lost its coordinator link; the connections of its last registration are "
      "closed");
  worker::AbandonAllPeers(*ctx_.transport, why);
  if (tp_ != nullptr) tp_->DropKvConnections();
}

void DecodeRole::Shutdown() {
  // The table must not call into this role after it.
  if (ctx_.requests != nullptr) {
    ctx_.requests->Clear();
    ctx_.requests->SetRelease(nullptr);
  }
  if (tp_ != nullptr) tp_->Shutdown();  // followers stop with their rank 0
}

}  // namespace kvrelay::decode_worker
