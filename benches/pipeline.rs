//! Criterion benchmarks of memplan's stages on GPT-2 training steps of three
//! sizes: `small` (gpt2-tiny), `medium` (gpt2-small, seq 1024) and `xl`
//! (gpt2-xl, seq 1024).
//!
//! Stages: `lower` (graph to solver problem), `order/*` (ordering and
//! evaluating an order), `bounds/*` (lower bounds), `layout/*` (offsets for
//! the list-scheduled order) and `pipeline/plan` (all of `memplan::plan`).
//!
//! Run all with `cargo bench --bench pipeline`, a subset with a filter
//! (`cargo bench --bench pipeline -- layout/xl`); compare two commits with
//! criterion baselines (`--save-baseline before`, then `--baseline before`),
//! see docs/benchmarks.md.

use std::hint::black_box;
use std::time::Duration;

use criterion::measurement::WallTime;
use criterion::{BenchmarkGroup, BenchmarkId, Criterion, criterion_group, criterion_main};
use memplan::graph::Graph;
use memplan::lower::{self, Lowered};
use memplan::models::{ExampleOptions, example};
use memplan_allocator as alloc;
use memplan_solver as solver;

/// The benchmarked graphs: (size label, example name).
const SIZES: [(&str, &str); 3] = [
    ("small", "gpt2-tiny"),
    ("medium", "gpt2-small"),
    ("xl", "gpt2-xl"),
];

struct Case {
    size: &'static str,
    graph: Graph,
    low: Lowered,
    order: Vec<solver::OpIdx>,
    layout: lower::LayoutProblem,
}

fn cases() -> Vec<Case> {
    SIZES
        .iter()
        .map(|&(size, name)| {
            let graph = example(name, &ExampleOptions::default()).expect("built-in example");
            let low = lower::lower(&graph, true);
            let order = solver::list_schedule(&low.problem);
            let ev = solver::evaluate(&low.problem, &order);
            let layout = lower::layout_problem(&graph, &low, &ev);
            Case {
                size,
                graph,
                low,
                order,
                layout,
            }
        })
        .collect()
}

/// A group with few samples and short runs, so `cargo bench` stays in
/// minutes on the big graph; criterion still reports medians with
/// confidence intervals.
fn group<'a>(c: &'a mut Criterion, name: &str) -> BenchmarkGroup<'a, WallTime> {
    let mut g = c.benchmark_group(name);
    g.warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .sample_size(10);
    g
}

fn stages(c: &mut Criterion) {
    let cases = cases();
    {
        let mut g = group(c, "lower");
        for k in &cases {
            g.bench_with_input(BenchmarkId::from_parameter(k.size), k, |b, k| {
                b.iter(|| lower::lower(black_box(&k.graph), true))
            });
        }
        g.finish();
    }
    {
        let mut g = group(c, "order");
        for k in &cases {
            g.bench_with_input(BenchmarkId::new("list_schedule", k.size), k, |b, k| {
                b.iter(|| solver::list_schedule(black_box(&k.low.problem)))
            });
            g.bench_with_input(BenchmarkId::new("evaluate", k.size), k, |b, k| {
                b.iter(|| solver::evaluate(black_box(&k.low.problem), black_box(&k.order)))
            });
        }
        g.finish();
    }
    {
        let mut g = group(c, "bounds");
        for k in &cases {
            g.bench_with_input(BenchmarkId::new("op_footprint", k.size), k, |b, k| {
                b.iter(|| solver::bounds::op_footprint(black_box(&k.low.problem)))
            });
        }
        g.finish();
    }
    {
        let mut g = group(c, "layout");
        for k in &cases {
            g.bench_with_input(BenchmarkId::new("greedy_by_size", k.size), k, |b, k| {
                b.iter(|| alloc::greedy_by_size(black_box(&k.layout.problem)))
            });
        }
        g.finish();
    }
    {
        let mut g = group(c, "pipeline");
        for k in &cases {
            g.bench_with_input(BenchmarkId::new("plan", k.size), k, |b, k| {
                b.iter(|| memplan::plan(black_box(&k.graph), &memplan::Options::default()))
            });
        }
        g.finish();
    }
}

criterion_group!(benches, stages);
criterion_main!(benches);
