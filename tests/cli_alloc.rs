//! `memplan alloc`, run as a user runs it: MiniMalloc CSV in and out,
//! capacity mode, JSON, and clear errors for bad files.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use memplan_allocator::io::minimalloc_csv;
use memplan_allocator::{Solution, validate};

fn memplan(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_memplan"))
        .args(args)
        .output()
        .expect("memplan runs")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("memplan-alloc-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn example() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/minimalloc/example.12.csv")
}

#[test]
fn writes_a_layout_the_checker_accepts() {
    let d = scratch("out");
    let out_csv = d.join("out.csv");
    let out = memplan(&["alloc", s(&example()), "-o", s(&out_csv)]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains("arena 12 (optimal)"),
        "{}",
        text(&out.stdout)
    );
    // The output is the input plus offsets: read both back and check.
    let problem = minimalloc_csv::read(&example()).unwrap();
    let written = std::fs::read_to_string(&out_csv).unwrap();
    let mut offsets = Vec::new();
    for line in written.lines().skip(1) {
        offsets.push(line.rsplit(',').next().unwrap().parse::<u64>().unwrap());
    }
    let height = problem
        .buffers
        .iter()
        .zip(&offsets)
        .map(|(b, o)| o + b.size)
        .max()
        .unwrap();
    let sol = Solution { offsets, height };
    assert_eq!(height, 12);
    validate(&problem, &sol, Some(12)).unwrap();
    // And the written file parses as a problem again (offset column left
    // out of the problem).
    assert_eq!(minimalloc_csv::read(&out_csv).unwrap(), problem);
    // Given to `alloc`, its offsets are laid out anew and reported.
    let again = memplan(&["alloc", s(&out_csv)]);
    assert!(
        text(&again.stdout).contains(
            "the file's own offset column (not used; pin offsets with `pinned`): a valid layout, arena 12"
        ),
        "{}",
        text(&again.stdout)
    );
    // Offsets that overlap, or are missing, are said to be so.
    let mut lines: Vec<String> = written.lines().map(String::from).collect();
    let zeroed: Vec<String> = lines[1..]
        .iter()
        .map(|l| format!("{},0", l.rsplit_once(',').unwrap().0))
        .collect();
    let bad = d.join("bad.csv");
    std::fs::write(
        &bad,
        [lines[0].clone()]
            .into_iter()
            .chain(zeroed)
            .collect::<Vec<_>>()
            .join("\n"),
    )
    .unwrap();
    let v: serde_json::Value =
        serde_json::from_slice(&memplan(&["alloc", s(&bad), "--json"]).stdout).unwrap();
    assert_eq!(v["given_layout"]["valid"], false);
    assert!(
        v["given_layout"]["error"]
            .as_str()
            .unwrap()
            .contains("share bytes"),
        "{v}"
    );
    assert_eq!(v["arena_bytes"], 12);
    let last = lines.len() - 1;
    lines[last] = format!("{},", lines[last].rsplit_once(',').unwrap().0);
    std::fs::write(&bad, lines.join("\n")).unwrap();
    let v: serde_json::Value =
        serde_json::from_slice(&memplan(&["alloc", s(&bad), "--json"]).stdout).unwrap();
    assert_eq!(
        v["given_layout"]["error"],
        format!("1 of {} buffers have no offset", last)
    );
    // Without an offset column there is nothing to report.
    let v: serde_json::Value =
        serde_json::from_slice(&memplan(&["alloc", s(&example()), "--json"]).stdout).unwrap();
    assert!(v["given_layout"].is_null());
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn capacity_mode_answers_in_json_and_fails_when_refuted() {
    let out = memplan(&["alloc", s(&example()), "--capacity", "12", "--json"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["status"], "optimal");
    assert_eq!(v["arena_bytes"], 12);
    assert_eq!(v["max_live_bytes"], 12);
    let out = memplan(&["alloc", s(&example()), "--capacity", "11"]);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("proven: no layout fits in 11 bytes"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn a_bad_csv_gets_file_line_and_reason() {
    let d = scratch("bad");
    let bad = d.join("bad.csv");
    std::fs::write(&bad, "id,lower,upper,size\nb0,0,4,16\nb1,3,two,8\n").unwrap();
    let out = memplan(&["alloc", s(&bad)]);
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(
        err.contains("bad.csv:3: upper: expected a non-negative integer, got \"two\""),
        "{err}"
    );
    std::fs::write(&bad, "id,lower,size\nb0,0,16\n").unwrap();
    let err = text(&memplan(&["alloc", s(&bad)]).stderr);
    assert!(
        err.contains("bad.csv:1: the header has no \"upper\" column"),
        "{err}"
    );
    let out = memplan(&["alloc", s(&d.join("missing.csv"))]);
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("missing.csv"));
    std::fs::remove_dir_all(&d).unwrap();
}
