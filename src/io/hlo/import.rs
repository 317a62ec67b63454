//! A parsed HLO module → memplan's [`Graph`].
//!
//! One computation becomes one graph: each instruction that computes
//! something becomes an op, each array it produces a tensor. Instructions
//! that only name bytes made elsewhere make no op: `parameter` and
//! `constant` make step inputs, `tuple` and `get-tuple-element` are
//! resolved to the tensors they group or pick, `bitcast` (and `reshape`
//! between default layouts, which XLA lowers to a bitcast) makes a view.
//! `docs/hlo.md` lists every rule and what it approximates.
//!
//! `while`, `conditional` and `call` are single ops; their bodies' own peak
//! (computed here, recursively, by importing the body the same way with its
//! parameters and results counted by the caller) becomes a temporary output
//! of the op, live exactly at the op's step.

use std::collections::HashMap;

use memplan_solver as solver;
use serde_json::json;

use super::HloError;
use super::parser::{CompIdx, Computation, Instr, InstrIdx, Module, ShapeIndex, is_collective};
use super::shape::{ArrayShape, Shape};
use crate::error::Error;
use crate::graph::{
    Graph, GraphBuilder, Lifetime, OpId, OpKind, OpSpec, Role, TensorId, TensorSpec,
};
use crate::lower::{self, Lowered};

/// Deepest nesting of `while`/`call`/`conditional` bodies accepted.
pub const MAX_CALL_DEPTH: usize = 64;

/// How to import.
#[derive(Clone, Debug)]
pub struct ImportOptions {
    /// Alignment of every tensor's offset (XLA's CPU backend aligns buffers
    /// to 64 bytes).
    pub align: u64,
    /// Count memory as XLA's allocations hold it (see
    /// [`alias_outputs_into_parameters`]): each entry parameter that an
    /// output aliases keeps its bytes for the whole step, and that output
    /// is written into them. Off: one arena, where a donated parameter's
    /// bytes are free for anything once it is dead.
    pub xla_allocations: bool,
}

impl Default for ImportOptions {
    fn default() -> Self {
        ImportOptions {
            align: 64,
            xla_allocations: false,
        }
    }
}

/// Elementwise opcodes (XLA's `IsElementwise`), except `copy` and
/// `bitcast-convert`, which are handled where they matter.
const ELEMENTWISE: &[&str] = &[
    "abs",
    "add",
    "and",
    "atan2",
    "cbrt",
    "ceil",
    "clamp",
    "compare",
    "complex",
    "convert",
    "cosine",
    "count-leading-zeros",
    "divide",
    "erf",
    "exponential",
    "exponential-minus-one",
    "floor",
    "imag",
    "is-finite",
    "log",
    "log-plus-one",
    "logistic",
    "map",
    "maximum",
    "minimum",
    "multiply",
    "negate",
    "not",
    "or",
    "popcnt",
    "power",
    "real",
    "reduce-precision",
    "remainder",
    "round-nearest-afz",
    "round-nearest-even",
    "rsqrt",
    "select",
    "shift-left",
    "shift-right-arithmetic",
    "shift-right-logical",
    "sign",
    "sine",
    "sqrt",
    "stochastic-convert",
    "subtract",
    "tan",
    "tanh",
    "xor",
];

/// Every other opcode memplan imports as an ordinary op (operands in, fresh
/// results out).
const PLAIN: &[&str] = &[
    "after-all",
    "all-gather",
    "all-reduce",
    "all-reduce-start",
    "all-to-all",
    "batch-norm-grad",
    "batch-norm-inference",
    "batch-norm-training",
    "bitcast-convert",
    "broadcast",
    "cholesky",
    "collective-broadcast",
    "collective-permute",
    "concatenate",
    "convolution",
    "copy",
    "custom-call",
    "dot",
    "dynamic-reshape",
    "dynamic-slice",
    "dynamic-update-slice",
    "fft",
    "gather",
    "get-dimension-size",
    "infeed",
    "iota",
    "outfeed",
    "pad",
    "partition-id",
    "ragged-all-to-all",
    "ragged-dot",
    "recv",
    "recv-done",
    "reduce",
    "reduce-scatter",
    "reduce-window",
    "replica-id",
    "reshape",
    "reverse",
    "rng",
    "rng-bit-generator",
    "rng-get-and-update-state",
    "scatter",
    "select-and-scatter",
    "send",
    "send-done",
    "set-dimension-size",
    "slice",
    "sort",
    "topk",
    "transpose",
    "triangular-solve",
    "fusion",
    "while",
    "conditional",
    "call",
];

/// Opcodes with their own rule in the importer (no op, or a view).
const SPECIAL: &[&str] = &[
    "parameter",
    "constant",
    "tuple",
    "get-tuple-element",
    "domain",
    "bitcast",
    "opt-barrier",
    "add-dependency",
    "copy-start",
    "copy-done",
    "async-start",
    "async-update",
    "async-done",
    "all-gather-start",
    "all-gather-done",
    "collective-permute-start",
    "collective-permute-done",
    "all-reduce-done",
];

/// Whether memplan knows the HLO opcode `op`.
pub fn is_known_opcode(op: &str) -> bool {
    ELEMENTWISE.contains(&op) || PLAIN.contains(&op) || SPECIAL.contains(&op)
}

fn is_elementwise(m: &Computation, ins: &Instr) -> bool {
    if ELEMENTWISE.contains(&ins.opcode.as_str()) {
        return true;
    }
    if ins.opcode == "bitcast-convert" {
        // Elementwise only between types of the same width.
        let (Some(out), Some(inp)) = (
            ins.shape.as_array(),
            ins.operands
                .first()
                .and_then(|&o| m.instrs[o.index()].shape.as_array()),
        ) else {
            return false;
        };
        return out.element.bits == inp.element.bits;
    }
    false
}

/// What an instruction evaluates to: a tensor, or a tuple of values.
#[derive(Clone, Debug)]
enum Val {
    Leaf(TensorId),
    Tuple(Vec<Val>),
}

impl Val {
    fn leaves(&self, out: &mut Vec<TensorId>) {
        match self {
            Val::Leaf(t) => out.push(*t),
            Val::Tuple(v) => v.iter().for_each(|x| x.leaves(out)),
        }
    }
    fn at(&self, path: &[u32]) -> Option<&Val> {
        let mut cur = self;
        for &i in path {
            match cur {
                Val::Tuple(v) => cur = v.get(i as usize)?,
                Val::Leaf(_) => return None,
            }
        }
        Some(cur)
    }
}

/// Whether a computation is the entry (its parameters are step inputs, its
/// results step outputs) or a body whose parameters and results the caller
/// counts.
#[derive(Copy, Clone, PartialEq, Eq)]
enum Mode {
    Entry,
    Nested,
}

/// Per-module state shared by every computation's import.
struct Ctx<'m> {
    m: &'m Module,
    opts: &'m ImportOptions,
    /// Own peak of each body computation, once known; `None` while it is
    /// being computed (a second visit is a cycle).
    peaks: HashMap<CompIdx, Option<u64>>,
    /// Users of each instruction of each fused computation analysed.
    users: HashMap<CompIdx, Vec<Vec<InstrIdx>>>,
}

/// Imports the module's entry computation as a graph.
pub fn import_module(m: &Module, opts: &ImportOptions) -> Result<Graph, Error> {
    // Every computation, fused bodies and reducers included: an opcode
    // memplan does not know is an error (docs/hlo.md), not a guess, since
    // inside a fusion it decides which operands the output may reuse.
    for c in &m.computations {
        if let Some(ins) = c.instrs.iter().find(|i| !is_known_opcode(&i.opcode)) {
            return Err(err_at(
                ins,
                format!(
                    "%{}: unknown opcode '{}' in computation %{} (memplan knows XLA's HLO opcodes; see docs/hlo.md)",
                    ins.name, ins.opcode, c.name
                ),
            ));
        }
    }
    let mut ctx = Ctx {
        m,
        opts,
        peaks: HashMap::new(),
        users: HashMap::new(),
    };
    let built = build(&mut ctx, m.entry, Mode::Entry)?;
    let mut g = built.graph;
    if m.is_scheduled {
        let order: Vec<OpId> = g.op_ids().collect();
        g.add_order("xla-order", order)?;
    }
    let entry = m.entry();
    let md = &mut g.metadata;
    md.insert("source".into(), json!("hlo"));
    md.insert("hlo_module".into(), json!(m.name));
    md.insert("entry_computation".into(), json!(entry.name));
    md.insert("is_scheduled".into(), json!(m.is_scheduled));
    md.insert("instructions".into(), json!(m.num_instructions()));
    md.insert("entry_instructions".into(), json!(entry.instrs.len()));
    md.insert("computations".into(), json!(m.computations.len()));
    let count = |op: &str| entry.instrs.iter().filter(|i| i.opcode == op).count();
    md.insert("entry_fusions".into(), json!(count("fusion")));
    md.insert("entry_whiles".into(), json!(count("while")));
    md.insert("entry_parameters".into(), json!(entry.params.len()));
    md.insert("donated_parameter_bytes".into(), json!(built.donated_bytes));
    md.insert("parameter_bytes".into(), json!(built.param_bytes));
    if opts.xla_allocations {
        md.insert("xla_parameter_outputs".into(), json!(built.aliased));
    }
    Ok(g)
}

struct Built {
    graph: Graph,
    param_bytes: u64,
    donated_bytes: u64,
    /// With `xla_allocations`: (parameter, output written into it) names.
    aliased: Vec<(String, String)>,
}

fn err_at(ins: &Instr, msg: impl Into<String>) -> Error {
    Error::from(HloError::new(ins.line, ins.col, msg))
}

/// One computation's graph under construction.
struct Builder<'c> {
    m: &'c Module,
    comp: &'c Computation,
    mode: Mode,
    align: u64,
    b: GraphBuilder,
    vals: Vec<Option<Val>>,
    /// Whether an op produces each tensor (for roles).
    produced: Vec<bool>,
    param_bytes: u64,
    donated_bytes: u64,
}

impl Builder<'_> {
    fn new_tensor(&mut self, name: String, a: &ArrayShape, ins: &Instr) -> Result<TensorId, Error> {
        let size = a.byte_size().ok_or_else(|| {
            err_at(
                ins,
                format!(
                    "%{}: shape {a} is too large: its byte size overflows 64 bits",
                    ins.name
                ),
            )
        })?;
        let t = self.b.add_tensor(
            TensorSpec::new(name, size)
                .align(self.align)
                .dtype(a.element.name)
                .shape(a.dim_sizes()),
        );
        self.produced.push(false);
        Ok(t)
    }

    fn leaf_name(ins: &Instr, path: &[u32], whole: bool) -> String {
        tensor_name(&ins.name, if whole { &[] } else { path })
    }

    /// New tensors for every leaf of the instruction's shape.
    fn fresh(&mut self, ins: &Instr) -> Result<(Val, Vec<TensorId>), Error> {
        let mut made = Vec::new();
        let v = self.fresh_shape(ins, &ins.shape, &mut Vec::new(), &mut made)?;
        Ok((v, made))
    }

    fn fresh_shape(
        &mut self,
        ins: &Instr,
        s: &Shape,
        path: &mut Vec<u32>,
        made: &mut Vec<TensorId>,
    ) -> Result<Val, Error> {
        match s {
            Shape::Array(a) => {
                let name = Self::leaf_name(ins, path, matches!(ins.shape, Shape::Array(_)));
                let t = self.new_tensor(name, a, ins)?;
                made.push(t);
                Ok(Val::Leaf(t))
            }
            Shape::Tuple(parts) => {
                let mut v = Vec::with_capacity(parts.len());
                for (i, p) in parts.iter().enumerate() {
                    path.push(i as u32);
                    v.push(self.fresh_shape(ins, p, path, made)?);
                    path.pop();
                }
                Ok(Val::Tuple(v))
            }
        }
    }

    /// View tensors mirroring `base`, named after `ins`.
    fn views_of(
        &mut self,
        ins: &Instr,
        base: &Val,
        path: &mut Vec<u32>,
        made: &mut Vec<TensorId>,
    ) -> Val {
        match base {
            Val::Leaf(t) => {
                let whole = path.is_empty();
                let spec = self.b.tensor_spec(*t).clone();
                let v = self.b.add_tensor(TensorSpec {
                    name: Self::leaf_name(ins, path, whole),
                    view_of: Some(*t),
                    lifetime: Lifetime::Transient,
                    role: Role::Activation,
                    ..spec
                });
                self.produced.push(false);
                made.push(v);
                Val::Leaf(v)
            }
            Val::Tuple(parts) => {
                let mut out = Vec::with_capacity(parts.len());
                for (i, p) in parts.iter().enumerate() {
                    path.push(i as u32);
                    out.push(self.views_of(ins, p, path, made));
                    path.pop();
                }
                Val::Tuple(out)
            }
        }
    }

    fn operand(&self, ins: &Instr, k: usize) -> Result<&Val, Error> {
        let i = *ins.operands.get(k).ok_or_else(|| {
            err_at(
                ins,
                format!(
                    "%{}: {} needs operand {k}, it has {}",
                    ins.name,
                    ins.opcode,
                    ins.operands.len()
                ),
            )
        })?;
        Ok(self.vals[i.index()]
            .as_ref()
            .expect("operands are defined before their users"))
    }

    fn operand_leaves(&self, ins: &Instr) -> Vec<TensorId> {
        let mut out = Vec::new();
        for &o in &ins.operands {
            if let Some(v) = &self.vals[o.index()] {
                v.leaves(&mut out);
            }
        }
        let mut seen = std::collections::HashSet::new();
        out.retain(|t| seen.insert(*t));
        out
    }

    /// The root tensor of `t` (follows views).
    fn root_of(&self, mut t: TensorId) -> TensorId {
        while let Some(b) = self.b.tensor_spec(t).view_of {
            t = b;
        }
        t
    }
}

/// The name of the tensor for the leaf at `path` of an instruction's result
/// (`name` for an array, `name{i,j}` for a tuple's leaf), as XLA names values.
pub fn tensor_name(instr: &str, path: &[u32]) -> String {
    if path.is_empty() {
        instr.to_string()
    } else {
        let p: Vec<String> = path.iter().map(|i| i.to_string()).collect();
        format!("{instr}{{{}}}", p.join(","))
    }
}

/// Whether an `async-start`/`-update`/`-done` wraps a collective: its
/// called computation (or, for the later halves, its start's) holds one.
fn wraps_collective(m: &Module, comp: &Computation, ins: &Instr) -> bool {
    let mut cur = ins;
    for _ in 0..4 {
        if !cur.opcode.starts_with("async-") {
            return false;
        }
        if let Some(c) = cur.called("calls") {
            return m.comp(c).instrs.iter().any(|i| is_collective(&i.opcode));
        }
        match cur.operands.first() {
            Some(&o) => cur = &comp.instrs[o.index()],
            None => return false,
        }
    }
    false
}

fn op_kind(m: &Module, comp: &Computation, ins: &Instr) -> OpKind {
    if is_collective(&ins.opcode) || wraps_collective(m, comp, ins) {
        return OpKind::Collective;
    }
    match &ins.op_name {
        Some(n) if n.contains("transpose(") => OpKind::Backward,
        Some(n) if n.contains("jvp(") => OpKind::Forward,
        _ => OpKind::Other,
    }
}

/// Builds the graph of computation `c`.
fn build(ctx: &mut Ctx<'_>, c: CompIdx, mode: Mode) -> Result<Built, Error> {
    let m = ctx.m;
    let comp = m.comp(c);
    let mut bl = Builder {
        m,
        comp,
        mode,
        align: ctx.opts.align.max(1),
        b: GraphBuilder::new(if mode == Mode::Entry {
            m.name.clone()
        } else {
            comp.name.clone()
        }),
        vals: vec![None; comp.instrs.len()],
        produced: Vec::new(),
        param_bytes: 0,
        donated_bytes: 0,
    };

    // Donated entry parameters: (number, index prefix).
    let mut donated: Vec<(u64, ShapeIndex)> = Vec::new();
    if mode == Mode::Entry {
        for a in &m.input_output_alias {
            donated.push((a.param, a.param_index.clone()));
        }
        donated.extend(m.buffer_donors.iter().cloned());
        for (p, _) in &donated {
            if *p >= comp.params.len() as u64 {
                return Err(Error::from(HloError::new(
                    1,
                    1,
                    format!(
                        "the module header donates parameter {p}, but the entry computation %{} has {} parameters",
                        comp.name,
                        comp.params.len()
                    ),
                )));
            }
        }
    }

    for (i, ins) in comp.instrs.iter().enumerate() {
        let val = import_instr(ctx, &mut bl, ins, &donated)?;
        bl.vals[i] = Some(val);
    }
    control_edges(&mut bl);

    // What the root returns.
    let mut out = Vec::new();
    bl.vals[comp.root.index()]
        .as_ref()
        .expect("every instruction has a value")
        .leaves(&mut out);
    for t in out {
        let r = bl.root_of(t);
        let produced = bl.produced[r.index()];
        let spec = bl.b.tensor_spec_mut(r);
        match mode {
            Mode::Entry => {
                spec.lifetime = Lifetime::Persistent;
                if produced {
                    spec.role = Role::Output;
                }
            }
            // The caller holds the results: they cost the body nothing.
            Mode::Nested => spec.size = 0,
        }
    }
    let mut aliased = Vec::new();
    if mode == Mode::Entry && ctx.opts.xla_allocations {
        aliased = alias_outputs_into_parameters(&mut bl);
    }
    // Zeroed sizes may have made some hints invalid; ops that write step
    // outputs and are neither forward nor backward are the update.
    for o in 0..bl.b.num_ops() {
        let op = OpId(o as u32);
        let specs: Vec<(TensorId, TensorId)> = bl.b.op_spec_mut(op).reuse.clone();
        let keep: Vec<(TensorId, TensorId)> = specs
            .into_iter()
            .filter(|&(out, inp)| {
                let r = bl.root_of(inp);
                bl.b.tensor_spec(out).size <= bl.b.tensor_spec(r).size
            })
            .collect();
        let writes_output = mode == Mode::Entry
            && bl
                .b
                .op_spec_mut(op)
                .outputs
                .clone()
                .iter()
                .any(|&t| bl.b.tensor_spec(t).role == Role::Output);
        let spec = bl.b.op_spec_mut(op);
        spec.reuse = keep;
        if writes_output && spec.kind == OpKind::Other {
            spec.kind = OpKind::Optimizer;
        }
    }
    let (param_bytes, donated_bytes) = (bl.param_bytes, bl.donated_bytes);
    let graph = bl.b.build().map_err(|e| match mode {
        Mode::Entry => Error::from(e),
        Mode::Nested => Error::from(crate::error::GraphError::Other(format!(
            "computation %{}: {e}",
            comp.name
        ))),
    })?;
    Ok(Built {
        graph,
        param_bytes,
        donated_bytes,
        aliased,
    })
}

/// XLA's allocations for the header's `input_output_alias`: XLA gives
/// every entry parameter an allocation of its own and writes an output
/// that aliases it into that allocation. So the parameter's bytes are held
/// for the whole step (persistent), the output takes no bytes of its own
/// (size 0), and the op making the output runs after every op that reads
/// the parameter (it overwrites it). XLA may put other values into a dead
/// parameter's allocation, one that fits at a time; that is not counted,
/// so the peak is what XLA needs at most for the order, short of that
/// sharing. A pair is left as it is when the output is the parameter
/// itself, is not made by an op, or when an op reading the parameter
/// depends on the output (XLA copies then). Returns the pairs aliased, by
/// tensor name (parameter, output).
fn alias_outputs_into_parameters(bl: &mut Builder<'_>) -> Vec<(String, String)> {
    let m = bl.m;
    let mut pairs = Vec::new();
    let Some(root) = bl.vals[bl.comp.root.index()].clone() else {
        return pairs;
    };
    for a in &m.input_output_alias {
        let Some(&pi) = bl.comp.params.get(a.param as usize) else {
            continue;
        };
        let (Some(Val::Leaf(o)), Some(Some(Val::Leaf(p)))) = (
            root.at(&a.output),
            bl.vals[pi.index()].as_ref().map(|v| v.at(&a.param_index)),
        ) else {
            continue;
        };
        let (o, p) = (bl.root_of(*o), bl.root_of(*p));
        if o == p || !bl.produced[o.index()] {
            continue;
        }
        let reads = |bl: &Builder<'_>, op: OpId| {
            let spec = bl.b.op_spec(op);
            spec.inputs
                .iter()
                .chain(&spec.updates)
                .any(|&t| bl.root_of(t) == p)
        };
        let ops: Vec<OpId> = (0..bl.b.num_ops()).map(|k| OpId(k as u32)).collect();
        let Some(&maker) = ops
            .iter()
            .find(|&&op| bl.b.op_spec(op).outputs.contains(&o))
        else {
            continue;
        };
        let readers: Vec<OpId> = ops
            .iter()
            .copied()
            .filter(|&op| op != maker && reads(bl, op))
            .collect();
        let after_maker = descendants(bl, maker);
        if readers.iter().any(|r| after_maker.contains(r)) {
            continue;
        }
        bl.b.tensor_spec_mut(p).lifetime = Lifetime::Persistent;
        bl.b.tensor_spec_mut(o).size = 0;
        bl.b.op_spec_mut(maker).after.extend(readers);
        let name = |t: TensorId| bl.b.tensor_spec(t).name.clone();
        pairs.push((name(p), name(o)));
    }
    pairs
}

/// Every op that must run after `op`: it reads, directly or through other
/// ops, what `op` makes, or is listed `after` it.
fn descendants(bl: &Builder<'_>, op: OpId) -> std::collections::HashSet<OpId> {
    let n = bl.b.num_ops();
    let mut readers_of: HashMap<TensorId, Vec<OpId>> = HashMap::new();
    let mut later: HashMap<OpId, Vec<OpId>> = HashMap::new();
    for k in 0..n {
        let v = OpId(k as u32);
        let spec = bl.b.op_spec(v);
        for &t in spec.inputs.iter().chain(&spec.updates) {
            readers_of.entry(bl.root_of(t)).or_default().push(v);
        }
        for &a in &spec.after {
            later.entry(a).or_default().push(v);
        }
    }
    let mut seen = std::collections::HashSet::new();
    let mut stack = vec![op];
    while let Some(u) = stack.pop() {
        let made = bl.b.op_spec(u).outputs.iter();
        let readers = made.flat_map(|&t| readers_of.get(&bl.root_of(t)).into_iter().flatten());
        for &r in readers.chain(later.get(&u).into_iter().flatten()) {
            if seen.insert(r) {
                stack.push(r);
            }
        }
    }
    seen
}

/// `control-predecessors`: each becomes a tensor of no bytes that the
/// predecessor's op writes and the successor's op reads, so every order
/// memplan considers keeps them. Instructions that make no op (parameters,
/// tuples, bitcasts) are available from the start and need no edge.
fn control_edges(bl: &mut Builder<'_>) {
    let mut op_of: HashMap<String, OpId> = HashMap::new();
    for o in 0..bl.b.num_ops() {
        let op = OpId(o as u32);
        op_of.insert(bl.b.op_spec_mut(op).name.clone(), op);
    }
    for ins in &bl.comp.instrs {
        let Some(&succ) = op_of.get(&ins.name) else {
            continue;
        };
        for p in &ins.control_preds {
            let pred_name = &bl.comp.instrs[p.index()].name;
            let Some(&pred) = op_of.get(pred_name) else {
                continue;
            };
            let t = bl.b.add_tensor(
                TensorSpec::new(format!("{pred_name}/control->{}", ins.name), 0)
                    .role(Role::Temporary),
            );
            bl.produced.push(true);
            bl.b.op_spec_mut(pred).outputs.push(t);
            bl.b.op_spec_mut(succ).inputs.push(t);
        }
    }
}

/// The own peak of a called computation: the max live bytes of its
/// instructions in listed order, its parameters and results excluded (the
/// caller counts them).
fn body_peak(ctx: &mut Ctx<'_>, c: CompIdx, ins: &Instr) -> Result<u64, Error> {
    match ctx.peaks.get(&c) {
        Some(Some(p)) => return Ok(*p),
        Some(None) => {
            return Err(err_at(
                ins,
                format!(
                    "computation %{} calls itself (through %{})",
                    ctx.m.comp(c).name,
                    ins.name
                ),
            ));
        }
        None => {}
    }
    if depth_of(ctx) >= MAX_CALL_DEPTH {
        return Err(err_at(
            ins,
            format!("called computations nest deeper than {MAX_CALL_DEPTH} levels"),
        ));
    }
    ctx.peaks.insert(c, None);
    let built = build(ctx, c, Mode::Nested)?;
    let g = built.graph;
    let low = lower::lower(&g, true);
    let order = Lowered::from_op_ids(g.program_order());
    let peak = solver::evaluate(&low.problem, &order).peak;
    ctx.peaks.insert(c, Some(peak));
    Ok(peak)
}

fn import_instr(
    ctx: &mut Ctx<'_>,
    bl: &mut Builder<'_>,
    ins: &Instr,
    donated: &[(u64, ShapeIndex)],
) -> Result<Val, Error> {
    let op = ins.opcode.as_str();
    match op {
        "parameter" => parameter(bl, ins, donated),
        "constant" => {
            let (v, made) = bl.fresh(ins)?;
            for t in made {
                let spec = bl.b.tensor_spec_mut(t);
                spec.role = Role::Input;
                spec.lifetime = Lifetime::Persistent;
            }
            Ok(v)
        }
        "tuple" => {
            let mut parts = Vec::with_capacity(ins.operands.len());
            for k in 0..ins.operands.len() {
                parts.push(bl.operand(ins, k)?.clone());
            }
            Ok(Val::Tuple(parts))
        }
        "get-tuple-element" => get_tuple_element(bl, ins),
        "domain" => Ok(bl.operand(ins, 0)?.clone()),
        "bitcast" | "reshape" if is_bitcast(bl, ins) => {
            let base = bl.operand(ins, 0)?.clone();
            let mut made = Vec::new();
            let v = bl.views_of(ins, &base, &mut Vec::new(), &mut made);
            // The view carries its own shape.
            if let (Some(a), [t]) = (ins.shape.as_array(), made.as_slice()) {
                let spec = bl.b.tensor_spec_mut(*t);
                spec.shape = Some(a.dim_sizes());
                spec.dtype = Some(a.element.name.to_string());
            }
            Ok(v)
        }
        "bitcast" => Err(err_at(
            ins,
            format!(
                "%{}: bitcast of a tuple or between different byte sizes",
                ins.name
            ),
        )),
        "opt-barrier"
        | "add-dependency"
        | "copy-done"
        | "async-done"
        | "async-update"
        | "all-gather-done"
        | "collective-permute-done"
        | "all-reduce-done" => async_done(ctx, bl, ins),
        "copy-start" | "async-start" | "all-gather-start" | "collective-permute-start" => {
            async_start(ctx, bl, ins)
        }
        _ if is_known_opcode(op) => plain(ctx, bl, ins),
        _ => Err(err_at(
            ins,
            format!(
                "%{}: unknown opcode '{}' (memplan knows XLA's HLO opcodes; see docs/hlo.md)",
                ins.name, ins.opcode
            ),
        )),
    }
}

/// A parameter: in a called computation, the caller's bytes (size 0); in
/// the entry, a step input, persistent unless the header donates it.
fn parameter(
    bl: &mut Builder<'_>,
    ins: &Instr,
    donated: &[(u64, ShapeIndex)],
) -> Result<Val, Error> {
    let (v, made) = bl.fresh(ins)?;
    let n = ins.param_number.unwrap_or(0);
    let leaves = ins.shape.leaves();
    for (t, (path, _)) in made.iter().zip(leaves) {
        let spec = bl.b.tensor_spec_mut(*t);
        match bl.mode {
            Mode::Nested => {
                spec.size = 0;
                spec.role = Role::Input;
            }
            Mode::Entry => {
                let size = spec.size;
                let is_donated = donated
                    .iter()
                    .any(|(p, idx)| *p == n && path.starts_with(idx));
                if is_donated {
                    spec.role = Role::Parameter;
                    spec.lifetime = Lifetime::Transient;
                    bl.donated_bytes += size;
                } else {
                    spec.role = Role::Input;
                    spec.lifetime = Lifetime::Persistent;
                }
                bl.param_bytes += size;
            }
        }
    }
    Ok(v)
}

fn get_tuple_element(bl: &mut Builder<'_>, ins: &Instr) -> Result<Val, Error> {
    let idx = ins.tuple_index.ok_or_else(|| {
        err_at(
            ins,
            format!("%{}: get-tuple-element without index=", ins.name),
        )
    })?;
    match bl.operand(ins, 0)? {
        Val::Tuple(parts) => parts.get(idx as usize).cloned().ok_or_else(|| {
            err_at(
                ins,
                format!(
                    "%{}: index={idx} is out of range for a tuple of {}",
                    ins.name,
                    parts.len()
                ),
            )
        }),
        Val::Leaf(_) => Err(err_at(
            ins,
            format!(
                "%{}: get-tuple-element of an operand that is not a tuple",
                ins.name
            ),
        )),
    }
}

/// Ops whose result is bytes an earlier value already holds (the end of an
/// async pair, barriers): a view of those bytes, made by an op that reads
/// the operands.
fn async_done(ctx: &mut Ctx<'_>, bl: &mut Builder<'_>, ins: &Instr) -> Result<Val, Error> {
    let base = match ins.opcode.as_str() {
        "copy-done" => bl.operand(ins, 0)?.at(&[0]).cloned(),
        "async-done" | "all-gather-done" | "collective-permute-done" => {
            match bl.operand(ins, 0)? {
                v @ Val::Tuple(_) => v.at(&[1]).cloned(),
                v => Some(v.clone()),
            }
        }
        _ => Some(bl.operand(ins, 0)?.clone()),
    };
    let inputs = bl.operand_leaves(ins);
    match base {
        Some(base) => {
            let mut made = Vec::new();
            let v = bl.views_of(ins, &base, &mut Vec::new(), &mut made);
            add_op(bl, ins, inputs, made, Vec::new(), None);
            Ok(v)
        }
        None => plain(ctx, bl, ins),
    }
}

/// The start of an async pair: its result tuple holds the operands (for
/// `copy-start` the source) beside fresh buffers.
fn async_start(ctx: &mut Ctx<'_>, bl: &mut Builder<'_>, ins: &Instr) -> Result<Val, Error> {
    let inputs = bl.operand_leaves(ins);
    let Shape::Tuple(parts) = &ins.shape else {
        return plain(ctx, bl, ins);
    };
    let alias_slot = if ins.opcode == "copy-start" { 1 } else { 0 };
    let operands: Vec<Val> = (0..ins.operands.len())
        .map(|k| bl.operand(ins, k).cloned())
        .collect::<Result<_, _>>()?;
    let aliased = match (&parts.get(alias_slot), operands.len()) {
        (Some(Shape::Tuple(_)), _) => Val::Tuple(operands),
        (Some(Shape::Array(_)), 1) => operands[0].clone(),
        _ => return plain(ctx, bl, ins),
    };
    let mut out = Vec::with_capacity(parts.len());
    let mut made = Vec::new();
    for (i, p) in parts.iter().enumerate() {
        if i == alias_slot {
            out.push(aliased.clone());
        } else {
            out.push(bl.fresh_shape(ins, p, &mut vec![i as u32], &mut made)?);
        }
    }
    add_op(bl, ins, inputs, made, Vec::new(), None);
    Ok(Val::Tuple(out))
}

/// `bitcast`, or a `reshape` between default layouts of the same byte size
/// (XLA turns those into bitcasts).
fn is_bitcast(bl: &Builder<'_>, ins: &Instr) -> bool {
    let Some(&o) = ins.operands.first() else {
        return false;
    };
    let (Some(out), Some(inp)) = (
        ins.shape.as_array(),
        bl.comp.instrs[o.index()].shape.as_array(),
    ) else {
        return false;
    };
    let same_bytes = out.byte_size().is_some() && out.byte_size() == inp.byte_size();
    match ins.opcode.as_str() {
        "bitcast" => same_bytes && matches!(bl.vals[o.index()], Some(Val::Leaf(_))),
        _ => {
            same_bytes
                && out.element == inp.element
                && out.has_default_layout()
                && inp.has_default_layout()
        }
    }
}

fn add_op(
    bl: &mut Builder<'_>,
    ins: &Instr,
    inputs: Vec<TensorId>,
    outputs: Vec<TensorId>,
    reuse: Vec<(TensorId, TensorId)>,
    extra: Option<(&str, u64)>,
) -> OpId {
    let mut spec = OpSpec::new(
        ins.name.clone(),
        op_kind(bl.m, bl.comp, ins),
        ins.opcode.clone(),
    )
    .inputs(inputs)
    .outputs(outputs.iter().copied())
    .attr("hlo_opcode", ins.opcode.clone());
    spec.flops = Some(super::flops::instruction(bl.m, bl.comp, ins, 0));
    if let Some(k) = &ins.fusion_kind {
        spec = spec.attr("fusion_kind", k.clone());
    }
    if let Some(t) = &ins.custom_call_target {
        spec = spec.attr("custom_call_target", t.clone());
    }
    if let Some(n) = &ins.op_name {
        spec = spec.attr("op_name", n.clone());
    }
    if let Some((k, v)) = extra {
        spec = spec.attr(k, v);
    }
    spec.reuse = reuse;
    for &t in &outputs {
        bl.produced[t.index()] = true;
    }
    bl.b.add_op(spec)
}

/// An ordinary op: operands in, fresh results out, reuse hints where XLA
/// may write the result into an operand's buffer, and for control flow a
/// temporary as large as the bodies' own peak.
fn plain(ctx: &mut Ctx<'_>, bl: &mut Builder<'_>, ins: &Instr) -> Result<Val, Error> {
    let inputs = bl.operand_leaves(ins);
    let (val, mut outputs) = if ins.opcode == "while" {
        while_results(bl, ctx.m, ins)?
    } else {
        bl.fresh(ins)?
    };
    let pairs = sharing_pairs(ctx, bl, ins);
    let reuse = reuse_hints(bl, ins, &val, &outputs, pairs);
    let mut extra = None;
    if let Some((t, peak)) = body_peak_tensor(ctx, bl, ins)? {
        outputs.extend(t);
        extra = Some(("body_peak_bytes", peak));
    }
    add_op(bl, ins, inputs, outputs, reuse, extra);
    Ok(val)
}

/// Where XLA may put a result of `ins` into an operand's buffer: (output
/// index, operand number, operand index) pairs, by XLA's sharing rules
/// (docs/hlo.md).
fn sharing_pairs(
    ctx: &mut Ctx<'_>,
    bl: &Builder<'_>,
    ins: &Instr,
) -> Vec<(ShapeIndex, usize, ShapeIndex)> {
    let mut pairs: Vec<(ShapeIndex, usize, ShapeIndex)> = Vec::new();
    let op = ins.opcode.as_str();
    let comp = bl.comp;
    let operand_shape =
        |k: usize| -> Option<&Shape> { ins.operands.get(k).map(|o| &comp.instrs[o.index()].shape) };
    match op {
        _ if is_elementwise(comp, ins) => {
            if let Some(out) = ins.shape.as_array() {
                for k in 0..ins.operands.len() {
                    if operand_shape(k)
                        .and_then(|s| s.as_array())
                        .is_some_and(|a| a.same_as(out))
                    {
                        pairs.push((vec![], k, vec![]));
                    }
                }
            }
        }
        "dynamic-update-slice" => pairs.push((vec![], 0, vec![])),
        "scatter" | "sort" => {
            // Variadic: result i in operand i's buffer.
            let n = match &ins.shape {
                Shape::Tuple(p) => p.len(),
                Shape::Array(_) => 1,
            };
            for i in 0..n {
                let out_idx = if matches!(ins.shape, Shape::Tuple(_)) {
                    vec![i as u32]
                } else {
                    vec![]
                };
                let same = ins
                    .shape
                    .leaves()
                    .get(i)
                    .zip(operand_shape(i).and_then(|s| s.as_array()))
                    .is_some_and(|((_, o), a)| a.same_as(o));
                if op == "scatter" || same {
                    pairs.push((out_idx, i, vec![]));
                }
            }
        }
        "triangular-solve" => pairs.push((vec![], 1, vec![])),
        "custom-call" => {
            for (o, k, idx) in &ins.output_operand_alias {
                pairs.push((o.clone(), *k as usize, idx.clone()));
            }
        }
        "fusion" => {
            if let Some(f) = ins.called("calls") {
                pairs.extend(fusion_pairs(ctx, f, ins));
            }
        }
        "while" => {
            for (path, _) in ins.shape.leaves() {
                pairs.push((path.clone(), 0, path));
            }
        }
        "conditional" | "call" => {
            // A result the called computation returns straight from its
            // parameter is the operand's buffer in XLA (the output value
            // flows through the branch): let it take the operand's bytes.
            let callees: Vec<(CompIdx, usize)> = if op == "call" {
                ins.called_all("to_apply").map(|c| (c, 0)).collect()
            } else {
                ins.called_all("branch_computations")
                    .chain(ins.called_all("true_computation"))
                    .chain(ins.called_all("false_computation"))
                    .enumerate()
                    .map(|(k, c)| (c, k + 1))
                    .collect()
            };
            for (c, first_operand) in callees {
                let callee = ctx.m.comp(c);
                for (path, _) in ins.shape.leaves() {
                    if let Some((param, idx)) = passthrough(callee, &path) {
                        // A call's parameter j is operand j; a branch has
                        // one parameter, its own operand.
                        let k = if op == "call" {
                            param as usize
                        } else {
                            first_operand + param as usize
                        };
                        pairs.push((path, k, idx));
                    }
                }
            }
        }
        _ => {}
    }

    pairs
}

/// The pairs as reuse hints (output, operand tensor): only a result with
/// bytes of its own, no larger than the operand's root.
fn reuse_hints(
    bl: &Builder<'_>,
    ins: &Instr,
    val: &Val,
    outputs: &[TensorId],
    pairs: Vec<(ShapeIndex, usize, ShapeIndex)>,
) -> Vec<(TensorId, TensorId)> {
    let mut reuse = Vec::new();
    for (oi, k, ii) in pairs {
        let Some(Val::Leaf(out)) = val.at(&oi) else {
            continue;
        };
        if !outputs.contains(out) {
            // An aliased result (a loop invariant) has no bytes of its own.
            continue;
        }
        let Some(&o) = ins.operands.get(k) else {
            continue;
        };
        let Some(Val::Leaf(inp)) = bl.vals[o.index()].as_ref().and_then(|v| v.at(&ii)) else {
            continue;
        };
        let r = bl.root_of(*inp);
        if bl.b.tensor_spec(*out).size <= bl.b.tensor_spec(r).size && !reuse.contains(&(*out, *inp))
        {
            reuse.push((*out, *inp));
        }
    }
    reuse
}

/// Control flow: a temporary holding the called bodies' own peak, live at
/// the op (with the peak; `None` for other ops). An empty peak makes no
/// tensor.
fn body_peak_tensor(
    ctx: &mut Ctx<'_>,
    bl: &mut Builder<'_>,
    ins: &Instr,
) -> Result<Option<(Option<TensorId>, u64)>, Error> {
    let bodies: Vec<CompIdx> = match ins.opcode.as_str() {
        "while" => ins
            .called_all("body")
            .chain(ins.called_all("condition"))
            .collect(),
        "conditional" => ins
            .called_all("branch_computations")
            .chain(ins.called_all("true_computation"))
            .chain(ins.called_all("false_computation"))
            .collect(),
        "call" => ins.called_all("to_apply").collect(),
        _ => return Ok(None),
    };
    if bodies.is_empty() {
        return Ok(None);
    }
    let mut peak = 0u64;
    for c in bodies {
        peak = peak.max(body_peak(ctx, c, ins)?);
    }
    if peak == 0 {
        return Ok(Some((None, 0)));
    }
    let t = bl.b.add_tensor(
        TensorSpec::new(format!("{}/body-peak", ins.name), peak)
            .align(bl.align)
            .role(Role::Temporary),
    );
    bl.produced.push(false);
    Ok(Some((Some(t), peak)))
}

/// A `while`'s results: a state element the body returns unchanged (a
/// loop invariant, e.g. stacked weights a scan reads) is the initial
/// value's buffer itself, as in XLA; every other element is a fresh tensor
/// (which may take its initial value's bytes, see the reuse hints).
fn while_results(
    bl: &mut Builder<'_>,
    m: &Module,
    ins: &Instr,
) -> Result<(Val, Vec<TensorId>), Error> {
    let init = bl.operand(ins, 0)?.clone();
    let body = ins.called("body").map(|c| m.comp(c));
    let mut made = Vec::new();
    let val = build_while_val(bl, ins, &ins.shape, &mut Vec::new(), &init, body, &mut made)?;
    Ok((val, made))
}

fn build_while_val(
    bl: &mut Builder<'_>,
    ins: &Instr,
    s: &Shape,
    path: &mut Vec<u32>,
    init: &Val,
    body: Option<&Computation>,
    made: &mut Vec<TensorId>,
) -> Result<Val, Error> {
    match s {
        Shape::Array(_) => {
            let invariant = body.is_some_and(|b| {
                passthrough(b, path).is_some_and(|(p, idx)| p == 0 && idx == *path)
            });
            if invariant && let Some(Val::Leaf(t)) = init.at(path) {
                return Ok(Val::Leaf(*t));
            }
            bl.fresh_shape(ins, s, path, made)
        }
        Shape::Tuple(parts) => {
            let mut v = Vec::with_capacity(parts.len());
            for (i, p) in parts.iter().enumerate() {
                path.push(i as u32);
                v.push(build_while_val(bl, ins, p, path, init, body, made)?);
                path.pop();
            }
            Ok(Val::Tuple(v))
        }
    }
}

/// The parameter (number, index) that `comp` returns unchanged at `path`
/// of its result, following `tuple`, `get-tuple-element` and `bitcast`.
fn passthrough(comp: &Computation, path: &[u32]) -> Option<(u64, ShapeIndex)> {
    let mut cur = comp.root;
    let mut rest: Vec<u32> = path.to_vec();
    // Each step moves to an operand, which comes earlier: this terminates.
    loop {
        let x = &comp.instrs[cur.index()];
        match x.opcode.as_str() {
            "parameter" => return Some((x.param_number?, rest)),
            "tuple" if !rest.is_empty() => {
                cur = *x.operands.get(rest[0] as usize)?;
                rest.remove(0);
            }
            "get-tuple-element" => {
                rest.insert(0, u32::try_from(x.tuple_index?).ok()?);
                cur = *x.operands.first()?;
            }
            "bitcast" | "domain" if rest.is_empty() => cur = *x.operands.first()?,
            _ => return None,
        }
    }
}

fn depth_of(ctx: &Ctx<'_>) -> usize {
    // Bodies being computed right now are the call stack.
    ctx.peaks.values().filter(|p| p.is_none()).count()
}

/// Output/operand pairs a fusion may share, as XLA decides: an output made
/// by an in-place `dynamic-update-slice` or `scatter` on a fused parameter
/// (any fusion kind), and for loop and input fusions an operand whose fused
/// parameter is used only elementwise, with the output's exact shape.
fn fusion_pairs(
    ctx: &mut Ctx<'_>,
    f: CompIdx,
    ins: &Instr,
) -> Vec<(ShapeIndex, usize, ShapeIndex)> {
    let fused = ctx.m.comp(f);
    let mut pairs = Vec::new();
    let follow_bitcasts = |mut i: InstrIdx| {
        while fused.instrs[i.index()].opcode == "bitcast" {
            match fused.instrs[i.index()].operands.first() {
                Some(&o) => i = o,
                None => break,
            }
        }
        i
    };
    let leaves = ins.shape.leaves();
    for (path, _) in &leaves {
        // The instruction that makes this output.
        let mut cur = fused.root;
        let mut rest: &[u32] = path;
        while let [first, tail @ ..] = rest {
            let x = &fused.instrs[cur.index()];
            if x.opcode != "tuple" {
                break;
            }
            match x.operands.get(*first as usize) {
                Some(&o) => cur = o,
                None => break,
            }
            rest = tail;
        }
        if !rest.is_empty() {
            continue;
        }
        let cur = follow_bitcasts(cur);
        let x = &fused.instrs[cur.index()];
        if matches!(x.opcode.as_str(), "dynamic-update-slice" | "scatter")
            && let Some(&src) = x.operands.first()
        {
            let src = follow_bitcasts(src);
            if let Some(p) = fused.instrs[src.index()].param_number {
                pairs.push((path.clone(), p as usize, vec![]));
            }
        }
    }
    let loop_like = matches!(ins.fusion_kind.as_deref(), Some("kLoop" | "kInput"));
    if loop_like {
        let users = ctx.users.entry(f).or_insert_with(|| {
            let mut u = vec![Vec::new(); fused.instrs.len()];
            for (i, x) in fused.instrs.iter().enumerate() {
                for &o in &x.operands {
                    if !u[o.index()].contains(&InstrIdx(i as u32)) {
                        u[o.index()].push(InstrIdx(i as u32));
                    }
                }
            }
            u
        });
        for (k, &p) in fused.params.iter().enumerate() {
            let Some(pshape) = fused.instrs[p.index()].shape.as_array() else {
                continue;
            };
            if !uses_elementwise_or_tuple(fused, users, p) {
                continue;
            }
            for (path, out) in &leaves {
                if pshape.same_as(out) {
                    pairs.push((path.clone(), k, vec![]));
                }
            }
        }
    }
    pairs
}

/// XLA's `AreTransitiveUsesElementwiseOrTuple` inside a fused computation.
fn uses_elementwise_or_tuple(
    fused: &Computation,
    users: &[Vec<InstrIdx>],
    start: InstrIdx,
) -> bool {
    let mut seen = vec![false; fused.instrs.len()];
    let mut stack = vec![start];
    while let Some(cur) = stack.pop() {
        if std::mem::replace(&mut seen[cur.index()], true) {
            continue;
        }
        for &u in &users[cur.index()] {
            let x = &fused.instrs[u.index()];
            let ok = x.opcode == "tuple" || x.opcode == "copy" || is_elementwise(fused, x);
            if !ok {
                return false;
            }
            stack.push(u);
        }
    }
    true
}
