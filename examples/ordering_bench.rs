//! The ordering benchmark: memplan against program order and the simulated
//! PyTorch caching allocator, and its gap to the lower bound, on the
//! built-in GPT-2 family (batch 1 and 4) and on any graph files given.
//!
//! ```text
//! cargo run --release --example ordering_bench                  # GPT-2 presets
//! cargo run --release --example ordering_bench -- FILE...      # graph files
//! cargo run --release --example ordering_bench -- --ablation gpt2-small
//! ```
//!
//! With `--ablation NAME`, every solver switch is turned off in turn on that
//! example (batch 1) and the max live bytes and time are printed.

use std::time::{Duration, Instant};

use memplan::graph::Graph;
use memplan::models::{ExampleOptions, example};
use memplan::{Options, baselines, checker};

fn gib(b: u64) -> String {
    format!("{:.3}", b as f64 / (1u64 << 30) as f64)
}

fn row(g: &Graph, opts: &Options) {
    let t = Instant::now();
    let (plan, report) = memplan::pipeline::plan_with_report(g, opts).expect("plans");
    let secs = t.elapsed().as_secs_f64();
    checker::check(g, &plan).expect("the checker accepts memplan's plan");
    let cs = baselines::pytorch_caching(g);
    let po = baselines::program_order_max_live(g);
    let s = &plan.stats;
    let bound = s.lower_bound_bytes.max(1);
    println!(
        "| {} | {} | {} | {} | {} | {} | {} ({}) | {:.2}% | {:.2}% | {:.1}% | {:.2} |",
        g.name,
        g.num_ops(),
        gib(cs.max_reserved),
        gib(po),
        gib(s.max_live_bytes),
        gib(plan.arena_bytes),
        gib(s.lower_bound_bytes),
        s.lower_bound_kind,
        100.0 * (s.max_live_bytes as f64 / bound as f64 - 1.0),
        100.0 * (plan.arena_bytes as f64 / bound as f64 - 1.0),
        100.0 * (1.0 - plan.arena_bytes as f64 / cs.max_reserved.max(1) as f64),
        secs,
    );
    let largest = report.solver.parts.iter().map(|p| p.ops).max().unwrap_or(0);
    eprintln!(
        "  {}: {} parts (largest {} ops), order {} (solver peak {}, solver bound {}), phases {:?}",
        g.name,
        report.solver.parts.len(),
        largest,
        s.order_source,
        report.solver.peak,
        report.solver.lower_bound,
        report.phases
    );
}

fn header() {
    println!(
        "| graph | ops | PyTorch reserved GiB | program order max live GiB | memplan max live GiB | memplan arena GiB | bound GiB | max live vs bound | arena vs bound | arena below PyTorch | solve s |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let opts = Options {
        time_limit: Duration::from_secs(60),
        ..Options::default()
    };
    if args.first().map(String::as_str) == Some("--ablation") {
        let name = args.get(1).map_or("gpt2-small", String::as_str);
        let g = example(name, &ExampleOptions::default()).expect("example");
        println!("| switch off | max live | arena | solve s |");
        println!("|---|---:|---:|---:|");
        let mut names = vec!["(none)".to_string()];
        names.extend(
            memplan_solver::SolverParams::default()
                .switches()
                .iter()
                .map(|(n, _)| n.to_string()),
        );
        for n in names {
            let mut o = opts.clone();
            o.solver.disable(&n);
            let t = Instant::now();
            let plan = memplan::plan(&g, &o).expect("plans");
            println!(
                "| {n} | {} | {} | {:.2} |",
                plan.stats.max_live_bytes,
                plan.arena_bytes,
                t.elapsed().as_secs_f64()
            );
        }
        return;
    }
    header();
    if args.is_empty() {
        for name in [
            "gpt2-tiny",
            "gpt2-small",
            "gpt2-medium",
            "gpt2-large",
            "gpt2-xl",
        ] {
            for batch in [1, 4] {
                let g = example(
                    name,
                    &ExampleOptions {
                        batch: Some(batch),
                        ..ExampleOptions::default()
                    },
                )
                .expect("example");
                row(&g, &opts);
            }
        }
        for (ckpt, clip) in [(true, None), (false, Some(1.0))] {
            let g = example(
                "gpt2-small",
                &ExampleOptions {
                    checkpoint: ckpt,
                    clip_grad_norm: clip,
                    ..ExampleOptions::default()
                },
            )
            .expect("example");
            row(&g, &opts);
        }
    } else {
        for path in &args {
            let g = memplan::io::load_graph(std::path::Path::new(path)).expect("graph file");
            row(&g, &opts);
        }
    }
}
