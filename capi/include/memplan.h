/* memplan's C ABI: plan a training step's graph (operator order and every
 * tensor's offset in one arena) and check a plan, from any language.
 *
 * Graphs and plans are the JSON documents of docs/graph-format.md and
 * docs/plan-format.md, as NUL-terminated UTF-8 strings. Every function
 * returns 0 (MEMPLAN_OK) on success and writes a string the caller owns to
 * *out (free it with memplan_string_free); on failure it returns one of the
 * MEMPLAN_E_* codes below, which says what kind of error it is, and writes
 * the error message (which document, which element, what is wrong) to *out
 * instead.
 * Functions never abort the process: a bad argument is an error, not a
 * crash. They are safe to call from several threads at once.
 *
 * Link with -lmemplan_capi (libmemplan_capi.so / libmemplan_capi.a from
 * `cargo build -p memplan-capi`). */
#ifndef MEMPLAN_H
#define MEMPLAN_H

#ifdef __cplusplus
extern "C" {
#endif

/* Return codes (stable; memplan::ErrorKind::code in Rust, MemplanError.kind
 * in Python). */
#define MEMPLAN_OK 0
#define MEMPLAN_E_INTERNAL 1         /* a bug in memplan: please report it */
#define MEMPLAN_E_IO 2               /* a file could not be read or written */
#define MEMPLAN_E_INPUT 3            /* a graph or plan document memplan cannot read */
#define MEMPLAN_E_INVALID_ARGUMENT 4 /* a NULL or bad argument, option or spec */
#define MEMPLAN_E_INVALID_PLAN 5     /* the checker refuses the plan */
#define MEMPLAN_E_UNSUPPORTED 6      /* a valid graph that the call cannot take */
#define MEMPLAN_E_DOES_NOT_FIT 7     /* no plan within the memory budget */
#define MEMPLAN_E_SOLVER 8           /* the solver failed */

/* Plans `graph_json` within `time_limit_seconds` (every time limit here:
 * finite, above 0 and at most 1e9, as for the CLI's --time-limit; anything
 * else is an error). On success *out is the plan document: "order", "tensors" (id, offset), "arena_bytes", and in
 * "stats" the lower bound and the gap to it. */
int memplan_plan(const char *graph_json, double time_limit_seconds, char **out);

/* memplan_plan, with the loss chain (LM head, cross-entropy and their
 * backward) and the row-wise regions around up projections (a block's MLP)
 * split into chunks of rows where that lowers the arena
 * (docs/splitting.md): `split` is "auto" (2 to 32 chunks tried), "off", or
 * a number of chunks. On success *out is {"graph": the graph planned (split
 * or not), "plan": its checked plan, "split": {"chunks" (1: not split),
 * "chains", "regions", "tried" ([chunks, arena bytes] each), "added_flops",
 * "step_flops"}}. */
int memplan_plan_split(const char *graph_json, double time_limit_seconds, const char *split,
                       char **out);

/* What `graph_json` needs without memplan, simulated on the graph (the
 * baselines of `memplan compare`): PyTorch eager's caching allocator with
 * and without expandable segments, the optimizer in the backward pass, the
 * program order's max live bytes. `device` is "cuda" or "cpu" (how FSDP2
 * eager issues a captured sharded step's all-gathers). On success *out is
 * {"baselines": [{"name", "footprint_bytes", "description"}, ...],
 * "best_eager": the eager configuration that needs the least, or null}:
 * a footprint is the memory a configuration holds at its worst (reserved
 * bytes, an arena, or max live bytes for an order alone); each baseline
 * also carries it as "peak_bytes", its old name, for one release. */
int memplan_baselines(const char *graph_json, const char *device, char **out);

/* Checks `plan_json` against `graph_json` with memplan's independent
 * checker. On success *out is the checker's report as JSON:
 * {"max_live_bytes", "used_bytes", "ops", "tensors_placed"}. */
int memplan_check(const char *graph_json, const char *plan_json, char **out);

/* Fits `graph_json` into `budget_bytes` by recomputation (docs/fit.md):
 * the cheapest set of forward ops to run again in the backward pass, with
 * `minimise` "time" (the default, also for NULL) or "flops". On success
 * *out is {"graph": the step with the recomputed ops, "plan": its checked
 * plan, "recomputed_ops", "added_flops", "added_seconds_estimate",
 * "arena_bytes", "no_recompute_arena_bytes", "optimal", ...}; a budget no
 * plan reaches is an error stating the bound. */
int memplan_fit(const char *graph_json, unsigned long long budget_bytes, double time_limit_seconds,
                const char *minimise, char **out);

/* The other way round: the smallest arena found whose recomputation adds
 * at most `max_added` times the step's cost (0.001: 0.1% more estimated
 * time, or FLOPs with `minimise` "flops"). The same answer as memplan_fit,
 * with "max_added_share" and "share_floor_bytes" (no recomputation within
 * the share, in any order, needs less; docs/fit.md); a negative or
 * non-finite share is an error. */
int memplan_fit_within(const char *graph_json, double max_added, double time_limit_seconds,
                       const char *minimise, char **out);

/* Offloads `graph_json` to host memory, chosen with recomputation
 * (docs/offload.md). `options_json` is a JSON object with either "budget"
 * (bytes: the least modeled time within it) or "max_slowdown" (a share:
 * the smallest arena whose modeled time is at most that much above the
 * step's), and optionally "device" (a preset: "h100-pcie5", "h200-pcie5",
 * "gh200-c2c", "cpu-dev"), "link_gbps", "host_memory" (bytes) and
 * "time_limit" (seconds, default 60). On success *out holds "graph" (the
 * step with its copy ops and host tensors), "plan" (checked) and
 * "offload" (arena_bytes, host_bytes, modeled_seconds, compute_seconds,
 * modeled_seconds_without_offload, lower_bound_bytes, ...).
 * MEMPLAN_E_DOES_NOT_FIT with the bound when nothing fits; an unknown
 * preset, a link of 0 or NaN GB/s or an unknown option is an error. */
int memplan_fit_offload(const char *graph_json, const char *options_json, char **out);

/* memplan_fit_within for a graph made from another step that it already
 * adds `already_flops` FLOPs to (a split made outside memplan): `max_added`
 * is a share of that other step's cost, and those FLOPs count against it.
 * MEMPLAN_E_DOES_NOT_FIT when they alone exceed it; a negative or
 * non-finite count is an error. */
int memplan_fit_within_after(const char *graph_json, double max_added, double already_flops,
                             double time_limit_seconds, const char *minimise, char **out);

/* memplan_fit (with `max_added` below 0: fits into `budget_bytes`) or
 * memplan_fit_within (with `max_added` 0 or more; `budget_bytes` is then
 * not read) that may also split the loss chain as memplan_plan_split does
 * (`split` "auto", "off" or a number of chunks): with a budget where that
 * is the cheaper way into it, within a share where that gives the smaller
 * arena, the split's FLOPs counted in the share. On success *out is the
 * fit's answer, its "graph" the split step's when split and its
 * "added_flops" the split's and the recomputation's, with "split" as
 * memplan_plan_split gives it ("chunks" 1: not split). A NaN `max_added`
 * is an error. */
int memplan_fit_split(const char *graph_json, unsigned long long budget_bytes, double max_added,
                      double time_limit_seconds, const char *minimise, const char *split, char **out);

/* The step at batch size `batch`, from the same step captured at two batch
 * sizes: `graph1_json` at `batch1` and `graph2_json` at `batch2` (0: the
 * batch that graph's metadata records as "batch", as memplan export and
 * memplan.torch.capture write it). Sizes, shapes, FLOPs, costs and numeric
 * op attributes follow the line through the two captures (docs/fit.md,
 * "Largest batch"); `batch` 0 gives the line's intercept. On success *out
 * is the graph document at `batch`, its metadata recording "batch" and
 * "extrapolated_from_batches". Errors: a
 * negative batch; two equal batch sizes (or a 0 whose graph records none);
 * captures that differ in structure, or a size that shrinks with the batch
 * or grows by a fraction of a byte per sample (the tensor is named); a
 * size below 0 or above 2^64 - 1 bytes at `batch`. Capture at two sizes
 * above 1: PyTorch can trace batch 1 differently. */
int memplan_at_batch(const char *graph1_json, long long batch1, const char *graph2_json,
                     long long batch2, long long batch, char **out);

/* The largest batch whose step fits `budget_bytes`, from two captures as
 * for memplan_at_batch, three ways: PyTorch eager in its best configuration
 * (its caching allocator simulated over the eager order, with and without
 * expandable segments and the optimizer in the backward, as memplan_baselines
 * simulates them), memplan's plan without recomputation, and memplan_fit's
 * recomputation. On success *out is {"eager", "eager_configuration",
 * "eager_default", "planned", "fitted", "cap", "budget_bytes"}: each but
 * "eager_configuration" a batch size, 0 where not even batch 1 fits (not an
 * error); one equal to "cap" (65536) means "at least". "eager_configuration"
 * names the configuration that fits at "eager" (null at 0); "eager_default"
 * is the default allocator's answer. Each trial plan or fit gets `probe_time_seconds` (a time limit as for
 * memplan_plan; plans without recomputation at most 5 s), and a search
 * makes a few dozen of them. The batch arguments' errors are
 * memplan_at_batch's. */
int memplan_max_batch(const char *graph1_json, long long batch1, const char *graph2_json,
                      long long batch2, unsigned long long budget_bytes,
                      double probe_time_seconds, char **out);

/* A built-in example step as a graph document, `spec` written as for
 * `memplan bench`: "NAME[,batch=N,seq=N,layers=N,dtype=T,clip=X,world=N,
 * prefetch=N,noreshard,flat,reduce=bf16,checkpoint,fused,mixed]", e.g.
 * "llama3-8b,world=8,mixed,checkpoint" (one rank of an FSDP2 step). */
int memplan_example(const char *spec, char **out);

/* Frees a string this library returned (NULL is allowed). */
void memplan_string_free(char *s);

/* The library's version, a static string. */
const char *memplan_version(void);

#ifdef __cplusplus
}
#endif

#endif /* MEMPLAN_H */
