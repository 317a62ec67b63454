//! Issue 41, "limits not honoured": every phase stops at the time limit
//! with the best plan it has, the plan stays valid, and the output says
//! the limit was hit. No test here measures time (that is the benchmarks'
//! job: `benches/pipeline.rs`, `time_limited`): each gives a deadline that
//! has already passed, so the result does not depend on the machine's
//! speed.

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use memplan::models::{ExampleOptions, example};
use memplan::{Options, checker, pipeline};
use memplan_allocator::{self as alloc, Buffer, Mode, Problem, SolverParams};

fn gpt2(layers: u64) -> memplan::graph::Graph {
    let opts = ExampleOptions {
        layers: Some(layers),
        ..Default::default()
    };
    example("gpt2-tiny", &opts).expect("builds")
}

#[test]
fn a_past_deadline_still_gives_a_checked_plan_that_says_so() {
    let g = gpt2(4);
    let opts = Options::default();
    let (plan, report) = pipeline::plan_by(&g, &opts, Some(Instant::now())).expect("plans");
    checker::check(&g, &plan).expect("the plan is valid");
    assert!(plan.stats.time_limit_hit, "{:?}", plan.stats);
    assert!(plan.arena_bytes >= plan.stats.max_live_bytes);
    assert!(plan.stats.lower_bound_bytes <= plan.stats.max_live_bytes);
    // The solver's part of the report says so too.
    assert!(report.solver.time_limit_hit);
    // Only the best candidate order was laid out.
    let laid_out = report.candidates.iter().filter(|c| c.2.is_some()).count();
    assert_eq!(laid_out, 1, "{:?}", report.candidates);
    // The flag travels in the plan file, and reads back.
    let text = plan.to_json(&g);
    assert!(text.contains("\"time_limit_hit\": true"), "{text}");
}

#[test]
fn a_plan_within_its_limit_is_the_plain_plan_and_does_not_say_so() {
    // The MLP plans in milliseconds: a deadline an hour away is never
    // reached, so plan_by is plan_with_report, byte for byte.
    let g = example("mlp", &ExampleOptions::default()).expect("builds");
    let opts = Options::default();
    let far = Instant::now().checked_add(Duration::from_secs(3600));
    let (a, _) = pipeline::plan_by(&g, &opts, far).expect("plans");
    let (b, _) = pipeline::plan_with_report(&g, &opts).expect("plans");
    assert!(!a.stats.time_limit_hit);
    assert_eq!(a.arena_bytes, b.arena_bytes);
    assert_eq!(a.offsets, b.offsets);
    assert!(!a.to_json(&g).contains("time_limit_hit"));
}

/// `n` buffers with overlapping lifetimes, no two identical.
fn crowded(n: u64) -> Problem {
    Problem::new(
        (0..n)
            .map(|i| {
                Buffer::new(
                    format!("b{i}"),
                    i,
                    i + 1 + (i * 7919) % 97,
                    1 + (i * 31) % 13,
                )
            })
            .collect(),
    )
}

#[test]
fn the_allocator_at_a_past_deadline_returns_a_valid_layout_and_says_so() {
    let p = crowded(3_000);
    for (limit, hit) in [(Duration::ZERO, true), (Duration::from_secs(3600), false)] {
        let params = SolverParams {
            time_limit: Some(limit),
            // Heuristics only, so that the unlimited run ends by itself.
            exact_search: false,
            ..SolverParams::default()
        };
        let out = alloc::solve(&p, Mode::Minimize, &params).expect("solves");
        alloc::validate(&p, &out.solution, None).expect("valid layout");
        assert!(out.solution.height >= out.max_live);
        assert_eq!(out.stats.time_limit_hit, hit, "{limit:?}");
    }
}

fn memplan_bin(args: &[&str]) -> (i32, String, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_memplan"))
        .args(args)
        .output()
        .expect("runs the memplan binary");
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (
        o.status.code().unwrap_or(-1),
        text(&o.stdout),
        text(&o.stderr),
    )
}

#[test]
fn the_cli_says_when_it_stopped_at_the_limit() {
    // A nanosecond is over before the solve starts.
    let args = [
        "plan",
        "--example",
        "gpt2-tiny",
        "--layers",
        "3",
        "--time-limit",
        "1e-9",
    ];
    let (code, out, err) = memplan_bin(&args);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out.contains("stopped at the time limit"), "{out}");
    let mut json = args.to_vec();
    json.push("--json");
    let (code, out, err) = memplan_bin(&json);
    assert_eq!(code, 0, "{out}\n{err}");
    let v: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    assert_eq!(v["time_limit_hit"], true, "{v}");

    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("time_limits");
    std::fs::create_dir_all(&dir).unwrap();
    let csv = dir.join("crowded.csv");
    let mut text = String::from("id,lower,upper,size\n");
    for (i, b) in crowded(2_000).buffers.iter().enumerate() {
        text.push_str(&format!("{i},{},{},{}\n", b.lower, b.upper, b.size));
    }
    std::fs::write(&csv, text).unwrap();
    let csv = csv.display().to_string();
    let (code, out, err) = memplan_bin(&["alloc", &csv, "--time-limit", "1e-9", "--json"]);
    assert_eq!(code, 0, "{out}\n{err}");
    let v: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    assert_eq!(v["time_limit_hit"], true, "{v}");
}

#[test]
fn the_greedy_baseline_gives_up_at_its_deadline() {
    // The pipeline's program-order baseline once ran its greedy layout
    // (quadratic in the buffers) without the deadline whenever a large
    // layout had ended early: 585 s at 100k ops and --time-limit 4.
    let g = gpt2(4);
    assert!(memplan::baselines::program_order_greedy_until(&g, Some(Instant::now())).is_none());
    let far = Instant::now().checked_add(Duration::from_secs(3600));
    let within =
        memplan::baselines::program_order_greedy_until(&g, far).expect("an hour is enough");
    let plain = memplan::baselines::program_order_greedy(&g);
    checker::check(&g, &within).expect("valid");
    assert_eq!(within.arena_bytes, plain.arena_bytes);
    assert_eq!(within.offsets, plain.offsets);
    let problem = crowded(2_000);
    assert!(alloc::greedy_by_size_until(&problem, Some(Instant::now())).is_none());
}
