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
    PyDictObject dict;
    u64_table table; /* key -> the low 64 worker bits of its holders; 0 bits: not kept */
} KeyMasksObject;

static PyTypeObject KeyMasksType;

#define KEYMASKS_MIN_CAPACITY 64

/* Blocks hashed ahead of their probe in npu_walk's table path. */
#define WALK_AHEAD 8

static inline void keymasks_prefetch(const KeyMasksObject *masks, uint64_t key) { u64_prefetch(&masks->table, key); }

/* The low 64 worker bits held for `key`, 0 for none. */
static inline uint64_t keymasks_lookup(const KeyMasksObject *masks, uint64_t key) {
    uint64_t held = 0;
    return u64_get(&masks->table, key, &held) ? held : 0;
}

static void keymasks_remove(KeyMasksObject *masks, uint64_t key) {
    uint64_t ignored;
    (void)u64_take(&masks->table, key, &ignored);
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
    if (table->table.load_den == 0) { /* the table's settings, at its first write (dict's new zeroes them) */
        u64_table_init(&table->table, 7, 10, KEYMASKS_MIN_CAPACITY, 1);
    }
    uint64_t held;
    if (holders_within(value, ~(uint64_t)0, &held) != 0 || (held != 0 && u64_reserve(&table->table, 1) != 0)) {
        return -1;
    }
    if (PyDict_SetItem(self, key, value) != 0) {
        return -1;
    }
    if (held != 0) {
        (void)u64_set(&table->table, raw, held); /* room reserved above: no allocation */
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
    u64_drop(&((KeyMasksObject *)self)->table);
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
                              (Py_ssize_t)(table->table.capacity * sizeof(u64_slot)));
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
    return PyLong_FromSize_t(u64_len(&((KeyMasksObject *)self)->table));
}

static int keymasks_init(PyObject *self, PyObject *args, PyObject *kwargs) {
    if (PyTuple_GET_SIZE(args) != 0 || (kwargs != NULL && PyDict_GET_SIZE(kwargs) != 0)) {
        PyErr_SetString(PyExc_TypeError, "KeyMasks() takes no arguments");
        return -1;
    }
    return 0;
}

static void keymasks_dealloc(PyObject *self) {
    u64_drop(&((KeyMasksObject *)self)->table);
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
