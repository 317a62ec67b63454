//! Every `memplan` command in the docs runs as written (issue 41).
//!
//! - **Fenced examples**: each `memplan …` line of a fenced shell block of
//!   README.md, python/README.md and docs/*.md runs, in the block's order,
//!   in a temporary directory holding the files the docs name (`step.json`,
//!   `MODULE.txt`, `fixtures/`, …, made by [`files_the_docs_name`]). It must
//!   exit 0 without a panic, and what it writes with `-o` or `>` must
//!   exist. Two changes, both for CI's time: a command of a subcommand that
//!   takes `--time-limit` and sets none gets `--time-limit 2`, and a
//!   `--device cuda` command, on a machine without a GPU, must instead fail
//!   with an error naming CUDA.
//! - **Synopses** (a fenced line with `[--flag …]`): each flag is in the
//!   subcommand's `--help`.
//! - **Inline commands** (`` `memplan SUB …` `` in the prose, many of them
//!   the commands behind a quoted figure, too slow to rerun here): each
//!   parses, every flag and value accepted, by running it with `--help`
//!   appended (clap parses what comes before `--help` and stops there).
//!
//! The Python examples run in python/tests/test_doc_examples.py.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn memplan_in(dir: &Path, args: &[String]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_memplan"))
        .args(args)
        .current_dir(dir)
        .stdin(Stdio::null())
        .output()
        .expect("memplan runs")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// The docs whose examples are run: every markdown file a newcomer reads.
fn docs() -> Vec<String> {
    let mut out = vec!["README.md".to_string(), "python/README.md".to_string()];
    let mut md: Vec<String> = std::fs::read_dir(root().join("docs"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".md"))
        .map(|n| format!("docs/{n}"))
        .collect();
    md.sort();
    out.extend(md);
    out
}

/// A shell line's words: quotes ('…', "…") group, `#` after a space starts
/// a comment, `\` escapes one character.
fn words(line: &str) -> Vec<String> {
    let (mut out, mut cur, mut has) = (Vec::new(), String::new(), false);
    let mut quote: Option<char> = None;
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some(_), c) => cur.push(c),
            (None, '\'' | '"') => {
                quote = Some(c);
                has = true;
            }
            (None, '\\') => {
                if let Some(n) = chars.next() {
                    cur.push(n);
                    has = true;
                }
            }
            (None, '#') if !has => break,
            (None, c) if c.is_whitespace() => {
                if has {
                    out.push(std::mem::take(&mut cur));
                    has = false;
                }
            }
            (None, c) => {
                cur.push(c);
                has = true;
            }
        }
    }
    if has {
        out.push(cur);
    }
    out
}

/// The subcommands, from `memplan --help`.
fn subcommands() -> BTreeSet<String> {
    let o = memplan_in(&root(), &["--help".to_string()]);
    let help = text(&o.stdout);
    let list = help.split("Commands:").nth(1).expect("a Commands: section");
    list.lines()
        .skip(1)
        .take_while(|l| !l.trim().is_empty())
        .filter_map(|l| l.split_whitespace().next().map(str::to_string))
        .filter(|w| w != "help")
        .collect()
}

#[derive(Debug, Clone)]
struct Example {
    doc: String,
    line: usize,
    words: Vec<String>,
}

impl Example {
    fn shown(&self) -> String {
        format!("{}:{}: {}", self.doc, self.line, self.words.join(" "))
    }
    fn sub(&self) -> &str {
        &self.words[1]
    }
}

/// Each `memplan SUB …` of `doc`: (fenced, in order), (inline).
fn examples(doc: &str, subs: &BTreeSet<String>) -> (Vec<Example>, Vec<Example>) {
    let body = std::fs::read_to_string(root().join(doc)).unwrap();
    let is_memplan = |w: &[String]| w.len() >= 2 && w[0] == "memplan" && subs.contains(&w[1]);
    let (mut fenced, mut inline) = (Vec::new(), Vec::new());
    let mut fence: Option<String> = None;
    let mut pending = String::new();
    for (i, line) in body.lines().enumerate() {
        if let Some(lang) = line.trim_start().strip_prefix("```") {
            fence = match fence {
                None => Some(lang.trim().to_string()),
                Some(_) => None,
            };
            continue;
        }
        match fence.as_deref() {
            Some("sh" | "bash" | "") => {
                if let Some(start) = line.strip_suffix('\\') {
                    pending.push_str(start);
                    pending.push(' ');
                    continue;
                }
                let full = std::mem::take(&mut pending) + line;
                let w = words(full.trim_start_matches("$ "));
                if is_memplan(&w) {
                    fenced.push(Example {
                        doc: doc.to_string(),
                        line: i + 1,
                        words: w,
                    });
                }
            }
            Some(_) => {}
            None => {
                for (j, part) in line.split('`').enumerate() {
                    let w = words(part);
                    // Odd parts are inside backticks; a bare `memplan SUB`
                    // names a command rather than showing an example.
                    if j % 2 == 1 && is_memplan(&w) && w.len() > 2 {
                        inline.push(Example {
                            doc: doc.to_string(),
                            line: i + 1,
                            words: w,
                        });
                    }
                }
            }
        }
    }
    (fenced, inline)
}

fn gunzip(from: &Path, to: &Path) {
    use std::io::Read;
    let mut s = String::new();
    flate2::read::GzDecoder::new(std::fs::File::open(from).unwrap())
        .read_to_string(&mut s)
        .unwrap();
    std::fs::write(to, s).unwrap();
}

/// The files the examples read, made in `dir`: a step's graph under the
/// names the docs use (an MLP), its plan, the step at batches 2 and 3, an
/// XLA module, a PyTorch export and `fixtures/` (the repository's, with a
/// copy of `peaks.json`, which `bench --update` rewrites).
fn files_the_docs_name(dir: &Path) {
    let run = |args: &[&str]| {
        let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        let o = memplan_in(dir, &args);
        assert!(o.status.success(), "{args:?}: {}", text(&o.stderr));
    };
    for name in ["model.json", "step.json", "my_step.json"] {
        run(&["export", "--example", "mlp", "-o", name]);
    }
    run(&[
        "export",
        "--example",
        "mlp",
        "--batch",
        "2",
        "-o",
        "step-b2.json",
    ]);
    run(&[
        "export",
        "--example",
        "mlp",
        "--batch",
        "3",
        "-o",
        "step-b3.json",
    ]);
    run(&[
        "plan",
        "step.json",
        "--time-limit",
        "2",
        "-o",
        "step.plan.json",
    ]);
    let module = root().join("fixtures/hlo/mlp/cpu_after_optimizations.txt.gz");
    gunzip(&module, &dir.join("MODULE.txt"));
    std::fs::create_dir_all(dir.join("DIR")).unwrap();
    gunzip(
        &module,
        &dir.join("DIR/module_0001.jit_step.cpu_after_optimizations.txt"),
    );
    std::fs::copy(
        root().join("fixtures/torch/resnet50_b32.json.gz"),
        dir.join("resnet50_b32.json.gz"),
    )
    .unwrap();
    // `fixtures/`: a small copy of the repository's (real files, since a
    // record's graphs must lie under its folder), and a record of the
    // graphs it holds: `bench --check` and `--update` run as written on it
    // in seconds; tests/peaks.rs checks the whole record.
    let fixtures = dir.join("fixtures");
    for f in FIXTURES {
        let to = fixtures.join(f);
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        std::fs::copy(root().join("fixtures").join(f), to).unwrap();
    }
    let record = std::fs::read_to_string(root().join("fixtures/peaks.json")).unwrap();
    let mut record: serde_json::Value = serde_json::from_str(&record).unwrap();
    let kept: Vec<serde_json::Value> = record["entries"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| {
            let src = e["source"].as_str().unwrap();
            RECORDED_EXAMPLES.contains(&src) || FIXTURES.contains(&src)
        })
        .cloned()
        .collect();
    assert_eq!(kept.len(), RECORDED_EXAMPLES.len() + FIXTURES.len());
    record["entries"] = serde_json::Value::Array(kept);
    std::fs::write(
        fixtures.join("peaks.json"),
        serde_json::to_string_pretty(&record).unwrap(),
    )
    .unwrap();
}

/// The graph files of the small `fixtures/` the examples see.
const FIXTURES: &[&str] = &[
    "graphs/linear-sgd.json",
    "graphs/mlp.json.gz",
    "hlo/mlp/cpu_after_optimizations.txt.gz",
    "hlo/cnn/cpu_after_optimizations.txt.gz",
];

/// The built-in examples kept in its record.
const RECORDED_EXAMPLES: &[&str] = &["example:mlp", "example:gpt2-tiny", "example:llama-tiny"];

/// Does `memplan SUB --help` list `flag`?
fn help_of(sub: &str) -> String {
    let o = memplan_in(&root(), &[sub.to_string(), "--help".to_string()]);
    assert!(o.status.success(), "memplan {sub} --help");
    text(&o.stdout)
}

/// Runs one fenced example in `dir`; an error message, or None.
fn run_example(dir: &Path, ex: &Example) -> Option<String> {
    let mut args: Vec<String> = ex.words[1..].to_vec();
    // `> FILE`: standard output into FILE.
    let redirect = args.iter().position(|w| w == ">").map(|i| {
        let file = args.get(i + 1).cloned().expect("a file after >");
        args.truncate(i);
        file
    });
    // `bench --check` / `--update` re-plan at the record's own limits.
    let record = args.iter().any(|a| a == "--check" || a == "--update");
    if !record
        && !args.iter().any(|a| a == "--time-limit")
        && help_of(ex.sub()).contains("--time-limit")
    {
        args.extend(["--time-limit".to_string(), "2".to_string()]);
    }
    let o = memplan_in(dir, &args);
    let (out, err) = (text(&o.stdout), text(&o.stderr));
    if err.contains("panicked") {
        return Some(format!("panicked: {err}"));
    }
    let cuda = args
        .windows(2)
        .any(|w| w[0] == "--device" && w[1] == "cuda");
    if cuda && !o.status.success() {
        // No GPU here: a clear error naming CUDA, not a crash.
        return (o.status.code() != Some(1) || !err.to_lowercase().contains("cuda"))
            .then(|| format!("without a GPU: exit {:?}: {err}", o.status.code()));
    }
    if !o.status.success() {
        return Some(format!("exit {:?}: {err}", o.status.code()));
    }
    if let Some(file) = redirect {
        std::fs::write(dir.join(&file), &out).unwrap();
    }
    let wrote = args
        .windows(2)
        .filter(|w| {
            [
                "-o",
                "--output",
                "--graph-output",
                "--output-graph",
                "--svg",
            ]
            .contains(&w[0].as_str())
        })
        .map(|w| w[1].clone());
    for f in wrote {
        if f != "-" && !dir.join(&f).is_file() {
            return Some(format!("wrote no {f}"));
        }
    }
    None
}

/// A synopsis line (`[--flag …]`): each flag in the subcommand's help.
fn synopsis_flags_exist(ex: &Example) -> Option<String> {
    let help = help_of(ex.sub());
    let missing: Vec<&str> = ex
        .words
        .iter()
        .map(|w| w.trim_start_matches('[').trim_end_matches(']'))
        .filter(|w| w.starts_with('-') && !help.contains(w))
        .collect();
    (!missing.is_empty()).then(|| format!("not in `memplan {} --help`: {missing:?}", ex.sub()))
}

/// A synopsis line: `[--flag …]` groups.
fn is_synopsis(ex: &Example) -> bool {
    ex.words.iter().any(|w| w.starts_with('['))
}

/// An inline command with a placeholder value (`--split-chunks K`,
/// `--budget B`: a word in capitals) shows a form, not an example.
fn has_placeholder(ex: &Example) -> bool {
    ex.words.iter().any(|w| {
        w.len() <= 12
            && w.chars().any(|c| c.is_ascii_uppercase())
            && w.chars()
                .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
    })
}

/// An inline command: a form (a placeholder, or a flag named without its
/// value, `memplan run --device`) has its flags checked; an example must
/// parse.
fn inline_fails(ex: &Example) -> Option<String> {
    if has_placeholder(ex) {
        return synopsis_flags_exist(ex);
    }
    let bare_flag = ex.words.last().is_some_and(|w| w.starts_with("--"));
    match parses(ex) {
        Some(e) if bare_flag && e.contains("a value is required") => synopsis_flags_exist(ex),
        r => r,
    }
}

/// An inline command parses: `… --help` exits 0.
fn parses(ex: &Example) -> Option<String> {
    let mut args = ex.words[1..].to_vec();
    args.push("--help".to_string());
    let o = memplan_in(&root(), &args);
    (!o.status.success()).then(|| format!("does not parse: {}", text(&o.stderr)))
}

fn check_doc(doc: &str) {
    let subs = subcommands();
    let (fenced, inline) = examples(doc, &subs);
    let dir = tempfile::tempdir().unwrap();
    if fenced.iter().any(|e| !is_synopsis(e)) {
        files_the_docs_name(dir.path());
    }
    let mut failures = Vec::new();
    for ex in &fenced {
        let failed = if is_synopsis(ex) {
            synopsis_flags_exist(ex)
        } else {
            run_example(dir.path(), ex)
        };
        if let Some(why) = failed {
            failures.push(format!("{}\n    {why}", ex.shown()));
        }
    }
    for ex in &inline {
        if let Some(why) = inline_fails(ex) {
            failures.push(format!("{}\n    {why}", ex.shown()));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn shell_words_and_comments() {
    assert_eq!(
        words(r#"memplan plot a.json --title "my step"   # a comment"#),
        ["memplan", "plot", "a.json", "--title", "my step"]
    );
    assert_eq!(
        words("memplan fit x --budget 75%"),
        ["memplan", "fit", "x", "--budget", "75%"]
    );
    assert_eq!(words("# only a comment"), Vec::<String>::new());
    assert_eq!(words("a#b 'c d'"), ["a#b", "c d"]);
}

/// Every doc with a `memplan` command has its test below, and the docs
/// have examples at all (a change of fence style cannot empty this file).
#[test]
fn every_doc_with_commands_is_tested() {
    let subs = subcommands();
    assert!(subs.contains("plan") && subs.contains("fit"), "{subs:?}");
    let with: BTreeSet<String> = docs()
        .into_iter()
        .filter(|d| {
            let (f, i) = examples(d, &subs);
            !f.is_empty() || !i.is_empty()
        })
        .collect();
    let tested: BTreeSet<String> = TESTED.iter().map(|s| s.to_string()).collect();
    assert_eq!(with, tested, "add a test for each doc with commands");
    let fenced: usize = TESTED.iter().map(|d| examples(d, &subs).0.len()).sum();
    assert!(fenced >= 30, "only {fenced} fenced commands found");
}

const TESTED: &[&str] = &[
    "README.md",
    "docs/allocator.md",
    "docs/benchmarks.md",
    "docs/cli.md",
    "docs/distributed.md",
    "docs/fit.md",
    "docs/graph-format.md",
    "docs/hlo.md",
    "docs/offload.md",
    "docs/pictures.md",
    "docs/plan-format.md",
    "docs/results.md",
    "docs/runtime.md",
    "docs/splitting.md",
    "docs/torch-export.md",
];

macro_rules! doc_tests {
    ($($name:ident => $doc:literal),* $(,)?) => {
        $(#[test] fn $name() { check_doc($doc); })*
    };
}

doc_tests! {
    readme => "README.md",
    allocator => "docs/allocator.md",
    benchmarks => "docs/benchmarks.md",
    cli => "docs/cli.md",
    distributed => "docs/distributed.md",
    fit => "docs/fit.md",
    graph_format => "docs/graph-format.md",
    hlo => "docs/hlo.md",
    offload => "docs/offload.md",
    pictures => "docs/pictures.md",
    results => "docs/results.md",
    plan_format => "docs/plan-format.md",
    runtime => "docs/runtime.md",
    splitting => "docs/splitting.md",
    torch_export => "docs/torch-export.md",
}
