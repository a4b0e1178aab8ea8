/* The adapter's /query body: the msgpack body split around its ids (take_token_ids), and
 * split, decoded and hashed in one call (take_query_keys, with QueryKeysMemo's prefix reuse).
 *
 * One file of the router's _answer extension: a unity build, included by
 * motor_adapter/_answer.c in order (docs/native.md says what each part is for). */

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
