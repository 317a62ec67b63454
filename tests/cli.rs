//! The `memplan` binary: exit codes (0 ok, 1 bad input, 2 usage), `--json`
//! output, and the export → plan → check round trip.

use std::path::Path;
use std::process::{Command, Output};

fn memplan(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_memplan"))
        .args(args)
        .output()
        .expect("runs the memplan binary")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}
fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn ok(args: &[&str]) -> String {
    let o = memplan(args);
    assert_eq!(o.status.code(), Some(0), "{args:?}: {}", stderr(&o));
    stdout(&o)
}

fn json(args: &[&str]) -> serde_json::Value {
    let out = ok(args);
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("{args:?}: not JSON ({e}): {out}"))
}

#[test]
fn plan_json_has_the_documented_keys() {
    let v = json(&["plan", "--example", "mlp", "--json"]);
    for key in [
        "arena_bytes",
        "gap",
        "lower_bound_bytes",
        "solve_seconds",
        "max_live_bytes",
    ] {
        assert!(v.get(key).is_some(), "missing {key}: {v}");
    }
    // The arena's old name, written for one more release.
    assert_eq!(v["peak_bytes"], v["arena_bytes"], "{v}");
    let peak = v["arena_bytes"].as_u64().unwrap();
    let bound = v["lower_bound_bytes"].as_u64().unwrap();
    assert!(bound > 0 && bound <= peak, "{v}");
    // On the MLP the per-op min-cut floor is below the optimum; the group
    // search (which weight-gradient op runs first) lifts it to the optimum
    // the exact search proves (see docs/plan-format.md).
    assert_eq!(v["lower_bound_kind"], "min-cut-groups");
    assert_eq!(bound, v["max_live_bytes"].as_u64().unwrap(), "{v}");
    assert!(v["solve_seconds"].as_f64().unwrap() >= 0.0);
}

#[test]
fn compare_json_has_every_baseline() {
    let v = json(&["compare", "--example", "gpt2-tiny", "--json"]);
    let peak = v["arena_bytes"].as_u64().unwrap();
    let bound = v["lower_bound_bytes"].as_u64().unwrap();
    assert!(bound <= peak);
    assert!(v["solve_seconds"].as_f64().is_some());
    // The simple bound is reported beside the floor, never above it.
    let simple = v["simple_bound_bytes"].as_u64().unwrap();
    assert!(simple > 0 && simple <= bound, "{v}");
    let bound_s = v["bound_seconds"].as_f64().unwrap();
    assert!(bound_s <= v["solve_seconds"].as_f64().unwrap(), "{v}");
    let base = v["baselines"].as_object().expect("baselines is an object");
    for name in [
        "pytorch-reserved",
        "pytorch-allocated",
        "program-order",
        "program-order+greedy",
    ] {
        let b = base[name]["footprint_bytes"]
            .as_u64()
            .unwrap_or_else(|| panic!("{name}: {v}"));
        assert!(bound <= b, "{name} below the lower bound");
        // The old name, written for one more release.
        assert_eq!(base[name]["peak_bytes"], base[name]["footprint_bytes"]);
    }
    // Never worse than the static program-order arena or PyTorch's reserved.
    assert!(
        peak <= base["program-order+greedy"]["footprint_bytes"]
            .as_u64()
            .unwrap()
    );
    assert!(
        peak <= base["pytorch-reserved"]["footprint_bytes"]
            .as_u64()
            .unwrap()
    );
}

#[test]
fn text_outputs() {
    let out = ok(&["compare", "--example", "mlp"]);
    assert!(
        out.contains("lower bound (min-cut-groups)") && out.contains("pytorch-reserved"),
        "{out}"
    );
    let out = ok(&["stats", "--example", "mlp"]);
    assert!(out.contains("ops") && out.contains("parameter"), "{out}");
    let v = json(&["stats", "--example", "mlp", "--json"]);
    assert!(v["ops"].as_u64().unwrap() > 0);
}

#[test]
fn export_plan_check_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let graph = dir.path().join("tiny.json.gz");
    let plan = dir.path().join("tiny.plan.json");
    let (g, p) = (graph.to_str().unwrap(), plan.to_str().unwrap());
    let o = memplan(&["export", "--example", "gpt2-tiny", "-o", g]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let v = json(&["plan", g, "-o", p, "--json"]);
    assert_eq!(v["plan_file"], p);
    let checked = json(&["check", g, p, "--json"]);
    assert_eq!(checked["valid"], true);
    assert_eq!(checked["arena_bytes"], v["arena_bytes"]);
    assert_eq!(checked["max_live_bytes"], v["max_live_bytes"]);
    // The same plan against the built-in example directly.
    ok(&["check", "--example", "gpt2-tiny", p]);
    let text = ok(&["check", g, p]);
    assert!(text.contains("plan is valid"), "{text}");

    // A corrupted plan: one fewer op in the order.
    let mut doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&plan).unwrap()).unwrap();
    doc["order"].as_array_mut().unwrap().pop();
    let bad = dir.path().join("bad.plan.json");
    std::fs::write(&bad, doc.to_string()).unwrap();
    let o = memplan(&["check", g, bad.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    let e = stderr(&o);
    assert!(
        e.contains("bad.plan.json") && e.contains("invalid") && e.contains("the order has"),
        "{e}"
    );

    // A corrupted layout: every tensor at offset 0.
    let mut doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&plan).unwrap()).unwrap();
    for t in doc["tensors"].as_array_mut().unwrap() {
        t["offset"] = 0.into();
    }
    std::fs::write(&bad, doc.to_string()).unwrap();
    let o = memplan(&["check", g, bad.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("share bytes"), "{}", stderr(&o));
}

#[test]
fn bad_input_exits_1_with_a_message() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("broken.json");
    std::fs::write(
        &path,
        "{\"format\": \"memplan-graph\", \"version\": 1,\n \"tensors\": [}",
    )
    .unwrap();
    for cmd in ["plan", "stats", "compare"] {
        let o = memplan(&[cmd, path.to_str().unwrap()]);
        assert_eq!(o.status.code(), Some(1), "{cmd}");
        let e = stderr(&o);
        assert!(e.contains("broken.json:2:"), "{cmd}: {e}");
        assert!(stdout(&o).is_empty());
    }
    let o = memplan(&["plan", "/no/such/file.json"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("/no/such/file.json"));
    let o = memplan(&["plan", "--example", "gpt2-huge"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("unknown example \"gpt2-huge\""),
        "{}",
        stderr(&o)
    );
    let o = memplan(&["plan", "--example", "mlp", "--time-limit=-3"]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
}

#[test]
fn usage_errors_exit_2() {
    for args in [
        &["plan", "--no-such-flag"][..],
        &["frobnicate"][..],
        &[][..],
        &["check"][..],
        &["plan", "--batch", "2"][..],
    ] {
        let o = memplan(args);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", stderr(&o));
        assert!(!stderr(&o).is_empty());
    }
    let o = memplan(&["--help"]);
    assert_eq!(o.status.code(), Some(0));
    assert!(stdout(&o).contains("compare"));
}

#[test]
fn export_needs_an_example() {
    let o = memplan(&["export", "-o", "/tmp/never-written.json"]);
    assert_ne!(o.status.code(), Some(0));
    assert!(!Path::new("/tmp/never-written.json").exists());
}

#[test]
fn run_options_are_checked_and_cuda_failures_are_errors() {
    let o = memplan(&["run", "--example", "gpt2-tiny", "--compare-cpu"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("--device cuda"), "{}", stderr(&o));
    // Without a GPU (CI) this fails with an error naming what is missing;
    // with one it runs. Either way it never panics.
    let o = memplan(&[
        "run",
        "--example",
        "gpt2-tiny",
        "--device",
        "cuda",
        "--steps",
        "1",
    ]);
    let err = stderr(&o);
    assert!(matches!(o.status.code(), Some(0 | 1)), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    if o.status.code() == Some(1) {
        assert!(err.contains("CUDA") || err.contains("cuda"), "{err}");
    }
    // `--attention` chooses the CUDA lowering of fused attention.
    let o = memplan(&["run", "--example", "llama-tiny", "--attention", "gemm"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("--device cuda"), "{}", stderr(&o));
    let o = memplan(&[
        "run",
        "--example",
        "llama-tiny",
        "--attention",
        "tensor-cores",
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("--device cuda"), "{}", stderr(&o));
    // `auto` (the default) is for any device: on the CPU it changes nothing.
    let o = memplan(&[
        "run",
        "--example",
        "llama-tiny",
        "--attention",
        "auto",
        "--steps",
        "1",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let o = memplan(&["run", "--example", "llama-tiny", "--attention", "tiles"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    let o = memplan(&[
        "run",
        "--example",
        "llama-tiny",
        "--device",
        "cuda",
        "--attention",
        "gemm",
        "--steps",
        "1",
    ]);
    let err = stderr(&o);
    assert!(
        matches!(o.status.code(), Some(0 | 1)) && !err.contains("panicked"),
        "{err}"
    );
}

#[test]
fn fused_attention_is_an_example_option() {
    let v = json(&[
        "plan",
        "--example",
        "gpt2-tiny",
        "--fused-attention",
        "--json",
    ]);
    assert!(
        v["graph"].as_str().unwrap_or_default().ends_with("-fused"),
        "{v}"
    );
    let o = memplan(&["plan", "--fused-attention"]);
    assert_eq!(
        o.status.code(),
        Some(2),
        "--fused-attention needs --example"
    );
}

/// `run --profile`: the time per step by kernel, in the text and JSON
/// reports; without it the JSON has no profile.
#[test]
fn run_profile_reports_time_by_kernel() {
    let v = json(&[
        "run",
        "--example",
        "llama-tiny",
        "--steps",
        "2",
        "--profile",
        "--json",
    ]);
    let prof = v["profile"].as_array().expect("a profile");
    let kernels: Vec<&str> = prof.iter().map(|k| k["kernel"].as_str().unwrap()).collect();
    for k in [
        "fused_attention",
        "fused_attention_backward",
        "rmsnorm",
        "swiglu",
        "adamw",
    ] {
        assert!(kernels.contains(&k), "{k} missing from {kernels:?}");
    }
    let mut unique = kernels.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(unique.len(), kernels.len(), "{kernels:?}");
    let secs: Vec<f64> = prof
        .iter()
        .map(|k| k["seconds_per_step"].as_f64().unwrap())
        .collect();
    assert!(secs.windows(2).all(|w| w[0] >= w[1]), "{secs:?}");
    assert!(prof.iter().all(|k| k["instrs"].as_u64().unwrap() >= 1));
    let step = v["median_step_seconds"].as_f64().unwrap();
    assert!(secs.iter().sum::<f64>() <= step, "{secs:?} in {step}");
    let plain = json(&["run", "--example", "llama-tiny", "--steps", "1", "--json"]);
    assert!(plain["profile"].is_null(), "{plain}");
    // Each step's planned arena, under its name and (for one release) the old one.
    let first = &plain["steps"][0];
    assert_eq!(
        first["planned_arena_bytes"], plain["arena_bytes"],
        "{plain}"
    );
    assert_eq!(first["planned_peak_bytes"], first["planned_arena_bytes"]);
    let o = memplan(&[
        "run",
        "--example",
        "llama-tiny",
        "--steps",
        "2",
        "--profile",
    ]);
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success() && text.contains("time by kernel") && text.contains("fused_attention"),
        "{text}"
    );
}

/// Llama with mixed precision, sharded with FSDP2's options: planned and
/// run; the options need what they modify.
#[test]
fn llama_mixed_precision_and_fsdp_options() {
    let v = json(&[
        "run",
        "--example",
        "llama-tiny",
        "--mixed-precision",
        "--world-size",
        "2",
        "--prefetch",
        "2",
        "--reduce-bf16",
        "--steps",
        "2",
        "--json",
    ]);
    assert_eq!(v["graph"], "llama-tiny-b2-mixed-fsdp2", "{v}");
    let losses: Vec<f64> = v["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["loss"].as_f64().unwrap())
        .collect();
    assert!(
        losses[1] < losses[0] && (losses[0] - 512f64.ln()).abs() < 0.1,
        "{losses:?}"
    );
    let kept = json(&[
        "plan",
        "--example",
        "llama-tiny",
        "--world-size",
        "2",
        "--no-reshard-after-forward",
        "--json",
    ]);
    let resharded = json(&[
        "plan",
        "--example",
        "llama-tiny",
        "--world-size",
        "2",
        "--json",
    ]);
    let peak = |v: &serde_json::Value| v["arena_bytes"].as_u64().expect("an arena");
    assert!(peak(&kept) > peak(&resharded), "{kept} vs {resharded}");
    // FSDP1's flat units: fewer ops (no copy-outs, one update per unit).
    let flat = json(&[
        "plan",
        "--example",
        "llama-tiny",
        "--world-size",
        "2",
        "--flat-shards",
        "--json",
    ]);
    let ops = |v: &serde_json::Value| v["ops"].as_u64().expect("an op count");
    assert!(ops(&flat) < ops(&resharded), "{flat} vs {resharded}");
    for args in [
        &["plan", "--example", "llama-tiny", "--flat-shards"][..],
        &["plan", "--example", "llama-tiny", "--prefetch", "2"],
        &["plan", "--example", "llama-tiny", "--reduce-bf16"],
        &[
            "plan",
            "--example",
            "llama-tiny",
            "--no-reshard-after-forward",
        ],
    ] {
        assert_eq!(
            memplan(args).status.code(),
            Some(2),
            "{args:?} needs --world-size"
        );
    }
    let o = memplan(&["plan", "--example", "mlp", "--mixed-precision"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("mixed precision"), "{}", stderr(&o));
}

/// `plan` checks against `graph` (both written by `fit`) with max live
/// bytes within `arena`.
fn checks_within(graph: &Path, plan: &Path, arena: u64) {
    let c = json(&[
        "check",
        graph.to_str().unwrap(),
        plan.to_str().unwrap(),
        "--json",
    ]);
    assert!(c["max_live_bytes"].as_u64().unwrap() <= arena);
}

#[test]
fn fit_writes_a_plan_that_checks_and_refuses_what_cannot_fit() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("cli-fit");
    std::fs::create_dir_all(&dir).unwrap();
    let (plan, graph) = (dir.join("plan.json"), dir.join("graph.json"));
    let args = [
        "fit",
        "--example",
        "gpt2-small",
        "--layers",
        "6",
        "--budget",
        "90%",
        "--json",
        "--time-limit",
        "20",
    ];
    let mut with_out = args.to_vec();
    with_out.extend([
        "-o",
        plan.to_str().unwrap(),
        "--output-graph",
        graph.to_str().unwrap(),
    ]);
    let v = json(&with_out);
    let arena = v["arena_bytes"].as_u64().unwrap();
    assert!(arena <= v["budget_bytes"].as_u64().unwrap());
    assert!(arena < v["no_recompute_arena_bytes"].as_u64().unwrap());
    assert!(!v["recomputed_ops"].as_array().unwrap().is_empty());
    assert!(v["added_flops"].as_f64().unwrap() > 0.0);
    // The plan names the recomputed tensors: it checks against the graph
    // written beside it.
    checks_within(&graph, &plan, arena);
    // Below the floor: exit code 1, the bound and its reason.
    let o = memplan(&[
        "fit",
        "--example",
        "gpt2-small",
        "--layers",
        "2",
        "--budget",
        "1MiB",
    ]);
    assert_eq!(o.status.code(), Some(1));
    let e = stderr(&o);
    assert!(
        e.contains("needs at least") && e.contains("alone needs"),
        "{e}"
    );
    // A budget that is not a size.
    let o = memplan(&["fit", "--example", "mlp", "--budget", "lots"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("--budget"), "{}", stderr(&o));
}

#[test]
fn fit_max_added_finds_a_smaller_arena_within_the_share() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("cli-fit-within");
    std::fs::create_dir_all(&dir).unwrap();
    let (plan, graph) = (dir.join("plan.json"), dir.join("graph.json"));
    let v = json(&[
        "fit",
        "--example",
        "gpt2-small",
        "--layers",
        "2",
        "--max-added",
        "0.5%",
        "--minimise",
        "flops",
        "--json",
        "--time-limit",
        "10",
        "-o",
        plan.to_str().unwrap(),
        "--output-graph",
        graph.to_str().unwrap(),
    ]);
    let arena = v["arena_bytes"].as_u64().unwrap();
    assert!(
        arena < v["no_recompute_arena_bytes"].as_u64().unwrap(),
        "{v}"
    );
    assert_eq!(v["max_added_share"], 0.005);
    let (added, step) = (
        v["added_flops"].as_f64().unwrap(),
        v["step_flops"].as_f64().unwrap(),
    );
    assert!(added > 0.0 && added <= 0.005 * step, "{added} of {step}");
    checks_within(&graph, &plan, arena);
    // The text report says what was allowed.
    let o = ok(&[
        "fit",
        "--example",
        "mlp",
        "--max-added",
        "0.002",
        "--time-limit",
        "5",
    ]);
    assert!(o.contains("at most +0.200% of the step's cost"), "{o}");
    // Not a share, or with a budget too: refused by name.
    let o = memplan(&["fit", "--example", "mlp", "--max-added=-1%"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("--max-added"), "{}", stderr(&o));
    let o = memplan(&[
        "fit",
        "--example",
        "mlp",
        "--max-added",
        "1%",
        "--budget",
        "1GiB",
    ]);
    assert_ne!(o.status.code(), Some(0));
    assert!(stderr(&o).contains("--max-added"), "{}", stderr(&o));
}

#[test]
fn export_hlo_writes_the_planned_order_scheduled_and_chained() {
    let dir = std::env::temp_dir().join(format!("memplan-export-hlo-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let module = "fixtures/hlo/cnn/cpu_after_optimizations.txt.gz";
    let plan = dir.join("plan.json");
    let out = dir.join("scheduled.txt");
    ok(&[
        "plan",
        module,
        "-o",
        plan.to_str().unwrap(),
        "--time-limit",
        "2",
    ]);
    ok(&[
        "export",
        "--hlo",
        module,
        "--plan",
        plan.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
    ]);
    let text = std::fs::read_to_string(&out).unwrap();
    assert!(text.starts_with("HloModule jit_step_cnn, is_scheduled=true"));
    // The relisted module's own schedule is the plan's order.
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&plan).unwrap()).unwrap();
    let planned: Vec<String> = v["order"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o.as_str().unwrap().to_string())
        .collect();
    let g = memplan::io::load_graph(&out).unwrap();
    let (_, order) = g
        .extra_orders
        .iter()
        .find(|(n, _)| n == "xla-order")
        .unwrap();
    let listed: Vec<String> = order.iter().map(|&o| g.op(o).name.clone()).collect();
    assert_eq!(listed, planned);
    assert!(text.contains("control-predecessors={%"));
    // A plan of another module is refused, naming what is wrong.
    let e = memplan(&[
        "export",
        "--hlo",
        "fixtures/hlo/mlp/cpu_after_optimizations.txt.gz",
        "--plan",
        plan.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
    ]);
    assert!(!e.status.success());
    assert!(stderr(&e).contains("plan"), "{}", stderr(&e));
    // --hlo needs an HLO module.
    let e = memplan(&[
        "export",
        "--hlo",
        "fixtures/graphs/linear-sgd.json",
        "-o",
        "x.txt",
    ]);
    assert!(!e.status.success());
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn xla_allocations_plan_and_export_an_hlo_module_and_refuse_other_graphs() {
    let dir = std::env::temp_dir().join(format!("memplan-xla-alloc-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let module = "fixtures/hlo/cnn/cpu_after_optimizations.txt.gz";
    let plan = dir.join("plan.json");
    let one_arena = json(&["plan", module, "--json", "--time-limit", "2"]);
    let xla = json(&[
        "plan",
        module,
        "--xla-allocations",
        "--json",
        "--time-limit",
        "2",
        "-o",
        plan.to_str().unwrap(),
    ]);
    // Every aliased parameter's bytes held all step: never less.
    let bytes = |v: &serde_json::Value| v["max_live_bytes"].as_u64().unwrap();
    assert!(bytes(&xla) >= bytes(&one_arena));
    // The estimate of XLA's total: no less than one arena's max live, and
    // at most the ceiling plus packing.
    let estimate = xla["xla_estimate_bytes"].as_u64().unwrap();
    assert!(estimate >= bytes(&one_arena), "{xla}");
    assert!(estimate as f64 <= bytes(&xla) as f64 * 1.01, "{xla}");
    // The plan fits the module imported the same way, not the one-arena one.
    let out = dir.join("scheduled.txt");
    let (p, o) = (plan.to_str().unwrap(), out.to_str().unwrap());
    ok(&[
        "export",
        "--hlo",
        module,
        "--xla-allocations",
        "--plan",
        p,
        "-o",
        o,
    ]);
    let e = memplan(&["export", "--hlo", module, "--plan", p, "-o", o]);
    assert_eq!(e.status.code(), Some(1), "{}", stderr(&e));
    // compare sets the estimate for XLA's own order beside XLA's report.
    let c = json(&[
        "compare",
        module,
        "--xla-allocations",
        "--json",
        "--time-limit",
        "2",
    ]);
    let peak = |name: &str| c["baselines"][name]["footprint_bytes"].as_u64().unwrap() as f64;
    let ratio = peak("xla") / peak("xla-order, xla-estimate");
    assert!((0.998..=1.002).contains(&ratio), "{c}");
    // memplan's order is never estimated above XLA's own.
    let mine = c["xla_estimate_bytes"].as_u64().unwrap() as f64;
    assert!(mine <= peak("xla-order, xla-estimate"), "{c}");
    let e = memplan(&[
        "plan",
        "fixtures/graphs/linear-sgd.json",
        "--xla-allocations",
    ]);
    assert_eq!(e.status.code(), Some(1));
    assert!(
        stderr(&e).contains("applies to XLA HLO modules"),
        "{}",
        stderr(&e)
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn an_error_names_its_cause_once() {
    let dir = std::env::temp_dir().join(format!("memplan-cli-dup-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("dup.json");
    std::fs::write(
        &path,
        r#"{"format": "memplan-graph", "version": 1, "tensors": [{"id": "t", "size": 4}, {"id": "t", "size": 4}], "ops": []}"#,
    )
    .unwrap();
    let o = memplan(&["plan", path.to_str().unwrap()]);
    std::fs::remove_dir_all(&dir).ok();
    assert_eq!(o.status.code(), Some(1));
    let err = stderr(&o);
    assert_eq!(err.matches("is defined twice").count(), 1, "{err}");
    assert!(err.contains("dup.json"), "{err}");
}

#[test]
fn max_batch_of_a_graph_file_from_two_captures() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("cli-max-batch");
    std::fs::create_dir_all(&dir).unwrap();
    let file = |b: &str| {
        dir.join(format!("mlp-b{b}.json"))
            .to_str()
            .unwrap()
            .to_string()
    };
    let (f2, f3) = (file("2"), file("3"));
    for (b, f) in [("2", &f2), ("3", &f3)] {
        ok(&["export", "--example", "mlp", "--batch", b, "-o", f]);
    }
    let budget = ["--budget", "60MB", "--time-limit", "10"];
    let mut args = vec!["fit", &f2, "--batch-graph", &f3, "--max-batch", "--json"];
    args.extend(budget);
    let from_files = json(&args);
    let mut args = vec!["fit", "--example", "mlp", "--max-batch", "--json"];
    args.extend(budget);
    let from_example = json(&args);
    assert_eq!(
        from_files["planned"], from_example["planned"],
        "{from_files}"
    );
    assert_eq!(from_files["eager"], from_example["eager"], "{from_files}");
    assert!(from_files["planned"].as_u64().unwrap() >= 1, "{from_files}");
    // A graph file alone has no batch line.
    let o = memplan(&["fit", &f2, "--max-batch", "--budget", "1GB"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("--batch-graph"), "{}", stderr(&o));
    // Two captures of different steps are refused by name.
    let other = dir.join("gpt2.json");
    ok(&[
        "export",
        "--example",
        "gpt2-tiny",
        "--layers",
        "1",
        "-o",
        other.to_str().unwrap(),
    ]);
    let o = memplan(&[
        "fit",
        &f2,
        "--batch-graph",
        other.to_str().unwrap(),
        "--batches",
        "2,3",
        "--max-batch",
        "--budget",
        "1GB",
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("differ"), "{}", stderr(&o));
}

/// `run --world-size W --batch b` trains one device's step with batch
/// `W·b` (each rank its own rows of the global batch, gradients averaged),
/// so its losses are `run --batch W·b`'s, not `--world-size 1 --batch b`'s
/// (issue 41: "--world-size 4 gives another loss than one rank";
/// docs/runtime.md says why).
#[test]
fn a_sharded_run_has_the_losses_of_one_rank_with_the_global_batch() {
    let losses = |extra: &[&str]| -> Vec<f64> {
        let mut args = vec!["run", "--example", "gpt2-tiny", "--steps", "3", "--json"];
        args.extend(extra);
        json(&args)["steps"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["loss"].as_f64().unwrap())
            .collect()
    };
    let sharded = losses(&["--world-size", "4", "--batch", "1"]);
    let global = losses(&["--batch", "4"]);
    let one = losses(&["--batch", "1"]);
    assert_eq!(sharded.len(), 3);
    for (s, g) in sharded.iter().zip(&global) {
        assert!((s - g).abs() <= 1e-5 * g.abs(), "{sharded:?} vs {global:?}");
    }
    assert!((sharded[0] - one[0]).abs() > 1e-4, "{sharded:?} vs {one:?}");
}

#[test]
fn fit_offload_meets_a_budget_with_copies_that_check_and_refuses_bad_links() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("cli-offload");
    std::fs::create_dir_all(&dir).unwrap();
    let (plan, graph) = (dir.join("plan.json"), dir.join("graph.json"));
    let v = json(&[
        "fit",
        "--example",
        "gpt2-small",
        "--layers",
        "4",
        "--offload",
        "--time-limit",
        "10",
        "--budget",
        "60%",
        "--device",
        "h200-pcie5",
        "--json",
        "-o",
        plan.to_str().unwrap(),
        "--graph-output",
        graph.to_str().unwrap(),
    ]);
    let o = &v["offload"];
    let arena = v["arena_bytes"].as_u64().unwrap();
    assert!(arena <= o["arena_bytes_without_offload"].as_u64().unwrap() * 6 / 10);
    assert!(arena >= o["lower_bound_bytes"].as_u64().unwrap());
    assert!(o["host_bytes"].as_u64().unwrap() > 0 && o["offloaded_tensors"].as_u64().unwrap() > 0);
    let (t, c) = (
        o["modeled_seconds"].as_f64().unwrap(),
        o["compute_seconds"].as_f64().unwrap(),
    );
    assert!(t >= c && c == o["modeled_seconds_without_offload"].as_f64().unwrap());
    assert_eq!(o["device"], "h200-pcie5");
    // The graph with its copies and the plan check, host pool included.
    let check = json(&[
        "check",
        graph.to_str().unwrap(),
        plan.to_str().unwrap(),
        "--json",
    ]);
    assert_eq!(check["host_max_live_bytes"], o["host_bytes"]);
    assert!(check["max_live_bytes"].as_u64().unwrap() <= arena);
    // Within a slowdown instead of a budget.
    let v = json(&[
        "fit",
        "--example",
        "gpt2-small",
        "--layers",
        "4",
        "--offload",
        "--max-slowdown",
        "5%",
        "--time-limit",
        "10",
        "--json",
    ]);
    let o = &v["offload"];
    assert!(
        o["modeled_seconds"].as_f64().unwrap()
            <= o["compute_seconds"].as_f64().unwrap() * 1.05 + 1e-12
    );
    // Bad links, presets, host memory and budgets: exit 1, named.
    for (args, want) in [
        (vec!["--link-gbps", "0"], "--link-gbps"),
        (vec!["--link-gbps", "NaN"], "--link-gbps"),
        (vec!["--device", "tpu"], "unknown device preset \"tpu\""),
        (vec!["--host-memory", "lots"], "--host-memory"),
        (vec!["--host-memory", "1KiB"], "host memory"),
        (vec!["--budget", "1MiB"], "the bound at any link speed"),
    ] {
        let mut a = vec![
            "fit",
            "--example",
            "gpt2-small",
            "--layers",
            "4",
            "--offload",
        ];
        if !args.contains(&"--budget") {
            a.extend(["--budget", "60%", "--time-limit", "5"]);
        }
        a.extend(args.iter().copied());
        let o = memplan(&a);
        assert_eq!(o.status.code(), Some(1), "{a:?}: {}", stderr(&o));
        assert!(stderr(&o).contains(want), "{a:?}: {}", stderr(&o));
    }
    // Options of --offload without it: a usage error.
    let o = memplan(&[
        "fit",
        "--example",
        "mlp",
        "--budget",
        "50%",
        "--device",
        "h100-pcie5",
    ]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
}
