//! `memplan fit`: the cheapest recomputation that fits a step into a budget,
//! the largest batch that fits, and the budget/cost curve.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::Args;
use serde_json::json;

use memplan::fit::{FitOptions, Fitted, fit, fit_within};
use memplan::graph::Graph;

use super::GraphArgs;
use super::format::{grouped_f64, human_bytes, table};
use super::load::{load, load_for_planning, shard};

#[derive(Args, Debug)]
pub struct FitArgs {
    /// Graph file: memplan JSON, XLA HLO text or a networkx node-link graph
    /// (Checkmate, Moccasin), optionally .gz.
    #[arg(required_unless_present = "example")]
    pub graph: Option<PathBuf>,
    #[command(flatten)]
    pub source: GraphArgs,
    /// The most bytes the arena may take: bytes (`25769803776`), with a unit
    /// (`24GiB`, `500MB`), or a share of the plan without recomputation
    /// (`75%`).
    #[arg(
        long,
        value_name = "BYTES",
        required_unless_present_any = ["pareto", "max_added", "max_slowdown"]
    )]
    pub budget: Option<String>,
    /// Offload to host memory instead of recomputing: which tensors leave
    /// the device and when they come back, for the least modeled time
    /// within --budget, or the smallest arena within --max-slowdown
    /// (docs/offload.md).
    #[arg(long, conflicts_with_all = ["pareto", "max_batch", "max_added"])]
    pub offload: bool,
    /// With --offload, instead of a budget: the smallest arena whose
    /// modeled step time is at most this share above the step's without
    /// offload: `5%`, or a fraction (`0.05`).
    #[arg(
        long,
        value_name = "SHARE",
        requires = "offload",
        conflicts_with = "budget"
    )]
    pub max_slowdown: Option<String>,
    /// With --offload: the device and its link to the host (h100-pcie5,
    /// h200-pcie5, gh200-c2c, cpu-dev; default h100-pcie5).
    #[arg(long, value_name = "PRESET", requires = "offload")]
    pub device: Option<String>,
    /// With --offload: the link's bandwidth each way, GB/s (replaces the
    /// preset's).
    #[arg(
        long,
        value_name = "GBPS",
        requires = "offload",
        allow_negative_numbers = true
    )]
    pub link_gbps: Option<f64>,
    /// With --offload: the most host memory offloaded tensors may take at
    /// once (bytes, or with a unit: `256GiB`).
    #[arg(long, value_name = "BYTES", requires = "offload")]
    pub host_memory: Option<String>,
    /// Instead of a budget: the smallest arena whose recomputation adds at
    /// most this share of the step's cost (estimated time, or FLOPs with
    /// --minimise flops): `0.5%`, or a fraction (`0.005`).
    #[arg(long, value_name = "SHARE", conflicts_with_all = ["budget", "pareto", "max_batch"])]
    pub max_added: Option<String>,
    /// Write the plan here (it names the recomputed tensors: check or run it
    /// with the graph of --output-graph); `-`: to standard output (the
    /// summary then goes to standard error).
    #[arg(short, long, value_name = "PLAN")]
    pub output: Option<PathBuf>,
    /// Write the step with its recomputation (or its offload copies) here
    /// (memplan JSON); `-`: to standard output.
    #[arg(long, value_name = "GRAPH", alias = "graph-output")]
    pub output_graph: Option<PathBuf>,
    /// Print the result as JSON.
    #[arg(long)]
    pub json: bool,
    /// Time budget of the whole fit, in seconds.
    #[arg(
        long,
        value_name = "S",
        allow_negative_numbers = true,
        default_value_t = 60.0
    )]
    pub time_limit: f64,
    /// List every recomputed op.
    #[arg(long)]
    pub list: bool,
    /// What to minimise: the estimated added time, or the added FLOPs.
    #[arg(long, value_enum, default_value = "time", alias = "minimize")]
    pub minimise: memplan::fit::Objective,
    /// The budget / added-cost curve instead of one fit: budgets from the
    /// plan without recomputation down to the floor, in steps of 5%.
    #[arg(long, conflicts_with_all = ["budget", "max_batch"])]
    pub pareto: bool,
    /// With --pareto: also draw the curve as SVG here (`-`: standard
    /// output, the table then on standard error).
    #[arg(long, value_name = "OUT.svg", requires = "pareto")]
    pub svg: Option<PathBuf>,
    /// The largest batch that fits --budget (bytes or a unit, not %), with
    /// and without recomputation, next to PyTorch eager's (caching-allocator
    /// simulation). Works on a built-in example, or on a graph file with
    /// --batch-graph (the same step captured at another batch size).
    #[arg(long)]
    pub max_batch: bool,
    /// With --max-batch and a graph file: the same step captured at another
    /// batch size. Sizes, shapes and FLOPs are extrapolated along the line
    /// through the two captures (docs/fit.md).
    #[arg(long, value_name = "GRAPH", requires = "max_batch")]
    pub batch_graph: Option<PathBuf>,
    /// The batch sizes of GRAPH and --batch-graph, when their metadata does
    /// not record them (`"batch"`).
    #[arg(
        long,
        value_name = "B1,B2",
        value_delimiter = ',',
        requires = "batch_graph"
    )]
    pub batches: Option<Vec<u64>>,
}

/// A budget as the user wrote it, resolved against the plan without
/// recomputation.
pub fn parse_budget(text: &str, base: impl FnOnce() -> Result<u64>) -> Result<u64> {
    let t = text.trim();
    if let Some(p) = t.strip_suffix('%') {
        let share: f64 = p
            .trim()
            .parse()
            .with_context(|| format!("--budget {text:?}"))?;
        if !(share.is_finite() && share > 0.0 && share <= 1000.0) {
            bail!("--budget {text:?}: the share must be a number between 0 and 1000 percent");
        }
        return Ok((base()? as f64 * share / 100.0).floor() as u64);
    }
    memplan::units::parse_bytes(t).map_err(|e| anyhow::anyhow!("--budget {e}"))
}

/// A share of the step's cost as the user wrote it: `0.5%` or `0.005`.
pub fn parse_share(text: &str) -> Result<f64> {
    let t = text.trim();
    let (num, scale) = match t.strip_suffix('%') {
        Some(p) => (p.trim(), 0.01),
        None => (t, 1.0),
    };
    let x: f64 = num
        .parse()
        .ok()
        .filter(|x: &f64| x.is_finite() && *x >= 0.0)
        .with_context(|| {
            format!(
                "--max-added {text:?}: give a share of the step's cost, 0 or more: 0.5% or 0.005"
            )
        })?;
    Ok(x * scale)
}

pub fn run(a: FitArgs) -> Result<()> {
    let limit = super::load::time_limit(a.time_limit)?;
    super::claim_stdout(&[
        ("-o", a.output.as_deref()),
        ("--output-graph", a.output_graph.as_deref()),
        ("--svg", a.svg.as_deref()),
    ])?;
    if a.max_batch {
        return max_batch(&a, limit);
    }
    if a.offload {
        return offload(&a, limit);
    }
    if a.pareto {
        // The curve of one graph: `--split K` splits it first (`auto` is
        // refused: it picks a count per budget).
        return pareto(&load(a.graph.as_deref(), &a.source)?, &a, limit);
    }
    // `--split` (GraphArgs): with --budget, split where that is the
    // cheaper way into the budget; with --max-added, where that gives the
    // smaller arena, the split's added FLOPs counted in the share
    // (docs/splitting.md); the step and plan written are then the split
    // step's.
    let (g, split_arg) = load_for_planning(a.graph.as_deref(), &a.source)?;
    let progress = std::sync::Arc::new(memplan_solver::Progress::new());
    progress.start_phase("fit: trying recomputation sets", 0);
    let mut opts = FitOptions {
        time_limit: limit,
        objective: a.minimise,
        progress: Some(progress.clone()),
        ..FitOptions::default()
    };
    let guard = super::progress::watch_fit(progress);
    let mut split = None;
    let f = match &a.max_added {
        Some(share) if split_arg == memplan::split::Split::Off => {
            fit_within(&g, parse_share(share)?, &opts)?
        }
        Some(share) => {
            let s = memplan::split::fit_within_split(&g, parse_share(share)?, &opts, split_arg)?;
            split = Some(s.split);
            s.fitted
        }
        None => {
            let budget_text = a.budget.as_deref().unwrap_or("100%");
            opts.budget = parse_budget(budget_text, || base_arena(&g))?;
            if split_arg == memplan::split::Split::Off {
                fit(&g, &opts)?
            } else {
                let s = memplan::split::fit_split(&g, &opts, split_arg)?;
                split = Some(s.split);
                s.fitted
            }
        }
    };
    drop(guard);
    write_outputs(&f, a.output.as_deref(), a.output_graph.as_deref())?;
    if a.json {
        let mut v = f.summary_json();
        if let Some(s) = &split {
            v["split_chunks"] = serde_json::json!(s.chunks);
            v["split_chains"] = serde_json::json!(s.chains);
            v["split_regions"] = serde_json::json!(s.regions);
            v["split_added_flops"] = serde_json::json!(s.added_flops);
        }
        sayln!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        print_fitted(&g, &f, a.list);
        if let Some(s) = &split {
            sayln!(
                "split: {}",
                if s.chunks > 1 {
                    format!(
                        "{} loss chain(s) and {} row-wise region(s) into {} chunks ({} FLOPs added, counted above)",
                        s.chains,
                        s.regions,
                        s.chunks,
                        super::format::grouped(s.added_flops as u64)
                    )
                } else if f.max_added.is_some() {
                    "none (the unsplit step fits at least as small)".to_string()
                } else {
                    "none (the unsplit step fits at least as cheaply)".to_string()
                }
            );
        }
    }
    Ok(())
}

/// `fit --offload`: the planner's order of the step, then the copies to
/// and from host memory that meet the budget (or the slowdown).
fn offload(a: &FitArgs, limit: Duration) -> Result<()> {
    use memplan::offload::{self, Device, Target};
    let (g, split) = load_for_planning(a.graph.as_deref(), &a.source)?;
    if split != memplan::split::Split::Off {
        bail!(
            "--offload with --split: offload is not yet chosen together with splitting; write the split step first (`memplan plan --split K --graph-output split.json`), then fit that with --offload"
        );
    }
    let mut device = Device::preset(a.device.as_deref().unwrap_or("h100-pcie5"))?;
    if let Some(gbps) = a.link_gbps {
        device = device.with_link_gbps(gbps)?;
    }
    let host_memory = match &a.host_memory {
        Some(h) => {
            Some(memplan::units::parse_bytes(h).map_err(|e| anyhow::anyhow!("--host-memory {e}"))?)
        }
        None => None,
    };
    let target = match (&a.max_slowdown, &a.budget) {
        (Some(s), _) => Target::MaxSlowdown(parse_share(s).map_err(|e| {
            anyhow::anyhow!("{}", e.to_string().replace("--max-added", "--max-slowdown"))
        })?),
        (None, b) => Target::Budget(parse_budget(b.as_deref().unwrap_or("100%"), || {
            base_arena(&g)
        })?),
    };
    let opts = offload::Options {
        device,
        host_memory,
        target,
        deadline: None,
        compute_seconds: None,
        reference_seconds: None,
    };
    let r = offload::fit_offload(&g, &opts, limit)?;
    if let Some(p) = &a.output {
        super::write_output(p, &r.plan.to_json(&r.graph))?;
    }
    match &a.output_graph {
        Some(p) if super::is_stdout(p) => {
            super::write_output(p, &memplan::io::json::write_graph(&r.graph))?
        }
        Some(p) => memplan::io::save_graph(&r.graph, p)?,
        None => {}
    }
    if a.json {
        let v = serde_json::json!({
            "graph": g.name,
            "arena_bytes": r.plan.arena_bytes,
            "max_live_bytes": r.check.max_live_bytes,
            "offload": r.summary_json(),
        });
        sayln!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    let pct = |x: f64, of: f64| {
        if of > 0.0 {
            100.0 * (x / of - 1.0)
        } else {
            0.0
        }
    };
    let goal = match target {
        Target::Budget(b) => format!("budget {}", human_bytes(b)),
        Target::MaxSlowdown(s) => format!("at most {:.2}% slower", 100.0 * s),
    };
    sayln!(
        "{}: device arena {} ({goal}; without offload {}), host pool {}, on {}",
        g.name,
        human_bytes(r.plan.arena_bytes),
        human_bytes(r.arena_without_offload),
        human_bytes(r.host_bytes),
        r.device
    );
    sayln!(
        "offloads {} tensors with {} copies ({} to the host, {} back){}",
        r.offloaded_tensors,
        r.copies,
        human_bytes(r.timing.to_host_bytes),
        human_bytes(r.timing.to_device_bytes),
        if r.recomputed.is_empty() {
            String::new()
        } else {
            format!(", after recomputing {} ops", r.recomputed.len())
        }
    );
    sayln!(
        "modeled step {:.3} ms ({:+.2}% on the step's compute of {:.3} ms; without offload {:.3} ms)",
        r.timing.seconds * 1e3,
        pct(r.timing.seconds, r.compute_seconds),
        r.compute_seconds * 1e3,
        r.seconds_without_offload * 1e3
    );
    sayln!(
        "lower bound with offload {}: the arena is {:.2}% above it ({})",
        human_bytes(r.bound.bytes),
        100.0 * r.plan.gap(),
        r.bound.why
    );
    Ok(())
}

/// The arena of the plan without recomputation.
fn base_arena(g: &Graph) -> Result<u64> {
    Ok(memplan::plan(
        g,
        &memplan::Options {
            time_limit: Duration::from_secs(5),
            ..Default::default()
        },
    )?
    .arena_bytes)
}

fn write_outputs(f: &Fitted, plan: Option<&Path>, graph: Option<&Path>) -> Result<()> {
    if let Some(p) = plan {
        super::write_output(p, &f.plan.to_json(&f.graph))?;
    }
    match graph {
        Some(p) if super::is_stdout(p) => {
            super::write_output(p, &memplan::io::json::write_graph(&f.graph))?
        }
        Some(p) => memplan::io::save_graph(&f.graph, p)?,
        None => {}
    }
    Ok(())
}

fn print_fitted(g: &Graph, f: &Fitted, list: bool) {
    let pct = |a: f64, b: f64| if b > 0.0 { 100.0 * a / b } else { 0.0 };
    let limit = match f.max_added {
        Some(share) => format!("at most +{:.3}% of the step's cost", 100.0 * share),
        None => format!("budget {}", human_bytes(f.budget)),
    };
    sayln!(
        "{}: arena {} ({limit}; without recomputation {})",
        g.name,
        human_bytes(f.plan.arena_bytes),
        human_bytes(f.base_arena)
    );
    sayln!(
        "recomputes {} of {} candidate ops: +{} FLOPs ({:.2}% of the step), +{:.3} ms estimated ({:.2}%){}",
        f.recomputed.len(),
        f.candidates,
        grouped_f64(f.added.flops),
        pct(f.added.flops, f.step.flops),
        f.added.seconds * 1e3,
        pct(f.added.seconds, f.step.seconds),
        match (f.optimal, f.max_added) {
            (false, _) => "",
            (true, None) => "; proven cheapest",
            (true, Some(_)) => "; proven lowest within it",
        }
    );
    sayln!(
        "max live {}, lower bound of this step {} ({} plans tried, {:.1} s)",
        human_bytes(f.plan.stats.max_live_bytes),
        human_bytes(f.plan.stats.lower_bound_bytes),
        f.probes,
        f.seconds
    );
    if let Some(floor) = &f.share_floor {
        sayln!(
            "no recomputation within this share goes below {}{}: this plan is {:.2}% above it ({})",
            human_bytes(floor.bytes),
            if floor.finished {
                ""
            } else {
                " (bound cut short by its deadline)"
            },
            pct(
                f.plan.arena_bytes.saturating_sub(floor.bytes) as f64,
                floor.bytes as f64
            ),
            floor.why
        );
    }
    if list {
        let rows: Vec<Vec<String>> = f.recomputed.iter().map(|n| vec![n.clone()]).collect();
        say!("{}", table(&["recomputed op"], &rows));
    }
}

fn pareto(g: &Graph, a: &FitArgs, limit: Duration) -> Result<()> {
    let base = base_arena(g)?;
    let (floor, why) = memplan::fit::fit_floor(g);
    let budgets: Vec<u64> = (0..20)
        .map(|i| (base as f64 * (1.0 - 0.05 * i as f64)) as u64)
        .take_while(|&b| b >= floor)
        .collect();
    let opts = FitOptions {
        time_limit: limit,
        objective: a.minimise,
        ..FitOptions::default()
    };
    let points = memplan::fit::pareto(g, &budgets, &opts);
    let step = memplan::cost::CostModel::default().checked_total(g)?;
    let pct = |x: f64, of: f64| if of > 0.0 { 100.0 * x / of } else { 0.0 };
    if let Some(path) = &a.svg {
        let pts: Vec<(u64, f64)> = points
            .iter()
            .filter_map(|p| p.arena.map(|ar| (ar, pct(p.added.flops, step.flops))))
            .collect();
        let svg = memplan::plot::pareto_svg(
            &format!("{}: memory vs recomputation", g.name),
            &pts,
            floor,
        )?;
        super::write_output(path, &svg)?;
    }
    if a.json {
        let rows: Vec<serde_json::Value> = points
            .iter()
            .map(|p| {
                json!({
                    "budget_bytes": p.budget,
                    "arena_bytes": p.arena,
                    "added_flops": p.added.flops,
                    "added_seconds_estimate": p.added.seconds,
                    "recomputed_ops": p.recomputed,
                    "optimal": p.optimal,
                })
            })
            .collect();
        let doc = json!({"graph": g.name, "no_recompute_arena_bytes": base, "floor_bytes": floor,
            "step_flops": step.flops, "points": rows});
        sayln!("{}", serde_json::to_string_pretty(&doc)?);
        return Ok(());
    }
    let rows: Vec<Vec<String>> = points
        .iter()
        .map(|p| {
            vec![
                format!("{:.0}%", pct(p.budget as f64, base as f64)),
                human_bytes(p.budget),
                p.arena.map_or("not found".into(), human_bytes),
                format!("{:.2}%", pct(p.added.flops, step.flops)),
                format!("{:.2}%", pct(p.added.seconds, step.seconds)),
                p.recomputed.to_string(),
            ]
        })
        .collect();
    sayln!(
        "{}: without recomputation {}; floor {} ({why})",
        g.name,
        human_bytes(base),
        human_bytes(floor)
    );
    say!(
        "{}",
        table(
            &[
                "budget",
                "bytes",
                "arena",
                "+FLOPs",
                "+time (est.)",
                "recomputed ops"
            ],
            &rows
        )
    );
    Ok(())
}

/// `e` as the library's error: itself where it is one, else (a problem
/// the command line found) an invalid argument with its context.
fn as_memplan_error(e: anyhow::Error) -> memplan::Error {
    e.downcast::<memplan::Error>()
        .unwrap_or_else(|e| memplan::Error::InvalidArgument(format!("{e:#}")))
}

/// The step at any batch: the built-in example built at that batch, or the
/// line through two captures of a graph file.
type GraphAt = Box<dyn FnMut(u64) -> memplan::Result<Graph>>;

fn graph_at(a: &FitArgs) -> Result<GraphAt> {
    let src = a.source.clone();
    let Some(path) = &a.graph else {
        return Ok(Box::new(move |batch| {
            let src = GraphArgs {
                batch: Some(batch),
                ..src.clone()
            };
            load(None, &src).map_err(as_memplan_error)
        }));
    };
    if a.source.example.is_some() {
        bail!(
            "give either a graph file ({}) or --example, not both",
            path.display()
        );
    }
    let Some(second) = &a.batch_graph else {
        bail!(
            "--max-batch on a graph file needs --batch-graph: the same step captured at another batch size"
        );
    };
    let g1 = memplan::io::load_graph(path)?;
    let g2 = memplan::io::load_graph(second)?;
    let (b1, b2) = match a.batches.as_deref() {
        Some(&[b1, b2]) => (b1, b2),
        Some(other) => bail!("--batches takes two batch sizes, B1,B2; got {other:?}"),
        None => {
            let of = |g: &Graph, p: &Path| {
                memplan::batch::recorded_batch(g).with_context(|| {
                    format!(
                        "{}: its metadata records no \"batch\"; give the two batch sizes with --batches B1,B2",
                        p.display()
                    )
                })
            };
            (of(&g1, path)?, of(&g2, second)?)
        }
    };
    let line = memplan::batch::BatchLine::new(g1, b1, g2, b2)?;
    Ok(Box::new(move |batch| {
        let g = line.at(batch)?;
        shard(g, &src).map_err(as_memplan_error)
    }))
}

fn max_batch(a: &FitArgs, limit: Duration) -> Result<()> {
    let Some(text) = &a.budget else {
        bail!("--max-batch needs --budget BYTES");
    };
    if text.trim().ends_with('%') {
        bail!("--max-batch needs --budget in bytes (e.g. 80GiB), not a share");
    }
    let budget = parse_budget(text, || Ok(0))?;
    let mut at = graph_at(a)?;
    let opts = FitOptions {
        time_limit: limit.div_f64(24.0),
        objective: a.minimise,
        ..FitOptions::default()
    };
    let r = memplan::batch::max_batch(&mut *at, budget, &opts, 1 << 16)?;
    if a.json {
        sayln!("{}", serde_json::to_string_pretty(&r)?);
        return Ok(());
    }
    let at_least = |b: u64| {
        if b == r.cap {
            format!("at least {b}")
        } else {
            b.to_string()
        }
    };
    let best = match &r.eager_configuration {
        Some(c) => format!("PyTorch eager, best configuration ({c})"),
        None => "PyTorch eager, best configuration".to_string(),
    };
    for (name, b) in [
        (best.as_str(), r.eager),
        ("PyTorch eager, default allocator", r.eager_default),
        ("memplan", r.planned),
        ("memplan + recomputation", r.fitted),
    ] {
        sayln!(
            "{name}: largest batch within {} is {}",
            human_bytes(budget),
            at_least(b)
        );
    }
    Ok(())
}
