/* Msgpack arrays of token ids read into u32: the two-chain decoder, the AVX-512 VBMI wide
 * decoder (checked at run time), u32_from_msgpack and u32_count_msgpack.
 *
 * One file of the _native extension: a unity build, included by sglang_kvpub/core/_native.c in
 * order (docs/native.md says what each part is for and why it is native). */

/* Reads a big-endian unsigned integer of `size` bytes. */
static uint64_t read_be(const unsigned char *at, int size) {
    uint64_t value = 0;
    for (int i = 0; i < size; i++) {
        value = (value << 8) | at[i];
    }
    return value;
}

/* Decodes one msgpack integer at `at` (within `stop`) into *value; the bytes it took, or 0
 * when the item is no integer in [0, 2^32) (a negative, a float, a string...). */
static Py_ssize_t msgpack_u32(const unsigned char *at, const unsigned char *stop, uint32_t *value) {
    const unsigned char tag = *at;
    const Py_ssize_t room = stop - at;
    if (tag <= 0x7f) { /* positive fixint */
        *value = tag;
        return 1;
    }
    switch (tag) { /* the three forms token ids take, spelled out: this loop runs per id */
        case 0xcc:
            if (room < 2) return 0;
            *value = at[1];
            return 2;
        case 0xcd:
            if (room < 3) return 0;
            *value = ((uint32_t)at[1] << 8) | at[2];
            return 3;
        case 0xce:
            if (room < 5) return 0;
            *value = ((uint32_t)at[1] << 24) | ((uint32_t)at[2] << 16) | ((uint32_t)at[3] << 8) | at[4];
            return 5;
        default: break;
    }
    int size;
    int is_signed = 0;
    switch (tag) {
        case 0xcf: size = 8; break;
        case 0xd0:
            size = 1;
            is_signed = 1;
            break;
        case 0xd1:
            size = 2;
            is_signed = 1;
            break;
        case 0xd2:
            size = 4;
            is_signed = 1;
            break;
        case 0xd3:
            size = 8;
            is_signed = 1;
            break;
        default: return 0;
    }
    if (room < 1 + size) {
        return 0;
    }
    const uint64_t raw = read_be(at + 1, size);
    if ((is_signed && (raw >> (size * 8 - 1)) & 1) || raw > 0xFFFFFFFFull) {
        return 0; /* negative, or beyond u32 */
    }
    *value = (uint32_t)raw;
    return 1 + size;
}

static const unsigned char *msgpack_skip(const unsigned char *at, const unsigned char *stop);

/* Decodes leading ids of the forms token ids take (fixint, 0xcc, 0xcd, 0xce) into `ids`
 * while 5 bytes remain, each item's length and value computed from its tag rather than
 * switched on: the forms mix at random within a prompt, so a switch per id (msgpack_u32's)
 * mispredicts often (docs/native.md has the figures).  Stops at the first other item
 * (msgpack_u32 takes it, or refuses it); returns the ids decoded. */
static Py_ssize_t u32_run(const unsigned char **cursor, const unsigned char *stop, uint32_t *ids, Py_ssize_t count) {
    const unsigned char *at = *cursor;
    Py_ssize_t i = 0;
    while (i < count && stop - at >= 5) {
        const uint32_t tag = at[0];
        const uint32_t form = tag - 0xcc; /* 0, 1, 2 for 0xcc, 0xcd, 0xce; wraps high otherwise */
        const uint32_t fix = tag < 0x80;
        if (!fix && form > 2) {
            break;
        }
        uint32_t word;
        memcpy(&word, at + 1, 4);
        word = (word >> 24) | ((word >> 8) & 0xff00u) | ((word << 8) & 0xff0000u) | (word << 24); /* big-endian */
        const uint32_t bits = fix ? 0 : 8u << form; /* payload bits: 0, 8, 16 or 32 */
        const uint32_t value = (uint32_t)((uint64_t)word >> (32 - bits));
        ids[i++] = fix ? tag : value;
        at += 1 + (bits >> 3);
    }
    *cursor = at;
    return i;
}

/* One item of u32_run's forms at `at` (5 bytes readable): its value in *value and its
 * length, or 0 when it is of another form. */
static inline Py_ssize_t u32_item(const unsigned char *at, uint32_t *value) {
    const uint32_t tag = at[0];
    const uint32_t form = tag - 0xcc;
    const uint32_t fix = tag < 0x80;
    if (!fix && form > 2) {
        return 0;
    }
    uint32_t word;
    memcpy(&word, at + 1, 4);
    word = (word >> 24) | ((word >> 8) & 0xff00u) | ((word << 8) & 0xff0000u) | (word << 24);
    const uint32_t bits = fix ? 0 : 8u << form;
    *value = fix ? tag : (uint32_t)((uint64_t)word >> (32 - bits));
    return 1 + (bits >> 3);
}

#define U32_SPLIT_MIN   1024 /* ids: below this one chain (u32_run) does it */
#define U32_SPLIT_PROBE 64   /* ids decoded alone first, to measure the bytes an id takes */
#define U32_SPLIT_PRIME 12   /* items a second chain's start must decode in a row */

/* Whether U32_SPLIT_PRIME items of u32_run's forms decode in a row from `at`. */
static int u32_primes(const unsigned char *at, const unsigned char *stop) {
    for (int k = 0; k < U32_SPLIT_PRIME; k++) {
        uint32_t value;
        const Py_ssize_t len = stop - at >= 5 ? u32_item(at, &value) : 0;
        if (len == 0) {
            return 0;
        }
        at += len;
    }
    return 1;
}

/* u32_run in two chains at once.  Each item's length depends on its tag, so one chain is a
 * serial dependency (load a tag, compute its length, add), whatever the core's width.  A
 * second chain starts near where the second half should begin (the first byte from which
 * U32_SPLIT_PRIME items decode), decodes speculatively into its own buffer and records where
 * each of its items starts; the first chain then runs on until it stands where the second
 * one had an item - from the same byte both decode the same items, so the second chain's
 * from there on are the array's.  If they never meet, the first chain decodes on alone: the
 * result is u32_run's exactly, only the time differs. */
static Py_ssize_t u32_run_split(const unsigned char **cursor, const unsigned char *stop, uint32_t *ids,
                                Py_ssize_t count) {
    const unsigned char *base = *cursor;
    const unsigned char *a = base;
    Py_ssize_t i = u32_run(&a, stop, ids, count < U32_SPLIT_PROBE ? count : U32_SPLIT_PROBE);
    const Py_ssize_t rest = count - i;
    const Py_ssize_t half = rest / 2;
    uint32_t *b_values = NULL;
    const unsigned char *b = NULL;
    /* fixints only (a byte an id): u32_run's branch predicts every length, nothing to gain */
    if (i == U32_SPLIT_PROBE && count >= U32_SPLIT_MIN && a - base >= 2 * i && stop - base < 0xFFFFFFF0) {
        const unsigned char *guess = a + (size_t)(a - base) * (size_t)half / (size_t)i; /* item i + half's start? */
        for (int shift = 0; shift < 16 && guess + shift < stop; shift++) {
            if (u32_primes(guess + shift, stop)) {
                b = guess + shift;
                break;
            }
        }
        if (b != NULL) {
            b_values = PyMem_Malloc((size_t)(rest - half + U32_SPLIT_PROBE) * 2 * sizeof(uint32_t));
        }
    }
    if (b_values == NULL) { /* too short, no start found (or no memory): one chain */
        i += u32_run(&a, stop, ids + i, count - i);
        *cursor = a;
        return i;
    }
    const Py_ssize_t budget = rest - half + U32_SPLIT_PROBE;
    uint32_t *b_starts = b_values + budget; /* offsets from `base` */
    const unsigned char *const b_first = b;
    Py_ssize_t nb = 0;
    int a_failed = 0;
    while (i < count && a < b_first && nb < budget && stop - b >= 5) { /* a < b_first: 5 bytes readable */
        uint32_t value;
        const Py_ssize_t a_len = u32_item(a, &value);
        if (a_len == 0) {
            a_failed = 1;
            break;
        }
        ids[i++] = value;
        a += a_len;
        const Py_ssize_t b_len = u32_item(b, &value);
        if (b_len == 0) {
            break;
        }
        b_values[nb] = value;
        b_starts[nb++] = (uint32_t)(b - base);
        b += b_len;
    }
    Py_ssize_t j = 0;
    while (!a_failed && i < count && stop - a >= 5) { /* the first chain on, until it meets the second */
        const uint32_t at = (uint32_t)(a - base);
        while (j < nb && b_starts[j] < at) {
            j++;
        }
        if (j >= nb) {
            break; /* past every item the second chain decoded: on alone */
        }
        if (b_starts[j] == at) { /* in step: the second chain's items from j are the array's */
            Py_ssize_t take = nb - j;
            if (take > count - i) {
                take = count - i;
            }
            memcpy(ids + i, b_values + j, (size_t)take * sizeof(uint32_t));
            i += take;
            a = j + take < nb ? base + b_starts[j + take] : b;
            break;
        }
        uint32_t value;
        const Py_ssize_t a_len = u32_item(a, &value);
        if (a_len == 0) {
            break;
        }
        ids[i++] = value;
        a += a_len;
    }
    PyMem_Free(b_values);
    i += u32_run(&a, stop, ids + i, count - i); /* what the second chain did not reach */
    *cursor = a;
    return i;
}

/* ------------------------------------------------------------------ wide id decode
 *
 * u32_run over 64-byte windows with AVX-512 VBMI, where the CPU has it (checked at run time;
 * the build needs no flag): the same ids, the same stopping point, 1.7x (ids of a 150k
 * vocabulary, mostly 3 and 5 bytes) to 3.4x (text-like ids, mostly 1 and 2) faster than the
 * two chains.  Per window, with no dependency on the windows before: each byte's item
 * length taken as a tag (1, 2, 3, 5; 0 for another form), jump[0][p] = p + length, and
 * jump[b] = jump[b-1] o jump[b-1] (where 2^b items from p end; positions past the window
 * stay put, an item of another form is a fixed point).  The one serial step a window is a
 * byte: the window's exit from the entry e, jump[6][e] (at most 64 items a window).  Item k
 * starts at jump[k's bits](e); each item's value is gathered from the 4 bytes ending with
 * its last one (byte-swapped, masked to its payload). */
#if defined(__x86_64__) && defined(__GNUC__) && (defined(__clang__) || __GNUC__ >= 8)
#define HAVE_WIDE_DECODE 1
#include <immintrin.h>

static int wide_decode = -1; /* -1: not looked up yet */

static int wide_decode_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("bmi");
}

__attribute__((target("avx512f,avx512bw,avx512vbmi,bmi"))) static Py_ssize_t
u32_run_wide(const unsigned char **cursor, const unsigned char *stop, uint32_t *ids, Py_ssize_t count) {
    const unsigned char *w = *cursor; /* the window; an item starts at w + e */
    Py_ssize_t i = 0;
    uint32_t e = 0;
    const __m512i lane =
        _mm512_set_epi8(63, 62, 61, 60, 59, 58, 57, 56, 55, 54, 53, 52, 51, 50, 49, 48, 47, 46, 45, 44, 43, 42, 41, 40,
                        39, 38, 37, 36, 35, 34, 33, 32, 31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16,
                        15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i beyond = _mm512_add_epi8(lane, _mm512_set1_epi8(64)); /* positions 64..127 map to themselves */
    /* by item length: the right shift of an all-ones mask that keeps its payload (0: none) */
    const __m512i shift_of_len = _mm512_set_epi32(32, 32, 32, 32, 32, 32, 32, 32, 32, 32, 0, 32, 16, 24, 24, 32);
    const __m512i back = _mm512_set1_epi32(0x03020100);
    const __m512i spread =
        _mm512_set_epi32(0x0c0c0c0c, 0x08080808, 0x04040404, 0, 0x0c0c0c0c, 0x08080808, 0x04040404, 0, 0x0c0c0c0c,
                         0x08080808, 0x04040404, 0, 0x0c0c0c0c, 0x08080808, 0x04040404, 0);
    const __mmask64 bit[6] = {0xAAAAAAAAAAAAAAAAull, 0xCCCCCCCCCCCCCCCCull, 0xF0F0F0F0F0F0F0F0ull,
                              0xFF00FF00FF00FF00ull, 0xFFFF0000FFFF0000ull, 0xFFFFFFFF00000000ull};
    unsigned char starts[64], ends[64], lens[64];
    while (i < count && stop - w >= 128) { /* the window and the next one readable: items run past it */
        const __m512i data = _mm512_loadu_si512(w);
        const __m512i next = _mm512_loadu_si512(w + 64);
        __m512i len =
            _mm512_maskz_mov_epi8(_mm512_cmplt_epu8_mask(data, _mm512_set1_epi8((char)0x80)), _mm512_set1_epi8(1));
        len =
            _mm512_mask_mov_epi8(len, _mm512_cmpeq_epi8_mask(data, _mm512_set1_epi8((char)0xcc)), _mm512_set1_epi8(2));
        len =
            _mm512_mask_mov_epi8(len, _mm512_cmpeq_epi8_mask(data, _mm512_set1_epi8((char)0xcd)), _mm512_set1_epi8(3));
        len =
            _mm512_mask_mov_epi8(len, _mm512_cmpeq_epi8_mask(data, _mm512_set1_epi8((char)0xce)), _mm512_set1_epi8(5));
        __m512i jump[7];
        jump[0] = _mm512_add_epi8(lane, len);
        for (int b = 1; b < 7; b++) {
            jump[b] = _mm512_permutex2var_epi8(jump[b - 1], jump[b - 1], beyond);
        }
        const uint64_t exits = (uint64_t)_mm_cvtsi128_si64(_mm512_castsi512_si128(jump[6])); /* from e in 0..7 */
        const uint32_t out = (uint32_t)(exits >> (8 * e)) & 0xff;
        __m512i at = _mm512_set1_epi8((char)e); /* lane k: where item k starts */
        for (int b = 0; b < 6; b++) {
            at = _mm512_mask2_permutex2var_epi8(jump[b], at, bit[b], beyond);
        }
        const __m512i len_at = _mm512_permutex2var_epi8(len, at, _mm512_setzero_si512());
        const Py_ssize_t n = (Py_ssize_t)_tzcnt_u64(~_mm512_test_epi8_mask(len_at, len_at)); /* items in the window */
        const Py_ssize_t m = n < count - i ? n : count - i;
        _mm512_storeu_si512(starts, at);
        _mm512_storeu_si512(ends, _mm512_sub_epi8(_mm512_add_epi8(at, len_at), _mm512_set1_epi8(1)));
        _mm512_storeu_si512(lens, len_at);
        for (Py_ssize_t g = 0; g < m; g += 16) {
            const __m512i end = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(ends + g)));
            const __m512i from = _mm512_sub_epi8(_mm512_shuffle_epi8(end, spread), back); /* end, end-1, end-2, end-3 */
            const __m512i item_len = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(lens + g)));
            const __m512i keep =
                _mm512_srlv_epi32(_mm512_set1_epi32(-1), _mm512_permutexvar_epi32(item_len, shift_of_len));
            const __m512i value = _mm512_and_si512(_mm512_permutex2var_epi8(data, from, next), keep);
            const Py_ssize_t left = m - g;
            _mm512_mask_storeu_epi32(ids + i + g, left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1),
                                     value);
        }
        i += m;
        if (m < n || out < 64) { /* the array's end, or an item of another form (u32_run stops there) */
            w += starts[m];
            e = 0;
            break;
        }
        e = out - 64;
        w += 64;
    }
    w += e;
    i += u32_run(&w, stop, ids + i, count - i); /* the last window's items */
    *cursor = w;
    return i;
}
#endif

/* u32_decode_wide(enabled) -> bool
 *
 * Whether the ids are decoded with AVX-512 VBMI (see u32_run_wide) after the call: None asks,
 * True turns it on where the CPU has it, False off (the two chains: a side-by-side figure,
 * and the tests check both ways agree). */
static PyObject *native_u32_decode_wide(PyObject *self, PyObject *arg) {
#ifdef HAVE_WIDE_DECODE
    if (wide_decode < 0) {
        wide_decode = wide_decode_supported();
    }
    if (arg != Py_None) {
        const int wanted = PyObject_IsTrue(arg);
        if (wanted < 0) {
            return NULL;
        }
        wide_decode = wanted && wide_decode_supported();
    }
    return PyBool_FromLong(wide_decode);
#else
    (void)arg;
    Py_RETURN_FALSE;
#endif
}

/* The leading ids of u32_run's forms: wide where the CPU allows, else in two chains. */
static Py_ssize_t u32_run_fast(const unsigned char **cursor, const unsigned char *stop, uint32_t *ids,
                               Py_ssize_t count) {
#ifdef HAVE_WIDE_DECODE
    if (wide_decode < 0) {
        wide_decode = wide_decode_supported();
    }
    if (wide_decode) {
        return u32_run_wide(cursor, stop, ids, count);
    }
#endif
    return u32_run_split(cursor, stop, ids, count);
}

/* The item count of the msgpack array at `at` (*items set past its header), or -1 when it is
 * no array. */
static Py_ssize_t msgpack_array_header(const unsigned char *at, const unsigned char *stop,
                                       const unsigned char **items) {
    const Py_ssize_t room = stop - at;
    if (room >= 1 && (at[0] & 0xf0) == 0x90) {
        *items = at + 1;
        return at[0] & 0x0f;
    }
    if (room >= 3 && at[0] == 0xdc) {
        *items = at + 3;
        return (Py_ssize_t)read_be(at + 1, 2);
    }
    if (room >= 5 && at[0] == 0xdd) {
        *items = at + 5;
        return (Py_ssize_t)read_be(at + 1, 4);
    }
    return -1;
}

/* Items `first` to `count` - 1 of an array, item `first` at `at`, as u32 into ids[first..];
 * *end set past them.  -1 with ValueError naming the first bad item by its index in the
 * array; *truncated set when the items run past `stop` (malformed msgpack rather than a bad
 * id).  `first` > 0: take_query_keys reusing a remembered body's leading blocks. */
static int u32_items(const unsigned char *at, const unsigned char *stop, Py_ssize_t first, Py_ssize_t count,
                     uint32_t *ids, const unsigned char **end, int *truncated) {
    *truncated = 0;
    for (Py_ssize_t i = first + u32_run_fast(&at, stop, ids + first, count - first); i < count; i++) { /* the rest */
        uint32_t value = 0;
        const Py_ssize_t taken = at < stop ? msgpack_u32(at, stop, &value) : 0;
        if (taken == 0) {
            *truncated = at >= stop || msgpack_skip(at, stop) == NULL;
            if (*truncated) {
                PyErr_SetString(PyExc_ValueError, "token_ids: truncated array");
            } else {
                PyErr_Format(PyExc_ValueError, "token_ids[%zd] must be an integer in [0, 2^32)", i);
            }
            return -1;
        }
        ids[i] = value; /* little-endian host (checked by bind) */
        at += taken;
    }
    *end = at;
    return 0;
}

/* The count of the msgpack array at `at` (*items set past its header), checked against the
 * bytes left: -1 with ValueError when it is no array, or (*truncated set) runs past `stop`. */
static Py_ssize_t u32_array_count(const unsigned char *at, const unsigned char *stop, const unsigned char **items,
                                  int *truncated) {
    *truncated = 0;
    const Py_ssize_t count = msgpack_array_header(at, stop, items);
    if (count < 0) {
        PyErr_SetString(PyExc_ValueError, "token_ids must be an array");
        return -1;
    }
    if (count > stop - *items) { /* every item takes at least one byte */
        *truncated = 1;
        PyErr_SetString(PyExc_ValueError, "token_ids: truncated array");
        return -1;
    }
    return count;
}

/* The end of the msgpack value starting at `at`, or NULL when it is malformed or runs past
 * `stop`.  Iterative: containers add their items to the count still to skip. */
static const unsigned char *msgpack_skip(const unsigned char *at, const unsigned char *stop) {
    uint64_t pending = 1;
    while (pending > 0) {
        if (at >= stop) {
            return NULL;
        }
        pending--;
        const unsigned char tag = *at++;
        uint64_t length = 0; /* payload bytes after the header */
        if (tag <= 0x7f || tag >= 0xe0 || tag == 0xc0 || tag == 0xc2 || tag == 0xc3) {
            continue;
        } else if (tag <= 0x8f) {
            pending += 2 * (uint64_t)(tag & 0x0f);
            continue;
        } else if (tag <= 0x9f) {
            pending += tag & 0x0f;
            continue;
        } else if (tag <= 0xbf) {
            length = tag & 0x1f;
        } else {
            static const int header[32] = {
                /* c0..cf */ 0, -1, 0, 0, 1, 2, 4, 1, 2, 4, 0, 0, 0, 0, 0, 0,
                /* d0..df */ 0, 0,  0, 0, 0, 0, 0, 0, 0, 1, 2, 4, 2, 4, 2, 4,
            };
            static const int fixed[32] = {
                /* c0..cf */ 0, 0, 0, 0, 0, 0, 0, 1, 1,  1, 4, 8, 1, 2, 4, 8,
                /* d0..df */ 1, 2, 4, 8, 2, 3, 5, 9, 17, 0, 0, 0, 0, 0, 0, 0,
            };
            const int size = header[tag - 0xc0];
            if (size < 0 || stop - at < size) {
                return NULL;
            }
            const uint64_t count = read_be(at, size);
            at += size;
            if (tag == 0xdc || tag == 0xdd) {
                pending += count;
                continue;
            }
            if (tag == 0xde || tag == 0xdf) {
                pending += 2 * count;
                continue;
            }
            length = count + (uint64_t)fixed[tag - 0xc0]; /* bin/str/ext: count bytes (+ ext type) */
        }
        if ((uint64_t)(stop - at) < length) {
            return NULL;
        }
        at += length;
    }
    return at;
}
