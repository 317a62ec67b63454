//! memplan's C ABI (`include/memplan.h`): a thin layer over
//! [`memplan::api`], which does the work on JSON text. This crate only
//! moves strings across the boundary: it reads the caller's NUL-terminated
//! UTF-8, hands back strings allocated here (freed by
//! [`memplan_string_free`]), turns every error into a message, and catches
//! any panic so that none unwinds into C.

use std::ffi::{CStr, CString, c_char, c_int};
use std::panic::{AssertUnwindSafe, catch_unwind};

use memplan::ErrorKind;

/// Writes `text` to `*out` as a new C string.
///
/// # Safety
/// `out` must be valid for a write (checked for null by the callers).
unsafe fn give(out: *mut *mut c_char, text: String) {
    // Interior NULs cannot occur in JSON or in our messages; replace them
    // rather than fail.
    let c = CString::new(text.replace('\0', " ")).expect("no NUL left");
    // SAFETY: the function's contract.
    unsafe { *out = c.into_raw() };
}

/// An error for the caller: its code (`MEMPLAN_E_*`) and its message.
struct Failure {
    code: c_int,
    message: String,
}

/// A bad argument this layer finds itself (a NULL or non-UTF-8 string, a
/// negative count).
impl From<String> for Failure {
    fn from(message: String) -> Self {
        Failure {
            code: ErrorKind::InvalidArgument.code(),
            message,
        }
    }
}

impl From<memplan::Error> for Failure {
    fn from(e: memplan::Error) -> Self {
        Failure {
            code: e.kind().code(),
            message: e.to_string(),
        }
    }
}

/// Reads argument `what` as UTF-8 text.
///
/// # Safety
/// `p` must be null or a NUL-terminated string.
unsafe fn text<'a>(p: *const c_char, what: &str) -> Result<&'a str, String> {
    if p.is_null() {
        return Err(format!("{what} is NULL"));
    }
    // SAFETY: the function's contract.
    unsafe { CStr::from_ptr(p) }
        .to_str()
        .map_err(|e| format!("{what} is not UTF-8: {e}"))
}

/// Runs `f`, writes its result or error message to `*out`; returns 0 on
/// success, else the error's code ([`ErrorKind::code`]).
///
/// # Safety
/// `out` must be null or valid for a write.
unsafe fn answer(out: *mut *mut c_char, f: impl FnOnce() -> Result<String, Failure>) -> c_int {
    if out.is_null() {
        return ErrorKind::InvalidArgument.code();
    }
    let result = catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|_| {
        Err(Failure {
            code: ErrorKind::Internal.code(),
            message: "internal error: memplan panicked (please report it)".into(),
        })
    });
    let (code, text) = match result {
        Ok(text) => (0, text),
        Err(f) => (f.code, f.message),
    };
    // SAFETY: checked non-null above; the caller's contract.
    unsafe { give(out, text) };
    code
}

/// Plans `graph_json`; see `memplan.h`.
///
/// # Safety
/// `graph_json` must be null or a NUL-terminated string, `out` null or
/// valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memplan_plan(
    graph_json: *const c_char,
    time_limit_seconds: f64,
    out: *mut *mut c_char,
) -> c_int {
    // SAFETY: forwarded from the caller.
    unsafe {
        answer(out, || {
            let g = text(graph_json, "graph_json")?;
            memplan::api::plan_json(g, time_limit_seconds).map_err(Failure::from)
        })
    }
}

/// Plans `graph_json`, splitting its loss chain as `split` asks; see
/// `memplan.h`.
///
/// # Safety
/// As [`memplan_plan`], for `graph_json` and `split`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memplan_plan_split(
    graph_json: *const c_char,
    time_limit_seconds: f64,
    split: *const c_char,
    out: *mut *mut c_char,
) -> c_int {
    // SAFETY: forwarded from the caller.
    unsafe {
        answer(out, || {
            let g = text(graph_json, "graph_json")?;
            let s = text(split, "split")?;
            memplan::api::plan_split_json(g, time_limit_seconds, s).map_err(Failure::from)
        })
    }
}

/// What `graph_json` needs without memplan; see `memplan.h`.
///
/// # Safety
/// As [`memplan_plan`], for `graph_json` and `device`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memplan_baselines(
    graph_json: *const c_char,
    device: *const c_char,
    out: *mut *mut c_char,
) -> c_int {
    // SAFETY: forwarded from the caller.
    unsafe {
        answer(out, || {
            let g = text(graph_json, "graph_json")?;
            let d = text(device, "device")?;
            memplan::api::baselines_json(g, d).map_err(Failure::from)
        })
    }
}

/// Checks `plan_json` against `graph_json`; see `memplan.h`.
///
/// # Safety
/// As [`memplan_plan`], for both strings.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memplan_check(
    graph_json: *const c_char,
    plan_json: *const c_char,
    out: *mut *mut c_char,
) -> c_int {
    // SAFETY: forwarded from the caller.
    unsafe {
        answer(out, || {
            let g = text(graph_json, "graph_json")?;
            let p = text(plan_json, "plan_json")?;
            memplan::api::check_json(g, p).map_err(Failure::from)
        })
    }
}

/// A built-in example step as a graph document; see `memplan.h`.
///
/// # Safety
/// As [`memplan_plan`], for `spec`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memplan_example(spec: *const c_char, out: *mut *mut c_char) -> c_int {
    // SAFETY: forwarded from the caller.
    unsafe {
        answer(out, || {
            let s = text(spec, "spec")?;
            memplan::api::example_json(s).map_err(Failure::from)
        })
    }
}

/// The fit's objective: `minimise`, or "time" for NULL.
///
/// # Safety
/// `minimise` must be null or a NUL-terminated string.
unsafe fn objective<'a>(minimise: *const c_char) -> Result<&'a str, String> {
    if minimise.is_null() {
        return Ok("time");
    }
    // SAFETY: forwarded from the caller.
    unsafe { text(minimise, "minimise") }
}

/// Fits `graph_json` into `budget_bytes` by recomputation; see `memplan.h`.
///
/// # Safety
/// As [`memplan_plan`], for both strings.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memplan_fit(
    graph_json: *const c_char,
    budget_bytes: u64,
    time_limit_seconds: f64,
    minimise: *const c_char,
    out: *mut *mut c_char,
) -> c_int {
    // SAFETY: forwarded from the caller.
    unsafe {
        answer(out, || {
            let g = text(graph_json, "graph_json")?;
            let m = objective(minimise)?;
            memplan::api::fit_json(g, budget_bytes, time_limit_seconds, m).map_err(Failure::from)
        })
    }
}

/// The smallest arena within `max_added` of the step's cost; see
/// `memplan.h`.
///
/// # Safety
/// As [`memplan_plan`], for both strings.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memplan_fit_within(
    graph_json: *const c_char,
    max_added: f64,
    time_limit_seconds: f64,
    minimise: *const c_char,
    out: *mut *mut c_char,
) -> c_int {
    // SAFETY: forwarded from the caller.
    unsafe {
        answer(out, || {
            let g = text(graph_json, "graph_json")?;
            let m = objective(minimise)?;
            memplan::api::fit_within_json(g, max_added, time_limit_seconds, m)
                .map_err(Failure::from)
        })
    }
}

/// Offloads `graph_json` to host memory as `options_json` asks; see
/// `memplan.h`.
///
/// # Safety
/// As [`memplan_plan`], for both strings.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memplan_fit_offload(
    graph_json: *const c_char,
    options_json: *const c_char,
    out: *mut *mut c_char,
) -> c_int {
    // SAFETY: forwarded from the caller.
    unsafe {
        answer(out, || {
            let g = text(graph_json, "graph_json")?;
            let o = text(options_json, "options_json")?;
            memplan::api::offload_json(g, o).map_err(Failure::from)
        })
    }
}

/// `memplan_fit_within` for a graph that already adds `already_flops`
/// FLOPs to the step it was made from; see `memplan.h`.
///
/// # Safety
/// As [`memplan_plan`], for both strings.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memplan_fit_within_after(
    graph_json: *const c_char,
    max_added: f64,
    already_flops: f64,
    time_limit_seconds: f64,
    minimise: *const c_char,
    out: *mut *mut c_char,
) -> c_int {
    // SAFETY: forwarded from the caller.
    unsafe {
        answer(out, || {
            let g = text(graph_json, "graph_json")?;
            let m = objective(minimise)?;
            memplan::api::fit_within_after_json(g, max_added, already_flops, time_limit_seconds, m)
                .map_err(Failure::from)
        })
    }
}

/// `memplan_fit` (`max_added` negative) or `memplan_fit_within`
/// (`budget_bytes` ignored) that may also split the loss chain; see
/// `memplan.h`.
///
/// # Safety
/// As [`memplan_plan`], for the three strings.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memplan_fit_split(
    graph_json: *const c_char,
    budget_bytes: u64,
    max_added: f64,
    time_limit_seconds: f64,
    minimise: *const c_char,
    split: *const c_char,
    out: *mut *mut c_char,
) -> c_int {
    // SAFETY: forwarded from the caller.
    unsafe {
        answer(out, || {
            let g = text(graph_json, "graph_json")?;
            let m = objective(minimise)?;
            let s = text(split, "split")?;
            let (budget, share) = if max_added < 0.0 {
                (Some(budget_bytes), None)
            } else {
                (None, Some(max_added))
            };
            memplan::api::fit_split_json(g, budget, share, time_limit_seconds, m, s)
                .map_err(Failure::from)
        })
    }
}

/// A batch size argument: 0 or more (0: the batch the graph's metadata
/// records, where the function allows it), never negative.
fn batch_size(n: i64, what: &str) -> Result<u64, String> {
    u64::try_from(n).map_err(|_| format!("{what} must be 0 or more, got {n}"))
}

/// The step at `batch` from two captures at `batch1` and `batch2`; see
/// `memplan.h`.
///
/// # Safety
/// As [`memplan_plan`], for both strings.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memplan_at_batch(
    graph1_json: *const c_char,
    batch1: i64,
    graph2_json: *const c_char,
    batch2: i64,
    batch: i64,
    out: *mut *mut c_char,
) -> c_int {
    // SAFETY: forwarded from the caller.
    unsafe {
        answer(out, || {
            let g1 = text(graph1_json, "graph1_json")?;
            let g2 = text(graph2_json, "graph2_json")?;
            let (b1, b2) = (batch_size(batch1, "batch1")?, batch_size(batch2, "batch2")?);
            let b = batch_size(batch, "batch")?;
            memplan::api::graph_at_batch_json(g1, b1, g2, b2, b).map_err(Failure::from)
        })
    }
}

/// The largest batch that fits `budget_bytes`, from two captures; see
/// `memplan.h`.
///
/// # Safety
/// As [`memplan_plan`], for both strings.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memplan_max_batch(
    graph1_json: *const c_char,
    batch1: i64,
    graph2_json: *const c_char,
    batch2: i64,
    budget_bytes: u64,
    probe_time_seconds: f64,
    out: *mut *mut c_char,
) -> c_int {
    // SAFETY: forwarded from the caller.
    unsafe {
        answer(out, || {
            let g1 = text(graph1_json, "graph1_json")?;
            let g2 = text(graph2_json, "graph2_json")?;
            let (b1, b2) = (batch_size(batch1, "batch1")?, batch_size(batch2, "batch2")?);
            memplan::api::max_batch_json(g1, b1, g2, b2, budget_bytes, probe_time_seconds)
                .map_err(Failure::from)
        })
    }
}

/// Frees a string returned by this library.
///
/// # Safety
/// `s` must be null or a string this library returned, freed once.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memplan_string_free(s: *mut c_char) {
    if !s.is_null() {
        // SAFETY: the function's contract: made by `CString::into_raw`.
        drop(unsafe { CString::from_raw(s) });
    }
}

/// The library's version.
#[unsafe(no_mangle)]
pub extern "C" fn memplan_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr() as *const c_char
}
