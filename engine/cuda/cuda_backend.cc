#include "engine/cuda/cuda_backend.h"

#include <cublas_v2.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "engine/cuda/cuda_util.h"
#include "engine/cuda/device.h"
#include "engine/cuda/kernel_math.h"
#include "engine/cuda/kernels.cuh"
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
};

class CudaBackend final : public ComputeBackend {
 public:
  CudaBackend(const ComputeBackendOptions& options, const Model& model, KvBlockPool* pool)
      : options_(options), model_(model), pool_(pool) {}
  ~CudaBackend() override {
    for (auto& [key, g] : graphs_) cudaGraphExecDestroy(g);
    if (cublas_ != nullptr) cublasDestroy(cublas_);
    for (void* p : allocations_) cudaFree(p);
  }

  Status Init();
  DeviceSpec device() const override { return options_.device; }
  Status Run(std::span<const SeqStep> seqs, ForwardOutput* out,
             const std::function<void(int layer)>& layer_hook) override;
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
  // Uploads the invalid blocks among `needed` (holding cached positions);
  // `fresh` blocks (only positions this step writes) become valid as they are.
  Status UploadInvalidBlocks(const std::vector<int32_t>& needed, const std::vector<int32_t>& fresh);
  // kExact TP: all ranks' [T x w_r] blocks of `local` -> [T x full] in `full`.
  Status GatherColumns(const float* local, const std::vector<UnitRange>& widths, int64_t T,
                       float* full);
  Status AllReduce(float* data, int64_t n);

  // Launches of family f per step: 2 for the doubled family, else 1.
  int Reps(Family f) const { return f == doubled_ ? 2 : 1; }

  ComputeBackendOptions options_;
  Family doubled_ = Family::kNone;  // set at the start of each Run
  const Model& model_;
  KvBlockPool* pool_;
  TpCollective* collective_ = nullptr;
  cublasHandle_t cublas_ = nullptr;
  Stream stream_, copy_stream_;
  std::vector<Event> layer_ready_;  // per layer: uploads of that layer done
  std::vector<void*> allocations_;  // weights, norms, the KV pool
  std::vector<DevLayer> layers_;
  DevMatrix embd_, lm_head_;
  float* output_norm_ = nullptr;
  uint8_t* kv_pool_ = nullptr;
  std::vector<uint8_t> valid_;  // per block: the device copy equals the host bytes
  float theta_scale_ = 1.0f;
  std::vector<UnitRange> q_cols_, ffn_cols_;
  // Per-step scratch.
  DeviceBuffer meta_, x_, xn_, q_, k_, v_, attn_, proj_, gate_, up_, partials_, logits_, kv_stash_,
      xq_q_, xq_d_, xq_s_, xh_, wh_, gathered_, full_;
  PinnedBuffer h_meta_, h_logits_, h_stash_, h_upload_, h_tp_;
  // Decode-step graphs by step shape (see Run); seen_ counts uncaptured runs.
  std::map<std::string, cudaGraphExec_t> graphs_;
  std::map<std::string, int> seen_;
  std::vector<float> tp_host_, tp_host2_;
};

Status CudaBackend::Alloc(size_t bytes, void** out) {
  KVR_CUDA_RETURN(cudaMalloc(out, bytes == 0 ? 1 : bytes));
  allocations_.push_back(*out);
  return Status::Ok();
}

Status CudaBackend::UploadMatrix(const GgufTensor* t, DevMatrix* out) {
  return UploadStacked(std::span<const GgufTensor* const>(&t, 1), out);
}

Status CudaBackend::UploadStacked(std::span<const GgufTensor* const> ts, DevMatrix* out) {
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

Status CudaBackend::UploadFloats(const std::vector<float>& v, float** out) {
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

Status CudaBackend::BuildFp16Cache() {
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

Status CudaBackend::Init() {
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
  if (c.gemma_norms || c.embed_scale != 1.0f || c.ffn_act != ModelConfig::FfnAct::kSilu ||
      c.q_scale != 0.0f || !c.layer_sliding.empty() || c.final_logit_softcap > 0.0f) {
    return Unimplemented("cuda backend: architecture '" + c.arch +
                         "' (Gemma norms, GeGLU, per-layer windows) runs on the CPU backend only");
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
  layer_ready_.resize(c.n_layers);
  for (Event& e : layer_ready_) RETURN_IF_ERROR(e.Create());
  theta_scale_ = std::pow(c.rope_base, -2.0f / static_cast<float>(c.rope_dim));
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

Status CudaBackend::MatMul(const DevMatrix& w, const float* x, int64_t T, const float* bias,
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

Status CudaBackend::UploadInvalidBlocks(const std::vector<int32_t>& blocks,
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
  const int L = model_.config().n_layers;
  if (todo.empty()) return Status::Ok();
  std::sort(todo.begin(), todo.end());
  todo.erase(std::unique(todo.begin(), todo.end()), todo.end());
  // The previous step's copies are done before its end (it synchronised), so
  // the staging buffer is free. Layer by layer: stage the host bytes, enqueue
  // the copies, record the layer's event; the compute stream waits on layer
  // l's event only before layer l's attention, so later layers' copies
  // overlap earlier layers' compute.
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

Status CudaBackend::AllReduce(float* data, int64_t n) {
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

Status CudaBackend::GatherColumns(const float* local, const std::vector<UnitRange>& widths,
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

Status CudaBackend::Run(std::span<const SeqStep> seqs, ForwardOutput* out,
                        const std::function<void(int layer)>& layer_hook) {
  const ModelConfig& c = model_.config();
  const KvLayout& kl = pool_->layout();
  if (kl.layers != c.n_layers || kl.kv_heads != c.n_kv_heads || kl.head_dim != c.head_dim) {
    return InvalidArgument("KV pool layout does not match the model");
  }
  // The device is per host thread; steps may run on another thread than Init.
  KVR_CUDA_RETURN(cudaSetDevice(options_.device.index));
  doubled_ = DoubledFamily();
  const int B = kl.block_tokens;
  // Validation: the CPU ForwardPass's rules and messages.
  ASSIGN_OR_RETURN(const StepShape shape, CheckStep(seqs, B, pool_->total_blocks(), c.vocab));
  const int64_t T = shape.tokens, max_len = shape.max_len;
  out->logits.clear();
  out->row_begin.assign(1, 0);
  if (T == 0) return Status::Ok();
  if (T > 65535) {
    return InvalidArgument("cuda backend: " + std::to_string(T) +
                           " tokens in one step (at most 65535: one attention grid row per token)");
  }
  const TensorParallelShard& shard = model_.shard();
  if (shard.size > 1 && (collective_ == nullptr || collective_->size() != shard.size ||
                         collective_->rank() != shard.rank)) {
    return FailedPrecondition("model shard " + std::to_string(shard.rank) + " of " +
                              std::to_string(shard.size) +
                              " needs the collective of its tensor-parallel group");
  }
  const bool exact_tp = shard.size > 1 && shard.mode == TpMode::kExact;
  const bool reduce_tp = shard.size > 1 && shard.mode == TpMode::kReduce;
  const int d = c.d_model, qd = c.q_dim(), kvd = c.kv_dim(), L = c.n_layers;
  const bool mirror = options_.mirror_kv_to_host;
  if (!mirror && layer_hook) {
    return FailedPrecondition(
        "a layer hook reads the host pool, which this backend does not mirror");
  }

  // Step metadata, packed: tokens, seq, rows (int32), then tables, then pos
  // and table offsets (int64).
  std::vector<int32_t> tokens, seq_of, tables, rows, cached_blocks, fresh_blocks;
  std::vector<int64_t> pos, table_off;
  tokens.reserve(T);
  seq_of.reserve(T);
  pos.reserve(T);
  for (size_t s = 0; s < seqs.size(); ++s) {
    const SeqStep& q = seqs[s];
    const int64_t len = q.cache_len + static_cast<int64_t>(q.tokens.size());
    table_off.push_back(static_cast<int64_t>(tables.size()));
    for (int64_t b = 0; b < (len + B - 1) / B; ++b) {
      tables.push_back(q.blocks[b]);
      (b * B < q.cache_len ? cached_blocks : fresh_blocks).push_back(q.blocks[b]);
    }
    const int64_t first = static_cast<int64_t>(tokens.size());
    for (size_t i = 0; i < q.tokens.size(); ++i) {
      tokens.push_back(q.tokens[i]);
      seq_of.push_back(static_cast<int32_t>(s));
      pos.push_back(q.cache_len + static_cast<int64_t>(i));
    }
    const int64_t n = static_cast<int64_t>(q.tokens.size());
    if (q.logits == LogitRows::kAll) {
      for (int64_t i = 0; i < n; ++i) rows.push_back(static_cast<int32_t>(first + i));
    } else if (q.logits == LogitRows::kLast) {
      rows.push_back(static_cast<int32_t>(first + n - 1));
    }
    out->row_begin.push_back(static_cast<int64_t>(rows.size()));
  }
  const int64_t R = static_cast<int64_t>(rows.size());
  // Layout of meta_: int32 tokens [T], seq [T], rows [R] (padded to 8 bytes),
  // int64 pos [T], table_off [S], then the int32 tables padded to a multiple
  // of 64 entries. Only the tables' length changes as sequences grow, and it
  // is last, so a decode step's graph (keyed by the padded length) stays
  // valid for 64 block-table entries.
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
  const int32_t* d_tokens = meta_.as<int32_t>();
  const int32_t* d_seq = d_tokens + T;
  const int32_t* d_rows = d_seq + T;
  const int64_t* d_pos = reinterpret_cast<const int64_t*>(meta_.as<int32_t>() + n32_padded);
  const int64_t* d_table_off = d_pos + T;
  const int32_t* d_tables = reinterpret_cast<const int32_t*>(d_table_off + seqs.size());

  const bool uploads = std::any_of(cached_blocks.begin(), cached_blocks.end(),
                                   [&](int32_t b) { return !valid_[b]; });
  RETURN_IF_ERROR(UploadInvalidBlocks(cached_blocks, fresh_blocks));

  // Scratch.
  const size_t f = sizeof(float);
  const int split_tokens = AttentionSplitTokens(T, c.n_heads, options_.attention_split_tokens);
  const int splits = AttentionSplits(max_len, split_tokens);
  RETURN_IF_ERROR(x_.Reserve(T * d * f));
  RETURN_IF_ERROR(xn_.Reserve(T * std::max(d, qd) * f));
  RETURN_IF_ERROR(q_.Reserve(T * (qd + 2 * kvd) * f));  // [T][q | k | v] when stacked
  RETURN_IF_ERROR(k_.Reserve(T * kvd * f));
  RETURN_IF_ERROR(v_.Reserve(T * kvd * f));
  RETURN_IF_ERROR(attn_.Reserve(T * qd * f));
  RETURN_IF_ERROR(proj_.Reserve(T * d * f));
  RETURN_IF_ERROR(gate_.Reserve(T * c.ffn_dim * f));
  RETURN_IF_ERROR(up_.Reserve(2 * T * c.ffn_dim * f));  // [T][gate | up] when stacked
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
  if (mirror) RETURN_IF_ERROR(kv_stash_.Reserve(static_cast<size_t>(L) * 2 * T * kvd * f));
  if (exact_tp) {
    RETURN_IF_ERROR(full_.Reserve(
        T * std::max(model_.full_config().q_dim(), model_.full_config().ffn_dim) * f));
  }

  DevKvView kv;
  kv.pool = kv_pool_;
  kv.block_bytes = kl.BlockBytes();
  kv.layer_bytes = kl.LayerBytes();
  kv.slab_bytes = kl.SlabBytes();
  kv.block_tokens = B;
  kv.kv_heads = c.n_kv_heads;
  kv.head_dim = c.head_dim;
  kv.f16 = kl.dtype == KvDtype::kF16;
  kv.tables = d_tables;
  kv.table_off = d_table_off;

  float* x = x_.as<float>();
  float* xn = xn_.as<float>();
  const float scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
  auto enqueue = [&]() -> Status {
    for (int rep = 0; rep < Reps(Family::kEmbed); ++rep) LaunchEmbed(embd_, d_tokens, T, x, st);
    for (int l = 0; l < L; ++l) {
      const DevLayer& w = layers_[l];
      // RMSNorm + q8 in one kernel when the Q projection reads q8.
      const DevQ8 nq = Q8();
      const bool qkv_stacked = w.wqkv.data != nullptr;
      bool xq = ReadsQ8(qkv_stacked ? w.wqkv : w.wq, T);
      for (int rep = 0; rep < Reps(Family::kNorm); ++rep) {
        LaunchRmsNorm(x, nullptr, T, d, w.attn_norm, c.rms_eps, xn, xq ? &nq : nullptr, st);
      }
      float *qp = q_.as<float>(), *kp = k_.as<float>(), *vp = v_.as<float>();
      int64_t ldq = qd, ldkv = kvd;
      if (qkv_stacked) {
        RETURN_IF_ERROR(MatMul(w.wqkv, xn, T, w.bqkv, false, qp, &xq));
        kp = qp + qd;
        vp = kp + kvd;
        ldq = ldkv = qd + 2 * kvd;
      } else {
        RETURN_IF_ERROR(MatMul(w.wq, xn, T, w.bq, false, qp, &xq));
        RETURN_IF_ERROR(MatMul(w.wk, xn, T, w.bk, false, kp, &xq));
        RETURN_IF_ERROR(MatMul(w.wv, xn, T, w.bv, false, vp, &xq));
      }
      // The copies of this layer's cached blocks land before its KV is touched.
      if (uploads) KVR_CUDA_RETURN(cudaStreamWaitEvent(st, layer_ready_[l].get(), 0));
      for (int rep = 0; rep < Reps(Family::kRopeKv); ++rep) {
        LaunchRopeWriteKv(kv, l, qp, kp, vp, ldq, ldkv, d_seq, d_pos, T, c.n_heads, c.rope_dim,
                          c.rope_layout != RopeLayout::kNormal, theta_scale_, st);
      }
      if (mirror) {
        float* stash = kv_stash_.as<float>() + static_cast<int64_t>(l) * 2 * T * kvd;
        KVR_CUDA_RETURN(cudaMemcpy2DAsync(stash, kvd * f, kp, ldkv * f, kvd * f, T,
                                          cudaMemcpyDeviceToDevice, st));
        KVR_CUDA_RETURN(cudaMemcpy2DAsync(stash + T * kvd, kvd * f, vp, ldkv * f, kvd * f, T,
                                          cudaMemcpyDeviceToDevice, st));
      }
      // The merge quantizes the attention output for the output projection
      // (not under kExact TP, whose projection input is gathered first).
      bool aq = !exact_tp && ReadsQ8(w.wo, T);
      for (int rep = 0; rep < Reps(Family::kAttention); ++rep) {
        LaunchAttention(kv, l, qp, ldq, d_seq, d_pos, T, c.n_heads, c.sliding_window, scale,
                        max_len, split_tokens, partials_.as<float>(), attn_.as<float>(),
                        aq ? &nq : nullptr, st);
      }
      if (exact_tp) {
        RETURN_IF_ERROR(GatherColumns(attn_.as<float>(), q_cols_, T, full_.as<float>())
                            .WithContext("attention"));
        RETURN_IF_ERROR(MatMul(w.wo, full_.as<float>(), T, nullptr, true, x, &aq));
      } else if (reduce_tp) {
        RETURN_IF_ERROR(MatMul(w.wo, attn_.as<float>(), T, nullptr, false, proj_.as<float>(), &aq));
        RETURN_IF_ERROR(AllReduce(proj_.as<float>(), T * d).WithContext("attention"));
        LaunchAddBias(x, proj_.as<float>(), 1, T * d, st);
      } else {
        RETURN_IF_ERROR(MatMul(w.wo, attn_.as<float>(), T, nullptr, true, x, &aq));
      }
      const bool stacked = w.gate_up.data != nullptr;
      bool fq = ReadsQ8(stacked ? w.gate_up : w.gate, T);
      for (int rep = 0; rep < Reps(Family::kNorm); ++rep) {
        LaunchRmsNorm(x, nullptr, T, d, w.ffn_norm, c.rms_eps, xn, fq ? &nq : nullptr, st);
      }
      const int64_t n_ffn = c.ffn_dim;
      const float *g_in = up_.as<float>(), *u_in = up_.as<float>() + n_ffn;
      int64_t ld_ffn = 2 * n_ffn;
      if (stacked) {
        RETURN_IF_ERROR(MatMul(w.gate_up, xn, T, nullptr, false, up_.as<float>(), &fq));
      } else {
        RETURN_IF_ERROR(MatMul(w.gate, xn, T, nullptr, false, gate_.as<float>(), &fq));
        RETURN_IF_ERROR(MatMul(w.up, xn, T, nullptr, false, up_.as<float>(), &fq));
        g_in = gate_.as<float>();
        u_in = up_.as<float>();
        ld_ffn = n_ffn;
      }
      // SwiGLU + the down projection's q8 input in one kernel (not under
      // kExact TP, whose down input is the gathered full width).
      bool dq = !exact_tp && ReadsQ8(w.down, T);
      for (int rep = 0; rep < Reps(Family::kSwiGlu); ++rep) {
        LaunchSwiGlu(g_in, u_in, ld_ffn, T, n_ffn, gate_.as<float>(), dq ? &nq : nullptr, st);
      }
      if (exact_tp) {
        RETURN_IF_ERROR(
            GatherColumns(gate_.as<float>(), ffn_cols_, T, full_.as<float>()).WithContext("ffn"));
        RETURN_IF_ERROR(MatMul(w.down, full_.as<float>(), T, nullptr, true, x, &dq));
      } else if (reduce_tp) {
        RETURN_IF_ERROR(
            MatMul(w.down, gate_.as<float>(), T, nullptr, false, proj_.as<float>(), &dq));
        RETURN_IF_ERROR(AllReduce(proj_.as<float>(), T * d).WithContext("ffn"));
        LaunchAddBias(x, proj_.as<float>(), 1, T * d, st);
      } else {
        RETURN_IF_ERROR(MatMul(w.down, gate_.as<float>(), T, nullptr, true, x, &dq));
      }
    }
    if (R > 0) {
      const DevQ8 oq = Q8();
      bool lq = ReadsQ8(lm_head_, R);
      for (int rep = 0; rep < Reps(Family::kNorm); ++rep) {
        LaunchRmsNorm(x, d_rows, R, d, output_norm_, c.rms_eps, xn, lq ? &oq : nullptr, st);
      }
      RETURN_IF_ERROR(logits_.Reserve(static_cast<size_t>(R) * c.vocab * f));
      RETURN_IF_ERROR(MatMul(lm_head_, xn, R, nullptr, false, logits_.as<float>(), &lq));
      RETURN_IF_ERROR(h_logits_.Reserve(static_cast<size_t>(R) * c.vocab * f));
      KVR_CUDA_RETURN(cudaMemcpyAsync(h_logits_.as<void>(), logits_.get(), R * c.vocab * f,
                                      cudaMemcpyDeviceToHost, st));
    }
    if (mirror) {
      RETURN_IF_ERROR(h_stash_.Reserve(static_cast<size_t>(L) * 2 * T * kvd * f));
      KVR_CUDA_RETURN(cudaMemcpyAsync(h_stash_.as<void>(), kv_stash_.get(), L * 2 * T * kvd * f,
                                      cudaMemcpyDeviceToHost, st));
    }
    return Status::Ok();
  };
  // Decode steps replay a CUDA graph of everything above (and the meta H2D
  // copy) once a step of the same shape ran uncaptured (so every buffer is
  // already reserved and no allocation happens while capturing). The shape
  // key holds every value baked into the graph: sizes that pick grids and
  // offsets, and the buffer addresses.
  const bool graphable =
      options_.cuda_graphs && !uploads && shard.size == 1 && T < options_.gemm_min_tokens && R > 0;
  std::string key;
  if (graphable) {
    key = std::to_string(T) + "/" + std::to_string(seqs.size()) + "/" + std::to_string(R) + "/" +
          std::to_string(tables_padded) + "/" + std::to_string(splits) + "/" +
          std::to_string(split_tokens) + "/" + std::to_string(static_cast<int>(doubled_)) + "/" +
          std::to_string(mirror);
    for (const void* p :
         {meta_.get(), x_.get(), xn_.get(), q_.get(), k_.get(), v_.get(), attn_.get(), gate_.get(),
          up_.get(), partials_.get(), logits_.get(), kv_stash_.get(), xq_q_.get(), xq_d_.get(),
          xq_s_.get(), h_logits_.as<void>(), h_stash_.as<void>(), h_meta_.as<void>()}) {
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
    if (cs.ok()) cs = enqueue();
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
    RETURN_IF_ERROR(enqueue());
  }
  KVR_CUDA_RETURN(cudaGetLastError());  // launch failures
  KVR_CUDA_RETURN(cudaStreamSynchronize(st));
  if (R > 0) {
    out->logits.resize(R * c.vocab);
    std::memcpy(out->logits.data(), h_logits_.as<void>(), R * c.vocab * f);
  }
  // Mirror the step's K/V into the host pool (layer order, hook after each).
  for (int l = 0; mirror && l < L; ++l) {
    const float* ks = h_stash_.as<float>() + static_cast<int64_t>(l) * 2 * T * kvd;
    const float* vs = ks + T * kvd;
    for (int64_t t = 0; t < T; ++t) {
      const SeqStep& q = seqs[seq_of[t]];
      pool_->WriteToken(q.blocks[pos[t] / B], l, static_cast<int>(pos[t] % B), ks + t * kvd,
                        vs + t * kvd);
    }
    if (layer_hook) layer_hook(l);
  }
  return Status::Ok();
}

}  // namespace

Result<std::unique_ptr<ComputeBackend>> CreateCudaBackend(const ComputeBackendOptions& options,
                                                          const Model& model, KvBlockPool* pool) {
  if (options.gemm_min_tokens < 1 || options.attention_split_tokens < 1) {
    return InvalidArgument(
        "ComputeBackendOptions: gemm_min_tokens and attention_split_tokens must be >= 1");
  }
  auto backend = std::make_unique<CudaBackend>(options, model, pool);
  RETURN_IF_ERROR(backend->Init().WithContext("cuda:" + std::to_string(options.device.index)));
  return std::unique_ptr<ComputeBackend>(std::move(backend));
}

}  // namespace kvrelay::engine::cuda
