//! Helpers the split tests (`tests/split.rs`, `tests/split_rows.rs`)
//! share: plans that leave through the checker, CPU runs in an arena of
//! exactly the planned size, and the distance between two final states.

use std::time::Duration;

use memplan::exec;
use memplan::graph::Graph;
use memplan::{Options, Plan, checker};
use memplan_runtime::runner::{RunConfig, RunReport, run_cpu};

pub fn opts() -> Options {
    Options {
        time_limit: Duration::from_secs(1),
        ..Options::default()
    }
}

/// `g`'s plan, checked.
pub fn plan(g: &Graph) -> Plan {
    let p = memplan::plan(g, &opts()).unwrap();
    checker::check(g, &p).unwrap();
    p
}

/// Runs `steps` steps of `g`'s plan on the CPU executor (batches from
/// `seed`), in one arena of exactly the planned size.
pub fn run_seeded(g: &Graph, steps: usize, seed: u64) -> RunReport {
    let planned = plan(g);
    let p = exec::program(g, &planned).unwrap();
    let cfg = RunConfig {
        steps,
        keep_state: true,
        data_seed: seed,
        ..RunConfig::default()
    };
    let r = run_cpu(&p, &cfg).unwrap();
    assert_eq!(r.arena_bytes, planned.arena_bytes);
    r
}

/// Relative L2 distance between the final states (every parameter, moment
/// and the loss), after checking they name the same tensors.
pub fn state_distance(a: &RunReport, b: &RunReport) -> f64 {
    let (mut d, mut n) = (0.0f64, 0.0f64);
    assert_eq!(a.state[0].len(), b.state[0].len());
    for ((na, va), (nb, vb)) in a.state[0].iter().zip(&b.state[0]) {
        assert_eq!(na, nb);
        assert_eq!(va.len(), vb.len(), "{na}");
        for (&x, &y) in va.iter().zip(vb) {
            d += (x as f64 - y as f64).powi(2);
            n += (y as f64).powi(2);
        }
    }
    (d / n.max(f64::MIN_POSITIVE)).sqrt()
}
