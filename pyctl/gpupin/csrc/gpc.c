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
 * around these calls.
 */
struct gpc_ent {
	uint64_t start, end, buffer_id, valid_word, slot, lru;
	int32_t refs;
	int16_t indexed;
	int16_t hashed;			/* in the page hash (else only in the sorted index) */
};

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
	int check_kernel, check_tag_cuda;
	int closed;			/* gpc_close(): every lookup says GPC_CLOSED */
	struct gpc_ent *ents;
	int64_t nents;
	uint64_t *starts;
	int64_t *ids;
	int64_t n, cap;
	uint64_t tick, acquires, hits;
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

struct gpc *gpc_new(const uint64_t *words, uint64_t nwords, int check_kernel, int check_tag_cuda)
{
	struct gpc *c = calloc(1, sizeof(*c));

	if (!c)
		return NULL;
	pthread_mutex_init(&c->lock, NULL);
	c->words = words;
	c->nwords = nwords;
	c->check_kernel = check_kernel;
	c->check_tag_cuda = check_tag_cuda;
	return c;
}

/* Drop every entry and the index; caller holds c->lock (or is alone). */
static void gpc_drop_index(struct gpc *c)
{
	free(c->ents);
	free(c->starts);
	free(c->ids);
	gpc_ht_free(c->ht, c->ht_cap);
	c->ents = NULL;
	c->starts = NULL;
	c->ids = NULL;
	c->ht = NULL;
	c->nents = c->n = c->cap = 0;
	c->ht_cap = c->ht_used = c->ht_live = 0;
	c->unhashed = 0;
}

/*
 * The cache closed: drop the index and stop reading the validity map (which
 * may be unmapped next).  The struct stays until gpc_free, since bound fast
 * paths (gpc_bind) may still be called.
 */
void gpc_close(struct gpc *c)
{
	pthread_mutex_lock(&c->lock);
	c->closed = 1;
	c->words = NULL;
	c->nwords = 0;
	gpc_drop_index(c);
	pthread_mutex_unlock(&c->lock);
}

/*
 * In a forked child, before it runs any other thread: forget every entry
 * (they are the parent's pins: nothing is released) and stop reading the
 * parent's validity map.  The mutex is made anew, since a thread of the
 * parent may have held it at the fork.  Bound fast paths keep working: the
 * struct stays where it is.
 */
void gpc_reset_in_child(struct gpc *c)
{
	pthread_mutex_init(&c->lock, NULL);
	gpc_drop_index(c);
	c->tick = c->acquires = c->hits = 0;
	c->words = NULL;
	c->nwords = 0;
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
 * >= 0: the id of a valid entry covering the range, now referenced.
 * GPC_MISS: no entry covers it; GPC_BAD_ARG: empty or wrapping range.
 * -(id + GPC_STALE_BASE): an entry covers it but is stale (validity word or
 * buffer id changed); no reference taken.
 */
int64_t gpc_lookup(struct gpc *c, uint64_t ptr, uint64_t size)
{
	int64_t id, ret = GPC_MISS;
	struct gpc_ent *e;

	if (!size || ptr + size < ptr)
		return GPC_BAD_ARG;
	pthread_mutex_lock(&c->lock);
	if (c->closed) {
		pthread_mutex_unlock(&c->lock);
		return GPC_CLOSED;
	}
	c->acquires++;
	id = gpc_page_lookup(c, ptr);
	if (id < 0 && c->unhashed) {
		int64_t pos = gpc_pos(c, ptr);

		if (pos >= 0 && ptr < c->ents[c->ids[pos]].end)
			id = c->ids[pos];
	}
	if (id < 0)
		goto out;
	e = &c->ents[id];
	if (ptr + size > e->end)
		goto out;
	if (c->check_kernel && (e->slot >= c->nwords || c->words[e->slot] != e->valid_word)) {
		ret = -(id + GPC_STALE_BASE);
		goto out;
	}
	if (c->check_tag_cuda) {
		uint64_t bid = 0;

		if (gp_cuda_buffer_id(ptr, &bid) != 0 || bid != e->buffer_id) {
			ret = -(id + GPC_STALE_BASE);
			goto out;
		}
	}
	e->refs++;
	c->hits++;
	ret = id;
out:
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

int gpc_release(struct gpc *c, int64_t id)
{
	int unindexed;

	return gpc_release_ex(c, id, &unindexed);
}

/*
 * Drop a reference: the references left, -1 for an id not held, GPC_CLOSED
 * after gpc_close.  *unindexed: the entry is out of the index (stale or
 * evicted), so the last release must unpin it.
 */
int gpc_release_ex(struct gpc *c, int64_t id, int *unindexed)
{
	int refs;

	*unindexed = 0;
	pthread_mutex_lock(&c->lock);
	if (c->closed) {
		pthread_mutex_unlock(&c->lock);
		return GPC_CLOSED;
	}
	if (id < 0 || id >= c->nents || c->ents[id].refs <= 0) {
		pthread_mutex_unlock(&c->lock);
		return -1;
	}
	refs = --c->ents[id].refs;
	if (!refs)
		c->ents[id].lru = ++c->tick;
	*unindexed = !c->ents[id].indexed;
	pthread_mutex_unlock(&c->lock);
	return refs;
}

int gpc_use(struct gpc *c, int64_t id)
{
	int refs = -1;

	pthread_mutex_lock(&c->lock);
	if (id >= 0 && id < c->nents)
		refs = ++c->ents[id].refs;
	pthread_mutex_unlock(&c->lock);
	return refs;
}

int gpc_refs(struct gpc *c, int64_t id)
{
	int refs = -1;

	pthread_mutex_lock(&c->lock);
	if (id >= 0 && id < c->nents)
		refs = c->ents[id].refs;
	pthread_mutex_unlock(&c->lock);
	return refs;
}

int gpc_insert(struct gpc *c, int64_t id, uint64_t start, uint64_t end, uint64_t buffer_id,
			uint64_t slot, uint64_t valid_word)
{
	struct gpc_ent ne;
	int64_t pos;
	int ret = 0;

	if (id < 0 || end <= start)
		return -1;
	pthread_mutex_lock(&c->lock);
	if (id >= c->nents) {
		int64_t n = id + 1 > 2 * c->nents ? id + 1 : 2 * c->nents;
		struct gpc_ent *ents = realloc(c->ents, n * sizeof(*ents));

		if (!ents) {
			ret = -1;
			goto out;
		}
		memset(ents + c->nents, 0, (n - c->nents) * sizeof(*ents));
		c->ents = ents;
		c->nents = n;
	}
	if (c->n == c->cap) {
		int64_t cap = c->cap ? 2 * c->cap : 64;
		uint64_t *starts = realloc(c->starts, cap * sizeof(*starts));
		int64_t *ids;

		if (!starts) {
			ret = -1;
			goto out;
		}
		c->starts = starts;
		ids = realloc(c->ids, cap * sizeof(*ids));
		if (!ids) {
			ret = -1;
			goto out;
		}
		c->ids = ids;
		c->cap = cap;
	}
	if (c->ents[id].indexed) {
		ret = -1;
		goto out;
	}
	/* No overlaps: the page hash and the sorted index agree only then. */
	pos = gpc_pos(c, start);
	if ((pos >= 0 && c->ents[c->ids[pos]].end > start) ||
	    (pos + 1 < c->n && c->starts[pos + 1] < end)) {
		ret = -1;
		goto out;
	}
	ne = (struct gpc_ent){ start, end, buffer_id, valid_word, slot, 0, 0, 1, 0 };
	/* Out of memory for the hash is no failure: the sorted index finds it. */
	if (gpc_page_last(end) - (start >> GPC_PAGE_SHIFT) < GPC_HASH_MAX_PAGES &&
	    !gpc_pages_add(c, id, start, end))
		ne.hashed = 1;
	else
		c->unhashed++;
	c->ents[id] = ne;
	pos++;
	memmove(c->starts + pos + 1, c->starts + pos, (c->n - pos) * sizeof(*c->starts));
	memmove(c->ids + pos + 1, c->ids + pos, (c->n - pos) * sizeof(*c->ids));
	c->starts[pos] = start;
	c->ids[pos] = id;
	c->n++;
out:
	pthread_mutex_unlock(&c->lock);
	return ret;
}

/*
 * Entry @id leaves the index: out of the page hash, and out of the sorted
 * arrays at @pos (-1: not found there).  Its refs stay until released.
 */
static void gpc_unindex(struct gpc *c, int64_t id, int64_t pos)
{
	gpc_unhash(c, id);
	if (pos >= 0) {
		memmove(c->starts + pos, c->starts + pos + 1, (c->n - pos - 1) * sizeof(*c->starts));
		memmove(c->ids + pos, c->ids + pos + 1, (c->n - pos - 1) * sizeof(*c->ids));
		c->n--;
	}
	c->ents[id].indexed = 0;
}

/* Take id out of the index (its refs stay until released). */
int gpc_remove(struct gpc *c, int64_t id)
{
	int64_t pos;
	int ret = -1;

	pthread_mutex_lock(&c->lock);
	if (id >= 0 && id < c->nents && c->ents[id].indexed) {
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
 * returns its id, or -1 if every indexed entry is in use.
 */
int64_t gpc_evict_lru(struct gpc *c)
{
	int64_t i, best = -1, best_pos = -1;
	uint64_t best_lru = UINT64_MAX;

	pthread_mutex_lock(&c->lock);
	for (i = 0; i < c->n; i++) {
		struct gpc_ent *e = &c->ents[c->ids[i]];

		if (!e->refs && e->lru < best_lru) {
			best_lru = e->lru;
			best = c->ids[i];
			best_pos = i;
		}
	}
	if (best >= 0)
		gpc_unindex(c, best, best_pos);
	pthread_mutex_unlock(&c->lock);
	return best;
}

/* The indexed entry whose range holds ptr (for invalidation), or -1. */
int64_t gpc_find(struct gpc *c, uint64_t ptr)
{
	int64_t pos, id = -1;

	pthread_mutex_lock(&c->lock);
	pos = gpc_pos(c, ptr);
	if (pos >= 0 && ptr < c->ents[c->ids[pos]].end)
		id = c->ids[pos];
	pthread_mutex_unlock(&c->lock);
	return id;
}

/* Some indexed entry overlapping [start, stop), or -1. */
int64_t gpc_overlap(struct gpc *c, uint64_t start, uint64_t stop)
{
	int64_t pos, id = -1;

	pthread_mutex_lock(&c->lock);
	pos = gpc_pos(c, stop - 1);	/* the last entry starting before stop */
	if (pos >= 0 && c->ents[c->ids[pos]].end > start)
		id = c->ids[pos];
	pthread_mutex_unlock(&c->lock);
	return id;
}

void gpc_counts(struct gpc *c, uint64_t *acquires, uint64_t *hits)
{
	pthread_mutex_lock(&c->lock);
	*acquires = c->acquires;
	*hits = c->hits;
	pthread_mutex_unlock(&c->lock);
}
