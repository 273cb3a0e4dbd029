// y = x W^T for 4-bit weights in blocks of 32 columns, w = d * q + m with q in 0..15 (GGUF's
// Q4_1 block, d and m float16), on AVX-512 VNNI: the operator gapless::int4_vnni_mm (schema:
// gpu_runner/cpu/kernels.py). For the single row of one stream's decode step.
//
// Each row of x is quantized per block of 32 columns to int8 with a float scale (dx_b =
// max |x| / 127 over block b), and its block sums sx_b are kept unquantized, so
//   y[n] = sum_b d_nb * dx_b * dot_b(q_n, qx) + m_nb * sx_b
// The codes are unsigned, so vpdpbusd takes them as they are (four products summed into each
// int32 lane). The layout gives every lane a block of its own: a group of G <= 16 blocks is
// read as 8 steps of 4G bytes, step k holding bytes 4k..4k+3 of each block, so the 8 products
// of a group add up in int32 lanes, one block a lane, and the scales d, m, dx and sx of 16
// blocks are one vector each. Two steps share a byte (step 2j the low nibble, 2j + 1 the
// high), so a group's codes are 4 loads of 4G bytes, 16G bytes in all: 4 bits a weight.
// Per 512 weights and row that is 4 loads of codes and 2 of scales, 12 integer ops, 8 vpdpbusd
// and 6 float ops (weights are widened to float per block, never per weight).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__)
#include <immintrin.h>

namespace {

constexpr int64_t BLOCK = 32;  // weights per (d, m)
constexpr int64_t GROUP = 16;  // blocks per group: an int32 lane each
constexpr int64_t ROWS = 4;    // weight rows per pass: four independent sums per x row
// why prefetch 2 KB ahead of the codes: a large call reads the codes faster with it than without
// or at 1 KB, and a step's calls are far smaller than the calls 4 KB helps (bench/RESULTS.md,
// "the int4 layers' single row through a VNNI kernel")
constexpr int64_t PREFETCH = 2048;

// one row of x in the codes' order: q [K] int8, its block scales dx and sums sx [groups * 16]
// (zero past the last block)
struct Quantized {
    std::vector<int8_t> q;
    std::vector<float> dx, sx;
};

inline int64_t group_blocks(int64_t nb, int64_t g0) { return std::min(GROUP, nb - g0); }

template <typename scalar_t>
void quantize_row(const scalar_t *x, int64_t K, Quantized &out) {
    const int64_t nb = K / BLOCK, padded = (nb + GROUP - 1) / GROUP * GROUP;
    out.q.resize(K);
    out.dx.assign(padded, 0.f);
    out.sx.assign(padded, 0.f);
    for (int64_t b = 0; b < nb; b++) {
        float xb[BLOCK];
        float top = 0.f, sum = 0.f;
        for (int64_t i = 0; i < BLOCK; i++) {
            xb[i] = float(x[b * BLOCK + i]);
            top = std::fmax(top, std::fabs(xb[i]));
            sum += xb[i];
        }
        const float inv = top > 0.f ? 127.f / top : 0.f;
        const int64_t g0 = b / GROUP * GROUP, gb = group_blocks(nb, g0), lane = b - g0;
        int8_t *group = out.q.data() + g0 * BLOCK;
        for (int64_t i = 0; i < BLOCK; i++)
            group[(i / 4) * 4 * gb + lane * 4 + i % 4] = int8_t(std::nearbyint(xb[i] * inv));
        out.dx[b] = top / 127.f;
        out.sx[b] = sum;
    }
}

// n bytes from p, zero above; why plain loads where the width allows: AVX-512 masked loads
// from memory run at a fraction of the bandwidth of plain ones on some CPUs (AMD Zen 4)
inline __m512i tail(const void *p, int64_t n, __mmask64 mask) {
    if (n == 4) return _mm512_zextsi128_si512(_mm_cvtsi32_si128(*static_cast<const int32_t *>(p)));
    if (n == 8) return _mm512_zextsi128_si512(_mm_loadl_epi64(static_cast<const __m128i *>(p)));
    if (n == 16) return _mm512_zextsi128_si512(_mm_loadu_si128(static_cast<const __m128i *>(p)));
    if (n == 32) return _mm512_zextsi256_si512(_mm256_loadu_si256(static_cast<const __m256i *>(p)));
    return _mm512_maskz_loadu_epi8(mask, p);
}

// the products of one group of gb blocks for R weight rows from n; FULL: gb == GROUP, whose
// loads need no mask
template <int R, bool FULL>
inline void group(const uint8_t *codes, const uint16_t *d, const uint16_t *m, const Quantized &xq,
                  int64_t K, int64_t n, int64_t g0, int64_t gb, __m512 *acc) {
    const int64_t nb = K / BLOCK, step = 4 * gb;
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    const __mmask64 bytes = FULL ? ~0ULL : (1ULL << step) - 1;
    const __mmask64 lanes = (1ULL << (2 * gb)) - 1;  // gb float16 values
    auto load = [&](const void *p) { return FULL ? _mm512_loadu_si512(p) : tail(p, step, bytes); };
    auto half = [&](const uint16_t *p) {
        return _mm512_cvtph_ps(FULL ? _mm256_loadu_si256(reinterpret_cast<const __m256i *>(p))
                                    : _mm512_castsi512_si256(tail(p, 2 * gb, lanes)));
    };
    __m512i xs[8];
    for (int k = 0; k < 8; k++) xs[k] = load(xq.q.data() + g0 * BLOCK + k * step);
    const __m512 dx = _mm512_loadu_ps(xq.dx.data() + g0);
    const __m512 sx = _mm512_loadu_ps(xq.sx.data() + g0);
    for (int r = 0; r < R; r++) {
        const uint8_t *c = codes + (n + r) * (K / 2) + g0 * BLOCK / 2;
        __m512i dot = _mm512_setzero_si512();
        for (int j = 0; j < 4; j++) {
            const __m512i v = load(c + j * step);
            if constexpr (FULL) _mm_prefetch(reinterpret_cast<const char *>(c + j * step) + PREFETCH, _MM_HINT_T0);
            const __m512i lo = _mm512_and_si512(v, nibble);
            const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
            dot = _mm512_dpbusd_epi32(dot, lo, xs[2 * j]);
            dot = _mm512_dpbusd_epi32(dot, hi, xs[2 * j + 1]);
        }
        const __m512 dw = half(d + (n + r) * nb + g0), mw = half(m + (n + r) * nb + g0);
        acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(dot), dx), dw, acc[r]);
        acc[r] = _mm512_fmadd_ps(mw, sx, acc[r]);
    }
}

// y[n] for R weight rows from n and one quantized row of x
template <int R>
void rows(const uint8_t *codes, const uint16_t *d, const uint16_t *m, const Quantized &xq,
          int64_t K, int64_t n, float *y) {
    const int64_t nb = K / BLOCK;
    __m512 acc[R];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    int64_t g0 = 0;
    for (; g0 + GROUP <= nb; g0 += GROUP) group<R, true>(codes, d, m, xq, K, n, g0, GROUP, acc);
    if (g0 < nb) group<R, false>(codes, d, m, xq, K, n, g0, nb - g0, acc);
    for (int r = 0; r < R; r++) y[n + r] = _mm512_reduce_add_ps(acc[r]);
}

at::Tensor int4_vnni_mm(const at::Tensor &x_in, const at::Tensor &codes, const at::Tensor &d,
                        const at::Tensor &m) {
    TORCH_CHECK(x_in.dim() == 2 && codes.dim() == 2 && x_in.size(1) == 2 * codes.size(1),
                "int4_vnni_mm: x [M, K] and codes [N, K / 2]");
    const int64_t M = x_in.size(0), K = x_in.size(1), N = codes.size(0);
    TORCH_CHECK(K % BLOCK == 0, "int4_vnni_mm: K a multiple of 32, not ", K);
    TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous(),
                "int4_vnni_mm: codes contiguous uint8");
    for (const at::Tensor *t : {&d, &m})
        TORCH_CHECK(t->scalar_type() == at::kHalf && t->is_contiguous() && t->dim() == 2 &&
                        t->size(0) == N && t->size(1) == K / BLOCK,
                    "int4_vnni_mm: d and m contiguous float16 [N, K / 32]");
    const at::Tensor x = x_in.scalar_type() == at::kBFloat16 ? x_in.contiguous()
                                                             : x_in.to(at::kFloat).contiguous();
    at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
    thread_local std::vector<Quantized> xq;  // why kept: a step makes ~120 calls
    xq.resize(M);
    for (int64_t i = 0; i < M; i++) {
        if (x.scalar_type() == at::kBFloat16)
            quantize_row(x.data_ptr<at::BFloat16>() + i * K, K, xq[i]);
        else
            quantize_row(x.data_ptr<float>() + i * K, K, xq[i]);
    }
    const Quantized *xqs = xq.data();  // this thread's rows, for the team (xq is per thread)
    const uint8_t *c = codes.data_ptr<uint8_t>();
    const auto *dp = reinterpret_cast<const uint16_t *>(d.data_ptr<at::Half>());
    const auto *mp = reinterpret_cast<const uint16_t *>(m.data_ptr<at::Half>());
    float *out = y.data_ptr<float>();
    // why guided: each thread starts on a long run of rows (half, then a quarter, ...), which
    // the prefetchers stream as well as halves, and the last tiles go to whoever is free, so
    // a thread the OS parks does not hold the call up (see int8_matvec.cpp). Tiles taken one
    // by one in turn read memory slower than guided or halves.
    constexpr int64_t TILE = 16;
    const int64_t tiles = (N + TILE - 1) / TILE;
    const int threads = at::get_num_threads();
#pragma omp parallel for schedule(guided, 1) num_threads(threads) if (threads > 1)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t n0 = t * TILE, n1 = std::min(n0 + TILE, N);
        for (int64_t i = 0; i < M; i++) {
            int64_t n = n0;
            for (; n + ROWS <= n1; n += ROWS) rows<ROWS>(c, dp, mp, xqs[i], K, n, out + i * N);
            for (; n < n1; n++) rows<1>(c, dp, mp, xqs[i], K, n, out + i * N);
        }
    }
    return y;
}

}  // namespace

TORCH_LIBRARY_IMPL(gapless, CPU, m) { m.impl("int4_vnni_mm", &int4_vnni_mm); }

#endif  // AVX-512 VNNI
