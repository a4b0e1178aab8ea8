/* The rank-aware answer's JSON text, written as msgspec writes the reference's dict: a
 * growing buffer kept between calls, integers from digit pairs, floats as "%.1f" of
 * round(x, 1) where that is exact (renderable), and one entry per instance.
 *
 * One file of the router's extension (motor_adapter._answer): a unity build, included by
 * motor_adapter/_answer.c in order: answer_score.c (the scoring), answer_json.c (the text),
 * answer.c (the board read and the call). */

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
    if (n <= 64) { /* names, keys, digits: short enough that a byte loop beats a libc call per copy */
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
