// The KV data plane chosen by name: every role talks to a Transport obtained
// here, never to a concrete backend.
//
//   tcp    anywhere (Kubernetes, the local launcher): one data port per
//          endpoint, peers connected from their conn_info().
//   mpi    under mpirun: MPI_Isend/Irecv on MPI_COMM_WORLD, world ranks as
//          peers (MPI must be initialised with MPI_THREAD_MULTIPLE first).
//   auto   mpi when this process was started by mpirun (and MPI is
//          initialised), tcp otherwise.
//   local  in-process (tests, benchmarks): see local_transport.h; not
//          creatable by name because its endpoints share a fabric object.
#pragma once

#include <memory>
#include <string>

#include "common/status.h"
#include "kv_transfer/transport.h"
#include "protocols/cluster_auth.h"

namespace kvrelay::kv_transfer {

struct TransportOptions {
  std::string name = "tcp";  // tcp | mpi | auto
  int rank = 0;              // this endpoint's peer index (mpi: ignored, the world rank)
  int world_size = 2;        // (mpi: ignored, the world size)
  // tcp only.
  std::string listen_host = "127.0.0.1";
  uint16_t listen_port = 0;           // 0 = ephemeral
  std::string advertise_host;         // empty = listen_host
  protocols::ClusterKey cluster_key;  // every data connection proves it (required)
};

// Names accepted by CreateTransport, for flag help and errors.
inline constexpr const char* kTransportNames = "tcp, mpi or auto";

// True when this process was started by mpirun (Open MPI's environment).
bool LaunchedByMpirun();

// InvalidArgument for an unknown name (naming the valid ones),
// FailedPrecondition for mpi when MPI is not initialised.
Result<std::unique_ptr<Transport>> CreateTransport(const TransportOptions& options);

}  // namespace kvrelay::kv_transfer
