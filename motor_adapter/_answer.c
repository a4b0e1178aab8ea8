/* The router's C helpers (motor_adapter._answer, docs/native.md): what the adapter runs per
 * /query and nothing the engine needs - the msgpack body's ids split off, decoded and hashed in
 * one call (take_query_keys, with QueryKeysMemo's prefix reuse) and the rank-aware answer
 * (rank_answer).  Python is the reference and the fallback for each.
 *
 * A unity build: the block keys (XXH3 bound from the xxhash package, chained keys), the
 * msgpack id decoders and the u64 -> u64 table are the engine's files (sglang_kvpub/core/csrc/),
 * compiled here too so both extensions hash, decode and index with the same code; the rest is
 * motor_adapter/csrc/.
 * Little-endian hosts only, as the engine's. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <dlfcn.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "sglang_kvpub/core/rank_cost.h"

#include "sglang_kvpub/core/csrc/hash.c"
#include "sglang_kvpub/core/csrc/msgpack_ids.c"
#include "sglang_kvpub/core/csrc/u64_table.c"
#include "csrc/body_split.h"
#include "csrc/query_memo.c"
#include "csrc/query_body.c"
#include "csrc/answer_score.c"
#include "csrc/answer_json.c"
#include "csrc/answer.c"

static PyMethodDef answer_methods[] = {
    {"bind", native_bind, METH_O, "Resolve XXH3_64bits_withSeed from the shared object at the given path."},
    {"chain_keys", native_chain_keys, METH_VARARGS,
     "chain_keys(tokens, block_size, seed, parent, start, end) -> chained block keys (list of int)."},
    {"u32_decode_wide", native_u32_decode_wide, METH_O,
     "u32_decode_wide(enabled) -> whether ids are decoded with AVX-512 VBMI after the call (None: ask)."},
    {"take_token_ids", native_take_token_ids, METH_O,
     "take_token_ids(body) -> (u32 bytes | None, body without token_ids): a msgpack /query body split."},
    {"take_query_keys", native_take_query_keys, METH_VARARGS,
     "take_query_keys(body, default_block_size, seed, memo=None) -> (rest, keys, tokens, spread, block_size) | "
     "None: take_token_ids with the ids hashed into sequence_keys and spread_key instead of returned; with a "
     "QueryKeysMemo, the leading blocks a recent body shares are taken from it."},
    {"rank_answer", answer_rank_answer, METH_VARARGS,
     "rank_answer(board, streams, live, now, stale_after, isl, spread) -> False | None | (json, best_blocks, until, "
     "effects): the rank-aware /query answer and what it commits and counts (see csrc/answer.c)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef answer_module = {
    PyModuleDef_HEAD_INIT,
    "_answer",
    "The router's C helpers: the /query body and the rank-aware answer (docs/native.md).",
    -1,
    answer_methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC PyInit__answer(void) {
    name_received = PyUnicode_InternFromString("received");
    name_total = PyUnicode_InternFromString("total");
    name_loads = PyUnicode_InternFromString("loads");
    if (name_received == NULL || name_total == NULL || name_loads == NULL) {
        return NULL;
    }
    PyObject *module = PyModule_Create(&answer_module);
    if (module == NULL) {
        return NULL;
    }
    if (PyType_Ready(&QueryKeysMemoType) != 0 ||
        PyModule_AddObjectRef(module, "QueryKeysMemo", (PyObject *)&QueryKeysMemoType) != 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
