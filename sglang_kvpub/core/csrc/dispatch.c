/* dispatch_score: the in-instance dispatcher's costs over its candidate ranks (rank_cost.h).
 *
 * One file of the _native extension: a unity build, included by sglang_kvpub/core/_native.c in
 * order (docs/native.md says what each part is for and why it is native). */

/* ------------------------------------------------------------------ dispatch_score
 *
 * CacheAwareDispatcher._decide's arithmetic after the walk (sglang_kvpub/core/dispatch.py
 * is the reference): per candidate rank, in the rotated order ranks[start:] + ranks[:start],
 *   matched = min(round((npu*w_npu + cpu*w_cpu + disk*w_disk) * block_size), isl)
 *   cost    = prefill_scale * max(0, isl - overlap_credit * matched) + load_weight * load
 * the first lowest cost wins, then the hot-spot guard may send it to the least loaded. */

enum { SCORE_CACHE_HIT = 0, SCORE_NO_HIT = 1, SCORE_HOTSPOT = 2 };

typedef rank_cost_params score_params;

/* The matched tokens of a hit tuple (npu, cpu, disk); -1 with an exception set. */
static long long hit_matched(const score_params *p, PyObject *hit) {
    if (!PyTuple_Check(hit) || PyTuple_GET_SIZE(hit) != 3) {
        PyErr_SetString(PyExc_TypeError, "a hit is a tuple (npu, cpu, disk)");
        return -1;
    }
    double blocks[3];
    for (int i = 0; i < 3; i++) {
        blocks[i] = PyFloat_AsDouble(PyTuple_GET_ITEM(hit, i));
        if (blocks[i] == -1.0 && PyErr_Occurred()) {
            return -1;
        }
    }
    long long matched = 0;
    switch (rank_cost_matched(p, blocks[0], blocks[1], blocks[2], &matched)) {
        case RANK_COST_NAN: PyErr_SetString(PyExc_ValueError, "cannot convert float NaN to integer"); return -1;
        case RANK_COST_RANGE:
            PyErr_SetString(PyExc_OverflowError, "matched tokens out of range (check the tier weights)");
            return -1;
        default: return matched;
    }
}

/* *matched = the matched tokens of `rank`'s hit, 0 without one; -1 with an exception set. */
static int rank_matched(const score_params *p, PyObject *hits, PyObject *rank, long long *matched) {
    PyObject *hit = PyDict_GetItemWithError(hits, rank); /* borrowed */
    *matched = 0;
    if (hit == NULL) {
        return PyErr_Occurred() ? -1 : 0;
    }
    *matched = hit_matched(p, hit);
    return *matched == -1 && PyErr_Occurred() ? -1 : 0;
}

static double prefill_cost(const score_params *p, long long matched) { return rank_cost_prefill(p, matched); }

/* The float of an optional number (None: disabled); -1 with an exception set. */
static int optional_double(PyObject *value, int *present, double *out) {
    *present = value != Py_None;
    if (*present) {
        *out = PyFloat_AsDouble(value);
        if (*out == -1.0 && PyErr_Occurred()) {
            return -1;
        }
    }
    return 0;
}

/* dispatch_score(hits, loads, ranks, start, isl, block_size, weights, prefill_scale,
 *                overlap_credit, load_weight, hotspot_spread, hotspot_relative)
 *   -> (best_rank, reason, matched_tokens, cost, load)
 * reason 0 cache_hit, 1 no_hit, 2 hotspot; `ranks` a non-empty list of ranks indexing
 * `loads`; `hits` rank -> (npu, cpu, disk). */
static PyObject *native_dispatch_score(PyObject *self, PyObject *args) {
    PyObject *hits, *loads, *ranks, *spread_obj, *relative_obj;
    Py_ssize_t start;
    score_params p;
    Py_ssize_t isl, block_size;
    if (!PyArg_ParseTuple(args, "O!OO!nnn(ddd)dddOO", &PyDict_Type, &hits, &loads, &PyList_Type, &ranks, &start, &isl,
                          &block_size, &p.w_npu, &p.w_cpu, &p.w_disk, &p.prefill_scale, &p.overlap_credit,
                          &p.load_weight, &spread_obj, &relative_obj)) {
        return NULL;
    }
    p.isl = isl;
    p.block_size = block_size;
    const Py_ssize_t n = PyList_GET_SIZE(ranks);
    if (n == 0 || start < 0 || start >= n) {
        PyErr_SetString(PyExc_ValueError, "dispatch_score needs ranks and a start within them");
        return NULL;
    }
    int has_spread, has_relative;
    double hotspot_spread = 0.0, hotspot_relative = 0.0;
    if (optional_double(spread_obj, &has_spread, &hotspot_spread) != 0 ||
        optional_double(relative_obj, &has_relative, &hotspot_relative) != 0) {
        return NULL;
    }
    const double miss = prefill_cost(&p, 0);
    double best_cost = 0.0, least_load = 0.0, load_total = 0.0;
    Py_ssize_t best_at = 0, least_at = 0;
    PyObject *last_hit = NULL;
    double last_prefill = miss;
    double load_of_best = 0.0, first_load = 0.0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *rank = PyList_GET_ITEM(ranks, (start + i) % n);
        const Py_ssize_t index = PyNumber_AsSsize_t(rank, PyExc_IndexError);
        if (index == -1 && PyErr_Occurred()) {
            return NULL;
        }
        PyObject *item = PySequence_GetItem(loads, index);
        if (item == NULL) {
            return NULL;
        }
        const double load = PyFloat_AsDouble(item);
        Py_DECREF(item);
        if (load == -1.0 && PyErr_Occurred()) {
            return NULL;
        }
        PyObject *hit = PyDict_GetItemWithError(hits, rank); /* borrowed */
        double prefill = miss;
        if (hit != NULL) {
            if (hit != last_hit) { /* NPU-only ranks ending at one block share a tuple */
                const long long matched = hit_matched(&p, hit);
                if (matched == -1 && PyErr_Occurred()) {
                    return NULL;
                }
                last_hit = hit;
                last_prefill = prefill_cost(&p, matched);
            }
            prefill = last_prefill;
        } else if (PyErr_Occurred()) {
            return NULL;
        }
        const double cost = rank_cost_of(&p, prefill, load);
        if (i == 0) {
            first_load = load;
        }
        if (i == 0 || cost < best_cost) { /* the first among equals, as min() then index() */
            best_cost = cost;
            best_at = i;
            load_of_best = load;
        }
        if (i == 0 || load < least_load) {
            least_load = load;
            least_at = i;
        }
        load_total += load; /* left to right, as 3.11's sum(); 3.12's compensated sum may differ in the last bit */
    }
    if (!(best_cost < INFINITY)) {
        best_at = 0;
        load_of_best = first_load;
    }
    PyObject *best = PyList_GET_ITEM(ranks, (start + best_at) % n);
    long long matched = 0;
    if (best_cost < INFINITY && rank_matched(&p, hits, best, &matched) != 0) {
        return NULL;
    }
    int reason = matched > 0 ? SCORE_CACHE_HIT : SCORE_NO_HIT;
    const double spread = load_of_best - least_load;
    const double mean = load_total / (double)n;
    int hotspot = 0;
    if (!(spread <= 0.0) && (has_spread || has_relative)) {
        double limit = has_spread ? hotspot_spread : 0.0;
        if (has_relative && hotspot_relative * mean > limit) {
            limit = hotspot_relative * mean;
        }
        hotspot = spread > limit;
    }
    if (hotspot) {
        best = PyList_GET_ITEM(ranks, (start + least_at) % n);
        reason = SCORE_HOTSPOT;
        if (rank_matched(&p, hits, best, &matched) != 0) {
            return NULL;
        }
        load_of_best = least_load;
        best_cost = rank_cost_of(&p, prefill_cost(&p, matched), least_load);
    }
    return Py_BuildValue("(OiLdd)", best, reason, matched, best_cost, load_of_best);
}
