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
 * motor_adapter/_answer.c. */

/* Floats print as "%.1f" of round(x, 1) - what msgspec writes for them - below this. */
#define EXACT_FLOAT_MAX 1e15
/* Ints from float rounding (Motor's DP values) stay within this. */
#define EXACT_INT_MAX 4e18

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
 * loads' sum as sum() adds them) and `loads`, a buffer of doubles (format "d") held in *view
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

/* ------------------------------------------------------------------ the JSON text */

typedef struct {
    char *data;
    size_t len, cap;
} text_t;

/* The answer's text buffer, kept between calls (the GIL serialises them; rank_answer takes it
 * and gives it back, so a call made meanwhile would only start with none): up to this size. */
#define SCRATCH_MAX (1 << 20)
static text_t scratch = {NULL, 0, 0};

static inline __attribute__((always_inline)) int text_room(text_t *t, size_t more) {
    if (t->len + more <= t->cap) {
        return 0;
    }
    size_t cap = t->cap ? t->cap : 1024;
    while (cap < t->len + more) {
        cap *= 2;
    }
    char *data = PyMem_Realloc(t->data, cap);
    if (data == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    t->data = data;
    t->cap = cap;
    return 0;
}

static inline __attribute__((always_inline)) int text_raw(text_t *t, const char *s, size_t n) {
    if (text_room(t, n) != 0) {
        return -1;
    }
    char *to = t->data + t->len;
    if (n <= 64) { /* names, keys, digits: a libc memcpy per copy made an 8-instance answer 3.3 us, not 2.2 */
        for (size_t k = 0; k < n; k++) {
            to[k] = s[k];
        }
    } else {
        memcpy(to, s, n);
    }
    t->len += n;
    return 0;
}

#define TEXT_LIT(t, s) text_raw((t), (s), sizeof(s) - 1)

/* "00".."99": two digits per division (an answer prints ~100 figures of a few digits each). */
static const char digit_pairs[201] =
    "0001020304050607080910111213141516171819202122232425262728293031323334353637383940414243444546474849"
    "5051525354555657585960616263646566676869707172737475767778798081828384858687888990919293949596979899";

/* The decimal digits of u written ending at `end` (backwards); returns where they start. */
static inline char *digits_before(char *end, unsigned long long u) {
    while (u >= 100) {
        const unsigned pair = (unsigned)(u % 100) * 2;
        u /= 100;
        *--end = digit_pairs[pair + 1];
        *--end = digit_pairs[pair];
    }
    if (u >= 10) {
        *--end = digit_pairs[u * 2 + 1];
        *--end = digit_pairs[u * 2];
    } else {
        *--end = (char)('0' + u);
    }
    return end;
}

static inline int digit_count(unsigned long long u) {
    int n = 1;
    for (unsigned long long bound = 10; u >= bound && n < 20; bound *= 10) { /* no division: 20 digits at most */
        n++;
    }
    return n;
}

/* v in decimal, written in place (a small copy per figure costs more than the digits). */
static int text_int(text_t *t, long long v) {
    if (text_room(t, 24) != 0) {
        return -1;
    }
    const unsigned long long u = v < 0 ? 0ULL - (unsigned long long)v : (unsigned long long)v;
    char *at = t->data + t->len;
    if (v < 0) {
        *at++ = '-';
    }
    const int n = digit_count(u);
    digits_before(at + n, u);
    t->len = (size_t)(at + n - t->data);
    return 0;
}

static int text_rank(text_t *t, long long rank) { return rank < 0 ? TEXT_LIT(t, "null") : text_int(t, rank); }

/* round(v, 1) as msgspec writes it: CPython's correctly rounded one-decimal form ("%.1f"
 * through PyOS_double_to_string), which is the shortest repr of round(v, 1) below
 * EXACT_FLOAT_MAX (v checked finite and below it by the caller).  A whole number (loads are
 * token counts) is its integer's digits and ".0", exactly what that form is for it. */
static int text_round1(text_t *t, double v) {
    if (v == trunc(v) && !(v == 0.0 && signbit(v))) { /* a whole number (|v| < 1e15): its digits and ".0" */
        return text_int(t, (long long)v) || TEXT_LIT(t, ".0");
    }
    char *text = PyOS_double_to_string(v, 'f', 1, 0, NULL);
    if (text == NULL) {
        return -1;
    }
    const int status = text_raw(t, text, strlen(text));
    PyMem_Free(text);
    return status;
}

static int renderable(double v) { return isfinite(v) && fabs(v) < EXACT_FLOAT_MAX; }

/* One instance's entry: "<name>":{...} (the reference's key order). */
static int text_entry(text_t *t, const instance_t *in, const scored_t *s, long long gpu, long long dp, Py_ssize_t bs) {
    const long long npu = s->has_hit ? s->npu : 0, cpu = s->has_hit ? s->cpu : 0, disk = s->has_hit ? s->disk : 0;
    if (text_raw(t, in->name, in->name_len) || TEXT_LIT(t, ":{\"longest_matched\":") || text_int(t, in->longest) ||
        TEXT_LIT(t, ",\"GPU\":") || text_int(t, gpu) || TEXT_LIT(t, ",\"CPU\":") || text_int(t, cpu * bs) ||
        TEXT_LIT(t, ",\"DISK\":") || text_int(t, disk * bs) || TEXT_LIT(t, ",\"DP\":{") ||
        text_raw(t, in->key, in->key_len) || TEXT_LIT(t, ":") || text_int(t, dp) || TEXT_LIT(t, "},\"dp_detail\":{") ||
        text_raw(t, in->key, in->key_len) || TEXT_LIT(t, ":{\"matched_tokens\":") ||
        text_int(t, (npu + cpu + disk) * bs) || TEXT_LIT(t, ",\"npu_blocks\":") || text_int(t, npu) ||
        TEXT_LIT(t, ",\"cpu_blocks\":") || text_int(t, cpu) || TEXT_LIT(t, ",\"disk_blocks\":") || text_int(t, disk) ||
        TEXT_LIT(t, ",\"engine_dp_rank\":") || text_rank(t, s->matched > 0 ? s->rank : -1) ||
        TEXT_LIT(t, ",\"scored_rank\":") || text_rank(t, s->rank) || TEXT_LIT(t, ",\"rank_cost\":") ||
        text_round1(t, s->cost) || TEXT_LIT(t, ",\"rank_load\":") || text_round1(t, s->load) || TEXT_LIT(t, "}}}")) {
        return -1;
    }
    return 0;
}

/* ------------------------------------------------------------------ the board
 *
 * One bytes object per (view, walk result), built by rank_render.RankTable, read front to back
 * (one object, contiguous: a cold cache misses a few lines, not an object per figure).  Native
 * int64 / double words:
 *   n, block_size, w_npu, w_cpu, w_disk, prefill_scale, overlap_credit, load_weight (doubles),
 *   tenant_len, tenant bytes (padded to 8);
 *   per instance: name_len, key_len, longest, hits_count, name bytes (padded), key bytes
 *   (padded), hits_count x (rank, npu, cpu, disk). */

typedef struct {
    const unsigned char *at, *stop;
} cursor_t;

static int take_word(cursor_t *c, void *out) {
    if (c->stop - c->at < 8) {
        return -1;
    }
    memcpy(out, c->at, 8);
    c->at += 8;
    return 0;
}

static int take_text(cursor_t *c, long long len, const char **out) {
    const long long padded = (len + 7) / 8 * 8;
    if (len < 0 || c->stop - c->at < padded) {
        return -1;
    }
    *out = (const char *)c->at;
    c->at += padded;
    return 0;
}

/* Parses the board into *p, the tenant and `instances` (room for n, allocated here). */
static int read_board(PyObject *board, params_t *p, const char **tenant, size_t *tenant_len, instance_t **instances,
                      Py_ssize_t *n) {
    cursor_t c = {(const unsigned char *)PyBytes_AS_STRING(board),
                  (const unsigned char *)PyBytes_AS_STRING(board) + PyBytes_GET_SIZE(board)};
    long long count, block_size, tlen;
    if (take_word(&c, &count) || take_word(&c, &block_size) || take_word(&c, &p->w_npu) || take_word(&c, &p->w_cpu) ||
        take_word(&c, &p->w_disk) || take_word(&c, &p->prefill_scale) || take_word(&c, &p->overlap_credit) ||
        take_word(&c, &p->load_weight) || take_word(&c, &tlen) || take_text(&c, tlen, tenant) || count <= 0 ||
        count > (1 << 20)) {
        goto bad;
    }
    p->block_size = block_size;
    *tenant_len = (size_t)tlen;
    *n = (Py_ssize_t)count;
    *instances = PyMem_Malloc((size_t)count * sizeof(instance_t));
    if (*instances == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (long long i = 0; i < count; i++) {
        instance_t *in = &(*instances)[i];
        long long name_len, key_len, hits_count;
        if (take_word(&c, &name_len) || take_word(&c, &key_len) || take_word(&c, &in->longest) ||
            take_word(&c, &hits_count) || take_text(&c, name_len, &in->name) || take_text(&c, key_len, &in->key) ||
            hits_count < 0 || (c.stop - c.at) / 32 < hits_count) {
            PyMem_Free(*instances);
            *instances = NULL;
            goto bad;
        }
        in->name_len = (size_t)name_len;
        in->key_len = (size_t)key_len;
        in->hits.items = (const long long(*)[4])c.at;
        in->hits.count = (Py_ssize_t)hits_count;
        c.at += hits_count * 32;
    }
    if (c.at != c.stop) {
        PyMem_Free(*instances);
        *instances = NULL;
        goto bad;
    }
    return 0;
bad:
    PyErr_SetString(PyExc_ValueError, "a malformed rank board (rank_render.RankTable builds it)");
    return -1;
}

/* rank_answer(board, streams, live, now, stale_after, isl, spread)
 *   -> False | None | (json, best_blocks, until, effects)
 *
 * board: the view's and walk result's inputs (above); streams[i]: instance i's stream, its key
 * in `live` (RankLoadBook.live: a rank_loads.LiveLoads per stream, read, never changed).
 * best_blocks: the largest hit of the answer (AdapterMetrics.observe_tally's); until: when the
 * first fresh instance goes stale (the answer holds while the book does not change until
 * then); effects: what the answer makes the caller do, as the reference does it -
 * (chosen instance, commit rank (-1: none), commit tokens, ((instance, rank, matched), ...) of
 * each instance whose scored rank holds a hit): rank_render.effects commits and counts them.
 * False: no instance has fresh loads (answer by the longest hit); None: fall back to the
 * reference. */
static PyObject *answer_rank_answer(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *board, *streams, *live, *spread_obj;
    double now, stale_after;
    params_t p;
    Py_ssize_t isl;
    if (!PyArg_ParseTuple(args, "O!O!O!ddnO", &PyBytes_Type, &board, &PyTuple_Type, &streams, &PyDict_Type, &live, &now,
                          &stale_after, &isl, &spread_obj)) {
        return NULL;
    }
    p.isl = isl;
    const uint64_t spread = PyLong_AsUnsignedLongLongMask(spread_obj);
    if (spread == (uint64_t)-1 && PyErr_Occurred()) {
        return NULL;
    }
    const char *tenant;
    size_t tenant_len;
    instance_t *instances = NULL;
    Py_ssize_t n;
    if (read_board(board, &p, &tenant, &tenant_len, &instances, &n) != 0) {
        return NULL;
    }
    if (PyTuple_GET_SIZE(streams) != n) {
        PyMem_Free(instances);
        PyErr_SetString(PyExc_ValueError, "rank_answer needs one stream per instance of the board");
        return NULL;
    }
    scored_t stack_scored[64];
    scored_t *scored = n <= 64 ? stack_scored : PyMem_Malloc((size_t)n * sizeof(scored_t));
    long long *values = PyMem_Malloc((size_t)n * 2 * sizeof(long long)); /* gpu, dp */
    text_t text = scratch; /* taken back at the end: no Python code runs while it is written */
    text.len = 0;
    scratch = (text_t){NULL, 0, 0};
    PyObject *out = NULL, *json = NULL, *counted = NULL;
    if (scored == NULL || values == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    long long *gpu = values, *dp = values + n;
    int any_fresh = 0;
    double until = INFINITY; /* when the first fresh instance goes stale: the answer holds until then */
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *loads = PyDict_GetItemWithError(live, PyTuple_GET_ITEM(streams, i)); /* borrowed */
        if (loads == NULL && PyErr_Occurred()) {
            goto fail;
        }
        const int status = score_instance(&p, &instances[i].hits, loads, now, stale_after, spread, &scored[i]);
        if (status < 0) {
            goto fail;
        }
        if (status > 0 || !renderable(scored[i].cost) || !renderable(scored[i].load) ||
            !isfinite(scored[i].load_estimate)) {
            goto fall_back;
        }
        any_fresh |= scored[i].fresh;
        if (scored[i].fresh && scored[i].received + stale_after < until) {
            until = scored[i].received + stale_after;
        }
    }
    if (!any_fresh) {
        out = Py_NewRef(Py_False);
        goto fail;
    }
    /* pick_instance: the lowest cost; equal costs go to the one `spread` names among them. */
    double low = scored[0].cost;
    for (Py_ssize_t i = 1; i < n; i++) {
        if (scored[i].cost < low) {
            low = scored[i].cost;
        }
    }
    Py_ssize_t tied = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        tied += scored[i].cost == low;
    }
    Py_ssize_t pick = (Py_ssize_t)(spread % (uint64_t)tied), best = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (scored[i].cost == low && pick-- == 0) {
            best = i;
            break;
        }
    }
    /* motor_values */
    const scored_t *top = &scored[best];
    const long long gpu_best = n > 1 && p.isl > 0 ? (top->matched > 1 ? top->matched : 1) : top->matched;
    for (Py_ssize_t i = 0; i < n; i++) {
        long long v = scored[i].matched < gpu_best - 1 ? scored[i].matched : gpu_best - 1;
        gpu[i] = i == best ? gpu_best : (v > 0 ? v : 0);
    }
    const double scale = p.prefill_scale * p.overlap_credit;
    if (scale <= 0.0) {
        for (Py_ssize_t i = 0; i < n; i++) {
            dp[i] = scored[i].matched < p.isl ? scored[i].matched : (long long)p.isl;
        }
    } else {
        const double t_best = top->cost - p.load_weight * top->load_estimate;
        const double anchor = (double)(top->matched < p.isl ? top->matched : (long long)p.isl);
        for (Py_ssize_t i = 0; i < n; i++) {
            const double target = scored[i].cost - p.load_weight * scored[i].load_estimate;
            double v = anchor - (target - t_best) / scale;
            if (!(v < (double)p.isl) && !isnan(v)) { /* min(v, float(isl)): v unless isl is smaller */
                v = (double)p.isl;
            }
            v = nearbyint(v);
            if (!isfinite(v) || fabs(v) > EXACT_INT_MAX) {
                goto fall_back;
            }
            dp[i] = (long long)v;
        }
        dp[best] = (long long)nearbyint(anchor);
    }
    /* The text: {"<tenant>":{<entries>}} */
    if (text_room(&text, (size_t)n * 512 + 64) || TEXT_LIT(&text, "{") || text_raw(&text, tenant, tenant_len) ||
        TEXT_LIT(&text, ":{")) {
        goto fail;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if ((i && TEXT_LIT(&text, ",")) || text_entry(&text, &instances[i], &scored[i], gpu[i], dp[i], p.block_size)) {
            goto fail;
        }
    }
    if (TEXT_LIT(&text, "}}")) {
        goto fail;
    }
    /* The effects: the chosen instance, the commit's rank (-1: none) and tokens, then
     * (instance, rank, matched) of each instance counted - a hit on its scored rank - as
     * native int64 triples in one bytes object (rank_render.effects reads them with array). */
    json = PyBytes_FromStringAndSize(text.data, (Py_ssize_t)text.len);
    Py_ssize_t hits = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        hits += scored[i].rank >= 0 && scored[i].has_hit; /* matched > 0 needs a hit */
    }
    counted = json != NULL ? PyBytes_FromStringAndSize(NULL, hits * 3 * (Py_ssize_t)sizeof(long long)) : NULL;
    if (counted == NULL) {
        goto fail;
    }
    long long best_blocks = 0;
    long long *triples = (long long *)PyBytes_AS_STRING(counted);
    for (Py_ssize_t i = 0, k = 0; i < n; i++) {
        const scored_t *s = &scored[i];
        if (s->rank < 0 || !s->has_hit) {
            continue;
        }
        triples[k++] = i;
        triples[k++] = s->rank;
        triples[k++] = s->matched;
        const long long total = s->npu + s->cpu + s->disk;
        best_blocks = total > best_blocks ? total : best_blocks;
    }
    out = Py_BuildValue("(OLd(nLLO))", json, best_blocks, until, best, top->rank >= 0 && top->fresh ? top->rank : -1LL,
                        (long long)p.isl - top->matched, counted);
    goto fail; /* the common exit: out is set on success */
fall_back:
    out = Py_NewRef(Py_None);
fail:
    Py_XDECREF(json);
    Py_XDECREF(counted);
    if (text.cap <= SCRATCH_MAX && scratch.data == NULL) {
        scratch = text; /* kept for the next answer: a fresh buffer each time is a cold one */
    } else {
        PyMem_Free(text.data);
    }
    PyMem_Free(values);
    if (scored != stack_scored) {
        PyMem_Free(scored);
    }
    PyMem_Free(instances);
    return out;
}
