//! Guards against import rings coming back (issue 38, "Layering"): each
//! check names a ring that was broken and the one-way direction that
//! replaced it. Only code counts: comments (doc links included) and
//! `#[cfg(test)]` modules at the end of a file are skipped.

use std::path::Path;

/// The code of `path` (from the repository root): comments dropped, and
/// everything from the first `#[cfg(test)]` on.
fn code(path: &str) -> String {
    let full = Path::new(env!("CARGO_MANIFEST_DIR")).join(path);
    let text = std::fs::read_to_string(&full).unwrap_or_else(|e| panic!("{path}: {e}"));
    let text = text.split("#[cfg(test)]").next().unwrap_or("");
    text.lines()
        .map(|l| l.split("//").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Fails, naming `ring`, when `path`'s code mentions any of `forbidden`.
fn refuses(ring: &str, path: &str, forbidden: &[&str]) {
    refuses_in(ring, path, &code(path), forbidden);
}

/// [`refuses`], the file's tests included.
fn refuses_with_tests(ring: &str, path: &str, forbidden: &[&str]) {
    let full = Path::new(env!("CARGO_MANIFEST_DIR")).join(path);
    let text = std::fs::read_to_string(&full).unwrap_or_else(|e| panic!("{path}: {e}"));
    let c = text
        .lines()
        .map(|l| l.split("//").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n");
    refuses_in(ring, path, &c, forbidden);
}

fn refuses_in(ring: &str, path: &str, c: &str, forbidden: &[&str]) {
    for f in forbidden {
        assert!(
            !c.contains(f),
            "{path} uses `{f}`: that brings back the ring {ring} (issue 38)"
        );
    }
}

#[test]
fn plan_model_does_not_depend_on_io_or_checker() {
    let ring = "error -> checker -> plan -> io/json";
    refuses(ring, "src/plan.rs", &["crate::io", "crate::checker"]);
    refuses(
        ring,
        "src/error.rs",
        &["crate::checker", "crate::plan", "crate::io"],
    );
    refuses(ring, "src/checker.rs", &["crate::io"]);
}

#[test]
fn baselines_and_layout_do_not_depend_on_the_pipeline() {
    let ring = "pipeline -> baselines -> io/hlo/xla_estimate -> pipeline";
    refuses(
        ring,
        "src/layout.rs",
        &["crate::pipeline", "crate::baselines"],
    );
    refuses(
        ring,
        "src/baselines/mod.rs",
        &["crate::pipeline", "crate::io"],
    );
    refuses(
        ring,
        "src/baselines/xla_estimate.rs",
        &["crate::pipeline", "crate::io"],
    );
    refuses(ring, "src/baselines/caching.rs", &["crate::pipeline"]);
    assert!(
        !Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("src/io/hlo/xla_estimate.rs")
            .exists(),
        "the XLA estimate is a baseline: it lives in src/baselines/"
    );
}

#[test]
fn cut_solver_is_below_both_floors() {
    let ring = "solver bounds <-> group_bound";
    // Its tests too: they share the solver's test helpers
    // (solver/src/testing.rs), not bounds' own.
    refuses_with_tests(ring, "solver/src/group_bound.rs", &["crate::bounds"]);
    refuses(
        ring,
        "solver/src/cut.rs",
        &["crate::bounds", "crate::group_bound"],
    );
}

#[test]
fn init_is_below_program() {
    refuses(
        "runtime init <-> program",
        "runtime/src/init.rs",
        &["crate::program", "super::program"],
    );
}

#[test]
fn flops_do_not_depend_on_the_importer() {
    refuses(
        "io/hlo flops <-> import",
        "src/io/hlo/flops.rs",
        &["super::import", "hlo::import"],
    );
    refuses(
        "io/hlo flops <-> import",
        "src/io/hlo/parser.rs",
        &["super::import", "super::flops", "hlo::import", "hlo::flops"],
    );
}

#[test]
fn the_pipeline_does_not_depend_on_the_split_pass() {
    // The split pass plans its candidates through the pipeline; the
    // pipeline's `Split` option lives with its other options.
    refuses(
        "pipeline <-> split",
        "src/pipeline.rs",
        &["crate::split::Split", "split::plan"],
    );
}

#[test]
fn the_cli_has_no_hub() {
    // cli/commands.rs held plan, compare, stats and the graph loader, and
    // fit, plot, run and trace imported it back. Now mod.rs dispatches,
    // load.rs holds what every command starts from, and no command file
    // imports another (nor load.rs any).
    let commands = [
        "plan", "check", "stats", "compare", "export", "alloc", "run", "bench", "plot", "trace",
        "fit",
    ];
    let ring = "cli/commands.rs <-> fit, plot, run, trace";
    let forbidden: Vec<String> = commands
        .iter()
        .map(|c| format!("super::{c}::"))
        .chain(["commands::".to_string()])
        .collect();
    let forbidden: Vec<&str> = forbidden.iter().map(String::as_str).collect();
    for file in commands.iter().chain(&["load"]) {
        refuses(ring, &format!("src/cli/{file}.rs"), &forbidden);
    }
}
