//! Placement of weight updates and collectives into valleys of the
//! live-bytes curve.
//!
//! An optimizer update reads a parameter, its gradient and its state,
//! updates them in place and may need a working buffer; the graph's edges
//! already say when it is legal (after the gradient's last accumulation and
//! the parameter's last read, after any global reduction such as gradient-norm
//! clipping, before the parameter's next read). Inside that window its place
//! is a trade: early frees the gradient sooner, late keeps the gradient
//! alive but may put the working set where memory is low. Collectives
//! (all-gather before a layer's use, reduce-scatter after its gradient) are
//! the same kind of decision with the signs reversed.
//!
//! [`place`] takes the movable ops (classes `Optimizer` and `Collective`),
//! largest working set first, removes each from the order and puts it in
//! the gap of its window that minimises, lexicographically, the new peak
//! and then the highest point of the stretch the move changes — for an
//! update moved from just after its gradient to step `t`, that stretch is
//! `max(max_{r ≤ i < t} M(i) + |g|, M(t) + W)`, so it lands in a valley —
//! then the earliest such gap. Each move is re-simulated and kept only if the
//! peak does not rise. The legal window comes from the dependency edges
//! alone, so updates can never precede their gradient or the parameter's
//! last read.
//!
//! Some updates free a buffer only together: FSDP2's per-parameter updates
//! of one unit each read a view of the unit's reduce-scattered gradient
//! shard, which dies after the last of them. Moved one at a time, none
//! frees anything, so each stays put. [`place`] then moves every such group
//! as a block to the earliest gap all its members' predecessors allow, and
//! keeps the move when it lowers the peak or the number of steps at it, or
//! leaves both as they were and lowers the area under the curve (the
//! gradient dies sooner): updates away from the peak still run as early as
//! they may, so the memory they free is there for the ops that follow —
//! and for later passes, which can only use a valley that exists.

use crate::budget::Budget;
use crate::problem::{OpClass, OpIdx, Problem};
use crate::profile::Profile;

/// Ops whose place [`place`] optimises.
pub fn movable(p: &Problem) -> Vec<OpIdx> {
    p.ops()
        .filter(|&v| matches!(p.class(v), OpClass::Optimizer | OpClass::Collective))
        .collect()
}

/// Bytes an op touches at its step (inputs and outputs that are not
/// resident for the whole step).
fn working_set(p: &Problem, v: OpIdx) -> u64 {
    let resident = |b: crate::BufIdx| {
        let x = p.buf(b);
        x.persistent && x.producer.is_none()
    };
    p.uses(v)
        .chain(p.outputs(v))
        .filter(|&b| !resident(b))
        .map(|b| p.size(b))
        .sum()
}

/// Places every movable op of `order` (see the module docs). Returns the new
/// order and how many ops moved.
pub fn place(p: &Problem, order: Vec<OpIdx>, budget: &Budget) -> (Vec<OpIdx>, usize) {
    let mut ops = movable(p);
    if ops.is_empty() {
        return (order, 0);
    }
    ops.sort_by_key(|&v| (std::cmp::Reverse(working_set(p, v)), v));
    let mut prof = Profile::new(p, order);
    let n = prof.order.len();
    let mut moved = 0;
    for v in ops {
        if budget.expired() {
            break;
        }
        let i = prof.ev.pos[v.index()] as usize;
        let scores = prof.scan(p, v, 0, n);
        let best = scores
            .iter()
            .min_by_key(|s| (s.peak, s.local, s.gap))
            .expect("the current gap is always scored");
        if best.gap == i || best.gap == i + 1 || best.peak > prof.peak() {
            continue;
        }
        let next = Profile::new(p, prof.moved(v, best.gap));
        if next.peak() <= prof.peak() {
            prof = next;
            moved += 1;
        }
    }
    for group in update_groups(p) {
        if budget.expired() {
            break;
        }
        let Some(order) = group_moved_early(p, &prof, &group) else {
            continue;
        };
        let next = Profile::new(p, order);
        if next.key() < prof.key() || (next.key() == prof.key() && next.area() < prof.area()) {
            prof = next;
            moved += group.len();
        }
    }
    (prof.order, moved)
}

/// Groups of at least two optimizer ops that are all the users of some
/// buffer made outside the optimizer (joined when they share one): the
/// buffer dies only when the whole group has run.
fn update_groups(p: &Problem) -> Vec<Vec<OpIdx>> {
    let mut sets = petgraph::unionfind::UnionFind::<usize>::new(p.num_ops());
    let mut grouped = vec![false; p.num_ops()];
    for b in p.buf_ids() {
        let made_outside = p
            .buf(b)
            .producer
            .is_some_and(|o| p.class(o) != OpClass::Optimizer);
        if !made_outside
            || p.num_users(b) < 2
            || p.users(b).any(|u| p.class(u) != OpClass::Optimizer)
        {
            continue;
        }
        let first = p.users(b).next().expect("two users").index();
        for u in p.users(b) {
            grouped[u.index()] = true;
            sets.union(first, u.index());
        }
    }
    let mut groups: std::collections::BTreeMap<usize, Vec<OpIdx>> = Default::default();
    for v in p.ops().filter(|v| grouped[v.index()]) {
        groups.entry(sets.find(v.index())).or_default().push(v);
    }
    groups.into_values().collect()
}

/// The order with `group` moved, as a block in its current relative order,
/// to the earliest gap after every member's predecessors; `None` when that
/// is not earlier than where the group starts or would pass a successor.
fn group_moved_early(p: &Problem, prof: &Profile, group: &[OpIdx]) -> Option<Vec<OpIdx>> {
    let pos = |v: OpIdx| prof.ev.pos[v.index()] as usize;
    let mut members: Vec<OpIdx> = group.to_vec();
    members.sort_by_key(|&v| pos(v));
    let inside = |u: OpIdx| members.contains(&u);
    let lo = members
        .iter()
        .flat_map(|&v| p.preds(v))
        .filter(|&u| !inside(u))
        .map(|u| pos(u) + 1)
        .max()
        .unwrap_or(0);
    if lo >= pos(members[0]) {
        return None;
    }
    let mut order: Vec<OpIdx> = prof.order[..lo].to_vec();
    order.extend(&members);
    order.extend(prof.order[lo..].iter().filter(|&&u| !inside(u)));
    p.is_valid_order(&order).then_some(order)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::problem::ProblemBuilder;
    use crate::simulate::evaluate;

    /// Two layers' backward: a big activation is freed at the second
    /// backward op. The update of layer 1 (gradient 10, working buffer 10)
    /// should not run at the activation peak but after it.
    #[test]
    fn update_goes_into_the_valley() {
        let mut b = ProblemBuilder::new();
        let w = b.add_buf(10, None, true);
        let act = b.add_buf(100, None, false);
        let g_op = b.add_op(OpClass::Backward);
        b.add_use(g_op, w);
        let grad = b.add_buf(10, Some(g_op), false);
        let upd = b.add_op(OpClass::Optimizer);
        b.add_use(upd, grad);
        b.add_use(upd, w);
        b.add_buf(10, Some(upd), false); // working buffer
        let bw2 = b.add_op(OpClass::Backward);
        b.add_edge(g_op, bw2);
        b.add_use(bw2, act);
        let tail = b.add_op(OpClass::Backward);
        b.add_edge(bw2, tail);
        let p = b.build().unwrap();
        let early = vec![g_op, upd, bw2, tail];
        assert!(p.is_valid_order(&early));
        let before = evaluate(&p, &early).peak;
        let (after, moved) = place(&p, early, &Budget::unlimited());
        assert_eq!(moved, 1);
        let e = evaluate(&p, &after);
        assert!(e.peak < before, "{} -> {}", before, e.peak);
        assert!(e.pos[upd.index()] > e.pos[bw2.index()]);
    }

    /// FSDP2's per-parameter updates: two updates read one gradient shard,
    /// which dies only after both. Moving either alone frees nothing; the
    /// pair moves as a block before the big activation and the shard dies
    /// before it is made.
    #[test]
    fn updates_sharing_a_gradient_move_together() {
        let mut b = ProblemBuilder::new();
        let w1 = b.add_buf(4, None, true);
        let w2 = b.add_buf(4, None, true);
        let reduce = b.add_op(OpClass::Collective);
        let shard = b.add_buf(10, Some(reduce), false);
        let ups: Vec<OpIdx> = [w1, w2]
            .into_iter()
            .map(|w| {
                let u = b.add_op(OpClass::Optimizer);
                b.add_use(u, shard);
                b.add_use(u, w);
                u
            })
            .collect();
        let x = b.add_op(OpClass::Backward);
        b.add_edge(reduce, x);
        let act = b.add_buf(100, Some(x), false);
        let y = b.add_op(OpClass::Backward);
        b.add_use(y, act);
        let p = b.build().unwrap();
        assert_eq!(update_groups(&p), vec![ups.clone()]);
        let late = vec![reduce, x, y, ups[0], ups[1]];
        assert!(p.is_valid_order(&late));
        assert_eq!(evaluate(&p, &late).peak, 8 + 110);
        let (after, moved) = place(&p, late, &Budget::unlimited());
        // (The single-op pass may also move the reduce-scatter: a no-op here.)
        assert!(moved >= 2, "{moved}");
        let e = evaluate(&p, &after);
        assert_eq!(e.peak, 8 + 100);
        for u in ups {
            assert!(e.pos[u.index()] < e.pos[x.index()], "{after:?}");
        }
    }
}
