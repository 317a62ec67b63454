//! The format documents stay true: their examples parse and check, the JSON
//! Schema is valid, and every graph memplan writes or ships validates
//! against it.

use std::path::{Path, PathBuf};

use memplan::Plan;
use memplan::io::json::parse_graph;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The first ```json block of a markdown file.
fn json_block(doc: &str) -> String {
    let text = std::fs::read_to_string(root().join(doc)).unwrap();
    let start = text.find("```json\n").expect("a ```json block") + "```json\n".len();
    let len = text[start..].find("```").expect("a closed block");
    text[start..start + len].to_string()
}

fn schema() -> serde_json::Value {
    let text = std::fs::read_to_string(root().join("docs/graph-format.schema.json")).unwrap();
    serde_json::from_str(&text).expect("the schema is valid JSON")
}

/// A validator for the subset of JSON Schema 2020-12 the graph schema uses
/// (`type`, `required`, `properties`, `additionalProperties`, `items`,
/// `const`, `enum`, `minimum`, `maximum`, local `$ref`; annotations are
/// ignored). Any other keyword fails the test, so the schema cannot grow a
/// rule this check silently skips. (A full validator crate would pull in a
/// large dependency tree for this one test.)
struct Validator {
    root: serde_json::Value,
}

const ANNOTATIONS: &[&str] = &["$schema", "$id", "$defs", "title", "description", "default"];

impl Validator {
    fn errors(
        &self,
        schema: &serde_json::Value,
        doc: &serde_json::Value,
        at: &str,
        out: &mut Vec<String>,
    ) {
        use serde_json::Value;
        let s = schema.as_object().expect("every schema is an object");
        for (key, rule) in s {
            match key.as_str() {
                "$ref" => {
                    let name = rule
                        .as_str()
                        .unwrap()
                        .strip_prefix("#/$defs/")
                        .expect("local $ref");
                    self.errors(&self.root["$defs"][name], doc, at, out);
                }
                "type" => {
                    let types: Vec<&str> = match rule {
                        Value::String(t) => vec![t.as_str()],
                        Value::Array(ts) => ts.iter().map(|t| t.as_str().unwrap()).collect(),
                        _ => panic!("bad type rule"),
                    };
                    let ok = types.iter().any(|t| match *t {
                        "object" => doc.is_object(),
                        "array" => doc.is_array(),
                        "string" => doc.is_string(),
                        "integer" => doc.is_u64() || doc.is_i64(),
                        "number" => doc.is_number(),
                        "null" => doc.is_null(),
                        "boolean" => doc.is_boolean(),
                        other => panic!("unknown type {other}"),
                    });
                    if !ok {
                        out.push(format!("{at}: not of type {types:?}"));
                    }
                }
                "const" => {
                    if doc != rule {
                        out.push(format!("{at}: must be {rule}"));
                    }
                }
                "enum" => {
                    if !rule.as_array().unwrap().contains(doc) {
                        out.push(format!("{at}: {doc} is not one of {rule}"));
                    }
                }
                "minimum" | "maximum" => {
                    if let Some(x) = doc.as_f64().filter(|_| doc.is_number()) {
                        let lim = rule.as_f64().unwrap();
                        let exact = doc
                            .as_i64()
                            .map(|v| v as i128)
                            .or(doc.as_u64().map(|v| v as i128));
                        let bad = match (key.as_str(), exact, rule.as_u64()) {
                            ("minimum", Some(v), Some(l)) => v < l as i128,
                            ("maximum", Some(v), Some(l)) => v > l as i128,
                            ("minimum", _, _) => x < lim,
                            _ => x > lim,
                        };
                        if bad {
                            out.push(format!("{at}: {doc} breaks {key} {rule}"));
                        }
                    }
                }
                "required" => {
                    if let Some(o) = doc.as_object() {
                        for r in rule.as_array().unwrap() {
                            if !o.contains_key(r.as_str().unwrap()) {
                                out.push(format!("{at}: missing {r}"));
                            }
                        }
                    }
                }
                "properties" => {
                    if let Some(o) = doc.as_object() {
                        for (k, v) in o {
                            if let Some(sub) = rule.get(k) {
                                self.errors(sub, v, &format!("{at}/{k}"), out);
                            }
                        }
                    }
                }
                "additionalProperties" => {
                    if let Some(o) = doc.as_object() {
                        let known = s.get("properties").and_then(|p| p.as_object());
                        for (k, v) in o {
                            if known.is_some_and(|p| p.contains_key(k)) {
                                continue;
                            }
                            match rule {
                                Value::Bool(false) => {
                                    out.push(format!("{at}: unknown field {k:?}"))
                                }
                                Value::Bool(true) => {}
                                sub => self.errors(sub, v, &format!("{at}/{k}"), out),
                            }
                        }
                    }
                }
                "items" => {
                    if let Some(a) = doc.as_array() {
                        for (i, v) in a.iter().enumerate() {
                            self.errors(rule, v, &format!("{at}/{i}"), out);
                        }
                    }
                }
                k if ANNOTATIONS.contains(&k) => {}
                other => {
                    panic!("the schema uses keyword {other:?}, which this test does not check")
                }
            }
        }
    }

    fn check(&self, doc: &serde_json::Value) -> Vec<String> {
        let mut out = Vec::new();
        self.errors(&self.root, doc, "", &mut out);
        out
    }
}

fn validator() -> Validator {
    let root = schema();
    assert_eq!(
        root["$schema"],
        "https://json-schema.org/draft/2020-12/schema"
    );
    Validator { root }
}

fn assert_valid(v: &Validator, doc: &serde_json::Value, what: &str) {
    let errors = v.check(doc);
    assert!(
        errors.is_empty(),
        "{what} does not match the schema: {errors:#?}"
    );
}

/// The schema names exactly the fields memplan's reader accepts.
#[test]
fn schema_fields_match_the_reader() {
    let s = schema();
    let keys = |v: &serde_json::Value| -> Vec<String> {
        let mut k: Vec<String> = v.as_object().unwrap().keys().cloned().collect();
        k.sort();
        k
    };
    let full = |fields: &[&str]| {
        let mut k: Vec<String> = fields.iter().map(|s| s.to_string()).collect();
        k.sort();
        k
    };
    assert_eq!(
        keys(&s["properties"]),
        full(&[
            "format",
            "version",
            "name",
            "tensors",
            "ops",
            "orders",
            "reference_peaks",
            "metadata"
        ])
    );
    assert_eq!(
        keys(&s["$defs"]["tensor"]["properties"]),
        full(&[
            "id", "size", "align", "role", "lifetime", "view_of", "dtype", "shape"
        ])
    );
    assert_eq!(
        keys(&s["$defs"]["op"]["properties"]),
        full(&[
            "id", "kind", "type", "inputs", "outputs", "updates", "reuse", "after", "cost",
            "flops", "stream", "attrs"
        ])
    );
    // Every field the schema lists is one the reader knows: a graph using
    // them all parses.
    let all = r#"{"format": "memplan-graph", "version": 1, "name": "n",
        "tensors": [{"id": "a", "size": 8, "align": 4, "role": "input", "lifetime": "persistent",
                     "dtype": "f32", "shape": [2]},
                    {"id": "v", "size": 8, "view_of": "a", "dtype": null, "shape": null},
                    {"id": "b", "size": 8}],
        "ops": [{"id": "o", "kind": "forward", "type": "t", "inputs": ["a"], "outputs": ["b"],
                 "updates": [], "reuse": [], "after": [], "cost": 1.0, "stream": 1, "attrs": {"k": 1}},
                {"id": "p", "inputs": ["v", "b"], "after": ["o"], "cost": null}],
        "orders": {"x": ["o", "p"]}, "reference_peaks": {"t": 5}, "metadata": {"m": [1]}}"#;
    parse_graph(all, Path::new("all.json")).unwrap();
    assert_valid(
        &validator(),
        &serde_json::from_str(all).unwrap(),
        "the all-fields graph",
    );
    // Enumerations match the reader's.
    for role in [
        "parameter",
        "gradient",
        "optimizer_state",
        "activation",
        "temporary",
        "input",
        "output",
        "communication",
    ] {
        assert!(
            s["$defs"]["tensor"]["properties"]["role"]["enum"]
                .as_array()
                .unwrap()
                .contains(&role.into())
        );
        let text = format!(
            r#"{{"format": "memplan-graph", "version": 1, "tensors": [{{"id": "a", "size": 1, "role": "{role}"}}], "ops": []}}"#
        );
        parse_graph(&text, Path::new("r.json")).unwrap();
    }
    for kind in ["forward", "backward", "optimizer", "collective", "other"] {
        assert!(
            s["$defs"]["op"]["properties"]["kind"]["enum"]
                .as_array()
                .unwrap()
                .contains(&kind.into())
        );
        let text = format!(
            r#"{{"format": "memplan-graph", "version": 1, "tensors": [], "ops": [{{"id": "o", "kind": "{kind}"}}]}}"#
        );
        parse_graph(&text, Path::new("k.json")).unwrap();
    }
}

#[test]
fn graph_doc_example_parses_plans_and_checks() {
    let text = json_block("docs/graph-format.md");
    let g = parse_graph(&text, Path::new("docs/graph-format.md")).unwrap();
    assert_eq!(g.name, "linear-sgd");
    assert_eq!((g.num_ops(), g.num_tensors()), (7, 8));
    assert_eq!(g.extra_orders.len(), 1);
    assert_eq!(
        g.reference_peaks,
        vec![("torch-reserved".to_string(), 2097152)]
    );
    assert_eq!(g.metadata["source"], "hand-written example");
    // The claims the doc makes about it.
    let sgd = g.op_by_name("sgd").unwrap();
    for reader in ["fc", "fc_dx"] {
        assert!(
            g.deps(sgd).contains(&g.op_by_name(reader).unwrap()),
            "sgd after {reader}"
        );
    }
    let yt = g.tensor_by_name("yt").unwrap();
    assert!(!g.occupies_memory(yt));
    let plan = memplan::plan(&g, &Default::default()).unwrap();
    memplan::checker::check(&g, &plan).unwrap();
    assert_valid(
        &validator(),
        &serde_json::from_str(&text).unwrap(),
        "the doc example",
    );
}

#[test]
fn plan_doc_example_is_a_valid_plan() {
    let g = parse_graph(&json_block("docs/graph-format.md"), Path::new("g.json")).unwrap();
    let text = json_block("docs/plan-format.md");
    let plan = Plan::from_json(&text, &g, Path::new("docs/plan-format.md")).unwrap();
    let report = memplan::checker::check(&g, &plan).unwrap();
    assert_eq!(report.max_live_bytes, plan.stats.max_live_bytes);
    #[allow(deprecated)] // the arena's old copy in plan files, for one release
    let copy = plan.stats.peak_bytes;
    assert_eq!(plan.arena_bytes, copy);
    assert!(plan.stats.lower_bound_bytes <= report.max_live_bytes);
}

/// The doc says its example is "the plan `memplan plan` writes" for the
/// graph doc's example: it is, field for field, but for the two timings.
#[test]
fn plan_doc_example_is_what_memplan_plan_writes() {
    let g = parse_graph(&json_block("docs/graph-format.md"), Path::new("g.json")).unwrap();
    let fresh = memplan::plan(&g, &Default::default()).unwrap();
    let mut written: serde_json::Value = serde_json::from_str(&fresh.to_json(&g)).unwrap();
    let mut doc: serde_json::Value =
        serde_json::from_str(&json_block("docs/plan-format.md")).unwrap();
    for v in [&mut written, &mut doc] {
        let stats = v["stats"].as_object_mut().expect("stats");
        for timing in ["bound_seconds", "solve_seconds"] {
            assert!(stats.remove(timing).is_some(), "{timing}");
        }
    }
    assert_eq!(
        doc,
        written,
        "docs/plan-format.md's example is not what memplan writes; it writes:\n{}",
        fresh.to_json(&g)
    );
}

#[test]
fn schema_rejects_what_memplan_rejects() {
    let v = validator();
    let bad = [
        r#"{"format": "memplan-graph", "version": 1, "tensors": [], "ops": [], "extra": 1}"#,
        r#"{"format": "memplan-graph", "version": 2, "tensors": [], "ops": []}"#,
        r#"{"format": "onnx", "version": 1, "tensors": [], "ops": []}"#,
        r#"{"format": "memplan-graph", "version": 1, "tensors": [{"id": "a"}], "ops": []}"#,
        r#"{"format": "memplan-graph", "version": 1, "tensors": [{"id": "a", "size": -1}], "ops": []}"#,
        r#"{"format": "memplan-graph", "version": 1, "tensors": [{"id": "a", "size": 1, "align": 0}], "ops": []}"#,
        r#"{"format": "memplan-graph", "version": 1, "tensors": [{"id": "a", "size": 1, "role": "weights"}], "ops": []}"#,
        r#"{"format": "memplan-graph", "version": 1, "tensors": [], "ops": [{"id": "o", "stream": 1024}]}"#,
        r#"{"format": "memplan-graph", "version": 1, "tensors": [], "ops": [{"id": "o", "reuse": [{"output": "a"}]}]}"#,
    ];
    for text in bad {
        let doc: serde_json::Value = serde_json::from_str(text).unwrap();
        assert!(!v.check(&doc).is_empty(), "schema accepted {text}");
        assert!(
            parse_graph(text, Path::new("x.json")).is_err(),
            "memplan accepted {text}"
        );
    }
}

#[test]
fn every_written_and_shipped_graph_validates() {
    let v = validator();
    let opts = memplan::models::ExampleOptions::default();
    for name in ["gpt2-tiny", "mlp"] {
        let g = memplan::models::example(name, &opts).unwrap();
        let doc = serde_json::to_value(memplan::io::json::to_file(&g)).unwrap();
        assert_valid(&v, &doc, name);
    }
    let g = memplan::testing::synthetic_training_step(3, 1);
    assert_valid(
        &v,
        &serde_json::to_value(memplan::io::json::to_file(&g)).unwrap(),
        "synthetic",
    );
    // Every graph file shipped under fixtures/.
    let mut files = Vec::new();
    let mut stack = vec![root().join("fixtures")];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for e in entries.flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.to_string_lossy().ends_with(".json")
                || p.to_string_lossy().ends_with(".json.gz")
            {
                files.push(p);
            }
        }
    }
    let mut graphs = 0;
    for p in files {
        let text = memplan::io::read_text(&p).unwrap();
        let doc: serde_json::Value = serde_json::from_str(&text).unwrap();
        if doc.get("format").and_then(|f| f.as_str()) == Some("memplan-graph") {
            assert_valid(&v, &doc, &p.display().to_string());
            memplan::io::load_graph(&p).unwrap();
            graphs += 1;
        }
    }
    assert!(graphs >= 1, "no graph fixtures found under fixtures/");
}

/// Every op type the built-in graphs emit (every example, with its options
/// and sharded) has a row in docs/ops.md.
#[test]
fn every_built_in_op_type_is_documented() {
    use memplan::models::{EXAMPLES, ExampleOptions, example, fsdp};
    let doc = std::fs::read_to_string(root().join("docs/ops.md")).unwrap();
    let mut seen = std::collections::BTreeSet::new();
    for name in EXAMPLES {
        for (checkpoint, mixed, fused) in [(false, false, false), (true, true, true)] {
            let opts = ExampleOptions {
                layers: Some(1),
                seq: Some(16),
                checkpoint,
                mixed_precision: mixed && *name != "mlp",
                fused_attention: fused,
                clip_grad_norm: Some(1.0),
                ..ExampleOptions::default()
            };
            let g = example(name, &opts).unwrap();
            let s = fsdp::shard(&g, 2).unwrap();
            for op in g.ops().iter().chain(s.ops()) {
                seen.insert(op.op_type.clone());
            }
        }
    }
    let missing: Vec<&String> = seen
        .iter()
        .filter(|t| !doc.contains(&format!("`{t}`")))
        .collect();
    assert!(missing.is_empty(), "not in docs/ops.md: {missing:?}");
    assert!(seen.contains("rope") && seen.contains("cast"), "{seen:?}");
    // The vocabulary: every op type the executors run is documented, and
    // the built-in steps use no other.
    let undocumented: Vec<&&str> = memplan::vocab::OP_TYPES
        .iter()
        .filter(|t| !doc.contains(&format!("`{t}`")))
        .collect();
    assert!(
        undocumented.is_empty(),
        "not in docs/ops.md: {undocumented:?}"
    );
    let outside: Vec<&String> = seen
        .iter()
        .filter(|t| !memplan::vocab::OP_TYPES.contains(&t.as_str()))
        .collect();
    assert!(outside.is_empty(), "not in memplan::vocab: {outside:?}");
}
