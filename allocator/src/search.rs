//! Exact search for a layout within a capacity (the decision problem).
//!
//! **Canonical layouts.** Take any layout that fits and let every unit fall
//! as low as it can, even jumping over others, until no unit can move to a
//! lower free offset. In the result, sorted by (offset, rank), every unit
//! sits at the lowest aligned offset at or above the tops of the units
//! before it that it conflicts with, skipping pinned units in its way (if
//! it sat higher, that slot would be free and it could jump down). So a
//! depth-first search that repeatedly picks the next unit, puts it at that
//! *minimum offset*, and never goes back to a lower (offset, rank) than the
//! last placement, reaches a layout whenever one exists.
//!
//! **Pruning** (each a switch in [`SolverParams`]):
//! - *section inference*: in each section still holding unplaced units,
//!   all of them go above the section's floor (and above the last
//!   placement's offset), stacked, so floor + their total size must fit
//!   the capacity; with *unallocated floor* the floor is the lowest minimum
//!   offset among them;
//! - *dominance*: if an unplaced unit's minimum offset plus its size is at
//!   most the last placement's offset, its slot will stay free forever and
//!   the layout cannot be canonical: prune;
//! - *hatless pruning*: a unit that no unplaced unit conflicts with keeps
//!   its minimum offset forever; if placing it now fails, every
//!   alternative fails too (they would pass it by);
//! - *decomposition*: where no unplaced unit crosses a section boundary,
//!   the two sides only share the (fixed) floors and the last offset, so
//!   they are solved one after the other and a failure of either fails the
//!   node, without trying the cross product of their choices;
//! - *re-ranking parts*: each part of a decomposition gets its own static
//!   order, by the same preorder but with the bytes still to place in its
//!   sections as the `Total` key, and drops the rank of the last placement
//!   from its canonical bound (only the offset carries over: any tie-break
//!   order is canonical inside a part). On MiniMalloc's challenging set
//!   this is what lets problem I solve in a fraction of a second instead
//!   of running out of time.
//!
//! **Candidates** are tried in increasing (minimum offset, static rank). The
//! static rank comes from a [`Preorder`]; runs restart round-robin over the
//! preorders with doubling node limits, so an unlucky order costs little,
//! and (see [`Restarts`]) between those rounds on slightly shuffled
//! preorders with short Luby-sequence limits: the run times of one
//! problem under different orders are heavy-tailed, and many short runs
//! on different orders hit a short one sooner. A batch of runs may go to
//! threads; the result is always the sequential one.
//!
//! The search is complete: when it ends without a node limit or deadline
//! cutting it short and finds nothing, no layout fits. Cost per node:
//! `O(n + s)` for `n` units and `s` sections of the current part, plus the
//! conflicts of the placed unit.
//!
//! The ideas follow MiniMalloc (Moffitt, ASPLOS 2023): canonical
//! solutions, section inference, dominance, hatless pruning, dynamic
//! decomposition, static preorders with restarts. The shuffled Luby
//! restarts and the parallel batches are ours.

use rand_xoshiro::SplitMix64;
use rand_xoshiro::rand_core::{Rng as _, SeedableRng};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use crate::params::{Preorder, SolverParams};
use crate::units::Unit;

/// What a search run ended with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    /// A layout within the capacity: offsets indexed like the units.
    Fits(Vec<u64>),
    /// Proven: no layout fits the capacity.
    Infeasible,
    /// The node limit or the deadline stopped it first.
    Unknown,
}

/// Counters of one or more runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SearchStats {
    pub nodes: u64,
    pub runs: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Res {
    Found,
    Fail,
    Abort,
}

/// One undo record.
enum Undo {
    /// A unit was placed: unplace it, give back its bytes and cuts.
    Place(u32),
    /// A section's floor changed.
    Floor(u32, u64),
    /// A unit's base and minimum offset changed.
    Min(u32, u64, u64),
}

/// The static data of a search over a set of units.
struct Model<'a> {
    units: &'a [Unit],
    /// Sections each unit covers.
    span: Vec<(u32, u32)>,
    nsec: usize,
    /// For each unit, the free units it conflicts with.
    adj: Vec<Vec<u32>>,
    /// For each free unit, the pinned units it conflicts with, by offset:
    /// (offset, end).
    pins: Vec<Vec<(u64, u64)>>,
    /// Free units (not pinned).
    free: Vec<u32>,
    /// For each free unit, the previous free unit (by index) with the same
    /// lifetime, size and alignment: twins are placed in index order.
    twin: Vec<Option<u32>>,
    /// For each section, the free units covering it.
    cover: Vec<Vec<u32>>,
}

impl<'a> Model<'a> {
    fn new(units: &'a [Unit]) -> Model<'a> {
        let n = units.len();
        let mut times: Vec<u64> = units.iter().flat_map(|u| [u.lower, u.upper]).collect();
        times.sort_unstable();
        times.dedup();
        let at = |t: u64| times.binary_search(&t).expect("an endpoint") as u32;
        let span: Vec<(u32, u32)> = units.iter().map(|u| (at(u.lower), at(u.upper))).collect();
        let nsec = times.len().saturating_sub(1);
        // Conflicts: sweep by start.
        let mut idx: Vec<u32> = (0..n as u32).collect();
        idx.sort_by_key(|&i| (units[i as usize].lower, i));
        let mut adj: Vec<Vec<u32>> = vec![Vec::new(); n];
        let mut pins: Vec<Vec<(u64, u64)>> = vec![Vec::new(); n];
        let mut active: Vec<u32> = Vec::new();
        for &i in &idx {
            let u = &units[i as usize];
            active.retain(|&j| units[j as usize].upper > u.lower);
            for &j in &active {
                let v = &units[j as usize];
                match (u.pin, v.pin) {
                    (None, None) => {
                        adj[i as usize].push(j);
                        adj[j as usize].push(i);
                    }
                    (None, Some(p)) => pins[i as usize].push((p, p + v.size)),
                    (Some(p), None) => pins[j as usize].push((p, p + u.size)),
                    (Some(_), Some(_)) => {}
                }
            }
            active.push(i);
        }
        for p in &mut pins {
            p.sort_unstable();
        }
        let free: Vec<u32> = (0..n as u32)
            .filter(|&i| units[i as usize].pin.is_none())
            .collect();
        let mut twin = vec![None; n];
        let mut last: std::collections::HashMap<(u64, u64, u64, u64), u32> = Default::default();
        for &i in &free {
            let u = &units[i as usize];
            twin[i as usize] = last.insert((u.lower, u.upper, u.size, u.align), i);
        }
        let mut cover: Vec<Vec<u32>> = vec![Vec::new(); nsec];
        for &i in &free {
            let (a, b) = span[i as usize];
            for c in &mut cover[a as usize..b as usize] {
                c.push(i);
            }
        }
        Model {
            units,
            span,
            nsec,
            adj,
            pins,
            free,
            twin,
            cover,
        }
    }

    /// The lowest offset of unit `i` at or above `base`: aligned, clear of
    /// the pinned units it conflicts with.
    #[inline]
    fn lift(&self, i: usize, base: u64) -> u64 {
        let u = &self.units[i];
        let mut y = base.next_multiple_of(u.align);
        for &(p, e) in &self.pins[i] {
            if y + u.size <= p {
                break;
            }
            if e > y {
                y = e.next_multiple_of(u.align);
            }
        }
        y
    }

    /// Static ranks of the free units under a preorder (lower goes first).
    fn ranks(&self, pre: Preorder) -> Vec<u32> {
        let mut load = vec![0u64; self.nsec];
        for &i in &self.free {
            let (a, b) = self.span[i as usize];
            for l in &mut load[a as usize..b as usize] {
                *l += self.units[i as usize].size;
            }
        }
        let mut order = self.free.clone();
        self.sort_by_preorder(pre, &mut order, &load);
        let mut rank = vec![u32::MAX; self.units.len()];
        for (r, &i) in order.iter().enumerate() {
            rank[i as usize] = r as u32;
        }
        rank
    }

    /// Sorts `order` (free units) by `pre`, with `load` the bytes in each
    /// section that the `Total` key reads. Keys are computed once per unit.
    fn sort_by_preorder(&self, pre: Preorder, order: &mut [u32], load: &[u64]) {
        let total = |i: u32| {
            let (a, b) = self.span[i as usize];
            load[a as usize..b as usize]
                .iter()
                .copied()
                .max()
                .unwrap_or(0) as u128
        };
        let width = |i: u32| (self.units[i as usize].upper - self.units[i as usize].lower) as u128;
        let area = |i: u32| self.units[i as usize].area();
        let size = |i: u32| self.units[i as usize].size as u128;
        // Every key decreasing, then the index increasing.
        let key = |i: u32| {
            let (k1, k2, k3) = match pre {
                Preorder::TotalWidthArea => (total(i), width(i), area(i)),
                Preorder::WidthAreaTotal => (width(i), area(i), total(i)),
                Preorder::TotalAreaWidth => (total(i), area(i), width(i)),
                Preorder::SizeWidth => (size(i), width(i), 0),
            };
            (!k1, !k2, !k3, i)
        };
        if order.len() <= 1 {
            return;
        }
        let mut keyed: Vec<(u128, u128, u128, u32)> = order.iter().map(|&i| key(i)).collect();
        keyed.sort_unstable();
        for (o, k) in order.iter_mut().zip(&keyed) {
            *o = k.3;
        }
    }
}

/// The mutable state of one run.
struct Run<'m, 'a> {
    m: &'m Model<'a>,
    p: &'m SolverParams,
    cap: u64,
    /// The preorder the ranks come from.
    pre: Preorder,
    rank: Vec<u32>,
    placed: Vec<bool>,
    off: Vec<u64>,
    /// Highest top of placed units conflicting with each unit.
    base: Vec<u64>,
    /// `lift(base)`: where each unit would go now.
    minoff: Vec<u64>,
    /// Highest top of placed units in each section (every unplaced unit
    /// of the section goes above it: it is placed at or above the last
    /// offset, so above every placed unit it conflicts with).
    floor: Vec<u64>,
    /// Bytes of unplaced units in each section.
    rem: Vec<u64>,
    /// Unplaced units crossing each boundary `b` (between sections `b` and
    /// `b + 1`).
    cut: Vec<u32>,
    trail: Vec<Undo>,
    nodes: u64,
    node_limit: u64,
    deadline: Option<Instant>,
    aborted: bool,
    /// Per section, an unplaced unit that shows the section can still fit
    /// (`u32::MAX`: none yet).
    witness: Vec<u32>,
    /// Reusable candidate lists: (minimum offset << 32 | rank, position).
    pool: Vec<Vec<(u128, u32)>>,
    /// Units placed now, and the most at once (shown by `MEMPLAN_TRACE`).
    depth: usize,
    deepest: usize,
    /// Set when this run is one of a parallel round: (the lowest index
    /// that decided, this run's index). A lower index deciding stops it.
    cancel: Option<(&'m AtomicUsize, usize)>,
}

impl<'m, 'a> Run<'m, 'a> {
    fn new(
        m: &'m Model<'a>,
        p: &'m SolverParams,
        cap: u64,
        pre: Preorder,
        rank: Vec<u32>,
        node_limit: u64,
        deadline: Option<Instant>,
    ) -> Self {
        let n = m.units.len();
        let mut rem = vec![0u64; m.nsec];
        let mut cut = vec![0u32; m.nsec.saturating_sub(1)];
        let mut minoff = vec![0u64; n];
        for &i in &m.free {
            let (a, b) = m.span[i as usize];
            for r in &mut rem[a as usize..b as usize] {
                *r += m.units[i as usize].size;
            }
            for c in &mut cut[a as usize..(b as usize - 1)] {
                *c += 1;
            }
            minoff[i as usize] = m.lift(i as usize, 0);
        }
        let mut off = vec![0u64; n];
        let mut placed = vec![false; n];
        for (i, u) in m.units.iter().enumerate() {
            if let Some(p) = u.pin {
                off[i] = p;
                placed[i] = true;
            }
        }
        Run {
            m,
            p,
            cap,
            pre,
            rank,
            placed,
            off,
            base: vec![0; n],
            minoff,
            floor: vec![0; m.nsec],
            rem,
            cut,
            trail: Vec::new(),
            nodes: 0,
            node_limit,
            deadline,
            aborted: false,
            witness: vec![u32::MAX; m.nsec],
            pool: Vec::new(),
            depth: 0,
            deepest: 0,
            cancel: None,
        }
    }

    fn place(&mut self, i: u32) -> bool {
        let iu = i as usize;
        let u = &self.m.units[iu];
        let x = self.minoff[iu];
        let top = x + u.size;
        self.placed[iu] = true;
        self.depth += 1;
        self.deepest = self.deepest.max(self.depth);
        self.off[iu] = x;
        self.trail.push(Undo::Place(i));
        let (a, b) = self.m.span[iu];
        for s in a as usize..b as usize {
            if self.floor[s] < top {
                self.trail.push(Undo::Floor(s as u32, self.floor[s]));
                self.floor[s] = top;
            }
            self.rem[s] -= u.size;
        }
        let mut new_cut = false;
        for c in &mut self.cut[a as usize..(b as usize - 1)] {
            *c -= 1;
            new_cut |= *c == 0;
        }
        for &j in &self.m.adj[iu] {
            let ju = j as usize;
            if !self.placed[ju] && self.base[ju] < top {
                self.trail
                    .push(Undo::Min(j, self.base[ju], self.minoff[ju]));
                self.base[ju] = top;
                self.minoff[ju] = self.m.lift(ju, top);
            }
        }
        new_cut
    }

    fn undo_to(&mut self, mark: usize) {
        while self.trail.len() > mark {
            match self.trail.pop().expect("non-empty") {
                Undo::Place(i) => {
                    let iu = i as usize;
                    let u = &self.m.units[iu];
                    self.placed[iu] = false;
                    self.depth -= 1;
                    let (a, b) = self.m.span[iu];
                    for r in &mut self.rem[a as usize..b as usize] {
                        *r += u.size;
                    }
                    for c in &mut self.cut[a as usize..(b as usize - 1)] {
                        *c += 1;
                    }
                }
                Undo::Floor(s, f) => self.floor[s as usize] = f,
                Undo::Min(j, b, m) => {
                    self.base[j as usize] = b;
                    self.minoff[j as usize] = m;
                }
            }
        }
    }

    fn tick(&mut self) -> bool {
        self.nodes += 1;
        if self.nodes > self.node_limit {
            self.aborted = true;
        } else if self.nodes % CLOCK_EVERY == 0 {
            if let Some(d) = self.deadline
                && Instant::now() >= d
            {
                self.aborted = true;
            }
            if let Some((decided, me)) = self.cancel
                && decided.load(Ordering::Relaxed) < me
            {
                self.aborted = true;
            }
        }
        self.aborted
    }

    /// Whether the sections `[a, b)` pass the inference. With the
    /// unallocated floor, each section keeps a witness: an unplaced unit
    /// covering it low enough for the rest to fit above; only when the
    /// witness is placed or lifted too high is the section scanned again.
    fn infer(&mut self, a: usize, b: usize, x_last: u64) -> bool {
        for s in a..b {
            let rem = self.rem[s];
            if rem == 0 {
                continue;
            }
            let Some(t) = self.cap.checked_sub(rem) else {
                return false;
            };
            if x_last > t || self.floor[s] > t {
                return false;
            }
            if self.p.unallocated_floor {
                let w = self.witness[s] as usize;
                if w < self.placed.len() && !self.placed[w] && self.minoff[w] <= t {
                    continue;
                }
                match self.m.cover[s]
                    .iter()
                    .find(|&&j| !self.placed[j as usize] && self.minoff[j as usize] <= t)
                {
                    Some(&j) => self.witness[s] = j,
                    None => return false,
                }
            }
        }
        true
    }

    /// Solves the part made of the unplaced units `items`, which live in
    /// sections `[a, b)`, after a placement at (`x_last`, `r_last`).
    fn dfs(&mut self, items: &mut [u32], a: usize, b: usize, x_last: u64, r_last: u32) -> Res {
        if items.is_empty() {
            return Res::Found;
        }
        if self.tick() {
            return Res::Abort;
        }
        let canon = self.p.canonical_only;
        let dom = canon && self.p.dominance;
        // One pass: the dominance bound (no placement may start at or
        // above the top of an unplaced unit's current slot, or that slot
        // stays free) and the candidates, by position in `items`.
        let mut bound = u64::MAX;
        let mut cands = self.pool.pop().unwrap_or_default();
        cands.clear();
        let mut more = false;
        let mut fail = false;
        for (pos, &i) in items.iter().enumerate() {
            let iu = i as usize;
            let mo = self.minoff[iu];
            let reach = mo + self.m.units[iu].size;
            if reach > self.cap {
                fail = true;
                break;
            }
            bound = bound.min(reach);
            let r = self.rank[iu];
            if canon && (mo, r) < (x_last, r_last) {
                // It can only be placed once a conflicting unit lifts it;
                // with dominance, that unit must go below its slot's top.
                if dom && !self.liftable(iu) {
                    fail = true;
                    break;
                }
                continue;
            }
            // Identical units go in index order.
            if let Some(t) = self.m.twin[iu]
                && !self.placed[t as usize]
            {
                continue;
            }
            more |= offer(&mut cands, ((mo as u128) << 32 | r as u128, pos as u32));
        }
        if fail
            || (dom && bound <= x_last)
            || (self.p.section_inference && !self.infer(a, b, if canon { x_last } else { 0 }))
        {
            self.pool.push(cands);
            return Res::Fail;
        }
        // Candidates in increasing key, CHUNK at a time: most nodes try one
        // or two (the first dives to a layout or the next fails fast), and
        // with thousands of units sorting them all at every node dominated
        // the search, while keeping them all at every level of a deep dive
        // took memory quadratic in the units (gigabytes at 5,000). When a
        // chunk runs out, the items are scanned again for the next keys
        // above the last one tried: the children have restored every
        // unit's minimum offset and placement, so the keys are the same.
        // Keys are unique (ranks are), so the order is the sort's.
        let mut res = Res::Fail;
        let last = items.len() - 1;
        let mut tried = 0u128;
        'tries: loop {
            let Some((key, pos)) = cands.pop() else {
                if !more {
                    break;
                }
                more = self.rescan(items, x_last, r_last, tried, &mut cands);
                if cands.is_empty() {
                    break;
                }
                continue;
            };
            tried = key;
            let x = (key >> 32) as u64;
            if dom && x >= bound {
                break;
            }
            let pos = pos as usize;
            let i = items[pos];
            let iu = i as usize;
            let hatless = self.p.hatless_pruning
                && canon
                && self.m.adj[iu].iter().all(|&j| self.placed[j as usize]);
            let mark = self.trail.len();
            let new_cut = self.place(i);
            // The rest are `items[..last]` while `i` sits at the end;
            // children leave the order of their slice as they found it.
            items.swap(pos, last);
            let rank = self.rank[iu];
            let rest = &mut items[..last];
            let r = if new_cut && self.p.dynamic_decomposition {
                self.solve_parts(rest, a, b, x, rank)
            } else {
                self.dfs(rest, a, b, x, rank)
            };
            items.swap(pos, last);
            match r {
                Res::Found => {
                    res = Res::Found;
                    break 'tries;
                }
                Res::Abort => {
                    self.undo_to(mark);
                    res = Res::Abort;
                    break 'tries;
                }
                Res::Fail => self.undo_to(mark),
            }
            if hatless {
                break;
            }
        }
        self.pool.push(cands);
        res
    }

    /// The next [`CHUNK`] candidates of a node (as its first pass chose
    /// them) with keys above `after`, into `cands`; true when more remain.
    fn rescan(
        &self,
        items: &[u32],
        x_last: u64,
        r_last: u32,
        after: u128,
        cands: &mut Vec<(u128, u32)>,
    ) -> bool {
        let canon = self.p.canonical_only;
        cands.clear();
        let mut more = false;
        for (pos, &i) in items.iter().enumerate() {
            let iu = i as usize;
            let mo = self.minoff[iu];
            let r = self.rank[iu];
            if canon && (mo, r) < (x_last, r_last) {
                continue;
            }
            if let Some(t) = self.m.twin[iu]
                && !self.placed[t as usize]
            {
                continue;
            }
            let key = (mo as u128) << 32 | r as u128;
            if key > after {
                more |= offer(cands, (key, pos as u32));
            }
        }
        more
    }

    /// Whether some unplaced unit conflicting with `j` could still be
    /// placed below the top of `j`'s slot (and so lift `j`).
    fn liftable(&self, j: usize) -> bool {
        let reach = self.minoff[j] + self.m.units[j].size;
        self.m.adj[j]
            .iter()
            .any(|&k| !self.placed[k as usize] && self.minoff[k as usize] < reach)
    }

    /// Splits `items` at every boundary in `[a, b)` no unplaced unit
    /// crosses, and solves the parts one by one.
    fn solve_parts(
        &mut self,
        items: &mut [u32],
        a: usize,
        b: usize,
        x_last: u64,
        r_last: u32,
    ) -> Res {
        if items.is_empty() {
            return Res::Found;
        }
        let mut parts = self.split(items, a, b);
        if parts.len() <= 1 {
            return self.dfs(items, a, b, x_last, r_last);
        }
        let mark = self.trail.len();
        for (pa, pb, part) in &mut parts {
            let res = if self.p.rerank_parts && part.len() > 1 {
                // The part's own preorder, from the bytes left in its
                // sections. Any rank order is canonical within a part, so
                // only the offset bound carries over.
                let saved: Vec<u32> = part.iter().map(|&i| self.rank[i as usize]).collect();
                let mut order = part.clone();
                self.m.sort_by_preorder(self.pre, &mut order, &self.rem);
                for (r, &i) in order.iter().enumerate() {
                    self.rank[i as usize] = r as u32;
                }
                let res = self.dfs(part, *pa, *pb, x_last, 0);
                for (&i, &r) in part.iter().zip(&saved) {
                    self.rank[i as usize] = r;
                }
                res
            } else {
                self.dfs(part, *pa, *pb, x_last, r_last)
            };
            match res {
                Res::Found => {}
                other => {
                    self.undo_to(mark);
                    return other;
                }
            }
        }
        Res::Found
    }

    /// The parts of `items` (sorted by their first section) between the
    /// zero cuts of `[a, b)`: (first section, end section, units).
    fn split(&self, items: &[u32], a: usize, b: usize) -> Vec<(usize, usize, Vec<u32>)> {
        let mut by_start: Vec<u32> = items.to_vec();
        by_start.sort_unstable_by_key(|&i| self.m.span[i as usize].0);
        let mut parts: Vec<(usize, usize, Vec<u32>)> = Vec::new();
        let mut reach = 0usize;
        for i in by_start {
            let (lo, hi) = self.m.span[i as usize];
            let (lo, hi) = (lo as usize, hi as usize);
            match parts.last_mut() {
                Some(p) if lo < reach => {
                    p.2.push(i);
                    reach = reach.max(hi);
                    p.1 = reach;
                }
                _ => {
                    parts.push((lo, hi, vec![i]));
                    reach = hi;
                }
            }
        }
        debug_assert!(parts.iter().all(|p| p.0 >= a && p.1 <= b));
        // Hardest part first: fail fast.
        parts.sort_by_key(|p| std::cmp::Reverse(p.2.len()));
        parts
    }
}

/// Nodes between looks at the clock (and at a parallel round's
/// cancellation): a node costs up to a few hundred microseconds on
/// thousands of units, so a thousand nodes could overrun a deadline by a
/// fraction of a second; reading the clock costs tens of nanoseconds.
const CLOCK_EVERY: u64 = 64;

/// Candidates a search node keeps at once (see [`Run::dfs`]).
const CHUNK: usize = 16;

/// Offers candidate `c` to `cands`, the (at most [`CHUNK`]) smallest keys
/// seen, largest first so that `pop` gives the smallest. Returns true when
/// a candidate was left out (this one or one it pushed out).
fn offer(cands: &mut Vec<(u128, u32)>, c: (u128, u32)) -> bool {
    if cands.len() == CHUNK {
        if c.0 > cands[0].0 {
            return true;
        }
        cands.remove(0);
        let at = cands.partition_point(|x| x.0 > c.0);
        cands.insert(at, c);
        return true;
    }
    let at = cands.partition_point(|x| x.0 > c.0);
    cands.insert(at, c);
    false
}

/// Decides whether `units` fit in `cap` bytes. Pinned units stay where
/// they are (they must not conflict with each other). Restarts over the
/// preorders with doubling node limits until a layout is found, the search
/// is proven exhausted, or `deadline` passes (then [`Decision::Unknown`]).
pub fn decide(
    units: &[Unit],
    cap: u64,
    params: &SolverParams,
    deadline: Option<Instant>,
    stats: &mut SearchStats,
) -> Decision {
    decide_limited(units, cap, params, deadline, u64::MAX, stats)
}

/// Below this node limit a batch of runs goes on the calling thread:
/// threads would cost more than such short runs. (Unit tests use threads
/// always, to check that they change nothing.)
fn parallel_min_nodes() -> u64 {
    if cfg!(test) { 0 } else { 16_384 }
}

/// How a decision restarts its search.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Restarts {
    /// Rounds over the preorders as they are, the node limit doubling
    /// every round. Best where one preorder solves the problem and the
    /// others do not (MiniMalloc's challenging set at its capacity).
    Doubling,
    /// Many short runs, each on a preorder whose ranks are shuffled a
    /// little (a different tree every run), with node limits following the
    /// Luby sequence (1, 1, 2, 1, 1, 2, 4, ... times
    /// [`LUBY_UNIT`] nodes), so a long run comes now and then. Best close
    /// to the optimum, where every order tends to get stuck early: there
    /// it finds layouts the doubling schedule does not. `seed` picks the
    /// shuffles, so each attempt can differ from the last.
    Randomized { seed: u64 },
    /// Both in turn: a doubling round, then shuffled runs with as many
    /// nodes as that round, and so on. Each schedule wins on problems where
    /// the other struggles (on MiniMalloc's set, the fixed orders solve A
    /// and I at once and the shuffled runs need seconds; the shuffled runs
    /// solve B, F and H in a tenth of a second, the fixed orders in one or
    /// two seconds); alternating costs at most about twice the better one.
    Mixed { seed: u64 },
}

/// Nodes per unit of the Luby sequence.
pub const LUBY_UNIT: u64 = 2048;

/// The `i`-th term (from 1) of the Luby sequence.
fn luby(mut i: u64) -> u64 {
    loop {
        // The smallest k with i <= 2^k - 1.
        let mut k = 1u32;
        while (1u64 << k) - 1 < i {
            k += 1;
        }
        if i == (1u64 << k) - 1 {
            return 1u64 << (k - 1);
        }
        i -= (1u64 << (k - 1)) - 1;
    }
}

/// Shuffle windows cycled over randomized runs: small ones keep the
/// preorder nearly intact, large ones explore further from it.
const WINDOWS: [u32; 3] = [3, 10, 30];

/// The generator behind shuffled preorders: SplitMix64 from `seed`.
fn splitmix(seed: u64) -> SplitMix64 {
    SplitMix64::seed_from_u64(seed)
}

/// Ranks moved at random by up to about `window` places each: the units
/// keep roughly their preorder, but ties and near-ties break differently.
/// Any rank order keeps the search complete, so a shuffled run that ends
/// without finding a layout is still a proof.
fn perturb(rank: &[u32], window: u32, seed: u64) -> Vec<u32> {
    let mut rng = splitmix(seed);
    let mut keyed: Vec<(u64, usize)> = rank
        .iter()
        .enumerate()
        .filter(|(_, r)| **r != u32::MAX)
        .map(|(i, &r)| (r as u64 + rng.next_u64() % (window as u64 + 1), i))
        .collect();
    keyed.sort_unstable();
    let mut out = vec![u32::MAX; rank.len()];
    for (r, &(_, i)) in keyed.iter().enumerate() {
        out[i] = r as u32;
    }
    out
}

/// One run to make: which preorder, shuffled how, with what node limit.
#[derive(Copy, Clone, Debug)]
struct Spec {
    pre: usize,
    /// (window, seed) of the shuffle; `None`: the preorder as it is.
    shuffle: Option<(u32, u64)>,
    limit: u64,
}

/// What one run ended with.
struct RunOutcome {
    res: Res,
    off: Vec<u64>,
    nodes: u64,
    deepest: usize,
}

/// [`decide`] with a total node limit across restarts and the doubling
/// schedule.
pub fn decide_limited(
    units: &[Unit],
    cap: u64,
    params: &SolverParams,
    deadline: Option<Instant>,
    max_nodes: u64,
    stats: &mut SearchStats,
) -> Decision {
    decide_with(
        units,
        cap,
        params,
        Restarts::Doubling,
        deadline,
        max_nodes,
        stats,
    )
}

/// The restart schedule: the batches of runs to make, in turn.
struct Schedule {
    restarts: Restarts,
    /// How many preorders there are.
    pres: usize,
    threads: usize,
    /// Doubling: the round's limit.
    limit: u64,
    /// Randomized: runs made so far.
    made: u64,
    /// Mixed: whether the next batch is a round of the fixed preorders, and
    /// the nodes the shuffled batch after it gets (the round's).
    fixed_turn: bool,
    quota: u64,
}

impl Schedule {
    fn new(restarts: Restarts, pres: usize, threads: usize, params: &SolverParams) -> Self {
        Schedule {
            restarts,
            pres,
            threads,
            limit: params.initial_node_limit.max(1),
            made: 0,
            fixed_turn: true,
            quota: 0,
        }
    }

    fn next_batch(&mut self) -> Vec<Spec> {
        match self.restarts {
            Restarts::Doubling => self.fixed_round(),
            // Enough runs to keep the threads busy for a while.
            Restarts::Randomized { seed } => {
                let quota = parallel_min_nodes() * self.threads as u64;
                self.shuffled(seed, 2 * self.threads, quota, 64)
            }
            Restarts::Mixed { seed } => {
                let b = if self.fixed_turn {
                    self.quota = self.limit.saturating_mul(self.pres as u64);
                    self.fixed_round()
                } else {
                    self.shuffled(seed, 1, self.quota, 4096)
                };
                self.fixed_turn = !self.fixed_turn;
                b
            }
        }
    }

    /// Every preorder as it is, at the round's limit; the next round's
    /// limit doubles.
    fn fixed_round(&mut self) -> Vec<Spec> {
        let limit = self.limit;
        self.limit = self.limit.saturating_mul(2);
        (0..self.pres)
            .map(|pre| Spec {
                pre,
                shuffle: None,
                limit,
            })
            .collect()
    }

    /// The next shuffled runs, on Luby's limits: at least `min_runs` and
    /// until they hold `quota` nodes, at most `max_runs`.
    fn shuffled(&mut self, seed: u64, min_runs: usize, quota: u64, max_runs: usize) -> Vec<Spec> {
        let mut b: Vec<Spec> = Vec::new();
        let mut nodes = 0u64;
        while b.len() < max_runs && (b.len() < min_runs || nodes < quota) {
            self.made += 1;
            let limit = luby(self.made).saturating_mul(LUBY_UNIT);
            let i = self.made - 1;
            let pres = self.pres as u64;
            let window = WINDOWS[(i / pres % WINDOWS.len() as u64) as usize];
            let mut rng = splitmix(seed ^ i.wrapping_mul(0x2545_f491_4f6c_dd1d));
            b.push(Spec {
                pre: (i % pres) as usize,
                shuffle: Some((window, rng.next_u64())),
                limit,
            });
            nodes += limit;
        }
        b
    }
}

/// What every run of one decision shares.
struct Runs<'a> {
    m: Model<'a>,
    params: &'a SolverParams,
    cap: u64,
    pres: Vec<Preorder>,
    ranks: Vec<Vec<u32>>,
    deadline: Option<Instant>,
}

impl Runs<'_> {
    fn one(&self, sp: &Spec, cancel: Option<(&AtomicUsize, usize)>) -> RunOutcome {
        let rank = match sp.shuffle {
            Some((w, seed)) => perturb(&self.ranks[sp.pre], w, seed),
            None => self.ranks[sp.pre].clone(),
        };
        let mut run = Run::new(
            &self.m,
            self.params,
            self.cap,
            self.pres[sp.pre],
            rank,
            sp.limit,
            self.deadline,
        );
        run.cancel = cancel;
        let mut items: Vec<u32> = self.m.free.clone();
        let res = if self.params.static_decomposition {
            run.solve_parts(&mut items, 0, self.m.nsec, 0, 0)
        } else {
            run.dfs(&mut items, 0, self.m.nsec, 0, 0)
        };
        RunOutcome {
            res,
            off: run.off,
            nodes: run.nodes,
            deepest: run.deepest,
        }
    }

    /// The batch's runs on `threads` threads. A run that decides stops the
    /// runs after it in the batch (their slots stay empty); those before it
    /// finish, so the sequence's first decision is the same as one thread's.
    fn parallel(&self, batch: &[Spec], threads: usize) -> Vec<Option<RunOutcome>> {
        // The lowest index that decided so far: runs after it stop.
        let decided = AtomicUsize::new(usize::MAX);
        let next = AtomicUsize::new(0);
        let slots: Vec<std::sync::Mutex<Option<RunOutcome>>> =
            batch.iter().map(|_| Default::default()).collect();
        let work = || {
            loop {
                let k = next.fetch_add(1, Ordering::Relaxed);
                if k >= batch.len() {
                    break;
                }
                if batch[k].limit == 0 || decided.load(Ordering::Relaxed) < k {
                    continue;
                }
                let o = self.one(&batch[k], Some((&decided, k)));
                if o.res != Res::Abort {
                    decided.fetch_min(k, Ordering::Relaxed);
                }
                *slots[k].lock().expect("no panics while held") = Some(o);
            }
        };
        // This thread is one of the workers; a helper that cannot start (a
        // process at its thread limit) leaves its share to the others.
        std::thread::scope(|sc| {
            for _ in 1..threads.min(batch.len()) {
                let _ = std::thread::Builder::new().spawn_scoped(sc, work);
            }
            work();
        });
        slots
            .into_iter()
            .map(|s| s.into_inner().expect("no panics while held"))
            .collect()
    }

    fn trace(&self, sp: &Spec, o: &RunOutcome) {
        eprintln!(
            "run cap {} {}{} limit {} nodes {} deepest {}/{} -> {:?}",
            self.cap,
            self.pres[sp.pre].name(),
            sp.shuffle.map(|(w, _)| format!("~{w}")).unwrap_or_default(),
            sp.limit,
            o.nodes,
            o.deepest,
            self.m.free.len(),
            o.res
        );
    }
}

/// Decides whether `units` fit in `cap` bytes, restarting as `restarts`
/// says, until a run decides, `max_nodes` nodes are spent over all runs,
/// or `deadline` passes.
///
/// Runs go in batches (a round of the preorders when doubling). The first
/// run in sequence that decides (finds a layout or exhausts its tree) ends
/// the search. With [`SolverParams::threads`] above 1 the runs of a batch
/// go to threads, but the result is the one the sequence gives: a run
/// that decides cancels only the runs after it, and the runs before it
/// finish. So the answer, the layout and the node count do not depend on
/// the number of threads or the machine (only a deadline can change them).
pub fn decide_with(
    units: &[Unit],
    cap: u64,
    params: &SolverParams,
    restarts: Restarts,
    deadline: Option<Instant>,
    max_nodes: u64,
    stats: &mut SearchStats,
) -> Decision {
    if units
        .iter()
        .any(|u| u.pin.is_some_and(|p| p + u.size > cap))
    {
        return Decision::Infeasible;
    }
    let m = Model::new(units);
    let pres: Vec<Preorder> = if params.preorders.is_empty() {
        vec![Preorder::TotalWidthArea]
    } else {
        params.preorders.clone()
    };
    let ranks: Vec<Vec<u32>> = pres.iter().map(|&p| m.ranks(p)).collect();
    let threads = params.thread_count().max(1);
    let trace = std::env::var_os("MEMPLAN_TRACE").is_some();
    let mut schedule = Schedule::new(restarts, pres.len(), threads, params);
    let runs = Runs {
        m,
        params,
        cap,
        pres,
        ranks,
        deadline,
    };
    let mut spent = 0u64;
    loop {
        let mut batch = schedule.next_batch();
        // Each run's limit, as if every run before it used its whole
        // limit (it did, unless one of them decided).
        let mut s = spent;
        for sp in &mut batch {
            sp.limit = sp.limit.min(max_nodes.saturating_sub(s));
            s = s.saturating_add(sp.limit + 1);
        }
        let total: u64 = batch.iter().map(|sp| sp.limit).sum();
        let parallel = threads > 1 && batch.len() > 1 && total >= parallel_min_nodes() * 2;
        let mut done = if parallel {
            runs.parallel(&batch, threads)
        } else {
            Vec::new()
        }
        .into_iter();
        for sp in &batch {
            if sp.limit == 0 {
                return Decision::Unknown;
            }
            let o = if parallel {
                match done.next().flatten() {
                    Some(o) => o,
                    // Skipped only after an earlier run decided, which
                    // returned below; never reached.
                    None => return Decision::Unknown,
                }
            } else {
                runs.one(sp, None)
            };
            stats.nodes += o.nodes;
            stats.runs += 1;
            if trace {
                runs.trace(sp, &o);
            }
            spent += o.nodes;
            match o.res {
                Res::Found => return Decision::Fits(o.off),
                Res::Fail => return Decision::Infeasible,
                Res::Abort if deadline.is_some_and(|d| Instant::now() >= d) => {
                    return Decision::Unknown;
                }
                Res::Abort => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shuffles' stream is the hand-written SplitMix64's this replaced
    /// (the allocator's runs, and the recorded layouts, are unchanged).
    #[test]
    fn shuffle_stream_is_unchanged() {
        assert_eq!(splitmix(9).next_u64(), 12587370737594032228);
    }

    fn u(lower: u64, upper: u64, size: u64) -> Unit {
        Unit {
            lower,
            upper,
            size,
            align: 1,
            pin: None,
        }
    }

    fn valid(units: &[Unit], offs: &[u64], cap: u64) {
        for i in 0..units.len() {
            assert!(offs[i] + units[i].size <= cap);
            assert_eq!(offs[i] % units[i].align, 0);
            for j in 0..i {
                if units[i].overlaps(&units[j]) {
                    assert!(
                        offs[i] + units[i].size <= offs[j] || offs[j] + units[j].size <= offs[i]
                    );
                }
            }
        }
    }

    /// A staircase that greedy-by-size packs badly but fits exactly.
    fn staircase() -> Vec<Unit> {
        vec![u(0, 2, 2), u(0, 4, 1), u(2, 6, 2), u(4, 6, 1), u(0, 6, 1)]
    }

    #[test]
    fn finds_a_perfect_packing_and_proves_one_byte_less_impossible() {
        let us = staircase();
        let floor = crate::units::max_live(&us);
        let mut st = SearchStats::default();
        let p = SolverParams::default();
        match decide(&us, floor, &p, None, &mut st) {
            Decision::Fits(o) => valid(&us, &o, floor),
            d => panic!("{d:?}"),
        }
        assert_eq!(
            decide(&us, floor - 1, &p, None, &mut st),
            Decision::Infeasible
        );
    }

    #[test]
    fn every_switch_off_still_decides_the_same() {
        let us = vec![
            u(0, 3, 3),
            u(1, 4, 2),
            u(2, 6, 2),
            u(0, 2, 1),
            u(3, 6, 3),
            u(4, 7, 1),
        ];
        let floor = crate::units::max_live(&us);
        let mut st = SearchStats::default();
        let on = SolverParams::default();
        let off = SolverParams {
            canonical_only: false,
            section_inference: false,
            unallocated_floor: false,
            dominance: false,
            hatless_pruning: false,
            static_decomposition: false,
            dynamic_decomposition: false,
            ..SolverParams::default()
        };
        for cap in floor..floor + 3 {
            let a = decide(&us, cap, &on, None, &mut st);
            let b = decide(&us, cap, &off, None, &mut st);
            assert_eq!(
                matches!(a, Decision::Fits(_)),
                matches!(b, Decision::Fits(_)),
                "cap {cap}"
            );
            if let Decision::Fits(o) = a {
                valid(&us, &o, cap);
            }
        }
    }

    #[test]
    fn pins_and_alignment_are_kept() {
        let mut us = vec![u(0, 4, 4), u(0, 2, 2), u(2, 4, 3), u(1, 3, 2)];
        us[0].pin = Some(2);
        us[2].align = 2;
        let mut st = SearchStats::default();
        let p = SolverParams::default();
        match decide(&us, 12, &p, None, &mut st) {
            Decision::Fits(o) => {
                valid(&us, &o, 12);
                assert_eq!(o[0], 2);
            }
            d => panic!("{d:?}"),
        }
        // Unit 3 [1,3) conflicts with everything: 4 + 2 + 2 (+ pin gap).
        assert_eq!(decide(&us, 7, &p, None, &mut st), Decision::Infeasible);
    }

    #[test]
    fn independent_parts_are_solved_apart() {
        // Two copies of the staircase side by side in time.
        let mut us = staircase();
        us.extend(staircase().into_iter().map(|mut x| {
            x.lower += 10;
            x.upper += 10;
            x
        }));
        let floor = crate::units::max_live(&us);
        let mut st = SearchStats::default();
        match decide(&us, floor, &SolverParams::default(), None, &mut st) {
            Decision::Fits(o) => valid(&us, &o, floor),
            d => panic!("{d:?}"),
        }
    }

    #[test]
    fn luby_sequence() {
        let first: Vec<u64> = (1..=15).map(luby).collect();
        assert_eq!(first, [1, 1, 2, 1, 1, 2, 4, 1, 1, 2, 1, 1, 2, 4, 8]);
    }

    #[test]
    fn perturbed_ranks_are_a_permutation_of_the_free_units() {
        let rank = vec![0, u32::MAX, 1, 2, 3, 4, 5];
        let p = perturb(&rank, 3, 7);
        assert_eq!(p[1], u32::MAX);
        let mut r: Vec<u32> = p.iter().copied().filter(|&r| r != u32::MAX).collect();
        r.sort_unstable();
        assert_eq!(r, [0, 1, 2, 3, 4, 5]);
        // A window of 0 keeps the order.
        assert_eq!(perturb(&rank, 0, 7), rank);
    }

    proptest::proptest! {
        /// Doubling rounds, shuffled restarts and both mixed reach the same verdict
        /// (both are complete), every layout is valid, and the thread
        /// count changes nothing, not even the node count.
        #[test]
        fn restart_policies_and_threads_agree(
            raw in proptest::collection::vec((0u64..8, 1u64..5, 1u64..7), 1..12),
            extra in 0u64..3,
            seed in 0u64..1000,
        ) {
            let us: Vec<Unit> = raw.iter().map(|&(l, d, s)| u(l, l + d, s)).collect();
            let cap = crate::units::max_live(&us) + extra;
            let base = SolverParams { initial_node_limit: 1, ..SolverParams::default() };
            let mut verdicts = Vec::new();
            for restarts in [
                Restarts::Doubling,
                Restarts::Randomized { seed },
                Restarts::Mixed { seed },
            ] {
                let mut runs = Vec::new();
                for threads in [1, 3] {
                    let p = SolverParams { threads, ..base.clone() };
                    let mut st = SearchStats::default();
                    let d = decide_with(&us, cap, &p, restarts, None, u64::MAX, &mut st);
                    if let Decision::Fits(o) = &d {
                        valid(&us, o, cap);
                    }
                    proptest::prop_assert!(d != Decision::Unknown);
                    runs.push((d, st));
                }
                proptest::prop_assert_eq!(&runs[0], &runs[1]);
                verdicts.push(matches!(runs[0].0, Decision::Fits(_)));
            }
            proptest::prop_assert!(verdicts.iter().all(|&v| v == verdicts[0]));
        }
    }
}
