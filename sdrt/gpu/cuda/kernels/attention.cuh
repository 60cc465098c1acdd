// Pieces shared by the attention kernel families (attention.cu, attention_sm90.cu): the mask
// dtype codes, log2(e) and -inf of the exp2 softmax, one mask element as float; and the parts
// of the sm_80+ flash kernels (mma.sync and wgmma) that work on one warp's 16-row tile in the
// m16n8 accumulator layout: the Q tile's staging and fragments, the masking of scores, the
// output rows.
#pragma once
#include "common.cuh"
#include "mma.cuh"

// dtype codes passed from Python (sdrt/gpu/cuda/attention.py DTYPE_CODE)
#define DT_F32 0
#define DT_F16 1
#define DT_BF16 2

#define LOG2E 1.4426950408889634f
#define NEG_INF (-__int_as_float(0x7f800000))

// One element of a mask (F32/F16/BF16, code `dt`) at byte offset `off`.
__device__ __forceinline__ float load_mask(const char* base, int64_t off, int dt) {
    const char* p = base + off;
    if (dt == DT_F32) return *reinterpret_cast<const float*>(p);
    if (dt == DT_F16) return __half2float(*reinterpret_cast<const __half*>(p));
    return __bfloat162float(*reinterpret_cast<const __nv_bfloat16*>(p));
}

// columns c, c + 1 of an output row as one aligned pair store
__device__ __forceinline__ void put2(float* p, float a, float b) { *reinterpret_cast<float2*>(p) = make_float2(a, b); }
__device__ __forceinline__ void put2(__half* p, float a, float b) {
    *reinterpret_cast<__half2*>(p) = __floats2half2_rn(a, b);
}
__device__ __forceinline__ void put2(__nv_bfloat16* p, float a, float b) {
    *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(a, b);
}

// half-row hr of accumulator tile o, times inv, into output row `orow` of type T
template <typename T, int ND>
__device__ __forceinline__ void store_row(const float (&o)[ND][4], int hr, float inv, T* orow, int tq, int Dv,
                                          bool pairs) {
#pragma unroll
    for (int d = 0; d < ND; ++d) {
        const int c = d * 8 + 2 * tq;
        const float v0 = o[d][2 * hr] * inv, v1 = o[d][2 * hr + 1] * inv;
        if (c + 1 < Dv && pairs) {
            put2(orow + c, v0, v1);
        } else {
            if (c < Dv) orow[c] = from_f32<T>(v0);
            if (c + 1 < Dv) orow[c + 1] = from_f32<T>(v1);
        }
    }
}

// The output rows of one 16-row m16n8 accumulator tile (o[d][e], lane l holding rows l/4 (e 0, 1)
// and l/4 + 8 (e 2, 3), columns d*8 + 2*(l%4) + {0, 1}), divided by their row sums (l_run: this
// lane's partial sums, reduced over the 4 lanes of a row here; a fully masked row, sum 0, gives
// zeros): row i = row0 + 8*hr at out + n*os3 + h*os2 + i*os1 elements, float, half (out_half 1)
// or bfloat16 (out_half 2: an attention output read by a BF16 GEMM), in column pairs where they
// are aligned. The mma.sync and wgmma flash kernels' epilogue.
template <int ND>
__device__ __forceinline__ void store_rows(const float (&o)[ND][4], const float (&l_run)[2], int row0, int tq,
                                           int Lq, int Dv, void* __restrict__ out, int64_t os1, int64_t os2,
                                           int64_t os3, int n, int h, int out_half) {
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
        float l = l_run[hr];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;
        const int i = row0 + hr * 8;
        if (i >= Lq) continue;
        const int64_t orow = (int64_t)n * os3 + (int64_t)h * os2 + (int64_t)i * os1;
        const bool pairs = ((orow | Dv) & 1) == 0;  // 8/4-byte aligned column pairs
        if (out_half == 1) store_row(o, hr, inv, static_cast<__half*>(out) + orow, tq, Dv, pairs);
        else if (out_half == 2) store_row(o, hr, inv, static_cast<__nv_bfloat16*>(out) + orow, tq, Dv, pairs);
        else store_row(o, hr, inv, static_cast<float*>(out) + orow, tq, Dv, pairs);
    }
}

#ifdef SDRT_HAVE_MMA
// Rows qb .. qb+BQ-1 of Q (row i at Qg + i*qs1, Dq valid halves, rows >= Lq and columns >= Dq
// zero-filled) into shared memory rows of LD halves, 16 bytes a copy (cp.async, not committed).
template <int NT, int BQ, int CH>
__device__ __forceinline__ void stage_q_rows(__half* Qs, int LD, const __half* Qg, int64_t qs1, int qb, int Lq,
                                             int Dq, const __half* Q, int tid) {
#pragma unroll
    for (int idx = tid; idx < BQ * CH; idx += NT) {
        const int r = idx / CH, c = idx % CH;
        const bool in = qb + r < Lq && c * 8 < Dq;
        cp_async16(Qs + r * LD + c * 8, in ? Qg + (int64_t)(qb + r) * qs1 + c * 8 : Q, in);
    }
}

// The first STAGES - 1 K/V tiles of a cp.async pipeline (load_kv(t) copies tile t, not
// committing), one commit group each (empty ones beyond nkt keep the group count fixed).
template <int STAGES, typename LoadKV>
__device__ __forceinline__ void prime_tiles(LoadKV& load_kv, int nkt) {
    load_kv(0);
    cp_async_commit();
#pragma unroll
    for (int t = 1; t < STAGES - 1; ++t) {
        if (t < nkt) load_kv(t);
        cp_async_commit();
    }
}

// The m16n8k16 A fragments of a 16-row Q tile starting at shared row `tile` (LD halves a row),
// one per 16 columns; and their scaling by qscale in registers.
template <int KD>
__device__ __forceinline__ void load_q_frags(unsigned (&qf)[KD][4], const __half* tile, int LD, int lane) {
#pragma unroll
    for (int kk = 0; kk < KD; ++kk)
        ldsm_x4(qf[kk], tile + ((lane & 7) + ((lane >> 3) & 1) * 8) * LD + kk * 16 + (lane >> 4) * 8);
}
template <int KD>
__device__ __forceinline__ void scale_q_frags(unsigned (&qf)[KD][4], float qscale) {
#pragma unroll
    for (int kk = 0; kk < KD; ++kk)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const float2 x = __half22float2(*reinterpret_cast<__half2*>(&qf[kk][e]));
            qf[kk][e] = pack_half2(x.x * qscale, x.y * qscale);
        }
}
#endif

// The scores of a 16-row tile (s[j][e] as store_rows' o, rows row0 and row0 + 8, keys
// k0 + 8 j + 2 (lane % 4) + {0, 1}): keys at or beyond Lk to -inf, the mask (natural-log units,
// so times log2(e)) added; mask plane (h % M2, n % M3), its row i (or 0 when it has one, Mq 1).
// The mask row of query row i (plane (h % M2, n % M3); row i, or 0 when the mask has one), or
// nullptr without a mask or past the last row
__device__ __forceinline__ const char* mask_row(const char* mask, int i, int Lq, int64_t mnb1, int64_t mnb2,
                                                int64_t mnb3, int Mq, int M2, int M3, int n, int h) {
    return (mask != nullptr && i < Lq)
               ? mask + (int64_t)(n % M3) * mnb3 + (int64_t)(h % M2) * mnb2 + (int64_t)(Mq == 1 ? 0 : i) * mnb1
               : nullptr;
}

template <int NS>
__device__ __forceinline__ void mask_scores(float (&s)[NS][4], int row0, int tq, int k0, int Lk, int Lq,
                                            const char* mask, int mdt, int64_t mnb0, int64_t mnb1, int64_t mnb2,
                                            int64_t mnb3, int Mq, int M2, int M3, int n, int h) {
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
        const char* mrow = mask_row(mask, row0 + hr * 8, Lq, mnb1, mnb2, mnb3, Mq, M2, M3, n, h);
#pragma unroll
        for (int j = 0; j < NS; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int key = k0 + j * 8 + 2 * tq + e;
                float& x = s[j][2 * hr + e];
                if (key >= Lk) x = NEG_INF;
                else if (mrow) x += load_mask(mrow, (int64_t)key * mnb0, mdt) * LOG2E;
            }
    }
}
