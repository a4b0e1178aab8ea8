/* KeyMasks: the NPU tier's key -> holders dict with its open-addressing walk table beside it.
 *
 * One file of the _native extension: a unity build, included by sglang_kvpub/core/_native.c in
 * order (docs/native.md says what each part is for and why it is native). */

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
