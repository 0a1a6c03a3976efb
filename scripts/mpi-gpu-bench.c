/* mpi-gpu-bench: how fast a site's MPI moves host and CUDA device buffers through its collectives.
 *
 * MPI_Allreduce (out of place, MPI_SUM), MPI_Bcast (root 0), MPI_Allgather, MPI_Reduce_scatter_block
 * (MPI_SUM), MPI_Alltoall and MPI_Reduce_local on MPI_FLOAT buffers from malloc (host) or cudaMalloc
 * (cuda), for sizes from --min-bytes to --max-bytes (doubling), or the sizes --sizes lists (e.g.
 * 1M,16M,64M,256M). Each size: --warmup untimed calls, then --iters
 * timed calls, each between two barriers; a call's time is the slower rank's (MPI_MAX), the row gives
 * the median of those. Bandwidth as nccl-tests defines it: algbw = bytes / time, busbw = algbw x
 * 2(n-1)/n for all_reduce, (n-1)/n for all_gather, reduce_scatter and all_to_all (bytes: the larger
 * buffer, the gathered one; all_to_all: each rank's whole buffer), 1 for broadcast and reduce_local.
 * all_reduce, all_gather, reduce_scatter and all_to_all are the calls cudampi's all_reduce is made of
 * or replaced by (docs/howto/mpi-without-a-rebuild.md, "Where a call's time goes"). Every result is checked element by element
 * against the exact value (small integers in float), on every rank.
 *
 * Compile with the site's MPI compiler wrapper, with CUDA where the MPI is CUDA-aware:
 *   mpicc -O2 -o mpi-gpu-bench scripts/mpi-gpu-bench.c
 *   mpicc -O2 -DMPI_GPU_BENCH_CUDA -I$CUDA_HOME/include -o mpi-gpu-bench scripts/mpi-gpu-bench.c \
 *       -L$CUDA_HOME/lib64 -lcudart
 * Run:
 *   mpiexec -n 2 ./mpi-gpu-bench --mem cuda,host --max-bytes 1G --iters 5 --label none --json
 *
 * Output: a human table on stderr (rank 0); with --json one JSON object per row on stdout (rank 0):
 *   {"label": ..., "collective": "all_reduce", "memory": "cuda", "bytes": N, "ranks": 2,
 *    "median_s": ..., "max_s": ..., "algbw_GBps": ..., "busbw_GBps": ..., "exact": true}
 * A size whose slowest timed call took longer than --max-call-s ends that collective's sweep (the
 * next row says "skipped": a bound, not a result). Exit 0: every row exact; 1: a wrong result or an
 * MPI/CUDA failure; 2: bad arguments (a message and a hint on stderr, nothing run).
 */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef MPI_GPU_BENCH_CUDA
#include <cuda_runtime_api.h>
#endif

enum memory { MEM_HOST, MEM_CUDA };
enum collective { ALL_REDUCE, BROADCAST, ALL_GATHER, REDUCE_SCATTER, REDUCE_LOCAL, ALL_TO_ALL, N_COLLECTIVES };

static const char *const collective_names[N_COLLECTIVES] = {"all_reduce", "broadcast", "all_gather",
                                                            "reduce_scatter", "reduce_local", "all_to_all"};

#define MAX_SIZES 32
static const char *const memory_names[2] = {"host", "cuda"};

struct options {
    size_t min_bytes, max_bytes;
    size_t sizes[MAX_SIZES]; /* --sizes: these instead of doubling from min_bytes (n_sizes > 0) */
    int n_sizes;
    int iters, warmup;
    double max_call_s;
    int memories[2];
    int collectives[N_COLLECTIVES];
    const char *label;
    int json;
};

static int rank_, size_;

static void usage_error(const char *message, const char *hint)
{
    if (rank_ == 0) {
        fprintf(stderr, "mpi-gpu-bench: %s\n  hint: %s\n", message, hint);
    }
    MPI_Finalize();
    exit(2);
}

/* "1M", "64K", "1G" or plain bytes. */
static int parse_bytes(const char *text, size_t *out)
{
    char *end = NULL;
    unsigned long long value = strtoull(text, &end, 10);
    if (end == text) {
        return -1;
    }
    switch (*end) {
    case 'K': case 'k': value <<= 10; end++; break;
    case 'M': case 'm': value <<= 20; end++; break;
    case 'G': case 'g': value <<= 30; end++; break;
    default: break;
    }
    if (*end != '\0' || value == 0) {
        return -1;
    }
    *out = (size_t) value;
    return 0;
}

static int parse_list(const char *text, const char *const *names, int n_names, int *chosen)
{
    char buffer[256];
    if (strlen(text) >= sizeof(buffer)) {
        return -1;
    }
    strcpy(buffer, text);
    memset(chosen, 0, sizeof(int) * (size_t) n_names);
    for (char *item = strtok(buffer, ","); item != NULL; item = strtok(NULL, ",")) {
        int found = 0;
        for (int i = 0; i < n_names; i++) {
            if (strcmp(item, names[i]) == 0) {
                chosen[i] = found = 1;
            }
        }
        if (!found) {
            return -1;
        }
    }
    return 0;
}

static void parse_args(int argc, char **argv, struct options *opt)
{
    opt->min_bytes = 1 << 20;
    opt->max_bytes = 1 << 30;
    opt->iters = 5;
    opt->warmup = 1;
    opt->max_call_s = 0.0;
    opt->memories[MEM_HOST] = opt->memories[MEM_CUDA] = 1;
    for (int c = 0; c < N_COLLECTIVES; c++) {
        opt->collectives[c] = c != REDUCE_LOCAL && c != ALL_TO_ALL;
    }
    opt->n_sizes = 0;
    opt->label = "";
    opt->json = 0;
    for (int i = 1; i < argc; i++) {
        const char *arg = argv[i];
        const char *value = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(arg, "--json") == 0) {
            opt->json = 1;
            continue;
        }
        if (value == NULL) {
            usage_error("an option is missing its value or is unknown",
                        "options: --min-bytes --max-bytes --sizes --iters --warmup --max-call-s "
                        "--mem --collectives --label --json");
        }
        i++;
        if (strcmp(arg, "--min-bytes") == 0 || strcmp(arg, "--max-bytes") == 0) {
            size_t *target = arg[2] == 'm' && arg[3] == 'i' ? &opt->min_bytes : &opt->max_bytes;
            if (parse_bytes(value, target) != 0) {
                usage_error("a byte size must be a positive number with an optional K, M or G",
                            "e.g. --max-bytes 1G");
            }
        } else if (strcmp(arg, "--sizes") == 0) {
            char buffer[512];
            if (strlen(value) >= sizeof(buffer)) {
                usage_error("--sizes is too long", "e.g. --sizes 1M,16M,64M,256M");
            }
            strcpy(buffer, value);
            opt->n_sizes = 0;
            for (char *item = strtok(buffer, ","); item != NULL; item = strtok(NULL, ",")) {
                if (opt->n_sizes == MAX_SIZES || parse_bytes(item, &opt->sizes[opt->n_sizes]) != 0) {
                    usage_error("--sizes takes up to 32 comma-separated byte sizes, each a positive "
                                "number with an optional K, M or G", "e.g. --sizes 1M,16M,64M,256M");
                }
                opt->n_sizes++;
            }
            if (opt->n_sizes == 0) {
                usage_error("--sizes needs at least one size", "e.g. --sizes 1M,16M,64M,256M");
            }
        } else if (strcmp(arg, "--iters") == 0 || strcmp(arg, "--warmup") == 0) {
            char *end = NULL;
            long n = strtol(value, &end, 10);
            int minimum = arg[2] == 'i' ? 1 : 0;
            if (*end != '\0' || n < minimum || n > 100000) {
                usage_error("--iters needs an integer >= 1, --warmup one >= 0", "e.g. --iters 5");
            }
            *(arg[2] == 'i' ? &opt->iters : &opt->warmup) = (int) n;
        } else if (strcmp(arg, "--max-call-s") == 0) {
            char *end = NULL;
            opt->max_call_s = strtod(value, &end);
            if (*end != '\0' || opt->max_call_s < 0) {
                usage_error("--max-call-s needs seconds >= 0 (0: no bound)", "e.g. --max-call-s 2");
            }
        } else if (strcmp(arg, "--mem") == 0) {
            if (parse_list(value, memory_names, 2, opt->memories) != 0) {
                usage_error("--mem takes host, cuda or both", "e.g. --mem cuda,host");
            }
        } else if (strcmp(arg, "--collectives") == 0) {
            if (parse_list(value, collective_names, N_COLLECTIVES, opt->collectives) != 0) {
                usage_error("--collectives takes a comma-separated list",
                            "of all_reduce, broadcast, all_gather, reduce_scatter, reduce_local, "
                            "all_to_all");
            }
        } else if (strcmp(arg, "--label") == 0) {
            if (strpbrk(value, "\"\\") != NULL) {
                usage_error("--label may not hold quotes or backslashes", "e.g. --label yaksa-off");
            }
            opt->label = value;
        } else {
            usage_error("unknown option", "options: --min-bytes --max-bytes --sizes --iters "
                        "--warmup --max-call-s --mem --collectives --label --json");
        }
    }
    if (opt->n_sizes > 0) {
        /* --sizes wins over --min-bytes/--max-bytes: the checks below and the host buffer use its range. */
        opt->min_bytes = opt->max_bytes = opt->sizes[0];
        for (int k = 1; k < opt->n_sizes; k++) {
            opt->min_bytes = opt->sizes[k] < opt->min_bytes ? opt->sizes[k] : opt->min_bytes;
            opt->max_bytes = opt->sizes[k] > opt->max_bytes ? opt->sizes[k] : opt->max_bytes;
        }
    }
    if (opt->min_bytes > opt->max_bytes) {
        usage_error("--min-bytes is larger than --max-bytes", "e.g. --min-bytes 1M --max-bytes 1G");
    }
#ifndef MPI_GPU_BENCH_CUDA
    if (opt->memories[MEM_CUDA]) {
        usage_error("this build has no CUDA: --mem cuda needs -DMPI_GPU_BENCH_CUDA and -lcudart",
                    "use --mem host, or compile as the header of scripts/mpi-gpu-bench.c says");
    }
#endif
}

static void fail(const char *what)
{
    fprintf(stderr, "mpi-gpu-bench: rank %d: %s\n", rank_, what);
    MPI_Abort(MPI_COMM_WORLD, 1);
}

static void *allocate(enum memory memory, size_t bytes)
{
    void *pointer = NULL;
    if (memory == MEM_HOST) {
        pointer = malloc(bytes);
    } else {
#ifdef MPI_GPU_BENCH_CUDA
        if (cudaMalloc(&pointer, bytes) != cudaSuccess) {
            pointer = NULL;
        }
#endif
    }
    if (pointer == NULL) {
        fail("out of memory");
    }
    return pointer;
}

static void release(enum memory memory, void *pointer)
{
    if (memory == MEM_HOST) {
        free(pointer);
    } else {
#ifdef MPI_GPU_BENCH_CUDA
        cudaFree(pointer);
#endif
    }
}

/* Host <-> buffer copies; for device buffers the copy is synchronous (cudaMemcpy). */
static void put(enum memory memory, void *target, const float *source, size_t bytes)
{
    if (memory == MEM_HOST) {
        memcpy(target, source, bytes);
    } else {
#ifdef MPI_GPU_BENCH_CUDA
        if (cudaMemcpy(target, source, bytes, cudaMemcpyHostToDevice) != cudaSuccess) {
            fail("cudaMemcpy to the device failed");
        }
#endif
    }
}

static void get(enum memory memory, float *target, const void *source, size_t bytes)
{
    if (memory == MEM_HOST) {
        memcpy(target, source, bytes);
    } else {
#ifdef MPI_GPU_BENCH_CUDA
        if (cudaMemcpy(target, source, bytes, cudaMemcpyDeviceToHost) != cudaSuccess) {
            fail("cudaMemcpy from the device failed");
        }
#endif
    }
}

/* Element i of rank r's input: small integers, so that every sum here is exact in float. */
static float input_value(size_t i, int r)
{
    return (float) ((i % 251) + (size_t) r + 1);
}

/* The exact expected element i of the result on this rank. */
static float expected_value(enum collective coll, size_t i, size_t count)
{
    switch (coll) {
    case ALL_REDUCE: {
        float sum = 0.0f;
        for (int r = 0; r < size_; r++) {
            sum += input_value(i, r);
        }
        return sum;
    }
    case BROADCAST:
        return input_value(i, 0);
    case ALL_GATHER:
        /* Block r of the gathered buffer is rank r's input. */
        return input_value(i % count, (int) (i / count));
    case REDUCE_SCATTER: {
        /* This rank's block of the sum of every rank's full input. */
        float sum = 0.0f;
        for (int r = 0; r < size_; r++) {
            sum += input_value((size_t) rank_ * count + i, r);
        }
        return sum;
    }
    case REDUCE_LOCAL:
        /* inout (this rank's input) += in (this rank's input again). */
        return 2.0f * input_value(i, rank_);
    case ALL_TO_ALL:
        /* Block r of the result is block `rank_` of rank r's input. */
        return input_value((size_t) rank_ * count + i % count, (int) (i / count));
    default:
        return 0.0f;
    }
}

struct buffers {
    void *send, *recv;
    size_t send_bytes, recv_bytes, count; /* count: elements per rank's block */
};

/* Buffers of one row: bytes is the nccl-tests size (the larger buffer). */
static struct buffers prepare(enum collective coll, enum memory memory, size_t bytes, float *host)
{
    struct buffers b;
    size_t elements = bytes / sizeof(float);
    switch (coll) {
    case ALL_GATHER:
        b.count = elements / (size_t) size_;
        b.send_bytes = b.count * sizeof(float);
        b.recv_bytes = b.count * sizeof(float) * (size_t) size_;
        break;
    case REDUCE_SCATTER:
        b.count = elements / (size_t) size_;
        b.send_bytes = b.count * sizeof(float) * (size_t) size_;
        b.recv_bytes = b.count * sizeof(float);
        break;
    case ALL_TO_ALL:
        /* count: the elements of one block, sent to one rank. */
        b.count = elements / (size_t) size_;
        b.send_bytes = b.recv_bytes = b.count * sizeof(float) * (size_t) size_;
        break;
    default:
        b.count = elements;
        b.send_bytes = b.recv_bytes = elements * sizeof(float);
        break;
    }
    b.send = allocate(memory, b.send_bytes);
    b.recv = coll == BROADCAST ? b.send : allocate(memory, b.recv_bytes);
    size_t send_elements = b.send_bytes / sizeof(float);
    for (size_t i = 0; i < send_elements; i++) {
        /* A broadcast's non-root buffer starts wrong, so that a missing transfer shows. */
        host[i] = coll == BROADCAST && rank_ != 0 ? -1.0f : input_value(i, rank_);
    }
    put(memory, b.send, host, b.send_bytes);
    return b;
}

static void reset_inout(enum collective coll, enum memory memory, struct buffers *b, float *host)
{
    if (coll == REDUCE_LOCAL) {
        /* MPI_Reduce_local accumulates into recv: give it the input again before every call. */
        for (size_t i = 0; i < b->count; i++) {
            host[i] = input_value(i, rank_);
        }
        put(memory, b->recv, host, b->recv_bytes);
    }
}

static void call(enum collective coll, struct buffers *b)
{
    int rc = MPI_SUCCESS;
    int count = (int) b->count;
    switch (coll) {
    case ALL_REDUCE:
        rc = MPI_Allreduce(b->send, b->recv, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        break;
    case BROADCAST:
        rc = MPI_Bcast(b->send, count, MPI_FLOAT, 0, MPI_COMM_WORLD);
        break;
    case ALL_GATHER:
        rc = MPI_Allgather(b->send, count, MPI_FLOAT, b->recv, count, MPI_FLOAT, MPI_COMM_WORLD);
        break;
    case REDUCE_SCATTER:
        rc = MPI_Reduce_scatter_block(b->send, b->recv, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        break;
    case REDUCE_LOCAL:
        rc = MPI_Reduce_local(b->send, b->recv, count, MPI_FLOAT, MPI_SUM);
        break;
    case ALL_TO_ALL:
        rc = MPI_Alltoall(b->send, count, MPI_FLOAT, b->recv, count, MPI_FLOAT, MPI_COMM_WORLD);
        break;
    default:
        break;
    }
    if (rc != MPI_SUCCESS) {
        fail("an MPI collective returned an error");
    }
}

static int compare_doubles(const void *a, const void *b)
{
    double x = *(const double *) a, y = *(const double *) b;
    return (x > y) - (x < y);
}

static double bus_factor(enum collective coll)
{
    double n = (double) size_;
    switch (coll) {
    case ALL_REDUCE: return 2.0 * (n - 1.0) / n;
    case ALL_GATHER:
    case REDUCE_SCATTER:
    case ALL_TO_ALL: return (n - 1.0) / n;
    default: return 1.0;
    }
}

/* One row; returns the slowest timed call (seconds), or -1 when the result was wrong. */
static double run_row(const struct options *opt, enum collective coll, enum memory memory,
                      size_t bytes, float *host, int *all_exact)
{
    struct buffers b = prepare(coll, memory, bytes, host);
    double *times = malloc(sizeof(double) * (size_t) opt->iters);
    if (times == NULL) {
        fail("out of memory");
    }
    for (int i = 0; i < opt->warmup + opt->iters; i++) {
        reset_inout(coll, memory, &b, host);
        MPI_Barrier(MPI_COMM_WORLD);
        double start = MPI_Wtime();
        call(coll, &b);
        double mine = MPI_Wtime() - start, slowest = 0.0;
        MPI_Allreduce(&mine, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
        if (i >= opt->warmup) {
            times[i - opt->warmup] = slowest;
        }
    }
    /* The result of the last call, element by element, on every rank. */
    get(memory, host, b.recv, b.recv_bytes);
    size_t wrong = 0, elements = b.recv_bytes / sizeof(float);
    for (size_t i = 0; i < elements; i++) {
        wrong += host[i] != expected_value(coll, i, b.count);
    }
    unsigned long long wrong_all = 0, wrong_mine = wrong;
    MPI_Allreduce(&wrong_mine, &wrong_all, 1, MPI_UNSIGNED_LONG_LONG, MPI_SUM, MPI_COMM_WORLD);
    qsort(times, (size_t) opt->iters, sizeof(double), compare_doubles);
    double median = opt->iters % 2 ? times[opt->iters / 2]
                                   : 0.5 * (times[opt->iters / 2 - 1] + times[opt->iters / 2]);
    double slowest = times[opt->iters - 1];
    double algbw = (double) bytes / median / 1e9;
    if (rank_ == 0) {
        fprintf(stderr, "%-16s %-5s %11zu %12.3f %12.3f %10.2f %10.2f %s\n", collective_names[coll],
                memory_names[memory], bytes, median * 1e3, slowest * 1e3, algbw,
                algbw * bus_factor(coll), wrong_all ? "WRONG" : "exact");
        if (opt->json) {
            printf("{\"label\": \"%s\", \"collective\": \"%s\", \"memory\": \"%s\", \"bytes\": %zu, "
                   "\"ranks\": %d, \"iters\": %d, \"median_s\": %.9g, \"max_s\": %.9g, "
                   "\"algbw_GBps\": %.6g, \"busbw_GBps\": %.6g, \"exact\": %s, \"wrong_elements\": %llu}\n",
                   opt->label, collective_names[coll], memory_names[memory], bytes, size_, opt->iters,
                   median, slowest, algbw, algbw * bus_factor(coll), wrong_all ? "false" : "true",
                   wrong_all);
            fflush(stdout);
        }
    }
    if (wrong_all) {
        *all_exact = 0;
    }
    free(times);
    if (b.recv != b.send) {
        release(memory, b.recv);
    }
    release(memory, b.send);
    return slowest;
}

int main(int argc, char **argv)
{
    struct options opt;
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
    MPI_Comm_size(MPI_COMM_WORLD, &size_);
    parse_args(argc, argv, &opt);
    if (opt.min_bytes < sizeof(float) * (size_t) size_) {
        usage_error("--min-bytes must hold at least one float per rank", "e.g. --min-bytes 1M");
    }
    if (opt.max_bytes / sizeof(float) > (size_t) INT32_MAX) {
        usage_error("--max-bytes over 8 GiB needs counts beyond MPI's int", "e.g. --max-bytes 1G");
    }
#ifdef MPI_GPU_BENCH_CUDA
    if (opt.memories[MEM_CUDA]) {
        int devices = 0;
        if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
            usage_error("--mem cuda but no CUDA device is visible", "use --mem host on this node");
        }
        /* One GPU per rank where there are enough; several ranks share a device otherwise. */
        int local_rank = 0;
        MPI_Comm node;
        MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node);
        MPI_Comm_rank(node, &local_rank);
        MPI_Comm_free(&node);
        cudaSetDevice(local_rank % devices);
    }
#endif
    float *host = malloc(opt.max_bytes);
    if (host == NULL) {
        fail("out of host memory for the check buffer");
    }
    if (rank_ == 0) {
        char version[MPI_MAX_LIBRARY_VERSION_STRING];
        int length = 0;
        MPI_Get_library_version(version, &length);
        fprintf(stderr, "# %.*s\n# ranks %d, label '%s', median of %d calls (slower rank), %d warm-up\n",
                (int) strcspn(version, "\n"), version, size_, opt.label, opt.iters, opt.warmup);
        fprintf(stderr, "%-16s %-5s %11s %12s %12s %10s %10s %s\n", "collective", "mem", "bytes",
                "median_ms", "max_ms", "algbw_GB/s", "busbw_GB/s", "check");
    }
    int all_exact = 1;
    for (int m = 0; m < 2; m++) {
        if (!opt.memories[m]) {
            continue;
        }
        for (int c = 0; c < N_COLLECTIVES; c++) {
            if (!opt.collectives[c]) {
                continue;
            }
            for (int k = 0;; k++) {
                size_t bytes = opt.n_sizes > 0 ? opt.sizes[k] : opt.min_bytes << k;
                int last = opt.n_sizes > 0 ? k + 1 == opt.n_sizes : bytes * 2 > opt.max_bytes;
                double slowest = run_row(&opt, (enum collective) c, (enum memory) m, bytes, host,
                                         &all_exact);
                if (last) {
                    break;
                }
                size_t next = opt.n_sizes > 0 ? opt.sizes[k + 1] : bytes * 2;
                if (opt.max_call_s > 0 && slowest > opt.max_call_s) {
                    if (rank_ == 0) {
                        fprintf(stderr, "%-16s %-5s skipped from %zu bytes: a call took %.3f s > %.3f s\n",
                                collective_names[c], memory_names[m], next, slowest,
                                opt.max_call_s);
                        if (opt.json) {
                            printf("{\"label\": \"%s\", \"collective\": \"%s\", \"memory\": \"%s\", "
                                   "\"bytes\": %zu, \"skipped\": \"a call at %zu bytes took %.3f s "
                                   "(> --max-call-s %.3f)\"}\n",
                                   opt.label, collective_names[c], memory_names[m], next, bytes,
                                   slowest, opt.max_call_s);
                            fflush(stdout);
                        }
                    }
                    break;
                }
            }
        }
    }
    free(host);
    MPI_Finalize();
    return all_exact ? 0 : 1;
}
