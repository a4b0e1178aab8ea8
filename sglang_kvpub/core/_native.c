/* Optional C helpers for the hot paths of sglang_kvpub.core.hashing (see docs/native.md).
 *
 * The Python implementation in hashing.py is the reference and the fallback: this module
 * computes the same values, in one call instead of a Python loop per block.  It carries no
 * hash implementation of its own: `bind` resolves XXH3_64bits_withSeed from the xxhash
 * package's extension (already a dependency, already loaded), so both paths use the same
 * XXH3 code.  Little-endian hosts only: the module refuses to bind elsewhere.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dlfcn.h>
#include <stdint.h>
#include <string.h>

typedef uint64_t (*xxh3_seeded_fn)(const void *data, size_t len, uint64_t seed);

static xxh3_seeded_fn xxh3_seeded = NULL;

/* Stack room for one block widened from 8-byte ids; larger blocks use the heap. */
#define STACK_TOKENS 1024

static int host_is_little_endian(void) {
    const uint16_t probe = 1;
    return *(const uint8_t *)&probe == 1;
}

static PyObject *native_bind(PyObject *self, PyObject *arg) {
    const char *path = PyUnicode_AsUTF8(arg);
    if (path == NULL) {
        return NULL;
    }
    if (!host_is_little_endian()) {
        PyErr_SetString(PyExc_ImportError, "the native hashing helpers need a little-endian host");
        return NULL;
    }
    void *handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (handle == NULL) {
        PyErr_Format(PyExc_ImportError, "cannot open %s: %s", path, dlerror());
        return NULL;
    }
    void *symbol = dlsym(handle, "XXH3_64bits_withSeed");
    if (symbol == NULL) {
        PyErr_Format(PyExc_ImportError, "%s exports no XXH3_64bits_withSeed", path);
        return NULL;
    }
    /* The handle stays open for the life of the process: the symbol is used until exit. */
    xxh3_seeded = (xxh3_seeded_fn)symbol;
    Py_RETURN_NONE;
}

static int is_integer_format(const char *format) {
    if (format == NULL) {
        return 1; /* PyBUF_FORMAT not honoured: plain bytes */
    }
    if (format[0] == '@' || format[0] == '=' || format[0] == '<') {
        format++;
    }
    return format[0] != '\0' && format[1] == '\0' && strchr("bBhHiIlLqQnN", format[0]) != NULL;
}

/* Token count and id width of a 1-D contiguous integer buffer; itemsize 1 means u32 bytes. */
static int token_layout(const Py_buffer *view, Py_ssize_t *tokens, Py_ssize_t *width) {
    if (view->ndim > 1 || !is_integer_format(view->format)) {
        PyErr_SetString(PyExc_TypeError, "tokens must be u32 bytes or a 1-D integer buffer");
        return -1;
    }
    if (view->itemsize == 1) {
        if (view->len % 4 != 0) {
            PyErr_SetString(PyExc_ValueError, "u32 token bytes must be a multiple of 4 long");
            return -1;
        }
        *tokens = view->len / 4;
        *width = 4;
        return 0;
    }
    if (view->itemsize == 4 || view->itemsize == 8) {
        *tokens = view->len / view->itemsize;
        *width = view->itemsize;
        return 0;
    }
    PyErr_SetString(PyExc_TypeError, "token ids must be 4 or 8 bytes wide (or u32 bytes)");
    return -1;
}

/* A prompt's token ids, hashed a block at a time (8-byte ids widened to u32 on the way). */
typedef struct {
    Py_buffer view;
    Py_ssize_t tokens;
    Py_ssize_t width;
    Py_ssize_t block_size;
    uint64_t seed;
    uint32_t stack_block[STACK_TOKENS];
    uint32_t *widened;
} token_source;

/* Opens `source` for blocks below `end`; -1 with an exception set (nothing to release). */
static int source_open(token_source *src, PyObject *source, Py_ssize_t block_size, uint64_t seed, Py_ssize_t end) {
    if (xxh3_seeded == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "native hashing helpers are not bound");
        return -1;
    }
    if (block_size <= 0 || end < 0) {
        PyErr_Format(PyExc_ValueError, "bad block range: block_size=%zd end=%zd", block_size, end);
        return -1;
    }
    if (PyObject_GetBuffer(source, &src->view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0) {
        return -1;
    }
    src->block_size = block_size;
    src->seed = seed;
    src->widened = src->stack_block;
    if (token_layout(&src->view, &src->tokens, &src->width) != 0) {
        PyBuffer_Release(&src->view);
        return -1;
    }
    if (end > src->tokens / block_size) {
        PyErr_Format(PyExc_ValueError, "blocks up to %zd need %zd tokens, got %zd", end, end * block_size, src->tokens);
        PyBuffer_Release(&src->view);
        return -1;
    }
    if (src->width == 8 && block_size > STACK_TOKENS) {
        src->widened = PyMem_Malloc((size_t)block_size * sizeof(uint32_t));
        if (src->widened == NULL) {
            PyBuffer_Release(&src->view);
            PyErr_NoMemory();
            return -1;
        }
    }
    return 0;
}

static void source_close(token_source *src) {
    if (src->widened != src->stack_block) {
        PyMem_Free(src->widened);
    }
    PyBuffer_Release(&src->view);
}

/* The key of block `block` chained under `parent` (hashing.chain_next of its local hash). */
static uint64_t source_key(token_source *src, Py_ssize_t block, uint64_t parent) {
    const size_t block_bytes = (size_t)src->block_size * 4;
    const void *data;
    if (src->width == 4) {
        data = (const char *)src->view.buf + (size_t)block * block_bytes;
    } else {
        const uint64_t *ids = (const uint64_t *)src->view.buf + (size_t)block * (size_t)src->block_size;
        for (Py_ssize_t i = 0; i < src->block_size; i++) {
            src->widened[i] = (uint32_t)ids[i]; /* id & 0xFFFFFFFF, as hashing.tokens_u32 */
        }
        data = src->widened;
    }
    const uint64_t local = xxh3_seeded(data, block_bytes, src->seed);
    return xxh3_seeded(&local, sizeof(local), parent); /* little-endian: the 8 LE bytes */
}

/* chain_keys(tokens, block_size, seed, parent, start, end) -> list[int]
 *
 * hashing.chained_block_keys over any integer buffer: the chained keys of blocks
 * start..end-1, block `start` hanging under `parent`. */
static PyObject *native_chain_keys(PyObject *self, PyObject *args) {
    PyObject *source;
    Py_ssize_t block_size, start, end;
    unsigned long long seed, parent;
    if (!PyArg_ParseTuple(args, "OnKKnn", &source, &block_size, &seed, &parent, &start, &end)) {
        return NULL;
    }
    if (start < 0 || end < start) {
        PyErr_Format(PyExc_ValueError, "bad block range: start=%zd end=%zd", start, end);
        return NULL;
    }
    token_source src;
    if (source_open(&src, source, block_size, seed, end) != 0) {
        return NULL;
    }
    PyObject *keys = PyList_New(end - start);
    uint64_t key = parent;
    for (Py_ssize_t block = start; keys != NULL && block < end; block++) {
        key = source_key(&src, block, key);
        PyObject *value = PyLong_FromUnsignedLongLong(key);
        if (value == NULL) {
            Py_CLEAR(keys);
            break;
        }
        PyList_SET_ITEM(keys, block - start, value);
    }
    source_close(&src);
    return keys;
}

/* The workers of `held` (at most 64) that a masks value names: a value >= 0 is a worker
 * bit mask, a negative one is ~wid of a single worker (sglang_kvpub.core.index's layout). */
static int holders_within(PyObject *value, uint64_t held, uint64_t *kept) {
    int overflow = 0;
    const long long small = PyLong_AsLongLongAndOverflow(value, &overflow);
    if (small == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (overflow > 0) { /* a mask beyond 63 bits: only its low 64 can meet `held` */
        const unsigned long long low = PyLong_AsUnsignedLongLongMask(value);
        if (low == (unsigned long long)-1 && PyErr_Occurred()) {
            return -1;
        }
        *kept = held & low;
    } else if (overflow < 0) {
        *kept = 0; /* ~wid of a wid far beyond 64 */
    } else if (small >= 0) {
        *kept = held & (uint64_t)small;
    } else {
        const long long wid = ~small;
        *kept = wid < 64 ? held & ((uint64_t)1 << wid) : 0;
    }
    return 0;
}

/* npu_walk(tokens, block_size, seed, blocks, masks, held) -> (ends, depth)
 *
 * PrefixIndex's NPU walk with the hashing fused in, for workers `held` (an int below
 * 2^64): block by block, the chained key is computed and looked up in `masks`; the walk
 * stops at the first block none of the remaining workers holds, so a cold prompt hashes
 * one block.  `ends` lists (position, workers holding exactly `position` blocks) in
 * ascending position; `depth` is the deepest position (0: no worker holds block 0). */
static PyObject *native_npu_walk(PyObject *self, PyObject *args) {
    PyObject *source, *masks, *held_object;
    Py_ssize_t block_size, blocks;
    unsigned long long seed;
    if (!PyArg_ParseTuple(args, "OnKnO!O!", &source, &block_size, &seed, &blocks, &PyDict_Type, &masks, &PyLong_Type,
                          &held_object)) {
        return NULL;
    }
    const unsigned long long held_arg = PyLong_AsUnsignedLongLong(held_object); /* OverflowError past 64 bits */
    if (held_arg == (unsigned long long)-1 && PyErr_Occurred()) {
        return NULL;
    }
    token_source src;
    if (source_open(&src, source, block_size, seed, blocks) != 0) {
        return NULL;
    }
    PyObject *ends = PyList_New(0);
    uint64_t held = held_arg;
    uint64_t key = seed;
    Py_ssize_t position = 0;
    int failed = ends == NULL;
    for (Py_ssize_t block = 0; !failed && held != 0 && block < blocks; block++) {
        key = source_key(&src, block, key);
        PyObject *lookup = PyLong_FromUnsignedLongLong(key);
        if (lookup == NULL) {
            failed = 1;
            break;
        }
        PyObject *value = PyDict_GetItemWithError(masks, lookup); /* borrowed */
        Py_DECREF(lookup);
        uint64_t kept = 0;
        if (value == NULL ? PyErr_Occurred() != NULL : holders_within(value, held, &kept) != 0) {
            failed = 1;
            break;
        }
        if (kept != held) {
            if (position > 0) {
                PyObject *end = Py_BuildValue("(nK)", position, (unsigned long long)(held ^ kept));
                failed = end == NULL || PyList_Append(ends, end) != 0;
                Py_XDECREF(end);
            }
            held = kept;
        }
        if (held != 0) {
            position++;
        }
    }
    if (!failed && held != 0 && position > 0) {
        PyObject *end = Py_BuildValue("(nK)", position, (unsigned long long)held);
        failed = end == NULL || PyList_Append(ends, end) != 0;
        Py_XDECREF(end);
    }
    source_close(&src);
    if (failed) {
        Py_XDECREF(ends);
        return NULL;
    }
    PyObject *result = Py_BuildValue("(Nn)", ends, position);
    return result;
}

/* u32_from_ints(ids) -> bytes
 *
 * hashing.tokens_u32 of a list or tuple of ints: little-endian u32 bytes, each id cast
 * `& 0xFFFFFFFF` as the conductor casts it; TypeError for an item that is no integer. */
static PyObject *native_u32_from_ints(PyObject *self, PyObject *arg) {
    if (!PyList_Check(arg) && !PyTuple_Check(arg)) {
        PyErr_SetString(PyExc_TypeError, "token ids must be a list or a tuple");
        return NULL;
    }
    const Py_ssize_t count = PySequence_Fast_GET_SIZE(arg);
    PyObject **items = PySequence_Fast_ITEMS(arg);
    PyObject *out = PyBytes_FromStringAndSize(NULL, count * 4);
    if (out == NULL) {
        return NULL;
    }
    uint32_t *ids = (uint32_t *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *item = items[i];
        if (!PyLong_Check(item)) { /* numpy ints and other __index__ types, as struct takes them */
            PyObject *index = PyNumber_Index(item);
            if (index == NULL) {
                Py_DECREF(out);
                return NULL;
            }
            ids[i] = (uint32_t)PyLong_AsUnsignedLongLongMask(index);
            Py_DECREF(index);
            continue;
        }
        ids[i] = (uint32_t)PyLong_AsUnsignedLongLongMask(item); /* little-endian host */
    }
    return out;
}

/* target[rank_of[8*page + b]] = hit for each set bit b of `byte` (ranks below 0 skipped when
 * `ranked_only`); -1 with an exception set on failure. */
static int insert_page(PyObject *target, unsigned char byte, Py_ssize_t page, PyObject *hit, PyObject *rank_of,
                       int ranked_only) {
    if (8 * page + 8 > PyList_GET_SIZE(rank_of)) {
        PyErr_SetString(PyExc_IndexError, "mask names a worker beyond the index's tables");
        return -1;
    }
    for (int bit = 0; bit < 8; bit++) {
        if (!((byte >> bit) & 1)) {
            continue;
        }
        PyObject *rank = PyList_GET_ITEM(rank_of, 8 * page + bit);
        if (ranked_only) {
            const long value = PyLong_AsLong(rank);
            if (value == -1 && PyErr_Occurred()) {
                return -1;
            }
            if (value < 0) {
                continue;
            }
        }
        if (PyDict_SetItem(target, rank, hit) != 0) {
            return -1;
        }
    }
    return 0;
}

/* emit_hits(out, mask_bytes, hit, rank_of, pages) -> None
 *
 * PrefixIndex._emit_hits: every worker of a mask (its little-endian bytes; byte i is page i,
 * bit b of it worker 8*i+b) holds `hit`: out[pages[i]][rank_of[8*i+b]] = hit, the
 * per-instance dicts made as needed. */
static PyObject *native_emit_hits(PyObject *self, PyObject *args) {
    PyObject *out, *hit, *rank_of, *pages;
    Py_buffer mask;
    if (!PyArg_ParseTuple(args, "O!y*OO!O!", &PyDict_Type, &out, &mask, &hit, &PyList_Type, &rank_of, &PyList_Type,
                          &pages)) {
        return NULL;
    }
    const unsigned char *bytes = mask.buf;
    int failed = 0;
    for (Py_ssize_t page = 0; !failed && page < mask.len; page++) {
        if (bytes[page] == 0) {
            continue;
        }
        if (page >= PyList_GET_SIZE(pages)) {
            PyErr_SetString(PyExc_IndexError, "mask names a page beyond the index's tables");
            failed = 1;
            break;
        }
        PyObject *instance = PyList_GET_ITEM(pages, page);
        PyObject *ranks = PyDict_GetItemWithError(out, instance); /* borrowed */
        if (ranks == NULL && !PyErr_Occurred()) {
            ranks = PyDict_New();
            if (ranks != NULL && PyDict_SetItem(out, instance, ranks) != 0) {
                Py_CLEAR(ranks);
            }
            Py_XDECREF(ranks); /* out holds it */
        }
        failed = ranks == NULL || insert_page(ranks, bytes[page], page, hit, rank_of, 0) != 0;
    }
    PyBuffer_Release(&mask);
    if (failed) {
        return NULL;
    }
    Py_RETURN_NONE;
}

/* emit_ranks(out, mask_bytes, hit, rank_of) -> None
 *
 * PrefixIndex._emit_npu: out[rank_of[w]] = hit for every worker w of the mask (its
 * little-endian bytes) that still has a rank (rank_of[w] >= 0). */
static PyObject *native_emit_ranks(PyObject *self, PyObject *args) {
    PyObject *out, *hit, *rank_of;
    Py_buffer mask;
    if (!PyArg_ParseTuple(args, "O!y*OO!", &PyDict_Type, &out, &mask, &hit, &PyList_Type, &rank_of)) {
        return NULL;
    }
    const unsigned char *bytes = mask.buf;
    int failed = 0;
    for (Py_ssize_t page = 0; !failed && page < mask.len; page++) {
        failed = bytes[page] != 0 && insert_page(out, bytes[page], page, hit, rank_of, 1) != 0;
    }
    PyBuffer_Release(&mask);
    if (failed) {
        return NULL;
    }
    Py_RETURN_NONE;
}

/* Reads a big-endian unsigned integer of `size` bytes. */
static uint64_t read_be(const unsigned char *at, int size) {
    uint64_t value = 0;
    for (int i = 0; i < size; i++) {
        value = (value << 8) | at[i];
    }
    return value;
}

/* Decodes one msgpack integer at `at` (within `stop`) into *value; the bytes it took, or 0
 * when the item is no integer in [0, 2^32) (a negative, a float, a string...). */
static Py_ssize_t msgpack_u32(const unsigned char *at, const unsigned char *stop, uint32_t *value) {
    const unsigned char tag = *at;
    const Py_ssize_t room = stop - at;
    if (tag <= 0x7f) { /* positive fixint */
        *value = tag;
        return 1;
    }
    switch (tag) { /* the three forms token ids take, spelled out: this loop runs per id */
        case 0xcc:
            if (room < 2) return 0;
            *value = at[1];
            return 2;
        case 0xcd:
            if (room < 3) return 0;
            *value = ((uint32_t)at[1] << 8) | at[2];
            return 3;
        case 0xce:
            if (room < 5) return 0;
            *value = ((uint32_t)at[1] << 24) | ((uint32_t)at[2] << 16) | ((uint32_t)at[3] << 8) | at[4];
            return 5;
        default:
            break;
    }
    int size;
    int is_signed = 0;
    switch (tag) {
        case 0xcf: size = 8; break;
        case 0xd0: size = 1; is_signed = 1; break;
        case 0xd1: size = 2; is_signed = 1; break;
        case 0xd2: size = 4; is_signed = 1; break;
        case 0xd3: size = 8; is_signed = 1; break;
        default: return 0;
    }
    if (room < 1 + size) {
        return 0;
    }
    const uint64_t raw = read_be(at + 1, size);
    if ((is_signed && (raw >> (size * 8 - 1)) & 1) || raw > 0xFFFFFFFFull) {
        return 0; /* negative, or beyond u32 */
    }
    *value = (uint32_t)raw;
    return 1 + size;
}

static const unsigned char *msgpack_skip(const unsigned char *at, const unsigned char *stop);

/* The msgpack array at `at` of integers in [0, 2^32) as little-endian u32 bytes; *end set
 * past the array.  NULL with ValueError naming the first bad item; *truncated set when the
 * array runs past `stop` (malformed msgpack rather than a bad id). */
static PyObject *u32_array(const unsigned char *at, const unsigned char *stop, const unsigned char **end,
                           int *truncated) {
    *truncated = 0;
    Py_ssize_t count = -1;
    const Py_ssize_t room = stop - at;
    if (room >= 1 && (at[0] & 0xf0) == 0x90) {
        count = at[0] & 0x0f;
        at += 1;
    } else if (room >= 3 && at[0] == 0xdc) {
        count = (Py_ssize_t)read_be(at + 1, 2);
        at += 3;
    } else if (room >= 5 && at[0] == 0xdd) {
        count = (Py_ssize_t)read_be(at + 1, 4);
        at += 5;
    }
    if (count < 0) {
        PyErr_SetString(PyExc_ValueError, "token_ids must be an array");
        return NULL;
    }
    if (count > stop - at) { /* every item takes at least one byte */
        *truncated = 1;
        PyErr_SetString(PyExc_ValueError, "token_ids: truncated array");
        return NULL;
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, count * 4);
    if (out == NULL) {
        return NULL;
    }
    uint32_t *ids = (uint32_t *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < count; i++) {
        uint32_t value = 0;
        const Py_ssize_t taken = at < stop ? msgpack_u32(at, stop, &value) : 0;
        if (taken == 0) {
            *truncated = at >= stop || msgpack_skip(at, stop) == NULL;
            if (*truncated) {
                PyErr_SetString(PyExc_ValueError, "token_ids: truncated array");
            } else {
                PyErr_Format(PyExc_ValueError, "token_ids[%zd] must be an integer in [0, 2^32)", i);
            }
            Py_DECREF(out);
            return NULL;
        }
        ids[i] = value; /* little-endian host (checked by bind) */
        at += taken;
    }
    *end = at;
    return out;
}

/* u32_from_msgpack(raw) -> bytes
 *
 * One msgpack array of integers in [0, 2^32) (the encoded `token_ids` of a /query body)
 * as little-endian u32 bytes, without a Python int per id.  ValueError naming the first
 * bad item's index; the array must fill `raw` exactly. */
static PyObject *native_u32_from_msgpack(PyObject *self, PyObject *arg) {
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) != 0) {
        return NULL;
    }
    const unsigned char *stop = (const unsigned char *)view.buf + view.len;
    const unsigned char *end = NULL;
    int truncated;
    PyObject *out = u32_array(view.buf, stop, &end, &truncated);
    if (out != NULL && end != stop) {
        PyErr_SetString(PyExc_ValueError, "token_ids: trailing bytes after the array");
        Py_CLEAR(out);
    }
    PyBuffer_Release(&view);
    return out;
}

/* The end of the msgpack value starting at `at`, or NULL when it is malformed or runs past
 * `stop`.  Iterative: containers add their items to the count still to skip. */
static const unsigned char *msgpack_skip(const unsigned char *at, const unsigned char *stop) {
    uint64_t pending = 1;
    while (pending > 0) {
        if (at >= stop) {
            return NULL;
        }
        pending--;
        const unsigned char tag = *at++;
        uint64_t length = 0; /* payload bytes after the header */
        if (tag <= 0x7f || tag >= 0xe0 || tag == 0xc0 || tag == 0xc2 || tag == 0xc3) {
            continue;
        } else if (tag <= 0x8f) {
            pending += 2 * (uint64_t)(tag & 0x0f);
            continue;
        } else if (tag <= 0x9f) {
            pending += tag & 0x0f;
            continue;
        } else if (tag <= 0xbf) {
            length = tag & 0x1f;
        } else {
            static const int header[32] = {
                /* c0..cf */ 0, -1, 0, 0, 1, 2, 4, 1, 2, 4, 0, 0, 0, 0, 0, 0,
                /* d0..df */ 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 2, 4, 2, 4, 2, 4,
            };
            static const int fixed[32] = {
                /* c0..cf */ 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 4, 8, 1, 2, 4, 8,
                /* d0..df */ 1, 2, 4, 8, 2, 3, 5, 9, 17, 0, 0, 0, 0, 0, 0, 0,
            };
            const int size = header[tag - 0xc0];
            if (size < 0 || stop - at < size) {
                return NULL;
            }
            const uint64_t count = read_be(at, size);
            at += size;
            if (tag == 0xdc || tag == 0xdd) {
                pending += count;
                continue;
            }
            if (tag == 0xde || tag == 0xdf) {
                pending += 2 * count;
                continue;
            }
            length = count + (uint64_t)fixed[tag - 0xc0]; /* bin/str/ext: count bytes (+ ext type) */
        }
        if ((uint64_t)(stop - at) < length) {
            return NULL;
        }
        at += length;
    }
    return at;
}

/* Whether the msgpack string at `at` (within `stop`) is `name`; *end set past it. */
static int msgpack_str_is(const unsigned char *at, const unsigned char *stop, const char *name, size_t name_len,
                          const unsigned char **end) {
    *end = msgpack_skip(at, stop);
    if (*end == NULL) {
        return 0;
    }
    size_t header = 0;
    if ((at[0] & 0xe0) == 0xa0) {
        header = 1;
    } else if (at[0] == 0xd9) {
        header = 2;
    } else {
        return 0; /* not a string (or a str16/32: no field name is that long) */
    }
    return (size_t)(*end - at) == header + name_len && memcmp(at + header, name, name_len) == 0;
}

/* take_token_ids(body) -> (ids, rest)
 *
 * A msgpack /query body split in one pass: `ids` the u32 bytes of its top-level
 * "token_ids" array (u32_from_msgpack's checks, ValueError naming a bad item), `rest` the
 * body without that entry, for the struct decoder.  (None, body) as given when there is
 * nothing to take: not a map, no "token_ids" or two of them, a value that is not an array
 * (nil, a string...), or a malformed body - the struct decoder then refuses or takes it. */
static PyObject *native_take_token_ids(PyObject *self, PyObject *arg) {
    if (!PyBytes_Check(arg)) {
        PyErr_SetString(PyExc_TypeError, "body must be bytes");
        return NULL;
    }
    const unsigned char *base = (const unsigned char *)PyBytes_AS_STRING(arg);
    const unsigned char *stop = base + PyBytes_GET_SIZE(arg);
    const unsigned char *at = base;
    uint64_t entries;
    if (at < stop && (*at & 0xf0) == 0x80) {
        entries = *at & 0x0f;
        at += 1;
    } else if (stop - at >= 3 && *at == 0xde) {
        entries = read_be(at + 1, 2);
        at += 3;
    } else if (stop - at >= 5 && *at == 0xdf) {
        entries = read_be(at + 1, 4);
        at += 5;
    } else {
        return Py_BuildValue("(OO)", Py_None, arg);
    }
    const unsigned char *entries_start = at;
    const unsigned char *found = NULL, *value_end = NULL;
    PyObject *ids = NULL;
    for (uint64_t i = 0; i < entries; i++) {
        const unsigned char *key_end;
        const int is_ids = msgpack_str_is(at, stop, "token_ids", 9, &key_end);
        if (key_end == NULL || key_end >= stop || (is_ids && found != NULL)) {
            Py_XDECREF(ids);
            return Py_BuildValue("(OO)", Py_None, arg);
        }
        const unsigned char *end;
        if (is_ids && ((*key_end & 0xf0) == 0x90 || *key_end == 0xdc || *key_end == 0xdd)) {
            int truncated;
            ids = u32_array(key_end, stop, &end, &truncated); /* converted as it is scanned: one pass */
            if (ids == NULL) {
                if (!truncated) {
                    return NULL;
                }
                PyErr_Clear(); /* malformed msgpack: the struct decoder says so */
                return Py_BuildValue("(OO)", Py_None, arg);
            }
            found = at;
            value_end = end;
        } else {
            end = msgpack_skip(key_end, stop);
            if (end == NULL) {
                Py_XDECREF(ids);
                return Py_BuildValue("(OO)", Py_None, arg);
            }
            if (is_ids) {
                found = at; /* not an array: left to the struct decoder */
            }
        }
        at = end;
    }
    if (ids == NULL || at != stop) {
        Py_XDECREF(ids);
        return Py_BuildValue("(OO)", Py_None, arg);
    }
    /* rest: a map header for one entry less, then the entries before and after token_ids */
    const uint64_t left = entries - 1;
    unsigned char header[5];
    size_t header_len;
    if (left <= 15) {
        header[0] = (unsigned char)(0x80 | left);
        header_len = 1;
    } else if (left <= 0xffff) {
        header[0] = 0xde;
        header[1] = (unsigned char)(left >> 8);
        header[2] = (unsigned char)left;
        header_len = 3;
    } else {
        header[0] = 0xdf;
        for (int b = 0; b < 4; b++) {
            header[1 + b] = (unsigned char)(left >> (24 - 8 * b));
        }
        header_len = 5;
    }
    const size_t before = (size_t)(found - entries_start);
    const size_t after = (size_t)(stop - value_end);
    PyObject *rest = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(header_len + before + after));
    if (rest == NULL) {
        Py_DECREF(ids);
        return NULL;
    }
    char *out = PyBytes_AS_STRING(rest);
    memcpy(out, header, header_len);
    memcpy(out + header_len, entries_start, before);
    memcpy(out + header_len + before, value_end, after);
    return Py_BuildValue("(NN)", ids, rest);
}

static PyMethodDef native_methods[] = {
    {"bind", native_bind, METH_O, "Resolve XXH3_64bits_withSeed from the shared object at the given path."},
    {"chain_keys", native_chain_keys, METH_VARARGS,
     "chain_keys(tokens, block_size, seed, parent, start, end) -> chained block keys (list of int)."},
    {"npu_walk", native_npu_walk, METH_VARARGS,
     "npu_walk(tokens, block_size, seed, blocks, masks, held) -> (ends, depth): the NPU walk, hashing fused in."},
    {"emit_hits", native_emit_hits, METH_VARARGS,
     "emit_hits(out, mask_bytes, hit, rank_of, pages): out[pages[i]][rank_of[8*i+b]] = hit per set bit."},
    {"emit_ranks", native_emit_ranks, METH_VARARGS,
     "emit_ranks(out, mask_bytes, hit, rank_of): out[rank_of[w]] = hit per set bit w with a rank."},
    {"u32_from_ints", native_u32_from_ints, METH_O,
     "u32_from_ints(ids) -> little-endian u32 bytes of a list or tuple of ints (each cast & 0xFFFFFFFF)."},
    {"u32_from_msgpack", native_u32_from_msgpack, METH_O,
     "u32_from_msgpack(raw) -> little-endian u32 bytes of a msgpack array of integers in [0, 2^32)."},
    {"take_token_ids", native_take_token_ids, METH_O,
     "take_token_ids(body) -> (u32 bytes | None, body without token_ids): a msgpack /query body split."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT, "_native", "Optional C helpers for sglang_kvpub.core.hashing.", -1, native_methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&native_module); }
