//! The cut at one op: the least bytes live at its step over every set of
//! ops that can run before it, less what reuse can save there, as a
//! minimum s-t cut ([`CutSolver`]).
//!
//! The building block of the min-cut floor ([`crate::bounds::min_cut_floor`],
//! whose module docs give the network and why it is a lower bound) and of
//! the group floor ([`crate::group_bound`]), which constrains the cut with
//! ops that must run before or after. Both build on this module; it
//! depends on neither.

use crate::maxflow::{FlowNetwork, INF};
use crate::problem::{OpIdx, Problem};

/// Computes the cut at single ops, reusing its scratch space between calls.
pub struct CutSolver<'p> {
    p: &'p Problem,
    /// Generation stamps: `mark[o] == 2 * stamp` for ancestors of the current
    /// op, `2 * stamp + 1` for descendants.
    mark: Vec<u32>,
    stamp: u32,
    /// Network node of each free (incomparable) op.
    node: Vec<u32>,
    stack: Vec<OpIdx>,
    free_users: Vec<u32>,
    net: FlowNetwork,
}

/// Where an op stands relative to the op whose cut is being computed.
#[derive(Copy, Clone, PartialEq, Eq)]
enum Side {
    /// Surely before it (an ancestor), or it.
    Before,
    /// Surely after it (a descendant).
    After,
    /// Either; the network node that decides.
    Free(u32),
}

/// The cut at one op: its bound and how big its network was.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cut {
    /// Bytes live at this op's step in every order.
    pub bytes: u64,
    /// Ops incomparable with it (the network's op nodes).
    pub free_ops: usize,
}

impl<'p> CutSolver<'p> {
    pub fn new(p: &'p Problem) -> Self {
        let n = p.num_ops();
        CutSolver {
            p,
            mark: vec![0; n],
            stamp: 0,
            node: vec![0; n],
            stack: Vec::new(),
            free_users: Vec::new(),
            net: FlowNetwork::new(),
        }
    }

    fn next_gen(&mut self) -> (u32, u32) {
        if self.stamp >= u32::MAX / 2 - 1 {
            self.mark.fill(0);
            self.stamp = 0;
        }
        self.stamp += 1;
        (2 * self.stamp, 2 * self.stamp + 1)
    }

    /// The least live bytes at `v`'s step over every set of ops that can
    /// run before it, less what reuse can save there; see the module docs.
    pub fn cut_at(&mut self, v: OpIdx) -> Cut {
        self.cut_with(v, &[], &[])
            .expect("an op alone always has an order")
    }

    /// [`cut_at`](Self::cut_at) over the orders that also run every op of
    /// `before` ahead of `v` and every op of `after` behind it: the sets `S`
    /// must hold `before` (with its ancestors) and nothing of `after` (nor
    /// its descendants). `None` when no valid order does that (an op of
    /// `after` is an ancestor of `v` or of an op of `before`, an op of
    /// `before` is a descendant of `v`, or `v` is in either list). Used by
    /// [`crate::group_bound`].
    pub fn cut_with(&mut self, v: OpIdx, before: &[OpIdx], after: &[OpIdx]) -> Option<Cut> {
        if before.contains(&v) || after.contains(&v) {
            return None;
        }
        let sides = self.mark_sides(v, before, after)?;
        self.net.clear();
        let free_ops = self.closure_arcs(&sides);
        let fixed = self.buffer_arcs(&sides);
        let flow = self.net.solve();
        let (mark, desc) = (&self.mark, sides.desc);
        let save = reuse_savings(self.p, v, |u| mark[u.index()] == desc);
        Some(Cut {
            bytes: fixed.saturating_add(flow).saturating_sub(save),
            free_ops,
        })
    }

    /// Marks the ancestors (of `v` and of `before`) and the descendants (of
    /// `v` and of `after`) by depth-first search; `None` when an op is on
    /// both sides, so no order exists.
    fn mark_sides(&mut self, v: OpIdx, before: &[OpIdx], after: &[OpIdx]) -> Option<Sides> {
        let p = self.p;
        let (anc, desc) = self.next_gen();
        self.stack.clear();
        self.stack.push(v);
        for &b in before {
            self.mark[b.index()] = anc;
            self.stack.push(b);
        }
        while let Some(x) = self.stack.pop() {
            for q in p.preds(x) {
                if self.mark[q.index()] != anc {
                    self.mark[q.index()] = anc;
                    self.stack.push(q);
                }
            }
        }
        if self.mark[v.index()] == anc {
            // v precedes an op of `before`.
            return None;
        }
        for &a in after {
            if self.mark[a.index()] == anc {
                return None;
            }
            self.mark[a.index()] = desc;
        }
        self.stack.push(v);
        self.stack.extend_from_slice(after);
        while let Some(x) = self.stack.pop() {
            for s in p.succs(x) {
                let m = self.mark[s.index()];
                if m == anc || s == v {
                    return None;
                }
                if m != desc {
                    self.mark[s.index()] = desc;
                    self.stack.push(s);
                }
            }
        }
        Some(Sides { v, anc, desc })
    }

    /// Where `o` runs relative to `v`'s step (after [`Self::mark_sides`] and
    /// [`Self::closure_arcs`]).
    fn side(&self, sides: &Sides, o: OpIdx) -> Side {
        if o == sides.v || self.mark[o.index()] == sides.anc {
            Side::Before
        } else if self.mark[o.index()] == sides.desc {
            Side::After
        } else {
            Side::Free(self.node[o.index()])
        }
    }

    /// A node for every free op, and the closure arcs (a free op in `S`
    /// needs its free predecessors in `S`). Returns the number of free ops.
    fn closure_arcs(&mut self, sides: &Sides) -> usize {
        let p = self.p;
        let mut free_ops = 0;
        for o in p.ops() {
            let m = self.mark[o.index()];
            if o != sides.v && m != sides.anc && m != sides.desc {
                self.node[o.index()] = self.net.add_node();
                free_ops += 1;
            }
        }
        for o in p.ops() {
            if let Side::Free(x) = self.side(sides, o) {
                for q in p.preds(o) {
                    if let Side::Free(y) = self.side(sides, q) {
                        self.net.add_arc(x, y, INF);
                    }
                }
            }
        }
        free_ops
    }

    /// Each buffer's bytes at `v`'s step: counted outright when its side
    /// is settled, else an arc that the cut pays when `S` leaves it live.
    /// Returns the bytes counted outright.
    fn buffer_arcs(&mut self, sides: &Sides) -> u64 {
        let p = self.p;
        let mut fixed = 0u64;
        for b in p.buf_ids() {
            let x = p.buf(b);
            let s = x.size;
            if s == 0 {
                continue;
            }
            // Born by v's step?
            let born = match x.producer {
                None => Side::Before,
                Some(o) => self.side(sides, o),
            };
            if born == Side::After {
                continue;
            }
            if p.num_users(b) == 0 && !x.persistent {
                // Live at its producer's step only (step 0 without one:
                // the first-step term).
                if x.producer == Some(sides.v) {
                    fixed += s;
                }
                continue;
            }
            // Used at or after v's step? Surely, if persistent or if v or a
            // descendant uses it; not at all, if only ancestors do; else if
            // a free user lands outside S.
            self.free_users.clear();
            let mut surely = x.persistent;
            if !surely {
                for u in p.users(b) {
                    match self.side(sides, u) {
                        Side::After => surely = true,
                        Side::Before if u == sides.v => surely = true,
                        Side::Before => {}
                        Side::Free(y) => self.free_users.push(y),
                    }
                }
            }
            match (born, surely) {
                (Side::Before, true) => fixed += s,
                (Side::Free(a), true) => self.net.add_sink_arc(a, s),
                (_, false) => self.live_if_used_later(born, s),
                (Side::After, true) => {}
            }
        }
        fixed
    }

    /// Arcs for a buffer of `size` bytes born on side `born` whose only
    /// users after it are the free ops in `self.free_users`: the cut pays
    /// `size` when it is born in `S` and one of them is outside.
    fn live_if_used_later(&mut self, born: Side, size: u64) {
        match (born, self.free_users.as_slice()) {
            (_, []) | (Side::After, _) => {}
            (Side::Before, &[u]) => self.net.add_source_arc(u, size),
            (Side::Free(a), &[u]) => self.net.add_arc(a, u, size),
            (Side::Before, us) => {
                let aux = self.net.add_node();
                self.net.add_source_arc(aux, size);
                for &u in us {
                    self.net.add_arc(aux, u, INF);
                }
            }
            (Side::Free(a), us) => {
                let aux = self.net.add_node();
                self.net.add_arc(a, aux, size);
                for &u in us {
                    self.net.add_arc(aux, u, INF);
                }
            }
        }
    }
}

/// The marks of one cut: `v`, and the stamps of its ancestors and
/// descendants in [`CutSolver`]'s marks.
struct Sides {
    v: OpIdx,
    anc: u32,
    desc: u32,
}

/// The most bytes reuse hints can save at `v`'s step in any order; see the
/// docs of [`crate::bounds`]. `surely_later(u)` must be true only for ops
/// that run after `v` in every order (descendants of `v`); saying false is
/// always safe.
pub(crate) fn reuse_savings(p: &Problem, v: OpIdx, surely_later: impl Fn(OpIdx) -> bool) -> u64 {
    let mut by_out: Vec<(u32, u64)> = Vec::new();
    let mut by_inp: Vec<(u32, u64)> = Vec::new();
    for r in p.reuses_of(v) {
        let takeable = r.out != r.inp
            && !p.buf(r.inp).persistent
            && p.size(r.out) <= p.size(r.inp)
            && !p.users(r.inp).any(|u| u != v && surely_later(u));
        if takeable {
            let w = p.size(r.out).min(p.size(r.inp));
            by_out.push((r.out.0, w));
            by_inp.push((r.inp.0, w));
        }
    }
    let total = |list: &mut Vec<(u32, u64)>| -> u64 {
        // Largest weight per distinct buffer, summed.
        list.sort_unstable_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)));
        list.dedup_by_key(|x| x.0);
        list.iter().map(|x| x.1).sum()
    };
    total(&mut by_out).min(total(&mut by_inp))
}
