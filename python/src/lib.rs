//! The native half of the `memplan` Python package: a thin layer over
//! [`memplan::api`] (graphs and plans cross as JSON text). The Python half
//! (`python/memplan/__init__.py`) turns dicts and paths into that text and
//! errors into `memplan.MemplanError`.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

/// `e` as a `ValueError` with the message, and its kind
/// ([`memplan::ErrorKind::name`]) as attribute `kind`, which the Python half
/// carries over to `MemplanError.kind`.
fn err(e: memplan::Error) -> PyErr {
    Python::attach(|py| {
        let pe = PyValueError::new_err(e.to_string());
        // Setting an attribute on a fresh ValueError cannot fail short of
        // memory; the message alone is still the error then.
        let _ = pe.value(py).setattr("kind", e.kind().name());
        pe
    })
}

/// Plans the graph document `graph_json`; returns the plan document.
#[pyfunction]
#[pyo3(signature = (graph_json, time_limit))]
fn plan_json(py: Python<'_>, graph_json: &str, time_limit: f64) -> PyResult<String> {
    let g = graph_json.to_string();
    py.detach(move || memplan::api::plan_json(&g, time_limit))
        .map_err(err)
}

/// Plans the graph document with its loss chain split as `split` asks;
/// returns `{"graph", "plan", "split"}` as JSON.
#[pyfunction]
fn plan_split_json(
    py: Python<'_>,
    graph_json: &str,
    time_limit: f64,
    split: &str,
) -> PyResult<String> {
    let (g, s) = (graph_json.to_string(), split.to_string());
    py.detach(move || memplan::api::plan_split_json(&g, time_limit, &s))
        .map_err(err)
}

/// The baselines of the graph document (`memplan compare`'s), as JSON.
#[pyfunction]
fn baselines_json(py: Python<'_>, graph_json: &str, device: &str) -> PyResult<String> {
    let (g, d) = (graph_json.to_string(), device.to_string());
    py.detach(move || memplan::api::baselines_json(&g, &d))
        .map_err(err)
}

/// Checks the plan document against the graph document; returns the
/// checker's report as JSON.
#[pyfunction]
fn check_json(graph_json: &str, plan_json: &str) -> PyResult<String> {
    memplan::api::check_json(graph_json, plan_json).map_err(err)
}

/// Fits the graph document into `budget` bytes by recomputation; returns
/// the fitted step, its plan and what the recomputation costs (JSON).
#[pyfunction]
#[pyo3(signature = (graph_json, budget, time_limit, minimise))]
fn fit_json(
    py: Python<'_>,
    graph_json: &str,
    budget: u64,
    time_limit: f64,
    minimise: &str,
) -> PyResult<String> {
    let (g, m) = (graph_json.to_string(), minimise.to_string());
    py.detach(move || memplan::api::fit_json(&g, budget, time_limit, &m))
        .map_err(err)
}

/// Offloads the graph document to host memory as the options document
/// asks (docs/offload.md); returns the step with its copies, its plan and
/// the figures (JSON).
#[pyfunction]
fn fit_offload_json(py: Python<'_>, graph_json: &str, options_json: &str) -> PyResult<String> {
    let (g, o) = (graph_json.to_string(), options_json.to_string());
    py.detach(move || memplan::api::offload_json(&g, &o))
        .map_err(err)
}

/// Fusion regions of a planned order and the fused step's checked plan,
/// as the options document asks (`memplan::api::fuse_json`; JSON).
#[pyfunction]
fn fuse_json(py: Python<'_>, graph_json: &str, options_json: &str) -> PyResult<String> {
    let (g, o) = (graph_json.to_string(), options_json.to_string());
    py.detach(move || memplan::api::fuse_json(&g, &o))
        .map_err(err)
}

/// The smallest arena within `max_added` of the step's cost (JSON report);
/// with `already_flops`, of the cost of the step the graph was made from,
/// which it already adds that many FLOPs to.
#[pyfunction]
#[pyo3(signature = (graph_json, max_added, time_limit, minimise, already_flops=0.0))]
fn fit_within_json(
    py: Python<'_>,
    graph_json: &str,
    max_added: f64,
    time_limit: f64,
    minimise: &str,
    already_flops: f64,
) -> PyResult<String> {
    let (g, m) = (graph_json.to_string(), minimise.to_string());
    py.detach(move || {
        if already_flops == 0.0 {
            memplan::api::fit_within_json(&g, max_added, time_limit, &m)
        } else {
            memplan::api::fit_within_after_json(&g, max_added, already_flops, time_limit, &m)
        }
    })
    .map_err(err)
}

/// A fit (`budget`) or a fit within a share (`max_added`) that may also
/// split the loss chain as `split` asks (JSON report with `split`).
#[pyfunction]
#[pyo3(signature = (graph_json, budget, max_added, time_limit, minimise, split))]
fn fit_split_json(
    py: Python<'_>,
    graph_json: &str,
    budget: Option<u64>,
    max_added: Option<f64>,
    time_limit: f64,
    minimise: &str,
    split: &str,
) -> PyResult<String> {
    let (g, m, s) = (
        graph_json.to_string(),
        minimise.to_string(),
        split.to_string(),
    );
    py.detach(move || memplan::api::fit_split_json(&g, budget, max_added, time_limit, &m, &s))
        .map_err(err)
}

/// The step at `batch` from two captures at batches `b1` and `b2` (0: the
/// batch the graph's metadata records).
#[pyfunction]
fn graph_at_batch_json(g1: &str, b1: u64, g2: &str, b2: u64, batch: u64) -> PyResult<String> {
    memplan::api::graph_at_batch_json(g1, b1, g2, b2, batch).map_err(err)
}

/// The largest batch that fits `budget`, eager / planned / fitted (JSON).
#[pyfunction]
#[pyo3(signature = (g1, b1, g2, b2, budget, probe_time))]
fn max_batch_json(
    py: Python<'_>,
    g1: &str,
    b1: u64,
    g2: &str,
    b2: u64,
    budget: u64,
    probe_time: f64,
) -> PyResult<String> {
    let (g1, g2) = (g1.to_string(), g2.to_string());
    py.detach(move || memplan::api::max_batch_json(&g1, b1, &g2, b2, budget, probe_time))
        .map_err(err)
}

/// A built-in example step (`memplan bench`'s spec) as a graph document.
#[pyfunction]
fn example_json(spec: &str) -> PyResult<String> {
    memplan::api::example_json(spec).map_err(err)
}

/// The text of a graph or plan file (gzip-compressed when it ends in `.gz`).
#[pyfunction]
fn read_text(path: std::path::PathBuf) -> PyResult<String> {
    memplan::io::read_text(&path).map_err(err)
}

/// Bytes written as people write them (`"24GiB"`, `"1.5 GB"`): the CLI's
/// rule, `memplan::units::parse_bytes`.
#[pyfunction]
fn parse_bytes(text: &str) -> PyResult<u64> {
    memplan::units::parse_bytes(text).map_err(err)
}

#[pymodule]
fn _memplan(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(plan_json, m)?)?;
    m.add_function(wrap_pyfunction!(plan_split_json, m)?)?;
    m.add_function(wrap_pyfunction!(check_json, m)?)?;
    m.add_function(wrap_pyfunction!(baselines_json, m)?)?;
    m.add_function(wrap_pyfunction!(read_text, m)?)?;
    m.add_function(wrap_pyfunction!(fit_json, m)?)?;
    m.add_function(wrap_pyfunction!(fit_offload_json, m)?)?;
    m.add_function(wrap_pyfunction!(fuse_json, m)?)?;
    m.add_function(wrap_pyfunction!(fit_within_json, m)?)?;
    m.add_function(wrap_pyfunction!(fit_split_json, m)?)?;
    m.add_function(wrap_pyfunction!(graph_at_batch_json, m)?)?;
    m.add_function(wrap_pyfunction!(max_batch_json, m)?)?;
    m.add_function(wrap_pyfunction!(example_json, m)?)?;
    m.add_function(wrap_pyfunction!(parse_bytes, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
