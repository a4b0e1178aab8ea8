/* The block keys: XXH3 bound from the xxhash package's extension, token ids read from any
 * integer buffer, the chained keys (chain_keys) and u32 bytes of a list of ints.
 *
 * One file of the _native extension: a unity build, included by sglang_kvpub/core/_native.c in
 * order (docs/native.md says what each part is for and why it is native). */

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
