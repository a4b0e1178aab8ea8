/* The rank-aware /query answer in one C call (docs/native.md, "rank_answer").
 *
 * motor_adapter.answer.rank_answer is the reference and the fallback: this
 * computes the same answer for the common shape - every registered instance one fanned-in
 * stream, the "tokens" answer shape, the NPU tier alone holding blocks - and renders it as
 * the JSON bytes msgspec writes for the reference's dict.  Per instance: the rank that would
 * serve the request (rank_cost.score_ranks without the hot-spot guard, which the adapter never
 * sets), or the longest hit without load figures (scoring.best_rank); then pick_instance,
 * motor_values and the entry (_rank_entry + Motor's values).  It returns None instead of an
 * answer whenever a figure would not render exactly as the reference does (a non-finite or
 * huge float): the caller then runs the reference.
 *
 * One file of the router's extension (motor_adapter._answer): a unity build, included by
 * motor_adapter/_answer.c in order: answer_score.c (the scoring), answer_json.c (the text),
 * answer.c (the board read and the call). */

/* Floats print as "%.1f" of round(x, 1) - what msgspec writes for them - below this. */
#define EXACT_FLOAT_MAX 1e15
/* Ints from float rounding (Motor's DP values) stay within this. */
#define EXACT_INT_MAX 4e18
#define MOTOR_BOOK_MARGIN 2147483648.0 /* scoring.MOTOR_BOOK_MARGIN: 1 << 31 tokens */

typedef rank_cost_params params_t;

typedef struct {
    long long rank; /* -1: none */
    long long npu, cpu, disk;
    int has_hit;
    long long matched;
    double cost, load_estimate, load;
    int fresh; /* the instance has fresh load figures (the answer commits to it) */
    double received;
} scored_t;

/* rank_cost_matched of a hit's blocks; 1 when it has no value (the reference raises: fall back). */
static int matched_of(const params_t *p, long long npu, long long cpu, long long disk, long long *out) {
    return rank_cost_matched(p, (double)npu, (double)cpu, (double)disk, out) != RANK_COST_OK;
}

static double prefill_of(const params_t *p, long long matched) { return rank_cost_prefill(p, matched); }

/* An instance's hits: native int64 quads (rank, npu, cpu, disk), one per rank holding block 0. */
typedef struct {
    const long long (*items)[4];
    Py_ssize_t count;
} hits_t;

/* One instance of the board: its JSON name and dp key, longest hit, hits (pointers into it). */
typedef struct {
    const char *name, *key;
    size_t name_len, key_len;
    long long longest;
    hits_t hits;
} instance_t;

/* scoring.best_rank: the largest weighted hit, then more NPU blocks, more blocks, the lower
 * rank.  Sets s->rank/-1 and the tiers.  0 on success, -1 with an exception. */
static void longest_hit(const params_t *p, const hits_t *hits, scored_t *s) {
    int found = 0;
    double best_w = 0.0;
    long long best[4] = {0, 0, 0, 0}, best_total = 0;
    for (Py_ssize_t j = 0; j < hits->count; j++) {
        const long long *h = hits->items[j];
        const double weighted = (double)h[1] * p->w_npu + (double)h[2] * p->w_cpu + (double)h[3] * p->w_disk;
        if (found && weighted < best_w) {
            continue;
        }
        const long long total = h[1] + h[2] + h[3];
        if (total <= 0) {
            continue;
        }
        int better = !found || weighted > best_w;
        if (!better) { /* (npu, total, -rank) > best's, lexicographically */
            better =
                h[1] > best[1] || (h[1] == best[1] && (total > best_total || (total == best_total && h[0] < best[0])));
        }
        if (better) {
            found = 1;
            best_w = weighted;
            memcpy(best, h, sizeof best);
            best_total = total;
        }
    }
    s->rank = found ? best[0] : -1;
    s->has_hit = found;
    s->npu = best[1];
    s->cpu = best[2];
    s->disk = best[3];
}

/* The attribute names of rank_loads.LiveLoads the scoring reads (interned at import). */
static PyObject *name_received, *name_total, *name_loads;

/* A float attribute of `obj` into *out: 0, or -1 with an exception. */
static int float_attr(PyObject *obj, PyObject *name, double *out) {
    PyObject *value = PyObject_GetAttr(obj, name);
    if (value == NULL) {
        return -1;
    }
    *out = PyFloat_AsDouble(value);
    Py_DECREF(value);
    return *out == -1.0 && PyErr_Occurred() ? -1 : 0;
}

/* An instance's rank_loads.LiveLoads, through its public attributes: `received`, `total` (the
 * instance's load, as the reference reads it) and `loads`, a buffer of doubles (format "d") held in *view
 * until the caller releases it.  0, or -1 with an exception. */
static int live_read(PyObject *live, double *received, double *total, Py_buffer *view) {
    if (float_attr(live, name_received, received) != 0 || float_attr(live, name_total, total) != 0) {
        return -1;
    }
    PyObject *loads = PyObject_GetAttr(live, name_loads);
    if (loads == NULL) {
        return -1;
    }
    const int status = PyObject_GetBuffer(loads, view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS);
    Py_DECREF(loads);
    if (status != 0) {
        return -1;
    }
    if (view->format == NULL || strcmp(view->format, "d") != 0 || view->itemsize != (Py_ssize_t)sizeof(double)) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_TypeError, "LiveLoads.loads is a buffer of doubles (array('d'))");
        return -1;
    }
    return 0;
}

/* One instance scored (_InstanceScores.at).  `live` is its RankLoadBook live entry or NULL;
 * fresh when received within stale_after of now.  0 on success, 1 to fall back, -1 with an
 * exception. */
static int score_instance(const params_t *p, const hits_t *hits, PyObject *live, double now, double stale_after,
                          uint64_t spread, scored_t *s) {
    memset(s, 0, sizeof *s);
    const double *values = NULL;
    Py_ssize_t size = 0;
    Py_buffer view = {0};
    if (live != NULL) {
        double total;
        if (live_read(live, &s->received, &total, &view) != 0) {
            return -1;
        }
        s->fresh = !(now - s->received > stale_after); /* RankLoadBook.token: stale past stale_after */
        if (s->fresh) {
            s->load_estimate = total;
            values = view.buf;
            size = view.len / (Py_ssize_t)sizeof(double);
        }
    }
    if (size == 0) { /* no figures: the longest hit, as before loads existed */
        if (view.obj != NULL) {
            PyBuffer_Release(&view);
        }
        s->load_estimate = 0.0;
        longest_hit(p, hits, s);
        if (s->has_hit && matched_of(p, s->npu, s->cpu, s->disk, &s->matched) != 0) {
            return 1;
        }
        s->cost = prefill_of(p, s->matched); /* cfg.prefill_load_scale * prefill_cost(matched) */
        return isfinite(s->cost) ? 0 : 1;
    }
    /* Each rank's hit by rank (ranks below size only, as _HitsShape.tiers). */
    Py_ssize_t stack_index[256];
    Py_ssize_t *index = size <= 256 ? stack_index : PyMem_Malloc((size_t)size * sizeof(Py_ssize_t));
    int status = 0;
    if (index == NULL) {
        PyBuffer_Release(&view);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t r = 0; r < size; r++) {
        index[r] = -1;
    }
    for (Py_ssize_t j = 0; j < hits->count; j++) {
        const long long rank = hits->items[j][0];
        if (rank >= 0 && rank < size) {
            index[rank] = j;
        }
    }
    const double miss = prefill_of(p, 0);
    const Py_ssize_t start = (Py_ssize_t)(spread % (uint64_t)size);
    double best_cost = 0.0, best_load = 0.0;
    Py_ssize_t best_rank = start;
    for (Py_ssize_t k = 0, r = start; k < size; k++, r = r + 1 < size ? r + 1 : 0) { /* (start + k) % size */
        const double load = values[r];
        if (!isfinite(load)) {
            status = 1;
            goto done;
        }
        double prefill = miss;
        if (index[r] >= 0) {
            const long long *h = hits->items[index[r]];
            long long matched = 0;
            if (matched_of(p, h[1], h[2], h[3], &matched) != 0) {
                status = 1;
                goto done;
            }
            prefill = prefill_of(p, matched);
        }
        const double cost = rank_cost_of(p, prefill, load);
        if (k == 0 || cost < best_cost) { /* the first among equals from the start, as min() then index() */
            best_cost = cost;
            best_rank = r;
            best_load = load;
        }
    }
    if (!isfinite(best_cost)) {
        status = 1;
        goto done;
    }
    s->rank = best_rank;
    s->cost = best_cost;
    s->load = best_load;
    if (index[best_rank] >= 0) {
        const long long *h = hits->items[index[best_rank]];
        s->has_hit = 1;
        s->npu = h[1];
        s->cpu = h[2];
        s->disk = h[3];
        if (matched_of(p, h[1], h[2], h[3], &s->matched) != 0) {
            status = 1;
        }
    }
done:
    if (index != stack_index) {
        PyMem_Free(index);
    }
    PyBuffer_Release(&view);
    return status;
}
