//! NetworkX node-link graphs, the form in which Checkmate's and Moccasin's
//! rematerialization benchmarks are published.
//!
//! Such a file is a `networkx.node_link_data` dump of a DAG: `nodes` (each
//! with an `id`), and `links` (or `edges`, networkx ≥ 3.4) from `source` to
//! `target` (or `"0"` to `"1"`, as Moccasin's random layered graphs have
//! them). Every node is one op with one output: `cost_ram` (or `out_cost`)
//! bytes, produced by the node and read by its successors; `cost_cpu` (or
//! `duration`) is the op's cost; `backward: true` marks backward ops and
//! anything else is forward. That is the memory model of both papers: a
//! value is live from the step that computes it to the last step that reads
//! it, and a value that nothing reads lives only while it is computed.
//!
//! The ops are listed in the order these tools start from: the graph's
//! `order` attribute when it has one, else networkx's `topological_sort`
//! (Kahn's algorithm by generations, nodes and successors in file order).
//! So the program order's peak is the one they scale their budgets from.

use std::collections::HashMap;
use std::path::Path;

use serde_json::{Map, Value};

use crate::error::{Error, GraphError};
use crate::graph::{Graph, Lifetime, OpKind, Role};
use crate::io::json::{self, GraphFile, OpRecord, TensorRecord};

/// Parses node-link JSON text. `path` is only used in messages.
pub fn parse_graph(text: &str, path: &Path) -> Result<Graph, Error> {
    let doc: Map<String, Value> = serde_json::from_str(text).map_err(|e| Error::Parse {
        path: path.to_path_buf(),
        line: e.line(),
        column: e.column(),
        msg: e.to_string(),
    })?;
    let file = to_graph_file(&doc).map_err(|e| Error::from(e).in_file(path))?;
    json::from_file(file).map_err(|e| Error::from(e).in_file(path))
}

fn bad(msg: String) -> GraphError {
    GraphError::Other(msg)
}

/// One node as read: its id, name and attributes.
struct Node {
    id: Value,
    name: String,
    bytes: u64,
    cost: f64,
    backward: bool,
}

fn number(node: &Map<String, Value>, keys: &[&str], i: usize) -> Result<Option<f64>, GraphError> {
    for k in keys {
        if let Some(v) = node.get(*k) {
            let x = v.as_f64().filter(|x| x.is_finite() && *x >= 0.0);
            return x.map(Some).ok_or_else(|| {
                bad(format!(
                    "nodes[{i}]: {k} must be a finite number ≥ 0, found {v}"
                ))
            });
        }
    }
    Ok(None)
}

fn read_node(i: usize, v: &Value) -> Result<Node, GraphError> {
    let node = v
        .as_object()
        .ok_or_else(|| bad(format!("nodes[{i}] is not an object")))?;
    let id = node
        .get("id")
        .cloned()
        .ok_or_else(|| bad(format!("nodes[{i}] has no id")))?;
    let name = match node.get("name") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Number(n)) => format!("node{n}"),
        _ => format!("node{}", key(&id)),
    };
    let bytes = number(node, &["cost_ram", "out_cost"], i)?
        .ok_or_else(|| bad(format!("nodes[{i}] ({name}) has no cost_ram")))?;
    if bytes.fract() != 0.0 || bytes > u64::MAX as f64 {
        return Err(bad(format!(
            "nodes[{i}] ({name}): cost_ram must be a whole number of bytes, found {bytes}"
        )));
    }
    Ok(Node {
        id,
        name,
        bytes: bytes as u64,
        cost: number(node, &["cost_cpu", "duration"], i)?.unwrap_or(0.0),
        backward: node.get("backward") == Some(&Value::Bool(true)),
    })
}

/// A node id as a map key (ids may be numbers or strings).
fn key(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

fn read_links(
    doc: &Map<String, Value>,
    index: &HashMap<String, usize>,
) -> Result<Vec<(usize, usize)>, GraphError> {
    let (field, links) = ["links", "edges"]
        .iter()
        .find_map(|f| doc.get(*f).map(|v| (*f, v)))
        .ok_or_else(|| bad("no links or edges".into()))?;
    let links = links
        .as_array()
        .ok_or_else(|| bad(format!("{field} is not a list")))?;
    let end = |link: &Map<String, Value>, i: usize, names: [&str; 2]| {
        let v = names
            .iter()
            .find_map(|n| link.get(*n))
            .ok_or_else(|| bad(format!("{field}[{i}] has no {}", names[0])))?;
        index
            .get(&key(v))
            .copied()
            .ok_or_else(|| bad(format!("{field}[{i}]: {} {v} is not a node id", names[0])))
    };
    links
        .iter()
        .enumerate()
        .map(|(i, l)| {
            let l = l
                .as_object()
                .ok_or_else(|| bad(format!("{field}[{i}] is not an object")))?;
            Ok((end(l, i, ["source", "0"])?, end(l, i, ["target", "1"])?))
        })
        .collect()
}

/// networkx's `topological_sort`: generations of Kahn's algorithm, each
/// generation in the order its nodes became ready.
fn topological_sort(n: usize, succ: &[Vec<usize>]) -> Result<Vec<usize>, GraphError> {
    let mut indegree = vec![0usize; n];
    for s in succ.iter().flatten() {
        indegree[*s] += 1;
    }
    let mut order = Vec::with_capacity(n);
    let mut generation: Vec<usize> = (0..n).filter(|&v| indegree[v] == 0).collect();
    while !generation.is_empty() {
        let mut next = vec![];
        for &v in &generation {
            for &c in &succ[v] {
                indegree[c] -= 1;
                if indegree[c] == 0 {
                    next.push(c);
                }
            }
        }
        order.append(&mut generation);
        generation = next;
    }
    if order.len() < n {
        let stuck = (0..n).find(|&v| indegree[v] > 0).unwrap_or(0);
        return Err(bad(format!(
            "the graph has a cycle (through node index {stuck})"
        )));
    }
    Ok(order)
}

fn given_order(
    doc: &Map<String, Value>,
    index: &HashMap<String, usize>,
) -> Result<Option<Vec<usize>>, GraphError> {
    let Some(order) = doc.get("graph").and_then(|g| g.get("order")) else {
        return Ok(None);
    };
    let ids = order
        .as_array()
        .ok_or_else(|| bad("graph.order is not a list".into()))?;
    let order = ids
        .iter()
        .map(|v| {
            index
                .get(&key(v))
                .copied()
                .ok_or_else(|| bad(format!("graph.order names {v}, which is not a node id")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    if order.len() != index.len() {
        return Err(bad(format!(
            "graph.order lists {} nodes, the graph has {}",
            order.len(),
            index.len()
        )));
    }
    Ok(Some(order))
}

/// Converts a parsed node-link document to memplan's file form.
pub fn to_graph_file(doc: &Map<String, Value>) -> Result<GraphFile, GraphError> {
    if doc.get("directed") == Some(&Value::Bool(false)) {
        return Err(bad(
            "the graph is undirected; a step is a directed graph".into()
        ));
    }
    if doc.get("multigraph") == Some(&Value::Bool(true)) {
        return Err(bad("multigraphs are not supported".into()));
    }
    let nodes = doc
        .get("nodes")
        .and_then(Value::as_array)
        .ok_or_else(|| bad("nodes is not a list".into()))?;
    let mut nodes = nodes
        .iter()
        .enumerate()
        .map(|(i, v)| read_node(i, v))
        .collect::<Result<Vec<_>, _>>()?;
    let mut index = HashMap::with_capacity(nodes.len());
    for (i, n) in nodes.iter().enumerate() {
        if index.insert(key(&n.id), i).is_some() {
            return Err(bad(format!("nodes[{i}]: id {} appears twice", n.id)));
        }
    }
    dedupe_names(&mut nodes);
    let links = read_links(doc, &index)?;
    let mut succ = vec![vec![]; nodes.len()];
    let mut pred = vec![vec![]; nodes.len()];
    for &(s, t) in &links {
        if s == t {
            return Err(bad(format!("node {} reads its own output", nodes[s].name)));
        }
        succ[s].push(t);
        pred[t].push(s);
    }
    let order = match given_order(doc, &index)? {
        Some(o) => o,
        None => topological_sort(nodes.len(), &succ)?,
    };
    let tensor = |i: usize| format!("{}:0", nodes[i].name);
    let name = doc
        .get("graph")
        .and_then(|g| g.get("name"))
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_string();
    let mut metadata = Map::new();
    metadata.insert("source".into(), "networkx node-link".into());
    Ok(GraphFile {
        format: json::GRAPH_FORMAT.into(),
        version: json::GRAPH_VERSION,
        name,
        tensors: (0..nodes.len())
            .map(|i| TensorRecord {
                id: tensor(i),
                size: nodes[i].bytes,
                align: 1,
                role: Role::default(),
                lifetime: Lifetime::Transient,
                view_of: None,
                dtype: None,
                shape: None,
                space: Default::default(),
            })
            .collect(),
        ops: order
            .iter()
            .map(|&i| OpRecord {
                id: nodes[i].name.clone(),
                kind: if nodes[i].backward {
                    OpKind::Backward
                } else {
                    OpKind::Forward
                },
                op_type: "node".into(),
                inputs: pred[i].iter().map(|&p| tensor(p)).collect(),
                outputs: vec![tensor(i)],
                updates: vec![],
                reuse: vec![],
                after: vec![],
                cost: Some(nodes[i].cost),
                flops: None,
                stream: 0,
                attrs: Map::new(),
            })
            .collect(),
        orders: Default::default(),
        reference_peaks: Default::default(),
        metadata,
    })
}

/// Makes node names unique by appending the node id to repeated ones.
fn dedupe_names(nodes: &mut [Node]) {
    let mut count: HashMap<String, usize> = HashMap::new();
    for n in nodes.iter() {
        *count.entry(n.name.clone()).or_default() += 1;
    }
    for n in nodes.iter_mut() {
        if count[&n.name] > 1 {
            n.name = format!("{}#{}", n.name, key(&n.id));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Graph, Error> {
        parse_graph(text, Path::new("g.json"))
    }

    const CHAIN: &str = r#"{"directed": true, "multigraph": false, "graph": {"name": "t"},
        "nodes": [{"id": 0, "name": "a", "cost_ram": 4, "cost_cpu": 1, "backward": false},
                  {"id": 2, "name": "c", "cost_ram": 1, "cost_cpu": 3, "backward": true},
                  {"id": 1, "name": "b", "cost_ram": 8, "cost_cpu": 2, "backward": false}],
        "links": [{"source": 0, "target": 1}, {"source": 1, "target": 2}, {"source": 0, "target": 2}]}"#;

    #[test]
    fn nodes_become_ops_with_one_output_in_topological_order() {
        let g = parse(CHAIN).unwrap();
        let names: Vec<_> = g
            .program_order()
            .iter()
            .map(|&o| g.op(o).name.as_str())
            .collect();
        assert_eq!(names, ["a", "b", "c"]);
        let c = g.op(g.op_by_name("c").unwrap());
        assert_eq!(c.kind, OpKind::Backward);
        assert_eq!(c.cost, Some(3.0));
        let inputs: Vec<_> = c
            .inputs
            .iter()
            .map(|&t| g.tensor(t).name.as_str())
            .collect();
        assert_eq!(inputs, ["b:0", "a:0"]);
        assert_eq!(
            g.tensor(g.op(g.op_by_name("b").unwrap()).outputs[0]).size,
            8
        );
    }

    #[test]
    fn topological_sort_goes_by_generations_like_networkx() {
        // 0 -> 2, 1 -> 3, 2 -> 3: generations [0, 1], [2], [3].
        let succ = vec![vec![2], vec![3], vec![3], vec![]];
        assert_eq!(topological_sort(4, &succ).unwrap(), [0, 1, 2, 3]);
        let cyc = vec![vec![1], vec![0]];
        assert!(topological_sort(2, &cyc).is_err());
    }

    #[test]
    fn moccasin_random_graph_keys_and_given_order_are_read() {
        let text = r#"{"directed": true, "multigraph": false,
            "graph": {"name": "r", "order": [1, 0]},
            "nodes": [{"id": 0, "out_cost": 5, "duration": 2, "name": 0},
                      {"id": 1, "out_cost": 7, "duration": 1, "name": 1}],
            "links": [{"0": 1, "1": 0}]}"#;
        let g = parse(text).unwrap();
        let first = g.program_order()[0];
        assert_eq!(g.op(first).name, "node1");
        assert_eq!(g.op(first).cost, Some(1.0));
    }

    #[test]
    fn bad_input_is_named() {
        let err = |t: &str| parse(t).unwrap_err().to_string();
        let no_ram = r#"{"nodes": [{"id": 0, "name": "x"}], "links": []}"#;
        assert!(
            err(no_ram).contains("nodes[0] (x) has no cost_ram"),
            "{}",
            err(no_ram)
        );
        let neg = r#"{"nodes": [{"id": 0, "cost_ram": -1}], "links": []}"#;
        assert!(err(neg).contains("cost_ram must be a finite number"));
        let dangling =
            r#"{"nodes": [{"id": 0, "cost_ram": 1}], "links": [{"source": 0, "target": 9}]}"#;
        assert!(
            err(dangling).contains("links[0]: target 9 is not a node id"),
            "{}",
            err(dangling)
        );
        let cycle = r#"{"nodes": [{"id": 0, "cost_ram": 1}, {"id": 1, "cost_ram": 1}],
            "links": [{"source": 0, "target": 1}, {"source": 1, "target": 0}]}"#;
        assert!(err(cycle).contains("cycle"));
        assert!(err(r#"{"nodes": 3, "links": []}"#).contains("nodes is not a list"));
    }
}
