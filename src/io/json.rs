//! memplan's JSON graph format, version 1 (documented in
//! `docs/graph-format.md`, schema in `docs/graph-format.schema.json`).

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use crate::error::{Error, GraphError};
use crate::graph::{Graph, GraphBuilder, Lifetime, OpId, OpKind, OpSpec, Role, Space, TensorSpec};

pub const GRAPH_FORMAT: &str = "memplan-graph";
pub const GRAPH_VERSION: u64 = 1;

/// The file as written: tensors and ops referring to each other by id.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct GraphFile {
    pub format: String,
    pub version: u64,
    #[serde(default)]
    pub name: String,
    pub tensors: Vec<TensorRecord>,
    pub ops: Vec<OpRecord>,
    /// Other known orders of the ops, by name (each lists every op id once).
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub orders: std::collections::BTreeMap<String, Vec<String>>,
    /// Peaks other tools reported for this step, in bytes, by name.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub reference_peaks: std::collections::BTreeMap<String, u64>,
    /// Free-form information about where the graph came from.
    #[serde(default, skip_serializing_if = "serde_json::Map::is_empty")]
    pub metadata: serde_json::Map<String, serde_json::Value>,
}

fn one() -> u64 {
    1
}
fn is_one(x: &u64) -> bool {
    *x == 1
}
fn is_zero(x: &u32) -> bool {
    *x == 0
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TensorRecord {
    pub id: String,
    pub size: u64,
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub align: u64,
    #[serde(default)]
    pub role: Role,
    #[serde(default)]
    pub lifetime: Lifetime,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub view_of: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dtype: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shape: Option<Vec<u64>>,
    /// `"host"` for a tensor in host memory (offloaded); absent: the device.
    #[serde(default, skip_serializing_if = "is_device")]
    pub space: Space,
}
fn is_device(s: &Space) -> bool {
    *s == Space::Device
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ReuseRecord {
    pub output: String,
    pub input: String,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct OpRecord {
    pub id: String,
    #[serde(default)]
    pub kind: OpKind,
    #[serde(rename = "type", default, skip_serializing_if = "String::is_empty")]
    pub op_type: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub inputs: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub outputs: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub updates: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub reuse: Vec<ReuseRecord>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub after: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flops: Option<f64>,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub stream: u32,
    #[serde(default, skip_serializing_if = "serde_json::Map::is_empty")]
    pub attrs: serde_json::Map<String, serde_json::Value>,
}

/// The top-level keys a JSON graph file is told apart by: memplan's
/// `format` and `version`, or a networkx node-link graph's `nodes` and
/// `links` (or `edges`). Read in one pass that skips everything else.
#[derive(Deserialize)]
pub struct Header {
    format: Option<String>,
    version: Option<u64>,
    nodes: Option<serde::de::IgnoredAny>,
    links: Option<serde::de::IgnoredAny>,
    edges: Option<serde::de::IgnoredAny>,
}

fn parse_error(path: &std::path::Path, e: serde_json::Error) -> Error {
    Error::Parse {
        path: path.to_path_buf(),
        line: e.line(),
        column: e.column(),
        msg: e.to_string(),
    }
}

impl Header {
    /// Reads the header of JSON text. `path` is only used in messages.
    pub fn read(text: &str, path: &std::path::Path) -> Result<Header, Error> {
        serde_json::from_str(text).map_err(|e| parse_error(path, e))
    }

    /// A networkx node-link graph (`crate::io::nx`) rather than memplan's
    /// format: it has `nodes` and `links` or `edges`, and no `format`.
    pub fn is_node_link(&self) -> bool {
        self.format.is_none()
            && self.nodes.is_some()
            && (self.links.is_some() || self.edges.is_some())
    }
}

/// Parses a graph from JSON text. `path` is only used in messages.
pub fn parse_graph(text: &str, path: &std::path::Path) -> Result<Graph, Error> {
    // The header first, so a newer version is reported as such rather than
    // as an unknown field.
    parse_with_header(text, path, Header::read(text, path)?)
}

/// [`parse_graph`] with the header already read.
pub fn parse_with_header(
    text: &str,
    path: &std::path::Path,
    header: Header,
) -> Result<Graph, Error> {
    let fmt = header.format.unwrap_or_default();
    if fmt != GRAPH_FORMAT {
        return Err(Error::from(GraphError::WrongFormat {
            found: fmt,
            expected: GRAPH_FORMAT.into(),
        })
        .in_file(path));
    }
    let version = header.version.unwrap_or(0);
    if version != GRAPH_VERSION {
        return Err(Error::from(GraphError::UnsupportedVersion {
            found: version,
            supported: GRAPH_VERSION,
        })
        .in_file(path));
    }
    let file: GraphFile = serde_json::from_str(text).map_err(|e| parse_error(path, e))?;
    from_file(file).map_err(|e| Error::from(e).in_file(path))
}

/// Builds a graph from its file form, resolving ids.
pub fn from_file(file: GraphFile) -> Result<Graph, GraphError> {
    let mut b = GraphBuilder::new(file.name);
    let mut tid: HashMap<&str, u32> = HashMap::with_capacity(file.tensors.len());
    for (i, t) in file.tensors.iter().enumerate() {
        if tid.insert(t.id.as_str(), i as u32).is_some() {
            return Err(GraphError::DuplicateTensor(t.id.clone()));
        }
    }
    let mut oid: HashMap<&str, u32> = HashMap::with_capacity(file.ops.len());
    for (i, o) in file.ops.iter().enumerate() {
        if oid.insert(o.id.as_str(), i as u32).is_some() {
            return Err(GraphError::DuplicateOp(o.id.clone()));
        }
    }
    for t in &file.tensors {
        let view_of = match &t.view_of {
            None => None,
            Some(base) => Some(crate::graph::TensorId(*tid.get(base.as_str()).ok_or_else(
                || GraphError::UnknownViewBase {
                    tensor: t.id.clone(),
                    base: base.clone(),
                },
            )?)),
        };
        b.add_tensor(TensorSpec {
            name: t.id.clone(),
            size: t.size,
            align: t.align,
            role: t.role,
            lifetime: t.lifetime,
            view_of,
            dtype: t.dtype.clone(),
            shape: t.shape.clone(),
            space: t.space,
        });
    }
    for o in &file.ops {
        let resolve = |field: &'static str, names: &[String]| {
            names
                .iter()
                .map(|n| {
                    tid.get(n.as_str())
                        .map(|&i| crate::graph::TensorId(i))
                        .ok_or_else(|| GraphError::UnknownTensor {
                            op: o.id.clone(),
                            field,
                            tensor: n.clone(),
                        })
                })
                .collect::<Result<Vec<_>, _>>()
        };
        let mut spec = OpSpec::new(o.id.clone(), o.kind, o.op_type.clone());
        spec.inputs = resolve("inputs", &o.inputs)?;
        spec.outputs = resolve("outputs", &o.outputs)?;
        spec.updates = resolve("updates", &o.updates)?;
        for r in &o.reuse {
            let out = resolve("reuse.output", std::slice::from_ref(&r.output))?[0];
            let inp = resolve("reuse.input", std::slice::from_ref(&r.input))?[0];
            spec.reuse.push((out, inp));
        }
        spec.after = o
            .after
            .iter()
            .map(|n| {
                oid.get(n.as_str())
                    .map(|&i| OpId(i))
                    .ok_or_else(|| GraphError::UnknownOp {
                        op: o.id.clone(),
                        target: n.clone(),
                    })
            })
            .collect::<Result<_, _>>()?;
        spec.cost = o.cost;
        spec.flops = o.flops;
        spec.stream = o.stream;
        spec.attrs = o.attrs.clone();
        b.add_op(spec);
    }
    let mut g = b.build()?;
    for (name, ids) in &file.orders {
        let order = ids
            .iter()
            .map(|n| {
                g.op_by_name(n).ok_or_else(|| {
                    GraphError::Other(format!("order {name:?} names unknown op {n:?}"))
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        g.add_order(name.clone(), order)?;
    }
    g.reference_peaks = file.reference_peaks.into_iter().collect();
    g.metadata = file.metadata;
    Ok(g)
}

/// The file form of a graph (ops in program order as given).
pub fn to_file(g: &Graph) -> GraphFile {
    let tname = |t: crate::graph::TensorId| g.tensor(t).name.clone();
    let names = |ts: &[crate::graph::TensorId]| ts.iter().map(|&t| tname(t)).collect::<Vec<_>>();
    GraphFile {
        format: GRAPH_FORMAT.into(),
        version: GRAPH_VERSION,
        name: g.name.clone(),
        tensors: g
            .tensors()
            .iter()
            .map(|t| TensorRecord {
                id: t.name.clone(),
                size: t.size,
                align: t.align,
                role: t.role,
                lifetime: t.lifetime,
                view_of: t.view_of.map(tname),
                dtype: t.dtype.clone(),
                shape: t.shape.clone(),
                space: t.space,
            })
            .collect(),
        ops: g
            .ops()
            .iter()
            .map(|o| OpRecord {
                id: o.name.clone(),
                kind: o.kind,
                op_type: o.op_type.clone(),
                inputs: names(&o.inputs),
                outputs: names(&o.outputs),
                updates: names(&o.updates),
                reuse: o
                    .reuse
                    .iter()
                    .map(|&(out, inp)| ReuseRecord {
                        output: tname(out),
                        input: tname(inp),
                    })
                    .collect(),
                after: o.after.iter().map(|&a| g.op(a).name.clone()).collect(),
                cost: o.cost,
                flops: o.flops,
                stream: o.stream,
                attrs: o.attrs.clone(),
            })
            .collect(),
        orders: g
            .extra_orders
            .iter()
            .map(|(n, o)| (n.clone(), o.iter().map(|&x| g.op(x).name.clone()).collect()))
            .collect(),
        reference_peaks: g.reference_peaks.iter().cloned().collect(),
        metadata: g.metadata.clone(),
    }
}

/// Writes a graph as JSON text.
pub fn write_graph(g: &Graph) -> String {
    serde_json::to_string_pretty(&to_file(g)).expect("graph serializes")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn err(text: &str) -> String {
        parse_graph(text, Path::new("g.json"))
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn round_trips() {
        let g = crate::models::mlp::build(&crate::models::mlp::MlpConfig::default()).unwrap();
        let text = write_graph(&g);
        let h = parse_graph(&text, Path::new("x.json")).unwrap();
        assert_eq!(to_file(&g), to_file(&h));
    }

    #[test]
    fn clear_errors() {
        assert!(err("{").starts_with("g.json:1:1:"), "{}", err("{"));
        assert!(
            err(r#"{"format":"memplan-graph","version":7,"tensors":[],"ops":[]}"#)
                .contains("unsupported format version 7")
        );
        let e = err(
            r#"{"format":"memplan-graph","version":1,"tensors":[{"id":"a","size":1}],
            "ops":[{"id":"o","inputs":["zz"]}]}"#,
        );
        assert!(
            e.contains("g.json") && e.contains("\"o\"") && e.contains("\"zz\""),
            "{e}"
        );
        let e = err(
            r#"{"format":"memplan-graph","version":1,"tensors":[{"id":"a","size":1},{"id":"a","size":2}],"ops":[]}"#,
        );
        assert!(e.contains("defined twice"), "{e}");
        let e = err(
            r#"{"format":"memplan-graph","version":1,"tensors":[{"id":"a","size":-1}],"ops":[]}"#,
        );
        assert!(e.starts_with("g.json:1:"), "{e}");
    }
}
