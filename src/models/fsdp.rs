//! ZeRO-3 / FSDP: one rank's training step when parameters, gradients and
//! optimizer state are sharded over `W` ranks.
//!
//! [`shard`] rewrites a single-device step (any graph whose parameters are
//! updated by one `adam`/`adamw` op each, as the GPT-2 and MLP builders
//! make) into the step every rank runs, data parallel, on its own batch:
//!
//! - Parameters are grouped into *units* (by default the first dotted
//!   component of the name, with the next one when it is a list index:
//!   `h3.attn.c_attn.weight` → `h3`, `layers.3.attention.wo` → `layers.3`,
//!   `wte` → `wte`), as PyTorch FSDP wraps modules. A unit's parameters are laid end to end
//!   in one flat buffer (each segment starting on a 256-byte boundary),
//!   padded to a multiple of `W`; each rank holds one shard of `S` elements
//!   of the flat parameter and of its Adam moments (persistent).
//! - Before a run of ops that use a unit's parameters, an `all_gather`
//!   (kind collective, stream 1) fills a planned buffer of `W·S` elements
//!   (role communication) and a `view` op cuts it into one view per
//!   parameter; the ops read the views. A new gather starts whenever ops of
//!   another unit ran since the unit's last use — so a layer is gathered
//!   once before its forward and again before its backward, and the buffer
//!   dies in between (the planner sees all of it).
//! - After the last op that produces a unit's gradients, a `pack` copies
//!   them into a flat buffer (zero padding) and a `reduce_scatter` (average
//!   over ranks) leaves this rank's shard of the averaged gradient.
//! - The updates become one Adam/AdamW per unit on the shards, with the
//!   hyper-parameters of the original updates and `init_segments` telling
//!   the executor how the flat shard is initialized (the same values as the
//!   unsharded parameters). Global-norm clipping becomes a `grad_norm` of
//!   the squared norm of the local shards and an `all_reduce` (sum).
//!
//! The loss is each rank's mean over its own batch; gradients are averaged
//! over ranks, so `W` ranks with batch `b` each compute the same update as
//! one device with batch `W·b` (up to float rounding).

use std::collections::HashMap;

use serde_json::{Value, json};

use crate::error::Error;
use crate::graph::{
    Graph, GraphBuilder, Lifetime, OpId, OpKind, OpSpec, Role, TensorId, TensorSpec,
};

/// Byte alignment of each parameter's segment in a flat buffer.
pub const SEGMENT_ALIGN_BYTES: u64 = 256;
/// The stream collectives are issued on.
pub const COMM_STREAM: u32 = 1;

/// The default unit of a parameter: the first dotted component of its
/// name, with the second when that is a number (a module list's index, as
/// in `layers.3.attention.wo` → `layers.3`).
pub fn default_unit(name: &str) -> String {
    let mut parts = name.split('.');
    let first = parts.next().unwrap_or(name);
    match parts.next() {
        Some(i) if !i.is_empty() && i.bytes().all(|b| b.is_ascii_digit()) => format!("{first}.{i}"),
        _ => first.to_string(),
    }
}

fn invalid(why: impl Into<String>) -> Error {
    Error::Invalid(format!("fsdp: {}", why.into()))
}

/// A parameter with the ops and tensors around it.
struct Param {
    w: TensorId,
    grad: TensorId,
    m: TensorId,
    v: TensorId,
    update: OpId,
}

/// A flat unit of parameters.
struct Unit {
    name: String,
    params: Vec<usize>,
    /// Element offset of each parameter in the flat buffer.
    offsets: Vec<u64>,
    /// Shard elements per rank.
    shard: u64,
    dtype: String,
    elem_bytes: u64,
    align: u64,
    /// New tensors.
    shard_t: TensorId,
    m_t: TensorId,
    v_t: TensorId,
    /// The op (old id) after which the gradients are complete.
    last_grad_op: OpId,
}

/// Hyper-parameters that must agree within a unit.
const SHARED_ATTRS: [&str; 8] = [
    "lr",
    "beta1",
    "beta2",
    "eps",
    "weight_decay",
    "step",
    "clip",
    "layers",
];

/// Shards `g` over `world` ranks with [`default_unit`]; see the module docs.
pub fn shard(g: &Graph, world: u64) -> Result<Graph, Error> {
    shard_with(g, world, &default_unit)
}

/// Shards `g` over `world` ranks, grouping parameters by `unit_of(name)`.
pub fn shard_with(g: &Graph, world: u64, unit_of: &dyn Fn(&str) -> String) -> Result<Graph, Error> {
    if world == 0 || world > 1 << 16 {
        return Err(invalid(format!(
            "world size must be in 1..=65536, got {world}"
        )));
    }
    // Parameters and their updates.
    let mut update_of: HashMap<TensorId, OpId> = HashMap::new();
    for o in g.op_ids() {
        let op = g.op(o);
        if op.kind == OpKind::Optimizer && matches!(op.op_type.as_str(), "adam" | "adamw") {
            let w = *op
                .updates
                .first()
                .ok_or_else(|| invalid(format!("update {:?} updates nothing", op.name)))?;
            if update_of.insert(w, o).is_some() {
                return Err(invalid(format!(
                    "parameter {:?} has two update ops",
                    g.tensor(w).name
                )));
            }
        }
    }
    let mut params = Vec::new();
    for t in g.tensor_ids() {
        let x = g.tensor(t);
        if x.role != Role::Parameter || x.view_of.is_some() {
            continue;
        }
        let o = *update_of.get(&t).ok_or_else(|| {
            invalid(format!(
                "parameter {:?} has no adam/adamw update op",
                x.name
            ))
        })?;
        let op = g.op(o);
        if op.updates.len() != 3
            || op.inputs.is_empty()
            || op.inputs.len() > 2
            || op.outputs.len() > 1
        {
            return Err(invalid(format!(
                "update {:?} must read [grad, (norm)], write at most one temporary and update [param, m, v]",
                op.name
            )));
        }
        params.push(Param {
            w: t,
            grad: op.inputs[0],
            m: op.updates[1],
            v: op.updates[2],
            update: o,
        });
    }
    if params.is_empty() {
        return Err(invalid("the graph has no parameters to shard"));
    }
    let grad_norm_ops: Vec<OpId> = g
        .op_ids()
        .filter(|&o| g.op(o).op_type == "grad_norm")
        .collect();
    let max_norm = grad_norm_ops.first().map(|&o| {
        g.op(o)
            .attrs
            .get("max_norm")
            .cloned()
            .unwrap_or(Value::Null)
    });

    let mut pos = vec![0usize; g.num_ops()];
    for (i, &o) in g.program_order().iter().enumerate() {
        pos[o.index()] = i;
    }

    // Units, in order of their first parameter.
    let mut b = GraphBuilder::new(format!("{}-fsdp{world}", g.name));
    let mut units: Vec<Unit> = Vec::new();
    let mut unit_index: HashMap<String, usize> = HashMap::new();
    let mut unit_of_param: HashMap<TensorId, usize> = HashMap::new();
    for (pi, p) in params.iter().enumerate() {
        let name = unit_of(&g.tensor(p.w).name);
        let ui = *unit_index.entry(name.clone()).or_insert_with(|| {
            units.push(Unit {
                name,
                params: Vec::new(),
                offsets: Vec::new(),
                shard: 0,
                dtype: String::new(),
                elem_bytes: 0,
                align: 1,
                shard_t: TensorId(0),
                m_t: TensorId(0),
                v_t: TensorId(0),
                last_grad_op: OpId(0),
            });
            units.len() - 1
        });
        units[ui].params.push(pi);
        unit_of_param.insert(p.w, ui);
    }
    for u in &mut units {
        let first = &params[u.params[0]];
        let x0 = g.tensor(first.w);
        u.dtype = x0
            .dtype
            .clone()
            .ok_or_else(|| invalid(format!("parameter {:?} has no dtype", x0.name)))?;
        let elements = |t: TensorId| -> Result<u64, Error> {
            let x = g.tensor(t);
            x.shape
                .as_ref()
                .map(|s| s.iter().product())
                .ok_or_else(|| invalid(format!("parameter {:?} has no shape", x.name)))
        };
        let n0 = elements(first.w)?.max(1);
        u.elem_bytes = (x0.size / n0).max(1);
        u.align = x0.align.max(1);
        let seg_align = (SEGMENT_ALIGN_BYTES / u.elem_bytes).max(1);
        let mut end = 0u64;
        let upd0 = g.op(first.update);
        for &pi in &u.params {
            let p = &params[pi];
            let x = g.tensor(p.w);
            if x.dtype.as_deref() != Some(u.dtype.as_str()) {
                return Err(invalid(format!(
                    "unit {:?} mixes dtypes ({:?} is {:?}, {:?} is {:?})",
                    u.name, x0.name, u.dtype, x.name, x.dtype
                )));
            }
            let upd = g.op(p.update);
            if upd.op_type != upd0.op_type
                || SHARED_ATTRS
                    .iter()
                    .any(|k| upd.attrs.get(*k) != upd0.attrs.get(*k))
            {
                return Err(invalid(format!(
                    "unit {:?}: updates {:?} and {:?} differ in optimizer or hyper-parameters",
                    u.name, upd0.name, upd.name
                )));
            }
            let off = end.div_ceil(seg_align) * seg_align;
            u.offsets.push(off);
            end = off + elements(p.w)?;
        }
        u.shard = end.div_ceil(world).div_ceil(seg_align) * seg_align;
        u.last_grad_op = u
            .params
            .iter()
            .filter_map(|&pi| g.tensor(params[pi].grad).producer)
            .max_by_key(|o| pos[o.index()])
            .ok_or_else(|| invalid(format!("unit {:?}: no op produces its gradients", u.name)))?;
    }

    // Old tensors that do not carry over: parameters, their moments, the
    // updates' temporaries, the gradient norm.
    let mut dropped = vec![false; g.num_tensors()];
    for p in &params {
        dropped[p.w.index()] = true;
        dropped[p.m.index()] = true;
        dropped[p.v.index()] = true;
        for &t in &g.op(p.update).outputs {
            dropped[t.index()] = true;
        }
    }
    for &o in &grad_norm_ops {
        for &t in &g.op(o).outputs {
            dropped[t.index()] = true;
        }
    }
    let mut tmap: Vec<Option<TensorId>> = vec![None; g.num_tensors()];
    for t in g.tensor_ids() {
        if dropped[t.index()] {
            continue;
        }
        let x = g.tensor(t);
        let view_of = match x.view_of {
            None => None,
            Some(base) => Some(tmap[base.index()].ok_or_else(|| {
                invalid(format!(
                    "tensor {:?} views {:?}, which sharding replaces (views must follow their base and not view parameters)",
                    x.name,
                    g.tensor(base).name
                ))
            })?),
        };
        tmap[t.index()] = Some(b.add_tensor(TensorSpec {
            name: x.name.clone(),
            size: x.size,
            align: x.align,
            role: x.role,
            lifetime: x.lifetime,
            view_of,
            dtype: x.dtype.clone(),
            shape: x.shape.clone(),
        }));
    }
    let flat = |b: &mut GraphBuilder, u: &Unit, name: String, elements: u64, role: Role| {
        b.add_tensor(
            TensorSpec::new(name, elements * u.elem_bytes)
                .role(role)
                .align(u.align)
                .dtype(u.dtype.clone())
                .shape([elements]),
        )
    };
    for u in &mut units {
        let s = u.shard;
        let uu: &Unit = u;
        let shard_t = flat(
            &mut b,
            uu,
            format!("{}.flat_param.shard", uu.name),
            s,
            Role::Parameter,
        );
        let m_t = flat(
            &mut b,
            uu,
            format!("{}.flat_param.shard.adam_m", uu.name),
            s,
            Role::OptimizerState,
        );
        let v_t = flat(
            &mut b,
            uu,
            format!("{}.flat_param.shard.adam_v", uu.name),
            s,
            Role::OptimizerState,
        );
        for t in [shard_t, m_t, v_t] {
            b.tensor_spec_mut(t).lifetime = Lifetime::Persistent;
        }
        u.shard_t = shard_t;
        u.m_t = m_t;
        u.v_t = v_t;
    }

    // The ops, in program order, with gathers before runs of uses and
    // reduce-scatters after the last gradient.
    let skip: Vec<bool> = g
        .op_ids()
        .map(|o| {
            let op = g.op(o);
            op.op_type == "grad_norm" || update_of.values().any(|&u| u == o)
        })
        .collect();
    let mut omap: Vec<Option<OpId>> = vec![None; g.num_ops()];
    let mut open: Vec<Option<Vec<TensorId>>> = vec![None; units.len()];
    let mut gathers = vec![0usize; units.len()];
    let mut prev_units: Vec<usize> = Vec::new();
    let mut grad_shards: Vec<TensorId> = vec![TensorId(0); units.len()];
    for &o in g.program_order() {
        if skip[o.index()] {
            continue;
        }
        let op = g.op(o);
        let mut used: Vec<usize> = Vec::new();
        for &t in &op.inputs {
            if let Some(&ui) = unit_of_param.get(&t)
                && !used.contains(&ui)
            {
                used.push(ui);
            }
        }
        for &t in op.outputs.iter().chain(&op.updates) {
            if unit_of_param.contains_key(&t) {
                return Err(invalid(format!(
                    "op {:?} writes parameter {:?}; only its update may",
                    op.name,
                    g.tensor(t).name
                )));
            }
        }
        for &ui in &used {
            if open[ui].is_some() && prev_units.contains(&ui) {
                continue;
            }
            let u = &units[ui];
            let k = gathers[ui];
            gathers[ui] += 1;
            let full = world * u.shard;
            let gathered = flat(
                &mut b,
                u,
                format!("{}.flat_param.gathered{k}", u.name),
                full,
                Role::Communication,
            );
            b.add_op(
                OpSpec::new(
                    format!("{}.all_gather{k}", u.name),
                    OpKind::Collective,
                    "all_gather",
                )
                .inputs([u.shard_t])
                .outputs([gathered])
                .stream(COMM_STREAM)
                .attr("world_size", world)
                .attr("elements", full),
            );
            let views: Vec<TensorId> = u
                .params
                .iter()
                .map(|&pi| {
                    let x = g.tensor(params[pi].w);
                    b.add_tensor(TensorSpec {
                        name: format!("{}.gathered{k}", x.name),
                        size: x.size,
                        align: x.align,
                        role: Role::Parameter,
                        lifetime: Lifetime::Transient,
                        view_of: Some(gathered),
                        dtype: x.dtype.clone(),
                        shape: x.shape.clone(),
                    })
                })
                .collect();
            b.add_op(
                OpSpec::new(format!("{}.unflatten{k}", u.name), OpKind::Other, "view")
                    .inputs([gathered])
                    .outputs(views.iter().copied())
                    .attr("offsets", json!(u.offsets)),
            );
            open[ui] = Some(views);
        }
        if !used.is_empty() {
            prev_units = used;
        }
        let map_t = |t: TensorId| -> Result<TensorId, Error> {
            if let Some(&ui) = unit_of_param.get(&t) {
                let pi = units[ui]
                    .params
                    .iter()
                    .position(|&pi| params[pi].w == t)
                    .expect("in its unit");
                return Ok(open[ui].as_ref().expect("gathered above")[pi]);
            }
            tmap[t.index()].ok_or_else(|| {
                invalid(format!(
                    "op {:?} uses {:?}, which sharding replaces",
                    op.name,
                    g.tensor(t).name
                ))
            })
        };
        let map_all = |v: &[TensorId]| v.iter().map(|&t| map_t(t)).collect::<Result<Vec<_>, _>>();
        let mut spec = OpSpec::new(op.name.clone(), op.kind, op.op_type.clone())
            .inputs(map_all(&op.inputs)?)
            .outputs(map_all(&op.outputs)?)
            .updates(map_all(&op.updates)?)
            .stream(op.stream);
        for &(out, inp) in &op.reuse {
            spec = spec.reuse(map_t(out)?, map_t(inp)?);
        }
        for &a in &op.after {
            spec = spec.after([omap[a.index()].ok_or_else(|| {
                invalid(format!(
                    "op {:?} must follow {:?}, which sharding replaces",
                    op.name,
                    g.op(a).name
                ))
            })?]);
        }
        spec.cost = op.cost;
        spec.attrs = op.attrs.clone();
        omap[o.index()] = Some(b.add_op(spec));

        for (ui, u) in units.iter().enumerate() {
            if u.last_grad_op != o {
                continue;
            }
            let full = world * u.shard;
            let flat_grad = flat(
                &mut b,
                u,
                format!("{}.flat_grad", u.name),
                full,
                Role::Communication,
            );
            let grads = u
                .params
                .iter()
                .map(|&pi| map_t(params[pi].grad))
                .collect::<Result<Vec<_>, _>>()?;
            b.add_op(
                OpSpec::new(format!("{}.pack_grads", u.name), OpKind::Backward, "pack")
                    .inputs(grads)
                    .outputs([flat_grad])
                    .attr("offsets", json!(u.offsets))
                    .attr("elements", full),
            );
            let gs = flat(
                &mut b,
                u,
                format!("{}.flat_grad.shard", u.name),
                u.shard,
                Role::Gradient,
            );
            b.add_op(
                OpSpec::new(
                    format!("{}.reduce_scatter", u.name),
                    OpKind::Collective,
                    "reduce_scatter",
                )
                .inputs([flat_grad])
                .outputs([gs])
                .stream(COMM_STREAM)
                .attr("world_size", world)
                .attr("op", "avg")
                .attr("elements", full),
            );
            grad_shards[ui] = gs;
        }
    }

    // Clipping: the squared norm of the local shards, summed over ranks.
    let norm = match &max_norm {
        None => None,
        Some(max) => {
            let t = b.add_tensor(
                TensorSpec::new("grad_norm_squared", 4)
                    .role(Role::Temporary)
                    .align(units[0].align)
                    .dtype("f32")
                    .shape([1]),
            );
            b.add_op(
                OpSpec::new("clip_grad_norm", OpKind::Optimizer, "grad_norm")
                    .inputs(grad_shards.iter().copied())
                    .outputs([t])
                    .attr("max_norm", max.clone())
                    .attr("squared", true),
            );
            b.add_op(
                OpSpec::new("grad_norm.all_reduce", OpKind::Collective, "all_reduce")
                    .updates([t])
                    .stream(COMM_STREAM)
                    .attr("world_size", world)
                    .attr("op", "sum")
                    .attr("elements", 1),
            );
            Some(t)
        }
    };
    for (ui, u) in units.iter().enumerate() {
        let first = g.op(params[u.params[0]].update);
        let mut inputs = vec![grad_shards[ui]];
        inputs.extend(norm);
        let mut spec = OpSpec::new(
            format!("{}.update", u.name),
            OpKind::Optimizer,
            first.op_type.clone(),
        )
        .inputs(inputs)
        .updates([u.shard_t, u.m_t, u.v_t]);
        if !first.outputs.is_empty() {
            let d = flat(
                &mut b,
                u,
                format!("{}.flat_param.shard.adam_denom", u.name),
                u.shard,
                Role::Temporary,
            );
            spec = spec.outputs([d]);
        }
        let mut attrs = serde_json::Map::new();
        for k in SHARED_ATTRS {
            if let Some(v) = first.attrs.get(k) {
                attrs.insert(k.to_string(), v.clone());
            }
        }
        let segments: Vec<Value> = u
            .params
            .iter()
            .zip(&u.offsets)
            .map(|(&pi, &off)| {
                let p = &params[pi];
                let x = g.tensor(p.w);
                let n: u64 = x.shape.as_ref().map_or(0, |s| s.iter().product());
                json!({
                    "name": x.name,
                    "offset": off,
                    "elements": n,
                    "init": g.op(p.update).attrs.get("init").cloned().unwrap_or(json!("zeros")),
                })
            })
            .collect();
        attrs.insert("elements".into(), json!(u.shard));
        attrs.insert("init_segments".into(), Value::Array(segments));
        attrs.insert("sharded".into(), json!(true));
        attrs.insert("world_size".into(), json!(world));
        if norm.is_some() {
            attrs.insert("norm_squared".into(), json!(true));
        }
        spec.attrs = attrs;
        b.add_op(spec);
    }
    let mut out = b.build()?;
    out.metadata = g.metadata.clone();
    out.metadata.insert("fsdp_world_size".into(), json!(world));
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::gpt2::{self, Gpt2Config};

    #[test]
    fn gathers_each_block_twice_and_scatters_once() {
        let cfg = Gpt2Config::small_config(2, 32, 2, 8, 1, 64);
        let g = gpt2::build(&cfg).unwrap();
        let s = shard(&g, 4).unwrap();
        let count = |ty: &str, prefix: &str| {
            s.ops()
                .iter()
                .filter(|o| o.op_type == ty && o.name.starts_with(prefix))
                .count()
        };
        for l in 0..2 {
            let h = format!("h{l}.");
            assert_eq!(count("all_gather", &h), 2, "block {l}");
            assert_eq!(count("reduce_scatter", &h), 1);
            assert_eq!(count("adamw", &h), 1);
        }
        // wte: the embedding, then the tied head (forward and backward).
        assert_eq!(count("all_gather", "wte."), 2);
        // Every parameter, gradient and moment is a 1/4 shard.
        let params: u64 = s
            .tensors()
            .iter()
            .filter(|t| t.role == Role::Parameter && t.view_of.is_none())
            .map(|t| t.size)
            .sum();
        let full: u64 = g
            .tensors()
            .iter()
            .filter(|t| t.role == Role::Parameter)
            .map(|t| t.size)
            .sum();
        assert!(
            params * 4 >= full && params * 4 < full + 4 * 64 * 256 * 4,
            "{params} vs {full}"
        );
        // Collectives are on their own stream.
        assert!(
            s.ops()
                .iter()
                .filter(|o| o.kind == OpKind::Collective)
                .all(|o| o.stream == COMM_STREAM)
        );
    }

    #[test]
    fn rejects_mixed_hyper_parameters_in_a_unit() {
        let mut b = GraphBuilder::new("two");
        let t = |b: &mut GraphBuilder, n: &str, role| {
            b.add_tensor(
                TensorSpec::new(n, 16)
                    .role(role)
                    .dtype("f32")
                    .shape([4])
                    .align(16),
            )
        };
        let x = t(&mut b, "x", Role::Input);
        let mut grads = Vec::new();
        let mut ws = Vec::new();
        for p in ["a", "b"] {
            let w = t(&mut b, p, Role::Parameter);
            let m = t(&mut b, &format!("{p}.m"), Role::OptimizerState);
            let v = t(&mut b, &format!("{p}.v"), Role::OptimizerState);
            for z in [w, m, v] {
                b.tensor_spec_mut(z).lifetime = Lifetime::Persistent;
            }
            grads.push(t(&mut b, &format!("{p}.grad"), Role::Gradient));
            ws.push((w, m, v));
        }
        b.add_op(
            OpSpec::new("grads", OpKind::Backward, "f")
                .inputs([x, ws[0].0, ws[1].0])
                .outputs(grads.clone()),
        );
        for (i, &(w, m, v)) in ws.iter().enumerate() {
            b.add_op(
                OpSpec::new(format!("u{i}"), OpKind::Optimizer, "adam")
                    .inputs([grads[i]])
                    .updates([w, m, v])
                    .attr("lr", 0.1 * (i + 1) as f64)
                    .attr("elements", 4),
            );
        }
        let g = b.build().unwrap();
        let e = shard_with(&g, 2, &|_| "all".to_string())
            .unwrap_err()
            .to_string();
        assert!(e.contains("differ in optimizer or hyper-parameters"), "{e}");
        // One unit per parameter is fine: each gets its own gather.
        let s = shard(&g, 2).unwrap();
        assert_eq!(
            s.ops().iter().filter(|o| o.op_type == "all_gather").count(),
            2
        );
    }
}
