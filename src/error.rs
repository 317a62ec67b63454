//! Errors: what is wrong, in which file, at which element.

use std::path::PathBuf;

/// A problem with one element of a graph. Every variant names the element.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GraphError {
    #[error("unsupported format version {found} (this memplan reads version {supported})")]
    UnsupportedVersion { found: u64, supported: u64 },
    #[error("unknown format {found:?} (expected {expected:?})")]
    WrongFormat { found: String, expected: String },
    #[error("tensor id {0:?} is defined twice")]
    DuplicateTensor(String),
    #[error("op id {0:?} is defined twice")]
    DuplicateOp(String),
    #[error("op {op:?}: {field} names unknown tensor {tensor:?}")]
    UnknownTensor {
        op: String,
        field: &'static str,
        tensor: String,
    },
    #[error("op {op:?}: `after` names unknown op {target:?}")]
    UnknownOp { op: String, target: String },
    #[error("tensor {tensor:?}: view_of names unknown tensor {base:?}")]
    UnknownViewBase { tensor: String, base: String },
    #[error("tensor {0:?}: its chain of view_of bases loops back to itself")]
    ViewCycle(String),
    #[error("tensor {tensor:?} is produced by two ops, {first:?} and {second:?}")]
    TwoProducers {
        tensor: String,
        first: String,
        second: String,
    },
    #[error(
        "tensor {tensor:?} ({role}) is read by op {consumer:?} but no op produces it and it is not a step input (give it a producer, or role input/parameter/optimizer_state, or lifetime persistent)"
    )]
    NoProducer {
        tensor: String,
        role: &'static str,
        consumer: String,
    },
    #[error("op {op:?} both produces and reads tensor {tensor:?}")]
    ReadsOwnOutput { op: String, tensor: String },
    #[error("op {op:?} updates tensor {tensor:?} in place, which it also produces")]
    UpdatesOwnOutput { op: String, tensor: String },
    #[error("the ops form a cycle: {}", .0.join(" -> "))]
    Cycle(Vec<String>),
    #[error("tensor {0:?}: size plus alignment overflows u64 when added to the sizes before it")]
    SizeOverflow(String),
    #[error("tensor {tensor:?}: alignment must be at least 1, got {align}")]
    BadAlignment { tensor: String, align: u64 },
    #[error("op {op:?}: reuse hint {output:?} <- {input:?}: {why}")]
    BadReuse {
        op: String,
        output: String,
        input: String,
        why: &'static str,
    },
    #[error("op {op:?}: stream must be below 1024, got {stream}")]
    BadStream { op: String, stream: u64 },
    #[error("{0}")]
    Other(String),
}

/// A problem with a plan relative to its graph (reading it, not checking it).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanFormatError {
    #[error("unsupported plan version {found} (this memplan reads version {supported})")]
    UnsupportedVersion { found: u64, supported: u64 },
    #[error("unknown format {found:?} (expected {expected:?})")]
    WrongFormat { found: String, expected: String },
    #[error("order: unknown op {0:?}")]
    UnknownOp(String),
    #[error("offsets: unknown tensor {0:?}")]
    UnknownTensor(String),
    #[error("offsets: tensor {0:?} appears twice")]
    DuplicateTensor(String),
    #[error("reuse: unknown tensor {0:?}")]
    UnknownReuseTensor(String),
}

/// Every error memplan's library returns.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}:{line}:{column}: {msg}")]
    Parse {
        path: PathBuf,
        line: usize,
        column: usize,
        msg: String,
    },
    #[error("{}: {source}", display_path(.path))]
    Graph {
        path: Option<PathBuf>,
        #[source]
        source: GraphError,
    },
    #[error("{}: {source}", display_path(.path))]
    PlanFormat {
        path: Option<PathBuf>,
        #[source]
        source: PlanFormatError,
    },
    #[error("the plan is invalid: {0}")]
    Check(#[from] CheckError),
    #[error("unknown example {name:?}; known examples: {known}")]
    UnknownExample { name: String, known: String },
    /// A value the caller gave (an option, a size, a spec, a model's
    /// configuration) that memplan cannot accept.
    #[error("{0}")]
    InvalidArgument(String),
    /// A valid graph that what was asked cannot take: a transform that
    /// finds nothing to transform, a step the executors cannot run, two
    /// captures that are not of one step.
    #[error("{0}")]
    Unsupported(String),
    /// A bug in memplan (a plan of its own its checker refuses, a value it
    /// cannot write); the message asks for a report.
    #[error("internal error: {0} (please report it)")]
    Internal(String),
    /// The catch-all of earlier releases, now split into
    /// [`Error::InvalidArgument`], [`Error::Unsupported`] and
    /// [`Error::Internal`]; nothing in memplan returns it.
    #[deprecated(note = "use Error::InvalidArgument, Error::Unsupported or Error::Internal")]
    #[error("{0}")]
    Invalid(String),
    #[error("solver: {0}")]
    Solver(String),
    /// No plan within the memory budget (`memplan fit`); the message gives
    /// the best found and the bound that shows how far it can go.
    #[error("{0}")]
    DoesNotFit(String),
}

fn display_path(p: &Option<PathBuf>) -> String {
    match p {
        Some(p) => p.display().to_string(),
        None => "graph".to_string(),
    }
}

impl From<GraphError> for Error {
    fn from(source: GraphError) -> Self {
        Error::Graph { path: None, source }
    }
}

impl Error {
    /// Attaches a file path to an error that names no file yet.
    pub fn in_file(self, file: impl Into<PathBuf>) -> Self {
        match self {
            Error::Graph { path: None, source } => Error::Graph {
                path: Some(file.into()),
                source,
            },
            Error::PlanFormat { path: None, source } => Error::PlanFormat {
                path: Some(file.into()),
                source,
            },
            other => other,
        }
    }
}

/// Which kind of error an [`Error`] is: what a caller can act on without
/// reading the message. The C ABI returns [`ErrorKind::code`]; Python's
/// `MemplanError.kind` is [`ErrorKind::name`].
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// A bug in memplan.
    Internal,
    /// A file could not be read or written.
    Io,
    /// A graph or plan document memplan cannot read (syntax, format,
    /// version, an element that names something missing).
    Input,
    /// A value the caller gave (option, size, spec, example name).
    InvalidArgument,
    /// A plan its checker refuses.
    InvalidPlan,
    /// A valid graph that what was asked cannot take.
    Unsupported,
    /// No plan within the memory budget.
    DoesNotFit,
    /// The solver failed.
    Solver,
}

impl ErrorKind {
    pub const ALL: [ErrorKind; 8] = [
        ErrorKind::Internal,
        ErrorKind::Io,
        ErrorKind::Input,
        ErrorKind::InvalidArgument,
        ErrorKind::InvalidPlan,
        ErrorKind::Unsupported,
        ErrorKind::DoesNotFit,
        ErrorKind::Solver,
    ];

    /// The C ABI's return code (`MEMPLAN_E_*` in `memplan.h`; 0 is
    /// success). Stable across releases.
    pub fn code(self) -> i32 {
        match self {
            ErrorKind::Internal => 1,
            ErrorKind::Io => 2,
            ErrorKind::Input => 3,
            ErrorKind::InvalidArgument => 4,
            ErrorKind::InvalidPlan => 5,
            ErrorKind::Unsupported => 6,
            ErrorKind::DoesNotFit => 7,
            ErrorKind::Solver => 8,
        }
    }

    /// Its name in Python (`MemplanError.kind`) and in messages.
    pub fn name(self) -> &'static str {
        match self {
            ErrorKind::Internal => "internal",
            ErrorKind::Io => "io",
            ErrorKind::Input => "input",
            ErrorKind::InvalidArgument => "invalid_argument",
            ErrorKind::InvalidPlan => "invalid_plan",
            ErrorKind::Unsupported => "unsupported",
            ErrorKind::DoesNotFit => "does_not_fit",
            ErrorKind::Solver => "solver",
        }
    }
}

impl Error {
    /// Which kind of error this is.
    pub fn kind(&self) -> ErrorKind {
        #[allow(deprecated)]
        match self {
            Error::Io { .. } => ErrorKind::Io,
            Error::Parse { .. } | Error::Graph { .. } | Error::PlanFormat { .. } => {
                ErrorKind::Input
            }
            Error::Check(_) => ErrorKind::InvalidPlan,
            Error::UnknownExample { .. } | Error::InvalidArgument(_) | Error::Invalid(_) => {
                ErrorKind::InvalidArgument
            }
            Error::Unsupported(_) => ErrorKind::Unsupported,
            Error::Internal(_) => ErrorKind::Internal,
            Error::Solver(_) => ErrorKind::Solver,
            Error::DoesNotFit(_) => ErrorKind::DoesNotFit,
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What is wrong with a plan, as the plan checker finds it. Every variant
/// names the op or tensor.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CheckError {
    #[error("the order has {got} ops, the graph {want}")]
    OrderLength { got: usize, want: usize },
    #[error("the order names op index {0} which the graph does not have")]
    UnknownOp(u32),
    #[error("op {0:?} appears twice in the order")]
    DuplicateOp(String),
    #[error(
        "op {op:?} runs at step {op_step} but depends on {dep:?}, which runs at step {dep_step}"
    )]
    Dependency {
        op: String,
        dep: String,
        op_step: usize,
        dep_step: usize,
    },
    #[error("the plan has {got} offsets, the graph {want} tensors")]
    OffsetsLength { got: usize, want: usize },
    #[error("tensor {0:?} occupies memory but has no offset")]
    MissingOffset(String),
    #[error("tensor {0:?} owns no bytes (a view or zero-sized) but has an offset")]
    NeedlessOffset(String),
    #[error("tensor {tensor:?}: offset {offset} is not a multiple of its alignment {align}")]
    Misaligned {
        tensor: String,
        offset: u64,
        align: u64,
    },
    #[error("tensor {tensor:?}: bytes [{offset}, {end}) pass the end of the arena ({arena} bytes)")]
    OutsideArena {
        tensor: String,
        offset: u64,
        end: u128,
        arena: u64,
    },
    #[error("reuse {output:?} <- {input:?}: {why}")]
    BadReuse {
        output: String,
        input: String,
        why: String,
    },
    #[error(
        "tensors {a:?} [{a_off}, {a_end}) and {b:?} [{b_off}, {b_end}) share bytes while both live at step {step}"
    )]
    Overlap {
        a: String,
        a_off: u64,
        a_end: u64,
        b: String,
        b_off: u64,
        b_end: u64,
        step: usize,
    },
    #[error("copy {op:?} between host and device memory: {why}")]
    BadCopy { op: String, why: String },
}
