/* llmsim/sim/allocator.py's CachingAllocator, compiled: the same model of PyTorch's CUDA caching allocator
 * (c10/cuda/CUDACachingAllocator.cpp), rule for rule and in the same order, so that every replay gives the same
 * bytes as the Python model (tests/test_allocator.py replays both on the same streams). The Python class is the
 * reference and documents the rules; this file only follows it. Blocks live in one array and link by index, so a
 * paused replay is copied with memcpy (`clone`). A pool keeps its free blocks in the Python model's (size, address)
 * order as buckets of one size each, sorted by size, each a binary heap of its blocks by address: a pool holds
 * hundreds of free blocks of a few sizes (a 70B step: 300-560 blocks of 9-15 sizes), so the first fit is a search
 * among the sizes and a heap's top, and a block comes and goes in a heap of one size.
 *
 * Allocator(capacity_bytes, max_split_size, expandable)
 *   .malloc(key, size) / .free(key) / .clone() / .replay(serials, deltas, start, stop[, at, own_serials, own_deltas])
 *   / .same_state(other)
 *   .reserved_bytes, .allocated_bytes, .peak_reserved_bytes, .peak_allocated_bytes
 * `replay` takes int64 buffers (numpy arrays) of storage serials and byte deltas, as `CachingAllocator.replay`. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>

#define MIN_BLOCK_BYTES 512LL
#define SMALL_SIZE_BYTES (1LL << 20)
#define SMALL_BUFFER_BYTES (2LL << 20)
#define LARGE_BUFFER_BYTES (20LL << 20)
#define MIN_LARGE_ALLOC_BYTES (10LL << 20)
#define ROUND_LARGE_BYTES (2LL << 20)
#define NONE (-1)

typedef struct {
    int64_t address, size;
    int32_t prev, next; /* neighbours in the segment; for a dead block, `next` links the list of dead blocks */
    int32_t heap_pos;   /* a free block: where it is in its bucket's heap */
    uint8_t small, allocated;
} Block;

typedef struct { /* a pool's free blocks of one size: a binary min-heap of block indices by address */
    int64_t size;
    int32_t *heap;
    int32_t count, cap;
} Bucket;

typedef struct {
    int64_t key, size; /* size: the storage's bytes while `tracked` (the replay's `sizes`) */
    int32_t block;     /* the live block under this key, or NONE */
    uint8_t used, tracked;
} Slot;

static PyObject *out_of_memory = NULL; /* llmsim.sim.allocator.OutOfMemory, set at import */

typedef struct {
    PyObject_HEAD
    int64_t capacity_bytes, max_split_size;
    int expandable;
    int64_t reserved_bytes, allocated_bytes, peak_reserved_bytes, peak_allocated_bytes;
    int64_t next_address;
    int32_t tail[2];
    Block *blocks;
    int32_t n_blocks, cap_blocks, dead;
    Bucket *buckets[2]; /* each pool's buckets of free blocks, by size: [0] large, [1] small */
    int32_t n_buckets[2], cap_buckets[2];
    Bucket *spare; /* heaps of buckets emptied, for the next new sizes (a merged block's size is often new) */
    int32_t n_spare, cap_spare;
    Py_ssize_t pool_size[2];
    Slot *slots;
    int64_t n_slots, used_slots; /* n_slots: a power of two */
} Allocator;

/* ---- memory helpers ------------------------------------------------------------------------------------ */
static int grow(void **array, Py_ssize_t *cap, Py_ssize_t need, size_t item) {
    if (need <= *cap) return 0;
    Py_ssize_t cap2 = *cap ? *cap : 64;
    while (cap2 < need) cap2 *= 2;
    void *p = PyMem_Realloc(*array, (size_t)cap2 * item);
    if (!p) {
        PyErr_NoMemory();
        return -1;
    }
    *array = p;
    *cap = cap2;
    return 0;
}

static int32_t new_block(Allocator *a, int64_t address, int64_t size, uint8_t small, int32_t prev, int32_t next) {
    int32_t i;
    if (a->dead != NONE) {
        i = a->dead;
        a->dead = a->blocks[i].next;
    } else {
        if (a->n_blocks == a->cap_blocks) {
            Py_ssize_t cap = a->cap_blocks;
            if (grow((void **)&a->blocks, &cap, a->n_blocks + 1, sizeof(Block)) < 0) return NONE;
            a->cap_blocks = (int32_t)cap;
        }
        i = a->n_blocks++;
    }
    Block *b = &a->blocks[i];
    b->address = address;
    b->size = size;
    b->small = small;
    b->allocated = 0;
    b->prev = prev;
    b->next = next;
    return i;
}

static void kill_block(Allocator *a, int32_t i) {
    a->blocks[i].next = a->dead;
    a->dead = i;
}

static inline uint64_t mix(int64_t key);
static inline uint64_t free_block_hash(const Block *b) { /* what a free block's future depends on */
    return mix((int64_t)(mix(b->address) ^ (uint64_t)b->size ^
                         ((uint64_t)b->small | (uint64_t)(b->prev == NONE) << 1 | (uint64_t)(b->next == NONE) << 2)
                             << 56));
}

/* ---- pools: buckets of one size, by size; a heap of blocks by address in each ---------------------------- */
static int32_t bucket_at(Allocator *a, int small, int64_t size) { /* the first bucket of >= size bytes */
    const Bucket *b = a->buckets[small];
    int32_t lo = 0, hi = a->n_buckets[small];
    while (lo < hi) {
        int32_t mid = (lo + hi) >> 1;
        if (b[mid].size < size) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

static void sift_up(Allocator *a, int32_t *heap, int32_t pos) {
    int32_t i = heap[pos];
    int64_t address = a->blocks[i].address;
    while (pos > 0) {
        int32_t parent = (pos - 1) >> 1;
        if (a->blocks[heap[parent]].address <= address) break;
        heap[pos] = heap[parent];
        a->blocks[heap[pos]].heap_pos = pos;
        pos = parent;
    }
    heap[pos] = i;
    a->blocks[i].heap_pos = pos;
}

static void sift_down(Allocator *a, int32_t *heap, int32_t count, int32_t pos) {
    int32_t i = heap[pos];
    int64_t address = a->blocks[i].address;
    for (;;) {
        int32_t child = 2 * pos + 1;
        if (child >= count) break;
        if (child + 1 < count && a->blocks[heap[child + 1]].address < a->blocks[heap[child]].address) child++;
        if (a->blocks[heap[child]].address >= address) break;
        heap[pos] = heap[child];
        a->blocks[heap[pos]].heap_pos = pos;
        pos = child;
    }
    heap[pos] = i;
    a->blocks[i].heap_pos = pos;
}

static int pool_insert(Allocator *a, int32_t i) {
    Block *b = &a->blocks[i];
    int small = b->small;
    int32_t j = bucket_at(a, small, b->size);
    if (j == a->n_buckets[small] || a->buckets[small][j].size != b->size) { /* a size the pool does not hold */
        if (a->n_buckets[small] == a->cap_buckets[small]) {
            Py_ssize_t cap = a->cap_buckets[small];
            if (grow((void **)&a->buckets[small], &cap, cap + 1, sizeof(Bucket)) < 0) return -1;
            a->cap_buckets[small] = (int32_t)cap;
        }
        Bucket *buckets = a->buckets[small];
        memmove(&buckets[j + 1], &buckets[j], (size_t)(a->n_buckets[small] - j) * sizeof(Bucket));
        if (a->n_spare) {
            buckets[j] = a->spare[--a->n_spare];
        } else {
            buckets[j].heap = NULL;
            buckets[j].cap = 0;
        }
        buckets[j].size = b->size;
        buckets[j].count = 0;
        a->n_buckets[small]++;
    }
    Bucket *bucket = &a->buckets[small][j];
    if (bucket->count == bucket->cap) {
        Py_ssize_t cap = bucket->cap;
        if (grow((void **)&bucket->heap, &cap, cap + 1, sizeof(int32_t)) < 0) return -1;
        bucket->cap = (int32_t)cap;
    }
    bucket->heap[bucket->count] = i;
    sift_up(a, bucket->heap, bucket->count++);
    a->pool_size[small]++;
    return 0;
}

static void pool_remove(Allocator *a, int32_t i) {
    Block *b = &a->blocks[i];
    int small = b->small;
    int32_t j = bucket_at(a, small, b->size);
    Bucket *bucket = &a->buckets[small][j];
    int32_t pos = b->heap_pos, last = bucket->heap[--bucket->count];
    if (pos < bucket->count) { /* the last one takes its place, then goes up or down */
        bucket->heap[pos] = last;
        a->blocks[last].heap_pos = pos;
        if (pos > 0 && a->blocks[bucket->heap[(pos - 1) >> 1]].address > a->blocks[last].address)
            sift_up(a, bucket->heap, pos);
        else
            sift_down(a, bucket->heap, bucket->count, pos);
    }
    if (bucket->count == 0) { /* the pool holds no block of this size any more: its heap is kept for another */
        Py_ssize_t cap = a->cap_spare;
        if (a->n_spare < cap || grow((void **)&a->spare, &cap, a->n_spare + 1, sizeof(Bucket)) == 0) {
            a->cap_spare = (int32_t)cap;
            a->spare[a->n_spare++] = *bucket;
        } else {
            PyErr_Clear(); /* no room to keep it: let it go */
            PyMem_Free(bucket->heap);
        }
        Bucket *buckets = a->buckets[small];
        memmove(&buckets[j], &buckets[j + 1], (size_t)(a->n_buckets[small] - j - 1) * sizeof(Bucket));
        a->n_buckets[small]--;
    }
    a->pool_size[small]--;
}

static int32_t pool_first_fit(Allocator *a, int small, int64_t size) { /* the first block of >= size bytes */
    int32_t j = bucket_at(a, small, size);
    return j < a->n_buckets[small] ? a->buckets[small][j].heap[0] : NONE;
}

typedef struct {
    int64_t address;
    int32_t block;
} Entry;

static int by_address(const void *x, const void *y) {
    int64_t p = ((const Entry *)x)->address, q = ((const Entry *)y)->address;
    return (p > q) - (p < q);
}

static int32_t *pool_list(Allocator *a, int small) { /* the pool's blocks in (size, address) order; PyMem_Free it */
    int32_t *out = PyMem_Malloc((size_t)(a->pool_size[small] + 1) * sizeof(int32_t));
    Entry *entries = PyMem_Malloc((size_t)(a->pool_size[small] + 1) * sizeof(Entry));
    if (!out || !entries) {
        PyMem_Free(out);
        PyMem_Free(entries);
        PyErr_NoMemory();
        return NULL;
    }
    Py_ssize_t n = 0;
    for (int32_t j = 0; j < a->n_buckets[small]; j++) {
        const Bucket *bucket = &a->buckets[small][j];
        for (int32_t k = 0; k < bucket->count; k++) {
            entries[k].address = a->blocks[bucket->heap[k]].address;
            entries[k].block = bucket->heap[k];
        }
        qsort(entries, (size_t)bucket->count, sizeof(Entry), by_address);
        for (int32_t k = 0; k < bucket->count; k++) out[n++] = entries[k].block;
    }
    PyMem_Free(entries);
    return out;
}

static void free_buckets(Allocator *a) {
    for (int32_t j = 0; j < a->n_spare; j++) PyMem_Free(a->spare[j].heap);
    PyMem_Free(a->spare);
    a->spare = NULL;
    a->n_spare = a->cap_spare = 0;
    for (int k = 0; k < 2; k++) {
        for (int32_t j = 0; j < a->n_buckets[k]; j++) PyMem_Free(a->buckets[k][j].heap);
        PyMem_Free(a->buckets[k]);
        a->buckets[k] = NULL;
        a->n_buckets[k] = a->cap_buckets[k] = 0;
    }
}

/* ---- key -> live block (and the replay's storage sizes) --------------------------------------------------- */
static inline uint64_t mix(int64_t key) { /* splitmix64's finalizer */
    uint64_t z = (uint64_t)key + 0x9e3779b97f4a7c15ULL;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

static Slot *slot_find(Allocator *a, int64_t key) {
    uint64_t mask = (uint64_t)a->n_slots - 1;
    for (uint64_t h = mix(key) & mask;; h = (h + 1) & mask) {
        Slot *s = &a->slots[h];
        if (!s->used) return NULL;
        if (s->key == key) return s;
    }
}

static int slots_resize(Allocator *a, int64_t n) {
    Slot *old = a->slots;
    int64_t old_n = a->n_slots;
    Slot *fresh = PyMem_Calloc((size_t)n, sizeof(Slot));
    if (!fresh) {
        PyErr_NoMemory();
        return -1;
    }
    a->slots = fresh;
    a->n_slots = n;
    uint64_t mask = (uint64_t)n - 1;
    for (int64_t i = 0; i < old_n; i++) {
        if (!old[i].used) continue;
        uint64_t h = mix(old[i].key) & mask;
        while (fresh[h].used) h = (h + 1) & mask;
        fresh[h] = old[i];
    }
    PyMem_Free(old);
    return 0;
}

static Slot *slot_get(Allocator *a, int64_t key) { /* find, or add an empty slot */
    Slot *s = slot_find(a, key);
    if (s) return s;
    if (2 * (a->used_slots + 1) > a->n_slots && slots_resize(a, 2 * a->n_slots) < 0) return NULL;
    uint64_t mask = (uint64_t)a->n_slots - 1;
    uint64_t h = mix(key) & mask;
    while (a->slots[h].used) h = (h + 1) & mask;
    s = &a->slots[h];
    s->used = 1;
    s->key = key;
    s->size = 0;
    s->block = NONE;
    s->tracked = 0;
    a->used_slots++;
    return s;
}

static void slot_drop(Allocator *a, Slot *s) { /* linear probing: shift the following run back */
    uint64_t mask = (uint64_t)a->n_slots - 1;
    uint64_t i = (uint64_t)(s - a->slots);
    a->slots[i].used = 0;
    a->used_slots--;
    for (uint64_t j = (i + 1) & mask; a->slots[j].used; j = (j + 1) & mask) {
        uint64_t home = mix(a->slots[j].key) & mask;
        /* move j to i when its home is not in the cyclic range (i, j] */
        if ((j > i && (home <= i || home > j)) || (j < i && (home <= i && home > j))) {
            a->slots[i] = a->slots[j];
            a->slots[j].used = 0;
            i = j;
        }
    }
}

static inline uint64_t live_hash(int64_t key, const Block *b) {
    return mix((int64_t)(mix(key) ^ mix(b->address + 1) ^ (uint64_t)b->size));
}

static inline uint64_t size_hash(int64_t key, int64_t size) { return mix((int64_t)(mix(key + 7) ^ (uint64_t)size)); }

/* ---- the allocator -------------------------------------------------------------------------------------- */
static int64_t allocation_size(int64_t size) {
    if (size <= SMALL_SIZE_BYTES) return SMALL_BUFFER_BYTES;
    if (size < MIN_LARGE_ALLOC_BYTES) return LARGE_BUFFER_BYTES;
    return (size + ROUND_LARGE_BYTES - 1) / ROUND_LARGE_BYTES * ROUND_LARGE_BYTES;
}

static inline void add_reserved(Allocator *a, int64_t bytes) {
    a->reserved_bytes += bytes;
    if (a->reserved_bytes > a->peak_reserved_bytes) a->peak_reserved_bytes = a->reserved_bytes;
}

static int32_t take_free_block(Allocator *a, int64_t size, int small) {
    int32_t b = pool_first_fit(a, small, size);
    if (b == NONE) return NONE;
    int64_t bsize = a->blocks[b].size;
    if (size < a->max_split_size && a->max_split_size <= bsize) return NONE;
    if (size >= a->max_split_size && bsize >= size + LARGE_BUFFER_BYTES) return NONE;
    pool_remove(a, b);
    return b;
}

#define OOM (-2)

static int32_t map_at_end(Allocator *a, int64_t size, int small) {
    int64_t page = small ? SMALL_BUFFER_BYTES : LARGE_BUFFER_BYTES;
    int32_t tail = a->tail[small];
    int grow_free_tail = tail != NONE && !a->blocks[tail].allocated;
    int64_t needed = grow_free_tail ? size - a->blocks[tail].size : size;
    int64_t mapped = (needed + page - 1) / page * page;
    if (a->reserved_bytes + mapped > a->capacity_bytes) {
        PyErr_Format(out_of_memory, "mapping %lld B more does not fit: %lld B reserved of %lld B",
                     (long long)mapped, (long long)a->reserved_bytes, (long long)a->capacity_bytes);
        return OOM;
    }
    add_reserved(a, mapped);
    if (grow_free_tail) {
        pool_remove(a, tail);
        a->blocks[tail].size += mapped;
        return tail;
    }
    int64_t address = tail != NONE ? a->blocks[tail].address + a->blocks[tail].size
                                   : (small ? 0 : (LARGE_BUFFER_BYTES << 32));
    int32_t b = new_block(a, address, mapped, (uint8_t)small, tail, NONE);
    if (b == NONE) return OOM;
    if (tail != NONE) a->blocks[tail].next = b;
    a->tail[small] = b;
    return b;
}

static int unmap_free_tails(Allocator *a) {
    for (int k = 0; k < 2; k++) {
        int small = k == 0; /* the small pool first, as the Python model */
        int32_t tail = a->tail[small];
        if (tail == NONE || a->blocks[tail].allocated) continue;
        int64_t page = small ? SMALL_BUFFER_BYTES : LARGE_BUFFER_BYTES;
        Block *t = &a->blocks[tail];
        int64_t end = t->address + t->size;
        int64_t unmapped = end - (t->address + page - 1) / page * page;
        if (unmapped <= 0) continue;
        pool_remove(a, tail);
        a->reserved_bytes -= unmapped;
        t->size -= unmapped;
        if (t->size) {
            if (pool_insert(a, tail) < 0) return -1;
        } else {
            a->tail[small] = t->prev;
            if (t->prev != NONE) a->blocks[t->prev].next = NONE;
            kill_block(a, tail);
        }
    }
    return 0;
}

static inline int is_split(Allocator *a, int32_t b) {
    return a->blocks[b].prev != NONE || a->blocks[b].next != NONE;
}

static int release_cached(Allocator *a, int64_t needed) {
    /* the candidates, listed before any is released: the first unsplit large block that fits, or every unsplit
       large block; then every unsplit small block */
    int32_t *large = pool_list(a, 0), *small = pool_list(a, 1);
    int32_t *chosen = PyMem_Malloc((size_t)(a->pool_size[0] + a->pool_size[1] + 1) * sizeof(int32_t));
    if (!large || !small || !chosen) {
        PyMem_Free(large);
        PyMem_Free(small);
        PyMem_Free(chosen);
        return -1;
    }
    Py_ssize_t n = 0;
    for (Py_ssize_t i = 0; i < a->pool_size[0]; i++) {
        if (!is_split(a, large[i]) && a->blocks[large[i]].size >= needed) {
            chosen[n++] = large[i];
            break;
        }
    }
    if (n == 0)
        for (Py_ssize_t i = 0; i < a->pool_size[0]; i++)
            if (!is_split(a, large[i])) chosen[n++] = large[i];
    for (Py_ssize_t i = 0; i < a->pool_size[1]; i++)
        if (!is_split(a, small[i])) chosen[n++] = small[i];
    for (Py_ssize_t i = 0; i < n; i++) {
        pool_remove(a, chosen[i]);
        a->reserved_bytes -= a->blocks[chosen[i]].size;
        kill_block(a, chosen[i]);
        if (a->reserved_bytes + needed <= a->capacity_bytes) break;
    }
    PyMem_Free(large);
    PyMem_Free(small);
    PyMem_Free(chosen);
    return 0;
}

static int32_t new_segment(Allocator *a, int64_t size, int small) {
    if (a->expandable) {
        int32_t b = map_at_end(a, size, small);
        if (b != OOM || !PyErr_ExceptionMatches(out_of_memory)) return b;
        PyErr_Clear();
        if (unmap_free_tails(a) < 0) return OOM;
        return map_at_end(a, size, small);
    }
    int64_t segment = allocation_size(size);
    if (a->reserved_bytes + segment > a->capacity_bytes && release_cached(a, segment) < 0) return OOM;
    if (a->reserved_bytes + segment > a->capacity_bytes) {
        PyErr_Format(out_of_memory, "a %lld-byte segment does not fit: %lld B reserved of %lld B",
                     (long long)segment, (long long)a->reserved_bytes, (long long)a->capacity_bytes);
        return OOM;
    }
    int32_t b = new_block(a, a->next_address, segment, (uint8_t)small, NONE, NONE);
    if (b == NONE) return OOM;
    a->next_address += segment;
    add_reserved(a, segment);
    return b;
}

static int malloc_into(Allocator *a, Slot *s, int64_t size);

static int do_malloc(Allocator *a, int64_t key, int64_t size) {
    Slot *s = slot_get(a, key);
    return s ? malloc_into(a, s, size) : -1;
}

static int malloc_into(Allocator *a, Slot *s, int64_t size) { /* into the slot of its key (slot_get) */
    size = size > 0 ? (size + MIN_BLOCK_BYTES - 1) / MIN_BLOCK_BYTES * MIN_BLOCK_BYTES : 0;
    if (size == 0) size = MIN_BLOCK_BYTES;
    int small = size <= SMALL_SIZE_BYTES;
    int32_t b = take_free_block(a, size, small);
    if (b == NONE) b = new_segment(a, size, small);
    if (b < 0) return -1;
    int64_t remaining = a->blocks[b].size - size;
    int split = small ? remaining >= MIN_BLOCK_BYTES : (size < a->max_split_size && remaining > SMALL_SIZE_BYTES);
    if (split) {
        int32_t rest = new_block(a, a->blocks[b].address + size, remaining, (uint8_t)small, b, a->blocks[b].next);
        if (rest == NONE) return -1;
        Block *blk = &a->blocks[b];
        if (blk->next != NONE) a->blocks[blk->next].prev = rest;
        blk->next = rest;
        blk->size = size;
        if (a->tail[small] == b) a->tail[small] = rest;
        if (pool_insert(a, rest) < 0) return -1;
    }
    a->blocks[b].allocated = 1;
    s->block = b;
    a->allocated_bytes += a->blocks[b].size;
    if (a->allocated_bytes > a->peak_allocated_bytes) a->peak_allocated_bytes = a->allocated_bytes;
    return 0;
}

static int32_t merge(Allocator *a, int32_t block, int32_t neighbour) {
    int32_t first = block, second = neighbour;
    if (a->blocks[neighbour].address < a->blocks[block].address) {
        first = neighbour;
        second = block;
    }
    Block *f = &a->blocks[first], *s = &a->blocks[second];
    f->size += s->size;
    f->next = s->next;
    if (a->tail[f->small] == second) a->tail[f->small] = first;
    if (s->next != NONE) a->blocks[s->next].prev = first;
    kill_block(a, second);
    return first;
}

static int free_from(Allocator *a, Slot *s);

static int do_free(Allocator *a, int64_t key) {
    Slot *s = slot_find(a, key);
    if (!s || s->block == NONE) {
        PyObject *k = PyLong_FromLongLong(key);
        if (k) {
            PyErr_SetObject(PyExc_KeyError, k);
            Py_DECREF(k);
        }
        return -1;
    }
    return free_from(a, s);
}

static int free_from(Allocator *a, Slot *s) { /* the live block of slot s (found, with a block) */
    int32_t block = s->block;
    s->block = NONE;
    if (!s->tracked) slot_drop(a, s);
    Block *b = &a->blocks[block];
    b->allocated = 0;
    a->allocated_bytes -= b->size;
    int32_t neighbours[2] = {b->prev, b->next};
    for (int k = 0; k < 2; k++) {
        int32_t n = neighbours[k];
        if (n != NONE && !a->blocks[n].allocated) {
            pool_remove(a, n);
            block = merge(a, block, n);
        }
    }
    return pool_insert(a, block);
}

static inline int free_slot(Allocator *a, Slot *s) { /* do_free, from the key's slot (KeyError without a block) */
    return s->block == NONE ? do_free(a, s->key) : free_from(a, s);
}

static inline int replay_event(Allocator *a, int64_t serial, int64_t delta) {
    if (delta > 0) {
        Slot *s = slot_get(a, serial);
        if (!s) return -1;
        if (!s->tracked) {
            s->tracked = 1;
            s->size = delta;
            return malloc_into(a, s, delta);
        }
        /* a resize: a tracked slot stays where it is through the free */
        s->size += delta;
        int64_t size = s->size;
        return free_slot(a, s) < 0 ? -1 : malloc_into(a, s, size);
    }
    if (delta < 0) {
        Slot *s = slot_find(a, serial);
        if (!s || !s->tracked) return 0;
        s->size += delta;
        int64_t size = s->size;
        if (size <= 0) s->tracked = 0; /* the free drops the slot */
        if (free_slot(a, s) < 0) return -1;
        if (size > 0 && malloc_into(a, s, size) < 0) return -1;
    }
    return 0;
}

/* events start:stop of (serials, deltas), with n_own events of their own spliced in: own event j goes before
   event at[j] (after the last where at[j] >= stop) */
static int do_replay(Allocator *a, const int64_t *serials, const int64_t *deltas, Py_ssize_t start, Py_ssize_t stop,
                     const int64_t *at, const int64_t *own_serials, const int64_t *own_deltas, Py_ssize_t n_own) {
    Py_ssize_t j = 0;
    for (Py_ssize_t i = start; i < stop; i++) {
        for (; j < n_own && at[j] <= i; j++)
            if (replay_event(a, own_serials[j], own_deltas[j]) < 0) return -1;
        if (replay_event(a, serials[i], deltas[i]) < 0) return -1;
    }
    for (; j < n_own; j++)
        if (replay_event(a, own_serials[j], own_deltas[j]) < 0) return -1;
    return 0;
}

/* ---- Python ---------------------------------------------------------------------------------------------- */
static int Allocator_init(Allocator *a, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"capacity_bytes", "max_split_size", "expandable", NULL};
    long long capacity = 1LL << 62, max_split = 1LL << 62;
    int expandable = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|LLp", kwlist, &capacity, &max_split, &expandable)) return -1;
    a->capacity_bytes = capacity;
    a->max_split_size = max_split;
    a->expandable = expandable;
    a->tail[0] = a->tail[1] = NONE;
    a->dead = NONE;
    if (!a->slots) {
        a->slots = PyMem_Calloc(64, sizeof(Slot));
        if (!a->slots) {
            PyErr_NoMemory();
            return -1;
        }
        a->n_slots = 64;
    }
    return 0;
}

static void Allocator_dealloc(Allocator *a) {
    free_buckets(a);
    PyMem_Free(a->blocks);
    PyMem_Free(a->slots);
    Py_TYPE(a)->tp_free((PyObject *)a);
}

static PyObject *Allocator_malloc(Allocator *a, PyObject *args) {
    long long key, size;
    if (!PyArg_ParseTuple(args, "LL", &key, &size)) return NULL;
    if (do_malloc(a, key, size) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Allocator_free(Allocator *a, PyObject *args) {
    long long key;
    if (!PyArg_ParseTuple(args, "L", &key)) return NULL;
    if (do_free(a, key) < 0) return NULL;
    Py_RETURN_NONE;
}

static int int64_buffer(PyObject *object, Py_buffer *view) {
    if (PyObject_GetBuffer(object, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return -1;
    const char *format = view->format ? view->format : "";
    char code = format[0] ? format[strlen(format) - 1] : 0;
    if (view->itemsize != 8 || view->ndim != 1 || (code != 'q' && code != 'l')) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_TypeError, "replay takes one-dimensional int64 buffers");
        return -1;
    }
    return 0;
}

static PyObject *Allocator_replay(Allocator *a, PyObject *args) {
    PyObject *objects[5] = {NULL, NULL, NULL, NULL, NULL}; /* serials, deltas[, at, own serials, own deltas] */
    Py_ssize_t start = 0, stop = PY_SSIZE_T_MAX;
    if (!PyArg_ParseTuple(args, "OO|nnOOO", &objects[0], &objects[1], &start, &stop, &objects[2], &objects[3],
                          &objects[4]))
        return NULL;
    int spliced = objects[2] != NULL && objects[2] != Py_None;
    if (spliced && (objects[3] == NULL || objects[4] == NULL)) {
        PyErr_SetString(PyExc_TypeError, "replay: at comes with own_serials and own_deltas");
        return NULL;
    }
    Py_buffer views[5];
    int held = 0;
    for (; held < (spliced ? 5 : 2); held++)
        if (int64_buffer(objects[held], &views[held]) < 0) break;
    if (held < (spliced ? 5 : 2)) {
        while (held--) PyBuffer_Release(&views[held]);
        return NULL;
    }
    Py_ssize_t n = views[0].shape[0] < views[1].shape[0] ? views[0].shape[0] : views[1].shape[0];
    Py_ssize_t n_own = 0;
    if (spliced) {
        n_own = views[2].shape[0];
        if (views[3].shape[0] < n_own) n_own = views[3].shape[0];
        if (views[4].shape[0] < n_own) n_own = views[4].shape[0];
    }
    if (stop > n) stop = n;
    if (start < 0) start = 0;
    int64_t peak = a->peak_reserved_bytes; /* the window's own peak: counted from the reserved bytes at its start */
    a->peak_reserved_bytes = a->reserved_bytes;
    int rc = do_replay(a, views[0].buf, views[1].buf, start, stop, spliced ? views[2].buf : NULL,
                       spliced ? views[3].buf : NULL, spliced ? views[4].buf : NULL, n_own);
    while (held--) PyBuffer_Release(&views[held]);
    int64_t window = a->peak_reserved_bytes;
    if (window < peak) a->peak_reserved_bytes = peak;
    if (rc < 0) return NULL;
    return PyLong_FromLongLong(window);
}

/* the block under pool entry / live slot `b`, as what the allocator's future depends on: where it is, its size,
   whether it is in use, and whether it has neighbours in its segment (the split structure) */
static int same_block(Allocator *a, int32_t i, Allocator *b, int32_t j) {
    Block *x = &a->blocks[i], *y = &b->blocks[j];
    return x->address == y->address && x->size == y->size && x->small == y->small && x->allocated == y->allocated &&
           (x->prev == NONE) == (y->prev == NONE) && (x->next == NONE) == (y->next == NONE);
}

static PyObject *Allocator_fingerprint(Allocator *a, PyObject *Py_UNUSED(ignored)) {
    /* a hash of the state `same_state` compares, summed over its free blocks, live blocks and storage sizes: equal
       states, equal fingerprints. Made when asked (a replay pauses every few thousand events), not kept as the
       state changes: that cost a third of an event. */
    uint64_t pool = 0, live = 0, sizes = 0;
    for (int k = 0; k < 2; k++)
        for (int32_t j = 0; j < a->n_buckets[k]; j++)
            for (int32_t i = 0; i < a->buckets[k][j].count; i++)
                pool += free_block_hash(&a->blocks[a->buckets[k][j].heap[i]]);
    for (int64_t i = 0; i < a->n_slots; i++) {
        const Slot *s = &a->slots[i];
        if (!s->used) continue;
        if (s->tracked) sizes += size_hash(s->key, s->size);
        if (s->block != NONE) live += live_hash(s->key, &a->blocks[s->block]);
    }
    uint64_t h = mix(a->reserved_bytes) ^ mix(a->allocated_bytes + 1) ^ mix(a->next_address + 2) ^
                 mix((int64_t)a->pool_size[0] + 3) ^ mix((int64_t)a->pool_size[1] + 4);
    h += pool + 3 * live + 5 * sizes;
    for (int k = 0; k < 2; k++)
        if (a->tail[k] != NONE) h += mix(a->blocks[a->tail[k]].address + 5 + k);
    return PyLong_FromUnsignedLongLong(h);
}

static PyObject *Allocator_same_state(Allocator *a, PyObject *other) {
    if (!PyObject_TypeCheck(other, Py_TYPE(a))) {
        PyErr_SetString(PyExc_TypeError, "same_state compares two compiled allocators");
        return NULL;
    }
    Allocator *b = (Allocator *)other;
    if (a->capacity_bytes != b->capacity_bytes || a->max_split_size != b->max_split_size ||
        a->expandable != b->expandable || a->reserved_bytes != b->reserved_bytes ||
        a->allocated_bytes != b->allocated_bytes || a->next_address != b->next_address ||
        a->used_slots != b->used_slots)
        Py_RETURN_FALSE;
    for (int k = 0; k < 2; k++) {
        if (a->pool_size[k] != b->pool_size[k]) Py_RETURN_FALSE;
        if ((a->tail[k] == NONE) != (b->tail[k] == NONE) ||
            (a->tail[k] != NONE && !same_block(a, a->tail[k], b, b->tail[k])))
            Py_RETURN_FALSE;
    }
    for (int k = 0; k < 2; k++) {
        int32_t *p = pool_list(a, k), *q = pool_list(b, k);
        int same = p && q;
        for (Py_ssize_t i = 0; same && i < a->pool_size[k]; i++) same = same_block(a, p[i], b, q[i]);
        PyMem_Free(p);
        PyMem_Free(q);
        if (PyErr_Occurred()) return NULL;
        if (!same) Py_RETURN_FALSE;
    }
    for (int64_t i = 0; i < a->n_slots; i++) {
        Slot *s = &a->slots[i];
        if (!s->used) continue;
        Slot *t = slot_find(b, s->key);
        if (!t || t->tracked != s->tracked || (s->tracked && t->size != s->size) ||
            (s->block == NONE) != (t->block == NONE) || (s->block != NONE && !same_block(a, s->block, b, t->block)))
            Py_RETURN_FALSE;
    }
    Py_RETURN_TRUE;
}

static PyObject *Allocator_clone(Allocator *a, PyObject *Py_UNUSED(ignored)) {
    Allocator *t = (Allocator *)Py_TYPE(a)->tp_alloc(Py_TYPE(a), 0);
    if (!t) return NULL;
    t->capacity_bytes = a->capacity_bytes;
    t->max_split_size = a->max_split_size;
    t->expandable = a->expandable;
    t->reserved_bytes = a->reserved_bytes;
    t->allocated_bytes = a->allocated_bytes;
    t->peak_reserved_bytes = a->peak_reserved_bytes;
    t->peak_allocated_bytes = a->peak_allocated_bytes;
    t->next_address = a->next_address;
    t->tail[0] = a->tail[0];
    t->tail[1] = a->tail[1];
    t->pool_size[0] = a->pool_size[0];
    t->pool_size[1] = a->pool_size[1];
    t->dead = a->dead;
    t->n_blocks = t->cap_blocks = a->n_blocks;
    t->blocks = PyMem_Malloc((size_t)(a->n_blocks ? a->n_blocks : 1) * sizeof(Block));
    t->slots = PyMem_Malloc((size_t)a->n_slots * sizeof(Slot));
    t->n_slots = a->n_slots;
    t->used_slots = a->used_slots;
    if (!t->blocks || !t->slots) {
        Py_DECREF(t);
        return PyErr_NoMemory();
    }
    memcpy(t->blocks, a->blocks, (size_t)a->n_blocks * sizeof(Block));
    memcpy(t->slots, a->slots, (size_t)a->n_slots * sizeof(Slot));
    for (int k = 0; k < 2; k++) { /* each bucket's heap, as large as it is */
        int32_t n = a->n_buckets[k];
        t->buckets[k] = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(Bucket));
        if (!t->buckets[k]) {
            Py_DECREF(t);
            return PyErr_NoMemory();
        }
        t->cap_buckets[k] = n;
        for (int32_t j = 0; j < n; j++) {
            const Bucket *from = &a->buckets[k][j];
            Bucket *to = &t->buckets[k][t->n_buckets[k]];
            to->size = from->size;
            to->count = to->cap = from->count;
            to->heap = PyMem_Malloc((size_t)from->count * sizeof(int32_t));
            if (!to->heap) {
                Py_DECREF(t);
                return PyErr_NoMemory();
            }
            memcpy(to->heap, from->heap, (size_t)from->count * sizeof(int32_t));
            t->n_buckets[k]++;
        }
    }
    return (PyObject *)t;
}

static PyMethodDef Allocator_methods[] = {
    {"malloc", (PyCFunction)Allocator_malloc, METH_VARARGS, "malloc(key, size): a block of round_size(size)"},
    {"free", (PyCFunction)Allocator_free, METH_VARARGS, "free(key): the block back to its pool, merged"},
    {"replay", (PyCFunction)Allocator_replay, METH_VARARGS,
     "replay(serials, deltas, start=0, stop=len, at=None, own_serials=None, own_deltas=None): a timeline's events, "
     "by storage serial, with events of their own spliced in before event at[j]"},
    {"clone", (PyCFunction)Allocator_clone, METH_NOARGS, "an independent copy"},
    {"fingerprint", (PyCFunction)Allocator_fingerprint, METH_NOARGS,
     "a hash of the state same_state compares (equal states, equal fingerprints)"},
    {"same_state", (PyCFunction)Allocator_same_state, METH_O,
     "whether every later event would do the same with the other allocator (peaks aside)"},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef Allocator_members[] = {
    {"capacity_bytes", T_LONGLONG, offsetof(Allocator, capacity_bytes), READONLY, NULL},
    {"max_split_size", T_LONGLONG, offsetof(Allocator, max_split_size), READONLY, NULL},
    {"reserved_bytes", T_LONGLONG, offsetof(Allocator, reserved_bytes), READONLY, NULL},
    {"allocated_bytes", T_LONGLONG, offsetof(Allocator, allocated_bytes), READONLY, NULL},
    {"peak_reserved_bytes", T_LONGLONG, offsetof(Allocator, peak_reserved_bytes), READONLY, NULL},
    {"peak_allocated_bytes", T_LONGLONG, offsetof(Allocator, peak_allocated_bytes), READONLY, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject AllocatorType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "llmsim.sim._allocator.Allocator",
    .tp_basicsize = sizeof(Allocator),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "llmsim.sim.allocator.CachingAllocator, compiled",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Allocator_init,
    .tp_dealloc = (destructor)Allocator_dealloc,
    .tp_methods = Allocator_methods,
    .tp_members = Allocator_members,
};

static PyObject *set_out_of_memory(PyObject *module, PyObject *cls) {
    Py_XSETREF(out_of_memory, Py_NewRef(cls));
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"set_out_of_memory", set_out_of_memory, METH_O, "the exception class a segment that does not fit raises"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "llmsim.sim._allocator", NULL, -1, module_methods};

PyMODINIT_FUNC PyInit__allocator(void) {
    if (PyType_Ready(&AllocatorType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    out_of_memory = Py_NewRef(PyExc_MemoryError);
    if (PyModule_AddObjectRef(m, "Allocator", (PyObject *)&AllocatorType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
