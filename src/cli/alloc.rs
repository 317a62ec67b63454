//! `memplan alloc`: offsets for buffers with fixed lifetimes (MiniMalloc's
//! CSV format), and the allocator's benchmark report.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result, anyhow, bail};
use clap::Args;
use serde_json::{Value, json};

use memplan::lower::{self, Lowered};
use memplan_allocator::io::minimalloc_csv;
use memplan_allocator::{self as alloc, Mode, Problem, SolverParams, Status};
use memplan_solver as solver;

use super::format::{grouped, table};

/// What the input's own `offset` column (a previous layout, as `-o`
/// writes) is worth: memplan lays the buffers out anew, and says whether
/// the given offsets are a valid layout and how high, to set beside its own.
enum GivenLayout {
    /// Every buffer has an offset and they are a valid layout this high.
    Valid(u64),
    /// Every buffer has an offset, but they overlap (or break an alignment,
    /// a pin or the capacity): what is wrong.
    Invalid(String),
    /// Buffers without an offset, of how many.
    Incomplete(usize, usize),
}

fn given_layout(problem: &Problem, given: &[Option<u64>], capacity: Option<u64>) -> GivenLayout {
    let offsets: Vec<u64> = given.iter().flatten().copied().collect();
    if offsets.len() < given.len() {
        return GivenLayout::Incomplete(given.len() - offsets.len(), given.len());
    }
    let height = problem
        .buffers
        .iter()
        .zip(&offsets)
        .filter(|(b, _)| b.size > 0)
        .map(|(b, &o)| o.saturating_add(b.size))
        .max()
        .unwrap_or(0);
    let sol = alloc::Solution { offsets, height };
    match alloc::validate(problem, &sol, capacity) {
        Ok(()) => GivenLayout::Valid(height),
        Err(e) => GivenLayout::Invalid(e.to_string()),
    }
}

impl GivenLayout {
    fn line(&self) -> String {
        let what = match self {
            GivenLayout::Valid(h) => format!("a valid layout, arena {}", grouped(*h)),
            GivenLayout::Invalid(e) => format!("not a valid layout ({e})"),
            GivenLayout::Incomplete(n, of) => format!("incomplete ({n} of {of} buffers have none)"),
        };
        format!("the file's own offset column (not used; pin offsets with `pinned`): {what}")
    }

    fn json(&self) -> Value {
        match self {
            GivenLayout::Valid(h) => json!({"valid": true, "arena_bytes": h}),
            GivenLayout::Invalid(e) => json!({"valid": false, "error": e}),
            GivenLayout::Incomplete(n, of) => {
                json!({"valid": false, "error": format!("{n} of {of} buffers have no offset")})
            }
        }
    }
}

#[derive(Args, Debug)]
pub struct AllocArgs {
    /// The problem (CSV: id,lower,upper,size[,align][,pinned]); with
    /// --report, any number of CSV files or folders of them.
    #[arg(value_name = "PROBLEM", required_unless_present = "graphs")]
    pub inputs: Vec<PathBuf>,
    /// Decide whether everything fits in N bytes (MiniMalloc's problem)
    /// instead of finding the smallest arena.
    #[arg(long, value_name = "N")]
    pub capacity: Option<u64>,
    /// Write the layout here (the input's columns plus `offset`); `-`: to
    /// standard output (the summary then goes to standard error).
    #[arg(short, long, value_name = "OUT")]
    pub output: Option<PathBuf>,
    /// Time budget per problem, in seconds.
    #[arg(
        long,
        value_name = "S",
        allow_negative_numbers = true,
        default_value_t = 10.0
    )]
    pub time_limit: f64,
    /// Print the result as JSON.
    #[arg(long)]
    pub json: bool,
    /// Benchmark report: run every problem given (a capacity in the file
    /// name, as in `A.1048576.csv`, selects capacity mode).
    #[arg(long)]
    pub report: bool,
    /// With --report: also find the smallest arena of problems that have a
    /// capacity.
    #[arg(long, requires = "report")]
    pub minimize: bool,
    /// With --report: add the layouts of the built-in training graphs
    /// (GPT-2 family, MLP) in program order and list-schedule order.
    #[arg(long)]
    pub graphs: bool,
    /// Turn search techniques off (ablations), comma-separated: canonical,
    /// inference, unallocated-floor, dominance, hatless,
    /// static-decomposition, dynamic-decomposition, rerank, peel,
    /// random-restarts, search.
    #[arg(long, value_name = "LIST", value_delimiter = ',')]
    pub disable: Vec<String>,
    /// Solve partitions of up to N units with the ILP (HiGHS) when
    /// minimising.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub ilp: usize,
    /// Threads for the search's restarts (0: one per core). The layout
    /// does not depend on it.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub threads: usize,
    /// Seed of the shuffled restarts (same seed, same layout unless the
    /// time limit cuts a search short).
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub seed: u64,
}

fn params(a: &AllocArgs) -> Result<SolverParams> {
    let mut p = SolverParams {
        time_limit: Some(super::load::time_limit(a.time_limit)?),
        ilp_max_units: a.ilp,
        threads: a.threads,
        seed: a.seed,
        ..SolverParams::default()
    };
    for d in &a.disable {
        match d.trim() {
            "canonical" => p.canonical_only = false,
            "inference" => p.section_inference = false,
            "unallocated-floor" => p.unallocated_floor = false,
            "dominance" => p.dominance = false,
            "hatless" => p.hatless_pruning = false,
            "static-decomposition" => p.static_decomposition = false,
            "dynamic-decomposition" => p.dynamic_decomposition = false,
            "rerank" => p.rerank_parts = false,
            "peel" => p.peel_full_span = false,
            "random-restarts" => p.random_restarts = false,
            "search" => p.exact_search = false,
            other => bail!(
                "--disable: unknown technique {other:?} (canonical, inference, unallocated-floor, \
                 dominance, hatless, static-decomposition, dynamic-decomposition, rerank, peel, \
                 random-restarts, search)"
            ),
        }
    }
    Ok(p)
}

pub fn run(a: AllocArgs) -> Result<()> {
    let p = params(&a)?;
    if a.report {
        return report(&a, &p);
    }
    if a.graphs {
        bail!("--graphs goes with --report");
    }
    let [input] = a.inputs.as_slice() else {
        bail!("give one PROBLEM.csv (or use --report for several)");
    };
    super::claim_stdout(&[("-o", a.output.as_deref())])?;
    let (problem, given) = minimalloc_csv::read_with_layout(input)?;
    let given = given.map(|g| given_layout(&problem, &g, a.capacity));
    let mode = a.capacity.map_or(Mode::Minimize, Mode::Capacity);
    let out = alloc::solve(&problem, mode, &p).with_context(|| format!("{}", input.display()))?;
    // Every layout leaves through the independent checker.
    alloc::validate(&problem, &out.solution, None)
        .map_err(|e| anyhow!("internal error: the allocator produced an invalid layout: {e}"))?;
    let fits = !matches!(out.status, Status::Infeasible | Status::Unknown);
    if fits && let Some(path) = &a.output {
        super::write_output(path, &minimalloc_csv::to_string(&problem, &out.solution))?;
    }
    if a.json {
        let v = json!({
            "file": input.display().to_string(),
            "buffers": problem.buffers.len(),
            "capacity": a.capacity,
            "status": out.status.as_str(),
            "arena_bytes": out.solution.height,
            "max_live_bytes": out.max_live,
            "lower_bound_bytes": out.lower_bound,
            "gap": out.gap(),
            "heuristic_arena_bytes": out.stats.heuristic_height,
            "source": out.source,
            "seconds": out.stats.seconds,
            "search_nodes": out.stats.nodes,
            "time_limit_hit": out.stats.time_limit_hit,
            "output": a.output.as_ref().filter(|_| fits).map(|p| p.display().to_string()),
            "given_layout": given.as_ref().map(GivenLayout::json),
        });
        sayln!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        let h = grouped(out.solution.height);
        // In capacity mode an answer other than a fit has no arena: say
        // what is known instead (the smallest layout found is above it).
        let arena = match (mode, out.status) {
            (Mode::Capacity(c), Status::Infeasible) => format!(
                "no arena of {} fits (proven; the smallest layout found takes {h})",
                grouped(c)
            ),
            (Mode::Capacity(c), Status::Unknown) => format!(
                "no arena of {} found in time, nor ruled out (the smallest layout found takes {h})",
                grouped(c)
            ),
            (_, status) => format!("arena {h} ({})", status.as_str()),
        };
        sayln!(
            "{}: {} buffers, max live {}, {arena}, lower bound {}, gap {:.2}%, {} in {:.3} s",
            input.display(),
            problem.buffers.len(),
            grouped(out.max_live),
            grouped(out.lower_bound),
            100.0 * out.gap(),
            out.source,
            out.stats.seconds
        );
        if let Some(g) = &given {
            sayln!("{}", g.line());
        }
        if out.stats.time_limit_hit && out.status != Status::Optimal {
            sayln!(
                "stopped at the time limit ({} s): the best layout found by then (checked)",
                a.time_limit
            );
        }
        if fits && let Some(path) = &a.output {
            sayln!("layout written to {}", super::shown(path));
        }
    }
    match (mode, out.status) {
        (Mode::Capacity(c), Status::Infeasible) => {
            bail!(
                "{}: proven: no layout fits in {} bytes",
                input.display(),
                grouped(c)
            )
        }
        (Mode::Capacity(c), Status::Unknown) => bail!(
            "{}: no layout within {} bytes found in {} s (and none ruled out)",
            input.display(),
            grouped(c),
            a.time_limit
        ),
        _ => Ok(()),
    }
}

/// The capacity in a MiniMalloc benchmark name: `A.1048576.csv`.
fn capacity_in_name(path: &Path) -> Option<u64> {
    let stem = path.file_stem()?.to_str()?;
    stem.rsplit('.')
        .next()?
        .parse()
        .ok()
        .filter(|_| stem.contains('.'))
}

/// The CSV files named by `inputs` (folders: their `*.csv`, sorted).
fn csv_files(inputs: &[PathBuf]) -> Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    for p in inputs {
        if p.is_dir() {
            let mut v: Vec<PathBuf> = std::fs::read_dir(p)
                .with_context(|| format!("reading {}", p.display()))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|q| q.extension().is_some_and(|e| e == "csv"))
                .collect();
            v.sort();
            out.extend(v);
        } else {
            out.push(p.clone());
        }
    }
    Ok(out)
}

/// One report row.
struct Row {
    name: String,
    buffers: usize,
    max_live: u64,
    capacity: Option<u64>,
    greedy: u64,
    heuristics: u64,
    heuristic_seconds: f64,
    decide: Option<(Status, f64)>,
    minimise: Option<(u64, u64, Status, f64)>,
}

impl Row {
    fn json(&self) -> Value {
        json!({
            "problem": self.name,
            "buffers": self.buffers,
            "max_live_bytes": self.max_live,
            "capacity": self.capacity,
            "greedy_by_size_bytes": self.greedy,
            "best_heuristic_bytes": self.heuristics,
            "heuristics_seconds": self.heuristic_seconds,
            "capacity_status": self.decide.map(|d| d.0.as_str()),
            "capacity_seconds": self.decide.map(|d| d.1),
            "min_arena_bytes": self.minimise.map(|m| m.0),
            "min_lower_bound_bytes": self.minimise.map(|m| m.1),
            "min_status": self.minimise.map(|m| m.2.as_str()),
            "min_seconds": self.minimise.map(|m| m.3),
        })
    }
    fn cells(&self) -> Vec<String> {
        let ratio = |x: u64| format!("{:.4}", x as f64 / self.max_live.max(1) as f64);
        vec![
            self.name.clone(),
            self.buffers.to_string(),
            grouped(self.max_live),
            self.capacity.map(grouped).unwrap_or_default(),
            ratio(self.greedy),
            ratio(self.heuristics),
            format!("{:.3}", self.heuristic_seconds),
            self.decide
                .map(|d| format!("{} {:.3}", d.0.as_str(), d.1))
                .unwrap_or_default(),
            self.minimise.map(|m| grouped(m.0)).unwrap_or_default(),
            self.minimise.map(|m| ratio(m.0)).unwrap_or_default(),
            self.minimise
                .map(|m| format!("{} {:.3}", m.2.as_str(), m.3))
                .unwrap_or_default(),
        ]
    }
}

fn run_one(
    name: String,
    problem: &Problem,
    capacity: Option<u64>,
    minimise: bool,
    p: &SolverParams,
) -> Result<Row> {
    let max_live = problem.max_live();
    let greedy = alloc::greedy_by_size(problem).height;
    let t = Instant::now();
    let heur = alloc::solve(
        problem,
        Mode::Minimize,
        &SolverParams {
            exact_search: false,
            ..p.clone()
        },
    )?;
    let heuristic_seconds = t.elapsed().as_secs_f64();
    alloc::validate(problem, &heur.solution, None)
        .map_err(|e| anyhow!("{name}: invalid heuristic layout: {e}"))?;
    let decide = match capacity {
        Some(c) => {
            let out = alloc::solve(problem, Mode::Capacity(c), p)?;
            if matches!(out.status, Status::Feasible | Status::Optimal) {
                alloc::validate(problem, &out.solution, Some(c))
                    .map_err(|e| anyhow!("{name}: invalid layout: {e}"))?;
            }
            Some((out.status, out.stats.seconds))
        }
        None => None,
    };
    let min = if capacity.is_none() || minimise {
        let out = alloc::solve(problem, Mode::Minimize, p)?;
        alloc::validate(problem, &out.solution, None)
            .map_err(|e| anyhow!("{name}: invalid layout: {e}"))?;
        Some((
            out.solution.height,
            out.lower_bound,
            out.status,
            out.stats.seconds,
        ))
    } else {
        None
    };
    Ok(Row {
        name,
        buffers: problem.buffers.len(),
        max_live,
        capacity,
        greedy,
        heuristics: heur.solution.height,
        heuristic_seconds,
        decide,
        minimise: min,
    })
}

/// The layout problems of the built-in training graphs: program order and
/// list-schedule order, with reuses.
fn graph_problems() -> Result<Vec<(String, Problem)>> {
    let mut out = Vec::new();
    let mut cases: Vec<(String, memplan::models::ExampleOptions)> = Vec::new();
    for name in memplan::models::EXAMPLES {
        cases.push((name.to_string(), Default::default()));
    }
    cases.push((
        "gpt2-small+checkpoint".into(),
        memplan::models::ExampleOptions {
            checkpoint: true,
            ..Default::default()
        },
    ));
    for (label, opts) in cases {
        let name = label.split('+').next().unwrap_or(&label).to_string();
        let g = memplan::models::example(&name, &opts)?;
        let low = lower::lower(&g, true);
        let orders = [
            ("program", Lowered::from_op_ids(g.program_order())),
            ("list", solver::list_schedule(&low.problem)),
        ];
        for (oname, order) in orders {
            let ev = solver::evaluate(&low.problem, &order);
            let lp = lower::layout_problem(&g, &low, &ev);
            out.push((format!("{label}/{oname}"), lp.problem));
        }
    }
    Ok(out)
}

fn report(a: &AllocArgs, p: &SolverParams) -> Result<()> {
    let mut rows = Vec::new();
    for f in csv_files(&a.inputs)? {
        let problem = minimalloc_csv::read(&f)?;
        let cap = a.capacity.or_else(|| capacity_in_name(&f));
        let name = f
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let row = run_one(name, &problem, cap, a.minimize, p)?;
        if !a.json {
            eprintln!("{}", row.cells().join("  "));
        }
        rows.push(row);
    }
    if a.graphs {
        for (name, problem) in graph_problems()? {
            let row = run_one(name, &problem, None, true, p)?;
            if !a.json {
                eprintln!("{}", row.cells().join("  "));
            }
            rows.push(row);
        }
    }
    if a.json {
        let v: Vec<Value> = rows.iter().map(Row::json).collect();
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    let cells: Vec<Vec<String>> = rows.iter().map(Row::cells).collect();
    print!(
        "{}",
        table(
            &[
                "problem",
                "buffers",
                "max live",
                "capacity",
                "greedy/ML",
                "heur/ML",
                "heur s",
                "capacity mode s",
                "min arena",
                "min/ML",
                "minimise s",
            ],
            &cells
        )
    );
    Ok(())
}
