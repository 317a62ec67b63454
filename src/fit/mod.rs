//! Fitting a step into a memory budget by recomputation.
//!
//! [`fit`] answers "what is the cheapest way to run this step in `N`
//! bytes?". It chooses forward ops to run a second time in the backward
//! pass (activation recomputation), then orders and lays out the step as
//! [`crate::plan`] does, so the arena is at most `N` bytes; or it says that
//! nothing it can do fits, with the bound that shows it.
//!
//! # The transform ([`recompute`])
//! Recomputing a forward op `p` adds a copy `recompute.p` (kind backward,
//! same type and attributes, so executors run it unchanged) that writes new
//! tensors `recompute.<output>`. Every non-forward op that read an output of
//! `p` reads the copy instead, so the original dies at its last forward use.
//! The copy reads `p`'s inputs, or their copies when their producers are
//! recomputed too (chains recompute from the nearest kept value), and is
//! placed in program order just before the first op that reads it; the
//! planner may move it anywhere its dependencies allow. The graph's
//! metadata names the op each copy copies ([`COPY_OF`]). Ops that only make
//! views of a recomputed output are recomputed with it, since a view keeps
//! its base alive.
//!
//! An op can be recomputed ([`candidates`]) when it is a forward op that
//! updates nothing in place (or whose updates a copy may skip,
//! [`RERUN_WITHOUT_UPDATES`]), its outputs are transient, some non-forward op
//! reads one of them, nothing updates them in place, and none of its inputs
//! is updated in place between the op and that reader (the copy must read
//! the same values). Its price is its cost ([`crate::cost`]).
//!
//! # The choice
//! The search is [`memplan_solver::remat::select`]: exact over subsets for
//! a few candidates, else greedy by bytes freed at the peak per unit of
//! cost, then pruned; every probe is a real plan of the transformed step,
//! so what it reports is what the plan needs. Probes are planned in a
//! short time each ([`FitOptions::probe_time`]); the search gets four
//! fifths of the time limit, and the answer is planned once more with what
//! is left, keeping the lower arena (a large step's probe stops before the
//! planner's improvement passes are done). The result is checked by the independent checker
//! like every plan.
//!
//! [`fit_within`] asks the dual question, "how small does the step get for
//! at most this share more cost?", through
//! [`memplan_solver::remat::select_within`] with the same oracle.
//!
//! # When nothing fits, and how far from the best
//! No recomputation takes a step below its resident bytes plus its largest
//! op's working set ([`fit_floor`]). A budget below that is refused with
//! the op that sets it; a budget above it that the search could not reach
//! is refused with the best peak found, saying that it is not proven.
//! [`fit_within`] also reports the floor of every recomputation within its
//! share ([`floor_within`]): what the ops too costly to run again force to
//! be live at once.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use memplan_solver::remat::{self, Candidate, FitParams, Oracle, Probe};
use memplan_solver::{Budget, Progress};

use crate::cost::{CostModel, OpCost};
use crate::error::Error;
use crate::graph::{Graph, GraphBuilder, Lifetime, OpId, OpKind, OpSpec, TensorId, TensorSpec};
use crate::pipeline::{self, Options};
use crate::plan::Plan;
use crate::timeline::{Timeline, human};

mod floor;
pub(crate) use floor::working_set_where;
pub use floor::{ShareFloor, fit_floor, floor_within};

/// Prefix of recomputed ops and tensors.
pub const PREFIX: &str = "recompute.";

/// An op attribute: `true` says the op's in-place updates are a side
/// effect its outputs do not depend on, and that whoever runs the graph
/// runs a copy without them (the copy lists no updates). Batch norm in
/// training is one: it updates its running statistics, and its outputs
/// use the batch's own; `memplan.torch` runs a copy with no running
/// statistics, so they are updated once, as eager does.
pub const RERUN_WITHOUT_UPDATES: &str = "rerun_without_updates";

/// The recomputed graph's metadata key naming, for each added op, the op
/// of the original step it copies (`{"recompute.p": "p"}`), so a caller
/// maps copies back without reading names (`memplan.torch` runs each copy
/// as its original's captured call).
pub const COPY_OF: &str = "recompute_of";

/// A forward op the fit may run again in the backward pass.
#[derive(Clone, Debug, PartialEq)]
pub struct RematCandidate {
    pub op: OpId,
    /// Bytes of its outputs that non-forward ops read.
    pub bytes: u64,
    /// What running it again costs.
    pub cost: OpCost,
}

fn late(g: &Graph, o: OpId) -> bool {
    g.op(o).kind != OpKind::Forward
}

fn positions(g: &Graph) -> Vec<usize> {
    let mut pos = vec![0; g.num_ops()];
    for (i, &o) in g.program_order().iter().enumerate() {
        pos[o.index()] = i;
    }
    pos
}

/// Program positions of the ops that update each root in place.
fn updaters(g: &Graph, pos: &[usize]) -> Vec<Vec<usize>> {
    let mut up = vec![Vec::new(); g.num_tensors()];
    for o in g.op_ids() {
        for &t in &g.op(o).updates {
            up[g.root(t).index()].push(pos[o.index()]);
        }
    }
    up
}

/// Every op that can be recomputed (see the module docs), in program order.
/// Ops whose outputs only forward ops read are candidates too (with no
/// bytes of their own): they recompute inputs of other candidates.
pub fn candidates(g: &Graph, model: &CostModel) -> Vec<RematCandidate> {
    let pos = positions(g);
    let up = updaters(g, &pos);
    let mut out = Vec::new();
    for &o in g.program_order() {
        let op = g.op(o);
        if op.kind != OpKind::Forward
            || !(op.updates.is_empty() || reruns_without_updates(g, o))
            || op.outputs.is_empty()
            || is_pure_view(g, o)
        {
            continue;
        }
        if op.outputs.iter().any(|&t| {
            g.tensor(t).lifetime == Lifetime::Persistent || !up[g.root(t).index()].is_empty()
        }) {
            continue;
        }
        let mut bytes = 0;
        let mut first_late = usize::MAX;
        for &t in op.outputs.iter().filter(|&&t| g.occupies_memory(t)) {
            let lates = g.users_of_root(t).iter().filter(|&&u| late(g, u));
            if let Some(f) = lates.map(|u| pos[u.index()]).min() {
                bytes += g.tensor(t).size;
                first_late = first_late.min(f);
            }
        }
        let p = pos[o.index()];
        let stale = first_late != usize::MAX
            && op.inputs.iter().any(|&x| {
                up[g.root(x).index()]
                    .iter()
                    .any(|&u| u > p && u < first_late)
            });
        if !stale {
            out.push(RematCandidate {
                op: o,
                bytes,
                cost: model.op(g, o),
            });
        }
    }
    out
}

/// Whether `o`'s in-place updates are a side effect its outputs do not
/// depend on, so a copy may run without them ([`RERUN_WITHOUT_UPDATES`]).
pub fn reruns_without_updates(g: &Graph, o: OpId) -> bool {
    g.op(o)
        .attrs
        .get(RERUN_WITHOUT_UPDATES)
        .and_then(|v| v.as_bool())
        .unwrap_or(false)
}

fn is_pure_view(g: &Graph, o: OpId) -> bool {
    let op = g.op(o);
    op.kind == OpKind::Forward
        && op.updates.is_empty()
        && !op.outputs.is_empty()
        && op.outputs.iter().all(|&t| g.tensor(t).is_view())
}

/// Which ops get a copy, and where: for each op, the program position of
/// the first op that reads its copy (`usize::MAX`: no copy). A chosen op
/// whose copy would read an input after an in-place update of it (so a
/// different value) gets none; ops that read its outputs then read the
/// originals.
fn copy_positions(g: &Graph, chosen: &[OpId], pos: &[usize], up: &[Vec<usize>]) -> Vec<usize> {
    let n = g.num_ops();
    let mut in_r = vec![false; n];
    for &o in chosen {
        in_r[o.index()] = true;
    }
    for &o in g.program_order() {
        let from_r = |x: &TensorId| g.tensor(*x).producer.is_some_and(|p| in_r[p.index()]);
        if !in_r[o.index()] && is_pure_view(g, o) && g.op(o).inputs.iter().any(from_r) {
            in_r[o.index()] = true;
        }
    }
    loop {
        let mut at = vec![usize::MAX; n];
        for &o in g.program_order().iter().rev() {
            if !in_r[o.index()] {
                continue;
            }
            let mut first = usize::MAX;
            for &t in &g.op(o).outputs {
                for &r in g.readers(t) {
                    if late(g, r) {
                        first = first.min(pos[r.index()]);
                    } else if in_r[r.index()] {
                        first = first.min(at[r.index()]);
                    }
                }
            }
            at[o.index()] = first;
        }
        let stale = |o: OpId| {
            let (p, i) = (pos[o.index()], at[o.index()]);
            g.op(o).inputs.iter().any(|&x| {
                let from_copy = g
                    .tensor(x)
                    .producer
                    .is_some_and(|q| at[q.index()] != usize::MAX);
                !from_copy && up[g.root(x).index()].iter().any(|&u| u > p && u < i)
            })
        };
        let bad: Vec<OpId> = g
            .op_ids()
            .filter(|&o| at[o.index()] != usize::MAX && stale(o))
            .collect();
        if bad.is_empty() {
            return at;
        }
        for o in bad {
            in_r[o.index()] = false;
        }
    }
}

/// The step with the ops in `chosen` recomputed (see the module docs).
pub fn recompute(g: &Graph, chosen: &[OpId]) -> Result<Graph, Error> {
    let pos = positions(g);
    let up = updaters(g, &pos);
    let at = copy_positions(g, chosen, &pos, &up);
    let mut b = GraphBuilder::new(g.name.clone());
    for t in g.tensor_ids() {
        b.add_tensor(TensorSpec::from(g.tensor(t)));
    }
    // Copies of the outputs of every copied op.
    let mut copy: Vec<Option<TensorId>> = vec![None; g.num_tensors()];
    let fresh = |name: &str| {
        let mut n = format!("{PREFIX}{name}");
        while g.tensor_by_name(&n).is_some() || g.op_by_name(&n).is_some() {
            n.insert_str(0, "re");
        }
        n
    };
    for &o in g.program_order() {
        if at[o.index()] == usize::MAX {
            continue;
        }
        for &t in &g.op(o).outputs {
            let mut s = TensorSpec::from(g.tensor(t));
            s.name = fresh(&s.name);
            s.lifetime = Lifetime::Transient;
            copy[t.index()] = Some(b.add_tensor(s));
        }
    }
    // Views follow their base to its copy: copies of views, and views that
    // non-forward ops make (they read the copy of the base).
    for t in g.tensor_ids() {
        let Some(base) = g.tensor(t).view_of else {
            continue;
        };
        if let Some(c) = copy[t.index()] {
            b.tensor_spec_mut(c).view_of = Some(copy[base.index()].unwrap_or(base));
        } else if let Some(cb) = copy[base.index()]
            && g.tensor(t).producer.is_some_and(|p| late(g, p))
        {
            b.tensor_spec_mut(t).view_of = Some(cb);
        }
    }
    let read = |t: TensorId| copy[t.index()].unwrap_or(t);

    // Copies go just before their first reader, in program order.
    let mut copies_at: HashMap<usize, Vec<OpId>> = HashMap::new();
    for &o in g.program_order() {
        if at[o.index()] != usize::MAX {
            copies_at.entry(at[o.index()]).or_default().push(o);
        }
    }
    let mut omap = vec![OpId(u32::MAX); g.num_ops()];
    let mut names = Vec::new();
    let mut copy_of = serde_json::Map::new();
    for (i, &o) in g.program_order().iter().enumerate() {
        for &c in copies_at.get(&i).map(Vec::as_slice).unwrap_or(&[]) {
            let op = g.op(c);
            let name = fresh(&op.name);
            copy_of.insert(name.clone(), op.name.clone().into());
            let mut spec = OpSpec::new(name, OpKind::Backward, op.op_type.clone())
                .inputs(op.inputs.iter().map(|&x| read(x)))
                .outputs(op.outputs.iter().map(|&x| read(x)))
                .stream(op.stream);
            for &(out, inp) in &op.reuse {
                spec = spec.reuse(read(out), read(inp));
            }
            spec.cost = op.cost;
            spec.flops = op.flops;
            spec.attrs = op.attrs.clone();
            b.add_op(spec);
            names.push(op.name.clone());
        }
        let op = g.op(o);
        let lt = late(g, o);
        let map = |x: TensorId| if lt { read(x) } else { x };
        if lt && let Some(&t) = op.updates.iter().find(|&&t| copy[t.index()].is_some()) {
            return Err(Error::Unsupported(format!(
                "cannot recompute the producer of {:?}: op {:?} updates it in place",
                g.tensor(t).name,
                op.name
            )));
        }
        let mut spec = OpSpec::new(op.name.clone(), op.kind, op.op_type.clone())
            .inputs(op.inputs.iter().map(|&x| map(x)))
            .outputs(op.outputs.iter().copied())
            .updates(op.updates.iter().copied())
            .stream(op.stream);
        for &(out, inp) in &op.reuse {
            spec = spec.reuse(out, map(inp));
        }
        spec.cost = op.cost;
        spec.flops = op.flops;
        spec.attrs = op.attrs.clone();
        omap[o.index()] = b.add_op(spec);
    }
    // `after` edges, once every op has its new id.
    for o in g.op_ids() {
        let spec = b.op_spec_mut(omap[o.index()]);
        spec.after = g.op(o).after.iter().map(|a| omap[a.index()]).collect();
    }
    let mut out = b.build()?;
    out.metadata = g.metadata.clone();
    out.metadata.insert("recomputed".into(), names.into());
    out.metadata.insert(COPY_OF.into(), copy_of.into());
    Ok(out)
}

/// The ops of `g` that `recomputed` (made by [`recompute`]) copies.
fn copied_ops(g: &Graph, recomputed: &Graph) -> Vec<OpId> {
    let names = recomputed
        .metadata
        .get("recomputed")
        .and_then(|v| v.as_array());
    names
        .into_iter()
        .flatten()
        .filter_map(|n| n.as_str().and_then(|n| g.op_by_name(n)))
        .collect()
}

/// Forward ops that no forward data flows around: every value an earlier
/// forward op made and a later one reads is made by this op. They cut the
/// forward pass into segments (a transformer's residual adds); keeping
/// only their outputs and recomputing the rest is activation
/// checkpointing. In program order.
pub fn segment_boundaries(g: &Graph) -> Vec<OpId> {
    let fwd: Vec<OpId> = g
        .program_order()
        .iter()
        .copied()
        .filter(|&o| g.op(o).kind == OpKind::Forward)
        .collect();
    let n = fwd.len();
    let mut idx = vec![usize::MAX; g.num_ops()];
    for (i, &o) in fwd.iter().enumerate() {
        idx[o.index()] = i;
    }
    // crossing[i]: forward edges a -> b with a < i < b.
    let mut delta = vec![0i64; n + 1];
    for (j, &o) in fwd.iter().enumerate() {
        for &d in g.deps(o) {
            let i = idx[d.index()];
            if i != usize::MAX && i + 1 < j {
                delta[i + 1] += 1;
                delta[j] -= 1;
            }
        }
    }
    let mut crossing = 0;
    let mut out = Vec::new();
    for (i, &o) in fwd.iter().enumerate() {
        crossing += delta[i];
        if crossing == 0 {
            out.push(o);
        }
    }
    out
}

/// Checkpointing-style sets to start the search from: recompute every
/// candidate except the segment boundaries, keeping every boundary, every
/// second one, and so on (every `k`-th boundary kept for `k` = 1, 2, 3, 4).
fn segment_seeds(g: &Graph, cands: &[RematCandidate]) -> Vec<Vec<bool>> {
    let bounds = segment_boundaries(g);
    (1..=4)
        .map(|k| {
            let keep: std::collections::HashSet<OpId> = bounds.iter().step_by(k).copied().collect();
            cands.iter().map(|c| !keep.contains(&c.op)).collect()
        })
        .collect()
}

/// The shares of the step's cost a budget's search first caps its greedy
/// descent at, in turn ([`remat::select`]'s ladder): a cheap fit is found
/// before an expensive one.
const LADDER_SHARES: [f64; 3] = [0.001, 0.01, 0.1];

/// What the fit minimises.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "cli", derive(clap::ValueEnum))]
pub enum Objective {
    /// The estimated added time (the cost model's roofline, or `cost`).
    #[default]
    Time,
    /// The added floating-point operations.
    Flops,
}

/// How to fit.
#[derive(Clone, Debug)]
pub struct FitOptions {
    /// The most bytes the plan's arena may take.
    pub budget: u64,
    /// Wall-clock budget of the whole fit.
    pub time_limit: Duration,
    /// Time limit of each trial plan.
    pub probe_time: Duration,
    pub cost_model: CostModel,
    pub search: FitParams,
    pub objective: Objective,
    /// Counters the fit updates (plans made, best peak), for a progress
    /// bar.
    pub progress: Option<Arc<Progress>>,
}

impl Default for FitOptions {
    fn default() -> Self {
        FitOptions {
            budget: u64::MAX,
            time_limit: Duration::from_secs(60),
            probe_time: Duration::from_millis(1500),
            cost_model: CostModel::default(),
            search: FitParams::default(),
            objective: Objective::default(),
            progress: None,
        }
    }
}

/// A step fitted into a budget.
#[derive(Clone, Debug)]
pub struct Fitted {
    /// The step with the recomputation added.
    pub graph: Graph,
    /// Its plan (checked).
    pub plan: Plan,
    /// The ops recomputed (names in the original step).
    pub recomputed: Vec<String>,
    /// What the recomputation adds.
    pub added: OpCost,
    /// What the step itself costs.
    pub step: OpCost,
    /// The planned arena without recomputation.
    pub base_arena: u64,
    pub budget: u64,
    /// With [`fit_within`]: the added cost allowed, as a share of the
    /// step's.
    pub max_added: Option<f64>,
    /// Whether no cheaper choice fits (exact search); with [`fit_within`],
    /// whether no affordable choice peaks lower.
    pub optimal: bool,
    pub candidates: usize,
    pub probes: usize,
    pub seconds: f64,
    /// With [`fit_within`]: no recomputation within the share, in any
    /// order, needs less ([`floor_within`]).
    pub share_floor: Option<ShareFloor>,
}

impl Fitted {
    /// The fit's figures as JSON (`memplan fit --json`; the bindings add
    /// the graph and plan documents).
    pub fn summary_json(&self) -> serde_json::Value {
        serde_json::json!({
            "graph": self.graph.name,
            "budget_bytes": self.budget,
            "max_added_share": self.max_added,
            "arena_bytes": self.plan.arena_bytes,
            "max_live_bytes": self.plan.stats.max_live_bytes,
            "lower_bound_bytes": self.plan.stats.lower_bound_bytes,
            "no_recompute_arena_bytes": self.base_arena,
            "recomputed_ops": self.recomputed,
            "added_flops": self.added.flops,
            "added_seconds_estimate": self.added.seconds,
            "step_flops": self.step.flops,
            "step_seconds_estimate": self.step.seconds,
            "optimal": self.optimal,
            "candidates": self.candidates,
            "probes": self.probes,
            "solve_seconds": self.seconds,
            "share_floor_bytes": self.share_floor.as_ref().map(|f| f.bytes),
            "share_floor_why": self.share_floor.as_ref().map(|f| f.why.clone()),
            "share_floor_finished": self.share_floor.as_ref().map(|f| f.finished),
            "share_floor_anchors": self.share_floor.as_ref().map(|f| f.anchors),
        })
    }
}

/// The planner as the search's oracle: one plan per set of choices.
struct Planner<'a> {
    g: &'a Graph,
    cands: &'a [RematCandidate],
    /// Candidate index of each op.
    index: Vec<Option<usize>>,
    opts: Options,
    plans: HashMap<Vec<bool>, Plan>,
    /// Why the last probe that failed to plan failed.
    failed: Option<String>,
    progress: Option<Arc<Progress>>,
}

impl Planner<'_> {
    fn chosen_ops(&self, chosen: &[bool]) -> Vec<OpId> {
        self.cands
            .iter()
            .zip(chosen)
            .filter(|(_, c)| **c)
            .map(|(c, _)| c.op)
            .collect()
    }

    /// The group recomputing candidate `c` needs at step `s` of `tl`, and
    /// the bytes it would free there: `c` with the producers of the inputs
    /// it would otherwise keep alive (recursively, a few ops deep); the
    /// gain is the group's backward-read outputs live across `s`, less the
    /// inputs it still keeps alive.
    fn group_at(
        &self,
        g: &Graph,
        c: usize,
        tl: &Timeline,
        pos: &[usize],
        s: usize,
        chosen: &[bool],
    ) -> (Vec<usize>, u64) {
        let live_at =
            |r: TensorId| tl.intervals[r.index()].is_some_and(|iv| iv.first <= s && iv.last >= s);
        let across =
            |r: TensorId| tl.intervals[r.index()].is_some_and(|iv| iv.first < s && iv.last > s);
        let mut group = vec![c];
        let mut kept = 0u64;
        let mut i = 0;
        while i < group.len() {
            let op = g.op(self.cands[group[i]].op);
            i += 1;
            for &x in &op.inputs {
                let r = g.root(x);
                if !g.occupies_memory(r)
                    || g.tensor(r).lifetime == Lifetime::Persistent
                    || live_at(r)
                {
                    continue;
                }
                match g.tensor(r).producer.and_then(|p| self.index[p.index()]) {
                    Some(k) if chosen[k] || group.contains(&k) => {}
                    Some(k) if group.len() < MAX_GROUP => group.push(k),
                    _ => kept += g.tensor(r).size,
                }
            }
        }
        let mut held = 0u64;
        for &k in &group {
            let o = self.cands[k].op;
            if pos[o.index()] >= s {
                return (group, 0);
            }
            held += g
                .op(o)
                .outputs
                .iter()
                .filter(|&&t| g.occupies_memory(t) && across(t))
                .filter(|&&t| g.users_of_root(t).iter().any(|&u| late(g, u)))
                .map(|&t| g.tensor(t).size)
                .sum::<u64>();
        }
        (group, held.saturating_sub(kept))
    }
}

/// The share of a fit's time limit held back from the search, to plan its
/// answer once more ([`Planner::fitted`]).
const ANSWER_SHARE: f64 = 0.2;

/// The search's part of `opts.time_limit`: all but [`ANSWER_SHARE`] of it.
fn search_time(opts: &FitOptions) -> Duration {
    opts.time_limit.mul_f64(1.0 - ANSWER_SHARE)
}

/// Most candidates one greedy step takes together.
const MAX_GROUP: usize = 8;

impl Oracle for Planner<'_> {
    fn best_changed(&mut self, peak: u64, _cost: f64) {
        if let Some(p) = &self.progress {
            p.best_peak.store(peak, Ordering::Relaxed);
        }
    }

    fn probe(&mut self, chosen: &[bool]) -> Probe {
        if let Some(p) = &self.progress {
            p.part_done();
        }
        let planned = recompute(self.g, &self.chosen_ops(chosen))
            .and_then(|g| pipeline::plan(&g, &self.opts).map(|p| (g, p)));
        let (g, plan) = match planned {
            Ok(x) => x,
            Err(e) => {
                self.failed = Some(e.to_string());
                return Probe {
                    peak: u64::MAX,
                    ..Default::default()
                };
            }
        };
        let tl = Timeline::of_plan(&g, &plan);
        let s = tl.peak_step();
        let mut pos = vec![0; g.num_ops()];
        for (i, &o) in plan.order.iter().enumerate() {
            pos[o.index()] = i;
        }
        // The candidates keep their op and tensor ids in the transformed
        // step (copies are added after them).
        let idle = self
            .cands
            .iter()
            .enumerate()
            .filter(|&(i, c)| !chosen[i] && c.bytes > 0)
            .map(|(i, _)| self.group_at(&g, i, &tl, &pos, s, chosen))
            .filter(|(_, b)| *b > 0)
            .collect();
        let copied = copied_ops(self.g, &g);
        let unused = (0..chosen.len())
            .filter(|&i| chosen[i] && !copied.contains(&self.cands[i].op))
            .collect();
        let probe = Probe {
            peak: plan.arena_bytes,
            idle,
            proven: plan.arena_bytes <= plan.stats.lower_bound_bytes,
            unused,
        };
        self.plans.insert(chosen.to_vec(), plan);
        probe
    }
}

impl<'a> Planner<'a> {
    fn new(g: &'a Graph, cands: &'a [RematCandidate], opts: &FitOptions) -> Self {
        let mut index = vec![None; g.num_ops()];
        for (i, c) in cands.iter().enumerate() {
            index[c.op.index()] = Some(i);
        }
        Planner {
            g,
            cands,
            index,
            opts: Options {
                time_limit: opts.probe_time,
                layouts: 1,
                ..Options::default()
            },
            plans: HashMap::new(),
            failed: None,
            progress: opts.progress.clone(),
        }
    }

    /// The arena without recomputation (the search's first probe).
    fn base_arena(&self) -> Result<u64, Error> {
        match self.plans.get(&vec![false; self.cands.len()]) {
            Some(base) => Ok(base.arena_bytes),
            None => Err(Error::Solver(format!(
                "planning {:?} failed: {}",
                self.g.name,
                self.failed.clone().unwrap_or_default()
            ))),
        }
    }

    /// The fitted step of the search's answer, checked, with its cost. The
    /// answer's probe was planned in a probe's time; unless that plan is
    /// at its lower bound, the step is planned again with what is left of
    /// the fit's time limit, counted from `start` (when that is longer than
    /// a probe's), and the lower of the two arenas is kept. A large step's
    /// probe stops before the planner's improvement passes are done.
    fn fitted(
        mut self,
        sel: &remat::Selection,
        opts: &FitOptions,
        start: Instant,
    ) -> Result<Fitted, Error> {
        let g = self.g;
        let base_arena = self.base_arena()?;
        let chosen = self.chosen_ops(&sel.chosen);
        let graph = recompute(g, &chosen)?;
        let mut plan = self
            .plans
            .remove(&sel.chosen)
            .expect("the search planned its answer");
        let left = opts.time_limit.saturating_sub(start.elapsed());
        if plan.arena_bytes > plan.stats.lower_bound_bytes && left > self.opts.time_limit {
            let again = pipeline::plan(
                &graph,
                &Options {
                    time_limit: left,
                    ..Options::default()
                },
            );
            if let Ok(again) = again
                && again.arena_bytes < plan.arena_bytes
            {
                plan = again;
                if let Some(p) = &self.progress {
                    p.best_peak.store(plan.arena_bytes, Ordering::Relaxed);
                }
            }
        }
        crate::checker::check(&graph, &plan)?;
        // What was copied: chosen ops that nothing needs get no copy and cost
        // nothing; ops that only make views come with their base.
        let copied = copied_ops(g, &graph);
        let mut added = OpCost::default();
        for &o in &copied {
            added += opts.cost_model.op(g, o);
        }
        Ok(Fitted {
            recomputed: copied.iter().map(|&o| g.op(o).name.clone()).collect(),
            added,
            step: opts.cost_model.total(g),
            base_arena,
            budget: opts.budget,
            max_added: None,
            optimal: sel.optimal,
            candidates: self.cands.len(),
            probes: sel.probes,
            seconds: 0.0,
            share_floor: None,
            graph,
            plan,
        })
    }
}

/// The candidates as the search sees them: their cost in the objective's
/// unit.
fn search_candidates(cands: &[RematCandidate], objective: Objective) -> Vec<Candidate> {
    cands
        .iter()
        .map(|c| Candidate {
            cost: objective.of(&c.cost),
            bytes: c.bytes,
        })
        .collect()
}

impl Objective {
    /// The part of `cost` this objective counts.
    pub fn of(self, cost: &OpCost) -> f64 {
        match self {
            Objective::Time => cost.seconds,
            Objective::Flops => cost.flops,
        }
    }
}

/// The share of the time limit [`fit_within`] gives [`floor_within`].
const FLOOR_SHARE: f64 = 0.05;

/// Fits `g` into `opts.budget` bytes; see the module docs.
pub fn fit(g: &Graph, opts: &FitOptions) -> Result<Fitted, Error> {
    let start = Instant::now();
    let step = opts.objective.of(&opts.cost_model.checked_total(g)?);
    let (floor, why) = fit_floor(g);
    if opts.budget < floor {
        return Err(Error::DoesNotFit(format!(
            "no plan of {:?} fits in {} ({} bytes), with or without recomputation: it needs at least {} ({} bytes): {why}",
            g.name,
            human(opts.budget),
            opts.budget,
            human(floor),
            floor
        )));
    }
    let cands = candidates(g, &opts.cost_model);
    let mut planner = Planner::new(g, &cands, opts);
    let time = Budget::new(search_time(opts));
    let seeds = segment_seeds(g, &cands);
    let ladder = LADDER_SHARES.map(|share| share * step);
    let sel = remat::select(
        &search_candidates(&cands, opts.objective),
        opts.budget,
        &mut planner,
        &opts.search,
        &time,
        &seeds,
        &ladder,
    );
    planner.base_arena()?;
    if !sel.fits {
        let how = if sel.proven_infeasible {
            "proven: every choice of recomputation was planned to its lower bound".to_string()
        } else {
            format!(
                "not proven: no plan needs less than {} ({} bytes) whatever is recomputed ({why})",
                human(floor),
                floor
            )
        };
        return Err(Error::DoesNotFit(format!(
            "no plan of {:?} found within {} ({} bytes): the best needs {} ({} bytes) recomputing {} of {} candidate ops; {how}",
            g.name,
            human(opts.budget),
            opts.budget,
            human(sel.peak),
            sel.peak,
            sel.chosen.iter().filter(|&&c| c).count(),
            cands.len(),
        )));
    }
    let mut f = planner.fitted(&sel, opts, start)?;
    f.seconds = start.elapsed().as_secs_f64();
    Ok(f)
}

/// The smallest arena found whose recomputation adds at most `max_added`
/// times the whole step's cost (in `opts.objective`'s unit: `0.001` is
/// 0.1% more FLOPs or estimated time); `opts.budget` is not used. The
/// answer's `budget` is its own arena. With `max_added` 0 it is the plan
/// without recomputation. See [`memplan_solver::remat::select_within`].
pub fn fit_within(g: &Graph, max_added: f64, opts: &FitOptions) -> Result<Fitted, Error> {
    let start = Instant::now();
    check_share(max_added)?;
    let cands = candidates(g, &opts.cost_model);
    let mut planner = Planner::new(g, &cands, opts);
    let time = Budget::new(search_time(opts));
    let seeds = segment_seeds(g, &cands);
    let step = opts.objective.of(&opts.cost_model.checked_total(g)?);
    let prices: Vec<f64> = g
        .op_ids()
        .map(|o| opts.objective.of(&opts.cost_model.op(g, o)))
        .collect();
    let floor = floor_within(
        g,
        &prices,
        max_added * step,
        Some(start + opts.time_limit.mul_f64(FLOOR_SHARE)),
    );
    let sel = remat::select_within(
        &search_candidates(&cands, opts.objective),
        max_added * step,
        &mut planner,
        &opts.search,
        &time,
        &seeds,
    );
    let mut f = planner.fitted(&sel, opts, start)?;
    f.budget = f.plan.arena_bytes;
    f.max_added = Some(max_added);
    f.optimal |= f.plan.arena_bytes <= floor.bytes;
    f.share_floor = Some(floor);
    f.seconds = start.elapsed().as_secs_f64();
    Ok(f)
}

/// The share of `g`'s own cost that recomputation may add when `g`
/// already adds `already_flops` FLOPs to the step it was made from (a
/// split's additions) and at most `max_added` of that step's cost may be
/// added in all: `already_flops` count at `g`'s own FLOP rate (their time
/// too, with the time objective). `None` when they alone exceed the share.
pub fn share_after(
    g: &Graph,
    max_added: f64,
    already_flops: f64,
    opts: &FitOptions,
) -> Result<Option<f64>, Error> {
    check_share(max_added)?;
    if !(already_flops.is_finite() && already_flops >= 0.0) {
        return Err(Error::InvalidArgument(format!(
            "the FLOPs a graph already adds must be 0 or more, not {already_flops}"
        )));
    }
    let step = opts.cost_model.checked_total(g)?;
    let rate = if step.flops > 0.0 {
        step.seconds / step.flops
    } else {
        0.0
    };
    let already = opts.objective.of(&crate::cost::OpCost {
        flops: already_flops,
        seconds: already_flops * rate,
        bytes: 0,
    });
    let whole = opts.objective.of(&step);
    let left = max_added * (whole - already) - already;
    if left < 0.0 {
        return Ok(None);
    }
    Ok(Some(if whole > 0.0 { left / whole } else { 0.0 }))
}

/// [`fit_within`] for a graph that already adds `already_flops` FLOPs to
/// the step it was made from ([`share_after`]): `max_added` is a share of
/// that step's cost, and those FLOPs count against it. An error
/// ([`Error::DoesNotFit`]) when they alone exceed it.
pub fn fit_within_after(
    g: &Graph,
    max_added: f64,
    already_flops: f64,
    opts: &FitOptions,
) -> Result<Fitted, Error> {
    let Some(share) = share_after(g, max_added, already_flops, opts)? else {
        return Err(Error::DoesNotFit(format!(
            "{}: the graph already adds {already_flops:.0} FLOPs to the step it was made from, more than max_added={max_added} of that step's cost allows",
            g.name
        )));
    };
    let mut f = fit_within(g, share, opts)?;
    f.max_added = Some(max_added);
    Ok(f)
}

/// Refuses an added-cost share that is negative or not finite.
pub(crate) fn check_share(max_added: f64) -> Result<(), Error> {
    if max_added.is_finite() && max_added >= 0.0 {
        return Ok(());
    }
    Err(Error::InvalidArgument(format!(
        "the added cost allowed must be a share of the step's cost, 0 or more, not {max_added}"
    )))
}

/// One point of the budget / added-cost curve.
#[derive(Clone, Debug, PartialEq)]
pub struct ParetoPoint {
    pub budget: u64,
    /// The fitted plan's arena, or `None` when nothing was found within
    /// the budget.
    pub arena: Option<u64>,
    pub added: OpCost,
    pub recomputed: usize,
    pub optimal: bool,
}

/// Fits `g` into each budget of `budgets` (largest first), sharing
/// `opts.time_limit` between them; stops at the first budget below the
/// floor ([`fit_floor`]).
pub fn pareto(g: &Graph, budgets: &[u64], opts: &FitOptions) -> Vec<ParetoPoint> {
    let mut budgets = budgets.to_vec();
    budgets.sort_unstable_by(|a, b| b.cmp(a));
    let (floor, _) = fit_floor(g);
    let each = opts.time_limit.div_f64(budgets.len().max(1) as f64);
    let mut out = Vec::new();
    for budget in budgets.into_iter().take_while(|&b| b >= floor) {
        let o = FitOptions {
            budget,
            time_limit: each,
            ..opts.clone()
        };
        out.push(match fit(g, &o) {
            Ok(f) => ParetoPoint {
                budget,
                arena: Some(f.plan.arena_bytes),
                added: f.added,
                recomputed: f.recomputed.len(),
                optimal: f.optimal,
            },
            Err(_) => ParetoPoint {
                budget,
                arena: None,
                added: OpCost::default(),
                recomputed: 0,
                optimal: false,
            },
        });
    }
    out
}
