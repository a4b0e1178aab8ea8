/* body_key: the adapter's /query prompt-cache key (XXH3-128 through the plain entry point).
 *
 * One file of the _native extension: a unity build, included by sglang_kvpub/core/_native.c in
 * order (docs/native.md says what each part is for and why it is native). */

/* body_key(data, flag) -> int
 *
 * The adapter's /query prompt-cache key: XXH3-128 of `data` (seed 0: xxhash.xxh3_128_intdigest's
 * value) shifted left by one with `flag` (0 or 1, the body's format) in bit 0.  Through the plain
 * XXH3 entry point, which stays on SSE2: the package's own function dispatches to AVX-512, faster
 * in a tight loop but dearer per request in the live server (docs/perf/query-cpu.md), which runs
 * other code between two hashes and idles between requests (likely the 512-bit units' warm-up and
 * clock change). */
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
