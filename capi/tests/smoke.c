/* A C program using memplan.h: plans a two-op graph, checks the plan, and
 * gets an error message for a bad graph; extrapolates the graph captured at
 * batch 2 and 3 to batch 8 and finds the largest batch that fits a budget.
 * scripts/test.sh builds and runs it. */
#include <stdio.h>
#include <string.h>

#include "memplan.h"

static const char *GRAPH =
    "{\"format\": \"memplan-graph\", \"version\": 1, \"name\": \"c-smoke\","
    " \"tensors\": [{\"id\": \"x\", \"size\": 1024, \"role\": \"input\", \"lifetime\": \"persistent\"},"
    "  {\"id\": \"h\", \"size\": 4096},"
    "  {\"id\": \"y\", \"size\": 1024, \"role\": \"output\", \"lifetime\": \"persistent\"}],"
    " \"ops\": [{\"id\": \"f\", \"inputs\": [\"x\"], \"outputs\": [\"h\"]},"
    "  {\"id\": \"g\", \"inputs\": [\"h\"], \"outputs\": [\"y\"]}]}";

/* GRAPH with every size per sample, at batch 2 and 3 (recorded in the
 * metadata): its arena is 6144 bytes per sample. */
static const char *AT2 =
    "{\"format\": \"memplan-graph\", \"version\": 1, \"name\": \"c-smoke\","
    " \"metadata\": {\"batch\": 2},"
    " \"tensors\": [{\"id\": \"x\", \"size\": 2048, \"role\": \"input\", \"lifetime\": \"persistent\"},"
    "  {\"id\": \"h\", \"size\": 8192},"
    "  {\"id\": \"y\", \"size\": 2048, \"role\": \"output\", \"lifetime\": \"persistent\"}],"
    " \"ops\": [{\"id\": \"f\", \"inputs\": [\"x\"], \"outputs\": [\"h\"]},"
    "  {\"id\": \"g\", \"inputs\": [\"h\"], \"outputs\": [\"y\"]}]}";
static const char *AT3 =
    "{\"format\": \"memplan-graph\", \"version\": 1, \"name\": \"c-smoke\","
    " \"metadata\": {\"batch\": 3},"
    " \"tensors\": [{\"id\": \"x\", \"size\": 3072, \"role\": \"input\", \"lifetime\": \"persistent\"},"
    "  {\"id\": \"h\", \"size\": 12288},"
    "  {\"id\": \"y\", \"size\": 3072, \"role\": \"output\", \"lifetime\": \"persistent\"}],"
    " \"ops\": [{\"id\": \"f\", \"inputs\": [\"x\"], \"outputs\": [\"h\"]},"
    "  {\"id\": \"g\", \"inputs\": [\"h\"], \"outputs\": [\"y\"]}]}";

/* The batch functions: 0 on success, else 1 with a message on stderr. */
static int batches(void) {
    char *at8 = NULL, *plan8 = NULL, *best = NULL, *err = NULL;
    int failed = 1;
    /* Batch sizes from the metadata (0, 0). */
    if (memplan_at_batch(AT2, 0, AT3, 0, 8, &at8) != 0) {
        fprintf(stderr, "at_batch failed: %s\n", at8);
        goto done;
    }
    if (memplan_plan(at8, 1.0, &plan8) != 0 || !strstr(plan8, "\"arena_bytes\": 49152")) {
        fprintf(stderr, "the step at batch 8 should plan in 8 * 6144 bytes: %s\n", plan8);
        goto done;
    }
    /* 10 samples' arenas: batch 10 planned (nothing to recompute). */
    if (memplan_max_batch(AT2, 2, AT3, 3, 61440ULL, 1.0, &best) != 0 ||
        !strstr(best, "\"planned\":10") || !strstr(best, "\"fitted\":10")) {
        fprintf(stderr, "max_batch: expected 10 planned and fitted, got %s\n", best);
        goto done;
    }
    if (memplan_at_batch(AT2, 2, AT3, 2, 8, &err) != MEMPLAN_E_INVALID_ARGUMENT || !strstr(err, "two different")) {
        fprintf(stderr, "equal batch sizes should fail with a message, got: %s\n", err);
        goto done;
    }
    memplan_string_free(err);
    err = NULL;
    if (memplan_max_batch(AT2, -1, AT3, 3, 61440ULL, 1.0, &err) != MEMPLAN_E_INVALID_ARGUMENT ||
        strcmp(err, "batch1 must be 0 or more, got -1") != 0) {
        fprintf(stderr, "a negative batch should fail with a message, got: %s\n", err);
        goto done;
    }
    printf("at_batch ok, max_batch %s\n", best);
    failed = 0;
done:
    memplan_string_free(at8);
    memplan_string_free(plan8);
    memplan_string_free(best);
    memplan_string_free(err);
    return failed;
}

int main(void) {
    char *plan = NULL, *report = NULL, *err = NULL;
    if (memplan_plan(GRAPH, 1.0, &plan) != 0) {
        fprintf(stderr, "plan failed: %s\n", plan);
        return 1;
    }
    if (!strstr(plan, "\"arena_bytes\": 6144")) {
        fprintf(stderr, "unexpected plan: %s\n", plan);
        return 1;
    }
    if (memplan_check(GRAPH, plan, &report) != 0) {
        fprintf(stderr, "check failed: %s\n", report);
        return 1;
    }
    if (memplan_plan("{", 1.0, &err) != MEMPLAN_E_INPUT || !strstr(err, "<graph>")) {
        fprintf(stderr, "a bad graph should fail with a message, got: %s\n", err);
        return 1;
    }
    printf("memplan %s from C: plan ok, check %s, bad graph: %s\n", memplan_version(), report, err);
    memplan_string_free(plan);
    memplan_string_free(report);
    memplan_string_free(err);
    return batches();
}
