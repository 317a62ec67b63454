//! `memplan plan`: the plan of a graph (or an XLA module's schedule).

use std::path::PathBuf;

use anyhow::Result;
use serde_json::json;

use super::GraphArgs;
use super::format::{grouped, human_bytes, plan_summary, split_json, split_line};
use super::load::{for_xla, load_for_planning, solve_with_report};

pub(super) fn plan(
    graph: Option<PathBuf>,
    src: &GraphArgs,
    (output, graph_output): (Option<PathBuf>, Option<PathBuf>),
    as_json: bool,
    time_limit: f64,
    with_report: bool,
) -> Result<()> {
    super::claim_stdout(&[
        ("-o", output.as_deref()),
        ("--graph-output", graph_output.as_deref()),
    ])?;
    let (g, split) = load_for_planning(graph.as_deref(), src)?;
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
        let mut v = plan_summary(&g, &plan);
        v["plan_file"] = json!(output.as_ref().map(|p| p.display().to_string()));
        if split.tried.len() > 1 {
            v["split"] = split_json(&split);
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
            human_bytes(plan.arena_bytes),
            grouped(plan.arena_bytes),
            human_bytes(s.max_live_bytes),
            human_bytes(s.lower_bound_bytes),
            s.lower_bound_kind,
            s.bound_seconds,
            human_bytes(s.simple_bound_bytes),
            100.0 * plan.gap(),
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
            sayln!("{}", split_line(&split));
        }
        if let Some(out) = &output {
            sayln!("plan written to {}", super::shown(out));
        }
    }
    Ok(())
}
