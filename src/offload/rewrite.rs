//! The step with its copies: the graph the plan of an offload is made for,
//! checked and run like any other.
//!
//! For each offloaded tensor `T`:
//! - a step input offloaded lives in host memory under its own name (its
//!   space becomes `host`); any other gets a host tensor `offload.T`,
//!   written by its first copy to the host;
//! - its first residency keeps `T` (a step input's is reloaded too), each
//!   later one is a new device tensor `reload<j>.T`, written by a copy
//!   to the device; the ops of each residency read and write that
//!   residency's tensor;
//! - a copy to the host is `offload<j>.T` (op type
//!   [`crate::graph::COPY_TO_HOST`]), a copy to the device `reload<j>.T`
//!   ([`crate::graph::COPY_TO_DEVICE`]).
//!
//! The ops are listed in the new order (the copies where the search put
//! them, copies to the host before copies to the device at one place), so
//! the graph's program order is the plan's order.

use std::collections::HashMap;

use crate::error::Error;
use crate::graph::{
    COPY_TO_DEVICE, COPY_TO_HOST, Graph, GraphBuilder, Lifetime, OpId, OpKind, OpSpec, Role, Space,
    TensorId, TensorSpec,
};

use super::choose::{Candidate, Decision, TensorPlan};

/// The graph with the copies of `plans`, and its order (module docs).
pub(super) fn rewrite(
    g: &Graph,
    order: &[OpId],
    cands: &[Candidate],
    decisions: &[Decision],
    plans: &[TensorPlan],
) -> Result<(Graph, Vec<OpId>), Error> {
    let n = order.len();
    let mut b = GraphBuilder::new(g.name.clone());
    for x in g.tensors() {
        b.add_tensor(TensorSpec::from(x));
    }
    // (place, original tensor) -> the residency's tensor.
    let mut rename: HashMap<(usize, TensorId), TensorId> = HashMap::new();
    // Copies before each place: (to_host, spec).
    let mut at: Vec<Vec<(bool, OpSpec)>> = vec![Vec::new(); n + 1];
    for ((c, d), tp) in cands.iter().zip(decisions).zip(plans) {
        if !d.offloads() {
            continue;
        }
        let x = g.tensor(c.t);
        let residencies = tp.residency_of_use.last().map_or(1, |r| r + 1);
        let host = if d.host_home {
            b.tensor_spec_mut(c.t).space = Space::Host;
            c.t
        } else {
            b.add_tensor(TensorSpec {
                name: format!("offload.{}", x.name),
                lifetime: Lifetime::Transient,
                view_of: None,
                space: Space::Host,
                ..TensorSpec::from(x)
            })
        };
        let device: Vec<TensorId> = (0..residencies)
            .map(|j| {
                if j == 0 && !d.host_home {
                    c.t
                } else {
                    b.add_tensor(TensorSpec {
                        name: format!("reload{j}.{}", x.name),
                        lifetime: Lifetime::Transient,
                        view_of: None,
                        space: Space::Device,
                        // A copy of the step's data is not an input the
                        // caller writes.
                        role: if x.role == Role::Input {
                            Role::Activation
                        } else {
                            x.role
                        },
                        ..TensorSpec::from(x)
                    })
                }
            })
            .collect();
        for (i, &u) in c.uses.iter().enumerate() {
            rename.insert((u, c.t), device[tp.residency_of_use[i]]);
        }
        copies(x, d.host_home, host, &device, tp, &mut at);
    }
    let mut new_id = vec![OpId(u32::MAX); g.num_ops()];
    let mut new_order = Vec::new();
    for (p, copies) in at.iter_mut().enumerate() {
        copies.sort_by_key(|(to_host, _)| !*to_host);
        for (_, spec) in copies.drain(..) {
            new_order.push(b.add_op(spec));
        }
        if p == n {
            break;
        }
        let o = order[p];
        let mut spec = OpSpec::from(g.op(o));
        let r = |t: TensorId| {
            rename
                .get(&(p, g.root(t)))
                .copied()
                .filter(|_| g.root(t) == t)
                .unwrap_or(t)
        };
        spec.inputs = spec.inputs.iter().map(|&t| r(t)).collect();
        spec.outputs = spec.outputs.iter().map(|&t| r(t)).collect();
        spec.updates = spec.updates.iter().map(|&t| r(t)).collect();
        spec.reuse = spec.reuse.iter().map(|&(a, i)| (r(a), r(i))).collect();
        spec.after = spec.after.iter().map(|a| new_id[a.index()]).collect();
        let id = b.add_op(spec);
        new_id[o.index()] = id;
        new_order.push(id);
    }
    let mut out = b.build().map_err(|e| {
        Error::Internal(format!(
            "the step with its offload copies is not a valid graph: {e}"
        ))
    })?;
    out.metadata = g.metadata.clone();
    Ok((out, new_order))
}

/// The copies of one offloaded tensor `x` (host tensor `host`, residency
/// tensors `device`), each added to the place the search gave it.
fn copies(
    x: &crate::graph::Tensor,
    host_home: bool,
    host: TensorId,
    device: &[TensorId],
    tp: &TensorPlan,
    at: &mut [Vec<(bool, OpSpec)>],
) {
    let mut host_written = host_home;
    let mut copies = tp.copies.clone();
    copies.sort_by_key(|c| (c.residency, !c.to_host));
    for cp in copies {
        let dev = device[cp.residency];
        let spec = if cp.to_host {
            let s = OpSpec::new(
                format!("offload{}.{}", cp.residency, x.name),
                OpKind::Other,
                COPY_TO_HOST,
            )
            .inputs([dev]);
            if host_written {
                s.updates([host])
            } else {
                host_written = true;
                s.outputs([host])
            }
        } else {
            OpSpec::new(
                format!("reload{}.{}", cp.residency, x.name),
                OpKind::Other,
                COPY_TO_DEVICE,
            )
            .inputs([host])
            .outputs([dev])
        };
        let elements = x.shape.as_ref().map_or_else(
            || x.size / crate::cost::dtype_bytes(x.dtype.as_deref()).max(1),
            |s| s.iter().product(),
        );
        at[cp.before].push((
            cp.to_host,
            spec.attr("bytes", x.size).attr("elements", elements),
        ));
    }
}
