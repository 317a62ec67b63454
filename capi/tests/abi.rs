//! The C ABI called as C calls it: plan a graph, check the plan, and get
//! messages (not crashes) for bad input; and a C program (`smoke.c`)
//! compiled against `memplan.h` and the shared library.

use std::ffi::{CStr, CString, c_char};
use std::ptr;

use memplan_capi::{
    memplan_check, memplan_example, memplan_fit, memplan_fit_within, memplan_plan,
    memplan_string_free, memplan_version,
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
    assert_eq!(rc, 1);
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
    assert_eq!(rc, 1);
    assert!(take(out).contains("needs at least"));
    let bad = CString::new("speed").unwrap();
    let rc = unsafe { memplan_fit(g.as_ptr(), budget, 5.0, bad.as_ptr(), &mut out) };
    assert_eq!(rc, 1);
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
    assert_eq!(rc, 1);
    assert!(take(out).contains("share of the step's cost"));
}

#[test]
fn bad_input_is_a_message_never_a_crash() {
    let mut out = ptr::null_mut();
    let bad = CString::new("{\"format\": \"memplan-graph\"").unwrap();
    // SAFETY: valid pointers; null arguments are part of what is tested.
    let rc = unsafe { memplan_plan(bad.as_ptr(), 1.0, &mut out) };
    assert_eq!(rc, 1);
    assert!(take(out).contains("<graph>"));
    let rc = unsafe { memplan_plan(ptr::null(), 1.0, &mut out) };
    assert_eq!(rc, 1);
    assert_eq!(take(out), "graph_json is NULL");
    let g = CString::new(GRAPH).unwrap();
    let rc = unsafe { memplan_plan(g.as_ptr(), -1.0, &mut out) };
    assert_eq!(rc, 1);
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
        assert_eq!(rc, 1, "{bad}");
        let msg = take(out);
        assert!(msg.contains("time limit") && msg.contains(shown), "{msg}");
        let rc = unsafe { memplan_fit(g.as_ptr(), 1 << 20, bad, ptr::null(), &mut out) };
        assert_eq!(rc, 1, "{bad}");
        assert!(take(out).contains(shown));
    }
    let wrong = CString::new(r#"{"format": "memplan-plan", "version": 1, "arena_bytes": 0, "order": ["g", "f"], "tensors": []}"#).unwrap();
    let rc = unsafe { memplan_check(g.as_ptr(), wrong.as_ptr(), &mut out) };
    assert_eq!(rc, 1);
    assert!(take(out).contains("<plan>"));
    assert_eq!(unsafe { memplan_plan(g.as_ptr(), 1.0, ptr::null_mut()) }, 1);
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
    let out = Command::new(&exe).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("plan ok"), "{text}");
}
