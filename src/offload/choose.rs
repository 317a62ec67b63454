//! Which tensors leave the device, and where their copies go in a fixed
//! order.
//!
//! A tensor's *uses* are the places in the order of the ops that write,
//! read or update its bytes. Offloading it splits its uses into
//! *residencies* at chosen gaps between consecutive uses; between two
//! residencies its bytes are on the host only. A residency after a gap
//! starts with a copy to the device; one ends with a copy to the host when
//! the host has no current copy of it (a transient tensor's first
//! residency; one that wrote it, when a later residency or the step's end
//! needs the value), else the device copy is simply dropped after its last
//! use. A step input (parameters, optimizer state, data: no producer) that
//! is offloaded lives in host memory (its *home*): each of its residencies
//! starts with a copy to the device, and the last write is copied back.
//!
//! Copies are placed to hide behind compute: a copy to the device as late
//! as lets it end before its first reader starts, a copy to the host as
//! early after its last writer as lets it end before the compute stream
//! passes it ([`super::timing`]'s rules), each within the link time the
//! ops in its window have left (`busy`, one ledger per direction). A
//! window too short to hide a copy costs the difference: the *stall*.
//!
//! The search is greedy at the peak: while the device's live bytes exceed
//! the target, among the tensors live at the peak place that could be
//! away there (the peak lies inside one of their gaps, or before the first
//! or after the last use of a step input), take the one with the most
//! bytes per second of added stall (link time breaks ties). Every change
//! only shortens a tensor's device life, so the profile falls where it
//! changes and the search ends.

use std::collections::BTreeSet;

use crate::graph::{Graph, Lifetime, OpId, TensorId};

use super::device::Device;

/// A tensor the search may offload, with its uses in the order.
#[derive(Clone, Debug)]
pub(super) struct Candidate {
    pub t: TensorId,
    pub size: u64,
    /// Places of the ops that use its bytes (sorted, distinct).
    pub uses: Vec<usize>,
    /// Whether the op at each use writes it (produces or updates it).
    pub writes: Vec<bool>,
    /// A step input (no producer): offloaded, it lives on the host.
    pub step_input: bool,
    pub persistent: bool,
}

/// What the search decided for one candidate.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct Decision {
    /// Lives on the host between residencies and steps (step inputs).
    pub host_home: bool,
    /// Gaps that split residencies: gap `i` lies between `uses[i]` and
    /// `uses[i + 1]`.
    pub cuts: BTreeSet<usize>,
    /// Places it must be away from the device (the peaks it was offloaded
    /// for): copies to the device go after them and copies to the host
    /// before them, stalling if they must.
    pub away: BTreeSet<usize>,
}

impl Decision {
    pub fn offloads(&self) -> bool {
        self.host_home || !self.cuts.is_empty()
    }
}

/// One copy of a candidate.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Copy {
    pub to_host: bool,
    /// Inserted just before the op at this place (`n`: after the last op).
    pub before: usize,
    /// The residency it starts (to the device) or ends (to the host).
    pub residency: usize,
    /// The ops whose time it may run under: `[from, to)`.
    pub window: (usize, usize),
    pub seconds: f64,
}

/// A candidate's device life and copies under one decision.
#[derive(Clone, Debug, Default)]
pub(super) struct TensorPlan {
    /// Places it is on the device, closed intervals.
    pub intervals: Vec<(usize, usize)>,
    /// Places its host copy exists, a closed interval.
    pub host: Option<(usize, usize)>,
    pub copies: Vec<Copy>,
    /// The residency of each use.
    pub residency_of_use: Vec<usize>,
    /// Estimated seconds its copies add (module docs).
    pub stall: f64,
    /// Link time each copy booked: `(direction, place, seconds)`.
    bookings: Vec<(usize, usize, f64)>,
}

impl TensorPlan {
    fn covers(&self, p: usize) -> bool {
        self.intervals.iter().any(|&(a, b)| a <= p && p <= b)
    }
}

/// The search's state over one order.
pub(super) struct Chooser<'a> {
    dev: &'a Device,
    n: usize,
    /// Each place's op's seconds.
    dur: Vec<f64>,
    /// The roots each place's op reads (false) and writes (true).
    touch: Vec<Vec<(u32, bool)>>,
    /// Each root's candidate, if it is one.
    cand_of: Vec<u32>,
    /// Changes the simulation refused: (candidate, peak place).
    rejected: std::collections::HashSet<(usize, usize)>,
    /// Link time left under each place's op, per direction (0: to the
    /// host, 1: to the device).
    links: [Ledger; 2],
    pub cands: Vec<Candidate>,
    pub decisions: Vec<Decision>,
    pub plans: Vec<TensorPlan>,
    /// Device live bytes at each place.
    profile: Vec<i128>,
    host_profile: Vec<i128>,
    /// The sum of the plans' stalls.
    pub stall: f64,
}

/// Where to stop, and what a change may cost.
#[derive(Clone, Copy, Debug)]
pub(super) struct Limits {
    /// Device live bytes to reach.
    pub target: u64,
    /// Most stall seconds in all (None: any).
    pub stall: Option<f64>,
    /// Most host bytes live at once (None: any).
    pub host_bytes: Option<u64>,
}

impl<'a> Chooser<'a> {
    /// The search over `g` in `order`, nothing offloaded yet. Candidates:
    /// roots in device memory with no views, whose bytes are read or
    /// written by an op, persistent only when a step input.
    pub fn new(g: &'a Graph, order: &[OpId], dev: &'a Device) -> Self {
        let n = order.len();
        let mut place = vec![0usize; g.num_ops()];
        for (i, &o) in order.iter().enumerate() {
            place[o.index()] = i;
        }
        let dur: Vec<f64> = order.iter().map(|&o| dev.op_seconds(g, o)).collect();
        let mut viewed = vec![false; g.num_tensors()];
        for t in g.tensor_ids() {
            if g.tensor(t).view_of.is_some() {
                viewed[g.root(t).index()] = true;
            }
        }
        let mut touch: Vec<Vec<(u32, bool)>> = vec![Vec::new(); n];
        for (p, &o) in order.iter().enumerate() {
            let op = g.op(o);
            for &t in op.inputs.iter().chain(&op.updates) {
                touch[p].push((g.root(t).0, false));
            }
            for &t in op.outputs.iter().chain(&op.updates) {
                touch[p].push((g.root(t).0, true));
            }
        }
        let mut cand_of = vec![u32::MAX; g.num_tensors()];
        let mut profile = vec![0i128; n + 2];
        let mut cands = Vec::new();
        for t in g.tensor_ids().filter(|&t| g.occupies_memory(t)) {
            let x = g.tensor(t);
            let mut uses: Vec<(usize, bool)> = g
                .users_of_root(t)
                .iter()
                .map(|&o| {
                    let op = g.op(o);
                    let w = op.outputs.contains(&t) || op.updates.contains(&t);
                    (place[o.index()], w)
                })
                .collect();
            if let Some(p) = x.producer {
                uses.push((place[p.index()], true));
            }
            uses.sort();
            uses.dedup_by(|b, a| {
                if a.0 == b.0 {
                    a.1 |= b.1;
                    true
                } else {
                    false
                }
            });
            let birth = x.producer.map_or(0, |p| place[p.index()]);
            let persistent = x.lifetime == Lifetime::Persistent;
            let death = if persistent {
                n.saturating_sub(1)
            } else {
                uses.last().map_or(birth, |u| u.0).max(birth)
            };
            add(&mut profile, birth, death, x.size as i128);
            let step_input = x.producer.is_none();
            if viewed[t.index()] || uses.is_empty() || (persistent && !step_input) {
                continue;
            }
            cand_of[t.index()] = cands.len() as u32;
            cands.push(Candidate {
                t,
                size: x.size,
                uses: uses.iter().map(|u| u.0).collect(),
                writes: uses.iter().map(|u| u.1).collect(),
                step_input,
                persistent,
            });
        }
        let plans = cands
            .iter()
            .map(|c| {
                let birth = if c.step_input { 0 } else { c.uses[0] };
                let death = if c.persistent {
                    n.saturating_sub(1)
                } else {
                    *c.uses.last().unwrap()
                };
                TensorPlan {
                    intervals: vec![(birth, death)],
                    residency_of_use: vec![0; c.uses.len()],
                    ..Default::default()
                }
            })
            .collect();
        Chooser {
            dev,
            n,
            links: [Ledger::new(&dur), Ledger::new(&dur)],
            dur,
            touch,
            cand_of,
            rejected: Default::default(),
            decisions: vec![Decision::default(); cands.len()],
            cands,
            plans,
            profile,
            host_profile: vec![0; n + 2],
            stall: 0.0,
        }
    }

    /// The highest device live bytes and the first place it is reached.
    pub fn peak(&self) -> (u64, usize) {
        let mut cur = 0i128;
        let mut best = (0i128, 0usize);
        for (p, d) in self.profile[..self.n].iter().enumerate() {
            cur += d;
            if cur > best.0 {
                best = (cur, p);
            }
        }
        (best.0.max(0) as u64, best.1)
    }

    /// Where a candidate's copies go and how long it is on the device
    /// under `d` (module docs).
    fn plan(&self, i: usize, d: &Decision) -> TensorPlan {
        let c = &self.cands[i];
        let n = self.n;
        let mut groups: Vec<(usize, usize)> = Vec::new();
        let mut lo = 0;
        for i in 0..c.uses.len() {
            if d.cuts.contains(&i) || i + 1 == c.uses.len() {
                groups.push((lo, i));
                lo = i + 1;
            }
        }
        let k = groups.len() - 1;
        let mut tp = TensorPlan {
            residency_of_use: vec![0; c.uses.len()],
            ..Default::default()
        };
        let mut floor = 0usize;
        let mut host: Option<(usize, usize)> = d.host_home.then_some((0, n.saturating_sub(1)));
        for (j, &(lo, hi)) in groups.iter().enumerate() {
            for r in &mut tp.residency_of_use[lo..=hi] {
                *r = j;
            }
            let (first, last) = (c.uses[lo], c.uses[hi]);
            let next = groups.get(j + 1).map_or(n, |g| c.uses[g.0]);
            let start = if d.host_home || j > 0 {
                let secs = self.dev.copy_seconds(c.size, false);
                // After every place it must be away at before its first
                // use, and then as late as leaves the copy time to end.
                let lo_q = d
                    .away
                    .range(floor..first)
                    .next_back()
                    .map_or(floor, |&a| a + 1);
                let (q, have) = self.links[1].latest_start(lo_q, first, secs);
                tp.stall += (secs - have).max(0.0);
                tp.copies.push(Copy {
                    to_host: false,
                    before: q,
                    residency: j,
                    window: (q, first),
                    seconds: secs,
                });
                if let Some(h) = &mut host {
                    h.1 = h.1.max(q);
                }
                q
            } else if c.step_input {
                0
            } else {
                first
            };
            let wrote = (lo..=hi).rev().find(|&i| c.writes[i]).map(|i| c.uses[i]);
            let needs_out = if d.host_home {
                wrote.is_some() && (j < k || c.persistent)
            } else {
                (j == 0 && k > 0) || (j > 0 && j < k && wrote.is_some())
            };
            let end = if needs_out {
                let secs = self.dev.copy_seconds(c.size, true);
                let from = wrote.unwrap_or(first) + 1;
                let ceiling = d.away.range(last + 1..next).next().copied().unwrap_or(next);
                let (o, have) =
                    self.links[0].earliest_end(from.min(last + 1), last + 1, ceiling, secs);
                tp.stall += (secs - have).max(0.0);
                tp.copies.push(Copy {
                    to_host: true,
                    before: o,
                    residency: j,
                    window: (from.min(o), o),
                    seconds: secs,
                });
                if host.is_none() {
                    host = Some((o.saturating_sub(1), o));
                }
                floor = o;
                o - 1
            } else {
                floor = last + 1;
                last
            };
            tp.intervals.push((start, end));
        }
        if let Some(h) = &mut host {
            if let Some(last_in) = tp
                .copies
                .iter()
                .filter(|c| !c.to_host)
                .map(|c| c.before)
                .max()
            {
                h.1 = h.1.max(last_in);
            }
        }
        tp.host = host;
        tp
    }

    /// Books (`sign` 1) or frees (-1) a plan's link time and its bytes in
    /// the profiles.
    fn apply(&mut self, i: usize, sign: i128) {
        let size = self.cands[i].size as i128;
        let tp = &mut self.plans[i];
        for &(a, b) in &tp.intervals {
            add(&mut self.profile, a, b, sign * size);
        }
        if let Some((a, b)) = tp.host {
            add(&mut self.host_profile, a, b, sign * size);
        }
        if sign > 0 {
            self.stall += tp.stall;
            let mut bookings = Vec::new();
            for c in &tp.copies {
                let dir = usize::from(!c.to_host);
                let mut left = c.seconds;
                for p in c.window.0..c.window.1 {
                    if left <= 0.0 {
                        break;
                    }
                    let take = self.links[dir].left(p).min(left);
                    if take > 0.0 {
                        self.links[dir].take(p, take);
                        bookings.push((dir, p, take));
                        left -= take;
                    }
                }
            }
            tp.bookings = bookings;
        } else {
            self.stall -= tp.stall;
            for &(dir, p, s) in &tp.bookings {
                self.links[dir].take(p, -s);
            }
            tp.bookings.clear();
        }
    }

    /// The highest host live bytes over `[a, b]`.
    fn host_peak_over(&self, a: usize, b: usize) -> u64 {
        let mut cur = 0i128;
        let mut best = 0i128;
        for (p, d) in self.host_profile[..=b.min(self.n)].iter().enumerate() {
            cur += d;
            if p >= a {
                best = best.max(cur);
            }
        }
        best.max(0) as u64
    }

    /// One change that takes bytes off the device at the peak, within
    /// `lim`; false when none is left (or the target is met).
    pub fn improve(&mut self, lim: &Limits) -> bool {
        match self.best_change(lim) {
            Some((i, d, tp)) => {
                self.commit(i, d, tp);
                true
            }
            None => false,
        }
    }

    /// [`Chooser::improve`], keeping only changes after which the
    /// simulated step ([`Chooser::simulate`]) takes at most `seconds`;
    /// each refused change is not tried again at its peak.
    pub fn improve_within(&mut self, lim: &Limits, seconds: f64) -> bool {
        while let Some((i, d, tp)) = self.best_change(lim) {
            let at = self.peak().1;
            let old = self.commit(i, d, tp);
            if self.simulate() <= seconds {
                return true;
            }
            self.commit(i, old.0, old.1);
            self.rejected.insert((i, at));
        }
        false
    }

    /// Replaces candidate `i`'s decision and plan; the old ones.
    fn commit(&mut self, i: usize, d: Decision, tp: TensorPlan) -> (Decision, TensorPlan) {
        self.apply(i, -1);
        let old_d = std::mem::replace(&mut self.decisions[i], d);
        let old_tp = std::mem::replace(&mut self.plans[i], tp);
        self.apply(i, 1);
        (old_d, old_tp)
    }

    /// The best change at the peak within `lim` (module docs).
    fn best_change(&mut self, lim: &Limits) -> Option<(usize, Decision, TensorPlan)> {
        self.changes(lim)
            .into_iter()
            .max_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)))
            .map(|(_, _, i, d, tp)| (i, d, tp))
    }

    /// Steps of more places than this take several changes per scan
    /// ([`Chooser::improve_many`]): one scan of a 40,000-op step takes
    /// about 0.1 s here.
    pub const LARGE: usize = 10_000;

    /// [`Chooser::improve`] on a large step: the best changes at the peak,
    /// best first, until they take off what the peak is above the target
    /// (at most 256; each planned as if alone, so their stalls are
    /// estimates). False when there is none.
    pub fn improve_many(&mut self, lim: &Limits) -> bool {
        if self.n <= Self::LARGE {
            return self.improve(lim);
        }
        let (peak, _) = self.peak();
        let mut all = self.changes(lim);
        if all.is_empty() {
            return false;
        }
        all.sort_by(|a, b| b.0.total_cmp(&a.0).then(b.1.cmp(&a.1)));
        let mut off = 0u64;
        for (_, size, i, d, tp) in all.into_iter().take(256) {
            self.commit(i, d, tp);
            off += size;
            if off >= peak.saturating_sub(lim.target) {
                break;
            }
        }
        true
    }

    /// Every change at the peak within `lim`, with its score and bytes.
    #[allow(clippy::type_complexity)]
    fn changes(&mut self, lim: &Limits) -> Vec<(f64, u64, usize, Decision, TensorPlan)> {
        let (peak, at) = self.peak();
        if peak <= lim.target {
            return Vec::new();
        }
        let mut found = Vec::new();
        for i in 0..self.cands.len() {
            if !self.plans[i].covers(at) || self.rejected.contains(&(i, at)) {
                continue;
            }
            let (uses, step_input, size) = {
                let c = &self.cands[i];
                (&c.uses, c.step_input, c.size)
            };
            if uses.binary_search(&at).is_ok() {
                continue;
            }
            let mut d = self.decisions[i].clone();
            if step_input {
                d.host_home = true;
            }
            let gap = uses.partition_point(|&u| u < at);
            if gap > 0 && gap < uses.len() {
                d.cuts.insert(gap - 1);
            }
            d.away.insert(at);
            if d == self.decisions[i] {
                continue;
            }
            self.apply(i, -1);
            let tp = self.plan(i, &d);
            self.apply(i, 1);
            if tp.covers(at) {
                continue;
            }
            let added = (tp.stall - self.plans[i].stall).max(0.0);
            if let Some(s) = lim.stall
                && self.stall + added > s
            {
                continue;
            }
            if let (Some(limit), Some((a, b))) = (lim.host_bytes, tp.host)
                && self.plans[i].host.is_none()
                && self.host_peak_over(a, b) + size > limit
            {
                continue;
            }
            let link: f64 = tp.copies.iter().map(|c| c.seconds).sum();
            let score = size as f64 / (added + 1e-6 * link + 1e-15);
            found.push((score, size, i, d, tp));
        }
        found
    }

    /// The modeled time of the step with the copies chosen so far: what
    /// [`super::timing::simulate`] gives for the rewritten step, computed
    /// here without building it.
    pub fn simulate(&self) -> f64 {
        let n = self.n;
        let mut at: Vec<Vec<(usize, Copy)>> = vec![Vec::new(); n + 1];
        for (i, tp) in self.plans.iter().enumerate() {
            if !self.decisions[i].offloads() {
                continue;
            }
            let mut copies = tp.copies.clone();
            copies.sort_by_key(|c| (c.residency, !c.to_host));
            for c in copies {
                at[c.before].push((i, c));
            }
        }
        let mut ready_root = vec![0.0f64; self.cand_of.len()];
        let mut ready_dev: Vec<Vec<f64>> = self
            .plans
            .iter()
            .map(|tp| vec![0.0; tp.residency_of_use.last().map_or(1, |r| r + 1)])
            .collect();
        let mut ready_host = vec![0.0f64; self.cands.len()];
        let (mut compute, mut d2h, mut h2d) = (0.0f64, 0.0f64, 0.0f64);
        for (p, copies) in at.iter_mut().enumerate() {
            copies.sort_by_key(|(_, c)| !c.to_host);
            for &(i, c) in copies.iter() {
                if c.to_host {
                    let f = ready_dev[i][c.residency].max(d2h) + c.seconds;
                    d2h = f;
                    compute = compute.max(f);
                    ready_host[i] = f;
                } else {
                    let f = compute.max(h2d).max(ready_host[i]) + c.seconds;
                    h2d = f;
                    ready_dev[i][c.residency] = f;
                }
            }
            if p == n {
                break;
            }
            let residency = |i: usize| {
                let c = &self.cands[i];
                let u = c.uses.binary_search(&p).expect("a use at this place");
                self.plans[i].residency_of_use[u]
            };
            let mut start = compute;
            for &(t, w) in &self.touch[p] {
                if w {
                    continue;
                }
                let i = self.cand_of[t as usize];
                let r = if i == u32::MAX {
                    ready_root[t as usize]
                } else {
                    ready_dev[i as usize][residency(i as usize)]
                };
                start = start.max(r);
            }
            let f = start + self.dur[p];
            compute = f;
            for &(t, w) in &self.touch[p] {
                if !w {
                    continue;
                }
                let i = self.cand_of[t as usize];
                if i == u32::MAX {
                    ready_root[t as usize] = f;
                } else {
                    let r = residency(i as usize);
                    ready_dev[i as usize][r] = f;
                }
            }
        }
        compute.max(d2h).max(h2d)
    }

    /// How many tensors it offloads.
    pub fn offloaded(&self) -> usize {
        self.decisions.iter().filter(|d| d.offloads()).count()
    }
}

/// One direction's link time under each place's op: the op's seconds
/// less what copies booked, with prefix sums (a Fenwick tree) so a copy's
/// place is found in logarithmic time.
struct Ledger {
    dur: Vec<f64>,
    busy: Vec<f64>,
    tree: Vec<f64>,
}

impl Ledger {
    fn new(dur: &[f64]) -> Self {
        let mut l = Ledger {
            dur: dur.to_vec(),
            busy: vec![0.0; dur.len()],
            tree: vec![0.0; dur.len() + 1],
        };
        for (p, &d) in dur.iter().enumerate() {
            l.bump(p, d);
        }
        l
    }
    fn bump(&mut self, p: usize, v: f64) {
        let mut i = p + 1;
        while i < self.tree.len() {
            self.tree[i] += v;
            i += i & i.wrapping_neg();
        }
    }
    /// Free seconds under places `[0, p)`.
    fn prefix(&self, p: usize) -> f64 {
        let (mut i, mut s) = (p, 0.0);
        while i > 0 {
            s += self.tree[i];
            i &= i - 1;
        }
        s
    }
    /// Free seconds under place `p`.
    fn left(&self, p: usize) -> f64 {
        (self.dur[p] - self.busy[p]).max(0.0)
    }
    /// Books `secs` under place `p` (negative: frees them).
    fn take(&mut self, p: usize, secs: f64) {
        let before = self.left(p);
        self.busy[p] += secs;
        let after = self.left(p);
        self.bump(p, after - before);
    }
    /// The latest `q` in `[lo, first]` whose places up to `first` leave
    /// `secs` free, or `lo`; and the free seconds from it.
    fn latest_start(&self, lo: usize, first: usize, secs: f64) -> (usize, f64) {
        let end = self.prefix(first);
        if end - self.prefix(lo) < secs {
            return (lo, (end - self.prefix(lo)).max(0.0));
        }
        // prefix(q) <= end - secs holds at lo and fails past some q.
        let (mut a, mut b) = (lo, first);
        while a < b {
            let m = (a + b).div_ceil(2);
            if self.prefix(m) <= end - secs {
                a = m;
            } else {
                b = m - 1;
            }
        }
        (a, (end - self.prefix(a)).max(0.0))
    }
    /// The earliest `o` in `[lo, ceiling]` whose places from `from` leave
    /// `secs` free, or `ceiling`; and the free seconds up to it.
    fn earliest_end(&self, from: usize, lo: usize, ceiling: usize, secs: f64) -> (usize, f64) {
        let start = self.prefix(from);
        if self.prefix(ceiling) - start < secs {
            return (ceiling, (self.prefix(ceiling) - start).max(0.0));
        }
        let (mut a, mut b) = (lo, ceiling);
        while a < b {
            let m = (a + b) / 2;
            if self.prefix(m) - start >= secs {
                b = m;
            } else {
                a = m + 1;
            }
        }
        (a, (self.prefix(a) - start).max(0.0))
    }
}

/// Adds `v` to places `[a, b]` of a difference array.
fn add(diff: &mut [i128], a: usize, b: usize, v: i128) {
    diff[a] += v;
    diff[b + 1] -= v;
}
