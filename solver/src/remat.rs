//! Choosing what to recompute so that a step fits a memory budget.
//!
//! # Model
//! A *candidate* is a forward op whose outputs the backward pass reads.
//! Choosing it means that the backward pass reads a second copy of those
//! outputs, made by running the op again just before they are needed; the
//! first copies die at their last forward use. The price is the op's cost;
//! the gain is whatever the outputs held across the peak, less what the op's
//! inputs now have to hold until the recomputation (unless they are
//! recomputed too: a chosen op whose input comes from another chosen op
//! reads that op's copy, so chains recompute from the nearest kept value).
//!
//! Whether a set of choices fits is not a sum of sizes: the peak moves, and
//! the order and layout are re-planned for every set. The search therefore
//! asks an [`Oracle`] (the caller's planner) for the planned peak of a set,
//! and for the candidates that sit idle across that peak.
//!
//! # Search
//! 1. **Exact**, when there are few candidates ([`FitParams::exact_candidates`]):
//!    every subset in increasing cost; the first whose plan fits is the
//!    cheapest, and it is *proven* cheapest when every cheaper subset's
//!    planned peak was proven minimal for its set (the oracle says so when
//!    its plan meets its lower bound) and above the budget.
//! 2. **Greedy** otherwise (and when the exact search runs out of probes):
//!    while the peak is above the budget, take the idle candidates at the
//!    peak by bytes freed per unit of cost until they cover the excess;
//!    re-plan; repeat. Cheap, large values go first, which is what selective
//!    activation checkpointing does by hand (norms and pointwise ops before
//!    matrix products). The descent is capped at each cost of the caller's
//!    *ladder* in turn (the fit's: 0.1%, 1% and 10% of the step), going on
//!    from where it stopped when a cap is too low, and uncapped last.
//!    Uncapped from the start, a round that covers a large excess at once
//!    can take matrix products that the pointwise ops would have made
//!    unnecessary; on a large step, where a
//!    probe takes seconds, the pruning and local search after it may have
//!    no time to undo that (Hugging Face GPT-2 XL at selective
//!    checkpointing's simulated peak, 20 s: +17% FLOPs uncapped, +0.025%
//!    with the ladder, no matrix product recomputed).
//! 3. **Pruning**: the greedy overshoots, so each chosen candidate, most
//!    expensive first, is dropped again if the step still fits without it.
//! 4. **Local search** (with the same patience as step 5): drop one chosen candidate (or
//!    two), let
//!    the greedy repair the step without it, prune, and keep the result
//!    when it is cheaper (a cheap candidate or two can stand in for an
//!    expensive one that pruning alone cannot remove).
//! 5. **Iterated local search** with the time that is left: drop a random
//!    part of the best set, repair, prune, keep what is cheaper; it stops
//!    after [`FitParams::patience`] tries without a gain, or after as long
//!    without a gain as half the time the search took before it (at least
//!    2 s); step 4 stops by the same rule.
//!
//! Every probe is a full plan of a transformed step, so the search is
//! bounded by time ([`Budget`]) and keeps the cheapest fitting set found;
//! when nothing fits it keeps the set with the lowest peak.
//!
//! # Lowest peak within a cost
//! [`select_within`] answers the dual question: how low can the peak go if
//! recomputation may add at most so much cost (AOTAutograd's partitioner
//! asks it implicitly when it recomputes only cheap ops). The same moves
//! serve, with the acceptance turned around: the greedy aims below any
//! peak and stops when no idle group is affordable, pruning then drops
//! what the reached peak does not need, and the greedy goes on with the
//! cost pruning freed (*descend*). The local searches keep a set when it
//! is affordable and peaks lower (or as low, cheaper). With few candidates
//! every affordable subset is planned; the answer is proven when each of
//! them was planned at its lower bound.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use crate::Budget;
use crate::random::Rng;

/// One recomputable op, as the search sees it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Candidate {
    /// What recomputing it costs (seconds, or any unit used consistently).
    pub cost: f64,
    /// Bytes of its outputs that the backward pass reads.
    pub bytes: u64,
}

/// What the oracle found for one set of choices.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Probe {
    /// The planned peak (arena bytes) with the set.
    pub peak: u64,
    /// Groups of candidates not in the set that hold bytes across the peak
    /// without being used there, with the bytes recomputing the group would
    /// free there (a group is a candidate with the producers of the inputs
    /// it would otherwise keep alive).
    pub idle: Vec<(Vec<usize>, u64)>,
    /// Whether `peak` is the least any order and layout of this set reach.
    pub proven: bool,
    /// Chosen candidates that changed nothing (nothing needed their
    /// recomputation): dropping them keeps the same plan.
    pub unused: Vec<usize>,
}

/// The caller's planner.
pub trait Oracle {
    /// Plans the step with the candidates marked in `chosen` recomputed.
    fn probe(&mut self, chosen: &[bool]) -> Probe;

    /// Told each time the search's best set changes (for progress).
    fn best_changed(&mut self, _peak: u64, _cost: f64) {}
}

/// Limits of the search.
#[derive(Clone, Debug)]
pub struct FitParams {
    /// Up to this many candidates, every subset is tried in cost order.
    pub exact_candidates: usize,
    /// Probes the exact search may spend before the greedy takes over.
    pub exact_probes: usize,
    /// Tries without a gain after which the iterated local search stops.
    pub patience: usize,
    /// It also stops after this long without a gain: the time the search
    /// took before it, times [`FitParams::patience_factor`], but at least
    /// this many seconds.
    pub patience_secs: f64,
    pub patience_factor: f64,
}

impl Default for FitParams {
    fn default() -> Self {
        FitParams {
            exact_candidates: 14,
            exact_probes: 20_000,
            patience: 200,
            patience_secs: 2.0,
            patience_factor: 0.5,
        }
    }
}

/// The outcome of [`select`].
#[derive(Clone, Debug, PartialEq)]
pub struct Selection {
    /// The chosen candidates.
    pub chosen: Vec<bool>,
    /// Planned peak with them.
    pub peak: u64,
    /// Their summed cost.
    pub cost: f64,
    /// Whether the peak is within the budget.
    pub fits: bool,
    /// Whether no cheaper set fits (exact search, every cheaper peak proven).
    pub optimal: bool,
    /// Whether the exact search ran to its end (every subset up to the
    /// answer was probed).
    pub exhaustive: bool,
    /// Whether no subset fits, proven: every subset probed, each peak
    /// proven minimal for its set.
    pub proven_infeasible: bool,
    /// Plans made.
    pub probes: usize,
    /// Whether the time budget cut the search short.
    pub stopped_by_time: bool,
}

struct Search<'a, O: Oracle> {
    cands: &'a [Candidate],
    /// The budget ([`select`]); 0 and unused within a cost.
    budget_bytes: u64,
    /// The most a set may cost ([`select_within`]); infinite when fitting
    /// a budget ([`select`]).
    max_cost: f64,
    /// A cap on what the greedy descent may add, below `max_cost` (the
    /// budget search's capped descents; infinite otherwise). Unlike
    /// `max_cost` it does not make the search one within a cost.
    cap: f64,
    oracle: &'a mut O,
    time: &'a Budget,
    probes: usize,
    /// Cheapest fitting set so far, else lowest peak; within a cost, the
    /// lowest peak among affordable sets (then the cheapest).
    best: Option<(Vec<bool>, Probe)>,
}

impl<O: Oracle> Search<'_, O> {
    fn cost(&self, chosen: &[bool]) -> f64 {
        chosen
            .iter()
            .zip(self.cands)
            .filter(|(c, _)| **c)
            .map(|(_, c)| c.cost)
            .sum()
    }

    /// Whether the search minimises the peak within [`Search::max_cost`]
    /// rather than the cost within the budget.
    fn within(&self) -> bool {
        self.max_cost.is_finite()
    }

    /// What adding `group` to `chosen` costs.
    fn added_cost(&self, group: &[usize], chosen: &[bool]) -> f64 {
        group
            .iter()
            .filter(|&&i| !chosen[i])
            .map(|&i| self.cands[i].cost)
            .sum()
    }

    /// Whether `(c, q)` is better than the search's current `(chosen, p)`:
    /// within the budget and cheaper, or (within a cost) affordable and
    /// lower, or as low and cheaper.
    fn improves(&self, c: &[bool], q: &Probe, chosen: &[bool], p: &Probe) -> bool {
        let cheaper = self.cost(c) < self.cost(chosen) * (1.0 - 1e-12);
        if self.within() {
            self.cost(c) <= self.max_cost && (q.peak < p.peak || q.peak == p.peak && cheaper)
        } else {
            q.peak <= self.budget_bytes && cheaper
        }
    }

    /// Whether an improvement from `p` to `q` renews the local searches'
    /// patience: any (cheaper) fit of the budget, but within a cost only a
    /// lower peak, so that shaving cost off one peak cannot keep the
    /// search going to its time limit.
    fn is_gain(&self, q: &Probe, p: &Probe) -> bool {
        !self.within() || q.peak < p.peak
    }

    /// The chosen candidates, most expensive first (ties by index).
    fn most_expensive_first(&self, chosen: &[bool]) -> Vec<usize> {
        let mut order: Vec<usize> = (0..chosen.len()).filter(|&i| chosen[i]).collect();
        order.sort_by(|&a, &b| {
            self.cands[b]
                .cost
                .total_cmp(&self.cands[a].cost)
                .then(a.cmp(&b))
        });
        order
    }

    fn probe(&mut self, chosen: &[bool]) -> Probe {
        self.probes += 1;
        let p = self.oracle.probe(chosen);
        let better = match &self.best {
            None => true,
            Some((b, bp)) if self.within() => {
                let (c, bc) = (self.cost(chosen), self.cost(b));
                c <= self.max_cost && (p.peak < bp.peak || p.peak == bp.peak && c < bc)
            }
            Some((b, bp)) => {
                let fits = p.peak <= self.budget_bytes;
                let bfits = bp.peak <= self.budget_bytes;
                match (fits, bfits) {
                    (true, false) => true,
                    (false, true) => false,
                    (true, true) => self.cost(chosen) < self.cost(b),
                    (false, false) => p.peak < bp.peak,
                }
            }
        };
        if better {
            self.oracle.best_changed(p.peak, self.cost(chosen));
            self.best = Some((chosen.to_vec(), p.clone()));
        }
        p
    }

    /// Every subset in increasing cost. Returns `Some(optimal)` when it
    /// found a fitting set or proved none exists, `None` when it ran out
    /// of probes or time. Within a cost, every affordable subset (`None`
    /// at once when there are more than `max_probes`); `Some(true)` says
    /// that every one was planned at its lower bound, so the lowest peak
    /// found is the lowest there is.
    fn exact(&mut self, max_probes: usize) -> Option<bool> {
        let n = self.cands.len();
        let mut subsets: Vec<(f64, u32)> = (0..1u32 << n)
            .map(|m| {
                let c = (0..n)
                    .filter(|i| m >> i & 1 == 1)
                    .map(|i| self.cands[i].cost)
                    .sum();
                (c, m)
            })
            .collect();
        subsets.sort_by(|a, b| {
            a.0.total_cmp(&b.0)
                .then(a.1.count_ones().cmp(&b.1.count_ones()))
        });
        if self.within() {
            subsets.retain(|&(c, _)| c <= self.max_cost);
            if subsets.len() > max_probes {
                return None;
            }
        }
        let mut all_proven = true;
        for (k, &(_, m)) in subsets.iter().enumerate() {
            if k >= max_probes || self.time.expired() {
                return None;
            }
            let chosen: Vec<bool> = (0..n).map(|i| m >> i & 1 == 1).collect();
            let p = self.probe(&chosen);
            if !self.within() && p.peak <= self.budget_bytes {
                return Some(all_proven);
            }
            all_proven &= p.proven;
        }
        Some(all_proven)
    }

    /// Adds idle groups at the peak until the excess is covered, and
    /// re-plans, until the step fits or nothing idle is left. A round that
    /// raises the peak (recomputed chains can be live together) is undone
    /// and its groups are tried one at a time; groups that raise the peak
    /// on their own are not tried again.
    /// Groups holding a candidate marked in `excluded` are never added, nor
    /// groups that would take the set's cost above [`Search::max_cost`].
    /// With `one_by_one`, each round adds only the best idle group. It aims
    /// at `target` bytes (the budget, or 0 to go as low as the cost allows).
    fn greedy(
        &mut self,
        mut chosen: Vec<bool>,
        mut p: Probe,
        target: u64,
        excluded: &[bool],
        one_by_one: bool,
    ) -> (Vec<bool>, Probe) {
        let mut banned: Vec<Vec<usize>> = Vec::new();
        // Share of the excess one round tries to cover: halved after a
        // round that raised the peak, doubled after one that lowered it.
        let mut share = 1.0f64;
        while p.peak > target && !self.time.expired() {
            let excess = ((p.peak - target) as f64 * share) as u64;
            let spent = self.cost(&chosen);
            let mut idle: Vec<(f64, Vec<usize>, u64)> = p
                .idle
                .iter()
                .filter(|(g, b)| {
                    *b > 0
                        && g.iter().any(|&i| !chosen[i])
                        && !g.iter().any(|&i| excluded[i])
                        && !banned.contains(g)
                        && spent + self.added_cost(g, &chosen) <= self.max_cost.min(self.cap)
                })
                .map(|(g, b)| {
                    let cost: f64 = g.iter().map(|&i| self.cands[i].cost).sum();
                    (*b as f64 / cost.max(1e-30), g.clone(), *b)
                })
                .collect();
            if idle.is_empty() {
                break;
            }
            idle.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
            let mut next = chosen.clone();
            let mut taken = Vec::new();
            let mut covered = 0u64;
            for (_, group, b) in &idle {
                if group.iter().all(|&i| next[i])
                    || self.cost(&next) + self.added_cost(group, &next)
                        > self.max_cost.min(self.cap)
                {
                    continue;
                }
                for &i in group {
                    next[i] = true;
                }
                taken.push(group.clone());
                covered += b;
                if covered >= excess || one_by_one {
                    break;
                }
            }
            let q = self.probe(&next);
            if q.peak < p.peak || taken.len() == 1 && q.peak == p.peak {
                (chosen, p) = (next, q);
                share = (share * 2.0).min(1.0);
                continue;
            }
            share /= 2.0;
            if taken.len() == 1 {
                banned.push(taken.swap_remove(0));
                continue;
            }
            // One group at a time, best first, until one helps.
            let mut moved = false;
            for group in taken {
                if self.time.expired() {
                    break;
                }
                let mut one = chosen.clone();
                for &i in &group {
                    one[i] = true;
                }
                let q = self.probe(&one);
                if q.peak < p.peak {
                    (chosen, p) = (one, q);
                    moved = true;
                    break;
                }
                banned.push(group);
            }
            if !moved && idle.iter().all(|(_, g, _)| banned.contains(g)) {
                break;
            }
        }
        (chosen, p)
    }

    /// Drops chosen candidates, most expensive first, while the step fits
    /// `target` bytes: in runs (a whole run at once when that fits, else
    /// each half), so a large set needs far fewer plans than one per
    /// candidate.
    fn prune(&mut self, mut chosen: Vec<bool>, mut p: Probe, target: u64) -> (Vec<bool>, Probe) {
        if !p.unused.is_empty() {
            for &i in &p.unused {
                chosen[i] = false;
            }
            p = self.probe(&chosen);
        }
        let order = self.most_expensive_first(&chosen);
        let mut runs: Vec<&[usize]> = order.chunks(16).rev().collect();
        while let Some(run) = runs.pop() {
            if self.time.expired() {
                break;
            }
            for &i in run {
                chosen[i] = false;
            }
            let q = self.probe(&chosen);
            if q.peak <= target {
                p = q;
                continue;
            }
            for &i in run {
                chosen[i] = true;
            }
            if run.len() > 1 {
                let (a, b) = run.split_at(run.len() / 2);
                runs.push(b);
                runs.push(a);
            }
        }
        (chosen, p)
    }

    /// Completes a start of the local searches: to the budget by the
    /// greedy, then pruned (`None` when it does not fit); within a cost, by
    /// [`Search::descend`].
    fn repair(
        &mut self,
        start: Vec<bool>,
        q: Probe,
        excluded: &[bool],
        one_by_one: bool,
    ) -> Option<(Vec<bool>, Probe)> {
        if self.within() {
            return Some(self.descend(start, q, excluded, one_by_one));
        }
        let budget = self.budget_bytes;
        let (c, q) = self.greedy(start, q, budget, excluded, one_by_one);
        if q.peak > budget {
            return None;
        }
        let (c, q) = self.prune(c, q, budget);
        (q.peak <= self.budget_bytes).then_some((c, q))
    }

    /// Within a cost: lowers the peak by the greedy (aiming at nothing, so
    /// it goes as far as the cost allows), prunes what the new peak does
    /// not need, and again with the cost pruning freed, while the peak
    /// falls.
    fn descend(
        &mut self,
        mut chosen: Vec<bool>,
        mut p: Probe,
        excluded: &[bool],
        one_by_one: bool,
    ) -> (Vec<bool>, Probe) {
        let mut last = u64::MAX;
        while p.peak < last && !self.time.expired() {
            last = p.peak;
            (chosen, p) = self.greedy(chosen, p, 0, excluded, one_by_one);
            let reached = p.peak;
            (chosen, p) = self.prune(chosen, p, reached);
        }
        (chosen, p)
    }

    /// Local search on a fitting set: drop one chosen candidate (most
    /// expensive first), let the greedy repair the step without it, prune,
    /// and keep the result when it is cheaper; repeat until no drop helps
    /// or time runs out. Pruning alone stops at sets where no single
    /// candidate can go; this also finds cheaper candidates that can
    /// replace an expensive one.
    fn improve(
        &mut self,
        mut chosen: Vec<bool>,
        mut p: Probe,
        patience_time: Duration,
    ) -> (Vec<bool>, Probe) {
        let mut tried: HashSet<Vec<bool>> = HashSet::new();
        let mut last_gain = Instant::now();
        'outer: loop {
            let order = self.most_expensive_first(&chosen);
            // Single drops, then pairs (most expensive first).
            let singles = order.iter().map(|&i| vec![i]);
            let pairs = (0..order.len())
                .flat_map(|a| (a + 1..order.len()).map(move |b| (a, b)))
                .map(|(a, b)| vec![order[a], order[b]]);
            for drop in singles.chain(pairs) {
                if self.time.expired() || last_gain.elapsed() >= patience_time {
                    break 'outer;
                }
                let mut start = chosen.clone();
                let mut excluded = vec![false; chosen.len()];
                for &i in &drop {
                    start[i] = false;
                    excluded[i] = true;
                }
                if !tried.insert(start.clone()) {
                    continue;
                }
                let q = self.probe(&start);
                for one_by_one in [false, true] {
                    let repaired = self.repair(start.clone(), q.clone(), &excluded, one_by_one);
                    let Some((c, q)) = repaired else { continue };
                    if self.improves(&c, &q, &chosen, &p) {
                        if self.is_gain(&q, &p) {
                            last_gain = Instant::now();
                        }
                        (chosen, p) = (c, q);
                        continue 'outer;
                    }
                }
            }
            break;
        }
        (chosen, p)
    }
}

impl<'a, O: Oracle> Search<'a, O> {
    fn new(
        cands: &'a [Candidate],
        budget_bytes: u64,
        max_cost: f64,
        oracle: &'a mut O,
        time: &'a Budget,
    ) -> Self {
        Search {
            cands,
            budget_bytes,
            max_cost,
            cap: f64::INFINITY,
            oracle,
            time,
            probes: 0,
            best: None,
        }
    }

    /// Steps 4 and 5 from `(chosen, p)`, with the patience the time since
    /// `started` gives them.
    fn local_search(&mut self, chosen: Vec<bool>, p: Probe, started: Instant, params: &FitParams) {
        let patience_time = Duration::from_secs_f64(
            (started.elapsed().as_secs_f64() * params.patience_factor).max(params.patience_secs),
        );
        let (chosen, p) = self.improve(chosen, p, patience_time);
        self.perturb(chosen, p, &mut Rng::new(1), params.patience, patience_time);
    }

    /// Iterated local search from a fitting set: drop a random part of it
    /// (at least one candidate, which may not come back), sometimes force
    /// a random other candidate in, repair with the greedy, prune, and keep
    /// the result when it is cheaper. Stops after `patience` tries without
    /// a gain, or when time runs out. Seeded, so a run is repeatable.
    fn perturb(
        &mut self,
        mut chosen: Vec<bool>,
        mut p: Probe,
        rng: &mut Rng,
        patience: usize,
        patience_time: Duration,
    ) -> (Vec<bool>, Probe) {
        let n = chosen.len();
        let mut stale = 0;
        let mut last_gain = Instant::now();
        while stale < patience && last_gain.elapsed() < patience_time && !self.time.expired() {
            stale += 1;
            let on: Vec<usize> = (0..n).filter(|&i| chosen[i]).collect();
            if on.is_empty() {
                break;
            }
            let mut start = chosen.clone();
            let mut excluded = vec![false; n];
            let forced = on[rng.below(on.len() as u64) as usize];
            for &i in &on {
                if i == forced || rng.chance(0.5) {
                    start[i] = false;
                    excluded[i] = i == forced || rng.chance(0.5);
                }
            }
            if rng.chance(0.5) {
                let off: Vec<usize> = (0..n).filter(|&i| !start[i] && !excluded[i]).collect();
                if !off.is_empty() {
                    start[off[rng.below(off.len() as u64) as usize]] = true;
                }
            }
            let q = self.probe(&start);
            let Some((c, q)) = self.repair(start, q, &excluded, rng.chance(0.5)) else {
                continue;
            };
            if self.improves(&c, &q, &chosen, &p) {
                if self.is_gain(&q, &p) {
                    stale = 0;
                    last_gain = Instant::now();
                }
                (chosen, p) = (c, q);
            }
        }
        (chosen, p)
    }
}

/// Chooses candidates to recompute so that the planned peak is at most
/// `budget_bytes`, at the least cost found; see the module docs.
///
/// `ladder` holds costs (increasing) to cap the greedy descent at, in
/// turn: where it stops short of the budget, the next cap lets it go on,
/// and the last rung is uncapped. When it fits within the ladder's top
/// cost, the second (one group a round) descent is skipped. `seeds` are
/// sets worth trying as they are (e.g. checkpointing at every segment
/// boundary), probed unless a fitting start already costs less; the
/// cheapest fitting start is then pruned.
pub fn select<O: Oracle>(
    cands: &[Candidate],
    budget_bytes: u64,
    oracle: &mut O,
    params: &FitParams,
    time: &Budget,
    seeds: &[Vec<bool>],
    ladder: &[f64],
) -> Selection {
    let started = Instant::now();
    let n = cands.len();
    let mut s = Search::new(cands, budget_bytes, f64::INFINITY, oracle, time);
    let none = vec![false; n];
    let p0 = s.probe(&none);
    let mut optimal = false;
    let mut exhaustive = false;
    let mut proven = false;
    if p0.peak > budget_bytes {
        let exact = if n <= params.exact_candidates {
            s.exact(params.exact_probes)
        } else {
            None
        };
        match exact {
            Some(all_proven) => {
                exhaustive = true;
                optimal = all_proven;
                proven = all_proven;
            }
            None => {
                // One descent, capped at each of `ladder`'s costs in turn
                // (each rung goes on from where the last stopped short of
                // the budget), uncapped last: uncapped from the start it
                // covers the excess in large rounds and can stop at a set
                // far more expensive than needed, which on a large step
                // (seconds a probe) the pruning has no time to undo.
                let mut start = (none.clone(), p0.clone());
                for &cap in ladder.iter().chain([f64::INFINITY].iter()) {
                    if s.time.expired() {
                        break;
                    }
                    s.cap = cap;
                    start = s.greedy(start.0, start.1, budget_bytes, &none, false);
                    if start.1.peak <= budget_bytes {
                        break;
                    }
                }
                s.cap = f64::INFINITY;
                let fitted = start.1.peak <= budget_bytes;
                let mut starts = vec![start];
                // The one-group-a-round descent, unless the first fits at a
                // cost below the ladder's top (its time then goes to the
                // pruning and the local search).
                if !fitted || ladder.last().is_none_or(|&top| s.cost(&starts[0].0) > top) {
                    starts.push(s.greedy(none.clone(), p0, budget_bytes, &none, true));
                }
                let cheapest = starts
                    .iter()
                    .filter(|(_, p)| p.peak <= budget_bytes)
                    .map(|(c, _)| s.cost(c))
                    .min_by(f64::total_cmp);
                for seed in seeds.iter().filter(|x| x.len() == n) {
                    if s.time.expired() {
                        break;
                    }
                    if cheapest.is_some_and(|c| s.cost(seed) >= c) {
                        continue;
                    }
                    let p = s.probe(seed);
                    starts.push((seed.clone(), p));
                }
                let fitting = starts
                    .into_iter()
                    .filter(|(_, p)| p.peak <= budget_bytes)
                    .min_by(|a, b| s.cost(&a.0).total_cmp(&s.cost(&b.0)));
                if let Some((chosen, p)) = fitting {
                    let (chosen, p) = s.prune(chosen, p, budget_bytes);
                    s.local_search(chosen, p, started, params);
                }
            }
        }
    } else {
        optimal = true;
        exhaustive = true;
    }
    let (chosen, p) = s.best.clone().expect("probed at least once");
    let fits = p.peak <= budget_bytes;
    Selection {
        cost: s.cost(&chosen),
        chosen,
        peak: p.peak,
        fits,
        optimal: fits && optimal,
        exhaustive,
        proven_infeasible: !fits && proven,
        probes: s.probes,
        stopped_by_time: time.was_hit(),
    }
}

/// Chooses candidates costing at most `max_cost` together so that the
/// planned peak is the lowest found (then the cheapest set reaching it);
/// see the module docs. `seeds` that are affordable are tried as starts.
pub fn select_within<O: Oracle>(
    cands: &[Candidate],
    max_cost: f64,
    oracle: &mut O,
    params: &FitParams,
    time: &Budget,
    seeds: &[Vec<bool>],
) -> Selection {
    let started = Instant::now();
    let n = cands.len();
    let max_cost = if max_cost.is_finite() {
        max_cost.max(0.0)
    } else {
        f64::MAX
    };
    let mut s = Search::new(cands, 0, max_cost, oracle, time);
    let none = vec![false; n];
    let p0 = s.probe(&none);
    let exact = if n <= params.exact_candidates {
        s.exact(params.exact_probes)
    } else {
        None
    };
    if exact.is_none() {
        // Every probe competes for `s.best`; the starts need not be kept.
        s.descend(none.clone(), p0.clone(), &none, false);
        s.descend(none.clone(), p0, &none, true);
        for seed in seeds.iter().filter(|x| x.len() == n) {
            if s.time.expired() {
                break;
            }
            if s.cost(seed) <= s.max_cost {
                let p = s.probe(seed);
                s.descend(seed.clone(), p, &none, true);
            }
        }
        let (chosen, p) = s.best.clone().expect("probed at least once");
        s.local_search(chosen, p, started, params);
    }
    let (chosen, p) = s.best.clone().expect("probed at least once");
    Selection {
        cost: s.cost(&chosen),
        chosen,
        peak: p.peak,
        fits: true,
        optimal: exact == Some(true),
        exhaustive: exact.is_some(),
        proven_infeasible: false,
        probes: s.probes,
        stopped_by_time: time.was_hit(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A toy oracle: the peak is `base` minus the bytes of the chosen
    /// candidates, each freeing its bytes only while `gate` of it is chosen
    /// too (so sums alone mislead).
    struct Toy {
        base: u64,
        free: Vec<u64>,
        needs: Vec<Option<usize>>,
    }
    impl Oracle for Toy {
        fn probe(&mut self, chosen: &[bool]) -> Probe {
            let gain = |i: usize| match self.needs[i] {
                Some(j) if !chosen[j] => 0,
                _ => self.free[i],
            };
            let saved: u64 = (0..chosen.len()).filter(|&i| chosen[i]).map(gain).sum();
            Probe {
                peak: self.base - saved,
                idle: (0..chosen.len())
                    .filter(|&i| !chosen[i])
                    .map(|i| (vec![i], self.free[i]))
                    .collect(),
                proven: true,
                unused: vec![],
            }
        }
    }

    fn cands(costs: &[f64], free: &[u64]) -> Vec<Candidate> {
        costs
            .iter()
            .zip(free)
            .map(|(&cost, &bytes)| Candidate { cost, bytes })
            .collect()
    }

    /// Brute force: the cheapest subset whose toy peak fits.
    fn brute(t: &mut Toy, c: &[Candidate], budget: u64) -> Option<f64> {
        let n = c.len();
        (0..1u32 << n)
            .filter_map(|m| {
                let ch: Vec<bool> = (0..n).map(|i| m >> i & 1 == 1).collect();
                (t.probe(&ch).peak <= budget)
                    .then(|| (0..n).filter(|&i| ch[i]).map(|i| c[i].cost).sum())
            })
            .min_by(f64::total_cmp)
    }

    /// A small linear congruential generator for the random toys.
    struct Lcg(u64);
    impl Lcg {
        fn next(&mut self, m: u64) -> u64 {
            self.0 = self
                .0
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (self.0 >> 33) % m
        }
    }

    /// A toy of up to 8 candidates on a base of 1000 bytes, some gated on
    /// an earlier one, with its candidates.
    fn random_toy(rng: &mut Lcg) -> (Toy, Vec<Candidate>) {
        let n = 1 + rng.next(8) as usize;
        let free: Vec<u64> = (0..n).map(|_| 1 + rng.next(50)).collect();
        let costs: Vec<f64> = (0..n).map(|_| 1.0 + rng.next(20) as f64).collect();
        let needs = (0..n)
            .map(|i| (i > 0 && rng.next(3) == 0).then(|| rng.next(i as u64) as usize))
            .collect();
        let c = cands(&costs, &free);
        (
            Toy {
                base: 1000,
                free,
                needs,
            },
            c,
        )
    }

    #[test]
    fn exact_search_finds_the_cheapest_fitting_set() {
        let mut rng = Lcg(7);
        for _ in 0..40 {
            let (mut toy, c) = random_toy(&mut rng);
            let budget = toy.base - rng.next(120);
            let want = brute(&mut toy, &c, budget);
            let s = select(
                &c,
                budget,
                &mut toy,
                &FitParams::default(),
                &Budget::unlimited(),
                &[],
                &[],
            );
            assert_eq!(s.fits, want.is_some());
            if let Some(w) = want {
                assert_eq!(s.cost, w);
                assert!(s.optimal && s.peak <= budget);
            } else {
                assert!(s.exhaustive && !s.optimal && s.proven_infeasible);
            }
        }
    }

    /// A budget's search tries descents capped at its ladder's costs first:
    /// here the uncapped descent takes the expensive candidate (the best
    /// bytes per cost), which pruning cannot drop; without the local search
    /// after it (no patience, as when a large step's probes use up the
    /// time) that is the answer. The descent capped at 2 finds the two
    /// cheap ones.
    #[test]
    fn the_ladder_finds_the_cheap_fit_first() {
        let n = 20;
        let mut free = vec![1_000u64, 5, 5];
        free.resize(n, 1);
        let mut costs = vec![100.0, 1.0, 1.0];
        costs.resize(n, 50.0);
        let c = cands(&costs, &free);
        let run = |ladder: &[f64]| {
            let mut toy = Toy {
                base: 10_000,
                free: free.clone(),
                needs: vec![None; n],
            };
            let impatient = FitParams {
                patience: 0,
                patience_secs: 0.0,
                patience_factor: 0.0,
                ..FitParams::default()
            };
            select(
                &c,
                9_990,
                &mut toy,
                &impatient,
                &Budget::unlimited(),
                &[],
                ladder,
            )
        };
        let (with, without) = (run(&[2.0, 20.0]), run(&[]));
        assert!(with.fits && without.fits);
        assert_eq!(with.cost, 2.0);
        assert_eq!(without.cost, 100.0);
    }

    #[test]
    fn greedy_fits_and_prunes_what_it_did_not_need() {
        // Forty candidates: too many for the exact search.
        let n = 40;
        let free: Vec<u64> = (0..n).map(|i| 10 + i as u64).collect();
        let costs: Vec<f64> = (0..n).map(|i| 1.0 + (i % 7) as f64).collect();
        let mut toy = Toy {
            base: 10_000,
            free,
            needs: vec![None; n],
        };
        let c = cands(&costs, &toy.free);
        let s = select(
            &c,
            9_700,
            &mut toy,
            &FitParams::default(),
            &Budget::unlimited(),
            &[],
            &[],
        );
        assert!(s.fits && s.peak <= 9_700 && !s.optimal);
        // Pruned: no chosen candidate can be dropped.
        for i in (0..n).filter(|&i| s.chosen[i]) {
            let mut ch = s.chosen.clone();
            ch[i] = false;
            assert!(toy.probe(&ch).peak > 9_700, "candidate {i} was not needed");
        }
        // Out of reach: the lowest peak is kept and reported as not fitting.
        let all: u64 = toy.free.iter().sum();
        let s = select(
            &c,
            10_000 - all - 1,
            &mut toy,
            &FitParams::default(),
            &Budget::unlimited(),
            &[],
            &[],
        );
        assert!(!s.fits && s.peak == 10_000 - all);
    }

    /// Brute force: the lowest toy peak among subsets costing at most
    /// `max_cost`.
    fn brute_within(t: &mut Toy, c: &[Candidate], max_cost: f64) -> u64 {
        let n = c.len();
        (0..1u32 << n)
            .map(|m| (0..n).map(|i| m >> i & 1 == 1).collect::<Vec<bool>>())
            .filter(|ch| (0..n).filter(|&i| ch[i]).map(|i| c[i].cost).sum::<f64>() <= max_cost)
            .map(|ch| t.probe(&ch).peak)
            .min()
            .expect("the empty set costs nothing")
    }

    #[test]
    fn within_a_cost_the_exact_search_finds_the_lowest_peak() {
        let mut rng = Lcg(11);
        for _ in 0..40 {
            let (mut toy, c) = random_toy(&mut rng);
            let max_cost = rng.next(40) as f64;
            let want = brute_within(&mut toy, &c, max_cost);
            let s = select_within(
                &c,
                max_cost,
                &mut toy,
                &FitParams::default(),
                &Budget::unlimited(),
                &[],
            );
            assert_eq!(s.peak, want, "max cost {max_cost}");
            assert!(s.cost <= max_cost && s.optimal && s.exhaustive && s.fits);
            assert_eq!(toy.probe(&s.chosen).peak, s.peak);
        }
    }

    #[test]
    fn within_a_cost_the_search_beats_the_ratio_greedy() {
        // Forty independent candidates: a knapsack (bytes freed within the
        // cost), too large for the exact search.
        let n = 40;
        let free: Vec<u64> = (0..n).map(|i| 10 + (i as u64 * 37) % 53).collect();
        let costs: Vec<f64> = (0..n).map(|i| 1.0 + ((i * 13) % 9) as f64).collect();
        let mut toy = Toy {
            base: 10_000,
            free: free.clone(),
            needs: vec![None; n],
        };
        let c = cands(&costs, &free);
        for max_cost in [0.0, 5.0, 30.0, 1e9] {
            // The textbook greedy: best bytes per cost first, while affordable.
            let mut by_ratio: Vec<usize> = (0..n).collect();
            by_ratio.sort_by(|&a, &b| {
                (free[b] as f64 / costs[b]).total_cmp(&(free[a] as f64 / costs[a]))
            });
            let (mut spent, mut saved) = (0.0, 0);
            for i in by_ratio {
                if spent + costs[i] <= max_cost {
                    spent += costs[i];
                    saved += free[i];
                }
            }
            let s = select_within(
                &c,
                max_cost,
                &mut toy,
                &FitParams::default(),
                &Budget::unlimited(),
                &[],
            );
            assert!(s.cost <= max_cost, "{} > {max_cost}", s.cost);
            assert!(s.peak <= 10_000 - saved, "max cost {max_cost}: {}", s.peak);
            assert_eq!(toy.probe(&s.chosen).peak, s.peak);
            if max_cost >= costs.iter().sum::<f64>() {
                assert_eq!(s.peak, 10_000 - free.iter().sum::<u64>());
            }
        }
    }
}
