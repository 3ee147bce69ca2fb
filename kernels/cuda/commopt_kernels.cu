// commopt.kernels CUDA sources: compiled at run time by CuPy's RawModule (NVRTC), once per device,
// and by `nvcc --ptx` in the test suite. Self-contained (no includes) so that NVRTC of CUDA 12 and
// 13 needs no header search path.
//
// Every kernel computes exactly what commopt/kernels/reference.py computes. Rounding-sensitive
// arithmetic uses the explicit round-to-nearest intrinsics (__fdiv_rn, __fadd_rn, __fmul_rn), and
// the module is built with --fmad=false, so that no multiply-add is contracted into an FMA: the
// reference rounds each operation separately.
//
// Element formats: fp32 as uint32 bits, fp16 and bf16 as uint16 bits, converted here with
// round-to-nearest-even (the same integer algorithm as kernels/cpu.py).

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;
typedef unsigned long long u64;

// ------------------------------------------------------------------------------------------------
// formats

__device__ __forceinline__ float f16_to_f32(u32 b) {
    u32 sign = (b & 0x8000u) << 16;
    u32 e = (b >> 10) & 0x1Fu;
    u32 m = b & 0x3FFu;
    u32 r;
    if (e == 31u) {
        r = 0x7F800000u | (m << 13);
    } else if (e == 0u) {
        r = __float_as_uint(__fmul_rn((float)m, 5.9604644775390625e-08f));  // m * 2**-24, exact
    } else {
        r = ((e + 112u) << 23) | (m << 13);
    }
    return __uint_as_float(r | sign);
}

__device__ __forceinline__ u32 f32_to_f16(float v) {
    u32 u = __float_as_uint(v);
    u32 a = u & 0x7FFFFFFFu;
    u32 sign = (u >> 16) & 0x8000u;
    u32 r;
    if (a > 0x7F800000u) {
        r = 0x7E00u;  // NaN
    } else if (a >= 0x477FF000u) {
        r = 0x7C00u;  // >= 65520 rounds to inf
    } else if (a >= 0x38800000u) {
        u32 t = a - 0x38000000u;  // rebias the exponent from 127 to 15
        r = (t + 0xFFFu + ((t >> 13) & 1u)) >> 13;
    } else {
        // subnormal half: |x| * 2**24 (exact), rounded to nearest even
        r = (u32)rintf(__fmul_rn(fabsf(v), 16777216.0f));
    }
    return r | sign;
}

__device__ __forceinline__ u32 f32_to_bf16(float v) {
    u32 u = __float_as_uint(v);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0u;  // torch's canonical bf16 NaN
    return (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
}

struct F32 {
    typedef u32 T;
    static const u32 absmask = 0x7FFFFFFFu;
    static const u32 shift = 31u;
    __device__ static __forceinline__ float widen(u32 b) { return __uint_as_float(b); }
    __device__ static __forceinline__ u32 narrow(float v) { return __float_as_uint(v); }
};

struct F16 {
    typedef u16 T;
    static const u32 absmask = 0x7FFFu;
    static const u32 shift = 15u;
    __device__ static __forceinline__ float widen(u32 b) { return f16_to_f32(b); }
    __device__ static __forceinline__ u32 narrow(float v) { return f32_to_f16(v); }
};

struct BF16 {
    typedef u16 T;
    static const u32 absmask = 0x7FFFu;
    static const u32 shift = 15u;
    __device__ static __forceinline__ float widen(u32 b) { return __uint_as_float(b << 16); }
    __device__ static __forceinline__ u32 narrow(float v) { return f32_to_bf16(v); }
};

// ------------------------------------------------------------------------------------------------
// the counter-based hash of stochastic rounding (reference.hash_key)

__device__ __forceinline__ u32 fmix32(u32 h) {
    h ^= h >> 16;
    h *= 0x85EBCA6Bu;
    h ^= h >> 13;
    h *= 0xC2B2AE35u;
    h ^= h >> 16;
    return h;
}

__device__ __forceinline__ float uniform(i64 i, u32 key) {
    u32 hi = (u32)((u64)i >> 32);
    u32 k = hi == 0u ? key : fmix32(key ^ hi);
    u32 h = fmix32((u32)((u64)i & 0xFFFFFFFFull) ^ k);
    return __fmul_rn((float)(h >> 8), 5.9604644775390625e-08f);  // exact: < 2**24 times 2**-24
}

__device__ __forceinline__ int round_code(float v, float u, float q, int stochastic) {
    float f = stochastic ? floorf(__fadd_rn(v, u)) : rintf(v);
    f = f > q ? q : f;
    f = f < -q ? -q : f;
    return v != v ? 0 : (int)f;
}

// ------------------------------------------------------------------------------------------------
// copies: one launch for any number of (src, dst, bytes, zero padding) segments

// table: nseg rows of (src address, dst address, bytes, padding bytes, first task); one block per
// task of `chunk` bytes, so that a large segment is spread over many blocks
extern "C" __global__ void commopt_copy_segments(const i64* __restrict__ table, int nseg, i64 chunk) {
    const i64 t = blockIdx.x;
    int lo = 0, hi = nseg - 1;
    while (lo < hi) {  // the last segment whose first task is <= t
        int mid = (lo + hi + 1) >> 1;
        if (table[5 * mid + 4] <= t) lo = mid; else hi = mid - 1;
    }
    const i64* row = table + 5 * lo;
    const u8* src = (const u8*)row[0];
    u8* dst = (u8*)row[1];
    const i64 n = row[2];
    const i64 a = (t - row[4]) * chunk;
    const i64 b = min(a + chunk, n + row[3]);
    const i64 ce = min(b, n);
    if (a < ce) {
        i64 body = 0;
        if (((((u64)(src + a)) | ((u64)(dst + a))) & 15ull) == 0ull) {
            const i64 nv = (ce - a) >> 4;
            const uint4* s4 = (const uint4*)(src + a);
            uint4* d4 = (uint4*)(dst + a);
            for (i64 i = threadIdx.x; i < nv; i += blockDim.x) d4[i] = s4[i];
            body = nv << 4;
        }
        for (i64 i = a + body + threadIdx.x; i < ce; i += blockDim.x) dst[i] = src[i];
    }
    for (i64 i = max(a, n) + threadIdx.x; i < b; i += blockDim.x) dst[i] = 0;
}

// ------------------------------------------------------------------------------------------------
// signs

template <typename F>
__device__ void pack_signs(const typename F::T* __restrict__ x, u32* __restrict__ bits, i64 n) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    const u32 bit = i < n ? ((((u32)x[i]) >> F::shift) & 1u) ^ 1u : 0u;
    const u32 word = __ballot_sync(0xFFFFFFFFu, bit);  // lane j holds element 32w + j: LSB first
    if ((threadIdx.x & 31u) == 0u && i < n) bits[i >> 5] = word;
}

extern "C" __global__ void commopt_pack_signs_b32(const u32* x, u32* bits, i64 n) { pack_signs<F32>(x, bits, n); }
extern "C" __global__ void commopt_pack_signs_b16(const u16* x, u32* bits, i64 n) { pack_signs<F16>(x, bits, n); }

// one block per scale block; fp64 accumulation like the reference
template <typename F>
__device__ void abs_mean(const typename F::T* __restrict__ x, float* __restrict__ out, i64 n, i64 block) {
    __shared__ double partial[32];
    const i64 lo = (i64)blockIdx.x * block;
    const i64 hi = min(lo + block, n);
    double s = 0.0;
    for (i64 i = lo + threadIdx.x; i < hi; i += blockDim.x) s += (double)fabsf(F::widen(x[i]));
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xFFFFFFFFu, s, o);
    if ((threadIdx.x & 31u) == 0u) partial[threadIdx.x >> 5] = s;
    __syncthreads();
    if (threadIdx.x == 0) {
        double t = 0.0;
        for (unsigned w = 0; w < (blockDim.x + 31u) >> 5; ++w) t += partial[w];
        out[blockIdx.x] = (float)(t / (double)(hi - lo));
    }
}

extern "C" __global__ void commopt_abs_mean_f32(const u32* x, float* out, i64 n, i64 block) { abs_mean<F32>(x, out, n, block); }
extern "C" __global__ void commopt_abs_mean_f16(const u16* x, float* out, i64 n, i64 block) { abs_mean<F16>(x, out, n, block); }
extern "C" __global__ void commopt_abs_mean_bf16(const u16* x, float* out, i64 n, i64 block) { abs_mean<BF16>(x, out, n, block); }

template <typename F>
__device__ void unpack_signs(const u32* __restrict__ bits, const float* __restrict__ scales, i64 block,
                             int has_scales, typename F::T* __restrict__ out, i64 n) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        const float s = has_scales ? scales[i / block] : 1.0f;
        const u32 bit = (bits[i >> 5] >> (i & 31)) & 1u;
        out[i] = (typename F::T)F::narrow(bit ? s : -s);
    }
}

extern "C" __global__ void commopt_unpack_signs_f32(const u32* bits, const float* scales, i64 block, int has_scales, u32* out, i64 n) { unpack_signs<F32>(bits, scales, block, has_scales, out, n); }
extern "C" __global__ void commopt_unpack_signs_f16(const u32* bits, const float* scales, i64 block, int has_scales, u16* out, i64 n) { unpack_signs<F16>(bits, scales, block, has_scales, out, n); }
extern "C" __global__ void commopt_unpack_signs_bf16(const u32* bits, const float* scales, i64 block, int has_scales, u16* out, i64 n) { unpack_signs<BF16>(bits, scales, block, has_scales, out, n); }

// ------------------------------------------------------------------------------------------------
// quantisation: one CUDA block per quantisation block, so x is read from DRAM once (the second
// pass hits L1/L2)

template <typename F>
__device__ void quantize(const typename F::T* __restrict__ x, u8* __restrict__ codes, float* __restrict__ scales,
                         i64 n, i64 block, int qmax, int stochastic, u32 key, int int4) {
    __shared__ u32 partial[32];
    const i64 lo = (i64)blockIdx.x * block;
    const i64 hi = min(lo + block, n);
    // magnitudes compare like their bit patterns; NaN patterns sort above inf, so NaN wins
    u32 m = 0u;
    for (i64 i = lo + threadIdx.x; i < hi; i += blockDim.x) m = max(m, ((u32)x[i]) & F::absmask);
    for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
    if ((threadIdx.x & 31u) == 0u) partial[threadIdx.x >> 5] = m;
    __syncthreads();
    if (threadIdx.x < 32u) {
        m = threadIdx.x < ((blockDim.x + 31u) >> 5) ? partial[threadIdx.x] : 0u;
        for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
        if (threadIdx.x == 0u) partial[0] = m;
    }
    __syncthreads();
    const float q = (float)qmax;
    const float scale = __fdiv_rn(F::widen(partial[0]), q);
    if (threadIdx.x == 0u) scales[blockIdx.x] = scale;
    if (int4) {
        // block is even, so a byte never spans two blocks
        for (i64 i = lo + 2 * (i64)threadIdx.x; i < hi; i += 2 * (i64)blockDim.x) {
            const int c0 = round_code(__fdiv_rn(F::widen(x[i]), scale), stochastic ? uniform(i, key) : 0.0f, q, stochastic);
            int c1 = 0;
            if (i + 1 < hi) c1 = round_code(__fdiv_rn(F::widen(x[i + 1]), scale), stochastic ? uniform(i + 1, key) : 0.0f, q, stochastic);
            codes[i >> 1] = (u8)((c0 & 15) | ((c1 & 15) << 4));
        }
    } else {
        for (i64 i = lo + threadIdx.x; i < hi; i += blockDim.x) {
            codes[i] = (u8)round_code(__fdiv_rn(F::widen(x[i]), scale), stochastic ? uniform(i, key) : 0.0f, q, stochastic);
        }
    }
}

extern "C" __global__ void commopt_quantize_f32(const u32* x, u8* codes, float* scales, i64 n, i64 block, int qmax, int stochastic, u32 key, int int4) { quantize<F32>(x, codes, scales, n, block, qmax, stochastic, key, int4); }
extern "C" __global__ void commopt_quantize_f16(const u16* x, u8* codes, float* scales, i64 n, i64 block, int qmax, int stochastic, u32 key, int int4) { quantize<F16>(x, codes, scales, n, block, qmax, stochastic, key, int4); }
extern "C" __global__ void commopt_quantize_bf16(const u16* x, u8* codes, float* scales, i64 n, i64 block, int qmax, int stochastic, u32 key, int int4) { quantize<BF16>(x, codes, scales, n, block, qmax, stochastic, key, int4); }

template <typename F>
__device__ void dequantize(const u8* __restrict__ codes, const float* __restrict__ scales, i64 n, i64 block, int int4,
                           typename F::T* __restrict__ out) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        int c;
        if (int4) {
            c = (codes[i >> 1] >> ((i & 1) * 4)) & 15;
            c = c >= 8 ? c - 16 : c;
        } else {
            c = (int)(signed char)codes[i];
        }
        out[i] = (typename F::T)F::narrow(__fmul_rn((float)c, scales[i / block]));
    }
}

extern "C" __global__ void commopt_dequantize_f32(const u8* codes, const float* scales, i64 n, i64 block, int int4, u32* out) { dequantize<F32>(codes, scales, n, block, int4, out); }
extern "C" __global__ void commopt_dequantize_f16(const u8* codes, const float* scales, i64 n, i64 block, int int4, u16* out) { dequantize<F16>(codes, scales, n, block, int4, out); }
extern "C" __global__ void commopt_dequantize_bf16(const u8* codes, const float* scales, i64 n, i64 block, int int4, u16* out) { dequantize<BF16>(codes, scales, n, block, int4, out); }

// ------------------------------------------------------------------------------------------------
// sparse payloads (layout: reference.topk_layout)

// writes header, values, padding and indices of a payload from the sorted selected indices
template <typename T>
__device__ void topk_gather(const T* __restrict__ x, const i64* __restrict__ idx, i64 k, u32 code, u8* payload,
                            i64 values_at, i64 indices_at) {
    const i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (t == 0) {
        ((u32*)payload)[0] = (u32)k;
        ((u32*)payload)[1] = code;
        for (i64 p = values_at + k * (i64)sizeof(T); p < indices_at; ++p) payload[p] = 0;
    }
    for (i64 j = t; j < k; j += (i64)gridDim.x * blockDim.x) {
        const i64 i = idx[j];
        ((T*)(payload + values_at))[j] = x[i];
        ((int*)(payload + indices_at))[j] = (int)i;
    }
}

extern "C" __global__ void commopt_topk_gather_b32(const u32* x, const i64* idx, i64 k, u32 code, u8* payload, i64 values_at, i64 indices_at) { topk_gather<u32>(x, idx, k, code, payload, values_at, indices_at); }
extern "C" __global__ void commopt_topk_gather_b16(const u16* x, const i64* idx, i64 k, u32 code, u8* payload, i64 values_at, i64 indices_at) { topk_gather<u16>(x, idx, k, code, payload, values_at, indices_at); }

// out[idx] += value for one payload (indices within a payload are distinct, so no atomics; payloads
// are launched one after another on one stream, which fixes the summation order). The header is
// checked on the device: a payload that disagrees with (k, code) adds NaN, indices out of range are
// skipped (the host cannot check without a synchronisation).
template <typename F>
__device__ void scatter_add(const u8* __restrict__ payload, i64 k, u32 code, i64 values_at, i64 indices_at,
                            float* __restrict__ out, i64 n) {
    const bool ok = ((const u32*)payload)[0] == (u32)k && ((const u32*)payload)[1] == code;
    for (i64 j = (i64)blockIdx.x * blockDim.x + threadIdx.x; j < k; j += (i64)gridDim.x * blockDim.x) {
        const i64 i = ((const int*)(payload + indices_at))[j];
        if (i < 0 || i >= n) continue;
        const float v = ok ? F::widen(((const typename F::T*)(payload + values_at))[j]) : __uint_as_float(0x7FC00000u);
        out[i] = __fadd_rn(out[i], v);
    }
}

extern "C" __global__ void commopt_scatter_add_f32(const u8* p, i64 k, u32 code, i64 va, i64 ia, float* out, i64 n) { scatter_add<F32>(p, k, code, va, ia, out, n); }
extern "C" __global__ void commopt_scatter_add_f16(const u8* p, i64 k, u32 code, i64 va, i64 ia, float* out, i64 n) { scatter_add<F16>(p, k, code, va, ia, out, n); }
extern "C" __global__ void commopt_scatter_add_bf16(const u8* p, i64 k, u32 code, i64 va, i64 ia, float* out, i64 n) { scatter_add<BF16>(p, k, code, va, ia, out, n); }
