//! The executor's program: tensors bound to arena offsets, instructions in
//! run order, streams.
//!
//! A [`Program`] is everything an executor needs and nothing more: it knows
//! no graph, no planner and no model. Every tensor has an absolute byte
//! offset in one arena of [`Program::arena_bytes`] bytes, a dtype and a shape;
//! every instruction names a typed [`Kernel`] and its operands. Instructions
//! run in the order they are listed (on CPU strictly one after the other; on
//! CUDA each on its stream, with waits wherever two streams touch the same
//! bytes, see [`crate::schedule`]).
//!
//! Operand rules (checked by [`Program::validate`]):
//! - an instruction reads its `inputs`, writes its `outputs`, and reads and
//!   writes its `updates` in place;
//! - an output may share bytes with an input only as an exact *in-place pair*
//!   the kernel supports ([`Kernel::in_place_sources`]) — the planner's reuse
//!   hints. Any other overlap between an output and an input is handled by
//!   staging the input in the workspace ([`crate::binding`]); overlaps
//!   between two written operands are errors.

use std::fmt;

use crate::error::RuntimeError;
use crate::init::Init;
use crate::kernel::Kernel;

/// Index of a tensor in a [`Program`].
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TensorIdx(pub u32);

/// Index of an instruction in a [`Program`] (its position in run order).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct InstrIdx(pub u32);

/// A stream: instructions on one stream run in program order; instructions
/// on different streams may overlap unless they touch the same bytes.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct StreamId(pub u32);

impl TensorIdx {
    #[inline]
    pub fn index(self) -> usize {
        self.0 as usize
    }
}
impl InstrIdx {
    #[inline]
    pub fn index(self) -> usize {
        self.0 as usize
    }
}
impl StreamId {
    #[inline]
    pub fn index(self) -> usize {
        self.0 as usize
    }
}
impl fmt::Display for TensorIdx {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "t{}", self.0)
    }
}
impl fmt::Display for InstrIdx {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "i{}", self.0)
    }
}
impl fmt::Display for StreamId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "s{}", self.0)
    }
}

/// Element type of a tensor.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    /// bfloat16: stored in 2 bytes; computed in f32 by backends that take it.
    BF16,
    I32,
}

impl DType {
    /// Bytes per element ([`crate::dtype`]'s table).
    pub fn size(self) -> u64 {
        crate::dtype::ElementType::named(self.as_str())
            .expect("the executors' types are in the table")
            .unpacked_bytes()
    }
    pub fn as_str(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::I32 => "i32",
        }
    }
    /// A name of [`crate::dtype`]'s table (`f32`, `float32`, `bf16`,
    /// `i32`, `int32`, `s32`...) of one of the types the executors store.
    pub fn parse(s: &str) -> Option<DType> {
        match crate::dtype::ElementType::named(s)?.name {
            "f32" => Some(DType::F32),
            "bf16" => Some(DType::BF16),
            "s32" => Some(DType::I32),
            _ => None,
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a tensor is for (reports, initialization, what to read back).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Default)]
pub enum Role {
    Parameter,
    Gradient,
    OptimizerState,
    #[default]
    Activation,
    Temporary,
    Input,
    Output,
    /// A collective's buffer (gathered parameters, flat gradients).
    Communication,
}

/// A tensor bound to its bytes in the arena.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorDesc {
    pub name: String,
    pub dtype: DType,
    /// Dimensions, row-major. The element count is their product (1 for `[]`).
    pub shape: Vec<u64>,
    /// Absolute byte offset in the arena (a view's offset includes its
    /// offset inside its base).
    pub offset: u64,
    pub role: Role,
    /// Holds a meaningful value after the step (parameters, optimizer state,
    /// step inputs and outputs): nothing else may take its bytes.
    pub persistent: bool,
    /// The tensor whose bytes it views, if it is a view.
    pub view_of: Option<TensorIdx>,
    /// How to fill it before the first step, if it is a step input the
    /// executor initializes (parameters, optimizer state).
    pub init: Option<Init>,
}

impl TensorDesc {
    /// A tensor with no role, not persistent, no init.
    pub fn new(name: impl Into<String>, dtype: DType, shape: Vec<u64>, offset: u64) -> Self {
        TensorDesc {
            name: name.into(),
            dtype,
            shape,
            offset,
            role: Role::Activation,
            persistent: false,
            view_of: None,
            init: None,
        }
    }
    pub fn elements(&self) -> u64 {
        self.shape.iter().product()
    }
    pub fn bytes(&self) -> u64 {
        self.elements() * self.dtype.size()
    }
    /// Its bytes `[offset, offset + bytes)`.
    pub fn range(&self) -> std::ops::Range<u64> {
        self.offset..self.offset + self.bytes()
    }
}

/// One instruction: a kernel and its operands.
#[derive(Clone, Debug, PartialEq)]
pub struct Instr {
    pub name: String,
    pub kernel: Kernel,
    /// Read only.
    pub inputs: Vec<TensorIdx>,
    /// Written (their previous contents are ignored).
    pub outputs: Vec<TensorIdx>,
    /// Read and written in place.
    pub updates: Vec<TensorIdx>,
    pub stream: StreamId,
    /// Earlier instructions that must finish first beyond those it shares
    /// bytes with (which [`crate::schedule`] finds on its own).
    pub after: Vec<InstrIdx>,
}

impl Instr {
    pub fn new(name: impl Into<String>, kernel: Kernel) -> Self {
        Instr {
            name: name.into(),
            kernel,
            inputs: vec![],
            outputs: vec![],
            updates: vec![],
            stream: StreamId(0),
            after: vec![],
        }
    }
    pub fn inputs(mut self, t: impl IntoIterator<Item = TensorIdx>) -> Self {
        self.inputs.extend(t);
        self
    }
    pub fn outputs(mut self, t: impl IntoIterator<Item = TensorIdx>) -> Self {
        self.outputs.extend(t);
        self
    }
    pub fn updates(mut self, t: impl IntoIterator<Item = TensorIdx>) -> Self {
        self.updates.extend(t);
        self
    }
    pub fn stream(mut self, s: u32) -> Self {
        self.stream = StreamId(s);
        self
    }
}

/// A training step ready to execute; see the module docs.
#[derive(Clone, Debug, PartialEq)]
pub struct Program {
    pub name: String,
    /// Bytes of the one arena every tensor lives in.
    pub arena_bytes: u64,
    pub tensors: Vec<TensorDesc>,
    /// In run order.
    pub instrs: Vec<Instr>,
    /// Ranks running this program together (1 without collectives).
    pub world_size: u32,
}

/// Most streams a program may use.
pub const MAX_STREAMS: u32 = 16;

impl Program {
    pub fn tensor(&self, t: TensorIdx) -> &TensorDesc {
        &self.tensors[t.index()]
    }
    pub fn instr(&self, i: InstrIdx) -> &Instr {
        &self.instrs[i.index()]
    }
    pub fn tensor_by_name(&self, name: &str) -> Option<TensorIdx> {
        self.tensors
            .iter()
            .position(|t| t.name == name)
            .map(|i| TensorIdx(i as u32))
    }
    /// Number of streams (highest stream index + 1, at least 1).
    pub fn num_streams(&self) -> u32 {
        self.instrs
            .iter()
            .map(|i| i.stream.0 + 1)
            .max()
            .unwrap_or(1)
    }

    /// Checks everything an executor relies on: every tensor inside the arena
    /// and aligned to its element size, views inside their base, operand
    /// indices, kernel signatures (operand counts, dtypes, element counts),
    /// `after` pointing backwards, streams, and collectives agreeing with
    /// [`Program::world_size`]. Aliasing between operands is judged by
    /// [`crate::binding::Bindings::new`].
    pub fn validate(&self) -> Result<(), RuntimeError> {
        let nt = self.tensors.len();
        if self.world_size == 0 {
            return Err(RuntimeError::InvalidProgram(
                "world size must be at least 1".into(),
            ));
        }
        for t in &self.tensors {
            let bad = |why: String| RuntimeError::InvalidTensor {
                tensor: t.name.clone(),
                why,
            };
            let bytes = t
                .shape
                .iter()
                .try_fold(t.dtype.size(), |a, &d| a.checked_mul(d))
                .ok_or_else(|| bad(format!("shape {:?} overflows", t.shape)))?;
            let end = t
                .offset
                .checked_add(bytes)
                .ok_or_else(|| bad("offset + size overflows".into()))?;
            if bytes > 0 && end > self.arena_bytes {
                return Err(bad(format!(
                    "bytes [{}, {end}) pass the end of the arena ({} bytes)",
                    t.offset, self.arena_bytes
                )));
            }
            if t.offset % t.dtype.size() != 0 {
                return Err(bad(format!(
                    "offset {} is not a multiple of its element size {} ({})",
                    t.offset,
                    t.dtype.size(),
                    t.dtype
                )));
            }
            if let Some(b) = t.view_of {
                let Some(base) = self.tensors.get(b.index()) else {
                    return Err(bad(format!("views unknown tensor {b}")));
                };
                if bytes > 0 && (t.offset < base.offset || end > base.offset + base.bytes()) {
                    return Err(bad(format!(
                        "view bytes [{}, {end}) leave its base {:?} [{}, {})",
                        t.offset,
                        base.name,
                        base.offset,
                        base.offset + base.bytes()
                    )));
                }
            }
            if let Some(init) = &t.init {
                init.validate(t.elements()).map_err(bad)?;
            }
        }
        for (i, ins) in self.instrs.iter().enumerate() {
            let bad = |why: String| RuntimeError::InvalidInstr {
                instr: ins.name.clone(),
                why,
            };
            for &t in ins.inputs.iter().chain(&ins.outputs).chain(&ins.updates) {
                if t.index() >= nt {
                    return Err(bad(format!("names unknown tensor {t}")));
                }
            }
            for &a in &ins.after {
                if a.index() >= i {
                    return Err(bad(format!(
                        "must run after instruction {a}, which does not run before it"
                    )));
                }
            }
            if ins.stream.0 >= MAX_STREAMS {
                return Err(bad(format!(
                    "stream {} (at most {MAX_STREAMS} streams)",
                    ins.stream
                )));
            }
            ins.kernel.check_operands(self, ins).map_err(bad)?;
            if let Some(w) = ins.kernel.world_size()
                && w != self.world_size
            {
                return Err(bad(format!(
                    "collective for world size {w} in a program for world size {}",
                    self.world_size
                )));
            }
        }
        Ok(())
    }

    /// Tensors whose value is defined after a step: persistent ones that are
    /// not views.
    pub fn persistent_tensors(&self) -> impl Iterator<Item = TensorIdx> + '_ {
        self.tensors
            .iter()
            .enumerate()
            .filter(|(_, t)| t.persistent && t.view_of.is_none())
            .map(|(i, _)| TensorIdx(i as u32))
    }
}
