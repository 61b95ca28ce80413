/* The BPE merge loop of archlab.tokenizer.bpe_train, in C (loaded with ctypes; no Python headers).
 *
 * Same algorithm as the pure-Python fallback `_merge_loop_python`, so both give identical merges:
 *   - every distinct pre-token ("word") is a doubly linked list of symbols in one flat array;
 *   - each pair keeps its count and the list of positions (left symbol index) where it was seen;
 *     stale positions are skipped when visited (symbols only ever grow, so a stale entry never
 *     becomes valid again);
 *   - an indexed binary max-heap orders pairs by (count, bytes of left, bytes of right), so among
 *     equally frequent pairs the lexicographically greater pair wins (GPT-2 / cs336 rule);
 *   - a merge visits the positions of the merged pair left to right and updates the counts of the
 *     neighbouring pairs incrementally: no recount per merge.
 * Token ids here: 0..255 are the bytes, 256+k is the k-th merge.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct { int32_t *data; int32_t len, cap; } ivec;

typedef struct {
    /* pairs */
    int32_t *pa, *pb, *hpos;
    int64_t *cnt;
    ivec *occ;
    int32_t n_pairs, cap_pairs;
    /* hash: key -> pair index + 1 (0 = empty) */
    uint64_t *hkeys;
    int32_t *hvals;
    uint64_t hcap, hused;
    /* heap of pair indices */
    int32_t *heap;
    int32_t hsize;
    /* token bytes */
    uint8_t *tbytes;
    int64_t *toff;
    int32_t *tlen;
    int64_t tbytes_used, tbytes_cap;
} state;

static int ivec_push(ivec *v, int32_t x) {
    if (v->len == v->cap) {
        int32_t nc = v->cap ? v->cap * 2 : 4;
        int32_t *nd = (int32_t *)realloc(v->data, (size_t)nc * sizeof(int32_t));
        if (!nd) return -1;
        v->data = nd; v->cap = nc;
    }
    v->data[v->len++] = x;
    return 0;
}

static inline uint64_t hash64(uint64_t x) {
    x ^= x >> 33; x *= 0xff51afd7ed558ccdULL; x ^= x >> 33; x *= 0xc4ceb9fe1a85ec53ULL; x ^= x >> 33;
    return x;
}

/* 1 if pair p ranks above pair q */
static inline int better(const state *s, int32_t p, int32_t q) {
    if (s->cnt[p] != s->cnt[q]) return s->cnt[p] > s->cnt[q];
    int32_t ids[2][2] = {{s->pa[p], s->pb[p]}, {s->pa[q], s->pb[q]}};
    for (int k = 0; k < 2; k++) {
        int32_t x = ids[0][k], y = ids[1][k];
        if (x == y) continue;
        int32_t lx = s->tlen[x], ly = s->tlen[y];
        int c = memcmp(s->tbytes + s->toff[x], s->tbytes + s->toff[y], (size_t)(lx < ly ? lx : ly));
        if (c != 0) return c > 0;
        if (lx != ly) return lx > ly;
    }
    return 0;
}

static void heap_swap(state *s, int32_t i, int32_t j) {
    int32_t a = s->heap[i], b = s->heap[j];
    s->heap[i] = b; s->heap[j] = a;
    s->hpos[b] = i; s->hpos[a] = j;
}

static void sift_up(state *s, int32_t i) {
    while (i > 0) {
        int32_t parent = (i - 1) / 2;
        if (!better(s, s->heap[i], s->heap[parent])) break;
        heap_swap(s, i, parent);
        i = parent;
    }
}

static void sift_down(state *s, int32_t i) {
    for (;;) {
        int32_t l = 2 * i + 1, r = l + 1, m = i;
        if (l < s->hsize && better(s, s->heap[l], s->heap[m])) m = l;
        if (r < s->hsize && better(s, s->heap[r], s->heap[m])) m = r;
        if (m == i) break;
        heap_swap(s, i, m);
        i = m;
    }
}

static int hash_grow(state *s) {
    uint64_t nc = s->hcap ? s->hcap * 2 : 1 << 16;
    uint64_t *nk = (uint64_t *)calloc(nc, sizeof(uint64_t));
    int32_t *nv = (int32_t *)calloc(nc, sizeof(int32_t));
    if (!nk || !nv) { free(nk); free(nv); return -1; }
    for (uint64_t i = 0; i < s->hcap; i++) {
        if (!s->hvals[i]) continue;
        uint64_t h = hash64(s->hkeys[i]) & (nc - 1);
        while (nv[h]) h = (h + 1) & (nc - 1);
        nk[h] = s->hkeys[i]; nv[h] = s->hvals[i];
    }
    free(s->hkeys); free(s->hvals);
    s->hkeys = nk; s->hvals = nv; s->hcap = nc;
    return 0;
}

/* index of pair (a, b), created with count 0 if absent; -1 on allocation failure */
static int32_t get_pair(state *s, int32_t a, int32_t b, int create) {
    if (create && (s->hcap == 0 || (s->hused + 1) * 2 > s->hcap) && hash_grow(s)) return -1;
    if (s->hcap == 0) return -1;
    uint64_t key = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
    uint64_t h = hash64(key) & (s->hcap - 1);
    while (s->hvals[h]) {
        if (s->hkeys[h] == key) return s->hvals[h] - 1;
        h = (h + 1) & (s->hcap - 1);
    }
    if (!create) return -1;
    if (s->n_pairs == s->cap_pairs) {
        int32_t nc = s->cap_pairs ? s->cap_pairs * 2 : 1 << 16;
        int32_t *pa = realloc(s->pa, (size_t)nc * sizeof(int32_t)); if (!pa) return -1; s->pa = pa;
        int32_t *pb = realloc(s->pb, (size_t)nc * sizeof(int32_t)); if (!pb) return -1; s->pb = pb;
        int32_t *hp = realloc(s->hpos, (size_t)nc * sizeof(int32_t)); if (!hp) return -1; s->hpos = hp;
        int64_t *ct = realloc(s->cnt, (size_t)nc * sizeof(int64_t)); if (!ct) return -1; s->cnt = ct;
        ivec *oc = realloc(s->occ, (size_t)nc * sizeof(ivec)); if (!oc) return -1; s->occ = oc;
        int32_t *hh = realloc(s->heap, (size_t)nc * sizeof(int32_t)); if (!hh) return -1; s->heap = hh;
        s->cap_pairs = nc;
    }
    int32_t p = s->n_pairs++;
    s->pa[p] = a; s->pb[p] = b; s->cnt[p] = 0;
    s->occ[p].data = NULL; s->occ[p].len = 0; s->occ[p].cap = 0;
    s->heap[s->hsize] = p; s->hpos[p] = s->hsize; s->hsize++;
    s->hkeys[h] = key; s->hvals[h] = p + 1; s->hused++;
    return p;
}

static int add_pair(state *s, int32_t a, int32_t b, int64_t w, int32_t pos) {
    int32_t p = get_pair(s, a, b, 1);
    if (p < 0) return -1;
    s->cnt[p] += w;
    if (ivec_push(&s->occ[p], pos)) return -1;
    sift_up(s, s->hpos[p]);
    return 0;
}

static void sub_pair(state *s, int32_t a, int32_t b, int64_t w) {
    int32_t p = get_pair(s, a, b, 0);
    if (p < 0) return;
    s->cnt[p] -= w;
    sift_down(s, s->hpos[p]);
}

static int cmp_i32(const void *x, const void *y) {
    int32_t a = *(const int32_t *)x, b = *(const int32_t *)y;
    return (a > b) - (a < b);
}

typedef int (*progress_fn)(int32_t done);

/* Returns the number of merges made (<= n_merges), or -1 when out of memory.
 * word_offsets: n_words + 1 offsets into symbols (byte values 0..255); counts: one per word.
 * out_merges: 2 * n_merges token ids (left, right). */
int64_t bpe_merge(int32_t n_words, const int64_t *word_offsets, const int32_t *symbols,
                  const int64_t *counts, int32_t n_merges, int32_t *out_merges, progress_fn progress) {
    int64_t n_sym = word_offsets[n_words];
    int64_t result = -1;
    state st; memset(&st, 0, sizeof st);
    state *s = &st;
    int32_t *sym = malloc((size_t)(n_sym ? n_sym : 1) * sizeof(int32_t));
    int32_t *nxt = malloc((size_t)(n_sym ? n_sym : 1) * sizeof(int32_t));
    int32_t *prv = malloc((size_t)(n_sym ? n_sym : 1) * sizeof(int32_t));
    int32_t *wof = malloc((size_t)(n_sym ? n_sym : 1) * sizeof(int32_t));
    int32_t n_tok = 256 + n_merges;
    s->toff = malloc((size_t)n_tok * sizeof(int64_t));
    s->tlen = malloc((size_t)n_tok * sizeof(int32_t));
    s->tbytes_cap = 1 << 20;
    s->tbytes = malloc((size_t)s->tbytes_cap);
    if (!sym || !nxt || !prv || !wof || !s->toff || !s->tlen || !s->tbytes) goto done;
    for (int32_t t = 0; t < 256; t++) { s->tbytes[t] = (uint8_t)t; s->toff[t] = t; s->tlen[t] = 1; }
    s->tbytes_used = 256;

    for (int32_t w = 0; w < n_words; w++) {
        int64_t lo = word_offsets[w], hi = word_offsets[w + 1];
        for (int64_t i = lo; i < hi; i++) {
            sym[i] = symbols[i]; wof[i] = w;
            prv[i] = (i > lo) ? (int32_t)(i - 1) : -1;
            nxt[i] = (i + 1 < hi) ? (int32_t)(i + 1) : -1;
        }
    }
    /* initial pair counts, positions in increasing order */
    for (int64_t i = 0; i < n_sym; i++) {
        if (nxt[i] < 0) continue;
        int32_t p = get_pair(s, sym[i], sym[nxt[i]], 1);
        if (p < 0) goto done;
        s->cnt[p] += counts[wof[i]];
        if (ivec_push(&s->occ[p], (int32_t)i)) goto done;
    }
    /* heapify */
    for (int32_t i = s->hsize / 2 - 1; i >= 0; i--) sift_down(s, i);

    int32_t k;
    for (k = 0; k < n_merges; k++) {
        if (s->hsize == 0) break;
        int32_t top = s->heap[0];
        if (s->cnt[top] <= 0) break;
        int32_t a = s->pa[top], b = s->pb[top], c = 256 + k;
        out_merges[2 * k] = a; out_merges[2 * k + 1] = b;
        /* bytes of the new token */
        int64_t need = s->tbytes_used + s->tlen[a] + s->tlen[b];
        if (need > s->tbytes_cap) {
            while (need > s->tbytes_cap) s->tbytes_cap *= 2;
            uint8_t *nb = realloc(s->tbytes, (size_t)s->tbytes_cap);
            if (!nb) goto done;
            s->tbytes = nb;
        }
        s->toff[c] = s->tbytes_used;
        memcpy(s->tbytes + s->tbytes_used, s->tbytes + s->toff[a], (size_t)s->tlen[a]);
        memcpy(s->tbytes + s->tbytes_used + s->tlen[a], s->tbytes + s->toff[b], (size_t)s->tlen[b]);
        s->tlen[c] = s->tlen[a] + s->tlen[b];
        s->tbytes_used = need;

        ivec positions = s->occ[top];
        s->occ[top].data = NULL; s->occ[top].len = 0; s->occ[top].cap = 0;
        qsort(positions.data, (size_t)positions.len, sizeof(int32_t), cmp_i32);
        for (int32_t t = 0; t < positions.len; t++) {
            int32_t i = positions.data[t];
            if (t > 0 && positions.data[t - 1] == i) continue;
            if (sym[i] != a) continue;
            int32_t j = nxt[i];
            if (j < 0 || sym[j] != b) continue;
            int64_t w = counts[wof[i]];
            int32_t p = prv[i], n = nxt[j];
            if (p >= 0) {
                sub_pair(s, sym[p], a, w);
                if (add_pair(s, sym[p], c, w, p)) { free(positions.data); goto done; }
            }
            if (n >= 0) {
                sub_pair(s, b, sym[n], w);
                if (add_pair(s, c, sym[n], w, i)) { free(positions.data); goto done; }
            }
            sym[i] = c; sym[j] = -1; nxt[i] = n;
            if (n >= 0) prv[n] = i;
        }
        free(positions.data);
        s->cnt[top] = 0;
        sift_down(s, s->hpos[top]);
        if (progress && (k + 1) % 256 == 0 && progress(k + 1)) { k++; break; }
    }
    result = k;
done:
    free(sym); free(nxt); free(prv); free(wof);
    for (int32_t p = 0; p < s->n_pairs; p++) free(s->occ[p].data);
    free(s->pa); free(s->pb); free(s->hpos); free(s->cnt); free(s->occ); free(s->heap);
    free(s->hkeys); free(s->hvals); free(s->tbytes); free(s->toff); free(s->tlen);
    return result;
}
