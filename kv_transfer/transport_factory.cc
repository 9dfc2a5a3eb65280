#include "kv_transfer/transport_factory.h"

#include <mpi.h>

#include <cstdlib>

#include "kv_transfer/mpi_transport.h"
#include "kv_transfer/tcp_transport.h"

namespace kvrelay::kv_transfer {

bool LaunchedByMpirun() { return std::getenv("OMPI_COMM_WORLD_RANK") != nullptr; }

Result<std::unique_ptr<Transport>> CreateTransport(const TransportOptions& options) {
  std::string name = options.name;
  if (name == "auto") name = LaunchedByMpirun() ? "mpi" : "tcp";
  if (name == "tcp") {
    TcpTransport::Options t;
    t.rank = options.rank;
    t.world_size = options.world_size;
    t.listen_host = options.listen_host;
    t.listen_port = options.listen_port;
    t.advertise_host = options.advertise_host;
    t.cluster_key = options.cluster_key;
    ASSIGN_OR_RETURN(std::unique_ptr<TcpTransport> tcp, TcpTransport::Create(t));
    return std::unique_ptr<Transport>(std::move(tcp));
  }
  if (name == "mpi") {
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized) {
      return FailedPrecondition(
          "the mpi KV transport needs MPI initialised (run the daemon under mpirun)");
    }
    ASSIGN_OR_RETURN(std::unique_ptr<MpiTransport> mpi, MpiTransport::Create({}));
    return std::unique_ptr<Transport>(std::move(mpi));
  }
  return InvalidArgument("unknown KV transport '" + options.name + "' (expected " +
                         kTransportNames + ")");
}

}  // namespace kvrelay::kv_transfer
