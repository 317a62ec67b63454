//! `memplan fit`: the cheapest recomputation that fits a step into a budget,
//! the largest batch that fits, and the budget/cost curve.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::Args;
use serde_json::json;

use memplan::fit::{FitOptions, Fitted, fit};
use memplan::graph::Graph;

use super::GraphArgs;
use super::commands::load;
use super::format::{grouped, human_bytes, table};

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
    #[arg(long, value_name = "BYTES", required_unless_present = "pareto")]
    pub budget: Option<String>,
    /// Write the plan here (it names the recomputed tensors: check or run it
    /// with the graph of --output-graph).
    #[arg(short, long, value_name = "PLAN")]
    pub output: Option<PathBuf>,
    /// Write the step with its recomputation here (memplan JSON).
    #[arg(long, value_name = "GRAPH")]
    pub output_graph: Option<PathBuf>,
    /// Print the result as JSON.
    #[arg(long)]
    pub json: bool,
    /// Time budget of the whole fit, in seconds.
    #[arg(long, value_name = "S", default_value_t = 60.0)]
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
    /// With --pareto: also draw the curve as SVG here.
    #[arg(long, value_name = "OUT.svg", requires = "pareto")]
    pub svg: Option<PathBuf>,
    /// The largest batch of a built-in example that fits --budget (bytes or
    /// a unit, not %), with and without recomputation, next to PyTorch
    /// eager's (caching-allocator simulation).
    #[arg(long, requires = "example")]
    pub max_batch: bool,
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
    let split = t.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let scale: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kb" => 1e3,
        "m" | "mb" => 1e6,
        "g" | "gb" => 1e9,
        "t" | "tb" => 1e12,
        "kib" => 1024.0,
        "mib" => 1024.0 * 1024.0,
        "gib" => 1024.0 * 1024.0 * 1024.0,
        "tib" => 1024f64.powi(4),
        u => bail!(
            "--budget {text:?}: unknown unit {u:?} (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB, or %)"
        ),
    };
    let n: f64 = num
        .trim()
        .parse()
        .with_context(|| format!("--budget {text:?}: not a number"))?;
    let bytes = n * scale;
    if !(bytes.is_finite() && bytes >= 0.0 && bytes < u64::MAX as f64) {
        bail!("--budget {text:?}: out of range");
    }
    Ok(bytes.floor() as u64)
}

fn time_limit(s: f64) -> Result<Duration> {
    Duration::try_from_secs_f64(s)
        .ok()
        .filter(|d| !d.is_zero())
        .with_context(|| format!("--time-limit must be a positive number of seconds, got {s}"))
}

pub fn run(a: FitArgs) -> Result<()> {
    let limit = time_limit(a.time_limit)?;
    if a.max_batch {
        return max_batch(&a, limit);
    }
    let g = load(a.graph.as_deref(), &a.source)?;
    if a.pareto {
        return pareto(&g, &a, limit);
    }
    let budget_text = a.budget.as_deref().unwrap_or("100%");
    let budget = parse_budget(budget_text, || base_arena(&g))?;
    let opts = FitOptions {
        budget,
        time_limit: limit,
        objective: a.minimise,
        ..FitOptions::default()
    };
    let f = fit(&g, &opts)?;
    write_outputs(&f, a.output.as_deref(), a.output_graph.as_deref())?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&fitted_json(&f))?);
    } else {
        print_fitted(&g, &f, a.list);
    }
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
        std::fs::write(p, f.plan.to_json(&f.graph))
            .with_context(|| format!("writing {}", p.display()))?;
    }
    if let Some(p) = graph {
        memplan::io::save_graph(&f.graph, p)?;
    }
    Ok(())
}

pub fn fitted_json(f: &Fitted) -> serde_json::Value {
    json!({
        "graph": f.graph.name,
        "budget_bytes": f.budget,
        "arena_bytes": f.plan.arena_bytes,
        "max_live_bytes": f.plan.stats.max_live_bytes,
        "lower_bound_bytes": f.plan.stats.lower_bound_bytes,
        "no_recompute_arena_bytes": f.base_arena,
        "recomputed_ops": f.recomputed,
        "added_flops": f.added.flops,
        "added_seconds_estimate": f.added.seconds,
        "step_flops": f.step.flops,
        "step_seconds_estimate": f.step.seconds,
        "optimal": f.optimal,
        "candidates": f.candidates,
        "probes": f.probes,
        "solve_seconds": f.seconds,
    })
}

fn print_fitted(g: &Graph, f: &Fitted, list: bool) {
    let pct = |a: f64, b: f64| if b > 0.0 { 100.0 * a / b } else { 0.0 };
    println!(
        "{}: arena {} (budget {}; without recomputation {})",
        g.name,
        human_bytes(f.plan.arena_bytes),
        human_bytes(f.budget),
        human_bytes(f.base_arena)
    );
    println!(
        "recomputes {} of {} candidate ops: +{} FLOPs ({:.2}% of the step), +{:.3} ms estimated ({:.2}%){}",
        f.recomputed.len(),
        f.candidates,
        grouped(f.added.flops as u64),
        pct(f.added.flops, f.step.flops),
        f.added.seconds * 1e3,
        pct(f.added.seconds, f.step.seconds),
        if f.optimal { "; proven cheapest" } else { "" }
    );
    println!(
        "max live {}, lower bound of this step {} ({} plans tried, {:.1} s)",
        human_bytes(f.plan.stats.max_live_bytes),
        human_bytes(f.plan.stats.lower_bound_bytes),
        f.probes,
        f.seconds
    );
    if list {
        let rows: Vec<Vec<String>> = f.recomputed.iter().map(|n| vec![n.clone()]).collect();
        print!("{}", table(&["recomputed op"], &rows));
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
    let step = memplan::cost::CostModel::default().total(g);
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
        std::fs::write(path, svg).with_context(|| format!("writing {}", path.display()))?;
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
        println!("{}", serde_json::to_string_pretty(&doc)?);
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
    println!(
        "{}: without recomputation {}; floor {} ({why})",
        g.name,
        human_bytes(base),
        human_bytes(floor)
    );
    print!(
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

/// Whether a built-in example at `batch` fits `budget`: planned without
/// recomputation, fitted with it, and PyTorch eager's simulated reserved
/// bytes.
/// (`kind` 0, 1, 2: eager, planned, fitted).
fn batch_fits(a: &FitArgs, batch: u64, budget: u64, limit: Duration, kind: usize) -> Result<bool> {
    let src = GraphArgs {
        batch: Some(batch),
        ..a.source.clone()
    };
    let g = load(None, &src)?;
    Ok(match kind {
        0 => memplan::baselines::pytorch_caching(&g).max_reserved <= budget,
        1 => base_arena(&g)? <= budget,
        _ => {
            let opts = FitOptions {
                budget,
                time_limit: limit,
                objective: a.minimise,
                ..FitOptions::default()
            };
            base_arena(&g)? <= budget || fit(&g, &opts).is_ok()
        }
    })
}

fn max_batch(a: &FitArgs, limit: Duration) -> Result<()> {
    let Some(text) = &a.budget else {
        bail!("--max-batch needs --budget BYTES");
    };
    if text.trim().ends_with('%') {
        bail!("--max-batch needs --budget in bytes (e.g. 80GiB), not a share");
    }
    let budget = parse_budget(text, || Ok(0))?;
    // Doubling, then bisection, for each of the three.
    let mut best = [0u64; 3];
    let per = limit.div_f64(24.0);
    for (k, name) in ["PyTorch eager", "memplan", "memplan + recomputation"]
        .iter()
        .enumerate()
    {
        let mut lo = 0u64;
        let mut hi = 1u64;
        while hi <= 1 << 16 && batch_fits(a, hi, budget, per, k)? {
            lo = hi;
            hi *= 2;
        }
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if batch_fits(a, mid, budget, per, k)? {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        best[k] = lo;
        if !a.json {
            println!(
                "{name}: largest batch within {} is {lo}",
                human_bytes(budget)
            );
        }
    }
    if a.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&json!({
                "budget_bytes": budget,
                "eager_max_batch": best[0],
                "planned_max_batch": best[1],
                "fitted_max_batch": best[2],
            }))?
        );
    }
    Ok(())
}
