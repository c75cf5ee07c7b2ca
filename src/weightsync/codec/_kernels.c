/* weightsync.codec._kernels: the codec's hot loops in C (docs/DESIGN.md "Native core").
 *
 * Every function here mirrors a pure-numpy reference in weightsync/codec/kernels.py and
 * weightsync/codec/checksum.py; tests/codec/test_kernels.py asserts they agree bit for bit.
 * Built against the limited API (Py_LIMITED_API = 3.11) so one .abi3.so serves every
 * CPython >= 3.11. No library beyond libc and pthreads.
 *
 * Rules every entry point keeps:
 *   - arguments are parsed and buffers acquired with the GIL held; every loop runs with the
 *     GIL released (Py_BEGIN_ALLOW_THREADS), so frames decode on as many cores as threads;
 *   - lengths are checked here (ValueError) before any byte is touched: a Python caller can
 *     pass anything and never makes this code read or write outside a buffer;
 *   - data-dependent failures (a sparse position past the end) are reported as a return
 *     value checked before the first write, so the target is untouched (FORMAT §4.2).
 * Elements are little-endian unsigned integers of 1, 2, 4 or 8 bytes (FORMAT §3).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <pthread.h>
#include <stdint.h>
#include <string.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "weightsync kernels assume a little-endian host (the wire format is little-endian)"
#endif

/* Hot loops get an AVX2 clone on x86-64, picked at load time (ifunc), and a baseline one. */
#if defined(__x86_64__) && defined(__GNUC__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define HOT __attribute__((target_clones("avx2", "default")))
#endif
#endif
#ifndef HOT
#define HOT
#endif

#if defined(__x86_64__) && defined(__GNUC__)
#define WS_X86 1
#include <immintrin.h>
static int has_avx2; /* set once at import */
#endif

typedef uint8_t u8;
typedef uint16_t u16;
typedef uint32_t u32;
typedef uint64_t u64;

/* ---- buffers ------------------------------------------------------------------------- */

typedef struct {
    Py_buffer views[16];
    int n;
} Held;

static void release_all(Held *h) {
    for (int i = 0; i < h->n; i++) PyBuffer_Release(&h->views[i]);
    h->n = 0;
}

/* Acquire a C-contiguous buffer (writable if asked); NULL with an exception set on failure. */
static u8 *hold(Held *h, PyObject *obj, int writable, Py_ssize_t *len) {
    if (h->n >= 16) {
        PyErr_SetString(PyExc_ValueError, "too many buffers");
        return NULL;
    }
    Py_buffer *v = &h->views[h->n];
    if (PyObject_GetBuffer(obj, v, writable ? PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS : PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    h->n++;
    *len = v->len;
    return (u8 *)v->buf;
}

/* A sequence of `count` buffers of exactly `each` bytes (byte planes). */
static int hold_planes(Held *h, PyObject *seq, int count, Py_ssize_t each, int writable, u8 **out) {
    if (!PySequence_Check(seq) || PySequence_Size(seq) != count) {
        PyErr_Format(PyExc_ValueError, "expected a sequence of %d planes", count);
        return -1;
    }
    for (int j = 0; j < count; j++) {
        PyObject *item = PySequence_GetItem(seq, j);
        if (item == NULL) return -1;
        Py_ssize_t len = 0;
        out[j] = hold(h, item, writable, &len);
        Py_DECREF(item);
        if (out[j] == NULL) return -1;
        if (len != each) {
            PyErr_Format(PyExc_ValueError, "plane %d holds %zd bytes, expected %zd", j, len, each);
            return -1;
        }
    }
    return 0;
}

static int check_width(int width) {
    if (width == 1 || width == 2 || width == 4 || width == 8) return 0;
    PyErr_Format(PyExc_ValueError, "element width must be 1, 2, 4 or 8, got %d", width);
    return -1;
}

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

/* ---- encode -------------------------------------------------------------------------- */

/* Whether the 32 bytes at a and b differ: four 8-byte compares, so unchanged runs cost
 * little. */
static inline int block_differs(const u8 *a, const u8 *b) {
    u64 x[4], y[4];
    memcpy(x, a, 32);
    memcpy(y, b, 32);
    return ((x[0] ^ y[0]) | (x[1] ^ y[1]) | (x[2] ^ y[2]) | (x[3] ^ y[3])) != 0;
}

/* Per-width loops: T is the element type; loads go through memcpy, so any alignment works. */
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

static PyObject *count_changed(PyObject *self, PyObject *args) {
    PyObject *ob, *on;
    int w;
    if (!PyArg_ParseTuple(args, "OOi", &ob, &on, &w) || check_width(w) < 0) return NULL;
    Held h = {.n = 0};
    Py_ssize_t lb, ln;
    u8 *a = hold(&h, ob, 0, &lb), *b = a ? hold(&h, on, 0, &ln) : NULL;
    if (b == NULL) goto fail;
    if (lb != ln || ln % w) {
        PyErr_SetString(PyExc_ValueError, "base and new must be the same whole number of elements");
        goto fail;
    }
    u64 count;
    Py_BEGIN_ALLOW_THREADS
    count = count_changed_loop(a, b, (u64)ln, w);
    Py_END_ALLOW_THREADS
    release_all(&h);
    return PyLong_FromUnsignedLongLong(count);
fail:
    release_all(&h);
    return NULL;
}

/* Sparse method (FORMAT §4.2): for the k-th changed element, byte j of its gap (u32, the
 * unchanged elements since the previous change) goes to gaps[j][k] and byte j of its value
 * to vals[j][k]. Returns the number of changes written, or cap + 1 as soon as there are
 * more than `cap` (the caller then codes the frame dense). 32-byte blocks without a change
 * are skipped with one compare. */
#define SPARSE_LOOP(T)                                                                          \
    static u64 sparse_##T(const u8 *a, const u8 *b, u64 n, int add, u8 **gaps, u8 **vals,      \
                          u64 cap) {                                                           \
        const u64 per = 32 / sizeof(T);                                                        \
        u64 k = 0, prev = (u64)-1;                                                             \
        for (u64 i = 0; i < n;) {                                                              \
            if (i + per <= n && !block_differs(a + i * sizeof(T), b + i * sizeof(T))) {         \
                i += per;                                                                      \
                continue;                                                                      \
            }                                                                                  \
            u64 end = i + per <= n ? i + per : n;                                              \
            for (; i < end; i++) {                                                             \
                T x, y;                                                                        \
                memcpy(&x, a + i * sizeof(T), sizeof(T));                                      \
                memcpy(&y, b + i * sizeof(T), sizeof(T));                                      \
                if (x == y) continue;                                                          \
                if (k == cap) return cap + 1;                                                        \
                u64 gap = i - prev - 1, v = delta_value(x, y, sizeof(T), add);                 \
                prev = i;                                                                      \
                gaps[0][k] = (u8)gap;                                                          \
                gaps[1][k] = (u8)(gap >> 8);                                                   \
                gaps[2][k] = (u8)(gap >> 16);                                                  \
                gaps[3][k] = (u8)(gap >> 24);                                                  \
                for (unsigned j = 0; j < sizeof(T); j++) vals[j][k] = (u8)(v >> (8 * j));      \
                k++;                                                                           \
            }                                                                                  \
        }                                                                                      \
        return k;                                                                              \
    }
HOT SPARSE_LOOP(u8)
HOT SPARSE_LOOP(u16)
HOT SPARSE_LOOP(u32)
HOT SPARSE_LOOP(u64)

#ifdef WS_X86
/* AVX2 for 1- and 2-byte elements (bf16, fp16, fp8: most of a model): compare 32 elements
 * at once into a bit mask of changed elements, then visit only the set bits. */
#define SPARSE_AVX2(T)                                                                           \
    __attribute__((target("avx2"))) static u64 sparse_avx2_##T(const u8 *a, const u8 *b, u64 n,  \
                                                                int add, u8 **gaps, u8 **vals, u64 cap) { \
        u64 k = 0, prev = (u64)-1, i = 0;                                                        \
        for (; i + 32 <= n; i += 32) {                                                           \
            u32 eq;                                                                              \
            if (sizeof(T) == 1) {                                                                \
                __m256i x = _mm256_loadu_si256((const __m256i *)(a + i));                        \
                __m256i y = _mm256_loadu_si256((const __m256i *)(b + i));                        \
                eq = (u32)_mm256_movemask_epi8(_mm256_cmpeq_epi8(x, y));                         \
            } else {                                                                             \
                const u8 *pa = a + 2 * i, *pb = b + 2 * i;                                       \
                __m256i c0 = _mm256_cmpeq_epi16(_mm256_loadu_si256((const __m256i *)pa),         \
                                                _mm256_loadu_si256((const __m256i *)pb));        \
                __m256i c1 = _mm256_cmpeq_epi16(_mm256_loadu_si256((const __m256i *)(pa + 32)),  \
                                                _mm256_loadu_si256((const __m256i *)(pb + 32))); \
                /* packs interleaves 128-bit lanes; the permute restores element order */        \
                __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi16(c0, c1), 0xD8);     \
                eq = (u32)_mm256_movemask_epi8(packed);                                          \
            }                                                                                    \
            u32 changed = ~eq;                                                                   \
            while (changed) {                                                                    \
                u64 e = i + (u64)__builtin_ctz(changed);                                         \
                changed &= changed - 1;                                                          \
                if (k == cap) return cap + 1;                                                          \
                T x, y;                                                                          \
                memcpy(&x, a + e * sizeof(T), sizeof(T));                                        \
                memcpy(&y, b + e * sizeof(T), sizeof(T));                                        \
                u64 gap = e - prev - 1, v = delta_value(x, y, sizeof(T), add);                   \
                prev = e;                                                                        \
                gaps[0][k] = (u8)gap;                                                            \
                gaps[1][k] = (u8)(gap >> 8);                                                     \
                gaps[2][k] = (u8)(gap >> 16);                                                    \
                gaps[3][k] = (u8)(gap >> 24);                                                    \
                vals[0][k] = (u8)v;                                                              \
                if (sizeof(T) == 2) vals[1][k] = (u8)(v >> 8);                                   \
                k++;                                                                             \
            }                                                                                    \
        }                                                                                        \
        for (; i < n; i++) {                                                                     \
            T x, y;                                                                              \
            memcpy(&x, a + i * sizeof(T), sizeof(T));                                            \
            memcpy(&y, b + i * sizeof(T), sizeof(T));                                            \
            if (x == y) continue;                                                                \
            if (k == cap) return cap + 1;                                                              \
            u64 gap = i - prev - 1, v = delta_value(x, y, sizeof(T), add);                       \
            prev = i;                                                                            \
            gaps[0][k] = (u8)gap;                                                                \
            gaps[1][k] = (u8)(gap >> 8);                                                         \
            gaps[2][k] = (u8)(gap >> 16);                                                        \
            gaps[3][k] = (u8)(gap >> 24);                                                        \
            vals[0][k] = (u8)v;                                                                  \
            if (sizeof(T) == 2) vals[1][k] = (u8)(v >> 8);                                       \
            k++;                                                                                 \
        }                                                                                        \
        return k;                                                                                \
    }
SPARSE_AVX2(u8)
SPARSE_AVX2(u16)
#endif

static u64 sparse_loop(const u8 *a, const u8 *b, u64 nbytes, int w, int add, u8 **gaps, u8 **vals, u64 cap) {
#ifdef WS_X86
    if (has_avx2 && w == 1) return sparse_avx2_u8(a, b, nbytes, add, gaps, vals, cap);
    if (has_avx2 && w == 2) return sparse_avx2_u16(a, b, nbytes / 2, add, gaps, vals, cap);
#endif
    switch (w) {
    case 1: return sparse_u8(a, b, nbytes, add, gaps, vals, cap);
    case 2: return sparse_u16(a, b, nbytes / 2, add, gaps, vals, cap);
    case 4: return sparse_u32(a, b, nbytes / 4, add, gaps, vals, cap);
    default: return sparse_u64(a, b, nbytes / 8, add, gaps, vals, cap);
    }
}

static PyObject *encode_sparse(PyObject *self, PyObject *args) {
    PyObject *ob, *on, *og, *ov;
    int w, add;
    unsigned long long cap;
    if (!PyArg_ParseTuple(args, "OOipKOO", &ob, &on, &w, &add, &cap, &og, &ov) || check_width(w) < 0)
        return NULL;
    Held h = {.n = 0};
    Py_ssize_t lb, ln;
    u8 *gaps[4], *vals[8];
    u8 *a = hold(&h, ob, 0, &lb), *b = a ? hold(&h, on, 0, &ln) : NULL;
    if (b == NULL) goto fail;
    if (lb != ln || ln % w || (u64)ln / w > 0xFFFFFFFFull) {
        PyErr_SetString(PyExc_ValueError, "base and new must be the same whole number (< 2^32) of elements");
        goto fail;
    }
    if (hold_planes(&h, og, 4, (Py_ssize_t)cap, 1, gaps) < 0 || hold_planes(&h, ov, w, (Py_ssize_t)cap, 1, vals) < 0)
        goto fail;
    u64 k;
    Py_BEGIN_ALLOW_THREADS
    k = sparse_loop(a, b, (u64)ln, w, add, gaps, vals, cap);
    Py_END_ALLOW_THREADS
    release_all(&h);
    return PyLong_FromUnsignedLongLong(k);
fail:
    release_all(&h);
    return NULL;
}

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

static PyObject *encode_dense(PyObject *self, PyObject *args) {
    PyObject *ob, *on, *op;
    int w, add;
    if (!PyArg_ParseTuple(args, "OOipO", &ob, &on, &w, &add, &op) || check_width(w) < 0) return NULL;
    Held h = {.n = 0};
    Py_ssize_t lb, ln;
    u8 *planes[8];
    u8 *a = hold(&h, ob, 0, &lb), *b = a ? hold(&h, on, 0, &ln) : NULL;
    if (b == NULL) goto fail;
    if (lb != ln || ln % w) {
        PyErr_SetString(PyExc_ValueError, "base and new must be the same whole number of elements");
        goto fail;
    }
    if (hold_planes(&h, op, w, ln / w, 1, planes) < 0) goto fail;
    Py_BEGIN_ALLOW_THREADS
    dense_loop(a, b, (u64)ln / w, w, add, planes);
    Py_END_ALLOW_THREADS
    release_all(&h);
    Py_RETURN_NONE;
fail:
    release_all(&h);
    return NULL;
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

static PyObject *split_planes(PyObject *self, PyObject *args) {
    PyObject *os, *op;
    int w;
    if (!PyArg_ParseTuple(args, "OiO", &os, &w, &op) || check_width(w) < 0) return NULL;
    Held h = {.n = 0};
    Py_ssize_t ls;
    u8 *planes[8];
    u8 *src = hold(&h, os, 0, &ls);
    if (src == NULL) goto fail;
    if (ls % w) {
        PyErr_SetString(PyExc_ValueError, "source is not a whole number of elements");
        goto fail;
    }
    if (hold_planes(&h, op, w, ls / w, 1, planes) < 0) goto fail;
    Py_BEGIN_ALLOW_THREADS
    split_loop(src, (u64)ls / w, w, planes);
    Py_END_ALLOW_THREADS
    release_all(&h);
    Py_RETURN_NONE;
fail:
    release_all(&h);
    return NULL;
}

/* ---- decode / apply ------------------------------------------------------------------ */

enum { OP_SET = 0, OP_XOR = 1, OP_ADD = 2, OP_SUB = 3 };

static inline u64 joined(u8 *const *planes, int w, u64 i) {
    u64 v = 0;
    for (int j = 0; j < w; j++) v |= (u64)planes[j][i] << (8 * j);
    return v;
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

static void dense_apply_loop(u8 *t, u64 n, int w, int op, u8 *const *planes) {
    if (w <= 2) {
        DENSE_APPLY_FNS[w - 1][op](t, n, planes);
        return;
    }
    for (u64 i = 0; i < n; i++) store(t + i * w, w, combine(load(t + i * w, w), joined(planes, w, i), w, op));
}

static int parse_op(int op) {
    if (op >= OP_SET && op <= OP_SUB) return 0;
    PyErr_Format(PyExc_ValueError, "unknown apply operation %d", op);
    return -1;
}

static PyObject *apply_dense(PyObject *self, PyObject *args) {
    PyObject *ot, *op;
    int w, opc;
    if (!PyArg_ParseTuple(args, "OiiO", &ot, &w, &opc, &op) || check_width(w) < 0 || parse_op(opc) < 0)
        return NULL;
    Held h = {.n = 0};
    Py_ssize_t lt;
    u8 *planes[8];
    u8 *t = hold(&h, ot, 1, &lt);
    if (t == NULL) goto fail;
    if (lt % w) {
        PyErr_SetString(PyExc_ValueError, "target is not a whole number of elements");
        goto fail;
    }
    if (hold_planes(&h, op, w, lt / w, 0, planes) < 0) goto fail;
    Py_BEGIN_ALLOW_THREADS
    dense_apply_loop(t, (u64)lt / w, w, opc, planes);
    Py_END_ALLOW_THREADS
    release_all(&h);
    Py_RETURN_NONE;
fail:
    release_all(&h);
    return NULL;
}

/* Position of the last change (sum of gaps + count - 1), or UINT64_MAX when count is 0. */
HOT static u64 last_position(u8 *const *gaps, u64 count) {
    u64 total = 0;
    for (u64 k = 0; k < count; k++)
        total += (u64)gaps[0][k] | ((u64)gaps[1][k] << 8) | ((u64)gaps[2][k] << 16) | ((u64)gaps[3][k] << 24);
    return count ? total + count - 1 : UINT64_MAX;
}

/* Per width and operation, so the loop body has no branch but the data's. */
#define SPARSE_APPLY(T, NAME, EXPR)                                                                     \
    static void NAME(u8 *t, u8 *const *gaps, u8 *const *vals, u64 count) {                              \
        u64 pos = (u64)-1;                                                                               \
        const u8 *g0 = gaps[0], *g1 = gaps[1], *g2 = gaps[2], *g3 = gaps[3];                             \
        for (u64 k = 0; k < count; k++) {                                                                \
            pos += 1 + ((u64)g0[k] | ((u64)g1[k] << 8) | ((u64)g2[k] << 16) | ((u64)g3[k] << 24));       \
            T v = 0, cur;                                                                                \
            for (unsigned j = 0; j < sizeof(T); j++) v |= (T)((T)vals[j][k] << (8 * j));                 \
            memcpy(&cur, t + pos * sizeof(T), sizeof(T));                                                \
            T d = (T)((T)(v >> 1) ^ (T)(0 - (T)(v & 1)));                                                \
            (void)d;                                                                                     \
            cur = (T)(EXPR);                                                                             \
            memcpy(t + pos * sizeof(T), &cur, sizeof(T));                                                \
        }                                                                                                \
    }
#define SPARSE_APPLY_ALL(T)                                \
    SPARSE_APPLY(T, sparse_set_##T, v)                     \
    SPARSE_APPLY(T, sparse_xor_##T, cur ^ v)               \
    SPARSE_APPLY(T, sparse_add_##T, cur + d)               \
    SPARSE_APPLY(T, sparse_sub_##T, cur - d)
SPARSE_APPLY_ALL(u8)
SPARSE_APPLY_ALL(u16)
SPARSE_APPLY_ALL(u32)
SPARSE_APPLY_ALL(u64)

typedef void (*sparse_apply_fn)(u8 *, u8 *const *, u8 *const *, u64);
static const sparse_apply_fn SPARSE_APPLY_FNS[4][4] = {
    {sparse_set_u8, sparse_xor_u8, sparse_add_u8, sparse_sub_u8},
    {sparse_set_u16, sparse_xor_u16, sparse_add_u16, sparse_sub_u16},
    {sparse_set_u32, sparse_xor_u32, sparse_add_u32, sparse_sub_u32},
    {sparse_set_u64, sparse_xor_u64, sparse_add_u64, sparse_sub_u64},
};

static void sparse_apply_loop(u8 *t, int w, int op, u8 *const *gaps, u8 *const *vals, u64 count) {
    int wi = w == 1 ? 0 : w == 2 ? 1 : w == 4 ? 2 : 3;
    SPARSE_APPLY_FNS[wi][op](t, gaps, vals, count);
}

/* Sparse (FORMAT §4.2): apply `count` changes given as gap planes and value planes. Returns
 * False, without writing, when a position would fall outside the target. */
static PyObject *apply_sparse(PyObject *self, PyObject *args) {
    PyObject *ot, *og, *ov;
    int w, opc;
    unsigned long long count;
    if (!PyArg_ParseTuple(args, "OiiKOO", &ot, &w, &opc, &count, &og, &ov) || check_width(w) < 0 ||
        parse_op(opc) < 0)
        return NULL;
    Held h = {.n = 0};
    Py_ssize_t lt;
    u8 *gaps[4], *vals[8];
    u8 *t = hold(&h, ot, 1, &lt);
    if (t == NULL) goto fail;
    if (lt % w) {
        PyErr_SetString(PyExc_ValueError, "target is not a whole number of elements");
        goto fail;
    }
    if (hold_planes(&h, og, 4, (Py_ssize_t)count, 0, gaps) < 0 ||
        hold_planes(&h, ov, w, (Py_ssize_t)count, 0, vals) < 0)
        goto fail;
    int ok;
    Py_BEGIN_ALLOW_THREADS
    u64 last = last_position(gaps, count);
    ok = count == 0 || last < (u64)lt / w;
    if (ok) sparse_apply_loop(t, w, opc, gaps, vals, count);
    Py_END_ALLOW_THREADS
    release_all(&h);
    return PyBool_FromLong(ok);
fail:
    release_all(&h);
    return NULL;
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

static PyObject *gap_positions(PyObject *self, PyObject *args) {
    PyObject *og, *oo;
    unsigned long long count;
    if (!PyArg_ParseTuple(args, "KOO", &count, &og, &oo)) return NULL;
    Held h = {.n = 0};
    Py_ssize_t lo;
    u8 *gaps[4];
    if (hold_planes(&h, og, 4, (Py_ssize_t)count, 0, gaps) < 0) goto fail;
    u8 *out = hold(&h, oo, 1, &lo);
    if (out == NULL) goto fail;
    if ((u64)lo != count * 8) {
        PyErr_SetString(PyExc_ValueError, "positions buffer must hold count int64");
        goto fail;
    }
    u64 end;
    Py_BEGIN_ALLOW_THREADS
    end = positions_loop(gaps, count, (int64_t *)out);
    Py_END_ALLOW_THREADS
    release_all(&h);
    return PyLong_FromUnsignedLongLong(end);
fail:
    release_all(&h);
    return NULL;
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

static PyObject *gap_cuts(PyObject *self, PyObject *args) {
    PyObject *og, *ob, *oc, *of;
    unsigned long long count;
    if (!PyArg_ParseTuple(args, "KOOOO", &count, &og, &ob, &oc, &of)) return NULL;
    Held h = {.n = 0};
    Py_ssize_t lb, lc, lf;
    u8 *gaps[4];
    if (hold_planes(&h, og, 4, (Py_ssize_t)count, 0, gaps) < 0) goto fail;
    u8 *b = hold(&h, ob, 0, &lb), *c = b ? hold(&h, oc, 1, &lc) : NULL, *f = c ? hold(&h, of, 1, &lf) : NULL;
    if (f == NULL) goto fail;
    if (lb % 8 || lc != lb || lf != lb) {
        PyErr_SetString(PyExc_ValueError, "bounds, cuts and firsts must be int64 arrays of one length");
        goto fail;
    }
    for (Py_ssize_t i = 1; i < lb / 8; i++) {
        if (((const int64_t *)b)[i] < ((const int64_t *)b)[i - 1]) {
            PyErr_SetString(PyExc_ValueError, "bounds must ascend");
            goto fail;
        }
    }
    u64 end;
    Py_BEGIN_ALLOW_THREADS
    end = cuts_loop(gaps, count, (const int64_t *)b, (u64)lb / 8, (int64_t *)c, (int64_t *)f);
    Py_END_ALLOW_THREADS
    release_all(&h);
    return PyLong_FromUnsignedLongLong(end);
fail:
    release_all(&h);
    return NULL;
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

static PyObject *join_planes(PyObject *self, PyObject *args) {
    PyObject *op, *oo;
    int w;
    if (!PyArg_ParseTuple(args, "OiO", &op, &w, &oo) || check_width(w) < 0) return NULL;
    Held h = {.n = 0};
    Py_ssize_t lo;
    u8 *planes[8];
    u8 *out = hold(&h, oo, 1, &lo);
    if (out == NULL) goto fail;
    if (lo % w) {
        PyErr_SetString(PyExc_ValueError, "output is not a whole number of elements");
        goto fail;
    }
    if (hold_planes(&h, op, w, lo / w, 0, planes) < 0) goto fail;
    Py_BEGIN_ALLOW_THREADS
    join_loop(planes, (u64)lo / w, w, out);
    Py_END_ALLOW_THREADS
    release_all(&h);
    Py_RETURN_NONE;
fail:
    release_all(&h);
    return NULL;
}

/* ---- the tensor checksum (FORMAT §10) ------------------------------------------------ */

/* Words are bytes (1-byte elements) or little-endian u16 (wider elements); an element of
 * width w holds L = max(1, w/2) words and word h of every element feeds lane h:
 *     lane[h] = sum over elements i of (word(i, h) + C) * (2 * (start + i) + 1)  mod 2^64.
 * Blocks of ROWS rows of VEC words: accumulator j sees word j of every row. Without any
 * multiplication in the inner loop: s[j] sums the words and t[j] sums the running s[j], so
 * after the block t[j] = sum_r u(r, j) * (ROWS - r), hence sum_r u(r, j) * r = ROWS*s[j] - t[j].
 * Word (r, j) belongs to element r*VEC/L + j/L of the block and lane j % L. 32-bit
 * accumulators cannot overflow: t <= ROWS^2 * 2^16 = 2^30. */
#define VEC 16
#define ROWS 128
#define BLOCK (VEC * ROWS)

/* GCC vector extensions: eight u32 per vector (one AVX2 register, two SSE ones). */
typedef u32 v8u32 __attribute__((vector_size(32)));
typedef u16 v8u16 __attribute__((vector_size(16)));

#define CHECKSUM_BLOCK(T, V)                                                                  \
    static void checksum_block_##T(const u8 *p, u32 *restrict s_out, u32 *restrict t_out) {  \
        v8u32 s0 = {0}, s1 = {0}, t0 = {0}, t1 = {0};                                         \
        for (int r = 0; r < ROWS; r++) {                                                      \
            V lo, hi;                                                                         \
            memcpy(&lo, p + (size_t)r * VEC * sizeof(T), sizeof(V));                          \
            memcpy(&hi, p + (size_t)r * VEC * sizeof(T) + sizeof(V), sizeof(V));              \
            s0 += __builtin_convertvector(lo, v8u32);                                         \
            s1 += __builtin_convertvector(hi, v8u32);                                         \
            t0 += s0;                                                                         \
            t1 += s1;                                                                         \
        }                                                                                     \
        memcpy(s_out, &s0, 32);                                                               \
        memcpy(s_out + 8, &s1, 32);                                                           \
        memcpy(t_out, &t0, 32);                                                               \
        memcpy(t_out + 8, &t1, 32);                                                           \
    }
typedef u8 v16u8 __attribute__((vector_size(16)));
HOT static void checksum_block_u8(const u8 *p, u32 *restrict s_out, u32 *restrict t_out) {
    v8u32 s0 = {0}, s1 = {0}, t0 = {0}, t1 = {0};
    for (int r = 0; r < ROWS; r++) {
        v16u8 x;
        memcpy(&x, p + (size_t)r * VEC, sizeof(x));
        s0 += __builtin_convertvector(__builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7), v8u32);
        s1 += __builtin_convertvector(__builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15), v8u32);
        t0 += s0;
        t1 += s1;
    }
    memcpy(s_out, &s0, 32);
    memcpy(s_out + 8, &s1, 32);
    memcpy(t_out, &t0, 32);
    memcpy(t_out + 8, &t1, 32);
}
HOT CHECKSUM_BLOCK(u16, v8u16)

#ifdef WS_X86
/* GCC widens bytes to u32 lanes poorly from vector extensions; AVX2 does it in one instruction. */
__attribute__((target("avx2"))) static void checksum_block_u8_avx2(const u8 *p, u32 *restrict s_out,
                                                                    u32 *restrict t_out) {
    __m256i s0 = _mm256_setzero_si256(), s1 = s0, t0 = s0, t1 = s0;
    for (int r = 0; r < ROWS; r++) {
        __m128i x = _mm_loadu_si128((const __m128i *)(p + (size_t)r * VEC));
        s0 = _mm256_add_epi32(s0, _mm256_cvtepu8_epi32(x));
        s1 = _mm256_add_epi32(s1, _mm256_cvtepu8_epi32(_mm_srli_si128(x, 8)));
        t0 = _mm256_add_epi32(t0, s0);
        t1 = _mm256_add_epi32(t1, s1);
    }
    _mm256_storeu_si256((__m256i *)s_out, s0);
    _mm256_storeu_si256((__m256i *)(s_out + 8), s1);
    _mm256_storeu_si256((__m256i *)t_out, t0);
    _mm256_storeu_si256((__m256i *)(t_out + 8), t1);
}
#endif

static void checksum_loop(const u8 *data, u64 nwords, int wordbytes, int L, u64 start, u64 *lanes) {
    u64 m = 0, elem = start;
    const u64 per_row = VEC / L; /* elements per row */
    for (; m + BLOCK <= nwords; m += BLOCK, elem += BLOCK / L) {
        u32 s[VEC] = {0}, t[VEC] = {0};
#ifdef WS_X86
        if (wordbytes == 1 && has_avx2) checksum_block_u8_avx2(data + m, s, t);
        else
#endif
        if (wordbytes == 1) checksum_block_u8(data + m, s, t);
        else checksum_block_u16(data + 2 * m, s, t);
        for (int j = 0; j < VEC; j++) {
            /* sum over the block's words of lane j%L: u * (2 * (elem + r*per_row + j/L) + 1) */
            u64 weighted_rows = (u64)ROWS * s[j] - t[j]; /* sum_r u * r */
            lanes[j % L] += (u64)s[j] * (2 * (elem + (u64)(j / L)) + 1) + 2 * per_row * weighted_rows;
        }
    }
    for (; m < nwords; m++) {
        u64 u = wordbytes == 1 ? data[m] : (u64)data[2 * m] | ((u64)data[2 * m + 1] << 8);
        lanes[m % L] += u * (2 * (start + m / L) + 1);
    }
}

typedef struct {
    const u8 *data;
    u64 nwords, start;
    int wordbytes, L;
    u64 lanes[4];
} Part;

static void *checksum_part(void *arg) {
    Part *p = (Part *)arg;
    checksum_loop(p->data, p->nwords, p->wordbytes, p->L, p->start, p->lanes);
    return NULL;
}

/* checksum(data, width, start, constant, threads) -> tuple of L lanes (ints). Parts are split
 * at block boundaries and summed: the checksum of a concatenation is the sum of its parts'
 * checksums taken at their positions (FORMAT §10.2). */
static PyObject *checksum(PyObject *self, PyObject *args) {
    PyObject *od;
    int w, threads;
    unsigned long long start, constant;
    if (!PyArg_ParseTuple(args, "OiKKi", &od, &w, &start, &constant, &threads) || check_width(w) < 0) return NULL;
    Held h = {.n = 0};
    Py_ssize_t ld;
    const u8 *data = hold(&h, od, 0, &ld);
    if (data == NULL) return NULL;
    if (ld % w) {
        release_all(&h);
        PyErr_SetString(PyExc_ValueError, "data is not a whole number of elements");
        return NULL;
    }
    int wordbytes = w == 1 ? 1 : 2, L = w == 1 ? 1 : w / 2;
    u64 nwords = (u64)ld / wordbytes, n = (u64)ld / w;
    u64 lanes[4] = {0, 0, 0, 0};
    if (threads < 1) threads = 1;
    if (threads > 64) threads = 64;
    /* at least 8 MiB per thread: below that a thread costs more than it saves */
    u64 per = (u64)ld / threads < (8u << 20) ? 0 : nwords / threads / BLOCK * BLOCK;
    int used = per ? threads : 1;
    Py_BEGIN_ALLOW_THREADS
    Part parts[64];
    pthread_t ids[64];
    int started[64] = {0};
    for (int i = 0; i < used; i++) {
        u64 first = per * i, count = i == used - 1 ? nwords - first : per;
        parts[i] = (Part){data + first * wordbytes, count, start + first / L, wordbytes, L, {0, 0, 0, 0}};
        if (i < used - 1) started[i] = pthread_create(&ids[i], NULL, checksum_part, &parts[i]) == 0;
    }
    for (int i = 0; i < used; i++)
        if (!started[i]) checksum_part(&parts[i]);
    for (int i = 0; i < used; i++) {
        if (started[i]) pthread_join(ids[i], NULL);
        for (int j = 0; j < L; j++) lanes[j] += parts[i].lanes[j];
    }
    /* the constant's share: C * sum over i in [start, start+n) of (2i + 1) = C * ((start+n)^2 - start^2) */
    u64 end = start + n, weights = end * end - start * start;
    for (int j = 0; j < L; j++) lanes[j] += constant * weights;
    Py_END_ALLOW_THREADS
    release_all(&h);
    PyObject *out = PyTuple_New(L);
    if (out == NULL) return NULL;
    for (int j = 0; j < L; j++) {
        PyObject *v = PyLong_FromUnsignedLongLong(lanes[j]);
        if (v == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyTuple_SetItem(out, j, v);
    }
    return out;
}

/* ---- module -------------------------------------------------------------------------- */

static PyMethodDef methods[] = {
    {"count_changed", count_changed, METH_VARARGS, "count_changed(base, new, width) -> changed elements"},
    {"encode_sparse", encode_sparse, METH_VARARGS,
     "encode_sparse(base, new, width, add, cap, gap_planes, value_planes) -> changes, cap + 1 if more"},
    {"encode_dense", encode_dense, METH_VARARGS, "encode_dense(base, new, width, add, value_planes)"},
    {"split_planes", split_planes, METH_VARARGS, "split_planes(src, width, planes)"},
    {"join_planes", join_planes, METH_VARARGS, "join_planes(planes, width, out)"},
    {"gap_cuts", gap_cuts, METH_VARARGS, "gap_cuts(count, gap_planes, bounds, cuts_out, firsts_out) -> end"},
    {"apply_dense", apply_dense, METH_VARARGS, "apply_dense(target, width, op, value_planes)"},
    {"apply_sparse", apply_sparse, METH_VARARGS,
     "apply_sparse(target, width, op, count, gap_planes, value_planes) -> False if out of range"},
    {"gap_positions", gap_positions, METH_VARARGS, "gap_positions(count, gap_planes, out_int64) -> end"},
    {"checksum", checksum, METH_VARARGS, "checksum(data, width, start, constant, threads) -> lanes"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_kernels",
    .m_doc = "The codec's hot loops in C (weightsync.codec.kernels wraps them).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__kernels(void) {
#ifdef WS_X86
    __builtin_cpu_init();
    has_avx2 = __builtin_cpu_supports("avx2");
#endif
    return PyModule_Create(&module);
}
