//! Errors of the runtime: each names what failed and where.

/// Everything that can go wrong building or running a program.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RuntimeError {
    #[error("invalid program: {0}")]
    InvalidProgram(String),
    #[error("tensor {tensor:?}: {why}")]
    InvalidTensor { tensor: String, why: String },
    #[error("instruction {instr:?}: {why}")]
    InvalidInstr { instr: String, why: String },
    /// Two operands of one instruction that write share bytes, or an update
    /// shares bytes with another operand: the plan is not valid.
    #[error("instruction {instr:?}: operands {a:?} and {b:?} share bytes and {why}")]
    Aliasing {
        instr: String,
        a: String,
        b: String,
        why: &'static str,
    },
    #[error("instruction {instr:?} ({kernel}): {why}")]
    Kernel {
        instr: String,
        kernel: &'static str,
        why: String,
    },
    #[error("out of {device} memory: could not allocate {bytes} bytes for {what}")]
    OutOfMemory {
        device: String,
        bytes: u64,
        what: String,
    },
    #[error("tensor {tensor:?}: {why}")]
    Access { tensor: String, why: String },
    #[error("collective {op} on rank {rank}: {why}")]
    Comm {
        op: &'static str,
        rank: usize,
        why: String,
    },
    /// A CUDA, cuBLAS, NVRTC or NCCL call failed, or a library is missing.
    #[error("{library}: {call} failed: {why}")]
    Device {
        library: &'static str,
        call: String,
        why: String,
    },
    #[error("{0} is not available: {1}")]
    Unavailable(&'static str, String),
    /// A setting (an environment variable) has a value that cannot be used.
    #[error("invalid setting: {0}")]
    InvalidSetting(String),
    /// A rank's NCCL communicator was not ready in time: another rank
    /// probably failed before joining, or never joined.
    #[error(
        "rank {rank} of {world}: NCCL set-up did not finish within {timeout:?}; another rank \
         probably failed or never joined (MEMPLAN_NCCL_INIT_TIMEOUT_S sets the limit in seconds)"
    )]
    CommInitTimeout {
        rank: usize,
        world: usize,
        timeout: std::time::Duration,
    },
    /// The error of one rank of a run with several.
    #[error("rank {rank}: {error}")]
    Rank {
        rank: usize,
        error: Box<RuntimeError>,
    },
}

pub type Result<T, E = RuntimeError> = std::result::Result<T, E>;
