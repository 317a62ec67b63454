//! The allocator's errors.

use crate::problem::ProblemError;

/// Everything that can go wrong outside the planners themselves.
#[derive(Debug, thiserror::Error)]
pub enum AllocError {
    #[error("{file}: {source}")]
    Io {
        file: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{file}:{line}: {what}")]
    Csv {
        file: String,
        line: u64,
        what: String,
    },
    #[error(transparent)]
    Problem(#[from] ProblemError),
}
