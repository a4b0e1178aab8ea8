/* Token ids into little-endian u32 bytes for hashing.tokens_u32 and the router's stream
 * decoder (hashing.token_ids_from_msgpack): a list or tuple of ints, a msgpack array.
 *
 * One file of the _native extension: a unity build, included by sglang_kvpub/core/_native.c in
 * order (docs/native.md says what each part is for and why it is native). */

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
