# Required dependencies come from Debian packages; a missing one stops
# configure with the package name to install (scripts/install-deps.sh does it).
function(kvrelay_require found what package)
  if(NOT ${found})
    message(FATAL_ERROR "kvrelay: ${what} not found. Install the Debian package: apt-get install ${package}  (or run ./scripts/install-deps.sh)")
  endif()
endfunction()

find_package(Threads REQUIRED)

# A minimal GPU build may take OpenSSL and xxHash from a carried prefix
# (scripts/gpu-check.sh --prepare copies the static archives and headers).
if(KVRELAY_DEPS_PREFIX)
  list(PREPEND CMAKE_PREFIX_PATH ${KVRELAY_DEPS_PREFIX})
  set(OPENSSL_ROOT_DIR ${KVRELAY_DEPS_PREFIX})
  set(OPENSSL_USE_STATIC_LIBS TRUE)
endif()

if(NOT KVRELAY_MINIMAL_GPU)
  find_package(MPI COMPONENTS CXX QUIET)
  kvrelay_require(MPI_CXX_FOUND "Open MPI (C++)" "libopenmpi-dev openmpi-bin")

  find_package(Protobuf QUIET)
  kvrelay_require(Protobuf_FOUND "Protobuf" "libprotobuf-dev protobuf-compiler")
  find_program(KVRELAY_PROTOC protoc)
  kvrelay_require(KVRELAY_PROTOC "protoc" "protobuf-compiler")

  find_package(Boost 1.74 QUIET)
  kvrelay_require(Boost_FOUND "Boost (Asio, Beast)" "libboost-dev")

  find_path(ROCKSDB_INCLUDE_DIR rocksdb/db.h)
  find_library(ROCKSDB_LIBRARY rocksdb)
  kvrelay_require(ROCKSDB_LIBRARY "RocksDB" "librocksdb-dev")
  add_library(kvrelay_rocksdb INTERFACE)
  target_include_directories(kvrelay_rocksdb INTERFACE ${ROCKSDB_INCLUDE_DIR})
  target_link_libraries(kvrelay_rocksdb INTERFACE ${ROCKSDB_LIBRARY})

endif()

# Header-only; the engine's grammar needs it in every configuration, the
# minimal GPU build included (--prepare carries the headers and CMake files).
find_package(nlohmann_json 3 QUIET)
kvrelay_require(nlohmann_json_FOUND "nlohmann-json" "nlohmann-json3-dev")

find_path(XXHASH_INCLUDE_DIR xxhash.h)
find_library(XXHASH_LIBRARY xxhash)
kvrelay_require(XXHASH_LIBRARY "xxHash" "libxxhash-dev")
add_library(kvrelay_xxhash INTERFACE)
target_include_directories(kvrelay_xxhash INTERFACE ${XXHASH_INCLUDE_DIR})
target_link_libraries(kvrelay_xxhash INTERFACE ${XXHASH_LIBRARY})

find_package(OpenSSL QUIET COMPONENTS Crypto)
kvrelay_require(OPENSSL_FOUND "OpenSSL libcrypto (SHA-256)" "libssl-dev")

if(KVRELAY_BUILD_TESTS AND NOT KVRELAY_MINIMAL_GPU)
  find_package(GTest QUIET)
  kvrelay_require(GTest_FOUND "GoogleTest" "libgtest-dev libgmock-dev")
endif()
if(KVRELAY_BUILD_BENCH AND NOT KVRELAY_MINIMAL_GPU)
  find_package(benchmark QUIET)
  kvrelay_require(benchmark_FOUND "Google Benchmark" "libbenchmark-dev")
endif()

# Optional accelerators: found automatically, can be forced off with -DKVRELAY_WITH_CUDA=OFF.
include(CheckLanguage)
if(NOT DEFINED KVRELAY_WITH_CUDA)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    set(KVRELAY_WITH_CUDA ON CACHE BOOL "Build CUDA kernels")
  else()
    set(KVRELAY_WITH_CUDA OFF CACHE BOOL "Build CUDA kernels")
  endif()
endif()
if(KVRELAY_WITH_CUDA)
  # One real architecture plus its PTX keeps nvcc time modest: sm_90 SASS for
  # H100/H200 and compute_90 PTX the driver JIT-compiles for newer GPUs.
  # Override with -DCMAKE_CUDA_ARCHITECTURES=...
  if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
    set(CMAKE_CUDA_ARCHITECTURES 90)
  endif()
  enable_language(CUDA)
  find_package(CUDAToolkit QUIET)
  if(NOT CUDAToolkit_FOUND)
    message(FATAL_ERROR "kvrelay: KVRELAY_WITH_CUDA=ON but the CUDA toolkit was not found; pass -DKVRELAY_WITH_CUDA=OFF")
  endif()
endif()
find_path(NCCL_INCLUDE_DIR nccl.h HINTS /usr/local/cuda/include /usr/include)
find_library(NCCL_LIBRARY nccl HINTS /usr/local/cuda/lib64 /usr/lib/x86_64-linux-gnu)
if(NOT DEFINED KVRELAY_WITH_NCCL)
  if(KVRELAY_WITH_CUDA AND NCCL_INCLUDE_DIR AND NCCL_LIBRARY)
    set(KVRELAY_WITH_NCCL ON CACHE BOOL "Build the NCCL transport")
  else()
    set(KVRELAY_WITH_NCCL OFF CACHE BOOL "Build the NCCL transport")
  endif()
endif()
if(KVRELAY_WITH_NCCL AND NOT (KVRELAY_WITH_CUDA AND NCCL_INCLUDE_DIR AND NCCL_LIBRARY))
  message(FATAL_ERROR "kvrelay: KVRELAY_WITH_NCCL=ON needs KVRELAY_WITH_CUDA=ON and NCCL (nccl.h, libnccl)")
endif()
message(STATUS "kvrelay: CUDA=${KVRELAY_WITH_CUDA} NCCL=${KVRELAY_WITH_NCCL}")
