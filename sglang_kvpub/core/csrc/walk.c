/* The index walks: npu_walk and npu_walk_ranks (hashing fused in, over KeyMasks), wide_walk
 * (precomputed keys, masks of any width) and the emission of hits per set worker bit.
 *
 * One file of the _native extension: a unity build, included by sglang_kvpub/core/_native.c in
 * order (docs/native.md says what each part is for and why it is native). */

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

/* A mask of `count` little-endian words as a Python int, through CPython's converter. */
static PyObject *wide_to_long(const uint64_t *words, int count) {
#if PY_VERSION_HEX >= 0x030D0000
    return PyLong_FromUnsignedNativeBytes(words, (size_t)count * 8, Py_ASNATIVEBYTES_LITTLE_ENDIAN);
#else
    return _PyLong_FromByteArray((const unsigned char *)words, (size_t)count * 8, 1, 0);
#endif
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
