//! FSDP2 eager's order for a sharded step captured by `memplan.torch`.
//!
//! A captured rank's graph records its collectives where capture meets
//! them, not where FSDP2 eager issues them: every forward all-gather comes
//! before the forward, every reduce-scatter after the whole backward. The
//! program order of such a graph is therefore no eager user's order, and
//! the eager baselines must not be measured on it. The capture tags the
//! ops it records for FSDP2 (op attributes): a gather's ops (the shard's
//! padded view, its cast to `param_dtype`, the empty buffer, the
//! all-gather) with `fsdp_unit` and `fsdp_pass` (`forward`, or `backward`
//! for a resharded unit's gather again), a reduction's ops (padding,
//! reduce-scatter, HSDP's all-reduce, the cast) with `fsdp_unit`. From
//! those this module rebuilds the order FSDP2 eager runs, as
//! [`crate::models::fsdp`] emits it for the built-in models:
//!
//! - a **gather group** is one unit's gather ops of one pass; its **first
//!   use** is the first untagged op that reads one of them;
//! - groups are issued `prefetch` groups ahead of their first use, counted
//!   within their pass (FSDP2 prefetches one unit in the forward and one in
//!   the backward on CUDA; on the CPU its forward issues each unit's
//!   gathers at the unit's own pre-forward, depth 0);
//! - a reduction's ops run as soon as their inputs are ready (an empty
//!   buffer just before its first reader), as FSDP2's post-backward
//!   reduces each unit's gradients once they are complete;
//! - every other op keeps its program order (the optimizer steps after the
//!   backward, as `optimizer.step()` does).
//!
//! The result is checked against the graph's dependencies; a graph whose
//! rebuilt order would break one keeps its program order ([`eager_order`]
//! returns `None`).

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap};

use crate::graph::{Graph, OpId};

/// All-gathers issued ahead of their first use, per pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Prefetch {
    pub forward: usize,
    pub backward: usize,
}

impl Prefetch {
    /// FSDP2 on CUDA: one unit ahead in both passes (the depth the built-in
    /// models' sharding uses, `FsdpOptions::new`).
    pub const CUDA: Prefetch = Prefetch {
        forward: 1,
        backward: 1,
    };
    /// FSDP2 on the CPU (gloo): no stream runs ahead, so the forward
    /// gathers at each unit's pre-forward; the backward's explicit
    /// prefetch still gathers one unit ahead.
    pub const CPU: Prefetch = Prefetch {
        forward: 0,
        backward: 1,
    };
}

fn attr<'a>(g: &'a Graph, o: OpId, key: &str) -> Option<&'a str> {
    g.op(o).attrs.get(key).and_then(|v| v.as_str())
}

/// Whether `g` is a captured FSDP2 step whose collectives name their units.
pub fn applies(g: &Graph) -> bool {
    g.op_ids()
        .any(|o| g.op(o).op_type == "memplan.all_gather" && attr(g, o, "fsdp_pass").is_some())
}

/// FSDP2 eager's order of `g` (see the module doc), or `None` when `g`
/// has no unit-named all-gathers or the rebuilt order would break one of
/// its dependencies.
pub fn eager_order(g: &Graph, prefetch: Prefetch) -> Option<Vec<OpId>> {
    if !applies(g) {
        return None;
    }
    let n = g.num_ops();
    let program = g.program_order();
    let mut position = vec![0usize; n];
    for (i, &o) in program.iter().enumerate() {
        position[o.index()] = i;
    }
    let mut users: Vec<Vec<OpId>> = vec![Vec::new(); n];
    for o in g.op_ids() {
        for &d in g.deps(o) {
            users[d.index()].push(o);
        }
    }
    // Gather groups, keyed by (pass, unit): every op tagged with both.
    const FREE: usize = usize::MAX;
    let mut group_of = vec![FREE; n];
    let mut keys: BTreeMap<(&str, &str), usize> = BTreeMap::new();
    let mut members: Vec<Vec<OpId>> = Vec::new();
    let mut pass_of: Vec<bool> = Vec::new(); // true: backward
    for &o in program {
        let (Some(unit), Some(pass)) = (attr(g, o, "fsdp_unit"), attr(g, o, "fsdp_pass")) else {
            continue;
        };
        let next = members.len();
        let k = *keys.entry((pass, unit)).or_insert(next);
        if k == next {
            members.push(Vec::new());
            pass_of.push(pass == "backward");
        }
        group_of[o.index()] = k;
        members[k].push(o);
    }
    // The reductions: every op tagged with a unit and no pass runs as soon
    // as it is ready.
    let asap = |o: OpId| group_of[o.index()] == FREE && attr(g, o, "fsdp_unit").is_some();
    // The rest in program order; each group's first use in it.
    let rest: Vec<OpId> = program
        .iter()
        .copied()
        .filter(|&o| group_of[o.index()] == FREE && !asap(o))
        .collect();
    let mut first_use = vec![usize::MAX; members.len()];
    for (i, &o) in rest.iter().enumerate() {
        for &d in g.deps(o) {
            let k = group_of[d.index()];
            if k != FREE && first_use[k] == usize::MAX {
                first_use[k] = i;
            }
        }
    }
    // A gather nothing reads has no place to be issued: keep program order.
    if first_use.contains(&usize::MAX) {
        return None;
    }
    // Issue each group `prefetch` groups of its pass ahead of its use.
    let mut issue_at: HashMap<usize, Vec<usize>> = HashMap::new();
    for backward in [false, true] {
        let mut ks: Vec<usize> = (0..members.len())
            .filter(|&k| pass_of[k] == backward)
            .collect();
        ks.sort_by_key(|&k| (first_use[k], k));
        let d = if backward {
            prefetch.backward
        } else {
            prefetch.forward
        };
        for (j, &k) in ks.iter().enumerate() {
            let at = first_use[ks[j.saturating_sub(d)]];
            issue_at.entry(at).or_default().push(k);
        }
    }
    let mut base = Vec::with_capacity(n);
    for (i, &o) in rest.iter().enumerate() {
        for &k in issue_at.get(&i).map(Vec::as_slice).unwrap_or(&[]) {
            base.extend_from_slice(&members[k]);
        }
        base.push(o);
    }
    // Merge the post-backward ops in as soon as they are ready. One that
    // reads nothing (an empty buffer) waits for its first reader instead,
    // as eager makes it there.
    let source = |o: OpId| asap(o) && g.deps(o).is_empty();
    let mut missing = vec![0usize; n];
    let mut ready = BinaryHeap::new();
    for &o in program.iter().filter(|&&o| asap(o) && !source(o)) {
        missing[o.index()] = g.deps(o).iter().filter(|&&d| !source(d)).count();
        if missing[o.index()] == 0 {
            ready.push(Reverse(position[o.index()]));
        }
    }
    let mut order = Vec::with_capacity(n);
    let mut done = vec![false; n];
    let mut rest = base.into_iter();
    loop {
        let o = match ready.pop() {
            Some(Reverse(i)) => program[i],
            None => match rest.next() {
                Some(o) => o,
                None => break,
            },
        };
        for &d in g.deps(o) {
            if source(d) && !done[d.index()] {
                done[d.index()] = true;
                order.push(d);
            }
        }
        if g.deps(o).iter().any(|d| !done[d.index()]) {
            return None; // would break a dependency: keep program order
        }
        done[o.index()] = true;
        order.push(o);
        for &w in &users[o.index()] {
            if asap(w) && !source(o) {
                missing[w.index()] -= 1;
                if missing[w.index()] == 0 {
                    ready.push(Reverse(position[w.index()]));
                }
            }
        }
    }
    // Sources nothing reads, last.
    order.extend(
        program
            .iter()
            .copied()
            .filter(|&o| source(o) && !done[o.index()]),
    );
    (order.len() == n).then_some(order)
}
