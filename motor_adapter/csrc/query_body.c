/* The adapter's /query body: take_token_ids, take_query_keys and QueryKeysMemo.
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
    u64_table index;     /* probe -> its entry's slot; room for `capacity` made up front */
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

/* The entry remembered under `probe`, found by the index; with `free_slot`, where a new entry
 * goes when there is none: an empty slot, else the oldest entry's. */
static memo_entry *memo_find(QueryKeysMemoObject *memo, uint64_t probe, memo_entry **free_slot) {
    uint64_t at;
    if (u64_get(&memo->index, probe, &at)) {
        return &memo->slots[at];
    }
    if (free_slot != NULL) {
        memo_entry *oldest = NULL;
        for (Py_ssize_t i = 0; i < memo->capacity; i++) {
            memo_entry *entry = &memo->slots[i];
            if (entry->stamp == 0) {
                oldest = entry;
                break;
            }
            if (oldest == NULL || entry->stamp < oldest->stamp) {
                oldest = entry;
            }
        }
        *free_slot = oldest;
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
        uint64_t at;
        (void)u64_take(&memo->index, old.probe, &at);
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
    (void)u64_set(&memo->index, reuse->probe, (uint64_t)(slot - memo->slots)); /* never grows: room made */
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
    u64_table_init(&memo->index, 1, 2, 16, 0);
    memo->slots = PyMem_Calloc((size_t)max_entries, sizeof(memo_entry));
    if (memo->slots == NULL) {
        Py_DECREF(memo);
        return PyErr_NoMemory();
    }
    if (u64_reserve(&memo->index, (size_t)max_entries) != 0) { /* so remembering never allocates */
        Py_DECREF(memo);
        return NULL;
    }
    memo->capacity = max_entries;
    memo->max_bytes = max_bytes;
    return (PyObject *)memo;
}

static void querykeysmemo_dealloc(PyObject *self) {
    QueryKeysMemoObject *memo = (QueryKeysMemoObject *)self;
    memo_clear_all(memo);
    PyMem_Free(memo->slots);
    u64_drop(&memo->index);
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
              "their shared leading blocks (see query_body.c).",
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
