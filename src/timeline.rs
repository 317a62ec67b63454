//! The memory timeline of an order: when every tensor's bytes are live, and
//! the live bytes at each step split by [`Role`]. Pictures (`memplan plot`)
//! and traces (`memplan trace`) are drawn from it.
//!
//! The rules are the graph's ([`crate::graph`]): a tensor that owns bytes is
//! live on the closed step interval from its producer's step (0 for a step
//! input) to the last step of any op that uses its bytes (the last step of the
//! order if it is persistent; its birth if nothing uses it). Views own nothing
//! and are not listed. A taken reuse `(output, input)` puts the output in the
//! input's bytes: at the reusing op's step both are live but the bytes count
//! once, and the shared bytes are booked to the output's role.
//!
//! The curve is what [`memplan_solver::evaluate`] computes for the same
//! order, split by role; tests hold the two equal.

use crate::graph::{Graph, Lifetime, OpId, Role, TensorId};
use crate::plan::Plan;

/// Index of `role` in [`Role::ALL`].
pub fn role_index(role: Role) -> usize {
    Role::ALL
        .iter()
        .position(|&r| r == role)
        .expect("Role::ALL lists every role")
}

/// The steps (inclusive) during which a tensor's bytes are live.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Interval {
    /// First live step.
    pub first: usize,
    /// Last live step (inclusive).
    pub last: usize,
}

/// The live bytes of one order, step by step, split by role.
#[derive(Clone, Debug, PartialEq)]
pub struct Timeline {
    /// Number of steps (the number of ops).
    pub steps: usize,
    /// Live interval of every tensor that owns bytes (`None` for views and
    /// zero-sized tensors), indexed by [`TensorId`].
    pub intervals: Vec<Option<Interval>>,
    /// Live bytes at every step for each role, indexed like [`Role::ALL`].
    pub by_role: [Vec<u64>; Role::ALL.len()],
    /// Live bytes at every step (the sum over roles).
    pub total: Vec<u64>,
    /// Maximum of `total`.
    pub peak: u64,
    /// Live interval of every host tensor that owns bytes (offloaded
    /// copies, [`crate::graph::Space::Host`]; `None` for the others),
    /// indexed by [`TensorId`]. Host bytes are in none of the curves above.
    pub host_intervals: Vec<Option<Interval>>,
    /// Live bytes of the host pool at every step.
    pub host: Vec<u64>,
    /// Maximum of `host` (0 for a step without offload).
    pub host_peak: u64,
}

impl Timeline {
    /// The timeline of `order` (every op once, a valid order of `g`) with
    /// the reuses `(output, input)` taken.
    pub fn of_order(g: &Graph, order: &[OpId], reuses: &[(TensorId, TensorId)]) -> Timeline {
        let n = order.len();
        let mut step = vec![0usize; g.num_ops()];
        for (i, &o) in order.iter().enumerate() {
            step[o.index()] = i;
        }
        let last_step = n.saturating_sub(1);
        let mut intervals = vec![None; g.num_tensors()];
        let mut host_intervals = vec![None; g.num_tensors()];
        // Difference arrays: +size at birth, -size after death.
        let mut delta: Vec<Vec<i128>> = vec![vec![0; n + 1]; Role::ALL.len()];
        let mut host_delta: Vec<i128> = vec![0; n + 1];
        let live = |t: TensorId| {
            let x = g.tensor(t);
            let first = x.producer.map_or(0, |p| step[p.index()]);
            let last = if x.lifetime == Lifetime::Persistent {
                last_step
            } else {
                g.users_of_root(t)
                    .iter()
                    .map(|u| step[u.index()])
                    .max()
                    .unwrap_or(first)
                    .max(first)
            };
            Interval { first, last }
        };
        for t in g.tensor_ids() {
            let x = g.tensor(t);
            if g.on_host(t) && x.view_of.is_none() && x.size > 0 {
                let iv = live(t);
                host_intervals[t.index()] = Some(iv);
                if n > 0 {
                    host_delta[iv.first] += x.size as i128;
                    host_delta[iv.last + 1] -= x.size as i128;
                }
                continue;
            }
            if !g.occupies_memory(t) {
                continue;
            }
            let Interval { first, last } = live(t);
            intervals[t.index()] = Some(Interval { first, last });
            if n > 0 {
                let d = &mut delta[role_index(x.role)];
                d[first] += x.size as i128;
                d[last + 1] -= x.size as i128;
            }
        }
        for &(out, inp) in reuses {
            let (Some(o), true) = (intervals[out.index()], g.occupies_memory(inp)) else {
                continue;
            };
            let shared = g.tensor(out).size.min(g.tensor(inp).size) as i128;
            if n > 0 {
                let d = &mut delta[role_index(g.tensor(out).role)];
                d[o.first] -= shared;
                d[o.first + 1] += shared;
            }
        }
        let by_role: [Vec<u64>; Role::ALL.len()] = std::array::from_fn(|r| running(&delta[r][..n]));
        let total: Vec<u64> = (0..n).map(|i| by_role.iter().map(|c| c[i]).sum()).collect();
        let peak = total.iter().copied().max().unwrap_or(0);
        let host = running(&host_delta[..n]);
        let host_peak = host.iter().copied().max().unwrap_or(0);
        Timeline {
            steps: n,
            intervals,
            by_role,
            total,
            peak,
            host_intervals,
            host,
            host_peak,
        }
    }

    /// The timeline of a plan's order and reuses.
    pub fn of_plan(g: &Graph, plan: &Plan) -> Timeline {
        Timeline::of_order(g, &plan.order, &plan.reuses)
    }

    /// The timeline of the graph's program order without reuses: what an
    /// eager framework runs.
    pub fn program_order(g: &Graph) -> Timeline {
        Timeline::of_order(g, g.program_order(), &[])
    }

    /// The curve of one role.
    pub fn role(&self, role: Role) -> &[u64] {
        &self.by_role[role_index(role)]
    }

    /// The first step at which `total` reaches `peak`.
    pub fn peak_step(&self) -> usize {
        self.total.iter().position(|&b| b == self.peak).unwrap_or(0)
    }

    /// Roles with any live bytes, in [`Role::ALL`] order.
    pub fn roles_present(&self) -> Vec<Role> {
        Role::ALL
            .iter()
            .copied()
            .filter(|&r| self.role(r).iter().any(|&b| b > 0))
            .collect()
    }
}

/// The running sums of a difference array: the live bytes at each step.
fn running(delta: &[i128]) -> Vec<u64> {
    let mut acc = 0i128;
    delta
        .iter()
        .map(|d| {
            acc += d;
            acc.max(0) as u64
        })
        .collect()
}

/// The order roles are stacked in, bottom to top: what lives all step long
/// first, then what comes and goes.
pub const STACK_ORDER: [Role; 8] = [
    Role::Parameter,
    Role::OptimizerState,
    Role::Input,
    Role::Output,
    Role::Gradient,
    Role::Activation,
    Role::Temporary,
    Role::Communication,
];

/// A role's name in legends.
pub fn role_label(role: Role) -> &'static str {
    match role {
        Role::Parameter => "parameters",
        Role::OptimizerState => "optimizer state",
        Role::Gradient => "gradients",
        Role::Activation => "activations",
        Role::Temporary => "temporaries",
        Role::Communication => "communication",
        Role::Input => "inputs",
        Role::Output => "outputs",
    }
}

/// Binary byte units for an axis whose largest value is `max`: the unit's
/// name and its size in bytes.
pub fn byte_unit(max: f64) -> (&'static str, f64) {
    const UNITS: [(&str, f64); 5] = [
        ("TiB", 1099511627776.0),
        ("GiB", 1073741824.0),
        ("MiB", 1048576.0),
        ("KiB", 1024.0),
        ("B", 1.0),
    ];
    UNITS
        .iter()
        .copied()
        .find(|&(_, s)| max >= s)
        .unwrap_or(("B", 1.0))
}

/// `bytes` in binary units with up to two decimals: `1.5 GiB`, `512 B`.
pub fn human(bytes: u64) -> String {
    let (name, size) = byte_unit(bytes as f64);
    format_in(bytes as f64, name, size)
}

pub(crate) fn format_in(v: f64, name: &str, size: f64) -> String {
    let x = v / size;
    let s = format!("{x:.2}");
    let s = s.trim_end_matches('0').trim_end_matches('.');
    format!("{s} {name}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::{GraphBuilder, OpKind, OpSpec, TensorSpec};
    use crate::models::{ExampleOptions, example};

    #[test]
    fn books_bytes_by_role_and_counts_reuse_once() {
        let mut b = GraphBuilder::new("g");
        let w = b.add_tensor(TensorSpec::new("w", 8).role(Role::Parameter).persistent());
        let x = b.add_tensor(TensorSpec::new("x", 4).role(Role::Input));
        let y = b.add_tensor(TensorSpec::new("y", 16));
        let z = b.add_tensor(TensorSpec::new("z", 16).role(Role::Temporary));
        let out = b.add_tensor(TensorSpec::new("out", 2).role(Role::Output).persistent());
        let a = b.add_op(
            OpSpec::new("a", OpKind::Forward, "mm")
                .inputs([x, w])
                .outputs([y]),
        );
        let c = b.add_op(
            OpSpec::new("c", OpKind::Forward, "gelu")
                .inputs([y])
                .outputs([z])
                .reuse(z, y),
        );
        let d = b.add_op(
            OpSpec::new("d", OpKind::Forward, "sum")
                .inputs([z])
                .outputs([out]),
        );
        let g = b.build().unwrap();
        let order = [a, c, d];
        let plain = Timeline::of_order(&g, &order, &[]);
        // step 0: w x y; step 1: w y z; step 2: w z out.
        assert_eq!(plain.total, vec![28, 40, 26]);
        assert_eq!(plain.role(Role::Parameter), &[8, 8, 8]);
        assert_eq!(plain.role(Role::Input), &[4, 0, 0]);
        assert_eq!(plain.role(Role::Temporary), &[0, 16, 16]);
        assert_eq!(plain.peak, 40);
        assert_eq!(plain.peak_step(), 1);
        let reused = Timeline::of_order(&g, &order, &[(z, y)]);
        assert_eq!(reused.total, vec![28, 24, 26]);
        // The shared bytes are booked to the output's role.
        assert_eq!(reused.role(Role::Temporary), &[0, 0, 16]);
        assert_eq!(reused.role(Role::Activation), &[16, 16, 0]);
        assert_eq!(
            reused.intervals[y.index()],
            Some(Interval { first: 0, last: 1 })
        );
        assert_eq!(
            reused.intervals[w.index()],
            Some(Interval { first: 0, last: 2 })
        );
        assert_eq!(
            reused.roles_present(),
            vec![
                Role::Parameter,
                Role::Activation,
                Role::Temporary,
                Role::Input,
                Role::Output
            ]
        );
    }

    #[test]
    fn agrees_with_the_planner_and_the_checker() {
        let g = example("gpt2-tiny", &ExampleOptions::default()).unwrap();
        let plan = crate::plan(&g, &crate::Options::default()).unwrap();
        let report = crate::checker::check(&g, &plan).unwrap();
        let tl = Timeline::of_plan(&g, &plan);
        assert_eq!(tl.peak, plan.stats.max_live_bytes);
        assert_eq!(tl.peak, report.max_live_bytes);
        assert_eq!(
            Timeline::program_order(&g).peak,
            crate::baselines::program_order_max_live(&g)
        );
    }
}
