//! What every command starts from: the graph it names (a file or an
//! example, sharded if asked), the time limit, and the plan of the graph.

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};

use memplan::example_spec::ExampleSpec;
use memplan::graph::Graph;
use memplan::models::{DType, ExampleOptions};
use memplan::split::Split;
use memplan::{Options, Plan, baselines, checker};

use super::GraphArgs;

/// Loads the graph a command names: a file or `--example`, sharded over
/// `--world-size` ranks if given, then split into the `--split K` chunks
/// if asked ([`memplan::transforms`], the bench's example specs' too):
/// the graph as commands that read a plan's graph (check, stats, run...)
/// see it. `--split auto` is refused here: only planning picks a count.
pub fn load(graph: Option<&Path>, src: &GraphArgs) -> Result<Graph> {
    let chunks = match src.split {
        None | Some(Split::Off) => None,
        Some(Split::Chunks(k)) => Some(k),
        Some(Split::Auto) => bail!(
            "--split auto picks the chunk count while planning (memplan plan, compare and fit \
             do); this command reads the graph split into a given count: pass --split K with \
             the K the plan's summary names, or the graph `memplan plan --graph-output` wrote"
        ),
    };
    let t = transforms(src, chunks)?;
    Ok(t.apply(load_unsharded(graph, src)?)?)
}

/// For commands that plan: the graph a command names, sharded but not
/// split, and the `--split` to plan it with
/// ([`memplan::split::plan_split_with`] keeps a split only where it
/// lowers the arena).
pub fn load_for_planning(graph: Option<&Path>, src: &GraphArgs) -> Result<(Graph, Split)> {
    let g = transforms(src, None)?.apply(load_unsharded(graph, src)?)?;
    Ok((g, src.split.unwrap_or_default()))
}

/// `g` sharded as --world-size asks (unchanged without it).
pub fn shard(g: Graph, src: &GraphArgs) -> Result<Graph> {
    Ok(transforms(src, None)?.apply(g)?)
}

/// The transforms the flags ask for, the split as `split_chunks` says.
fn transforms(
    src: &GraphArgs,
    split_chunks: Option<u64>,
) -> Result<memplan::transforms::Transforms> {
    use memplan::models::fsdp::{FsdpOptions, ShardLayout};
    if src.world_size == Some(0) {
        bail!("--world-size must be at least 1");
    }
    Ok(memplan::transforms::Transforms {
        split_chunks,
        fsdp: FsdpOptions {
            world: src.world_size.unwrap_or(1),
            prefetch: src.prefetch,
            reshard_after_forward: !src.no_reshard_after_forward,
            reduce_in_compute_dtype: src.reduce_bf16,
            layout: if src.flat_shards {
                ShardLayout::Flat
            } else {
                ShardLayout::PerParameter
            },
        },
    })
}

/// The built-in example `--example NAME` and the flags name (unsharded,
/// unsplit: [`load`] applies the transforms to files and examples alike).
fn example(name: &str, src: &GraphArgs) -> Result<ExampleSpec> {
    let mut spec = ExampleSpec::new(name)?;
    spec.opts = ExampleOptions {
        batch: src.batch,
        seq: src.seq,
        layers: src.layers,
        dtype: match &src.dtype {
            None => None,
            Some(d) => Some(
                DType::parse(d).ok_or_else(|| anyhow!("unknown --dtype {d:?} (f32, bf16, f16)"))?,
            ),
        },
        checkpoint: src.checkpoint,
        clip_grad_norm: src.clip_grad_norm,
        fused_attention: src.fused_attention,
        mixed_precision: src.mixed_precision,
    };
    Ok(spec)
}

pub fn load_unsharded(graph: Option<&Path>, src: &GraphArgs) -> Result<Graph> {
    match (&src.example, graph) {
        (Some(_), Some(p)) => bail!(
            "give either a graph file ({}) or --example, not both",
            p.display()
        ),
        (Some(name), None) => Ok(example(name, src)?.build()?),
        (None, Some(p)) if src.xla_allocations => {
            let opts = memplan::io::hlo::ImportOptions {
                xla_allocations: true,
                ..Default::default()
            };
            match memplan::io::load_graph_with(p, &opts)? {
                g if g.metadata.get("source").and_then(|s| s.as_str()) == Some("hlo") => Ok(g),
                _ => bail!(
                    "--xla-allocations applies to XLA HLO modules, and {} is not one",
                    p.display()
                ),
            }
        }
        (None, Some(p)) => Ok(memplan::io::load_graph(p)?),
        (None, None) => bail!("give a graph file or --example NAME"),
    }
}

/// `--time-limit`, checked by the rule every front end shares
/// ([`memplan::pipeline::time_limit`]).
pub fn time_limit(seconds: f64) -> Result<Duration> {
    Ok(memplan::pipeline::time_limit(seconds, "--time-limit")?)
}

fn options(seconds: f64) -> Result<Options> {
    Ok(Options {
        time_limit: time_limit(seconds)?,
        ..Options::default()
    })
}

pub fn solve(g: &Graph, time_limit: f64) -> Result<Plan> {
    Ok(solve_with_report(g, time_limit)?.0)
}

/// Plans with a progress bar (shown when the solve takes over a second).
pub fn solve_with_report(g: &Graph, time_limit: f64) -> Result<(Plan, memplan::pipeline::Report)> {
    let progress = std::sync::Arc::new(memplan_solver::Progress::new());
    let opts = Options {
        progress: Some(progress.clone()),
        ..options(time_limit)?
    };
    let guard = super::progress::watch(progress);
    let result = memplan::pipeline::plan_with_report(g, &opts);
    drop(guard);
    let (plan, report) = result?;
    // Every plan leaves through the independent checker.
    checker::check(g, &plan).context("internal error: memplan produced an invalid plan")?;
    Ok((plan, report))
}

/// `plan --xla-allocations`: of the plan of `g` (imported with XLA's
/// allocations), the one-arena plan of the same module and the module's own
/// order, the order whose estimated XLA total is lowest (docs/hlo.md), as a
/// plan of `g`, with its estimate; so never estimated above XLA's own
/// order. An order is a candidate only where it writes every aliased
/// output after its parameter's last reader.
pub fn for_xla(
    g: &Graph,
    module: &Path,
    plan: Plan,
    time_limit: f64,
) -> Result<(Plan, Option<memplan::io::hlo::xla_estimate::XlaEstimate>)> {
    use memplan::io::hlo::xla_estimate::estimate;
    let one_arena = memplan::io::load_graph(module)?;
    let (other, _) = solve_with_report(&one_arena, time_limit)?;
    let mut best = (estimate(g, &plan.order), None);
    let mut others = vec![("one-arena plan", other.order.clone())];
    if let Some((_, o)) = g.extra_orders.iter().find(|(n, _)| n == "xla-order") {
        others.push(("xla-order", o.clone()));
    }
    for (name, order) in others {
        if let Some(e) = estimate(g, &order) {
            if best.0.as_ref().is_none_or(|b| e.total < b.total) {
                best = (Some(e), Some((name, order)));
            }
        }
    }
    let Some((name, order)) = best.1 else {
        return Ok((plan, best.0));
    };
    let mut p = baselines::order_with_layout(g, &order, name);
    let s = &plan.stats;
    p.stats.lower_bound_bytes = s.lower_bound_bytes;
    p.stats.lower_bound_kind = s.lower_bound_kind.clone();
    p.stats.simple_bound_bytes = s.simple_bound_bytes;
    p.stats.bound_seconds = s.bound_seconds;
    p.stats.solve_seconds = s.solve_seconds + other.stats.solve_seconds;
    Ok((p, best.0))
}

/// Reads and checks the plan at `path`, or plans `g` when there is none.
pub fn load_or_make_plan(g: &Graph, path: Option<&Path>, time_limit: f64) -> Result<Plan> {
    if let Some(p) = path {
        let text = memplan::io::read_text(p)?;
        let plan = Plan::from_json(&text, g, p)?;
        checker::check(g, &plan)
            .map_err(|e| anyhow!("{}: the plan is invalid: {e}", p.display()))?;
        return Ok(plan);
    }
    let plan = memplan::plan(g, &options(time_limit)?)?;
    checker::check(g, &plan).context("internal error: memplan produced an invalid plan")?;
    Ok(plan)
}
