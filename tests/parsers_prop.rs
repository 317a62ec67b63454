//! Property tests of the graph readers (HLO text, memplan JSON and
//! networkx node-link JSON):
//! whatever the input — garbage, truncated files, unknown opcodes, huge
//! shapes, cycles, deep nesting — the result is a graph or a clear error
//! naming where the problem is, never a panic, and memory stays bounded.

use std::path::Path;

use memplan::io::hlo::{ImportOptions, import_str};
use memplan::io::{json, nx};
use memplan::{Error, checker};
use proptest::prelude::*;

/// A small valid module: a scheduled step with a fusion, a tuple, a
/// donated parameter and a root tuple.
const SMALL: &str = r#"HloModule jit_step, is_scheduled=true, input_output_alias={ {0}: (0, {}, may-alias) }

%fused_computation (param_0: f32[4,4], param_1: f32[4,4]) -> f32[4,4] {
  %param_0 = f32[4,4]{1,0} parameter(0)
  %param_1 = f32[4,4]{1,0} parameter(1)
  ROOT %add.1 = f32[4,4]{1,0} add(%param_0, %param_1), metadata={op_name="jit(step)/add"}
}

ENTRY %main.1 (w: f32[4,4], x: f32[4,4]) -> (f32[4,4], f32[]) {
  %w = f32[4,4]{1,0} parameter(0), metadata={op_name="w"}
  %x = f32[4,4]{1,0} parameter(1)
  %dot.1 = f32[4,4]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %fusion.1 = f32[4,4]{1,0} fusion(%w, %dot.1), kind=kLoop, calls=%fused_computation, backend_config={"outer_dimension_partitions":["2"],"s":"{}"}
  %bitcast.1 = f32[16]{0} bitcast(%fusion.1)
  %constant.1 = f32[] constant(0)
  %reduce.1 = f32[] reduce(%dot.1, %constant.1), dimensions={0,1}, to_apply=%fused_computation
  ROOT %tuple.1 = (f32[4,4]{1,0}, f32[]) tuple(%fusion.1, %reduce.1)
}
"#;

fn import(text: &str) -> Result<memplan::Graph, Error> {
    import_str(text, &ImportOptions::default())
}

/// An error that says where: HLO errors carry a line and column.
fn assert_located(e: &Error) {
    let msg = e.to_string();
    assert!(!msg.is_empty());
    if let Error::Parse { line, .. } = e {
        assert!(*line >= 1, "parse error without a line: {msg}");
    }
}

#[test]
fn the_small_module_imports_plans_and_checks() {
    let g = import(SMALL).unwrap();
    assert_eq!(g.num_ops(), 3, "dot, fusion, reduce");
    let plan = memplan::plan(&g, &Default::default()).unwrap();
    checker::check(&g, &plan).unwrap();
}

fn text_strategy() -> impl Strategy<Value = String> {
    // Garbage made of HLO-ish pieces, so the parser gets past the first
    // token often.
    let piece = prop_oneof![
        Just("HloModule m\n".to_string()),
        Just("ENTRY %e {\n".to_string()),
        Just("%c (p: f32[2]) -> f32[2] {\n".to_string()),
        Just("}\n".to_string()),
        Just("  %a = f32[2]{0} parameter(0)\n".to_string()),
        Just("  ROOT %b = f32[2]{0} add(%a, %a)\n".to_string()),
        Just("(f32[], (s32[2], pred[]))".to_string()),
        Just("/*index=5*/".to_string()),
        Just("{ {0}: (0, {}, may-alias) }".to_string()),
        Just("backend_config={\"a\":{\"b\":\"}\"}}".to_string()),
        Just(", calls=%c".to_string()),
        "[ -~\\n]{0,12}",
    ];
    prop::collection::vec(piece, 0..24).prop_map(|v| v.concat())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn hlo_garbage_never_panics(text in text_strategy()) {
        match import(&text) {
            Ok(g) => {
                let plan = memplan::plan(&g, &Default::default()).unwrap();
                checker::check(&g, &plan).unwrap();
            }
            Err(e) => assert_located(&e),
        }
        // The same with XLA's allocations counted (aliased parameters held,
        // their outputs written into them).
        let opts = ImportOptions { xla_allocations: true, ..Default::default() };
        if let Ok(g) = import_str(&text, &opts) {
            let plan = memplan::plan(&g, &Default::default()).unwrap();
            checker::check(&g, &plan).unwrap();
        }
    }

    #[test]
    fn hlo_random_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        let text = String::from_utf8_lossy(&bytes);
        if let Err(e) = import(&text) {
            assert_located(&e);
        }
        let with_header = format!("HloModule m\n{text}");
        if let Err(e) = import(&with_header) {
            assert_located(&e);
        }
    }

    #[test]
    fn hlo_truncated_files_give_errors(cut in 0usize..SMALL.len()) {
        let mut cut = cut;
        while !SMALL.is_char_boundary(cut) {
            cut -= 1;
        }
        // A prefix that ends inside the entry computation lacks its closing
        // brace, so it cannot be a valid module.
        let entry = SMALL.find("ENTRY").unwrap();
        let end = SMALL.rfind('}').unwrap();
        match import(&SMALL[..cut]) {
            Ok(_) => prop_assert!(cut <= entry || cut > end, "a truncated entry imported"),
            Err(e) => assert_located(&e),
        }
    }

    #[test]
    fn hlo_unknown_opcodes_are_named(op in "[a-z][a-z-]{2,12}") {
        prop_assume!(!memplan::io::hlo::import::is_known_opcode(&op));
        let text = SMALL.replace("dot(%x, %w)", &format!("{op}(%x, %w)"));
        let e = import(&text).unwrap_err();
        let msg = e.to_string();
        prop_assert!(msg.contains(&format!("unknown opcode '{op}'")), "{msg}");
        prop_assert!(msg.contains("dot.1"), "{msg}");
    }

    #[test]
    fn hlo_huge_shapes_are_errors_not_overflows(a in 1u64.., b in 1u64..) {
        let text = format!(
            "HloModule m\nENTRY %e {{\n  ROOT %p = f32[{a},{b}]{{1,0}} parameter(0)\n}}\n"
        );
        let fits = a.checked_mul(b).and_then(|n| n.checked_mul(4)).is_some();
        match import(&text) {
            Ok(g) => prop_assert!(fits && g.total_bytes() == a * b * 4),
            Err(e) => {
                prop_assert!(!fits || e.to_string().contains("overflow"), "{e}");
                assert_located(&e);
            }
        }
    }

    #[test]
    fn json_garbage_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        let text = String::from_utf8_lossy(&bytes);
        let _ = json::parse_graph(&text, Path::new("x.json"));
        let framed = format!("{{\"format\":\"memplan-graph\",\"version\":1,{text}");
        if let Err(e) = json::parse_graph(&framed, Path::new("x.json")) {
            prop_assert!(e.to_string().starts_with("x.json"), "{e}");
        }
    }

    #[test]
    fn json_truncated_graphs_give_errors(cut in 0usize..400) {
        let g = memplan::models::example("mlp", &Default::default()).unwrap();
        let text = json::write_graph(&g);
        let cut = cut.min(text.len().saturating_sub(1));
        let e = json::parse_graph(&text[..cut], Path::new("g.json")).unwrap_err();
        prop_assert!(e.to_string().starts_with("g.json"), "{e}");
    }
}

/// A node-link document: `n` nodes with sizes and costs (some bad when
/// `bad` picks them), and links drawn from `links` (forward ones make a
/// DAG; backward ones may close cycles; ids ≥ n dangle).
fn node_link(n: usize, sizes: &[i64], links: &[(usize, usize)], bad: Option<usize>) -> String {
    let nodes: Vec<String> = (0..n)
        .map(|i| {
            let ram = if bad == Some(i) {
                "\"big\"".to_string()
            } else {
                sizes[i % sizes.len()].to_string()
            };
            format!(r#"{{"id": {i}, "name": "v{i}", "cost_ram": {ram}, "cost_cpu": {}, "backward": {}}}"#, i + 1, i >= n / 2)
        })
        .collect();
    let links: Vec<String> = links
        .iter()
        .map(|(s, t)| format!(r#"{{"source": {s}, "target": {t}}}"#))
        .collect();
    format!(
        r#"{{"directed": true, "multigraph": false, "graph": {{"name": "p"}}, "nodes": [{}], "links": [{}]}}"#,
        nodes.join(","),
        links.join(",")
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn node_link_dags_import_plan_and_check(
        n in 1usize..24,
        sizes in prop::collection::vec(0i64..5000, 1..8),
        raw in prop::collection::vec((0usize..24, 0usize..24), 0..48),
    ) {
        // Forward links only (lower id to higher id): a DAG.
        let links: Vec<(usize, usize)> = raw
            .iter()
            .map(|&(a, b)| (a % n, b % n))
            .filter(|(a, b)| a < b)
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .collect();
        let text = node_link(n, &sizes, &links, None);
        let g = nx::parse_graph(&text, Path::new("g.json")).unwrap();
        prop_assert_eq!(g.num_ops(), n);
        let reads: usize = g.ops().iter().map(|o| o.inputs.len()).sum();
        prop_assert_eq!(reads, links.len());
        let opts = memplan::Options {
            time_limit: std::time::Duration::from_millis(50),
            ..Default::default()
        };
        let plan = memplan::plan(&g, &opts).unwrap();
        checker::check(&g, &plan).unwrap();
    }

    #[test]
    fn node_link_bad_documents_give_located_errors(
        n in 1usize..12,
        raw in prop::collection::vec((0usize..16, 0usize..16), 1..24),
        bad in prop::option::of(0usize..12),
        cut in prop::option::of(0usize..400),
    ) {
        // Any links: cycles, self-links and dangling ids included.
        let mut text = node_link(n, &[8], &raw, bad);
        if let Some(c) = cut {
            text.truncate(c.min(text.len()));
        }
        if let Err(e) = nx::parse_graph(&text, Path::new("g.json")) {
            prop_assert!(e.to_string().starts_with("g.json"), "{e}");
        }
    }

    #[test]
    fn node_link_garbage_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        let text = String::from_utf8_lossy(&bytes);
        let framed = format!("{{\"nodes\": [{text}], \"links\": []}}");
        let _ = nx::parse_graph(&framed, Path::new("g.json"));
        let _ = nx::parse_graph(&text, Path::new("g.json"));
    }
}

#[test]
fn hlo_deep_tuple_nesting_is_an_error_not_a_stack_overflow() {
    let depth = 100_000;
    let shape = format!("{}f32[]{}", "(".repeat(depth), ")".repeat(depth));
    let text = format!("HloModule m\nENTRY %e {{\n  ROOT %p = {shape} parameter(0)\n}}\n");
    let e = import(&text).unwrap_err();
    assert!(e.to_string().contains("nested deeper"), "{e}");
}

#[test]
fn hlo_deep_attribute_nesting_is_skipped_without_recursion() {
    let depth = 1_000_000;
    let attr = format!("{}{}", "{".repeat(depth), "}".repeat(depth));
    let text = format!(
        "HloModule m\nENTRY %e {{\n  %p = f32[2]{{0}} parameter(0)\n  ROOT %n = f32[2]{{0}} negate(%p), frontend_attributes={attr}\n}}\n"
    );
    let g = import(&text).unwrap();
    assert_eq!(g.num_ops(), 1);
    // Unbalanced: an error, still no recursion.
    let bad = text.replacen('}', "", 1);
    assert_located(&import(&bad).unwrap_err());
}

#[test]
fn hlo_cycles_are_errors() {
    // An operand used before it is defined (the only way to write a cycle).
    let text = "HloModule m\nENTRY %e {\n  %a = f32[2]{0} negate(%b)\n  ROOT %b = f32[2]{0} negate(%a)\n}\n";
    let e = import(text).unwrap_err();
    assert!(e.to_string().contains("not defined before it"), "{e}");
    // A computation that calls itself.
    let text = "HloModule m\n%f (p: f32[2]) -> f32[2] {\n  %p = f32[2]{0} parameter(0)\n  ROOT %c = f32[2]{0} call(%p), to_apply=%f\n}\nENTRY %e {\n  %x = f32[2]{0} parameter(0)\n  ROOT %y = f32[2]{0} call(%x), to_apply=%f\n}\n";
    let e = import(text).unwrap_err();
    assert!(e.to_string().contains("calls itself"), "{e}");
}

#[test]
fn hlo_deep_call_chains_are_errors() {
    let n = 500;
    let mut text = String::from("HloModule m\n");
    text.push_str("%c0 (p: f32[2]) -> f32[2] {\n  %p0 = f32[2]{0} parameter(0)\n  ROOT %r0 = f32[2]{0} negate(%p0)\n}\n");
    for i in 1..n {
        text.push_str(&format!(
            "%c{i} (p: f32[2]) -> f32[2] {{\n  %p{i} = f32[2]{{0}} parameter(0)\n  ROOT %r{i} = f32[2]{{0}} call(%p{i}), to_apply=%c{}\n}}\n",
            i - 1
        ));
    }
    text.push_str(&format!(
        "ENTRY %e {{\n  %x = f32[2]{{0}} parameter(0)\n  ROOT %y = f32[2]{{0}} call(%x), to_apply=%c{}\n}}\n",
        n - 1
    ));
    let e = import(&text).unwrap_err();
    assert!(e.to_string().contains("nest deeper"), "{e}");
}

#[test]
fn json_deep_nesting_and_cycles_are_errors() {
    let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
    assert!(json::parse_graph(&deep, Path::new("d.json")).is_err());
    let cyc = r#"{"format":"memplan-graph","version":1,"tensors":[{"id":"x","size":8},{"id":"y","size":8}],
      "ops":[{"id":"a","inputs":["y"],"outputs":["x"]},{"id":"b","inputs":["x"],"outputs":["y"]}]}"#;
    let e = json::parse_graph(cyc, Path::new("c.json")).unwrap_err();
    assert!(e.to_string().contains("cycle"), "{e}");
    let huge = r#"{"format":"memplan-graph","version":1,"tensors":[{"id":"x","size":18446744073709551615},{"id":"y","size":8}],"ops":[]}"#;
    let e = json::parse_graph(huge, Path::new("h.json")).unwrap_err();
    assert!(e.to_string().contains("overflows"), "{e}");
}
