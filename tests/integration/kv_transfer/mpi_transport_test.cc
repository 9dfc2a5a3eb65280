// Runs under `mpirun -np 2`: rank 0 sends, rank 1 receives and checks.
// Data is generated from seeds both ranks know, so rank 1 checks bytes
// without a second channel. Each rank asserts its own side.
#include "kv_transfer/mpi_transport.h"

#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <random>

#include "kv_transfer/layer_stream.h"
#include "tests/testing/fault_injecting_transport.h"

namespace kvrelay::kv_transfer {
namespace {

std::vector<uint8_t> Bytes(size_t n, uint32_t seed) {
  std::vector<uint8_t> v(n);
  std::mt19937 rng(seed);
  for (auto& x : v) x = static_cast<uint8_t>(rng());
  return v;
}

TransferDesc Desc(int peer, uint64_t req, uint32_t tag, std::vector<uint8_t>& buf, int heads,
                  int64_t slab, int hb, int he) {
  TransferDesc d;
  d.peer = peer;
  d.request_id = req;
  d.tag = tag;
  d.layout = {heads, slab, MemoryKind::kHost};
  const int64_t layer = 2 * heads * slab;
  const int layers = static_cast<int>(buf.size() / layer);
  d.slices.push_back({0, 0, layers, hb, he, buf.data(), 0});
  return d;
}

class MpiTransportTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto t = MpiTransport::Create({});
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    t_ = std::move(t).value();
    ASSERT_EQ(t_->world_size(), 2) << "run under mpirun -np 2";
  }
  void TearDown() override {
    MPI_Barrier(MPI_COMM_WORLD);
    EXPECT_EQ(t_->inflight(), 0);
    t_->Shutdown();
  }
  std::unique_ptr<MpiTransport> t_;
};

TEST_F(MpiTransportTest, RoundTripManySizesOutOfOrderAndUnexpected) {
  const std::vector<int64_t> slabs = {2,     64,      4096,
                                      65536, 1 << 20, 3 << 20};  // x 2 heads x 2 layers
  std::vector<std::vector<uint8_t>> bufs;
  for (size_t i = 0; i < slabs.size(); ++i) {
    size_t n = static_cast<size_t>(2 * 2 * 2 * slabs[i]);
    bufs.push_back(t_->rank() == 0 ? Bytes(n, static_cast<uint32_t>(i + 1))
                                   : std::vector<uint8_t>(n, 0));
  }
  std::vector<TransferHandle> handles(slabs.size());
  if (t_->rank() == 1) {
    // Even cases posted before the sender starts (direct path), in reverse.
    for (size_t k = slabs.size(); k-- > 0;) {
      if (k % 2) continue;
      handles[k] = *t_->PostRecv(Desc(0, 1, static_cast<uint32_t>(k), bufs[k], 2, slabs[k], 0, 2));
    }
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (t_->rank() == 0) {
    for (size_t k = 0; k < slabs.size(); ++k) {
      handles[k] = *t_->PostSend(Desc(1, 1, static_cast<uint32_t>(k), bufs[k], 2, slabs[k], 0, 2));
    }
    for (size_t k = 0; k < slabs.size(); ++k) {
      EXPECT_TRUE(t_->Wait(handles[k], Deadline::AfterMs(30000)).ok());
    }
  }
  MPI_Barrier(MPI_COMM_WORLD);  // odd cases arrived before their receive: staged
  if (t_->rank() == 1) {
    for (size_t k = 1; k < slabs.size(); k += 2) {
      handles[k] = *t_->PostRecv(Desc(0, 1, static_cast<uint32_t>(k), bufs[k], 2, slabs[k], 0, 2));
    }
    std::vector<size_t> order = {3, 0, 5, 1, 4, 2};
    for (size_t k : order) {
      Status st = t_->Wait(handles[k], Deadline::AfterMs(30000));
      EXPECT_TRUE(st.ok()) << k << ": " << st.ToString();
      EXPECT_TRUE(bufs[k] == Bytes(bufs[k].size(), static_cast<uint32_t>(k + 1))) << "case " << k;
    }
  }
}

TEST_F(MpiTransportTest, HeadSliceIntoSmallerLayout) {
  // Rank 0 holds 3 heads and sends head 1; rank 1 holds one head.
  const int64_t slab = 4096;
  if (t_->rank() == 0) {
    auto src = Bytes(4 * 2 * 3 * slab, 9);
    auto h = t_->PostSend(Desc(1, 2, 0, src, 3, slab, 1, 2));
    ASSERT_TRUE(h.ok());
    EXPECT_TRUE(t_->Wait(*h, Deadline::AfterMs(10000)).ok());
  } else {
    std::vector<uint8_t> dst(4 * 2 * slab, 0);
    auto h = t_->PostRecv(Desc(0, 2, 0, dst, 1, slab, 0, 1));
    ASSERT_TRUE(h.ok());
    ASSERT_TRUE(t_->Wait(*h, Deadline::AfterMs(10000)).ok());
    auto src = Bytes(4 * 2 * 3 * slab, 9);
    for (int l = 0; l < 4; ++l) {
      EXPECT_EQ(0, memcmp(dst.data() + l * 2 * slab, src.data() + (l * 6 + 1) * slab, slab));
      EXPECT_EQ(0, memcmp(dst.data() + (l * 2 + 1) * slab, src.data() + (l * 6 + 4) * slab, slab));
    }
  }
}

TEST_F(MpiTransportTest, LayerStreamCatchesCorruptionAndDeadline) {
  const int layers = 30, heads = 3, nblocks = 4;
  const int64_t slab = 16 * 64 * 2;
  const size_t block_bytes = static_cast<size_t>(layers * 2 * heads * slab);
  StreamSpec spec;
  spec.request_id = 3;
  spec.layers = layers;
  spec.blocks = {5, 6, 7, 8};
  spec.global_heads = {0, heads};
  spec.block_tokens = 16;
  spec.head_dim = 64;
  spec.dtype = engine::KvDtype::kF16;
  std::vector<uint8_t> mem = t_->rank() == 0 ? Bytes(block_bytes * nblocks, 11)
                                             : std::vector<uint8_t>(block_bytes * nblocks, 0);
  StreamBuffers buffers;
  buffers.layout = {heads, slab, MemoryKind::kHost};
  buffers.local_heads = {0, heads};
  for (int i = 0; i < nblocks; ++i) buffers.block_layer0.push_back(mem.data() + i * block_bytes);

  // Stream 0: clean. Stream 1: layer 12 corrupted. Stream 2: layer 20 dropped.
  if (t_->rank() == 0) {
    FaultInjectingTransport faulty(t_.get(), [](const TransferDesc& d) {
      if (d.tag == StreamTag(1, 12, true)) return Fault::kCorrupt;
      if (d.tag == StreamTag(2, 20, true)) return Fault::kDrop;
      return Fault::kNone;
    });
    for (uint32_t sid = 0; sid < 3; ++sid) {
      StreamSpec s = spec;
      s.stream_id = sid;
      LayerStreamSender tx(&faulty, 1, s, buffers);
      for (int l = 0; l < layers; ++l) ASSERT_TRUE(tx.SendLayer(l).ok());
      EXPECT_TRUE(tx.Finish(Deadline::AfterMs(30000)).ok());
    }
    MPI_Barrier(MPI_COMM_WORLD);
  } else {
    std::vector<std::unique_ptr<LayerStreamReceiver>> rx;
    // Each stream lands in its own memory (stream 0 in `mem`).
    std::vector<std::vector<uint8_t>> other(2, std::vector<uint8_t>(mem.size(), 0));
    for (uint32_t sid = 0; sid < 3; ++sid) {
      StreamSpec s = spec;
      s.stream_id = sid;
      StreamBuffers b = buffers;
      if (sid > 0) {
        for (int i = 0; i < nblocks; ++i)
          b.block_layer0[i] = other[sid - 1].data() + i * block_bytes;
      }
      rx.push_back(std::make_unique<LayerStreamReceiver>(t_.get(), 0, s, b));
      ASSERT_TRUE(rx.back()->Start().ok());
    }
    Status ok = rx[0]->WaitAll(Deadline::AfterMs(30000));
    EXPECT_TRUE(ok.ok()) << ok.ToString();
    EXPECT_TRUE(mem == Bytes(block_bytes * nblocks, 11));
    Status bad = rx[1]->WaitAll(Deadline::AfterMs(30000));
    EXPECT_EQ(bad.code(), StatusCode::kDataLoss) << bad.ToString();
    EXPECT_NE(bad.message().find("layer 12"), std::string::npos) << bad.ToString();
    EXPECT_FALSE(rx[1]->complete());
    MPI_Barrier(MPI_COMM_WORLD);  // the sender is done: layer 20 of stream 2 never comes
    Status late = rx[2]->WaitAll(Deadline::AfterMs(300));
    EXPECT_EQ(late.code(), StatusCode::kDeadlineExceeded) << late.ToString();
    EXPECT_FALSE(rx[2]->complete());
  }
}

}  // namespace
}  // namespace kvrelay::kv_transfer

int main(int argc, char** argv) {
  if (!kvrelay::kv_transfer::InitMpiThreadMultiple(&argc, &argv).ok()) return 2;
  ::testing::InitGoogleTest(&argc, argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  int rc = RUN_ALL_TESTS();
  int worst = 0;
  MPI_Allreduce(&rc, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return worst;
}
