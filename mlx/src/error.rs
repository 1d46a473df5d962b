//! The error type of every fallible MLX call.

use crate::Dtype;

/// What went wrong in a call into MLX.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// MLX threw an exception; `message` is MLX's own text.
    #[error("MLX {op} failed: {message}")]
    Mlx {
        /// The operation that failed.
        op: &'static str,
        /// MLX's exception message.
        message: String,
    },
    /// Host data was requested as one element type but the array holds another.
    #[error("array holds {actual} but {expected} was requested; call astype first")]
    DtypeMismatch {
        /// The dtype the caller asked for.
        expected: Dtype,
        /// The dtype the array holds.
        actual: Dtype,
    },
    /// MLX reported a dtype code this crate does not know.
    #[error("MLX returned unknown dtype code {0}")]
    UnknownDtype(u8),
    /// A file path could not be passed to MLX.
    #[error("path {0:?} is not valid UTF-8; MLX needs UTF-8 paths")]
    NonUtf8Path(std::path::PathBuf),
    /// A model file failed the checks of [`crate::validate`] and was not handed to MLX.
    #[error("{path} is not a valid {format} file: {reason}")]
    InvalidFile {
        /// The file.
        path: std::path::PathBuf,
        /// `GGUF` or `safetensors`.
        format: &'static str,
        /// What is wrong, naming the field.
        reason: String,
    },
    /// A model file could not be read.
    #[error("could not read {path}: {source}")]
    Io {
        /// The file.
        path: std::path::PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// An argument was rejected before reaching MLX.
    #[error("invalid argument to {op}: {message}")]
    InvalidArgument {
        /// The operation.
        op: &'static str,
        /// Why the argument is invalid.
        message: String,
    },
}

/// Result of a call into MLX.
pub type Result<T> = std::result::Result<T, Error>;

/// Turns a cxx exception from operation `op` into [`Error::Mlx`].
pub(crate) fn check<T>(op: &'static str, r: std::result::Result<T, cxx::Exception>) -> Result<T> {
    r.map_err(|e| Error::Mlx {
        op,
        message: e.what().to_string(),
    })
}
