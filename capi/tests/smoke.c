/* A C program using memplan.h: plans a two-op graph, checks the plan, and
 * gets an error message for a bad graph. scripts/test.sh builds and runs it. */
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
    if (memplan_plan("{", 1.0, &err) != 1 || !strstr(err, "<graph>")) {
        fprintf(stderr, "a bad graph should fail with a message, got: %s\n", err);
        return 1;
    }
    printf("memplan %s from C: plan ok, check %s, bad graph: %s\n", memplan_version(), report, err);
    memplan_string_free(plan);
    memplan_string_free(report);
    memplan_string_free(err);
    return 0;
}
