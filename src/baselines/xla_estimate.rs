//! What XLA's buffer assignment will need for an order: an estimate of its
//! `Total bytes`, for a module imported with
//! [`ImportOptions::xla_allocations`](crate::io::hlo::ImportOptions).
//!
//! That import holds every aliased entry parameter's bytes for the whole
//! step, with its output written into them, so the plan's peak is a ceiling.
//! XLA does one thing more: a parameter's allocation, between the
//! parameter's last read and the write of its output, may hold other
//! values, each at the allocation's start, one at a time, when it fits.
//! The estimate replays that:
//!
//! 1. Evaluate the order: every buffer's first and last step.
//! 2. For every aliased parameter, its free window: after its last reader,
//!    before the op that writes its output.
//! 3. Take the other transient buffers largest first; each goes into the
//!    first parameter allocation (in the order the module lists the
//!    parameters) that is large enough, free over its whole life, and
//!    holds no value live at the same time.
//! 4. Lay out what is left (persistent bytes, unhosted values) with the
//!    allocator: that arena is the estimate.
//!
//! XLA's own choice of values and allocations differs in detail (its sort,
//! its interference test at shared steps), so this is an estimate, not a
//! bound; `tools/xla_run_scheduled.py` sets it against XLA's report.

use std::collections::HashMap;

use memplan_allocator as alloc;
use memplan_solver as solver;

use crate::graph::{Graph, OpId};
use crate::layout::{LAYOUT_BACKSTOP, layout_params};
use crate::lower::{self, Lowered};

/// The estimate and what went into it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct XlaEstimate {
    /// Estimated `Total bytes`: the arena of what XLA cannot put into a
    /// dead parameter's allocation.
    pub total: u64,
    /// The order's max live bytes with every aliased parameter held (the
    /// ceiling).
    pub ceiling: u64,
    /// Values placed into parameters' allocations, and their bytes.
    pub hosted: usize,
    pub hosted_bytes: u64,
}

/// A parameter's allocation: its size, and the steps it is free.
struct Room {
    size: u64,
    /// Free from `from` (the first step after the last reader) to `to`
    /// (exclusive: the step writing the output).
    from: u64,
    to: u64,
    /// (first, last + 1) of the values placed into it.
    taken: Vec<(u64, u64)>,
}

impl Room {
    fn fits(&self, size: u64, lower: u64, upper: u64) -> bool {
        size <= self.size
            && self.from <= lower
            && upper <= self.to
            && self.taken.iter().all(|&(a, b)| upper <= a || b <= lower)
    }
}

/// The estimate for `order` of `g`, which must come from an import with
/// `xla_allocations` (its metadata lists the aliased parameters); `None`
/// without that list or when `order` is not a valid order of `g`.
pub fn estimate(g: &Graph, order: &[OpId]) -> Option<XlaEstimate> {
    let pairs = g.metadata.get("xla_parameter_outputs")?.as_array()?;
    let low = lower::lower(g, true);
    let lowered = Lowered::from_op_ids(order);
    if !low.problem.is_valid_order(&lowered) {
        return None;
    }
    let ev = solver::evaluate(&low.problem, &lowered);
    let lp = lower::layout_problem(g, &low, &ev);
    let mut rooms = rooms(g, &low, &ev, &lp.group_of_buf, pairs);
    let mut problem = lp.problem;
    // The allocator's buffers that are parameters' allocations themselves.
    let own: Vec<usize> = rooms.keys().copied().collect();
    let mut cands: Vec<usize> = (0..problem.buffers.len())
        .filter(|&i| {
            let b = &problem.buffers[i];
            b.size > 0 && !own.contains(&i) && !persistent(&b.id, g)
        })
        .collect();
    cands.sort_by_key(|&i| (std::cmp::Reverse(problem.buffers[i].size), i));
    let mut order_of_rooms: Vec<usize> = rooms.keys().copied().collect();
    order_of_rooms.sort_unstable();
    let (mut hosted, mut hosted_bytes) = (0, 0);
    for i in cands {
        let b = &problem.buffers[i];
        let room = order_of_rooms
            .iter()
            .find(|r| rooms[r].fits(b.size, b.lower, b.upper));
        if let Some(r) = room {
            rooms
                .get_mut(r)
                .expect("a room")
                .taken
                .push((b.lower, b.upper));
            hosted += 1;
            hosted_bytes += b.size;
            problem.buffers[i].size = 0;
        }
    }
    let params = layout_params(problem.buffers.len(), LAYOUT_BACKSTOP);
    let total = match alloc::solve(&problem, alloc::Mode::Minimize, &params) {
        Ok(out) => out.solution.height,
        Err(_) => alloc::greedy_by_size(&problem).height,
    };
    Some(XlaEstimate {
        total,
        ceiling: ev.peak,
        hosted,
        hosted_bytes,
    })
}

fn persistent(name: &str, g: &Graph) -> bool {
    g.tensor_by_name(name)
        .is_some_and(|t| g.tensor(t).lifetime == crate::graph::Lifetime::Persistent)
}

/// The free window of every aliased parameter, by its allocator buffer.
fn rooms(
    g: &Graph,
    low: &Lowered,
    ev: &solver::Evaluation,
    group_of_buf: &[usize],
    pairs: &[serde_json::Value],
) -> HashMap<usize, Room> {
    let mut out = HashMap::new();
    for pair in pairs {
        let (Some(p), Some(o)) = (
            pair.get(0).and_then(|v| v.as_str()),
            pair.get(1).and_then(|v| v.as_str()),
        ) else {
            continue;
        };
        let (Some(pt), Some(ot)) = (g.tensor_by_name(p), g.tensor_by_name(o)) else {
            continue;
        };
        let Some(pb) = low.buf_of_tensor[pt.index()] else {
            continue;
        };
        let Some(maker) = g.ops().iter().position(|op| op.outputs.contains(&ot)) else {
            continue;
        };
        let readers = low.problem.users(pb).map(|u| ev.pos[u.index()] as u64);
        let from = readers.max().map_or(0, |s| s + 1);
        let to = ev.pos[maker] as u64;
        let group = group_of_buf[pb.index()];
        out.insert(
            group,
            Room {
                size: g.tensor(pt).size,
                from,
                to,
                taken: Vec::new(),
            },
        );
    }
    out
}
