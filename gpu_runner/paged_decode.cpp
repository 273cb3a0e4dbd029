// Paged decode attention for the cpu device: one query token per sequence, K and V read in
// place from the paged cache (no gathered copy). A task is one sequence, all its heads, so
// each cached row (every KV head of a token) is read once, front to back: scores for the
// whole context, softmax, then the weighted sum of V. Sequences are spread over torch's
// OpenMP threads; a single sequence runs on the calling thread. Built by
// gpu_runner/kernels.py; the layouts are gpu_runner/attention.py's:
//   q, out      [D, H, hd]         H = KVH * G; query head h * G + g reads KV head h
//   k, v        [W, KVH, hd]       rows written to the cache first, at cache row slots[i]
//   k/v cache   [R, KVH, hd]       R = num_blocks * bs; a context's token t lives at row
//                                  pages[d, t / bs] * bs + t % bs
//   pages       [D, P] int64, ctx [D] int64 (1 <= ctx[d] <= P * bs)
// Scores and softmax are float32 whatever the storage type (float32 or bfloat16).

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

struct F32 {
    using T = float;
    static inline float load(float x) { return x; }
    static inline float store(float x) { return x; }
};

struct BF16 {
    using T = uint16_t;
    static inline float load(uint16_t x) {
        uint32_t bits = uint32_t(x) << 16;
        float f;
        std::memcpy(&f, &bits, sizeof f);
        return f;
    }
    static inline uint16_t store(float f) {  // round to nearest even, as torch does
        uint32_t bits;
        std::memcpy(&bits, &f, sizeof bits);
        if (std::isnan(f)) return 0x7fc0;
        return uint16_t((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
    }
};

template <typename S>
void paged_decode(const typename S::T *q, const typename S::T *k, const typename S::T *v,
                  const int64_t *slots, int64_t num_writes, typename S::T *k_cache,
                  typename S::T *v_cache, const int64_t *pages, const int64_t *ctx,
                  typename S::T *out, int64_t D, int64_t P, int64_t KVH, int64_t G, int64_t HD,
                  int64_t BS, float scale, int threads) {
    using T = typename S::T;
    const int64_t row = KVH * HD;  // elements of one cached token
    for (int64_t i = 0; i < num_writes; i++) {
        std::memcpy(k_cache + slots[i] * row, k + i * row, sizeof(T) * row);
        std::memcpy(v_cache + slots[i] * row, v + i * row, sizeof(T) * row);
    }
    const int64_t H = KVH * G;
#pragma omp parallel num_threads(threads) if (threads > 1 && D > 1)
    {
        std::vector<float> score(H * P * BS), qf(H * HD), acc(H * HD);
#pragma omp for schedule(dynamic, 1)
        for (int64_t d = 0; d < D; d++) {
            const int64_t len = ctx[d] < P * BS ? ctx[d] : P * BS;  // never past its pages
            const T *qd = q + d * H * HD;
            for (int64_t i = 0; i < H * HD; i++) qf[i] = S::load(qd[i]) * scale;
            for (int64_t t0 = 0, p = 0; t0 < len; t0 += BS, p++) {
                const int64_t n = len - t0 < BS ? len - t0 : BS;
                const T *kr = k_cache + pages[d * P + p] * BS * row;
                for (int64_t t = 0; t < n; t++, kr += row) {
                    for (int64_t hg = 0; hg < H; hg++) {
                        const float *qg = qf.data() + hg * HD;
                        const T *kh = kr + (hg / G) * HD;
                        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
                        for (int64_t i = 0; i < HD; i++) dot += qg[i] * S::load(kh[i]);
                        score[hg * len + t0 + t] = dot;
                    }
                }
            }
            for (int64_t hg = 0; hg < H; hg++) {
                float *s = score.data() + hg * len, top = -INFINITY, sum = 0.f;
                for (int64_t t = 0; t < len; t++) top = s[t] > top ? s[t] : top;
                for (int64_t t = 0; t < len; t++) {
                    s[t] = std::exp(s[t] - top);
                    sum += s[t];
                }
                const float inv = 1.f / sum;
                for (int64_t t = 0; t < len; t++) s[t] *= inv;
            }
            std::fill(acc.begin(), acc.end(), 0.f);
            for (int64_t t0 = 0, p = 0; t0 < len; t0 += BS, p++) {
                const int64_t n = len - t0 < BS ? len - t0 : BS;
                const T *vr = v_cache + pages[d * P + p] * BS * row;
                for (int64_t t = 0; t < n; t++, vr += row) {
                    for (int64_t hg = 0; hg < H; hg++) {
                        const float w = score[hg * len + t0 + t];
                        const T *vh = vr + (hg / G) * HD;
                        float *a = acc.data() + hg * HD;
#pragma omp simd
                        for (int64_t i = 0; i < HD; i++) a[i] += w * S::load(vh[i]);
                    }
                }
            }
            T *o = out + d * H * HD;
            for (int64_t i = 0; i < H * HD; i++) o[i] = S::store(acc[i]);
        }
    }
}

}  // namespace

#define GAPLESS_EXPORT(NAME, S)                                                                 \
    extern "C" void NAME(const S::T *q, const S::T *k, const S::T *v, const int64_t *slots,     \
                         int64_t num_writes, S::T *k_cache, S::T *v_cache, const int64_t *pages, \
                         const int64_t *ctx, S::T *out, int64_t D, int64_t P, int64_t KVH,      \
                         int64_t G, int64_t HD, int64_t BS, float scale, int threads) {         \
        paged_decode<S>(q, k, v, slots, num_writes, k_cache, v_cache, pages, ctx, out, D, P,    \
                        KVH, G, HD, BS, scale, threads);                                        \
    }

GAPLESS_EXPORT(paged_decode_float32, F32)
GAPLESS_EXPORT(paged_decode_bfloat16, BF16)
