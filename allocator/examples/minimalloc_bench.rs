//! Runs the allocator over MiniMalloc benchmark files and prints one row
//! per problem: max live, the best greedy layout, capacity mode at the
//! capacity in the file name (`A.1048576.csv`), and, with `--minimize`,
//! the smallest arena found.
//!
//! ```text
//! cargo run --release -p memplan-allocator --example minimalloc_bench -- \
//!     [--time-limit S] [--minimize] [--capacity N] [--threads N] \
//!     [--node-budget N] [--seed N] [--disable LIST] [--node-limit N] \
//!     [--preorders TWA,TAW,WAT,SW] FILE_OR_DIR...
//! ```
//!
//! Every layout goes through [`validate`] before it is counted.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use memplan_allocator::io::minimalloc_csv;
use memplan_allocator::{Mode, Preorder, SolverParams, Status, solve, validate};

fn main() {
    if let Err(e) = run() {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let mut files: Vec<PathBuf> = Vec::new();
    let mut limit = 10.0f64;
    let mut minimize = false;
    let mut disable: Vec<String> = Vec::new();
    let mut node_limit: Option<u64> = None;
    let mut cap_override: Option<u64> = None;
    let mut threads: Option<usize> = None;
    let mut node_budget: Option<u64> = None;
    let mut seed = 0u64;
    let mut preorders: Option<Vec<Preorder>> = None;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--time-limit" => {
                limit = args
                    .next()
                    .ok_or("--time-limit needs seconds")?
                    .parse()
                    .map_err(|_| "--time-limit: not a number")?
            }
            "--minimize" => minimize = true,
            "--threads" => {
                threads = Some(
                    args.next()
                        .ok_or("--threads needs a number")?
                        .parse()
                        .map_err(|_| "--threads: not a number")?,
                )
            }
            "--seed" => {
                seed = args
                    .next()
                    .ok_or("--seed needs a number")?
                    .parse()
                    .map_err(|_| "--seed: not a number")?
            }
            "--node-budget" => {
                node_budget = Some(
                    args.next()
                        .ok_or("--node-budget needs a number")?
                        .parse()
                        .map_err(|_| "--node-budget: not a number")?,
                )
            }
            "--capacity" => {
                cap_override = Some(
                    args.next()
                        .ok_or("--capacity needs bytes")?
                        .parse()
                        .map_err(|_| "--capacity: not a number")?,
                )
            }
            "--preorders" => {
                let list = args.next().ok_or("--preorders needs a list")?;
                let mut v = Vec::new();
                for x in list.split(',') {
                    v.push(match x {
                        "TWA" => Preorder::TotalWidthArea,
                        "WAT" => Preorder::WidthAreaTotal,
                        "TAW" => Preorder::TotalAreaWidth,
                        "SW" => Preorder::SizeWidth,
                        other => return Err(format!("--preorders: unknown {other:?}").into()),
                    });
                }
                preorders = Some(v);
            }
            // Ablations: techniques to turn off, comma-separated.
            "--disable" => disable.extend(
                args.next()
                    .ok_or("--disable needs a list")?
                    .split(',')
                    .map(str::to_string),
            ),
            "--node-limit" => {
                node_limit = Some(
                    args.next()
                        .ok_or("--node-limit needs a number")?
                        .parse()
                        .map_err(|_| "--node-limit: not a number")?,
                )
            }
            _ => {
                let p = PathBuf::from(&a);
                if p.is_dir() {
                    let mut v: Vec<PathBuf> = std::fs::read_dir(&p)?
                        .filter_map(|e| e.ok().map(|e| e.path()))
                        .filter(|q| q.extension().is_some_and(|e| e == "csv"))
                        .collect();
                    v.sort();
                    files.extend(v);
                } else {
                    files.push(p);
                }
            }
        }
    }
    if files.is_empty() {
        return Err("give CSV files or folders of them".into());
    }
    let mut params = SolverParams {
        time_limit: Some(Duration::from_secs_f64(limit)),
        ..SolverParams::default()
    };
    if let Some(t) = threads {
        params.threads = t;
    }
    params.node_budget = node_budget;
    params.seed = seed;
    if let Some(list) = preorders {
        params.preorders = list;
    }
    if let Some(n) = node_limit {
        params.initial_node_limit = n;
    }
    for d in &disable {
        match d.as_str() {
            "canonical" => params.canonical_only = false,
            "inference" => params.section_inference = false,
            "unallocated-floor" => params.unallocated_floor = false,
            "dominance" => params.dominance = false,
            "hatless" => params.hatless_pruning = false,
            "static-decomposition" => params.static_decomposition = false,
            "dynamic-decomposition" => params.dynamic_decomposition = false,
            "rerank" => params.rerank_parts = false,
            "random-restarts" => params.random_restarts = false,
            "peel" => params.peel_full_span = false,
            "search" => params.exact_search = false,
            other => return Err(format!("--disable: unknown technique {other:?}").into()),
        }
    }
    println!(
        "{:<16} {:>6} {:>9} {:>9} {:>8} {:>11} {:>8} {:>9} {:>8} {:>10} {:>8}",
        "problem",
        "bufs",
        "max live",
        "capacity",
        "heur/ML",
        "cap status",
        "cap s",
        "min arena",
        "min/ML",
        "min status",
        "min s"
    );
    for f in files {
        let p = minimalloc_csv::read(&f)?;
        let name = f
            .file_name()
            .unwrap_or_default()
            .to_string_lossy()
            .into_owned();
        let cap: Option<u64> = f
            .file_stem()
            .and_then(|s| s.to_str())
            .and_then(|s| s.rsplit_once('.'))
            .and_then(|(_, c)| c.parse().ok())
            .or(cap_override);
        let cap = cap_override.or(cap);
        let ml = p.max_live();
        let heur = solve(
            &p,
            Mode::Minimize,
            &SolverParams {
                exact_search: false,
                ..params.clone()
            },
        )?;
        validate(&p, &heur.solution, None)?;
        let (cs, ct) = match cap {
            Some(c) => {
                let t = Instant::now();
                let out = solve(&p, Mode::Capacity(c), &params)?;
                let secs = t.elapsed().as_secs_f64();
                if matches!(out.status, Status::Feasible | Status::Optimal) {
                    validate(&p, &out.solution, Some(c))?;
                }
                (out.status.as_str().to_string(), format!("{secs:.3}"))
            }
            None => (String::new(), String::new()),
        };
        let (ma, mr, ms, mt) = if minimize || cap.is_none() {
            let t = Instant::now();
            let out = solve(&p, Mode::Minimize, &params)?;
            let secs = t.elapsed().as_secs_f64();
            validate(&p, &out.solution, None)?;
            (
                out.solution.height.to_string(),
                format!("{:.4}", out.solution.height as f64 / ml.max(1) as f64),
                out.status.as_str().to_string(),
                format!("{secs:.3}"),
            )
        } else {
            Default::default()
        };
        println!(
            "{:<16} {:>6} {:>9} {:>9} {:>8.4} {:>11} {:>8} {:>9} {:>8} {:>10} {:>8}",
            name,
            p.buffers.len(),
            ml,
            cap.map(|c| c.to_string()).unwrap_or_default(),
            heur.solution.height as f64 / ml.max(1) as f64,
            cs,
            ct,
            ma,
            mr,
            ms,
            mt
        );
    }
    Ok(())
}
