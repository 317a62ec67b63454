//! The pipeline as text in, text out, for the bindings (the C ABI in
//! `capi/`, the Python package in `python/`): graphs and plans cross a
//! language boundary as the JSON documents of docs/graph-format.md and
//! docs/plan-format.md, so no Rust type leaks into another language and
//! every binding gets the same errors (which element of which document is
//! wrong, never a panic).

use std::path::Path;
use std::time::Duration;

use serde_json::json;

use crate::error::Error;
use crate::graph::Graph;
use crate::plan::Plan;
use crate::{checker, io, pipeline};

/// How a document that did not come from a file is named in errors.
pub const GRAPH_DOC: &str = "<graph>";
pub const PLAN_DOC: &str = "<plan>";

fn graph(text: &str) -> Result<Graph, Error> {
    io::json::parse_graph(text, Path::new(GRAPH_DOC))
}

/// Plans the graph in `graph_json` within `time_limit_s` seconds and
/// returns the plan document (order, every tensor's offset, the arena, and
/// in `stats` the lower bound and the gap to it). The plan has passed the
/// independent checker.
pub fn plan_json(graph_json: &str, time_limit_s: f64) -> Result<String, Error> {
    let time_limit = Duration::try_from_secs_f64(time_limit_s)
        .ok()
        .filter(|d| !d.is_zero())
        .ok_or_else(|| {
            Error::Invalid(format!(
                "time limit must be a positive number of seconds, got {time_limit_s}"
            ))
        })?;
    let g = graph(graph_json)?;
    let opts = pipeline::Options {
        time_limit,
        ..pipeline::Options::default()
    };
    let plan = pipeline::plan(&g, &opts)?;
    checker::check(&g, &plan).map_err(|e| Error::Invalid(format!("internal error: {e}")))?;
    Ok(plan.to_json(&g))
}

/// Checks the plan document `plan_json` against the graph in `graph_json`
/// with the independent checker; returns its report as JSON
/// (`max_live_bytes`, `used_bytes`, `ops`, `tensors_placed`).
pub fn check_json(graph_json: &str, plan_json: &str) -> Result<String, Error> {
    let g = graph(graph_json)?;
    let plan = Plan::from_json(plan_json, &g, Path::new(PLAN_DOC))?;
    let r = checker::check(&g, &plan).map_err(|e| Error::Invalid(format!("{PLAN_DOC}: {e}")))?;
    Ok(json!({
        "max_live_bytes": r.max_live_bytes,
        "used_bytes": r.used_bytes,
        "ops": r.ops,
        "tensors_placed": r.tensors_placed,
    })
    .to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::{ExampleOptions, example};

    #[test]
    fn plans_checks_and_names_what_is_wrong() {
        let g = example("gpt2-tiny", &ExampleOptions::default()).unwrap();
        let text = io::json::write_graph(&g);
        let plan = plan_json(&text, 2.0).unwrap();
        let report: serde_json::Value =
            serde_json::from_str(&check_json(&text, &plan).unwrap()).unwrap();
        let p: serde_json::Value = serde_json::from_str(&plan).unwrap();
        assert!(report["max_live_bytes"].as_u64().unwrap() <= p["arena_bytes"].as_u64().unwrap());
        let e = plan_json("{", 1.0).unwrap_err().to_string();
        assert!(e.contains(GRAPH_DOC), "{e}");
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY, 1e300] {
            let e = plan_json(&text, bad).unwrap_err().to_string();
            assert!(e.contains("time limit"), "{bad}: {e}");
        }
        // A plan whose arena is too small fails the checker, by name.
        let mut bad = p.clone();
        bad["arena_bytes"] = json!(16);
        let e = check_json(&text, &bad.to_string()).unwrap_err().to_string();
        assert!(e.contains(PLAN_DOC), "{e}");
    }
}
