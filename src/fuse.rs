//! Regions of a planned order for a compiler to fuse, and the fused
//! program's graph, planned and checked like any other.
//!
//! A compiler (Inductor) turns a run of ops into a few kernels: the
//! intermediates a region makes and uses up inside never reach memory as
//! tensors of their own, but everything the region reads stays live until
//! its last kernel, and every tensor it hands on is live from its first.
//! [`fuse`] walks the planned order and grows each region over consecutive
//! ops while
//! - the op can be compiled: it writes nothing in place (no optimizer
//!   update, no random draw: those update a generator's state tensor),
//!   is no collective, no copy between memories and none of the driver's
//!   own ops (`memplan.*`), and the caller did not exclude it;
//! - the region holds at most [`Options::max_ops`] ops;
//! - the fused program's live bytes at the region stay within
//!   [`Options::limit`] (by default the order's own max live), so fusing
//!   never raises the step's peak above the plan's.
//!
//! The fused graph has one op per region (type [`FUSED`], named
//! `fused<k>`, attribute `ops`: the names of the ops it stands for) in the
//! region's place in the order:
//! - its inputs are the tensors the region reads and did not make;
//! - its outputs are the tensors it makes that an op after it uses (or
//!   the step keeps), with the bases of such views;
//! - a `fused<k>.workspace` temporary, output by the region and read by
//!   nothing, holds what the region's dropped intermediates need: their
//!   most bytes live at once in the planned order. A compiler that
//!   materialises some of them (a matrix product's result feeding a fused
//!   epilogue) has that room; one that fuses them away needs less.
//!
//! Regions of one op are not fused (nothing to gain). The fused graph
//! lists its ops in the fused order, so its program order is that order,
//! and its plan lays out that order ([`crate::baselines::order_with_layout`]).

use std::collections::HashSet;

use crate::error::Error;
use crate::graph::{
    COPY_TO_DEVICE, COPY_TO_HOST, Graph, GraphBuilder, Lifetime, OpId, OpKind, OpSpec, Role,
    TensorId, TensorSpec,
};
use crate::plan::Plan;
use crate::timeline::Timeline;

/// The op type of a fused region in the fused graph.
pub const FUSED: &str = "memplan.fused";

/// How regions are chosen.
#[derive(Clone, Debug)]
pub struct Options {
    /// Most live bytes the fused program may have at a region (None: the
    /// order's max live without reuses).
    pub limit: Option<u64>,
    /// Most ops in one region.
    pub max_ops: usize,
    /// Ops (by name) never put in a region.
    pub exclude: HashSet<String>,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            limit: None,
            max_ops: 512,
            exclude: HashSet::new(),
        }
    }
}

/// One fused region: a run of consecutive ops of the order.
#[derive(Clone, Debug, PartialEq)]
pub struct Region {
    /// Its op in the fused graph.
    pub name: String,
    /// The ops it stands for, in order (ids of the original graph).
    pub ops: Vec<OpId>,
    /// What it reads and did not make (original ids).
    pub inputs: Vec<TensorId>,
    /// What it makes and hands on (original ids).
    pub outputs: Vec<TensorId>,
    /// Bytes of its workspace (module docs).
    pub workspace: u64,
}

/// The regions, the fused graph, its order and its checked plan.
#[derive(Clone, Debug)]
pub struct Fused {
    pub regions: Vec<Region>,
    pub graph: Graph,
    pub order: Vec<OpId>,
    pub plan: Plan,
    /// Max live of the given order without reuses (what [`Options::limit`]
    /// defaults to).
    pub unfused_max_live: u64,
    /// Ops of the order inside a region.
    pub fused_ops: usize,
}

/// Whether op `o` may be compiled into a region.
fn compilable(g: &Graph, o: OpId, opts: &Options) -> bool {
    let op = g.op(o);
    op.updates.is_empty()
        && op.kind != OpKind::Collective
        && !op.op_type.starts_with("memplan.")
        && op.op_type != COPY_TO_HOST
        && op.op_type != COPY_TO_DEVICE
        && !opts.exclude.contains(&op.name)
        && op.inputs.iter().chain(&op.outputs).all(|&t| !g.on_host(t))
}

/// Where each op and tensor sits in the order.
struct Places {
    step: Vec<usize>,
    timeline: Timeline,
    /// Bytes of the tensors produced at each step that own memory.
    made_at: Vec<u64>,
}

impl Places {
    fn new(g: &Graph, order: &[OpId]) -> Places {
        let mut step = vec![0; g.num_ops()];
        for (i, &o) in order.iter().enumerate() {
            step[o.index()] = i;
        }
        let timeline = Timeline::of_order(g, order, &[]);
        let mut made_at = vec![0; order.len()];
        for t in g.tensor_ids() {
            if let (Some(p), true) = (g.tensor(t).producer, g.occupies_memory(t)) {
                made_at[step[p.index()]] += g.tensor(t).size;
            }
        }
        Places {
            step,
            timeline,
            made_at,
        }
    }

    /// Whether root `t`, made in the region ending at step `b`, is handed
    /// on (used later or kept by the step).
    fn handed_on(&self, g: &Graph, t: TensorId, b: usize) -> bool {
        let x = g.tensor(t);
        x.lifetime == Lifetime::Persistent
            || x.role == Role::Output
            || self.timeline.intervals[t.index()].is_some_and(|i| i.last > b)
    }

    /// Live bytes of the fused program at the region of steps `a..=b`
    /// (module docs): what is live at `a` and was made before, what the
    /// region hands on, and its workspace.
    fn fused_live(&self, g: &Graph, order: &[OpId], a: usize, b: usize) -> u64 {
        let before = self.timeline.total[a] - self.made_at[a];
        let mut kept = 0;
        let mut delta = vec![0i128; b - a + 2];
        for &o in &order[a..=b] {
            for &t in &g.op(o).outputs {
                if !g.occupies_memory(t) {
                    continue;
                }
                let size = g.tensor(t).size;
                if self.handed_on(g, t, b) {
                    kept += size;
                } else if let Some(i) = self.timeline.intervals[t.index()] {
                    delta[i.first - a] += size as i128;
                    delta[i.last.min(b) - a + 1] -= size as i128;
                }
            }
        }
        before + kept + workspace(&delta)
    }
}

/// Most bytes live at once from a difference array.
fn workspace(delta: &[i128]) -> u64 {
    let mut acc = 0i128;
    let mut most = 0i128;
    for d in delta {
        acc += d;
        most = most.max(acc);
    }
    most as u64
}

/// Chooses the regions of `order` (a valid order of `g`, every op once)
/// and builds the fused graph (module docs).
pub fn fuse(g: &Graph, order: &[OpId], opts: &Options) -> Result<Fused, Error> {
    if order.len() != g.num_ops() {
        return Err(Error::InvalidArgument(format!(
            "the order lists {} ops; the graph has {}",
            order.len(),
            g.num_ops()
        )));
    }
    if opts.max_ops == 0 {
        return Err(Error::InvalidArgument(
            "max_ops must be at least 1 (1: nothing is fused)".into(),
        ));
    }
    let places = Places::new(g, order);
    let unfused = places.timeline.peak;
    let limit = opts.limit.unwrap_or(unfused);
    let spans = spans(g, order, opts, &places, limit);
    let regions: Vec<Region> = spans
        .iter()
        .enumerate()
        .map(|(k, &(a, b))| region(g, order, &places, k, a, b))
        .collect();
    let (graph, new_order) = fused_graph(g, order, &spans, &regions)?;
    let plan = crate::baselines::order_with_layout(&graph, &new_order, "fused");
    crate::checker::check(&graph, &plan)
        .map_err(|e| Error::Internal(format!("the fused step's plan fails the checker: {e}")))?;
    Ok(Fused {
        fused_ops: regions.iter().map(|r| r.ops.len()).sum(),
        regions,
        graph,
        order: new_order,
        plan,
        unfused_max_live: unfused,
    })
}

/// The regions as step ranges `(a, b)`, inclusive, at least two ops each.
fn spans(
    g: &Graph,
    order: &[OpId],
    opts: &Options,
    places: &Places,
    limit: u64,
) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut a = 0;
    while a < order.len() {
        if !compilable(g, order[a], opts) {
            a += 1;
            continue;
        }
        let mut b = a;
        while b + 1 < order.len()
            && b + 1 - a < opts.max_ops
            && compilable(g, order[b + 1], opts)
            && places.fused_live(g, order, a, b + 1) <= limit
        {
            b += 1;
        }
        if b > a {
            out.push((a, b));
        }
        a = b + 1;
    }
    out
}

/// Region `k` over steps `a..=b`.
fn region(g: &Graph, order: &[OpId], places: &Places, k: usize, a: usize, b: usize) -> Region {
    let ops = order[a..=b].to_vec();
    let inside = |t: TensorId| {
        g.tensor(t)
            .producer
            .is_some_and(|p| (a..=b).contains(&places.step[p.index()]))
    };
    let mut inputs = Vec::new();
    let mut seen = HashSet::new();
    for &o in &ops {
        for &t in &g.op(o).inputs {
            if !inside(t) && seen.insert(t) {
                inputs.push(t);
            }
        }
    }
    // What is used after the region or kept, then the views' bases.
    let mut kept: HashSet<TensorId> = HashSet::new();
    for &o in &order[b + 1..] {
        let op = g.op(o);
        kept.extend(
            op.inputs
                .iter()
                .chain(&op.updates)
                .copied()
                .filter(|&t| inside(t)),
        );
    }
    for &o in &ops {
        for &t in &g.op(o).outputs {
            let x = g.tensor(t);
            if x.lifetime == Lifetime::Persistent || x.role == Role::Output {
                kept.insert(t);
            }
        }
    }
    let mut chain: Vec<TensorId> = kept.iter().copied().collect();
    while let Some(t) = chain.pop() {
        if let Some(base) = g.tensor(t).view_of
            && inside(base)
            && kept.insert(base)
        {
            chain.push(base);
        }
    }
    let outputs: Vec<TensorId> = ops
        .iter()
        .flat_map(|&o| g.op(o).outputs.iter().copied())
        .filter(|t| kept.contains(t))
        .collect();
    let mut delta = vec![0i128; b - a + 2];
    for &o in &ops {
        for &t in &g.op(o).outputs {
            if g.occupies_memory(t)
                && !kept.contains(&t)
                && let Some(i) = places.timeline.intervals[t.index()]
            {
                let size = g.tensor(t).size as i128;
                delta[i.first - a] += size;
                delta[i.last.min(b) - a + 1] -= size;
            }
        }
    }
    Region {
        name: format!("fused{k}"),
        ops,
        inputs,
        outputs,
        workspace: workspace(&delta),
    }
}

/// Every tensor of `g` once, each base before its views. A graph's list
/// need not be in that order: recomputation appends a recomputed base
/// after the views that the recorded ops it feeds already made of it.
fn bases_first(g: &Graph) -> Vec<TensorId> {
    let mut listed = vec![false; g.num_tensors()];
    let mut out = Vec::with_capacity(g.num_tensors());
    for t in g.tensor_ids() {
        let mut chain = vec![t];
        while let Some(v) = g.tensor(*chain.last().expect("not empty")).view_of {
            if listed[v.index()] {
                break;
            }
            chain.push(v);
        }
        for &u in chain.iter().rev() {
            if !listed[u.index()] {
                listed[u.index()] = true;
                out.push(u);
            }
        }
    }
    out
}

/// The graph with one op per region, listed in the fused order.
fn fused_graph(
    g: &Graph,
    order: &[OpId],
    spans: &[(usize, usize)],
    regions: &[Region],
) -> Result<(Graph, Vec<OpId>), Error> {
    // Which tensors the fused graph drops: made in a region, not handed on.
    let mut dropped = vec![false; g.num_tensors()];
    let mut region_at = vec![None; order.len()];
    for (k, (&(a, b), r)) in spans.iter().zip(regions).enumerate() {
        let out: HashSet<TensorId> = r.outputs.iter().copied().collect();
        for (p, &o) in order.iter().enumerate().take(b + 1).skip(a) {
            region_at[p] = Some(k);
            for &t in &g.op(o).outputs {
                dropped[t.index()] = !out.contains(&t);
            }
        }
    }
    let mut b = GraphBuilder::new(g.name.clone());
    let mut id = vec![None; g.num_tensors()];
    for t in bases_first(g) {
        if dropped[t.index()] {
            continue;
        }
        let mut spec = TensorSpec::from(g.tensor(t));
        spec.view_of = match spec.view_of {
            None => None,
            Some(v) => Some(id[v.index()].ok_or_else(|| {
                Error::Internal(format!(
                    "fuse: tensor {:?} is kept but its base {:?} is dropped",
                    g.tensor(t).name,
                    g.tensor(v).name
                ))
            })?),
        };
        id[t.index()] = Some(b.add_tensor(spec));
    }
    let map = |ts: &[TensorId]| -> Vec<TensorId> {
        ts.iter()
            .map(|t| id[t.index()].expect("a kept op's tensors are kept"))
            .collect()
    };
    let mut op_id = vec![OpId(u32::MAX); g.num_ops()];
    let mut new_order = Vec::new();
    let mut p = 0;
    while p < order.len() {
        let spec = match region_at[p] {
            None => {
                let o = g.op(order[p]);
                let mut spec = OpSpec::from(o);
                spec.inputs = map(&o.inputs);
                spec.outputs = map(&o.outputs);
                spec.updates = map(&o.updates);
                spec.reuse = map(&o.reuse.iter().map(|r| r.0).collect::<Vec<_>>())
                    .into_iter()
                    .zip(map(&o.reuse.iter().map(|r| r.1).collect::<Vec<_>>()))
                    .collect();
                spec.after = o.after.iter().map(|a| op_id[a.index()]).collect();
                p += 1;
                spec
            }
            Some(k) => {
                let r = &regions[k];
                p += r.ops.len();
                region_op(g, r, &map, &op_id, &mut b)
            }
        };
        let new = b.add_op(spec);
        new_order.push(new);
        let first = p - 1;
        match region_at[first] {
            Some(k) => regions[k].ops.iter().for_each(|o| op_id[o.index()] = new),
            None => op_id[order[first].index()] = new,
        }
    }
    let mut out = b
        .build()
        .map_err(|e| Error::Internal(format!("the fused step is not a valid graph: {e}")))?;
    out.metadata = g.metadata.clone();
    Ok((out, new_order))
}

/// The fused graph's op of region `r`.
fn region_op(
    g: &Graph,
    r: &Region,
    map: &dyn Fn(&[TensorId]) -> Vec<TensorId>,
    op_id: &[OpId],
    b: &mut GraphBuilder,
) -> OpSpec {
    let first = g.op(r.ops[0]);
    let members: HashSet<OpId> = r.ops.iter().copied().collect();
    let mut spec = OpSpec::new(r.name.clone(), first.kind, FUSED)
        .inputs(map(&r.inputs))
        .outputs(map(&r.outputs))
        .attr(
            "ops",
            r.ops
                .iter()
                .map(|&o| g.op(o).name.clone())
                .collect::<Vec<_>>(),
        )
        .attr("workspace_bytes", r.workspace);
    let mut after: Vec<OpId> = r
        .ops
        .iter()
        .flat_map(|&o| g.op(o).after.iter().copied())
        .filter(|a| !members.contains(a))
        .map(|a| op_id[a.index()])
        .collect();
    after.sort();
    after.dedup();
    spec.after = after;
    let flops: Vec<f64> = r.ops.iter().filter_map(|&o| g.op(o).flops).collect();
    if !flops.is_empty() {
        spec.flops = Some(flops.iter().sum());
    }
    let costs: Vec<f64> = r.ops.iter().filter_map(|&o| g.op(o).cost).collect();
    if costs.len() == r.ops.len() {
        spec.cost = Some(costs.iter().sum());
    }
    if r.workspace > 0 {
        let w = b.add_tensor(
            TensorSpec::new(format!("{}.workspace", r.name), r.workspace).role(Role::Temporary),
        );
        spec.outputs.push(w);
    }
    spec
}

#[cfg(test)]
mod tests;
