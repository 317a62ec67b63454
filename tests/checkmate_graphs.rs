//! Checkmate's benchmark graphs (fixtures/checkmate, networkx node-link
//! files as Moccasin publishes them) and `memplan fit` on them.
//!
//! - The importer reproduces the memory model and the starting order of
//!   Checkmate and Moccasin: the peak of the program order and the summed
//!   cost equal what Moccasin's own code computed for each graph
//!   (fixtures/checkmate/moccasin.json, from tools/moccasin_reference.py).
//! - At Moccasin's budgets (90% and 80% of that peak), every fit is checked
//!   and within its budget, and where Moccasin proved a budget infeasible
//!   memplan refuses it too, with a floor above the budget.
//!
//! How the added cost compares with Moccasin's is a benchmark, not a test:
//! `cargo run --release --example checkmate_fit` (docs/fit.md).

use std::path::{Path, PathBuf};
use std::time::Duration;

use memplan::checker;
use memplan::fit::{FitOptions, fit, fit_floor};
use memplan::graph::Graph;
use memplan::timeline::Timeline;
use serde_json::Value;

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/checkmate")
}

fn load(name: &str) -> Graph {
    memplan::io::load_graph(&dir().join(format!("{name}.json.gz"))).unwrap()
}

fn moccasin_rows() -> Vec<Value> {
    let text = std::fs::read_to_string(dir().join("moccasin.json")).unwrap();
    let doc: Value = serde_json::from_str(&text).unwrap();
    doc["rows"].as_array().unwrap().clone()
}

#[test]
fn program_order_peak_and_cost_are_moccasins() {
    let rows = moccasin_rows();
    assert_eq!(rows.len(), 14, "7 graphs at 2 budgets");
    for r in rows {
        let name = r["graph"].as_str().unwrap();
        let g = load(name);
        let peak = Timeline::program_order(&g).peak;
        assert_eq!(peak, r["topo_mem"].as_u64().unwrap(), "{name}: peak");
        let cost: f64 = g.ops().iter().map(|o| o.cost.unwrap()).sum();
        assert_eq!(cost, r["topo_cost"].as_f64().unwrap(), "{name}: cost");
        let share = r["share"].as_f64().unwrap();
        let budget = (peak as f64 * share).ceil() as u64;
        assert_eq!(budget, r["budget"].as_u64().unwrap(), "{name}: budget");
    }
}

#[test]
fn fits_at_moccasins_budgets_are_checked_or_refused_with_the_floor() {
    for r in moccasin_rows() {
        let name = r["graph"].as_str().unwrap();
        if !["vgg16", "vgg19", "unet"].contains(&name) {
            continue;
        }
        let g = load(name);
        let budget = r["budget"].as_u64().unwrap();
        let opts = FitOptions {
            budget,
            time_limit: Duration::from_secs(10),
            ..FitOptions::default()
        };
        let result = fit(&g, &opts);
        if r["status"] == "INFEASIBLE" {
            let (floor, _) = fit_floor(&g);
            assert!(floor > budget, "{name}: floor {floor} ≤ {budget}");
            let err = result.expect_err("refused").to_string();
            assert!(err.contains("needs at least"), "{err}");
            continue;
        }
        let f = result.unwrap_or_else(|e| panic!("{name} at {budget}: {e}"));
        checker::check(&f.graph, &f.plan).unwrap();
        assert!(f.plan.arena_bytes <= budget, "{name}");
        assert!(
            !f.recomputed.is_empty(),
            "{name}: fits without recomputation?"
        );
    }
}

#[test]
fn node_link_files_load_through_the_cli_loader_with_named_errors() {
    let tmp = std::env::temp_dir().join(format!("memplan-nx-{}.json", std::process::id()));
    std::fs::write(
        &tmp,
        r#"{"directed": true, "nodes": [{"id": 0, "cost_ram": 1}, {"id": 1, "cost_ram": "x"}], "links": []}"#,
    )
    .unwrap();
    let err = memplan::io::load_graph(&tmp).unwrap_err().to_string();
    std::fs::remove_file(&tmp).ok();
    assert!(
        err.contains("nodes[1]: cost_ram must be a finite number"),
        "{err}"
    );
    assert!(err.contains(&tmp.display().to_string()), "{err}");
}
