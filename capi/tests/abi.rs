//! The C ABI called as C calls it: plan a graph, check the plan, and get
//! messages (not crashes) for bad input; and a C program (`smoke.c`)
//! compiled against `memplan.h` and the shared library.

use memplan::ErrorKind;
use std::ffi::{CStr, CString, c_char};
use std::ptr;

use memplan_capi::{
    memplan_at_batch, memplan_baselines, memplan_check, memplan_example, memplan_fit,
    memplan_fit_split, memplan_fit_within, memplan_fit_within_after, memplan_max_batch,
    memplan_plan, memplan_plan_split, memplan_string_free, memplan_version,
};

fn take(p: *mut c_char) -> String {
    // SAFETY: a string the library returned, freed once here.
    let s = unsafe { CStr::from_ptr(p) }.to_str().unwrap().to_string();
    unsafe { memplan_string_free(p) };
    s
}

const GRAPH: &str = r#"{"format": "memplan-graph", "version": 1, "name": "two-ops",
  "tensors": [
    {"id": "x", "size": 1024, "role": "input", "lifetime": "persistent"},
    {"id": "h", "size": 4096},
    {"id": "y", "size": 1024, "role": "output", "lifetime": "persistent"}],
  "ops": [
    {"id": "f", "inputs": ["x"], "outputs": ["h"]},
    {"id": "g", "inputs": ["h"], "outputs": ["y"]}]}"#;

/// A built-in FSDP2 step from its spec, planned and checked through the ABI.
#[test]
fn built_in_examples_through_the_c_abi() {
    let spec = CString::new("llama-tiny,world=2").unwrap();
    let mut out = ptr::null_mut();
    let rc = unsafe { memplan_example(spec.as_ptr(), &mut out) };
    let g = take(out);
    assert_eq!(rc, 0, "{g}");
    let gc = CString::new(g).unwrap();
    let rc = unsafe { memplan_plan(gc.as_ptr(), 2.0, &mut out) };
    let plan = CString::new(take(out)).unwrap();
    assert_eq!(rc, 0);
    let rc = unsafe { memplan_check(gc.as_ptr(), plan.as_ptr(), &mut out) };
    assert_eq!(rc, 0, "{}", take(out));
    let bad = CString::new("llama-tiny,world=two").unwrap();
    let rc = unsafe { memplan_example(bad.as_ptr(), &mut out) };
    assert_eq!(rc, code("INVALID_ARGUMENT"));
    assert!(take(out).contains("world must be a positive integer"));
}

#[test]
fn plans_and_checks_through_the_c_abi() {
    let g = CString::new(GRAPH).unwrap();
    let mut out = ptr::null_mut();
    // SAFETY: valid strings and out pointer.
    let rc = unsafe { memplan_plan(g.as_ptr(), 1.0, &mut out) };
    let plan = take(out);
    assert_eq!(rc, 0, "{plan}");
    let v: serde_json::Value = serde_json::from_str(&plan).unwrap();
    assert_eq!(v["order"], serde_json::json!(["f", "g"]));
    assert_eq!(v["arena_bytes"], 6144);
    let p = CString::new(plan).unwrap();
    let rc = unsafe { memplan_check(g.as_ptr(), p.as_ptr(), &mut out) };
    let report = take(out);
    assert_eq!(rc, 0, "{report}");
    assert!(report.contains("\"max_live_bytes\":6144"), "{report}");
    // SAFETY: a static NUL-terminated string.
    let version = unsafe { CStr::from_ptr(memplan_version()) }
        .to_str()
        .unwrap();
    assert_eq!(version, env!("CARGO_PKG_VERSION"));
}

#[test]
fn baselines_and_split_plans_through_the_c_abi() {
    let g = CString::new(GRAPH).unwrap();
    let cuda = CString::new("cuda").unwrap();
    let mut out = ptr::null_mut();
    // SAFETY: valid strings and out pointer, here and below.
    let rc = unsafe { memplan_baselines(g.as_ptr(), cuda.as_ptr(), &mut out) };
    let v = json(rc, out);
    let base = v["baselines"].as_array().unwrap();
    let program = base.iter().find(|b| b["name"] == "program-order").unwrap();
    assert_eq!(program["peak_bytes"], 6144, "{v}");
    assert!(v["best_eager"].is_string(), "{v}");
    let tpu = CString::new("tpu").unwrap();
    let rc = unsafe { memplan_baselines(g.as_ptr(), tpu.as_ptr(), &mut out) };
    let e = error(rc, out);
    assert_eq!(rc, code("INVALID_ARGUMENT"), "{e}");
    assert!(e.contains("\"tpu\""), "{e}");
    let rc = unsafe { memplan_baselines(g.as_ptr(), ptr::null(), &mut out) };
    assert_eq!(rc, code("INVALID_ARGUMENT"));
    assert!(error(rc, out).contains("device is NULL"));

    // A step with a loss chain, split in two and by choice.
    let spec = CString::new("gpt2-tiny").unwrap();
    let rc = unsafe { memplan_example(spec.as_ptr(), &mut out) };
    let step = CString::new(json(rc, out).to_string()).unwrap();
    let two = CString::new("2").unwrap();
    let rc = unsafe { memplan_plan_split(step.as_ptr(), 2.0, two.as_ptr(), &mut out) };
    let v = json(rc, out);
    assert_eq!(v["split"]["chunks"], 2, "{}", v["split"]);
    // The plan is the split graph's, and the checker takes it.
    let (sg, sp) = (
        CString::new(v["graph"].to_string()).unwrap(),
        CString::new(v["plan"].to_string()).unwrap(),
    );
    let rc = unsafe { memplan_check(sg.as_ptr(), sp.as_ptr(), &mut out) };
    json(rc, out);
    let off = CString::new("off").unwrap();
    let rc = unsafe { memplan_plan_split(step.as_ptr(), 2.0, off.as_ptr(), &mut out) };
    assert_eq!(json(rc, out)["split"]["chunks"], 1);
    let bad = CString::new("some").unwrap();
    let rc = unsafe { memplan_plan_split(step.as_ptr(), 2.0, bad.as_ptr(), &mut out) };
    let e = error(rc, out);
    assert_eq!(rc, code("INVALID_ARGUMENT"), "{e}");
    let rc = unsafe { memplan_plan_split(step.as_ptr(), 2.0, ptr::null(), &mut out) };
    assert_eq!(rc, code("INVALID_ARGUMENT"));
    assert!(error(rc, out).contains("split is NULL"));

    // A fit that may split: within 1% more FLOPs (the split's counted),
    // and into the split plan's arena; each answer's graph and plan check.
    let flops = CString::new("flops").unwrap();
    let auto = CString::new("auto").unwrap();
    let rc = unsafe {
        memplan_fit_split(
            step.as_ptr(),
            0,
            0.01,
            4.0,
            flops.as_ptr(),
            auto.as_ptr(),
            &mut out,
        )
    };
    let v = json(rc, out);
    assert!(
        v["split"]["chunks"].as_u64().unwrap() >= 1,
        "{}",
        v["split"]
    );
    assert!(
        v["added_flops"].as_f64().unwrap()
            <= 0.01 * v["split"]["step_flops"].as_f64().unwrap() * 1.000001,
        "{v}"
    );
    let budget = v["arena_bytes"].as_u64().unwrap();
    let rc = unsafe {
        memplan_fit_split(
            step.as_ptr(),
            budget,
            -1.0,
            4.0,
            flops.as_ptr(),
            auto.as_ptr(),
            &mut out,
        )
    };
    let v = json(rc, out);
    assert!(v["arena_bytes"].as_u64().unwrap() <= budget, "{v}");
    let (fg, fp) = (
        CString::new(v["graph"].to_string()).unwrap(),
        CString::new(v["plan"].to_string()).unwrap(),
    );
    let rc = unsafe { memplan_check(fg.as_ptr(), fp.as_ptr(), &mut out) };
    json(rc, out);
    let rc = unsafe {
        memplan_fit_split(
            step.as_ptr(),
            0,
            f64::NAN,
            4.0,
            ptr::null(),
            auto.as_ptr(),
            &mut out,
        )
    };
    assert_eq!(rc, code("INVALID_ARGUMENT"));
    assert!(error(rc, out).contains("share of the step's cost"));
    let rc = unsafe {
        memplan_fit_split(
            step.as_ptr(),
            0,
            0.01,
            4.0,
            ptr::null(),
            bad.as_ptr(),
            &mut out,
        )
    };
    assert_eq!(rc, code("INVALID_ARGUMENT"));
    error(rc, out);
}

/// `h` (4096 bytes) is read again by the backward op `b2`: recomputing `f`
/// there lets it die after `g`, below the peak at `g2`.
const REMAT: &str = r#"{"format": "memplan-graph", "version": 1, "name": "remat",
  "tensors": [
    {"id": "x", "size": 1024, "role": "input", "lifetime": "persistent"},
    {"id": "h", "size": 4096},
    {"id": "y", "size": 8192},
    {"id": "s", "size": 1024},
    {"id": "d", "size": 1024},
    {"id": "z", "size": 1024, "role": "output", "lifetime": "persistent"}],
  "ops": [
    {"id": "f", "kind": "forward", "inputs": ["x"], "outputs": ["h"], "flops": 10},
    {"id": "g", "kind": "forward", "inputs": ["h"], "outputs": ["y"], "flops": 1000},
    {"id": "g2", "kind": "forward", "inputs": ["y"], "outputs": ["s"], "flops": 1000},
    {"id": "b1", "kind": "backward", "inputs": ["s"], "outputs": ["d"]},
    {"id": "b2", "kind": "backward", "inputs": ["d", "h"], "outputs": ["z"]}]}"#;

#[test]
fn fits_through_the_c_abi() {
    let g = CString::new(REMAT).unwrap();
    let mut out = ptr::null_mut();
    // SAFETY: valid strings and out pointer.
    let rc = unsafe { memplan_plan(g.as_ptr(), 1.0, &mut out) };
    let base: serde_json::Value = serde_json::from_str(&take(out)).unwrap();
    assert_eq!(rc, 0);
    let budget = base["arena_bytes"].as_u64().unwrap() - 1;
    let flops = CString::new("flops").unwrap();
    let rc = unsafe { memplan_fit(g.as_ptr(), budget, 5.0, flops.as_ptr(), &mut out) };
    let fitted = take(out);
    assert_eq!(rc, 0, "{fitted}");
    let v: serde_json::Value = serde_json::from_str(&fitted).unwrap();
    assert!(v["arena_bytes"].as_u64().unwrap() <= budget, "{v}");
    assert_eq!(v["recomputed_ops"], serde_json::json!(["f"]));
    assert_eq!(v["added_flops"], 10.0);
    // The fitted graph and plan check through the same ABI.
    let (fg, fp) = (
        CString::new(v["graph"].to_string()).unwrap(),
        CString::new(v["plan"].to_string()).unwrap(),
    );
    let rc = unsafe { memplan_check(fg.as_ptr(), fp.as_ptr(), &mut out) };
    assert_eq!(rc, 0, "{}", take(out));
    // Below the floor: an error with the bound; a bad objective by name.
    let rc = unsafe { memplan_fit(g.as_ptr(), 100, 5.0, ptr::null(), &mut out) };
    assert_eq!(rc, code("DOES_NOT_FIT"));
    assert!(take(out).contains("needs at least"));
    let bad = CString::new("speed").unwrap();
    let rc = unsafe { memplan_fit(g.as_ptr(), budget, 5.0, bad.as_ptr(), &mut out) };
    assert_eq!(rc, code("INVALID_ARGUMENT"));
    assert!(take(out).contains("unknown objective"));
    // The other way round: recomputing `f` costs 10 of the step's 2,010
    // FLOPs, so 1% allows it and 0.1% does not.
    let rc = unsafe { memplan_fit_within(g.as_ptr(), 0.01, 5.0, flops.as_ptr(), &mut out) };
    let v: serde_json::Value = serde_json::from_str(&take(out)).unwrap();
    assert_eq!(rc, 0, "{v}");
    assert_eq!(v["recomputed_ops"], serde_json::json!(["f"]));
    assert!(
        v["arena_bytes"].as_u64() < base["arena_bytes"].as_u64(),
        "{v}"
    );
    let rc = unsafe { memplan_fit_within(g.as_ptr(), 0.001, 5.0, flops.as_ptr(), &mut out) };
    let v: serde_json::Value = serde_json::from_str(&take(out)).unwrap();
    assert_eq!(rc, 0, "{v}");
    assert_eq!(v["recomputed_ops"], serde_json::json!([]));
    assert_eq!(v["arena_bytes"], base["arena_bytes"]);
    let rc = unsafe { memplan_fit_within(g.as_ptr(), -0.5, 5.0, ptr::null(), &mut out) };
    assert_eq!(rc, code("INVALID_ARGUMENT"));
    assert!(take(out).contains("share of the step's cost"));
    // The cost model counts the step at 2,522 FLOPs (`b1` and `b2` carry
    // no count: elementwise estimates). After 5 FLOPs the graph already
    // adds, 1% of the 2,517 before less 5 leaves 20.17, so `f` (10) is
    // still recomputed; after 16, 1% of 2,506 less 16 leaves 9.06, and it
    // is not; after 25 the share is spent before any recomputation.
    let rc =
        unsafe { memplan_fit_within_after(g.as_ptr(), 0.01, 5.0, 5.0, flops.as_ptr(), &mut out) };
    let v: serde_json::Value = serde_json::from_str(&take(out)).unwrap();
    assert_eq!(rc, 0, "{v}");
    assert_eq!(v["recomputed_ops"], serde_json::json!(["f"]));
    let rc =
        unsafe { memplan_fit_within_after(g.as_ptr(), 0.01, 16.0, 5.0, flops.as_ptr(), &mut out) };
    let v: serde_json::Value = serde_json::from_str(&take(out)).unwrap();
    assert_eq!(rc, 0, "{v}");
    assert_eq!(v["recomputed_ops"], serde_json::json!([]));
    let rc =
        unsafe { memplan_fit_within_after(g.as_ptr(), 0.01, 25.0, 5.0, flops.as_ptr(), &mut out) };
    assert_eq!(rc, code("DOES_NOT_FIT"));
    assert!(take(out).contains("more than max_added=0.01"));
    let rc = unsafe {
        memplan_fit_within_after(g.as_ptr(), 0.01, f64::NAN, 5.0, flops.as_ptr(), &mut out)
    };
    assert_eq!(rc, code("INVALID_ARGUMENT"));
    take(out);
}

/// `REMAT` at batch `b`: every size `b` times its own, the batch recorded
/// in the metadata. Planned, its arena is 14,336·b bytes (`x`, `h`, `y`
/// and `s` at `g2`); recomputing `f` lowers it to 13,312·b (`x`, `h` and
/// `y` at `g`).
fn remat_at(b: u64) -> String {
    let mut v: serde_json::Value = serde_json::from_str(REMAT).unwrap();
    for t in v["tensors"].as_array_mut().unwrap() {
        t["size"] = (t["size"].as_u64().unwrap() * b).into();
    }
    v["metadata"] = serde_json::json!({ "batch": b });
    v.to_string()
}

fn json(rc: i32, out: *mut c_char) -> serde_json::Value {
    let text = take(out);
    assert_eq!(rc, 0, "{text}");
    serde_json::from_str(&text).unwrap()
}

fn error(rc: i32, out: *mut c_char) -> String {
    let text = take(out);
    assert!(
        ErrorKind::ALL.iter().any(|k| k.code() == rc),
        "expected an error, got {rc}: {text}"
    );
    text
}

/// The value `memplan.h` defines for `MEMPLAN_E_<name>`.
fn code(name: &str) -> i32 {
    let header = include_str!("../include/memplan.h");
    let define = format!("#define MEMPLAN_E_{name} ");
    let line = header
        .lines()
        .find(|l| l.starts_with(&define))
        .unwrap_or_else(|| panic!("{define}"));
    line[define.len()..]
        .split_whitespace()
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

/// The header's codes are the library's, one per kind, and 0 is success.
#[test]
fn the_headers_error_codes_are_the_librarys() {
    for k in ErrorKind::ALL {
        assert_eq!(code(&k.name().to_uppercase()), k.code(), "{k:?}");
    }
    let header = include_str!("../include/memplan.h");
    assert_eq!(
        header.matches("#define MEMPLAN_E_").count(),
        ErrorKind::ALL.len()
    );
    assert!(header.contains("#define MEMPLAN_OK 0\n"));
}

/// Two captures make the step at any batch (the batch sizes given or read
/// from the metadata), and the largest batch that fits a budget three ways.
#[test]
fn batches_through_the_c_abi() {
    let (g2, g3) = (
        CString::new(remat_at(2)).unwrap(),
        CString::new(remat_at(3)).unwrap(),
    );
    let mut out = ptr::null_mut();
    // SAFETY: valid strings and out pointer.
    let at = json(
        unsafe { memplan_at_batch(g2.as_ptr(), 2, g3.as_ptr(), 3, 16, &mut out) },
        out,
    );
    let want: serde_json::Value = serde_json::from_str(&remat_at(16)).unwrap();
    for (t, w) in at["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .zip(want["tensors"].as_array().unwrap())
    {
        assert_eq!((&t["id"], &t["size"]), (&w["id"], &w["size"]), "{at}");
    }
    assert_eq!(at["metadata"]["batch"], 16);
    assert_eq!(
        at["metadata"]["extrapolated_from_batches"],
        serde_json::json!([2, 3])
    );
    // 0: the batch each graph records; the same step.
    let at0 = json(
        unsafe { memplan_at_batch(g2.as_ptr(), 0, g3.as_ptr(), 0, 16, &mut out) },
        out,
    );
    assert_eq!(at0, at);
    // Batch 0 is the line's intercept, as in the Rust and Python APIs:
    // here every size is per sample, so every tensor has 0 bytes.
    let zero = json(
        unsafe { memplan_at_batch(g2.as_ptr(), 2, g3.as_ptr(), 3, 0, &mut out) },
        out,
    );
    assert!(
        zero["tensors"]
            .as_array()
            .unwrap()
            .iter()
            .all(|t| t["size"] == 0),
        "{zero}"
    );
    assert_eq!(zero["metadata"]["batch"], 0);
    // The extrapolated step plans as the one built at that batch would.
    let atc = CString::new(at.to_string()).unwrap();
    let plan = json(unsafe { memplan_plan(atc.as_ptr(), 1.0, &mut out) }, out);
    let wc = CString::new(remat_at(16)).unwrap();
    let direct = json(unsafe { memplan_plan(wc.as_ptr(), 1.0, &mut out) }, out);
    assert_eq!(plan["arena_bytes"], direct["arena_bytes"]);

    // The largest batch: 10.5 batches' arenas fit batch 10 planned, and
    // 11 with recomputation (11 · 13,312 bytes); the budget is far below
    // the caching allocator's first 2 MiB segment, so eager fits none.
    let b1 = CString::new(remat_at(1)).unwrap();
    let one = json(unsafe { memplan_plan(b1.as_ptr(), 1.0, &mut out) }, out);
    let per = one["arena_bytes"].as_u64().unwrap();
    assert_eq!(per, 14336);
    let budget = 10 * per + per / 2;
    let r = json(
        unsafe { memplan_max_batch(g2.as_ptr(), 2, g3.as_ptr(), 3, budget, 1.0, &mut out) },
        out,
    );
    assert_eq!(r["planned"], 10, "{r}");
    assert_eq!(r["fitted"], 11, "{r}");
    assert_eq!(r["eager"], 0, "{r}");
    assert_eq!(r["budget_bytes"], budget);
    assert_eq!(r["cap"], 65536);
    // Batch sizes from the metadata give the same answer.
    let r0 = json(
        unsafe { memplan_max_batch(g2.as_ptr(), 0, g3.as_ptr(), 0, budget, 1.0, &mut out) },
        out,
    );
    assert_eq!(r0, r);
    // 4 MiB: the caching allocator's segments fit some batches too.
    let r = json(
        unsafe { memplan_max_batch(g2.as_ptr(), 2, g3.as_ptr(), 3, 4 << 20, 1.0, &mut out) },
        out,
    );
    assert_eq!(r["planned"], (4 << 20) / per, "{r}");
    assert!(r["eager"].as_u64().unwrap() >= 1, "{r}");
    assert!(r["fitted"].as_u64() > r["planned"].as_u64(), "{r}");
    // A budget below anything: batch 0 every way, not an error.
    let r = json(
        unsafe { memplan_max_batch(g2.as_ptr(), 2, g3.as_ptr(), 3, 16, 1.0, &mut out) },
        out,
    );
    assert_eq!(
        (&r["eager"], &r["planned"], &r["fitted"]),
        (
            &serde_json::json!(0),
            &serde_json::json!(0),
            &serde_json::json!(0)
        ),
        "{r}"
    );
}

#[test]
fn bad_batch_input_is_a_message_never_a_crash() {
    let (g2, g3) = (
        CString::new(remat_at(2)).unwrap(),
        CString::new(remat_at(3)).unwrap(),
    );
    let mut out = ptr::null_mut();
    // SAFETY: valid pointers; null arguments and bytes that are not UTF-8
    // are part of what is tested.
    unsafe {
        let e = error(
            memplan_at_batch(ptr::null(), 2, g3.as_ptr(), 3, 8, &mut out),
            out,
        );
        assert_eq!(e, "graph1_json is NULL");
        let e = error(
            memplan_at_batch(g2.as_ptr(), 2, ptr::null(), 3, 8, &mut out),
            out,
        );
        assert_eq!(e, "graph2_json is NULL");
        let e = error(
            memplan_max_batch(ptr::null(), 2, g3.as_ptr(), 3, 1 << 20, 1.0, &mut out),
            out,
        );
        assert_eq!(e, "graph1_json is NULL");
        let e = error(
            memplan_max_batch(g2.as_ptr(), 2, ptr::null(), 3, 1 << 20, 1.0, &mut out),
            out,
        );
        assert_eq!(e, "graph2_json is NULL");
        assert_eq!(
            memplan_at_batch(g2.as_ptr(), 2, g3.as_ptr(), 3, 8, ptr::null_mut()),
            code("INVALID_ARGUMENT")
        );
        assert_eq!(
            memplan_max_batch(
                g2.as_ptr(),
                2,
                g3.as_ptr(),
                3,
                1 << 20,
                1.0,
                ptr::null_mut()
            ),
            code("INVALID_ARGUMENT")
        );
        let latin1 = CString::new(vec![b'{', 0xe9, b'}']).unwrap();
        let e = error(
            memplan_at_batch(g2.as_ptr(), 2, latin1.as_ptr(), 3, 8, &mut out),
            out,
        );
        assert!(e.starts_with("graph2_json is not UTF-8"), "{e}");
        let e = error(
            memplan_max_batch(latin1.as_ptr(), 2, g3.as_ptr(), 3, 1 << 20, 1.0, &mut out),
            out,
        );
        assert!(e.starts_with("graph1_json is not UTF-8"), "{e}");

        // Invalid JSON: the document is named.
        let bad = CString::new("{\"format\": \"memplan-graph\"").unwrap();
        let e = error(
            memplan_at_batch(g2.as_ptr(), 2, bad.as_ptr(), 3, 8, &mut out),
            out,
        );
        assert!(e.contains("<graph at the second batch>"), "{e}");
        let e = error(
            memplan_max_batch(bad.as_ptr(), 2, g3.as_ptr(), 3, 1 << 20, 1.0, &mut out),
            out,
        );
        assert!(e.contains("<graph at the first batch>"), "{e}");

        // Equal, negative and unrecorded batch sizes.
        let e = error(
            memplan_at_batch(g2.as_ptr(), 2, g3.as_ptr(), 2, 8, &mut out),
            out,
        );
        assert!(
            e.contains("two different positive batch sizes, got 2 and 2"),
            "{e}"
        );
        let e = error(
            memplan_max_batch(g2.as_ptr(), 3, g3.as_ptr(), 3, 1 << 20, 1.0, &mut out),
            out,
        );
        assert!(
            e.contains("two different positive batch sizes, got 3 and 3"),
            "{e}"
        );
        let e = error(
            memplan_at_batch(g2.as_ptr(), 0, g2.as_ptr(), 0, 8, &mut out),
            out,
        );
        assert!(
            e.contains("two different positive batch sizes, got 2 and 2"),
            "{e}"
        );
        let e = error(
            memplan_at_batch(g2.as_ptr(), -2, g3.as_ptr(), 3, 8, &mut out),
            out,
        );
        assert_eq!(e, "batch1 must be 0 or more, got -2");
        let e = error(
            memplan_at_batch(g2.as_ptr(), 2, g3.as_ptr(), -3, 8, &mut out),
            out,
        );
        assert_eq!(e, "batch2 must be 0 or more, got -3");
        let e = error(
            memplan_at_batch(g2.as_ptr(), 2, g3.as_ptr(), 3, -1, &mut out),
            out,
        );
        assert_eq!(e, "batch must be 0 or more, got -1");
        let e = error(
            memplan_at_batch(g2.as_ptr(), 2, g3.as_ptr(), 3, i64::MIN, &mut out),
            out,
        );
        assert!(e.starts_with("batch must be 0 or more"), "{e}");
        let e = error(
            memplan_max_batch(g2.as_ptr(), -1, g3.as_ptr(), 3, 1 << 20, 1.0, &mut out),
            out,
        );
        assert_eq!(e, "batch1 must be 0 or more, got -1");
        let bare = CString::new(GRAPH).unwrap();
        let e = error(
            memplan_at_batch(bare.as_ptr(), 0, g3.as_ptr(), 3, 8, &mut out),
            out,
        );
        assert!(e.contains("records no \"batch\""), "{e}");
        // Different steps, by the element where they differ.
        let e = error(
            memplan_at_batch(bare.as_ptr(), 2, g3.as_ptr(), 3, 8, &mut out),
            out,
        );
        assert!(e.contains("differ"), "{e}");

        // A size that would pass 2^64 - 1 bytes at a huge batch.
        let e = error(
            memplan_at_batch(g2.as_ptr(), 2, g3.as_ptr(), 3, i64::MAX, &mut out),
            out,
        );
        assert!(e.contains("bytes at batch 9223372036854775807"), "{e}");

        // The probe time follows the one time-limit rule.
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY, 1e300] {
            let e = error(
                memplan_max_batch(g2.as_ptr(), 2, g3.as_ptr(), 3, 1 << 20, bad, &mut out),
                out,
            );
            assert!(e.contains("probe time"), "{bad}: {e}");
        }
    }
}

#[test]
fn bad_input_is_a_message_never_a_crash() {
    let mut out = ptr::null_mut();
    let bad = CString::new("{\"format\": \"memplan-graph\"").unwrap();
    // SAFETY: valid pointers; null arguments are part of what is tested.
    let rc = unsafe { memplan_plan(bad.as_ptr(), 1.0, &mut out) };
    assert_eq!(rc, code("INPUT"));
    assert!(take(out).contains("<graph>"));
    let rc = unsafe { memplan_plan(ptr::null(), 1.0, &mut out) };
    assert_eq!(rc, code("INVALID_ARGUMENT"));
    assert_eq!(take(out), "graph_json is NULL");
    let g = CString::new(GRAPH).unwrap();
    let rc = unsafe { memplan_plan(g.as_ptr(), -1.0, &mut out) };
    assert_eq!(rc, code("INVALID_ARGUMENT"));
    assert!(take(out).contains("time limit"));
    // Every time limit passes the one rule of memplan::pipeline::time_limit:
    // zero, NaN, infinity and a huge finite number are refused by name, the
    // number printed compactly (a huge one used to panic converting it).
    for (bad, shown) in [
        (0.0, "got 0"),
        (f64::NAN, "got NaN"),
        (f64::INFINITY, "got inf"),
        (1e300, "at most 1e9 seconds (about 31 years), got 1e300"),
    ] {
        let rc = unsafe { memplan_plan(g.as_ptr(), bad, &mut out) };
        assert_eq!(rc, code("INVALID_ARGUMENT"), "{bad}");
        let msg = take(out);
        assert!(msg.contains("time limit") && msg.contains(shown), "{msg}");
        let rc = unsafe { memplan_fit(g.as_ptr(), 1 << 20, bad, ptr::null(), &mut out) };
        assert_eq!(rc, code("INVALID_ARGUMENT"), "{bad}");
        assert!(take(out).contains(shown));
    }
    let wrong = CString::new(r#"{"format": "memplan-plan", "version": 1, "arena_bytes": 0, "order": ["g", "f"], "tensors": []}"#).unwrap();
    let rc = unsafe { memplan_check(g.as_ptr(), wrong.as_ptr(), &mut out) };
    assert_eq!(rc, code("INVALID_PLAN"));
    assert!(take(out).contains("the plan is invalid"));
    assert_eq!(
        unsafe { memplan_plan(g.as_ptr(), 1.0, ptr::null_mut()) },
        code("INVALID_ARGUMENT")
    );
    unsafe { memplan_string_free(ptr::null_mut()) };
}

/// `smoke.c` compiled by the system C compiler against `memplan.h` and the
/// shared library cargo built next to this test, then run.
#[test]
fn a_c_program_plans_and_checks() {
    use std::path::PathBuf;
    use std::process::Command;
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    // The test runs from target/<profile>/deps, where cargo also put the
    // library's cdylib for this test.
    let deps = std::env::current_exe()
        .unwrap()
        .parent()
        .unwrap()
        .to_path_buf();
    assert!(
        deps.join("libmemplan_capi.so").exists(),
        "no libmemplan_capi.so in {}",
        deps.display()
    );
    let exe = deps.join("memplan-c-smoke");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let status = Command::new(&cc)
        .args(["-std=c99", "-Wall", "-Wextra", "-Werror"])
        .arg(manifest.join("tests/smoke.c"))
        .arg("-I")
        .arg(manifest.join("include"))
        .arg("-L")
        .arg(&deps)
        .arg("-lmemplan_capi")
        .arg(format!("-Wl,-rpath,{}", deps.display()))
        .arg("-o")
        .arg(&exe)
        .status()
        .unwrap_or_else(|e| panic!("cannot run the C compiler {cc:?}: {e}"));
    assert!(status.success(), "smoke.c did not compile");
    // cargo's LD_LIBRARY_PATH lists target/<profile> too, where an older
    // `cargo build -p memplan-capi` may have left a stale library that
    // would win over the rpath: the one built for this test goes first,
    // before the paths of the libraries it needs itself (a HiGHS that
    // pkg-config found, scripts/highs.sh).
    let mut path = std::ffi::OsString::from(&deps);
    if let Some(rest) = std::env::var_os("LD_LIBRARY_PATH") {
        path.push(":");
        path.push(rest);
    }
    let out = Command::new(&exe)
        .env("LD_LIBRARY_PATH", path)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("plan ok"), "{text}");
    assert!(text.contains("at_batch ok"), "{text}");
}

/// A step whose parameters dominate, offloaded through the ABI: the step
/// with its copies and its plan check through the ABI too; bad options
/// are errors by name.
#[test]
fn offload_through_the_c_abi() {
    use memplan_capi::memplan_fit_offload;
    let spec = CString::new("gpt2-tiny").unwrap();
    let mut out = ptr::null_mut();
    let rc = unsafe { memplan_example(spec.as_ptr(), &mut out) };
    let g = CString::new(take(out)).unwrap();
    assert_eq!(rc, 0);
    let rc = unsafe { memplan_plan(g.as_ptr(), 2.0, &mut out) };
    let base: serde_json::Value = serde_json::from_str(&take(out)).unwrap();
    assert_eq!(rc, 0);
    let budget = base["arena_bytes"].as_u64().unwrap() * 9 / 10;
    let opts = CString::new(format!(
        r#"{{"budget": {budget}, "device": "h200-pcie5", "time_limit": 10}}"#
    ))
    .unwrap();
    let rc = unsafe { memplan_fit_offload(g.as_ptr(), opts.as_ptr(), &mut out) };
    let text = take(out);
    assert_eq!(rc, 0, "{text}");
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert!(v["arena_bytes"].as_u64().unwrap() <= budget, "{v}");
    assert!(v["offload"]["host_bytes"].as_u64().unwrap() > 0, "{v}");
    let (og, op) = (
        CString::new(v["graph"].to_string()).unwrap(),
        CString::new(v["plan"].to_string()).unwrap(),
    );
    let rc = unsafe { memplan_check(og.as_ptr(), op.as_ptr(), &mut out) };
    let report: serde_json::Value = serde_json::from_str(&take(out)).unwrap();
    assert_eq!(rc, 0, "{report}");
    assert_eq!(report["host_max_live_bytes"], v["offload"]["host_bytes"]);
    for (opts, kind, want) in [
        (r#"{"budget": 1}"#, "DOES_NOT_FIT", "the bound"),
        (
            r#"{"budget": 1000000, "link_gbps": 0}"#,
            "INVALID_ARGUMENT",
            "--link-gbps",
        ),
        (
            r#"{"budget": 1000000, "device": "tpu"}"#,
            "INVALID_ARGUMENT",
            "unknown device preset",
        ),
        (
            r#"{"budget": 1000000, "max_slowdown": 0.1}"#,
            "INVALID_ARGUMENT",
            "either",
        ),
        (
            r#"{"budget": 1000000, "colour": "red"}"#,
            "INVALID_ARGUMENT",
            "unknown field",
        ),
    ] {
        let o = CString::new(opts).unwrap();
        let rc = unsafe { memplan_fit_offload(g.as_ptr(), o.as_ptr(), &mut out) };
        let m = take(out);
        assert_eq!(rc, code(kind), "{opts}: {m}");
        assert!(m.contains(want), "{opts}: {m}");
    }
}
