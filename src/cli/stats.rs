//! `memplan stats`: what a graph holds, without planning it.

use std::path::PathBuf;

use anyhow::Result;
use serde_json::json;

use super::GraphArgs;
use super::format::{grouped, human_bytes, table};
use super::load::load;

pub(super) fn stats(graph: Option<PathBuf>, src: &GraphArgs, as_json: bool) -> Result<()> {
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
