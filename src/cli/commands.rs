//! The commands behind the CLI.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use serde_json::json;

use memplan::graph::Graph;
use memplan::models::{DType, ExampleOptions};
use memplan::{Options, Plan, baselines, checker};

use super::format::{grouped, human_bytes, table};
use super::{Command, GraphArgs};

pub fn run(cmd: Command) -> Result<()> {
    match cmd {
        Command::Plan {
            graph,
            source,
            output,
            json,
            time_limit,
            report,
            split,
            graph_output,
        } => plan(
            graph,
            &source,
            (output, graph_output),
            json,
            time_limit,
            report,
            split,
        ),
        Command::Check {
            files,
            source,
            json,
        } => check(files, &source, json),
        Command::Stats {
            graph,
            source,
            json,
        } => stats(graph, &source, json),
        Command::Compare {
            graph,
            source,
            json,
            time_limit,
        } => compare(graph, &source, json, time_limit),
        Command::Export {
            graph,
            source,
            output,
            hlo,
            plan,
            time_limit,
            no_chain,
        } => match (hlo, graph) {
            (true, Some(g)) => {
                let opts = memplan::io::hlo::ImportOptions {
                    xla_allocations: source.xla_allocations,
                    ..Default::default()
                };
                export_hlo(&g, plan.as_deref(), &output, time_limit, no_chain, &opts)
            }
            (true, None) => bail!("--hlo needs the HLO module file as GRAPH"),
            (false, g) => export(g.as_deref(), &source, &output),
        },
        Command::Alloc(a) => super::alloc::run(a),
        Command::Run(args) => super::run::run(args),
        Command::Bench(a) => super::bench::run(a),
        Command::Plot(a) => super::plot::run(a),
        Command::Trace(a) => super::trace::run(a),
        Command::Fit(a) => super::fit::run(a),
    }
}

/// Loads the graph a command names: a file or `--example`, sharded over
/// `--world-size` ranks if given.
pub fn load(graph: Option<&Path>, src: &GraphArgs) -> Result<Graph> {
    let g = load_unsharded(graph, src)?;
    let g = match src.split_chunks {
        Some(k) => memplan::split::split_graph(&g, k)?,
        None => g,
    };
    shard(g, src)
}

/// `g` sharded as --world-size asks (unchanged without it).
pub fn shard(g: Graph, src: &GraphArgs) -> Result<Graph> {
    match src.world_size {
        Some(w) if w > 1 => {
            let opts = memplan::models::fsdp::FsdpOptions {
                world: w,
                prefetch: src.prefetch,
                reshard_after_forward: !src.no_reshard_after_forward,
                reduce_in_compute_dtype: src.reduce_bf16,
                layout: if src.flat_shards {
                    memplan::models::fsdp::ShardLayout::Flat
                } else {
                    memplan::models::fsdp::ShardLayout::PerParameter
                },
            };
            let unit = &memplan::models::fsdp::default_unit;
            Ok(memplan::models::fsdp::shard_with(&g, &opts, unit)?)
        }
        Some(0) => bail!("--world-size must be at least 1"),
        _ => Ok(g),
    }
}

pub fn load_unsharded(graph: Option<&Path>, src: &GraphArgs) -> Result<Graph> {
    match (&src.example, graph) {
        (Some(_), Some(p)) => bail!(
            "give either a graph file ({}) or --example, not both",
            p.display()
        ),
        (Some(name), None) => {
            let dtype = match &src.dtype {
                None => None,
                Some(d) => Some(
                    DType::parse(d)
                        .ok_or_else(|| anyhow!("unknown --dtype {d:?} (f32, bf16, f16)"))?,
                ),
            };
            let opts = ExampleOptions {
                batch: src.batch,
                seq: src.seq,
                layers: src.layers,
                dtype,
                checkpoint: src.checkpoint,
                clip_grad_norm: src.clip_grad_norm,
                fused_attention: src.fused_attention,
                mixed_precision: src.mixed_precision,
            };
            Ok(memplan::models::example(name, &opts)?)
        }
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
fn solve_with_report(g: &Graph, time_limit: f64) -> Result<(Plan, memplan::pipeline::Report)> {
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

fn plan(
    graph: Option<PathBuf>,
    src: &GraphArgs,
    (output, graph_output): (Option<PathBuf>, Option<PathBuf>),
    as_json: bool,
    time_limit: f64,
    with_report: bool,
    split: memplan::split::Split,
) -> Result<()> {
    super::claim_stdout(&[
        ("-o", output.as_deref()),
        ("--graph-output", graph_output.as_deref()),
    ])?;
    let g = load(graph.as_deref(), src)?;
    let (g, (mut plan, report), split) = memplan::split::plan_split_with(&g, split, |g, n| {
        solve_with_report(g, time_limit / f64::from(n))
    })
    .map(|(g, p, r, s)| (g, (p, r), s))?;
    if let Some(out) = &graph_output {
        super::write_output(out, &memplan::io::json::write_graph(&g))?;
    }
    let mut xla = None;
    if let (true, Some(path)) = (src.xla_allocations, graph.as_deref()) {
        let (p, e) = for_xla(&g, path, plan, time_limit)?;
        plan = p;
        xla = e;
    }
    if let Some(out) = &output {
        super::write_output(out, &plan.to_json(&g))?;
    }
    let s = &plan.stats;
    if as_json {
        let v = json!({
            "graph": g.name,
            "ops": g.num_ops(),
            "tensors": g.num_tensors(),
            "peak_bytes": s.peak_bytes,
            "max_live_bytes": s.max_live_bytes,
            "lower_bound_bytes": s.lower_bound_bytes,
            "lower_bound_kind": s.lower_bound_kind,
            "simple_bound_bytes": s.simple_bound_bytes,
            "bound_seconds": s.bound_seconds,
            "gap": s.gap(),
            "solve_seconds": s.solve_seconds,
            "order_source": s.order_source,
            "layout_source": s.layout_source,
            "time_limit_hit": s.time_limit_hit,
            "plan_file": output.as_ref().map(|p| p.display().to_string()),
        });
        let mut v = v;
        if split.tried.len() > 1 {
            v["split"] = json!({
                "chunks": split.chunks,
                "chains": split.chains,
                "added_flops": split.added_flops,
                "step_flops": split.step_flops,
                "tried": split.tried.iter().map(|&(k, b)| json!({"chunks": k, "peak_bytes": b})).collect::<Vec<_>>(),
            });
        }
        if with_report {
            v["report"] = super::report::json(&report);
        }
        if let Some(e) = &xla {
            v["xla_estimate_bytes"] = json!(e.total);
            v["xla_hosted_bytes"] = json!(e.hosted_bytes);
        }
        sayln!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        if with_report {
            say!("{}", super::report::text(&g, &plan, &report));
        }
        sayln!(
            "{}: arena {} ({} bytes), max live {}, lower bound {} ({}, {:.2} s; simple bound {}), gap {:.2}%, solved in {:.2} s",
            g.name,
            human_bytes(s.peak_bytes),
            grouped(s.peak_bytes),
            human_bytes(s.max_live_bytes),
            human_bytes(s.lower_bound_bytes),
            s.lower_bound_kind,
            s.bound_seconds,
            human_bytes(s.simple_bound_bytes),
            100.0 * s.gap(),
            s.solve_seconds
        );
        if s.time_limit_hit {
            sayln!(
                "stopped at the time limit ({time_limit} s): this is the best plan found by then (checked); a longer --time-limit may find a smaller one"
            );
        }
        if let Some(e) = &xla {
            sayln!(
                "XLA's Total bytes for this order, estimated: {} ({} bytes; {} put into dead parameters' allocations; order from the {})",
                human_bytes(e.total),
                grouped(e.total),
                human_bytes(e.hosted_bytes),
                s.order_source
            );
        }
        if split.tried.len() > 1 {
            let tried: Vec<String> = split
                .tried
                .iter()
                .map(|&(k, b)| format!("{k}: {}", human_bytes(b)))
                .collect();
            sayln!(
                "split: {} (arena by chunks: {}; {} FLOPs added, {:.4}% of the step's)",
                if split.chunks > 1 {
                    format!("{} chain(s) into {} chunks", split.chains, split.chunks)
                } else {
                    "none (no split lowered the arena)".to_string()
                },
                tried.join(", "),
                grouped(split.added_flops as u64),
                100.0 * split.added_flops / split.step_flops.max(1.0)
            );
        }
        if let Some(out) = &output {
            sayln!("plan written to {}", super::shown(out));
        }
    }
    Ok(())
}

/// `plan --xla-allocations`: of the plan of `g` (imported with XLA's
/// allocations), the one-arena plan of the same module and the module's own
/// order, the order whose estimated XLA total is lowest (docs/hlo.md), as a
/// plan of `g`, with its estimate; so never estimated above XLA's own
/// order. An order is a candidate only where it writes every aliased
/// output after its parameter's last reader.
fn for_xla(
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

fn check(files: Vec<PathBuf>, src: &GraphArgs, as_json: bool) -> Result<()> {
    let (g, plan_path) = match (&src.example, files.as_slice()) {
        (Some(_), [p]) => (load(None, src)?, p.clone()),
        (None, [g, p]) => (load(Some(g), src)?, p.clone()),
        (Some(_), _) => bail!("with --example, give only the plan file"),
        (None, _) => bail!("give GRAPH PLAN"),
    };
    let text = memplan::io::read_text(&plan_path)?;
    let plan = Plan::from_json(&text, &g, &plan_path)?;
    let report = checker::check(&g, &plan)
        .map_err(|e| anyhow!("{}: the plan is invalid: {e}", plan_path.display()))?;
    if as_json {
        let v = json!({
            "valid": true,
            "ops": report.ops,
            "tensors_placed": report.tensors_placed,
            "max_live_bytes": report.max_live_bytes,
            "used_bytes": report.used_bytes,
            "arena_bytes": plan.arena_bytes,
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        println!(
            "{}: {report}, arena {} bytes",
            plan_path.display(),
            plan.arena_bytes
        );
    }
    Ok(())
}

fn stats(graph: Option<PathBuf>, src: &GraphArgs, as_json: bool) -> Result<()> {
    let g = load(graph.as_deref(), src)?;
    let by_role = g.bytes_by_role();
    let views = g.tensors().iter().filter(|t| t.is_view()).count();
    let mut kinds: std::collections::BTreeMap<&str, usize> = Default::default();
    for o in g.ops() {
        *kinds.entry(o.kind.as_str()).or_default() += 1;
    }
    let hints: usize = g.ops().iter().map(|o| o.reuse.len()).sum();
    let updates: usize = g.ops().iter().map(|o| o.updates.len()).sum();
    if as_json {
        let roles: serde_json::Map<String, serde_json::Value> = by_role
            .iter()
            .map(|(r, b)| (r.as_str().to_string(), json!(b)))
            .collect();
        let v = json!({
            "graph": g.name,
            "ops": g.num_ops(),
            "tensors": g.num_tensors(),
            "views": views,
            "ops_by_kind": kinds,
            "reuse_hints": hints,
            "in_place_updates": updates,
            "total_bytes": g.total_bytes(),
            "resident_bytes": g.resident_bytes(),
            "bytes_by_role": roles,
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!(
        "{}: {} ops, {} tensors ({} views), {} reuse hints, {} in-place updates",
        g.name,
        grouped(g.num_ops() as u64),
        grouped(g.num_tensors() as u64),
        views,
        hints,
        updates
    );
    let k: Vec<String> = kinds.iter().map(|(k, n)| format!("{k} {n}")).collect();
    println!("ops by kind: {}", k.join(", "));
    let rows: Vec<Vec<String>> = by_role
        .iter()
        .filter(|(_, b)| *b > 0)
        .map(|(r, b)| vec![r.to_string(), human_bytes(*b), grouped(*b)])
        .collect();
    print!("{}", table(&["role", "size", "bytes"], &rows));
    println!(
        "total {} ({} resident for the whole step)",
        human_bytes(g.total_bytes()),
        human_bytes(g.resident_bytes())
    );
    Ok(())
}

fn compare(graph: Option<PathBuf>, src: &GraphArgs, as_json: bool, time_limit: f64) -> Result<()> {
    let g = load(graph.as_deref(), src)?;
    let base = baselines::all(&g);
    let mut plan = solve(&g, time_limit)?;
    let mut xla = None;
    if let (true, Some(path)) = (src.xla_allocations, graph.as_deref()) {
        (plan, xla) = for_xla(&g, path, plan, time_limit)?;
    }
    let s = &plan.stats;
    let lb = s.lower_bound_bytes.max(1);
    if as_json {
        let b: serde_json::Map<String, serde_json::Value> = base
            .iter()
            .map(|b| {
                (
                    b.name.clone(),
                    json!({"peak_bytes": b.peak_bytes, "description": b.description,
                           "ratio_to_lower_bound": b.peak_bytes as f64 / lb as f64}),
                )
            })
            .collect();
        let best = base.iter().map(|b| b.peak_bytes).min().unwrap_or(0);
        let v = json!({
            "graph": g.name,
            "ops": g.num_ops(),
            "tensors": g.num_tensors(),
            "peak_bytes": s.peak_bytes,
            "max_live_bytes": s.max_live_bytes,
            "lower_bound_bytes": s.lower_bound_bytes,
            "lower_bound_kind": s.lower_bound_kind,
            "simple_bound_bytes": s.simple_bound_bytes,
            "bound_seconds": s.bound_seconds,
            "ratio_to_lower_bound": s.peak_bytes as f64 / lb as f64,
            "ratio_to_best_baseline": s.peak_bytes as f64 / best.max(1) as f64,
            "solve_seconds": s.solve_seconds,
            "order_source": s.order_source,
            "layout_source": s.layout_source,
            "baselines": b,
            "best_eager": baselines::best_eager(&base)
                .map(|b| json!({"name": b.name, "peak_bytes": b.peak_bytes})),
            "ratio_to_best_eager": baselines::best_eager(&base)
                .map(|b| s.peak_bytes as f64 / b.peak_bytes.max(1) as f64),
            "xla_estimate_bytes": xla.as_ref().map(|e| e.total),
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!(
        "{}: {} ops, {} tensors",
        g.name,
        grouped(g.num_ops() as u64),
        grouped(g.num_tensors() as u64)
    );
    let mut rows = vec![vec![
        format!("lower bound ({})", s.lower_bound_kind),
        human_bytes(s.lower_bound_bytes),
        grouped(s.lower_bound_bytes),
        "1.000".into(),
        format!("{:.1} ms", 1e3 * s.bound_seconds),
    ]];
    rows.push(vec![
        "simple bound".into(),
        human_bytes(s.simple_bound_bytes),
        grouped(s.simple_bound_bytes),
        format!("{:.3}", s.simple_bound_bytes as f64 / lb as f64),
        String::new(),
    ]);
    for b in &base {
        rows.push(vec![
            b.name.clone(),
            human_bytes(b.peak_bytes),
            grouped(b.peak_bytes),
            format!("{:.3}", b.peak_bytes as f64 / lb as f64),
            String::new(),
        ]);
    }
    rows.push(vec![
        format!("memplan ({} + {})", s.order_source, s.layout_source),
        human_bytes(s.peak_bytes),
        grouped(s.peak_bytes),
        format!("{:.3}", s.peak_bytes as f64 / lb as f64),
        format!("{:.2} s", s.solve_seconds),
    ]);
    if let Some(e) = &xla {
        rows.push(vec![
            "memplan, xla-estimate".into(),
            human_bytes(e.total),
            grouped(e.total),
            format!("{:.3}", e.total as f64 / lb as f64),
            String::new(),
        ]);
    }
    print!(
        "{}",
        table(&["plan", "peak", "bytes", "vs bound", "solve time"], &rows)
    );
    if let Some(line) = verdict(&g, &base, s.peak_bytes, xla.as_ref().map(|e| e.total)) {
        println!("{line}");
    }
    Ok(())
}

/// `compare`'s closing sentence: memplan against the baseline a user of
/// the input's framework runs today. An XLA module: XLA's own total (its
/// memory-usage report), else XLA's own order; another graph: the best
/// eager configuration (the least reserved memory of PyTorch eager's
/// simulated configurations, [`baselines::best_eager`]), then PyTorch
/// eager on its default allocator as a second figure. `xla_estimate` is
/// memplan's plan in XLA's terms (`--xla-allocations`), compared with
/// XLA's total.
fn verdict(
    g: &Graph,
    base: &[baselines::Baseline],
    peak: u64,
    xla_estimate: Option<u64>,
) -> Option<String> {
    let find = |name: &str| base.iter().find(|b| b.name == name).map(|b| b.peak_bytes);
    let versus = |ours: u64, theirs: u64, what: &str| {
        let change = 1.0 - ours as f64 / theirs.max(1) as f64;
        if change >= 0.0 {
            format!("{:.1}% less than {what}", 100.0 * change)
        } else {
            format!("{:.1}% more than {what}", -100.0 * change)
        }
    };
    let hlo = g.metadata.get("source").and_then(|s| s.as_str()) == Some("hlo");
    let (ours, theirs, what) = if hlo {
        if let Some(xla) = find("xla") {
            (
                xla_estimate.unwrap_or(peak),
                xla,
                "XLA's own Total bytes (its memory-usage report)",
            )
        } else if let Some(x) = find("xla-order+memplan-layout") {
            (
                peak,
                x,
                "XLA's own order of the module, laid out in one arena",
            )
        } else {
            (
                peak,
                find("program-order+greedy")?,
                "the module's listed order, laid out greedily",
            )
        }
    } else {
        let best = baselines::best_eager(base)?;
        let mut line = format!(
            "memplan needs {}",
            versus(
                peak,
                best.peak_bytes,
                &format!("the best eager configuration ({})", best.name)
            )
        );
        if best.name != "pytorch-reserved"
            && let Some(default) = find("pytorch-reserved")
        {
            line.push_str(&format!(
                "; {}",
                versus(
                    peak,
                    default,
                    "PyTorch eager on its default allocator (pytorch-reserved)"
                )
            ));
        }
        return Some(line);
    };
    Some(format!("memplan needs {}", versus(ours, theirs, what)))
}

fn export(graph: Option<&Path>, src: &GraphArgs, output: &Path) -> Result<()> {
    let g = load(graph, src)?;
    if super::is_stdout(output) {
        super::write_output(output, &memplan::io::json::write_graph(&g))?;
    } else {
        memplan::io::save_graph(&g, output)?;
    }
    eprintln!(
        "wrote {} ({} ops, {} tensors) to {}",
        g.name,
        g.num_ops(),
        g.num_tensors(),
        super::shown(output)
    );
    Ok(())
}

/// `export --hlo`: the module relisted in the plan's order.
fn export_hlo(
    module: &Path,
    plan: Option<&Path>,
    output: &Path,
    time_limit: f64,
    no_chain: bool,
    opts: &memplan::io::hlo::ImportOptions,
) -> Result<()> {
    use memplan::io::hlo;
    let text = memplan::io::read_text(module)?;
    if !hlo::looks_like_hlo(&text) {
        bail!(
            "{}: --hlo needs an XLA HLO module (text starting with `HloModule`)",
            module.display()
        );
    }
    let m = hlo::parse_module(&text).map_err(|e| {
        anyhow!(memplan::error::Error::from(e)).context(format!("reading {}", module.display()))
    })?;
    let g = hlo::import::import_module(&m, opts).map_err(|e| e.in_file(module))?;
    let plan = match plan {
        Some(p) => {
            let t = memplan::io::read_text(p)?;
            let plan = Plan::from_json(&t, &g, p)?;
            checker::check(&g, &plan).with_context(|| {
                format!(
                    "{} is not a valid plan of {}",
                    p.display(),
                    module.display()
                )
            })?;
            plan
        }
        None if opts.xla_allocations => for_xla(&g, module, solve(&g, time_limit)?, time_limit)?.0,
        None => solve(&g, time_limit)?,
    };
    let out = hlo::schedule::scheduled_text(&text, &m, &g, &plan.order, !no_chain)
        .with_context(|| format!("relisting {}", module.display()))?;
    if super::is_stdout(output) {
        super::write_output(output, &out)?;
    } else {
        memplan::io::write_text(output, &out)?;
    }
    let xla_order = g
        .extra_orders
        .iter()
        .find(|(n, _)| n == "xla-order")
        .map(|(n, o)| baselines::order_with_layout(&g, o, n).stats.max_live_bytes);
    eprintln!(
        "wrote {} scheduled in memplan's order to {}: max live {} ({} bytes){}",
        m.name,
        super::shown(output),
        human_bytes(plan.stats.max_live_bytes),
        grouped(plan.stats.max_live_bytes),
        match xla_order {
            Some(x) => format!(
                ", XLA's own order {} ({} bytes)",
                human_bytes(x),
                grouped(x)
            ),
            None => String::new(),
        }
    );
    Ok(())
}
