/* HashKeys: the index's engine hash -> key map (u64 -> u64, one open-addressing table).
 *
 * One file of the _native extension: a unity build, included by sglang_kvpub/core/_native.c in
 * order (docs/native.md says what each part is for and why it is native). */

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
    PyObject_HEAD u64_table table;
} HashKeysObject;

static PyTypeObject HashKeysType;

#define HASHKEYS_MIN_CAPACITY 8

static Py_ssize_t hk_len(const HashKeysObject *map) { return (Py_ssize_t)u64_len(&map->table); }

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
    return ok <= 0 ? ok : u64_get(&map->table, raw, value);
}

static int hk_set(HashKeysObject *map, uint64_t key, uint64_t value) { return u64_set(&map->table, key, value); }

/* Removes `key`: 1 and *value set when it was there, 0 when absent. */
static int hk_take(HashKeysObject *map, uint64_t key, uint64_t *value) { return u64_take(&map->table, key, value); }

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
    const u64_table *t = &map->table;
    for (size_t i = 0; i <= t->capacity; i++) {
        uint64_t key, value;
        if (i == t->capacity) { /* engine hash 0 last */
            if (!t->has_zero) {
                break;
            }
            key = 0;
            value = t->zero_value;
        } else if (t->slots[i].key == 0) {
            continue;
        } else {
            key = t->slots[i].key;
            value = t->slots[i].value;
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

static PyObject *hashkeys_clear(PyObject *self, PyObject *unused) {
    u64_drop(&((HashKeysObject *)self)->table);
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
    if (u64_reserve(&map->table, (size_t)n) != 0) {
        goto done;
    }
    for (; added < n; added++) {
        const uint64_t key = raw[2 * added];
        if (key == 0 ? map->table.has_zero : u64_find(&map->table, key) != NULL) {
            break; /* present, or a repeat within `hashes` */
        }
        if (key == 0) {
            map->table.has_zero = 1;
            map->table.zero_value = raw[2 * added + 1];
        } else {
            u64_insert_new(&map->table, key, raw[2 * added + 1]);
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
    return PyLong_FromSize_t(sizeof(HashKeysObject) + map->table.capacity * sizeof(u64_slot));
}

static PyObject *hashkeys_capacity(PyObject *self, PyObject *unused) {
    return PyLong_FromSize_t(((HashKeysObject *)self)->table.capacity);
}

static PyObject *hashkeys_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    if (PyTuple_GET_SIZE(args) != 0 || (kwargs != NULL && PyDict_GET_SIZE(kwargs) != 0)) {
        PyErr_SetString(PyExc_TypeError, "HashKeys() takes no arguments");
        return NULL;
    }
    HashKeysObject *map = (HashKeysObject *)type->tp_alloc(type, 0);
    if (map != NULL) {
        u64_table_init(&map->table, 3, 4, HASHKEYS_MIN_CAPACITY, 0);
    }
    return (PyObject *)map;
}

static void hashkeys_dealloc(PyObject *self) {
    u64_drop(&((HashKeysObject *)self)->table);
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
