/* Paged decode micro-attention with its log-sum-exp, on the CPU, in one pass over the cache.
 *
 * The contract is kvfleet.kernels' `micro_attention_decode` (_checks.py): one query token per
 * sequence, GQA-grouped, over the KV blocks this part holds; out fp32 [seqs, q_heads, head_dim] and a
 * natural-log LSE fp32 [seqs, q_heads]; a sequence with no tokens gets out 0 and lse -inf. The torch
 * backend computes the same with a gather of every block into a head-major copy and two matmuls: two
 * copies of the context's K and V per layer, which is where its time goes (bench/attention.py). This
 * reads each K and V row once where it lies, as vLLM's CPU kernel does, and keeps the softmax online
 * per block (FlashAttention's rescaling), so it also returns the LSE that vLLM's kernel does not.
 *
 * Built and loaded by cpu_native.py (ctypes, a C compiler at first use, cached); no Python headers.
 * Caches may be strided views (a unit-stride head dimension): vLLM's NHD layout keeps K and V of a
 * token side by side, and elastic memory's block-major storage interleaves layers.
 * Work is split over (sequence, run of KV heads) items across `threads` OpenMP threads (torch's pool).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_GROUP 16      /* query heads per KV head (GQA groups); more go to the torch backend */
#define MAX_DIM 256       /* head_dim */
#define MAX_BLOCK 256     /* tokens per block */
#define MAX_ROWS 64       /* query heads one item attends for (its KV heads x the group) */

enum { F32 = 0, BF16 = 1, F16 = 2 };

typedef struct {
    const void *q; int64_t q_seq, q_head;                 /* element strides; head_dim is unit-stride */
    const void *k; const void *v;
    int64_t c_block, c_token, c_head;                     /* both caches share their strides */
    const int32_t *table; int64_t table_row; int64_t table_width;
    const int32_t *lens;
    int64_t seqs, q_heads, kv_heads, dim, block_size;
    float scale;
    int dtype;
    float *out; float *lse;                               /* contiguous [seqs, q_heads, dim], [seqs, q_heads] */
    int64_t heads_per_item;                               /* KV heads one item takes, a divisor of kv_heads */
} Job;

static inline float bf16_to_f32(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* One row of `dim` elements into `to` as fp32. Copied even when it is fp32 already: reading the
 * strided row in place measured slower (about 2x at head_dim 64 in vLLM's NHD layout). */
static inline void load_row(const void *base, int64_t offset, int64_t dim, int dtype, float *restrict to) {
    if (dtype == F32) {
        memcpy(to, (const float *)base + offset, (size_t)dim * 4);
    } else if (dtype == BF16) {
        const uint16_t *row = (const uint16_t *)base + offset;
#pragma omp simd
        for (int64_t d = 0; d < dim; d++) to[d] = bf16_to_f32(row[d]);
    } else {
        const _Float16 *row = (const _Float16 *)base + offset;
#pragma omp simd
        for (int64_t d = 0; d < dim; d++) to[d] = (float)row[d];
    }
}

/* exp(x) for x <= 0, vectorisable (libm's expf is not, and a decode takes one per key and query
 * head): Cephes' expf, a Cody-Waite reduction by ln 2 and a degree-6 polynomial, within 2 ulp of
 * expf. Below -87 it returns 2^-126 rather than less: against a row maximum of exp(0) = 1 in the
 * same sum, nothing a float32 holds. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float k = floorf(x * 1.44269504088896341f + 0.5f);
    const float r = x - k * 0.693359375f + k * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    /* 2^k from its exponent bits */
    const union { int32_t bits; float value; } scale = {.bits = ((int32_t)k + 127) << 23};
    return p * scale.value;
}

/* x[i] = exp(x[i] - shift) for x[i] <= shift; returns their sum. Out of line: one vectorised loop
 * shared by every head_dim's item function. */
static __attribute__((noinline)) float exp_shifted(float *restrict x, int64_t n, float shift) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; i++) {
        x[i] = exp_nonpositive(x[i] - shift);
        sum += x[i];
    }
    return sum;
}

static inline float dot(const float *restrict a, const float *restrict b, int64_t dim) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t d = 0; d < dim; d++) sum += a[d] * b[d];
    return sum;
}

/* The work of one item: a sequence's `heads_per_item` consecutive KV heads, all of a block's tokens for
 * them read in memory order (one token's heads lie side by side in vLLM's NHD layout, so an item that
 * takes them all streams each block once). Inlined into one function per common head_dim, where `dim`
 * is a constant: the compiler unrolls the row loops into a few vector instructions each (about 1.6x
 * faster than the generic loops at head_dim 64). */
static inline __attribute__((always_inline)) void run_item_dim(const Job *job, int64_t item, const int64_t dim) {
    const int64_t bs = job->block_size, group = job->q_heads / job->kv_heads, heads = job->heads_per_item;
    const int64_t per_seq = job->kv_heads / heads;
    const int64_t seq = item / per_seq, first_head = (item % per_seq) * heads;
    const int64_t rows = heads * group;   /* query heads of this item, in order */
    int64_t len = job->lens[seq];
    if (len > job->table_width * bs) len = job->table_width * bs;   /* tokens past the row are ignored */
    float *out = job->out + (seq * job->q_heads + first_head * group) * dim;
    float *lse = job->lse + seq * job->q_heads + first_head * group;
    if (len <= 0) {
        memset(out, 0, (size_t)(rows * dim) * 4);
        for (int64_t r = 0; r < rows; r++) lse[r] = -INFINITY;
        return;
    }
    float q[MAX_ROWS][MAX_DIM];
    float scores[MAX_ROWS][MAX_BLOCK];
    float row[MAX_DIM];
    float running_max[MAX_ROWS], running_sum[MAX_ROWS];
    for (int64_t r = 0; r < rows; r++) {
        load_row(job->q, seq * job->q_seq + (first_head * group + r) * job->q_head, dim, job->dtype, q[r]);
        for (int64_t d = 0; d < dim; d++) q[r][d] *= job->scale;
        running_max[r] = -INFINITY;
        running_sum[r] = 0.0f;
    }
    memset(out, 0, (size_t)(rows * dim) * 4);   /* the accumulators, normalised at the end */
    const int32_t *blocks = job->table + seq * job->table_row;
    for (int64_t start = 0; start < len; start += bs) {
        const int64_t block = blocks[start / bs];
        const int64_t tokens = len - start < bs ? len - start : bs;
        const int64_t base = block * job->c_block + first_head * job->c_head;
        /* A block at a time: its scores, one rescale of the sums per block (FlashAttention's online
         * softmax), then its values. */
        for (int64_t t = 0; t < tokens; t++) {
            for (int64_t h = 0; h < heads; h++) {
                load_row(job->k, base + t * job->c_token + h * job->c_head, dim, job->dtype, row);
                for (int64_t g = 0; g < group; g++) scores[h * group + g][t] = dot(q[h * group + g], row, dim);
            }
        }
        for (int64_t r = 0; r < rows; r++) {
            float block_max = scores[r][0];
            for (int64_t t = 1; t < tokens; t++) block_max = scores[r][t] > block_max ? scores[r][t] : block_max;
            const float new_max = block_max > running_max[r] ? block_max : running_max[r];
            /* exp(-inf - x) is 0: the first block starts the sums from nothing */
            const float rescale = expf(running_max[r] - new_max);
            running_sum[r] *= rescale;
            float *acc = out + r * dim;
            if (rescale != 1.0f) {
#pragma omp simd
                for (int64_t d = 0; d < dim; d++) acc[d] *= rescale;
            }
            running_sum[r] += exp_shifted(scores[r], tokens, new_max);
            running_max[r] = new_max;
        }
        for (int64_t t = 0; t < tokens; t++) {
            for (int64_t h = 0; h < heads; h++) {
                load_row(job->v, base + t * job->c_token + h * job->c_head, dim, job->dtype, row);
                for (int64_t g = 0; g < group; g++) {
                    const float p = scores[h * group + g][t];
                    float *acc = out + (h * group + g) * dim;
#pragma omp simd
                    for (int64_t d = 0; d < dim; d++) acc[d] += p * row[d];
                }
            }
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        const float inverse = 1.0f / running_sum[r];
        float *acc = out + r * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; d++) acc[d] *= inverse;
        lse[r] = running_max[r] + logf(running_sum[r]);
    }
}

static void run_item_64(const Job *job, int64_t item) { run_item_dim(job, item, 64); }
static void run_item_128(const Job *job, int64_t item) { run_item_dim(job, item, 128); }
static void run_item_any(const Job *job, int64_t item) { run_item_dim(job, item, job->dim); }

/* The limits the caller (cpu_native.py) checks before it calls. */
int64_t kvfleet_decode_limits(int64_t which) {
    return which == 0 ? MAX_GROUP : which == 1 ? MAX_DIM : MAX_BLOCK;
}

/* Items are split over `threads` OpenMP threads: built with -fopenmp, this library needs libgomp.so.1,
 * which the loader resolves to the one torch already loaded (same soname), so the kernel runs on the
 * thread pool torch's and vLLM's CPU ops use. A pool of its own would compete with theirs, whose idle
 * threads spin for a while after each parallel region: measured inside vLLM on 2 cores, POSIX threads
 * of its own made the kernel 2-3x slower than alone. */
int kvfleet_paged_decode(const void *q, int64_t q_seq, int64_t q_head, const void *k, const void *v,
                         int64_t c_block, int64_t c_token, int64_t c_head, const int32_t *table,
                         int64_t table_row, int64_t table_width, const int32_t *lens, int64_t seqs,
                         int64_t q_heads, int64_t kv_heads, int64_t dim, int64_t block_size, float scale,
                         int dtype, float *out, float *lse, int threads) {
    if (threads < 1) threads = 1;
    /* As many KV heads per item as MAX_ROWS allows, while there are at least as many items as threads. */
    const int64_t group = q_heads / kv_heads;
    int64_t heads_per_item = 1;
    for (int64_t h = kv_heads; h >= 1; h--) {
        if (kv_heads % h == 0 && h * group <= MAX_ROWS && seqs * (kv_heads / h) >= threads) {
            heads_per_item = h;
            break;
        }
    }
    const int64_t items = seqs * (kv_heads / heads_per_item);
    if (threads > items) threads = (int)(items > 0 ? items : 1);
    const Job job = {q, q_seq, q_head, k, v, c_block, c_token, c_head, table, table_row, table_width, lens,
                     seqs, q_heads, kv_heads, dim, block_size, scale, dtype, out, lse, heads_per_item};
    void (*run)(const Job *, int64_t) = dim == 64 ? run_item_64 : dim == 128 ? run_item_128 : run_item_any;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t item = 0; item < items; item++) run(&job, item);
    return 0;
}
