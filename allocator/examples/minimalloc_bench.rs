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

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use clap::{Parser, ValueEnum};
use memplan_allocator::io::minimalloc_csv;
use memplan_allocator::{Mode, Preorder, Problem, SolverParams, Status, solve, validate};

#[derive(Parser, Debug)]
#[command(about = "The allocator over MiniMalloc benchmark files, one row per problem")]
struct Args {
    /// CSV files, or folders of them.
    #[arg(required = true, value_name = "FILE_OR_DIR")]
    paths: Vec<PathBuf>,
    /// Seconds per solve.
    #[arg(long, default_value_t = 10.0)]
    time_limit: f64,
    /// Also find the smallest arena (always done when there is no capacity).
    #[arg(long)]
    minimize: bool,
    /// Capacity for every file, instead of the one in its name.
    #[arg(long)]
    capacity: Option<u64>,
    /// Search threads (0: one per core).
    #[arg(long)]
    threads: Option<usize>,
    #[arg(long)]
    node_budget: Option<u64>,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// The search's first node limit.
    #[arg(long)]
    node_limit: Option<u64>,
    /// Preorders to try, in order.
    #[arg(long, value_delimiter = ',')]
    preorders: Option<Vec<PreorderArg>>,
    /// Ablations: techniques to turn off.
    #[arg(long, value_delimiter = ',')]
    disable: Vec<Technique>,
}

#[derive(Copy, Clone, Debug, ValueEnum)]
enum PreorderArg {
    #[value(name = "TWA")]
    Twa,
    #[value(name = "WAT")]
    Wat,
    #[value(name = "TAW")]
    Taw,
    #[value(name = "SW")]
    Sw,
}

#[derive(Copy, Clone, Debug, ValueEnum)]
enum Technique {
    Canonical,
    Inference,
    UnallocatedFloor,
    Dominance,
    Hatless,
    StaticDecomposition,
    DynamicDecomposition,
    Rerank,
    RandomRestarts,
    Peel,
    Search,
}

fn main() {
    if let Err(e) = run(Args::parse()) {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

fn params(a: &Args) -> SolverParams {
    let mut p = SolverParams {
        time_limit: Some(Duration::from_secs_f64(a.time_limit)),
        node_budget: a.node_budget,
        seed: a.seed,
        ..SolverParams::default()
    };
    if let Some(t) = a.threads {
        p.threads = t;
    }
    if let Some(list) = &a.preorders {
        p.preorders = list
            .iter()
            .map(|x| match x {
                PreorderArg::Twa => Preorder::TotalWidthArea,
                PreorderArg::Wat => Preorder::WidthAreaTotal,
                PreorderArg::Taw => Preorder::TotalAreaWidth,
                PreorderArg::Sw => Preorder::SizeWidth,
            })
            .collect();
    }
    if let Some(n) = a.node_limit {
        p.initial_node_limit = n;
    }
    for t in &a.disable {
        match t {
            Technique::Canonical => p.canonical_only = false,
            Technique::Inference => p.section_inference = false,
            Technique::UnallocatedFloor => p.unallocated_floor = false,
            Technique::Dominance => p.dominance = false,
            Technique::Hatless => p.hatless_pruning = false,
            Technique::StaticDecomposition => p.static_decomposition = false,
            Technique::DynamicDecomposition => p.dynamic_decomposition = false,
            Technique::Rerank => p.rerank_parts = false,
            Technique::RandomRestarts => p.random_restarts = false,
            Technique::Peel => p.peel_full_span = false,
            Technique::Search => p.exact_search = false,
        }
    }
    p
}

/// The CSV files named, folders expanded (sorted).
fn files(paths: &[PathBuf]) -> std::io::Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    for p in paths {
        if p.is_dir() {
            let mut v: Vec<PathBuf> = std::fs::read_dir(p)?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|q| q.extension().is_some_and(|e| e == "csv"))
                .collect();
            v.sort();
            files.extend(v);
        } else {
            files.push(p.clone());
        }
    }
    Ok(files)
}

/// The capacity in a file name such as `A.1048576.csv`.
fn capacity_in_name(f: &Path) -> Option<u64> {
    f.file_stem()
        .and_then(|s| s.to_str())
        .and_then(|s| s.rsplit_once('.'))
        .and_then(|(_, c)| c.parse().ok())
}

/// Solves `p` in `mode`, validates a layout it found, and returns the
/// outcome with its wall-clock seconds.
fn timed(
    p: &Problem,
    mode: Mode,
    params: &SolverParams,
) -> Result<(memplan_allocator::Outcome, f64), Box<dyn std::error::Error>> {
    let t = Instant::now();
    let out = solve(p, mode, params)?;
    let secs = t.elapsed().as_secs_f64();
    match mode {
        Mode::Capacity(c) if matches!(out.status, Status::Feasible | Status::Optimal) => {
            validate(p, &out.solution, Some(c))?
        }
        Mode::Capacity(_) => {}
        _ => validate(p, &out.solution, None)?,
    }
    Ok((out, secs))
}

fn run(a: Args) -> Result<(), Box<dyn std::error::Error>> {
    let params = params(&a);
    let files = files(&a.paths)?;
    if files.is_empty() {
        return Err("no CSV files in the folders given".into());
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
        let name = f.file_name().unwrap_or_default().to_string_lossy();
        let cap = a.capacity.or(capacity_in_name(&f));
        let ml = p.max_live();
        let greedy = SolverParams {
            exact_search: false,
            ..params.clone()
        };
        let (heur, _) = timed(&p, Mode::Minimize, &greedy)?;
        let (cs, ct) = match cap {
            Some(c) => {
                let (out, secs) = timed(&p, Mode::Capacity(c), &params)?;
                (out.status.as_str().to_string(), format!("{secs:.3}"))
            }
            None => Default::default(),
        };
        let (ma, mr, ms, mt) = if a.minimize || cap.is_none() {
            let (out, secs) = timed(&p, Mode::Minimize, &params)?;
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
