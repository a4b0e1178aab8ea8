/* The one open-addressing table of u64 -> u64 under KeyMasks (key -> low 64 worker bits) and
 * HashKeys (engine hash -> key).
 *
 * One array of 16-byte slots, a power of two of them; Fibonacci hashing to a home slot,
 * linear probing, deletion by backward shift (no tombstones, so churn never grows it).  Key 0
 * marks an empty slot, so an entry for key 0 is kept beside the array.  Each owner sets its
 * bound on the load (num/den), its smallest capacity and whether a large array is aligned to
 * and advised for huge pages (a probe then costs a cache miss, not a TLB miss too; such an
 * array is malloc'ed, others come from PyMem, which tracemalloc sees).
 *
 * The types and the lookups, inlined into their callers; u64_table.c holds the writes.  Both
 * extensions compile these files (a unity build: sglang_kvpub/core/_native.c for KeyMasks and
 * HashKeys, motor_adapter/_answer.c for QueryKeysMemo's index); the engine owns them. */
#ifndef KVPUB_U64_TABLE_H
#define KVPUB_U64_TABLE_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
    uint64_t key; /* 0: empty (key 0 lives in zero_value) */
    uint64_t value;
} u64_slot;

typedef struct {
    u64_slot *slots;
    size_t capacity; /* a power of two, or 0 */
    size_t used;     /* slots in use (key 0 not counted) */
    int shift;       /* 64 - log2(capacity) */
    int has_zero;
    uint64_t zero_value;
    /* the owner's settings */
    unsigned load_num, load_den;
    size_t min_capacity;
    int huge;
} u64_table;

#define HUGE_PAGE (2u << 20)

static inline size_t u64_home(uint64_t key, int shift) { return (size_t)((key * 0x9E3779B97F4A7C15ULL) >> shift); }

static inline size_t u64_len(const u64_table *t) { return t->used + (t->has_zero ? 1 : 0); }

static inline void u64_prefetch(const u64_table *t, uint64_t key) {
    if (t->capacity != 0) {
        __builtin_prefetch(&t->slots[u64_home(key, t->shift)]);
    }
}

/* The slot holding `key` (non-zero), or NULL. */
static inline u64_slot *u64_find(const u64_table *t, uint64_t key) {
    if (t->capacity == 0) {
        return NULL;
    }
    const size_t mask = t->capacity - 1;
    for (size_t i = u64_home(key, t->shift);; i = (i + 1) & mask) {
        u64_slot *slot = &t->slots[i];
        if (slot->key == key) {
            return slot;
        }
        if (slot->key == 0) {
            return NULL;
        }
    }
}

/* Whether `key` is held, its value in *value. */
static inline int u64_get(const u64_table *t, uint64_t key, uint64_t *value) {
    if (key == 0) {
        *value = t->zero_value;
        return t->has_zero;
    }
    const u64_slot *slot = u64_find(t, key);
    if (slot == NULL) {
        return 0;
    }
    *value = slot->value;
    return 1;
}

#endif /* KVPUB_U64_TABLE_H */
