// Batched device-to-device copy of many pieces in one kernel launch (per 960 pieces): the local
// copies of a staged expert-parallel exchange (Communicator::copy_local of the NCCL communicator,
// of the device SimWorld and of the CUDA layer). Public so that the communicators, which sit above
// the CUDA backend, use it through its interface (link flowmoe_cuda).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <vector>

#include "flowmoe/comm.h"

namespace flowmoe {
namespace cuda {
namespace comm {

// Copies each piece (device pointers, any alignment and size; pieces must not overlap) on
// `stream`; a piece with src == nullptr zero-fills its destination (the padding rows of a
// dispatch). Asynchronous; the piece table travels as kernel parameters, so nothing needs to stay
// valid after the call returns. Throws Error on a bad piece or a failed launch.
void copy_pieces(const std::vector<CopyPiece>& pieces, cudaStream_t stream);

}  // namespace comm
}  // namespace cuda
}  // namespace flowmoe
