//! Reading and writing graphs and plans.
//!
//! [`load_graph`] reads a graph file of any supported kind, plain or
//! gzip-compressed (`.gz`): memplan's JSON graph format ([`json`]), XLA
//! HLO text ([`hlo`]) or a networkx node-link graph as Checkmate and
//! Moccasin publish theirs ([`nx`]), told apart by content.

pub mod hlo;
pub mod json;
pub mod nx;
pub mod plan_json;

use std::io::Read;
use std::path::Path;

use crate::error::{Error, GraphError};
use crate::graph::Graph;

/// The most bytes a gzip-compressed file may inflate to (1 GiB): far above
/// any graph or plan memplan can plan (a 100,000-op graph is tens of MB),
/// and a guard against a small file that inflates to gigabytes.
pub const MAX_INFLATED_BYTES: u64 = 1 << 30;

/// Reads a file as text, gunzipping it when it starts with the gzip magic
/// (at most [`MAX_INFLATED_BYTES`] of it).
pub fn read_text(path: &Path) -> Result<String, Error> {
    read_text_limited(path, MAX_INFLATED_BYTES)
}

/// [`read_text`], a compressed file inflating to at most `max_inflated`
/// bytes (an error naming the file and the limit beyond).
pub fn read_text_limited(path: &Path, max_inflated: u64) -> Result<String, Error> {
    let bytes = std::fs::read(path).map_err(|source| Error::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let bytes = if bytes.starts_with(&[0x1f, 0x8b]) {
        let mut out = Vec::new();
        flate2::read::MultiGzDecoder::new(&bytes[..])
            .take(max_inflated.saturating_add(1))
            .read_to_end(&mut out)
            .map_err(|source| Error::Io {
                path: path.to_path_buf(),
                source,
            })?;
        if out.len() as u64 > max_inflated {
            return Err(Error::Io {
                path: path.to_path_buf(),
                source: std::io::Error::new(
                    std::io::ErrorKind::FileTooLarge,
                    format!(
                        "the compressed file inflates to more than {max_inflated} bytes, the most memplan reads from one"
                    ),
                ),
            });
        }
        out
    } else {
        bytes
    };
    String::from_utf8(bytes).map_err(|e| Error::Parse {
        path: path.to_path_buf(),
        line: 0,
        column: 0,
        msg: format!(
            "the file is not UTF-8 text (bad byte at offset {})",
            e.utf8_error().valid_up_to()
        ),
    })
}

/// Writes `g` as memplan JSON, gzip-compressed when `path` ends in `.gz`.
pub fn save_graph(g: &Graph, path: &Path) -> Result<(), Error> {
    write_text(path, &json::write_graph(g))
}

/// Writes `text` to `path`, gzip-compressed when `path` ends in `.gz`.
pub fn write_text(path: &Path, text: &str) -> Result<(), Error> {
    use std::io::Write;
    let io_err = |source| Error::Io {
        path: path.to_path_buf(),
        source,
    };
    let file = std::fs::File::create(path).map_err(io_err)?;
    if path.extension().is_some_and(|e| e == "gz") {
        let mut enc = flate2::write::GzEncoder::new(file, flate2::Compression::default());
        enc.write_all(text.as_bytes()).map_err(io_err)?;
        enc.finish().map_err(io_err)?;
    } else {
        let mut f = std::io::BufWriter::new(file);
        f.write_all(text.as_bytes()).map_err(io_err)?;
        f.flush().map_err(io_err)?;
    }
    Ok(())
}

/// Loads a graph file, choosing the reader by its content.
pub fn load_graph(path: &Path) -> Result<Graph, Error> {
    load_graph_with(path, &hlo::ImportOptions::default())
}

/// [`load_graph`], importing an XLA HLO module with `hlo_opts`.
pub fn load_graph_with(path: &Path, hlo_opts: &hlo::ImportOptions) -> Result<Graph, Error> {
    let text = read_text(path)?;
    let start = text.trim_start();
    if start.starts_with('{') {
        let header = json::Header::read(&text, path)?;
        if header.is_node_link() {
            return nx::parse_graph(&text, path);
        }
        return json::parse_with_header(&text, path, header);
    }
    if hlo::looks_like_hlo(&text) {
        return hlo::parse_graph(&text, path, hlo_opts);
    }
    Err(Error::Graph {
        path: Some(path.to_path_buf()),
        source: GraphError::Other(
            "unrecognised graph file: expected memplan JSON or networkx node-link JSON (starting with '{') or XLA HLO text (starting with 'HloModule')".into(),
        ),
    })
}
