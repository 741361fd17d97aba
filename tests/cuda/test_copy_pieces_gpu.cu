// The batched copy kernel of the staged expert-parallel exchange (flowmoe/cuda/copy_pieces.h):
// every piece's bytes land exactly (or zeros, for a piece without a source), nothing else is
// written, for any alignment and size (1 byte to several units), and for more pieces than one
// launch takes.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "cuda/gpu_test_util.h"
#include "flowmoe/cuda/copy_pieces.h"

namespace flowmoe {
namespace {

using namespace testutil;  // ASSERT_CUDA_OK

TEST(CopyPiecesGpu, RandomPiecesLandExactly) {
  for (int npieces : {1, 7, 961, 2500}) {
    std::mt19937 rng(1234 + npieces);
    // non-overlapping pieces in one source and one destination arena, random offsets (so every
    // alignment of the two addresses occurs) and sizes from 1 byte to 3.5 copy units
    std::vector<CopyPiece> host;
    std::vector<int64_t> so, dof, len;
    int64_t s_at = 0, d_at = 0;
    for (int i = 0; i < npieces; ++i) {
      const int64_t n = (i % 97 == 5) ? 0 : (rng() % 8 == 0 ? 1 + rng() % (115 * 1024) : 1 + rng() % 700);
      s_at += rng() % 33;
      d_at += rng() % 41;
      so.push_back(s_at);
      dof.push_back(d_at);
      len.push_back(n);
      s_at += n;
      d_at += n;
    }
    std::vector<uint8_t> src(s_at + 16), dst0(d_at + 16);
    for (auto& b : src) b = uint8_t(rng());
    for (auto& b : dst0) b = uint8_t(rng());
    uint8_t *ds = nullptr, *dd = nullptr;
    ASSERT_CUDA_OK(cudaMalloc(&ds, src.size()));
    ASSERT_CUDA_OK(cudaMalloc(&dd, dst0.size()));
    ASSERT_CUDA_OK(cudaMemcpy(ds, src.data(), src.size(), cudaMemcpyHostToDevice));
    ASSERT_CUDA_OK(cudaMemcpy(dd, dst0.data(), dst0.size(), cudaMemcpyHostToDevice));
    std::vector<uint8_t> expect = dst0;
    for (int i = 0; i < npieces; ++i) {
      const bool zero = i % 5 == 3;  // every fifth piece a zero fill
      host.push_back({zero ? nullptr : ds + so[i], dd + dof[i], len[i]});
      for (int64_t b = 0; b < len[i]; ++b) expect[dof[i] + b] = zero ? 0 : src[so[i] + b];
    }
    cuda::comm::copy_pieces(host, nullptr);
    ASSERT_CUDA_OK(cudaDeviceSynchronize());
    std::vector<uint8_t> got(dst0.size());
    ASSERT_CUDA_OK(cudaMemcpy(got.data(), dd, got.size(), cudaMemcpyDeviceToHost));
    int64_t bad = 0;
    for (size_t b = 0; b < got.size(); ++b) bad += got[b] != expect[b];
    EXPECT_EQ(bad, 0) << npieces << " pieces, " << d_at << " bytes";
    cudaFree(ds);
    cudaFree(dd);
  }
}

TEST(CopyPiecesGpu, BadPieceIsAClearError) {
  uint8_t* d = nullptr;
  ASSERT_EQ(cudaMalloc(&d, 64), cudaSuccess);
  EXPECT_THROW(cuda::comm::copy_pieces({{d, nullptr, 8}}, nullptr), Error);  // no destination
  EXPECT_THROW(cuda::comm::copy_pieces({{d, d + 32, -1}}, nullptr), Error);
  cuda::comm::copy_pieces({{nullptr, nullptr, 0}}, nullptr);  // empty pieces are skipped
  cuda::comm::copy_pieces({}, nullptr);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  cudaFree(d);
}

}  // namespace
}  // namespace flowmoe
