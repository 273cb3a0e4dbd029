// y = x W^T for int8 weights with one scale per output row, on AVX-512 VNNI: the operator
// gapless::int8_vnni_mm (schema: gpu_runner/cpu/kernels.py). For the few rows of a decode step,
// where the matmul reads each weight once and torch's weight-only int8 kernel spends more time
// widening int8 to float than reading memory.
//
// x [M, K] (float32 or bfloat16) is quantized per block of 32 columns to int8 with a float
// scale (dx_b = max |x| / 127 over block b), as llama.cpp does for its Q8_0 dot products. The
// weights are stored biased, u = w + 128 in 0..255, so that vpdpbusd (unsigned x signed bytes,
// four products summed into each int32 lane) takes them as they are:
//   sum_k u_k q_k = sum_k w_k q_k + 128 sum_k q_k
// and the bias term depends on x alone. So, with s_b = sum of block b's q:
//   y[m, n] = scale_n * (sum_b dx_b * dot_b(u_n, q_m) - 128 * sum_b dx_b * s_b)
// where the second sum is one number per row of x. A 64-byte vector holds two blocks: lanes
// 0-7 sum block 2p, lanes 8-15 block 2p + 1, so each lane is scaled by its block's dx before
// the lanes of a row are added once at the end.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>

namespace {

constexpr int64_t BLOCK = 32;
constexpr int64_t ROWS = 4;  // weight rows per pass: four independent sums per x row

// one row of x, quantized: q [K] int8, dxv [K / 64][16] (each lane's block scale), and the
// bias term 128 * sum_b dx_b * s_b
struct Quantized {
    std::vector<int8_t> q;
    std::vector<float> dxv;
    float bias = 0.f;
};

void quantize_row(const float *x, int64_t K, Quantized &out) {
    out.q.resize(K);
    out.dxv.resize(K / 64 * 16);
    double bias = 0.0;
    for (int64_t b = 0; b < K / BLOCK; b++) {
        const float *xb = x + b * BLOCK;
        float top = 0.f;
        for (int64_t i = 0; i < BLOCK; i++) top = std::fmax(top, std::fabs(xb[i]));
        const float dx = top / 127.f, inv = top > 0.f ? 127.f / top : 0.f;
        int32_t sum = 0;
        for (int64_t i = 0; i < BLOCK; i++) {
            const int32_t v = int32_t(std::nearbyint(xb[i] * inv));
            out.q[b * BLOCK + i] = int8_t(v);
            sum += v;
        }
        for (int64_t l = 0; l < 8; l++) out.dxv[(b / 2) * 16 + (b % 2) * 8 + l] = dx;
        bias += 128.0 * double(dx) * double(sum);
    }
    out.bias = float(bias);
}

inline float hsum(__m512 v) { return _mm512_reduce_add_ps(v); }

// y[n] for R weight rows from n and one quantized row of x: R independent sums
template <int R>
void rows(const uint8_t *u, const float *scales, const Quantized &xq, int64_t K, int64_t n,
          float *y) {
    __m512 acc[R];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t p = 0; p < K / 64; p++) {
        const __m512i q = _mm512_loadu_si512(xq.q.data() + p * 64);
        const __m512 dx = _mm512_loadu_ps(xq.dxv.data() + p * 16);
        for (int r = 0; r < R; r++) {
            const __m512i w = _mm512_loadu_si512(u + (n + r) * K + p * 64);
            const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, q);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), dx, acc[r]);
        }
    }
    for (int r = 0; r < R; r++) y[n + r] = scales[n + r] * (hsum(acc[r]) - xq.bias);
}

// y[n] for rows n0..n1 of the weights and one quantized row of x
void rows_of(const uint8_t *u, const float *scales, const Quantized &xq, int64_t K, int64_t n0,
             int64_t n1, float *y) {
    int64_t n = n0;
    for (; n + ROWS <= n1; n += ROWS) rows<ROWS>(u, scales, xq, K, n, y);
    for (; n < n1; n++) rows<1>(u, scales, xq, K, n, y);
}

at::Tensor int8_vnni_mm(const at::Tensor &x_in, const at::Tensor &u, const at::Tensor &scales) {
    TORCH_CHECK(x_in.dim() == 2 && u.dim() == 2 && x_in.size(1) == u.size(1),
                "int8_vnni_mm: x [M, K] and weights [N, K]");
    TORCH_CHECK(u.scalar_type() == at::kByte && u.is_contiguous(),
                "int8_vnni_mm: weights contiguous uint8 (int8 + 128)");
    TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                    scales.numel() == u.size(0),
                "int8_vnni_mm: one float32 scale per weight row");
    const int64_t M = x_in.size(0), K = x_in.size(1), N = u.size(0);
    TORCH_CHECK(K % 64 == 0, "int8_vnni_mm: K a multiple of 64, not ", K);
    const at::Tensor x = x_in.to(at::kFloat).contiguous();
    at::Tensor y = at::empty({M, N}, x.options());
    std::vector<Quantized> xq(M);
    for (int64_t m = 0; m < M; m++) quantize_row(x.data_ptr<float>() + m * K, K, xq[m]);
    const uint8_t *w = u.data_ptr<uint8_t>();
    const float *s = scales.data_ptr<float>();
    float *out = y.data_ptr<float>();
    // why tiles of TILE weight rows: each x row passes over a tile while it is in L2 (147 KB
    // at K = 576), so the weights are read from memory once whatever M. why taken one by one
    // rather than split in halves: a thread the OS parks (the server's other processes share
    // the cores) leaves its tiles to the other instead of holding the call up (the output
    // layer beside a busy loop: bench/RESULTS.md, "one stream's step")
    constexpr int64_t TILE = 256;
    const int64_t tiles = (N + TILE - 1) / TILE;
    const int threads = at::get_num_threads();
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t n0 = t * TILE, n1 = n0 + TILE < N ? n0 + TILE : N;
        for (int64_t m = 0; m < M; m++) rows_of(w, s, xq[m], K, n0, n1, out + m * N);
    }
    return y;
}

}  // namespace

TORCH_LIBRARY_IMPL(gapless, CPU, m) { m.impl("int8_vnni_mm", &int8_vnni_mm); }

#endif  // AVX-512 VNNI
