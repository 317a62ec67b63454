//! The training-step graph: ops, tensors, and what memory they need.
//!
//! # Semantics
//! A [`Graph`] is one training step. Ops run one at a time in some order; the
//! op at step `i` reads its inputs and in-place updates and writes its
//! outputs during step `i`, so all of them are live at `i`.
//!
//! **Tensors** own bytes unless they are views. A tensor's bytes are live on
//! the closed step interval from its birth to its death:
//! - birth: its producer's step, or step 0 if nothing produces it (a step
//!   input: parameters, optimizer state, data);
//! - death: the last step of any op that reads it, updates it, or reads or
//!   makes a view of it; the last step of the whole step if it is
//!   [`Lifetime::Persistent`] (it must survive the step); its birth if nothing
//!   uses it.
//!
//! **Views** ([`Tensor::view_of`]) own no bytes: reading a view reads its
//! base, so every use of a view extends the life of the base (the *root*, the
//! first tensor up the `view_of` chain that is not a view).
//!
//! **In-place updates** ([`Op::updates`]): the op reads the tensor and writes
//! it in the same bytes. Which version an op reads follows the program order
//! (the order the ops are listed in, made topological): an op reads the last
//! version written before it. memplan turns this into ordering edges: an
//! update runs after every earlier reader and writer of the same root, and a
//! later reader runs after it ([`Graph::deps`]).
//!
//! **Reuse hints** ([`Op::reuse`]): an output *may* take the bytes of an
//! input, if this op is the input's last use in the chosen order and the
//! input is not persistent; the planner decides, and the plan records each
//! reuse it takes. The output must not be larger than the input.
//!
//! Zero-sized tensors occupy nothing; they still order their producer before
//! their readers.

use std::collections::HashMap;
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::error::GraphError;

/// Index of a tensor in a [`Graph`].
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct TensorId(pub u32);

/// Index of an op in a [`Graph`].
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct OpId(pub u32);

impl TensorId {
    #[inline]
    pub fn index(self) -> usize {
        self.0 as usize
    }
}
impl OpId {
    #[inline]
    pub fn index(self) -> usize {
        self.0 as usize
    }
}
impl fmt::Display for TensorId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "t{}", self.0)
    }
}
impl fmt::Display for OpId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "op{}", self.0)
    }
}

/// What a tensor is for; used in reports and pictures, and to decide which
/// tensors may lack a producer.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    Parameter,
    Gradient,
    OptimizerState,
    #[default]
    Activation,
    Temporary,
    Input,
    Output,
    Communication,
}

impl Role {
    pub const ALL: [Role; 8] = [
        Role::Parameter,
        Role::OptimizerState,
        Role::Gradient,
        Role::Activation,
        Role::Temporary,
        Role::Input,
        Role::Output,
        Role::Communication,
    ];
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Parameter => "parameter",
            Role::Gradient => "gradient",
            Role::OptimizerState => "optimizer_state",
            Role::Activation => "activation",
            Role::Temporary => "temporary",
            Role::Input => "input",
            Role::Output => "output",
            Role::Communication => "communication",
        }
    }
    /// Roles that may exist before the step without a producer.
    pub fn is_step_input(self) -> bool {
        matches!(self, Role::Parameter | Role::OptimizerState | Role::Input)
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Whether a tensor must survive the step.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Lifetime {
    /// Dies after its last use.
    #[default]
    Transient,
    /// Alive until the end of the step (and from the start, if nothing
    /// produces it): parameters, optimizer state, step outputs.
    Persistent,
}

/// What part of the training step an op belongs to.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum OpKind {
    Forward,
    Backward,
    Optimizer,
    Collective,
    #[default]
    Other,
}

impl OpKind {
    pub fn as_str(self) -> &'static str {
        match self {
            OpKind::Forward => "forward",
            OpKind::Backward => "backward",
            OpKind::Optimizer => "optimizer",
            OpKind::Collective => "collective",
            OpKind::Other => "other",
        }
    }
}

/// Which memory holds a tensor's bytes.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Space {
    /// The device arena (the memory a plan lays out).
    #[default]
    Device,
    /// Host memory (pinned), reached over a link: only the copy ops of
    /// [`crate::offload`] read or write it ([`COPY_TO_HOST`],
    /// [`COPY_TO_DEVICE`]), and it takes no room in the device arena.
    Host,
}

impl Space {
    pub fn as_str(self) -> &'static str {
        match self {
            Space::Device => "device",
            Space::Host => "host",
        }
    }
}

/// The op type that copies a device tensor to host memory: one device
/// input, and one host output (a new host tensor) or one host update (a
/// host tensor it overwrites, e.g. optimizer state written back), of the
/// same size.
pub const COPY_TO_HOST: &str = "copy_to_host";
/// The op type that copies a host tensor to the device: one host input,
/// one device output of the same size.
pub const COPY_TO_DEVICE: &str = "copy_to_device";

/// A tensor.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    pub name: String,
    /// Bytes it occupies (a view's logical size; views occupy nothing).
    pub size: u64,
    /// Its offset must be a multiple of this.
    pub align: u64,
    pub role: Role,
    pub lifetime: Lifetime,
    /// The op that writes it, if any.
    pub producer: Option<OpId>,
    /// The tensor whose bytes it views, if it is a view.
    pub view_of: Option<TensorId>,
    /// Element type, e.g. `f32` (informational; executors use it).
    pub dtype: Option<String>,
    /// Dimensions (informational; executors use it).
    pub shape: Option<Vec<u64>>,
    /// Which memory holds it (the device unless offloaded).
    pub space: Space,
}

impl Tensor {
    pub fn is_view(&self) -> bool {
        self.view_of.is_some()
    }
}

/// An op.
#[derive(Clone, Debug, PartialEq)]
pub struct Op {
    pub name: String,
    pub kind: OpKind,
    /// What it computes, e.g. `matmul`, `layernorm_backward`, `adamw`.
    pub op_type: String,
    pub inputs: Vec<TensorId>,
    pub outputs: Vec<TensorId>,
    /// Tensors it reads and writes in place.
    pub updates: Vec<TensorId>,
    /// Outputs that may take the bytes of an input: `(output, input)`.
    pub reuse: Vec<(TensorId, TensorId)>,
    /// Ops that must run before it, beyond its data dependencies.
    pub after: Vec<OpId>,
    /// Estimated run time in seconds, if known; overrides the cost model
    /// ([`crate::cost`]).
    pub cost: Option<f64>,
    /// Floating-point operations it performs, if known; else the cost model
    /// estimates them from its type and shapes.
    pub flops: Option<f64>,
    /// The stream it is issued on (0 by default).
    pub stream: u32,
    /// Op-specific attributes (shapes, hyper-parameters) for executors.
    pub attrs: serde_json::Map<String, serde_json::Value>,
}

/// A validated training-step graph; see the module docs for its semantics.
#[derive(Clone, Debug)]
pub struct Graph {
    pub name: String,
    tensors: Vec<Tensor>,
    ops: Vec<Op>,
    tensor_names: HashMap<String, TensorId>,
    op_names: HashMap<String, OpId>,
    root: Vec<TensorId>,
    /// Ops that read each tensor directly (inputs only).
    readers: Vec<Vec<OpId>>,
    /// Ops that use each root's bytes: read, update, or read/make a view.
    root_users: Vec<Vec<OpId>>,
    deps: Vec<Vec<OpId>>,
    program_order: Vec<OpId>,
    /// Other orders known for this graph (e.g. `xla-order`, the schedule of
    /// a scheduled HLO module), each a valid order of every op.
    pub extra_orders: Vec<(String, Vec<OpId>)>,
    /// Peaks other tools reported for this step (e.g. `xla`: XLA's total
    /// bytes; `torch-reserved`: PyTorch's measured `max_memory_reserved`).
    pub reference_peaks: Vec<(String, u64)>,
    /// Free-form information about where the graph came from.
    pub metadata: serde_json::Map<String, serde_json::Value>,
}

impl Graph {
    /// A builder holding this graph's tensors and ops under the same ids, to
    /// amend and build again (the program order is kept; known orders,
    /// reference peaks and metadata are not part of a builder).
    pub fn to_builder(&self) -> GraphBuilder {
        GraphBuilder {
            name: self.name.clone(),
            tensors: self.tensors.iter().map(TensorSpec::from).collect(),
            ops: self.ops.iter().map(OpSpec::from).collect(),
        }
    }

    /// Adds a named order after checking it holds every op once and respects
    /// every dependency.
    pub fn add_order(
        &mut self,
        name: impl Into<String>,
        order: Vec<OpId>,
    ) -> Result<(), GraphError> {
        let name = name.into();
        let n = self.ops.len();
        let bad = |why: String| GraphError::Other(format!("order {name:?}: {why}"));
        if order.len() != n {
            return Err(bad(format!("has {} ops, the graph {n}", order.len())));
        }
        let mut pos = vec![usize::MAX; n];
        for (i, &o) in order.iter().enumerate() {
            if o.index() >= n || pos[o.index()] != usize::MAX {
                return Err(bad(format!("names op index {} twice or out of range", o.0)));
            }
            pos[o.index()] = i;
        }
        for o in self.op_ids() {
            for &d in self.deps(o) {
                if pos[d.index()] > pos[o.index()] {
                    return Err(bad(format!(
                        "runs {:?} before its dependency {:?}",
                        self.op(o).name,
                        self.op(d).name
                    )));
                }
            }
        }
        self.extra_orders.retain(|(n, _)| *n != name);
        self.extra_orders.push((name, order));
        Ok(())
    }

    /// Sets every op's `flops` (one figure per op, in id order).
    pub fn set_flops(&mut self, flops: &[f64]) {
        assert_eq!(flops.len(), self.ops.len(), "one figure per op");
        for (op, &f) in self.ops.iter_mut().zip(flops) {
            op.flops = Some(f);
        }
    }

    pub fn tensors(&self) -> &[Tensor] {
        &self.tensors
    }
    pub fn ops(&self) -> &[Op] {
        &self.ops
    }
    pub fn num_ops(&self) -> usize {
        self.ops.len()
    }
    pub fn num_tensors(&self) -> usize {
        self.tensors.len()
    }
    pub fn tensor(&self, t: TensorId) -> &Tensor {
        &self.tensors[t.index()]
    }
    pub fn op(&self, o: OpId) -> &Op {
        &self.ops[o.index()]
    }
    pub fn tensor_ids(&self) -> impl ExactSizeIterator<Item = TensorId> + Clone + use<> {
        (0..self.tensors.len() as u32).map(TensorId)
    }
    pub fn op_ids(&self) -> impl ExactSizeIterator<Item = OpId> + Clone + use<> {
        (0..self.ops.len() as u32).map(OpId)
    }
    pub fn tensor_by_name(&self, name: &str) -> Option<TensorId> {
        self.tensor_names.get(name).copied()
    }
    pub fn op_by_name(&self, name: &str) -> Option<OpId> {
        self.op_names.get(name).copied()
    }
    /// The tensor that owns `t`'s bytes (`t` itself unless it is a view).
    pub fn root(&self, t: TensorId) -> TensorId {
        self.root[t.index()]
    }
    /// Whether `t` owns bytes that need a place in the (device) arena:
    /// not a view, not empty, not in host memory.
    pub fn occupies_memory(&self, t: TensorId) -> bool {
        let x = self.tensor(t);
        x.view_of.is_none() && x.size > 0 && x.space == Space::Device
    }
    /// Whether `t` lives in host memory ([`Space::Host`]).
    pub fn on_host(&self, t: TensorId) -> bool {
        self.tensor(t).space == Space::Host
    }
    /// Ops that list `t` among their inputs.
    pub fn readers(&self, t: TensorId) -> &[OpId] {
        &self.readers[t.index()]
    }
    /// Ops that use the bytes of root `t` (reads, updates, views): its death
    /// is the last of these. Empty for views.
    pub fn users_of_root(&self, t: TensorId) -> &[OpId] {
        &self.root_users[t.index()]
    }
    /// Every op that must run before `op` (data, view, `after` and in-place
    /// ordering), without duplicates.
    pub fn deps(&self, op: OpId) -> &[OpId] {
        &self.deps[op.index()]
    }
    /// The order the ops were given in, made topological (stable): the
    /// baseline order a framework would run.
    pub fn program_order(&self) -> &[OpId] {
        &self.program_order
    }
    /// Sum of the sizes of all tensors that occupy memory.
    pub fn total_bytes(&self) -> u64 {
        self.tensor_ids()
            .filter(|&t| self.occupies_memory(t))
            .map(|t| self.tensor(t).size)
            .sum()
    }
    /// Bytes live during the whole step whatever the order: persistent
    /// tensors that no op produces.
    pub fn resident_bytes(&self) -> u64 {
        self.tensor_ids()
            .filter(|&t| self.occupies_memory(t))
            .map(|t| self.tensor(t))
            .filter(|x| x.lifetime == Lifetime::Persistent && x.producer.is_none())
            .map(|x| x.size)
            .sum()
    }
    /// Sum of sizes by role (roots only).
    pub fn bytes_by_role(&self) -> Vec<(Role, u64)> {
        Role::ALL
            .iter()
            .map(|&r| {
                let s = self
                    .tensor_ids()
                    .filter(|&t| self.occupies_memory(t) && self.tensor(t).role == r)
                    .map(|t| self.tensor(t).size)
                    .sum();
                (r, s)
            })
            .collect()
    }
}

/// A tensor to add to a [`GraphBuilder`].
#[derive(Clone, Debug, PartialEq)]
pub struct TensorSpec {
    pub name: String,
    pub size: u64,
    pub align: u64,
    pub role: Role,
    pub lifetime: Lifetime,
    pub view_of: Option<TensorId>,
    pub dtype: Option<String>,
    pub shape: Option<Vec<u64>>,
    pub space: Space,
}

impl From<&Tensor> for TensorSpec {
    /// The spec that adds a copy of an existing tensor (same name, size,
    /// role, view base id) to another builder.
    fn from(x: &Tensor) -> Self {
        TensorSpec {
            name: x.name.clone(),
            size: x.size,
            align: x.align,
            role: x.role,
            lifetime: x.lifetime,
            view_of: x.view_of,
            dtype: x.dtype.clone(),
            shape: x.shape.clone(),
            space: x.space,
        }
    }
}

impl TensorSpec {
    /// A transient activation of `size` bytes, alignment 1.
    pub fn new(name: impl Into<String>, size: u64) -> Self {
        TensorSpec {
            name: name.into(),
            size,
            align: 1,
            role: Role::Activation,
            lifetime: Lifetime::Transient,
            view_of: None,
            dtype: None,
            shape: None,
            space: Space::Device,
        }
    }
    /// In host memory ([`Space::Host`]).
    pub fn host(mut self) -> Self {
        self.space = Space::Host;
        self
    }
    pub fn role(mut self, role: Role) -> Self {
        self.role = role;
        self
    }
    pub fn persistent(mut self) -> Self {
        self.lifetime = Lifetime::Persistent;
        self
    }
    pub fn lifetime(mut self, l: Lifetime) -> Self {
        self.lifetime = l;
        self
    }
    pub fn align(mut self, a: u64) -> Self {
        self.align = a;
        self
    }
    pub fn view_of(mut self, base: TensorId) -> Self {
        self.view_of = Some(base);
        self
    }
    pub fn dtype(mut self, d: impl Into<String>) -> Self {
        self.dtype = Some(d.into());
        self
    }
    pub fn shape(mut self, s: impl Into<Vec<u64>>) -> Self {
        self.shape = Some(s.into());
        self
    }
}

/// An op to add to a [`GraphBuilder`].
#[derive(Clone, Debug, PartialEq)]
pub struct OpSpec {
    pub name: String,
    pub kind: OpKind,
    pub op_type: String,
    pub inputs: Vec<TensorId>,
    pub outputs: Vec<TensorId>,
    pub updates: Vec<TensorId>,
    pub reuse: Vec<(TensorId, TensorId)>,
    pub after: Vec<OpId>,
    pub cost: Option<f64>,
    pub flops: Option<f64>,
    pub stream: u32,
    pub attrs: serde_json::Map<String, serde_json::Value>,
}

impl OpSpec {
    pub fn new(name: impl Into<String>, kind: OpKind, op_type: impl Into<String>) -> Self {
        OpSpec {
            name: name.into(),
            kind,
            op_type: op_type.into(),
            inputs: vec![],
            outputs: vec![],
            updates: vec![],
            reuse: vec![],
            after: vec![],
            cost: None,
            flops: None,
            stream: 0,
            attrs: Default::default(),
        }
    }
    pub fn inputs(mut self, t: impl IntoIterator<Item = TensorId>) -> Self {
        self.inputs.extend(t);
        self
    }
    pub fn outputs(mut self, t: impl IntoIterator<Item = TensorId>) -> Self {
        self.outputs.extend(t);
        self
    }
    pub fn updates(mut self, t: impl IntoIterator<Item = TensorId>) -> Self {
        self.updates.extend(t);
        self
    }
    /// `output` may take the bytes of `input` if this op is its last use.
    pub fn reuse(mut self, output: TensorId, input: TensorId) -> Self {
        self.reuse.push((output, input));
        self
    }
    pub fn after(mut self, ops: impl IntoIterator<Item = OpId>) -> Self {
        self.after.extend(ops);
        self
    }
    pub fn cost(mut self, c: f64) -> Self {
        self.cost = Some(c);
        self
    }
    pub fn flops(mut self, f: f64) -> Self {
        self.flops = Some(f);
        self
    }
    pub fn stream(mut self, s: u32) -> Self {
        self.stream = s;
        self
    }
    pub fn attr(mut self, key: &str, value: impl Into<serde_json::Value>) -> Self {
        self.attrs.insert(key.to_string(), value.into());
        self
    }
}

impl From<&Op> for OpSpec {
    /// The spec that adds a copy of an existing op (same name, tensor and op
    /// ids) to another builder.
    fn from(o: &Op) -> Self {
        OpSpec {
            name: o.name.clone(),
            kind: o.kind,
            op_type: o.op_type.clone(),
            inputs: o.inputs.clone(),
            outputs: o.outputs.clone(),
            updates: o.updates.clone(),
            reuse: o.reuse.clone(),
            after: o.after.clone(),
            cost: o.cost,
            flops: o.flops,
            stream: o.stream,
            attrs: o.attrs.clone(),
        }
    }
}

/// Builds a [`Graph`] in code; [`GraphBuilder::build`] validates it.
///
/// ```
/// use memplan::graph::{GraphBuilder, OpKind, OpSpec, Role, TensorSpec};
/// let mut b = GraphBuilder::new("tiny");
/// let w = b.add_tensor(TensorSpec::new("w", 64).role(Role::Parameter).persistent());
/// let x = b.add_tensor(TensorSpec::new("x", 32).role(Role::Input));
/// let y = b.add_tensor(TensorSpec::new("y", 32));
/// b.add_op(OpSpec::new("mm", OpKind::Forward, "matmul").inputs([x, w]).outputs([y]));
/// let g = b.build().unwrap();
/// assert_eq!(g.num_ops(), 1);
/// ```
#[derive(Clone, Debug, Default)]
pub struct GraphBuilder {
    name: String,
    tensors: Vec<TensorSpec>,
    ops: Vec<OpSpec>,
}

impl GraphBuilder {
    pub fn new(name: impl Into<String>) -> Self {
        GraphBuilder {
            name: name.into(),
            ..Default::default()
        }
    }
    pub fn add_tensor(&mut self, t: TensorSpec) -> TensorId {
        self.tensors.push(t);
        TensorId(self.tensors.len() as u32 - 1)
    }
    pub fn add_op(&mut self, o: OpSpec) -> OpId {
        self.ops.push(o);
        OpId(self.ops.len() as u32 - 1)
    }
    /// A tensor added earlier, to read or amend before building.
    pub fn tensor_spec(&self, t: TensorId) -> &TensorSpec {
        &self.tensors[t.index()]
    }
    pub fn tensor_spec_mut(&mut self, t: TensorId) -> &mut TensorSpec {
        &mut self.tensors[t.index()]
    }
    /// An op added earlier, to read or amend before building.
    pub fn op_spec(&self, o: OpId) -> &OpSpec {
        &self.ops[o.index()]
    }
    pub fn op_spec_mut(&mut self, o: OpId) -> &mut OpSpec {
        &mut self.ops[o.index()]
    }
    /// The id the next [`GraphBuilder::add_op`] will return.
    pub fn next_op_id(&self) -> OpId {
        OpId(self.ops.len() as u32)
    }
    pub fn num_tensors(&self) -> usize {
        self.tensors.len()
    }
    pub fn num_ops(&self) -> usize {
        self.ops.len()
    }

    /// Validates and builds the graph: names, sizes, views, producers and
    /// reads are checked in turn ([`Specs`]), then the dependencies (data,
    /// `after`, and the order of in-place updates against reads of the same
    /// bytes) give the program order.
    pub fn build(self) -> Result<Graph, GraphError> {
        let GraphBuilder { name, tensors, ops } = self;
        let s = Specs {
            tensors: &tensors,
            ops: &ops,
        };
        let (tensor_names, op_names) = s.names()?;
        s.check_sizes()?;
        let root = s.view_roots()?;
        let producer = s.producers()?;
        s.check_reads(&producer)?;
        s.check_reuse(&root)?;
        s.check_host(&root)?;
        let (mut deps, readers) = s.data_deps(&producer)?;
        let program_order = stable_topo(ops.len(), &deps).map_err(|cycle| {
            GraphError::Cycle(cycle.iter().map(|o| ops[o.index()].name.clone()).collect())
        })?;
        let mut root_users = s.root_users(&root, &program_order);
        s.in_place_deps(&root, &producer, &root_users, &mut deps);
        // Views own no bytes: their users were folded into their root.
        for (i, t) in tensors.iter().enumerate() {
            if t.view_of.is_some() {
                root_users[i].clear();
            }
        }
        Ok(Graph {
            name,
            tensors: tensors
                .into_iter()
                .zip(&producer)
                .map(|(s, &producer)| Tensor {
                    name: s.name,
                    size: s.size,
                    align: s.align,
                    role: s.role,
                    lifetime: s.lifetime,
                    producer,
                    view_of: s.view_of,
                    dtype: s.dtype,
                    shape: s.shape,
                    space: s.space,
                })
                .collect(),
            ops: ops
                .into_iter()
                .map(|s| Op {
                    name: s.name,
                    kind: s.kind,
                    op_type: s.op_type,
                    inputs: s.inputs,
                    outputs: s.outputs,
                    updates: s.updates,
                    reuse: s.reuse,
                    after: s.after,
                    cost: s.cost,
                    flops: s.flops,
                    stream: s.stream,
                    attrs: s.attrs,
                })
                .collect(),
            tensor_names,
            op_names,
            root,
            readers,
            root_users,
            deps,
            program_order,
            extra_orders: Vec::new(),
            reference_peaks: Vec::new(),
            metadata: Default::default(),
        })
    }
}

type NameMap<T> = HashMap<String, T>;
/// One list of ops per op or per tensor.
type OpLists = Vec<Vec<OpId>>;

/// The specs of a graph being built, and the passes that check them and
/// derive its structure, in the order [`GraphBuilder::build`] runs them.
/// Each pass may assume what the earlier ones checked.
struct Specs<'a> {
    tensors: &'a [TensorSpec],
    ops: &'a [OpSpec],
}

impl Specs<'_> {
    /// A tensor's name for errors (its id when it does not exist).
    fn tname(&self, t: TensorId) -> String {
        self.tensors
            .get(t.index())
            .map_or_else(|| t.to_string(), |x| x.name.clone())
    }

    /// Name maps; rejects duplicate names, zero alignments, out-of-range
    /// streams and negative or non-finite costs.
    fn names(&self) -> Result<(NameMap<TensorId>, NameMap<OpId>), GraphError> {
        let mut tensor_names = HashMap::with_capacity(self.tensors.len());
        for (i, t) in self.tensors.iter().enumerate() {
            if tensor_names
                .insert(t.name.clone(), TensorId(i as u32))
                .is_some()
            {
                return Err(GraphError::DuplicateTensor(t.name.clone()));
            }
            if t.align == 0 {
                return Err(GraphError::BadAlignment {
                    tensor: t.name.clone(),
                    align: 0,
                });
            }
        }
        let mut op_names = HashMap::with_capacity(self.ops.len());
        for (i, o) in self.ops.iter().enumerate() {
            if op_names.insert(o.name.clone(), OpId(i as u32)).is_some() {
                return Err(GraphError::DuplicateOp(o.name.clone()));
            }
            if o.stream >= 1024 {
                return Err(GraphError::BadStream {
                    op: o.name.clone(),
                    stream: o.stream as u64,
                });
            }
            for (field, v) in [("cost", o.cost), ("flops", o.flops)] {
                if let Some(v) = v
                    && !(v.is_finite() && v >= 0.0)
                {
                    return Err(GraphError::Other(format!(
                        "op {:?}: {field} must be a finite number >= 0, got {v}",
                        o.name
                    )));
                }
            }
        }
        Ok((tensor_names, op_names))
    }

    /// The total size (with alignment slack) must fit in u64, so every sum
    /// of sizes later on is safe.
    fn check_sizes(&self) -> Result<(), GraphError> {
        let mut total: u64 = 0;
        for t in self.tensors.iter().filter(|t| t.view_of.is_none()) {
            total = total
                .checked_add(t.size)
                .and_then(|x| x.checked_add(t.align - 1))
                .ok_or_else(|| GraphError::SizeOverflow(t.name.clone()))?;
        }
        Ok(())
    }

    /// The root of every tensor's view chain (itself when not a view);
    /// rejects unknown bases and view cycles.
    fn view_roots(&self) -> Result<Vec<TensorId>, GraphError> {
        let nt = self.tensors.len();
        for t in self.tensors {
            if let Some(base) = t.view_of
                && base.index() >= nt
            {
                return Err(GraphError::UnknownViewBase {
                    tensor: t.name.clone(),
                    base: base.to_string(),
                });
            }
        }
        (0..nt)
            .map(|i| {
                let mut cur = i;
                let mut steps = 0;
                while let Some(base) = self.tensors[cur].view_of {
                    cur = base.index();
                    steps += 1;
                    if steps > nt {
                        return Err(GraphError::ViewCycle(self.tensors[i].name.clone()));
                    }
                }
                Ok(TensorId(cur as u32))
            })
            .collect()
    }

    /// The producer of every tensor; rejects references to unknown tensors
    /// or ops and tensors with two producers.
    fn producers(&self) -> Result<Vec<Option<OpId>>, GraphError> {
        let (nt, no) = (self.tensors.len(), self.ops.len());
        let mut producer: Vec<Option<OpId>> = vec![None; nt];
        let check_t = |op: &OpSpec, field: &'static str, t: TensorId| {
            if t.index() >= nt {
                Err(GraphError::UnknownTensor {
                    op: op.name.clone(),
                    field,
                    tensor: t.to_string(),
                })
            } else {
                Ok(())
            }
        };
        for (i, o) in self.ops.iter().enumerate() {
            let id = OpId(i as u32);
            for &t in &o.outputs {
                check_t(o, "outputs", t)?;
                if let Some(first) = producer[t.index()]
                    && first != id
                {
                    return Err(GraphError::TwoProducers {
                        tensor: self.tname(t),
                        first: self.ops[first.index()].name.clone(),
                        second: o.name.clone(),
                    });
                }
                producer[t.index()] = Some(id);
            }
            for &t in &o.inputs {
                check_t(o, "inputs", t)?;
            }
            for &t in &o.updates {
                check_t(o, "updates", t)?;
            }
            if let Some(a) = o.after.iter().find(|a| a.index() >= no) {
                return Err(GraphError::UnknownOp {
                    op: o.name.clone(),
                    target: a.to_string(),
                });
            }
        }
        Ok(producer)
    }

    /// No op reads or updates its own output, and every tensor read has a
    /// source: a producer, or (up its view chain) a step input or a
    /// persistent tensor.
    fn check_reads(&self, producer: &[Option<OpId>]) -> Result<(), GraphError> {
        for o in self.ops {
            for (&t, update) in o
                .inputs
                .iter()
                .map(|t| (t, false))
                .chain(o.updates.iter().map(|t| (t, true)))
            {
                if !o.outputs.contains(&t) {
                    continue;
                }
                let (op, tensor) = (o.name.clone(), self.tname(t));
                return Err(if update {
                    GraphError::UpdatesOwnOutput { op, tensor }
                } else {
                    GraphError::ReadsOwnOutput { op, tensor }
                });
            }
        }
        let has_source = |t: TensorId| -> bool {
            let mut cur = t;
            loop {
                let x = &self.tensors[cur.index()];
                if producer[cur.index()].is_some()
                    || x.role.is_step_input()
                    || x.lifetime == Lifetime::Persistent
                {
                    return true;
                }
                match x.view_of {
                    Some(b) => cur = b,
                    None => return false,
                }
            }
        };
        for o in self.ops {
            if let Some(&t) = o.inputs.iter().chain(&o.updates).find(|&&t| !has_source(t)) {
                return Err(GraphError::NoProducer {
                    tensor: self.tname(t),
                    role: self.tensors[t.index()].role.as_str(),
                    consumer: o.name.clone(),
                });
            }
        }
        Ok(())
    }

    /// Every reuse hint names an output (not a view) and an input of its op,
    /// and the output fits in the input's bytes.
    fn check_reuse(&self, root: &[TensorId]) -> Result<(), GraphError> {
        let nt = self.tensors.len();
        for o in self.ops {
            for &(out, inp) in &o.reuse {
                let bad = |why| GraphError::BadReuse {
                    op: o.name.clone(),
                    output: self.tname(out),
                    input: self.tname(inp),
                    why,
                };
                if out.index() >= nt || inp.index() >= nt {
                    return Err(bad("unknown tensor"));
                }
                if !o.outputs.contains(&out) {
                    return Err(bad("the output is not an output of this op"));
                }
                if !o.inputs.contains(&inp) {
                    return Err(bad("the input is not an input of this op"));
                }
                if self.tensors[out.index()].view_of.is_some() {
                    return Err(bad("the output is a view"));
                }
                if self.tensors[out.index()].size > self.tensors[root[inp.index()].index()].size {
                    return Err(bad("the output is larger than the input"));
                }
            }
        }
        Ok(())
    }

    /// Host memory is reached only by copies: a host tensor is no view and
    /// has none; an op that names one is a [`COPY_TO_HOST`] (one device
    /// input; one host output or one host update, of the input's size) or
    /// a [`COPY_TO_DEVICE`] (one host input, one device output, same size),
    /// with no reuse hints.
    fn check_host(&self, root: &[TensorId]) -> Result<(), GraphError> {
        let host = |t: TensorId| self.tensors[root[t.index()].index()].space == Space::Host;
        for t in self.tensors {
            if t.space == Space::Host && t.view_of.is_some() {
                return Err(GraphError::Other(format!(
                    "tensor {:?} is in host memory and a view: host tensors own their bytes (make it a device view, or copy its base)",
                    t.name
                )));
            }
        }
        for (i, t) in self.tensors.iter().enumerate() {
            if t.view_of.is_some() && host(TensorId(i as u32)) {
                return Err(GraphError::Other(format!(
                    "tensor {:?} views host memory: only copy ops read host tensors, and they read them whole",
                    t.name
                )));
            }
        }
        for o in self.ops {
            let named = o.inputs.iter().chain(&o.outputs).chain(&o.updates);
            let touches = named.clone().any(|&t| host(t));
            let bad = |why: &str| {
                Err(GraphError::Other(format!(
                    "op {:?} ({}): {why}",
                    o.name, o.op_type
                )))
            };
            let size = |t: TensorId| self.tensors[t.index()].size;
            match o.op_type.as_str() {
                COPY_TO_HOST => {
                    let dst: Vec<TensorId> = o.outputs.iter().chain(&o.updates).copied().collect();
                    if o.inputs.len() != 1 || dst.len() != 1 || !o.reuse.is_empty() {
                        return bad(
                            "a copy to the host reads one device tensor and writes one host tensor (one output or one update), with no reuse hints",
                        );
                    }
                    if host(o.inputs[0]) || !host(dst[0]) {
                        return bad(
                            "a copy to the host reads a device tensor and writes a host one",
                        );
                    }
                    if size(o.inputs[0]) != size(dst[0]) {
                        return bad("its input and its host tensor differ in size");
                    }
                }
                COPY_TO_DEVICE => {
                    if o.inputs.len() != 1
                        || o.outputs.len() != 1
                        || !o.updates.is_empty()
                        || !o.reuse.is_empty()
                    {
                        return bad(
                            "a copy to the device reads one host tensor and writes one new device tensor, with no updates or reuse hints",
                        );
                    }
                    if !host(o.inputs[0])
                        || host(o.outputs[0])
                        || self.tensors[o.outputs[0].index()].view_of.is_some()
                    {
                        return bad(
                            "a copy to the device reads a host tensor and writes a device tensor that is not a view",
                        );
                    }
                    if size(o.inputs[0]) != size(o.outputs[0]) {
                        return bad("its host input and its output differ in size");
                    }
                }
                _ if touches => {
                    let t = named.copied().find(|&t| host(t)).expect("touches");
                    return bad(&format!(
                        "it names host tensor {:?}, but only {COPY_TO_HOST:?} and {COPY_TO_DEVICE:?} ops reach host memory: copy it to the device first",
                        self.tname(t)
                    ));
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// Data dependencies of each op (sorted, deduplicated): the producer of
    /// each tensor it reads or updates and of every base up their view
    /// chains (the bytes must exist), the producers of its outputs' bases
    /// (making a view reads its base), and `after`. Also the readers of
    /// every tensor. Rejects an op that depends on itself.
    fn data_deps(&self, producer: &[Option<OpId>]) -> Result<(OpLists, OpLists), GraphError> {
        let mut deps: Vec<Vec<OpId>> = vec![Vec::new(); self.ops.len()];
        let mut readers: Vec<Vec<OpId>> = vec![Vec::new(); self.tensors.len()];
        let chain_producers = |from: Option<TensorId>, d: &mut Vec<OpId>| {
            let mut cur = from;
            while let Some(c) = cur {
                d.extend(producer[c.index()]);
                cur = self.tensors[c.index()].view_of;
            }
        };
        for (i, o) in self.ops.iter().enumerate() {
            let d = &mut deps[i];
            for &t in o.inputs.iter().chain(&o.updates) {
                chain_producers(Some(t), d);
            }
            for &t in &o.outputs {
                // An output may be a view of another output of the same op
                // (aten returns one tensor for two results: the bias
                // gradients of mkldnn's RNN backward): no dependency on
                // itself.
                let mut chain = Vec::new();
                chain_producers(self.tensors[t.index()].view_of, &mut chain);
                d.extend(chain.into_iter().filter(|p| p.index() != i));
            }
            d.extend(o.after.iter().copied());
            d.sort_unstable();
            d.dedup();
            if d.contains(&OpId(i as u32)) {
                let name = self.ops[i].name.clone();
                return Err(GraphError::Cycle(vec![name.clone(), name]));
            }
            for &t in &o.inputs {
                readers[t.index()].push(OpId(i as u32));
            }
        }
        for r in readers.iter_mut() {
            r.dedup();
        }
        Ok((deps, readers))
    }

    /// The ops that read, update or view each root's bytes, in program
    /// order (indexed by root; a view's list is empty).
    fn root_users(&self, root: &[TensorId], program_order: &[OpId]) -> Vec<Vec<OpId>> {
        let mut root_users: Vec<Vec<OpId>> = vec![Vec::new(); self.tensors.len()];
        for &id in program_order {
            let o = &self.ops[id.index()];
            let views = o
                .outputs
                .iter()
                .filter(|t| self.tensors[t.index()].view_of.is_some());
            for &t in o.inputs.iter().chain(&o.updates).chain(views) {
                let users = &mut root_users[root[t.index()].index()];
                if users.last() != Some(&id) {
                    users.push(id);
                }
            }
        }
        root_users
    }

    /// In-place ordering: along each updated root's users in program order,
    /// every user comes after the last writer, and every writer after the
    /// readers since the previous write. Adds those edges to `deps`.
    fn in_place_deps(
        &self,
        root: &[TensorId],
        producer: &[Option<OpId>],
        root_users: &[Vec<OpId>],
        deps: &mut [Vec<OpId>],
    ) {
        let mut updated = vec![false; self.tensors.len()];
        for o in self.ops {
            for &t in &o.updates {
                updated[root[t.index()].index()] = true;
            }
        }
        for r in (0..self.tensors.len()).filter(|&r| updated[r]) {
            let mut last_writer = producer[r];
            let mut readers_since: Vec<OpId> = Vec::new();
            for &u in &root_users[r] {
                let o = &self.ops[u.index()];
                let writes = o.updates.iter().any(|&t| root[t.index()].index() == r);
                if let Some(w) = last_writer
                    && w != u
                {
                    deps[u.index()].push(w);
                }
                if writes {
                    deps[u.index()].extend(readers_since.drain(..).filter(|&rd| rd != u));
                    last_writer = Some(u);
                } else {
                    readers_since.push(u);
                }
            }
        }
        for d in deps.iter_mut() {
            d.sort_unstable();
            d.dedup();
        }
    }
}

/// Kahn's algorithm taking the smallest index first, so a graph listed in a
/// valid order keeps it. On a cycle, returns the ops of one cycle.
fn stable_topo(n: usize, deps: &[Vec<OpId>]) -> Result<Vec<OpId>, Vec<OpId>> {
    let mut succs: Vec<Vec<u32>> = vec![Vec::new(); n];
    let mut indeg = vec![0u32; n];
    for (v, d) in deps.iter().enumerate() {
        indeg[v] = d.len() as u32;
        for &u in d {
            succs[u.index()].push(v as u32);
        }
    }
    let mut ready: std::collections::BinaryHeap<std::cmp::Reverse<u32>> = (0..n as u32)
        .filter(|&v| indeg[v as usize] == 0)
        .map(std::cmp::Reverse)
        .collect();
    let mut order = Vec::with_capacity(n);
    while let Some(std::cmp::Reverse(v)) = ready.pop() {
        order.push(OpId(v));
        for &s in &succs[v as usize] {
            indeg[s as usize] -= 1;
            if indeg[s as usize] == 0 {
                ready.push(std::cmp::Reverse(s));
            }
        }
    }
    if order.len() == n {
        return Ok(order);
    }
    // Every op left has an unfinished dependency that is also left: walk
    // backwards through those until an op repeats.
    let start = (0..n).find(|&v| indeg[v] > 0).unwrap_or(0);
    let mut seen = vec![usize::MAX; n];
    let mut path = Vec::new();
    let mut cur = start;
    while seen[cur] == usize::MAX {
        seen[cur] = path.len();
        path.push(OpId(cur as u32));
        cur = deps[cur]
            .iter()
            .find(|u| indeg[u.index()] > 0)
            .map_or(cur, |u| u.index());
    }
    let mut cycle: Vec<OpId> = path[seen[cur]..].to_vec();
    cycle.reverse();
    cycle.push(cycle[0]);
    Err(cycle)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(g: &Graph, ops: &[OpId]) -> Vec<String> {
        ops.iter().map(|&o| g.op(o).name.clone()).collect()
    }

    #[test]
    fn in_place_update_waits_for_earlier_readers() {
        let mut b = GraphBuilder::new("t");
        let w = b.add_tensor(TensorSpec::new("w", 8).role(Role::Parameter).persistent());
        let x = b.add_tensor(TensorSpec::new("x", 8).role(Role::Input));
        let y = b.add_tensor(TensorSpec::new("y", 8));
        let g = b.add_tensor(TensorSpec::new("g", 8).role(Role::Gradient));
        let z = b.add_tensor(TensorSpec::new("z", 8).role(Role::Output).persistent());
        let fwd = b.add_op(
            OpSpec::new("fwd", OpKind::Forward, "mm")
                .inputs([x, w])
                .outputs([y]),
        );
        let grad = b.add_op(
            OpSpec::new("grad", OpKind::Backward, "g")
                .inputs([y])
                .outputs([g]),
        );
        let upd = b.add_op(
            OpSpec::new("upd", OpKind::Optimizer, "sgd")
                .inputs([g])
                .updates([w]),
        );
        let read2 = b.add_op(
            OpSpec::new("read2", OpKind::Other, "copy")
                .inputs([w])
                .outputs([z]),
        );
        let g = b.build().unwrap();
        assert!(g.deps(upd).contains(&fwd));
        assert!(g.deps(upd).contains(&grad));
        assert!(g.deps(read2).contains(&upd));
        assert_eq!(
            names(&g, g.program_order()),
            ["fwd", "grad", "upd", "read2"]
        );
    }

    #[test]
    fn program_order_is_stable_topological() {
        let mut b = GraphBuilder::new("t");
        let x = b.add_tensor(TensorSpec::new("x", 8));
        let y = b.add_tensor(TensorSpec::new("y", 8));
        b.add_op(
            OpSpec::new("second", OpKind::Other, "f")
                .inputs([x])
                .outputs([y]),
        );
        b.add_op(OpSpec::new("first", OpKind::Other, "f").outputs([x]));
        let g = b.build().unwrap();
        assert_eq!(names(&g, g.program_order()), ["first", "second"]);
    }

    #[test]
    fn reports_cycles_by_name() {
        let mut b = GraphBuilder::new("t");
        let x = b.add_tensor(TensorSpec::new("x", 8));
        let y = b.add_tensor(TensorSpec::new("y", 8));
        b.add_op(
            OpSpec::new("a", OpKind::Other, "f")
                .inputs([y])
                .outputs([x]),
        );
        b.add_op(
            OpSpec::new("b", OpKind::Other, "f")
                .inputs([x])
                .outputs([y]),
        );
        match b.build() {
            Err(GraphError::Cycle(c)) => {
                assert_eq!(c.first(), c.last());
                assert_eq!(c.len(), 3);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn an_op_may_output_a_view_of_its_own_output() {
        // mkldnn's RNN backward returns one tensor as both bias gradients.
        let mut b = GraphBuilder::new("t");
        let x = b.add_tensor(TensorSpec::new("x", 8));
        let g = b.add_tensor(TensorSpec::new("g", 8));
        let h = b.add_tensor(TensorSpec::new("h", 8).view_of(g));
        let y = b.add_tensor(TensorSpec::new("y", 8));
        b.add_op(OpSpec::new("make", OpKind::Other, "f").outputs([x]));
        let both = b.add_op(
            OpSpec::new("both", OpKind::Other, "f")
                .inputs([x])
                .outputs([g, h]),
        );
        let read = b.add_op(
            OpSpec::new("read", OpKind::Other, "f")
                .inputs([h])
                .outputs([y]),
        );
        let graph = b.build().unwrap();
        assert!(!graph.deps(both).contains(&both));
        assert!(graph.deps(read).contains(&both));
        assert_eq!(
            names(&graph, graph.program_order()),
            ["make", "both", "read"]
        );
    }

    #[test]
    fn views_extend_their_root() {
        let mut b = GraphBuilder::new("t");
        let x = b.add_tensor(TensorSpec::new("x", 8));
        let v = b.add_tensor(TensorSpec::new("v", 8).view_of(x));
        let y = b.add_tensor(TensorSpec::new("y", 8));
        let p = b.add_op(OpSpec::new("p", OpKind::Other, "f").outputs([x]));
        let r = b.add_op(
            OpSpec::new("r", OpKind::Other, "reshape")
                .inputs([x])
                .outputs([v]),
        );
        let c = b.add_op(
            OpSpec::new("c", OpKind::Other, "f")
                .inputs([v])
                .outputs([y]),
        );
        let g = b.build().unwrap();
        assert_eq!(g.root(v), x);
        assert_eq!(g.users_of_root(x), &[r, c]);
        assert!(g.deps(c).contains(&r) && g.deps(c).contains(&p));
        assert!(!g.occupies_memory(v));
    }

    #[test]
    fn rejects_unproduced_activation() {
        let mut b = GraphBuilder::new("t");
        let x = b.add_tensor(TensorSpec::new("x", 8));
        b.add_op(OpSpec::new("a", OpKind::Other, "f").inputs([x]));
        assert!(matches!(b.build(), Err(GraphError::NoProducer { .. })));
    }

    #[test]
    fn rejects_overflowing_sizes() {
        let mut b = GraphBuilder::new("t");
        b.add_tensor(TensorSpec::new("x", u64::MAX - 4));
        b.add_tensor(TensorSpec::new("y", 8));
        assert_eq!(b.build().unwrap_err(), GraphError::SizeOverflow("y".into()));
    }
}
