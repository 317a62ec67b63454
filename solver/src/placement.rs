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
    (prof.order, moved)
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
}
