// SPDX-License-Identifier: MIT OR GPL-2.0
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "gpupin_py.h"

/*
 * The registration cache's hot path: one call finds the entry covering
 * [ptr, ptr + size), checks its validity word (and, for CUDA memory, the
 * buffer id at ptr), and takes a reference.  Python keeps everything else.
 *
 * Entries are indexed by id (chosen by Python); the index is an array of
 * starts sorted ascending, with no two entries overlapping (gpc_insert
 * refuses overlaps), and beside it a hash table from each 64 KiB page of the
 * address space to the entries that touch it, which the hit path tries
 * first: a hit costs about the same with 100 or 100,000 entries (a binary
 * search over 100,000 starts is 17 dependent loads, most of them missing the
 * L1 cache).  The hash is an accelerator only: entries over
 * GPC_HASH_MAX_PAGES pages, or whose buckets could not be allocated, are
 * found by the binary search.  All under one mutex: cffi drops the GIL
 * around these calls, and the CPython entry points (python.c) wait for it
 * without the GIL.
 *
 * Tokens.  What a lookup hands out is a token, (generation << 32) | id: the
 * id is the entry's slot (chosen by Python), the generation is given anew to
 * every entry inserted (from one counter per core, which a fork child keeps
 * counting, and which ends instead of wrapping: see GPC_MAX_GEN).  Every call that takes a token checks both, so a late or doubled
 * release after the slot was reused, or a parent's token used in a fork
 * child, is refused instead of dropping another entry's reference.  A slot
 * is free for reuse only once gpc_retire() saw it unreferenced.
 *
 * Unreferenced indexed entries sit on a list, least recently released
 * first: eviction takes its head without scanning the index.
 */
struct gpc_ent {			/* 64 bytes: one cache line per hit */
	uint64_t start, end, buffer_id, valid_word, slot;
	int32_t prev, next;		/* the LRU list (ids; -1 ends it) */
	uint32_t gen;			/* 0: the slot holds no entry */
	int32_t refs;
	uint8_t indexed;
	uint8_t hashed;			/* in the page hash (else only in the sorted index) */
	uint8_t on_lru;
	uint8_t hidden;			/* staged: indexed, but lookups miss it until published */
};

_Static_assert(sizeof(struct gpc_ent) == 64, "an entry is one cache line");

#define GPC_ID_BITS 32
#define GPC_ID_MASK 0xffffffffull
#define GPC_MAX_ID 0x7fffffff
/*
 * Tokens stay below 2^62, so -(token + base) fits: 30 bits of generation.
 * They never wrap: a wrap would give a slot a token it had before, and a late
 * release of the old one would drop the new entry's reference (ABA).  After
 * the last one gpc_insert and gpc_stage say GPC_NO_GENERATION: the cache
 * makes no more entries (2^30 - 1 pins made by one cache; make a new one).
 */
#define GPC_MAX_GEN 0x3fffffffu

/*
 * 64 KiB, nv-p2p's GPU page: most entries then share a bucket with few others
 * (2 MiB buckets held 32 pinned GPU pages each, and scanning them cost more
 * than the binary search saved).  Entries over 32 MiB are not hashed: a few
 * large entries are quick to find by the binary search, and hashing them would
 * cost 16,384 buckets per GiB.
 */
#define GPC_PAGE_SHIFT 16
#define GPC_HASH_MAX_PAGES 512
#define GPC_NO_PAGE UINT64_MAX

/* One 64 KiB page's entries, sorted by start; n == 0 marks a vacated slot. */
struct gpc_bucket {
	uint64_t page;			/* GPC_NO_PAGE: never used */
	uint32_t n, cap;
	struct gpc_slot { uint64_t start; int64_t id; } *v;
};

struct gpc {
	pthread_mutex_t lock;
	const volatile uint64_t *words;
	uint64_t nwords;
	int check_kernel, check_buffer_id;
	gpc_buffer_id_query_t query;	/* the provider's buffer-id query (default: libcuda's) */
	void *query_ctx;		/* its first argument */
	int closed;			/* gpc_close(): every lookup says GPC_CLOSED */
	int closing;			/* gpc_quiesce(): lookups say GPC_CLOSED, releases go on */
	uint32_t gen;			/* the last generation given out */
	int32_t max_refs;		/* references one entry may hold (a test lowers it) */
	int32_t lru_head, lru_tail;	/* oldest and newest unreferenced indexed entry */
	struct gpc_ent *ents;
	int64_t nents;
	uint64_t *starts;
	int64_t *ids;
	int64_t n, cap;
	uint64_t acquires, hits;
	struct gpc_bucket *ht;		/* open addressing, linear probing */
	uint64_t ht_cap;		/* a power of two */
	uint64_t ht_used;		/* slots with a page, vacated ones (n == 0) too */
	uint64_t ht_live;		/* slots with entries */
	int64_t unhashed;		/* indexed entries not in the hash */
};

static uint64_t gpc_hash(uint64_t page, uint64_t cap)
{
	return ((page * 0x9E3779B97F4A7C15ull) >> 17) & (cap - 1);
}

/* The bucket of @page, or NULL. */
static struct gpc_bucket *gpc_bucket_find(const struct gpc *c, uint64_t page)
{
	uint64_t i;

	if (!c->ht_cap)
		return NULL;
	for (i = gpc_hash(page, c->ht_cap);; i = (i + 1) & (c->ht_cap - 1)) {
		struct gpc_bucket *b = &c->ht[i];

		if (b->page == page)
			return b;
		if (b->page == GPC_NO_PAGE)
			return NULL;
	}
}

static void gpc_ht_free(struct gpc_bucket *ht, uint64_t cap)
{
	uint64_t i;

	for (i = 0; ht && i < cap; i++)
		free(ht[i].v);
	free(ht);
}

/* Rebuild with room for @want pages, dropping vacated slots (grows or shrinks); 0 or -1. */
static int gpc_ht_resize(struct gpc *c, uint64_t want)
{
	uint64_t cap = 64, i, j, used = 0;
	struct gpc_bucket *ht;

	while (cap < 2 * want)
		cap *= 2;
	ht = malloc(cap * sizeof(*ht));
	if (!ht)
		return -1;
	for (i = 0; i < cap; i++)
		ht[i] = (struct gpc_bucket){ GPC_NO_PAGE, 0, 0, NULL };
	for (i = 0; i < c->ht_cap; i++) {
		struct gpc_bucket *b = &c->ht[i];

		if (b->page == GPC_NO_PAGE || !b->n) {
			free(b->v);
			continue;
		}
		for (j = gpc_hash(b->page, cap); ht[j].page != GPC_NO_PAGE; j = (j + 1) & (cap - 1))
			;
		ht[j] = *b;
		used++;
	}
	free(c->ht);
	c->ht = ht;
	c->ht_cap = cap;
	c->ht_used = c->ht_live = used;
	return 0;
}

/* The bucket of @page, made if missing; NULL when out of memory. */
static struct gpc_bucket *gpc_bucket_get(struct gpc *c, uint64_t page)
{
	struct gpc_bucket *b = gpc_bucket_find(c, page);
	uint64_t i;

	if (b)
		return b;
	/* Sized by the live pages: vacated slots alone make it rebuild at the same size. */
	if (2 * (c->ht_used + 1) > c->ht_cap && gpc_ht_resize(c, c->ht_live + 1))
		return NULL;
	for (i = gpc_hash(page, c->ht_cap); c->ht[i].page != GPC_NO_PAGE; i = (i + 1) & (c->ht_cap - 1))
		;
	c->ht[i].page = page;
	c->ht_used++;
	return &c->ht[i];
}

/* Take @id (starting at @start) out of @page's bucket, if there. */
static void gpc_bucket_del(struct gpc *c, uint64_t page, uint64_t start, int64_t id)
{
	struct gpc_bucket *b = gpc_bucket_find(c, page);
	uint32_t i;

	for (i = 0; b && i < b->n; i++) {
		if (b->v[i].id == id && b->v[i].start == start) {
			memmove(b->v + i, b->v + i + 1, (b->n - i - 1) * sizeof(*b->v));
			if (!--b->n)
				c->ht_live--;
			return;
		}
	}
}

/* Take entry @id, starting at @start, out of the pages from start's up to @upto. */
static void gpc_pages_del(struct gpc *c, int64_t id, uint64_t start, uint64_t upto)
{
	uint64_t page;

	for (page = start >> GPC_PAGE_SHIFT; page < upto; page++)
		gpc_bucket_del(c, page, start, id);
}

/* The last page [start, end) touches (end > start). */
static uint64_t gpc_page_last(uint64_t end)
{
	return (end - 1) >> GPC_PAGE_SHIFT;
}

/* Room for one more slot in @b: 0, or -1 (b unchanged). */
static int gpc_bucket_room(struct gpc_bucket *b)
{
	uint32_t cap = b->cap ? 2 * b->cap : 4;
	void *v;

	if (b->n < b->cap)
		return 0;
	v = realloc(b->v, cap * sizeof(*b->v));
	if (!v)
		return -1;
	b->v = v;
	b->cap = cap;
	return 0;
}

/*
 * Put entry @id, [start, end), into every page it touches; 0, or -1 with
 * nothing changed (out of memory).  GCC 12's analyser loses the bucket
 * arrays gpc_bucket_room() stores into elements of the heap array c->ht and
 * reports them leaked here; gpc_ht_resize() and gpc_ht_free() free them.
 */
#if defined(__GNUC__) && __GNUC__ >= 10 && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wanalyzer-malloc-leak"
#endif
static int gpc_pages_add(struct gpc *c, int64_t id, uint64_t start, uint64_t end)
{
	uint64_t page, last = gpc_page_last(end);

	for (page = start >> GPC_PAGE_SHIFT; page <= last; page++) {
		struct gpc_bucket *b = gpc_bucket_get(c, page);
		uint32_t i;

		if (!b || gpc_bucket_room(b)) {
			gpc_pages_del(c, id, start, page);
			return -1;
		}
		for (i = b->n; i > 0 && b->v[i - 1].start > start; i--)
			b->v[i] = b->v[i - 1];
		b->v[i] = (struct gpc_slot){ start, id };
		if (!b->n++)
			c->ht_live++;
	}
	return 0;
}
#if defined(__GNUC__) && __GNUC__ >= 10 && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

/* Entry @id leaves the index: out of the hash, or no longer counted outside it. */
static void gpc_unhash(struct gpc *c, int64_t id)
{
	struct gpc_ent *e = &c->ents[id];

	if (e->hashed)
		gpc_pages_del(c, id, e->start, gpc_page_last(e->end) + 1);
	else
		c->unhashed--;
	e->hashed = 0;
}

/* The hashed entry covering @ptr, through its page's bucket; -1 if none. */
static int64_t gpc_page_lookup(const struct gpc *c, uint64_t ptr)
{
	const struct gpc_bucket *b = gpc_bucket_find(c, ptr >> GPC_PAGE_SHIFT);
	uint32_t i;

	if (!b)
		return -1;
	/* Sorted by start: the last one starting at or before ptr is the only candidate. */
	for (i = b->n; i > 0; i--) {
		if (b->v[i - 1].start <= ptr)
			return ptr < c->ents[b->v[i - 1].id].end ? b->v[i - 1].id : -1;
	}
	return -1;
}

/* Token of entry @id as it is now. */
static int64_t gpc_token(const struct gpc *c, int64_t id)
{
	return (int64_t)((uint64_t)c->ents[id].gen << GPC_ID_BITS | (uint64_t)id);
}

/* The id @tok names if it names the entry in that slot now, else -1. */
static int64_t gpc_tok_id(const struct gpc *c, int64_t tok)
{
	int64_t id = (int64_t)((uint64_t)tok & GPC_ID_MASK);

	if (tok < 0 || id >= c->nents || !c->ents[id].gen ||
	    c->ents[id].gen != (uint64_t)tok >> GPC_ID_BITS)
		return -1;
	return id;
}

static void gpc_lru_del(struct gpc *c, int64_t id)
{
	struct gpc_ent *e = &c->ents[id];

	if (!e->on_lru)
		return;
	if (e->prev >= 0)
		c->ents[e->prev].next = e->next;
	else
		c->lru_head = e->next;
	if (e->next >= 0)
		c->ents[e->next].prev = e->prev;
	else
		c->lru_tail = e->prev;
	e->on_lru = 0;
}

/* @id (< 2^31) was just released by its last holder (or inserted): the newest on the list. */
static void gpc_lru_add(struct gpc *c, int64_t id)
{
	struct gpc_ent *e = &c->ents[id];

	e->prev = c->lru_tail;
	e->next = -1;
	if (c->lru_tail >= 0)
		c->ents[c->lru_tail].next = (int32_t)id;
	else
		c->lru_head = (int32_t)id;
	c->lru_tail = (int32_t)id;
	e->on_lru = 1;
}

/* Take a reference on @id; false if it holds max_refs already. */
static int gpc_get(struct gpc *c, int64_t id)
{
	struct gpc_ent *e = &c->ents[id];

	if (e->refs >= c->max_refs)
		return 0;
	if (!e->refs++)
		gpc_lru_del(c, id);
	return 1;
}

struct gpc *gpc_new(const uint64_t *words, uint64_t nwords, int check_kernel, int check_buffer_id)
{
	struct gpc *c = calloc(1, sizeof(*c));

	if (!c)
		return NULL;
	pthread_mutex_init(&c->lock, NULL);
	c->words = words;
	c->nwords = nwords;
	c->check_kernel = check_kernel;
	c->check_buffer_id = check_buffer_id;
	c->query = gp_cuda_query;
	c->max_refs = INT32_MAX;
	c->lru_head = c->lru_tail = -1;
	return c;
}

/* Drop the index (sorted arrays, page hash, LRU list); caller holds c->lock (or is alone). */
static void gpc_drop_lookup(struct gpc *c)
{
	free(c->starts);
	free(c->ids);
	gpc_ht_free(c->ht, c->ht_cap);
	c->starts = NULL;
	c->ids = NULL;
	c->ht = NULL;
	c->n = c->cap = 0;
	c->ht_cap = c->ht_used = c->ht_live = 0;
	c->unhashed = 0;
	c->lru_head = c->lru_tail = -1;
}

/* Entries referenced now; caller holds c->lock. */
static int64_t gpc_held_locked(const struct gpc *c)
{
	int64_t i, n = 0;

	for (i = 0; i < c->nents; i++)
		n += c->ents[i].gen && c->ents[i].refs > 0;
	return n;
}

/*
 * Close the cache, unless an entry is referenced and !@force: returns how
 * many are (0: closed).  Closed, it never reads the validity map again
 * (which may be unmapped next), hands out no reference and takes none back:
 * each entry's references stay as they were, for gpc_refs() to tell which
 * pins a holder still uses.  The struct stays until gpc_free, since bound
 * fast paths (gpc_bind) may still be called.
 */
int64_t gpc_close(struct gpc *c, int force)
{
	int64_t held;

	pthread_mutex_lock(&c->lock);
	held = gpc_held_locked(c);
	if (!held || force) {
		c->closed = 1;
		c->words = NULL;
		c->nwords = 0;
		gpc_drop_lookup(c);	/* the entries stay: their references tell who holds them */
	}
	pthread_mutex_unlock(&c->lock);
	return held;
}

/*
 * In a forked child, before it runs any other thread: forget every entry
 * (they are the parent's pins: nothing is released) and stop reading the
 * parent's validity map.  The mutex is made anew, since a thread of the
 * parent may have held it at the fork.  Bound fast paths keep working: the
 * struct stays where it is.  The generation counter goes on, so no token
 * of the parent names an entry of the child.  A closed core stays closed.
 *
 * The child's copies of the arrays are dropped, not freed: a parent thread
 * in a cffi call (which runs without the GIL, so the fork can come in the
 * middle) may have been freeing or reallocating them, and freeing them
 * again here would be a double free.  What leaks is the parent's index, once.
 */
void gpc_reset_in_child(struct gpc *c)
{
	pthread_mutex_init(&c->lock, NULL);
	c->ents = NULL;
	c->starts = NULL;
	c->ids = NULL;
	c->ht = NULL;
	c->nents = c->n = c->cap = 0;
	c->ht_cap = c->ht_used = c->ht_live = 0;
	c->unhashed = 0;
	c->lru_head = c->lru_tail = -1;
	c->acquires = c->hits = 0;
	c->words = NULL;
	c->nwords = 0;
	c->closing = 0;
}

/*
 * Stop (or resume) handing out references while a close waits for holders:
 * lookups say GPC_CLOSED, releases are taken.  References can then only go,
 * so a count of them stays true until the close.
 */
void gpc_quiesce(struct gpc *c, int on)
{
	pthread_mutex_lock(&c->lock);
	c->closing = on;
	pthread_mutex_unlock(&c->lock);
}

/* The validity map to read from now on; -1 unless the index is empty (or closed). */
int gpc_set_words(struct gpc *c, const uint64_t *words, uint64_t nwords)
{
	int ret = -1;

	pthread_mutex_lock(&c->lock);
	if (!c->closed && !c->n) {
		c->words = words;
		c->nwords = nwords;
		ret = 0;
	}
	pthread_mutex_unlock(&c->lock);
	return ret;
}

/* For tests: the last generation given out (the next entry gets the one after it). */
void gpc_set_gen(struct gpc *c, uint32_t gen)
{
	pthread_mutex_lock(&c->lock);
	c->gen = gen < GPC_MAX_GEN ? gen : GPC_MAX_GEN;
	pthread_mutex_unlock(&c->lock);
}

/* For tests: references one entry may hold (default INT32_MAX). */
void gpc_set_max_refs(struct gpc *c, int32_t max_refs)
{
	pthread_mutex_lock(&c->lock);
	c->max_refs = max_refs > 0 ? max_refs : INT32_MAX;
	pthread_mutex_unlock(&c->lock);
}

void gpc_free(struct gpc *c)
{
	if (!c)
		return;
	pthread_mutex_destroy(&c->lock);
	free(c->ents);
	free(c->starts);
	free(c->ids);
	gpc_ht_free(c->ht, c->ht_cap);
	free(c);
}

/* The mutex, for the CPython entry points (which wait for it without the GIL). */
int gpc_trylock(struct gpc *c)
{
	return pthread_mutex_trylock(&c->lock);
}

void gpc_lock(struct gpc *c)
{
	pthread_mutex_lock(&c->lock);
}

void gpc_unlock(struct gpc *c)
{
	pthread_mutex_unlock(&c->lock);
}

/*
 * Index position of the last entry starting at or before ptr, or -1.
 * Branch-free: lookups come in no predictable order, and a mispredicted
 * branch per halving cost more than the search itself (100 entries: 90 ns
 * with branches, 37 ns without, measured in C on this host).  The hit path
 * needs it only for entries the page hash does not hold.
 */
static int64_t gpc_pos(const struct gpc *c, uint64_t ptr)
{
	const uint64_t *base = c->starts;
	int64_t len = c->n;

	if (!len)
		return -1;
	while (len > 1) {
		int64_t half = len / 2;

		base = base[half] <= ptr ? base + half : base;
		len -= half;
	}
	return (base - c->starts) + (*base <= ptr) - 1;
}

/*
 * >= 0: the token of a valid entry covering the range, now referenced.
 * GPC_MISS: no entry covers it; GPC_BAD_ARG: empty or wrapping range;
 * GPC_CLOSED; GPC_TOO_MANY_REFS: the entry holds max_refs references.
 * -(token + GPC_STALE_BASE): an entry covers it but is stale (validity word
 * or buffer id changed); no reference taken.  Caller holds c->lock.
 */
int64_t gpc_lookup_locked(struct gpc *c, uint64_t ptr, uint64_t size)
{
	struct gpc_ent *e;
	int64_t id;

	if (c->closed || c->closing)
		return GPC_CLOSED;
	c->acquires++;
	id = gpc_page_lookup(c, ptr);
	if (id < 0 && c->unhashed) {
		int64_t pos = gpc_pos(c, ptr);

		if (pos >= 0 && ptr < c->ents[c->ids[pos]].end)
			id = c->ids[pos];
	}
	if (id < 0)
		return GPC_MISS;
	e = &c->ents[id];
	if (ptr + size > e->end || e->hidden)
		return GPC_MISS;
	if (c->check_kernel && (e->slot >= c->nwords || c->words[e->slot] != e->valid_word))
		return -(gpc_token(c, id) + GPC_STALE_BASE);
	if (c->check_buffer_id) {
		uint64_t bid = 0;

		if (c->query(c->query_ctx, ptr, &bid) != 0 || bid != e->buffer_id)
			return -(gpc_token(c, id) + GPC_STALE_BASE);
	}
	if (!gpc_get(c, id))
		return GPC_TOO_MANY_REFS;
	c->hits++;
	return gpc_token(c, id);
}

int64_t gpc_lookup(struct gpc *c, uint64_t ptr, uint64_t size)
{
	int64_t ret;

	if (!size || ptr + size < ptr)
		return GPC_BAD_ARG;
	pthread_mutex_lock(&c->lock);
	ret = gpc_lookup_locked(c, ptr, size);
	pthread_mutex_unlock(&c->lock);
	return ret;
}

/* Index position of entry id, which starts at start, or -1. */
static int64_t gpc_index_of(const struct gpc *c, int64_t id)
{
	int64_t pos = gpc_pos(c, c->ents[id].start);

	for (; pos >= 0 && c->starts[pos] == c->ents[id].start; pos--)
		if (c->ids[pos] == id)
			return pos;
	return -1;
}

int gpc_release(struct gpc *c, int64_t tok)
{
	int unindexed;

	return gpc_release_ex(c, tok, &unindexed);
}

/*
 * Drop a reference; caller holds c->lock.  Returns the references left, -1
 * for a token that names no held entry, GPC_CLOSED after gpc_close.
 * *unindexed: the entry is out of the index (stale or evicted), so the last
 * release must unpin it.
 */
int gpc_release_locked(struct gpc *c, int64_t tok, int *unindexed)
{
	int64_t id;
	int refs;

	*unindexed = 0;
	if (c->closed)
		return GPC_CLOSED;
	id = gpc_tok_id(c, tok);
	if (id < 0 || c->ents[id].refs <= 0)
		return -1;
	refs = --c->ents[id].refs;
	*unindexed = !c->ents[id].indexed;
	if (!refs && c->ents[id].indexed)
		gpc_lru_add(c, id);
	return refs;
}

int gpc_release_ex(struct gpc *c, int64_t tok, int *unindexed)
{
	int refs;

	pthread_mutex_lock(&c->lock);
	refs = gpc_release_locked(c, tok, unindexed);
	pthread_mutex_unlock(&c->lock);
	return refs;
}

/* Take a reference on the entry @tok names: the references now, or -1. */
int gpc_use(struct gpc *c, int64_t tok)
{
	int64_t id;
	int refs = -1;

	pthread_mutex_lock(&c->lock);
	id = c->closed || c->closing ? -1 : gpc_tok_id(c, tok);
	if (id >= 0 && gpc_get(c, id))
		refs = c->ents[id].refs;
	pthread_mutex_unlock(&c->lock);
	return refs;
}

/* References held on the entry @tok names, or -1. */
int gpc_refs(struct gpc *c, int64_t tok)
{
	int64_t id;
	int refs = -1;

	pthread_mutex_lock(&c->lock);
	id = gpc_tok_id(c, tok);
	if (id >= 0)
		refs = c->ents[id].refs;
	pthread_mutex_unlock(&c->lock);
	return refs;
}

/*
 * The entry @tok names is done with (unpinned): its slot may hold another
 * entry.  0, or -1 if it is still referenced or indexed (or not @tok's).
 */
int gpc_retire(struct gpc *c, int64_t tok)
{
	int64_t id;
	int ret = -1;

	pthread_mutex_lock(&c->lock);
	id = c->closed ? -1 : gpc_tok_id(c, tok);
	if (id >= 0 && !c->ents[id].refs && !c->ents[id].indexed) {
		c->ents[id].gen = 0;
		ret = 0;
	}
	pthread_mutex_unlock(&c->lock);
	return ret;
}

/*
 * Index [start, end) as entry @id, unreferenced, hidden from lookups if
 * @hidden: its token (>= 0), GPC_NO_GENERATION once the generations are
 * used up, or -1 if the slot holds an entry, the range is empty or overlaps
 * an indexed entry, or memory ran out.
 */
static int64_t gpc_add(struct gpc *c, int64_t id, uint64_t start, uint64_t end, uint64_t buffer_id,
		       uint64_t slot, uint64_t valid_word, int hidden)
{
	struct gpc_ent ne;
	int64_t pos, ret = -1;

	if (id < 0 || id > GPC_MAX_ID || end <= start)
		return -1;
	pthread_mutex_lock(&c->lock);
	if (c->closed)
		goto out;
	if (id >= c->nents) {
		int64_t n = id + 1 > 2 * c->nents ? id + 1 : 2 * c->nents;
		struct gpc_ent *ents = realloc(c->ents, n * sizeof(*ents));

		if (!ents)
			goto out;
		memset(ents + c->nents, 0, (n - c->nents) * sizeof(*ents));
		c->ents = ents;
		c->nents = n;
	}
	if (c->n == c->cap) {
		int64_t cap = c->cap ? 2 * c->cap : 64;
		uint64_t *starts = realloc(c->starts, cap * sizeof(*starts));
		int64_t *ids;

		if (!starts)
			goto out;
		c->starts = starts;
		ids = realloc(c->ids, cap * sizeof(*ids));
		if (!ids)
			goto out;
		c->ids = ids;
		c->cap = cap;
	}
	/* A slot is reused only after gpc_retire: never under a holder's token. */
	if (c->ents[id].gen)
		goto out;
	/* No overlaps: the page hash and the sorted index agree only then. */
	pos = gpc_pos(c, start);
	if ((pos >= 0 && c->ents[c->ids[pos]].end > start) ||
	    (pos + 1 < c->n && c->starts[pos + 1] < end))
		goto out;
	if (c->gen >= GPC_MAX_GEN) {
		ret = GPC_NO_GENERATION;
		goto out;
	}
	c->gen++;
	ne = (struct gpc_ent){ .start = start, .end = end, .buffer_id = buffer_id,
			       .valid_word = valid_word, .slot = slot, .gen = c->gen, .indexed = 1,
			       .hidden = !!hidden };
	/* Out of memory for the hash is no failure: the sorted index finds it. */
	if (gpc_page_last(end) - (start >> GPC_PAGE_SHIFT) < GPC_HASH_MAX_PAGES &&
	    !gpc_pages_add(c, id, start, end))
		ne.hashed = 1;
	else
		c->unhashed++;
	c->ents[id] = ne;
	gpc_lru_add(c, id);
	pos++;
	memmove(c->starts + pos + 1, c->starts + pos, (c->n - pos) * sizeof(*c->starts));
	memmove(c->ids + pos + 1, c->ids + pos, (c->n - pos) * sizeof(*c->ids));
	c->starts[pos] = start;
	c->ids[pos] = id;
	c->n++;
	ret = gpc_token(c, id);
out:
	pthread_mutex_unlock(&c->lock);
	return ret;
}

/* Index an entry that lookups find at once (what the core's own tests use). */
int64_t gpc_insert(struct gpc *c, int64_t id, uint64_t start, uint64_t end, uint64_t buffer_id,
		   uint64_t slot, uint64_t valid_word)
{
	return gpc_add(c, id, start, end, buffer_id, slot, valid_word, 0);
}

/*
 * Index an entry that lookups miss until gpc_publish(): the caller stores
 * what the token names (the cache's _ents) in between, so no hit can hand out
 * a token its caller cannot resolve yet.  Overlap checks and eviction see it.
 */
int64_t gpc_stage(struct gpc *c, int64_t id, uint64_t start, uint64_t end, uint64_t buffer_id,
		  uint64_t slot, uint64_t valid_word)
{
	return gpc_add(c, id, start, end, buffer_id, slot, valid_word, 1);
}

/* Let lookups find the staged entry @tok names: 0, or -1 if it names none. */
int gpc_publish(struct gpc *c, int64_t tok)
{
	int64_t id;
	int ret = -1;

	pthread_mutex_lock(&c->lock);
	id = gpc_tok_id(c, tok);
	if (id >= 0) {
		c->ents[id].hidden = 0;
		ret = 0;
	}
	pthread_mutex_unlock(&c->lock);
	return ret;
}

/*
 * The buffer-id query of the hit path and its context (CudaMemory's is
 * gp_cuda_query, the default; SimMemory's gp_sim_query, an ioctl on its
 * fd).  Called with c->lock held, and from the CPython entry points with the
 * GIL held too: it must not wait for either.  NULL puts the default back.
 */
void gpc_set_buffer_id_query(struct gpc *c, gpc_buffer_id_query_t query, void *ctx)
{
	pthread_mutex_lock(&c->lock);
	c->query = query ? query : gp_cuda_query;
	c->query_ctx = query ? ctx : NULL;
	pthread_mutex_unlock(&c->lock);
}

/*
 * The floor of a hit's buffer-id check, for the benchmark: @query called @n
 * times in a C loop, over @ptrs in turn (no Python, no cache).  Returns how
 * many calls failed (a floor of failing queries measures nothing).
 */
uint64_t gpc_query_loop(gpc_buffer_id_query_t query, void *ctx, const uint64_t *ptrs, uint64_t nptrs,
			uint64_t n)
{
	uint64_t i, j = 0, bid, failed = 0;

	if (!query || !nptrs)
		return n;
	for (i = 0; i < n; i++) {
		failed += query(ctx, ptrs[j], &bid) != 0;
		if (++j == nptrs)
			j = 0;
	}
	return failed;
}

/*
 * Entry @id leaves the index: out of the page hash, the LRU list, and the
 * sorted arrays at @pos (-1: not found there).  Its refs stay until released.
 */
static void gpc_unindex(struct gpc *c, int64_t id, int64_t pos)
{
	gpc_unhash(c, id);
	gpc_lru_del(c, id);
	if (pos >= 0) {
		memmove(c->starts + pos, c->starts + pos + 1, (c->n - pos - 1) * sizeof(*c->starts));
		memmove(c->ids + pos, c->ids + pos + 1, (c->n - pos - 1) * sizeof(*c->ids));
		c->n--;
	}
	c->ents[id].indexed = 0;
}

/* Take the entry @tok names out of the index (its refs stay until released). */
int gpc_remove(struct gpc *c, int64_t tok)
{
	int64_t id, pos;
	int ret = -1;

	pthread_mutex_lock(&c->lock);
	id = c->closed ? -1 : gpc_tok_id(c, tok);
	if (id >= 0 && c->ents[id].indexed) {
		pos = gpc_index_of(c, id);
		gpc_unindex(c, id, pos);
		ret = pos >= 0 ? 0 : -1;
	}
	pthread_mutex_unlock(&c->lock);
	return ret;
}

/*
 * Take the indexed, unreferenced entry released longest ago out of the
 * index, atomically with choosing it (no lookup can reference it after);
 * returns its token, or -1 if every indexed entry is in use.
 */
int64_t gpc_evict_lru(struct gpc *c)
{
	int64_t id, ret = -1;

	pthread_mutex_lock(&c->lock);
	id = c->lru_head;
	if (id >= 0) {
		gpc_unindex(c, id, gpc_index_of(c, id));
		ret = gpc_token(c, id);
	}
	pthread_mutex_unlock(&c->lock);
	return ret;
}

/*
 * Up to @max unreferenced entries out of the index at once, least recently
 * released first, their tokens in @out: how many.  One pass over the sorted
 * arrays, however many go (purge() would be quadratic one by one).
 */
int64_t gpc_evict_unused(struct gpc *c, int64_t *out, int64_t max)
{
	int64_t n = 0, i, j;

	pthread_mutex_lock(&c->lock);
	while (n < max && c->lru_head >= 0) {
		int64_t id = c->lru_head;

		gpc_unindex(c, id, -1);	/* -1: the arrays are compacted below */
		out[n++] = gpc_token(c, id);
	}
	for (i = j = 0; n && i < c->n; i++) {
		if (!c->ents[c->ids[i]].indexed)
			continue;
		c->starts[j] = c->starts[i];
		c->ids[j++] = c->ids[i];
	}
	if (n)
		c->n = j;
	pthread_mutex_unlock(&c->lock);
	return n;
}

/* The token of the indexed entry whose range holds ptr (for invalidation), or -1. */
int64_t gpc_find(struct gpc *c, uint64_t ptr)
{
	int64_t pos, tok = -1;

	pthread_mutex_lock(&c->lock);
	pos = gpc_pos(c, ptr);
	if (pos >= 0 && ptr < c->ents[c->ids[pos]].end)
		tok = gpc_token(c, c->ids[pos]);
	pthread_mutex_unlock(&c->lock);
	return tok;
}

/* The token of some indexed entry overlapping [start, stop), or -1. */
int64_t gpc_overlap(struct gpc *c, uint64_t start, uint64_t stop)
{
	int64_t pos, tok = -1;

	pthread_mutex_lock(&c->lock);
	pos = gpc_pos(c, stop - 1);	/* the last entry starting before stop */
	if (pos >= 0 && c->ents[c->ids[pos]].end > start)
		tok = gpc_token(c, c->ids[pos]);
	pthread_mutex_unlock(&c->lock);
	return tok;
}

/* Entries referenced now (close() refuses while any is). */
int64_t gpc_held(struct gpc *c)
{
	int64_t n;

	pthread_mutex_lock(&c->lock);
	n = gpc_held_locked(c);
	pthread_mutex_unlock(&c->lock);
	return n;
}

void gpc_counts(struct gpc *c, uint64_t *acquires, uint64_t *hits)
{
	pthread_mutex_lock(&c->lock);
	*acquires = c->acquires;
	*hits = c->hits;
	pthread_mutex_unlock(&c->lock);
}
