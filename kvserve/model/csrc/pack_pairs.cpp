// The packed weight layout of the AVX-512 and AVX2 projection families (linear_avx512.cpp, linear_avx2.cpp),
// packed once at load:
//
// w [N, K] bf16 -> [N / 16, K / 2, 32]: for each block of 16 output rows and each pair of k, the 16 rows'
// (w[n][k], w[n][k + 1]) side by side. A 32-bit lane then holds two k steps of one row: a shift left by 16
// gives step k as fp32, a mask of the high half gives step k + 1, and the pair is VDPBF16PS's operand as it
// is. One 64-byte line is a block's pair (one zmm, or two ymm of 8 rows each).

#include "common.h"

namespace kvserve {

at::Tensor pack_bf16_pairs(const at::Tensor& w) {
  constexpr int64_t kBlock = 16;
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.dim() == 2, "pack_bf16_pairs: bf16 [N, K] only");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(N % kBlock == 0 && K % 2 == 0, "pack_bf16_pairs: N must be a multiple of 16 and K even");
  at::Tensor src = w.contiguous();
  at::Tensor packed = at::empty({N / kBlock, K / 2, 2 * kBlock}, w.options());
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src.data_ptr<at::BFloat16>());
  uint16_t* d = reinterpret_cast<uint16_t*>(packed.data_ptr<at::BFloat16>());
  parallel_range(0, N / kBlock, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t nb = b0; nb < b1; ++nb)
      for (int64_t p = 0; p < K / 2; ++p)
        for (int64_t n = 0; n < kBlock; ++n)
          for (int64_t e = 0; e < 2; ++e)
            d[((nb * (K / 2) + p) * kBlock + n) * 2 + e] = s[(nb * kBlock + n) * K + 2 * p + e];
  });
  return packed;
}

}  // namespace kvserve
