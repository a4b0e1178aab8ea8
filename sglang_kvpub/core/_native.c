/* The engine's C helpers: what the SGLang processes and the index run on every dispatch decision
 * and every stored event - block keys, the index's tables and walks, the dispatch score (see
 * docs/native.md).  The router's own helpers (the /query body, the rank-aware answer) are in
 * motor_adapter/_answer.c, which compiles hash.c and msgpack_ids.c from here as well.
 *
 * The Python implementation in hashing.py is the reference and the fallback: this module
 * computes the same values, in one call instead of a Python loop per block.  It carries no
 * hash implementation of its own: `bind` resolves XXH3_64bits_withSeed from the xxhash
 * package's extension (already a dependency, already loaded), so both paths use the same
 * XXH3 code.  Little-endian hosts only: the module refuses to bind elsewhere.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <dlfcn.h>
#include <math.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <stdint.h>
#include <string.h>

#include "rank_cost.h"

#include "csrc/hash.c"
#include "csrc/u64_table.c"
#include "csrc/keymasks.c"
#include "csrc/walk.c"
#include "csrc/msgpack_ids.c"
#include "csrc/ids.c"
#include "csrc/dispatch.c"
#include "csrc/hashkeys.c"

static PyMethodDef native_methods[] = {
    {"bind", native_bind, METH_O, "Resolve XXH3_64bits_withSeed from the shared object at the given path."},
    {"chain_keys", native_chain_keys, METH_VARARGS,
     "chain_keys(tokens, block_size, seed, parent, start, end) -> chained block keys (list of int)."},
    {"npu_walk", native_npu_walk, METH_VARARGS,
     "npu_walk(tokens, block_size, seed, blocks, masks, held) -> (ends, depth): the NPU walk, hashing fused in."},
    {"npu_walk_ranks", native_npu_walk_ranks, METH_VARARGS,
     "npu_walk_ranks(tokens, block_size, seed, blocks, masks, held, out, rank_of) -> depth: npu_walk, ends "
     "emitted as out[rank] = (position, 0, 0)."},
    {"wide_walk", native_wide_walk, METH_VARARGS,
     "wide_walk(keys, masks, held, words[, prior_keys, prior_ends]) -> (ends, depth): the NPU walk over precomputed "
     "keys (from where they part from an earlier walk's keys, given its ends), masks of any "
     "width up to 1024 workers."},
    {"emit_hits", native_emit_hits, METH_VARARGS,
     "emit_hits(out, mask_bytes, hit, rank_of, pages): out[pages[i]][rank_of[8*i+b]] = hit per set bit."},
    {"emit_ranks", native_emit_ranks, METH_VARARGS,
     "emit_ranks(out, mask_bytes, hit, rank_of): out[rank_of[w]] = hit per set bit w with a rank."},
    {"u32_from_ints", native_u32_from_ints, METH_O,
     "u32_from_ints(ids) -> little-endian u32 bytes of a list or tuple of ints (each cast & 0xFFFFFFFF)."},
    {"u32_from_msgpack", native_u32_from_msgpack, METH_O,
     "u32_from_msgpack(raw) -> little-endian u32 bytes of a msgpack array of integers in [0, 2^32)."},
    {"u32_count_msgpack", native_u32_count_msgpack, METH_O,
     "u32_count_msgpack(raw) -> the length of a msgpack array of integers in [0, 2^32), each checked."},
    {"u32_decode_wide", native_u32_decode_wide, METH_O,
     "u32_decode_wide(enabled) -> whether ids are decoded with AVX-512 VBMI after the call (None: ask)."},
    {"dispatch_score", native_dispatch_score, METH_VARARGS,
     "dispatch_score(hits, loads, ranks, start, isl, block_size, weights, prefill_scale, overlap_credit, "
     "load_weight, hotspot_spread, hotspot_relative) -> (rank, reason, matched, cost, load)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT,
    "_native",
    "Optional C helpers for sglang_kvpub.core.hashing.",
    -1,
    native_methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC PyInit__native(void) {
    KeyMasksType.tp_base = &PyDict_Type;
    KeyMasksType.tp_traverse = PyDict_Type.tp_traverse; /* the table holds no objects */
    KeyMasksType.tp_clear = PyDict_Type.tp_clear;
    if (PyType_Ready(&KeyMasksType) != 0) {
        return NULL;
    }
    PyObject *module = PyModule_Create(&native_module);
    if (module == NULL) {
        return NULL;
    }
    Py_INCREF(&KeyMasksType);
    if (PyModule_AddObject(module, "KeyMasks", (PyObject *)&KeyMasksType) != 0) {
        Py_DECREF(&KeyMasksType);
        Py_DECREF(module);
        return NULL;
    }
    if (PyType_Ready(&HashKeysType) != 0 || PyModule_AddObjectRef(module, "HashKeys", (PyObject *)&HashKeysType) != 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
