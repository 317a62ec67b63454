//! The peak regression test: re-plans every graph recorded in
//! `fixtures/peaks.json` and fails if any planned peak grew, any lower bound
//! shrank, or any recorded graph changed. Exact: peaks are deterministic.
//! When peaks improve, rewrite the record with
//! `memplan bench --update fixtures/peaks.json` (see docs/benchmarks.md).

use std::path::Path;

use memplan::bench::{PeakRecord, Verdict, check_record};

fn record_path() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/peaks.json")
}

#[test]
fn recorded_peaks_do_not_get_worse() {
    let path = record_path();
    let verdicts = check_record(&path).unwrap_or_else(|e| panic!("{e}"));
    assert!(!verdicts.is_empty(), "{} records no graph", path.display());
    let mut failures = Vec::new();
    for v in &verdicts {
        match v {
            Verdict::Same { .. } => {}
            Verdict::Improved { .. } => eprintln!("{v}"),
            _ => failures.push(v.to_string()),
        }
    }
    if verdicts
        .iter()
        .any(|v| matches!(v, Verdict::Improved { .. }))
    {
        eprintln!(
            "peaks improved: tighten the record with memplan bench --update fixtures/peaks.json"
        );
    }
    assert!(
        failures.is_empty(),
        "{} of {} recorded graphs got worse:\n{}",
        failures.len(),
        verdicts.len(),
        failures.join("\n")
    );
}

/// The record covers every built-in GPT-2 preset, so a change that makes any
/// of them worse cannot pass unnoticed.
#[test]
fn record_covers_every_gpt2_preset() {
    let rec = PeakRecord::read(&record_path()).unwrap();
    for name in memplan::models::EXAMPLES
        .iter()
        .filter(|n| n.starts_with("gpt2-"))
    {
        let source = format!("example:{name}");
        assert!(
            rec.entry(&source).is_some(),
            "fixtures/peaks.json does not record {source}: run memplan bench --update fixtures/peaks.json {source}"
        );
    }
    for e in &rec.entries {
        assert!(
            e.lower_bound_bytes <= e.max_live_bytes && e.max_live_bytes <= e.arena_bytes,
            "{}: recorded bound {} <= max live {} <= peak {} does not hold",
            e.source,
            e.lower_bound_bytes,
            e.max_live_bytes,
            e.arena_bytes
        );
    }
}
