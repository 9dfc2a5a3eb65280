// The security fuzz targets (issue #14) as plain functions, so one body runs
// under libFuzzer (KVRELAY_FUZZ=ON, clang: each *_fuzz.cc then also defines
// LLVMFuzzerTestOneInput) and under the normal build's replay test
// (security_fuzz_replay: the checked-in corpora, their truncations and bit
// flips). Each aborts when an invariant breaks; returning is a pass.
// Seeds*() build the valid inputs the corpora start from.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace kvrelay::fuzz {

// The cluster-key challenge-response and the configuration Hello, fed a
// byte stream as an unauthenticated peer would send it (frames decoded under
// the pre-authentication limit). Invariant: nobody authenticates without
// the key; every message is refused with a status, never a crash.
int FuzzAuthHandshake(const uint8_t* data, size_t size);
std::vector<std::string> AuthSeeds();

// kv_store/block_codec DecodeBlock of an encoded block against fixed
// expectations. The first byte selects whether the harness repairs the
// checksum (so mutations reach the field checks). Invariant: a served block
// lies inside the input and has exactly the expected payload size, and
// re-encoding it gives the input back.
int FuzzBlockCodec(const uint8_t* data, size_t size);
std::vector<std::string> BlockCodecSeeds();

// kv_transfer/layer_stream VerifyLayerManifest of a manifest (wrapped in a
// valid slot, or raw when the first byte says so) over payload bytes from the
// input. Invariant: no crash, no read outside the slot or the buffers; a
// verified manifest matches the spec.
int FuzzLayerManifest(const uint8_t* data, size_t size);
std::vector<std::string> LayerManifestSeeds();

// The coordinator's HTTP edge (coordinator/http/http_request.h) over one
// connection's bytes, each request body through the OpenAI JSON mapping
// (ParseCompletionRequest). Invariant: every refusal is a 4xx with a message,
// a delivered body respects the limits and its Content-Length, an accepted
// request respects ApiLimits; never a crash.
int FuzzHttpRequest(const uint8_t* data, size_t size);
std::vector<std::string> HttpRequestSeeds();

// A TP follower's step plan (after the TP link authenticated its leader): a
// proto::TpStepPlan through decode_worker::FromProto into
// engine::TpFollower::Execute on a tiny synthetic model and an 8-block pool.
// Invariant: a plan naming a block outside the pool, a position outside its
// block table or a token outside the vocabulary is refused with a status;
// never a crash or a write outside the pool.
int FuzzTpPlan(const uint8_t* data, size_t size);
std::vector<std::string> TpPlanSeeds();

// Control frames from authenticated, registered workers (a prefill and a
// decode peer) about a live request, into a real ClusterBackend over
// 127.0.0.1. Invariant: the coordinator survives, the request's stream is
// well formed and ends within a deadline of its Cancel; never a crash.
int FuzzControlFrames(const uint8_t* data, size_t size);
std::vector<std::string> ControlFrameSeeds();

}  // namespace kvrelay::fuzz
