//! Imports, plans and checks every HLO module in a fixtures folder laid out
//! like `../shared/fixtures/hlo` (one folder per case holding
//! `before_optimizations.txt.gz`, `cpu_after_optimizations.txt.gz` and
//! XLA's memory-usage report), and prints one row per module: sizes,
//! times, the max live bytes of XLA's own order as memplan counts it, the
//! manifest's independent figure for it, memplan's arena, XLA's total, and
//! memplan / XLA with its geometric mean over the optimized modules.
//!
//! ```text
//! cargo run --release --example hlo_fixtures -- ../shared/fixtures/hlo [TIME_LIMIT_S]
//! ```

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use memplan::lower::{self, Lowered};
use memplan_solver as solver;

fn manifest(dir: &Path) -> HashMap<String, HashMap<String, String>> {
    let mut out = HashMap::new();
    let Ok(text) = std::fs::read_to_string(dir.join("manifest.csv")) else {
        return out;
    };
    let mut lines = text.lines();
    let Some(header) = lines.next() else {
        return out;
    };
    let cols: Vec<&str> = header.split(',').collect();
    for line in lines {
        // No cell of these manifests holds a comma; a row that does not
        // split into the header's columns is skipped.
        let cells: Vec<&str> = line.split(',').collect();
        if cells.len() != cols.len() {
            continue;
        }
        let row: HashMap<String, String> = cols
            .iter()
            .zip(&cells)
            .map(|(c, v)| (c.to_string(), v.to_string()))
            .collect();
        out.insert(cells[0].to_string(), row);
    }
    out
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let dir = PathBuf::from(args.get(1).map_or("../shared/fixtures/hlo", |s| s.as_str()));
    let time_limit: f64 = args.get(2).map_or(Ok(10.0), |s| s.parse())?;
    let man = manifest(&dir);
    let mut cases: Vec<PathBuf> = std::fs::read_dir(&dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_dir())
        .collect();
    cases.sort();
    println!(
        "{:<20} {:<24} {:>5} {:>6} {:>7} {:>7} {:>15} {:>15} {:>9} {:>15} {:>15} {:>7} {:>15} {:>8} {:>15}",
        "case",
        "file",
        "ops",
        "tens",
        "load_s",
        "plan_s",
        "xla_order_live",
        "manifest_live",
        "live/man",
        "memplan",
        "xla_total",
        "mp/xla",
        "bound",
        "mp/bound",
        "xla_realised"
    );
    let mut logs = Vec::new();
    for case in &cases {
        let name = case.file_name().unwrap().to_string_lossy().to_string();
        for file in [
            "before_optimizations.txt.gz",
            "cpu_after_optimizations.txt.gz",
        ] {
            let path = case.join(file);
            if !path.is_file() {
                continue;
            }
            let t0 = Instant::now();
            let g = memplan::io::load_graph(&path)?;
            let load_s = t0.elapsed().as_secs_f64();
            let t1 = Instant::now();
            let opts = memplan::Options {
                time_limit: Duration::from_secs_f64(time_limit),
                ..Default::default()
            };
            let plan = memplan::plan(&g, &opts)?;
            let plan_s = t1.elapsed().as_secs_f64();
            memplan::checker::check(&g, &plan)
                .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
            let low = lower::lower(&g, true);
            let xla_live = g
                .extra_orders
                .iter()
                .find(|(n, _)| n == "xla-order")
                .map(|(_, o)| solver::evaluate(&low.problem, &Lowered::from_op_ids(o)).peak);
            let xla_total = g
                .reference_peaks
                .iter()
                .find(|(n, _)| n == "xla")
                .map(|&(_, b)| b);
            let man_live = man
                .get(&name)
                .filter(|_| file.starts_with("cpu_after"))
                .and_then(|r| r.get("maxlive_xla_order_bytes"))
                .and_then(|v| v.parse::<u64>().ok());
            let ratio = |a: Option<u64>, b: Option<u64>| match (a, b) {
                (Some(a), Some(b)) if b > 0 => format!("{:.4}", a as f64 / b as f64),
                _ => "-".into(),
            };
            let show = |x: Option<u64>| x.map_or("-".to_string(), |v| v.to_string());
            let mp_xla = xla_total.map(|x| plan.arena_bytes as f64 / x as f64);
            if file.starts_with("cpu_after")
                && let Some(r) = mp_xla
            {
                logs.push(r.ln());
            }
            // XLA's order with XLA's own offsets (its buffer assignment).
            let realised = memplan::io::hlo::assignment::find(&path)?
                .and_then(|v| memplan::io::hlo::assignment::realised_peak(&g, &v))
                .map(|r| r.peak);
            let bound = plan.stats.lower_bound_bytes;
            println!(
                "{:<20} {:<24} {:>5} {:>6} {:>7.2} {:>7.2} {:>15} {:>15} {:>9} {:>15} {:>15} {:>7} {:>15} {:>8.4} {:>15}",
                name,
                file.trim_end_matches(".txt.gz"),
                g.num_ops(),
                g.num_tensors(),
                load_s,
                plan_s,
                show(xla_live),
                show(man_live),
                ratio(xla_live, man_live),
                plan.arena_bytes,
                show(xla_total),
                mp_xla.map_or("-".to_string(), |r| format!("{r:.4}")),
                bound,
                plan.arena_bytes as f64 / bound.max(1) as f64,
                show(realised),
            );
        }
    }
    if !logs.is_empty() {
        let gm = (logs.iter().sum::<f64>() / logs.len() as f64).exp();
        println!(
            "geometric mean of memplan / XLA total over {} optimized modules: {gm:.4}",
            logs.len()
        );
    }
    Ok(())
}
