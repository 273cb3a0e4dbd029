// Paged decode attention for the cpu device: one query token per sequence, K and V read in
// place from the paged cache (no gathered copy). A task is one sequence, all its heads, so
// each cached row (every KV head of a token) is read once, front to back: scores for the
// whole context, softmax, then the weighted sum of V. Sequences are spread over torch's
// OpenMP threads; a single sequence runs on the calling thread. Built by
// gpu_runner/cpu/kernels.py; the layouts are gpu_runner/attention.py's:
//   q, out      [D, H, hd]         H = KVH * G; query head h * G + g reads KV head h
//   k, v        [W, KVH, hd]       rows written to the cache first, at cache row slots[i];
//                                  row i of k starts k_step elements after row i - 1 (v:
//                                  v_step, slots: slot_step), so views need no copy
//   k/v cache   [R, KVH, hd]       R = num_blocks * bs; a context's token t lives at row
//                                  pages[d, t / bs] * bs + t % bs
//   pages       [D, P] int64, ctx [D] int64 (1 <= ctx[d] <= P * bs)
// Scores and softmax are float32 whatever the storage type (float32 or bfloat16). A window
// (> 0) keeps a query to the last `window` keys of its context, its own included: the pages
// before them are not read. A softcap (> 0) maps each scaled score s to softcap * tanh(s /
// softcap) before the softmax.
//
// Where the compiler targets AVX-512 with BF16 dot products, bfloat16 caches of head size 64
// or 128 take paged_decode_bf16_avx512 below: a page's rows are read from memory once for all
// heads, sixteen tokens at a time; q.k by vdpbf16ps (bf16 products are exact in float32), the
// sixteen dot products summed across lanes together; softmax with a vectorized exp; the
// weighted sum of V in float32. The next page is prefetched a slice per (tile, head), spread
// over the work. The portable loop leaves all this to the compiler, which reduces each dot product on
// its own, calls the scalar exp per score and waits on every page it reads, several times slower
// (test_bench_decode_attention_of_a_step, bf16); prefetching the whole next page in one burst
// instead stalled on the loads, and no prefetch was slower still (bench/RESULTS.md,
// "attention's vector path, fused projections, numpy's argmax").

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define GAPLESS_BF16_AVX512 1
#endif

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

#ifdef GAPLESS_BF16_AVX512

// e^x for x <= 0 (scores less their maximum): 2^n * e^r with |r| <= ln2 / 2, r's exponential
// by its Taylor series to degree 7 (error under 1e-8 relative to e^r)
inline __m512 exp_nonpositive(__m512 x) {
    x = _mm512_max_ps(_mm512_set1_ps(-87.0f), x);  // why this order: a NaN x stays NaN
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);  // ln2's high bits
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);       // and the rest
    __m512 p = _mm512_set1_ps(1.f / 5040);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

// lane j = the sum of v[j]'s sixteen lanes: halves, quarters, then pairs within each quarter
// are added across vectors, which leaves the sums in the lane order undone by the last permute
inline __m512 sum16(const __m512 *v) {
    __m512 a[8], b[4], c[2];
    for (int j = 0; j < 8; j++)
        a[j] = _mm512_add_ps(_mm512_shuffle_f32x4(v[j], v[j + 8], 0x44),
                             _mm512_shuffle_f32x4(v[j], v[j + 8], 0xee));
    for (int j = 0; j < 4; j++)
        b[j] = _mm512_add_ps(_mm512_shuffle_f32x4(a[j], a[j + 4], 0x88),
                             _mm512_shuffle_f32x4(a[j], a[j + 4], 0xdd));
    for (int j = 0; j < 2; j++)
        c[j] = _mm512_add_ps(_mm512_unpacklo_ps(b[j], b[j + 2]), _mm512_unpackhi_ps(b[j], b[j + 2]));
    const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(c[0]), _mm512_castps_pd(c[1]));
    const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(c[0]), _mm512_castps_pd(c[1]));
    const __m512 d = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
    // d's lane i holds the sum of v[order[i]]; the order is its own inverse
    const __m512i order = _mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15);
    return _mm512_permutexvar_ps(order, d);
}

// part `part` of `parts` of a page's cache lines on their way to L1: a page ahead is fetched a
// slice per (tile, head), so the loads spread over the work instead of stalling in one burst
inline void prefetch_part(const uint16_t *rows, int64_t bytes, int64_t part, int64_t parts) {
    const char *at = reinterpret_cast<const char *>(rows);
    const int64_t lines = bytes / 64, per = (lines + parts - 1) / parts;
    const int64_t end = (part + 1) * per < lines ? (part + 1) * per : lines;
    for (int64_t i = part * per; i < end; i++) _mm_prefetch(at + 64 * i, _MM_HINT_T0);
}

inline __mmask16 first_lanes(int64_t n) { return n < 16 ? __mmask16((1u << n) - 1) : 0xffff; }

#endif  // GAPLESS_BF16_AVX512

// the first key a query at the end of a context of `len` sees
inline int64_t window_start(int64_t len, int64_t window) {
    return window > 0 && len > window ? len - window : 0;
}

// scores s[start, len) -> softcap * tanh(s / softcap)
inline void soft_cap(float *s, int64_t start, int64_t len, float softcap) {
    if (softcap <= 0.f) return;
    const float inv = 1.f / softcap;
    for (int64_t t = start; t < len; t++) s[t] = softcap * std::tanh(s[t] * inv);
}

#ifdef GAPLESS_BF16_AVX512

// one sequence's attention, every head, over keys [start, len). A page's rows come from
// memory once: all H heads' scores (then weighted sums) are taken over sixteen tokens while
// they are in L1. score holds H * len floats, acc H * HD.
template <int HD>
void attend_bf16_avx512(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                        const int64_t *pages, int64_t start, int64_t len, uint16_t *out,
                        int64_t KVH, int64_t G, int64_t BS, float scale, float softcap,
                        float *score, float *acc) {
    constexpr int QC = HD / 32, VC = HD / 16;  // bf16 vectors of a head; float vectors
    const int64_t row = KVH * HD, H = KVH * G, page_bytes = BS * row * 2;
    const int64_t num_pages = (len + BS - 1) / BS, first = start / BS;
    const __m512 scale_v = _mm512_set1_ps(scale);
    for (int64_t p = first, t0 = first * BS; p < num_pages; p++, t0 += BS) {
        const uint16_t *page = k_cache + pages[p] * BS * row;
        const uint16_t *ahead = p + 1 < num_pages ? k_cache + pages[p + 1] * BS * row : nullptr;
        const int64_t n = len - t0 < BS ? len - t0 : BS, tiles = (n + 15) / 16;
        for (int64_t u = 0; u < n; u += 16) {
            const int m = n - u < 16 ? int(n - u) : 16;
            for (int64_t hg = 0; hg < H; hg++) {
                if (ahead) prefetch_part(ahead, page_bytes, u / 16 * H + hg, tiles * H);
                const uint16_t *kr = page + u * row + (hg / G) * HD;
                __m512bh qv[QC];
                for (int c = 0; c < QC; c++)
                    qv[c] = (__m512bh)_mm512_loadu_si512(q + hg * HD + 32 * c);
                __m512 dots[16];
#pragma GCC unroll 16
                for (int i = 0; i < 16; i++) {
                    dots[i] = _mm512_setzero_ps();
                    if (i < m)
                        for (int c = 0; c < QC; c++)
                            dots[i] = _mm512_dpbf16_ps(
                                dots[i], qv[c], (__m512bh)_mm512_loadu_si512(kr + i * row + 32 * c));
                }
                _mm512_mask_storeu_ps(score + hg * len + t0 + u, first_lanes(m),
                                      _mm512_mul_ps(sum16(dots), scale_v));
            }
        }
    }
    for (int64_t hg = 0; hg < H; hg++) {
        float *s = score + hg * len;
        soft_cap(s, start, len, softcap);
        __m512 top = _mm512_set1_ps(-INFINITY);
        __mmask16 nan = 0;  // why: max drops a NaN, which must reach the output as torch's does
        for (int64_t t = start; t < len; t += 16) {
            const __mmask16 keep = first_lanes(len - t);
            const __m512 x = _mm512_maskz_loadu_ps(keep, s + t);
            nan |= _mm512_mask_cmp_ps_mask(keep, x, x, _CMP_UNORD_Q);
            top = _mm512_mask_max_ps(top, keep, top, x);
        }
        const __m512 top_v = _mm512_set1_ps(nan ? NAN : _mm512_reduce_max_ps(top));
        __m512 sum = _mm512_setzero_ps();
        for (int64_t t = start; t < len; t += 16) {
            const __mmask16 keep = first_lanes(len - t);
            const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(keep, s + t), top_v));
            sum = _mm512_mask_add_ps(sum, keep, sum, e);
            _mm512_mask_storeu_ps(s + t, keep, e);
        }
        const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(sum));
        for (int64_t t = start; t < len; t += 16) {
            const __mmask16 keep = first_lanes(len - t);
            _mm512_mask_storeu_ps(s + t, keep, _mm512_mul_ps(_mm512_maskz_loadu_ps(keep, s + t), inv));
        }
    }
    std::memset(acc, 0, sizeof(float) * H * HD);
    for (int64_t p = first, t0 = first * BS; p < num_pages; p++, t0 += BS) {
        const uint16_t *page = v_cache + pages[p] * BS * row;
        const uint16_t *ahead = p + 1 < num_pages ? v_cache + pages[p + 1] * BS * row : nullptr;
        const int64_t n = len - t0 < BS ? len - t0 : BS, tiles = (n + 15) / 16;
        for (int64_t u = start > t0 ? start - t0 : 0; u < n; u += 16) {  // from the window's first
            const int64_t m = n - u < 16 ? n - u : 16;
            for (int64_t hg = 0; hg < H; hg++) {
                if (ahead) prefetch_part(ahead, page_bytes, u / 16 * H + hg, tiles * H);
                const uint16_t *vr = page + u * row + (hg / G) * HD;
                const float *w = score + hg * len + t0 + u;
                __m512 a[VC];
                for (int c = 0; c < VC; c++) a[c] = _mm512_loadu_ps(acc + hg * HD + 16 * c);
                for (int64_t i = 0; i < m; i++, vr += row) {
                    const __m512 wi = _mm512_set1_ps(w[i]);
                    for (int c = 0; c < VC; c++) {
                        const __m256i v16 = _mm256_loadu_si256((const __m256i *)(vr + 16 * c));
                        a[c] = _mm512_fmadd_ps(wi, _mm512_cvtpbh_ps((__m256bh)v16), a[c]);
                    }
                }
                for (int c = 0; c < VC; c++) _mm512_storeu_ps(acc + hg * HD + 16 * c, a[c]);
            }
        }
    }
    for (int64_t hg = 0; hg < H; hg++)
        for (int c = 0; c < VC; c++)
            _mm256_storeu_si256((__m256i *)(out + hg * HD + 16 * c),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(acc + hg * HD + 16 * c)));
}

// false where this head size has no vector path (the portable loop runs instead)
bool paged_decode_bf16_avx512(const uint16_t *q, const uint16_t *k_cache,
                              const uint16_t *v_cache, const int64_t *pages, const int64_t *ctx,
                              uint16_t *out, int64_t D, int64_t P, int64_t KVH, int64_t G,
                              int64_t HD, int64_t BS, float scale, int64_t window, float softcap,
                              int threads) {
    if (HD != 64 && HD != 128) return false;
    const int64_t H = KVH * G;
#pragma omp parallel num_threads(threads) if (threads > 1 && D > 1)
    {
        std::vector<float> score(H * P * BS), acc(H * HD);
#pragma omp for schedule(dynamic, 1)
        for (int64_t d = 0; d < D; d++) {
            const int64_t len = ctx[d] < P * BS ? ctx[d] : P * BS;
            (HD == 64 ? attend_bf16_avx512<64> : attend_bf16_avx512<128>)(
                q + d * H * HD, k_cache, v_cache, pages + d * P, window_start(len, window), len,
                out + d * H * HD, KVH, G, BS, scale, softcap, score.data(), acc.data());
        }
    }
    return true;
}

#endif  // GAPLESS_BF16_AVX512

template <typename S>
void paged_decode(const typename S::T *q, const typename S::T *k, const typename S::T *v,
                  const int64_t *slots, int64_t num_writes, int64_t k_step, int64_t v_step,
                  int64_t slot_step, typename S::T *k_cache,
                  typename S::T *v_cache, const int64_t *pages, const int64_t *ctx,
                  typename S::T *out, int64_t D, int64_t P, int64_t KVH, int64_t G, int64_t HD,
                  int64_t BS, float scale, int64_t window, float softcap, int threads) {
    using T = typename S::T;
    const int64_t row = KVH * HD;  // elements of one cached token
    for (int64_t i = 0; i < num_writes; i++) {
        const int64_t slot = slots[i * slot_step];
        std::memcpy(k_cache + slot * row, k + i * k_step, sizeof(T) * row);
        std::memcpy(v_cache + slot * row, v + i * v_step, sizeof(T) * row);
    }
#ifdef GAPLESS_BF16_AVX512
    if constexpr (sizeof(T) == 2) {
        if (paged_decode_bf16_avx512(q, k_cache, v_cache, pages, ctx, out, D, P, KVH, G, HD, BS,
                                     scale, window, softcap, threads))
            return;
    }
#endif
    const int64_t H = KVH * G;
#pragma omp parallel num_threads(threads) if (threads > 1 && D > 1)
    {
        std::vector<float> score(H * P * BS), qf(H * HD), acc(H * HD);
#pragma omp for schedule(dynamic, 1)
        for (int64_t d = 0; d < D; d++) {
            const int64_t len = ctx[d] < P * BS ? ctx[d] : P * BS;  // never past its pages
            const int64_t start = window_start(len, window), first = start / BS;
            const T *qd = q + d * H * HD;
            for (int64_t i = 0; i < H * HD; i++) qf[i] = S::load(qd[i]) * scale;
            for (int64_t t0 = first * BS, p = first; t0 < len; t0 += BS, p++) {
                const int64_t n = len - t0 < BS ? len - t0 : BS, skip = start > t0 ? start - t0 : 0;
                const T *kr = k_cache + (pages[d * P + p] * BS + skip) * row;
                for (int64_t t = skip; t < n; t++, kr += row) {
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
                soft_cap(s, start, len, softcap);
                for (int64_t t = start; t < len; t++) top = s[t] > top ? s[t] : top;
                for (int64_t t = start; t < len; t++) {
                    s[t] = std::exp(s[t] - top);
                    sum += s[t];
                }
                const float inv = 1.f / sum;
                for (int64_t t = start; t < len; t++) s[t] *= inv;
            }
            std::fill(acc.begin(), acc.end(), 0.f);
            for (int64_t t0 = first * BS, p = first; t0 < len; t0 += BS, p++) {
                const int64_t n = len - t0 < BS ? len - t0 : BS, skip = start > t0 ? start - t0 : 0;
                const T *vr = v_cache + (pages[d * P + p] * BS + skip) * row;
                for (int64_t t = skip; t < n; t++, vr += row) {
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

// the operator gapless::paged_decode (schema: gpu_runner/cpu/kernels.py)

// k / v rows may be views (the compiled layer's come out of the fused qkv projection): each
// row's KVH * HD elements must be contiguous, the rows themselves any distance apart
bool rows_contiguous(const at::Tensor &t) {
    return t.stride(2) == 1 && (t.size(1) == 1 || t.stride(1) == t.size(2));
}

template <typename S, typename Scalar>
void run(const at::Tensor &q, const at::Tensor *k, const at::Tensor *v, const at::Tensor *slots,
         const at::Tensor &k_cache, const at::Tensor &v_cache, const at::Tensor &pages,
         const at::Tensor &ctx, const at::Tensor &out, double scale, int64_t block_size,
         int64_t window, double softcap) {
    using T = typename S::T;
    auto ptr = [](const at::Tensor *t) {
        return t ? reinterpret_cast<T *>(t->data_ptr<Scalar>()) : nullptr;
    };
    paged_decode<S>(reinterpret_cast<const T *>(q.data_ptr<Scalar>()), ptr(k), ptr(v),
                    slots ? slots->data_ptr<int64_t>() : nullptr, slots ? slots->size(0) : 0,
                    k ? k->stride(0) : 0, v ? v->stride(0) : 0, slots ? slots->stride(0) : 0,
                    reinterpret_cast<T *>(k_cache.data_ptr<Scalar>()),
                    reinterpret_cast<T *>(v_cache.data_ptr<Scalar>()), pages.data_ptr<int64_t>(),
                    ctx.data_ptr<int64_t>(), reinterpret_cast<T *>(out.data_ptr<Scalar>()),
                    q.size(0), pages.size(1), k_cache.size(1), q.size(1) / k_cache.size(1),
                    q.size(2), block_size, float(scale), window, float(softcap),
                    at::get_num_threads());
}

at::Tensor paged_decode_op(const at::Tensor &q_in, const std::optional<at::Tensor> &k_in,
                           const std::optional<at::Tensor> &v_in, const at::Tensor &k_cache,
                           const at::Tensor &v_cache,
                           const std::optional<at::Tensor> &slots_in,
                           const at::Tensor &pages_in, const at::Tensor &ctx_in, double scale,
                           int64_t block_size, int64_t window, double softcap) {
    const auto dtype = q_in.scalar_type();
    TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "paged_decode: q is ", dtype);
    TORCH_CHECK(q_in.dim() == 3 && k_cache.dim() == 3 && k_cache.is_contiguous() &&
                    v_cache.is_contiguous() && k_cache.scalar_type() == dtype &&
                    v_cache.scalar_type() == dtype && k_cache.size(2) == q_in.size(2) &&
                    q_in.size(1) % k_cache.size(1) == 0,
                "paged_decode: q [D, H, d] and contiguous caches [R, KVH, d] of its dtype");
    TORCH_CHECK(pages_in.scalar_type() == at::kLong && ctx_in.scalar_type() == at::kLong &&
                    pages_in.dim() == 2 && pages_in.size(0) == q_in.size(0),
                "paged_decode: pages [D, P] and ctx [D], int64");
    TORCH_CHECK(k_in.has_value() == v_in.has_value() && k_in.has_value() == slots_in.has_value(),
                "paged_decode: k, v and slot_mapping come together");
    const at::Tensor q = q_in.contiguous(), pages = pages_in.contiguous(),
                     ctx = ctx_in.contiguous();
    at::Tensor out = at::empty_like(q);
    const bool writes = k_in.has_value();
    at::Tensor k, v;
    if (writes) {
        k = rows_contiguous(*k_in) ? *k_in : k_in->contiguous();
        v = rows_contiguous(*v_in) ? *v_in : v_in->contiguous();
        const at::Tensor &slots = *slots_in;
        TORCH_CHECK(k.scalar_type() == dtype && v.scalar_type() == dtype &&
                        k.sizes() == v.sizes() && k.dim() == 3 && k.size(0) == slots.size(0) &&
                        k.size(1) == k_cache.size(1) && k.size(2) == k_cache.size(2),
                    "paged_decode: k and v are [W, KVH, d] rows of the caches' dtype");
        TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1,
                    "paged_decode: slot_mapping [W] int64");
    }
    (dtype == at::kFloat ? run<F32, float> : run<BF16, at::BFloat16>)(
        q, writes ? &k : nullptr, writes ? &v : nullptr, writes ? &*slots_in : nullptr, k_cache,
        v_cache, pages, ctx, out, scale, block_size, window, softcap);
    return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(gapless, CPU, m) { m.impl("paged_decode", &paged_decode_op); }
