//! Size limits on the Rust sources (issue 38): no function over
//! [`LIMIT`] lines, from its `fn` line to its closing brace, except a
//! dispatch with one arm per op ([`DISPATCH`]). The functions still over
//! it are listed in [`DEBT`] with their length today: the test fails when a
//! new one appears, when a listed one grows, and when a listed one has
//! been brought under the limit but is still listed. The Python side has
//! its own test (`python/tests/test_code_size.py`).

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

/// Lines a function may have.
const LIMIT: usize = 120;

/// Dispatches with one arm per op: (file, function).
const DISPATCH: &[(&str, &str)] = &[
    ("runtime/src/cpu/mod.rs", "run_instr"),
    ("src/vocab.rs", "kernel"),
    ("src/vocab.rs", "write"),
];

/// Functions over the limit today: (file, function, lines). Shrink them;
/// never add to this list (empty since every one was split).
const DEBT: &[(&str, &str, usize)] = &[];

const ROOTS: &[&str] = &[
    "src",
    "solver/src",
    "allocator/src",
    "runtime/src",
    "capi/src",
    "python/src",
];

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// `line` without its string and character literals and its `//` comment,
/// so that only real braces are counted.
fn code_of(line: &str) -> String {
    let mut out = String::new();
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '"' => {
                while let Some(d) = chars.next() {
                    match d {
                        '\\' => {
                            chars.next();
                        }
                        '"' => break,
                        _ => {}
                    }
                }
            }
            // A character literal ('{', '\'', '\n'); a lifetime ('a) has
            // no closing quote right after and is kept.
            '\'' => {
                let rest: String = chars.clone().take(3).collect();
                let mut r = rest.chars();
                match (r.next(), r.next(), r.next()) {
                    (Some('\\'), Some(_), Some('\'')) => {
                        chars.nth(2);
                    }
                    (Some(_), Some('\''), _) => {
                        chars.nth(1);
                    }
                    _ => out.push(c),
                }
            }
            '/' if chars.peek() == Some(&'/') => break,
            _ => out.push(c),
        }
    }
    out
}

/// The name of the function a line declares, if it does.
fn declares(line: &str) -> Option<&str> {
    let t = line.trim_start();
    let mut words = t.split_whitespace().peekable();
    while let Some(w) = words.next() {
        match w {
            "fn" => {
                let name = words.next()?;
                let end = name
                    .find(|c: char| !(c.is_alphanumeric() || c == '_'))
                    .unwrap_or(name.len());
                return Some(&name[..end]);
            }
            "pub" | "const" | "async" | "unsafe" | "extern" | "\"C\"" => {}
            w if w.starts_with("pub(") => {}
            _ => return None,
        }
    }
    None
}

/// Every function of `text` with its length in lines.
fn functions(text: &str) -> Vec<(String, usize)> {
    let lines: Vec<String> = text.lines().map(code_of).collect();
    let mut out = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let Some(name) = declares(line) else {
            continue;
        };
        let mut depth = 0i64;
        let mut opened = false;
        for (j, l) in lines.iter().enumerate().skip(i) {
            if !opened && l.trim_end().ends_with(';') {
                break; // a declaration without a body (a trait's)
            }
            for c in l.chars() {
                match c {
                    '{' => {
                        depth += 1;
                        opened = true;
                    }
                    '}' => depth -= 1,
                    _ => {}
                }
            }
            if opened && depth <= 0 {
                out.push((name.to_string(), j - i + 1));
                break;
            }
        }
    }
    out
}

#[test]
fn the_scanner_measures_functions() {
    let text = "fn a() {\n    let s = \"}}\";\n    let c = '{';\n}\n\npub(crate) fn b<'x>(y: &'x str) -> &'x str {\n    // }\n    y\n}\ntrait T {\n    fn c(&self);\n}\n";
    assert_eq!(
        functions(text),
        vec![("a".to_string(), 4), ("b".to_string(), 4)]
    );
}

#[test]
fn no_function_grows_past_the_limit() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    for r in ROOTS {
        rust_files(&root.join(r), &mut files);
    }
    assert!(files.len() > 50, "found only {} Rust files", files.len());
    let mut over: BTreeMap<(String, String), usize> = BTreeMap::new();
    for f in &files {
        let rel = f
            .strip_prefix(&root)
            .unwrap()
            .to_string_lossy()
            .replace('\\', "/");
        let text = fs::read_to_string(f).unwrap();
        for (name, lines) in functions(&text) {
            if lines > LIMIT && !DISPATCH.contains(&(rel.as_str(), name.as_str())) {
                over.insert((rel.clone(), name), lines);
            }
        }
    }
    let mut problems = Vec::new();
    for ((file, name), lines) in &over {
        match DEBT.iter().find(|d| d.0 == file && d.1 == name) {
            None => problems.push(format!(
                "{file}: fn {name} has {lines} lines (limit {LIMIT}): split it"
            )),
            Some(&(_, _, was)) if *lines > was => problems.push(format!(
                "{file}: fn {name} grew from {was} to {lines} lines (limit {LIMIT}): split it"
            )),
            _ => {}
        }
    }
    for &(file, name, _) in DEBT {
        if !over.contains_key(&(file.to_string(), name.to_string())) {
            problems.push(format!(
                "{file}: fn {name} is within the limit now (or gone): remove it from DEBT"
            ));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}
