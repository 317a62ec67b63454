//! `memplan check`: a plan (or graph) file through the independent checker.

use std::path::PathBuf;

use anyhow::{Result, anyhow, bail};
use serde_json::json;

use memplan::{Plan, checker};

use super::GraphArgs;
use super::load::load;

pub(super) fn check(files: Vec<PathBuf>, src: &GraphArgs, as_json: bool) -> Result<()> {
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
            "host_max_live_bytes": report.host_max_live_bytes,
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
