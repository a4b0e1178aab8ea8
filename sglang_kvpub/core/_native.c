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
#include <structmember.h>

#include <dlfcn.h>
#include <math.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <stdint.h>
#include <string.h>

#include "rank_cost.h"

typedef uint64_t (*xxh3_seeded_fn)(const void *data, size_t len, uint64_t seed);

static xxh3_seeded_fn xxh3_seeded = NULL;

/* XXH3-128's value as the xxhash package returns it (low and high halves, by value). */
typedef struct {
    uint64_t low64;
    uint64_t high64;
} xxh3_128_value;
typedef xxh3_128_value (*xxh3_128_seeded_fn)(const void *data, size_t len, uint64_t seed);

static xxh3_128_seeded_fn xxh3_128_seeded = NULL;

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
    /* The plain (not the runtime-dispatched) entry point: the dispatched one picks AVX-512
     * where the CPU has it, which costs a server more per request (see body_key). */
    void *symbol_128 = dlsym(handle, "XXH3_128bits_withSeed");
    if (symbol_128 == NULL) {
        PyErr_Format(PyExc_ImportError, "%s exports no XXH3_128bits_withSeed", path);
        return NULL;
    }
    /* The handle stays open for the life of the process: the symbols are used until exit. */
    xxh3_seeded = (xxh3_seeded_fn)symbol;
    xxh3_128_seeded = (xxh3_128_seeded_fn)symbol_128;
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

/* ids[i] & 0xFFFFFFFF, as hashing.tokens_u32; restrict pointers and locals only, so the
 * compiler vectorises it (the struct's own u32 buffer would otherwise alias every store). */
static void narrow_ids(uint32_t *restrict out, const uint64_t *restrict ids, Py_ssize_t count) {
    for (Py_ssize_t i = 0; i < count; i++) {
        out[i] = (uint32_t)ids[i];
    }
}

/* The key of block `block` chained under `parent` (hashing.chain_next of its local hash). */
static uint64_t source_key(token_source *src, Py_ssize_t block, uint64_t parent) {
    const size_t block_bytes = (size_t)src->block_size * 4;
    const void *data;
    if (src->width == 4) {
        data = (const char *)src->view.buf + (size_t)block * block_bytes;
    } else {
        const uint64_t *ids = (const uint64_t *)src->view.buf + (size_t)block * (size_t)src->block_size;
        narrow_ids(src->widened, ids, src->block_size);
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

/* ------------------------------------------------------------------ KeyMasks
 *
 * KeyMasks(): a dict (key -> holders, PrefixIndex's layout) that keeps, beside itself, an
 * open-addressing table of key -> the low 64 worker bits of its holders.  npu_walk reads
 * that table: one probe of 16-byte slots per block, with no int object made for the key
 * and none read for the value, where a dict lookup touches its index, its entry, the key
 * object and the value object.  Every write path keeps both in step ([]=, del, pop,
 * clear); the writes that would bypass it (update, setdefault, popitem, |=) raise. */

typedef struct {
    uint64_t key;
    uint64_t held; /* 0: empty slot (a key whose low 64 bits hold no worker is not kept) */
} key_slot;

typedef struct {
    PyDictObject dict;
    key_slot *slots;
    size_t capacity; /* a power of two, or 0 */
    size_t used;
    int shift; /* 64 - log2(capacity) */
} KeyMasksObject;

static PyTypeObject KeyMasksType;

#define KEYMASKS_MIN_CAPACITY 64

static inline size_t slot_home(uint64_t key, int shift) { return (size_t)((key * 0x9E3779B97F4A7C15ULL) >> shift); }

/* Blocks hashed ahead of their probe in npu_walk's table path. */
#define WALK_AHEAD 8

static inline void keymasks_prefetch(const KeyMasksObject *table, uint64_t key) {
    if (table->capacity != 0) {
        __builtin_prefetch(&table->slots[slot_home(key, table->shift)]);
    }
}

static uint64_t keymasks_lookup(const KeyMasksObject *table, uint64_t key) {
    if (table->capacity == 0) {
        return 0;
    }
    const size_t mask = table->capacity - 1;
    for (size_t i = slot_home(key, table->shift);; i = (i + 1) & mask) {
        const key_slot *slot = &table->slots[i];
        if (slot->held == 0) {
            return 0;
        }
        if (slot->key == key) {
            return slot->held;
        }
    }
}

/* Inserts or replaces; the table has room (see keymasks_reserve). */
static void keymasks_put(KeyMasksObject *table, uint64_t key, uint64_t held) {
    const size_t mask = table->capacity - 1;
    for (size_t i = slot_home(key, table->shift);; i = (i + 1) & mask) {
        key_slot *slot = &table->slots[i];
        if (slot->held == 0) {
            slot->key = key;
            slot->held = held;
            table->used++;
            return;
        }
        if (slot->key == key) {
            slot->held = held;
            return;
        }
    }
}

/* Removes `key` if present, shifting the run after it back (no tombstones). */
static void keymasks_remove(KeyMasksObject *table, uint64_t key) {
    if (table->capacity == 0) {
        return;
    }
    const size_t mask = table->capacity - 1;
    size_t hole = slot_home(key, table->shift);
    for (;; hole = (hole + 1) & mask) {
        if (table->slots[hole].held == 0) {
            return;
        }
        if (table->slots[hole].key == key) {
            break;
        }
    }
    for (size_t next = (hole + 1) & mask; table->slots[next].held != 0; next = (next + 1) & mask) {
        const size_t home = slot_home(table->slots[next].key, table->shift);
        /* The entry at `next` may fill the hole unless its home lies cyclically in (hole, next]. */
        const int stays = hole <= next ? (home > hole && home <= next) : (home > hole || home <= next);
        if (!stays) {
            table->slots[hole] = table->slots[next];
            hole = next;
        }
    }
    table->slots[hole].held = 0;
    table->slots[hole].key = 0;
    table->used--;
}

#define HUGE_PAGE (2u << 20)

/* Zeroed slots; a table of 2 MiB or more is aligned to and advised for huge pages, so a
 * probe costs a cache miss and not a TLB miss as well. */
static key_slot *table_alloc(size_t capacity) {
    const size_t bytes = capacity * sizeof(key_slot);
    void *memory = NULL;
    if (posix_memalign(&memory, bytes >= HUGE_PAGE ? HUGE_PAGE : 64, bytes) != 0) {
        return NULL;
    }
#ifdef MADV_HUGEPAGE
    if (bytes >= HUGE_PAGE) {
        (void)madvise(memory, bytes, MADV_HUGEPAGE); /* advice only: THP may be off */
    }
#endif
    memset(memory, 0, bytes);
    return memory;
}

/* Room for one more entry at a load of at most 0.7; -1 with MemoryError. */
static int keymasks_reserve(KeyMasksObject *table) {
    if ((table->used + 1) * 10 <= table->capacity * 7) {
        return 0;
    }
    const size_t capacity = table->capacity ? table->capacity * 2 : KEYMASKS_MIN_CAPACITY;
    key_slot *fresh = table_alloc(capacity);
    if (fresh == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    key_slot *old = table->slots;
    const size_t old_capacity = table->capacity;
    int shift = 64;
    for (size_t c = capacity; c > 1; c >>= 1) {
        shift--;
    }
    table->slots = fresh;
    table->capacity = capacity;
    table->shift = shift;
    table->used = 0;
    for (size_t i = 0; i < old_capacity; i++) {
        if (old[i].held != 0) {
            keymasks_put(table, old[i].key, old[i].held);
        }
    }
    free(old);
    return 0;
}

static void keymasks_drop_table(KeyMasksObject *table) {
    free(table->slots);
    table->slots = NULL;
    table->capacity = 0;
    table->used = 0;
    table->shift = 64;
}

/* The key as a u64; TypeError / OverflowError for anything else (the index's keys are u64). */
static int keymasks_key(PyObject *key, uint64_t *out) {
    if (!PyLong_Check(key)) {
        PyErr_Format(PyExc_TypeError, "KeyMasks keys are u64 ints, got %.100s", Py_TYPE(key)->tp_name);
        return -1;
    }
    const unsigned long long value = PyLong_AsUnsignedLongLong(key);
    if (value == (unsigned long long)-1 && PyErr_Occurred()) {
        return -1;
    }
    *out = value;
    return 0;
}

static int keymasks_ass_sub(PyObject *self, PyObject *key, PyObject *value) {
    KeyMasksObject *table = (KeyMasksObject *)self;
    uint64_t raw;
    if (keymasks_key(key, &raw) != 0) {
        return -1;
    }
    if (value == NULL) {
        if (PyDict_DelItem(self, key) != 0) {
            return -1;
        }
        keymasks_remove(table, raw);
        return 0;
    }
    if (!PyLong_Check(value)) {
        PyErr_Format(PyExc_TypeError, "KeyMasks values are int holders, got %.100s", Py_TYPE(value)->tp_name);
        return -1;
    }
    uint64_t held;
    if (holders_within(value, ~(uint64_t)0, &held) != 0 || (held != 0 && keymasks_reserve(table) != 0)) {
        return -1;
    }
    if (PyDict_SetItem(self, key, value) != 0) {
        return -1;
    }
    if (held != 0) {
        keymasks_put(table, raw, held);
    } else {
        keymasks_remove(table, raw);
    }
    return 0;
}

static PyObject *keymasks_pop(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 2) {
        PyErr_Format(PyExc_TypeError, "pop expected 1 or 2 arguments, got %zd", nargs);
        return NULL;
    }
    PyObject *value = PyDict_GetItemWithError(self, args[0]); /* borrowed */
    if (value == NULL) {
        if (PyErr_Occurred()) {
            return NULL;
        }
        if (nargs == 2) {
            return Py_NewRef(args[1]);
        }
        PyErr_SetObject(PyExc_KeyError, args[0]);
        return NULL;
    }
    uint64_t raw;
    if (keymasks_key(args[0], &raw) != 0) {
        return NULL;
    }
    Py_INCREF(value);
    if (PyDict_DelItem(self, args[0]) != 0) {
        Py_DECREF(value);
        return NULL;
    }
    keymasks_remove((KeyMasksObject *)self, raw);
    return value;
}

static PyObject *keymasks_clear(PyObject *self, PyObject *unused) {
    PyDict_Clear(self);
    keymasks_drop_table((KeyMasksObject *)self);
    Py_RETURN_NONE;
}

static PyObject *keymasks_refuse(PyObject *self, PyObject *args, PyObject *kwargs) {
    PyErr_SetString(PyExc_TypeError, "KeyMasks is written through [], del, pop and clear only");
    return NULL;
}

static PyObject *keymasks_refuse_binary(PyObject *self, PyObject *other) { return keymasks_refuse(self, NULL, NULL); }

static PyObject *keymasks_sizeof(PyObject *self, PyObject *unused) {
    PyObject *base = PyObject_CallMethod((PyObject *)&PyDict_Type, "__sizeof__", "O", self);
    if (base == NULL) {
        return NULL;
    }
    const Py_ssize_t dict_bytes = PyLong_AsSsize_t(base);
    Py_DECREF(base);
    if (dict_bytes == -1 && PyErr_Occurred()) {
        return NULL;
    }
    const KeyMasksObject *table = (const KeyMasksObject *)self;
    return PyLong_FromSsize_t(dict_bytes + (Py_ssize_t)(sizeof(KeyMasksObject) - sizeof(PyDictObject)) +
                              (Py_ssize_t)(table->capacity * sizeof(key_slot)));
}

/* table_get(key) -> the low 64 worker bits the table holds for `key` (0: none); for tests. */
static PyObject *keymasks_table_get(PyObject *self, PyObject *key) {
    uint64_t raw;
    if (keymasks_key(key, &raw) != 0) {
        return NULL;
    }
    return PyLong_FromUnsignedLongLong(keymasks_lookup((KeyMasksObject *)self, raw));
}

static PyObject *keymasks_table_len(PyObject *self, PyObject *unused) {
    return PyLong_FromSize_t(((KeyMasksObject *)self)->used);
}

static int keymasks_init(PyObject *self, PyObject *args, PyObject *kwargs) {
    if (PyTuple_GET_SIZE(args) != 0 || (kwargs != NULL && PyDict_GET_SIZE(kwargs) != 0)) {
        PyErr_SetString(PyExc_TypeError, "KeyMasks() takes no arguments");
        return -1;
    }
    return 0;
}

static void keymasks_dealloc(PyObject *self) {
    keymasks_drop_table((KeyMasksObject *)self);
    PyDict_Type.tp_dealloc(self);
}

static PyMethodDef keymasks_methods[] = {
    {"pop", (PyCFunction)(void (*)(void))keymasks_pop, METH_FASTCALL, "D.pop(k[, d]): removes k from both tables."},
    {"clear", keymasks_clear, METH_NOARGS, "Empties both tables."},
    {"update", (PyCFunction)(void (*)(void))keymasks_refuse, METH_VARARGS | METH_KEYWORDS, "Refused (see KeyMasks)."},
    {"setdefault", (PyCFunction)(void (*)(void))keymasks_refuse, METH_VARARGS | METH_KEYWORDS,
     "Refused (see KeyMasks)."},
    {"popitem", (PyCFunction)(void (*)(void))keymasks_refuse, METH_VARARGS | METH_KEYWORDS, "Refused (see KeyMasks)."},
    {"__sizeof__", keymasks_sizeof, METH_NOARGS, "Size of the dict and of the table beside it."},
    {"table_get", keymasks_table_get, METH_O, "table_get(key) -> the low 64 worker bits kept for key (0: none)."},
    {"table_len", keymasks_table_len, METH_NOARGS, "Entries in the table (keys with a worker below 64)."},
    {NULL, NULL, 0, NULL},
};

static PyMappingMethods keymasks_as_mapping = {
    NULL, /* mp_length: inherited */
    NULL, /* mp_subscript: inherited */
    keymasks_ass_sub,
};

static PyNumberMethods keymasks_as_number = {
    .nb_inplace_or = keymasks_refuse_binary,
};

static PyTypeObject KeyMasksType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "sglang_kvpub.core._native.KeyMasks",
    .tp_basicsize = sizeof(KeyMasksObject),
    .tp_dealloc = keymasks_dealloc,
    .tp_as_number = &keymasks_as_number,
    .tp_as_mapping = &keymasks_as_mapping,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "A dict of key -> holders with a u64 table beside it for npu_walk (see _native.c).",
    .tp_methods = keymasks_methods,
    .tp_init = keymasks_init,
};

static int insert_page(PyObject *target, unsigned char byte, Py_ssize_t page, PyObject *hit, PyObject *rank_of,
                       int ranked_only);

/* Where a walk's ends go: a list of (position, mask) when `out` is NULL, else straight
 * into out[rank_of[w]] = (position, 0, 0) (PrefixIndex._emit_npu). */
typedef struct {
    PyObject *ends;
    PyObject *out;
    PyObject *rank_of;
} walk_sink;

static int sink_end(const walk_sink *sink, Py_ssize_t position, uint64_t mask) {
    if (sink->out == NULL) {
        PyObject *end = Py_BuildValue("(nK)", position, (unsigned long long)mask);
        const int failed = end == NULL || PyList_Append(sink->ends, end) != 0;
        Py_XDECREF(end);
        return failed ? -1 : 0;
    }
    PyObject *hit = Py_BuildValue("(nii)", position, 0, 0); /* one tuple shared by the end's ranks */
    if (hit == NULL) {
        return -1;
    }
    int failed = 0;
    for (Py_ssize_t page = 0; !failed && page < 8; page++) {
        const unsigned char byte = (unsigned char)(mask >> (8 * page));
        failed = byte != 0 && insert_page(sink->out, byte, page, hit, sink->rank_of, 1) != 0;
    }
    Py_DECREF(hit);
    return failed ? -1 : 0;
}

/* The walk of npu_walk / npu_walk_ranks; the depth, or -1 with an exception set. */
static Py_ssize_t walk_core(PyObject *source, Py_ssize_t block_size, uint64_t seed, Py_ssize_t blocks, PyObject *masks,
                            PyObject *held_object, const walk_sink *sink) {
    const unsigned long long held_arg = PyLong_AsUnsignedLongLong(held_object); /* OverflowError past 64 bits */
    if (held_arg == (unsigned long long)-1 && PyErr_Occurred()) {
        return -1;
    }
    token_source src;
    if (source_open(&src, source, block_size, seed, blocks) != 0) {
        return -1;
    }
    const KeyMasksObject *table = Py_IS_TYPE(masks, &KeyMasksType) ? (const KeyMasksObject *)masks : NULL;
    uint64_t held = held_arg;
    uint64_t key = seed;
    Py_ssize_t position = 0;
    int failed = 0;
    uint64_t ahead[WALK_AHEAD]; /* table path: keys of blocks [ahead_from, ahead_from + ahead_count) */
    Py_ssize_t ahead_from = 0, ahead_count = 0;
    for (Py_ssize_t block = 0; !failed && held != 0 && block < blocks; block++) {
        uint64_t kept = 0;
        if (table != NULL) {
            if (block == ahead_from + ahead_count) {
                /* Hash a batch, prefetching each key's slot as it is known: the probes' cache
                 * misses overlap the hashing.  Block 0 alone, so a cold prompt hashes one. */
                ahead_from = block;
                ahead_count = block == 0 ? 1 : (blocks - block < WALK_AHEAD ? blocks - block : WALK_AHEAD);
                for (Py_ssize_t j = 0; j < ahead_count; j++) {
                    key = source_key(&src, block + j, key);
                    ahead[j] = key;
                    keymasks_prefetch(table, key);
                }
            }
            kept = held & keymasks_lookup(table, ahead[block - ahead_from]);
        } else {
            key = source_key(&src, block, key);
            PyObject *lookup = PyLong_FromUnsignedLongLong(key);
            if (lookup == NULL) {
                failed = 1;
                break;
            }
            PyObject *value = PyDict_GetItemWithError(masks, lookup); /* borrowed */
            Py_DECREF(lookup);
            if (value == NULL ? PyErr_Occurred() != NULL : holders_within(value, held, &kept) != 0) {
                failed = 1;
                break;
            }
        }
        if (kept != held) {
            if (position > 0) {
                failed = sink_end(sink, position, held ^ kept) != 0;
            }
            held = kept;
        }
        if (held != 0) {
            position++;
        }
    }
    if (!failed && held != 0 && position > 0) {
        failed = sink_end(sink, position, held) != 0;
    }
    source_close(&src);
    return failed ? -1 : position;
}

/* npu_walk(tokens, block_size, seed, blocks, masks, held) -> (ends, depth)
 *
 * PrefixIndex's NPU walk with the hashing fused in, for workers `held` (an int below
 * 2^64): block by block, the chained key is computed and looked up in `masks` (in its
 * table when it is a KeyMasks); the walk stops at the first block none of the remaining
 * workers holds, so a cold prompt hashes one block.  `ends` lists (position, workers
 * holding exactly `position` blocks) in ascending position; `depth` is the deepest
 * position (0: no worker holds block 0). */
static PyObject *native_npu_walk(PyObject *self, PyObject *args) {
    PyObject *source, *masks, *held_object;
    Py_ssize_t block_size, blocks;
    unsigned long long seed;
    if (!PyArg_ParseTuple(args, "OnKnO!O!", &source, &block_size, &seed, &blocks, &PyDict_Type, &masks, &PyLong_Type,
                          &held_object)) {
        return NULL;
    }
    walk_sink sink = {PyList_New(0), NULL, NULL};
    if (sink.ends == NULL) {
        return NULL;
    }
    const Py_ssize_t depth = walk_core(source, block_size, seed, blocks, masks, held_object, &sink);
    if (depth < 0) {
        Py_DECREF(sink.ends);
        return NULL;
    }
    return Py_BuildValue("(Nn)", sink.ends, depth);
}

/* npu_walk_ranks(tokens, block_size, seed, blocks, masks, held, out, rank_of) -> depth
 *
 * npu_walk with its ends emitted as PrefixIndex._emit_npu does: out[rank_of[w]] =
 * (position, 0, 0) for every worker w leaving at `position` that has a rank. */
static PyObject *native_npu_walk_ranks(PyObject *self, PyObject *args) {
    PyObject *source, *masks, *held_object;
    Py_ssize_t block_size, blocks;
    unsigned long long seed;
    walk_sink sink = {NULL, NULL, NULL};
    if (!PyArg_ParseTuple(args, "OnKnO!O!O!O!", &source, &block_size, &seed, &blocks, &PyDict_Type, &masks,
                          &PyLong_Type, &held_object, &PyDict_Type, &sink.out, &PyList_Type, &sink.rank_of)) {
        return NULL;
    }
    const Py_ssize_t depth = walk_core(source, block_size, seed, blocks, masks, held_object, &sink);
    return depth < 0 ? NULL : PyLong_FromSsize_t(depth);
}

/* ------------------------------------------------------------------ wide_walk
 *
 * The NPU walk over precomputed keys for worker masks of any width up to WIDE_WORDS_MAX
 * words (the router's index: instances x ranks workers, often past 64).  A mask is held
 * as little-endian u64 words, so a step is a dict probe and a few word ANDs, with no int
 * object made per key. */

#define WIDE_WORDS_MAX 16 /* 1024 workers */

static int wide_le_bytes(PyObject *value, unsigned char *out, Py_ssize_t size) {
#if PY_VERSION_HEX >= 0x030D0000
    const Py_ssize_t need =
        PyLong_AsNativeBytes(value, out, size, Py_ASNATIVEBYTES_LITTLE_ENDIAN | Py_ASNATIVEBYTES_UNSIGNED_BUFFER);
    if (need < 0) {
        return -1;
    }
    if (need > size) {
        PyErr_SetString(PyExc_OverflowError, "worker mask wider than the walk's words");
        return -1;
    }
    return 0;
#else
    return _PyLong_AsByteArray((PyLongObject *)value, out, (size_t)size, 1, 0);
#endif
}

static PyObject *wide_to_long(const uint64_t *words, int count) {
#if PY_VERSION_HEX >= 0x030D0000
    return PyLong_FromUnsignedNativeBytes(words, (size_t)count * 8, Py_ASNATIVEBYTES_LITTLE_ENDIAN);
#else
    return _PyLong_FromByteArray((const unsigned char *)words, (size_t)count * 8, 1, 0);
#endif
}

/* A masks value (a worker mask >= 0, or ~wid of one worker) as `count` words. */
static int wide_from_long(PyObject *value, uint64_t *out, int count) {
    int overflow = 0;
    const long long small = PyLong_AsLongLongAndOverflow(value, &overflow);
    if (small == -1 && PyErr_Occurred()) {
        return -1;
    }
    memset(out, 0, (size_t)count * 8);
    if (overflow > 0) { /* past 64 bits: CPython's converter, little-endian words */
        return wide_le_bytes(value, (unsigned char *)out, (Py_ssize_t)count * 8); /* little-endian host */
    }
    if (overflow < 0) {
        return 0; /* ~wid of a wid beyond any mask */
    }
    if (small >= 0) {
        out[0] = (uint64_t)small;
    } else if (~small < (long long)count * 64) {
        const long long wid = ~small;
        out[wid >> 6] = (uint64_t)1 << (wid & 63);
    }
    return 0;
}

static int wide_end(PyObject *ends, Py_ssize_t position, const uint64_t *mask, int count) {
    PyObject *number = wide_to_long(mask, count);
    PyObject *at = number != NULL ? PyLong_FromSsize_t(position) : NULL;
    PyObject *end = at != NULL ? PyTuple_New(2) : NULL;
    if (end == NULL) {
        Py_XDECREF(at);
        Py_XDECREF(number);
        return -1;
    }
    PyTuple_SET_ITEM(end, 0, at);
    PyTuple_SET_ITEM(end, 1, number);
    const int failed = PyList_Append(ends, end) != 0;
    Py_DECREF(end);
    return failed ? -1 : 0;
}

/* How many leading items `keys` and `prior` (lists of ints) share: by identity first (a body's
 * keys taken from a recent body's are the same objects), else by value; -1 with an exception
 * set when a comparison fails. */
static Py_ssize_t wide_common_prefix(PyObject *keys, PyObject *prior) {
    const Py_ssize_t n = Py_MIN(PyList_GET_SIZE(keys), PyList_GET_SIZE(prior));
    Py_ssize_t i = 0;
    for (; i < n; i++) {
        PyObject *a = PyList_GET_ITEM(keys, i), *b = PyList_GET_ITEM(prior, i);
        if (a == b) {
            continue;
        }
        const int same = PyObject_RichCompareBool(a, b, Py_EQ);
        if (same < 0) {
            return -1;
        }
        if (!same) {
            break;
        }
    }
    return i;
}

/* wide_walk(keys, masks, held, words[, prior_keys, prior_ends]) -> (ends, depth)
 *
 * PrefixIndex's NPU walk over the chained `keys` (a list) for the workers of `held` (an
 * int below 2^(64 * words)): `ends` is a tuple of (position, workers holding exactly
 * `position` blocks) in ascending position - hashable as it comes, the key of the index's
 * memo of walk ends - and `depth` the deepest position; the walk stops at the first key
 * none of the remaining workers holds.
 *
 * With `prior_keys` and `prior_ends` - an earlier walk's keys and ends, for the same `held`
 * over the same masks (the caller keeps them only until the index changes) - the walk
 * starts where the two lists part: the ends before that position are the prior walk's, the
 * workers still held there are those of its ends at or past it, and only the keys after
 * are probed.  The same answer as the whole walk; a new prompt that shares its leading
 * blocks with one walked just before (the next turn, a shared system prompt, a retry with a
 * new tail) pays for its own tail only. */
static PyObject *native_wide_walk(PyObject *self, PyObject *args) {
    PyObject *keys, *masks, *held_object, *prior_keys = NULL, *prior_ends = NULL;
    int count;
    if (!PyArg_ParseTuple(args, "O!O!O!i|O!O!", &PyList_Type, &keys, &PyDict_Type, &masks, &PyLong_Type, &held_object,
                          &count, &PyList_Type, &prior_keys, &PyTuple_Type, &prior_ends)) {
        return NULL;
    }
    if (count < 1 || count > WIDE_WORDS_MAX) {
        PyErr_Format(PyExc_ValueError, "words must be in [1, %d], got %d", WIDE_WORDS_MAX, count);
        return NULL;
    }
    if ((prior_keys == NULL) != (prior_ends == NULL)) {
        PyErr_SetString(PyExc_TypeError, "wide_walk takes prior_keys and prior_ends together");
        return NULL;
    }
    uint64_t held[WIDE_WORDS_MAX], holders[WIDE_WORDS_MAX], left[WIDE_WORDS_MAX];
    if (wide_from_long(held_object, held, count) != 0) {
        return NULL;
    }
    PyObject *ends = PyList_New(0);
    if (ends == NULL) {
        return NULL;
    }
    Py_ssize_t position = 0, start = 0;
    if (prior_keys != NULL) {
        start = wide_common_prefix(keys, prior_keys);
        if (start < 0) {
            goto failed;
        }
    }
    if (start > 0) {
        /* the prior walk's ends before `start` as they are; the workers of its ends at or past
         * it hold keys[:start] (the shared keys): the walk goes on from there with them */
        memset(held, 0, (size_t)count * 8);
        Py_ssize_t last = 0;
        for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(prior_ends); k++) {
            PyObject *end = PyTuple_GET_ITEM(prior_ends, k);
            Py_ssize_t at;
            if (!PyTuple_Check(end) || PyTuple_GET_SIZE(end) != 2 || !PyLong_Check(PyTuple_GET_ITEM(end, 1)) ||
                ((at = PyLong_AsSsize_t(PyTuple_GET_ITEM(end, 0))) == -1 && PyErr_Occurred()) || at <= last) {
                if (!PyErr_Occurred()) {
                    PyErr_SetString(PyExc_ValueError, "prior_ends must be a walk's ends: (position, mask) pairs, "
                                                      "positions ascending from 1");
                }
                goto failed;
            }
            last = at;
            if (at < start) {
                if (PyList_Append(ends, end) != 0) {
                    goto failed;
                }
                position = at;
                continue;
            }
            if (wide_from_long(PyTuple_GET_ITEM(end, 1), holders, count) != 0) {
                goto failed;
            }
            for (int w = 0; w < count; w++) {
                held[w] |= holders[w];
            }
        }
    }
    uint64_t any = 0;
    for (int w = 0; w < count; w++) {
        any |= held[w];
    }
    if (start > 0 && any != 0) {
        position = start; /* every held worker holds the shared keys */
    }
    const Py_ssize_t total = PyList_GET_SIZE(keys);
    for (Py_ssize_t block = start; any != 0 && block < total; block++) {
        PyObject *value = PyDict_GetItemWithError(masks, PyList_GET_ITEM(keys, block)); /* borrowed */
        if (value == NULL) {
            if (PyErr_Occurred()) {
                goto failed;
            }
            memset(holders, 0, (size_t)count * 8);
        } else if (wide_from_long(value, holders, count) != 0) {
            goto failed;
        }
        uint64_t changed = 0;
        any = 0;
        for (int w = 0; w < count; w++) {
            const uint64_t kept = held[w] & holders[w];
            left[w] = held[w] ^ kept;
            changed |= left[w];
            held[w] = kept;
            any |= kept;
        }
        if (changed != 0 && position > 0 && wide_end(ends, position, left, count) != 0) {
            goto failed;
        }
        if (any != 0) {
            position++;
        }
    }
    if (any != 0 && position > 0 && wide_end(ends, position, held, count) != 0) {
        goto failed;
    }
    PyObject *frozen = PyList_AsTuple(ends);
    Py_DECREF(ends);
    return frozen != NULL ? Py_BuildValue("(Nn)", frozen, position) : NULL;
failed:
    Py_DECREF(ends);
    return NULL;
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
        default: break;
    }
    int size;
    int is_signed = 0;
    switch (tag) {
        case 0xcf: size = 8; break;
        case 0xd0:
            size = 1;
            is_signed = 1;
            break;
        case 0xd1:
            size = 2;
            is_signed = 1;
            break;
        case 0xd2:
            size = 4;
            is_signed = 1;
            break;
        case 0xd3:
            size = 8;
            is_signed = 1;
            break;
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

/* Decodes leading ids of the forms token ids take (fixint, 0xcc, 0xcd, 0xce) into `ids`
 * while 5 bytes remain, each item's length and value computed from its tag rather than
 * switched on: the forms mix at random within a prompt, and msgpack_u32's switch per id
 * mispredicted (25 us for 6k ids, 15 this way).  Stops at the first other item
 * (msgpack_u32 takes it, or refuses it); returns the ids decoded. */
static Py_ssize_t u32_run(const unsigned char **cursor, const unsigned char *stop, uint32_t *ids, Py_ssize_t count) {
    const unsigned char *at = *cursor;
    Py_ssize_t i = 0;
    while (i < count && stop - at >= 5) {
        const uint32_t tag = at[0];
        const uint32_t form = tag - 0xcc; /* 0, 1, 2 for 0xcc, 0xcd, 0xce; wraps high otherwise */
        const uint32_t fix = tag < 0x80;
        if (!fix && form > 2) {
            break;
        }
        uint32_t word;
        memcpy(&word, at + 1, 4);
        word = (word >> 24) | ((word >> 8) & 0xff00u) | ((word << 8) & 0xff0000u) | (word << 24); /* big-endian */
        const uint32_t bits = fix ? 0 : 8u << form; /* payload bits: 0, 8, 16 or 32 */
        const uint32_t value = (uint32_t)((uint64_t)word >> (32 - bits));
        ids[i++] = fix ? tag : value;
        at += 1 + (bits >> 3);
    }
    *cursor = at;
    return i;
}

/* One item of u32_run's forms at `at` (5 bytes readable): its value in *value and its
 * length, or 0 when it is of another form. */
static inline Py_ssize_t u32_item(const unsigned char *at, uint32_t *value) {
    const uint32_t tag = at[0];
    const uint32_t form = tag - 0xcc;
    const uint32_t fix = tag < 0x80;
    if (!fix && form > 2) {
        return 0;
    }
    uint32_t word;
    memcpy(&word, at + 1, 4);
    word = (word >> 24) | ((word >> 8) & 0xff00u) | ((word << 8) & 0xff0000u) | (word << 24);
    const uint32_t bits = fix ? 0 : 8u << form;
    *value = fix ? tag : (uint32_t)((uint64_t)word >> (32 - bits));
    return 1 + (bits >> 3);
}

#define U32_SPLIT_MIN   1024 /* ids: below this one chain (u32_run) does it */
#define U32_SPLIT_PROBE 64   /* ids decoded alone first, to measure the bytes an id takes */
#define U32_SPLIT_PRIME 12   /* items a second chain's start must decode in a row */

/* Whether U32_SPLIT_PRIME items of u32_run's forms decode in a row from `at`. */
static int u32_primes(const unsigned char *at, const unsigned char *stop) {
    for (int k = 0; k < U32_SPLIT_PRIME; k++) {
        uint32_t value;
        const Py_ssize_t len = stop - at >= 5 ? u32_item(at, &value) : 0;
        if (len == 0) {
            return 0;
        }
        at += len;
    }
    return 1;
}

/* u32_run in two chains at once.  Each item's length depends on its tag, so one chain is a
 * serial dependency (load a tag, compute its length, add), whatever the core's width.  A
 * second chain starts near where the second half should begin (the first byte from which
 * U32_SPLIT_PRIME items decode), decodes speculatively into its own buffer and records where
 * each of its items starts; the first chain then runs on until it stands where the second
 * one had an item - from the same byte both decode the same items, so the second chain's
 * from there on are the array's.  If they never meet, the first chain decodes on alone: the
 * result is u32_run's exactly, only the time differs. */
static Py_ssize_t u32_run_split(const unsigned char **cursor, const unsigned char *stop, uint32_t *ids,
                                Py_ssize_t count) {
    const unsigned char *base = *cursor;
    const unsigned char *a = base;
    Py_ssize_t i = u32_run(&a, stop, ids, count < U32_SPLIT_PROBE ? count : U32_SPLIT_PROBE);
    const Py_ssize_t rest = count - i;
    const Py_ssize_t half = rest / 2;
    uint32_t *b_values = NULL;
    const unsigned char *b = NULL;
    /* fixints only (a byte an id): u32_run's branch predicts every length, nothing to gain */
    if (i == U32_SPLIT_PROBE && count >= U32_SPLIT_MIN && a - base >= 2 * i && stop - base < 0xFFFFFFF0) {
        const unsigned char *guess = a + (size_t)(a - base) * (size_t)half / (size_t)i; /* item i + half's start? */
        for (int shift = 0; shift < 16 && guess + shift < stop; shift++) {
            if (u32_primes(guess + shift, stop)) {
                b = guess + shift;
                break;
            }
        }
        if (b != NULL) {
            b_values = PyMem_Malloc((size_t)(rest - half + U32_SPLIT_PROBE) * 2 * sizeof(uint32_t));
        }
    }
    if (b_values == NULL) { /* too short, no start found (or no memory): one chain */
        i += u32_run(&a, stop, ids + i, count - i);
        *cursor = a;
        return i;
    }
    const Py_ssize_t budget = rest - half + U32_SPLIT_PROBE;
    uint32_t *b_starts = b_values + budget; /* offsets from `base` */
    const unsigned char *const b_first = b;
    Py_ssize_t nb = 0;
    int a_failed = 0;
    while (i < count && a < b_first && nb < budget && stop - b >= 5) { /* a < b_first: 5 bytes readable */
        uint32_t value;
        const Py_ssize_t a_len = u32_item(a, &value);
        if (a_len == 0) {
            a_failed = 1;
            break;
        }
        ids[i++] = value;
        a += a_len;
        const Py_ssize_t b_len = u32_item(b, &value);
        if (b_len == 0) {
            break;
        }
        b_values[nb] = value;
        b_starts[nb++] = (uint32_t)(b - base);
        b += b_len;
    }
    Py_ssize_t j = 0;
    while (!a_failed && i < count && stop - a >= 5) { /* the first chain on, until it meets the second */
        const uint32_t at = (uint32_t)(a - base);
        while (j < nb && b_starts[j] < at) {
            j++;
        }
        if (j >= nb) {
            break; /* past every item the second chain decoded: on alone */
        }
        if (b_starts[j] == at) { /* in step: the second chain's items from j are the array's */
            Py_ssize_t take = nb - j;
            if (take > count - i) {
                take = count - i;
            }
            memcpy(ids + i, b_values + j, (size_t)take * sizeof(uint32_t));
            i += take;
            a = j + take < nb ? base + b_starts[j + take] : b;
            break;
        }
        uint32_t value;
        const Py_ssize_t a_len = u32_item(a, &value);
        if (a_len == 0) {
            break;
        }
        ids[i++] = value;
        a += a_len;
    }
    PyMem_Free(b_values);
    i += u32_run(&a, stop, ids + i, count - i); /* what the second chain did not reach */
    *cursor = a;
    return i;
}

/* ------------------------------------------------------------------ wide id decode
 *
 * u32_run over 64-byte windows with AVX-512 VBMI, where the CPU has it (checked at run time;
 * the build needs no flag): the same ids, the same stopping point, 1.7x (ids of a 150k
 * vocabulary, mostly 3 and 5 bytes) to 3.4x (text-like ids, mostly 1 and 2) faster than the
 * two chains.  Per window, with no dependency on the windows before: each byte's item
 * length taken as a tag (1, 2, 3, 5; 0 for another form), jump[0][p] = p + length, and
 * jump[b] = jump[b-1] o jump[b-1] (where 2^b items from p end; positions past the window
 * stay put, an item of another form is a fixed point).  The one serial step a window is a
 * byte: the window's exit from the entry e, jump[6][e] (at most 64 items a window).  Item k
 * starts at jump[k's bits](e); each item's value is gathered from the 4 bytes ending with
 * its last one (byte-swapped, masked to its payload). */
#if defined(__x86_64__) && defined(__GNUC__) && (defined(__clang__) || __GNUC__ >= 8)
#define HAVE_WIDE_DECODE 1
#include <immintrin.h>

static int wide_decode = -1; /* -1: not looked up yet */

static int wide_decode_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("bmi");
}

__attribute__((target("avx512f,avx512bw,avx512vbmi,bmi"))) static Py_ssize_t
u32_run_wide(const unsigned char **cursor, const unsigned char *stop, uint32_t *ids, Py_ssize_t count) {
    const unsigned char *w = *cursor; /* the window; an item starts at w + e */
    Py_ssize_t i = 0;
    uint32_t e = 0;
    const __m512i lane =
        _mm512_set_epi8(63, 62, 61, 60, 59, 58, 57, 56, 55, 54, 53, 52, 51, 50, 49, 48, 47, 46, 45, 44, 43, 42, 41, 40,
                        39, 38, 37, 36, 35, 34, 33, 32, 31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16,
                        15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i beyond = _mm512_add_epi8(lane, _mm512_set1_epi8(64)); /* positions 64..127 map to themselves */
    /* by item length: the right shift of an all-ones mask that keeps its payload (0: none) */
    const __m512i shift_of_len = _mm512_set_epi32(32, 32, 32, 32, 32, 32, 32, 32, 32, 32, 0, 32, 16, 24, 24, 32);
    const __m512i back = _mm512_set1_epi32(0x03020100);
    const __m512i spread =
        _mm512_set_epi32(0x0c0c0c0c, 0x08080808, 0x04040404, 0, 0x0c0c0c0c, 0x08080808, 0x04040404, 0, 0x0c0c0c0c,
                         0x08080808, 0x04040404, 0, 0x0c0c0c0c, 0x08080808, 0x04040404, 0);
    const __mmask64 bit[6] = {0xAAAAAAAAAAAAAAAAull, 0xCCCCCCCCCCCCCCCCull, 0xF0F0F0F0F0F0F0F0ull,
                              0xFF00FF00FF00FF00ull, 0xFFFF0000FFFF0000ull, 0xFFFFFFFF00000000ull};
    unsigned char starts[64], ends[64], lens[64];
    while (i < count && stop - w >= 128) { /* the window and the next one readable: items run past it */
        const __m512i data = _mm512_loadu_si512(w);
        const __m512i next = _mm512_loadu_si512(w + 64);
        __m512i len =
            _mm512_maskz_mov_epi8(_mm512_cmplt_epu8_mask(data, _mm512_set1_epi8((char)0x80)), _mm512_set1_epi8(1));
        len =
            _mm512_mask_mov_epi8(len, _mm512_cmpeq_epi8_mask(data, _mm512_set1_epi8((char)0xcc)), _mm512_set1_epi8(2));
        len =
            _mm512_mask_mov_epi8(len, _mm512_cmpeq_epi8_mask(data, _mm512_set1_epi8((char)0xcd)), _mm512_set1_epi8(3));
        len =
            _mm512_mask_mov_epi8(len, _mm512_cmpeq_epi8_mask(data, _mm512_set1_epi8((char)0xce)), _mm512_set1_epi8(5));
        __m512i jump[7];
        jump[0] = _mm512_add_epi8(lane, len);
        for (int b = 1; b < 7; b++) {
            jump[b] = _mm512_permutex2var_epi8(jump[b - 1], jump[b - 1], beyond);
        }
        const uint64_t exits = (uint64_t)_mm_cvtsi128_si64(_mm512_castsi512_si128(jump[6])); /* from e in 0..7 */
        const uint32_t out = (uint32_t)(exits >> (8 * e)) & 0xff;
        __m512i at = _mm512_set1_epi8((char)e); /* lane k: where item k starts */
        for (int b = 0; b < 6; b++) {
            at = _mm512_mask2_permutex2var_epi8(jump[b], at, bit[b], beyond);
        }
        const __m512i len_at = _mm512_permutex2var_epi8(len, at, _mm512_setzero_si512());
        const Py_ssize_t n = (Py_ssize_t)_tzcnt_u64(~_mm512_test_epi8_mask(len_at, len_at)); /* items in the window */
        const Py_ssize_t m = n < count - i ? n : count - i;
        _mm512_storeu_si512(starts, at);
        _mm512_storeu_si512(ends, _mm512_sub_epi8(_mm512_add_epi8(at, len_at), _mm512_set1_epi8(1)));
        _mm512_storeu_si512(lens, len_at);
        for (Py_ssize_t g = 0; g < m; g += 16) {
            const __m512i end = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(ends + g)));
            const __m512i from = _mm512_sub_epi8(_mm512_shuffle_epi8(end, spread), back); /* end, end-1, end-2, end-3 */
            const __m512i item_len = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(lens + g)));
            const __m512i keep =
                _mm512_srlv_epi32(_mm512_set1_epi32(-1), _mm512_permutexvar_epi32(item_len, shift_of_len));
            const __m512i value = _mm512_and_si512(_mm512_permutex2var_epi8(data, from, next), keep);
            const Py_ssize_t left = m - g;
            _mm512_mask_storeu_epi32(ids + i + g, left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1),
                                     value);
        }
        i += m;
        if (m < n || out < 64) { /* the array's end, or an item of another form (u32_run stops there) */
            w += starts[m];
            e = 0;
            break;
        }
        e = out - 64;
        w += 64;
    }
    w += e;
    i += u32_run(&w, stop, ids + i, count - i); /* the last window's items */
    *cursor = w;
    return i;
}
#endif

/* u32_decode_wide(enabled) -> bool
 *
 * Whether the ids are decoded with AVX-512 VBMI (see u32_run_wide) after the call: None asks,
 * True turns it on where the CPU has it, False off (the two chains: a side-by-side figure,
 * and the tests check both ways agree). */
static PyObject *native_u32_decode_wide(PyObject *self, PyObject *arg) {
#ifdef HAVE_WIDE_DECODE
    if (wide_decode < 0) {
        wide_decode = wide_decode_supported();
    }
    if (arg != Py_None) {
        const int wanted = PyObject_IsTrue(arg);
        if (wanted < 0) {
            return NULL;
        }
        wide_decode = wanted && wide_decode_supported();
    }
    return PyBool_FromLong(wide_decode);
#else
    (void)arg;
    Py_RETURN_FALSE;
#endif
}

/* The leading ids of u32_run's forms: wide where the CPU allows, else in two chains. */
static Py_ssize_t u32_run_fast(const unsigned char **cursor, const unsigned char *stop, uint32_t *ids,
                               Py_ssize_t count) {
#ifdef HAVE_WIDE_DECODE
    if (wide_decode < 0) {
        wide_decode = wide_decode_supported();
    }
    if (wide_decode) {
        return u32_run_wide(cursor, stop, ids, count);
    }
#endif
    return u32_run_split(cursor, stop, ids, count);
}

/* The item count of the msgpack array at `at` (*items set past its header), or -1 when it is
 * no array. */
static Py_ssize_t msgpack_array_header(const unsigned char *at, const unsigned char *stop,
                                       const unsigned char **items) {
    const Py_ssize_t room = stop - at;
    if (room >= 1 && (at[0] & 0xf0) == 0x90) {
        *items = at + 1;
        return at[0] & 0x0f;
    }
    if (room >= 3 && at[0] == 0xdc) {
        *items = at + 3;
        return (Py_ssize_t)read_be(at + 1, 2);
    }
    if (room >= 5 && at[0] == 0xdd) {
        *items = at + 5;
        return (Py_ssize_t)read_be(at + 1, 4);
    }
    return -1;
}

/* Items `first` to `count` - 1 of an array, item `first` at `at`, as u32 into ids[first..];
 * *end set past them.  -1 with ValueError naming the first bad item by its index in the
 * array; *truncated set when the items run past `stop` (malformed msgpack rather than a bad
 * id).  `first` > 0: take_query_keys reusing a remembered body's leading blocks. */
static int u32_items(const unsigned char *at, const unsigned char *stop, Py_ssize_t first, Py_ssize_t count,
                     uint32_t *ids, const unsigned char **end, int *truncated) {
    *truncated = 0;
    for (Py_ssize_t i = first + u32_run_fast(&at, stop, ids + first, count - first); i < count; i++) { /* the rest */
        uint32_t value = 0;
        const Py_ssize_t taken = at < stop ? msgpack_u32(at, stop, &value) : 0;
        if (taken == 0) {
            *truncated = at >= stop || msgpack_skip(at, stop) == NULL;
            if (*truncated) {
                PyErr_SetString(PyExc_ValueError, "token_ids: truncated array");
            } else {
                PyErr_Format(PyExc_ValueError, "token_ids[%zd] must be an integer in [0, 2^32)", i);
            }
            return -1;
        }
        ids[i] = value; /* little-endian host (checked by bind) */
        at += taken;
    }
    *end = at;
    return 0;
}

/* The count of the msgpack array at `at` (*items set past its header), checked against the
 * bytes left: -1 with ValueError when it is no array, or (*truncated set) runs past `stop`. */
static Py_ssize_t u32_array_count(const unsigned char *at, const unsigned char *stop, const unsigned char **items,
                                  int *truncated) {
    *truncated = 0;
    const Py_ssize_t count = msgpack_array_header(at, stop, items);
    if (count < 0) {
        PyErr_SetString(PyExc_ValueError, "token_ids must be an array");
        return -1;
    }
    if (count > stop - *items) { /* every item takes at least one byte */
        *truncated = 1;
        PyErr_SetString(PyExc_ValueError, "token_ids: truncated array");
        return -1;
    }
    return count;
}

/* The msgpack array at `at` of integers in [0, 2^32) as little-endian u32 bytes; *end set
 * past the array.  NULL with ValueError naming the first bad item; *truncated set when the
 * array runs past `stop` (malformed msgpack rather than a bad id). */
static PyObject *u32_array(const unsigned char *at, const unsigned char *stop, const unsigned char **end,
                           int *truncated) {
    const Py_ssize_t count = u32_array_count(at, stop, &at, truncated);
    if (count < 0) {
        return NULL;
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, count * 4);
    if (out == NULL) {
        return NULL;
    }
    if (u32_items(at, stop, 0, count, (uint32_t *)PyBytes_AS_STRING(out), end, truncated) != 0) {
        Py_DECREF(out);
        return NULL;
    }
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

/* u32_count_msgpack(raw) -> int
 *
 * The length of one msgpack array of integers in [0, 2^32) (a stored event's `token_ids` as
 * received), every item checked as u32_from_msgpack checks it, nothing allocated: the
 * adapter's decoder keeps the ids as those bytes (wire.MsgpackIds) and reads them into u32
 * only when the index hashes them.  ValueError as u32_from_msgpack's. */
static PyObject *native_u32_count_msgpack(PyObject *self, PyObject *arg) {
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) != 0) {
        return NULL;
    }
    const unsigned char *at = view.buf;
    const unsigned char *stop = at + view.len;
    Py_ssize_t count = -1;
    if (view.len >= 1 && (at[0] & 0xf0) == 0x90) {
        count = at[0] & 0x0f;
        at += 1;
    } else if (view.len >= 3 && at[0] == 0xdc) {
        count = (Py_ssize_t)read_be(at + 1, 2);
        at += 3;
    } else if (view.len >= 5 && at[0] == 0xdd) {
        count = (Py_ssize_t)read_be(at + 1, 4);
        at += 5;
    }
    PyObject *out = NULL;
    if (count < 0) {
        PyErr_SetString(PyExc_ValueError, "token_ids must be an array");
        goto done;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        uint32_t value;
        const Py_ssize_t taken = at < stop ? msgpack_u32(at, stop, &value) : 0;
        if (taken == 0) {
            PyErr_Format(PyExc_ValueError, "token_ids[%zd] must be an integer in [0, 2^32)", i);
            goto done;
        }
        at += taken;
    }
    if (at != stop) {
        PyErr_SetString(PyExc_ValueError, "token_ids: trailing bytes after the array");
        goto done;
    }
    out = PyLong_FromSsize_t(count);
done:
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
                /* d0..df */ 0, 0,  0, 0, 0, 0, 0, 0, 0, 1, 2, 4, 2, 4, 2, 4,
            };
            static const int fixed[32] = {
                /* c0..cf */ 0, 0, 0, 0, 0, 0, 0, 1, 1,  1, 4, 8, 1, 2, 4, 8,
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

/* Whether the msgpack value from `at` to `end` is the string `name`. */
static int msgpack_str_equals(const unsigned char *at, const unsigned char *end, const char *name, size_t name_len) {
    size_t header = 0;
    if ((at[0] & 0xe0) == 0xa0) {
        header = 1;
    } else if (at[0] == 0xd9) {
        header = 2;
    } else {
        return 0; /* not a string (or a str16/32: no field name is that long) */
    }
    return (size_t)(end - at) == header + name_len && memcmp(at + header, name, name_len) == 0;
}

/* A msgpack /query body split around its top-level "token_ids" array: take_token_ids and
 * take_query_keys scan it alike, so they take, leave and refuse the same bodies. */
typedef struct {
    uint64_t entries;                       /* the map's */
    const unsigned char *entries_start;     /* past the map header */
    const unsigned char *found, *value_end; /* the token_ids entry: its key, the end of its value */
    const unsigned char *items;             /* the token_ids array's first item */
    Py_ssize_t count;                       /* ids */
    uint32_t *ids;                          /* in `ids_bytes`, or PyMem's (split_release frees it) */
    PyObject *ids_bytes;
    int block_size_seen; /* 0: no "block_size" key, 1: one, an integer in [0, 2^32), -1: anything else */
    uint32_t block_size;
} body_split;

static void split_release(body_split *split) {
    if (split->ids_bytes != NULL) {
        Py_CLEAR(split->ids_bytes);
    } else {
        PyMem_Free(split->ids);
    }
    split->ids = NULL;
}

/* ------------------------------------------------------------------ take_query_keys's memo
 *
 * Prompts that share a long prefix of token ids come in close together: a multi-turn chat
 * sends the whole conversation again with each turn, many requests share a system prompt.
 * Block keys are chained (key i hangs on every id of blocks 0..i) and msgpack items are
 * parsed in order from the array's first item, so when a body's id payload (the array's
 * items, past its header) is byte for byte a remembered body's up to where that body's
 * block j ends, blocks 0..j hold the same ids and have the same keys: take_query_keys then
 * decodes and hashes only from block j + 1 on.  A remembered body is found by its probe, the
 * XXH3 of its first MEMO_PROBE_BYTES of payload under the seed and the block size as far as
 * it is known when the ids are reached (stated before them, else the default): bodies under
 * another seed or block size do not meet.  The bytes are then compared block by block, so a
 * probe shared by chance reuses nothing it should not.  The block size is checked against
 * the remembered body's: it may be stated after the ids, and is then known only once they
 * are decoded - a body whose block size turns out another decodes the skipped ids after all. */
#define MEMO_PROBE_BYTES 1024 /* ~300 ids: what a conversation's turns, or one system prompt, share */
#define MEMO_MIN_BYTES   2048 /* shorter payloads save too little for what a lookup and an entry cost */
#define MEMO_BLOCK_BYTES                                                                                               \
    64 /* per block beside the body: its end, its key's tuple slot and int, an answer's list slot */

typedef struct {
    uint64_t stamp; /* insertion order; 0: an empty slot */
    uint64_t probe;
    uint64_t seed;
    Py_ssize_t block_size;
    Py_ssize_t payload; /* the first item's offset in `body` */
    Py_ssize_t bytes;   /* counted against max_bytes */
    PyObject *body;     /* bytes, kept as given (no copy) */
    PyObject *keys;     /* tuple: the keys of the body's full blocks */
    PyObject *ends;     /* bytes: a Py_ssize_t per full block, where its last item ends (from `payload`) */
    PyObject *answer;   /* the caller's object for these exact bytes (attach), or NULL */
} memo_entry;

typedef struct {
    PyObject_HEAD memo_entry *slots;
    Py_ssize_t capacity; /* slots: the entry bound */
    Py_ssize_t used;
    Py_ssize_t bytes;
    Py_ssize_t max_bytes;
    uint64_t stamp;
    memo_entry *last;                 /* the entry memo_remember wrote last (attach's), or NULL */
    unsigned long long hits;          /* bodies that reused a remembered body's blocks */
    unsigned long long reused_blocks; /* the blocks they reused */
    unsigned long long exact_hits;    /* bodies answered by an attached object: the same bytes again */
} QueryKeysMemoObject;

static PyTypeObject QueryKeysMemoType;

/* What one take_query_keys call found in the memo.  It holds its own references to the
 * remembered keys and ends: an allocation may run a finalizer that uses the memo. */
typedef struct {
    QueryKeysMemoObject *memo; /* NULL: no memo */
    uint64_t seed;
    Py_ssize_t default_block_size;
    uint64_t probe;
    int probed;            /* probe set: the payload is long enough to be remembered */
    Py_ssize_t reused;     /* leading full blocks taken from `keys` (0: none) */
    Py_ssize_t block_size; /* the remembered body's */
    Py_ssize_t skip;       /* the payload bytes of the reused blocks */
    PyObject *keys;
    PyObject *ends;
    PyObject *exact; /* a remembered body's attached object: these are its bytes, all of them */
} memo_reuse;

static void memo_reuse_drop(memo_reuse *reuse) {
    reuse->reused = 0;
    reuse->skip = 0;
    Py_CLEAR(reuse->keys);
    Py_CLEAR(reuse->ends);
    Py_CLEAR(reuse->exact);
}

/* The entry remembered under `probe`: in its home slot or the one after (two choices, so two
 * conversations whose probes share a home do not push each other out). */
static memo_entry *memo_find(QueryKeysMemoObject *memo, uint64_t probe, memo_entry **free_slot) {
    memo_entry *home = &memo->slots[probe % (uint64_t)memo->capacity];
    memo_entry *next = home + 1 < memo->slots + memo->capacity ? home + 1 : memo->slots;
    if (home->stamp != 0 && home->probe == probe) {
        return home;
    }
    if (next->stamp != 0 && next->probe == probe) {
        return next;
    }
    if (free_slot != NULL) { /* where a new entry goes: an empty slot, else the older one */
        *free_slot = home->stamp == 0 || (next->stamp != 0 && home->stamp < next->stamp) ? home : next;
    }
    return NULL;
}

/* Sets `reuse` to the leading full blocks of the array at `items` (`count` ids) that a
 * remembered body holds byte for byte; the id index from which to decode (0: none).  Never
 * the body's last full block: its local hash is the spread key, so it is always hashed.
 * When every block the lookup may reuse matched and the rest of the body `base`..`stop`
 * (its bytes before the ids, the last block, what follows) is the remembered body's too,
 * and an object is attached to it, `reuse->exact` holds that object: the same bytes, so
 * the same answer, with nothing decoded or hashed. */
static Py_ssize_t memo_lookup(memo_reuse *reuse, int block_size_seen, uint32_t stated_block_size,
                              const unsigned char *base, const unsigned char *items, const unsigned char *stop,
                              Py_ssize_t count) {
    if (stop - items < MEMO_MIN_BYTES || block_size_seen < 0) {
        return 0;
    }
    /* the block size as far as known: the one stated before the ids, else the default */
    const uint64_t sized = block_size_seen == 1 ? stated_block_size : (uint64_t)reuse->default_block_size;
    reuse->probe = xxh3_seeded(items, MEMO_PROBE_BYTES, reuse->seed ^ (sized * 0x9E3779B97F4A7C15ULL));
    reuse->probed = 1;
    memo_entry *entry = memo_find(reuse->memo, reuse->probe, NULL);
    if (entry == NULL || entry->seed != reuse->seed ||
        (block_size_seen == 1 && (Py_ssize_t)stated_block_size != entry->block_size)) {
        return 0;
    }
    Py_ssize_t limit = count / entry->block_size - 1;
    if (limit > PyTuple_GET_SIZE(entry->keys)) {
        limit = PyTuple_GET_SIZE(entry->keys);
    }
    const Py_ssize_t *ends = (const Py_ssize_t *)PyBytes_AS_STRING(entry->ends);
    const unsigned char *old = (const unsigned char *)PyBytes_AS_STRING(entry->body) + entry->payload;
    Py_ssize_t reused = 0, same = 0; /* blocks, and the bytes they take, found equal */
    while (reused < limit && ends[reused] <= stop - items &&
           memcmp(items + same, old + same, (size_t)(ends[reused] - same)) == 0) {
        same = ends[reused++];
    }
    if (reused == 0) {
        return 0;
    }
    const Py_ssize_t head = items - base, tail = (stop - items) - same;
    if (entry->answer != NULL && reused == limit && PyBytes_GET_SIZE(entry->body) == stop - base &&
        entry->payload == head && memcmp(base, PyBytes_AS_STRING(entry->body), (size_t)head) == 0 &&
        memcmp(items + same, old + same, (size_t)tail) == 0) {
        reuse->exact = Py_NewRef(entry->answer);
        entry->stamp = ++reuse->memo->stamp; /* asked again: the last to go */
        return 0;
    }
    reuse->reused = reused;
    reuse->block_size = entry->block_size;
    reuse->skip = same;
    reuse->keys = Py_NewRef(entry->keys);
    reuse->ends = Py_NewRef(entry->ends);
    return reused * entry->block_size;
}

/* The bytes `count` ids take in their shortest msgpack forms (fixint, 0xcc, 0xcd, 0xce). */
static inline __attribute__((always_inline)) uint32_t shortest_bytes_loop(const uint32_t *ids, Py_ssize_t count) {
    uint32_t total = 0; /* count <= 2^20: at most 5 * 2^20 */
    for (Py_ssize_t i = 0; i < count; i++) {
        const uint32_t id = ids[i];
        total += 1 + (id > 0x7f) + (id > 0xff) + 2 * (id > 0xffff);
    }
    return total;
}

#ifdef HAVE_WIDE_DECODE
/* The same loop in 16 lanes where the ids are decoded wide: a body seen the first time sums
 * every id's length, 0.45 us for 6,144 ids (1.5 in the 4 lanes of the plain build). */
__attribute__((target("avx512f,avx512bw"))) static uint32_t shortest_bytes_wide(const uint32_t *ids, Py_ssize_t count) {
    return shortest_bytes_loop(ids, count);
}
#endif

static uint32_t shortest_bytes(const uint32_t *ids, Py_ssize_t count) {
#ifdef HAVE_WIDE_DECODE
    if (wide_decode > 0) { /* looked up by the decode that just ran */
        return shortest_bytes_wide(ids, count);
    }
#endif
    return shortest_bytes_loop(ids, count);
}

/* Empties `slot` (counted out of the memo); its references are the caller's to drop. */
static memo_entry memo_take(QueryKeysMemoObject *memo, memo_entry *slot) {
    const memo_entry old = *slot;
    if (old.stamp != 0) {
        memo->used--;
        memo->bytes -= old.bytes;
    }
    if (memo->last == slot) {
        memo->last = NULL;
    }
    memset(slot, 0, sizeof(*slot));
    return old;
}

static void memo_entry_release(memo_entry *entry) {
    Py_XDECREF(entry->body);
    Py_XDECREF(entry->keys);
    Py_XDECREF(entry->ends);
    Py_XDECREF(entry->answer); /* may run a finalizer: only once the table is consistent */
}

/* Remembers `body` (taken: `split`, hashed into `keys` at `block_size`) under the probe its
 * lookup took, in place of the body remembered there.  Nothing when the payload is short,
 * the body would take more than an eighth of the byte bound, or an id is in a longer form
 * than its value needs (the ends of the blocks come from the ids' shortest forms, checked
 * against where the array ends).  Never fails: a missing allocation only leaves it out. */
static void memo_remember(memo_reuse *reuse, PyObject *body, const body_split *split, Py_ssize_t block_size,
                          PyObject *keys) {
    QueryKeysMemoObject *memo = reuse->memo;
    const Py_ssize_t blocks = PyList_GET_SIZE(keys);
    const Py_ssize_t payload_len = split->value_end - split->items;
    const Py_ssize_t bytes = PyBytes_GET_SIZE(body) + blocks * MEMO_BLOCK_BYTES;
    /* exact bytes: its release runs no finalizer, and it cannot reach the memo back */
    if (!reuse->probed || blocks < 2 || payload_len < MEMO_MIN_BYTES || bytes > memo->max_bytes / 8 ||
        !PyBytes_CheckExact(body)) {
        return;
    }
    PyObject *ends = PyBytes_FromStringAndSize(NULL, blocks * (Py_ssize_t)sizeof(Py_ssize_t));
    if (ends == NULL) {
        PyErr_Clear();
        return;
    }
    Py_ssize_t *end = (Py_ssize_t *)PyBytes_AS_STRING(ends);
    Py_ssize_t at = 0;
    if (reuse->reused > 0) { /* the same bytes as the remembered body's: its ends */
        memcpy(end, PyBytes_AS_STRING(reuse->ends), (size_t)reuse->reused * sizeof(Py_ssize_t));
        at = end[reuse->reused - 1];
    }
    for (Py_ssize_t b = reuse->reused; b < blocks; b++) {
        at += shortest_bytes(split->ids + b * block_size, block_size);
        end[b] = at;
    }
    at += shortest_bytes(split->ids + blocks * block_size, split->count - blocks * block_size);
    if (at != payload_len) {
        Py_DECREF(ends);
        return;
    }
    PyObject *key_tuple = PyList_AsTuple(keys); /* a tuple: the caller may change its list */
    if (key_tuple == NULL) {
        PyErr_Clear();
        Py_DECREF(ends);
        return;
    }
    /* from here on nothing allocates (nor runs Python code) until the table is consistent */
    memo_entry *slot = NULL;
    memo_entry *same = memo_find(memo, reuse->probe, &slot);
    memo_entry old = memo_take(memo, same != NULL ? same : slot);
    slot = same != NULL ? same : slot;
    *slot = (memo_entry){
        .stamp = ++memo->stamp,
        .probe = reuse->probe,
        .seed = reuse->seed,
        .block_size = block_size,
        .payload = split->items - (const unsigned char *)PyBytes_AS_STRING(body),
        .bytes = bytes,
        .body = Py_NewRef(body),
        .keys = key_tuple,
        .ends = ends,
    };
    memo->used++;
    memo->bytes += bytes;
    memo->last = slot;
    memo_entry_release(&old);
    while (memo->bytes > memo->max_bytes) { /* the oldest out (never the new one: it fits alone) */
        memo_entry *oldest = NULL;
        for (Py_ssize_t i = 0; i < memo->capacity; i++) {
            memo_entry *entry = &memo->slots[i];
            if (entry->stamp != 0 && entry != slot && (oldest == NULL || entry->stamp < oldest->stamp)) {
                oldest = entry;
            }
        }
        if (oldest == NULL) {
            break;
        }
        memo_entry gone = memo_take(memo, oldest);
        memo_entry_release(&gone);
    }
}

static void memo_clear_all(QueryKeysMemoObject *memo) {
    for (Py_ssize_t i = 0; memo->slots != NULL && i < memo->capacity; i++) {
        memo_entry gone = memo_take(memo, &memo->slots[i]);
        memo_entry_release(&gone);
    }
}

static PyObject *querykeysmemo_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"max_entries", "max_bytes", NULL};
    Py_ssize_t max_entries = 256;
    Py_ssize_t max_bytes = 16 << 20;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|nn:QueryKeysMemo", names, &max_entries, &max_bytes)) {
        return NULL;
    }
    if (max_entries < 1 || max_entries > (1 << 20) || max_bytes < 0) {
        PyErr_Format(PyExc_ValueError, "QueryKeysMemo needs 1 <= max_entries <= 2^20 and max_bytes >= 0, got %zd, %zd",
                     max_entries, max_bytes);
        return NULL;
    }
    QueryKeysMemoObject *memo = (QueryKeysMemoObject *)type->tp_alloc(type, 0);
    if (memo == NULL) {
        return NULL;
    }
    memo->slots = PyMem_Calloc((size_t)max_entries, sizeof(memo_entry));
    if (memo->slots == NULL) {
        Py_DECREF(memo);
        return PyErr_NoMemory();
    }
    memo->capacity = max_entries;
    memo->max_bytes = max_bytes;
    return (PyObject *)memo;
}

static void querykeysmemo_dealloc(PyObject *self) {
    QueryKeysMemoObject *memo = (QueryKeysMemoObject *)self;
    memo_clear_all(memo);
    PyMem_Free(memo->slots);
    Py_TYPE(self)->tp_free(self);
}

static Py_ssize_t querykeysmemo_length(PyObject *self) { return ((QueryKeysMemoObject *)self)->used; }

static PyObject *querykeysmemo_clear(PyObject *self, PyObject *unused) {
    memo_clear_all((QueryKeysMemoObject *)self);
    Py_RETURN_NONE;
}

/* attach(body, answer) -> bool: keeps `answer` with the body take_query_keys remembered last
 * if that is `body` (the same object), for take_query_keys to return when these exact bytes
 * come again; False (nothing kept) otherwise.  The answer must not refer back to the memo:
 * the memo is not tracked by the cycle collector. */
static PyObject *querykeysmemo_attach(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "attach takes 2 arguments (body, answer), got %zd", nargs);
        return NULL;
    }
    QueryKeysMemoObject *memo = (QueryKeysMemoObject *)self;
    memo_entry *entry = memo->last; /* NULL once its slot is emptied (memo_take) */
    if (entry == NULL || entry->body != args[0]) {
        Py_RETURN_FALSE;
    }
    PyObject *old = entry->answer;
    entry->answer = Py_NewRef(args[1]);
    Py_XDECREF(old); /* after the entry is consistent: it may run a finalizer */
    Py_RETURN_TRUE;
}

static PyMethodDef querykeysmemo_methods[] = {
    {"clear", querykeysmemo_clear, METH_NOARGS, "Forgets every remembered body."},
    {"attach", (PyCFunction)(void (*)(void))querykeysmemo_attach, METH_FASTCALL,
     "attach(body, answer): keeps answer for the exact bytes of the body take_query_keys remembered last."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef querykeysmemo_members[] = {
    {"max_entries", T_PYSSIZET, offsetof(QueryKeysMemoObject, capacity), READONLY, "Bodies remembered at most."},
    {"max_bytes", T_PYSSIZET, offsetof(QueryKeysMemoObject, max_bytes), READONLY,
     "Bytes kept at most: the bodies plus 64 per block."},
    {"bytes", T_PYSSIZET, offsetof(QueryKeysMemoObject, bytes), READONLY, "Bytes kept now, counted as max_bytes."},
    {"hits", T_ULONGLONG, offsetof(QueryKeysMemoObject, hits), READONLY,
     "Bodies that reused a remembered body's leading blocks."},
    {"reused_blocks", T_ULONGLONG, offsetof(QueryKeysMemoObject, reused_blocks), READONLY,
     "The blocks those bodies reused (not decoded, not hashed)."},
    {"exact_hits", T_ULONGLONG, offsetof(QueryKeysMemoObject, exact_hits), READONLY,
     "Bodies answered by the object attached to the same bytes."},
    {NULL, 0, 0, 0, NULL},
};

static PySequenceMethods querykeysmemo_as_sequence = {
    .sq_length = querykeysmemo_length,
};

static PyTypeObject QueryKeysMemoType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "sglang_kvpub.core._native.QueryKeysMemo",
    .tp_basicsize = sizeof(QueryKeysMemoObject),
    .tp_dealloc = querykeysmemo_dealloc,
    .tp_as_sequence = &querykeysmemo_as_sequence,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "QueryKeysMemo(max_entries=256, max_bytes=16 MiB): take_query_keys's recent bodies, for "
              "their shared leading blocks (see _native.c).",
    .tp_methods = querykeysmemo_methods,
    .tp_members = querykeysmemo_members,
    .tp_new = querykeysmemo_new,
};

/* Splits the body from `base` to `stop`, the ids into a bytes object (`as_bytes`) or a PyMem
 * buffer: 1 when taken; 0 when there is nothing to take (not a map, no "token_ids" or two of
 * them, a value that is not an array, a malformed body: no exception set); -1 with
 * ValueError naming a bad id (or MemoryError).  With `reuse` (take_query_keys's memo), the
 * ids of the leading blocks a remembered body holds are not decoded (left unset in the
 * buffer): the caller takes their keys from the memo; 2, nothing split, when the whole body
 * is a remembered one with an attached object (`reuse->exact`). */
static int split_body(const unsigned char *base, const unsigned char *stop, int as_bytes, body_split *split,
                      memo_reuse *reuse) {
    memset(split, 0, sizeof(*split));
    const unsigned char *at = base;
    if (at < stop && (*at & 0xf0) == 0x80) {
        split->entries = *at & 0x0f;
        at += 1;
    } else if (stop - at >= 3 && *at == 0xde) {
        split->entries = read_be(at + 1, 2);
        at += 3;
    } else if (stop - at >= 5 && *at == 0xdf) {
        split->entries = read_be(at + 1, 4);
        at += 5;
    } else {
        return 0;
    }
    split->entries_start = at;
    int taken = 0;
    for (uint64_t i = 0; i < split->entries; i++) {
        const unsigned char *key_end = msgpack_skip(at, stop);
        if (key_end == NULL || key_end >= stop) {
            goto leave;
        }
        const int is_ids = msgpack_str_equals(at, key_end, "token_ids", 9);
        if (is_ids && split->found != NULL) {
            goto leave;
        }
        const unsigned char *end;
        if (is_ids && ((*key_end & 0xf0) == 0x90 || *key_end == 0xdc || *key_end == 0xdd)) {
            int truncated;
            const unsigned char *items;
            const Py_ssize_t count = u32_array_count(key_end, stop, &items, &truncated);
            Py_ssize_t first = 0; /* the first id to decode */
            if (count >= 0 && reuse != NULL && reuse->memo != NULL) {
                first = memo_lookup(reuse, split->block_size_seen, split->block_size, base, items, stop, count);
                if (reuse->exact != NULL) { /* the whole body is a remembered one's: nothing to decode */
                    return 2;
                }
            }
            if (count >= 0) {
                if (as_bytes) {
                    split->ids_bytes = PyBytes_FromStringAndSize(NULL, count * 4);
                    split->ids = split->ids_bytes != NULL ? (uint32_t *)PyBytes_AS_STRING(split->ids_bytes) : NULL;
                } else {
                    split->ids = PyMem_Malloc((size_t)(count > 0 ? count : 1) * sizeof(uint32_t));
                    if (split->ids == NULL) {
                        PyErr_NoMemory();
                    }
                }
                if (split->ids == NULL) {
                    return -1;
                }
                split->count = count;
                split->items = items;
            }
            /* converted as it is scanned: one pass */
            if (count < 0 || u32_items(items + (first > 0 ? reuse->skip : 0), stop, first, count, split->ids, &end,
                                       &truncated) != 0) {
                split_release(split);
                if (!truncated) {
                    return -1;
                }
                PyErr_Clear(); /* malformed msgpack: the struct decoder says so */
                return 0;
            }
            taken = 1;
            split->found = at;
            split->value_end = end;
        } else {
            end = msgpack_skip(key_end, stop);
            if (end == NULL) {
                goto leave;
            }
            if (is_ids) {
                split->found = at; /* not an array: left to the struct decoder */
            } else if (msgpack_str_equals(at, key_end, "block_size", 10)) {
                uint32_t value = 0;
                const int usable = split->block_size_seen == 0 && msgpack_u32(key_end, stop, &value) == end - key_end;
                split->block_size_seen = usable ? 1 : -1;
                split->block_size = usable ? value : 0;
            }
        }
        at = end;
    }
    if (taken && at == stop) {
        return 1;
    }
leave:
    split_release(split);
    return 0;
}

/* The body without its token_ids entry: a map header for one entry less, then the entries
 * before and after it, for the struct decoder.  NULL with MemoryError. */
static PyObject *split_rest(const body_split *split, const unsigned char *stop) {
    const uint64_t left = split->entries - 1;
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
    const size_t before = (size_t)(split->found - split->entries_start);
    const size_t after = (size_t)(stop - split->value_end);
    PyObject *rest = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(header_len + before + after));
    if (rest == NULL) {
        return NULL;
    }
    char *out = PyBytes_AS_STRING(rest);
    memcpy(out, header, header_len);
    memcpy(out + header_len, split->entries_start, before);
    memcpy(out + header_len + before, split->value_end, after);
    return rest;
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
    body_split split;
    const int taken = split_body(base, stop, 1, &split, NULL);
    if (taken <= 0) {
        return taken < 0 ? NULL : Py_BuildValue("(OO)", Py_None, arg);
    }
    PyObject *rest = split_rest(&split, stop);
    if (rest == NULL) {
        split_release(&split);
        return NULL;
    }
    PyObject *ids = split.ids_bytes;
    split.ids_bytes = NULL;
    return Py_BuildValue("(NN)", ids, rest);
}

/* take_query_keys(body, default_block_size, seed, memo=None) -> (rest, keys, tokens, spread, block_size) | None
 *                                                                  | the object attached to these bytes
 *
 * What the adapter's /query needs of a msgpack body, in one call: take_token_ids's split
 * (the same bodies taken, left and refused, the same ValueError naming a bad id), with the
 * ids decoded into a scratch buffer and hashed there instead of returned - `keys` is
 * hashing.sequence_keys(ids, block_size) under `seed`, `spread` rank_cost.spread_key(ids,
 * block_size) (the local hash under `seed` of the last full block, which the chain hashes
 * anyway; of every id when there is no full block; 0 for no id), `tokens` the id count.
 * `block_size` is the body's top-level "block_size" (`default_block_size` without one).
 * None when take_token_ids would return (None, body), and when the block size is not one
 * integer in [1, 2^20] (the caller's struct decoder refuses it): the caller's generic path
 * then runs as before.  With `memo` (a QueryKeysMemo), the leading blocks a recent body
 * shares byte for byte are neither decoded nor hashed (their keys are that body's), and
 * this body is remembered in turn: the same answer, the same refusals (a bad id can only be
 * in the part decoded, the part reused was accepted before).  A body the memo remembers
 * whole, byte for byte, with an object the caller attached to it (QueryKeysMemo.attach), is
 * answered with that object: nothing decoded, hashed or allocated. */
static PyObject *native_take_query_keys(PyObject *self, PyObject *args) {
    PyObject *body;
    Py_ssize_t default_block_size;
    unsigned long long seed;
    PyObject *memo = Py_None;
    if (!PyArg_ParseTuple(args, "O!nK|O", &PyBytes_Type, &body, &default_block_size, &seed, &memo)) {
        return NULL;
    }
    if (xxh3_seeded == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "native hashing helpers are not bound");
        return NULL;
    }
    if (default_block_size <= 0) {
        PyErr_Format(PyExc_ValueError, "default_block_size must be positive, got %zd", default_block_size);
        return NULL;
    }
    if (memo != Py_None && !PyObject_TypeCheck(memo, &QueryKeysMemoType)) {
        PyErr_Format(PyExc_TypeError, "memo must be a QueryKeysMemo or None, got %.100s", Py_TYPE(memo)->tp_name);
        return NULL;
    }
    memo_reuse reuse = {
        .memo = memo != Py_None ? (QueryKeysMemoObject *)memo : NULL,
        .seed = seed,
        .default_block_size = default_block_size,
    };
    const unsigned char *base = (const unsigned char *)PyBytes_AS_STRING(body);
    const unsigned char *stop = base + PyBytes_GET_SIZE(body);
    body_split split;
    const int taken = split_body(base, stop, 0, &split, &reuse);
    if (taken == 2) { /* these exact bytes were taken before: the caller's answer to them */
        PyObject *exact = Py_NewRef(reuse.exact);
        reuse.memo->exact_hits++;
        memo_reuse_drop(&reuse);
        return exact;
    }
    if (taken <= 0) {
        memo_reuse_drop(&reuse);
        if (taken < 0) {
            return NULL;
        }
        Py_RETURN_NONE;
    }
    Py_ssize_t block_size = default_block_size;
    if (split.block_size_seen != 0) {
        if (split.block_size_seen < 0 || split.block_size == 0 || split.block_size > (1u << 20)) {
            split_release(&split);
            memo_reuse_drop(&reuse);
            Py_RETURN_NONE;
        }
        block_size = (Py_ssize_t)split.block_size;
    }
    if (reuse.reused > 0 && reuse.block_size != block_size) { /* stated after the ids, unlike the memo's */
        const unsigned char *end;
        int truncated;
        const int failed =
            u32_items(split.items, stop, 0, reuse.reused * reuse.block_size, split.ids, &end, &truncated);
        memo_reuse_drop(&reuse);
        if (failed) { /* cannot happen: these bytes decoded before */
            split_release(&split);
            return NULL;
        }
    }
    const Py_ssize_t blocks = split.count / block_size;
    const size_t block_bytes = (size_t)block_size * 4;
    const Py_ssize_t reused = reuse.reused; /* < blocks: the last full block is always hashed */
    PyObject *rest = split_rest(&split, stop);
    PyObject *keys = rest != NULL ? PyList_New(blocks) : NULL;
    uint64_t key = seed, local = 0;
    if (keys != NULL && reused > 0) {
        for (Py_ssize_t block = 0; block < reused; block++) {
            PyList_SET_ITEM(keys, block, Py_NewRef(PyTuple_GET_ITEM(reuse.keys, block)));
        }
        key = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(reuse.keys, reused - 1)); /* ours: a u64 */
    }
    for (Py_ssize_t block = reused; keys != NULL && block < blocks; block++) {
        local = xxh3_seeded((const char *)split.ids + (size_t)block * block_bytes, block_bytes, seed);
        key = xxh3_seeded(&local, sizeof(local), key); /* hashing.chain_next: the 8 LE bytes */
        PyObject *value = PyLong_FromUnsignedLongLong(key);
        if (value == NULL) {
            Py_CLEAR(keys);
            break;
        }
        PyList_SET_ITEM(keys, block, value);
    }
    if (blocks == 0 && split.count > 0) {
        local = xxh3_seeded(split.ids, (size_t)split.count * 4, seed);
    }
    if (keys != NULL && reuse.memo != NULL) {
        reuse.memo->hits += reused > 0;
        reuse.memo->reused_blocks += (unsigned long long)reused;
        memo_remember(&reuse, body, &split, block_size, keys);
    }
    memo_reuse_drop(&reuse);
    split_release(&split);
    if (keys == NULL) {
        Py_XDECREF(rest);
        return NULL;
    }
    return Py_BuildValue("(NNnKn)", rest, keys, split.count, (unsigned long long)local, block_size);
}

/* ------------------------------------------------------------------ dispatch_score
 *
 * CacheAwareDispatcher._decide's arithmetic after the walk (sglang_kvpub/core/dispatch.py
 * is the reference): per candidate rank, in the rotated order ranks[start:] + ranks[:start],
 *   matched = min(round((npu*w_npu + cpu*w_cpu + disk*w_disk) * block_size), isl)
 *   cost    = prefill_scale * max(0, isl - overlap_credit * matched) + load_weight * load
 * the first lowest cost wins, then the hot-spot guard may send it to the least loaded. */

enum { SCORE_CACHE_HIT = 0, SCORE_NO_HIT = 1, SCORE_HOTSPOT = 2 };

typedef rank_cost_params score_params;

/* The matched tokens of a hit tuple (npu, cpu, disk); -1 with an exception set. */
static long long hit_matched(const score_params *p, PyObject *hit) {
    if (!PyTuple_Check(hit) || PyTuple_GET_SIZE(hit) != 3) {
        PyErr_SetString(PyExc_TypeError, "a hit is a tuple (npu, cpu, disk)");
        return -1;
    }
    double blocks[3];
    for (int i = 0; i < 3; i++) {
        blocks[i] = PyFloat_AsDouble(PyTuple_GET_ITEM(hit, i));
        if (blocks[i] == -1.0 && PyErr_Occurred()) {
            return -1;
        }
    }
    long long matched = 0;
    switch (rank_cost_matched(p, blocks[0], blocks[1], blocks[2], &matched)) {
        case RANK_COST_NAN: PyErr_SetString(PyExc_ValueError, "cannot convert float NaN to integer"); return -1;
        case RANK_COST_RANGE:
            PyErr_SetString(PyExc_OverflowError, "matched tokens out of range (check the tier weights)");
            return -1;
        default: return matched;
    }
}

/* *matched = the matched tokens of `rank`'s hit, 0 without one; -1 with an exception set. */
static int rank_matched(const score_params *p, PyObject *hits, PyObject *rank, long long *matched) {
    PyObject *hit = PyDict_GetItemWithError(hits, rank); /* borrowed */
    *matched = 0;
    if (hit == NULL) {
        return PyErr_Occurred() ? -1 : 0;
    }
    *matched = hit_matched(p, hit);
    return *matched == -1 && PyErr_Occurred() ? -1 : 0;
}

static double prefill_cost(const score_params *p, long long matched) { return rank_cost_prefill(p, matched); }

/* The float of an optional number (None: disabled); -1 with an exception set. */
static int optional_double(PyObject *value, int *present, double *out) {
    *present = value != Py_None;
    if (*present) {
        *out = PyFloat_AsDouble(value);
        if (*out == -1.0 && PyErr_Occurred()) {
            return -1;
        }
    }
    return 0;
}

/* dispatch_score(hits, loads, ranks, start, isl, block_size, weights, prefill_scale,
 *                overlap_credit, load_weight, hotspot_spread, hotspot_relative)
 *   -> (best_rank, reason, matched_tokens, cost, load)
 * reason 0 cache_hit, 1 no_hit, 2 hotspot; `ranks` a non-empty list of ranks indexing
 * `loads`; `hits` rank -> (npu, cpu, disk). */
static PyObject *native_dispatch_score(PyObject *self, PyObject *args) {
    PyObject *hits, *loads, *ranks, *spread_obj, *relative_obj;
    Py_ssize_t start;
    score_params p;
    Py_ssize_t isl, block_size;
    if (!PyArg_ParseTuple(args, "O!OO!nnn(ddd)dddOO", &PyDict_Type, &hits, &loads, &PyList_Type, &ranks, &start, &isl,
                          &block_size, &p.w_npu, &p.w_cpu, &p.w_disk, &p.prefill_scale, &p.overlap_credit,
                          &p.load_weight, &spread_obj, &relative_obj)) {
        return NULL;
    }
    p.isl = isl;
    p.block_size = block_size;
    const Py_ssize_t n = PyList_GET_SIZE(ranks);
    if (n == 0 || start < 0 || start >= n) {
        PyErr_SetString(PyExc_ValueError, "dispatch_score needs ranks and a start within them");
        return NULL;
    }
    int has_spread, has_relative;
    double hotspot_spread = 0.0, hotspot_relative = 0.0;
    if (optional_double(spread_obj, &has_spread, &hotspot_spread) != 0 ||
        optional_double(relative_obj, &has_relative, &hotspot_relative) != 0) {
        return NULL;
    }
    const double miss = prefill_cost(&p, 0);
    double best_cost = 0.0, least_load = 0.0, load_total = 0.0;
    Py_ssize_t best_at = 0, least_at = 0;
    PyObject *last_hit = NULL;
    double last_prefill = miss;
    double load_of_best = 0.0, first_load = 0.0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *rank = PyList_GET_ITEM(ranks, (start + i) % n);
        const Py_ssize_t index = PyNumber_AsSsize_t(rank, PyExc_IndexError);
        if (index == -1 && PyErr_Occurred()) {
            return NULL;
        }
        PyObject *item = PySequence_GetItem(loads, index);
        if (item == NULL) {
            return NULL;
        }
        const double load = PyFloat_AsDouble(item);
        Py_DECREF(item);
        if (load == -1.0 && PyErr_Occurred()) {
            return NULL;
        }
        PyObject *hit = PyDict_GetItemWithError(hits, rank); /* borrowed */
        double prefill = miss;
        if (hit != NULL) {
            if (hit != last_hit) { /* NPU-only ranks ending at one block share a tuple */
                const long long matched = hit_matched(&p, hit);
                if (matched == -1 && PyErr_Occurred()) {
                    return NULL;
                }
                last_hit = hit;
                last_prefill = prefill_cost(&p, matched);
            }
            prefill = last_prefill;
        } else if (PyErr_Occurred()) {
            return NULL;
        }
        const double cost = rank_cost_of(&p, prefill, load);
        if (i == 0) {
            first_load = load;
        }
        if (i == 0 || cost < best_cost) { /* the first among equals, as min() then index() */
            best_cost = cost;
            best_at = i;
            load_of_best = load;
        }
        if (i == 0 || load < least_load) {
            least_load = load;
            least_at = i;
        }
        load_total += load; /* left to right, as 3.11's sum(); 3.12's compensated sum may differ in the last bit */
    }
    if (!(best_cost < INFINITY)) {
        best_at = 0;
        load_of_best = first_load;
    }
    PyObject *best = PyList_GET_ITEM(ranks, (start + best_at) % n);
    long long matched = 0;
    if (best_cost < INFINITY && rank_matched(&p, hits, best, &matched) != 0) {
        return NULL;
    }
    int reason = matched > 0 ? SCORE_CACHE_HIT : SCORE_NO_HIT;
    const double spread = load_of_best - least_load;
    const double mean = load_total / (double)n;
    int hotspot = 0;
    if (!(spread <= 0.0) && (has_spread || has_relative)) {
        double limit = has_spread ? hotspot_spread : 0.0;
        if (has_relative && hotspot_relative * mean > limit) {
            limit = hotspot_relative * mean;
        }
        hotspot = spread > limit;
    }
    if (hotspot) {
        best = PyList_GET_ITEM(ranks, (start + least_at) % n);
        reason = SCORE_HOTSPOT;
        if (rank_matched(&p, hits, best, &matched) != 0) {
            return NULL;
        }
        load_of_best = least_load;
        best_cost = rank_cost_of(&p, prefill_cost(&p, matched), least_load);
    }
    return Py_BuildValue("(OiLdd)", best, reason, matched, best_cost, load_of_best);
}

/* ------------------------------------------------------------------ HashKeys
 *
 * HashKeys(): a map of u64 -> u64, PrefixIndex's per-worker, per-tier engine hash -> key.
 * Open addressing in one array of 16-byte slots (load <= 0.75, linear probing, deletion by
 * backward shift: no tombstones, so churn never grows it); key 0 marks an empty slot, so an
 * entry for engine hash 0 is kept beside the table.  A dict costs an entry of its own and an
 * int object per engine hash (~90 bytes); this costs 21-43 bytes per entry and makes no
 * object.  Keys and values are ints in [0, 2^64) (OverflowError on writes otherwise; a
 * lookup of any other int finds nothing).  Not ordered: keys(), values() and items() are
 * lists in table order. */

typedef struct {
    uint64_t key; /* 0: empty (engine hash 0 lives in zero_value) */
    uint64_t value;
} hk_slot;

typedef struct {
    PyObject_HEAD hk_slot *slots;
    size_t capacity; /* a power of two, or 0 */
    size_t used;     /* slots in use (engine hash 0 not counted) */
    int shift;       /* 64 - log2(capacity) */
    int has_zero;
    uint64_t zero_value;
} HashKeysObject;

static PyTypeObject HashKeysType;

#define HASHKEYS_MIN_CAPACITY 8

static inline size_t hk_home(uint64_t key, int shift) { return (size_t)((key * 0x9E3779B97F4A7C15ULL) >> shift); }

static Py_ssize_t hk_len(const HashKeysObject *map) { return (Py_ssize_t)(map->used + (map->has_zero ? 1 : 0)); }

/* The slot holding `key` (non-zero), or NULL. */
static hk_slot *hk_find(const HashKeysObject *map, uint64_t key) {
    if (map->capacity == 0) {
        return NULL;
    }
    const size_t mask = map->capacity - 1;
    for (size_t i = hk_home(key, map->shift);; i = (i + 1) & mask) {
        hk_slot *slot = &map->slots[i];
        if (slot->key == key) {
            return slot;
        }
        if (slot->key == 0) {
            return NULL;
        }
    }
}

/* Inserts a non-zero key known to be absent; the table has room (hk_reserve). */
static void hk_insert_new(HashKeysObject *map, uint64_t key, uint64_t value) {
    const size_t mask = map->capacity - 1;
    size_t i = hk_home(key, map->shift);
    while (map->slots[i].key != 0) {
        i = (i + 1) & mask;
    }
    map->slots[i].key = key;
    map->slots[i].value = value;
    map->used++;
}

/* Removes the entry in `slot`, shifting the run after it back. */
static void hk_remove_slot(HashKeysObject *map, hk_slot *slot) {
    const size_t mask = map->capacity - 1;
    size_t hole = (size_t)(slot - map->slots);
    for (size_t next = (hole + 1) & mask; map->slots[next].key != 0; next = (next + 1) & mask) {
        const size_t home = hk_home(map->slots[next].key, map->shift);
        /* The entry at `next` may fill the hole unless its home lies cyclically in (hole, next]. */
        const int stays = hole <= next ? (home > hole && home <= next) : (home > hole || home <= next);
        if (!stays) {
            map->slots[hole] = map->slots[next];
            hole = next;
        }
    }
    map->slots[hole].key = 0;
    map->slots[hole].value = 0;
    map->used--;
}

/* Room for `extra` more table entries at a load of at most 0.75; -1 with MemoryError. */
static int hk_reserve(HashKeysObject *map, size_t extra) {
    const size_t need = map->used + extra;
    if (need * 4 <= map->capacity * 3) {
        return 0;
    }
    size_t capacity = map->capacity ? map->capacity : HASHKEYS_MIN_CAPACITY;
    while (need * 4 > capacity * 3) {
        capacity *= 2;
    }
    hk_slot *fresh = PyMem_Calloc(capacity, sizeof(hk_slot)); /* PyMem: tracemalloc sees it */
    if (fresh == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    hk_slot *old = map->slots;
    const size_t old_capacity = map->capacity;
    int shift = 64;
    for (size_t c = capacity; c > 1; c >>= 1) {
        shift--;
    }
    map->slots = fresh;
    map->capacity = capacity;
    map->shift = shift;
    map->used = 0;
    for (size_t i = 0; i < old_capacity; i++) {
        if (old[i].key != 0) {
            hk_insert_new(map, old[i].key, old[i].value);
        }
    }
    PyMem_Free(old);
    return 0;
}

/* An int in [0, 2^64) as a u64: 1; any other int: 0 (no error set); not an int: -1 with
 * TypeError. */
static int hk_u64(PyObject *value, uint64_t *out) {
    if (!PyLong_Check(value)) {
        PyErr_Format(PyExc_TypeError, "HashKeys holds u64 ints, got %.100s", Py_TYPE(value)->tp_name);
        return -1;
    }
    const unsigned long long raw = PyLong_AsUnsignedLongLong(value);
    if (raw == (unsigned long long)-1 && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError)) {
            return -1;
        }
        PyErr_Clear();
        return 0;
    }
    *out = raw;
    return 1;
}

/* As hk_u64, an int outside the range raising OverflowError (for writes). */
static int hk_u64_strict(PyObject *value, uint64_t *out) {
    const int found = hk_u64(value, out);
    if (found == 0) {
        PyErr_SetString(PyExc_OverflowError, "HashKeys holds ints in [0, 2**64)");
        return -1;
    }
    return found == 1 ? 0 : -1;
}

/* The value of `key`: 1 and *value set, 0 when absent, -1 with an exception set. */
static int hk_lookup(const HashKeysObject *map, PyObject *key, uint64_t *value) {
    uint64_t raw;
    const int ok = hk_u64(key, &raw);
    if (ok <= 0) {
        return ok;
    }
    if (raw == 0) {
        *value = map->zero_value;
        return map->has_zero;
    }
    const hk_slot *slot = hk_find(map, raw);
    if (slot == NULL) {
        return 0;
    }
    *value = slot->value;
    return 1;
}

static int hk_set(HashKeysObject *map, uint64_t key, uint64_t value) {
    if (key == 0) {
        map->has_zero = 1;
        map->zero_value = value;
        return 0;
    }
    hk_slot *slot = hk_find(map, key);
    if (slot != NULL) {
        slot->value = value;
        return 0;
    }
    if (hk_reserve(map, 1) != 0) {
        return -1;
    }
    hk_insert_new(map, key, value);
    return 0;
}

/* Removes `key`: 1 and *value set when it was there, 0 when absent. */
static int hk_take(HashKeysObject *map, uint64_t key, uint64_t *value) {
    if (key == 0) {
        if (!map->has_zero) {
            return 0;
        }
        *value = map->zero_value;
        map->has_zero = 0;
        map->zero_value = 0;
        return 1;
    }
    hk_slot *slot = hk_find(map, key);
    if (slot == NULL) {
        return 0;
    }
    *value = slot->value;
    hk_remove_slot(map, slot);
    return 1;
}

static Py_ssize_t hashkeys_length(PyObject *self) { return hk_len((HashKeysObject *)self); }

static PyObject *hashkeys_subscript(PyObject *self, PyObject *key) {
    uint64_t value;
    const int found = hk_lookup((HashKeysObject *)self, key, &value);
    if (found < 0) {
        return NULL;
    }
    if (found == 0) {
        PyErr_SetObject(PyExc_KeyError, key);
        return NULL;
    }
    return PyLong_FromUnsignedLongLong(value);
}

static int hashkeys_ass_sub(PyObject *self, PyObject *key, PyObject *value) {
    HashKeysObject *map = (HashKeysObject *)self;
    if (value == NULL) {
        uint64_t raw, old;
        const int ok = hk_u64(key, &raw);
        if (ok < 0) {
            return -1;
        }
        if (ok == 0 || !hk_take(map, raw, &old)) {
            PyErr_SetObject(PyExc_KeyError, key);
            return -1;
        }
        return 0;
    }
    uint64_t raw, held;
    if (hk_u64_strict(key, &raw) != 0 || hk_u64_strict(value, &held) != 0) {
        return -1;
    }
    return hk_set(map, raw, held);
}

static int hashkeys_contains(PyObject *self, PyObject *key) {
    uint64_t value;
    return hk_lookup((HashKeysObject *)self, key, &value);
}

static PyObject *hashkeys_get(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 2) {
        PyErr_Format(PyExc_TypeError, "get expected 1 or 2 arguments, got %zd", nargs);
        return NULL;
    }
    uint64_t value;
    const int found = hk_lookup((HashKeysObject *)self, args[0], &value);
    if (found < 0) {
        return NULL;
    }
    if (found == 0) {
        return Py_NewRef(nargs == 2 ? args[1] : Py_None);
    }
    return PyLong_FromUnsignedLongLong(value);
}

static PyObject *hashkeys_pop(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 2) {
        PyErr_Format(PyExc_TypeError, "pop expected 1 or 2 arguments, got %zd", nargs);
        return NULL;
    }
    uint64_t raw, value;
    const int ok = hk_u64(args[0], &raw);
    if (ok < 0) {
        return NULL;
    }
    if (ok == 0 || !hk_take((HashKeysObject *)self, raw, &value)) {
        if (nargs == 2) {
            return Py_NewRef(args[1]);
        }
        PyErr_SetObject(PyExc_KeyError, args[0]);
        return NULL;
    }
    return PyLong_FromUnsignedLongLong(value);
}

enum { HK_KEYS, HK_VALUES, HK_ITEMS };

/* keys(), values() or items() as a list, engine hash 0 first, then table order. */
static PyObject *hk_list(const HashKeysObject *map, int what) {
    PyObject *out = PyList_New(hk_len(map));
    if (out == NULL) {
        return NULL;
    }
    Py_ssize_t at = 0;
    for (size_t i = 0; i <= map->capacity; i++) {
        uint64_t key, value;
        if (i == map->capacity) { /* engine hash 0 last */
            if (!map->has_zero) {
                break;
            }
            key = 0;
            value = map->zero_value;
        } else if (map->slots[i].key == 0) {
            continue;
        } else {
            key = map->slots[i].key;
            value = map->slots[i].value;
        }
        PyObject *item;
        if (what == HK_KEYS) {
            item = PyLong_FromUnsignedLongLong(key);
        } else if (what == HK_VALUES) {
            item = PyLong_FromUnsignedLongLong(value);
        } else {
            PyObject *k = PyLong_FromUnsignedLongLong(key);
            PyObject *v = k == NULL ? NULL : PyLong_FromUnsignedLongLong(value);
            item = v == NULL ? NULL : PyTuple_Pack(2, k, v);
            Py_XDECREF(k);
            Py_XDECREF(v);
        }
        if (item == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, at++, item);
    }
    return out;
}

static PyObject *hashkeys_keys(PyObject *self, PyObject *unused) { return hk_list((HashKeysObject *)self, HK_KEYS); }

static PyObject *hashkeys_values(PyObject *self, PyObject *unused) {
    return hk_list((HashKeysObject *)self, HK_VALUES);
}

static PyObject *hashkeys_items(PyObject *self, PyObject *unused) { return hk_list((HashKeysObject *)self, HK_ITEMS); }

static PyObject *hashkeys_iter(PyObject *self) {
    PyObject *keys = hk_list((HashKeysObject *)self, HK_KEYS);
    if (keys == NULL) {
        return NULL;
    }
    PyObject *it = PyObject_GetIter(keys);
    Py_DECREF(keys);
    return it;
}

static void hk_drop_table(HashKeysObject *map) {
    PyMem_Free(map->slots);
    map->slots = NULL;
    map->capacity = 0;
    map->used = 0;
    map->shift = 64;
    map->has_zero = 0;
    map->zero_value = 0;
}

static PyObject *hashkeys_clear(PyObject *self, PyObject *unused) {
    hk_drop_table((HashKeysObject *)self);
    Py_RETURN_NONE;
}

/* add_new(hashes, keys) -> bool: inserts every hashes[i] -> keys[i] when none of `hashes` is
 * present and they are distinct; else False, the map unchanged. */
static PyObject *hashkeys_add_new(PyObject *self, PyObject *args) {
    HashKeysObject *map = (HashKeysObject *)self;
    PyObject *hashes_in, *keys_in;
    if (!PyArg_ParseTuple(args, "OO", &hashes_in, &keys_in)) {
        return NULL;
    }
    PyObject *hashes = PySequence_Fast(hashes_in, "hashes must be a sequence");
    if (hashes == NULL) {
        return NULL;
    }
    PyObject *keys = PySequence_Fast(keys_in, "keys must be a sequence");
    if (keys == NULL) {
        Py_DECREF(hashes);
        return NULL;
    }
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(hashes);
    PyObject *result = NULL;
    Py_ssize_t added = 0;
    uint64_t *raw = NULL;
    if (PySequence_Fast_GET_SIZE(keys) != n) {
        PyErr_Format(PyExc_ValueError, "%zd hashes for %zd keys", n, PySequence_Fast_GET_SIZE(keys));
        goto done;
    }
    raw = PyMem_Malloc((size_t)(n ? n : 1) * 2 * sizeof(uint64_t));
    if (raw == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (hk_u64_strict(PySequence_Fast_GET_ITEM(hashes, i), &raw[2 * i]) != 0 ||
            hk_u64_strict(PySequence_Fast_GET_ITEM(keys, i), &raw[2 * i + 1]) != 0) {
            goto done;
        }
    }
    if (hk_reserve(map, (size_t)n) != 0) {
        goto done;
    }
    for (; added < n; added++) {
        const uint64_t key = raw[2 * added];
        if (key == 0 ? map->has_zero : hk_find(map, key) != NULL) {
            break; /* present, or a repeat within `hashes` */
        }
        if (key == 0) {
            map->has_zero = 1;
            map->zero_value = raw[2 * added + 1];
        } else {
            hk_insert_new(map, key, raw[2 * added + 1]);
        }
    }
    if (added == n) {
        result = Py_NewRef(Py_True);
    } else {
        uint64_t ignored;
        for (Py_ssize_t i = 0; i < added; i++) { /* undo: the map as it was */
            (void)hk_take(map, raw[2 * i], &ignored);
        }
        result = Py_NewRef(Py_False);
    }
done:
    PyMem_Free(raw);
    Py_DECREF(hashes);
    Py_DECREF(keys);
    return result;
}

static PyObject *hashkeys_sizeof(PyObject *self, PyObject *unused) {
    const HashKeysObject *map = (const HashKeysObject *)self;
    return PyLong_FromSize_t(sizeof(HashKeysObject) + map->capacity * sizeof(hk_slot));
}

static PyObject *hashkeys_capacity(PyObject *self, PyObject *unused) {
    return PyLong_FromSize_t(((HashKeysObject *)self)->capacity);
}

static PyObject *hashkeys_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    if (PyTuple_GET_SIZE(args) != 0 || (kwargs != NULL && PyDict_GET_SIZE(kwargs) != 0)) {
        PyErr_SetString(PyExc_TypeError, "HashKeys() takes no arguments");
        return NULL;
    }
    HashKeysObject *map = (HashKeysObject *)type->tp_alloc(type, 0);
    if (map != NULL) {
        map->shift = 64;
    }
    return (PyObject *)map;
}

static void hashkeys_dealloc(PyObject *self) {
    hk_drop_table((HashKeysObject *)self);
    Py_TYPE(self)->tp_free(self);
}

static PyMethodDef hashkeys_methods[] = {
    {"get", (PyCFunction)(void (*)(void))hashkeys_get, METH_FASTCALL, "M.get(k[, d]): the value of k, else d."},
    {"pop", (PyCFunction)(void (*)(void))hashkeys_pop, METH_FASTCALL, "M.pop(k[, d]): removes k, its value."},
    {"keys", hashkeys_keys, METH_NOARGS, "The engine hashes, a list in table order."},
    {"values", hashkeys_values, METH_NOARGS, "The values, a list in table order."},
    {"items", hashkeys_items, METH_NOARGS, "(hash, value) pairs, a list in table order."},
    {"clear", hashkeys_clear, METH_NOARGS, "Empties the map and frees its table."},
    {"add_new", hashkeys_add_new, METH_VARARGS,
     "add_new(hashes, keys) -> bool: all inserted when none is present and they are distinct, else False "
     "and nothing changed."},
    {"capacity", hashkeys_capacity, METH_NOARGS, "Slots in the table (for tests)."},
    {"__sizeof__", hashkeys_sizeof, METH_NOARGS, "Size of the object and of its table."},
    {NULL, NULL, 0, NULL},
};

static PyMappingMethods hashkeys_as_mapping = {
    hashkeys_length,
    hashkeys_subscript,
    hashkeys_ass_sub,
};

static PySequenceMethods hashkeys_as_sequence = {
    .sq_contains = hashkeys_contains,
};

static PyTypeObject HashKeysType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "sglang_kvpub.core._native.HashKeys",
    .tp_basicsize = sizeof(HashKeysObject),
    .tp_dealloc = hashkeys_dealloc,
    .tp_as_sequence = &hashkeys_as_sequence,
    .tp_as_mapping = &hashkeys_as_mapping,
    .tp_iter = hashkeys_iter,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A map of u64 engine hash -> u64 key in one flat table (see _native.c).",
    .tp_methods = hashkeys_methods,
    .tp_new = hashkeys_new,
};

/* body_key(data, flag) -> int
 *
 * The adapter's /query prompt-cache key: XXH3-128 of `data` (seed 0: xxhash.xxh3_128_intdigest's
 * value) shifted left by one with `flag` (0 or 1, the body's format) in bit 0.  Through the plain
 * XXH3 entry point, which stays on SSE2: the package's own function dispatches to AVX-512 here,
 * faster in a tight loop (0.6 against 1.1 us per 30 KB) but ~2 us more CPU per request in the
 * live server, which runs other code between two hashes and idles between requests (likely the
 * 512-bit units' warm-up and clock change; issue 32). */
static PyObject *native_body_key(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "body_key takes 2 arguments (%zd given)", nargs);
        return NULL;
    }
    const int flag = PyObject_IsTrue(args[1]);
    if (flag < 0) {
        return NULL;
    }
    if (xxh3_128_seeded == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "native hashing helpers are not bound");
        return NULL;
    }
    xxh3_128_value value;
    if (PyBytes_CheckExact(args[0])) { /* what aiohttp's read() gives: no buffer taken */
        value = xxh3_128_seeded(PyBytes_AS_STRING(args[0]), (size_t)PyBytes_GET_SIZE(args[0]), 0);
    } else {
        Py_buffer view;
        if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) != 0) {
            return NULL;
        }
        value = xxh3_128_seeded(view.buf, (size_t)view.len, 0);
        PyBuffer_Release(&view);
    }
    uint64_t words[3]; /* little-endian: (high:low) << 1 | flag, 129 bits */
    words[0] = (value.low64 << 1) | (uint64_t)flag;
    words[1] = (value.high64 << 1) | (value.low64 >> 63);
    words[2] = value.high64 >> 63;
    return wide_to_long(words, words[2] ? 3 : 2);
}

static PyMethodDef native_methods[] = {
    {"body_key", (PyCFunction)(void (*)(void))native_body_key, METH_FASTCALL,
     "body_key(data, flag) -> (XXH3-128 of data, seed 0) << 1 | flag, hashed without AVX-512."},
    {"bind", native_bind, METH_O, "Resolve XXH3_64bits_withSeed from the shared object at the given path."},
    {"chain_keys", native_chain_keys, METH_VARARGS,
     "chain_keys(tokens, block_size, seed, parent, start, end) -> chained block keys (list of int)."},
    {"npu_walk", native_npu_walk, METH_VARARGS,
     "npu_walk(tokens, block_size, seed, blocks, masks, held) -> (ends, depth): the NPU walk, hashing fused in."},
    {"npu_walk_ranks", native_npu_walk_ranks, METH_VARARGS,
     "npu_walk_ranks(tokens, block_size, seed, blocks, masks, held, out, rank_of) -> depth: npu_walk, ends "
     "emitted as out[rank] = (position, 0, 0)."},
    {"wide_walk", native_wide_walk, METH_VARARGS,
     "wide_walk(keys, masks, held, words[, prior_keys, prior_ends]) -> (ends, depth): the NPU walk over precomputed "
     "keys (from where they part from an earlier walk's keys, given its ends), masks of any "
     "width up to 1024 workers."},
    {"emit_hits", native_emit_hits, METH_VARARGS,
     "emit_hits(out, mask_bytes, hit, rank_of, pages): out[pages[i]][rank_of[8*i+b]] = hit per set bit."},
    {"emit_ranks", native_emit_ranks, METH_VARARGS,
     "emit_ranks(out, mask_bytes, hit, rank_of): out[rank_of[w]] = hit per set bit w with a rank."},
    {"u32_from_ints", native_u32_from_ints, METH_O,
     "u32_from_ints(ids) -> little-endian u32 bytes of a list or tuple of ints (each cast & 0xFFFFFFFF)."},
    {"u32_from_msgpack", native_u32_from_msgpack, METH_O,
     "u32_from_msgpack(raw) -> little-endian u32 bytes of a msgpack array of integers in [0, 2^32)."},
    {"u32_count_msgpack", native_u32_count_msgpack, METH_O,
     "u32_count_msgpack(raw) -> the length of a msgpack array of integers in [0, 2^32), each checked."},
    {"take_token_ids", native_take_token_ids, METH_O,
     "take_token_ids(body) -> (u32 bytes | None, body without token_ids): a msgpack /query body split."},
    {"u32_decode_wide", native_u32_decode_wide, METH_O,
     "u32_decode_wide(enabled) -> whether ids are decoded with AVX-512 VBMI after the call (None: ask)."},
    {"take_query_keys", native_take_query_keys, METH_VARARGS,
     "take_query_keys(body, default_block_size, seed, memo=None) -> (rest, keys, tokens, spread, block_size) | "
     "None: take_token_ids with the ids hashed into sequence_keys and spread_key instead of returned; with a "
     "QueryKeysMemo, the leading blocks a recent body shares are taken from it."},
    {"dispatch_score", native_dispatch_score, METH_VARARGS,
     "dispatch_score(hits, loads, ranks, start, isl, block_size, weights, prefill_scale, overlap_credit, "
     "load_weight, hotspot_spread, hotspot_relative) -> (rank, reason, matched, cost, load)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT,
    "_native",
    "Optional C helpers for sglang_kvpub.core.hashing.",
    -1,
    native_methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC PyInit__native(void) {
    KeyMasksType.tp_base = &PyDict_Type;
    KeyMasksType.tp_traverse = PyDict_Type.tp_traverse; /* the table holds no objects */
    KeyMasksType.tp_clear = PyDict_Type.tp_clear;
    if (PyType_Ready(&KeyMasksType) != 0) {
        return NULL;
    }
    PyObject *module = PyModule_Create(&native_module);
    if (module == NULL) {
        return NULL;
    }
    Py_INCREF(&KeyMasksType);
    if (PyModule_AddObject(module, "KeyMasks", (PyObject *)&KeyMasksType) != 0) {
        Py_DECREF(&KeyMasksType);
        Py_DECREF(module);
        return NULL;
    }
    if (PyType_Ready(&HashKeysType) != 0 || PyModule_AddObjectRef(module, "HashKeys", (PyObject *)&HashKeysType) != 0) {
        Py_DECREF(module);
        return NULL;
    }
    if (PyType_Ready(&QueryKeysMemoType) != 0 ||
        PyModule_AddObjectRef(module, "QueryKeysMemo", (PyObject *)&QueryKeysMemoType) != 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
