//! `memplan compare`: the plan against every baseline.

use std::path::PathBuf;

use anyhow::Result;
use serde_json::json;

use memplan::baselines;
use memplan::graph::Graph;

use super::GraphArgs;
use super::format::{grouped, human_bytes, plan_summary, split_json, split_line, table};
use super::load::{for_xla, load_for_planning, solve};

pub(super) fn compare(
    graph: Option<PathBuf>,
    src: &GraphArgs,
    as_json: bool,
    time_limit: f64,
) -> Result<()> {
    let (g, split) = load_for_planning(graph.as_deref(), src)?;
    // memplan's plan is of the split step where `--split` lowers its
    // arena; the baselines then run that split step too, as eager with a
    // chunked loss does (torchtune's CEWithChunkedOutputLoss): the same
    // step on every side.
    let (g, mut plan, (), split) = memplan::split::plan_split_with(&g, split, |g, n| {
        solve(g, time_limit / f64::from(n)).map(|p| (p, ()))
    })?;
    let base = baselines::all(&g);
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
                    json!({"footprint_bytes": b.footprint_bytes,
                           "peak_bytes": b.footprint_bytes,
                           "description": b.description,
                           "ratio_to_lower_bound": b.footprint_bytes as f64 / lb as f64}),
                )
            })
            .collect();
        let best = base.iter().map(|b| b.footprint_bytes).min().unwrap_or(0);
        let arena = plan.arena_bytes;
        let mut v = plan_summary(&g, &plan);
        if split.tried.len() > 1 {
            v["split"] = split_json(&split);
        }
        v["ratio_to_lower_bound"] = json!(arena as f64 / lb as f64);
        v["ratio_to_best_baseline"] = json!(arena as f64 / best.max(1) as f64);
        v["baselines"] = json!(b);
        v["best_eager"] = json!(baselines::best_eager(&base).map(
            |b| json!({"name": b.name, "footprint_bytes": b.footprint_bytes,
                                 "peak_bytes": b.footprint_bytes})
        ));
        v["ratio_to_best_eager"] = json!(
            baselines::best_eager(&base).map(|b| arena as f64 / b.footprint_bytes.max(1) as f64)
        );
        v["xla_estimate_bytes"] = json!(xla.as_ref().map(|e| e.total));
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
            human_bytes(b.footprint_bytes),
            grouped(b.footprint_bytes),
            format!("{:.3}", b.footprint_bytes as f64 / lb as f64),
            String::new(),
        ]);
    }
    rows.push(vec![
        format!("memplan ({} + {})", s.order_source, s.layout_source),
        human_bytes(plan.arena_bytes),
        grouped(plan.arena_bytes),
        format!("{:.3}", plan.arena_bytes as f64 / lb as f64),
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
        table(
            &["plan", "memory", "bytes", "vs bound", "solve time"],
            &rows
        )
    );
    if split.tried.len() > 1 {
        // Every row is the split step's.
        println!("{}", split_line(&split));
    }
    if let Some(line) = verdict(&g, &base, plan.arena_bytes, xla.as_ref().map(|e| e.total)) {
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
/// XLA's total. `arena` is memplan's plan.
fn verdict(
    g: &Graph,
    base: &[baselines::Baseline],
    arena: u64,
    xla_estimate: Option<u64>,
) -> Option<String> {
    let find = |name: &str| {
        base.iter()
            .find(|b| b.name == name)
            .map(|b| b.footprint_bytes)
    };
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
                xla_estimate.unwrap_or(arena),
                xla,
                "XLA's own Total bytes (its memory-usage report)",
            )
        } else if let Some(x) = find("xla-order+memplan-layout") {
            (
                arena,
                x,
                "XLA's own order of the module, laid out in one arena",
            )
        } else {
            (
                arena,
                find("program-order+greedy")?,
                "the module's listed order, laid out greedily",
            )
        }
    } else {
        let best = baselines::best_eager(base)?;
        let mut line = format!(
            "memplan needs {}",
            versus(
                arena,
                best.footprint_bytes,
                &format!("the best eager configuration ({})", best.name)
            )
        );
        if best.name != "pytorch-reserved"
            && let Some(default) = find("pytorch-reserved")
        {
            line.push_str(&format!(
                "; {}",
                versus(
                    arena,
                    default,
                    "PyTorch eager on its default allocator (pytorch-reserved)"
                )
            ));
        }
        return Some(line);
    };
    Some(format!("memplan needs {}", versus(ours, theirs, what)))
}
