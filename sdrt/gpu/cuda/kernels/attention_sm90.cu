// Flash attention on Hopper's warpgroup MMA (wgmma), for head dims 64 and 128: the kernel
// sdrt/gpu/cuda/ops/attention.py runs on sm_90 GPUs in place of attention.cu's mma.sync one
// (attn_mma_*), with the same arguments and the same result. This family is built for sm_90a
// only (wgmma is an sm_90a feature; driver.FAMILY_ARCHS): elsewhere the kernels trap.
//
// Scheme (FlashAttention-3's, without its producer warps and TMA):
//  * one block = NWG warpgroups of 4 warps; warpgroup w owns 64 query rows, warp i of it 16;
//  * K and V tiles of BK keys go through shared memory in wgmma's 128-byte swizzle layout: the
//    head dim in halves of 64 (128 bytes), each half a [BK][128 bytes] block whose 16-byte chunk
//    c of row r sits at chunk c ^ (r % 8) (without the swizzle, the tensor cores' row reads of
//    one 16-byte column hit the same banks: measured 2.5x slower). One thread copies one
//    16-byte chunk (cp.async), eight threads a row's half; K is then read K-major (the head dim
//    is the reduction of S = Q K^T), V N-major (the head dim is P V's output columns);
//  * S = Q K^T: Q and K both from shared memory through descriptors (Q as each warpgroup's
//    [64][DP] tile in the same swizzle layout, copied once per (head, batch); its scale*log2(e)
//    is applied to the scores), DP/16 wgmmas m64nBKk16 into the float accumulators;
//  * the accumulators of one warp hold, lane for lane, mma.sync's m16n8 layout (lane l: rows
//    l/4 and l/4 + 8, columns 2*(l%4) + {0, 1} of each 8-column block), so the online softmax
//    (lazy rescaling by MMA_LAZY, row sums per lane) is attention.cu's; P is repacked to the
//    A operand of O += P V in registers, V from its descriptor (BK/16 wgmmas m64nDPk16);
//  * K/V tiles are copied STAGES - 1 ahead; the warpgroups of a block run independently
//    between the per-tile barriers, so one's softmax overlaps another's wgmmas;
//  * PIPE (FlashAttention-3's in-warpgroup pipelining): the S wgmmas of tile t+1 go out with the
//    P V of tile t, and the softmax of t+1 runs while that P V does; PIPE 0 does one tile at a
//    time. The softmax only reads the S accumulators and writes P to a second register set:
//    ptxas serializes every wgmma of a kernel (warning C7515) where other instructions write an
//    accumulator while a wgmma is in flight, which the first pipelined version did.
#include "attention.cuh"
#include "mma.cuh"

#define WG_LAZY 8  // log2 units, as attention.cu's MMA_LAZY

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define SDRT_HAVE_WGMMA 1

// 64-bit shared memory descriptor of an operand in the 128-byte swizzle layout (PTX ISA,
// "matrix descriptor"): start address, leading-dimension byte offset (K-major: unused, 16;
// N-major: between 64-column halves), stride byte offset (between 8-row groups: 1024), all in
// 16-byte units; layout type 1 in bits 62-63. Atoms start on 1024-byte boundaries (base offset 0).
__device__ __forceinline__ uint64_t smem_desc(unsigned addr, unsigned lbo) {
    return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)(lbo >> 4) << 16) | ((uint64_t)(1024 >> 4) << 32) |
           (1ull << 62);
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// this thread's generic-proxy writes to shared memory (cp.async) become visible to wgmma
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

#define WG_D8(b) "+f"(d[b]), "+f"(d[b + 1]), "+f"(d[b + 2]), "+f"(d[b + 3]), "+f"(d[b + 4]), \
                 "+f"(d[b + 5]), "+f"(d[b + 6]), "+f"(d[b + 7])

// d (64 x N f32, this thread's N/2) (+)= a (64 x 16 f16, registers) * B (16 x N f16, descriptor);
// TRANS_B 0: B stored K-major, 1: N-major. scale_d 0 overwrites d.
template <int TRANS_B>
__device__ __forceinline__ void wgmma_n64(float (&d)[32], const unsigned (&a)[4], uint64_t desc, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
        "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,"
        "%24,%25,%26,%27,%28,%29,%30,%31}, {%32,%33,%34,%35}, %36, p, 1, 1, %38;\n}\n"
        : WG_D8(0), WG_D8(8), WG_D8(16), WG_D8(24)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d), "n"(TRANS_B));
}
template <int TRANS_B>
__device__ __forceinline__ void wgmma_n128(float (&d)[64], const unsigned (&a)[4], uint64_t desc, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
        "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,"
        "%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,"
        "%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, "
        "{%64,%65,%66,%67}, %68, p, 1, 1, %70;\n}\n"
        : WG_D8(0), WG_D8(8), WG_D8(16), WG_D8(24), WG_D8(32), WG_D8(40), WG_D8(48), WG_D8(56)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d), "n"(TRANS_B));
}
// d (64 x 64 f32) (+)= A (64 x 16 f16, K-major descriptor) * B (16 x 64 f16, K-major descriptor)
__device__ __forceinline__ void wgmma_ss_n64(float (&d)[32], uint64_t da, uint64_t db, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
        "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,"
        "%24,%25,%26,%27,%28,%29,%30,%31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
        : WG_D8(0), WG_D8(8), WG_D8(16), WG_D8(24)
        : "l"(da), "l"(db), "r"(scale_d));
}
__device__ __forceinline__ void wgmma_ss_n128(float (&d)[64], uint64_t da, uint64_t db, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
        "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,"
        "%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,"
        "%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
        : WG_D8(0), WG_D8(8), WG_D8(16), WG_D8(24), WG_D8(32), WG_D8(40), WG_D8(48), WG_D8(56)
        : "l"(da), "l"(db), "r"(scale_d));
}
template <int N>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 2], uint64_t da, uint64_t db, int scale_d) {
    static_assert(N == 64 || N == 128, "wgmma widths compiled: 64, 128");
    if constexpr (N == 64) wgmma_ss_n64(d, da, db, scale_d);
    else wgmma_ss_n128(d, da, db, scale_d);
}
template <int N, int TRANS_B>
__device__ __forceinline__ void wgmma(float (&d)[N / 2], const unsigned (&a)[4], uint64_t desc, int scale_d) {
    static_assert(N == 64 || N == 128, "wgmma widths compiled: 64, 128");
    if constexpr (N == 64) wgmma_n64<TRANS_B>(d, a, desc, scale_d);
    else wgmma_n128<TRANS_B>(d, a, desc, scale_d);
}
#endif

// dynamic shared memory: the K/V stages, the Q tile (both in the swizzle layout), and 1024 bytes
// to align them
__host__ __device__ constexpr int wg_smem_bytes(int dp, int nwg, int bk, int stages) {
    return 2 * (stages * 2 * bk * dp + nwg * 64 * dp) + 1024;
}

// Arguments as attention.cu's mma_body (Q/K/V half through row/head/batch strides, Q times
// qscale (applied to the scores here), mask, output F32 or half through strides).
template <int DP, int NWG, int BK, int STAGES, bool PIPE>
__device__ void wgmma_body(const __half* __restrict__ Q, int64_t qs1, int64_t qs2, int64_t qs3,
                           const __half* __restrict__ K, int64_t ks1, int64_t ks2, int64_t ks3,
                           const __half* __restrict__ V, int64_t vs1, int64_t vs2, int64_t vs3,
                           int Dq, int Dvv, float qscale, const char* __restrict__ mask, int mdt,
                           int64_t mnb0, int64_t mnb1, int64_t mnb2, int64_t mnb3, int Mq, int M2,
                           int M3, void* __restrict__ out, int64_t os1, int64_t os2, int64_t os3,
                           int out_half, int Dv, int Lq, int Lk, int H, int N, int rh, int rn) {
#ifdef SDRT_HAVE_WGMMA
    constexpr int NT = NWG * 128;
    constexpr int BQ = NWG * 64;        // query rows per block
    constexpr int CH = DP / 8;          // 16-byte chunks per row
    constexpr int KD = DP / 16;         // k-steps of Q K^T
    constexpr int NS = BK / 8;          // 8-key column blocks of S
    constexpr int KS = BK / 16;         // k-steps of P V
    constexpr int ND = DP / 8;          // 8-column blocks of O
    constexpr int TILE = BK * DP;       // halves of one K or V tile
    constexpr int LOADS = (BK * CH + NT - 1) / NT;  // 16-byte copies per thread per tile
    static_assert(DP % 64 == 0 && BK % 16 == 0 && STAGES >= (PIPE ? 3 : 2), "64-wide halves; pipelined: tiles t, t+1 resident while t+2 loads");

    extern __shared__ __align__(128) unsigned char dsmem[];
    if (dynamic_smem_bytes() < (unsigned)wg_smem_bytes(DP, NWG, BK, STAGES)) __trap();  // launch bug
    unsigned char* base = dsmem + ((1024 - (smem_addr(dsmem) & 1023)) & 1023);
    __half* tiles = reinterpret_cast<__half*>(base);
    __half* Qs = tiles + STAGES * 2 * TILE;
    const unsigned tiles_addr = smem_addr(tiles);

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, tq = lane & 3;
    const int qb = blockIdx.x * BQ;
    const int qw = qb + warp * 16;      // this warp's first query row
    const int nkt = (Lk + BK - 1) / BK;
    const int kstart = (int)(blockIdx.x % (unsigned)nkt);  // staggered first tile (attention.cu)
    auto tile_of = [&](int t) { const int u = t + kstart; return u >= nkt ? u - nkt : u; };

    for (int n = blockIdx.z; n < N; n += gridDim.z) {
        for (int h = blockIdx.y; h < H; h += gridDim.y) {
            __syncthreads();  // the previous (n, h) is done with shared memory
            const __half* Qg = Q + (int64_t)n * qs3 + (int64_t)h * qs2;
            const __half* Kg = K + (int64_t)(n / rn) * ks3 + (int64_t)(h / rh) * ks2;
            const __half* Vg = V + (int64_t)(n / rn) * vs3 + (int64_t)(h / rh) * vs2;

            // copy idx of a tile: row idx / CH, chunk c = idx % CH, to half c / 8 at row r,
            // chunk (c % 8) ^ (r % 8) (the swizzle layout, see the top)
            auto load_kv = [&](int t) {
                __half* Kb = tiles + (t % STAGES) * 2 * TILE;
                __half* Vb = Kb + TILE;
                const int k0 = tile_of(t) * BK;
#pragma unroll
                for (int i = 0; i < LOADS; ++i) {
                    const int idx = tid + i * NT;
                    if (BK * CH % NT != 0 && idx >= BK * CH) break;
                    const int r = idx / CH, c = idx % CH;
                    const int sw = (c >> 3) * BK * 64 + r * 64 + (((c & 7) ^ (r & 7)) << 3);  // halves
                    const bool in = k0 + r < Lk;
                    const int64_t row = in ? (int64_t)(k0 + r) : 0;
                    const bool kc = in && c * 8 < Dq, vc = in && c * 8 < Dvv;
                    cp_async16(Kb + sw, kc ? Kg + row * ks1 + c * 8 : Kg, kc);
                    cp_async16(Vb + sw, vc ? Vg + row * vs1 + c * 8 : Vg, vc);
                }
            };

#pragma unroll
            for (int idx = tid; idx < BQ * CH; idx += NT) {   // warpgroup r / 64's [64][DP] tile
                const int r = idx / CH, c = idx % CH, rr = r & 63;
                const bool in = qb + r < Lq && c * 8 < Dq;
                cp_async16(Qs + (r >> 6) * 64 * DP + (c >> 3) * 64 * 64 + rr * 64 + (((c & 7) ^ (rr & 7)) << 3),
                           in ? Qg + (int64_t)(qb + r) * qs1 + c * 8 : Q, in);
            }
            prime_tiles<STAGES>(load_kv, nkt);
            cp_async_wait<STAGES - 2>();  // Q and tile 0
            __syncthreads();

            const unsigned q_addr = smem_addr(Qs) + (warp >> 2) * 64 * DP * 2;   // this warpgroup's Q

            float o[ND * 4];
#pragma unroll
            for (int i = 0; i < ND * 4; ++i) o[i] = 0.0f;
            float m_run[2] = {NEG_INF, NEG_INF}, l_run[2] = {0.0f, 0.0f};
            float s[NS * 4];        // S of a tile: written by wgmma only (see softmax)
            unsigned pa[KS][4];     // P of the tile whose P V is issued (wgmma's A operand)

            // S = Q K^T of tile t into s (K-major B: k-step kk is 32 bytes into the rows of
            // head-dim half kk / 4), one wgmma group
            auto issue_s = [&](int t) {
                const unsigned Kb = tiles_addr + (t % STAGES) * 4 * TILE;
#pragma unroll
                for (int kk = 0; kk < KD; ++kk)
                    wgmma_ss<BK>(s, smem_desc(q_addr + (kk >> 2) * 64 * 128 + (kk & 3) * 32, 16),
                                 smem_desc(Kb + (kk >> 2) * BK * 128 + (kk & 3) * 32, 16), kk > 0);
                wgmma_commit();
            };
            // O += P V of tile t (N-major B: the 16 keys of step kb are rows 16 kb.., the two
            // head-dim halves BK * 128 bytes apart), one wgmma group
            auto issue_pv = [&](int t) {
                const unsigned Vb = tiles_addr + (t % STAGES) * 4 * TILE + 2 * TILE;
#pragma unroll
                for (int kb = 0; kb < KS; ++kb)
                    wgmma<DP, 1>(o, pa[kb], smem_desc(Vb + kb * 16 * 128, BK * 128), 1);
                wgmma_commit();
            };
            // The online softmax of tile t's scores in s into p (A-operand layout) and l: keys
            // beyond Lk and the mask, the running max (moved only when a row of the warp grew by
            // more than WG_LAZY). Returns whether the max moved; alpha: the factor O must then
            // be scaled by, which the caller applies once no P V in flight accumulates into O.
            // s is only read (a masked tile is copied first): an accumulator register written
            // by other instructions while a wgmma is in flight makes ptxas serialize every wgmma.
            float sm[NS * 4];
            auto softmax = [&](int t, float (&alpha)[2], unsigned (&p)[KS][4]) -> bool {
                auto run = [&](const float (&x)[NS * 4], float xs) -> bool {   // scores x * xs (xs > 0)
                    float mx[2];
#pragma unroll
                    for (int hr = 0; hr < 2; ++hr) {
                        float m = fmaxf(x[2 * hr], x[2 * hr + 1]);
#pragma unroll
                        for (int j = 1; j < NS; ++j) m = fmaxf(m, fmaxf(x[4 * j + 2 * hr], x[4 * j + 2 * hr + 1]));
                        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
                        mx[hr] = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2)) * xs;
                    }
                    const bool grow = __any_sync(0xffffffffu, mx[0] > m_run[0] + (float)WG_LAZY ||
                                                                  mx[1] > m_run[1] + (float)WG_LAZY);
#pragma unroll
                    for (int hr = 0; hr < 2; ++hr) {
                        alpha[hr] = 1.0f;
                        if (grow) {
                            const float m_new = fmaxf(m_run[hr], mx[hr]);
                            const float m_use = (m_new == NEG_INF) ? 0.0f : m_new;
                            alpha[hr] = fast_exp2(m_run[hr] - m_use);
                            m_run[hr] = m_new;
                        }
                        const float m_use = (m_run[hr] == NEG_INF) ? 0.0f : m_run[hr];
                        float sum = 0.0f;
#pragma unroll
                        for (int j = 0; j < NS; ++j) {
                            const float e0 = fast_exp2(fmaf(x[4 * j + 2 * hr], xs, -m_use));
                            const float e1 = fast_exp2(fmaf(x[4 * j + 2 * hr + 1], xs, -m_use));
                            sum += e0 + e1;
                            p[j >> 1][(j & 1) * 2 + hr] = pack_half2(e0, e1);
                        }
                        l_run[hr] = l_run[hr] * alpha[hr] + sum;
                    }
                    return grow;
                };
                const int k0 = tile_of(t) * BK;
                if (mask == nullptr && k0 + BK <= Lk) return run(s, qscale);
                // (written in one pass, not as a copy followed by attention.cuh's mask_scores: the
                // two passes cost registers, spilling at 3 warpgroups)
#pragma unroll
                for (int hr = 0; hr < 2; ++hr) {
                    const char* mrow = mask_row(mask, qw + g + hr * 8, Lq, mnb1, mnb2, mnb3, Mq, M2, M3, n, h);
#pragma unroll
                    for (int j = 0; j < NS; ++j)
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            const int key = k0 + j * 8 + 2 * tq + e;
                            const int idx = 4 * j + 2 * hr + e;
                            sm[idx] = key >= Lk ? NEG_INF
                                      : mrow ? s[idx] * qscale + load_mask(mrow, (int64_t)key * mnb0, mdt) * LOG2E
                                             : s[idx] * qscale;
                        }
                }
                return run(sm, 1.0f);
            };
            auto rescale_o = [&](const float (&alpha)[2]) {
#pragma unroll
                for (int d = 0; d < ND; ++d) {
                    o[4 * d] *= alpha[0];
                    o[4 * d + 1] *= alpha[0];
                    o[4 * d + 2] *= alpha[1];
                    o[4 * d + 3] *= alpha[1];
                }
            };

            float alpha[2];
            fence_async_smem();
            __syncthreads();
            if constexpr (PIPE) {
                // FlashAttention-3's in-warpgroup pipelining: S of tile t+1 is on the tensor
                // cores with the P V of tile t, and this warpgroup's softmax of tile t+1 runs
                // while that P V does. Tiles t and t+1 are resident during step t.
                unsigned pn[KS][4];
                wgmma_fence();
                issue_s(0);
                wgmma_wait<0>();
                softmax(0, alpha, pa);   // O is zero: nothing to rescale
                for (int t = 0; t < nkt; ++t) {
                    cp_async_wait<STAGES - 3>();  // tile t+1 has landed (this thread's part) ...
                    fence_async_smem();           // ... is visible to wgmma ...
                    __syncthreads();              // ... everyone's; stage (t-1) % STAGES is free
                    if (t + STAGES - 1 < nkt) load_kv(t + STAGES - 1);
                    cp_async_commit();
                    const bool next = t + 1 < nkt;
                    wgmma_fence();
                    if (next) issue_s(t + 1);
                    issue_pv(t);
                    if (next) {
                        wgmma_wait<1>();          // S of tile t+1 is done (P V of t may not be)
                        const bool grow = softmax(t + 1, alpha, pn);
                        wgmma_wait<0>();
                        if (grow) rescale_o(alpha);
#pragma unroll
                        for (int kb = 0; kb < KS; ++kb)
#pragma unroll
                            for (int e = 0; e < 4; ++e) pa[kb][e] = pn[kb][e];
                    } else {
                        wgmma_wait<0>();
                    }
                }
            } else {
                // one tile at a time: S, its softmax, P V
                for (int t = 0; t < nkt; ++t) {
                    cp_async_wait<STAGES - 2>();
                    fence_async_smem();
                    __syncthreads();
                    if (t + STAGES - 1 < nkt) load_kv(t + STAGES - 1);
                    cp_async_commit();
                    wgmma_fence();
                    issue_s(t);
                    wgmma_wait<0>();
                    if (softmax(t, alpha, pa)) rescale_o(alpha);
                    wgmma_fence();
                    issue_pv(t);
                    wgmma_wait<0>();
                }
            }
            cp_async_wait<0>();

            // out = O / l; a fully masked row (l = 0) gives zeros
            store_rows<ND>(reinterpret_cast<const float(&)[ND][4]>(o), l_run, qw + g, tq, Lq, Dv, out, os1, os2, os3,
                           n, h, out_half);
        }
    }
#else
    __trap();  // built without sm_90a: ops/attention.py only launches this on sm_90
#endif
}

#define WGMMA_KERNEL(DP, NWG, BK, STAGES, PIPE)                                                        \
    extern "C" __global__ void __launch_bounds__(NWG * 128)                                        \
    attn_wgmma_d##DP##_g##NWG##_k##BK##_p##PIPE(const __half* Q, int64_t qs1, int64_t qs2, int64_t qs3,     \
                                      const __half* K, int64_t ks1, int64_t ks2, int64_t ks3,     \
                                      const __half* V, int64_t vs1, int64_t vs2, int64_t vs3,     \
                                      int Dq, int Dvv, float qscale, const char* mask, int mdt,   \
                                      int64_t mnb0, int64_t mnb1, int64_t mnb2, int64_t mnb3,     \
                                      int Mq, int M2, int M3, void* out, int64_t os1, int64_t os2, \
                                      int64_t os3, int out_half, int Dv, int Lq, int Lk, int H,   \
                                      int N, int rh, int rn) {                                    \
        wgmma_body<DP, NWG, BK, STAGES, PIPE>(Q, qs1, qs2, qs3, K, ks1, ks2, ks3, V, vs1, vs2, vs3, Dq,  \
                                        Dvv, qscale, mask, mdt, mnb0, mnb1, mnb2, mnb3, Mq, M2,   \
                                        M3, out, os1, os2, os3, out_half, Dv, Lq, Lk, H, N, rh,   \
                                        rn);                                                      \
    }

// (DP, warpgroups, keys per tile, stages, pipelined): ops/attention.py WGMMA_KERNELS lists them; the
// bench times every one, WGMMA_VARIANT picks per head dim.
WGMMA_KERNEL(64, 2, 128, 3, 1)
WGMMA_KERNEL(64, 2, 64, 3, 0)
WGMMA_KERNEL(64, 3, 128, 2, 0)
WGMMA_KERNEL(128, 2, 64, 4, 1)
WGMMA_KERNEL(128, 3, 64, 3, 1)
WGMMA_KERNEL(128, 2, 64, 3, 0)
WGMMA_KERNEL(128, 3, 64, 2, 0)
WGMMA_KERNEL(128, 1, 64, 2, 0)
WGMMA_KERNEL(128, 2, 128, 2, 0)
