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
//! - a unit's reduction ops run together as soon as every gradient they
//!   read is complete (an empty buffer just before its first reader), as
//!   FSDP2's post-backward reduces a unit's gradients once the unit's
//!   backward is done;
//! - every other op keeps its program order (the optimizer steps after the
//!   backward, as `optimizer.step()` does).
//!
//! The result is checked against the graph's dependencies; a graph whose
//! rebuilt order would break one keeps its program order ([`eager_order`]
//! returns `None`).
//!
//! Capture records one collective per parameter, each writing the
//! parameter's own buffer; FSDP2 runs one per unit through flat buffers,
//! which the graph has no tensor for. [`flat_buffers`] gives the bytes
//! they add over the rebuilt order (measured against FSDP2 on gloo with
//! the profiler's allocation events):
//!
//! - a unit's all-gather writes one flat buffer of the unit's gathered
//!   bytes, copied out into the parameters at the unit's first use and
//!   freed after: twice the unit's bytes at that moment, where the graph
//!   has them once;
//! - a unit's gathered parameters stay until its post-backward reshards
//!   them, just before its reduction, where the graph frees each after
//!   its last reader (FSDP2's root, not resharded after the forward, holds
//!   its embedding through the whole backward);
//! - its reduce-scatter copies the unit's gradients (cast and padded) into
//!   one flat input, which FSDP2 holds until the next unit's reduction (or
//!   the end of the backward) waits for it: beside the gradients at the
//!   copy-in, and in place of the padded gradient each of the graph's
//!   reduce-scatters frees;
//! - on gloo (the CPU), `_allgather_base` gathers into a temporary as
//!   large as its output, and `_reduce_scatter_base` reduces a clone of
//!   its input: each is held while the collective runs.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap};

use memplan_solver as solver;

use crate::graph::{Graph, OpId, TensorId};
use crate::lower::{self, Lowered};

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

/// How FSDP2 eager runs a captured step on a device: its prefetch, and
/// whether its collectives are gloo's (their temporaries count).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Device {
    pub prefetch: Prefetch,
    pub gloo: bool,
}

impl Device {
    /// NCCL on CUDA, [`Prefetch::CUDA`].
    pub const CUDA: Device = Device {
        prefetch: Prefetch::CUDA,
        gloo: false,
    };
    /// gloo on the CPU, [`Prefetch::CPU`].
    pub const CPU: Device = Device {
        prefetch: Prefetch::CPU,
        gloo: true,
    };
}

/// Bytes FSDP2 eager holds beyond the graph's tensors over a span of an
/// order: half-steps `from` to `to`, inclusive, where half-step `2i` is
/// op `i` of the order before its outputs are made and `2i + 1` after.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Held {
    pub from: usize,
    pub to: usize,
    pub bytes: u64,
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
/// its dependencies: the ops outside the units in program order, each
/// unit's gathers issued `prefetch` units ahead of their first use
/// ([`Units::issue_gathers`]), and each unit's reductions merged in as
/// soon as all of them are ready ([`Units::merge_reductions`]).
pub fn eager_order(g: &Graph, prefetch: Prefetch) -> Option<Vec<OpId>> {
    if !applies(g) {
        return None;
    }
    let units = Units::new(g);
    let base = units.issue_gathers(prefetch)?;
    units.merge_reductions(base)
}

/// Not in any group.
const FREE: usize = usize::MAX;

/// The units of an FSDP2 step: its gather groups and its reductions.
struct Units<'g> {
    g: &'g Graph,
    program: &'g [OpId],
    /// Per op: its gather group (every op tagged with one (pass, unit)), or FREE.
    group_of: Vec<usize>,
    /// Each gather group's ops, in program order.
    members: Vec<Vec<OpId>>,
    /// Per gather group: whether it is the backward pass's.
    backward: Vec<bool>,
    /// Per op: its unit's reduction (ops tagged with a unit and no pass), or FREE.
    reduction_of: Vec<usize>,
    /// Each unit's reduction ops, in program order.
    reductions: Vec<Vec<OpId>>,
}

impl<'g> Units<'g> {
    fn new(g: &'g Graph) -> Self {
        let n = g.num_ops();
        let program = g.program_order();
        let mut u = Units {
            g,
            program,
            group_of: vec![FREE; n],
            members: Vec::new(),
            backward: Vec::new(),
            reduction_of: vec![FREE; n],
            reductions: Vec::new(),
        };
        let mut keys: BTreeMap<(&str, &str), usize> = BTreeMap::new();
        for &o in program {
            let (Some(unit), Some(pass)) = (attr(g, o, "fsdp_unit"), attr(g, o, "fsdp_pass"))
            else {
                continue;
            };
            let next = u.members.len();
            let k = *keys.entry((pass, unit)).or_insert(next);
            if k == next {
                u.members.push(Vec::new());
                u.backward.push(pass == "backward");
            }
            u.group_of[o.index()] = k;
            u.members[k].push(o);
        }
        let mut unit_reduction: HashMap<&str, usize> = HashMap::new();
        for &o in program {
            if !u.reduces(o) {
                continue;
            }
            let unit = attr(g, o, "fsdp_unit").unwrap_or_default();
            let next = u.reductions.len();
            let k = *unit_reduction.entry(unit).or_insert(next);
            if k == next {
                u.reductions.push(Vec::new());
            }
            u.reduction_of[o.index()] = k;
            u.reductions[k].push(o);
        }
        u
    }

    /// Whether `o` is one of a unit's reductions: tagged with a unit and
    /// no pass.
    fn reduces(&self, o: OpId) -> bool {
        self.group_of[o.index()] == FREE && attr(self.g, o, "fsdp_unit").is_some()
    }

    /// A reduction op that reads nothing (an empty buffer): it waits for
    /// its first reader, as eager makes it there.
    fn source(&self, o: OpId) -> bool {
        self.reduces(o) && self.g.deps(o).is_empty()
    }

    /// The ops outside the units in program order, with each gather group
    /// issued `prefetch` groups of its pass ahead of its first use; `None`
    /// when a gather has no reader (no place to issue it).
    fn issue_gathers(&self, prefetch: Prefetch) -> Option<Vec<OpId>> {
        let g = self.g;
        let rest: Vec<OpId> = self
            .program
            .iter()
            .copied()
            .filter(|&o| self.group_of[o.index()] == FREE && !self.reduces(o))
            .collect();
        let mut first_use = vec![usize::MAX; self.members.len()];
        for (i, &o) in rest.iter().enumerate() {
            for &d in g.deps(o) {
                let k = self.group_of[d.index()];
                if k != FREE && first_use[k] == usize::MAX {
                    first_use[k] = i;
                }
            }
        }
        if first_use.contains(&usize::MAX) {
            return None;
        }
        let mut issue_at: HashMap<usize, Vec<usize>> = HashMap::new();
        for backward in [false, true] {
            let mut ks: Vec<usize> = (0..self.members.len())
                .filter(|&k| self.backward[k] == backward)
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
        let mut base = Vec::with_capacity(g.num_ops());
        for (i, &o) in rest.iter().enumerate() {
            for &k in issue_at.get(&i).map(Vec::as_slice).unwrap_or(&[]) {
                base.extend_from_slice(&self.members[k]);
            }
            base.push(o);
        }
        Some(base)
    }

    /// `base` with each unit's reduction merged in as soon as all of it is
    /// ready (a source when its first reader runs, the unread ones last);
    /// `None` where that would break a dependency.
    fn merge_reductions(&self, base: Vec<OpId>) -> Option<Vec<OpId>> {
        let (g, n) = (self.g, self.g.num_ops());
        let mut position = vec![0usize; n];
        for (i, &o) in self.program.iter().enumerate() {
            position[o.index()] = i;
        }
        let mut users: Vec<Vec<OpId>> = vec![Vec::new(); n];
        for o in g.op_ids() {
            for &d in g.deps(o) {
                users[d.index()].push(o);
            }
        }
        let reduction_of = &self.reduction_of;
        let mut missing = vec![0usize; self.reductions.len()];
        for (k, ops) in self.reductions.iter().enumerate() {
            for &o in ops.iter().filter(|&&o| !self.source(o)) {
                missing[k] += g
                    .deps(o)
                    .iter()
                    .filter(|&&d| !self.source(d) && reduction_of[d.index()] != k)
                    .count();
            }
        }
        let first = |k: usize| Reverse((position[self.reductions[k][0].index()], k));
        let mut ready: BinaryHeap<Reverse<(usize, usize)>> = (0..self.reductions.len())
            .filter(|&k| missing[k] == 0)
            .map(first)
            .collect();
        let mut order = Vec::with_capacity(n);
        let mut done = vec![false; n];
        let mut rest = base.into_iter();
        loop {
            let ops: Vec<OpId> = match ready.pop() {
                Some(Reverse((_, k))) => self.reductions[k]
                    .iter()
                    .copied()
                    .filter(|&o| !self.source(o))
                    .collect(),
                None => match rest.next() {
                    Some(o) => vec![o],
                    None => break,
                },
            };
            for o in ops {
                for &d in g.deps(o) {
                    if self.source(d) && !done[d.index()] {
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
                    let k = reduction_of[w.index()];
                    if k != FREE
                        && k != reduction_of[o.index()]
                        && !self.source(o)
                        && !self.source(w)
                    {
                        missing[k] -= 1;
                        if missing[k] == 0 {
                            ready.push(first(k));
                        }
                    }
                }
            }
        }
        // Sources nothing reads, last.
        order.extend(
            self.program
                .iter()
                .copied()
                .filter(|&o| self.source(o) && !done[o.index()]),
        );
        (order.len() == n).then_some(order)
    }
}

/// The largest buffer `o` touches (a gather's gathered parameter, a
/// reduction's padded gradient), a view's base in its place.
fn largest_buffer(g: &Graph, o: OpId) -> Option<TensorId> {
    let op = g.op(o);
    op.inputs
        .iter()
        .chain(&op.outputs)
        .chain(&op.updates)
        .map(|&t| g.root(t))
        .max_by_key(|&t| (g.tensor(t).size, Reverse(t.index())))
}

/// The flat buffers FSDP2 eager holds beyond the graph's tensors when it
/// runs `order` (a valid order of `g`, e.g. [`eager_order`]'s) on
/// `device`, as spans of that order (see the module doc). Empty for a
/// graph whose collectives name no unit.
pub fn flat_buffers(g: &Graph, order: &[OpId], device: Device) -> Vec<Held> {
    if !applies(g) {
        return Vec::new();
    }
    let mut pos = vec![0usize; g.num_ops()];
    for (i, &o) in order.iter().enumerate() {
        pos[o.index()] = i;
    }
    let low = lower::lower(g, false);
    let ev = solver::evaluate(&low.problem, &Lowered::from_op_ids(order));
    let live = |t: TensorId| {
        low.buf_of_tensor[t.index()]
            .map(|b| (ev.birth[b.index()] as usize, ev.death[b.index()] as usize))
    };
    let live: &dyn Fn(TensorId) -> Option<(usize, usize)> = &live;
    // Gather groups by (pass, unit), reductions by unit: (first step, last
    // collective's step, the collectives' bytes); each group's gathered
    // parameters.
    let mut gathers: BTreeMap<(&str, &str), (usize, usize, u64)> = BTreeMap::new();
    let mut reductions: BTreeMap<(&str, &str), (usize, usize, u64)> = BTreeMap::new();
    let mut gathered: BTreeMap<(&str, &str), Vec<TensorId>> = BTreeMap::new();
    for &o in order {
        let Some(unit) = attr(g, o, "fsdp_unit") else {
            continue;
        };
        let pass = attr(g, o, "fsdp_pass");
        let e = match pass {
            Some(pass) => gathers.entry((pass, unit)),
            None => reductions.entry(("", unit)),
        }
        .or_insert((pos[o.index()], 0, 0));
        if matches!(
            g.op(o).op_type.as_str(),
            "memplan.all_gather" | "memplan.reduce_scatter"
        ) && let Some(t) = largest_buffer(g, o)
        {
            e.1 = pos[o.index()];
            e.2 += g.tensor(t).size;
            gathered
                .entry(pass.map_or(("", unit), |pass| (pass, unit)))
                .or_default()
                .push(t);
        }
    }
    let mut held = gather_spans(g, order, &pos, &gathers, device);
    held.extend(reshard_spans(g, &gathers, &reductions, &gathered, live));
    held.extend(reduction_spans(g, &reductions, &gathered, live, device));
    held.retain(|h| h.bytes > 0);
    held
}

/// Per (pass, unit) or ("", unit): (first step, last collective's step,
/// the collectives' bytes).
type Spans<'a> = BTreeMap<(&'a str, &'a str), (usize, usize, u64)>;
/// Per (pass, unit) or ("", unit): the buffers its collectives fill.
type Gathered<'a> = BTreeMap<(&'a str, &'a str), Vec<TensorId>>;

/// Each gather group's flat buffer at its first use, beside the copied-out
/// parameters; on gloo, its send buffer after its last collective too.
fn gather_spans(
    g: &Graph,
    order: &[OpId],
    pos: &[usize],
    gathers: &Spans,
    device: Device,
) -> Vec<Held> {
    let mut held = Vec::new();
    // Each gather group's first use: the first op outside it reading it.
    let mut first_use: HashMap<(&str, &str), usize> = HashMap::new();
    for &o in order {
        let mine = (attr(g, o, "fsdp_pass"), attr(g, o, "fsdp_unit"));
        for &d in g.deps(o) {
            if let (Some(pass), Some(unit)) = (attr(g, d, "fsdp_pass"), attr(g, d, "fsdp_unit"))
                && mine != (Some(pass), Some(unit))
            {
                first_use.entry((pass, unit)).or_insert(pos[o.index()]);
            }
        }
    }
    for (key, &(_, last, bytes)) in gathers {
        // The flat buffer beside the copied-out parameters.
        if let Some(&f) = first_use.get(key) {
            held.push(Held {
                from: 2 * f,
                to: 2 * f,
                bytes,
            });
        }
        if device.gloo {
            held.push(Held {
                from: 2 * last + 1,
                to: 2 * last + 1,
                bytes,
            });
        }
    }
    held
}

/// The gathered parameters held past their last use until the unit's
/// post-backward reshards them.
fn reshard_spans(
    g: &Graph,
    gathers: &Spans,
    reductions: &Spans,
    gathered: &Gathered,
    live: &dyn Fn(TensorId) -> Option<(usize, usize)>,
) -> Vec<Held> {
    let mut held = Vec::new();
    // A unit's parameters stay gathered until its post-backward reshards
    // them, just before its reduction: those of its backward gather, or of
    // its forward one when it has none (not resharded after the forward).
    for (&(pass, unit), ts) in gathered {
        if pass.is_empty() || pass == "forward" && gathers.contains_key(&("backward", unit)) {
            continue;
        }
        let Some(&(start, _, _)) = reductions.get(&("", unit)) else {
            continue;
        };
        for &t in ts {
            if let Some((_, last)) = live(t)
                && last + 1 < start
            {
                held.push(Held {
                    from: 2 * (last + 1),
                    to: 2 * start - 1,
                    bytes: g.tensor(t).size,
                });
            }
        }
    }
    held
}

/// Each reduction's flat input.
fn reduction_spans(
    g: &Graph,
    reductions: &Spans,
    gathered: &Gathered,
    live: &dyn Fn(TensorId) -> Option<(usize, usize)>,
    device: Device,
) -> Vec<Held> {
    let mut held = Vec::new();
    // Each reduction's flat input, from its copy-in to the next
    // reduction's start (or its own end, for the last), in place of the
    // padded gradients the graph reduces: where the graph holds one (the
    // gradient itself, or a padded or cast copy made for the reduction),
    // that share of the flat input is not on top; at the copy-in the
    // gradients themselves are there beside it.
    let mut runs: Vec<(usize, usize, u64, &str)> = reductions
        .iter()
        .map(|(&(_, unit), &(start, last, bytes))| (start, last, bytes, unit))
        .collect();
    runs.sort_unstable();
    for (j, &(start, last, bytes, unit)) in runs.iter().enumerate() {
        // The half-step the flat input is freed after.
        let end = runs.get(j + 1).map_or(2 * last + 1, |next| 2 * next.0 - 1);
        for &t in gathered.get(&("", unit)).map(Vec::as_slice).unwrap_or(&[]) {
            let size = g.tensor(t).size;
            let Some((born, died)) = live(t) else {
                continue;
            };
            let mut span = |from: usize, to: usize| {
                if from <= to {
                    held.push(Held {
                        from,
                        to,
                        bytes: size,
                    });
                }
            };
            if born < start {
                span(2 * start, 2 * start); // the gradient, copied in
            } else if born > start {
                span(2 * start, 2 * born - 1); // its copy not made yet
            }
            span(2 * (died + 1), end);
        }
        if device.gloo {
            held.push(Held {
                from: 2 * last + 1,
                to: 2 * last + 1,
                bytes,
            });
        }
    }
    held
}
