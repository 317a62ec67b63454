//! Bad input gets a clear error naming the file, the element and the
//! problem, never a panic: one test per kind of bad graph or plan file.

use std::path::{Path, PathBuf};

use memplan::Plan;

/// Writes `text` to a fresh file named `name` and loads it as a graph;
/// returns the error message and the path.
fn load_err(name: &str, text: &[u8]) -> (String, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(name);
    std::fs::write(&path, text).unwrap();
    let msg = match memplan::io::load_graph(&path) {
        Ok(g) => panic!("{name}: loaded a bad graph ({} ops)", g.num_ops()),
        Err(e) => e.to_string(),
    };
    // Keep the directory alive until the message is made.
    drop(dir);
    (msg, path)
}

/// Asserts the message for `text` names the file and holds every `part`.
fn expect(text: &str, parts: &[&str]) {
    let (msg, path) = load_err("bad-graph.json", text.as_bytes());
    assert!(
        msg.starts_with(&path.display().to_string()),
        "message does not start with the file: {msg}"
    );
    for p in parts {
        assert!(msg.contains(p), "message lacks {p:?}: {msg}");
    }
}

/// A graph file with the given tensors and ops arrays.
fn graph(tensors: &str, ops: &str) -> String {
    format!(
        r#"{{"format": "memplan-graph", "version": 1, "tensors": [{tensors}], "ops": [{ops}]}}"#
    )
}

#[test]
fn malformed_json_gives_line_and_column() {
    let text = "{\n  \"format\": \"memplan-graph\",\n  \"version\": 1,\n  \"tensors\": [}\n";
    let (msg, path) = load_err("g.json", text.as_bytes());
    assert!(msg.starts_with(&format!("{}:4:", path.display())), "{msg}");
    // A field of the wrong type, on line 3.
    let text = "{\"format\": \"memplan-graph\", \"version\": 1,\n\"tensors\": [\n{\"id\": \"a\", \"size\": \"big\"}], \"ops\": []}";
    let (msg, path) = load_err("g.json", text.as_bytes());
    assert!(msg.starts_with(&format!("{}:3:", path.display())), "{msg}");
    assert!(msg.contains("invalid type"), "{msg}");
    // A negative size.
    expect(
        &graph(r#"{"id": "a", "size": -1}"#, ""),
        &[":1:", "invalid value"],
    );
}

#[test]
fn unknown_fields_are_errors() {
    expect(
        &graph(r#"{"id": "a", "size": 1, "colour": "red"}"#, ""),
        &["unknown field `colour`"],
    );
    expect(
        &graph("", r#"{"id": "o", "input": ["a"]}"#),
        &["unknown field `input`"],
    );
}

#[test]
fn wrong_format_and_unsupported_version() {
    expect(
        r#"{"format": "onnx", "version": 1, "tensors": [], "ops": []}"#,
        &["unknown format \"onnx\"", "memplan-graph"],
    );
    expect(
        r#"{"version": 1, "tensors": [], "ops": []}"#,
        &["unknown format \"\""],
    );
    expect(
        r#"{"format": "memplan-graph", "version": 2, "tensors": [], "ops": [], "new_field": 1}"#,
        &["unsupported format version 2", "version 1"],
    );
}

#[test]
fn duplicate_ids() {
    expect(
        &graph(r#"{"id": "a", "size": 1}, {"id": "a", "size": 2}"#, ""),
        &["tensor id \"a\" is defined twice"],
    );
    expect(
        &graph("", r#"{"id": "o"}, {"id": "o"}"#),
        &["op id \"o\" is defined twice"],
    );
}

#[test]
fn unknown_ids_in_every_field() {
    let t = r#"{"id": "a", "size": 4, "role": "input"}, {"id": "b", "size": 4}"#;
    for (field, op) in [
        ("inputs", r#"{"id": "o", "inputs": ["zz"]}"#),
        ("outputs", r#"{"id": "o", "outputs": ["zz"]}"#),
        ("updates", r#"{"id": "o", "updates": ["zz"]}"#),
        (
            "reuse.output",
            r#"{"id": "o", "inputs": ["a"], "outputs": ["b"], "reuse": [{"output": "zz", "input": "a"}]}"#,
        ),
        (
            "reuse.input",
            r#"{"id": "o", "inputs": ["a"], "outputs": ["b"], "reuse": [{"output": "b", "input": "zz"}]}"#,
        ),
    ] {
        expect(&graph(t, op), &["op \"o\"", field, "unknown tensor \"zz\""]);
    }
    expect(
        &graph(t, r#"{"id": "o", "after": ["nope"]}"#),
        &["op \"o\"", "`after`", "unknown op \"nope\""],
    );
    expect(
        &graph(r#"{"id": "v", "size": 4, "view_of": "ghost"}"#, ""),
        &["tensor \"v\"", "view_of", "unknown tensor \"ghost\""],
    );
    let text = r#"{"format": "memplan-graph", "version": 1, "tensors": [], "ops": [{"id": "o"}], "orders": {"xla-order": ["o", "p"]}}"#;
    expect(text, &["order \"xla-order\"", "unknown op \"p\""]);
}

#[test]
fn bad_orders() {
    let ops = r#"{"id": "a", "outputs": ["x"]}, {"id": "b", "inputs": ["x"]}"#;
    let t = r#"{"id": "x", "size": 4}"#;
    let with_order = |order: &str| {
        format!(
            r#"{{"format": "memplan-graph", "version": 1, "tensors": [{t}], "ops": [{ops}], "orders": {{"eager": {order}}}}}"#
        )
    };
    expect(
        &with_order(r#"["a"]"#),
        &["order \"eager\"", "has 1 ops, the graph 2"],
    );
    expect(
        &with_order(r#"["b", "a"]"#),
        &["order \"eager\"", "runs \"b\" before its dependency \"a\""],
    );
    expect(&with_order(r#"["a", "a"]"#), &["order \"eager\"", "twice"]);
}

#[test]
fn cycles_name_their_ops() {
    expect(
        &graph(
            "",
            r#"{"id": "a", "after": ["c"]}, {"id": "b", "after": ["a"]}, {"id": "c", "after": ["b"]}"#,
        ),
        &["the ops form a cycle", "c -> a"],
    );
    // Through data: a reads what b makes and b reads what a makes.
    expect(
        &graph(
            r#"{"id": "x", "size": 1}, {"id": "y", "size": 1}"#,
            r#"{"id": "a", "inputs": ["y"], "outputs": ["x"]}, {"id": "b", "inputs": ["x"], "outputs": ["y"]}"#,
        ),
        &["cycle", "->"],
    );
    expect(
        &graph(
            r#"{"id": "u", "size": 1, "view_of": "w"}, {"id": "w", "size": 1, "view_of": "u"}"#,
            "",
        ),
        &["tensor \"u\"", "view_of", "loops"],
    );
}

#[test]
fn consumed_tensor_nobody_produces() {
    expect(
        &graph(
            r#"{"id": "act", "size": 8}"#,
            r#"{"id": "use", "inputs": ["act"]}"#,
        ),
        &[
            "tensor \"act\"",
            "activation",
            "op \"use\"",
            "no op produces it",
        ],
    );
    // A view of such a tensor, updated in place.
    expect(
        &graph(
            r#"{"id": "act", "size": 8}, {"id": "v", "size": 8, "view_of": "act"}"#,
            r#"{"id": "upd", "updates": ["v"]}"#,
        ),
        &["tensor \"v\"", "op \"upd\"", "no op produces it"],
    );
}

#[test]
fn size_overflow() {
    expect(
        &graph(
            r#"{"id": "a", "size": 18446744073709551000}, {"id": "b", "size": 1000}"#,
            "",
        ),
        &["tensor \"b\"", "overflows"],
    );
    // Alignment slack counts too.
    expect(
        &graph(
            r#"{"id": "a", "size": 18446744073709551000, "align": 4096}"#,
            "",
        ),
        &["tensor \"a\"", "overflows"],
    );
}

#[test]
fn other_invalid_elements() {
    expect(
        &graph(
            r#"{"id": "x", "size": 4}"#,
            r#"{"id": "a", "outputs": ["x"]}, {"id": "b", "outputs": ["x"]}"#,
        ),
        &["tensor \"x\"", "produced by two ops", "\"a\"", "\"b\""],
    );
    expect(
        &graph(
            r#"{"id": "x", "size": 4}"#,
            r#"{"id": "a", "inputs": ["x"], "outputs": ["x"]}"#,
        ),
        &["op \"a\"", "tensor \"x\"", "both produces and reads"],
    );
    expect(
        &graph(r#"{"id": "x", "size": 4, "align": 0}"#, ""),
        &["tensor \"x\"", "alignment"],
    );
    expect(
        &graph("", r#"{"id": "a", "stream": 5000}"#),
        &["op \"a\"", "stream", "5000"],
    );
    expect(
        &graph(
            r#"{"id": "x", "size": 4, "role": "input"}, {"id": "y", "size": 8}"#,
            r#"{"id": "a", "inputs": ["x"], "outputs": ["y"], "reuse": [{"output": "y", "input": "x"}]}"#,
        ),
        &[
            "op \"a\"",
            "reuse hint \"y\" <- \"x\"",
            "larger than the input",
        ],
    );
    expect(
        &graph(
            r#"{"id": "x", "size": 4, "role": "input"}, {"id": "y", "size": 4}"#,
            r#"{"id": "a", "inputs": ["x"], "reuse": [{"output": "y", "input": "x"}]}"#,
        ),
        &["op \"a\"", "not an output of this op"],
    );
}

#[test]
fn not_json_or_not_text() {
    let (msg, path) = load_err("g.json", b"[1, 2]");
    assert!(
        msg.starts_with(&path.display().to_string()) && msg.contains("unrecognised"),
        "{msg}"
    );
    let (msg, path) = load_err("g.json", b"");
    assert!(msg.starts_with(&path.display().to_string()), "{msg}");
    let (msg, path) = load_err("g.json", &[b'{', 0xff, 0xfe]);
    assert!(
        msg.starts_with(&path.display().to_string()) && msg.contains("UTF-8"),
        "{msg}"
    );
    // A file that claims gzip but is cut short.
    let (msg, path) = load_err("g.json.gz", &[0x1f, 0x8b, 8, 0, 0]);
    assert!(msg.starts_with(&path.display().to_string()), "{msg}");
    // A file that does not exist.
    let path = Path::new("/nonexistent/dir/graph.json");
    let msg = memplan::io::load_graph(path).unwrap_err().to_string();
    assert!(msg.starts_with("/nonexistent/dir/graph.json"), "{msg}");
}

#[test]
fn gzip_graphs_load() {
    use std::io::Write;
    let g = memplan::models::mlp::build(&Default::default()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("mlp.json.gz");
    let mut enc = flate2::write::GzEncoder::new(
        std::fs::File::create(&path).unwrap(),
        flate2::Compression::fast(),
    );
    enc.write_all(memplan::io::json::write_graph(&g).as_bytes())
        .unwrap();
    enc.finish().unwrap();
    let h = memplan::io::load_graph(&path).unwrap();
    assert_eq!(
        memplan::io::json::to_file(&g),
        memplan::io::json::to_file(&h)
    );
}

// ---------------------------------------------------------------------------
// Plan files.

fn plan_err(text: &str) -> String {
    let g = memplan::models::mlp::build(&Default::default()).unwrap();
    let path = Path::new("dir/the-plan.json");
    match Plan::from_json(text, &g, path) {
        Ok(_) => panic!("accepted a bad plan file"),
        Err(e) => {
            let msg = e.to_string();
            assert!(msg.starts_with("dir/the-plan.json"), "{msg}");
            msg
        }
    }
}

#[test]
fn bad_plan_files() {
    let ok = |order: &str, tensors: &str, extra: &str| {
        format!(
            r#"{{"format": "memplan-plan", "version": 1, "arena_bytes": 10, "order": [{order}], "tensors": [{tensors}]{extra}}}"#
        )
    };
    let m = plan_err("{\"format\": \"memplan-plan\",\n\"version\": }");
    assert!(m.starts_with("dir/the-plan.json:2:"), "{m}");
    let m = plan_err(
        r#"{"format": "memplan-graph", "version": 1, "arena_bytes": 1, "order": [], "tensors": []}"#,
    );
    assert!(m.contains("unknown format \"memplan-graph\""), "{m}");
    let m = plan_err(
        r#"{"format": "memplan-plan", "version": 9, "arena_bytes": 1, "order": [], "tensors": []}"#,
    );
    assert!(m.contains("unsupported plan version 9"), "{m}");
    let m = plan_err(&ok(r#""fc0", "warp""#, "", ""));
    assert!(m.contains("order: unknown op \"warp\""), "{m}");
    let m = plan_err(&ok("", r#"{"id": "ghost", "offset": 0}"#, ""));
    assert!(m.contains("offsets: unknown tensor \"ghost\""), "{m}");
    let m = plan_err(&ok(
        "",
        r#"{"id": "input", "offset": 0}, {"id": "input", "offset": 8}"#,
        "",
    ));
    assert!(m.contains("tensor \"input\" appears twice"), "{m}");
    let m = plan_err(&ok(
        "",
        "",
        r#", "reuse": [{"output": "input", "input": "nope"}]"#,
    ));
    assert!(m.contains("reuse: unknown tensor \"nope\""), "{m}");
    let m = plan_err(&ok("", "", r#", "speed": 3"#));
    assert!(m.contains("unknown field `speed`"), "{m}");
}
