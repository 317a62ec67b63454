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
//!   `wte` → `wte`), as PyTorch FSDP wraps modules. A unit is gathered and
//!   reduced as one collective.
//! - Shards ([`ShardLayout`]). FSDP2 (the default): every parameter and
//!   each of its Adam moments is its own persistent tensor of `⌈rows/W⌉`
//!   rows of dim 0 (a row-major tensor's dim-0 shard is a contiguous
//!   chunk, so the shard is elements `[r·c, (r+1)·c)` of the parameter
//!   padded to `W·c`). A rank's segment `S` of the unit lays its shards end
//!   to end, each on a 256-byte boundary. FSDP1 / ZeRO-3 (`Flat`): the
//!   unit's parameters end to end in one flat buffer padded to `W·S`, and
//!   each rank holds one `S`-element slice of it and of its moments.
//! - Before a run of ops that use a unit's parameters, an `all_gather`
//!   (kind collective, stream 1) fills a planned buffer of `W·S` elements
//!   (role communication). Per parameter, a `pack` first concatenates the
//!   rank's shards (FSDP2's copy-in) and a `copy_out` afterwards copies
//!   every parameter out of the `W` segments into its own tensor, after
//!   which the gathered buffer dies; flat, a `view` op cuts the gathered
//!   buffer into one view per parameter. A new gather starts whenever ops
//!   of another unit ran since the unit's last use — so a layer is
//!   gathered once before its forward and again before its backward, and
//!   its parameters die in between (the planner sees all of it).
//! - After the last op that produces a unit's gradients, they are packed
//!   into a `W·S` buffer (per parameter `chunk_cat`: segment `r` holds
//!   chunk `r` of every gradient; flat `pack`) and a `reduce_scatter`
//!   (average over ranks) leaves this rank's `S`-element gradient shard.
//! - The updates: per parameter, the original Adam/AdamW of each
//!   parameter on its shard, reading its view of the gradient shard; flat,
//!   one update per unit on the flat shards, with the hyper-parameters of
//!   the original updates (which must agree). `init_segments` tell the
//!   executor how a shard is initialized (the same values as the unsharded
//!   parameters). Global-norm clipping becomes a `grad_norm` of the squared
//!   norm of the local shards and an `all_reduce` (sum).
//!
//! The loss is each rank's mean over its own batch; gradients are averaged
//! over ranks, so `W` ranks with batch `b` each compute the same update as
//! one device with batch `W·b` (up to float rounding).

use std::collections::HashMap;

use memplan_runtime::{ChunkLayout, Kernel, ReduceOp};
use serde_json::{Value, json};

use crate::error::Error;
use crate::graph::{
    Graph, GraphBuilder, Lifetime, OpId, OpKind, OpSpec, Role, TensorId, TensorSpec,
};
use crate::vocab;

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
    Error::Unsupported(format!("fsdp: {}", why.into()))
}

/// How a unit's parameters are cut into shards.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ShardLayout {
    /// FSDP2: every parameter is its own tensor, sharded along dim 0 (rows
    /// padded to a multiple of `W`); a gather concatenates the rank's
    /// shards (`pack`), all-gathers them and copies every parameter out of
    /// the gathered buffer (`copy_out`), which then dies; gradients are
    /// packed chunk by chunk (`chunk_cat`) for the reduce-scatter, and each
    /// parameter has its own update on its own shard.
    PerParameter,
    /// FSDP1 / ZeRO-3: a unit's parameters end to end in one flat buffer,
    /// sharded as a whole; the ops read views of the gathered buffer and one
    /// update per unit runs on the flat shards.
    Flat,
}

/// How to shard: FSDP2's knobs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FsdpOptions {
    /// Ranks.
    pub world: u64,
    /// All-gathers issued ahead: with depth `d`, the gather of the unit the
    /// step uses `k`-th starts before the first op of the `(k − d)`-th, so it
    /// overlaps that unit's compute (FSDP2 prefetches one in forward and in
    /// backward). The planner keeps this: the op waits for the gather.
    pub prefetch: u32,
    /// Free a unit's gathered parameters after its forward and gather them
    /// again for its backward (FSDP2's default); `false` keeps them from the
    /// forward to the end of the unit's backward, one gather per step.
    pub reshard_after_forward: bool,
    /// Under mixed precision, reduce-scatter gradients in the compute dtype
    /// (FSDP2's `reduce_dtype=bf16`) and cast the shard to f32, instead of
    /// casting each gradient to f32 and reducing in f32 (the default).
    pub reduce_in_compute_dtype: bool,
    /// Per-parameter shards (FSDP2, the default) or flat ones (FSDP1).
    pub layout: ShardLayout,
}

impl FsdpOptions {
    /// FSDP2's defaults: prefetch one unit, reshard after forward.
    pub fn new(world: u64) -> FsdpOptions {
        FsdpOptions {
            world,
            prefetch: 1,
            reshard_after_forward: true,
            reduce_in_compute_dtype: false,
            layout: ShardLayout::PerParameter,
        }
    }
}

/// A parameter with the ops and tensors around it.
struct Param {
    w: TensorId,
    grad: TensorId,
    m: TensorId,
    v: TensorId,
    update: OpId,
    /// Mixed precision: the compute copy every op reads, made by a `cast`
    /// that is the parameter's only other use.
    copy: Option<TensorId>,
    /// Mixed precision, per parameter or reducing in the compute dtype: the
    /// compute-dtype gradient that a `cast` (dropped) turned into `grad`.
    grad_copy: Option<TensorId>,
}

impl Param {
    /// The tensor the step's ops read.
    fn read(&self) -> TensorId {
        self.copy.unwrap_or(self.w)
    }
    /// The gradient the reduce-scatter reads.
    fn reduced(&self) -> TensorId {
        self.grad_copy.unwrap_or(self.grad)
    }
}

/// A unit of parameters: gathered together, reduced together.
struct Unit {
    name: String,
    params: Vec<usize>,
    /// Flat: element offset of each parameter in the flat buffer.
    /// Per parameter: element offset of each parameter's shard in a rank's
    /// segment of the gathered buffer.
    offsets: Vec<u64>,
    /// Per parameter: each parameter's shard elements (dim 0 chunked).
    chunks: Vec<u64>,
    /// Shard elements per rank (the whole unit's).
    shard: u64,
    dtype: String,
    elem_bytes: u64,
    /// The dtype parameters are gathered in: the compute copies' under
    /// mixed precision (FSDP2's `param_dtype`), else `dtype`.
    gather_dtype: String,
    gather_bytes: u64,
    align: u64,
    /// The persistent shards `[param, adam_m, adam_v]`: one triple for a
    /// flat unit, one per parameter otherwise.
    state: Vec<[TensorId; 3]>,
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

/// Shards `g` over `world` ranks with [`default_unit`] and FSDP2's default
/// options; see the module docs.
pub fn shard(g: &Graph, world: u64) -> Result<Graph, Error> {
    shard_with(g, &FsdpOptions::new(world), &default_unit)
}

/// Shards `g` as `opts` says, grouping parameters by `unit_of(name)`.
pub fn shard_with(
    g: &Graph,
    opts: &FsdpOptions,
    unit_of: &dyn Fn(&str) -> String,
) -> Result<Graph, Error> {
    let world = opts.world;
    if world == 0 || world > 1 << 16 {
        return Err(invalid(format!(
            "world size must be in 1..=65536, got {world}"
        )));
    }
    let found = find_params(g, opts)?;
    let (units, unit_of_param) = group_units(g, &found.params, world, opts.layout, unit_of)?;
    let mut s = Sharder {
        g,
        opts: *opts,
        b: GraphBuilder::new(format!("{}-fsdp{world}", g.name)),
        open: vec![None; units.len()],
        grad_shards: vec![TensorId(0); units.len()],
        params: found.params,
        units,
        unit_of_param,
        skip: found.skip,
        tmap: vec![None; g.num_tensors()],
        omap: vec![None; g.num_ops()],
    };
    s.copy_tensors(&found.dropped)?;
    s.add_shards();
    s.emit_ops()?;
    s.optimizer_step(found.max_norm.as_ref());
    let mut out = s.b.build()?;
    out.metadata = g.metadata.clone();
    out.metadata.insert("fsdp_world_size".into(), json!(world));
    out.metadata
        .insert("fsdp_prefetch".into(), json!(opts.prefetch));
    out.metadata.insert(
        "fsdp_reshard_after_forward".into(),
        json!(opts.reshard_after_forward),
    );
    let layout = match opts.layout {
        ShardLayout::PerParameter => "per-parameter",
        ShardLayout::Flat => "flat",
    };
    out.metadata.insert("fsdp_layout".into(), json!(layout));
    Ok(out)
}

/// The parameters of `g` with their updates, and what sharding drops.
struct Found {
    params: Vec<Param>,
    /// Old ops that do not carry over: the updates and the gradient norm.
    skip: Vec<bool>,
    /// Old tensors that do not carry over: parameters, their moments, the
    /// updates' temporaries, the gradient norm.
    dropped: Vec<bool>,
    /// The clipping threshold, when the step clips.
    max_norm: Option<Value>,
}

fn find_params(g: &Graph, opts: &FsdpOptions) -> Result<Found, Error> {
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
            copy: None,
            grad_copy: None,
        });
    }
    let mut casts = find_casts(g, &mut params);
    // Per parameter (FSDP2), gradients stay in the compute dtype up to the
    // reduction: `chunk_cat` packs them into the reduce dtype's buffer. Flat
    // units keep each gradient's cast unless reducing in the compute dtype.
    if opts.reduce_in_compute_dtype || opts.layout == ShardLayout::PerParameter {
        casts.extend(find_grad_casts(g, &mut params));
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
    let mut skip = vec![false; g.num_ops()];
    for &o in update_of.values().chain(&grad_norm_ops).chain(&casts) {
        skip[o.index()] = true;
    }
    let mut dropped = vec![false; g.num_tensors()];
    for p in &params {
        for t in [p.w, p.m, p.v].into_iter().chain(p.copy) {
            dropped[t.index()] = true;
        }
        if p.grad_copy.is_some() {
            dropped[p.grad.index()] = true;
        }
    }
    for &o in update_of.values().chain(&grad_norm_ops) {
        for &t in &g.op(o).outputs {
            dropped[t.index()] = true;
        }
    }
    Ok(Found {
        params,
        skip,
        dropped,
        max_norm,
    })
}

/// Mixed precision: a parameter whose only use besides its update is one
/// `cast` is gathered already cast (FSDP2 casts the shard, then gathers):
/// records the cast's output as the parameter's copy and returns the casts,
/// which sharding drops.
fn find_casts(g: &Graph, params: &mut [Param]) -> Vec<OpId> {
    let mut uses: HashMap<TensorId, Vec<OpId>> = HashMap::new();
    for o in g.op_ids() {
        for &t in &g.op(o).inputs {
            uses.entry(t).or_default().push(o);
        }
    }
    let mut casts = Vec::new();
    for p in params {
        let reads: Vec<OpId> = uses
            .get(&p.w)
            .map(|v| v.iter().copied().filter(|&o| o != p.update).collect())
            .unwrap_or_default();
        if let [o] = reads[..]
            && g.op(o).op_type == "cast"
            && g.op(o).outputs.len() == 1
        {
            p.copy = Some(g.op(o).outputs[0]);
            casts.push(o);
        }
    }
    casts
}

/// Mixed precision: a gradient made by a `cast` from a compute-dtype
/// gradient is packed for the reduction before the cast (the cast moves to
/// the packing or to the shard); returns the casts, which sharding drops.
fn find_grad_casts(g: &Graph, params: &mut [Param]) -> Vec<OpId> {
    let mut casts = Vec::new();
    for p in params {
        let Some(o) = g.tensor(p.grad).producer else {
            continue;
        };
        let op = g.op(o);
        if p.copy.is_some() && op.op_type == "cast" && op.inputs.len() == 1 {
            p.grad_copy = Some(op.inputs[0]);
            casts.push(o);
        }
    }
    casts
}

/// Units, in order of their first parameter, each laid out flat.
fn group_units(
    g: &Graph,
    params: &[Param],
    world: u64,
    layout: ShardLayout,
    unit_of: &dyn Fn(&str) -> String,
) -> Result<(Vec<Unit>, HashMap<TensorId, usize>), Error> {
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
                gather_dtype: String::new(),
                gather_bytes: 0,
                align: 1,
                chunks: Vec::new(),
                state: Vec::new(),
                last_grad_op: OpId(0),
            });
            units.len() - 1
        });
        units[ui].params.push(pi);
        unit_of_param.insert(p.read(), ui);
    }
    let mut pos = vec![0usize; g.num_ops()];
    for (i, &o) in g.program_order().iter().enumerate() {
        pos[o.index()] = i;
    }
    for u in &mut units {
        u.lay_out(g, params, world, layout, &pos)?;
    }
    Ok((units, unit_of_param))
}

/// Elements of one rank's dim-0 shard of a tensor of `shape`: `⌈rows /
/// W⌉` rows (FSDP2 pads dim 0 to a multiple of `W`).
fn dim0_chunk(shape: &[u64], world: u64) -> u64 {
    match shape.split_first() {
        None => 1u64.div_ceil(world),
        Some((rows, rest)) => rows.div_ceil(world) * rest.iter().product::<u64>(),
    }
}

fn elements(g: &Graph, t: TensorId) -> Result<u64, Error> {
    let x = g.tensor(t);
    x.shape
        .as_ref()
        .map(|s| s.iter().product())
        .ok_or_else(|| invalid(format!("parameter {:?} has no shape", x.name)))
}

impl Unit {
    /// Checks that the unit's parameters agree in dtype (and, flat, in
    /// optimizer), and places them end to end (each segment aligned): flat,
    /// whole in a buffer padded to whole shards; per parameter, each one's
    /// dim-0 shard in a rank's segment.
    fn lay_out(
        &mut self,
        g: &Graph,
        params: &[Param],
        world: u64,
        layout: ShardLayout,
        pos: &[usize],
    ) -> Result<(), Error> {
        let first = &params[self.params[0]];
        let x0 = g.tensor(first.w);
        self.dtype = x0
            .dtype
            .clone()
            .ok_or_else(|| invalid(format!("parameter {:?} has no dtype", x0.name)))?;
        let n0 = elements(g, first.w)?.max(1);
        self.elem_bytes = (x0.size / n0).max(1);
        self.align = x0.align.max(1);
        let read0 = g.tensor(first.read());
        self.gather_dtype = read0.dtype.clone().unwrap_or_else(|| self.dtype.clone());
        self.gather_bytes = (read0.size / n0).max(1);
        let unit_bytes = self.elem_bytes.min(self.gather_bytes);
        let seg_align = (SEGMENT_ALIGN_BYTES / unit_bytes).max(1);
        let mut end = 0u64;
        let upd0 = g.op(first.update);
        for &pi in &self.params {
            let p = &params[pi];
            let x = g.tensor(p.w);
            let r = g.tensor(p.read());
            if x.dtype.as_deref() != Some(self.dtype.as_str())
                || r.dtype.as_deref() != Some(self.gather_dtype.as_str())
            {
                return Err(invalid(format!(
                    "unit {:?} mixes dtypes ({:?} is {:?} read as {:?}, {:?} is {:?} read as {:?})",
                    self.name, x0.name, self.dtype, self.gather_dtype, x.name, x.dtype, r.dtype
                )));
            }
            if p.grad_copy.is_some() != first.grad_copy.is_some() {
                return Err(invalid(format!(
                    "unit {:?}: {:?} and {:?} differ in the dtype their gradients are reduced in",
                    self.name, x0.name, x.name
                )));
            }
            let upd = g.op(p.update);
            // One flat update runs all of a unit's parameters.
            let differ = upd.op_type != upd0.op_type
                || SHARED_ATTRS
                    .iter()
                    .any(|k| upd.attrs.get(*k) != upd0.attrs.get(*k));
            if layout == ShardLayout::Flat && differ {
                return Err(invalid(format!(
                    "unit {:?}: updates {:?} and {:?} differ in optimizer or hyper-parameters",
                    self.name, upd0.name, upd.name
                )));
            }
            let off = end.div_ceil(seg_align) * seg_align;
            self.offsets.push(off);
            let n = elements(g, p.w)?;
            end = off
                + match layout {
                    ShardLayout::Flat => n,
                    ShardLayout::PerParameter => {
                        let c = dim0_chunk(x.shape.as_deref().unwrap_or(&[]), world);
                        self.chunks.push(c);
                        c
                    }
                };
        }
        self.shard = match layout {
            ShardLayout::Flat => end.div_ceil(world).div_ceil(seg_align) * seg_align,
            ShardLayout::PerParameter => end.div_ceil(seg_align).max(1) * seg_align,
        };
        self.last_grad_op = self
            .params
            .iter()
            .filter_map(|&pi| g.tensor(params[pi].reduced()).producer)
            .max_by_key(|o| pos[o.index()])
            .ok_or_else(|| {
                invalid(format!(
                    "unit {:?}: no op produces its gradients",
                    self.name
                ))
            })?;
        Ok(())
    }
}

/// One gather of a unit: the op (position in the old program order) whose
/// use of the unit starts it.
struct Gather {
    unit: usize,
    first_use: usize,
}

/// The sharded graph under construction.
struct Sharder<'g> {
    g: &'g Graph,
    opts: FsdpOptions,
    b: GraphBuilder,
    params: Vec<Param>,
    units: Vec<Unit>,
    unit_of_param: HashMap<TensorId, usize>,
    skip: Vec<bool>,
    /// New tensor of each old tensor that carries over.
    tmap: Vec<Option<TensorId>>,
    /// New op of each old op that carries over.
    omap: Vec<Option<OpId>>,
    /// The parameter views of each unit's latest gather.
    open: Vec<Option<Vec<TensorId>>>,
    /// Each unit's reduce-scattered gradient shard.
    grad_shards: Vec<TensorId>,
}

impl Sharder<'_> {
    fn flat(&mut self, ui: usize, name: String, elements: u64, role: Role) -> TensorId {
        let u = &self.units[ui];
        let (dtype, bytes) = (u.dtype.clone(), u.elem_bytes);
        self.flat_typed(ui, name, elements, role, dtype, bytes)
    }
    /// A flat buffer of unit `ui` in the dtype parameters are gathered in.
    fn flat_gathered(&mut self, ui: usize, name: String, elements: u64, role: Role) -> TensorId {
        let u = &self.units[ui];
        let (dtype, bytes) = (u.gather_dtype.clone(), u.gather_bytes);
        self.flat_typed(ui, name, elements, role, dtype, bytes)
    }
    fn flat_typed(
        &mut self,
        ui: usize,
        name: String,
        elements: u64,
        role: Role,
        dtype: String,
        bytes: u64,
    ) -> TensorId {
        self.b.add_tensor(
            TensorSpec::new(name, elements * bytes)
                .role(role)
                .align(self.units[ui].align)
                .dtype(dtype)
                .shape([elements]),
        )
    }

    /// The tensor a gather reads: the flat shard, or per parameter the
    /// rank's shards packed end to end; under mixed precision cast to the
    /// compute dtype.
    fn gather_source(&mut self, ui: usize, k: usize) -> TensorId {
        let u = &self.units[ui];
        let (name, shard) = (u.name.clone(), u.shard);
        let shard_t = match self.opts.layout {
            ShardLayout::Flat => u.state[0][0],
            ShardLayout::PerParameter => {
                let (shards, offsets) = (
                    u.state.iter().map(|s| s[0]).collect::<Vec<_>>(),
                    u.offsets.clone(),
                );
                let input = self.flat(
                    ui,
                    format!("{name}.all_gather_input{k}"),
                    shard,
                    Role::Communication,
                );
                let pack = Kernel::Pack {
                    offsets,
                    elements: shard,
                };
                self.b.add_op(
                    vocab::spec(format!("{name}.copy_in{k}"), OpKind::Other, &pack)
                        .inputs(shards)
                        .outputs([input]),
                );
                input
            }
        };
        let u = &self.units[ui];
        if u.gather_dtype == u.dtype {
            return shard_t;
        }
        let dt = u.gather_dtype.clone();
        let cast = self.flat_gathered(
            ui,
            format!("{name}.flat_param.shard.{dt}{k}"),
            shard,
            Role::Communication,
        );
        let k_cast = Kernel::Cast { elements: shard };
        self.b.add_op(
            vocab::spec(format!("{name}.cast{k}"), OpKind::Other, &k_cast)
                .inputs([shard_t])
                .outputs([cast]),
        );
        cast
    }

    /// Every old tensor that is not dropped, unchanged.
    fn copy_tensors(&mut self, dropped: &[bool]) -> Result<(), Error> {
        let g = self.g;
        for t in g.tensor_ids() {
            if dropped[t.index()] {
                continue;
            }
            let x = g.tensor(t);
            let view_of = match x.view_of {
                None => None,
                Some(base) => Some(self.tmap[base.index()].ok_or_else(|| {
                    invalid(format!(
                        "tensor {:?} views {:?}, which sharding replaces (views must follow their base and not view parameters)",
                        x.name,
                        g.tensor(base).name
                    ))
                })?),
            };
            self.tmap[t.index()] = Some(self.b.add_tensor(TensorSpec {
                view_of,
                ..TensorSpec::from(x)
            }));
        }
        Ok(())
    }

    /// The persistent parameter and Adam moment shards: each unit's flat
    /// ones, or each parameter's.
    fn add_shards(&mut self) {
        for ui in 0..self.units.len() {
            let u = &self.units[ui];
            let shards: Vec<(String, u64)> = match self.opts.layout {
                ShardLayout::Flat => vec![(format!("{}.flat_param", u.name), u.shard)],
                ShardLayout::PerParameter => u
                    .params
                    .iter()
                    .zip(&u.chunks)
                    .map(|(&pi, &c)| (self.g.tensor(self.params[pi].w).name.clone(), c))
                    .collect(),
            };
            for (base, n) in shards {
                let w = self.flat(ui, format!("{base}.shard"), n, Role::Parameter);
                let m = self.flat(ui, format!("{base}.shard.adam_m"), n, Role::OptimizerState);
                let v = self.flat(ui, format!("{base}.shard.adam_v"), n, Role::OptimizerState);
                for t in [w, m, v] {
                    self.b.tensor_spec_mut(t).lifetime = Lifetime::Persistent;
                }
                self.units[ui].state.push([w, m, v]);
            }
        }
    }

    /// The units an old op reads parameters of, in operand order; an error
    /// if it writes a parameter.
    fn units_used(&self, o: OpId) -> Result<Vec<usize>, Error> {
        let op = self.g.op(o);
        let mut used: Vec<usize> = Vec::new();
        for &t in &op.inputs {
            if let Some(&ui) = self.unit_of_param.get(&t)
                && !used.contains(&ui)
            {
                used.push(ui);
            }
        }
        for &t in op.outputs.iter().chain(&op.updates) {
            if self.unit_of_param.contains_key(&t) {
                return Err(invalid(format!(
                    "op {:?} writes parameter {:?}; only its update may",
                    op.name,
                    self.g.tensor(t).name
                )));
            }
        }
        Ok(used)
    }

    /// Where gathers start: a unit is gathered before a run of ops that use
    /// it, again whenever ops of another unit ran since its last use (once
    /// per step without `reshard_after_forward`).
    fn gathers(&self) -> Result<Vec<Gather>, Error> {
        let mut out = Vec::new();
        let mut open = vec![false; self.units.len()];
        let mut prev: Vec<usize> = Vec::new();
        for (i, &o) in self.g.program_order().iter().enumerate() {
            if self.skip[o.index()] {
                continue;
            }
            let used = self.units_used(o)?;
            for &ui in &used {
                let keep = prev.contains(&ui) || !self.opts.reshard_after_forward;
                if open[ui] && keep {
                    continue;
                }
                open[ui] = true;
                out.push(Gather {
                    unit: ui,
                    first_use: i,
                });
            }
            if !used.is_empty() {
                prev = used;
            }
        }
        Ok(out)
    }

    /// All-gathers unit `ui`'s shards into a flat buffer (collective
    /// stream) and cuts it into one view per parameter; returns the gather
    /// and the views.
    fn emit_gather(&mut self, ui: usize, k: usize) -> (OpId, Vec<TensorId>) {
        let world = self.opts.world;
        let name = self.units[ui].name.clone();
        let source = self.gather_source(ui, k);
        let full = world * self.units[ui].shard;
        let gathered_name = match self.opts.layout {
            ShardLayout::Flat => format!("{name}.flat_param.gathered{k}"),
            ShardLayout::PerParameter => format!("{name}.all_gather_output{k}"),
        };
        let gathered = self.flat_gathered(ui, gathered_name, full, Role::Communication);
        let all_gather = Kernel::AllGather {
            world: self.world32(),
        };
        let gather = self.b.add_op(
            vocab::spec(
                format!("{name}.all_gather{k}"),
                OpKind::Collective,
                &all_gather,
            )
            .inputs([source])
            .outputs([gathered])
            .stream(COMM_STREAM)
            .attr("elements", full),
        );
        let flat = self.opts.layout == ShardLayout::Flat;
        let views: Vec<TensorId> = self.units[ui]
            .params
            .iter()
            .map(|&pi| {
                let x = self.g.tensor(self.params[pi].read());
                self.b.add_tensor(TensorSpec {
                    name: format!("{}.gathered{k}", x.name),
                    size: x.size,
                    align: x.align,
                    role: Role::Parameter,
                    lifetime: Lifetime::Transient,
                    view_of: flat.then_some(gathered),
                    dtype: x.dtype.clone(),
                    shape: x.shape.clone(),
                    space: x.space,
                })
            })
            .collect();
        let spec = if flat {
            vocab::spec(format!("{name}.unflatten{k}"), OpKind::Other, &Kernel::View)
                .attr("offsets", json!(self.units[ui].offsets))
        } else {
            let copy_out = Kernel::CopyOut(self.chunk_layout(ui));
            vocab::spec(format!("{name}.copy_out{k}"), OpKind::Other, &copy_out)
                .attr("elements", self.opts.world * self.units[ui].shard)
        };
        self.b
            .add_op(spec.inputs([gathered]).outputs(views.iter().copied()));
        (gather, views)
    }

    /// Where unit `ui`'s parameters sit in its flat buffer, for its
    /// `chunk_cat` and `copy_out`.
    fn chunk_layout(&self, ui: usize) -> ChunkLayout {
        let u = &self.units[ui];
        ChunkLayout {
            world: self.world32(),
            shard: u.shard,
            offsets: u.offsets.clone(),
            chunks: u.chunks.clone(),
        }
    }

    /// The world size as the collectives' kernels take it (checked when
    /// the options were read).
    fn world32(&self) -> u32 {
        u32::try_from(self.opts.world).unwrap_or(u32::MAX)
    }

    /// The new tensor an old op's operand `t` becomes: the open view of a
    /// parameter, or the copied tensor.
    fn map_t(&self, o: OpId, t: TensorId) -> Result<TensorId, Error> {
        if let Some(&ui) = self.unit_of_param.get(&t) {
            let at = self.units[ui]
                .params
                .iter()
                .position(|&pi| self.params[pi].read() == t)
                .expect("in its unit");
            return Ok(self.open[ui].as_ref().expect("gathered before use")[at]);
        }
        self.tmap[t.index()].ok_or_else(|| {
            invalid(format!(
                "op {:?} uses {:?}, which sharding replaces",
                self.g.op(o).name,
                self.g.tensor(t).name
            ))
        })
    }

    /// Copies old op `o` onto the new tensors; it also runs after `after`.
    fn copy_op(&mut self, o: OpId, after: &[OpId]) -> Result<(), Error> {
        let op = self.g.op(o);
        let map_all = |v: &[TensorId]| {
            v.iter()
                .map(|&t| self.map_t(o, t))
                .collect::<Result<Vec<_>, _>>()
        };
        let mut spec = OpSpec::new(op.name.clone(), op.kind, op.op_type.clone())
            .inputs(map_all(&op.inputs)?)
            .outputs(map_all(&op.outputs)?)
            .updates(map_all(&op.updates)?)
            .stream(op.stream)
            .after(after.iter().copied());
        for &(out, inp) in &op.reuse {
            spec = spec.reuse(self.map_t(o, out)?, self.map_t(o, inp)?);
        }
        for &a in &op.after {
            spec = spec.after([self.omap[a.index()].ok_or_else(|| {
                invalid(format!(
                    "op {:?} must follow {:?}, which sharding replaces",
                    op.name,
                    self.g.op(a).name
                ))
            })?]);
        }
        spec.cost = op.cost;
        spec.flops = op.flops;
        spec.attrs = op.attrs.clone();
        self.omap[o.index()] = Some(self.b.add_op(spec));
        Ok(())
    }

    /// The ops in program order: each gather `d = prefetch` gathers ahead of
    /// its first use (the op that starts gather `k − d` waits for gather
    /// `k`), every old op, and a pack and reduce-scatter after each unit's
    /// last gradient.
    fn emit_ops(&mut self) -> Result<(), Error> {
        let gathers = self.gathers()?;
        let d = self.opts.prefetch as usize;
        // Gathers to issue just before each old program position.
        let mut issue_at: HashMap<usize, Vec<usize>> = HashMap::new();
        for k in 0..gathers.len() {
            let at = gathers[k.saturating_sub(d)].first_use;
            issue_at.entry(at).or_default().push(k);
        }
        let mut count = vec![0usize; self.units.len()];
        // Views of gathers issued whose first use is still ahead.
        let mut issued: HashMap<usize, Vec<TensorId>> = HashMap::new();
        let mut next = 0usize;
        let order = self.g.program_order().to_vec();
        for (i, &o) in order.iter().enumerate() {
            if self.skip[o.index()] {
                continue;
            }
            let mut after = Vec::new();
            for &k in issue_at.get(&i).map(Vec::as_slice).unwrap_or(&[]) {
                let ui = gathers[k].unit;
                let (op, views) = self.emit_gather(ui, count[ui]);
                count[ui] += 1;
                after.push(op);
                issued.insert(k, views);
            }
            // Gathers first used here replace their unit's views.
            while next < gathers.len() && gathers[next].first_use == i {
                let views = issued.remove(&next).expect("issued at or before its use");
                self.open[gathers[next].unit] = Some(views);
                next += 1;
            }
            self.copy_op(o, &after)?;
            for ui in 0..self.units.len() {
                if self.units[ui].last_grad_op == o {
                    self.reduce_scatter(ui)?;
                }
            }
        }
        Ok(())
    }

    /// Packs unit `ui`'s gradients into a flat buffer and reduce-scatters
    /// it (average over ranks) into this rank's gradient shard.
    fn reduce_scatter(&mut self, ui: usize) -> Result<(), Error> {
        let world = self.opts.world;
        let (name, shard) = (self.units[ui].name.clone(), self.units[ui].shard);
        let full = world * shard;
        let last = self.units[ui].last_grad_op;
        let grads = self.units[ui]
            .params
            .iter()
            .map(|&pi| self.map_t(last, self.params[pi].reduced()))
            .collect::<Result<Vec<_>, _>>()?;
        // Reduced in the compute dtype (then the shard is cast), or packed
        // from compute-dtype gradients into f32 by `chunk_cat` (FSDP2's
        // `reduce_dtype=f32`: no f32 copy of each gradient), or packed
        // from f32 gradients.
        let narrow = self.opts.reduce_in_compute_dtype
            && self.params[self.units[ui].params[0]].grad_copy.is_some();
        let flat = |s: &mut Self, name: String, n: u64, role: Role| {
            if narrow {
                s.flat_gathered(ui, name, n, role)
            } else {
                s.flat(ui, name, n, role)
            }
        };
        let flat_grad = flat(self, format!("{name}.flat_grad"), full, Role::Communication);
        let pack = match self.opts.layout {
            ShardLayout::Flat => {
                let pack = Kernel::Pack {
                    offsets: self.units[ui].offsets.clone(),
                    elements: full,
                };
                vocab::spec(format!("{name}.pack_grads"), OpKind::Backward, &pack)
            }
            ShardLayout::PerParameter => {
                let chunk_cat = Kernel::ChunkCat(self.chunk_layout(ui));
                vocab::spec(format!("{name}.chunk_cat"), OpKind::Backward, &chunk_cat)
                    .attr("elements", full)
            }
        };
        self.b.add_op(pack.inputs(grads).outputs([flat_grad]));
        let dt = self.units[ui].gather_dtype.clone();
        let rs_name = if narrow {
            format!("{name}.flat_grad.shard.{dt}")
        } else {
            format!("{name}.flat_grad.shard")
        };
        let rs = flat(self, rs_name, shard, Role::Gradient);
        let reduce_scatter = Kernel::ReduceScatter {
            world: self.world32(),
            op: ReduceOp::Avg,
        };
        self.b.add_op(
            vocab::spec(
                format!("{name}.reduce_scatter"),
                OpKind::Collective,
                &reduce_scatter,
            )
            .inputs([flat_grad])
            .outputs([rs])
            .stream(COMM_STREAM)
            .attr("elements", full),
        );
        self.grad_shards[ui] = if narrow {
            let gs = self.flat(ui, format!("{name}.flat_grad.shard"), shard, Role::Gradient);
            let cast = Kernel::Cast { elements: shard };
            self.b.add_op(
                vocab::spec(format!("{name}.flat_grad.cast"), OpKind::Backward, &cast)
                    .inputs([rs])
                    .outputs([gs]),
            );
            gs
        } else {
            rs
        };
        Ok(())
    }

    /// Clipping (the squared norm of the local shards, summed over ranks),
    /// then one update per unit on its shards.
    fn optimizer_step(&mut self, max_norm: Option<&Value>) {
        let norm = max_norm.map(|max| {
            let t = self.b.add_tensor(
                TensorSpec::new("grad_norm_squared", 4)
                    .role(Role::Temporary)
                    .align(self.units[0].align)
                    .dtype("f32")
                    .shape([1]),
            );
            let mut norm = vocab::spec(
                "clip_grad_norm",
                OpKind::Optimizer,
                &Kernel::GradNorm { squared: true },
            )
            .inputs(self.grad_shards.iter().copied())
            .outputs([t]);
            if !max.is_null() {
                norm = norm.attr("max_norm", max.clone());
            }
            self.b.add_op(norm);
            let all_reduce = Kernel::AllReduce {
                world: self.world32(),
                op: ReduceOp::Sum,
            };
            self.b.add_op(
                vocab::spec("grad_norm.all_reduce", OpKind::Collective, &all_reduce)
                    .updates([t])
                    .stream(COMM_STREAM)
                    .attr("elements", 1),
            );
            t
        });
        for ui in 0..self.units.len() {
            self.update(ui, norm);
        }
    }

    /// The Adam/AdamW updates of unit `ui`: one on its flat shards, or one
    /// per parameter on views of the unit's gradient shard.
    fn update(&mut self, ui: usize, norm: Option<TensorId>) {
        let g = self.g;
        let u = &self.units[ui];
        let (name, grad_shard) = (u.name.clone(), self.grad_shards[ui]);
        match self.opts.layout {
            ShardLayout::Flat => {
                let segments: Vec<Value> = u
                    .params
                    .iter()
                    .zip(&u.offsets)
                    .map(|(&pi, &off)| self.init_segment(pi, off))
                    .collect();
                let (state, shard) = (u.state[0], u.shard);
                let first = self.params[u.params[0]].update;
                let op_name = format!("{name}.update");
                self.add_update(first, op_name, grad_shard, state, shard, segments, norm);
            }
            ShardLayout::PerParameter => {
                let each: Vec<(usize, u64, [TensorId; 3])> = u
                    .params
                    .iter()
                    .zip(&u.chunks)
                    .zip(&u.state)
                    .map(|((&pi, &c), &st)| (pi, c, st))
                    .collect();
                let offsets = json!(u.offsets);
                // Each update reads its parameter's view of the unit's shard.
                let grads: Vec<TensorId> = each
                    .iter()
                    .map(|&(pi, c, _)| {
                        let view = format!("{}.shard.grad", g.tensor(self.params[pi].w).name);
                        let t = self.flat(ui, view, c, Role::Gradient);
                        self.b.tensor_spec_mut(t).view_of = Some(grad_shard);
                        t
                    })
                    .collect();
                self.b.add_op(
                    vocab::spec(
                        format!("{name}.grad_shards"),
                        OpKind::Optimizer,
                        &Kernel::View,
                    )
                    .inputs([grad_shard])
                    .outputs(grads.iter().copied())
                    .attr("offsets", offsets),
                );
                for ((pi, c, state), grad) in each.into_iter().zip(grads) {
                    let orig = self.params[pi].update;
                    let segments = vec![self.init_segment(pi, 0)];
                    let op_name = g.op(orig).name.clone();
                    self.add_update(orig, op_name, grad, state, c, segments, norm);
                }
            }
        }
    }

    /// How parameter `pi` initializes its part of a sharded buffer, from
    /// element `offset` of the unsharded (flat or padded) buffer.
    fn init_segment(&self, pi: usize, offset: u64) -> Value {
        let p = &self.params[pi];
        let x = self.g.tensor(p.w);
        let n: u64 = x.shape.as_ref().map_or(0, |s| s.iter().product());
        let init = self.g.op(p.update).attrs.get("init").cloned();
        json!({
            "name": x.name,
            "offset": offset,
            "elements": n,
            "init": init.unwrap_or(json!("zeros")),
        })
    }

    /// An Adam/AdamW update like old op `orig` of the sharded `state` of
    /// `elements` elements, reading `grad` (and the squared norm).
    #[allow(clippy::too_many_arguments)]
    fn add_update(
        &mut self,
        orig: OpId,
        name: String,
        grad: TensorId,
        state: [TensorId; 3],
        elements: u64,
        segments: Vec<Value>,
        norm: Option<TensorId>,
    ) {
        let first = self.g.op(orig);
        let mut inputs = vec![grad];
        inputs.extend(norm);
        let mut spec = OpSpec::new(name, OpKind::Optimizer, first.op_type.clone())
            .inputs(inputs)
            .updates(state);
        if !first.outputs.is_empty() {
            let w = self.b.tensor_spec(state[0]).clone();
            let d = self.b.add_tensor(TensorSpec {
                name: format!("{}.adam_denom", w.name),
                role: Role::Temporary,
                lifetime: Lifetime::Transient,
                ..w
            });
            spec = spec.outputs([d]);
        }
        let mut attrs = serde_json::Map::new();
        for k in SHARED_ATTRS {
            if let Some(v) = first.attrs.get(k) {
                attrs.insert(k.to_string(), v.clone());
            }
        }
        attrs.insert("elements".into(), json!(elements));
        attrs.insert("init_segments".into(), Value::Array(segments));
        attrs.insert("sharded".into(), json!(true));
        attrs.insert("world_size".into(), json!(self.opts.world));
        attrs.insert("norm_squared".into(), json!(norm.is_some()));
        spec.attrs = attrs;
        self.b.add_op(spec);
    }
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
        let block_params = g
            .tensors()
            .iter()
            .filter(|t| t.role == Role::Parameter && t.name.starts_with("h0."))
            .count();
        for l in 0..2 {
            let h = format!("h{l}.");
            assert_eq!(count("all_gather", &h), 2, "block {l}");
            assert_eq!(count("copy_out", &h), 2);
            assert_eq!(count("reduce_scatter", &h), 1);
            assert_eq!(count("chunk_cat", &h), 1);
            assert_eq!(count("adamw", &h), block_params);
        }
        let flat = FsdpOptions {
            layout: ShardLayout::Flat,
            ..FsdpOptions::new(4)
        };
        let f = shard_with(&g, &flat, &default_unit).unwrap();
        let count_f = |ty: &str| f.ops().iter().filter(|o| o.op_type == ty).count();
        assert_eq!(count_f("adamw"), 3 + 2, "one per block, wte, wpe, ln_f");
        assert_eq!(count_f("copy_out") + count_f("chunk_cat"), 0);
        // wte: the embedding, then the tied head (forward and backward).
        assert_eq!(count("all_gather", "wte."), 2);
        // Every parameter, gradient and moment is a 1/4 shard.
        let params: u64 = s
            .tensors()
            .iter()
            .filter(|t| t.role == Role::Parameter && t.lifetime == Lifetime::Persistent)
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
        let flat = FsdpOptions {
            layout: ShardLayout::Flat,
            ..FsdpOptions::new(2)
        };
        let e = shard_with(&g, &flat, &|_| "all".to_string())
            .unwrap_err()
            .to_string();
        assert!(e.contains("differ in optimizer or hyper-parameters"), "{e}");
        // Per parameter, each keeps its own update and learning rate.
        let s = shard_with(&g, &FsdpOptions::new(2), &|_| "all".to_string()).unwrap();
        let lrs: Vec<f64> = s
            .ops()
            .iter()
            .filter(|o| o.op_type == "adam")
            .map(|o| o.attrs["lr"].as_f64().unwrap())
            .collect();
        assert_eq!(lrs, [0.1, 0.2]);
        // One unit per parameter is fine: each gets its own gather.
        let s = shard(&g, 2).unwrap();
        assert_eq!(
            s.ops().iter().filter(|o| o.op_type == "all_gather").count(),
            2
        );
    }

    /// Position in program order of the op named `name`.
    fn at(s: &Graph, name: &str) -> usize {
        s.program_order()
            .iter()
            .position(|&o| s.op(o).name == name)
            .unwrap_or_else(|| panic!("no op {name}"))
    }

    #[test]
    fn prefetch_issues_gathers_ahead_and_the_plan_must_keep_them() {
        let g = gpt2::build(&Gpt2Config::small_config(3, 32, 2, 8, 1, 64)).unwrap();
        let with = |prefetch| {
            let opts = FsdpOptions {
                prefetch,
                ..FsdpOptions::new(2)
            };
            shard_with(&g, &opts, &default_unit).unwrap()
        };
        // No prefetch: each gather right before its unit's first op.
        let s0 = with(0);
        assert!(at(&s0, "h1.all_gather0") > at(&s0, "h0.ln_1"));
        assert!(at(&s0, "h1.all_gather0") < at(&s0, "h1.ln_1"));
        // Prefetch 1: h1's gather before h0's first op, which waits for it.
        let s1 = with(1);
        assert!(at(&s1, "h1.all_gather0") < at(&s1, "h0.ln_1"));
        let ln = s1.op(s1.program_order()[at(&s1, "h0.ln_1")]);
        let ag = s1.program_order()[at(&s1, "h1.all_gather0")];
        assert!(ln.after.contains(&ag));
        // Prefetch 2: h2's gather before h0's first op too.
        let s2 = with(2);
        assert!(at(&s2, "h2.all_gather0") < at(&s2, "h0.ln_1"));
        // In backward, h1 is gathered again while h2's backward runs.
        assert!(at(&s1, "h1.all_gather1") < at(&s1, "h2.ln_1.backward"));
        // The same collectives either way.
        let count = |s: &Graph| s.ops().iter().filter(|o| o.op_type == "all_gather").count();
        assert_eq!(count(&s0), count(&s1));
        assert_eq!(count(&s0), count(&s2));
    }

    #[test]
    fn without_resharding_each_unit_is_gathered_once_and_kept() {
        // Four blocks: resharded, at most two are gathered at once (one
        // prefetched); kept, all four are at the start of the backward.
        let g = gpt2::build(&Gpt2Config::small_config(4, 32, 2, 8, 1, 64)).unwrap();
        let opts = FsdpOptions {
            reshard_after_forward: false,
            ..FsdpOptions::new(2)
        };
        let s = shard_with(&g, &opts, &default_unit).unwrap();
        for l in 0..4 {
            let n = s
                .ops()
                .iter()
                .filter(|o| o.op_type == "all_gather" && o.name.starts_with(&format!("h{l}.")))
                .count();
            assert_eq!(n, 1, "block {l}");
        }
        // The backward reads the forward's gathered views.
        let bw = s.op(s.program_order()[at(&s, "h0.attn.c_attn.backward_data")]);
        assert!(
            bw.inputs
                .iter()
                .any(|&t| s.tensor(t).name.ends_with(".gathered0"))
        );
        let peak = |s: &Graph| {
            let low = crate::lower::lower(s, false);
            let order = crate::lower::Lowered::from_op_ids(s.program_order());
            memplan_solver::evaluate(&low.problem, &order).peak
        };
        let (kept, resharded) = (peak(&s), peak(&shard(&g, 2).unwrap()));
        assert!(kept > resharded, "{kept} vs {resharded}");
    }
}
