//! `memplan plan --report`: where the time went, and each part's size,
//! bound, result and gap.

use memplan::Plan;
use memplan::graph::Graph;
use memplan::pipeline::Report;
use memplan_solver::partition::PartKind;
use serde_json::{Value, json};

use super::format::{grouped, human_bytes, table};

/// Parts listed one by one in the text report (the highest peaks).
const SHOWN_PARTS: usize = 12;

fn kind(k: PartKind) -> &'static str {
    match k {
        PartKind::KeyPoint => "key point",
        PartKind::Segment => "segment",
    }
}

/// The report as text.
pub fn text(g: &Graph, plan: &Plan, r: &Report) -> String {
    let s = &r.solver;
    let mut out = String::new();
    let phases: Vec<String> = r
        .phases
        .iter()
        .map(|(n, t)| format!("{n} {t:.3} s"))
        .collect();
    out.push_str(&format!("time: {}\n", phases.join(", ")));
    let sp: Vec<String> = s
        .phases
        .iter()
        .map(|(n, t)| format!("{n} {t:.3} s"))
        .collect();
    out.push_str(&format!(
        "  ordering: {} ({} thread{}){}\n",
        sp.join(", "),
        s.threads,
        if s.threads == 1 { "" } else { "s" },
        if s.time_limit_hit {
            "; the time limit cut a search short"
        } else {
            ""
        }
    ));
    let rows: Vec<Vec<String>> = r
        .candidates
        .iter()
        .map(|(n, live, arena)| {
            vec![
                n.clone(),
                human_bytes(*live),
                arena.map_or("-".into(), human_bytes),
            ]
        })
        .collect();
    out.push_str("\ncandidate orders:\n");
    out.push_str(&table(&["order", "max live", "arena"], &rows));

    out.push_str(&parts_text(s));
    // The parts stop at their own (simple) bounds; the plan's bound below
    // (the min-cut floor over the whole step) may prove what they could not.
    let proof = if s.proven {
        ", proven optimal".to_string()
    } else if plan.stats.lower_bound_bytes >= s.peak {
        format!(
            ", proven optimal by the plan's {} bound",
            plan.stats.lower_bound_kind
        )
    } else {
        String::new()
    };
    out.push_str(&format!(
        "\n{}: order peak {} ({} bytes), parts' bound {} ({} bytes), gap {:.2}%{}\n",
        g.name,
        human_bytes(s.peak),
        grouped(s.peak),
        human_bytes(s.lower_bound),
        grouped(s.lower_bound),
        100.0 * s.gap(),
        proof
    ));
    out.push_str(&format!(
        "plan: arena {} ({} bytes) from {} + {}, max live {}, lower bound {} ({})\n",
        human_bytes(plan.arena_bytes),
        grouped(plan.arena_bytes),
        plan.stats.order_source,
        plan.stats.layout_source,
        human_bytes(plan.stats.max_live_bytes),
        human_bytes(plan.stats.lower_bound_bytes),
        plan.stats.lower_bound_kind
    ));
    out
}

/// The solver's parts: how many of each kind, how many proven, and the
/// ones with the highest peaks.
fn parts_text(s: &memplan_solver::SolveReport) -> String {
    let mut out = String::new();
    let keys = s
        .parts
        .iter()
        .filter(|p| p.kind == PartKind::KeyPoint)
        .count();
    let proven = s.parts.iter().filter(|p| p.proven).count();
    let largest = s.parts.iter().map(|p| p.ops).max().unwrap_or(0);
    out.push_str(&format!(
        "\n{} parts ({} key points, {} segments, largest {} ops), {} proven optimal\n",
        s.parts.len(),
        keys,
        s.parts.len() - keys,
        largest,
        proven
    ));
    let mut shown: Vec<&memplan_solver::PartReport> = s.parts.iter().collect();
    shown.sort_by_key(|p| (std::cmp::Reverse(p.peak), p.index));
    let rows: Vec<Vec<String>> = shown
        .iter()
        .take(SHOWN_PARTS)
        .map(|p| {
            vec![
                format!("#{}", p.index),
                kind(p.kind).into(),
                p.ops.to_string(),
                human_bytes(p.base),
                human_bytes(p.bound),
                human_bytes(p.first_peak),
                human_bytes(p.peak),
                format!("{:.2}%", 100.0 * p.gap()),
                if p.proven { "yes" } else { "no" }.into(),
                format!("{:.3}", p.seconds),
                p.method.clone(),
            ]
        })
        .collect();
    out.push_str(&format!(
        "parts with the highest peaks (of {}):\n",
        s.parts.len()
    ));
    out.push_str(&table(
        &[
            "part",
            "kind",
            "ops",
            "base",
            "bound",
            "heuristic",
            "peak",
            "gap",
            "proven",
            "s",
            "method",
        ],
        &rows,
    ));
    out
}

/// The report as JSON.
pub fn json(r: &Report) -> Value {
    let s = &r.solver;
    let parts: Vec<Value> = s
        .parts
        .iter()
        .map(|p| {
            json!({
                "index": p.index, "kind": kind(p.kind), "ops": p.ops, "base_bytes": p.base,
                "bound_bytes": p.bound, "heuristic_peak_bytes": p.first_peak,
                "peak_bytes": p.peak, "gap": p.gap(), "proven": p.proven,
                "method": p.method, "seconds": p.seconds, "states": p.states,
            })
        })
        .collect();
    json!({
        "phases": r.phases.iter().map(|(n, t)| json!({"phase": n, "seconds": t})).collect::<Vec<_>>(),
        "ordering_phases": s.phases.iter().map(|(n, t)| json!({"phase": n, "seconds": t})).collect::<Vec<_>>(),
        "threads": s.threads,
        "time_limit_hit": s.time_limit_hit,
        "order_peak_bytes": s.peak,
        "solver_bound_bytes": s.lower_bound,
        "proven": s.proven,
        "candidates": r.candidates.iter().map(|(n, l, a)| json!({"order": n, "max_live_bytes": l, "arena_bytes": a})).collect::<Vec<_>>(),
        "parts": parts,
    })
}
