// Tensor Memory Accelerator (sm_90): tensor-map descriptors (host) and the bulk copies that use
// them or plain addresses (device). Loads complete on an mbarrier (transaction bytes, see
// mbarrier.cuh); stores and reduce-adds from shared memory complete in bulk groups.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <cstdint>
#include <mutex>

#include "cuda/sm90/arch.cuh"
#include "flowmoe/error.h"

namespace flowmoe {
namespace cuda {
namespace sm90 {

// ---- host: descriptors ----------------------------------------------------------------------
// The driver's cuTensorMapEncodeTiled, looked up once per process through the runtime (no link
// against libcuda). Throws flowmoe::Error when the driver has none.
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  static std::once_flag once;
  std::call_once(once, [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q) == cudaSuccess &&
        q == cudaDriverEntryPointSuccess)
      fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  });
  FLOWMOE_CHECK(fn != nullptr, "TMA: the driver has no cuTensorMapEncodeTiled (CUDA 12+ driver needed)");
  return fn;
}

// 2-D map over a row-major [rows, cols] matrix of `elem`-byte elements, box [box_rows, box_cols].
// `what` names the kernel and the operand in the error a failed encoding throws.
inline CUtensorMap make_tensor_map_2d(const void* base, CUtensorMapDataType type, int elem, uint64_t rows,
                                      uint64_t cols, uint32_t box_rows, uint32_t box_cols,
                                      CUtensorMapSwizzle swizzle, const char* what) {
  CUtensorMap m;
  const cuuint64_t dims[2] = {cols, rows};
  const cuuint64_t strides[1] = {cols * elem};
  const cuuint32_t box[2] = {box_cols, box_rows};
  const cuuint32_t estr[2] = {1, 1};
  const CUresult r = tensor_map_encoder()(&m, type, 2, const_cast<void*>(base), dims, strides, box, estr,
                                          CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
                                          CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  FLOWMOE_CHECK(r == CUDA_SUCCESS, what << ": cuTensorMapEncodeTiled failed (error " << int(r) << ", [" << rows
                                        << ", " << cols << "] box [" << box_rows << ", " << box_cols << "])");
  return m;
}

// 3-D map over a row-major [depth, rows, cols] tensor, box [1, box_rows, box_cols]: boxes clipped
// at each matrix's edges (e.g. per expert), which a 2-D map over depth * rows rows is not.
inline CUtensorMap make_tensor_map_3d(const void* base, CUtensorMapDataType type, int elem, uint64_t depth,
                                      uint64_t rows, uint64_t cols, uint32_t box_rows, uint32_t box_cols,
                                      CUtensorMapSwizzle swizzle, const char* what) {
  CUtensorMap m;
  const cuuint64_t dims[3] = {cols, rows, depth};
  const cuuint64_t strides[2] = {cols * elem, rows * cols * elem};
  const cuuint32_t box[3] = {box_cols, box_rows, 1};
  const cuuint32_t estr[3] = {1, 1, 1};
  const CUresult r = tensor_map_encoder()(&m, type, 3, const_cast<void*>(base), dims, strides, box, estr,
                                          CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
                                          CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  FLOWMOE_CHECK(r == CUDA_SUCCESS, what << ": cuTensorMapEncodeTiled failed (error " << int(r) << ", [" << depth
                                        << ", " << rows << ", " << cols << "] box [" << box_rows << ", " << box_cols
                                        << "])");
  return m;
}

// ---- device: copies -------------------------------------------------------------------------
#ifdef FLOWMOE_SM90A
// Box at coordinates (c0 = column, c1 = row) of `map` -> shared `dst`; completes on `bar`.
__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];" ::"r"(
          smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1)
      : "memory");
}
// Box at (c0 = column, c1 = row, c2 = matrix) of a 3-D `map` -> shared `dst`; completes on `bar`
// (coordinates past a dimension read as zeros: a matrix's rows past its own never reach the next's).
__device__ __forceinline__ void tma_load_3d(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], [%2];" ::"r"(
          smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}
// `bytes` (a multiple of 16) contiguous bytes global -> shared; completes on `bar`.
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   smem_u32(dst)),
               "l"(src), "r"(bytes), "r"(smem_u32(bar))
               : "memory");
}
// Shared `src` added elementwise into the box at (c0, c1) of `map` (a bulk-group operation).
__device__ __forceinline__ void tma_reduce_add_2d(const CUtensorMap* map, const void* src, int c0, int c1) {
  asm volatile("cp.reduce.async.bulk.tensor.2d.global.shared::cta.add.bulk_group [%0, {%2, %3}], [%1];" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(smem_u32(src)), "r"(c0), "r"(c1)
               : "memory");
}
// Shared `src` stored into the box at (c0, c1) of `map` (a bulk-group operation).
__device__ __forceinline__ void tma_store_2d(const CUtensorMap* map, const void* src, int c0, int c1) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(smem_u32(src)), "r"(c0), "r"(c1)
               : "memory");
}
// The same two at (c0 = column, c1 = row, c2 = matrix) of a 3-D map.
__device__ __forceinline__ void tma_reduce_add_3d(const CUtensorMap* map, const void* src, int c0, int c1, int c2) {
  asm volatile("cp.reduce.async.bulk.tensor.3d.global.shared::cta.add.bulk_group [%0, {%2, %3, %4}], [%1];" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(smem_u32(src)), "r"(c0), "r"(c1), "r"(c2)
               : "memory");
}
__device__ __forceinline__ void tma_store_3d(const CUtensorMap* map, const void* src, int c0, int c1, int c2) {
  asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(smem_u32(src)), "r"(c0), "r"(c1), "r"(c2)
               : "memory");
}
// Closes the bulk group of this thread's operations issued since the last commit.
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// Waits until every committed group has finished reading its shared-memory source.
__device__ __forceinline__ void bulk_wait_read_all() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }
// Waits until every committed group has completed (writes visible).
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }
#endif  // FLOWMOE_SM90A

}  // namespace sm90
}  // namespace cuda
}  // namespace flowmoe
