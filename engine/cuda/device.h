// CUDA device discovery, callable from any C++ (no CUDA headers).
#pragma once

#include <string>

#include "common/status.h"

namespace kvrelay::engine::cuda {

// Number of CUDA devices this process can use; 0 when there is none or no
// usable driver (never an error: "no GPU" is a normal state of a CPU node).
int DeviceCount();

// Checks that device `index` exists and can be used (selects it on the
// calling thread). Unavailable with a message that says "no CUDA device was
// found" (and the driver's reason) when there is none, or names the ordinal
// and the count when it is out of range. On success *description (may be
// null) gets "NAME (sm_XY, N GiB)".
Status UseDevice(int index, std::string* description);

// Free and total device memory of the current device, bytes.
Status DeviceMemory(size_t* free_bytes, size_t* total_bytes);

}  // namespace kvrelay::engine::cuda
