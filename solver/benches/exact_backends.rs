//! The two exact back ends on the same parts: best-first search over
//! scheduled sets (`exact`) and the time-indexed ILP on HiGHS (`ilp`).
//!
//! Parts: random DAGs of 8 to 20 ops (the generator of `random`), and
//! windows of 16 and 24 consecutive steps cut from a heuristic order of a
//! 300-op random problem (what the window search hands the exact search).
//! Both back ends start from the same heuristic order and must agree on the
//! optimum; the bench asserts it before timing.
//!
//! Run: `cargo bench -p memplan-solver --bench exact_backends`.

use std::time::Duration;

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use memplan_solver::exact::{self, ExactLimits};
use memplan_solver::greedy::{Direction, Rule, greedy};
use memplan_solver::partition::extract_with;
use memplan_solver::random::random_problem;
use memplan_solver::{Budget, OpIdx, Problem, evaluate, ilp};

fn parts() -> Vec<(String, Problem)> {
    let mut out = Vec::new();
    for n in [8usize, 12, 16, 20] {
        for seed in 0..3u64 {
            out.push((
                format!("random-n{n}-s{seed}"),
                random_problem(1000 + seed, n, 0.25),
            ));
        }
    }
    let big = random_problem(77, 300, 0.02);
    let order = greedy(&big, Rule::NetFree, Direction::Forward);
    let pos = memplan_solver::simulate::positions(&big, &order);
    for width in [16usize, 24] {
        for start in [40usize, 140] {
            let ops: Vec<OpIdx> = order[start..start + width].to_vec();
            let side = |o: OpIdx| {
                let q = pos[o.index()] as usize;
                if q < start {
                    -1
                } else if q >= start + width {
                    1
                } else {
                    0
                }
            };
            let sub = extract_with(&big, &ops, 0, &[], side);
            out.push((format!("window-w{width}-at{start}"), sub.problem));
        }
    }
    out
}

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("exact_backends");
    group.sample_size(10);
    group.measurement_time(Duration::from_secs(3));
    for (name, p) in parts() {
        let start = greedy(&p, Rule::NetFree, Direction::Forward);
        let inc = evaluate(&p, &start).peak;
        let limits = ExactLimits {
            max_states: 5_000_000,
            dominance: true,
        };
        let dp = exact::solve(&p, inc, &limits, &Budget::unlimited());
        let lp = ilp::solve(&p, &start, Duration::from_secs(60)).expect("HiGHS solves");
        assert!(dp.proven, "{name}: exact search did not finish");
        if lp.proven {
            assert_eq!(dp.peak, lp.peak, "{name}: the back ends disagree");
        }
        eprintln!(
            "{name}: {} ops, heuristic {inc}, optimum {}, search states {}, ILP binaries {} (proven {})",
            p.num_ops(),
            dp.peak,
            dp.states,
            lp.binaries,
            lp.proven
        );
        group.bench_with_input(BenchmarkId::new("search", &name), &p, |b, p| {
            b.iter(|| exact::solve(p, inc, &limits, &Budget::unlimited()))
        });
        group.bench_with_input(BenchmarkId::new("ilp", &name), &p, |b, p| {
            b.iter(|| ilp::solve(p, &start, Duration::from_secs(60)))
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
