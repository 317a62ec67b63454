//! Splitting ("fission"): rewrite a chain of ops that is independent along
//! its rows into `k` chunks, joined by the reductions the chunks need.
//!
//! Order, layout and recomputation cannot make one tensor smaller; in a
//! language model's step the largest tensors are often the logits
//! `[B·T, V]` and their gradient. Nothing in the loss region mixes rows
//! (tokens) except two sums: the loss itself and the LM head's weight
//! gradient. So the region can run on `k` slices of the rows in turn, each
//! holding `[B·T/k, V]` instead of `[B·T, V]`, with the same math.
//!
//! [`loss`] splits the loss chain; [`rows`] splits the row-wise regions
//! around an expanding projection (a transformer block's MLP). Both are
//! [`Splits`], found together (a region never takes a chain's op) and
//! written into one new graph by one rewrite: each replaced part's ops and
//! tensors go, its chunks' ops take their place in the program order, and
//! every other op and tensor is copied.
//!
//! # Choosing `k`
//! [`plan_split`] plans the graph as it is and split into each `k` of
//! [`AUTO_CHUNKS`] (or the `k` asked for; `auto` stops once doubling `k`
//! no longer lowers the arena), sharing the time limit among them, and
//! keeps the split graph only if its planned arena is smaller: without a
//! gain the graph is left as it was. One `k` serves every chain and
//! region. Splitting recomputes nothing; it adds the `k − 1` partial-loss
//! additions and the `(k − 1)·V·C` additions of the head's gradient
//! ([`added_flops`]), and `k − 1` additions into each weight gradient a
//! region sums ([`rows::Region::added_flops`]).

pub mod loss;
pub mod rows;

use crate::error::Error;
use crate::graph::{Graph, GraphBuilder, OpId, OpKind, OpSpec, TensorId, TensorSpec};
use crate::pipeline::{self, Options};
use crate::plan::Plan;

pub use loss::{LossChain, added_flops, find_chains, split_chains};

// What `--split` asks for lives with the pipeline's options (so the
// pipeline does not depend on this pass, which plans through it).
pub use crate::pipeline::Split;

/// The chunk counts `auto` tries.
pub const AUTO_CHUNKS: [u64; 5] = [2, 4, 8, 16, 32];

/// Rows `[r₀, r₁)` of each of `k` chunks of `rows` (sizes differ by at most
/// one, larger first).
pub fn chunk_rows(rows: u64, k: u64) -> Vec<(u64, u64)> {
    let (q, r) = (rows / k, rows % k);
    let mut out = Vec::with_capacity(k as usize);
    let mut lo = 0;
    for i in 0..k {
        let n = q + u64::from(i < r);
        out.push((lo, lo + n));
        lo += n;
    }
    out
}

/// Bytes per element of `x`, which holds `elements`.
fn elem_bytes(x: &TensorSpec, elements: u64) -> u64 {
    x.size / elements.max(1)
}

/// Views of the rows of `base` (`row` elements a row) for each chunk of
/// `parts`, made by one `view` op of `new_base` (`base` in the graph
/// being built).
fn row_views(
    g: &Graph,
    b: &mut GraphBuilder,
    base: TensorId,
    new_base: TensorId,
    parts: &[(u64, u64)],
    row: u64,
) -> (OpId, Vec<TensorId>) {
    let spec = TensorSpec::from(g.tensor(base));
    let rows = parts.last().map_or(0, |p| p.1);
    let ebytes = elem_bytes(&spec, rows * row);
    let mut out = Vec::new();
    let mut offsets = Vec::new();
    for (i, &(lo, hi)) in parts.iter().enumerate() {
        let mut s = TensorSpec::new(format!("{}.chunk{i}", spec.name), (hi - lo) * row * ebytes)
            .role(spec.role)
            .align(spec.align)
            .view_of(new_base);
        s.dtype = spec.dtype.clone();
        s.shape = Some(if row == 1 {
            vec![hi - lo]
        } else {
            vec![hi - lo, row]
        });
        out.push(b.add_tensor(s));
        offsets.push(lo * row);
    }
    let op = b.add_op(
        OpSpec::new(format!("{}.chunks", spec.name), OpKind::Other, "view")
            .inputs([new_base])
            .outputs(out.clone())
            .attr("offsets", offsets),
    );
    (op, out)
}

/// A part of a graph the split replaces by its chunks: a loss chain or a
/// row-wise region.
trait Piece {
    /// The ops it replaces.
    fn replaced_ops(&self) -> Vec<OpId>;
    /// The tensors it replaces (made and read only by those ops).
    fn replaced_tensors(&self) -> Vec<TensorId>;
    /// The program position its chunks go before (`pos`: each op's).
    fn position(&self, pos: &[usize]) -> usize;
    /// Adds its `k` chunks to `b` (`tm`: a kept tensor's id there, `om`:
    /// an op's new ids, for ops earlier in program order); returns the
    /// ops added.
    fn emit(
        &self,
        g: &Graph,
        b: &mut GraphBuilder,
        k: u64,
        tm: &dyn Fn(TensorId) -> TensorId,
        om: &dyn Fn(OpId) -> Vec<OpId>,
    ) -> Vec<OpId>;
}

/// `g` with each of `pieces` replaced by its `k` chunks, put where it
/// says in program order; the rest of the graph is unchanged.
fn rewrite(g: &Graph, pieces: &[&dyn Piece], k: u64) -> Result<Graph, Error> {
    let n = g.num_ops();
    let mut pos = vec![0; n];
    for (i, &o) in g.program_order().iter().enumerate() {
        pos[o.index()] = i;
    }
    let mut dropped_ops = vec![false; n];
    let mut dropped_tensors = vec![false; g.num_tensors()];
    let mut at: Vec<Vec<&dyn Piece>> = vec![Vec::new(); n + 1];
    for &p in pieces {
        for o in p.replaced_ops() {
            dropped_ops[o.index()] = true;
        }
        for t in p.replaced_tensors() {
            dropped_tensors[t.index()] = true;
        }
        at[p.position(&pos).min(n)].push(p);
    }
    let mut b = GraphBuilder::new(g.name.clone());
    let mut tmap: Vec<Option<TensorId>> = vec![None; g.num_tensors()];
    // Bases before views: tensors in id order, views of dropped tensors
    // cannot exist (the replaced tensors are plain).
    for t in g.tensor_ids() {
        if dropped_tensors[t.index()] {
            continue;
        }
        let mut spec = TensorSpec::from(g.tensor(t));
        spec.view_of = spec
            .view_of
            .map(|v| tmap[v.index()].expect("a view's base is kept"));
        tmap[t.index()] = Some(b.add_tensor(spec));
    }
    let tm = |t: TensorId| tmap[t.index()].expect("kept tensor");
    let mut omap: Vec<Vec<OpId>> = vec![Vec::new(); n];
    let order = g.program_order();
    for (i, here) in at.iter().enumerate() {
        for p in here {
            let new = p.emit(g, &mut b, k, &tm, &|o: OpId| omap[o.index()].clone());
            for old in p.replaced_ops() {
                omap[old.index()] = new.clone();
            }
        }
        let Some(&o) = order.get(i) else { break };
        if dropped_ops[o.index()] {
            continue;
        }
        let op = g.op(o);
        let mut spec = OpSpec::from(op);
        spec.inputs = op.inputs.iter().map(|&t| tm(t)).collect();
        spec.outputs = op.outputs.iter().map(|&t| tm(t)).collect();
        spec.updates = op.updates.iter().map(|&t| tm(t)).collect();
        spec.reuse = op.reuse.iter().map(|&(x, y)| (tm(x), tm(y))).collect();
        spec.after = op
            .after
            .iter()
            .flat_map(|a| omap[a.index()].iter().copied())
            .collect();
        if op.after.iter().any(|a| omap[a.index()].is_empty()) {
            return Err(Error::Unsupported(format!(
                "op {:?} runs after an op that comes later in program order",
                op.name
            )));
        }
        omap[o.index()] = vec![b.add_op(spec)];
    }
    let mut out = b.build()?;
    out.reference_peaks = g.reference_peaks.clone();
    out.metadata = g.metadata.clone();
    Ok(out)
}

/// What a graph has to split: its loss chains and its row-wise regions
/// (outside the chains).
#[derive(Clone, Debug, Default)]
pub struct Splits {
    pub chains: Vec<LossChain>,
    pub regions: Vec<rows::Region>,
}

impl Splits {
    /// Every separable loss chain and row-wise region of `g`.
    pub fn find(g: &Graph) -> Splits {
        let chains = find_chains(g);
        let taken = chains.iter().flat_map(|c| c.all_ops()).collect();
        let regions = rows::find_regions(g, &taken);
        Splits { chains, regions }
    }

    pub fn is_empty(&self) -> bool {
        self.chains.is_empty() && self.regions.is_empty()
    }

    /// The fewest rows of any chain or region (0: none).
    pub fn min_rows(&self) -> u64 {
        let chains = self.chains.iter().map(|c| c.rows);
        chains
            .chain(self.regions.iter().map(|r| r.rows))
            .min()
            .unwrap_or(0)
    }

    /// FLOPs splitting them into `k` chunks adds.
    pub fn added_flops(&self, g: &Graph, k: u64) -> f64 {
        added_flops(&self.chains, k)
            + self
                .regions
                .iter()
                .map(|r| r.added_flops(g, k))
                .sum::<f64>()
    }

    /// `g` with each of them split into `k` chunks (`2 ≤ k ≤` the rows of
    /// each).
    pub fn apply(&self, g: &Graph, k: u64) -> Result<Graph, Error> {
        check_chunks(g, k, self)?;
        let pieces: Vec<&dyn Piece> = self
            .chains
            .iter()
            .map(|c| c as &dyn Piece)
            .chain(self.regions.iter().map(|r| r as &dyn Piece))
            .collect();
        let mut out = rewrite(g, &pieces, k)?;
        out.metadata.insert(
            "split".into(),
            serde_json::json!({
                "chunks": k,
                "chains": self.chains.len(),
                "regions": self.regions.len(),
            }),
        );
        Ok(out)
    }
}

/// An error unless `2 ≤ k ≤` the rows of every piece of `s`.
fn check_chunks(g: &Graph, k: u64, s: &Splits) -> Result<(), Error> {
    if k < 2 {
        return Err(Error::InvalidArgument(format!(
            "split into {k} chunks: need at least 2"
        )));
    }
    let firsts = s.chains.iter().map(|c| (c.ops[0], c.rows));
    for (o, rows) in firsts.chain(s.regions.iter().map(|r| (r.ops[0], r.rows))) {
        if k > rows {
            return Err(Error::InvalidArgument(format!(
                "split into {k} chunks: the chain at {:?} has only {rows} rows",
                g.op(o).name,
            )));
        }
    }
    Ok(())
}

/// `g` with every separable loss chain and row-wise region split into `k`
/// chunks (`--split`); an error if it has none, or `k` is not
/// between 2 and the rows of each.
pub fn split_graph(g: &Graph, k: u64) -> Result<Graph, Error> {
    let s = Splits::find(g);
    if s.is_empty() {
        return Err(Error::Unsupported(format!(
            "{}: no separable loss chain or row-wise region to split (docs/splitting.md)",
            g.name
        )));
    }
    s.apply(g, k)
}

/// What [`plan_split`] chose.
#[derive(Clone, Debug)]
pub struct SplitReport {
    /// Chunks of the kept graph (1: not split).
    pub chunks: u64,
    /// Loss chains split.
    pub chains: usize,
    /// Row-wise regions split ([`rows`]).
    pub regions: usize,
    /// `(k, arena bytes)` of every candidate planned (`k = 1`: unsplit).
    pub tried: Vec<(u64, u64)>,
    /// FLOPs the split adds (0 when not split).
    pub added_flops: f64,
    /// FLOPs of the unsplit step (the cost model's, [`crate::cost`]).
    pub step_flops: f64,
}

/// Plans `g` and, as `split` asks, its splits; returns the graph with the
/// smallest planned arena (the unsplit one unless a split is strictly
/// smaller), its plan and what was tried. Each candidate gets
/// `opts.time_limit` divided by the number of candidates.
pub fn plan_split(
    g: &Graph,
    opts: &Options,
    split: Split,
) -> Result<(Graph, Plan, SplitReport), Error> {
    let (g, p, (), rep) = plan_split_with(g, split, |g, n| {
        let mut o = opts.clone();
        o.time_limit = opts.time_limit / n;
        Ok::<_, Error>((pipeline::plan(g, &o)?, ()))
    })?;
    // Every plan leaves through the independent checker.
    crate::checker::check(&g, &p)
        .map_err(|e| Error::Internal(format!("the split plan is invalid: {e}")))?;
    Ok((g, p, rep))
}

/// [`plan_split`] with `opts.split`: the graph that was planned (split or
/// not), its plan, and what was tried.
pub fn plan(g: &Graph, opts: &Options) -> Result<(Graph, Plan, SplitReport), Error> {
    plan_split(g, opts, opts.split)
}

/// [`plan_split`] with any planner: `plan(graph, n)` plans one candidate of
/// `n` (to share a time budget) and returns its plan and whatever else it
/// reports, kept for the chosen graph.
pub fn plan_split_with<R, E: From<Error>>(
    g: &Graph,
    split: Split,
    mut plan: impl FnMut(&Graph, u32) -> Result<(Plan, R), E>,
) -> Result<(Graph, Plan, R, SplitReport), E> {
    let found = Splits::find(g);
    let min_rows = found.min_rows();
    let ks: Vec<u64> = match split {
        _ if found.is_empty() => Vec::new(),
        Split::Off => Vec::new(),
        Split::Auto => AUTO_CHUNKS
            .iter()
            .copied()
            .filter(|&k| k <= min_rows)
            .collect(),
        Split::Chunks(k) => vec![k.min(min_rows)],
    };
    let n = 1 + ks.len() as u32;
    let step_flops: f64 = g.op_ids().map(|o| crate::cost::op_flops(g, o)).sum();
    let (base, r) = plan(g, n)?;
    let mut tried = vec![(1, base.arena_bytes)];
    let mut best: Option<(Graph, Plan, R, u64)> = None;
    for &k in &ks {
        // `auto` stops once more chunks no longer lower the arena.
        if split == Split::Auto
            && let [.., (_, a), (_, b)] = tried[..]
            && tried.len() > 2
            && b >= a
        {
            break;
        }
        let sg = found.apply(g, k)?;
        let (p, r) = plan(&sg, n)?;
        tried.push((k, p.arena_bytes));
        let cur = best.as_ref().map_or(base.arena_bytes, |b| b.1.arena_bytes);
        if p.arena_bytes < cur {
            best = Some((sg, p, r, k));
        }
    }
    Ok(match best {
        Some((sg, p, r, k)) => (
            sg,
            p,
            r,
            SplitReport {
                chunks: k,
                chains: found.chains.len(),
                regions: found.regions.len(),
                tried,
                added_flops: found.added_flops(g, k),
                step_flops,
            },
        ),
        None => (
            g.clone(),
            base,
            r,
            SplitReport {
                chunks: 1,
                chains: 0,
                regions: 0,
                tried,
                added_flops: 0.0,
                step_flops,
            },
        ),
    })
}

/// A fit ([`crate::fit::fit`]) that may split as well as recompute.
#[derive(Clone, Debug)]
pub struct SplitFit {
    /// The fitted step: split (if that was cheaper) and with its
    /// recomputation. Its `added` includes the split's FLOPs (and their
    /// time at the step's FLOP rate).
    pub fitted: crate::fit::Fitted,
    /// The split chosen (`chunks` 1: not split).
    pub split: SplitReport,
}

/// Fits `g` into `opts.budget`, splitting as `split` asks where that is the
/// cheaper way in: the split with the smallest planned arena (if any is
/// smaller than the unsplit step's) and the unsplit step are each fitted
/// with half the time, and the one that fits with the least added cost
/// (recomputation plus the split's additions, in `opts.objective`'s unit)
/// is kept; ties go to the unsplit step.
pub fn fit_split(
    g: &Graph,
    opts: &crate::fit::FitOptions,
    split: Split,
) -> Result<SplitFit, Error> {
    use crate::fit::fit;
    let p = Probe::new(g, opts, split)?;
    if p.rep.chunks == 1 {
        return Ok(SplitFit {
            fitted: fit(g, opts)?,
            split: p.rep,
        });
    }
    let half = p.halves(opts);
    let plain = fit(g, &half);
    let split_fit = fit(&p.graph, &half).map(|f| {
        let added = split_cost(p.rep.added_flops, &f.step);
        with_split_added(f, &added)
    });
    let cost = |f: &crate::fit::Fitted| opts.objective.of(&f.added);
    p.choose(plain, split_fit, |a, b| cost(b) < cost(a))
}

/// The smallest arena found whose added cost is at most `max_added` times
/// the step's ([`crate::fit::fit_within`]), splitting as `split` asks where
/// that lowers it. The split's own additions count against the share (the
/// unsplit step's cost, in `opts.objective`'s unit): the split with the
/// smallest planned arena (if any is smaller than the unsplit step's) is
/// fitted with what the split leaves of it, the unsplit step with all of
/// it, each with half the time, and the smaller arena is kept (ties go to
/// the unsplit step). A split whose additions alone exceed the share is
/// not fitted.
pub fn fit_within_split(
    g: &Graph,
    max_added: f64,
    opts: &crate::fit::FitOptions,
    split: Split,
) -> Result<SplitFit, Error> {
    use crate::fit::fit_within;
    crate::fit::check_share(max_added)?;
    let p = Probe::new(g, opts, split)?;
    let share = match p.rep.chunks {
        1 => None,
        _ => crate::fit::share_after(&p.graph, max_added, p.rep.added_flops, opts)?,
    };
    let Some(share) = share else {
        return Ok(SplitFit {
            fitted: fit_within(g, max_added, opts)?,
            split: p.unsplit(),
        });
    };
    let half = p.halves(opts);
    let plain = fit_within(g, max_added, &half);
    let split_added = split_cost(p.rep.added_flops, &opts.cost_model.checked_total(&p.graph)?);
    let split_fit = fit_within(&p.graph, share, &half).map(|f| {
        let mut f = with_split_added(f, &split_added);
        f.max_added = Some(max_added);
        f
    });
    p.choose(plain, split_fit, |a, b| {
        b.plan.arena_bytes < a.plan.arena_bytes
    })
}

/// What both fits that may split start from: the split step `plan_split`
/// keeps under the fit's probe time, and when that probe started.
struct Probe {
    graph: Graph,
    rep: SplitReport,
    start: std::time::Instant,
}

impl Probe {
    fn new(g: &Graph, opts: &crate::fit::FitOptions, split: Split) -> Result<Probe, Error> {
        let probe = Options {
            time_limit: opts.probe_time,
            layouts: 1,
            ..Options::default()
        };
        let start = std::time::Instant::now();
        let (graph, _, rep) = plan_split(g, &probe, split)?;
        Ok(Probe { graph, rep, start })
    }

    /// `opts` with half of what is left of its time limit since the probe
    /// started, for each of the two fits.
    fn halves(&self, opts: &crate::fit::FitOptions) -> crate::fit::FitOptions {
        crate::fit::FitOptions {
            time_limit: opts.time_limit.saturating_sub(self.start.elapsed()) / 2,
            ..opts.clone()
        }
    }

    /// The report of the step left unsplit.
    fn unsplit(&self) -> SplitReport {
        SplitReport {
            chunks: 1,
            chains: 0,
            regions: 0,
            added_flops: 0.0,
            ..self.rep.clone()
        }
    }

    /// The split fit where `split_better(plain, split)` (or where only it
    /// succeeded), else the unsplit one; when both fail, the split's error.
    fn choose(
        self,
        plain: Result<crate::fit::Fitted, Error>,
        split_fit: Result<crate::fit::Fitted, Error>,
        split_better: impl Fn(&crate::fit::Fitted, &crate::fit::Fitted) -> bool,
    ) -> Result<SplitFit, Error> {
        let unsplit = self.unsplit();
        Ok(match (plain, split_fit) {
            (Ok(a), Ok(b)) if split_better(&a, &b) => SplitFit {
                fitted: b,
                split: self.rep,
            },
            (Ok(a), _) => SplitFit {
                fitted: a,
                split: unsplit,
            },
            (Err(_), Ok(b)) => SplitFit {
                fitted: b,
                split: self.rep,
            },
            (Err(_), Err(e)) => return Err(e),
        })
    }
}

/// `flops` the split adds, and their time at the rate of `step` (its
/// seconds per FLOP).
fn split_cost(flops: f64, step: &crate::cost::OpCost) -> crate::cost::OpCost {
    let rate = if step.flops > 0.0 {
        step.seconds / step.flops
    } else {
        0.0
    };
    crate::cost::OpCost {
        flops,
        seconds: flops * rate,
        bytes: 0,
    }
}

/// `f` with the split's `added` cost counted in its own.
fn with_split_added(mut f: crate::fit::Fitted, added: &crate::cost::OpCost) -> crate::fit::Fitted {
    f.added.flops += added.flops;
    f.added.seconds += added.seconds;
    f
}
