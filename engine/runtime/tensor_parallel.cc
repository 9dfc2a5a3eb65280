#include "engine/runtime/tensor_parallel.h"

#include <condition_variable>
#include <mutex>

#include "common/thread_pool.h"
#include "engine/runtime/compute_backend.h"
#include "engine/runtime/forward.h"
#include "engine/runtime/model.h"

namespace kvrelay::engine {

Status CheckTensorParallelDtype(KvDtype dtype) {
  if (dtype == KvDtype::kKivi4 || dtype == KvDtype::kKivi2) {
    return Unimplemented("KV dtype " + std::string(KvDtypeName(dtype)) +
                         " keeps per-block staging state that follower ranks cannot mirror; "
                         "use f32, f16, bf16 or int8 with tensor parallelism");
  }
  return Status::Ok();
}

struct InProcessTpGroup::Shared {
  int size = 1;
  std::chrono::milliseconds timeout{0};
  std::mutex mu;
  std::condition_variable cv;
  // Guarded by mu.
  uint64_t generation = 0;
  int arrived = 0;
  std::vector<const float*> in;
  std::vector<int64_t> n_in;
  std::vector<float*> out;
  std::vector<float> result;
  bool broken = false;
};

class InProcessTpGroup::Rank : public TpCollective {
 public:
  Rank(Shared* shared, int rank) : s_(shared), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return s_->size; }

  Status AllReduceSum(float* data, int64_t n) override {
    return Collect(data, n, data, n, /*reduce=*/true);
  }
  Status AllGather(const float* local, int64_t n_local, float* out, int64_t n_out) override {
    return Collect(local, n_local, out, n_out, /*reduce=*/false);
  }

 private:
  // The last rank to arrive computes the result for everyone while the others
  // wait (their buffers are not touched by them meanwhile).
  Status Collect(const float* in, int64_t n_in, float* out, int64_t n_out, bool reduce) {
    std::unique_lock lock(s_->mu);
    if (s_->broken) return Unavailable("the in-process TP group is broken (a rank failed)");
    s_->in[rank_] = in;
    s_->n_in[rank_] = n_in;
    s_->out[rank_] = out;
    if (++s_->arrived == s_->size) {
      Status st = Combine(n_out, reduce);
      if (!st.ok()) {
        s_->broken = true;
        s_->cv.notify_all();
        return st;
      }
      s_->arrived = 0;
      ++s_->generation;
      s_->cv.notify_all();
      return Status::Ok();
    }
    const uint64_t gen = s_->generation;
    if (!s_->cv.wait_for(lock, s_->timeout, [&] { return s_->generation != gen || s_->broken; })) {
      s_->broken = true;
      s_->cv.notify_all();
      return DeadlineExceeded("TP collective: not every rank arrived within " +
                              std::to_string(s_->timeout.count()) + " ms");
    }
    if (s_->generation == gen) return Unavailable("the in-process TP group is broken");
    return Status::Ok();
  }

  Status Combine(int64_t n_out, bool reduce) {
    const int T = s_->size;
    std::vector<float>& r = s_->result;
    if (reduce) {
      for (int i = 1; i < T; ++i) {
        if (s_->n_in[i] != s_->n_in[0]) {
          return InvalidArgument("all-reduce size mismatch between ranks 0 and " +
                                 std::to_string(i));
        }
      }
      r.assign(s_->in[0], s_->in[0] + s_->n_in[0]);
      for (int i = 1; i < T; ++i) {
        for (int64_t k = 0; k < s_->n_in[0]; ++k) r[k] += s_->in[i][k];
      }
    } else {
      r.clear();
      for (int i = 0; i < T; ++i) r.insert(r.end(), s_->in[i], s_->in[i] + s_->n_in[i]);
      if (static_cast<int64_t>(r.size()) != n_out) {
        return InvalidArgument("all-gather: ranks contribute " + std::to_string(r.size()) +
                               " floats, the output holds " + std::to_string(n_out));
      }
    }
    for (int i = 0; i < T; ++i) std::copy(r.begin(), r.end(), s_->out[i]);
    return Status::Ok();
  }

  Shared* s_;
  int rank_;
};

InProcessTpGroup::InProcessTpGroup(int size, std::chrono::milliseconds timeout)
    : shared_(std::make_unique<Shared>()) {
  shared_->size = size;
  shared_->timeout = timeout;
  shared_->in.assign(size, nullptr);
  shared_->n_in.assign(size, 0);
  shared_->out.assign(size, nullptr);
  for (int r = 0; r < size; ++r) ranks_.push_back(std::make_unique<Rank>(shared_.get(), r));
}
InProcessTpGroup::~InProcessTpGroup() = default;
TpCollective* InProcessTpGroup::rank(int r) { return ranks_.at(r).get(); }

class TpFollower::Impl {
 public:
  Impl(const EngineOptions& options, std::shared_ptr<const Model> model,
       std::unique_ptr<KvBlockPool> pool, KvCacheGroups groups)
      : model_(std::move(model)),
        pool_(std::move(pool)),
        groups_(std::move(groups)),
        threads_(options.threads > 0 ? options.threads : ThreadPool::DefaultThreads(), "tp") {}
  ~Impl() {
    pool_->SetHostWriteHook(nullptr);  // backend_ goes first
  }

  // The forward pass on options.device (rank 0's device kind; each rank its
  // own device), joined to the group's collective.
  Status Init(const EngineOptions& options, TpCollective* collective) {
    ASSIGN_OR_RETURN(const DeviceSpec device, ParseDevice(options.device));
    ComputeBackendOptions bo;
    bo.device = device;
    ASSIGN_OR_RETURN(backend_, CreateComputeBackend(bo, *model_, pool_.get(), groups_, &threads_));
    backend_->SetCollective(collective);
    if (device.kind != DeviceKind::kCpu) {
      // KV received from the prefill side lands in the host pool: the
      // device copy must re-read it.
      ComputeBackend* backend = backend_.get();
      pool_->SetHostWriteHook([backend](BlockId b) { backend->InvalidateBlock(b); });
    }
    return Status::Ok();
  }

  Status Execute(const StepPlan& plan) {
    const int64_t nb = pool_->total_blocks();
    auto bad = [&](BlockId b) { return b < 0 || b >= nb; };
    for (const auto& c : plan.copies) {
      if (bad(c.src) || bad(c.dst)) {
        return InvalidArgument("step plan copies block " + std::to_string(c.src) + " -> " +
                               std::to_string(c.dst) + ", outside the pool of " +
                               std::to_string(nb) + " blocks");
      }
    }
    // ForwardPass::Run validates block tables and tokens before writing.
    for (const auto& c : plan.copies) pool_->CopyBlock(c.src, c.dst);
    std::vector<SeqStep> seqs = plan.seqs;
    for (SeqStep& s : seqs) s.logits = LogitRows::kNone;  // rank 0 samples
    ForwardOutput out;
    return backend_->Run(seqs, &out);
  }

  std::shared_ptr<const Model> model_;
  std::unique_ptr<KvBlockPool> pool_;
  KvCacheGroups groups_;
  ThreadPool threads_;
  std::unique_ptr<ComputeBackend> backend_;
};

Result<std::unique_ptr<TpFollower>> TpFollower::Create(const EngineOptions& options,
                                                       std::shared_ptr<const Model> model,
                                                       int64_t total_blocks,
                                                       TpCollective* collective) {
  if (model == nullptr) return InvalidArgument("TpFollower needs a model shard and a collective");
  const int n_layers = model->config().n_layers;
  return Create(options, std::move(model), KvCacheGroups::One(n_layers), total_blocks, collective);
}

Result<std::unique_ptr<TpFollower>> TpFollower::Create(const EngineOptions& options,
                                                       std::shared_ptr<const Model> model,
                                                       KvCacheGroups groups, int64_t total_blocks,
                                                       TpCollective* collective) {
  if (model == nullptr || collective == nullptr) {
    return InvalidArgument("TpFollower needs a model shard and a collective");
  }
  RETURN_IF_ERROR(CheckTensorParallelDtype(options.kv_dtype));
  if (total_blocks <= 0) return InvalidArgument("TpFollower: total_blocks must be > 0");
  KvBlockPool::Options po;
  if (groups.n_layers() != model->config().n_layers || groups.size() < 1) {
    return InvalidArgument("TpFollower: KV cache groups " + groups.DebugString() +
                           " do not cover " + std::to_string(model->config().n_layers) + " layers");
  }
  po.layout = model->MakeKvLayout(options.kv_dtype, options.block_tokens);
  po.layout.layers = groups.layers_per_block();
  po.capacity_bytes = total_blocks * po.layout.BlockBytes();
  ASSIGN_OR_RETURN(std::unique_ptr<KvBlockPool> pool, KvBlockPool::Create(po));
  if (pool->total_blocks() != total_blocks) {
    return Internal("follower pool has " + std::to_string(pool->total_blocks()) +
                    " blocks, rank 0 has " + std::to_string(total_blocks));
  }
  auto impl = std::make_unique<Impl>(options, std::move(model), std::move(pool), std::move(groups));
  RETURN_IF_ERROR(impl->Init(options, collective));
  return std::unique_ptr<TpFollower>(new TpFollower(std::move(impl)));
}

TpFollower::TpFollower(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
TpFollower::~TpFollower() = default;
Status TpFollower::Execute(const StepPlan& plan) { return impl_->Execute(plan); }
KvBlockPool* TpFollower::pool() { return impl_->pool_.get(); }
const Model& TpFollower::model() const { return *impl_->model_; }
const KvCacheGroups& TpFollower::kv_groups() const { return impl_->groups_; }

}  // namespace kvrelay::engine
