//! Criterion benchmarks of the offset planner alone (crate
//! `memplan-allocator`), on two kinds of problems:
//!
//! - `alloc/minimalloc/<A..K>`: MiniMalloc's eleven challenging problems
//!   (fixtures/minimalloc), capacity mode at 1048576 bytes, the decision
//!   problem MiniMalloc solves;
//! - `alloc/training/<graph>`: the layout of a training step in the
//!   list-scheduled order, minimise mode with the pipeline's own settings
//!   (`memplan::layout::layout_params`): built-in GPT-2 presets and the
//!   JAX HLO fixtures (fixtures/hlo), the PyTorch exports (fixtures/torch)
//!   and, when ../shared/fixtures/hlo is there, XLA's optimized modules.
//!
//! Before timing, each case is solved once and a line goes to stderr:
//! arena found, max live (the floor of that order) and their ratio, so the
//! quality sits next to criterion's times. Every layout is validated.
//!
//! `cargo bench --bench allocator`, or a subset: `-- alloc/minimalloc/H`.

use std::hint::black_box;
use std::path::{Path, PathBuf};
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use memplan::layout::{LAYOUT_BACKSTOP, layout_params};
use memplan::lower;
use memplan::models::{ExampleOptions, example};
use memplan_allocator::{self as alloc, Mode, Problem, SolverParams, Status};
use memplan_solver as solver;

const CAPACITY: u64 = 1_048_576;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn minimalloc_cases() -> Vec<(String, Problem)> {
    "ABCDEFGHIJK"
        .chars()
        .map(|c| {
            let path = root().join(format!("fixtures/minimalloc/{c}.{CAPACITY}.csv"));
            let p = alloc::io::minimalloc_csv::read(&path).expect("fixture parses");
            (c.to_string(), p)
        })
        .collect()
}

/// The layout problem of `graph` in its list-scheduled order.
fn layout_of(graph: &memplan::Graph) -> Problem {
    let low = lower::lower(graph, true);
    let order = solver::list_schedule(&low.problem);
    let ev = solver::evaluate(&low.problem, &order);
    lower::layout_problem(graph, &low, &ev).problem
}

fn training_cases() -> Vec<(String, Problem)> {
    let mut v = Vec::new();
    for name in ["gpt2-tiny", "gpt2-small", "gpt2-medium"] {
        let g = example(name, &ExampleOptions::default()).expect("built-in example");
        v.push((name.to_string(), layout_of(&g)));
    }
    let hlo = root().join("fixtures/hlo");
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&hlo)
        .expect("fixtures/hlo")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_dir())
        .collect();
    dirs.sort();
    for d in dirs {
        let f = d.join("cpu_after_optimizations.txt.gz");
        if !f.exists() {
            continue;
        }
        let g = memplan::io::load_graph(&f).expect("HLO fixture imports");
        let name = format!("hlo-{}", file_name(&d));
        v.push((name, layout_of(&g)));
    }
    // PyTorch exports (1,000 to 9,000 tensors).
    let torch = root().join("fixtures/torch");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&torch)
        .expect("fixtures/torch")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.to_string_lossy().ends_with(".json.gz"))
        .collect();
    files.sort();
    for f in files {
        let g = memplan::io::load_graph(&f).expect("torch export loads");
        let name = file_name(&f).trim_end_matches(".json.gz").to_string();
        v.push((format!("torch-{name}"), layout_of(&g)));
    }
    // XLA's optimized training steps from ../shared/fixtures, when present
    // (1,500 to 2,000 buffers).
    let shared = root().join("../shared/fixtures/hlo");
    if let Ok(rd) = std::fs::read_dir(&shared) {
        let mut dirs: Vec<PathBuf> = rd
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.join("cpu_after_optimizations.txt.gz").exists())
            .collect();
        dirs.sort();
        for d in dirs {
            let f = d.join("cpu_after_optimizations.txt.gz");
            let g = memplan::io::load_graph(&f).expect("shared HLO module imports");
            v.push((format!("xla-{}", file_name(&d)), layout_of(&g)));
        }
    }
    v
}

fn file_name(p: &Path) -> String {
    p.file_name()
        .unwrap_or_default()
        .to_string_lossy()
        .into_owned()
}

fn solve_checked(p: &Problem, mode: Mode, params: &SolverParams) -> alloc::Outcome {
    let out = alloc::solve(p, mode, params).expect("valid problem");
    let cap = match mode {
        Mode::Capacity(c) if matches!(out.status, Status::Feasible | Status::Optimal) => Some(c),
        _ => None,
    };
    alloc::validate(p, &out.solution, cap).expect("layout passes the checker");
    out
}

fn report(kind: &str, name: &str, p: &Problem, out: &alloc::Outcome) {
    let ml = p.max_live();
    eprintln!(
        "{kind}/{name}: {} buffers, arena {}, max live {}, arena/max live {:.5}, {}, {:.3} s",
        p.buffers.len(),
        out.solution.height,
        ml,
        out.solution.height as f64 / ml.max(1) as f64,
        out.status.as_str(),
        out.stats.seconds
    );
}

fn allocator(c: &mut Criterion) {
    {
        let mut g = c.benchmark_group("alloc/minimalloc");
        g.warm_up_time(Duration::from_millis(500))
            .measurement_time(Duration::from_secs(5))
            .sample_size(10);
        let params = SolverParams {
            time_limit: Some(Duration::from_secs(30)),
            ..SolverParams::default()
        };
        for (name, p) in minimalloc_cases() {
            let out = solve_checked(&p, Mode::Capacity(CAPACITY), &params);
            report("minimalloc", &name, &p, &out);
            g.bench_with_input(BenchmarkId::from_parameter(&name), &p, |b, p| {
                b.iter(|| alloc::solve(black_box(p), Mode::Capacity(CAPACITY), &params))
            });
        }
        g.finish();
    }
    {
        let mut g = c.benchmark_group("alloc/training");
        g.warm_up_time(Duration::from_millis(500))
            .measurement_time(Duration::from_secs(3))
            .sample_size(10);
        for (name, p) in training_cases() {
            let params = layout_params(p.buffers.len(), LAYOUT_BACKSTOP);
            let out = solve_checked(&p, Mode::Minimize, &params);
            report("training", &name, &p, &out);
            g.bench_with_input(BenchmarkId::from_parameter(&name), &p, |b, p| {
                b.iter(|| alloc::solve(black_box(p), Mode::Minimize, &params))
            });
        }
        g.finish();
    }
}

criterion_group!(benches, allocator);
criterion_main!(benches);
