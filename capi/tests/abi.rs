//! The C ABI called as C calls it: plan a graph, check the plan, and get
//! messages (not crashes) for bad input. `scripts/test.sh` also compiles
//! and runs `capi/tests/smoke.c` against the built library and header.

use std::ffi::{CStr, CString, c_char};
use std::ptr;

use memplan_capi::{memplan_check, memplan_plan, memplan_string_free, memplan_version};

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
    let wrong = CString::new(r#"{"format": "memplan-plan", "version": 1, "arena_bytes": 0, "order": ["g", "f"], "tensors": []}"#).unwrap();
    let rc = unsafe { memplan_check(g.as_ptr(), wrong.as_ptr(), &mut out) };
    assert_eq!(rc, 1);
    assert!(take(out).contains("<plan>"));
    assert_eq!(unsafe { memplan_plan(g.as_ptr(), 1.0, ptr::null_mut()) }, 1);
    unsafe { memplan_string_free(ptr::null_mut()) };
}
