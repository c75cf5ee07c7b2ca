/* The tensor checksum of FORMAT §10, the loops only (included once, by _kernels.c).
 *
 * Words are bytes (1-byte elements) or little-endian u16 (wider elements); an element of
 * width w holds L = max(1, w/2) words and word h of every element feeds lane h:
 *     lane[h] = sum over elements i of (word(i, h) + C) * (2 * (start + i) + 1)  mod 2^64.
 * The C term is added once per piece (sum_constant); the loops add sum u * (2p + 1).
 *
 * Blocks of SUM_BLOCK bytes: SUM_ROWS rows of 32 bytes. Without a multiplication in the inner
 * loop: s sums each row's words and t sums the running s, so after the block
 * t = sum_r u(r) * (SUM_ROWS - r), hence sum_r u(r) * r = SUM_ROWS * s - t. Each block is
 * then folded into the 64-bit lanes with its first element's position. Measured on an AMD
 * EPYC (Zen 3) core, from L1/L2: ~42 GB/s for u16 words, ~45 for bytes (the vector-extension
 * loops they replace: 24 and 15), so the checksum runs at memory speed and is cheap to fuse
 * into a pass that already reads the bytes (the coding scan, the apply). On the 2-core
 * development VM (reported as family 23 model 1: 256-bit vector ops run as two 128-bit
 * halves, vpmovzxwd and vpmaddwd at two cycles each) the same loop runs at ~12 GB/s from
 * L1/L2 (thread CPU time), slower than memory: hence the pair sums for 2-byte elements
 * below (~16 GB/s), and fused passes that sum the bytes of one side only (the other
 * side's checksum is moved by the changes: Coder.fix, Changes.fix).
 */

#define SUM_ROWS 128
#define SUM_ROW 32 /* bytes per row: one AVX2 register */
#define SUM_BLOCK (SUM_ROWS * SUM_ROW)

#ifdef WS_X86
/* Software prefetch of the line a block ahead of p, in the loops that stream a tensor's bytes (the
 * checksum, the encode's scan): the hardware prefetchers alone left them well below memory speed on
 * an Intel Xeon VM (the checksum of a 45 MB tensor at 8.9 GB/s against numpy's sum at 22; with this,
 * 25 against 25; L2-resident bytes 19 -> 40 GB/s with the row loop unrolled). A prefetch never
 * faults, so reading past a buffer's end is harmless. */
#define PREFETCH_AHEAD(p) _mm_prefetch((const char *)(p) + SUM_BLOCK, _MM_HINT_T0)
#endif

/* Fold a block of u16 words into the lanes: s[j] and t[j] are the block's sums for word
 * slot j of a row (word j of a row is element j/L of it, lane j%L). */
static inline ALWAYS_INLINE void sum_fold_u16(const u32 *s, const u32 *t, u64 elem, int L, u64 *lanes) {
    const int shift = L == 1 ? 0 : L == 2 ? 1 : 2;
    const u64 per_row = 16 >> shift; /* elements per row */
    for (int j = 0; j < 16; j++) {
        u64 by_row = (u64)SUM_ROWS * s[j] - t[j]; /* sum_r u(r, j) * r */
        lanes[j & (L - 1)] += (u64)s[j] * (2 * (elem + (u64)(j >> shift)) + 1) + 2 * per_row * by_row;
    }
}

/* The fold with L a constant, so it vectorises: with L a variable it costs as much as the
 * block's 128 rows. */
static inline ALWAYS_INLINE void sum_fold_u16_by(const u32 *s, const u32 *t, u64 elem, int L, u64 *lanes) {
    if (L == 1) sum_fold_u16(s, t, elem, 1, lanes);
    else if (L == 2) sum_fold_u16(s, t, elem, 2, lanes);
    else sum_fold_u16(s, t, elem, 4, lanes);
}

/* Portable blocks: 32-bit accumulators per word slot of a row, loops GCC vectorises with
 * SSE2. Bounds: s <= 128 * 65535 < 2^23 and t <= 128 * s < 2^30 for u16 words. */
static void sum_block_u16_portable(const u8 *p, u64 elem, int L, u64 *lanes) {
    u32 s[16] = {0}, t[16] = {0};
    for (int r = 0; r < SUM_ROWS; r++) {
        for (int j = 0; j < 16; j++) {
            u16 u;
            memcpy(&u, p + (size_t)r * SUM_ROW + 2 * j, 2);
            s[j] += u;
            t[j] += s[j];
        }
    }
    sum_fold_u16_by(s, t, elem, L, lanes);
}

static void sum_block_u8_portable(const u8 *p, u64 elem, u64 *lanes) {
    u32 s[32] = {0}, t[32] = {0};
    for (int r = 0; r < SUM_ROWS; r++) {
        for (int j = 0; j < 32; j++) {
            s[j] += p[(size_t)r * SUM_ROW + j];
            t[j] += s[j];
        }
    }
    for (int j = 0; j < 32; j++)
        lanes[0] += (u64)s[j] * (2 * (elem + (u64)j) + 1) + 2 * 32 * ((u64)SUM_ROWS * s[j] - t[j]);
}

#ifdef WS_X86
/* u16 words: widen each half-row to eight u32 straight from memory (vpmovzxwd). */
__attribute__((target("avx2"))) static void sum_block_u16_avx2(const u8 *p, u64 elem, int L, u64 *lanes) {
    __m256i s0 = _mm256_setzero_si256(), s1 = s0, t0 = s0, t1 = s0;
    for (int r = 0; r < SUM_ROWS; r++) {
        const u8 *row = p + (size_t)r * SUM_ROW;
        if (r % 2 == 0) PREFETCH_AHEAD(row);
        s0 = _mm256_add_epi32(s0, _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)row)));
        s1 = _mm256_add_epi32(s1, _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(row + 16))));
        t0 = _mm256_add_epi32(t0, s0);
        t1 = _mm256_add_epi32(t1, s1);
    }
    u32 s[16], t[16];
    _mm256_storeu_si256((__m256i *)s, s0);
    _mm256_storeu_si256((__m256i *)(s + 8), s1);
    _mm256_storeu_si256((__m256i *)t, t0);
    _mm256_storeu_si256((__m256i *)(t + 8), t1);
    sum_fold_u16_by(s, t, elem, L, lanes);
}

/* 2-byte elements (L = 1) without widening each word: vpmovzxwd and vpmaddwd cost two cycles
 * each on a Zen 1 core, an add or a xor half a cycle. Rows of 64 bytes (32 words); per dword
 * slot d of the row's two 32-byte halves (d < 16), the words 2d and 2d+1:
 *   - p = vpmaddwd(y ^ 0x8000, 1): the pair's sum as signed words, u_e + u_o - 65536; s sums
 *     p over the rows and t the running s, so after R rows sum_r r * p(r) = R * s - t;
 *   - q sums the raw dwords mod 2^32: U_e + 65536 * U_o, where U_e + U_o = s + 65536 * R, so
 *     65535 * U_o = q - (s + 65536 * R) mod 2^32, and 65535 is odd: U_o is that times
 *     65535^-1 = 0xFFFEFFFF mod 2^32 (exact: U_o < 2^23 in a block).
 * A word's index in the block is 64 r / 2 + 2 d (+ 1 for the odd word), so
 *   sum u * index = 32 * sum_r r * P(r) + 2 d * S + U_o,  P = p + 65536, S = sum P.
 * Bounds per block (64 rows): |s| <= 2^22, |t| <= 2^28. Measured from L1/L2 on this box:
 * ~16 GB/s against ~12 for the widening loop below (which 4- and 8-byte elements keep:
 * their adjacent words feed different lanes). */
#define PAIR_ROWS (SUM_BLOCK / 64)

typedef struct {
    __m256i s0, s1, t0, t1, q0, q1;
} PairSums;

__attribute__((target("avx2"))) static inline ALWAYS_INLINE void pairs_start(PairSums *a) {
    a->s0 = a->s1 = a->t0 = a->t1 = a->q0 = a->q1 = _mm256_setzero_si256();
}

/* One row of 64 bytes (y0, y1: its halves). */
__attribute__((target("avx2"))) static inline ALWAYS_INLINE void pairs_row(PairSums *a, __m256i y0, __m256i y1) {
    const __m256i flip = _mm256_set1_epi16((short)0x8000), ones = _mm256_set1_epi16(1);
    a->s0 = _mm256_add_epi32(a->s0, _mm256_madd_epi16(_mm256_xor_si256(y0, flip), ones));
    a->s1 = _mm256_add_epi32(a->s1, _mm256_madd_epi16(_mm256_xor_si256(y1, flip), ones));
    a->t0 = _mm256_add_epi32(a->t0, a->s0);
    a->t1 = _mm256_add_epi32(a->t1, a->s1);
    a->q0 = _mm256_add_epi32(a->q0, y0);
    a->q1 = _mm256_add_epi32(a->q1, y1);
}

/* The lane of a block of PAIR_ROWS rows whose first element sits at position `elem`. */
__attribute__((target("avx2"))) static inline ALWAYS_INLINE u64 pairs_fold(const PairSums *a, u64 elem) {
    const u64 R = PAIR_ROWS;
    int32_t sv[16], tv[16];
    u32 qv[16];
    _mm256_storeu_si256((__m256i *)sv, a->s0);
    _mm256_storeu_si256((__m256i *)(sv + 8), a->s1);
    _mm256_storeu_si256((__m256i *)tv, a->t0);
    _mm256_storeu_si256((__m256i *)(tv + 8), a->t1);
    _mm256_storeu_si256((__m256i *)qv, a->q0);
    _mm256_storeu_si256((__m256i *)(qv + 8), a->q1);
    u64 acc = 0;
    for (int d = 0; d < 16; d++) {
        const u32 pairs = (u32)sv[d] + 65536u * (u32)R; /* U_e + U_o */
        const u64 odd = (u32)((qv[d] - pairs) * 0xFFFEFFFFu);
        const u64 by_row = R * (u64)(int64_t)sv[d] - (u64)(int64_t)tv[d] + 65536ull * (R * (R - 1) / 2);
        acc += (u64)pairs * (2 * (elem + 2 * (u64)d) + 1) + 2 * (32 * by_row + odd);
    }
    return acc;
}

__attribute__((target("avx2"))) static void sum_block_pairs_avx2(const u8 *p, u64 elem, u64 *lanes) {
    PairSums a;
    pairs_start(&a);
#pragma GCC unroll 4
    for (int r = 0; r < PAIR_ROWS; r++) {
        PREFETCH_AHEAD(p + 64 * r);
        pairs_row(&a, _mm256_loadu_si256((const __m256i *)(p + 64 * r)),
                  _mm256_loadu_si256((const __m256i *)(p + 64 * r + 32)));
    }
    lanes[0] += pairs_fold(&a, elem);
}

/* Bytes: only row totals need the row weight, so vpsadbw sums each row into four u64; the
 * weight of the slot j within the row comes from vpmaddubsw with weights 0..31 (pairs
 * <= 255 * 61, no saturation) and vpmaddwd into i32 (<= 4 * 255 * 31 per row). */
__attribute__((target("avx2"))) static void sum_block_u8_avx2(const u8 *p, u64 elem, u64 *lanes) {
    const __m256i zero = _mm256_setzero_si256(), ones = _mm256_set1_epi16(1);
    const __m256i slot = _mm256_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20,
                                          21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31);
    __m256i s = zero, t = zero, js = zero;
    for (int r = 0; r < SUM_ROWS; r++) {
        if (r % 2 == 0) PREFETCH_AHEAD(p + (size_t)r * SUM_ROW);
        __m256i x = _mm256_loadu_si256((const __m256i *)(p + (size_t)r * SUM_ROW));
        s = _mm256_add_epi64(s, _mm256_sad_epu8(x, zero));
        t = _mm256_add_epi64(t, s);
        js = _mm256_add_epi32(js, _mm256_madd_epi16(_mm256_maddubs_epi16(x, slot), ones));
    }
    u64 sv[4], tv[4];
    u32 jv[8];
    _mm256_storeu_si256((__m256i *)sv, s);
    _mm256_storeu_si256((__m256i *)tv, t);
    _mm256_storeu_si256((__m256i *)jv, js);
    u64 total = sv[0] + sv[1] + sv[2] + sv[3], running = tv[0] + tv[1] + tv[2] + tv[3], by_slot = 0;
    for (int i = 0; i < 8; i++) by_slot += jv[i];
    u64 by_index = 32 * ((u64)SUM_ROWS * total - running) + by_slot; /* sum over the block of u * index */
    lanes[0] += total * (2 * elem + 1) + 2 * by_index;
}
#endif

/* Adds the words of the n elements at p (width w), the first at position `elem`, to `lanes`
 * (without the C term). Any length: whole blocks, then word by word. */
static void sum_range(const u8 *p, u64 n, int w, u64 elem, u64 *lanes) {
    const int L = w == 1 ? 1 : w / 2;
    const u64 nbytes = n * w, per_block = SUM_BLOCK / w;
    u64 off = 0;
    for (; off + SUM_BLOCK <= nbytes; off += SUM_BLOCK, elem += per_block) {
#ifdef WS_X86
        if (has_avx2) {
            if (w == 1) sum_block_u8_avx2(p + off, elem, lanes);
            else if (L == 1) sum_block_pairs_avx2(p + off, elem, lanes);
            else sum_block_u16_avx2(p + off, elem, L, lanes);
            continue;
        }
#endif
        if (w == 1) sum_block_u8_portable(p + off, elem, lanes);
        else sum_block_u16_portable(p + off, elem, L, lanes);
    }
    if (w == 1) {
        for (u64 m = 0; off + m < nbytes; m++) lanes[0] += (u64)p[off + m] * (2 * (elem + m) + 1);
        return;
    }
    for (u64 m = 0; off + 2 * m < nbytes; m++) {
        u16 u;
        memcpy(&u, p + off + 2 * m, 2);
        lanes[m % L] += (u64)u * (2 * (elem + m / L) + 1);
    }
}

/* The C term of n elements from position `start`: C * sum (2i + 1) = C * ((start+n)^2 - start^2). */
static void sum_constant(u64 start, u64 n, u64 constant, int L, u64 *lanes) {
    u64 end = start + n, weights = end * end - start * start;
    for (int j = 0; j < L; j++) lanes[j] += constant * weights;
}
