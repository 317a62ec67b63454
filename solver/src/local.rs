//! Local improvement of an order: the sink/hoist pass, peak-driven
//! reinsertion, and exact re-ordering of windows around the peak.
//!
//! - [`sink_hoist`]: an op that allocates more than it frees moves to just
//!   before its first consumer (its outputs are born as late as possible);
//!   an op that frees more than it allocates moves to just after its last
//!   producer (its inputs die as early as possible). Sinks are processed
//!   from the end of the order, hoists from the start, repeated until
//!   nothing moves (or a pass limit). This undoes, for instance, a
//!   recomputation scheduled right after the forward pass it repeats, or a
//!   backward-only value computed early in the forward pass.
//! - [`reinsert`]: at the first step at the peak, every op that could
//!   lower it (the op there, producers of buffers live there that could run
//!   later, last users that could run earlier) is scored in every gap of
//!   its window with [`Profile::scan`]; the best move that lowers
//!   `(peak, steps at the peak)` is applied and re-simulated. Repeats until
//!   no move helps (a local optimum) or the round limit.
//! - [`window_exact`]: a window of consecutive steps around the peak is a
//!   stand-alone problem (the ops outside stay where they are); the exact
//!   search re-orders it, and the result is kept if it lowers
//!   `(peak, steps at the peak)`.
//!
//! Every function returns an order at least as good as its input.

use crate::budget::Budget;
use crate::exact::{self, ExactLimits};
use crate::partition::extract_with;
use crate::problem::{OpIdx, Problem};
use crate::profile::Profile;
use crate::simulate::evaluate;

/// Bytes of `v`'s outputs that outlive its step.
fn allocates(p: &Problem, v: OpIdx) -> u64 {
    p.outputs(v)
        .filter(|&b| p.buf(b).persistent || p.num_users(b) > 0)
        .map(|b| p.size(b))
        .sum()
}

/// The sink/hoist pass (see the module docs); returns an order whose peak
/// is not above the input's.
pub fn sink_hoist(p: &Problem, order: &[OpIdx], max_passes: usize) -> Vec<OpIdx> {
    let n = order.len();
    let mut cur = order.to_vec();
    let mut pos = crate::simulate::positions(p, &cur);
    let freed = |v: OpIdx, pos: &[u32]| -> u64 {
        p.uses(v)
            .filter(|&b| {
                !p.buf(b).persistent && p.users(b).all(|u| pos[u.index()] <= pos[v.index()])
            })
            .map(|b| p.size(b))
            .sum()
    };
    let relocate = |cur: &mut Vec<OpIdx>, pos: &mut Vec<u32>, from: usize, to: usize| {
        let v = cur.remove(from);
        cur.insert(to, v);
        let (a, b) = (from.min(to), from.max(to));
        for (k, &o) in cur.iter().enumerate().take(b + 1).skip(a) {
            pos[o.index()] = k as u32;
        }
    };
    for _ in 0..max_passes {
        let mut moved = false;
        // Sinks, from the end.
        let snapshot = cur.clone();
        for &v in snapshot.iter().rev() {
            let i = pos[v.index()] as usize;
            if allocates(p, v) <= freed(v, &pos) {
                continue;
            }
            let first = p
                .succs(v)
                .map(|s| pos[s.index()] as usize)
                .min()
                .unwrap_or(n);
            if first > i + 1 {
                relocate(&mut cur, &mut pos, i, first - 1);
                moved = true;
            }
        }
        // Hoists, from the start.
        let snapshot = cur.clone();
        for &v in &snapshot {
            let i = pos[v.index()] as usize;
            if allocates(p, v) >= freed(v, &pos) {
                continue;
            }
            let last = p
                .preds(v)
                .map(|u| pos[u.index()] as usize + 1)
                .max()
                .unwrap_or(0);
            if last < i {
                relocate(&mut cur, &mut pos, i, last);
                moved = true;
            }
        }
        if !moved {
            break;
        }
    }
    if evaluate(p, &cur).peak <= evaluate(p, order).peak {
        cur
    } else {
        order.to_vec()
    }
}

/// The tidy pass: from the end of the order, every op that allocates at
/// least as much as it frees (and allocates something; neutral ops are
/// included so chains of them follow) moves to just before its first
/// consumer, one move at a
/// time, each kept only if the peak does not rise. Unlike [`sink_hoist`],
/// which keeps or drops a whole pass, this keeps every harmless move, so
/// off-peak values (recomputed activations, backward-only values) are made
/// just before their use even when the step's peak lies elsewhere. Returns
/// an order whose peak is not above the input's; `O(n · (n + m))`.
pub fn tidy(p: &Problem, order: &[OpIdx]) -> Vec<OpIdx> {
    let n = order.len();
    let mut cur = order.to_vec();
    let mut peak = evaluate(p, &cur).peak;
    let mut pos = crate::simulate::positions(p, &cur);
    for v in order.iter().rev().copied() {
        let i = pos[v.index()] as usize;
        let freed: u64 = p
            .uses(v)
            .filter(|&b| {
                !p.buf(b).persistent && p.users(b).all(|u| pos[u.index()] <= pos[v.index()])
            })
            .map(|b| p.size(b))
            .sum();
        let alloc = allocates(p, v);
        if alloc == 0 || alloc < freed {
            continue;
        }
        let first = p
            .succs(v)
            .map(|s| pos[s.index()] as usize)
            .min()
            .unwrap_or(n);
        if first <= i + 1 {
            continue;
        }
        let mut next = cur.clone();
        let o = next.remove(i);
        next.insert(first - 1, o);
        let np = evaluate(p, &next).peak;
        if np <= peak {
            peak = np;
            cur = next;
            for (k, &o) in cur.iter().enumerate().take(first).skip(i) {
                pos[o.index()] = k as u32;
            }
        }
    }
    cur
}

/// Ops that could lower the live bytes at step `k`.
fn candidates(p: &Problem, prof: &Profile, k: usize) -> Vec<OpIdx> {
    let ev = &prof.ev;
    let mut c = vec![prof.order[k]];
    for b in p.buf_ids() {
        let (born, died) = (ev.birth[b.index()] as usize, ev.death[b.index()] as usize);
        if p.size(b) == 0 || born > k || died < k {
            continue;
        }
        if let Some(q) = p.buf(b).producer
            && born < k
        {
            c.push(q);
        }
        if !p.buf(b).persistent && died > k {
            c.extend(p.users(b).filter(|u| ev.pos[u.index()] as usize > k));
        }
    }
    c.sort_unstable();
    c.dedup();
    c
}

/// What local search did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LocalStats {
    pub rounds: usize,
    pub moves: usize,
}

/// Peak-driven reinsertion (see the module docs), at most `max_rounds`
/// accepted moves.
pub fn reinsert(
    p: &Problem,
    order: Vec<OpIdx>,
    max_rounds: usize,
    budget: &Budget,
) -> (Vec<OpIdx>, LocalStats) {
    let mut prof = Profile::new(p, order);
    let mut stats = LocalStats::default();
    let n = prof.order.len();
    if n < 2 {
        return (prof.order, stats);
    }
    let mut tabu: Vec<(OpIdx, usize)> = Vec::new();
    while stats.rounds < max_rounds && !budget.expired() {
        stats.rounds += 1;
        let key = prof.key();
        let k = prof.ev.peak_step();
        let mut best: Option<((u64, u32, u64), OpIdx, usize)> = None;
        for v in candidates(p, &prof, k) {
            for s in prof.scan(p, v, 0, n) {
                if (s.peak, s.at_peak) >= key || tabu.contains(&(v, s.gap)) {
                    continue;
                }
                let score = (s.peak, s.at_peak, s.local);
                if best.as_ref().is_none_or(|b| score < b.0) {
                    best = Some((score, v, s.gap));
                }
            }
        }
        let Some((_, v, gap)) = best else { break };
        let next = Profile::new(p, prof.moved(v, gap));
        if next.key() < key {
            prof = next;
            stats.moves += 1;
            tabu.clear();
        } else {
            // A reuse hint elsewhere changed: the score was optimistic.
            tabu.push((v, gap));
        }
    }
    (prof.order, stats)
}

/// Re-orders windows of `width` consecutive steps around the peak exactly,
/// at most `max_windows` windows; keeps what lowers `(peak, steps at the
/// peak)`.
pub fn window_exact(
    p: &Problem,
    order: Vec<OpIdx>,
    width: usize,
    max_windows: usize,
    limits: &ExactLimits,
    budget: &Budget,
) -> (Vec<OpIdx>, LocalStats) {
    let mut prof = Profile::new(p, order);
    let mut stats = LocalStats::default();
    let n = prof.order.len();
    if n < 3 || width < 2 {
        return (prof.order, stats);
    }
    let width = width.min(n);
    let mut tried: Vec<usize> = Vec::new();
    while stats.rounds < max_windows && !budget.expired() {
        let k = prof.ev.peak_step();
        // Centred on the peak, then shifted either way.
        let starts = [
            k.saturating_sub(width / 2),
            k.saturating_sub(width - 1),
            k,
            k.saturating_sub(width / 4),
            k.saturating_sub(3 * width / 4),
        ];
        let mut improved = false;
        for a in starts {
            let a = a.min(n - width);
            if tried.contains(&a) {
                continue;
            }
            tried.push(a);
            stats.rounds += 1;
            if let Some(next) = reorder_window(p, &prof, a, a + width, limits, budget)
                && next.key() < prof.key()
            {
                prof = next;
                stats.moves += 1;
                tried.clear();
                improved = true;
                break;
            }
            if stats.rounds >= max_windows || budget.expired() {
                break;
            }
        }
        if !improved {
            break;
        }
    }
    (prof.order, stats)
}

/// The order with steps `[a, b)` re-ordered optimally, if the exact search
/// finds a better window order.
fn reorder_window(
    p: &Problem,
    prof: &Profile,
    a: usize,
    b: usize,
    limits: &ExactLimits,
    budget: &Budget,
) -> Option<Profile> {
    let ops = &prof.order[a..b];
    let pos = &prof.ev.pos;
    let side = |o: OpIdx| {
        let q = pos[o.index()] as usize;
        if q < a {
            -1
        } else if q >= b {
            1
        } else {
            0
        }
    };
    let orphans: Vec<crate::BufIdx> = if a == 0 {
        p.buf_ids()
            .filter(|&x| {
                let y = p.buf(x);
                y.producer.is_none() && !y.persistent && p.num_users(x) == 0 && y.size > 0
            })
            .collect()
    } else {
        Vec::new()
    };
    let sub = extract_with(p, ops, 0, &orphans, side);
    let local: Vec<OpIdx> = (0..ops.len() as u32).map(OpIdx).collect();
    let cur = evaluate(&sub.problem, &local);
    let r = exact::solve(&sub.problem, cur.peak, limits, budget);
    let better = r.order?;
    let mut order = prof.order.clone();
    for (k, o) in better.iter().enumerate() {
        order[a + k] = sub.ops[o.index()];
    }
    Some(Profile::new(p, order))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::random::{random_order, random_problem};
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(100))]
        #[test]
        fn improvements_are_valid_and_never_worse(seed in any::<u64>(), n in 1usize..40) {
            let p = random_problem(seed, n, 0.15);
            let start = random_order(&p, seed);
            let peak = evaluate(&p, &start).peak;
            let a = sink_hoist(&p, &start, 8);
            prop_assert!(p.is_valid_order(&a));
            prop_assert!(evaluate(&p, &a).peak <= peak);
            let t = tidy(&p, &start);
            prop_assert!(p.is_valid_order(&t));
            prop_assert!(evaluate(&p, &t).peak <= peak);
            let (b, _) = reinsert(&p, start.clone(), 200, &Budget::unlimited());
            prop_assert!(p.is_valid_order(&b));
            prop_assert!(evaluate(&p, &b).peak <= peak);
            let (c, _) = window_exact(&p, start, 8, 20, &ExactLimits::default(), &Budget::unlimited());
            prop_assert!(p.is_valid_order(&c));
            prop_assert!(evaluate(&p, &c).peak <= peak);
        }
    }

    /// A recomputation-like op (reads an early input, makes a big output
    /// used only at the end) placed early is sunk to just before its use.
    #[test]
    fn sinks_an_early_allocator_to_its_consumer() {
        use crate::problem::{OpClass, ProblemBuilder};
        let mut b = ProblemBuilder::new();
        let x = b.add_buf(1, None, true);
        let re = b.add_op(OpClass::Forward);
        b.add_use(re, x);
        let big = b.add_buf(50, Some(re), false);
        let mut prev = b.add_op(OpClass::Forward);
        let first = prev;
        for _ in 0..5 {
            let t = b.add_buf(40, Some(prev), false);
            let nx = b.add_op(OpClass::Forward);
            b.add_use(nx, t);
            prev = nx;
        }
        b.add_use(prev, big);
        let p = b.build().unwrap();
        let mut order: Vec<OpIdx> = vec![re, first];
        order.extend(
            p.topo_order()
                .iter()
                .copied()
                .filter(|&o| o != re && o != first),
        );
        assert!(p.is_valid_order(&order));
        let before = evaluate(&p, &order).peak;
        let after = sink_hoist(&p, &order, 4);
        let e = evaluate(&p, &after);
        assert!(e.peak < before);
        assert_eq!(e.pos[re.index()] + 1, e.pos[prev.index()]);
    }
}
