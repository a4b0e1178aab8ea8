/* rank_answer: the board rank_render.RankTable built, read; each instance scored
 * (answer_score.c); the best picked, its figures committed and counted; the answer written
 * (answer_json.c).
 *
 * One file of the router's extension (motor_adapter._answer): a unity build, included by
 * motor_adapter/_answer.c in order: answer_score.c (the scoring), answer_json.c (the text),
 * answer.c (the board read and the call). */

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
 * each instance whose scored rank holds a hit): rank_render.apply commits and counts them.
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
    /* pick_instance: the lowest cost; equal costs go to the one `spread`'s high 32 bits name among them
     * (its low bits start the dispatcher's rank scan). */
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
    Py_ssize_t pick = (Py_ssize_t)((spread >> 32) % (uint64_t)tied), best = 0;
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
        const double margin = MOTOR_BOOK_MARGIN * p.load_weight / scale; /* scoring.MOTOR_BOOK_MARGIN */
        const double anchor = (double)(top->matched < p.isl ? top->matched : (long long)p.isl);
        for (Py_ssize_t i = 0; i < n; i++) {
            const double target = scored[i].cost - p.load_weight * scored[i].load_estimate;
            double v = anchor - (target - t_best) / scale;
            if (i != best && scored[i].fresh && top->fresh) { /* Motor's own book must not outweigh the pick */
                v -= margin;
            }
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
     * native int64 triples in one bytes object (rank_render.AnswerTally reads them with array). */
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
