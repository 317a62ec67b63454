//! The HLO importer's rules, one small hand-written module each: what
//! becomes an op, a tensor or a view, which tensors are persistent, which
//! reuse hints XLA's sharing rules give, and how control flow is counted.

use memplan::graph::{Graph, Lifetime, OpKind, Role};
use memplan::io::hlo::{ImportOptions, import_str};
use memplan::lower::{self, Lowered};
use memplan::{checker, io};
use memplan_solver as solver;

fn import(text: &str) -> Graph {
    import_with(text, false)
}

fn import_with(text: &str, xla_allocations: bool) -> Graph {
    let opts = ImportOptions {
        align: 1,
        xla_allocations,
    };
    let g = import_str(text, &opts).unwrap_or_else(|e| panic!("{e}"));
    let plan = memplan::plan(&g, &Default::default()).unwrap();
    checker::check(&g, &plan).unwrap();
    g
}

fn t<'g>(g: &'g Graph, name: &str) -> &'g memplan::graph::Tensor {
    g.tensor(
        g.tensor_by_name(name)
            .unwrap_or_else(|| panic!("no tensor {name}")),
    )
}

fn hints(g: &Graph, op: &str) -> Vec<(String, String)> {
    let o = g.op(g.op_by_name(op).unwrap_or_else(|| panic!("no op {op}")));
    o.reuse
        .iter()
        .map(|&(a, b)| (g.tensor(a).name.clone(), g.tensor(b).name.clone()))
        .collect()
}

/// Max live bytes of program order with reuse.
fn live(g: &Graph) -> u64 {
    let low = lower::lower(g, true);
    solver::evaluate(&low.problem, &Lowered::from_op_ids(g.program_order())).peak
}

#[test]
fn parameters_constants_tuples_and_views() {
    let g = import(
        r#"HloModule m, is_scheduled=true, input_output_alias={ {0}: (0, {}, may-alias) }, entry_computation_layout={(f32[8]{0}, (f32[2]{0}, s8[3]{0}))->(f32[8]{0}, f32[2,4]{1,0})}

ENTRY %e (p0: f32[8], p1: (f32[2], s8[3])) -> (f32[8], f32[2,4]) {
  %p0 = f32[8]{0} parameter(0)
  %p1 = (f32[2]{0}, s8[3]{0}) parameter(1)
  %c = f32[] constant(1.5)
  %g = f32[2]{0} get-tuple-element(%p1), index=0
  %n = f32[8]{0} negate(%p0)
  %b = f32[2,4]{1,0} bitcast(%n)
  %t = (f32[2]{0}, f32[8]{0}) tuple(%g, %n)
  %g2 = f32[8]{0} get-tuple-element(%t), index=1
  %m = f32[8]{0} multiply(%g2, %g2)
  ROOT %r = (f32[8]{0}, f32[2,4]{1,0}) tuple(%m, /*index=1*/%b)
}
"#,
    );
    // Ops: negate and multiply only.
    let names: Vec<&str> = g.ops().iter().map(|o| o.name.as_str()).collect();
    assert_eq!(names, ["n", "m"]);
    // The donated parameter may die; the other is persistent.
    assert_eq!(t(&g, "p0").lifetime, Lifetime::Transient);
    assert_eq!(t(&g, "p0").role, Role::Parameter);
    assert_eq!(t(&g, "p1{0}").lifetime, Lifetime::Persistent);
    assert_eq!(t(&g, "p1{1}").size, 3);
    assert_eq!(t(&g, "c").lifetime, Lifetime::Persistent);
    // bitcast is a view of n; n and m are returned, so persistent.
    let b = g.tensor_by_name("b").unwrap();
    assert_eq!(g.root(b), g.tensor_by_name("n").unwrap());
    assert_eq!(t(&g, "n").lifetime, Lifetime::Persistent);
    assert_eq!(t(&g, "m").role, Role::Output);
    // The multiply reads n through the tuple.
    let m = g.op(g.op_by_name("m").unwrap());
    assert_eq!(m.inputs, vec![g.tensor_by_name("n").unwrap()]);
    assert_eq!(g.extra_orders[0].0, "xla-order");
    // p1 (8 + 3) and c (4) for the whole step; n takes the donated p0's
    // bytes; n and m are both live at the multiply.
    assert_eq!(live(&g), 8 + 3 + 4 + 32 + 32);
}

/// A donated weight read by a copy (as XLA copies a kernel into another
/// layout), a temporary made after the copy, and the weight's update
/// written back into it.
const DONATED: &str = r#"HloModule m, input_output_alias={ {0}: (0, {}, may-alias) }
ENTRY %e {
  %w = f32[64]{0} parameter(0)
  %g = f32[64]{0} parameter(1)
  %wc = f32[64]{0} copy(%w)
  %t = f32[64]{0} multiply(%g, %g)
  %u = f32[64]{0} add(%wc, %t)
  ROOT %r = (f32[64]{0}) tuple(%u)
}
"#;

#[test]
fn xla_allocations_keep_an_aliased_parameter_and_write_its_output_into_it() {
    let one_arena = import_with(DONATED, false);
    let xla = import_with(DONATED, true);
    // One arena: the donated w dies at its copy, its bytes free for big.
    assert_eq!(t(&one_arena, "w").lifetime, Lifetime::Transient);
    // XLA's allocations: w's allocation is held all step, u is written
    // into it (no bytes of its own), after every reader of w.
    assert_eq!(t(&xla, "w").lifetime, Lifetime::Persistent);
    assert_eq!(t(&xla, "u").size, 0);
    let u = xla.op(xla.op_by_name("u").unwrap());
    assert_eq!(u.after, vec![xla.op_by_name("wc").unwrap()]);
    // g (256 bytes) for the whole step. One arena: w, then wc and t, the
    // sum written into one of them; XLA: w's 256 bytes all along as well.
    assert_eq!(live(&one_arena), 3 * 256);
    assert_eq!(live(&xla), 4 * 256);
    // Plans of both pass the checker (import() checks the first).
    let plan = memplan::plan(&xla, &Default::default()).unwrap();
    checker::check(&xla, &plan).unwrap();
    assert_eq!(plan.stats.max_live_bytes, 4 * 256);
}

#[test]
fn xla_estimate_puts_a_temporary_into_a_dead_parameters_allocation() {
    // w is dead after its copy and u is written into its allocation; t
    // lives in between (64 bytes, fits), b overlaps u's step.
    let g = import_with(
        r#"HloModule m, input_output_alias={ {0}: (0, {}, may-alias) }
ENTRY %e {
  %w = f32[64]{0} parameter(0)
  %g = f32[64]{0} parameter(1)
  %wc = f32[64]{0} copy(%w)
  %t = f32[16]{0} slice(%g), slice={[0:16]}
  %b = f32[4,16]{1,0} broadcast(%t), dimensions={1}
  %bb = f32[64]{0} bitcast(%b)
  %u = f32[64]{0} add(%wc, %bb)
  ROOT %r = (f32[64]{0}) tuple(%u)
}
"#,
        true,
    );
    let order = g.program_order();
    let e = memplan::baselines::xla_estimate::estimate(&g, order).unwrap();
    // Held all step: g and w (512); then wc, t and b at b's step.
    assert_eq!(e.ceiling, 512 + 256 + 64 + 256);
    assert_eq!((e.hosted, e.hosted_bytes), (1, 64));
    assert_eq!(e.total, 512 + 256 + 256);
    // Without the import's list of aliased parameters there is no estimate.
    let one_arena = import_with(DONATED, false);
    let order = one_arena.program_order();
    assert!(memplan::baselines::xla_estimate::estimate(&one_arena, order).is_none());
}

#[test]
fn elementwise_ops_may_write_into_operands_of_the_same_shape() {
    let g = import(
        r#"HloModule m
ENTRY %e {
  %x = f32[4,4]{1,0} parameter(0)
  %y = f32[4,4]{0,1} parameter(1)
  %a = f32[4,4]{1,0} exponential(%x)
  %s = f32[4,4]{1,0} add(%a, %y)
  %c = f16[4,4]{1,0} convert(%s)
  %i = s32[] constant(0)
  %d = f32[4,4]{1,0} dynamic-update-slice(%s, %a, %i, %i)
  ROOT %o = (f16[4,4]{1,0}, f32[4,4]{1,0}) tuple(%c, %d)
}
"#,
    );
    // exponential: same shape as x.
    assert_eq!(hints(&g, "a"), [("a".to_string(), "x".to_string())]);
    // add: only a, since y has another layout.
    assert_eq!(hints(&g, "s"), [("s".to_string(), "a".to_string())]);
    // convert changes the element type: no hint.
    assert!(hints(&g, "c").is_empty());
    // dynamic-update-slice writes into operand 0.
    assert_eq!(hints(&g, "d"), [("d".to_string(), "s".to_string())]);
}

const FUSIONS: &str = r#"HloModule m, input_output_alias={ {0}: (0, {}, may-alias), {1}: (1, {}, may-alias) }

%elementwise (param_0: f32[8], param_1: f32[8]) -> f32[8] {
  %param_0 = f32[8]{0} parameter(0)
  %param_1 = f32[8]{0} parameter(1)
  %m = f32[8]{0} multiply(%param_0, %param_0)
  ROOT %a = f32[8]{0} add(%m, %param_1)
}

%broadcasting (param_0.1: f32[8], param_1.1: f32[]) -> f32[8] {
  %param_0.1 = f32[8]{0} parameter(0)
  %param_1.1 = f32[] parameter(1)
  %b = f32[8]{0} broadcast(%param_1.1), dimensions={}
  %r = f32[8]{0} reverse(%param_0.1), dimensions={0}
  ROOT %a.1 = f32[8]{0} add(%r, %b)
}

%dus (param_0.2: f32[4,8], param_1.2: f32[8], param_2: s32[]) -> f32[4,8] {
  %param_0.2 = f32[4,8]{1,0} parameter(0)
  %param_1.2 = f32[8]{0} parameter(1)
  %param_2 = s32[] parameter(2)
  %bc = f32[1,8]{1,0} bitcast(%param_1.2)
  %z = s32[] constant(0)
  ROOT %u = f32[4,8]{1,0} dynamic-update-slice(%param_0.2, %bc, %param_2, %z)
}

ENTRY %e {
  %w = f32[8]{0} parameter(0)
  %stack = f32[4,8]{1,0} parameter(1)
  %g = f32[8]{0} parameter(2)
  %k = f32[] parameter(3)
  %i = s32[] parameter(4)
  %f1 = f32[8]{0} fusion(%w, %g), kind=kLoop, calls=%elementwise
  %f2 = f32[8]{0} fusion(%f1, %k), kind=kLoop, calls=%broadcasting
  %f3 = f32[8]{0} fusion(%f2, %g), kind=kCustom, calls=%elementwise, backend_config={"fusion_config":{"kind":"__custom"},"x":"}{"}
  %f4 = f32[4,8]{1,0} fusion(%stack, %f3, %i), kind=kLoop, calls=%dus
  ROOT %o = (f32[8]{0}, f32[4,8]{1,0}) tuple(%f3, %f4)
}
"#;

#[test]
fn fusions_follow_xlas_sharing_rules() {
    let g = import(FUSIONS);
    // Loop fusion, parameters used elementwise: both operands.
    assert_eq!(
        hints(&g, "f1"),
        [
            ("f1".to_string(), "w".to_string()),
            ("f1".to_string(), "g".to_string())
        ]
    );
    // reverse is not elementwise: no hint for param 0; param 1 is a scalar.
    assert!(hints(&g, "f2").is_empty());
    // Custom fusions do not share (no in-place root).
    assert!(hints(&g, "f3").is_empty());
    // In-place dynamic-update-slice on parameter 0, any fusion kind.
    assert_eq!(hints(&g, "f4"), [("f4".to_string(), "stack".to_string())]);
    // The fusions' bodies make no ops; the update ops are the optimizer.
    assert_eq!(g.num_ops(), 4);
    assert_eq!(g.op(g.op_by_name("f4").unwrap()).kind, OpKind::Optimizer);
    // Donated w dies at f1, which takes its bytes; the peak is at f2 and
    // f3: stack + g + k + i + two 32-byte results.
    assert_eq!(live(&g), 128 + 32 + 4 + 4 + 32 + 32);
}

#[test]
fn custom_call_aliasing_becomes_a_hint() {
    let g = import(
        r#"HloModule m
ENTRY %e {
  %x = f32[16]{0} parameter(0)
  %y = f32[16]{0} negate(%x)
  %cc = (f32[16]{0}, u8[64]{0}) custom-call(%y), custom_call_target="my_op", output_to_operand_aliasing={{0}: (0, {})}, api_version=API_VERSION_STATUS_RETURNING
  ROOT %r = f32[16]{0} get-tuple-element(%cc), index=0
}
"#,
    );
    assert_eq!(hints(&g, "cc"), [("cc{0}".to_string(), "y".to_string())]);
    // The scratch buffer is an output nobody reads: live at its op only.
    assert_eq!(t(&g, "cc{1}").size, 64);
    assert_eq!(t(&g, "cc{0}").lifetime, Lifetime::Persistent);
    // x (persistent) + y, then cc{0} takes y's bytes + 64 B scratch.
    assert_eq!(live(&g), 64 + 64 + 64);
}

const WHILE: &str = r#"HloModule m, is_scheduled=true

%body (state: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %state = (s32[], f32[4,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%state), index=0
  %acc = f32[4,8]{1,0} get-tuple-element(%state), index=1
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  %tmp = f32[64]{0} iota(), iota_dimension=0
  %row = f32[8]{0} slice(%tmp), slice={[0:8]}
  %bc = f32[1,8]{1,0} bitcast(%row)
  %z = s32[] constant(0)
  %upd = f32[4,8]{1,0} dynamic-update-slice(%acc, %bc, %i, %z)
  ROOT %out = (s32[], f32[4,8]{1,0}) tuple(%next, %upd)
}

%cond (state.1: (s32[], f32[4,8])) -> pred[] {
  %state.1 = (s32[], f32[4,8]{1,0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%state.1), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%i.1, %n), direction=LT
}

ENTRY %e {
  %x = f32[4,8]{1,0} parameter(0)
  %zero = s32[] constant(0)
  %init = f32[4,8]{1,0} negate(%x)
  %t = (s32[], f32[4,8]{1,0}) tuple(%zero, %init)
  %w = (s32[], f32[4,8]{1,0}) while(%t), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
  ROOT %res = f32[4,8]{1,0} get-tuple-element(%w), index=1
}
"#;

#[test]
fn while_is_one_op_holding_its_bodys_own_peak() {
    let g = import(WHILE);
    let names: Vec<&str> = g.ops().iter().map(|o| o.name.as_str()).collect();
    assert_eq!(names, ["init", "w"]);
    // Body: 4 (constant one) + 4 (constant z) + 256 (tmp) + 32 (row) live
    // at the slice; the state (i, acc, next, upd) is the caller's.
    let w = g.op(g.op_by_name("w").unwrap());
    assert_eq!(w.attrs["body_peak_bytes"], 4 + 4 + 256 + 32);
    assert_eq!(t(&g, "w/body-peak").size, 296);
    // Each state element may take its initial value's bytes (the counter's
    // is a persistent constant, so only the array's hint can be taken).
    assert_eq!(
        hints(&g, "w"),
        [
            ("w{0}".to_string(), "zero".to_string()),
            ("w{1}".to_string(), "init".to_string())
        ]
    );
    // x + zero + init/w{1} + w{0} + body peak.
    assert_eq!(live(&g), 128 + 4 + 128 + 4 + 296);
}

#[test]
fn conditional_and_call_hold_the_larger_branch() {
    let g = import(
        r#"HloModule m
%small (a: f32[4]) -> f32[4] {
  %a = f32[4]{0} parameter(0)
  ROOT %na = f32[4]{0} negate(%a)
}
%big (b: f32[4]) -> f32[4] {
  %b = f32[4]{0} parameter(0)
  %wide = f32[100]{0} broadcast(%b), dimensions={}
  %s = f32[4]{0} slice(%wide), slice={[0:4]}
  ROOT %nb = f32[4]{0} negate(%s)
}
ENTRY %e {
  %p = pred[] parameter(0)
  %x = f32[4]{0} parameter(1)
  %c = f32[4]{0} conditional(%p, %x, %x), true_computation=%small, false_computation=%big
  ROOT %k = f32[4]{0} call(%c), to_apply=%big
}
"#,
    );
    // big: wide (400) + s (16) at the slice; small: nothing of its own.
    let c = g.op(g.op_by_name("c").unwrap());
    assert_eq!(c.attrs["body_peak_bytes"], 416);
    let k = g.op(g.op_by_name("k").unwrap());
    assert_eq!(k.attrs["body_peak_bytes"], 416);
}

#[test]
fn async_pairs_and_barriers_keep_their_bytes() {
    let g = import(
        r#"HloModule m
ENTRY %e {
  %x = f32[16]{0} parameter(0)
  %y = f32[16]{0} negate(%x)
  %cs = (f32[16]{0}, f32[16]{0}, u32[]) copy-start(%y)
  %cd = f32[16]{0} copy-done(%cs)
  %t = (f32[16]{0}, f32[16]{0}) tuple(%y, %cd)
  %ob = (f32[16]{0}, f32[16]{0}) opt-barrier((f32[16]{0}, f32[16]{0}) %t)
  ROOT %z = f32[16]{0} get-tuple-element(%ob), index=1
}
"#,
    );
    // copy-start makes the destination; copy-done views it; the barrier
    // views both and orders its readers after it.
    let cd = g.tensor_by_name("cd").unwrap();
    assert_eq!(g.tensor(g.root(cd)).name, "cs{0}");
    let z = g.tensor_by_name("ob{1}").unwrap();
    assert_eq!(g.tensor(g.root(z)).name, "cs{0}");
    assert_eq!(t(&g, "cs{0}").lifetime, Lifetime::Persistent);
    assert_eq!(g.num_ops(), 4);
}

#[test]
fn older_syntax_operand_shapes_and_bare_names() {
    // Operands with shapes, names without %, no layouts, reshape between
    // default layouts as a view.
    let g = import(
        "HloModule old\n\nENTRY main.3 {\n  Arg_0.1 = f32[2,3] parameter(0)\n  reshape.2 = f32[6] reshape(f32[2,3] Arg_0.1)\n  ROOT exponential.3 = f32[6] exponential(f32[6] reshape.2)\n}\n",
    );
    assert_eq!(g.num_ops(), 1);
    let r = g.tensor_by_name("reshape.2").unwrap();
    assert!(g.tensor(r).is_view());
    assert_eq!(g.tensor(r).shape.as_deref(), Some(&[6u64][..]));
}

#[test]
fn errors_name_the_line_and_the_problem() {
    let cases = [
        (
            "HloModule m\nENTRY %e {\n  ROOT %a = f33[2] parameter(0)\n}\n",
            "3:",
            "unknown element type 'f33'",
        ),
        (
            "HloModule m\nENTRY %e {\n  %a = f32[2] parameter(0)\n  ROOT %b = f32[2] frobnicate(%a)\n}\n",
            "4:",
            "unknown opcode 'frobnicate'",
        ),
        (
            "HloModule m\nENTRY %e {\n  %a = f32[2] parameter(0)\n  ROOT %b = f32[2] negate(%q)\n}\n",
            "4:",
            "%q, which is not defined",
        ),
        (
            "HloModule m\nENTRY %e {\n  %a = (f32[2]) parameter(0)\n  ROOT %b = f32[2] get-tuple-element(%a), index=3\n}\n",
            "4:",
            "index=3 is out of range",
        ),
        (
            "HloModule m, input_output_alias={ {0}: (7, {}) }\nENTRY %e {\n  ROOT %a = f32[2] parameter(0)\n}\n",
            "1:",
            "donates parameter 7",
        ),
        (
            "HloModule m\nENTRY %e {\n  %a = f32[2] parameter(0)\n  ROOT %b = f32[2] call(%a), to_apply=%nowhere\n}\n",
            "4:",
            "unknown computation",
        ),
        (
            "HloModule m\nENTRY %e {\n  ROOT %a = f32[?] parameter(0)\n}\n",
            "3:",
            "unbounded dynamic dimension",
        ),
        (
            "HloModule m\nENTRY %e {\n  ROOT %a = f32[2] parameter(0)\n",
            "4:",
            "end of file inside computation",
        ),
        ("not hlo", "1:", "expected 'HloModule'"),
    ];
    for (text, at, what) in cases {
        let e = import_str(text, &ImportOptions::default())
            .unwrap_err()
            .to_string();
        assert!(e.starts_with(at) || e.contains(&format!(":{at}")), "{e}");
        assert!(e.contains(what), "wanted {what:?} in {e}");
    }
}

#[test]
fn load_graph_detects_hlo_by_content_plain_or_gzip() {
    let dir = std::env::temp_dir().join(format!("memplan-hlo-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let plain = dir.join("module.cpu_after_optimizations.txt");
    std::fs::write(&plain, WHILE).unwrap();
    // A report beside it, with XLA's UTF-8 multiplication sign.
    std::fs::write(
        dir.join("module.cpu_after_optimizations-memory-usage-report.txt"),
        "Memory Space: default (color=0)\nTotal bytes: 1234 (1.2KiB)\n  1.2KiB(100%); 2×f32[4,8]\n",
    )
    .unwrap();
    let g = io::load_graph(&plain).unwrap();
    assert_eq!(g.reference_peaks, [("xla".to_string(), 1234)]);
    assert_eq!(g.extra_orders.len(), 1);
    let gz = dir.join("other.txt.gz");
    let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    std::io::Write::write_all(&mut enc, FUSIONS.as_bytes()).unwrap();
    std::fs::write(&gz, enc.finish().unwrap()).unwrap();
    let g2 = io::load_graph(&gz).unwrap();
    assert_eq!(g2.num_ops(), 4);
    assert!(g2.reference_peaks.is_empty());
    // A broken file names itself and the line.
    let bad = dir.join("bad.txt");
    std::fs::write(
        &bad,
        "HloModule m\nENTRY %e {\n  ROOT %a = f32[2] nope(\n}\n",
    )
    .unwrap();
    let e = io::load_graph(&bad).unwrap_err().to_string();
    assert!(e.starts_with(&format!("{}:", bad.display())), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// One module for the remaining in-place rules of docs/hlo.md: `scatter`
/// (alone and fused), variadic `sort` (result i in operand i), a
/// multi-output fusion whose tuple holds an in-place update and an
/// elementwise result, `triangular-solve` (operand 1), and ops XLA never
/// writes in place: `select-and-scatter`, `copy`, `transpose`.
#[test]
fn in_place_rules_one_module_each() {
    let g = import(
        r#"HloModule m

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%ge (x: f32[], y: f32[]) -> pred[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %c = pred[] compare(%x, %y), direction=GE
}

%lt (p0: f32[], p1: f32[], p2: s32[], p3: s32[]) -> pred[] {
  %p0 = f32[] parameter(0)
  %p1 = f32[] parameter(1)
  %p2 = s32[] parameter(2)
  %p3 = s32[] parameter(3)
  ROOT %c.1 = pred[] compare(%p0, %p1), direction=LT
}

%fused_scatter (fp0: f32[16,8], fp1: s32[4,1], fp2: f32[4,8]) -> f32[16,8] {
  %fp0 = f32[16,8]{1,0} parameter(0)
  %fp1 = s32[4,1]{1,0} parameter(1)
  %fp2 = f32[4,8]{1,0} parameter(2)
  ROOT %sc.1 = f32[16,8]{1,0} scatter(%fp0, %fp1, %fp2), update_window_dims={1}, inserted_window_dims={0}, scatter_dims_to_operand_dims={0}, index_vector_dim=1, to_apply=%add
}

%multi (mp0: f32[16,8], mp1: f32[8], mp2: s32[]) -> (f32[16,8], f32[16,8]) {
  %mp0 = f32[16,8]{1,0} parameter(0)
  %mp1 = f32[8]{0} parameter(1)
  %mp2 = s32[] parameter(2)
  %row = f32[1,8]{1,0} bitcast(%mp1)
  %z = s32[] constant(0)
  %u = f32[16,8]{1,0} dynamic-update-slice(%mp0, %row, %mp2, %z)
  %e = f32[16,8]{1,0} exponential(%mp0)
  ROOT %t = (f32[16,8]{1,0}, f32[16,8]{1,0}) tuple(%u, %e)
}

ENTRY %e {
  %x = f32[16,8]{1,0} parameter(0)
  %idx = s32[4,1]{1,0} parameter(1)
  %upd = f32[4,8]{1,0} parameter(2)
  %keys = f32[16]{0} parameter(3)
  %vals = s32[16]{0} parameter(4)
  %a = f32[8,8]{1,0} parameter(5)
  %rhs = f32[8,8]{1,0} parameter(6)
  %row = f32[8]{0} parameter(7)
  %i = s32[] parameter(8)
  %init = f32[] constant(0)
  %x1 = f32[16,8]{1,0} negate(%x)
  %sc = f32[16,8]{1,0} scatter(%x1, %idx, %upd), update_window_dims={1}, inserted_window_dims={0}, scatter_dims_to_operand_dims={0}, index_vector_dim=1, to_apply=%add
  %x2 = f32[16,8]{1,0} negate(%sc)
  %fs = f32[16,8]{1,0} fusion(%x2, %idx, %upd), kind=kInput, calls=%fused_scatter
  %x3 = f32[16,8]{1,0} negate(%fs)
  %mo = (f32[16,8]{1,0}, f32[16,8]{1,0}) fusion(%x3, %row, %i), kind=kLoop, calls=%multi
  %k2 = f32[16]{0} negate(%keys)
  %v2 = s32[16]{0} negate(%vals)
  %so = (f32[16]{0}, s32[16]{0}) sort(%k2, %v2), dimensions={0}, is_stable=true, to_apply=%lt
  %rhs2 = f32[8,8]{1,0} negate(%rhs)
  %ts = f32[8,8]{1,0} triangular-solve(%a, %rhs2), left_side=true, lower=true, transpose_a=NO_TRANSPOSE, unit_diagonal=false
  %src = f32[16,8]{1,0} negate(%x)
  %ss = f32[16,8]{1,0} select-and-scatter(%src, %src, %init), window={size=1x1}, select=%ge, scatter=%add
  %cp = f32[16,8]{1,0} copy(%ss)
  %tr = f32[8,16]{0,1} transpose(%cp), dimensions={1,0}
  ROOT %out = (f32[16,8]{1,0}, f32[16,8]{1,0}, f32[16]{0}, s32[16]{0}, f32[8,8]{1,0}, f32[8,16]{0,1}) tuple(%mo, %so, %ts, %tr)
}
"#,
    );
    let pair = |a: &str, b: &str| (a.to_string(), b.to_string());
    // scatter writes into operand 0, alone and as a fusion's root.
    assert_eq!(hints(&g, "sc"), [pair("sc", "x1")]);
    assert_eq!(hints(&g, "fs"), [pair("fs", "x2")]);
    // The multi-output fusion: its update slot takes the updated operand's
    // bytes. The elementwise slot does not: the fused parameter also feeds
    // the dynamic-update-slice, so not all its uses are elementwise (XLA's
    // AreTransitiveUsesElementwiseOrTuple).
    assert_eq!(hints(&g, "mo"), [pair("mo{0}", "x3")]);
    // Variadic sort: each result in its own operand's buffer.
    assert_eq!(hints(&g, "so"), [pair("so{0}", "k2"), pair("so{1}", "v2")]);
    // triangular-solve: the result in the right-hand side (operand 1).
    assert_eq!(hints(&g, "ts"), [pair("ts", "rhs2")]);
    // Never in place: select-and-scatter, copy, transpose.
    for op in ["ss", "cp", "tr"] {
        assert!(hints(&g, op).is_empty(), "{op}: {:?}", hints(&g, op));
    }
}
