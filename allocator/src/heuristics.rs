//! Greedy layouts: take the units in some order and put each at the best
//! offset among the units already placed that are live at the same time.
//!
//! Orders (after pinned units, which go first, where they are pinned):
//! - [`Order::Size`]: decreasing size (TFLite's greedy by size);
//! - [`Order::Lifetime`]: decreasing duration, then earlier start
//!   (longest-lived first, as in LLFB);
//! - [`Order::Area`]: decreasing size × duration;
//! - [`Order::Time`]: increasing start, as a runtime allocator sees them
//!   (ties: longer first, then larger);
//! - [`Order::XlaSpatial`] and [`Order::XlaTemporal`]: the two sorts of
//!   XLA's global decreasing-size best-fit heap, (size ↓, duration ↓) and
//!   (duration ↓, size ↓).
//!
//! Fits: [`Fit::Best`] takes the smallest free gap that holds the unit (the
//! lowest such on ties), [`Fit::First`] the lowest gap that holds it; when
//! no gap holds it, it goes on top of the highest conflicting unit.
//! [`Fit::Stack`] is no greedy fit but a runtime allocator's layout (units
//! by start time, each in the smallest free slot that holds it, or a new
//! slot on top; `O(u log u)`): on large leaves it is the first layout, the
//! one ready in no time ([`best_of_until`]).
//!
//! Cost per unit: a scan of the placed units in offset order, `O(p)` where
//! `p` is the number placed so far (they are kept in a B-tree by offset),
//! so `O(u^2)` per heuristic in the worst case; units that conflict with
//! nothing that is placed cost the same scan, which is cheap in practice.

use std::collections::BTreeMap;
use std::time::Instant;

use crate::problem::{Problem, Solution};
use crate::units::{Unit, Units};

/// In what order a greedy layout takes the units.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum Order {
    Size,
    Lifetime,
    Area,
    Time,
    XlaSpatial,
    XlaTemporal,
}

/// Where a greedy layout puts a unit among the free gaps.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum Fit {
    Best,
    First,
    /// A runtime allocator's slots, whatever the order ([`stack_rest`]).
    Stack,
}

/// One greedy layout: an order and a fit.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct Heuristic {
    pub order: Order,
    pub fit: Fit,
}

impl Heuristic {
    /// Every order with best fit, then every order with first fit.
    pub const ALL: [Heuristic; 12] = {
        use Fit::*;
        use Order::*;
        let o = [Size, Lifetime, Area, Time, XlaSpatial, XlaTemporal];
        let mut out = [Heuristic {
            order: Size,
            fit: Best,
        }; 12];
        let mut i = 0;
        while i < 6 {
            out[i] = Heuristic {
                order: o[i],
                fit: Best,
            };
            out[i + 6] = Heuristic {
                order: o[i],
                fit: First,
            };
            i += 1;
        }
        out
    };

    /// A runtime allocator's layout ([`Fit::Stack`]; by start time).
    pub const STACK: Heuristic = Heuristic {
        order: Order::Time,
        fit: Fit::Stack,
    };

    /// A short name for reports (`size/best`, `xla-temporal/first`...).
    pub fn name(&self) -> String {
        let o = match self.order {
            Order::Size => "size",
            Order::Lifetime => "lifetime",
            Order::Area => "area",
            Order::Time => "time",
            Order::XlaSpatial => "xla-spatial",
            Order::XlaTemporal => "xla-temporal",
        };
        let f = match self.fit {
            Fit::Best => "best",
            Fit::First => "first",
            Fit::Stack => "stack",
        };
        format!("{o}/{f}")
    }
}

/// The order in which `h` takes `units` (indices into `units`).
pub fn order(units: &[Unit], h: Order) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..units.len()).collect();
    let dur = |u: &Unit| u.upper - u.lower;
    idx.sort_by(|&a, &b| {
        let (x, y) = (&units[a], &units[b]);
        let pins = y.pin.is_some().cmp(&x.pin.is_some());
        let key = match h {
            Order::Size => y.size.cmp(&x.size).then(dur(y).cmp(&dur(x))),
            Order::Lifetime => dur(y)
                .cmp(&dur(x))
                .then(x.lower.cmp(&y.lower))
                .then(y.size.cmp(&x.size)),
            Order::Area => y.area().cmp(&x.area()).then(y.size.cmp(&x.size)),
            Order::Time => x
                .lower
                .cmp(&y.lower)
                .then(dur(y).cmp(&dur(x)))
                .then(y.size.cmp(&x.size)),
            Order::XlaSpatial => y
                .size
                .cmp(&x.size)
                .then(dur(y).cmp(&dur(x)))
                .then(x.lower.cmp(&y.lower)),
            Order::XlaTemporal => dur(y)
                .cmp(&dur(x))
                .then(y.size.cmp(&x.size))
                .then(x.lower.cmp(&y.lower)),
        };
        pins.then(key).then(a.cmp(&b))
    });
    idx
}

/// Placed units by offset: `(offset, unit) -> (end, lower, upper)`.
type Placed = BTreeMap<(u64, u32), (u64, u64, u64)>;

/// Where `u` lands among `placed`.
fn fit_offset(u: &Unit, placed: &Placed, fit: Fit) -> u64 {
    let align = u.align;
    let mut best: Option<(u64, u64)> = None; // (gap, offset)
    let mut cursor = 0u64;
    for (&(off, _), &(end, lo, hi)) in placed {
        if lo >= u.upper || u.lower >= hi {
            continue;
        }
        if off > cursor {
            let start = cursor.next_multiple_of(align);
            if start.saturating_add(u.size) <= off {
                let gap = off - cursor;
                match fit {
                    // Stack never comes here (place_until lays it out whole).
                    Fit::First | Fit::Stack => return start,
                    Fit::Best => {
                        if best.is_none_or(|(g, _)| gap < g) {
                            best = Some((gap, start));
                            if gap == u.size {
                                return start;
                            }
                        }
                    }
                }
            }
        }
        cursor = cursor.max(end);
    }
    match best {
        Some((_, off)) => off,
        None => cursor.next_multiple_of(align),
    }
}

/// Places `units` one by one in `order`; returns the offsets (indexed like
/// `units`) and the height. Pinned units keep their pins wherever they
/// come in the order (put them first, as [`order`] does, so the others
/// see them).
pub fn place(units: &[Unit], order: &[usize], fit: Fit) -> (Vec<u64>, u64) {
    let (offsets, height, _) =
        place_until(units, order, fit, None, OnDeadline::GiveUp).expect("no deadline");
    (offsets, height)
}

/// How many units [`place_until`] places between looks at the clock.
const CLOCK_EVERY: usize = 64;

/// What [`place_until`] does when its deadline passes.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum OnDeadline {
    /// Give the layout up (`None`).
    GiveUp,
    /// Finish it at once: the units not yet placed go on top of all the
    /// others (above every pin too), laid out as a runtime allocator would
    /// ([`stack_rest`]). Valid, and the best layout a solve that has none
    /// yet can have in no time.
    Stack,
}

/// [`place`] within `deadline`; what happens when it passes is `then`'s.
/// The flag says whether it passed.
pub fn place_until(
    units: &[Unit],
    order: &[usize],
    fit: Fit,
    deadline: Option<Instant>,
    then: OnDeadline,
) -> Option<(Vec<u64>, u64, bool)> {
    let mut offsets = vec![0u64; units.len()];
    if fit == Fit::Stack {
        let height = stack_rest(units, order, 0, &mut offsets);
        return Some((offsets, height, false));
    }
    let mut placed: Placed = BTreeMap::new();
    let mut height = 0;
    for (k, &i) in order.iter().enumerate() {
        if k % CLOCK_EVERY == CLOCK_EVERY - 1 && past(deadline) {
            match then {
                OnDeadline::GiveUp => return None,
                OnDeadline::Stack => {
                    let h = stack_rest(units, &order[k..], height, &mut offsets);
                    return Some((offsets, height.max(h), true));
                }
            }
        }
        let u = &units[i];
        let off = match u.pin {
            Some(p) => p,
            None => fit_offset(u, &placed, fit),
        };
        offsets[i] = off;
        height = height.max(off + u.size);
        placed.insert((off, i as u32), (off + u.size, u.lower, u.upper));
    }
    Some((offsets, height, false))
}

/// Lays out `rest` (units not placed yet) at once, above `height` and
/// every pin, in `O(r log r)`: by start time, each takes the smallest
/// free slot that holds it (a slot is free once its last unit has ended),
/// or a new slot on top. Units in the region only meet each other, and
/// never two live at once in one slot, so the layout is valid; it is a
/// runtime allocator's, not a heuristic's. Returns the new height.
fn stack_rest(units: &[Unit], rest: &[usize], height: u64, offsets: &mut [u64]) -> u64 {
    use std::cmp::Reverse;
    use std::collections::BinaryHeap;
    let pins = units
        .iter()
        .filter_map(|u| u.pin.map(|p| p + u.size))
        .max()
        .unwrap_or(0);
    let mut top = height.max(pins);
    let mut free_units: Vec<usize> = rest
        .iter()
        .copied()
        .filter(|&i| {
            if let Some(p) = units[i].pin {
                offsets[i] = p;
                false
            } else {
                true
            }
        })
        .collect();
    free_units.sort_by_key(|&i| (units[i].lower, i));
    // Slots: (offset, size); busy ones by the time they end, free ones by
    // (size, offset).
    let mut busy: BinaryHeap<Reverse<(u64, u64, u64)>> = BinaryHeap::new();
    let mut free: BTreeMap<(u64, u64), ()> = BTreeMap::new();
    for i in free_units {
        let u = &units[i];
        while let Some(&Reverse((end, off, size))) = busy.peek() {
            if end > u.lower {
                break;
            }
            busy.pop();
            free.insert((size, off), ());
        }
        // The smallest free slot that holds it, aligned (a few tries).
        let slot = free
            .range((u.size, 0)..)
            .take(8)
            .map(|(&k, _)| k)
            .find(|&(_, off)| off % u.align == 0);
        let (size, off) = match slot {
            Some(k) => {
                free.remove(&k);
                k
            }
            None => {
                let off = top.next_multiple_of(u.align);
                top = off + u.size;
                (u.size, off)
            }
        };
        offsets[i] = off;
        busy.push(Reverse((u.upper.max(u.lower), off, size)));
    }
    top
}

/// Whether `deadline` has passed (never without one).
fn past(deadline: Option<Instant>) -> bool {
    deadline.is_some_and(|d| Instant::now() >= d)
}

/// Runs one heuristic.
pub fn run(units: &[Unit], h: Heuristic) -> (Vec<u64>, u64) {
    place(units, &order(units, h.order), h.fit)
}

/// Runs every heuristic in `hs` and keeps the lowest layout (the first of
/// equals); stops early when one reaches `floor`. Returns the winner too.
pub fn best_of(units: &[Unit], hs: &[Heuristic], floor: u64) -> (Heuristic, Vec<u64>, u64) {
    best_of_until(units, hs, floor, None).0
}

/// Leaves of at least this many units start from [`Heuristic::STACK`]
/// when a solve has a deadline. Smaller leaves (every step graph of the
/// recorded fixtures) run the greedy fits alone, which take a fraction of
/// a second there.
pub const STACK_FIRST_UNITS: usize = 16_384;

/// [`best_of`] within `deadline`: once it has passed, the heuristic
/// under way is given up, and the later ones skipped, except the first:
/// a layout is always needed, so it is finished at once by stacking the
/// units it has not placed yet ([`OnDeadline::Stack`]). The flag says
/// whether the deadline cut anything short.
pub fn best_of_until(
    units: &[Unit],
    hs: &[Heuristic],
    floor: u64,
    deadline: Option<Instant>,
) -> ((Heuristic, Vec<u64>, u64), bool) {
    let mut best: Option<(Heuristic, Vec<u64>, u64)> = None;
    let mut cut = false;
    // With a deadline, a large leaf starts from the layout that is ready
    // in no time: a greedy fit's O(u²) on such a leaf can take seconds,
    // and one stacked where the clock stopped it is sometimes better than
    // the runtime allocator's and sometimes worse, so both are kept and
    // the lower wins.
    let stack_first = deadline.is_some() && units.len() >= STACK_FIRST_UNITS;
    let hs = stack_first
        .then_some(Heuristic::STACK)
        .into_iter()
        .chain(hs.iter().copied());
    for (k, h) in hs.enumerate() {
        // The first greedy fit is finished at once when the deadline
        // passes (the rest stacked on top of it); later ones are given up.
        let first_fit = k == usize::from(stack_first);
        let then = if best.is_none() || first_fit {
            OnDeadline::Stack
        } else {
            OnDeadline::GiveUp
        };
        let ord = if h.fit == Fit::Stack {
            (0..units.len()).collect()
        } else {
            order(units, h.order)
        };
        let Some((offs, height, stacked)) = place_until(units, &ord, h.fit, deadline, then) else {
            cut = true;
            break;
        };
        cut |= stacked;
        if best.as_ref().is_none_or(|b| height < b.2) {
            best = Some((h, offs, height));
        }
        if height <= floor || cut {
            break;
        }
    }
    let best = best.unwrap_or((Heuristic::ALL[0], vec![0; units.len()], 0));
    (best, cut)
}

/// Greedy by size with best fit over a whole problem (TFLite's
/// greedy-by-size; reuse groups move as one): the plain baseline layout.
pub fn greedy_by_size(problem: &Problem) -> Solution {
    greedy_by_size_until(problem, None).expect("no deadline")
}

/// [`greedy_by_size`], given up (`None`) once `deadline` passes.
pub fn greedy_by_size_until(problem: &Problem, deadline: Option<Instant>) -> Option<Solution> {
    // Past the deadline already: not even the set-up (a sort of every
    // buffer, a tenth of a second at 200,000).
    if deadline.is_some_and(|d| Instant::now() >= d) {
        return None;
    }
    let u = Units::new(problem);
    let (offs, _, _) = place_until(
        &u.units,
        &order(&u.units, Order::Size),
        Fit::Best,
        deadline,
        OnDeadline::GiveUp,
    )?;
    Some(u.to_solution(problem, &offs))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::units::max_live;

    fn u(lower: u64, upper: u64, size: u64) -> Unit {
        Unit {
            lower,
            upper,
            size,
            align: 1,
            pin: None,
        }
    }

    fn check(units: &[Unit], offs: &[u64]) {
        for i in 0..units.len() {
            assert_eq!(offs[i] % units[i].align, 0);
            if let Some(p) = units[i].pin {
                assert_eq!(offs[i], p);
            }
            for j in 0..i {
                if units[i].overlaps(&units[j]) {
                    let (a, b) = (offs[i], offs[j]);
                    assert!(a + units[i].size <= b || b + units[j].size <= a, "{i} {j}");
                }
            }
        }
    }

    #[test]
    fn every_heuristic_gives_a_valid_layout() {
        let us = vec![
            u(0, 4, 3),
            u(1, 3, 5),
            u(2, 6, 2),
            u(3, 5, 4),
            u(0, 6, 1),
            u(4, 6, 3),
        ];
        for h in Heuristic::ALL {
            let (offs, height) = run(&us, h);
            check(&us, &offs);
            assert!(height >= max_live(&us), "{}", h.name());
        }
    }

    #[test]
    fn best_fit_takes_the_tightest_gap_first_fit_the_lowest() {
        // Pinned units leave two free gaps at time [2, 3), where only the
        // long units 1 and 3 live: [0, 4) of 4 bytes and [6, 8) of 2.
        let mut us = vec![u(0, 2, 4), u(0, 9, 2), u(0, 2, 2), u(0, 9, 10), u(2, 3, 2)];
        for (i, p) in [0, 4, 6, 8].into_iter().enumerate() {
            us[i].pin = Some(p);
        }
        let ord: Vec<usize> = (0..5).collect();
        let (best, _) = place(&us, &ord, Fit::Best);
        assert_eq!(best[4], 6);
        let (first, _) = place(&us, &ord, Fit::First);
        assert_eq!(first[4], 0);
    }

    #[test]
    fn time_order_reuses_freed_bytes() {
        // a dies before c is born: c takes a's bytes.
        let us = vec![u(0, 2, 4), u(0, 4, 4), u(2, 4, 4)];
        let (offs, h) = run(
            &us,
            Heuristic {
                order: Order::Time,
                fit: Fit::Best,
            },
        );
        assert_eq!(h, 8);
        assert_eq!(offs[2], offs[0]);
    }

    #[test]
    fn a_large_leaf_with_a_deadline_starts_from_the_stack() {
        // Short-lived units in waves: the runtime allocator's slots reach
        // max live; a deadline already past cuts every greedy fit, which
        // leaves the stack's layout (not a fit stacked where it stopped).
        let n = STACK_FIRST_UNITS;
        let us: Vec<Unit> = (0..n as u64)
            .map(|i| u(i / 4, i / 4 + 2, 1 + i % 4))
            .collect();
        let past = Some(Instant::now());
        let ((h, offs, height), cut) = best_of_until(&us, &Heuristic::ALL, 0, past);
        assert!(cut);
        assert_eq!(h, Heuristic::STACK);
        assert_eq!(h.name(), "time/stack");
        check(&us, &offs);
        let ord: Vec<usize> = (0..n).collect();
        assert_eq!(place(&us, &ord, Fit::Stack).1, height);
        // The first greedy fit, stacked where the deadline stopped it, is
        // kept where it is lower: never above either layout.
        let fit = Heuristic::ALL[0];
        let stopped = place_until(
            &us,
            &order(&us, fit.order),
            fit.fit,
            past,
            OnDeadline::Stack,
        )
        .unwrap();
        assert!(stopped.2);
        assert!(height <= stopped.1);
        assert!(
            height <= 2 * max_live(&us),
            "{height} against max live {}",
            max_live(&us)
        );
        // One unit fewer, or no deadline: the greedy fits alone, as before.
        let ((h, _, _), _) = best_of_until(&us[1..], &Heuristic::ALL, 0, past);
        assert_eq!(h, Heuristic::ALL[0]);
        let ((h, _, _), cut) = best_of_until(&us, &Heuristic::ALL[..1], 0, None);
        assert!(!cut);
        assert_eq!(h, Heuristic::ALL[0]);
    }

    #[test]
    fn a_past_deadline_keeps_the_first_heuristic_only() {
        let us: Vec<Unit> = (0..300).map(|i| u(i, i + 7, 1 + i % 5)).collect();
        let past = Some(Instant::now());
        let ((h, offs, height), cut) = best_of_until(&us, &Heuristic::ALL, 0, past);
        assert!(cut);
        assert_eq!(h, Heuristic::ALL[0]);
        check(&us, &offs);
        // The first 63 units are placed by the heuristic, the rest on top.
        assert!(height >= max_live(&us));
        let some: Vec<Unit> = (0..300).map(|i| u(i, i + 7, 1)).collect();
        let mut pinned = some.clone();
        pinned[299].pin = Some(5);
        let ((_, offs, _), cut) = best_of_until(&pinned, &Heuristic::ALL, 0, past);
        assert!(cut);
        check(&pinned, &offs);
        // Without a deadline every heuristic runs (the floor 0 is never met).
        let (_, cut) = best_of_until(&us, &Heuristic::ALL, 0, None);
        assert!(!cut);
        // The units placed after the deadline: valid with alignments and
        // pins, and reusing bytes (far below the sum of sizes).
        let mut mixed: Vec<Unit> = (0..500)
            .map(|i| u(i % 97, i % 97 + 1 + (i * 7) % 13, 1 + (i * 31) % 17))
            .collect();
        for (i, x) in mixed.iter_mut().enumerate() {
            x.align = [1, 2, 4, 8][i % 4];
        }
        mixed[3].pin = Some(40);
        let ord: Vec<usize> = (0..mixed.len()).collect();
        let mut offs = vec![0; mixed.len()];
        let h = stack_rest(&mixed, &ord, 10, &mut offs);
        check(&mixed, &offs);
        assert!(
            offs.iter()
                .zip(&mixed)
                .all(|(&o, x)| x.pin.is_some() || o >= 41)
        );
        assert!(h < mixed.iter().map(|x| x.size).sum::<u64>() / 2, "{h}");
        let ord = order(&us, Order::Size);
        assert!(place_until(&us, &ord, Fit::Best, past, OnDeadline::GiveUp).is_none());
    }

    #[test]
    fn alignment_rounds_gaps_up() {
        let mut us = vec![u(0, 4, 3), u(0, 4, 4)];
        us[1].align = 4;
        let (offs, h) = place(&us, &[0, 1], Fit::Best);
        assert_eq!(offs, vec![0, 4]);
        assert_eq!(h, 8);
    }
}
