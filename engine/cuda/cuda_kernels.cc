#include "engine/cuda/cuda_kernels.h"

#include <cublas_v2.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "engine/cuda/cuda_sampler.h"
#include "engine/cuda/cuda_util.h"
#include "engine/cuda/device.h"
#include "engine/cuda/kernel_math.h"
#include "engine/cuda/kernels.cuh"
#include "engine/kernels/gelu.h"
#include "engine/runtime/forward.h"
#if KVRELAY_WITH_NCCL
#include "engine/cuda/nccl_communicator.h"
#endif

namespace kvrelay::engine::cuda {
namespace {

Status CublasStatus(cublasStatus_t s, const char* what) {
  if (s == CUBLAS_STATUS_SUCCESS) return Status::Ok();
  std::string m = std::string(what) + ": " + cublasGetStatusString(s);
  if (s == CUBLAS_STATUS_ALLOC_FAILED) return ResourceExhausted(std::move(m));
  return Internal(std::move(m));
}
#define KVR_CUBLAS_RETURN(expr) RETURN_IF_ERROR(CublasStatus((expr), #expr))

// The first units % size ranks get one more (model.h SplitUnits).
UnitRange Split(int units, int size, int rank) {
  const int base = units / size, extra = units % size;
  UnitRange r;
  r.begin = rank * base + std::min(rank, extra);
  r.end = r.begin + base + (rank < extra ? 1 : 0);
  return r;
}

// Kernel families whose share of a step `kvrelay_gpu_check bench` measures:
// with KVRELAY_CUDA_DOUBLE=<name> (read every step) every launch of that
// family is enqueued twice, so the step grows by the family's cost. The
// step's outputs are then meaningless; timing only.
enum class Family { kNone, kMatMul, kQuantize, kNorm, kRopeKv, kAttention, kSwiGlu, kEmbed };
Family DoubledFamily() {
  const char* e = std::getenv("KVRELAY_CUDA_DOUBLE");
  if (e == nullptr) return Family::kNone;
  static const std::pair<const char*, Family> kNames[] = {
      {"matmul", Family::kMatMul},  {"quantize", Family::kQuantize},   {"norm", Family::kNorm},
      {"rope_kv", Family::kRopeKv}, {"attention", Family::kAttention}, {"swiglu", Family::kSwiGlu},
      {"embed", Family::kEmbed}};
  for (const auto& [name, f] : kNames) {
    if (std::strcmp(e, name) == 0) return f;
  }
  return Family::kNone;
}

struct DevLayer {
  DevMatrix wq, wk, wv, wo, gate, up, down;
  // gate rows then up rows in one matrix (one product per step) when the two
  // share a type and width; gate and up are then empty.
  DevMatrix gate_up;
  // Q, K and V rows in one matrix likewise (wq, wk, wv then empty), with the
  // biases stacked in bqkv (zeros where a projection has none), or null.
  DevMatrix wqkv;
  float* bqkv = nullptr;
  float* attn_norm = nullptr;
  float* ffn_norm = nullptr;
  float* bq = nullptr;
  float* bk = nullptr;
  float* bv = nullptr;
  // Gemma 3 only.
  float* post_attn_norm = nullptr;
  float* post_ffn_norm = nullptr;
  float* q_norm = nullptr;
  float* k_norm = nullptr;
};

static_assert(kMaxBackendTopK == kMaxDeviceTopK, "BackendPick's top_k range is the sampler's");

// What xq_ (the q8 copy a GEMV product reads) holds: kNoQ8, or the
// step_kernels.h Act whose rows it quantizes.
constexpr int kNoQ8 = -1;

class CudaKernels final : public StepKernels {
 public:
  CudaKernels(const ComputeBackendOptions& options, const Model& model, KvBlockPool* pool,
              KvCacheGroups groups)
      : options_(options), model_(model), pool_(pool), groups_(std::move(groups)) {}
  ~CudaKernels() override {
    for (auto& [key, g] : graphs_) cudaGraphExecDestroy(g);
    if (cublas_ != nullptr) cublasDestroy(cublas_);
    for (void* p : allocations_) cudaFree(p);
  }

  Status Init();

  Status RunStep(std::span<const SeqStep> seqs, const StepShape& shape,
                 std::span<const int64_t> logit_rows, std::span<const BackendPick> picks,
                 ForwardOutput* out, const std::function<void(int layer)>& layer_hook,
                 const std::function<Status()>& body) override;
  Status Embed(float scale) override;
  Status RmsNorm(int layer, LayerNorm which, Act in, Act out) override;
  Status ProjectQkv(int layer) override;
  Status QkNorm(int layer) override;
  Status RopeWriteKv(int layer, float rope_base, float q_scale) override;
  Status Attend(int layer, int window, float scale) override;
  Status LayerDone(int) override { return Status::Ok(); }  // hooks run after the step
  Status Project(int layer, LayerMatrix which, Act in, Act out, bool accumulate) override;
  Status ProjectGateUp(int layer) override;
  Status GatedActivation(ModelConfig::FfnAct act) override;
  Status Add(Act dst, Act src) override;
  Status AllReduce(Act a) override;
  Status GatherColumns(Act local, const std::vector<UnitRange>& widths) override;
  Status FinalNorm() override;
  Status Logits(float softcap) override;
  bool PicksTokens() const override { return true; }
  void SetCollective(TpCollective* collective) override { collective_ = collective; }
  void InvalidateBlock(BlockId block) override {
    if (block >= 0 && block < static_cast<BlockId>(valid_.size())) valid_[block] = 0;
  }

 private:
  Status UploadMatrix(const GgufTensor* t, DevMatrix* out);
  // The tensors' rows stacked into one device matrix (same type and width:
  // quantized rows are self-contained, so stacking is a byte concatenation).
  Status UploadStacked(std::span<const GgufTensor* const> ts, DevMatrix* out);
  Status UploadFloats(const std::vector<float>& v, float** out);
  // fp16 copies of every matrix when they fit (fp16_weight_cache_fraction).
  Status BuildFp16Cache();
  Status Alloc(size_t bytes, void** out);
  // Whether a product of w with T tokens reads the q8 activations (xq_), so
  // the kernel that writes its input may quantize it in place (fusion).
  bool ReadsQ8(const DevMatrix& w, int64_t T) const {
    return w.data != nullptr && T < options_.gemm_min_tokens &&
           math::QuantizedActivationType(w.type);
  }
  DevQ8 Q8() const { return {xq_q_.as<int8_t>(), xq_d_.as<float>(), xq_s_.as<float>()}; }
  // Y (+)= W X for T tokens; `xq_ready` says x is already quantized in xq_.
  Status MatMul(const DevMatrix& w, const float* x, int64_t T, const float* bias, bool accumulate,
                float* y, bool* xq_ready);
  // A product of buffer `in`: reuses xq_ when it holds `in`, and records
  // that it does after the product quantized it.
  Status Product(const DevMatrix& w, Act in, int64_t T, const float* bias, bool accumulate,
                 float* y);
  // Uploads the invalid blocks among `needed` (holding cached positions);
  // `fresh` blocks (only positions this step writes) become valid as they are.
  Status UploadInvalidBlocks(const std::vector<int32_t>& needed, const std::vector<int32_t>& fresh);
  // kExact TP: all ranks' [T x w_r] blocks of `local` -> [T x full] in `full`.
  Status GatherColumns(const float* local, const std::vector<UnitRange>& widths, int64_t T,
                       float* full);
  Status AllReduce(float* data, int64_t n);
  float* Buf(Act a) const;
  // A kernel wrote `a`: a q8 copy of it is stale (unless set again).
  void Wrote(Act a) {
    if (xq_of_ == static_cast<int>(a)) xq_of_ = kNoQ8;
  }

  // Launches of family f per step: 2 for the doubled family, else 1.
  int Reps(Family f) const { return f == doubled_ ? 2 : 1; }

  ComputeBackendOptions options_;
  Family doubled_ = Family::kNone;  // set at the start of each step
  const Model& model_;
  KvBlockPool* pool_;
  KvCacheGroups groups_;
  TpCollective* collective_ = nullptr;
  cublasHandle_t cublas_ = nullptr;
  Stream stream_, copy_stream_;
  std::vector<Event> layer_ready_;  // per layer slot: uploads of that slot done
  std::vector<void*> allocations_;  // weights, norms, the KV pool, the GELU table
  std::vector<DevLayer> layers_;
  DevMatrix embd_, lm_head_;
  float* output_norm_ = nullptr;
  const uint16_t* gelu_table_ = nullptr;
  uint8_t* kv_pool_ = nullptr;
  std::vector<uint8_t> valid_;  // per block: the device copy equals the host bytes
  std::vector<UnitRange> q_cols_, ffn_cols_;
  // Per-step scratch.
  DeviceBuffer meta_, x_, xn_, q_, k_, v_, attn_, proj_, gate_, up_, partials_, logits_, kv_stash_,
      xq_q_, xq_d_, xq_s_, xh_, wh_, gathered_, full_, norm_tmp_;
  PinnedBuffer h_meta_, h_logits_, h_stash_, h_upload_, h_tp_;
  // Decode-step graphs by step shape (see RunStep); seen_ counts uncaptured runs.
  std::map<std::string, cudaGraphExec_t> graphs_;
  std::map<std::string, int> seen_;
  std::vector<float> tp_host_, tp_host2_;
  CudaSampler sampler_;  // picks on the device (RunStep's picks)
  std::vector<DeviceSampleParams> pick_params_;

  // The step RunStep is running: sizes, device metadata, where the
  // products left Q/K/V and gate/up, what xq_ holds.
  int64_t T_ = 0, R_ = 0, max_len_ = 0;
  int split_tokens_ = 0;
  bool exact_tp_ = false, uploads_ = false, mirror_ = false;
  const int32_t* d_tokens_ = nullptr;
  const int32_t* d_seq_ = nullptr;
  const int32_t* d_rows_ = nullptr;
  const int64_t* d_pos_ = nullptr;
  std::vector<DevKvView> kv_;  // per group
  float *qp_ = nullptr, *kp_ = nullptr, *vp_ = nullptr;
  int64_t ldq_ = 0, ldkv_ = 0;
  const float *g_in_ = nullptr, *u_in_ = nullptr;
  int64_t ld_ffn_ = 0;
  int ffn_layer_ = 0;  // the layer of the last ProjectGateUp
  int xq_of_ = kNoQ8;
};

Status CudaKernels::Alloc(size_t bytes, void** out) {
  KVR_CUDA_RETURN(cudaMalloc(out, bytes == 0 ? 1 : bytes));
  allocations_.push_back(*out);
  return Status::Ok();
}

Status CudaKernels::UploadMatrix(const GgufTensor* t, DevMatrix* out) {
  return UploadStacked(std::span<const GgufTensor* const>(&t, 1), out);
}

Status CudaKernels::UploadStacked(std::span<const GgufTensor* const> ts, DevMatrix* out) {
  size_t bytes = 0;
  for (const GgufTensor* t : ts) {
    if (t == nullptr) return InvalidArgument("missing weight tensor");
    const uint32_t type = static_cast<uint32_t>(t->type);
    if (!math::DeviceSupportsType(type)) {
      return Unimplemented("cuda backend: tensor " + t->name + " has ggml type " +
                           std::to_string(type) +
                           "; supported: F32, F16, Q4_0, Q4_1, Q8_0, Q4_K, Q6_K");
    }
    if (math::QuantizedActivationType(type) && t->Cols() % 32 != 0) {
      return InvalidArgument("tensor " + t->name + ": columns are not a multiple of 32");
    }
    if (t->type != ts[0]->type || t->Cols() != ts[0]->Cols()) {
      return InvalidArgument("tensor " + t->name + ": stacked with " + ts[0]->name +
                             " of another type or width");
    }
    bytes += t->nbytes;
  }
  out->type = static_cast<uint32_t>(ts[0]->type);
  out->cols = ts[0]->Cols();
  out->rows = 0;
  for (const GgufTensor* t : ts) out->rows += t->Rows();
  out->row_bytes = out->rows > 0 ? static_cast<int64_t>(bytes) / out->rows : 0;
  void* p = nullptr;
  RETURN_IF_ERROR(Alloc(bytes, &p));
  size_t at = 0;
  for (const GgufTensor* t : ts) {
    KVR_CUDA_RETURN(
        cudaMemcpy(static_cast<uint8_t*>(p) + at, t->data, t->nbytes, cudaMemcpyHostToDevice));
    at += t->nbytes;
  }
  out->data = static_cast<const uint8_t*>(p);
  return Status::Ok();
}

Status CudaKernels::UploadFloats(const std::vector<float>& v, float** out) {
  if (v.empty()) {
    *out = nullptr;
    return Status::Ok();
  }
  void* p = nullptr;
  RETURN_IF_ERROR(Alloc(v.size() * sizeof(float), &p));
  KVR_CUDA_RETURN(cudaMemcpy(p, v.data(), v.size() * sizeof(float), cudaMemcpyHostToDevice));
  *out = static_cast<float*>(p);
  return Status::Ok();
}

Status CudaKernels::BuildFp16Cache() {
  std::vector<DevMatrix*> all;
  for (DevLayer& l : layers_) {
    for (DevMatrix* m :
         {&l.wq, &l.wk, &l.wv, &l.wqkv, &l.wo, &l.gate, &l.up, &l.gate_up, &l.down}) {
      if (m->data != nullptr) all.push_back(m);
    }
  }
  all.push_back(&lm_head_);
  size_t bytes = 0;
  for (const DevMatrix* m : all) bytes += static_cast<size_t>(m->rows * m->cols) * sizeof(__half);
  size_t free_b = 0, total_b = 0;
  RETURN_IF_ERROR(DeviceMemory(&free_b, &total_b));
  if (options_.fp16_weight_cache_fraction <= 0 ||
      static_cast<double>(bytes) >
          options_.fp16_weight_cache_fraction * static_cast<double>(free_b)) {
    return Status::Ok();
  }
  for (DevMatrix* m : all) {
    void* p = nullptr;
    RETURN_IF_ERROR(Alloc(static_cast<size_t>(m->rows * m->cols) * sizeof(__half), &p));
    LaunchDequantF16(*m, static_cast<__half*>(p), stream_.get());
    m->f16 = static_cast<const __half*>(p);
  }
  if (lm_head_.data == embd_.data) embd_.f16 = lm_head_.f16;
  KVR_CUDA_RETURN(cudaStreamSynchronize(stream_.get()));
  return Status::Ok();
}

Status CudaKernels::Init() {
  std::string desc;
  RETURN_IF_ERROR(UseDevice(options_.device.index, &desc).WithContext("cuda backend"));
  const ModelConfig& c = model_.config();
  const KvLayout& kl = pool_->layout();
  if (kl.dtype != KvDtype::kF32 && kl.dtype != KvDtype::kF16) {
    return Unimplemented("cuda backend: KV dtype " + std::string(KvDtypeName(kl.dtype)) +
                         " is not supported on the device (use f32 or f16)");
  }
  if (c.head_dim % 32 != 0 || c.head_dim / 32 > 8 || c.head_dim / 32 == 5 || c.head_dim / 32 == 6 ||
      c.head_dim / 32 == 7) {
    return Unimplemented("cuda backend: head_dim " + std::to_string(c.head_dim) +
                         " is not supported (32, 64, 96, 128 or 256)");
  }
  if (groups_.n_layers() != c.n_layers || kl.layers != groups_.layers_per_block()) {
    return InvalidArgument("cuda backend: the KV cache groups do not match the model and pool");
  }
  if (c.d_model % 32 != 0 || c.ffn_dim % 32 != 0) {
    return Unimplemented("cuda backend: d_model and ffn_dim must be multiples of 32");
  }
  RETURN_IF_ERROR(stream_.Create());
  RETURN_IF_ERROR(copy_stream_.Create());
  KVR_CUBLAS_RETURN(cublasCreate(&cublas_));
  KVR_CUBLAS_RETURN(cublasSetStream(cublas_, stream_.get()));
  KVR_CUBLAS_RETURN(cublasSetMathMode(cublas_, CUBLAS_DEFAULT_MATH));
  layers_.resize(c.n_layers);
  for (int l = 0; l < c.n_layers; ++l) {
    const LayerWeights& w = model_.layers()[l];
    DevLayer& d = layers_[l];
    const std::string ctx = "layer " + std::to_string(l);
    if (w.wq != nullptr && w.wk != nullptr && w.wv != nullptr && w.wq->type == w.wk->type &&
        w.wq->type == w.wv->type && w.wq->Cols() == w.wk->Cols() && w.wq->Cols() == w.wv->Cols()) {
      const GgufTensor* qkv[3] = {w.wq, w.wk, w.wv};
      RETURN_IF_ERROR(UploadStacked(qkv, &d.wqkv).WithContext(ctx));
      if (!w.bq.empty() || !w.bk.empty() || !w.bv.empty()) {
        std::vector<float> b;
        for (const auto& [t, bias] :
             {std::pair{w.wq, &w.bq}, std::pair{w.wk, &w.bk}, std::pair{w.wv, &w.bv}}) {
          if (!bias->empty() && static_cast<int64_t>(bias->size()) != t->Rows()) {
            return InvalidArgument(ctx + ": bias of " + t->name + " has " +
                                   std::to_string(bias->size()) + " values for " +
                                   std::to_string(t->Rows()) + " rows");
          }
          if (bias->empty()) {
            b.insert(b.end(), static_cast<size_t>(t->Rows()), 0.0f);
          } else {
            b.insert(b.end(), bias->begin(), bias->end());
          }
        }
        RETURN_IF_ERROR(UploadFloats(b, &d.bqkv));
      }
    } else {
      RETURN_IF_ERROR(UploadMatrix(w.wq, &d.wq).WithContext(ctx));
      RETURN_IF_ERROR(UploadMatrix(w.wk, &d.wk).WithContext(ctx));
      RETURN_IF_ERROR(UploadMatrix(w.wv, &d.wv).WithContext(ctx));
      RETURN_IF_ERROR(UploadFloats(w.bq, &d.bq));
      RETURN_IF_ERROR(UploadFloats(w.bk, &d.bk));
      RETURN_IF_ERROR(UploadFloats(w.bv, &d.bv));
    }
    RETURN_IF_ERROR(UploadMatrix(w.wo, &d.wo).WithContext(ctx));
    if (w.ffn_gate != nullptr && w.ffn_up != nullptr && w.ffn_gate->type == w.ffn_up->type &&
        w.ffn_gate->Cols() == w.ffn_up->Cols()) {
      const GgufTensor* gu[2] = {w.ffn_gate, w.ffn_up};
      RETURN_IF_ERROR(UploadStacked(gu, &d.gate_up).WithContext(ctx));
    } else {
      RETURN_IF_ERROR(UploadMatrix(w.ffn_gate, &d.gate).WithContext(ctx));
      RETURN_IF_ERROR(UploadMatrix(w.ffn_up, &d.up).WithContext(ctx));
    }
    RETURN_IF_ERROR(UploadMatrix(w.ffn_down, &d.down).WithContext(ctx));
    RETURN_IF_ERROR(UploadFloats(w.attn_norm_w, &d.attn_norm));
    RETURN_IF_ERROR(UploadFloats(w.ffn_norm_w, &d.ffn_norm));
    if (c.gemma_norms) {
      RETURN_IF_ERROR(UploadFloats(w.post_attn_norm_w, &d.post_attn_norm));
      RETURN_IF_ERROR(UploadFloats(w.post_ffn_norm_w, &d.post_ffn_norm));
      RETURN_IF_ERROR(UploadFloats(w.q_norm_w, &d.q_norm));
      RETURN_IF_ERROR(UploadFloats(w.k_norm_w, &d.k_norm));
      if (d.post_attn_norm == nullptr || d.post_ffn_norm == nullptr || d.q_norm == nullptr ||
          d.k_norm == nullptr) {
        return InvalidArgument(ctx + ": a Gemma norm weight is missing");
      }
    }
  }
  RETURN_IF_ERROR(UploadMatrix(&model_.token_embd(), &embd_).WithContext("token_embd"));
  if (&model_.lm_head() == &model_.token_embd()) {
    lm_head_ = embd_;
  } else {
    RETURN_IF_ERROR(UploadMatrix(&model_.lm_head(), &lm_head_).WithContext("output"));
  }
  RETURN_IF_ERROR(UploadFloats(model_.output_norm(), &output_norm_));
  // The device pool: same block count and layout as the host pool.
  void* p = nullptr;
  RETURN_IF_ERROR(
      Alloc(static_cast<size_t>(pool_->total_blocks() * kl.BlockBytes()), &p)
          .WithContext("device KV pool of " + std::to_string(pool_->total_blocks()) + " blocks"));
  kv_pool_ = static_cast<uint8_t*>(p);
  valid_.assign(pool_->total_blocks(), 0);
  RETURN_IF_ERROR(BuildFp16Cache());  // after the pool: it takes a share of what is left
  if (c.ffn_act == ModelConfig::FfnAct::kGeluTanh) {
    const std::span<const uint16_t> table = GeluTableGgml();
    void* t = nullptr;
    RETURN_IF_ERROR(Alloc(table.size_bytes(), &t));
    KVR_CUDA_RETURN(cudaMemcpy(t, table.data(), table.size_bytes(), cudaMemcpyHostToDevice));
    gelu_table_ = static_cast<const uint16_t*>(t);
  }
  layer_ready_.resize(kl.layers);  // per layer slot of a block
  for (Event& e : layer_ready_) RETURN_IF_ERROR(e.Create());
  const TensorParallelShard& shard = model_.shard();
  const ModelConfig& full = model_.full_config();
  const int ffn_unit = full.ffn_dim / model_.ffn_units();
  for (int r = 0; r < shard.size; ++r) {
    // The query heads of every rank, replicated KV heads included (model.h).
    ASSIGN_OR_RETURN(const AttentionHeadShard heads,
                     ShardAttentionHeads(full.n_heads, full.n_kv_heads, shard.size, r));
    const UnitRange h = heads.q;
    q_cols_.push_back({h.begin * full.head_dim, h.end * full.head_dim});
    const UnitRange f = Split(model_.ffn_units(), shard.size, r);
    ffn_cols_.push_back({f.begin * ffn_unit, f.end * ffn_unit});
  }
  return Status::Ok();
}

Status CudaKernels::MatMul(const DevMatrix& w, const float* x, int64_t T, const float* bias,
                           bool accumulate, float* y, bool* xq_ready) {
  cudaStream_t s = stream_.get();
  if (T >= options_.gemm_min_tokens) {
    // Tensor cores: fp16 tiles of W and X, fp32 accumulation.
    if (w.f16 == nullptr) {
      RETURN_IF_ERROR(wh_.Reserve(static_cast<size_t>(w.rows * w.cols) * sizeof(__half)));
    }
    RETURN_IF_ERROR(xh_.Reserve(static_cast<size_t>(T * w.cols) * sizeof(__half)));
    const __half* wf16 = w.f16;
    if (wf16 == nullptr) {
      LaunchDequantF16(w, wh_.as<__half>(), s);
      wf16 = wh_.as<__half>();
    }
    LaunchFloatToHalf(x, T * w.cols, xh_.as<__half>(), s);
    const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
    for (int rep = 1; rep < Reps(Family::kMatMul); ++rep) {
      KVR_CUBLAS_RETURN(cublasGemmEx(
          cublas_, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(w.rows), static_cast<int>(T),
          static_cast<int>(w.cols), &alpha, wf16, CUDA_R_16F, static_cast<int>(w.cols), xh_.get(),
          CUDA_R_16F, static_cast<int>(w.cols), &beta, y, CUDA_R_32F, static_cast<int>(w.rows),
          CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    }
    KVR_CUBLAS_RETURN(cublasGemmEx(
        cublas_, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(w.rows), static_cast<int>(T),
        static_cast<int>(w.cols), &alpha, wf16, CUDA_R_16F, static_cast<int>(w.cols), xh_.get(),
        CUDA_R_16F, static_cast<int>(w.cols), &beta, y, CUDA_R_32F, static_cast<int>(w.rows),
        CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    if (bias != nullptr) LaunchAddBias(y, bias, T, w.rows, s);
    return Status::Ok();
  }
  // xq_ holds T * max(d_model, q_dim, ffn_dim) activations (Run reserves it).
  const DevQ8 q = Q8();
  if (math::QuantizedActivationType(w.type) && !*xq_ready) {
    for (int rep = 0; rep < Reps(Family::kQuantize); ++rep) LaunchQuantizeQ8(x, T, w.cols, q, s);
    *xq_ready = true;
  }
  for (int rep = 0; rep < Reps(Family::kMatMul); ++rep)
    LaunchGemv(w, x, q, T, bias, accumulate, y, s);
  return Status::Ok();
}

Status CudaKernels::UploadInvalidBlocks(const std::vector<int32_t>& blocks,
                                        const std::vector<int32_t>& fresh) {
  std::vector<int32_t> todo;
  for (int32_t b : blocks) {
    if (!valid_[b]) {
      todo.push_back(b);
      valid_[b] = 1;  // the copies below are ordered before any read of it
    }
  }
  for (int32_t b : fresh) valid_[b] = 1;  // every position read is written first
  const KvLayout& kl = pool_->layout();
  const int64_t lb = kl.LayerBytes();
  const int L = kl.layers;  // layer slots of a block
  if (todo.empty()) return Status::Ok();
  std::sort(todo.begin(), todo.end());
  todo.erase(std::unique(todo.begin(), todo.end()), todo.end());
  // The previous step's copies are done before its end (it synchronised), so
  // the staging buffer is free. Layer by layer: stage the host bytes, enqueue
  // the copies, record the slot's event; the compute stream waits on a
  // slot's event only before the first layer in that slot writes or reads
  // its KV, so later layers' copies overlap earlier layers' compute.
  RETURN_IF_ERROR(h_upload_.Reserve(static_cast<size_t>(todo.size() * lb * L)));
  const KvBlockPool& pool = *pool_;
  for (int l = 0; l < L; ++l) {
    uint8_t* stage = h_upload_.as<uint8_t>() + static_cast<size_t>(l) * todo.size() * lb;
    for (size_t i = 0; i < todo.size(); ++i) {
      std::span<const uint8_t> src = pool.LayerData(todo[i], l);
      std::memcpy(stage + i * lb, src.data(), static_cast<size_t>(lb));
      uint8_t* dst = kv_pool_ + static_cast<int64_t>(todo[i]) * kl.BlockBytes() + l * lb;
      KVR_CUDA_RETURN(cudaMemcpyAsync(dst, stage + i * lb, static_cast<size_t>(lb),
                                      cudaMemcpyHostToDevice, copy_stream_.get()));
    }
    KVR_CUDA_RETURN(cudaEventRecord(layer_ready_[l].get(), copy_stream_.get()));
  }
  return Status::Ok();
}

Status CudaKernels::AllReduce(float* data, int64_t n) {
#if KVRELAY_WITH_NCCL
  // An NCCL group reduces the device buffer in place.
  if (auto* nccl = dynamic_cast<NcclCommunicator*>(collective_)) {
    return nccl->AllReduceSumDevice(data, n, stream_.get());
  }
#endif
  // Any other TpCollective: staged through host memory.
  tp_host_.resize(n);
  KVR_CUDA_RETURN(cudaMemcpyAsync(tp_host_.data(), data, n * sizeof(float), cudaMemcpyDeviceToHost,
                                  stream_.get()));
  KVR_CUDA_RETURN(cudaStreamSynchronize(stream_.get()));
  RETURN_IF_ERROR(collective_->AllReduceSum(tp_host_.data(), n));
  KVR_CUDA_RETURN(cudaMemcpyAsync(data, tp_host_.data(), n * sizeof(float), cudaMemcpyHostToDevice,
                                  stream_.get()));
  return Status::Ok();
}

Status CudaKernels::GatherColumns(const float* local, const std::vector<UnitRange>& widths,
                                  int64_t T, float* full) {
  const int64_t total = widths.back().end;
  const int64_t mine = widths[model_.shard().rank].size();
#if KVRELAY_WITH_NCCL
  // NCCL all-gathers equal pieces on the device; rank r's [T x w] block then
  // lands in columns [r.begin, r.end) of every row with one 2-D copy.
  auto* nccl = dynamic_cast<NcclCommunicator*>(collective_);
  const bool equal = std::all_of(widths.begin(), widths.end(),
                                 [&](const UnitRange& r) { return r.size() == mine; });
  if (nccl != nullptr && equal) {
    RETURN_IF_ERROR(gathered_.Reserve(static_cast<size_t>(T * total) * sizeof(float)));
    float* g = gathered_.as<float>();
    RETURN_IF_ERROR(nccl->AllGatherDevice(local, T * mine, g, stream_.get()));
    for (const UnitRange& r : widths) {
      KVR_CUDA_RETURN(cudaMemcpy2DAsync(full + r.begin, total * sizeof(float), g + T * r.begin,
                                        mine * sizeof(float), mine * sizeof(float), T,
                                        cudaMemcpyDeviceToDevice, stream_.get()));
    }
    return Status::Ok();
  }
#endif
  tp_host_.resize(T * mine);
  tp_host2_.resize(T * total);
  KVR_CUDA_RETURN(cudaMemcpyAsync(tp_host_.data(), local, T * mine * sizeof(float),
                                  cudaMemcpyDeviceToHost, stream_.get()));
  KVR_CUDA_RETURN(cudaStreamSynchronize(stream_.get()));
  std::vector<float> gathered(T * total);
  RETURN_IF_ERROR(collective_->AllGather(tp_host_.data(), T * mine, gathered.data(), T * total));
  for (const UnitRange& r : widths) {
    const float* src = gathered.data() + T * r.begin;
    const int64_t w = r.size();
    for (int64_t t = 0; t < T; ++t) {
      std::copy(src + t * w, src + (t + 1) * w, tp_host2_.data() + t * total + r.begin);
    }
  }
  KVR_CUDA_RETURN(cudaMemcpyAsync(full, tp_host2_.data(), T * total * sizeof(float),
                                  cudaMemcpyHostToDevice, stream_.get()));
  // tp_host2_ must stay untouched until the copy ran: the next use is after
  // a later synchronisation.
  return Status::Ok();
}

float* CudaKernels::Buf(Act a) const {
  switch (a) {
    case Act::kX:
      return x_.as<float>();
    case Act::kXn:
      return xn_.as<float>();
    case Act::kAttn:
      return attn_.as<float>();
    case Act::kProj:
      return proj_.as<float>();
    case Act::kFfn:
      return gate_.as<float>();  // the gated activation's output
    case Act::kFull:
      break;
  }
  return full_.as<float>();
}

Status CudaKernels::Product(const DevMatrix& w, Act in, int64_t T, const float* bias,
                            bool accumulate, float* y) {
  bool ready = xq_of_ == static_cast<int>(in);
  RETURN_IF_ERROR(MatMul(w, Buf(in), T, bias, accumulate, y, &ready));
  if (ready) xq_of_ = static_cast<int>(in);
  return Status::Ok();
}

Status CudaKernels::RunStep(std::span<const SeqStep> seqs, const StepShape& shape,
                            std::span<const int64_t> logit_rows, std::span<const BackendPick> picks,
                            ForwardOutput* out, const std::function<void(int layer)>& layer_hook,
                            const std::function<Status()>& body) {
  const ModelConfig& c = model_.config();
  const KvLayout& kl = pool_->layout();
  // The device is per host thread; steps may run on another thread than Init.
  KVR_CUDA_RETURN(cudaSetDevice(options_.device.index));
  doubled_ = DoubledFamily();
  const int B = kl.block_tokens;
  const int64_t T = shape.tokens;
  if (T > 65535) {
    return InvalidArgument("cuda backend: " + std::to_string(T) +
                           " tokens in one step (at most 65535: one attention grid row per token)");
  }
  const TensorParallelShard& shard = model_.shard();
  exact_tp_ = shard.size > 1 && shard.mode == TpMode::kExact;
  const int d = c.d_model, qd = c.q_dim(), kvd = c.kv_dim(), L = c.n_layers;
  mirror_ = options_.mirror_kv_to_host;
  if (!mirror_ && layer_hook) {
    return FailedPrecondition(
        "a layer hook reads the host pool, which this backend does not mirror");
  }

  // Step metadata, packed: tokens, seq, rows (int32), then pos and the
  // per-group table offsets (int64), then every group's tables (int32).
  const int G = groups_.size();
  const size_t S = seqs.size();
  std::vector<int32_t> tokens, seq_of, tables, rows, cached_blocks, fresh_blocks;
  std::vector<int64_t> pos, table_off;  // table_off[g * S + s]
  tokens.reserve(T);
  seq_of.reserve(T);
  pos.reserve(T);
  for (int g = 0; g < G; ++g) {
    for (const SeqStep& q : seqs) {
      const std::vector<BlockId>& table =
          g == 0 ? q.blocks : q.group_blocks[static_cast<size_t>(g - 1)];
      table_off.push_back(static_cast<int64_t>(tables.size()));
      // Blocks wholly before the window of a sliding group's first new
      // token are never read (the sequence may have dropped them).
      const int64_t skip = groups_.DroppableBlocks(g, q.cache_len, B);
      for (int64_t b = 0; b < (q.end() + B - 1) / B; ++b) {
        if (b < skip) {
          tables.push_back(0);
          continue;
        }
        tables.push_back(table[b]);
        (b * B < q.cache_len ? cached_blocks : fresh_blocks).push_back(table[b]);
      }
    }
  }
  for (size_t s = 0; s < S; ++s) {
    const SeqStep& q = seqs[s];
    for (size_t i = 0; i < q.tokens.size(); ++i) {
      tokens.push_back(q.tokens[i]);
      seq_of.push_back(static_cast<int32_t>(s));
      pos.push_back(q.cache_len + static_cast<int64_t>(i));
    }
  }
  for (int64_t r : logit_rows) rows.push_back(static_cast<int32_t>(r));
  const int64_t R = static_cast<int64_t>(rows.size());
  // Only the tables' length changes as sequences grow, and it is last, so a
  // decode step's graph (keyed by the padded length) stays valid for 64
  // block-table entries.
  const size_t n32 = tokens.size() + seq_of.size() + rows.size();
  const size_t n32_padded = (n32 + 1) & ~size_t{1};
  const size_t tables_padded = (tables.size() + 63) & ~size_t{63};
  const size_t meta_bytes =
      n32_padded * 4 + (pos.size() + table_off.size()) * 8 + tables_padded * 4;
  RETURN_IF_ERROR(h_meta_.Reserve(meta_bytes));
  RETURN_IF_ERROR(meta_.Reserve(meta_bytes));
  {
    int32_t* h = h_meta_.as<int32_t>();
    h = std::copy(tokens.begin(), tokens.end(), h);
    h = std::copy(seq_of.begin(), seq_of.end(), h);
    std::copy(rows.begin(), rows.end(), h);
    int64_t* h64 = reinterpret_cast<int64_t*>(h_meta_.as<int32_t>() + n32_padded);
    h64 = std::copy(pos.begin(), pos.end(), h64);
    h64 = std::copy(table_off.begin(), table_off.end(), h64);
    int32_t* ht = reinterpret_cast<int32_t*>(h64);
    std::fill(std::copy(tables.begin(), tables.end(), ht), ht + tables_padded, 0);
  }
  cudaStream_t st = stream_.get();
  KVR_CUDA_RETURN(
      cudaMemcpyAsync(meta_.get(), h_meta_.as<void>(), meta_bytes, cudaMemcpyHostToDevice, st));
  d_tokens_ = meta_.as<int32_t>();
  d_seq_ = d_tokens_ + T;
  d_rows_ = d_seq_ + T;
  d_pos_ = reinterpret_cast<const int64_t*>(meta_.as<int32_t>() + n32_padded);
  const int64_t* d_table_off = d_pos_ + T;
  const int32_t* d_tables = reinterpret_cast<const int32_t*>(d_table_off + table_off.size());

  uploads_ = std::any_of(cached_blocks.begin(), cached_blocks.end(),
                         [&](int32_t b) { return !valid_[b]; });
  RETURN_IF_ERROR(UploadInvalidBlocks(cached_blocks, fresh_blocks));

  // Scratch.
  const size_t f = sizeof(float);
  T_ = T;
  R_ = R;
  max_len_ = shape.max_len;
  split_tokens_ = AttentionSplitTokens(T, c.n_heads, options_.attention_split_tokens);
  const int splits = AttentionSplits(max_len_, split_tokens_);
  RETURN_IF_ERROR(x_.Reserve(T * d * f));
  RETURN_IF_ERROR(xn_.Reserve(T * std::max(d, qd) * f));
  RETURN_IF_ERROR(q_.Reserve(T * (qd + 2 * kvd) * f));  // [T][q | k | v] when stacked
  RETURN_IF_ERROR(k_.Reserve(T * kvd * f));
  RETURN_IF_ERROR(v_.Reserve(T * kvd * f));
  RETURN_IF_ERROR(attn_.Reserve(T * qd * f));
  RETURN_IF_ERROR(proj_.Reserve(T * d * f));
  RETURN_IF_ERROR(gate_.Reserve(T * c.ffn_dim * f));
  RETURN_IF_ERROR(up_.Reserve(2 * T * c.ffn_dim * f));  // [T][gate | up] when stacked
  if (c.gemma_norms) RETURN_IF_ERROR(norm_tmp_.Reserve(T * d * f));
  {
    // The widest product input: kExact TP multiplies the gathered full
    // width (the full model's q_dim and ffn_dim), wider than this shard's.
    const ModelConfig& fc = model_.full_config();
    const int64_t widest = std::max(
        {static_cast<int64_t>(d), static_cast<int64_t>(qd), static_cast<int64_t>(c.ffn_dim),
         static_cast<int64_t>(fc.q_dim()), static_cast<int64_t>(fc.ffn_dim)});
    // Only GEMV products (fewer than gemm_min_tokens rows) read q8.
    const int64_t tq = std::min<int64_t>(T, options_.gemm_min_tokens - 1);
    RETURN_IF_ERROR(xq_q_.Reserve(static_cast<size_t>(std::max<int64_t>(tq * widest, 1))));
    RETURN_IF_ERROR(xq_d_.Reserve(static_cast<size_t>(std::max<int64_t>(tq * widest / 32, 1)) * f));
    RETURN_IF_ERROR(xq_s_.Reserve(static_cast<size_t>(std::max<int64_t>(tq * widest / 32, 1)) * f));
  }
  RETURN_IF_ERROR(
      partials_.Reserve(static_cast<size_t>(T) * c.n_heads * splits * (c.head_dim + 2) * f));
  if (mirror_) {
    RETURN_IF_ERROR(kv_stash_.Reserve(static_cast<size_t>(L) * 2 * T * kvd * f));
    RETURN_IF_ERROR(h_stash_.Reserve(static_cast<size_t>(L) * 2 * T * kvd * f));
  }
  if (R > 0) {
    RETURN_IF_ERROR(logits_.Reserve(static_cast<size_t>(R) * c.vocab * f));
    RETURN_IF_ERROR(h_logits_.Reserve(static_cast<size_t>(R) * c.vocab * f));
  }
  if (exact_tp_) {
    RETURN_IF_ERROR(full_.Reserve(
        T * std::max(model_.full_config().q_dim(), model_.full_config().ffn_dim) * f));
  }
  kv_.assign(static_cast<size_t>(G), DevKvView{});
  for (int g = 0; g < G; ++g) {
    DevKvView& kv = kv_[static_cast<size_t>(g)];
    kv.pool = kv_pool_;
    kv.block_bytes = kl.BlockBytes();
    kv.layer_bytes = kl.LayerBytes();
    kv.slab_bytes = kl.SlabBytes();
    kv.block_tokens = B;
    kv.kv_heads = c.n_kv_heads;
    kv.head_dim = c.head_dim;
    kv.f16 = kl.dtype == KvDtype::kF16;
    kv.tables = d_tables;
    kv.table_off = d_table_off + static_cast<int64_t>(g) * static_cast<int64_t>(S);
  }
  xq_of_ = kNoQ8;

  // Decode steps replay a CUDA graph of the body (and the meta H2D copy)
  // once a step of the same shape ran uncaptured (so every buffer is
  // already reserved and no allocation happens while capturing). The shape
  // key holds every value baked into the graph: sizes that pick grids and
  // offsets, and the buffer addresses.
  const bool graphable =
      options_.cuda_graphs && !uploads_ && shard.size == 1 && T < options_.gemm_min_tokens && R > 0;
  std::string key;
  if (graphable) {
    key = std::to_string(T) + "/" + std::to_string(S) + "/" + std::to_string(R) + "/" +
          std::to_string(tables_padded) + "/" + std::to_string(splits) + "/" +
          std::to_string(split_tokens_) + "/" + std::to_string(static_cast<int>(doubled_)) + "/" +
          std::to_string(mirror_);
    for (const void* p :
         {meta_.get(), x_.get(), xn_.get(), q_.get(), k_.get(), v_.get(), attn_.get(), gate_.get(),
          up_.get(), partials_.get(), logits_.get(), kv_stash_.get(), xq_q_.get(), xq_d_.get(),
          xq_s_.get(), norm_tmp_.get(), h_meta_.as<void>()}) {
      key += "/" + std::to_string(reinterpret_cast<uintptr_t>(p));
    }
  }
  auto g = graphable ? graphs_.find(key) : graphs_.end();
  if (graphable && g == graphs_.end() && seen_.size() >= 4096) seen_.clear();  // bounded
  if (g != graphs_.end()) {
    KVR_CUDA_RETURN(cudaGraphLaunch(g->second, st));
  } else if (graphable && seen_[key]++ >= 1) {
    if (graphs_.size() >= 256) {
      for (auto& [k, e] : graphs_) cudaGraphExecDestroy(e);
      graphs_.clear();
      seen_.clear();
    }
    // The meta copy was enqueued before capture; capture it too so a replay
    // reads this step's pinned metadata.
    KVR_CUDA_RETURN(cudaStreamSynchronize(st));
    KVR_CUDA_RETURN(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
    Status cs = CudaStatus(
        cudaMemcpyAsync(meta_.get(), h_meta_.as<void>(), meta_bytes, cudaMemcpyHostToDevice, st),
        "meta");
    if (cs.ok()) cs = body();
    cudaGraph_t graph = nullptr;
    const cudaError_t end = cudaStreamEndCapture(st, &graph);
    if (cs.ok()) cs = CudaStatus(end, "cudaStreamEndCapture");
    cudaGraphExec_t exec = nullptr;
    if (cs.ok()) cs = CudaStatus(cudaGraphInstantiate(&exec, graph, 0), "cudaGraphInstantiate");
    if (graph != nullptr) cudaGraphDestroy(graph);
    RETURN_IF_ERROR(cs.WithContext("capturing the decode step"));
    graphs_[key] = exec;
    KVR_CUDA_RETURN(cudaGraphLaunch(exec, st));
  } else {
    RETURN_IF_ERROR(body());
  }
  if (!picks.empty()) {
    // The tokens, not the logits, come back: the sampler reads the rows in
    // place and copies R tokens to the host (it synchronises the stream).
    pick_params_.clear();
    for (const BackendPick& p : picks) {
      pick_params_.push_back({p.temperature, p.top_k, p.top_p, p.min_p, p.uniform});
    }
    out->picked.assign(static_cast<size_t>(R), -1);
    RETURN_IF_ERROR(
        sampler_.Sample(logits_.as<float>(), R, c.vocab, pick_params_, out->picked.data(), st)
            .WithContext("sampling on the device"));
  } else if (R > 0) {
    KVR_CUDA_RETURN(cudaMemcpyAsync(h_logits_.as<void>(), logits_.get(), R * c.vocab * f,
                                    cudaMemcpyDeviceToHost, st));
  }
  if (mirror_) {
    KVR_CUDA_RETURN(cudaMemcpyAsync(h_stash_.as<void>(), kv_stash_.get(), L * 2 * T * kvd * f,
                                    cudaMemcpyDeviceToHost, st));
  }
  KVR_CUDA_RETURN(cudaGetLastError());  // launch failures
  KVR_CUDA_RETURN(cudaStreamSynchronize(st));
  if (R > 0 && picks.empty()) {
    out->logits.resize(R * c.vocab);
    std::memcpy(out->logits.data(), h_logits_.as<void>(), R * c.vocab * f);
  }
  // Mirror the step's K/V into the host pool (layer order, hook after each).
  for (int l = 0; mirror_ && l < L; ++l) {
    const float* ks = h_stash_.as<float>() + static_cast<int64_t>(l) * 2 * T * kvd;
    const float* vs = ks + T * kvd;
    const int group = groups_.group_of[static_cast<size_t>(l)];
    const int slot = groups_.slot_of[static_cast<size_t>(l)];
    for (int64_t t = 0; t < T; ++t) {
      const SeqStep& q = seqs[seq_of[t]];
      const std::vector<BlockId>& table =
          group == 0 ? q.blocks : q.group_blocks[static_cast<size_t>(group - 1)];
      pool_->WriteToken(table[pos[t] / B], slot, static_cast<int>(pos[t] % B), ks + t * kvd,
                        vs + t * kvd);
    }
    if (layer_hook) layer_hook(l);
  }
  return Status::Ok();
}

Status CudaKernels::Embed(float scale) {
  const int d = model_.config().d_model;
  cudaStream_t st = stream_.get();
  for (int rep = 0; rep < Reps(Family::kEmbed); ++rep) {
    LaunchEmbed(embd_, d_tokens_, T_, x_.as<float>(), st);
  }
  if (scale != 1.0f) LaunchScale(x_.as<float>(), d, T_, d, scale, st);
  Wrote(Act::kX);
  return Status::Ok();
}

Status CudaKernels::RmsNorm(int layer, LayerNorm which, Act in, Act out) {
  const ModelConfig& c = model_.config();
  const DevLayer& w = layers_[static_cast<size_t>(layer)];
  const float* weights = nullptr;
  const DevMatrix* next = nullptr;  // the product that reads the result
  switch (which) {
    case LayerNorm::kAttn:
      weights = w.attn_norm;
      next = w.wqkv.data != nullptr ? &w.wqkv : &w.wq;
      break;
    case LayerNorm::kFfn:
      weights = w.ffn_norm;
      next = w.gate_up.data != nullptr ? &w.gate_up : &w.gate;
      break;
    case LayerNorm::kPostAttn:
      weights = w.post_attn_norm;
      break;
    case LayerNorm::kPostFfn:
      weights = w.post_ffn_norm;
      break;
  }
  if (weights == nullptr) return FailedPrecondition("cuda backend: the model has no such norm");
  cudaStream_t st = stream_.get();
  const int d = c.d_model;
  if (in == out) {
    // In place (Gemma's post-norms): through a scratch row block.
    for (int rep = 0; rep < Reps(Family::kNorm); ++rep) {
      LaunchRmsNorm(Buf(in), nullptr, T_, d, weights, c.rms_eps, norm_tmp_.as<float>(), nullptr,
                    st);
    }
    KVR_CUDA_RETURN(cudaMemcpyAsync(Buf(out), norm_tmp_.get(), T_ * d * sizeof(float),
                                    cudaMemcpyDeviceToDevice, st));
    Wrote(out);
    return Status::Ok();
  }
  // RMSNorm + q8 in one kernel when the next product reads q8.
  const bool fuse = next != nullptr && out == Act::kXn && ReadsQ8(*next, T_);
  const DevQ8 q = Q8();
  for (int rep = 0; rep < Reps(Family::kNorm); ++rep) {
    LaunchRmsNorm(Buf(in), nullptr, T_, d, weights, c.rms_eps, Buf(out), fuse ? &q : nullptr, st);
  }
  Wrote(out);
  if (fuse) xq_of_ = static_cast<int>(out);
  return Status::Ok();
}

Status CudaKernels::ProjectQkv(int layer) {
  const ModelConfig& c = model_.config();
  const DevLayer& w = layers_[static_cast<size_t>(layer)];
  const int qd = c.q_dim(), kvd = c.kv_dim();
  qp_ = q_.as<float>();
  if (w.wqkv.data != nullptr) {
    RETURN_IF_ERROR(Product(w.wqkv, Act::kXn, T_, w.bqkv, false, qp_));
    kp_ = qp_ + qd;
    vp_ = kp_ + kvd;
    ldq_ = ldkv_ = qd + 2 * kvd;
    return Status::Ok();
  }
  kp_ = k_.as<float>();
  vp_ = v_.as<float>();
  ldq_ = qd;
  ldkv_ = kvd;
  RETURN_IF_ERROR(Product(w.wq, Act::kXn, T_, w.bq, false, qp_));
  RETURN_IF_ERROR(Product(w.wk, Act::kXn, T_, w.bk, false, kp_));
  return Product(w.wv, Act::kXn, T_, w.bv, false, vp_);
}

Status CudaKernels::QkNorm(int layer) {
  const ModelConfig& c = model_.config();
  const DevLayer& w = layers_[static_cast<size_t>(layer)];
  if (w.q_norm == nullptr || w.k_norm == nullptr) {
    return FailedPrecondition("cuda backend: the model has no Q/K norms");
  }
  cudaStream_t st = stream_.get();
  for (int rep = 0; rep < Reps(Family::kNorm); ++rep) {
    LaunchHeadRmsNorm(qp_, ldq_, T_, c.n_heads, c.head_dim, w.q_norm, c.rms_eps, st);
    LaunchHeadRmsNorm(kp_, ldkv_, T_, c.n_kv_heads, c.head_dim, w.k_norm, c.rms_eps, st);
  }
  return Status::Ok();
}

Status CudaKernels::RopeWriteKv(int layer, float rope_base, float q_scale) {
  const ModelConfig& c = model_.config();
  const int group = groups_.group_of[static_cast<size_t>(layer)];
  const int slot = groups_.slot_of[static_cast<size_t>(layer)];
  cudaStream_t st = stream_.get();
  // The copies of this slot's cached blocks land before its KV is touched.
  if (uploads_) KVR_CUDA_RETURN(cudaStreamWaitEvent(st, layer_ready_[slot].get(), 0));
  // As ggml_rope_cache_init: the float power once, then iterated products.
  const float theta_scale = std::pow(rope_base, -2.0f / static_cast<float>(c.rope_dim));
  for (int rep = 0; rep < Reps(Family::kRopeKv); ++rep) {
    LaunchRopeWriteKv(kv_[static_cast<size_t>(group)], slot, qp_, kp_, vp_, ldq_, ldkv_, d_seq_,
                      d_pos_, T_, c.n_heads, c.rope_dim, c.rope_layout != RopeLayout::kNormal,
                      theta_scale, st);
  }
  if (q_scale != 0.0f) LaunchScale(qp_, ldq_, T_, c.q_dim(), q_scale, st);
  if (mirror_) {
    const int64_t kvd = c.kv_dim();
    const size_t f = sizeof(float);
    float* stash = kv_stash_.as<float>() + static_cast<int64_t>(layer) * 2 * T_ * kvd;
    KVR_CUDA_RETURN(cudaMemcpy2DAsync(stash, kvd * f, kp_, ldkv_ * f, kvd * f, T_,
                                      cudaMemcpyDeviceToDevice, st));
    KVR_CUDA_RETURN(cudaMemcpy2DAsync(stash + T_ * kvd, kvd * f, vp_, ldkv_ * f, kvd * f, T_,
                                      cudaMemcpyDeviceToDevice, st));
  }
  return Status::Ok();
}

Status CudaKernels::Attend(int layer, int window, float scale) {
  const ModelConfig& c = model_.config();
  const DevLayer& w = layers_[static_cast<size_t>(layer)];
  const int group = groups_.group_of[static_cast<size_t>(layer)];
  const int slot = groups_.slot_of[static_cast<size_t>(layer)];
  // The merge quantizes the attention output for the output projection
  // (not under kExact TP, whose projection input is gathered first).
  const bool aq = !exact_tp_ && ReadsQ8(w.wo, T_);
  const DevQ8 q = Q8();
  for (int rep = 0; rep < Reps(Family::kAttention); ++rep) {
    LaunchAttention(kv_[static_cast<size_t>(group)], slot, qp_, ldq_, d_seq_, d_pos_, T_, c.n_heads,
                    window, scale, max_len_, split_tokens_, partials_.as<float>(),
                    attn_.as<float>(), aq ? &q : nullptr, stream_.get());
  }
  Wrote(Act::kAttn);
  if (aq) xq_of_ = static_cast<int>(Act::kAttn);
  return Status::Ok();
}

Status CudaKernels::Project(int layer, LayerMatrix which, Act in, Act out, bool accumulate) {
  const DevLayer& w = layers_[static_cast<size_t>(layer)];
  RETURN_IF_ERROR(
      Product(which == LayerMatrix::kOut ? w.wo : w.down, in, T_, nullptr, accumulate, Buf(out)));
  Wrote(out);
  return Status::Ok();
}

Status CudaKernels::ProjectGateUp(int layer) {
  const DevLayer& w = layers_[static_cast<size_t>(layer)];
  const int64_t n = model_.config().ffn_dim;
  ffn_layer_ = layer;
  if (w.gate_up.data != nullptr) {
    RETURN_IF_ERROR(Product(w.gate_up, Act::kXn, T_, nullptr, false, up_.as<float>()));
    g_in_ = up_.as<float>();
    u_in_ = up_.as<float>() + n;
    ld_ffn_ = 2 * n;
    return Status::Ok();
  }
  RETURN_IF_ERROR(Product(w.gate, Act::kXn, T_, nullptr, false, gate_.as<float>()));
  Wrote(Act::kFfn);  // gate_ is the activation's buffer
  RETURN_IF_ERROR(Product(w.up, Act::kXn, T_, nullptr, false, up_.as<float>()));
  g_in_ = gate_.as<float>();
  u_in_ = up_.as<float>();
  ld_ffn_ = n;
  return Status::Ok();
}

Status CudaKernels::GatedActivation(ModelConfig::FfnAct act) {
  const DevLayer& w = layers_[static_cast<size_t>(ffn_layer_)];
  const int64_t n = model_.config().ffn_dim;
  // The activation + the down projection's q8 input in one kernel (not under
  // kExact TP, whose down input is the gathered full width).
  const bool dq = !exact_tp_ && ReadsQ8(w.down, T_);
  const DevQ8 q = Q8();
  const bool gelu = act == ModelConfig::FfnAct::kGeluTanh;
  if (gelu && gelu_table_ == nullptr) {
    return FailedPrecondition("cuda backend: GeGLU without the GELU table");
  }
  for (int rep = 0; rep < Reps(Family::kSwiGlu); ++rep) {
    if (gelu) {
      LaunchGeGlu(g_in_, u_in_, ld_ffn_, T_, n, gelu_table_, gate_.as<float>(), dq ? &q : nullptr,
                  stream_.get());
    } else {
      LaunchSwiGlu(g_in_, u_in_, ld_ffn_, T_, n, gate_.as<float>(), dq ? &q : nullptr,
                   stream_.get());
    }
  }
  Wrote(Act::kFfn);
  if (dq) xq_of_ = static_cast<int>(Act::kFfn);
  return Status::Ok();
}

Status CudaKernels::Add(Act dst, Act src) {
  LaunchAddBias(Buf(dst), Buf(src), 1, T_ * model_.config().d_model, stream_.get());
  Wrote(dst);
  return Status::Ok();
}

Status CudaKernels::AllReduce(Act a) {
  RETURN_IF_ERROR(AllReduce(Buf(a), T_ * model_.config().d_model));
  Wrote(a);
  return Status::Ok();
}

Status CudaKernels::GatherColumns(Act local, const std::vector<UnitRange>& widths) {
  RETURN_IF_ERROR(GatherColumns(Buf(local), widths, T_, full_.as<float>()));
  Wrote(Act::kFull);
  return Status::Ok();
}

Status CudaKernels::FinalNorm() {
  if (R_ == 0) return Status::Ok();
  const ModelConfig& c = model_.config();
  const bool lq = ReadsQ8(lm_head_, R_);
  const DevQ8 q = Q8();
  for (int rep = 0; rep < Reps(Family::kNorm); ++rep) {
    LaunchRmsNorm(x_.as<float>(), d_rows_, R_, c.d_model, output_norm_, c.rms_eps, xn_.as<float>(),
                  lq ? &q : nullptr, stream_.get());
  }
  Wrote(Act::kXn);
  if (lq) xq_of_ = static_cast<int>(Act::kXn);
  return Status::Ok();
}

Status CudaKernels::Logits(float softcap) {
  if (R_ == 0) return Status::Ok();
  const int vocab = model_.config().vocab;
  RETURN_IF_ERROR(Product(lm_head_, Act::kXn, R_, nullptr, false, logits_.as<float>()));
  if (softcap > 0.0f) LaunchSoftcap(logits_.as<float>(), R_ * vocab, softcap, stream_.get());
  return Status::Ok();
}

}  // namespace

Result<std::unique_ptr<StepKernels>> CreateCudaKernels(const ComputeBackendOptions& options,
                                                       const Model& model, KvBlockPool* pool,
                                                       const KvCacheGroups& groups) {
  if (options.gemm_min_tokens < 1 || options.attention_split_tokens < 1) {
    return InvalidArgument(
        "ComputeBackendOptions: gemm_min_tokens and attention_split_tokens must be >= 1");
  }
  auto kernels = std::make_unique<CudaKernels>(options, model, pool, groups);
  RETURN_IF_ERROR(kernels->Init().WithContext("cuda:" + std::to_string(options.device.index)));
  return std::unique_ptr<StepKernels>(std::move(kernels));
}

}  // namespace kvrelay::engine::cuda
