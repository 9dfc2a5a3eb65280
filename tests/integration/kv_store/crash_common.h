// Shared by kv_store_crash_test and its child: the store options and the
// deterministic block for each index.
#pragma once

#include <string>

#include "kv_store/rocksdb_tier.h"
#include "tests/unit/kv_store/test_blocks.h"

namespace kvrelay::kv_store::crash {

inline engine::KvLayout CrashLayout() {
  engine::KvLayout l;
  l.layers = 4;
  l.kv_heads = 2;
  l.head_dim = 16;
  l.block_tokens = 16;
  l.dtype = engine::KvDtype::kF32;  // 32 KiB per block: every value is a blob
  return l;
}

inline testing::TestBlock Block(uint64_t index) {
  return testing::MakeBlock(index, CrashLayout(), "crash-tenant", 9);
}

inline RocksDbTier::Options TierOptions(const std::string& dir) {
  RocksDbTier::Options o;
  o.path = dir;
  o.write_buffer_bytes = 512 << 10;  // frequent flushes: kills land in flushes and compactions
  o.blob_file_size = 2 << 20;
  o.max_queue_blocks = 32;
  return o;
}

}  // namespace kvrelay::kv_store::crash
