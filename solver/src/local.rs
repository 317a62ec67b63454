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
//!   backward-only value computed early in the forward pass. A forward or
//!   backward op that makes no buffer (a view: a transpose of a recomputed
//!   norm's output) also sinks to its first consumer when every buffer it
//!   reads is used there or later, so it does not pin the value it views.
//! - [`chain_hoist`]: an op that frees more than it allocates moves earlier
//!   with its private producers (and, as a second variant, with the
//!   consumers that free what it makes), to the best of a few insertion
//!   points by `(peak, area under the curve)`. This undoes what single-op
//!   moves cannot: a recomputed activation and the weight-gradient op that
//!   reads it, deferred together to the end of the backward pass.
//! - [`tail_sink`]: an op that made a buffer live at the peak moves later
//!   together with everything that depends on it, when that is a few ops
//!   (a weight-gradient op with its gradient's packing, reduce-scatter and
//!   update). Such a block can go to any later gap without breaking a
//!   dependency, which single-op moves cannot reach: each op of the chain
//!   is pinned by the next. The block keeps its inputs live longer and
//!   makes its outputs later, which pays when the peak it leaves is higher
//!   than the valley it lands in (the LM head's gradient of an FSDP step,
//!   made while every checkpoint is live, moved past the layers' backward).
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
use crate::problem::{OpClass, OpIdx, Problem};
use crate::profile::Profile;
use crate::simulate::evaluate;

/// Bytes of `v`'s outputs that outlive its step.
fn allocates(p: &Problem, v: OpIdx) -> u64 {
    p.outputs(v)
        .filter(|&b| p.buf(b).persistent || p.num_users(b) > 0)
        .map(|b| p.size(b))
        .sum()
}

/// Whether `v` is a forward or backward op that makes no buffer and,
/// moved to just before position `to`, keeps no buffer alive longer: each
/// buffer it reads has another user at `to` or later. Such ops (views,
/// mostly) move down with the op they feed, so they do not pin the value
/// they view where it was made: a recomputed norm whose output is
/// transposed for a weight gradient sinks to that gradient once the
/// transpose has. Optimizer and collective ops stay out: some that make no
/// buffer in the graph do allocate when they run (an FSDP2 step captured
/// by `memplan.torch` measured 1,988 bytes above its plan when they moved).
fn rides_along(p: &Problem, v: OpIdx, pos: &[u32], to: usize) -> bool {
    matches!(p.class(v), OpClass::Forward | OpClass::Backward)
        && p.outputs(v).len() == 0
        && p.uses(v).all(|b| {
            p.buf(b).persistent || p.users(b).any(|u| u != v && pos[u.index()] as usize >= to)
        })
}

/// Position of `v`'s first consumer in the order `pos` describes (`n`, the
/// order's length, when it has none).
fn first_consumer(p: &Problem, v: OpIdx, pos: &[u32], n: usize) -> usize {
    p.succs(v)
        .map(|s| pos[s.index()] as usize)
        .min()
        .unwrap_or(n)
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
            let first = first_consumer(p, v, &pos, n);
            if allocates(p, v) <= freed(v, &pos) && !(first < n && rides_along(p, v, &pos, first)) {
                continue;
            }
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
/// least as much as it frees (and allocates something, or makes no buffer
/// and rides along, see `rides_along`, so chains of views follow) moves to
/// just before its first consumer, one move at a time, each kept only if
/// the peak does not rise. Unlike [`sink_hoist`],
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
        let first = first_consumer(p, v, &pos, n);
        if first <= i + 1
            || alloc < freed
            || (alloc == 0 && !(first < n && rides_along(p, v, &pos, first)))
        {
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

/// Most insertion points scored per group in [`chain_hoist`].
const CHAIN_TRIES: usize = 8;
/// Largest group moved by [`chain_hoist`].
const CHAIN_MAX: usize = 16;

/// The chain-hoist pass: an op that frees more than it allocates moves
/// earlier together with its *private producers* (preds, transitively,
/// whose every consumer is in the group), kept in their relative order.
/// This undoes a pile-up that single-op moves cannot: a recomputed value
/// and the weight-gradient op that consumes it, both deferred to the end of
/// the backward pass, hold their inputs live across every later block;
/// hoisting either alone does not free anything, hoisting both does. The
/// group is tried at its earliest legal position and just after each
/// other user of a buffer it reads (where that buffer may die or be
/// reused); the best insertion point by `(peak, area under the curve)` is
/// kept if it lowers that pair. Ops are visited from the start, once each.
/// Returns an order whose peak is not above the input's; `O(n · CHAIN_TRIES
/// · (n + m))`, cut short when the budget expires.
pub fn chain_hoist(p: &Problem, order: Vec<OpIdx>, budget: &Budget) -> (Vec<OpIdx>, LocalStats) {
    let mut stats = LocalStats::default();
    let n = order.len();
    let key = |ev: &crate::simulate::Evaluation| {
        (ev.peak, ev.curve.iter().map(|&c| c as u128).sum::<u128>())
    };
    let mut cur = order;
    if n < 3 {
        return (cur, stats);
    }
    let ev = evaluate(p, &cur);
    let mut best_key = key(&ev);
    let mut pos = ev.pos;
    let visit = cur.clone();
    for v in visit {
        if budget.expired() {
            break;
        }
        stats.rounds += 1;
        let i = pos[v.index()] as usize;
        let mut best: Option<((u64, u128), Vec<OpIdx>)> = None;
        for mut group in chain_groups(p, v, &pos) {
            if !frees_more_than_it_keeps(p, &group, &pos, i) {
                continue;
            }
            group.sort_by_key(|w| pos[w.index()]);
            let Some(points) = insertion_points(p, &group, &pos, i) else {
                continue;
            };
            for &t in &points {
                let mut next = Vec::with_capacity(n);
                for (k, &o) in cur.iter().enumerate() {
                    if k == t {
                        next.extend_from_slice(&group);
                    }
                    if !group.contains(&o) {
                        next.push(o);
                    }
                }
                if next == cur {
                    continue;
                }
                debug_assert!(p.is_valid_order(&next));
                let e = evaluate(p, &next);
                let kk = key(&e);
                if kk < best_key && best.as_ref().is_none_or(|b| kk < b.0) {
                    best = Some((kk, next));
                }
            }
        }
        if let Some((kk, next)) = best {
            best_key = kk;
            cur = next;
            pos = crate::simulate::positions(p, &cur);
            stats.moves += 1;
        }
    }
    (cur, stats)
}

/// The groups [`chain_hoist`] tries to move with `v`: `v` and its private
/// producers; and also, when there are any, the consumers of `v`'s outputs
/// whose other inputs are ready before `v` (the weight update after a
/// weight-gradient op), so what `v` allocates can die with it.
fn chain_groups(p: &Problem, v: OpIdx, pos: &[u32]) -> Vec<Vec<OpIdx>> {
    let i = pos[v.index()];
    let mut base = vec![v];
    let mut k = 0;
    while k < base.len() {
        let w = base[k];
        k += 1;
        for u in p.preds(w) {
            if !base.contains(&u) && base.len() < CHAIN_MAX && p.succs(u).all(|s| base.contains(&s))
            {
                base.push(u);
            }
        }
    }
    let mut with_users = base.clone();
    for b in p.outputs(v) {
        for s in p.users(b) {
            if !with_users.contains(&s)
                && with_users.len() < CHAIN_MAX
                && p.preds(s).all(|u| u == v || pos[u.index()] < i)
            {
                with_users.push(s);
            }
        }
    }
    let mut variants = vec![base];
    if with_users.len() > variants[0].len() {
        variants.push(with_users);
    }
    variants
}

/// Whether moving `group` (of the op at position `i`) frees more bytes,
/// inputs it reads last, than its outputs keep allocated.
fn frees_more_than_it_keeps(p: &Problem, group: &[OpIdx], pos: &[u32], i: usize) -> bool {
    let inside = |o: &OpIdx| group.contains(o);
    let mut read: Vec<_> = group.iter().flat_map(|&w| p.uses(w)).collect();
    read.sort_unstable();
    read.dedup();
    let freed: u64 = read
        .into_iter()
        .filter(|&b| {
            !p.buf(b).persistent
                && !p.buf(b).producer.is_some_and(|q| inside(&q))
                && p.users(b).all(|u| inside(&u) || pos[u.index()] < i as u32)
        })
        .map(|b| p.size(b))
        .sum();
    let kept: u64 = group
        .iter()
        .flat_map(|&w| p.outputs(w))
        .filter(|&b| p.buf(b).persistent || p.users(b).any(|u| !inside(&u)))
        .map(|b| p.size(b))
        .sum();
    freed > kept
}

/// Where `group` (sorted by position) may go, as positions it goes just
/// before: its earliest legal one and just after each other user of a
/// buffer it reads; `None` when a single op cannot move earlier.
fn insertion_points(p: &Problem, group: &[OpIdx], pos: &[u32], i: usize) -> Option<Vec<usize>> {
    let first = pos[group[0].index()] as usize;
    let earliest = group
        .iter()
        .flat_map(|&w| p.preds(w))
        .filter(|u| !group.contains(u))
        .map(|u| pos[u.index()] as usize + 1)
        .max()
        .unwrap_or(0);
    if earliest >= first && group.len() == 1 {
        return None;
    }
    let mut points = vec![earliest];
    for &w in group {
        for b in p.uses(w) {
            if p.buf(b).persistent {
                continue;
            }
            for u in p.users(b) {
                let pu = pos[u.index()] as usize;
                if !group.contains(&u) && pu >= earliest && pu < i {
                    points.push(pu + 1);
                }
            }
        }
    }
    points.sort_unstable();
    points.dedup();
    points.truncate(CHAIN_TRIES);
    Some(points)
}

/// Most ops in a block [`tail_sink`] moves.
const TAIL_MAX: usize = 16;
/// Gaps [`tail_sink`] tries per block: the lowest points after the peak.
const TAIL_GAPS: usize = 24;

/// `v` and every op that depends on it, in order of position, if that is
/// at most [`TAIL_MAX`] ops.
fn descendants(p: &Problem, v: OpIdx, pos: &[u32]) -> Option<Vec<OpIdx>> {
    let mut block = vec![v];
    let mut k = 0;
    while k < block.len() {
        let w = block[k];
        k += 1;
        for s in p.succs(w) {
            if !block.contains(&s) {
                if block.len() == TAIL_MAX {
                    return None;
                }
                block.push(s);
            }
        }
    }
    block.sort_by_key(|w| pos[w.index()]);
    Some(block)
}

/// Peak-driven sinking of small descendant-closed blocks (see the module
/// docs), at most `max_rounds` accepted moves. At the first step at the
/// peak, each producer of a buffer live there (and the op there) whose
/// descendants are at most 16 ops (`TAIL_MAX`) is tried, with them, as a
/// block before each of the 24 lowest steps after the peak (`TAIL_GAPS`) and
/// after its last member, and at the end; the best move that lowers
/// `(peak, steps at the peak)` is applied. Moving a descendant-closed block
/// later than all its members keeps every dependency, so every candidate
/// order is valid.
pub fn tail_sink(
    p: &Problem,
    order: Vec<OpIdx>,
    max_rounds: usize,
    budget: &Budget,
) -> (Vec<OpIdx>, LocalStats) {
    let mut prof = Profile::new(p, order);
    let mut stats = LocalStats::default();
    let n = prof.order.len();
    while stats.rounds < max_rounds && n > 2 && !budget.expired() {
        stats.rounds += 1;
        let k = prof.ev.peak_step();
        let mut gaps: Vec<usize> = (k + 2..n).collect();
        gaps.sort_by_key(|&t| (prof.ev.curve[t - 1], t));
        gaps.truncate(TAIL_GAPS);
        gaps.push(n);
        let mut best: Option<((u64, u32), Vec<OpIdx>)> = None;
        for v in candidates(p, &prof, k) {
            if budget.expired() {
                break;
            }
            let i = prof.ev.pos[v.index()] as usize;
            if i > k {
                continue;
            }
            let Some(block) = descendants(p, v, &prof.ev.pos) else {
                continue;
            };
            // Only later than every member: a member already past a gap
            // would move up, before ops it depends on.
            let last = block.last().map_or(0, |w| prof.ev.pos[w.index()] as usize);
            for &t in gaps.iter().filter(|&&t| t > last) {
                let mut next = Vec::with_capacity(n);
                for (j, &o) in prof.order.iter().enumerate() {
                    if j == t {
                        next.extend_from_slice(&block);
                    }
                    if !block.contains(&o) {
                        next.push(o);
                    }
                }
                if t == n {
                    next.extend_from_slice(&block);
                }
                debug_assert!(p.is_valid_order(&next));
                let e = evaluate(p, &next);
                let key = (
                    e.peak,
                    e.curve.iter().filter(|&&c| c == e.peak).count() as u32,
                );
                if key < prof.key() && best.as_ref().is_none_or(|b| key < b.0) {
                    best = Some((key, next));
                }
            }
        }
        let Some((_, next)) = best else { break };
        prof = Profile::new(p, next);
        stats.moves += 1;
    }
    (prof.order, stats)
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
            let (h, _) = chain_hoist(&p, start.clone(), &Budget::unlimited());
            prop_assert!(p.is_valid_order(&h));
            prop_assert!(evaluate(&p, &h).peak <= peak);
            let (s, _) = tail_sink(&p, start.clone(), 200, &Budget::unlimited());
            prop_assert!(p.is_valid_order(&s));
            prop_assert!(evaluate(&p, &s).peak <= peak);
            let (c, _) = window_exact(&p, start, 8, 20, &ExactLimits::default(), &Budget::unlimited());
            prop_assert!(p.is_valid_order(&c));
            prop_assert!(evaluate(&p, &c).peak <= peak);
        }
    }

    /// The LM head of an FSDP step in miniature: `l` makes the logits'
    /// gradient `d`, read by the backward-data op `bd` and the
    /// weight-gradient op `bw`, whose gradient `g` is packed (`cc`),
    /// reduce-scattered (`rs`) and applied (`upd`). Run right away, the
    /// packing lands while the checkpoint `ck` is live (peak 100 + 80 +
    /// 100 + 10 = 290). Sunk past the layer's backward `b2` as one block,
    /// `d` (50) stays live there instead and the packing runs once `ck`
    /// is gone: peak 180 (`g` and the packed copy).
    #[test]
    fn sinks_a_weight_gradient_chain_past_the_peak() {
        use crate::problem::{OpClass, ProblemBuilder};
        let mut b = ProblemBuilder::new();
        let f = b.add_op(OpClass::Forward);
        let ck = b.add_buf(100, Some(f), false);
        let l = b.add_op(OpClass::Backward);
        b.add_edge(f, l);
        let d = b.add_buf(50, Some(l), false);
        let bd = b.add_op(OpClass::Backward);
        b.add_use(bd, d);
        let x = b.add_buf(10, Some(bd), false);
        let bw = b.add_op(OpClass::Backward);
        b.add_use(bw, d);
        let g = b.add_buf(80, Some(bw), false);
        let cc = b.add_op(OpClass::Backward);
        b.add_use(cc, g);
        let flat = b.add_buf(100, Some(cc), false);
        let rs = b.add_op(OpClass::Collective);
        b.add_use(rs, flat);
        let shard = b.add_buf(10, Some(rs), false);
        let upd = b.add_op(OpClass::Optimizer);
        b.add_use(upd, shard);
        let b2 = b.add_op(OpClass::Backward);
        b.add_use(b2, ck);
        b.add_use(b2, x);
        let y = b.add_buf(10, Some(b2), false);
        let tail = b.add_op(OpClass::Backward);
        b.add_use(tail, y);
        let p = b.build().unwrap();
        let order = vec![f, l, bd, bw, cc, rs, upd, b2, tail];
        assert!(p.is_valid_order(&order));
        assert_eq!(evaluate(&p, &order).peak, 290);
        let (after, stats) = tail_sink(&p, order, 10, &Budget::unlimited());
        assert_eq!(stats.moves, 1);
        assert_eq!(after, vec![f, l, bd, b2, tail, bw, cc, rs, upd]);
        assert_eq!(evaluate(&p, &after).peak, 180);
    }

    /// Six forward ops in a chain, each passing the next 40 bytes; returns
    /// the first and the last.
    fn chain(b: &mut crate::problem::ProblemBuilder) -> (OpIdx, OpIdx) {
        use crate::problem::OpClass;
        let first = b.add_op(OpClass::Forward);
        let mut prev = first;
        for _ in 0..5 {
            let t = b.add_buf(40, Some(prev), false);
            let nx = b.add_op(OpClass::Forward);
            b.add_use(nx, t);
            prev = nx;
        }
        (first, prev)
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
        let (first, prev) = chain(&mut b);
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

    /// The same, with the big value read through a view op (no buffer of
    /// its own, as a transpose lowers): the view moves down to its reader
    /// first, then the allocator follows, in both `sink_hoist` and `tidy`.
    /// Without the view riding along, both passes leave the order as it
    /// is (the view pins the allocator).
    #[test]
    fn sinks_an_allocator_past_the_views_that_read_it() {
        use crate::problem::{OpClass, ProblemBuilder};
        let mut b = ProblemBuilder::new();
        let x = b.add_buf(1, None, true);
        let re = b.add_op(OpClass::Backward);
        b.add_use(re, x);
        let big = b.add_buf(50, Some(re), false);
        let view = b.add_op(OpClass::Backward);
        b.add_use(view, big);
        b.add_edge(re, view);
        let (first, prev) = chain(&mut b);
        // The last op reads the view (so the root buffer) and its own chain.
        b.add_use(prev, big);
        b.add_edge(view, prev);
        let p = b.build().unwrap();
        let mut order: Vec<OpIdx> = vec![re, view, first];
        order.extend(
            p.topo_order()
                .iter()
                .copied()
                .filter(|&o| o != re && o != view && o != first),
        );
        assert!(p.is_valid_order(&order));
        assert_eq!(evaluate(&p, &order).peak, 50 + 40 + 40 + 1);
        for after in [sink_hoist(&p, &order, 4), tidy(&p, &order)] {
            let e = evaluate(&p, &after);
            assert_eq!(e.peak, 50 + 40 + 1, "{after:?}");
            assert_eq!(e.pos[re.index()] + 1, e.pos[view.index()]);
            assert_eq!(e.pos[view.index()] + 1, e.pos[prev.index()]);
        }
        // A view whose buffer nothing reads later stays where it is: moving
        // it down would keep `big` alive longer for nothing.
        assert!(!rides_along(
            &p,
            view,
            &evaluate(&p, &order).pos,
            order.len()
        ));
    }

    /// Checkpointing's pile-up in miniature: per block, `fc` is recomputed,
    /// read by the gelu backward `gb`, then turned in place into `gelu`,
    /// which the weight-gradient op `bw` reads; `upd` frees the gradient.
    /// With every block's `gelu, bw, upd` deferred to the end, each `fc`
    /// stays live across all later blocks. No single op frees anything by
    /// moving; the group `gelu, bw, upd` does, and goes back right after
    /// its block's `gb`.
    #[test]
    fn hoists_a_deferred_weight_gradient_with_its_recomputed_input() {
        use crate::problem::{OpClass, ProblemBuilder};
        let mut b = ProblemBuilder::new();
        let x = b.add_buf(1, None, true);
        let mut dx = x;
        let (mut early, mut late, mut gbs, mut gelus) = (vec![], vec![], vec![], vec![]);
        for _ in 0..6 {
            let fc_op = b.add_op(OpClass::Forward);
            b.add_use(fc_op, dx);
            let fc = b.add_buf(10, Some(fc_op), false);
            let gb = b.add_op(OpClass::Backward);
            b.add_use(gb, fc);
            dx = b.add_buf(1, Some(gb), false);
            let gelu_op = b.add_op(OpClass::Forward);
            b.add_use(gelu_op, fc);
            let gelu = b.add_buf(10, Some(gelu_op), false);
            b.add_reuse(gelu_op, gelu, fc);
            let bw = b.add_op(OpClass::Backward);
            b.add_use(bw, gelu);
            let grad = b.add_buf(10, Some(bw), false);
            let upd = b.add_op(OpClass::Optimizer);
            b.add_use(upd, grad);
            early.extend([fc_op, gb]);
            late.extend([gelu_op, bw, upd]);
            gbs.push(gb);
            gelus.push(gelu_op);
        }
        let last = b.add_op(OpClass::Backward);
        b.add_use(last, dx);
        early.push(last);
        let p = b.build().unwrap();
        let order: Vec<OpIdx> = early.into_iter().chain(late).collect();
        assert!(p.is_valid_order(&order));
        let before = evaluate(&p, &order).peak;
        assert!(before >= 60, "the deferred order holds every fc: {before}");
        assert_eq!(evaluate(&p, &sink_hoist(&p, &order, 8)).peak, before);
        let (after, st) = chain_hoist(&p, order, &Budget::unlimited());
        assert!(p.is_valid_order(&after));
        let e = evaluate(&p, &after);
        assert!(e.peak <= 22, "peak {}", e.peak);
        assert!(st.moves >= 6);
        for (gb, gelu) in gbs.iter().zip(&gelus) {
            assert_eq!(e.pos[gb.index()] + 1, e.pos[gelu.index()]);
        }
    }
}
