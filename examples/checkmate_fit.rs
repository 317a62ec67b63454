//! `memplan fit` on Checkmate's benchmark graphs (fixtures/checkmate, as
//! Moccasin publishes them), at the budgets of Moccasin's paper: 90% and
//! 80% of the peak of networkx's topological order. Prints, per graph and
//! budget, the cost memplan adds by recomputation, its arena and its wall
//! time, next to what Moccasin found on this machine
//! (fixtures/checkmate/moccasin.json, made by tools/moccasin_reference.py),
//! and the ratio of the two.
//!
//! ```text
//! cargo run --release --example checkmate_fit -- [TIME_LIMIT_S] [GRAPH...]
//! ```

use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, Instant};

use memplan::fit::{FitOptions, fit};
use memplan::timeline::Timeline;

const GRAPHS: [&str; 7] = [
    "vgg16",
    "vgg19",
    "fcn8",
    "segnet",
    "unet",
    "mobilenet",
    "resnet50",
];

/// Moccasin's rows, by (graph, share in percent).
fn reference(dir: &Path) -> HashMap<(String, u32), serde_json::Value> {
    let Ok(text) = std::fs::read_to_string(dir.join("moccasin.json")) else {
        return HashMap::new();
    };
    let Ok(doc) = serde_json::from_str::<serde_json::Value>(&text) else {
        return HashMap::new();
    };
    let rows = doc["rows"].as_array().cloned().unwrap_or_default();
    rows.into_iter()
        .filter_map(|r| {
            let g = r["graph"].as_str()?.to_string();
            let share = (r["share"].as_f64()? * 100.0).round() as u32;
            Some(((g, share), r))
        })
        .collect()
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let time_limit: f64 = args.first().map_or(Ok(10.0), |s| s.parse())?;
    let names: Vec<&str> = if args.len() > 1 {
        args[1..].iter().map(|s| s.as_str()).collect()
    } else {
        GRAPHS.to_vec()
    };
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/checkmate");
    let moccasin = reference(&dir);
    println!(
        "| graph | ops | budget | memplan +cost | memplan arena | proven | memplan s | Moccasin +cost | Moccasin status | Moccasin s | memplan / Moccasin cost |"
    );
    println!("|---|---:|---|---:|---:|---|---:|---:|---|---:|---:|");
    for name in names {
        let g = memplan::io::load_graph(&dir.join(format!("{name}.json.gz")))?;
        let topo = Timeline::program_order(&g).peak;
        for share in [90u32, 80] {
            let budget = (topo as u128 * share as u128).div_ceil(100) as u64;
            let opts = FitOptions {
                budget,
                time_limit: Duration::from_secs_f64(time_limit),
                ..FitOptions::default()
            };
            let t0 = Instant::now();
            let r = fit(&g, &opts);
            let secs = t0.elapsed().as_secs_f64();
            let m = moccasin.get(&(name.to_string(), share));
            let m_cost = m.and_then(|m| m["cost"].as_f64());
            let m_added = m.and_then(|m| m["added"].as_f64());
            let m_cells = format!(
                "{} | {} | {}",
                m_added.map_or("-".into(), |a| format!("{:.3}%", a * 100.0)),
                m.and_then(|m| m["status"].as_str()).unwrap_or("-"),
                m.and_then(|m| m["wall_s"].as_f64())
                    .map_or("-".into(), |s| format!(
                        "{s:.1} (limit {} per phase)",
                        m.and_then(|m| m["timeout_per_phase_s"].as_f64())
                            .unwrap_or(f64::NAN)
                    )),
            );
            match r {
                Ok(f) => {
                    let total = f.step.seconds + f.added.seconds;
                    let ratio = m_cost.map_or("-".into(), |c| format!("{:.4}", total / c));
                    println!(
                        "| {name} | {} | {share}% | {:.3}% | {} | {} | {secs:.1} | {m_cells} | {ratio} |",
                        g.num_ops(),
                        100.0 * f.added.seconds / f.step.seconds,
                        f.plan.arena_bytes,
                        if f.optimal { "yes" } else { "no" },
                    );
                }
                Err(e) => println!(
                    "| {name} | {} | {share}% | refused: {e} | | | {secs:.1} | {m_cells} | |",
                    g.num_ops()
                ),
            }
        }
    }
    Ok(())
}
