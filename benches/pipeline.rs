//! Criterion benchmarks of memplan's stages on GPT-2 training steps of three
//! sizes: `small` (gpt2-tiny), `medium` (gpt2-small, seq 1024) and `xl`
//! (gpt2-xl, seq 1024).
//!
//! Stages: `lower` (graph to solver problem), `order/*` (ordering and
//! evaluating an order), `bounds/*` (lower bounds), `layout/*` (offsets for
//! the list-scheduled order) and `pipeline/plan` (all of `memplan::plan`).
//!
//! `time_limited/*` (issue 41): the whole plan of GPT-2 tiny at 400, 1,000
//! and 2,500 layers (16,000, 40,000 and 100,000 ops) and the allocator on a 50,000-row
//! MiniMalloc-style problem, each with a 2 s time limit: the time a
//! sample takes is the limit plus what overruns it (lowering, a layout
//! finished at once, the bound); it should stay near 2 s.
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

/// A MiniMalloc-style problem of `n` buffers: lifetimes and sizes spread
/// by a fixed hash, so every run sees the same problem.
fn crowded(n: u64) -> alloc::Problem {
    let mix = |i: u64, k: u64| {
        let mut x = i.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ k;
        x ^= x >> 31;
        x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
        x ^ (x >> 29)
    };
    let span = 2 * n;
    alloc::Problem::new(
        (0..n)
            .map(|i| {
                let lower = mix(i, 1) % span;
                let len = 1 + mix(i, 2) % (span / 25);
                let size = 64 * (1 + mix(i, 3) % 256);
                alloc::Buffer::new(format!("b{i}"), lower, (lower + len).min(span), size)
            })
            .collect(),
    )
}

fn time_limited(c: &mut Criterion) {
    let limit = Duration::from_secs(2);
    let mut g = c.benchmark_group("time_limited");
    g.warm_up_time(Duration::from_millis(1))
        .measurement_time(Duration::from_secs(20))
        .sample_size(10);
    for layers in [400u64, 1000, 2500] {
        let graph = example(
            "gpt2-tiny",
            &ExampleOptions {
                layers: Some(layers),
                ..Default::default()
            },
        )
        .expect("built-in example");
        let opts = memplan::Options {
            time_limit: limit,
            ..Default::default()
        };
        g.bench_with_input(BenchmarkId::new("plan_2s", layers), &graph, |b, graph| {
            b.iter(|| memplan::plan(black_box(graph), &opts).expect("plans"))
        });
    }
    let p = crowded(50_000);
    let params = alloc::SolverParams {
        time_limit: Some(limit),
        ..Default::default()
    };
    g.bench_with_input(BenchmarkId::new("alloc_2s", 50_000), &p, |b, p| {
        b.iter(|| alloc::solve(black_box(p), alloc::Mode::Minimize, &params).expect("solves"))
    });
    g.finish();
}

criterion_group!(benches, stages, time_limited);
criterion_main!(benches);
