//! Speed of the lower bounds: the simple bound (target: fast at 100,000
//! ops) and the min-cut floor (target: seconds at 10,000 ops), on
//! synthetic graphs and the built-in GPT-2 XL step.
//!
//! `cargo bench --bench bounds` (criterion; 10 samples each). Before timing,
//! each case prints its size and the floor's search figures once.

use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use memplan::graph::Graph;
use memplan::models::{ExampleOptions, example};
use memplan::testing::{random_dag, synthetic_training_step};
use memplan_solver::bounds::{FloorParams, min_cut_floor, simple_bound};

fn cases() -> Vec<(&'static str, Graph, bool)> {
    // `cargo test --all-targets` runs benches once as a smoke test: keep
    // that small.
    if !std::env::args().any(|a| a == "--bench") {
        return vec![("random-dag-500", random_dag(500, 16, 1), true)];
    }
    vec![
        ("random-dag-10k", random_dag(10_000, 32, 1), true),
        ("synthetic-step-10k", synthetic_training_step(770, 1), true),
        (
            "gpt2-xl",
            example("gpt2-xl", &ExampleOptions::default()).unwrap(),
            true,
        ),
        ("random-dag-100k", random_dag(100_000, 32, 2), false),
        (
            "synthetic-step-100k",
            synthetic_training_step(7_700, 2),
            false,
        ),
    ]
}

fn bounds(c: &mut Criterion) {
    let mut group = c.benchmark_group("bounds");
    group.sample_size(10);
    for (name, g, floor) in cases() {
        let low = memplan::lower::lower(&g, true);
        let p = &low.problem;
        let simple = simple_bound(p);
        eprint!(
            "{name}: {} ops, {} buffers; simple bound {}",
            p.num_ops(),
            p.num_bufs(),
            simple.bytes
        );
        if floor {
            let f = min_cut_floor(p, &[], None, &FloorParams::default());
            eprintln!(
                "; floor {} ({:+.2}% over simple, {:.2}% under the best known order), {} cuts, {} ops pruned",
                f.bytes,
                100.0 * (f.bytes as f64 / simple.bytes as f64 - 1.0),
                100.0 * (1.0 - f.bytes as f64 / f.upper as f64),
                f.cuts,
                f.pruned
            );
        } else {
            eprintln!();
        }
        group.bench_function(format!("simple/{name}"), |b| {
            b.iter(|| black_box(simple_bound(black_box(p))))
        });
        if floor {
            group.bench_function(format!("floor/{name}"), |b| {
                b.iter(|| {
                    black_box(min_cut_floor(
                        black_box(p),
                        &[],
                        None,
                        &FloorParams::default(),
                    ))
                })
            });
        }
    }
    group.finish();
}

criterion_group!(benches, bounds);
criterion_main!(benches);
