//! XLA HLO text → memplan's graph.
//!
//! Reads an `HloModule` as XLA dumps it (`--xla_dump_hlo_as_text`), before
//! or after optimizations, plain or gzip-compressed, and builds the graph of
//! its entry computation (see `docs/hlo.md` for every rule):
//!
//! 1. [`lexer`] splits the text into words, strings and punctuation,
//!    dropping `/*...*/` comments and tracking lines;
//! 2. [`parser`] builds the module: computations, instructions with their
//!    [`shape`]s, operands and the few attributes that matter for memory
//!    (called computations, fusion kind, tuple index, aliasing, `op_name`),
//!    and the header's `is_scheduled`, `input_output_alias`, `buffer_donor`;
//! 3. [`import`] turns the entry computation into ops and tensors: views for
//!    `bitcast`, tuples resolved to their elements, reuse hints where XLA may
//!    write a result into an operand's buffer (elementwise ops, loop fusions
//!    on elementwise parameters, `dynamic-update-slice`/`scatter` in place,
//!    custom-call `output_to_operand_aliasing`, `while` state), and for
//!    `while`/`conditional`/`call` a temporary holding the body's own peak,
//!    computed by importing the body the same way (memoised, recursion and
//!    depth checked);
//!    Each op's FLOPs come from [`flops`] (dots and convolutions from their
//!    shapes, fusions and loops from their bodies);
//! 4. [`report`] reads `Total bytes` from XLA's memory-usage report beside
//!    the file, kept as the reference peak `xla`; a scheduled module's entry
//!    order is kept as the order `xla-order`.
//!
//! Everything is linear in the text's size; no recursion follows the input's
//! nesting except tuple shapes and called computations, both depth-limited,
//! so garbage, truncated files and adversarial nesting give an error naming
//! the line and column, never a panic or unbounded memory.

pub mod assignment;
pub mod flops;
pub mod import;
pub mod lexer;
pub mod parser;
pub mod report;
pub mod schedule;
pub mod shape;

// The estimate of XLA's bytes is a baseline and lives with them; the old
// path stays for the CLI (`memplan::io::hlo::xla_estimate`).
pub use crate::baselines::xla_estimate;

use std::path::{Path, PathBuf};

use serde_json::json;

use crate::error::Error;
use crate::graph::Graph;

pub use import::ImportOptions;
pub use parser::{Module, parse_module};

/// A problem in HLO text, at a line and column (1-based).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{line}:{column}: {msg}")]
pub struct HloError {
    pub line: u32,
    pub column: u32,
    pub msg: String,
}

impl HloError {
    pub fn new(line: u32, column: u32, msg: impl Into<String>) -> Self {
        HloError {
            line,
            column,
            msg: msg.into(),
        }
    }
}

impl From<HloError> for Error {
    /// A parse error with no file yet; [`parse_graph`] fills the path in.
    fn from(e: HloError) -> Self {
        Error::Parse {
            path: PathBuf::new(),
            line: e.line as usize,
            column: e.column as usize,
            msg: e.msg,
        }
    }
}

/// Whether `text` looks like HLO text (starts with `HloModule`).
pub fn looks_like_hlo(text: &str) -> bool {
    text.trim_start().starts_with("HloModule")
}

/// Parses and imports HLO text (no file: no memory-usage report).
pub fn import_str(text: &str, opts: &ImportOptions) -> Result<Graph, Error> {
    let m = parse_module(text)?;
    import::import_module(&m, opts)
}

fn in_file(e: Error, path: &Path) -> Error {
    match e {
        Error::Parse {
            path: p,
            line,
            column,
            msg,
        } if p.as_os_str().is_empty() => Error::Parse {
            path: path.to_path_buf(),
            line,
            column,
            msg,
        },
        other => other.in_file(path),
    }
}

/// Parses and imports the HLO text read from `path`, and reads XLA's
/// memory-usage report beside it when there is one (reference peak `xla`).
pub fn parse_graph(text: &str, path: &Path, opts: &ImportOptions) -> Result<Graph, Error> {
    let mut g = import_str(text, opts).map_err(|e| in_file(e, path))?;
    g.metadata
        .insert("file".into(), json!(path.display().to_string()));
    if let Some((report, total)) = report::find(path)? {
        g.reference_peaks.push(("xla".into(), total));
        g.metadata.insert(
            "memory_usage_report".into(),
            json!(report.display().to_string()),
        );
    }
    Ok(g)
}
