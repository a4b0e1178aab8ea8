/* The writes of the one u64 -> u64 table (u64_table.h): insertion, deletion by backward
 * shift, growth within the owner's load bound, and the array's allocation. */

#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "u64_table.h"

static void u64_table_init(u64_table *t, unsigned load_num, unsigned load_den, size_t min_capacity, int huge) {
    memset(t, 0, sizeof *t);
    t->shift = 64;
    t->load_num = load_num;
    t->load_den = load_den;
    t->min_capacity = min_capacity;
    t->huge = huge;
}

/* Inserts a non-zero key known to be absent; the table has room (u64_reserve). */
static void u64_insert_new(u64_table *t, uint64_t key, uint64_t value) {
    const size_t mask = t->capacity - 1;
    size_t i = u64_home(key, t->shift);
    while (t->slots[i].key != 0) {
        i = (i + 1) & mask;
    }
    t->slots[i].key = key;
    t->slots[i].value = value;
    t->used++;
}

/* Removes the entry in `slot`, shifting the run after it back. */
static void u64_remove_slot(u64_table *t, u64_slot *slot) {
    const size_t mask = t->capacity - 1;
    size_t hole = (size_t)(slot - t->slots);
    for (size_t next = (hole + 1) & mask; t->slots[next].key != 0; next = (next + 1) & mask) {
        const size_t home = u64_home(t->slots[next].key, t->shift);
        /* The entry at `next` may fill the hole unless its home lies cyclically in (hole, next]. */
        const int stays = hole <= next ? (home > hole && home <= next) : (home > hole || home <= next);
        if (!stays) {
            t->slots[hole] = t->slots[next];
            hole = next;
        }
    }
    t->slots[hole].key = 0;
    t->slots[hole].value = 0;
    t->used--;
}

/* Zeroed slots for `capacity`, as the owner allocates them; NULL when out of memory. */
static u64_slot *u64_alloc(const u64_table *t, size_t capacity) {
    const size_t bytes = capacity * sizeof(u64_slot);
    if (!t->huge) {
        return PyMem_Calloc(capacity, sizeof(u64_slot));
    }
    void *memory = NULL;
    if (posix_memalign(&memory, bytes >= HUGE_PAGE ? HUGE_PAGE : 64, bytes) != 0) {
        return NULL;
    }
#ifdef MADV_HUGEPAGE
    if (bytes >= HUGE_PAGE) {
        (void)madvise(memory, bytes, MADV_HUGEPAGE); /* advice only: THP may be off */
    }
#endif
    memset(memory, 0, bytes);
    return memory;
}

static void u64_free(const u64_table *t, u64_slot *slots) {
    if (t->huge) {
        free(slots);
    } else {
        PyMem_Free(slots);
    }
}

/* Room for `extra` more entries within the load bound; -1 with MemoryError. */
static int u64_reserve(u64_table *t, size_t extra) {
    const size_t need = t->used + extra;
    if (need * t->load_den <= t->capacity * t->load_num) {
        return 0;
    }
    size_t capacity = t->capacity ? t->capacity : t->min_capacity;
    while (need * t->load_den > capacity * t->load_num) {
        capacity *= 2;
    }
    u64_slot *fresh = u64_alloc(t, capacity);
    if (fresh == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    u64_slot *old = t->slots;
    const size_t old_capacity = t->capacity;
    int shift = 64;
    for (size_t c = capacity; c > 1; c >>= 1) {
        shift--;
    }
    t->slots = fresh;
    t->capacity = capacity;
    t->shift = shift;
    t->used = 0;
    for (size_t i = 0; i < old_capacity; i++) {
        if (old[i].key != 0) {
            u64_insert_new(t, old[i].key, old[i].value);
        }
    }
    u64_free(t, old);
    return 0;
}

/* Inserts or replaces; -1 with MemoryError. */
static int u64_set(u64_table *t, uint64_t key, uint64_t value) {
    if (key == 0) {
        t->has_zero = 1;
        t->zero_value = value;
        return 0;
    }
    u64_slot *slot = u64_find(t, key);
    if (slot != NULL) {
        slot->value = value;
        return 0;
    }
    if (u64_reserve(t, 1) != 0) {
        return -1;
    }
    u64_insert_new(t, key, value);
    return 0;
}

/* Removes `key`: 1 and its value in *value, or 0 when absent. */
static int u64_take(u64_table *t, uint64_t key, uint64_t *value) {
    if (key == 0) {
        if (!t->has_zero) {
            return 0;
        }
        *value = t->zero_value;
        t->has_zero = 0;
        t->zero_value = 0;
        return 1;
    }
    u64_slot *slot = u64_find(t, key);
    if (slot == NULL) {
        return 0;
    }
    *value = slot->value;
    u64_remove_slot(t, slot);
    return 1;
}

/* Empties the table and releases its array (the owner's settings stay). */
static void u64_drop(u64_table *t) {
    u64_free(t, t->slots);
    t->slots = NULL;
    t->capacity = 0;
    t->used = 0;
    t->shift = 64;
    t->has_zero = 0;
    t->zero_value = 0;
}
