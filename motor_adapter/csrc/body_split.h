/* A msgpack /query body split around its "token_ids" array: the shape take_token_ids,
 * take_query_keys and QueryKeysMemo share (body parsing in query_body.c, the memo in
 * query_memo.c).
 *
 * One file of the router's _answer extension: a unity build, included by
 * motor_adapter/_answer.c in order (docs/native.md says what each part is for). */

/* A msgpack /query body split around its top-level "token_ids" array: take_token_ids and
 * take_query_keys scan it alike, so they take, leave and refuse the same bodies. */
typedef struct {
    uint64_t entries;                       /* the map's */
    const unsigned char *entries_start;     /* past the map header */
    const unsigned char *found, *value_end; /* the token_ids entry: its key, the end of its value */
    const unsigned char *items;             /* the token_ids array's first item */
    Py_ssize_t count;                       /* ids */
    uint32_t *ids;                          /* in `ids_bytes`, or PyMem's (split_release frees it) */
    PyObject *ids_bytes;
    int block_size_seen; /* 0: no "block_size" key, 1: one, an integer in [0, 2^32), -1: anything else */
    uint32_t block_size;
} body_split;

static void split_release(body_split *split) {
    if (split->ids_bytes != NULL) {
        Py_CLEAR(split->ids_bytes);
    } else {
        PyMem_Free(split->ids);
    }
    split->ids = NULL;
}
