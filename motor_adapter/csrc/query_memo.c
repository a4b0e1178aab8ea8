/* QueryKeysMemo: take_query_keys's memo of recent bodies.
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
 * are decoded - a body whose block size turns out another decodes the skipped ids after all.
 *
 * One file of the router's _answer extension: a unity build, included by
 * motor_adapter/_answer.c in order (docs/native.md says what each part is for). */

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
 * every id's length, a cost every new body pays, so it runs as wide as the decode does. */
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
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "motor_adapter._answer.QueryKeysMemo",
    .tp_basicsize = sizeof(QueryKeysMemoObject),
    .tp_dealloc = querykeysmemo_dealloc,
    .tp_as_sequence = &querykeysmemo_as_sequence,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "QueryKeysMemo(max_entries=256, max_bytes=16 MiB): take_query_keys's recent bodies, for "
              "their shared leading blocks (see query_memo.c).",
    .tp_methods = querykeysmemo_methods,
    .tp_members = querykeysmemo_members,
    .tp_new = querykeysmemo_new,
};
