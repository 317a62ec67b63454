//! The `bench`, `plot` and `trace` commands, run as a user runs them.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn memplan(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_memplan"))
        .args(args)
        .output()
        .expect("memplan runs")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// A fresh folder for one test.
fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("memplan-cli-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn bench_prints_a_markdown_table_with_a_summary_row() {
    let out = memplan(&["bench", "example:gpt2-tiny", "example:mlp", "--markdown"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let md = text(&out.stdout);
    let lines: Vec<&str> = md.lines().collect();
    assert!(lines[0].starts_with("| graph | ops | tensors | lower bound | pytorch-reserved"));
    assert!(
        lines[0].ends_with("| memplan | vs bound | vs best baseline | vs best eager | solve |")
    );
    assert!(lines[1].starts_with("| :-- | --: |"));
    assert!(
        lines[2].starts_with("| gpt2-tiny-b2 | 93 |"),
        "{}",
        lines[2]
    );
    assert!(lines[3].starts_with("| mlp |"));
    assert!(
        lines[4].starts_with("| **geomean (2 graphs)** |"),
        "{}",
        lines[4]
    );
    // Every row has as many cells as the header.
    let cells = |l: &str| l.matches(" | ").count();
    assert!(lines[..5].iter().all(|l| cells(l) == cells(lines[0])));
}

#[test]
fn bench_json_holds_every_figure() {
    let out = memplan(&[
        "bench",
        "example:gpt2-tiny,checkpoint",
        "example:mlp,batch=8",
        "--json",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let graphs = v["graphs"].as_array().unwrap();
    assert_eq!(graphs.len(), 2);
    assert_eq!(graphs[0]["source"], "example:gpt2-tiny,checkpoint");
    for g in graphs {
        let peak = g["arena_bytes"].as_u64().unwrap();
        let bound = g["lower_bound_bytes"].as_u64().unwrap();
        assert!(bound <= peak);
        let greedy = g["baselines"]["program-order+greedy"]["footprint_bytes"]
            .as_u64()
            .unwrap();
        assert!(peak <= greedy, "memplan is worse than program order");
        let r = g["ratio_to_lower_bound"].as_f64().unwrap();
        assert!((r - peak as f64 / bound as f64).abs() < 1e-9);
        assert!(g["solve_seconds"].as_f64().unwrap() >= 0.0);
        assert!(
            g["baselines"]["pytorch-reserved"]["footprint_bytes"]
                .as_u64()
                .unwrap()
                > 0
        );
    }
    assert_eq!(v["summary"]["graphs"], 2);
    assert!(
        v["summary"]["geomean_ratio_to_lower_bound"]
            .as_f64()
            .unwrap()
            >= 1.0
    );
}

#[test]
fn bench_walks_folders_and_skips_files_that_are_not_graphs() {
    let d = scratch("walk");
    let graph = d.join("sub").join("mlp.json.gz");
    std::fs::create_dir_all(graph.parent().unwrap()).unwrap();
    let out = memplan(&["export", "--example", "mlp", "-o", s(&graph)]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    std::fs::write(d.join("notes.csv"), "a,b\n1,2\n").unwrap();
    std::fs::write(d.join(".hidden.json"), "{").unwrap();
    let out = memplan(&["bench", s(&d), "--json"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["graphs"].as_array().unwrap().len(), 1);
    assert_eq!(v["graphs"][0]["graph"], "mlp");
    let skipped = v["skipped"].as_array().unwrap();
    assert_eq!(skipped.len(), 1);
    assert!(skipped[0]["path"].as_str().unwrap().ends_with("notes.csv"));
    assert!(text(&out.stderr).contains("skipping"));
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn bench_reports_bad_input_clearly() {
    let out = memplan(&["bench", "no/such/graph.json"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("no/such/graph.json"),
        "{}",
        text(&out.stderr)
    );
    let out = memplan(&["bench", "example:gpt2-tiny,batch=zero"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("batch must be a positive integer"));
    let out = memplan(&["bench"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("nothing to benchmark"));
    let out = memplan(&["bench", "--check", "x.json", "example:mlp"]);
    assert_eq!(out.status.code(), Some(1));
}

#[test]
fn update_then_check_a_record() {
    let d = scratch("record");
    let graph = d.join("mlp.json");
    assert!(
        memplan(&["export", "--example", "mlp", "-o", s(&graph)])
            .status
            .success()
    );
    let rec = d.join("peaks.json");
    let out = memplan(&["bench", "--update", s(&rec), s(&graph), "example:gpt2-tiny"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&rec).unwrap()).unwrap();
    let sources: Vec<&str> = v["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["source"].as_str().unwrap())
        .collect();
    // Files are recorded relative to the record's folder.
    assert_eq!(sources, ["example:gpt2-tiny", "mlp.json"]);

    let out = memplan(&["bench", "--check", s(&rec)]);
    assert!(
        out.status.success(),
        "{}{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    assert!(text(&out.stdout).contains("0 worse"));

    // A record written before the arena had its name (`peak_bytes`) reads
    // as before.
    let mut old = v.clone();
    for e in old["entries"].as_array_mut().unwrap() {
        let e = e.as_object_mut().unwrap();
        let arena = e.remove("arena_bytes").unwrap();
        e.insert("peak_bytes".into(), arena);
    }
    let old_rec = d.join("old-peaks.json");
    std::fs::write(&old_rec, serde_json::to_string_pretty(&old).unwrap()).unwrap();
    let out = memplan(&["bench", "--check", s(&old_rec)]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("0 worse"));

    // A record claiming one byte less than memplan reaches fails the check,
    // and --update will not write the worse figure unless told to.
    let mut v2 = v.clone();
    let p = v2["entries"][1]["arena_bytes"].as_u64().unwrap();
    v2["entries"][1]["arena_bytes"] = (p - 1).into();
    std::fs::write(&rec, serde_json::to_string_pretty(&v2).unwrap()).unwrap();
    let out = memplan(&["bench", "--check", s(&rec)]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stdout).contains("mlp.json: REGRESSED: arena"),
        "{}",
        text(&out.stdout)
    );
    let out = memplan(&["bench", "--update", s(&rec)]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("--accept-worse"));
    let out = memplan(&["bench", "--update", s(&rec), "--accept-worse"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v3: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&rec).unwrap()).unwrap();
    assert_eq!(v3, v);

    // A graph outside the record's folder cannot be recorded.
    let other = scratch("record-outside").join("g.json");
    assert!(
        memplan(&["export", "--example", "mlp", "-o", s(&other)])
            .status
            .success()
    );
    let out = memplan(&["bench", "--update", s(&rec), s(&other)]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("must lie under the record's folder"));
    std::fs::remove_dir_all(other.parent().unwrap()).unwrap();
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn plot_draws_a_planned_or_given_plan() {
    let d = scratch("plot");
    let svg = d.join("tiny.svg");
    let out = memplan(&["plot", "--example", "gpt2-tiny", "-o", s(&svg)]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let body = std::fs::read_to_string(&svg).unwrap();
    assert!(body.starts_with("<svg") && body.trim_end().ends_with("</svg>"));
    assert!(body.contains("memplan order: peak"));

    let plan = d.join("tiny.plan.json");
    assert!(
        memplan(&["plan", "--example", "gpt2-tiny", "-o", s(&plan)])
            .status
            .success()
    );
    let out = memplan(&[
        "plot",
        "--example",
        "gpt2-tiny",
        "--plan",
        s(&plan),
        "-o",
        s(&svg),
        "--title",
        "given plan",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        std::fs::read_to_string(&svg)
            .unwrap()
            .contains("given plan")
    );

    // A plan that breaks the rules is refused, not drawn.
    let mut p: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&plan).unwrap()).unwrap();
    p["arena_bytes"] = 1.into();
    std::fs::write(&plan, p.to_string()).unwrap();
    let out = memplan(&[
        "plot",
        "--example",
        "gpt2-tiny",
        "--plan",
        s(&plan),
        "-o",
        s(&svg),
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("the plan is invalid"),
        "{}",
        text(&out.stderr)
    );
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn trace_writes_valid_trace_event_json() {
    let d = scratch("trace");
    let path = d.join("mlp.trace.json");
    let out = memplan(&["trace", "--example", "mlp", "-o", s(&path)]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    memplan::trace::validate(&v).unwrap();
    let events = v["traceEvents"].as_array().unwrap();
    assert!(
        events
            .iter()
            .any(|e| e["ph"] == "C" && e["name"] == "live bytes")
    );
    assert!(events.iter().any(|e| e["ph"] == "i" && e["name"] == "peak"));
    assert_eq!(v["otherData"]["graph"], "mlp");
    std::fs::remove_dir_all(&d).unwrap();
}
