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
 * Work is split over (sequence, kv head) pairs across `threads` POSIX threads.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#define MAX_GROUP 16      /* query heads per KV head (GQA groups); more go to the torch backend */
#define MAX_DIM 512       /* head_dim */
#define MAX_BLOCK 256     /* tokens per block */

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
    int64_t first, last;                                  /* this thread's (seq, kv head) items */
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

static inline float dot(const float *restrict a, const float *restrict b, int64_t dim) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t d = 0; d < dim; d++) sum += a[d] * b[d];
    return sum;
}

static void run_item(const Job *job, int64_t item) {
    const int64_t dim = job->dim, bs = job->block_size;
    const int64_t group = job->q_heads / job->kv_heads;
    const int64_t seq = item / job->kv_heads, kv_head = item % job->kv_heads;
    int64_t len = job->lens[seq];
    if (len > job->table_width * bs) len = job->table_width * bs;   /* tokens past the row are ignored */
    float *out = job->out + (seq * job->q_heads + kv_head * group) * dim;
    float *lse = job->lse + seq * job->q_heads + kv_head * group;
    if (len <= 0) {
        memset(out, 0, (size_t)(group * dim) * 4);
        for (int64_t g = 0; g < group; g++) lse[g] = -INFINITY;
        return;
    }
    float q[MAX_GROUP][MAX_DIM];
    float scores[MAX_GROUP][MAX_BLOCK];
    float row[MAX_DIM];
    float running_max[MAX_GROUP], running_sum[MAX_GROUP];
    for (int64_t g = 0; g < group; g++) {
        load_row(job->q, seq * job->q_seq + (kv_head * group + g) * job->q_head, dim, job->dtype, q[g]);
        for (int64_t d = 0; d < dim; d++) q[g][d] *= job->scale;
        running_max[g] = -INFINITY;
        running_sum[g] = 0.0f;
    }
    memset(out, 0, (size_t)(group * dim) * 4);   /* the accumulator, normalised at the end */
    const int32_t *blocks = job->table + seq * job->table_row;
    for (int64_t start = 0; start < len; start += bs) {
        const int64_t block = blocks[start / bs];
        const int64_t tokens = len - start < bs ? len - start : bs;
        const int64_t base = block * job->c_block + kv_head * job->c_head;
        /* A block at a time: its scores, one rescale of the sums per block (FlashAttention's online
         * softmax), then its values. */
        for (int64_t t = 0; t < tokens; t++) {
            load_row(job->k, base + t * job->c_token, dim, job->dtype, row);
            for (int64_t g = 0; g < group; g++) scores[g][t] = dot(q[g], row, dim);
        }
        for (int64_t g = 0; g < group; g++) {
            float block_max = scores[g][0];
            for (int64_t t = 1; t < tokens; t++) block_max = scores[g][t] > block_max ? scores[g][t] : block_max;
            const float new_max = block_max > running_max[g] ? block_max : running_max[g];
            /* exp(-inf - x) is 0: the first block starts the sums from nothing */
            const float rescale = expf(running_max[g] - new_max);
            running_sum[g] *= rescale;
            float *acc = out + g * dim;
            if (rescale != 1.0f) {
#pragma omp simd
                for (int64_t d = 0; d < dim; d++) acc[d] *= rescale;
            }
            for (int64_t t = 0; t < tokens; t++) {
                scores[g][t] = expf(scores[g][t] - new_max);
                running_sum[g] += scores[g][t];
            }
            running_max[g] = new_max;
        }
        for (int64_t t = 0; t < tokens; t++) {
            load_row(job->v, base + t * job->c_token, dim, job->dtype, row);
            for (int64_t g = 0; g < group; g++) {
                const float p = scores[g][t];
                float *acc = out + g * dim;
#pragma omp simd
                for (int64_t d = 0; d < dim; d++) acc[d] += p * row[d];
            }
        }
    }
    for (int64_t g = 0; g < group; g++) {
        const float inverse = 1.0f / running_sum[g];
        float *acc = out + g * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; d++) acc[d] *= inverse;
        lse[g] = running_max[g] + logf(running_sum[g]);
    }
}

static void *run_range(void *arg) {
    const Job *job = (const Job *)arg;
    for (int64_t item = job->first; item < job->last; item++) run_item(job, item);
    return NULL;
}

/* The limits the caller (cpu_native.py) checks before it calls. */
int64_t kvfleet_decode_limits(int64_t which) {
    return which == 0 ? MAX_GROUP : which == 1 ? MAX_DIM : MAX_BLOCK;
}

/* Items are split over `threads` threads; a thread that cannot start leaves its items to the caller's. */
int kvfleet_paged_decode(const void *q, int64_t q_seq, int64_t q_head, const void *k, const void *v,
                         int64_t c_block, int64_t c_token, int64_t c_head, const int32_t *table,
                         int64_t table_row, int64_t table_width, const int32_t *lens, int64_t seqs,
                         int64_t q_heads, int64_t kv_heads, int64_t dim, int64_t block_size, float scale,
                         int dtype, float *out, float *lse, int threads) {
    const int64_t items = seqs * kv_heads;
    if (threads < 1) threads = 1;
    if (threads > 64) threads = 64;
    if (threads > items) threads = (int)(items > 0 ? items : 1);
    Job jobs[64];
    pthread_t ids[64];
    for (int i = 0; i < threads; i++) {
        jobs[i] = (Job){q, q_seq, q_head, k, v, c_block, c_token, c_head, table, table_row, table_width, lens,
                        seqs, q_heads, kv_heads, dim, block_size, scale, dtype, out, lse,
                        items * i / threads, items * (i + 1) / threads};
    }
    int started = 1;   /* threads 1 .. started-1 run */
    for (; started < threads; started++) {
        if (pthread_create(&ids[started], NULL, run_range, &jobs[started]) != 0) break;
    }
    for (int i = started; i < threads; i++) run_range(&jobs[i]);   /* what could not start runs here */
    run_range(&jobs[0]);
    for (int i = 1; i < started; i++) pthread_join(ids[i], NULL);
    return 0;
}
