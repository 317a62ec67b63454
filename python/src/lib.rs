//! The native half of the `memplan` Python package: a thin layer over
//! [`memplan::api`] (graphs and plans cross as JSON text). The Python half
//! (`python/memplan/__init__.py`) turns dicts and paths into that text and
//! errors into `memplan.MemplanError`.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

fn err(e: memplan::Error) -> PyErr {
    PyValueError::new_err(e.to_string())
}

/// Plans the graph document `graph_json`; returns the plan document.
#[pyfunction]
#[pyo3(signature = (graph_json, time_limit))]
fn plan_json(py: Python<'_>, graph_json: &str, time_limit: f64) -> PyResult<String> {
    let g = graph_json.to_string();
    py.detach(move || memplan::api::plan_json(&g, time_limit))
        .map_err(err)
}

/// Checks the plan document against the graph document; returns the
/// checker's report as JSON.
#[pyfunction]
fn check_json(graph_json: &str, plan_json: &str) -> PyResult<String> {
    memplan::api::check_json(graph_json, plan_json).map_err(err)
}

/// The text of a graph or plan file (gzip-compressed when it ends in `.gz`).
#[pyfunction]
fn read_text(path: std::path::PathBuf) -> PyResult<String> {
    memplan::io::read_text(&path).map_err(err)
}

#[pymodule]
fn _memplan(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(plan_json, m)?)?;
    m.add_function(wrap_pyfunction!(check_json, m)?)?;
    m.add_function(wrap_pyfunction!(read_text, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
