/* weightsync.codec._kernels: the codec's hot loops in C (docs/DESIGN.md "Native core").
 *
 * Every function here mirrors a pure-numpy reference in weightsync/codec/kernels.py and
 * weightsync/codec/checksum.py; tests/codec/test_kernels.py asserts they agree bit for bit.
 * Built against the limited API (Py_LIMITED_API = 3.11) so one .abi3.so serves every
 * CPython >= 3.11. No library beyond libc and pthreads. The loops live in two headers
 * included below (one translation unit): _kernels_sum.h (the tensor checksum, FORMAT §10)
 * and _kernels_loops.h (find changes, byte planes, apply); this file is the Python side.
 *
 * Rules every entry point keeps:
 *   - arguments are parsed and buffers acquired with the GIL held; every loop runs with the
 *     GIL released (Py_BEGIN_ALLOW_THREADS), so frames decode on as many cores as threads;
 *   - lengths are checked here (ValueError) before any byte is touched: a Python caller can
 *     pass anything and never makes this code read or write outside a buffer;
 *   - data-dependent failures (a sparse position past the end) are reported as a return
 *     value checked before the first write, so the target is untouched (FORMAT §4.2).
 * Elements are little-endian unsigned integers of 1, 2, 4 or 8 bytes (FORMAT §3).
 *
 * The fused entry points (*_sums) do in one pass over the bytes what would otherwise be
 * two or three: code the changes and take the checksums of base and new; or take the
 * base's checksum, apply, and take the result's. They work through each piece in blocks
 * of SUM_BLOCK bytes, so the second and third looks at a block hit L1, not memory. The
 * sparse ones sum one side only: the checksum is linear (FORMAT §10), so the other side's
 * is the summed one moved by the changes the pass visits anyway (Coder.fix, Changes.fix).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
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
#if defined(__GNUC__)
#define ALWAYS_INLINE __attribute__((always_inline))
#else
#define ALWAYS_INLINE
#endif

#if defined(__x86_64__) && defined(__GNUC__)
#define WS_X86 1
#include <immintrin.h>
static int has_avx2; /* set once at import */
/* Dense blocks from one change in this many elements of a frame (0: never); WEIGHTSYNC_DENSE_APPLY_EVERY
 * at import, for measurements and tests. */
static long dense_apply_every = 16;
#endif

typedef uint8_t u8;
typedef uint16_t u16;
typedef uint32_t u32;
typedef uint64_t u64;

#include "_kernels_sum.h"
#include "_kernels_loops.h"

/* ---- buffers ------------------------------------------------------------------------- */

typedef struct {
    Py_buffer views[20];
    int n;
} Held;

static void release_all(Held *h) {
    for (int i = 0; i < h->n; i++) PyBuffer_Release(&h->views[i]);
    h->n = 0;
}

/* Acquire a C-contiguous buffer (writable if asked); NULL with an exception set on failure. */
static u8 *hold(Held *h, PyObject *obj, int writable, Py_ssize_t *len) {
    if (h->n >= 20) {
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

/* The pieces of a frame: any number of buffers, each a whole number of elements, and the
 * position of each one's first element within its tensor (the checksum's `start`). */
typedef struct {
    Py_ssize_t n, held;
    Py_buffer *views;
    u64 *starts;
    u64 elements; /* total */
} Pieces;

static void release_pieces(Pieces *p) {
    for (Py_ssize_t i = 0; i < p->held; i++) PyBuffer_Release(&p->views[i]);
    PyMem_Free(p->views);
    PyMem_Free(p->starts);
    *p = (Pieces){0};
}

static int hold_pieces(Pieces *p, PyObject *seq, PyObject *starts, int writable, int w) {
    *p = (Pieces){0};
    if (!PySequence_Check(seq) || !PySequence_Check(starts)) {
        PyErr_SetString(PyExc_ValueError, "pieces and starts must be sequences");
        return -1;
    }
    p->n = PySequence_Size(seq);
    if (p->n < 0) return -1;
    if (PySequence_Size(starts) != p->n) {
        PyErr_SetString(PyExc_ValueError, "one start per piece");
        return -1;
    }
    p->views = PyMem_Calloc(p->n ? (size_t)p->n : 1, sizeof(Py_buffer));
    p->starts = PyMem_Calloc(p->n ? (size_t)p->n : 1, sizeof(u64));
    if (p->views == NULL || p->starts == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    int flags = writable ? PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS : PyBUF_C_CONTIGUOUS;
    for (Py_ssize_t i = 0; i < p->n; i++) {
        PyObject *item = PySequence_GetItem(seq, i);
        if (item == NULL) return -1;
        int bad = PyObject_GetBuffer(item, &p->views[i], flags);
        Py_DECREF(item);
        if (bad < 0) return -1;
        p->held++;
        if (p->views[i].len % w) {
            PyErr_Format(PyExc_ValueError, "piece %zd is not a whole number of elements", i);
            return -1;
        }
        p->elements += (u64)p->views[i].len / w;
        PyObject *s = PySequence_GetItem(starts, i);
        if (s == NULL) return -1;
        p->starts[i] = PyLong_AsUnsignedLongLong(s);
        Py_DECREF(s);
        if (PyErr_Occurred()) return -1;
    }
    return 0;
}

static u8 *piece(const Pieces *p, Py_ssize_t i) { return (u8 *)p->views[i].buf; }
static u64 piece_elements(const Pieces *p, Py_ssize_t i, int w) { return (u64)p->views[i].len / w; }

/* ---- checksum results ----------------------------------------------------------------- */

enum { SUM_BEFORE = 1, SUM_AFTER = 2 }; /* which checksums a fused kernel takes */

/* Per piece: lanes of the bytes before (base) and after (new or result), 4 slots each. */
typedef struct {
    u64 before[4], after[4];
} PieceSums;

static PyObject *lanes_tuple(const u64 *lanes, int L) {
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

/* [(before lanes or None, after lanes or None) for each piece] */
static PyObject *sums_list(const PieceSums *sums, Py_ssize_t n, int L, int want) {
    PyObject *out = PyList_New(n);
    if (out == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *b = want & SUM_BEFORE ? lanes_tuple(sums[i].before, L) : Py_NewRef(Py_None);
        PyObject *a = want & SUM_AFTER ? lanes_tuple(sums[i].after, L) : Py_NewRef(Py_None);
        PyObject *pair = b && a ? PyTuple_Pack(2, b, a) : NULL;
        Py_XDECREF(b);
        Py_XDECREF(a);
        if (pair == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SetItem(out, i, pair);
    }
    return out;
}

static int parse_want(int want) {
    if (want >= 0 && want <= (SUM_BEFORE | SUM_AFTER)) return 0;
    PyErr_Format(PyExc_ValueError, "unknown checksum selection %d", want);
    return -1;
}

/* ---- encode -------------------------------------------------------------------------- */

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

/* encode_sparse(base, new, width, add, cap, gap_planes, value_planes) -> changes written, or
 * cap + 1 as soon as there are more than `cap` (the caller then codes the frame dense). */
static PyObject *encode_sparse(PyObject *self, PyObject *args) {
    PyObject *ob, *on, *og, *ov;
    int w, add;
    unsigned long long cap;
    if (!PyArg_ParseTuple(args, "OOipKOO", &ob, &on, &w, &add, &cap, &og, &ov) || check_width(w) < 0)
        return NULL;
    Held h = {.n = 0};
    Py_ssize_t lb, ln;
    Coder c = {.cap = cap, .k = 0, .prev = (u64)-1};
    u8 *a = hold(&h, ob, 0, &lb), *b = a ? hold(&h, on, 0, &ln) : NULL;
    if (b == NULL) goto fail;
    if (lb != ln || ln % w || (u64)ln / w > 0xFFFFFFFFull) {
        PyErr_SetString(PyExc_ValueError, "base and new must be the same whole number (< 2^32) of elements");
        goto fail;
    }
    if (hold_planes(&h, og, 4, (Py_ssize_t)cap, 1, c.gaps) < 0 || hold_planes(&h, ov, w, (Py_ssize_t)cap, 1, c.vals) < 0)
        goto fail;
    int full;
    Py_BEGIN_ALLOW_THREADS
    full = scan(a, b, (u64)ln / w, w, 0, add, &c) < 0;
    Py_END_ALLOW_THREADS
    release_all(&h);
    return PyLong_FromUnsignedLongLong(full ? cap + 1 : c.k);
fail:
    release_all(&h);
    return NULL;
}

/* A frame's base and new pieces: as many of each, pairwise of the same length (the bases writable
 * with `keep`). */
static int hold_pairs(Pieces *bases, Pieces *news, PyObject *obs, PyObject *ons, PyObject *ost, int w, int keep) {
    if (hold_pieces(bases, obs, ost, keep, w) < 0 || hold_pieces(news, ons, ost, 0, w) < 0) return -1;
    for (Py_ssize_t i = 0; i <= news->n; i++) {
        if (bases->n != news->n || (i < news->n && bases->views[i].len != news->views[i].len)) {
            PyErr_SetString(PyExc_ValueError, "one base piece of the same length per new piece");
            return -1;
        }
    }
    return 0;
}

/* Take back what a keeping scan (Coder.keep) wrote into the bases: each of its c->k changes put the
 * new value where the base's was; XOR undoes XOR, SUB undoes ADD (FORMAT §4.2). */
static void unkeep(const Pieces *bases, int w, int add, const Coder *c) {
    Changes s;
    for (int j = 0; j < 4; j++) s.gaps[j] = c->gaps[j];
    for (int j = 0; j < w; j++) s.vals[j] = c->vals[j];
    changes_start(&s, c->k);
    const sparse_run_fn run = sparse_run_for(w, add ? OP_SUB : OP_XOR);
    u64 e0 = 0;
    for (Py_ssize_t i = 0; i < bases->n; i++) {
        const u64 n = piece_elements(bases, i, w);
        run(piece(bases, i), e0, e0 + n, &s);
        e0 += n;
    }
}

/* Code the pieces as their concatenation and take their checksums in the same pass, block
 * by block. Returns -1 when there are more than c->cap changes (sums are then partial; what a
 * keeping coder wrote into the bases is taken back first, so they hold their bytes of before).
 * The base is never summed when the new bytes are: its checksum is theirs moved by the
 * changes the scan finds anyway (Coder.fix), so a pass reads each byte once and sums half
 * of them. 2-byte elements on AVX2 take the one-loop scan_sum_avx2_u16. */
static int code_pieces(const Pieces *bases, const Pieces *news, int w, int add, int want, u64 constant, Coder *c,
                       PieceSums *sums) {
    const int L = w == 1 ? 1 : w / 2;
    const u64 per = SUM_BLOCK / w;
    const int moved = (want & SUM_BEFORE) && (want & SUM_AFTER);
    u64 e0 = 0;
    for (Py_ssize_t i = 0; i < news->n; i++) {
        const u8 *a = piece(bases, i), *b = piece(news, i);
        const u64 n = piece_elements(news, i, w), start = news->starts[i];
        u64 fix[4] = {0, 0, 0, 0};
        c->fix = moved ? fix : NULL;
        c->woff = start - e0; /* checksum position = frame position + woff (mod 2^64) */
#ifdef WS_X86
        if (has_avx2 && w == 2 && (want & SUM_AFTER)) {
            if (scan_sum_avx2_u16(a, b, n, e0, add, c, start, sums[i].after) < 0) goto full;
        } else
#endif
        for (u64 off = 0; off < n; off += per) {
            u64 m = n - off < per ? n - off : per;
            if ((want & SUM_BEFORE) && !moved) sum_range(a + off * w, m, w, start + off, sums[i].before);
            if (want & SUM_AFTER) sum_range(b + off * w, m, w, start + off, sums[i].after);
            if (scan(a + off * w, b + off * w, m, w, e0 + off, add, c) < 0) goto full;
        }
        if (moved)
            for (int j = 0; j < L; j++) sums[i].before[j] = sums[i].after[j] + fix[j];
        sum_constant(start, n, constant, L, sums[i].before);
        sum_constant(start, n, constant, L, sums[i].after);
        e0 += n;
    }
    return 0;
full:
    if (c->keep) unkeep(bases, w, add, c);
    return -1;
}

/* encode_sparse_sums(bases, news, starts, width, add, cap, gap_planes, value_planes, constant,
 * want, keep) -> (changes, sums): `encode_sparse` of the concatenated pieces plus, per piece, the
 * checksum (FORMAT §10, first element at its start) of the base and/or new bytes as `want`
 * selects; (cap + 1, None) when there are more than `cap` changes. With `keep`, the (writable)
 * bases hold the new bytes afterwards, each change written as it is coded; unless there were
 * more than `cap` changes: the bases are then as they were. */
static PyObject *encode_sparse_sums(PyObject *self, PyObject *args) {
    PyObject *obs, *ons, *ost, *og, *ov;
    int w, add, want, keep = 0;
    unsigned long long cap, constant;
    if (!PyArg_ParseTuple(args, "OOOipKOOKi|p", &obs, &ons, &ost, &w, &add, &cap, &og, &ov, &constant, &want,
                          &keep) ||
        check_width(w) < 0 || parse_want(want) < 0)
        return NULL;
    Held h = {.n = 0};
    Pieces bases = {0}, news = {0};
    PieceSums *sums = NULL;
    Coder c = {.cap = cap, .k = 0, .prev = (u64)-1, .keep = keep};
    PyObject *out = NULL;
    if (hold_pairs(&bases, &news, obs, ons, ost, w, keep) < 0) goto done;
    if (news.elements > 0xFFFFFFFFull) {
        PyErr_SetString(PyExc_ValueError, "a sparse frame holds fewer than 2^32 elements");
        goto done;
    }
    if (hold_planes(&h, og, 4, (Py_ssize_t)cap, 1, c.gaps) < 0 || hold_planes(&h, ov, w, (Py_ssize_t)cap, 1, c.vals) < 0)
        goto done;
    if ((sums = PyMem_Calloc(news.n ? (size_t)news.n : 1, sizeof(PieceSums))) == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    int full;
    Py_BEGIN_ALLOW_THREADS
    full = code_pieces(&bases, &news, w, add, want, constant, &c, sums) < 0;
    Py_END_ALLOW_THREADS
    if (full) {
        out = Py_BuildValue("(KO)", cap + 1, Py_None);
    } else {
        PyObject *list = sums_list(sums, news.n, w == 1 ? 1 : w / 2, want);
        out = list ? Py_BuildValue("(KN)", (unsigned long long)c.k, list) : NULL;
    }
done:
    PyMem_Free(sums);
    release_pieces(&bases);
    release_pieces(&news);
    release_all(&h);
    return out;
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

/* Dense values of the pieces (their concatenation) with their checksums, block by block. */
static void code_dense_pieces(const Pieces *bases, const Pieces *news, int w, int add, int want, u64 constant,
                              u8 *const *planes, PieceSums *sums, int keep) {
    const int L = w == 1 ? 1 : w / 2;
    const u64 per = SUM_BLOCK / w;
    u64 e0 = 0;
    for (Py_ssize_t i = 0; i < news->n; i++) {
        const u8 *a = piece(bases, i), *b = piece(news, i);
        const u64 n = piece_elements(news, i, w), start = news->starts[i];
        for (u64 off = 0; off < n; off += per) {
            const u64 m = n - off < per ? n - off : per;
            u8 *at[8];
            for (int j = 0; j < w; j++) at[j] = planes[j] + e0 + off;
            if (want & SUM_BEFORE) sum_range(a + off * w, m, w, start + off, sums[i].before);
            if (want & SUM_AFTER) sum_range(b + off * w, m, w, start + off, sums[i].after);
            dense_loop(a + off * w, b + off * w, m, w, add, at);
            if (keep) memcpy((u8 *)a + off * w, b + off * w, m * w); /* the block is in cache */
        }
        sum_constant(start, n, constant, L, sums[i].before);
        sum_constant(start, n, constant, L, sums[i].after);
        e0 += n;
    }
}

/* encode_dense_sums(bases, news, starts, width, add, value_planes, constant, want, keep) -> per
 * piece (before lanes or None, after lanes or None): `encode_dense` of the concatenated
 * pieces (planes of their total length) with the pieces' checksums, in one pass; with `keep`,
 * the (writable) bases hold the new bytes afterwards, each block copied while it is in cache. */
static PyObject *encode_dense_sums(PyObject *self, PyObject *args) {
    PyObject *obs, *ons, *ost, *op;
    int w, add, want, keep = 0;
    unsigned long long constant;
    if (!PyArg_ParseTuple(args, "OOOipOKi|p", &obs, &ons, &ost, &w, &add, &op, &constant, &want, &keep) ||
        check_width(w) < 0 || parse_want(want) < 0)
        return NULL;
    Held h = {.n = 0};
    Pieces bases = {0}, news = {0};
    PieceSums *sums = NULL;
    u8 *planes[8];
    PyObject *out = NULL;
    if (hold_pairs(&bases, &news, obs, ons, ost, w, keep) < 0) goto done;
    if (hold_planes(&h, op, w, (Py_ssize_t)news.elements, 1, planes) < 0) goto done;
    if ((sums = PyMem_Calloc(news.n ? (size_t)news.n : 1, sizeof(PieceSums))) == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    code_dense_pieces(&bases, &news, w, add, want, constant, planes, sums, keep);
    Py_END_ALLOW_THREADS
    out = sums_list(sums, news.n, w == 1 ? 1 : w / 2, want);
done:
    PyMem_Free(sums);
    release_pieces(&bases);
    release_pieces(&news);
    release_all(&h);
    return out;
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

/* apply_sparse(target, width, op, count, gap_planes, value_planes) -> False, without
 * writing, when a position would fall outside the target (FORMAT §4.2). */
static PyObject *apply_sparse(PyObject *self, PyObject *args) {
    PyObject *ot, *og, *ov;
    int w, opc;
    unsigned long long count;
    if (!PyArg_ParseTuple(args, "OiiKOO", &ot, &w, &opc, &count, &og, &ov) || check_width(w) < 0 ||
        parse_op(opc) < 0)
        return NULL;
    Held h = {.n = 0};
    Py_ssize_t lt;
    Changes s;
    u8 *t = hold(&h, ot, 1, &lt);
    if (t == NULL) goto fail;
    if (lt % w) {
        PyErr_SetString(PyExc_ValueError, "target is not a whole number of elements");
        goto fail;
    }
    if (hold_planes(&h, og, 4, (Py_ssize_t)count, 0, s.gaps) < 0 ||
        hold_planes(&h, ov, w, (Py_ssize_t)count, 0, s.vals) < 0)
        goto fail;
    int ok;
    Py_BEGIN_ALLOW_THREADS
    u64 last = last_position(s.gaps, count);
    ok = count == 0 || last < (u64)lt / w;
    if (ok) {
        changes_start(&s, count);
        sparse_run_for(w, opc)(t, 0, UINT64_MAX, &s);
    }
    Py_END_ALLOW_THREADS
    release_all(&h);
    return PyBool_FromLong(ok);
fail:
    release_all(&h);
    return NULL;
}

/* Apply gap-coded changes across the targets (consecutive pieces of one frame), taking each
 * target's checksum before and/or after in the same pass, block by block: a block is summed
 * as it comes from memory and its changes applied while it is in L1. The sum after is the
 * sum before moved by each change as it is written (Changes.fix: the checksum is linear,
 * FORMAT §10), so no byte is summed twice. */
static void apply_sparse_pieces(const Pieces *targets, int w, int op, int want, u64 constant, Changes *s,
                                PieceSums *sums) {
    const int L = w == 1 ? 1 : w / 2;
    const u64 per = SUM_BLOCK / w;
    const sparse_run_fn run = sparse_run_for(w, op);
#ifdef WS_X86
    /* Dense blocks (_kernels_loops.h) where the frame changes at least one element in DENSE_APPLY_EVERY. */
    const u64 every = dense_apply_every > 0 ? (u64)dense_apply_every : 0; /* a frame holds < 2^30 elements: no overflow below */
    const int dense = want && has_avx2 && w == 2 && op != OP_SET && every > 0 && s->count > 0 &&
                      (every >= targets->elements || s->count * every >= targets->elements);
    _Alignas(32) u16 scratch[SUM_BLOCK / 2];
#endif
    u64 e0 = 0;
    for (Py_ssize_t i = 0; i < targets->n; i++) {
        u8 *t = piece(targets, i);
        const u64 n = piece_elements(targets, i, w), start = targets->starts[i];
        if (!want) {
            run(t, e0, e0 + n, s);
            e0 += n;
            continue;
        }
#ifdef WS_X86
        if (dense) { /* the result summed from the block as written, not moved by each change */
            for (u64 off = 0; off < n; off += per) {
                const u64 m = n - off < per ? n - off : per;
                if (s->k < s->count && s->pos < e0 + off + m) {
                    memset(scratch, 0, m * 2);
                    scatter_avx2_u16(scratch, e0 + off, e0 + off + m, s, op != OP_XOR);
                    if (m == per) { /* a whole block: one pass */
                        combine_block_sums_avx2(t + off * w, scratch, start + off, op, sums[i].before, sums[i].after);
                        continue;
                    }
                    sum_range(t + off * w, m, w, start + off, sums[i].before);
                    combine_avx2_u16(t + off * w, scratch, m, op);
                    sum_range(t + off * w, m, w, start + off, sums[i].after);
                } else {
                    u64 block[1] = {0};
                    sum_range(t + off * w, m, w, start + off, block);
                    sums[i].before[0] += block[0];
                    sums[i].after[0] += block[0];
                }
            }
            sum_constant(start, n, constant, L, sums[i].before);
            sum_constant(start, n, constant, L, sums[i].after);
            e0 += n;
            continue;
        }
#endif
        u64 fix[4] = {0, 0, 0, 0};
        s->fix = fix;
        s->woff = start - e0; /* checksum position = frame position + woff (mod 2^64) */
        for (u64 off = 0; off < n; off += per) {
            const u64 m = n - off < per ? n - off : per;
            sum_range(t + off * w, m, w, start + off, sums[i].before);
            if (s->k < s->count && s->pos < e0 + off + m) run(t, e0, e0 + off + m, s);
        }
        s->fix = NULL;
        for (int j = 0; j < L; j++) sums[i].after[j] = sums[i].before[j] + fix[j];
        sum_constant(start, n, constant, L, sums[i].before);
        sum_constant(start, n, constant, L, sums[i].after);
        e0 += n;
    }
}

/* apply_sparse_sums(targets, starts, width, op, count, gap_planes, value_planes, constant,
 * want) -> per target (before lanes or None, after lanes or None), or None, without writing,
 * when a position falls past the targets' end. The changes' positions run across the
 * targets as if they were concatenated (a grouped frame applies straight into each tensor). */
static PyObject *apply_sparse_sums(PyObject *self, PyObject *args) {
    PyObject *ots, *ost, *og, *ov;
    int w, opc, want;
    unsigned long long count, constant;
    if (!PyArg_ParseTuple(args, "OOiiKOOKi", &ots, &ost, &w, &opc, &count, &og, &ov, &constant, &want) ||
        check_width(w) < 0 || parse_op(opc) < 0 || parse_want(want) < 0)
        return NULL;
    Held h = {.n = 0};
    Pieces targets = {0};
    PieceSums *sums = NULL;
    Changes s;
    PyObject *out = NULL;
    if (hold_pieces(&targets, ots, ost, 1, w) < 0) goto done;
    if (hold_planes(&h, og, 4, (Py_ssize_t)count, 0, s.gaps) < 0 ||
        hold_planes(&h, ov, w, (Py_ssize_t)count, 0, s.vals) < 0)
        goto done;
    if ((sums = PyMem_Calloc(targets.n ? (size_t)targets.n : 1, sizeof(PieceSums))) == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    int ok;
    Py_BEGIN_ALLOW_THREADS
    ok = count == 0 || last_position(s.gaps, count) < targets.elements;
    if (ok) {
        changes_start(&s, count);
        apply_sparse_pieces(&targets, w, opc, want, constant, &s, sums);
    }
    Py_END_ALLOW_THREADS
    out = ok ? sums_list(sums, targets.n, w == 1 ? 1 : w / 2, want) : Py_NewRef(Py_None);
done:
    PyMem_Free(sums);
    release_pieces(&targets);
    release_all(&h);
    return out;
}

/* Dense apply across the targets with their checksums, block by block (see apply_sparse_pieces). */
static void apply_dense_pieces(const Pieces *targets, int w, int op, int want, u64 constant, u8 *const *planes,
                               PieceSums *sums) {
    const int L = w == 1 ? 1 : w / 2;
    const u64 per = SUM_BLOCK / w;
    u64 e0 = 0;
    for (Py_ssize_t i = 0; i < targets->n; i++) {
        u8 *t = piece(targets, i);
        const u64 n = piece_elements(targets, i, w), start = targets->starts[i];
        for (u64 off = 0; off < n; off += per) {
            const u64 m = n - off < per ? n - off : per;
            u8 *at[8];
            for (int j = 0; j < w; j++) at[j] = planes[j] + e0 + off;
            if (want & SUM_BEFORE) sum_range(t + off * w, m, w, start + off, sums[i].before);
            dense_apply_loop(t + off * w, m, w, op, at);
            if (want & SUM_AFTER) sum_range(t + off * w, m, w, start + off, sums[i].after);
        }
        sum_constant(start, n, constant, L, sums[i].before);
        sum_constant(start, n, constant, L, sums[i].after);
        e0 += n;
    }
}

/* dense_apply_every([n]) -> the setting before; with n, sets it (tests and measurements compare the two
 * ways of applying a sparse frame; 0 keeps every frame on the sparse loops). */
static PyObject *dense_apply_every_fn(PyObject *self, PyObject *args) {
    long n = -1;
    if (!PyArg_ParseTuple(args, "|l", &n)) return NULL;
    if (n < -1) {
        PyErr_SetString(PyExc_ValueError, "dense_apply_every takes n >= 0");
        return NULL;
    }
#ifdef WS_X86
    const long before = dense_apply_every;
    if (n >= 0) dense_apply_every = n;
    return PyLong_FromLong(before);
#else
    return PyLong_FromLong(0);
#endif
}

/* apply_dense_sums(targets, starts, width, op, value_planes, constant, want) -> per target
 * (before lanes or None, after lanes or None); the planes hold one value per element of the
 * concatenated targets. */
static PyObject *apply_dense_sums(PyObject *self, PyObject *args) {
    PyObject *ots, *ost, *op;
    int w, opc, want;
    unsigned long long constant;
    if (!PyArg_ParseTuple(args, "OOiiOKi", &ots, &ost, &w, &opc, &op, &constant, &want) || check_width(w) < 0 ||
        parse_op(opc) < 0 || parse_want(want) < 0)
        return NULL;
    Held h = {.n = 0};
    Pieces targets = {0};
    PieceSums *sums = NULL;
    u8 *planes[8];
    PyObject *out = NULL;
    if (hold_pieces(&targets, ots, ost, 1, w) < 0) goto done;
    if (hold_planes(&h, op, w, (Py_ssize_t)targets.elements, 0, planes) < 0) goto done;
    if ((sums = PyMem_Calloc(targets.n ? (size_t)targets.n : 1, sizeof(PieceSums))) == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    apply_dense_pieces(&targets, w, opc, want, constant, planes, sums);
    Py_END_ALLOW_THREADS
    out = sums_list(sums, targets.n, w == 1 ? 1 : w / 2, want);
done:
    PyMem_Free(sums);
    release_pieces(&targets);
    release_all(&h);
    return out;
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

/* Bounds (int64, ascending from 0) of a frame's n >= 1 pieces, from a buffer of n int64. */
static const int64_t *piece_bounds(u8 *b, Py_ssize_t lb, Py_ssize_t stride) {
    const int64_t *bounds = (const int64_t *)b;
    const Py_ssize_t n = lb / (8 * stride);
    if (n == 0 || bounds[0] != 0) {
        PyErr_SetString(PyExc_ValueError, "bounds must start at 0");
        return NULL;
    }
    for (Py_ssize_t i = 1; i < n; i++) {
        if (bounds[i * stride] < bounds[(i - 1) * stride]) {
            PyErr_SetString(PyExc_ValueError, "bounds must ascend");
            return NULL;
        }
    }
    return bounds;
}

/* piece_changes(count, gap_planes, value_planes, width, add, bounds, offsets, positions_out,
 * operands_out, cuts_out) -> end: a delta frame's changes as its pieces' (pieces_loop), with
 * the GIL released: bounds and offsets int64 of one length n >= 1, bounds ascending from 0;
 * positions_out int64[count], operands_out count elements of `width` bytes, cuts_out int64[n]. */
static PyObject *piece_changes(PyObject *self, PyObject *args) {
    PyObject *og, *ov, *ob, *oo, *op, *ox, *oc;
    unsigned long long count;
    int w, add;
    if (!PyArg_ParseTuple(args, "KOOiiOOOOO", &count, &og, &ov, &w, &add, &ob, &oo, &op, &ox, &oc) ||
        check_width(w) < 0)
        return NULL;
    Held h = {.n = 0};
    Py_ssize_t lb, lo, lp, lx, lc;
    u8 *gaps[4], *planes[8];
    if (hold_planes(&h, og, 4, (Py_ssize_t)count, 0, gaps) < 0 ||
        hold_planes(&h, ov, w, (Py_ssize_t)count, 0, planes) < 0)
        goto fail;
    u8 *b = hold(&h, ob, 0, &lb), *o = b ? hold(&h, oo, 0, &lo) : NULL, *p = o ? hold(&h, op, 1, &lp) : NULL;
    u8 *x = p ? hold(&h, ox, 1, &lx) : NULL, *c = x ? hold(&h, oc, 1, &lc) : NULL;
    if (c == NULL) goto fail;
    if (lb == 0 || lb % 8 || lo != lb || lc != lb) {
        PyErr_SetString(PyExc_ValueError, "bounds, offsets and cuts must be int64 arrays of one length, at least 1");
        goto fail;
    }
    if ((u64)lp != count * 8 || (u64)lx != count * (u64)w) {
        PyErr_SetString(PyExc_ValueError, "positions must hold count int64 and operands count elements");
        goto fail;
    }
    const int64_t *bounds = piece_bounds(b, lb, 1);
    if (bounds == NULL) goto fail;
    u64 end;
    Py_BEGIN_ALLOW_THREADS
    end = pieces_loop(gaps, planes, count, w, add, bounds, (const int64_t *)o, (u64)lb / 8, (int64_t *)p, x,
                      (int64_t *)c);
    Py_END_ALLOW_THREADS
    release_all(&h);
    return PyLong_FromUnsignedLongLong(end);
fail:
    release_all(&h);
    return NULL;
}

/* piece_blocks(count, gap_planes, bounds, offsets, counts_out, nblocks_out, first_out, last_out) -> end:
 * per piece its changes and the blocks of 2^16 tensor elements holding them (blocks_loop). */
static PyObject *piece_blocks(PyObject *self, PyObject *args) {
    PyObject *og, *ob, *oo, *o1, *o2, *o3, *o4;
    unsigned long long count;
    if (!PyArg_ParseTuple(args, "KOOOOOOO", &count, &og, &ob, &oo, &o1, &o2, &o3, &o4)) return NULL;
    Held h = {.n = 0};
    Py_ssize_t lb, lo, l1, l2, l3, l4;
    u8 *gaps[4];
    if (hold_planes(&h, og, 4, (Py_ssize_t)count, 0, gaps) < 0) goto fail;
    u8 *b = hold(&h, ob, 0, &lb), *o = b ? hold(&h, oo, 0, &lo) : NULL;
    u8 *c1 = o ? hold(&h, o1, 1, &l1) : NULL, *c2 = c1 ? hold(&h, o2, 1, &l2) : NULL;
    u8 *c3 = c2 ? hold(&h, o3, 1, &l3) : NULL, *c4 = c3 ? hold(&h, o4, 1, &l4) : NULL;
    if (c4 == NULL) goto fail;
    if (lb % 8 || lo != lb || l1 != lb || l2 != lb || l3 != lb || l4 != lb) {
        PyErr_SetString(PyExc_ValueError, "bounds, offsets and the outputs must be int64 arrays of one length");
        goto fail;
    }
    const int64_t *bounds = piece_bounds(b, lb, 1);
    if (bounds == NULL) goto fail;
    u64 end;
    Py_BEGIN_ALLOW_THREADS
    end = blocks_loop(gaps, count, bounds, (const int64_t *)o, (u64)lb / 8, (int64_t *)c1, (int64_t *)c2,
                      (int64_t *)c3, (int64_t *)c4);
    Py_END_ALLOW_THREADS
    release_all(&h);
    return PyLong_FromUnsignedLongLong(end);
fail:
    release_all(&h);
    return NULL;
}

/* stage_pieces(count, gap_planes, value_planes, width, add, table, buf, carry_out) -> 0, 1 or 2:
 * each piece's staged change written into buf where its row of `table` (n x T_COLUMNS int64) says
 * (stage_loop). Every row's regions are checked to lie within buf before a byte is written; 0 if
 * the frame's changes do not match the rows' counts (buf then holds a partial write), 2 if a
 * staged operand is zero, else 1. */
static PyObject *stage_pieces(PyObject *self, PyObject *args) {
    PyObject *og, *ov, *ot, *ob, *oc;
    unsigned long long count;
    int w, add;
    if (!PyArg_ParseTuple(args, "KOOiiOOO", &count, &og, &ov, &w, &add, &ot, &ob, &oc) || check_width(w) < 0)
        return NULL;
    Held h = {.n = 0};
    Py_ssize_t lt, lb, lc;
    u8 *gaps[4], *planes[8];
    if (hold_planes(&h, og, 4, (Py_ssize_t)count, 0, gaps) < 0 ||
        hold_planes(&h, ov, w, (Py_ssize_t)count, 0, planes) < 0)
        goto fail;
    u8 *t = hold(&h, ot, 0, &lt), *buf = t ? hold(&h, ob, 1, &lb) : NULL, *c = buf ? hold(&h, oc, 1, &lc) : NULL;
    if (c == NULL) goto fail;
    if (lt % (8 * T_COLUMNS) || lc * T_COLUMNS != lt) {
        PyErr_SetString(PyExc_ValueError, "the table must be int64 rows of T_COLUMNS, carry one int64 per row");
        goto fail;
    }
    const Py_ssize_t n = lt / (8 * T_COLUMNS);
    const int64_t *table = (const int64_t *)t;
    if (piece_bounds(t, lt, T_COLUMNS) == NULL) goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        const int64_t *r = table + i * T_COLUMNS, m = r[T_MODE];
        if (m < STAGE_SKIP || m > STAGE_POS64) {
            PyErr_Format(PyExc_ValueError, "unknown staging mode %lld", (long long)m);
            goto fail;
        }
        if (m == STAGE_SKIP) continue;
        const int blocked = m == STAGE_BLOCKS32 || m == STAGE_BLOCKS64;
        const int64_t pw = blocked ? 2 : m == STAGE_POS32 ? 4 : 8, bw = m == STAGE_BLOCKS32 ? 4 : 8;
        const int64_t nc = r[T_CHANGES], ns = blocked ? r[T_SLOTS] : 0;
        const int64_t lim = (int64_t)lb;
        if (nc < 0 || ns < 0 || nc > lim || ns > lim || r[T_OPS] < 0 || r[T_POS] < 0 || r[T_OPS] > lim - nc * w ||
            r[T_POS] > lim - nc * pw ||
            (blocked && (r[T_BLOCKS] < 0 || r[T_COUNTS] < 0 || r[T_BLOCKS] > lim - ns * bw ||
                         r[T_COUNTS] > lim - ns * 8))) {
            PyErr_Format(PyExc_ValueError, "piece %zd's staging regions lie outside the buffer", i);
            goto fail;
        }
    }
    int ok;
    Py_BEGIN_ALLOW_THREADS
    ok = stage_loop(gaps, planes, count, w, add, table, (u64)n, buf, (int64_t *)c);
    Py_END_ALLOW_THREADS
    release_all(&h);
    return PyLong_FromLong(ok);
fail:
    release_all(&h);
    return NULL;
}

/* unzigzag(src, width, out): out = the wrapping differences the zigzag values of src code. */
static PyObject *unzigzag_values(PyObject *self, PyObject *args) {
    PyObject *os, *oo;
    int w;
    if (!PyArg_ParseTuple(args, "OiO", &os, &w, &oo) || check_width(w) < 0) return NULL;
    Held h = {.n = 0};
    Py_ssize_t ls, lo;
    u8 *src = hold(&h, os, 0, &ls), *out = src ? hold(&h, oo, 1, &lo) : NULL;
    if (out == NULL) goto fail;
    if (ls != lo || ls % w) {
        PyErr_SetString(PyExc_ValueError, "src and out must hold the same whole number of elements");
        goto fail;
    }
    Py_BEGIN_ALLOW_THREADS
    unzigzag_loop(src, (u64)ls / w, w, out);
    Py_END_ALLOW_THREADS
    release_all(&h);
    Py_RETURN_NONE;
fail:
    release_all(&h);
    return NULL;
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

typedef struct {
    const u8 *data;
    u64 n, start;
    int w;
    u64 lanes[4];
} Part;

static void *checksum_part(void *arg) {
    Part *p = (Part *)arg;
    sum_range(p->data, p->n, p->w, p->start, p->lanes);
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
    const int L = w == 1 ? 1 : w / 2;
    const u64 n = (u64)ld / w, per_block = SUM_BLOCK / w;
    u64 lanes[4] = {0, 0, 0, 0};
    if (threads < 1) threads = 1;
    if (threads > 64) threads = 64;
    /* at least 8 MiB per thread: below that a thread costs more than it saves */
    u64 per = (u64)ld / threads < (8u << 20) ? 0 : n / threads / per_block * per_block;
    int used = per ? threads : 1;
    Py_BEGIN_ALLOW_THREADS
    Part parts[64];
    pthread_t ids[64];
    int started[64] = {0};
    for (int i = 0; i < used; i++) {
        u64 first = per * i, count = i == used - 1 ? n - first : per;
        parts[i] = (Part){data + first * w, count, start + first, w, {0, 0, 0, 0}};
        if (i < used - 1) started[i] = pthread_create(&ids[i], NULL, checksum_part, &parts[i]) == 0;
    }
    for (int i = 0; i < used; i++)
        if (!started[i]) checksum_part(&parts[i]);
    for (int i = 0; i < used; i++) {
        if (started[i]) pthread_join(ids[i], NULL);
        for (int j = 0; j < L; j++) lanes[j] += parts[i].lanes[j];
    }
    sum_constant(start, n, constant, L, lanes);
    Py_END_ALLOW_THREADS
    release_all(&h);
    return lanes_tuple(lanes, L);
}

/* ---- module -------------------------------------------------------------------------- */

/* memory_views(addresses, lengths) -> [memoryview]: a writable byte view of each span of raw memory,
 * which the caller keeps alive while the views are used (the views own nothing). Targets for the
 * *_sums applies made from tensors' addresses: ~0.1 us a span, against ~2 us for a numpy view
 * that keeps its tensor alive. */
static PyObject *memory_views(PyObject *self, PyObject *args) {
    PyObject *oa, *ol;
    if (!PyArg_ParseTuple(args, "OO", &oa, &ol)) return NULL;
    if (!PySequence_Check(oa) || !PySequence_Check(ol)) {
        PyErr_SetString(PyExc_ValueError, "addresses and lengths must be sequences");
        return NULL;
    }
    const Py_ssize_t n = PySequence_Size(oa);
    if (n < 0) return NULL;
    if (PySequence_Size(ol) != n) {
        PyErr_SetString(PyExc_ValueError, "one length per address");
        return NULL;
    }
    PyObject *out = PyList_New(n);
    if (out == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *a = PySequence_GetItem(oa, i), *l = a == NULL ? NULL : PySequence_GetItem(ol, i);
        if (l == NULL) {
            Py_XDECREF(a);
            goto fail;
        }
        unsigned long long address = PyLong_AsUnsignedLongLong(a);
        Py_ssize_t length = PyLong_AsSsize_t(l);
        Py_DECREF(a);
        Py_DECREF(l);
        if (PyErr_Occurred()) goto fail;
        if (length < 0 || (address == 0 && length > 0)) {
            PyErr_Format(PyExc_ValueError, "span %zd: no memory of %zd bytes at address %llu", i, length, address);
            goto fail;
        }
        static char empty[1];
        PyObject *view = PyMemoryView_FromMemory(length ? (char *)(uintptr_t)address : empty, length, PyBUF_WRITE);
        if (view == NULL || PyList_SetItem(out, i, view) < 0) goto fail;
    }
    return out;
fail:
    Py_DECREF(out);
    return NULL;
}

/* same_spans(a, b, lengths) -> bytes: byte i is 1 when the lengths[i] bytes at address a[i] equal
 * those at address b[i] (memcmp: it stops at the first difference), else 0. Each argument is a
 * buffer of native u64 (numpy uint64 arrays); the caller keeps the memory alive and in bounds. The
 * encoder's compare of many small segments with their bases in one call (~10 us of Python a
 * segment before), with the GIL released. */
static PyObject *same_spans(PyObject *self, PyObject *args) {
    Py_buffer a, b, l;
    if (!PyArg_ParseTuple(args, "y*y*y*", &a, &b, &l)) return NULL;
    PyObject *out = NULL;
    if (a.len != b.len || a.len != l.len || a.len % 8) {
        PyErr_SetString(PyExc_ValueError, "same_spans: three u64 buffers of one length");
        goto done;
    }
    const Py_ssize_t n = a.len / 8;
    out = PyBytes_FromStringAndSize(NULL, n);
    if (out == NULL) goto done;
    {
        char *o = PyBytes_AsString(out);
        const u64 *pa = a.buf, *pb = b.buf, *pl = l.buf;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++)
            o[i] = pl[i] == 0 || memcmp((const void *)(uintptr_t)pa[i], (const void *)(uintptr_t)pb[i], pl[i]) == 0;
        Py_END_ALLOW_THREADS
    }
done:
    PyBuffer_Release(&a);
    PyBuffer_Release(&b);
    PyBuffer_Release(&l);
    return out;
}

static PyMethodDef methods[] = {
    {"count_changed", count_changed, METH_VARARGS, "count_changed(base, new, width) -> changed elements"},
    {"encode_sparse", encode_sparse, METH_VARARGS,
     "encode_sparse(base, new, width, add, cap, gap_planes, value_planes) -> changes, cap + 1 if more"},
    {"encode_sparse_sums", encode_sparse_sums, METH_VARARGS,
     "encode_sparse_sums(bases, news, starts, width, add, cap, gap_planes, value_planes, constant, want, keep=False)"
     " -> (changes, [(base lanes, new lanes)]), (cap + 1, None) if more"},
    {"encode_dense", encode_dense, METH_VARARGS, "encode_dense(base, new, width, add, value_planes)"},
    {"encode_dense_sums", encode_dense_sums, METH_VARARGS,
     "encode_dense_sums(bases, news, starts, width, add, value_planes, constant, want, keep=False) -> [(before, after)]"},
    {"split_planes", split_planes, METH_VARARGS, "split_planes(src, width, planes)"},
    {"join_planes", join_planes, METH_VARARGS, "join_planes(planes, width, out)"},
    {"unzigzag", unzigzag_values, METH_VARARGS, "unzigzag(src, width, out)"},
    {"gap_cuts", gap_cuts, METH_VARARGS, "gap_cuts(count, gap_planes, bounds, cuts_out, firsts_out) -> end"},
    {"apply_dense", apply_dense, METH_VARARGS, "apply_dense(target, width, op, value_planes)"},
    {"apply_dense_sums", apply_dense_sums, METH_VARARGS,
     "apply_dense_sums(targets, starts, width, op, value_planes, constant, want) -> [(before, after)]"},
    {"apply_sparse", apply_sparse, METH_VARARGS,
     "apply_sparse(target, width, op, count, gap_planes, value_planes) -> False if out of range"},
    {"dense_apply_every", dense_apply_every_fn, METH_VARARGS,
     "dense_apply_every([n]) -> the setting before: dense blocks from one change in n elements (0: never)"},
    {"apply_sparse_sums", apply_sparse_sums, METH_VARARGS,
     "apply_sparse_sums(targets, starts, width, op, count, gap_planes, value_planes, constant, want)"
     " -> [(before, after)], None if out of range"},
    {"gap_positions", gap_positions, METH_VARARGS, "gap_positions(count, gap_planes, out_int64) -> end"},
    {"piece_blocks", piece_blocks, METH_VARARGS,
     "piece_blocks(count, gap_planes, bounds, offsets, counts, nblocks, first, last) -> end"},
    {"stage_pieces", stage_pieces, METH_VARARGS,
     "stage_pieces(count, gap_planes, value_planes, width, add, table, buf, carry) -> 0, 1 or 2"},
    {"piece_changes", piece_changes, METH_VARARGS,
     "piece_changes(count, gap_planes, value_planes, width, add, bounds, offsets, positions, operands, cuts) -> end"},
    {"checksum", checksum, METH_VARARGS, "checksum(data, width, start, constant, threads) -> lanes"},
    {"memory_views", memory_views, METH_VARARGS, "memory_views(addresses, lengths) -> [writable memoryview]"},
    {"same_spans", same_spans, METH_VARARGS, "same_spans(a_addresses, b_addresses, lengths) -> bytes of 0/1"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_kernels",
    .m_doc = "The codec's hot loops in C (weightsync.codec.kernels wraps them).",
    .m_size = -1,
    .m_methods = methods,
};

/* WEIGHTSYNC_KERNELS_PORTABLE=1 selects the portable loops on an AVX2 host, so the tests
 * run both (the module's AVX2 attribute says which were picked). */
PyMODINIT_FUNC PyInit__kernels(void) {
    int avx2 = 0;
#ifdef WS_X86
    __builtin_cpu_init();
    const char *portable = getenv("WEIGHTSYNC_KERNELS_PORTABLE");
    has_avx2 = __builtin_cpu_supports("avx2") && !(portable && strcmp(portable, "1") == 0);
    avx2 = has_avx2;
    const char *every = getenv("WEIGHTSYNC_DENSE_APPLY_EVERY");
    if (every != NULL && *every) dense_apply_every = strtol(every, NULL, 10);
#endif
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && (PyModule_AddIntConstant(m, "AVX2", avx2) < 0 ||
                      PyModule_AddIntConstant(m, "STAGE_BITS", STAGE_BITS) < 0 ||
                      PyModule_AddIntConstant(m, "STAGE_COLUMNS", T_COLUMNS) < 0)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
