//! From a graph and its plan to the executor's program
//! ([`memplan_runtime::Program`]), and the unplanned reference.
//!
//! [`program`] checks the plan with [`crate::checker`] first (so the
//! executor never sees a plan whose bytes clash), then:
//! - every tensor gets its dtype and shape (required: the executor computes
//!   on them), its absolute offset (a root's planned offset; a view's is its
//!   base's plus its offset inside it, which a `view` op gives in its
//!   `offsets` attribute, 0 otherwise), its role, whether it is persistent,
//!   and how to initialize it (parameters from the `init` attribute of their
//!   update op, optimizer state zero);
//! - every op becomes an instruction with a typed kernel parsed from its
//!   `op_type` and attributes ([`crate::vocab`]), in the plan's order, on its
//!   stream.
//!
//! [`unplanned_plan`] is the reference a plan is compared with: program
//! order, every tensor in bytes of its own (no reuse, no sharing).

use memplan_runtime::{self as rt, DType, Fill, Init, InitSegment};

use crate::checker;
use crate::error::Error;
use crate::graph::{Graph, Lifetime, Op, OpId, Role, TensorId};
use crate::plan::{Plan, PlanStats};
use crate::vocab::{Attrs, bad_op, kernel};

/// Parses an `init` attribute: `zeros`, `ones`, `normal:STD`, or
/// `normal_resid:STD` (GPT-2's residual projections: `STD / √(2·layers)`,
/// with `layers` from the op's attributes).
fn fill(op: &Op, spec: &str) -> Result<Fill, Error> {
    let a = Attrs::new(op);
    let number = |s: &str| {
        s.parse::<f32>()
            .ok()
            .filter(|x| x.is_finite() && *x >= 0.0)
            .ok_or_else(|| bad_op(op, format!("init {spec:?}: bad standard deviation {s:?}")))
    };
    Ok(match spec.split_once(':') {
        None if spec == "zeros" => Fill::Zeros,
        None if spec == "ones" => Fill::Ones,
        Some(("normal", s)) => Fill::Normal { std: number(s)? },
        Some(("normal_resid", s)) => {
            let layers = a.u64("layers")?.max(1);
            Fill::Normal {
                std: number(s)? / (2.0 * layers as f32).sqrt(),
            }
        }
        _ => {
            return Err(bad_op(
                op,
                format!("unknown init {spec:?} (zeros, ones, normal:STD, normal_resid:STD)"),
            ));
        }
    })
}

/// The initialization an update op gives its parameter (`updates[0]`, or
/// where an offload copies it in from, whose name keys the values).
fn param_init(g: &Graph, op: &Op) -> Result<Option<Init>, Error> {
    let Some(&w) = op.updates.first() else {
        return Ok(None);
    };
    let w = home(g, w);
    let elements = g.tensor(w).shape.as_ref().map_or(0, |s| s.iter().product());
    if let Some(segs) = op.attrs.get("init_segments") {
        let list = segs
            .as_array()
            .ok_or_else(|| bad_op(op, "init_segments must be a list"))?;
        let mut segments = Vec::with_capacity(list.len());
        for s in list {
            let field = |k: &str| {
                s.get(k)
                    .ok_or_else(|| bad_op(op, format!("init_segments entry lacks {k:?}")))
            };
            let num = |k: &str| {
                field(k)?
                    .as_u64()
                    .ok_or_else(|| bad_op(op, format!("init_segments {k:?} must be an integer")))
            };
            let text = |k: &str| {
                field(k)?
                    .as_str()
                    .map(str::to_string)
                    .ok_or_else(|| bad_op(op, format!("init_segments {k:?} must be a string")))
            };
            segments.push(InitSegment {
                key: text("name")?,
                offset: num("offset")?,
                elements: num("elements")?,
                fill: fill(op, &text("init")?)?,
            });
        }
        let sharded = Attrs::new(op).bool_or("sharded", false)?;
        return Ok(Some(Init { segments, sharded }));
    }
    match op.attrs.get("init").and_then(|v| v.as_str()) {
        None => Ok(None),
        Some(spec) => Ok(Some(Init::whole(
            g.tensor(w).name.clone(),
            elements,
            fill(op, spec)?,
        ))),
    }
}

fn role(r: Role) -> rt::Role {
    match r {
        Role::Parameter => rt::Role::Parameter,
        Role::Gradient => rt::Role::Gradient,
        Role::OptimizerState => rt::Role::OptimizerState,
        Role::Activation => rt::Role::Activation,
        Role::Temporary => rt::Role::Temporary,
        Role::Input => rt::Role::Input,
        Role::Output => rt::Role::Output,
        Role::Communication => rt::Role::Communication,
    }
}

/// The offset of view `t` inside its base, in bytes.
fn view_offset(g: &Graph, t: TensorId) -> Result<u64, Error> {
    let x = g.tensor(t);
    let Some(p) = x.producer else {
        return Ok(0);
    };
    let op = g.op(p);
    if op.op_type != "view" || !op.attrs.contains_key("offsets") {
        return Ok(0);
    }
    let offsets = Attrs::new(op).u64_list("offsets")?;
    let pos = op
        .outputs
        .iter()
        .position(|&o| o == t)
        .expect("produces it");
    let off = offsets.get(pos).ok_or_else(|| {
        bad_op(
            op,
            format!("{} outputs but {} offsets", op.outputs.len(), offsets.len()),
        )
    })?;
    let dtype = x
        .dtype
        .as_deref()
        .and_then(DType::parse)
        .unwrap_or(DType::F32);
    Ok(off * dtype.size())
}

/// Lowers `g` laid out by `plan` to the executor's program. The plan is
/// checked first.
pub fn program(g: &Graph, plan: &Plan) -> Result<rt::Program, Error> {
    checker::check(g, plan)?;
    let mut tensors = Vec::with_capacity(g.num_tensors());
    // Offsets of roots first, then views (bases may come after their views
    // in the tensor list). Host tensors (an offloaded step) lie in a host
    // pool after the arena, each in bytes of its own.
    let mut offset: Vec<Option<u64>> = plan.offsets.clone();
    let end = host_pool(g, plan.arena_bytes, &mut offset);
    for t in g.tensor_ids() {
        if g.tensor(t).view_of.is_none() && offset[t.index()].is_none() {
            offset[t.index()] = Some(0); // zero-sized
        }
    }
    fn resolve(g: &Graph, t: TensorId, offset: &mut Vec<Option<u64>>) -> Result<u64, Error> {
        if let Some(o) = offset[t.index()] {
            return Ok(o);
        }
        let base = g.tensor(t).view_of.expect("only views lack an offset");
        let o = resolve(g, base, offset)? + view_offset(g, t)?;
        offset[t.index()] = Some(o);
        Ok(o)
    }
    for t in g.tensor_ids() {
        let x = g.tensor(t);
        let bad = |why: String| Error::Unsupported(format!("tensor {:?}: {why}", x.name));
        let dtype = match x.dtype.as_deref() {
            None => {
                return Err(bad(
                    "has no dtype; the executor needs dtype and shape".into()
                ));
            }
            Some(d) => DType::parse(d)
                .ok_or_else(|| bad(format!("dtype {d:?} is not f32, bf16 or i32")))?,
        };
        let shape = x
            .shape
            .clone()
            .ok_or_else(|| bad("has no shape; the executor needs dtype and shape".into()))?;
        let elements: u64 = shape.iter().product();
        if x.view_of.is_none() && elements * dtype.size() != x.size {
            return Err(bad(format!(
                "size {} bytes does not match shape {shape:?} of {dtype} ({} bytes)",
                x.size,
                elements * dtype.size()
            )));
        }
        let mut d = rt::TensorDesc::new(x.name.clone(), dtype, shape, resolve(g, t, &mut offset)?);
        d.role = role(x.role);
        d.persistent = x.lifetime == Lifetime::Persistent;
        d.view_of = x.view_of.map(|b| rt::TensorIdx(b.0));
        tensors.push(d);
    }
    // Initialization: parameters from their update op, optimizer state zero
    // (an offloaded one's in host memory, where its copy comes from).
    for op in g.ops() {
        if !matches!(op.op_type.as_str(), "adam" | "adamw") {
            continue;
        }
        if let Some(init) = param_init(g, op)? {
            let w = home(g, op.updates[0]);
            tensors[w.index()].init = Some(init);
        }
        for &s in op.updates.iter().skip(1) {
            let s = home(g, s);
            let n = tensors[s.index()].elements();
            tensors[s.index()].init = Some(Init::whole(g.tensor(s).name.clone(), n, Fill::Zeros));
        }
    }
    let mut pos = vec![usize::MAX; g.num_ops()];
    for (i, &o) in plan.order.iter().enumerate() {
        pos[o.index()] = i;
    }
    let mut world: Option<u32> = None;
    let mut instrs = Vec::with_capacity(g.num_ops());
    for &o in &plan.order {
        let op = g.op(o);
        let k = kernel(op)?;
        if let Some(w) = k.world_size() {
            if world.is_some_and(|x| x != w) {
                return Err(bad_op(
                    op,
                    format!(
                        "world size {w} differs from other collectives' {}",
                        world.unwrap_or(0)
                    ),
                ));
            }
            world = Some(w);
        }
        let ids = |v: &[TensorId]| v.iter().map(|t| rt::TensorIdx(t.0)).collect::<Vec<_>>();
        let mut ins = rt::Instr::new(op.name.clone(), k)
            .inputs(ids(&op.inputs))
            .outputs(ids(&op.outputs))
            .updates(ids(&op.updates))
            .stream(op.stream);
        ins.after = op
            .after
            .iter()
            .map(|a: &OpId| rt::InstrIdx(pos[a.index()] as u32))
            .collect();
        instrs.push(ins);
    }
    let p = rt::Program {
        name: g.name.clone(),
        arena_bytes: end,
        tensors,
        instrs,
        world_size: world.unwrap_or(1),
    };
    p.validate()
        .map_err(|e| Error::Unsupported(format!("graph {:?} cannot run: {e}", g.name)))?;
    Ok(p)
}

/// Alignment of each host tensor in the pool after the arena.
const HOST_ALIGN: u64 = 64;

/// Places each host tensor in bytes of its own after the arena (which
/// ends at `arena`); the end of the pool.
fn host_pool(g: &Graph, arena: u64, offset: &mut [Option<u64>]) -> u64 {
    let mut end = arena;
    for t in g.tensor_ids() {
        let x = g.tensor(t);
        if g.on_host(t) && x.view_of.is_none() {
            end = end.next_multiple_of(HOST_ALIGN);
            offset[t.index()] = Some(end);
            end += x.size;
        }
    }
    end
}

/// Where a state tensor lives across steps: itself, or, when an offload
/// copies it in from host memory, that host tensor.
fn home(g: &Graph, t: TensorId) -> TensorId {
    match g.tensor(t).producer.map(|p| g.op(p)) {
        Some(op) if op.op_type == crate::graph::COPY_TO_DEVICE => op.inputs[0],
        _ => t,
    }
}

/// The unplanned reference: program order, every tensor that occupies
/// memory in bytes of its own (as if each were allocated separately), no
/// reuse. Passes the checker by construction.
pub fn unplanned_plan(g: &Graph) -> Plan {
    let mut offsets = vec![None; g.num_tensors()];
    let mut end = 0u64;
    for t in g.tensor_ids() {
        if g.occupies_memory(t) {
            let x = g.tensor(t);
            let off = end.div_ceil(x.align.max(1)) * x.align.max(1);
            offsets[t.index()] = Some(off);
            end = off + x.size;
        }
    }
    Plan {
        order: g.program_order().to_vec(),
        offsets,
        arena_bytes: end,
        reuses: Vec::new(),
        #[allow(deprecated)] // the arena's old copy, written for one release
        stats: PlanStats {
            peak_bytes: end,
            order_source: "program-order".into(),
            layout_source: "unplanned (every tensor its own bytes)".into(),
            ..Default::default()
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::{GraphBuilder, OpKind, OpSpec, TensorSpec};

    #[test]
    fn names_the_op_and_attribute_that_is_wrong() {
        let mut b = GraphBuilder::new("t");
        let x = b.add_tensor(
            TensorSpec::new("x", 16)
                .role(Role::Input)
                .dtype("f32")
                .shape([4]),
        );
        let y = b.add_tensor(TensorSpec::new("y", 16).dtype("f32").shape([4]));
        b.add_op(
            OpSpec::new("act", OpKind::Forward, "gelu")
                .inputs([x])
                .outputs([y]),
        );
        let g = b.build().unwrap();
        let e = program(&g, &unplanned_plan(&g)).unwrap_err().to_string();
        assert_eq!(e, "op \"act\" (gelu): missing attribute \"elements\"");

        let mut b = GraphBuilder::new("t");
        let x = b.add_tensor(
            TensorSpec::new("x", 16)
                .role(Role::Input)
                .dtype("f32")
                .shape([4]),
        );
        let y = b.add_tensor(TensorSpec::new("y", 16).dtype("f32").shape([4]));
        b.add_op(
            OpSpec::new("s", OpKind::Forward, "sigmoid")
                .inputs([x])
                .outputs([y]),
        );
        let g = b.build().unwrap();
        let e = program(&g, &unplanned_plan(&g)).unwrap_err().to_string();
        assert!(e.contains("no kernel for op type \"sigmoid\""), "{e}");

        let mut b = GraphBuilder::new("t");
        let x = b.add_tensor(
            TensorSpec::new("x", 16)
                .role(Role::Input)
                .dtype("f32")
                .shape([4]),
        );
        let y = b.add_tensor(TensorSpec::new("y", 12).dtype("f32").shape([3]));
        b.add_op(
            OpSpec::new("act", OpKind::Forward, "gelu")
                .inputs([x])
                .outputs([y])
                .attr("elements", 4),
        );
        let g = b.build().unwrap();
        let e = program(&g, &unplanned_plan(&g)).unwrap_err().to_string();
        assert!(e.contains("output 0 \"y\" has 3 elements"), "{e}");
    }

    #[test]
    fn unplanned_layout_gives_every_tensor_its_own_bytes() {
        let g = crate::models::example("mlp", &Default::default()).unwrap();
        let plan = unplanned_plan(&g);
        checker::check(&g, &plan).unwrap();
        assert!(plan.arena_bytes >= g.total_bytes());
        let p = program(&g, &plan).unwrap();
        assert_eq!(p.world_size, 1);
        // Parameters have an init; optimizer state is zero-initialized.
        let w = p.tensor_by_name("fc0.weight").unwrap();
        assert!(p.tensor(w).init.is_some());
        let m = p.tensor_by_name("fc0.weight.adam_m").unwrap();
        assert_eq!(
            p.tensor(m).init.as_ref().unwrap().segments[0].fill,
            Fill::Zeros
        );
    }
}
