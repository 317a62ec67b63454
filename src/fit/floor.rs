//! How low any recomputation can take a step: the floors that tell a fit
//! how far it is from the best possible.
//!
//! # Whatever is recomputed ([`fit_floor`])
//! Any plan, with any recomputation, runs every op of the step at least
//! once with its inputs and outputs live, and ends with every persistent
//! tensor live. So the step needs at least the resident bytes plus the
//! largest single op's working set, and at least all persistent bytes.
//!
//! # Within a cost ([`floor_within`])
//! A fit that may add at most `C` (seconds or FLOPs) can run again no op
//! that costs more than `C` alone. Pick an op `L` (the anchor). Its
//! ancestors run before it in every order, its descendants after. A value
//! made by an ancestor (or by `L`) and read by a descendant must, while
//! `L` runs, be live, or be made again later from what is live then, by
//! ops that are cheap enough to run again. So the bytes live at `L` are at
//! least its own inputs and outputs, plus the smallest set of tensors from
//! which every such value can be made again through cheap ops alone
//! (parameters and other resident tensors are there anyway). That set is a
//! minimum vertex cut, in the graph of cheap ops, between the tensors only
//! their first making gives (outputs of expensive ops, ops that update in
//! place, step inputs) and the values read after `L`: a maximum flow
//! ([`memplan_solver::maxflow`]), each tensor a node whose capacity is its
//! size, split in two. The relaxation lets every cheap op run again for
//! free and ignores ops that are neither before nor after `L`, so the
//! bound holds for every recomputation within `C` and every order; it
//! says nothing about the layout, whose arena is at least the live bytes.
//!
//! The floor is the largest anchor's, with the resident bytes, and never
//! below [`fit_floor`]. Anchors are tried in decreasing order of the bytes
//! live at them in program order, which bounds each anchor's value from
//! above (that order's live set is one such set): once the next anchor
//! cannot beat the best, the floor is exact for this relaxation
//! (`finished`). A deadline stops it early with a bound that still holds.
//!
//! On a transformer step the anchor is the loss: every matrix product's
//! output the backward reads is live there, or something as large that
//! makes it again through elementwise ops (a cast's input, a residual
//! stream's parts).

use std::time::Instant;

use memplan_solver::maxflow::{FlowNetwork, INF};

use crate::graph::{Graph, Lifetime, OpId, TensorId};
use crate::timeline::human;

/// The least bytes any plan of `g` needs with any recomputation, and why:
/// see the module docs.
pub fn fit_floor(g: &Graph) -> (u64, String) {
    let resident = g.resident_bytes();
    let persistent: u64 = g
        .tensor_ids()
        .filter(|&t| g.occupies_memory(t) && g.tensor(t).lifetime == Lifetime::Persistent)
        .map(|t| g.tensor(t).size)
        .sum();
    let mut best = (
        persistent,
        format!(
            "the step's persistent tensors take {} at its end",
            human(persistent)
        ),
    );
    for o in g.op_ids() {
        let (_, work) = working_set(g, o);
        let need = resident + work;
        if need > best.0 {
            best = (
                need,
                format!(
                    "op {:?} alone needs {} for its inputs and outputs, with {} resident (parameters, optimizer state)",
                    g.op(o).name,
                    human(work),
                    human(resident)
                ),
            );
        }
    }
    best
}

/// The roots `o` reads, writes or updates that take memory and are not
/// resident, and their bytes less what reuse lets outputs share with
/// inputs: what is live while `o` runs, beyond the resident bytes.
fn working_set(g: &Graph, o: OpId) -> (Vec<TensorId>, u64) {
    working_set_where(g, o, |t| !resident(g, t))
}

/// The roots in memory `o` reads, writes or updates for which `keep`
/// holds, and their bytes less what reuse lets outputs share with inputs.
pub(crate) fn working_set_where(
    g: &Graph,
    o: OpId,
    keep: impl Fn(TensorId) -> bool,
) -> (Vec<TensorId>, u64) {
    let op = g.op(o);
    let mut roots: Vec<TensorId> = op
        .inputs
        .iter()
        .chain(&op.outputs)
        .chain(&op.updates)
        .map(|&t| g.root(t))
        .filter(|&t| g.occupies_memory(t) && keep(t))
        .collect();
    roots.sort();
    roots.dedup();
    let shared: u64 = op
        .reuse
        .iter()
        .map(|&(a, b)| g.tensor(a).size.min(g.tensor(g.root(b)).size))
        .sum();
    let bytes = roots
        .iter()
        .map(|&t| g.tensor(t).size)
        .sum::<u64>()
        .saturating_sub(shared);
    (roots, bytes)
}

/// Each op's successors: the ops whose [`Graph::deps`] name it.
fn successors(g: &Graph) -> Vec<Vec<OpId>> {
    let mut succs = vec![Vec::new(); g.num_ops()];
    for o in g.op_ids() {
        for &d in g.deps(o) {
            succs[d.index()].push(o);
        }
    }
    succs
}

/// What [`floor_within`] found.
#[derive(Clone, Debug, PartialEq)]
pub struct ShareFloor {
    /// No recomputation within the cost and no order needs fewer live
    /// bytes.
    pub bytes: u64,
    /// The anchor op whose cut gave `bytes`; `None` when [`fit_floor`]
    /// did.
    pub at: Option<OpId>,
    /// Why, in words.
    pub why: String,
    /// Whether every anchor that could raise it was tried before the
    /// deadline.
    pub finished: bool,
    /// Anchors whose cut was solved.
    pub anchors: usize,
}

/// Whether a tensor's bytes are there all step whatever is run: a
/// persistent tensor no op makes.
fn resident(g: &Graph, t: TensorId) -> bool {
    let x = g.tensor(t);
    x.lifetime == Lifetime::Persistent && x.producer.is_none()
}

/// Whether `o` may run a second time in a fit that adds at most `allowed`:
/// it writes new transient tensors only (or its updates may be skipped,
/// [`super::RERUN_WITHOUT_UPDATES`]), and costs no more than that.
fn may_rerun(g: &Graph, o: OpId, cost: f64, allowed: f64) -> bool {
    let op = g.op(o);
    (op.updates.is_empty() || super::reruns_without_updates(g, o))
        && !op.outputs.is_empty()
        && op
            .outputs
            .iter()
            .all(|&t| g.tensor(t).lifetime != Lifetime::Persistent)
        && cost <= allowed
}

/// Bytes live in program order while each op runs (its inputs and
/// outputs included), resident tensors left out: an upper bound of each
/// anchor's cut.
fn program_live(g: &Graph) -> Vec<u64> {
    let n = g.num_ops();
    let mut pos = vec![0usize; n];
    for (i, &o) in g.program_order().iter().enumerate() {
        pos[o.index()] = i;
    }
    let mut delta = vec![0i128; n + 1];
    for t in g.tensor_ids() {
        if !g.occupies_memory(t) || resident(g, t) {
            continue;
        }
        let x = g.tensor(t);
        let first = x.producer.map_or(0, |p| pos[p.index()]);
        let last = if x.lifetime == Lifetime::Persistent {
            n - 1
        } else {
            g.users_of_root(t)
                .iter()
                .map(|u| pos[u.index()])
                .max()
                .unwrap_or(first)
                .max(first)
        };
        delta[first] += x.size as i128;
        delta[last + 1] -= x.size as i128;
    }
    let mut live = vec![0u64; n];
    let mut s = 0i128;
    for (i, &o) in g.program_order().iter().enumerate() {
        s += delta[i];
        live[o.index()] = s.max(0) as u64;
    }
    live
}

/// The floor of every fit of `g` whose recomputation adds at most
/// `allowed` (in the unit of `cost`, each op's price by index; an op past
/// its end is never rerun): see the module docs. Stops at `deadline` with
/// the best bound so far.
pub fn floor_within(
    g: &Graph,
    cost: &[f64],
    allowed: f64,
    deadline: Option<Instant>,
) -> ShareFloor {
    let (floor, why) = fit_floor(g);
    let mut best = ShareFloor {
        bytes: floor,
        at: None,
        why,
        finished: true,
        anchors: 0,
    };
    let n = g.num_ops();
    if n == 0 {
        return best;
    }
    let resident_bytes = g.resident_bytes();
    let rerun: Vec<bool> = g
        .op_ids()
        .map(|o| {
            // (An op without a price is never rerun: the bound stays valid.)
            let price = cost.get(o.index()).copied().unwrap_or(f64::INFINITY);
            may_rerun(g, o, price, allowed)
        })
        .collect();
    let succs = successors(g);
    let upper = program_live(g);
    let mut anchors: Vec<OpId> = g.op_ids().collect();
    anchors.sort_by_key(|o| std::cmp::Reverse(upper[o.index()]));
    let mut cut = AnchorCut::new(g, &rerun, &succs);
    for l in anchors {
        if resident_bytes.saturating_add(upper[l.index()]) <= best.bytes {
            break;
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            best.finished = false;
            break;
        }
        let (work, rest) = cut.at(l);
        best.anchors += 1;
        let bytes = resident_bytes.saturating_add(work).saturating_add(rest);
        if bytes > best.bytes {
            best.bytes = bytes;
            best.at = Some(l);
            best.why = format!(
                "while op {:?} runs, {} of its own inputs and outputs and {} from which what later ops read can be made again by ops cheap enough to rerun are live, with {} resident",
                g.op(l).name,
                human(work),
                human(rest),
                human(resident_bytes)
            );
        }
    }
    best
}

/// One anchor's network, with scratch kept between anchors.
struct AnchorCut<'g> {
    g: &'g Graph,
    rerun: &'g [bool],
    succs: &'g [Vec<OpId>],
    /// `mark[o] == 2 * stamp`: before the anchor (or it); `2 * stamp + 1`:
    /// after it.
    mark: Vec<u32>,
    stamp: u32,
    /// Network node (the "in" half; "out" is the next) of each root, valid
    /// when `seen[t] == stamp`.
    node: Vec<u32>,
    seen: Vec<u32>,
    /// Roots among the anchor's own inputs and outputs.
    own: Vec<u32>,
    stack: Vec<OpId>,
    work: Vec<TensorId>,
    net: FlowNetwork,
}

impl<'g> AnchorCut<'g> {
    fn new(g: &'g Graph, rerun: &'g [bool], succs: &'g [Vec<OpId>]) -> Self {
        AnchorCut {
            g,
            rerun,
            succs,
            mark: vec![0; g.num_ops()],
            stamp: 0,
            node: vec![0; g.num_tensors()],
            seen: vec![0; g.num_tensors()],
            own: vec![0; g.num_tensors()],
            stack: Vec::new(),
            work: Vec::new(),
            net: FlowNetwork::new(),
        }
    }

    /// Marks `from`'s closure along `next` with `m`.
    fn mark_from(&mut self, from: OpId, m: u32, before: bool) {
        self.stack.clear();
        self.stack.push(from);
        while let Some(x) = self.stack.pop() {
            let next: &[OpId] = if before {
                self.g.deps(x)
            } else {
                &self.succs[x.index()]
            };
            for &q in next {
                if self.mark[q.index()] != m {
                    self.mark[q.index()] = m;
                    self.stack.push(q);
                }
            }
        }
    }

    /// The network node of root `t`, made on first use (with the arcs
    /// that say how `t` is made again, queued).
    fn node_of(&mut self, t: TensorId) -> u32 {
        if self.seen[t.index()] == self.stamp {
            return self.node[t.index()];
        }
        self.seen[t.index()] = self.stamp;
        let v = self.net.add_node();
        let out = self.net.add_node();
        let size = if self.g.occupies_memory(t) {
            self.g.tensor(t).size
        } else {
            0
        };
        let cap = if self.own[t.index()] == self.stamp {
            0
        } else {
            size
        };
        self.net.add_arc(v, out, cap);
        self.node[t.index()] = v;
        self.work.push(t);
        v
    }

    /// The anchor `l`'s working set (its inputs and outputs, less what
    /// reuse shares) and the cut beyond it; see the module docs.
    fn at(&mut self, l: OpId) -> (u64, u64) {
        let g = self.g;
        if self.stamp >= u32::MAX / 2 - 1 {
            self.mark.fill(0);
            self.seen.fill(0);
            self.own.fill(0);
            self.stamp = 0;
        }
        self.stamp += 1;
        let (before, after) = (2 * self.stamp, 2 * self.stamp + 1);
        self.mark[l.index()] = before;
        self.mark_from(l, before, true);
        self.mark_from(l, after, false);
        self.net.clear();
        self.work.clear();

        let (roots, work) = working_set(g, l);
        for &t in &roots {
            self.own[t.index()] = self.stamp;
        }

        // What ops after the anchor read, made before it (or never made).
        for u in g.op_ids() {
            if self.mark[u.index()] != after {
                continue;
            }
            let x = g.op(u);
            for &t in x.inputs.iter().chain(&x.updates) {
                let r = g.root(t);
                if resident(g, r) {
                    continue;
                }
                let made_before = match g.tensor(r).producer {
                    Some(p) => self.mark[p.index()] == before,
                    None => true,
                };
                if made_before {
                    let v = self.node_of(r);
                    self.net.add_sink_arc(v + 1, INF);
                }
            }
        }
        // How each queued root is made again: from its producer's inputs
        // if that op may run again, else only from the source.
        while let Some(t) = self.work.pop() {
            let v = self.node[t.index()];
            match g.tensor(t).producer {
                Some(p) if self.rerun[p.index()] => {
                    for &x in &g.op(p).inputs {
                        let r = g.root(x);
                        if resident(g, r) {
                            continue;
                        }
                        let a = self.node_of(r);
                        self.net.add_arc(a + 1, v, INF);
                    }
                }
                _ => self.net.add_source_arc(v, INF),
            }
        }
        (work, self.net.solve())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::{GraphBuilder, OpKind, OpSpec, Role, TensorSpec};

    const K: u64 = 1024;

    /// `x -f0-> a -f1-> b -loss-> g`, then `b0(g, b) -> gb` and
    /// `b1(gb, a) -> ga`; `f0` costs 10, the rest 1.
    fn chain() -> (Graph, Vec<f64>) {
        let mut b = GraphBuilder::new("chain");
        let x = b.add_tensor(TensorSpec::new("x", K).role(Role::Input).persistent());
        let a = b.add_tensor(TensorSpec::new("a", 4 * K));
        let bb = b.add_tensor(TensorSpec::new("b", 8 * K));
        let g = b.add_tensor(TensorSpec::new("g", K));
        let gb = b.add_tensor(TensorSpec::new("gb", K));
        let ga = b.add_tensor(TensorSpec::new("ga", 2 * K).role(Role::Output).persistent());
        let fwd = |n: &str| OpSpec::new(n, OpKind::Forward, n);
        let bwd = |n: &str| OpSpec::new(n, OpKind::Backward, n);
        b.add_op(fwd("f0").inputs([x]).outputs([a]));
        b.add_op(fwd("f1").inputs([a]).outputs([bb]));
        b.add_op(fwd("loss").inputs([bb]).outputs([g]));
        b.add_op(bwd("b0").inputs([g, bb]).outputs([gb]));
        b.add_op(bwd("b1").inputs([gb, a]).outputs([ga]));
        (b.build().unwrap(), vec![10.0, 1.0, 1.0, 1.0, 1.0])
    }

    #[test]
    fn an_output_too_costly_to_make_again_stays_live_across_the_anchor() {
        let (g, cost) = chain();
        // f0 may not run again: while b0 runs (g, b and gb: 10 KiB), `a`
        // (4 KiB), which b1 reads later, is live too; x (1 KiB) is
        // resident.
        let f = floor_within(&g, &cost, 5.0, None);
        assert_eq!(f.bytes, 15 * K, "{f:?}");
        assert_eq!(f.at, g.op_by_name("b0"));
        assert!(f.finished);
        // Everything may run again: `a` is made again from `x`, and the
        // floor is the largest working set with the resident bytes (f1's
        // a and b, 12 KiB, with x).
        let f = floor_within(&g, &cost, 10.0, None);
        assert_eq!(f.bytes, 13 * K, "{f:?}");
        assert_eq!(f.bytes, fit_floor(&g).0);
    }

    #[test]
    fn a_cheap_chain_is_cut_where_it_is_smallest() {
        // x -f0-> a (4 KiB) -f1-> b (8 KiB) -f2-> c -loss-> g; b0 reads
        // b, b1 reads c.
        let mut b = GraphBuilder::new("cheap-chain");
        let x = b.add_tensor(TensorSpec::new("x", K).role(Role::Input).persistent());
        let a = b.add_tensor(TensorSpec::new("a", 4 * K));
        let bb = b.add_tensor(TensorSpec::new("b", 8 * K));
        let c = b.add_tensor(TensorSpec::new("c", K));
        let g = b.add_tensor(TensorSpec::new("g", K));
        let gb = b.add_tensor(TensorSpec::new("gb", K));
        let gc = b.add_tensor(TensorSpec::new("gc", K).role(Role::Output).persistent());
        let fwd = |n: &str| OpSpec::new(n, OpKind::Forward, n);
        b.add_op(fwd("f0").inputs([x]).outputs([a]));
        b.add_op(fwd("f1").inputs([a]).outputs([bb]));
        b.add_op(fwd("f2").inputs([bb]).outputs([c]));
        let loss = b.add_op(fwd("loss").inputs([c]).outputs([g]));
        b.add_op(
            OpSpec::new("b0", OpKind::Backward, "b0")
                .inputs([g, bb])
                .outputs([gb]),
        );
        b.add_op(
            OpSpec::new("b1", OpKind::Backward, "b1")
                .inputs([gb, c])
                .outputs([gc]),
        );
        let g = b.build().unwrap();
        let s = successors(&g);
        let cut_at =
            |g: &Graph, rerun: &[bool], s: &[Vec<OpId>], l: OpId| AnchorCut::new(g, rerun, s).at(l);
        // f0 too costly, f1 cheap: `b` is made again from `a`, half its
        // size. While `loss` runs, c and g (2 KiB) are its own.
        assert_eq!(
            cut_at(&g, &[false, true, true, true, true, true], &s, loss),
            (2 * K, 4 * K)
        );
        // f1 too costly as well: `b` itself.
        assert_eq!(
            cut_at(&g, &[false, false, true, true, true, true], &s, loss),
            (2 * K, 8 * K)
        );
        // Everything cheap: made again from x, nothing kept.
        assert_eq!(cut_at(&g, &[true; 6], &s, loss), (2 * K, 0));
    }

    #[test]
    fn a_deadline_in_the_past_leaves_the_plain_floor() {
        let (g, cost) = chain();
        let f = floor_within(&g, &cost, 5.0, Some(Instant::now()));
        assert_eq!(f.bytes, fit_floor(&g).0);
        assert!(!f.finished);
        assert_eq!(f.anchors, 0);
    }
}
