/* The codec's element loops (included once, by _kernels.c): find changes, code and join
 * byte planes, apply values. No Python here: _kernels.c checks every length before calling.
 * Elements are little-endian unsigned integers of 1, 2, 4 or 8 bytes (FORMAT §3); loads go
 * through memcpy, so any alignment works. */

/* ---- element access ------------------------------------------------------------------ */

static inline u64 load(const u8 *p, int w) {
    switch (w) {
    case 1: return p[0];
    case 2: { u16 v; memcpy(&v, p, 2); return v; }
    case 4: { u32 v; memcpy(&v, p, 4); return v; }
    default: { u64 v; memcpy(&v, p, 8); return v; }
    }
}

static inline void store(u8 *p, int w, u64 v) {
    switch (w) {
    case 1: p[0] = (u8)v; break;
    case 2: { u16 x = (u16)v; memcpy(p, &x, 2); break; }
    case 4: { u32 x = (u32)v; memcpy(p, &x, 4); break; }
    default: memcpy(p, &v, 8);
    }
}

static inline u64 mask_of(int w) { return w == 8 ? ~(u64)0 : (((u64)1 << (8 * w)) - 1); }

/* FORMAT §4.2: zigzag of the wrapping difference, so 0,-1,1,-2 -> 0,1,2,3 at width w. */
static inline u64 zigzag(u64 d, int w) {
    u64 m = mask_of(w);
    d &= m;
    u64 sign = (d >> (8 * w - 1)) & 1;
    return ((d << 1) ^ ((u64)0 - sign)) & m;
}

static inline u64 unzigzag(u64 z, int w) { return ((z >> 1) ^ ((u64)0 - (z & 1))) & mask_of(w); }

/* The delta value of one element (FORMAT §4.2): zigzag(new - old) for ADD, else old ^ new. */
static inline u64 delta_value(u64 old, u64 new_, int w, int add) {
    return add ? zigzag(new_ - old, w) : (old ^ new_);
}

static inline u64 gap_at(u8 *const *gaps, u64 k) {
    return (u64)gaps[0][k] | ((u64)gaps[1][k] << 8) | ((u64)gaps[2][k] << 16) | ((u64)gaps[3][k] << 24);
}

/* ---- count --------------------------------------------------------------------------- */

#define COUNT_LOOP(T)                                             \
    static u64 count_##T(const u8 *a, const u8 *b, u64 n) {       \
        u64 count = 0;                                            \
        for (u64 i = 0; i < n; i++) {                             \
            T x, y;                                               \
            memcpy(&x, a + i * sizeof(T), sizeof(T));             \
            memcpy(&y, b + i * sizeof(T), sizeof(T));             \
            count += x != y;                                      \
        }                                                         \
        return count;                                             \
    }
HOT COUNT_LOOP(u8)
HOT COUNT_LOOP(u16)
HOT COUNT_LOOP(u32)
HOT COUNT_LOOP(u64)

static u64 count_changed_loop(const u8 *a, const u8 *b, u64 nbytes, int w) {
    switch (w) {
    case 1: return count_u8(a, b, nbytes);
    case 2: return count_u16(a, b, nbytes / 2);
    case 4: return count_u32(a, b, nbytes / 4);
    default: return count_u64(a, b, nbytes / 8);
    }
}

/* ---- the sparse scan (FORMAT §4.2) ---------------------------------------------------- */

/* Where a sparse coder writes: byte j of the k-th change's gap (u32: the unchanged elements
 * since the previous change) goes to gaps[j][k] and byte j of its value to vals[j][k]. The
 * scan is resumable: positions are frame positions, so the pieces of a grouped frame and
 * the parts of a piece code as their concatenation. */
typedef struct {
    u8 *gaps[4];
    u8 *vals[8];
    u64 cap;  /* room for this many changes */
    u64 k;    /* changes written */
    u64 prev; /* frame position of the last change; (u64)-1 before the first */
    /* When set, every change also adds (base word - new word) * weight to fix[lane] (FORMAT
     * §10.1, weight 2 * (frame position + woff) + 1): the base's checksum is then the new
     * bytes' checksum plus fix, with no pass over the base (the checksum is linear). */
    u64 *fix;
    u64 woff;
    /* When set, every change is also written into the base (its new value), while its line is
     * in cache: the base becomes the new bytes in the pass that codes them (a publisher keeping
     * its next base). Undone by `unkeep` when the scan runs out of room. */
    int keep;
} Coder;

/* The move of a checksum's lanes when an element of width w goes from y to x (one lane per
 * 16-bit word, or the byte for w == 1), at weight `weight`. */
static inline ALWAYS_INLINE void fix_change(u64 *fix, u64 x, u64 y, int w, u64 weight) {
    if (w == 1) {
        fix[0] += (x - y) * weight;
        return;
    }
    for (int h = 0; h < w / 2; h++) fix[h] += (((x >> (16 * h)) & 0xFFFF) - ((y >> (16 * h)) & 0xFFFF)) * weight;
}

#define EMIT(T, pos, x, y)                                                   \
    do {                                                                     \
        if (k == cap) goto full;                                             \
        u64 gap_ = (pos) - prev - 1, v_ = delta_value(x, y, sizeof(T), add); \
        prev = (pos);                                                        \
        g0[k] = (u8)gap_;                                                    \
        g1[k] = (u8)(gap_ >> 8);                                             \
        g2[k] = (u8)(gap_ >> 16);                                            \
        g3[k] = (u8)(gap_ >> 24);                                            \
        for (unsigned j_ = 0; j_ < sizeof(T); j_++) vals[j_][k] = (u8)(v_ >> (8 * j_)); \
        k++;                                                                 \
        if (fix) fix_change(fix, x, y, sizeof(T), 2 * ((pos) + woff) + 1);  \
        if (keep) memcpy((u8 *)a + ((pos) - e0) * sizeof(T), &(y), sizeof(T)); \
    } while (0)

/* Scan n elements at a (base) and b (new), the first at frame position e0, appending the
 * changes to c. Returns 0, or -1 as soon as there are more than c->cap (c is then spent).
 * 32-byte blocks without a change are skipped with one compare. */
#define SCAN_LOOP(T)                                                                         \
    static int scan_##T(const u8 *a, const u8 *b, u64 n, u64 e0, int add, Coder *c) {       \
        u64 k = c->k, prev = c->prev, cap = c->cap, *fix = c->fix, woff = c->woff;           \
        const int keep = c->keep;                                                            \
        u8 *g0 = c->gaps[0], *g1 = c->gaps[1], *g2 = c->gaps[2], *g3 = c->gaps[3];           \
        u8 **vals = c->vals;                                                                 \
        const u64 per = 32 / sizeof(T);                                                      \
        for (u64 i = 0; i < n;) {                                                            \
            if (i + per <= n) {                                                              \
                u64 x4[4], y4[4];                                                            \
                memcpy(x4, a + i * sizeof(T), 32);                                           \
                memcpy(y4, b + i * sizeof(T), 32);                                           \
                if (((x4[0] ^ y4[0]) | (x4[1] ^ y4[1]) | (x4[2] ^ y4[2]) | (x4[3] ^ y4[3])) == 0) { \
                    i += per;                                                                \
                    continue;                                                                \
                }                                                                            \
            }                                                                                \
            u64 end = i + per <= n ? i + per : n;                                            \
            for (; i < end; i++) {                                                           \
                T x, y;                                                                      \
                memcpy(&x, a + i * sizeof(T), sizeof(T));                                    \
                memcpy(&y, b + i * sizeof(T), sizeof(T));                                    \
                if (x != y) EMIT(T, e0 + i, x, y);                                           \
            }                                                                                \
        }                                                                                    \
        c->k = k;                                                                            \
        c->prev = prev;                                                                      \
        return 0;                                                                            \
    full:                                                                                    \
        c->k = k;                                                                            \
        return -1;                                                                           \
    }
HOT SCAN_LOOP(u8)
HOT SCAN_LOOP(u16)
HOT SCAN_LOOP(u32)
HOT SCAN_LOOP(u64)

#ifdef WS_X86
/* AVX2 for 1- and 2-byte elements (bf16, fp16, fp8: most of a model): compare 32 elements
 * at once into a bit mask of changed elements, then visit only the set bits. (Tried and
 * measured slower on Zen 3 from 0.05 % to 5 % density: coding the first two bits of every
 * group without a branch, with or without a (gap, value) scratch array split into planes
 * afterwards; the scratch wins ~15 % only above ~8 % density. The 2-byte scan with sums below,
 * the publisher's, lists the changes of a block after its vector pass instead: that visits only
 * the rows that hold a change, and was faster on an Intel Xeon from 0.1 % to 10 %.) */
#define SCAN_AVX2(T)                                                                                 \
    __attribute__((target("avx2"))) static int scan_avx2_##T(const u8 *a, const u8 *b, u64 n, u64 e0,  \
                                                              int add, Coder *c) {                   \
        u64 k = c->k, prev = c->prev, cap = c->cap, i = 0, *fix = c->fix, woff = c->woff;           \
        const int keep = c->keep;                                                                    \
        u8 *g0 = c->gaps[0], *g1 = c->gaps[1], *g2 = c->gaps[2], *g3 = c->gaps[3];                   \
        u8 **vals = c->vals;                                                                         \
        for (; i + 32 <= n; i += 32) {                                                               \
            u32 eq;                                                                                  \
            if (sizeof(T) == 1) {                                                                    \
                __m256i x = _mm256_loadu_si256((const __m256i *)(a + i));                            \
                __m256i y = _mm256_loadu_si256((const __m256i *)(b + i));                            \
                eq = (u32)_mm256_movemask_epi8(_mm256_cmpeq_epi8(x, y));                             \
            } else {                                                                                 \
                const u8 *pa = a + 2 * i, *pb = b + 2 * i;                                           \
                __m256i c0 = _mm256_cmpeq_epi16(_mm256_loadu_si256((const __m256i *)pa),             \
                                                _mm256_loadu_si256((const __m256i *)pb));            \
                __m256i c1 = _mm256_cmpeq_epi16(_mm256_loadu_si256((const __m256i *)(pa + 32)),      \
                                                _mm256_loadu_si256((const __m256i *)(pb + 32)));     \
                /* packs interleaves 128-bit lanes; the permute restores element order */            \
                __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi16(c0, c1), 0xD8);         \
                eq = (u32)_mm256_movemask_epi8(packed);                                              \
            }                                                                                        \
            u32 changed = ~eq;                                                                       \
            while (changed) {                                                                        \
                u64 e = i + (u64)__builtin_ctz(changed);                                             \
                changed &= changed - 1;                                                              \
                T x, y;                                                                              \
                memcpy(&x, a + e * sizeof(T), sizeof(T));                                            \
                memcpy(&y, b + e * sizeof(T), sizeof(T));                                            \
                EMIT(T, e0 + e, x, y);                                                               \
            }                                                                                        \
        }                                                                                            \
        for (; i < n; i++) {                                                                         \
            T x, y;                                                                                  \
            memcpy(&x, a + i * sizeof(T), sizeof(T));                                                \
            memcpy(&y, b + i * sizeof(T), sizeof(T));                                                \
            if (x != y) EMIT(T, e0 + i, x, y);                                                       \
        }                                                                                            \
        c->k = k;                                                                                    \
        c->prev = prev;                                                                              \
        return 0;                                                                                    \
    full:                                                                                            \
        c->k = k;                                                                                    \
        return -1;                                                                                   \
    }
SCAN_AVX2(u8)
SCAN_AVX2(u16)

#define DENSE_BLOCK_CHANGES 224 /* above ~11 % of a block's elements the row by row visit is faster */
#define ROW_BIT31 0x80000000u /* ctz(m | ROW_BIT31): m's first change, or 31 (a slot past the list) when none */
#define SCAN_ROWS (SUM_BLOCK / 64) /* rows of 32 2-byte elements in a block */

/* One block of scan_sum_avx2_u16 (elements i .. i + SCAN_ROWS * 32), each change coded as its row
 * is compared: the scan for blocks full of changes, where the branches of the visit are well
 * predicted and the coding overlaps the next loads. Returns the changes found, or -1 past c->cap.
 * Not inlined, like the one below: each keeps its loop's state in registers. */
__attribute__((target("avx2"), noinline)) static int64_t scan_block_rows(const u8 *a, const u8 *b, u64 i, u64 e0,
                                                                         int add, Coder *c, PairSums *out) {
    u64 k = c->k, prev = c->prev, cap = c->cap, *fix = c->fix, woff = c->woff, found = 0;
    const int keep = c->keep;
    u8 *g0 = c->gaps[0], *g1 = c->gaps[1], *g2 = c->gaps[2], *g3 = c->gaps[3];
    u8 **vals = c->vals;
    PairSums sums = *out;
    for (u64 j = i; j < i + 32 * SCAN_ROWS; j += 32) {
        const u8 *pa = a + 2 * j, *pb = b + 2 * j;
        PREFETCH_AHEAD(pa);
        PREFETCH_AHEAD(pb);
        __m256i x0 = _mm256_loadu_si256((const __m256i *)pa), x1 = _mm256_loadu_si256((const __m256i *)(pa + 32));
        __m256i y0 = _mm256_loadu_si256((const __m256i *)pb), y1 = _mm256_loadu_si256((const __m256i *)(pb + 32));
        pairs_row(&sums, y0, y1);
        /* two mask bits per element, in element order (no pack and lane permute) */
        u64 eq = (u64)(u32)_mm256_movemask_epi8(_mm256_cmpeq_epi16(x0, y0)) |
                 ((u64)(u32)_mm256_movemask_epi8(_mm256_cmpeq_epi16(x1, y1)) << 32);
        u64 changed = ~eq & 0x5555555555555555ull;
        while (changed) {
            u64 e = j + (u64)(__builtin_ctzll(changed) >> 1);
            changed &= changed - 1;
            found++;
            u16 x, y;
            memcpy(&x, a + 2 * e, 2);
            memcpy(&y, b + 2 * e, 2);
            EMIT(u16, e0 + e, x, y);
        }
    }
    *out = sums;
    c->k = k;
    c->prev = prev;
    return (int64_t)found;
full:
    c->k = k;
    return -1;
}

/* The rows of a block with a change (bit r of `rows`: masks[r] is not 0), their changes' element
 * indices within the block listed in order into `list` (room for SCAN_ROWS * 32 + 4): each row's
 * first four with no branch (a slot past the list takes 31 when a row has fewer), a fifth and more
 * in a loop. Returns how many. */
static inline ALWAYS_INLINE u64 list_rows(const u32 *masks, u64 rows, u16 *list) {
    u64 listed = 0;
    while (rows) {
        const u32 r = (u32)__builtin_ctzll(rows);
        rows &= rows - 1;
        u32 m = masks[r];
        const u16 at = (u16)(32 * r);
        for (int j = 0; j < 4; j++) {
            list[listed] = (u16)(at + __builtin_ctz(m | ROW_BIT31));
            listed += m != 0;
            m &= m - 1;
        }
        for (; m; m &= m - 1) list[listed++] = (u16)(at + __builtin_ctz(m));
    }
    return listed;
}

/* Code the `listed` changes of the block at element i (their indices in `list`), as EMIT would one by
 * one: where they would pass c->cap, one by one with its check, so what is written up to the cap,
 * and c->k, are the same; else in a loop whose only branch is its end. Returns `listed`, or -1 past
 * c->cap. */
static inline ALWAYS_INLINE int64_t emit_list_u16(const u8 *a, const u8 *b, u64 i, u64 e0, int add, Coder *c,
                                                  const u16 *list, u64 listed) {
    u64 k = c->k, prev = c->prev, cap = c->cap, *fix = c->fix, woff = c->woff;
    const int keep = c->keep;
    u8 *g0 = c->gaps[0], *g1 = c->gaps[1], *g2 = c->gaps[2], *g3 = c->gaps[3];
    u8 **vals = c->vals;
    u8 *v0 = vals[0], *v1 = vals[1];
    if (k + listed > cap) {
        for (u64 t = 0; t < listed; t++) {
            const u64 e = i + list[t];
            u16 x, y;
            memcpy(&x, a + 2 * e, 2);
            memcpy(&y, b + 2 * e, 2);
            EMIT(u16, e0 + e, x, y);
        }
    } else {
        for (u64 t = 0; t < listed; t++) {
            const u64 e = i + list[t], pos = e0 + e, gap = pos - prev - 1;
            u16 x, y;
            memcpy(&x, a + 2 * e, 2);
            memcpy(&y, b + 2 * e, 2);
            const u64 v = delta_value(x, y, 2, add);
            prev = pos;
            g0[k] = (u8)gap;
            g1[k] = (u8)(gap >> 8);
            g2[k] = (u8)(gap >> 16);
            g3[k] = (u8)(gap >> 24);
            v0[k] = (u8)v;
            v1[k] = (u8)(v >> 8);
            k++;
            if (fix) fix_change(fix, x, y, 2, 2 * (pos + woff) + 1);
            if (keep) memcpy((u8 *)a + 2 * e, &y, 2);
        }
    }
    c->k = k;
    c->prev = prev;
    return (int64_t)listed;
full:
    c->k = k;
    return -1;
}

/* One block of scan_sum_avx2_u16 in three steps, so that no branch depends on where the changes
 * are but once per row that holds one: (1) the vector pass compares and sums the block's rows and
 * keeps each row's mask of changed elements, and a bit per row that has any; (2) list_rows; (3)
 * emit_list. Returns the changes found, or -1 past c->cap. */
__attribute__((target("avx2"), noinline)) static int64_t scan_block_listed(const u8 *a, const u8 *b, u64 i, u64 e0,
                                                                           int add, Coder *c, PairSums *out) {
    u32 masks[SCAN_ROWS];
    u16 list[32 * SCAN_ROWS + 4];
    u64 rows = 0;
    PairSums sums = *out;
    for (u64 r = 0; r < SCAN_ROWS; r++) {
        const u8 *pa = a + 2 * (i + 32 * r), *pb = b + 2 * (i + 32 * r);
        PREFETCH_AHEAD(pa);
        PREFETCH_AHEAD(pb);
        __m256i x0 = _mm256_loadu_si256((const __m256i *)pa), x1 = _mm256_loadu_si256((const __m256i *)(pa + 32));
        __m256i y0 = _mm256_loadu_si256((const __m256i *)pb), y1 = _mm256_loadu_si256((const __m256i *)(pb + 32));
        pairs_row(&sums, y0, y1);
        /* packs interleaves 128-bit lanes; the permute restores element order */
        __m256i eq = _mm256_permute4x64_epi64(
            _mm256_packs_epi16(_mm256_cmpeq_epi16(x0, y0), _mm256_cmpeq_epi16(x1, y1)), 0xD8);
        const u32 m = ~(u32)_mm256_movemask_epi8(eq);
        masks[r] = m;
        rows |= (u64)(m != 0) << r;
    }
    *out = sums;
    return emit_list_u16(a, b, i, e0, add, c, list, list_rows(masks, rows, list));
}

/* The encode's one pass for 2-byte elements (bf16, fp16: most of a model): the change scan
 * of scan_avx2_u16 and the checksum of the new words (FORMAT §10, one lane: the pair sums of
 * _kernels_sum.h), from the same loads, so the new bytes are read once and the base's
 * checksum comes from c->fix. Adds the n elements' lanes (without the C term) to after[0];
 * element i sits at checksum position start + i and frame position e0 + i. Returns 0, or
 * -1 past c->cap changes. Blocks go to scan_block_listed, or, after a block of more than
 * DENSE_BLOCK_CHANGES changes (changes come in runs: a trained expert, a layer), to
 * scan_block_rows: at 1.5 % of elements the listing codes a 45 MB model ~1.5x faster (it
 * drops the mispredicted branches of visiting each row's set bits), above ~11 % the row by
 * row visit is faster (its coding overlaps the loads of the rows after). */
__attribute__((target("avx2"))) static int scan_sum_avx2_u16(const u8 *a, const u8 *b, u64 n, u64 e0, int add,
                                                              Coder *c, u64 start, u64 *after) {
    const u64 per = SUM_BLOCK / 2; /* 2048 elements: SCAN_ROWS rows of 32 */
    u64 i = 0;
    int64_t found = 0;
    for (; i + per <= n; i += per) {
        PairSums sums;
        pairs_start(&sums);
        found = (found > DENSE_BLOCK_CHANGES ? scan_block_rows : scan_block_listed)(a, b, i, e0, add, c, &sums);
        if (found < 0) return -1;
        after[0] += pairs_fold(&sums, start + i);
    }
    u64 k = c->k, prev = c->prev, cap = c->cap, *fix = c->fix, woff = c->woff;
    const int keep = c->keep;
    u8 *g0 = c->gaps[0], *g1 = c->gaps[1], *g2 = c->gaps[2], *g3 = c->gaps[3];
    u8 **vals = c->vals;
    sum_range(b + 2 * i, n - i, 2, start + i, after);
    for (; i < n; i++) {
        u16 x, y;
        memcpy(&x, a + 2 * i, 2);
        memcpy(&y, b + 2 * i, 2);
        if (x != y) EMIT(u16, e0 + i, x, y);
    }
    c->k = k;
    c->prev = prev;
    return 0;
full:
    c->k = k;
    return -1;
}
#endif

static int scan(const u8 *a, const u8 *b, u64 n, int w, u64 e0, int add, Coder *c) {
#ifdef WS_X86
    if (has_avx2 && w == 1) return scan_avx2_u8(a, b, n, e0, add, c);
    if (has_avx2 && w == 2) return scan_avx2_u16(a, b, n, e0, add, c);
#endif
    switch (w) {
    case 1: return scan_u8(a, b, n, e0, add, c);
    case 2: return scan_u16(a, b, n, e0, add, c);
    case 4: return scan_u32(a, b, n, e0, add, c);
    default: return scan_u64(a, b, n, e0, add, c);
    }
}

/* ---- dense coding and byte planes ----------------------------------------------------- */

/* Dense values (FORMAT §4.2 PLANES/STORED): byte j of element i's delta value -> planes[j][i]. */
HOT static void dense_loop(const u8 *a, const u8 *b, u64 n, int w, int add, u8 **planes) {
    switch (w) {
    case 1:
        if (add) for (u64 i = 0; i < n; i++) planes[0][i] = (u8)zigzag((u64)b[i] - a[i], 1);
        else for (u64 i = 0; i < n; i++) planes[0][i] = a[i] ^ b[i];
        break;
    case 2: {
        u8 *p0 = planes[0], *p1 = planes[1];
        for (u64 i = 0; i < n; i++) {
            u16 x, y;
            memcpy(&x, a + 2 * i, 2);
            memcpy(&y, b + 2 * i, 2);
            u16 v;
            if (add) {
                u16 d = (u16)(y - x);
                v = (u16)((u16)(d << 1) ^ (u16)(0 - (d >> 15)));
            } else {
                v = x ^ y;
            }
            p0[i] = (u8)v;
            p1[i] = (u8)(v >> 8);
        }
        break;
    }
    default:
        for (u64 i = 0; i < n; i++) {
            u64 v = delta_value(load(a + i * w, w), load(b + i * w, w), w, add);
            for (int j = 0; j < w; j++) planes[j][i] = (u8)(v >> (8 * j));
        }
    }
}

/* Byte planes of raw elements (keyframes, FORMAT §4.4): planes[j][i] = byte j of element i. */
HOT static void split_loop(const u8 *src, u64 n, int w, u8 **planes) {
    if (w == 2) {
        u8 *p0 = planes[0], *p1 = planes[1];
        for (u64 i = 0; i < n; i++) {
            p0[i] = src[2 * i];
            p1[i] = src[2 * i + 1];
        }
        return;
    }
    for (u64 i = 0; i < n; i++)
        for (int j = 0; j < w; j++) planes[j][i] = src[i * w + j];
}

/* out[i] = the wrapping difference that zigzag value src[i] codes (w-byte elements). */
HOT static void unzigzag_loop(const u8 *src, u64 n, int w, u8 *out) {
    if (w == 2) {
        const uint16_t *z = (const uint16_t *)src;
        uint16_t *o = (uint16_t *)out;
        for (u64 i = 0; i < n; i++) o[i] = (uint16_t)((z[i] >> 1) ^ (uint16_t)(0u - (z[i] & 1u)));
        return;
    }
    for (u64 i = 0; i < n; i++) {
        u64 z = 0;
        memcpy(&z, src + i * w, (size_t)w);
        u64 v = unzigzag(z, w);
        memcpy(out + i * w, &v, (size_t)w);
    }
}

/* Join byte planes into elements (values of a decoded frame). */
HOT static void join_loop(u8 *const *planes, u64 n, int w, u8 *out) {
    if (w == 2) {
        const u8 *p0 = planes[0], *p1 = planes[1];
        for (u64 i = 0; i < n; i++) {
            out[2 * i] = p0[i];
            out[2 * i + 1] = p1[i];
        }
        return;
    }
    for (u64 i = 0; i < n; i++)
        for (int j = 0; j < w; j++) out[i * w + j] = planes[j][i];
}

/* ---- apply ---------------------------------------------------------------------------- */

enum { OP_SET = 0, OP_XOR = 1, OP_ADD = 2, OP_SUB = 3 };

static inline u64 joined(u8 *const *planes, int w, u64 i) {
    u64 v = 0;
    for (int j = 0; j < w; j++) v |= (u64)planes[j][i] << (8 * j);
    return v;
}

/* A delta frame's changes split into the pieces of the tensors it holds, in one pass: for
 * change k at frame position p in piece i (bounds[i] <= p < bounds[i + 1]), positions[k] =
 * p - bounds[i] + offsets[i] (its element within piece i's tensor) and operands[k] its value,
 * un-zigzagged when `add` (the wrapping difference to add), else the XOR mask as it is;
 * cuts[i] = the index of piece i's first change. bounds ascend from 0. Returns the last
 * position + 1 (0 when count is 0), for the caller's check against the frame's length. */
HOT static u64 pieces_loop(u8 *const *gaps, u8 *const *planes, u64 count, int w, int add, const int64_t *bounds,
                           const int64_t *offsets, u64 nb, int64_t *positions, u8 *operands, int64_t *cuts) {
    u64 pos = (u64)-1, bi = 0, next = nb > 1 ? (u64)bounds[1] : UINT64_MAX;
    int64_t shift = nb ? offsets[0] - bounds[0] : 0;
    if (nb) cuts[0] = 0;
    for (u64 k = 0; k < count; k++) {
        pos += 1 + gap_at(gaps, k);
        while (pos >= next) { /* the change lies in a later piece: every piece passed starts here */
            bi++;
            cuts[bi] = (int64_t)k;
            shift = offsets[bi] - bounds[bi];
            next = bi + 1 < nb ? (u64)bounds[bi + 1] : UINT64_MAX;
        }
        positions[k] = (int64_t)pos + shift;
    }
    for (bi++; bi < nb; bi++) cuts[bi] = (int64_t)count;
    if (w == 2) {
        const u8 *p0 = planes[0], *p1 = planes[1];
        uint16_t *o = (uint16_t *)operands;
        if (add) {
            for (u64 k = 0; k < count; k++) {
                uint16_t z = (uint16_t)(p0[k] | (p1[k] << 8));
                o[k] = (uint16_t)((z >> 1) ^ (uint16_t)(0u - (z & 1u)));
            }
        } else {
            for (u64 k = 0; k < count; k++) o[k] = (uint16_t)(p0[k] | (p1[k] << 8));
        }
    } else {
        for (u64 k = 0; k < count; k++) {
            u64 v = joined(planes, w, k);
            if (add) v = unzigzag(v, w);
            memcpy(operands + k * w, &v, (size_t)w);
        }
    }
    return count ? pos + 1 : 0;
}

/* ---- a device's staging, straight from a frame ------------------------------------------ */

enum { STAGE_SKIP = 0, STAGE_BLOCKS32 = 1, STAGE_BLOCKS64 = 2, STAGE_POS32 = 3, STAGE_POS64 = 4 };
#define STAGE_BITS 16 /* client/tensors.py BLOCK_BITS: block-coded positions keep their low 16 bits */

/* ---- runs of gap-coded changes, eight at a time ------------------------------------------ */

#ifdef WS_X86
/* Steps 1 + gap of changes k .. k + 7, as u32 lanes; the caller checked that their gaps are below
 * 2^24 (their fourth byte planes zero), so eight of them add up to less than 2^27. */
__attribute__((target("avx2"))) static inline ALWAYS_INLINE __m256i steps8(const u8 *g0, const u8 *g1, const u8 *g2,
                                                                          u64 k) {
    __m256i gap = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(g0 + k)));
    gap = _mm256_or_si256(gap, _mm256_slli_epi32(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(g1 + k))), 8));
    gap = _mm256_or_si256(gap, _mm256_slli_epi32(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(g2 + k))), 16));
    return _mm256_add_epi32(gap, _mm256_set1_epi32(1));
}

/* Running sums of the eight lanes (lane j: lanes 0 .. j added), in-lane then across the halves. */
__attribute__((target("avx2"))) static inline ALWAYS_INLINE __m256i prefix8(__m256i step) {
    __m256i x = _mm256_add_epi32(step, _mm256_slli_si256(step, 4));
    x = _mm256_add_epi32(x, _mm256_slli_si256(x, 8));
    return _mm256_add_epi32(
        x, _mm256_blend_epi32(_mm256_setzero_si256(), _mm256_permutevar8x32_epi32(x, _mm256_set1_epi32(3)), 0xF0));
}

/* Whether changes k .. k + 7 all have gaps below 2^24. */
static inline ALWAYS_INLINE int small8(const u8 *g3, u64 k) {
    u64 high;
    memcpy(&high, g3 + k, 8);
    return high == 0;
}

/* run_in_block's vector loop: the changes it took (a multiple of eight), *pos moved to the last. */
__attribute__((target("avx2"))) static u64 run_in_block_avx2(u8 *const *gaps, u64 k, u64 n, u64 *pos, int64_t shift,
                                                             u64 next, u8 *lows) {
    const u8 *g0 = gaps[0], *g1 = gaps[1], *g2 = gaps[2], *g3 = gaps[3];
    u64 i = 0, p = *pos;
    while (i + 8 <= n && small8(g3, k + i)) {
        const __m256i x = prefix8(steps8(g0, g1, g2, k + i)); /* lane j: change k + i + j's position - p */
        const u64 last = p + (u32)_mm256_extract_epi32(x, 7);
        /* Tensor position p + shift lies in the block: within it, position + x_j's low bits. */
        const __m256i v = _mm256_add_epi32(x, _mm256_set1_epi32((int)(((u64)((int64_t)p + shift)) & 0xffff)));
        if (last >= next || ((u32)_mm256_extract_epi32(v, 7) >> STAGE_BITS) != 0) break; /* the eighth leaves it */
        if (lows != NULL) { /* every lane is below 2^16: the saturating pack is exact */
            const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(v, v), 0x08);
            _mm_storeu_si128((__m128i *)(lows + 2 * i), _mm256_castsi256_si128(packed));
        }
        p = last;
        i += 8;
    }
    *pos = p;
    return i;
}

/* stage_positions' vector loop: the positions it wrote (a multiple of eight), *pos moved to the last. */
__attribute__((target("avx2"))) static u64 positions_avx2(u8 *const *gaps, u64 k, u64 n, u64 *pos, int64_t shift,
                                                          u8 *out, int wide) {
    const u8 *g0 = gaps[0], *g1 = gaps[1], *g2 = gaps[2], *g3 = gaps[3];
    u64 j = 0, p = *pos;
    while (j + 8 <= n && small8(g3, k + j)) {
        const __m256i x = prefix8(steps8(g0, g1, g2, k + j));
        const u64 base = p + (u64)shift; /* the positions are base + x_j, mod 2^64 as the scalar loop's */
        if (wide) {
            const __m256i b = _mm256_set1_epi64x((long long)base);
            _mm256_storeu_si256((__m256i *)(out + 8 * j),
                                _mm256_add_epi64(b, _mm256_cvtepu32_epi64(_mm256_castsi256_si128(x))));
            _mm256_storeu_si256((__m256i *)(out + 8 * j + 32),
                                _mm256_add_epi64(b, _mm256_cvtepu32_epi64(_mm256_extracti128_si256(x, 1))));
        } else {
            _mm256_storeu_si256((__m256i *)(out + 4 * j), _mm256_add_epi32(x, _mm256_set1_epi32((int)(u32)base)));
        }
        p += (u32)_mm256_extract_epi32(x, 7);
        j += 8;
    }
    *pos = p;
    return j;
}
#endif

/* Changes k, k + 1, ... (at most n of them) that lie before frame position `next` and, at tensor
 * position frame position + shift, in the block of 2^16 elements `cur` that holds *pos (the change
 * before k, whose frame position *pos is): how many, *pos moved to the last of them. With `lows`,
 * each one's tensor position's low 16 bits are written there (int16, in order). The vector loop
 * takes eight changes whose gaps are below 2^24 at a time while the eighth stays in the block and
 * before `next`; the scalar loop the rest, one at a time, and it ends the run. The same results
 * either way (tests/codec/test_kernels.py, the portable run too). */
static inline ALWAYS_INLINE u64 run_in_block(u8 *const *gaps, u64 k, u64 n, u64 *pos, int64_t shift, int64_t cur,
                                             u64 next, u8 *lows) {
    u64 i = 0, p = *pos;
#ifdef WS_X86
    if (has_avx2) i = run_in_block_avx2(gaps, k, n, &p, shift, next, lows);
#endif
    for (; i < n; i++) {
        const u64 q = p + 1 + gap_at(gaps, k + i);
        if (q >= next || (((int64_t)q + shift) >> STAGE_BITS) != cur) break;
        if (lows != NULL) {
            const uint16_t low = (uint16_t)(((int64_t)q + shift) & 0xffff);
            memcpy(lows + 2 * i, &low, 2);
        }
        p = q;
    }
    *pos = p;
    return i;
}

/* The positions of changes k .. k + n - 1 (frame position + shift) as int32 or, `wide`, int64 to
 * `out`; returns the last one's frame position (`pos`: the one before k's). Eight at a time where
 * their gaps are below 2^24 (AVX2), else one by one: the same values. */
static inline ALWAYS_INLINE u64 stage_positions(u8 *const *gaps, u64 k, u64 n, u64 pos, int64_t shift, u8 *out,
                                                int wide) {
    u64 j = 0;
#ifdef WS_X86
    if (has_avx2) j = positions_avx2(gaps, k, n, &pos, shift, out, wide);
#endif
    for (; j < n; j++) {
        pos += 1 + gap_at(gaps, k + j);
        const int64_t t = (int64_t)pos + shift;
        if (wide) {
            memcpy(out + 8 * j, &t, 8);
        } else {
            int32_t p32 = (int32_t)t;
            memcpy(out + 4 * j, &p32, 4);
        }
    }
    return pos;
}

/* Per piece of a frame (as pieces_loop): its changes, the blocks of 2^STAGE_BITS elements of its
 * tensor that hold them, and the first and last such block (-1 when none). Returns the last
 * frame position + 1 (0 when count is 0). */
HOT static u64 blocks_loop(u8 *const *gaps, u64 count, const int64_t *bounds, const int64_t *offsets, u64 nb,
                           int64_t *counts, int64_t *nblocks, int64_t *first, int64_t *last) {
    for (u64 i = 0; i < nb; i++) counts[i] = nblocks[i] = 0, first[i] = last[i] = -1;
    u64 pos = (u64)-1, bi = 0, next = nb > 1 ? (u64)bounds[1] : UINT64_MAX;
    int64_t shift = offsets[0] - bounds[0], cur = -1, n = 0, blocks = 0;
    for (u64 k = 0; k < count; k++) {
        if (cur >= 0) { /* the changes that stay in the piece and in the block of the last one */
            const u64 m = run_in_block(gaps, k, count - k, &pos, shift, cur, next, NULL);
            n += (int64_t)m;
            k += m;
            if (k == count) break;
        }
        pos += 1 + gap_at(gaps, k);
        if (pos >= next) {
            counts[bi] = n, nblocks[bi] = blocks, last[bi] = cur;
            n = blocks = 0, cur = -1;
            while (pos >= next) {
                bi++;
                next = bi + 1 < nb ? (u64)bounds[bi + 1] : UINT64_MAX;
            }
            shift = offsets[bi] - bounds[bi];
        }
        const int64_t b = ((int64_t)pos + shift) >> STAGE_BITS;
        if (b != cur) {
            if (cur < 0) first[bi] = b;
            cur = b;
            blocks++;
        }
        n++;
    }
    if (nb) counts[bi] = n, nblocks[bi] = blocks, last[bi] = cur;
    return count ? pos + 1 : 0;
}

/* One row of stage_pieces' table, per piece. */
enum { T_BOUND, T_OFFSET, T_MODE, T_MERGE, T_OPS, T_POS, T_BLOCKS, T_COUNTS, T_CHANGES, T_SLOTS, T_COLUMNS };

/* Operands of changes [k0, k0 + n) of a frame, un-zigzagged when `add`, to `out`; whether one of
 * them is zero (a change that changes nothing: this codec never writes one, the format allows it). */
static inline ALWAYS_INLINE int stage_operands(u8 *const *planes, u64 k0, u64 n, int w, int add, u8 *out) {
    int zero = 0;
    if (w == 2) {
        const u8 *p0 = planes[0] + k0, *p1 = planes[1] + k0;
        if (add) {
            for (u64 j = 0; j < n; j++) {
                uint16_t z = (uint16_t)(p0[j] | (p1[j] << 8)), v = (uint16_t)((z >> 1) ^ (uint16_t)(0u - (z & 1u)));
                memcpy(out + 2 * j, &v, 2);
                zero |= z == 0;
            }
        } else {
            for (u64 j = 0; j < n; j++) {
                uint16_t v = (uint16_t)(p0[j] | (p1[j] << 8));
                memcpy(out + 2 * j, &v, 2);
                zero |= v == 0;
            }
        }
        return zero;
    }
    for (u64 j = 0; j < n; j++) {
        u64 v = joined(planes, w, k0 + j);
        if (add) v = unzigzag(v, w);
        memcpy(out + j * w, &v, (size_t)w);
        zero |= v == 0;
    }
    return zero;
}

/* A completed block of a piece's changes: its count to *carry when it continues the previous
 * piece's last block (`merged`), else its id and count into the next of the piece's `slots`
 * slots; 0 when there is none left. */
static inline ALWAYS_INLINE int stage_block(int merged, int64_t mode, int64_t id, int64_t run, u8 *ids, u8 *counts,
                                            int64_t *slot, int64_t slots, int64_t *carry) {
    if (merged) {
        *carry = run;
        return 1;
    }
    if (*slot >= slots) return 0;
    if (mode == STAGE_BLOCKS32) {
        int32_t id32 = (int32_t)id;
        memcpy(ids + 4 * *slot, &id32, 4);
    } else {
        memcpy(ids + 8 * *slot, &id, 8);
    }
    memcpy(counts + 8 * *slot, &run, 8);
    (*slot)++;
    return 1;
}

/* Write each piece's staged change into `buf` (client/tensors.py StagedChange): its operands
 * (un-zigzagged when `add`) at T_OPS; by mode, its positions as int32/int64 at T_POS, or
 * block-coded: the low 16 bits as int16 at T_POS and, per block, its id (int32/int64) at
 * T_BLOCKS and its count (int64) at T_COUNTS. Every piece's T_CHANGES is its number of changes
 * (skipped pieces too: their changes are passed over). A piece with T_MERGE set continues the
 * previous piece's last block: that block's count here goes to carry[i], not to a slot. Returns
 * 0 if the changes run past the frame's count, a change lies outside its piece, or a piece's
 * blocks exceed its T_SLOTS (the caller's layout came from blocks_loop over the same frame:
 * never); every write stays within the regions the caller checked. Returns 2 when a staged
 * operand is zero (the reference path drops such changes), else 1. */
HOT static int stage_loop(u8 *const *gaps, u8 *const *planes, u64 count, int w, int add, const int64_t *table,
                          u64 nb, u8 *buf, int64_t *carry) {
    u64 pos = (u64)-1, k = 0;
    int zero = 0;
    for (u64 i = 0; i < nb; i++) {
        const int64_t *row = table + i * T_COLUMNS;
        const u64 n = (u64)row[T_CHANGES], lo = (u64)row[T_BOUND];
        const u64 hi = i + 1 < nb ? (u64)table[(i + 1) * T_COLUMNS + T_BOUND] : UINT64_MAX;
        const int64_t mode = row[T_MODE], shift = row[T_OFFSET] - row[T_BOUND];
        carry[i] = -1;
        if (n > count - k) return 0;
        if (n) { /* the piece's first change lies in it (its last is checked below) */
            if (pos + 1 + gap_at(gaps, k) < lo) return 0;
        }
        if (mode == STAGE_SKIP) {
            for (u64 j = 0; j < n; j++) pos += 1 + gap_at(gaps, k + j);
            k += n;
            if (n && pos >= hi) return 0;
            continue;
        }
        zero |= stage_operands(planes, k, n, w, add, buf + row[T_OPS]);
        u8 *out = buf + row[T_POS];
        if (mode == STAGE_POS32 || mode == STAGE_POS64) {
            pos = stage_positions(gaps, k, n, pos, shift, out, mode == STAGE_POS64);
        } else {
            u8 *ids = buf + row[T_BLOCKS], *counts = buf + row[T_COUNTS];
            const int64_t slots = row[T_SLOTS];
            int64_t cur = -1, run = 0, slot = 0;
            int first = 1;
            for (u64 j = 0; j < n; j++) {
                if (cur >= 0) { /* the changes that stay in the block of the last one: their low bits */
                    const u64 m = run_in_block(gaps, k + j, n - j, &pos, shift, cur, UINT64_MAX, out + 2 * j);
                    run += (int64_t)m;
                    j += m;
                    if (j == n) break;
                }
                pos += 1 + gap_at(gaps, k + j);
                const int64_t t = (int64_t)pos + shift, b = t >> STAGE_BITS;
                const uint16_t low = (uint16_t)(t & 0xffff);
                memcpy(out + 2 * j, &low, 2);
                if (b != cur) {
                    if (cur >= 0) { /* the block before is complete */
                        if (!stage_block(first && row[T_MERGE], mode, cur, run, ids, counts, &slot, slots, carry + i))
                            return 0;
                        first = 0;
                    }
                    cur = b, run = 0;
                }
                run++;
            }
            if (cur >= 0 && !stage_block(first && row[T_MERGE], mode, cur, run, ids, counts, &slot, slots, carry + i))
                return 0;
            if (slot != slots) return 0;
        }
        k += n;
        if (n && pos >= hi) return 0; /* the piece's last change lies in it */
    }
    return k != count ? 0 : zero ? 2 : 1;
}

static inline u64 combine(u64 cur, u64 v, int w, int op) {
    switch (op) {
    case OP_SET: return v;
    case OP_XOR: return cur ^ v;
    case OP_ADD: return (cur + unzigzag(v, w)) & mask_of(w);
    default: return (cur - unzigzag(v, w)) & mask_of(w);
    }
}

/* Dense: target[i] = target[i] op join(planes)[i] for every element (op SET: keyframe planes).
 * One loop per width and operation, no branch inside, restrict pointers: these vectorise. */
#define DENSE_APPLY(T, NAME, EXPR)                                                             \
    HOT static void NAME(u8 *restrict t, u64 n, u8 *const *planes) {                          \
        const u8 *restrict p0 = planes[0];                                                      \
        const u8 *restrict p1 = sizeof(T) > 1 ? planes[1] : planes[0];                          \
        for (u64 i = 0; i < n; i++) {                                                           \
            T v = sizeof(T) > 1 ? (T)(p0[i] | (T)(p1[i] << 8)) : (T)p0[i], cur;                 \
            memcpy(&cur, t + i * sizeof(T), sizeof(T));                                         \
            T d = (T)((T)(v >> 1) ^ (T)(0 - (T)(v & 1)));                                       \
            (void)d;                                                                            \
            cur = (T)(EXPR);                                                                    \
            memcpy(t + i * sizeof(T), &cur, sizeof(T));                                         \
        }                                                                                       \
    }
DENSE_APPLY(u8, dense_set_u8, v)
DENSE_APPLY(u8, dense_xor_u8, cur ^ v)
DENSE_APPLY(u8, dense_add_u8, cur + d)
DENSE_APPLY(u8, dense_sub_u8, cur - d)
DENSE_APPLY(u16, dense_set_u16, v)
DENSE_APPLY(u16, dense_xor_u16, cur ^ v)
DENSE_APPLY(u16, dense_add_u16, cur + d)
DENSE_APPLY(u16, dense_sub_u16, cur - d)

typedef void (*dense_apply_fn)(u8 *, u64, u8 *const *);
static const dense_apply_fn DENSE_APPLY_FNS[2][4] = {
    {dense_set_u8, dense_xor_u8, dense_add_u8, dense_sub_u8},
    {dense_set_u16, dense_xor_u16, dense_add_u16, dense_sub_u16},
};

/* n elements at t; planes[j] points at byte j of the first of them. */
static void dense_apply_loop(u8 *t, u64 n, int w, int op, u8 *const *planes) {
    if (w <= 2) {
        DENSE_APPLY_FNS[w - 1][op](t, n, planes);
        return;
    }
    for (u64 i = 0; i < n; i++) store(t + i * w, w, combine(load(t + i * w, w), joined(planes, w, i), w, op));
}

#ifdef WS_X86
/* The sum of n bytes (vpsadbw: 32 bytes into four 64-bit sums per instruction). */
__attribute__((target("avx2"))) static u64 byte_sum_avx2(const u8 *p, u64 n) {
    const __m256i zero = _mm256_setzero_si256();
    __m256i a = zero, b = zero;
    u64 i = 0;
    for (; i + 64 <= n; i += 64) {
        a = _mm256_add_epi64(a, _mm256_sad_epu8(_mm256_loadu_si256((const __m256i *)(p + i)), zero));
        b = _mm256_add_epi64(b, _mm256_sad_epu8(_mm256_loadu_si256((const __m256i *)(p + i + 32)), zero));
    }
    u64 lanes[4];
    _mm256_storeu_si256((__m256i *)lanes, _mm256_add_epi64(a, b));
    u64 total = lanes[0] + lanes[1] + lanes[2] + lanes[3];
    for (; i < n; i++) total += p[i];
    return total;
}
#endif

/* Position of the last change (sum of gaps + count - 1), or UINT64_MAX when count is 0 or
 * the position does not fit 64 bits (crafted planes of 2^32 changes or more). */
HOT static u64 last_position(u8 *const *gaps, u64 count) {
    if (count == 0 || count > ((u64)1 << 32)) return UINT64_MAX;
    u64 total = 0; /* < 2^32 gaps of < 2^32 each: no overflow */
#ifdef WS_X86
    if (has_avx2) { /* the gaps' sum is the sum of each byte plane, shifted to its place */
        for (int j = 0; j < 4; j++) total += byte_sum_avx2(gaps[j], count) << (8 * j);
        return total + count - 1;
    }
#endif
    for (u64 k = 0; k < count; k++)
        total += (u64)gaps[0][k] | ((u64)gaps[1][k] << 8) | ((u64)gaps[2][k] << 16) | ((u64)gaps[3][k] << 24);
    return total + count - 1;
}

/* Gap-coded changes read in order; change k lies at frame position pos (when k < count). */
typedef struct {
    u8 *gaps[4];
    u8 *vals[8];
    u64 count, k, pos;
    /* When set, each change adds (new word - old word) * weight to fix[lane], weight
     * 2 * (frame position + woff) + 1: the target's checksum after the changes is its
     * checksum before plus fix (as Coder.fix), so the result needs no second sum. */
    u64 *fix;
    u64 woff;
} Changes;

static void changes_start(Changes *s, u64 count) {
    s->count = count;
    s->k = 0;
    s->pos = count ? gap_at(s->gaps, 0) : 0;
    s->fix = NULL;
    s->woff = 0;
}

/* Apply the next changes that lie before frame position `limit` to t, which holds frame
 * position t0 at its start; returns how many. Per width and operation, so the loop body
 * has no branch but the data's. Positions were bound-checked by the caller. */
/* The planes' pointers and the checksum's move are kept in locals: the target is a u8 *, so
 * every write through it might alias anything the compiler cannot see is private, and it
 * would reload s->vals and s->gaps, and load and store s->fix, at every change. */
#define SPARSE_RUN(T, NAME, EXPR)                                                               \
    static u64 NAME(u8 *t, u64 t0, u64 limit, Changes *s) {                                     \
        u64 k = s->k, pos = s->pos, first = k;                                                  \
        const u64 count = s->count, woff = s->woff;                                              \
        const u8 *vp[sizeof(T)], *g0 = s->gaps[0], *g1 = s->gaps[1], *g2 = s->gaps[2], *g3 = s->gaps[3]; \
        for (unsigned j = 0; j < sizeof(T); j++) vp[j] = s->vals[j];                             \
        u64 moved[4] = {0, 0, 0, 0};                                                             \
        const int fixing = s->fix != NULL;                                                       \
        while (k < count && pos < limit) {                                                       \
            T v = 0, cur;                                                                        \
            for (unsigned j = 0; j < sizeof(T); j++) v |= (T)((T)vp[j][k] << (8 * j));           \
            u8 *at = t + (pos - t0) * sizeof(T);                                                 \
            memcpy(&cur, at, sizeof(T));                                                         \
            const T old = cur;                                                                   \
            T d = (T)((T)(v >> 1) ^ (T)(0 - (T)(v & 1)));                                        \
            (void)d;                                                                             \
            cur = (T)(EXPR);                                                                     \
            memcpy(at, &cur, sizeof(T));                                                         \
            if (fixing) fix_change(moved, cur, old, sizeof(T), 2 * (pos + woff) + 1);           \
            if (++k < count)                                                                     \
                pos += 1 + ((u64)g0[k] | ((u64)g1[k] << 8) | ((u64)g2[k] << 16) | ((u64)g3[k] << 24)); \
        }                                                                                        \
        if (fixing)                                                                              \
            for (int h = 0; h < 4; h++) s->fix[h] += moved[h];                                   \
        s->k = k;                                                                                \
        s->pos = pos;                                                                            \
        return k - first;                                                                        \
    }
#define SPARSE_RUN_ALL(T)                               \
    SPARSE_RUN(T, sparse_set_##T, v)                    \
    SPARSE_RUN(T, sparse_xor_##T, cur ^ v)              \
    SPARSE_RUN(T, sparse_add_##T, cur + d)              \
    SPARSE_RUN(T, sparse_sub_##T, cur - d)
SPARSE_RUN_ALL(u8)
SPARSE_RUN_ALL(u16)
SPARSE_RUN_ALL(u32)
SPARSE_RUN_ALL(u64)

typedef u64 (*sparse_run_fn)(u8 *, u64, u64, Changes *);

#ifdef WS_X86
/* AVX2 for 2-byte elements (bf16, fp16: most of a model), eight changes at a time. The scalar
 * loop above decodes each position from the last (a chain through every change) and joins
 * four gap bytes and two value bytes per change; here one vector step joins eight gaps, takes
 * their prefix sum (eight positions, relative to the group's first) and decodes eight values,
 * and a loop with no chain between its iterations writes them and moves the checksum. A group
 * stops at `limit` (its lanes past it are left for the next call). Groups need the gaps of the
 * eight changes after the first, and gaps below 2^24 (so eight of them fit 32 bits); the rest,
 * and any group with a larger gap, go to the scalar loop, which ends the run. Same results,
 * bit for bit, as the scalar loop (tests/codec/test_kernels.py runs both). */
#define SPARSE_AVX2_U16(NAME, SCALAR, ZIGZAG, EXPR)                                                 \
    __attribute__((target("avx2"))) static u64 NAME(u8 *t, u64 t0, u64 limit, Changes *s) {       \
        u64 k = s->k, pos = s->pos;                                                                 \
        const u64 first = k, count = s->count, woff = s->woff;                                      \
        const u8 *g0 = s->gaps[0], *g1 = s->gaps[1], *g2 = s->gaps[2], *g3 = s->gaps[3];            \
        const u8 *v0 = s->vals[0], *v1 = s->vals[1];                                                \
        const int fixing = s->fix != NULL;                                                          \
        u64 moved[1] = {0};                                                                         \
        u32 rel[8];                                                                                 \
        u16 val[8];                                                                                 \
        const __m256i last = _mm256_set1_epi32(7);                                                  \
        while (k + 9 <= count && pos < limit) {                                                     \
            if (!small8(g3, k + 1)) break; /* a gap of 2^24 or more: the scalar loop's */           \
            /* step j: 1 + gap of change k + 1 + j; x: their running sums */                        \
            const __m256i step = steps8(g0, g1, g2, k + 1), x = prefix8(step);                      \
            /* lane j of x: change k + 1 + j's position - pos; rel[j]: change k + j's */            \
            __m256i r = _mm256_sub_epi32(x, step);                                                  \
            _mm256_storeu_si256((__m256i *)rel, r);                                                 \
            const u64 room = limit - pos; /* > 0 */                                                 \
            unsigned m = 8;                                                                         \
            if (room <= rel[7]) { /* the group crosses limit: its first m changes lie before it */  \
                m = 1;                                                                              \
                while (m < 8 && rel[m] < room) m++;                                                 \
            }                                                                                       \
            __m128i v = _mm_or_si128(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(v0 + k))), \
                                     _mm_slli_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(v1 + k))), 8)); \
            if (ZIGZAG) /* d = (v >> 1) ^ -(v & 1) */                                               \
                v = _mm_xor_si128(_mm_srli_epi16(v, 1),                                             \
                                  _mm_sub_epi16(_mm_setzero_si128(), _mm_and_si128(v, _mm_set1_epi16(1)))); \
            _mm_storeu_si128((__m128i *)val, v);                                                    \
            u8 *at0 = t + (pos - t0) * 2;                                                           \
            const u64 w0 = 2 * (pos + woff) + 1;                                                    \
            for (unsigned j = 0; j < m; j++) {                                                      \
                u8 *at = at0 + 2 * (u64)rel[j];                                                     \
                u16 cur, d = val[j], v_ = val[j];                                                   \
                (void)d;                                                                            \
                (void)v_;                                                                           \
                memcpy(&cur, at, 2);                                                                \
                const u16 old = cur;                                                                \
                cur = (u16)(EXPR);                                                                  \
                memcpy(at, &cur, 2);                                                                \
                fix_change(moved, cur, old, 2, w0 + 2 * (u64)rel[j]);                               \
            }                                                                                       \
            if (m < 8) { /* stopped at limit, inside the group: change k + m is next */             \
                pos += rel[m];                                                                      \
                k += m;                                                                             \
                break;                                                                              \
            }                                                                                       \
            pos += (u32)_mm256_cvtsi256_si32(_mm256_permutevar8x32_epi32(x, last));                 \
            k += 8;                                                                                 \
        }                                                                                           \
        if (fixing) s->fix[0] += moved[0];                                                          \
        s->k = k;                                                                                   \
        s->pos = pos;                                                                               \
        if (k >= count || pos >= limit) return k - first; /* most runs end in a group */            \
        /* GCC leaves the upper halves dirty on this path: SSE code after it would pay for them */  \
        _mm256_zeroupper();                                                                         \
        return (k - first) + SCALAR(t, t0, limit, s);                                               \
    }
SPARSE_AVX2_U16(sparse_avx2_set_u16, sparse_set_u16, 0, v_)
SPARSE_AVX2_U16(sparse_avx2_xor_u16, sparse_xor_u16, 0, cur ^ v_)
SPARSE_AVX2_U16(sparse_avx2_add_u16, sparse_add_u16, 1, cur + d)
SPARSE_AVX2_U16(sparse_avx2_sub_u16, sparse_sub_u16, 1, cur - d)
static const sparse_run_fn SPARSE_AVX2_FNS[4] = {sparse_avx2_set_u16, sparse_avx2_xor_u16, sparse_avx2_add_u16,
                                                 sparse_avx2_sub_u16};

/* Dense blocks of 2-byte elements. Where a frame changes one element in a few (a MoE's routed experts:
 * ~18 % of their elements in a step), patching each change in place (a read, a write and a checksum
 * move per change) costs more than the block's memory: instead a block's changes are scattered into a
 * zeroed scratch block of values (positions decoded eight at a time, as above: no target read, no
 * checksum move), then one vector pass combines the block with it, and the caller sums the result,
 * which is in L1 (apply_sparse_pieces). XOR, ADD and SUB; the values of ADD and SUB are zigzag-coded.
 * Same bytes and checksums as the sparse loops (tests/codec/test_kernels.py). The scatter is a loop of
 * its own rather than the sparse loops above with SET's expression: those read each slot and move a
 * checksum per change, which took back the whole gain (the 436 MB step's pass 38-40 against 29-30 ms). */
static u64 scatter_u16(u16 *scratch, u64 b0, u64 limit, Changes *s, int zz) {
    u64 k = s->k, pos = s->pos;
    const u64 first = k, count = s->count;
    const u8 *g0 = s->gaps[0], *g1 = s->gaps[1], *g2 = s->gaps[2], *g3 = s->gaps[3];
    const u8 *v0 = s->vals[0], *v1 = s->vals[1];
    while (k < count && pos < limit) {
        const u16 v = (u16)(v0[k] | (v1[k] << 8));
        scratch[pos - b0] = zz ? (u16)((u16)(v >> 1) ^ (u16)(0 - (v & 1))) : v;
        if (++k < count) pos += 1 + ((u64)g0[k] | ((u64)g1[k] << 8) | ((u64)g2[k] << 16) | ((u64)g3[k] << 24));
    }
    s->k = k;
    s->pos = pos;
    return k - first;
}

__attribute__((target("avx2"))) static u64 scatter_avx2_u16(u16 *scratch, u64 b0, u64 limit, Changes *s, int zz) {
    u64 k = s->k, pos = s->pos;
    const u64 first = k, count = s->count;
    const u8 *g0 = s->gaps[0], *g1 = s->gaps[1], *g2 = s->gaps[2], *g3 = s->gaps[3];
    const u8 *v0 = s->vals[0], *v1 = s->vals[1];
    u32 rel[8];
    u16 val[8];
    while (k + 9 <= count && pos < limit) {
        if (!small8(g3, k + 1)) break; /* a gap of 2^24 or more: the scalar loop's */
        const __m256i step = steps8(g0, g1, g2, k + 1), x = prefix8(step);
        _mm256_storeu_si256((__m256i *)rel, _mm256_sub_epi32(x, step)); /* change k + j's position - pos */
        const u64 room = limit - pos;
        unsigned m = 8;
        if (room <= rel[7]) {
            m = 1;
            while (m < 8 && rel[m] < room) m++;
        }
        __m128i v = _mm_or_si128(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(v0 + k))),
                                 _mm_slli_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(v1 + k))), 8));
        if (zz)
            v = _mm_xor_si128(_mm_srli_epi16(v, 1),
                              _mm_sub_epi16(_mm_setzero_si128(), _mm_and_si128(v, _mm_set1_epi16(1))));
        _mm_storeu_si128((__m128i *)val, v);
        u16 *at = scratch + (pos - b0);
        for (unsigned j = 0; j < m; j++) at[rel[j]] = val[j];
        if (m < 8) {
            pos += rel[m];
            k += m;
            break;
        }
        pos += (u32)_mm256_cvtsi256_si32(_mm256_permutevar8x32_epi32(x, _mm256_set1_epi32(7)));
        k += 8;
    }
    s->k = k;
    s->pos = pos;
    if (k >= count || pos >= limit) return k - first;
    _mm256_zeroupper();
    return (k - first) + scatter_u16(scratch, b0, limit, s, zz);
}

/* A whole block (SUM_BLOCK bytes of 2-byte elements at position `elem`): t op= d in one pass, the
 * block's checksum lane before (into before[0]) and after (into after[0]) taken from the registers. */
__attribute__((target("avx2"))) static void combine_block_sums_avx2(u8 *t, const u16 *d, u64 elem, int op, u64 *before,
                                                                   u64 *after) {
    PairSums a, b;
    pairs_start(&a);
    pairs_start(&b);
    for (int r = 0; r < PAIR_ROWS; r++) {
        u8 *row = t + 64 * r;
        PREFETCH_AHEAD(row);
        const __m256i x0 = _mm256_loadu_si256((const __m256i *)row), x1 = _mm256_loadu_si256((const __m256i *)(row + 32));
        const __m256i d0 = _mm256_loadu_si256((const __m256i *)(d + 32 * r)),
                      d1 = _mm256_loadu_si256((const __m256i *)(d + 32 * r + 16));
        pairs_row(&a, x0, x1);
        const __m256i y0 = op == OP_XOR ? _mm256_xor_si256(x0, d0)
                           : op == OP_ADD ? _mm256_add_epi16(x0, d0)
                                          : _mm256_sub_epi16(x0, d0);
        const __m256i y1 = op == OP_XOR ? _mm256_xor_si256(x1, d1)
                           : op == OP_ADD ? _mm256_add_epi16(x1, d1)
                                          : _mm256_sub_epi16(x1, d1);
        _mm256_storeu_si256((__m256i *)row, y0);
        _mm256_storeu_si256((__m256i *)(row + 32), y1);
        pairs_row(&b, y0, y1);
    }
    before[0] += pairs_fold(&a, elem);
    after[0] += pairs_fold(&b, elem);
}

/* t[i] op= d[i] for the m 2-byte elements of a block (op: XOR, ADD or SUB). */
__attribute__((target("avx2"))) static void combine_avx2_u16(u8 *t, const u16 *d, u64 m, int op) {
    u64 i = 0;
    for (; i + 16 <= m; i += 16) {
        const __m256i a = _mm256_loadu_si256((const __m256i *)(t + 2 * i));
        const __m256i b = _mm256_loadu_si256((const __m256i *)(d + i));
        const __m256i r = op == OP_XOR ? _mm256_xor_si256(a, b)
                          : op == OP_ADD ? _mm256_add_epi16(a, b)
                                         : _mm256_sub_epi16(a, b);
        _mm256_storeu_si256((__m256i *)(t + 2 * i), r);
    }
    for (; i < m; i++) {
        u16 a;
        memcpy(&a, t + 2 * i, 2);
        a = op == OP_XOR ? (u16)(a ^ d[i]) : op == OP_ADD ? (u16)(a + d[i]) : (u16)(a - d[i]);
        memcpy(t + 2 * i, &a, 2);
    }
}
#endif

static const sparse_run_fn SPARSE_RUN_FNS[4][4] = {
    {sparse_set_u8, sparse_xor_u8, sparse_add_u8, sparse_sub_u8},
    {sparse_set_u16, sparse_xor_u16, sparse_add_u16, sparse_sub_u16},
    {sparse_set_u32, sparse_xor_u32, sparse_add_u32, sparse_sub_u32},
    {sparse_set_u64, sparse_xor_u64, sparse_add_u64, sparse_sub_u64},
};

static sparse_run_fn sparse_run_for(int w, int op) {
#ifdef WS_X86
    if (has_avx2 && w == 2) return SPARSE_AVX2_FNS[op];
#endif
    return SPARSE_RUN_FNS[w == 1 ? 0 : w == 2 ? 1 : w == 4 ? 2 : 3][op];
}

/* Positions (int64) of `count` changes from their gap planes; returns the last position + 1
 * (0 when count is 0) so the caller checks the bound. */
HOT static u64 positions_loop(u8 *const *gaps, u64 count, int64_t *out) {
    u64 pos = (u64)-1;
    for (u64 k = 0; k < count; k++) {
        pos += 1 + ((u64)gaps[0][k] | ((u64)gaps[1][k] << 8) | ((u64)gaps[2][k] << 16) | ((u64)gaps[3][k] << 24));
        out[k] = (int64_t)pos;
    }
    return pos + 1;
}

/* Where a run of gap-coded changes crosses the ascending element `bounds` of consecutive
 * pieces: cuts[i] = index of the first change at or after bounds[i], firsts[i] = its
 * position (-1 if none). Returns the last position + 1 (0 when count is 0). */
HOT static u64 cuts_loop(u8 *const *gaps, u64 count, const int64_t *bounds, u64 nb, int64_t *cuts,
                         int64_t *firsts) {
    u64 pos = (u64)-1, bi = 0;
    for (u64 k = 0; k < count; k++) {
        pos += 1 + ((u64)gaps[0][k] | ((u64)gaps[1][k] << 8) | ((u64)gaps[2][k] << 16) | ((u64)gaps[3][k] << 24));
        while (bi < nb && (u64)bounds[bi] <= pos) {
            cuts[bi] = (int64_t)k;
            firsts[bi] = (int64_t)pos;
            bi++;
        }
    }
    for (; bi < nb; bi++) {
        cuts[bi] = (int64_t)count;
        firsts[bi] = -1;
    }
    return pos + 1;
}
