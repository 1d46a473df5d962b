//! The error type of the engine.

use std::path::PathBuf;

/// What went wrong while loading a model, tokenizing, or generating.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EngineError {
    /// An MLX call failed.
    #[error(transparent)]
    Mlx(#[from] mlx::Error),
    /// The KV cache rejected an update.
    #[error(transparent)]
    Cache(#[from] cache::CacheError),
    /// The block store could not be opened.
    #[error(transparent)]
    StoreOpen(#[from] store::OpenError),
    /// The model's namespace could not be registered in the block store.
    #[error(transparent)]
    StoreRegister(#[from] store::RegisterError),
    /// A published block was refused by the block store.
    #[error(transparent)]
    StoreInsert(#[from] store::InsertError),
    /// The block store failed to write (flush).
    #[error(transparent)]
    StoreWrite(#[from] store::WriteError),
    /// A file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The model path is neither a `.gguf` file nor a folder with `config.json`.
    #[error(
        "{0}: not a model (expected a .gguf file or a folder with config.json and *.safetensors)"
    )]
    NotAModel(PathBuf),
    /// A weights file could not be parsed (corrupt or truncated).
    #[error("corrupt weights in {path}: {message}")]
    CorruptWeights {
        /// The file.
        path: PathBuf,
        /// What the loader said.
        message: String,
    },
    /// A config file or metadata could not be understood.
    #[error("bad model config ({source_name}): {message}")]
    Config {
        /// Where the config came from (a path or "GGUF metadata").
        source_name: String,
        /// What is wrong.
        message: String,
    },
    /// The architecture is not one the engine implements.
    #[error(
        "unsupported architecture {0:?}: this engine runs {families}",
        families = crate::models::supported()
    )]
    UnsupportedArchitecture(String),
    /// A tensor the architecture needs is absent from the checkpoint.
    #[error("tensor {0} is missing from the checkpoint")]
    MissingTensor(String),
    /// A tensor's shape does not match the config.
    #[error("tensor {name} has shape {actual:?}, the config implies {expected:?}")]
    ShapeMismatch {
        /// The tensor.
        name: String,
        /// The shape the config implies.
        expected: Vec<i32>,
        /// The shape in the checkpoint.
        actual: Vec<i32>,
    },
    /// The tokenizer could not be built or used.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// The chat template failed to render (or there is none).
    #[error("chat template: {0}")]
    Template(String),
    /// The prompt does not fit the context.
    #[error("prompt of {prompt} tokens does not fit the context of {context} tokens")]
    PromptTooLong {
        /// Prompt tokens (including any cached prefix).
        prompt: usize,
        /// The context limit.
        context: usize,
    },
    /// A sampling or generation parameter is out of range.
    #[error("invalid parameter {name}: {message}")]
    InvalidParameter {
        /// The parameter.
        name: &'static str,
        /// Why it is rejected.
        message: String,
    },
    /// A token id outside the vocabulary.
    #[error("token id {id} is outside the vocabulary of {vocab}")]
    TokenOutOfRange {
        /// The id.
        id: u32,
        /// The vocabulary size.
        vocab: usize,
    },
    /// A thread panicked while holding a lock the request needed.
    #[error("internal error: a thread panicked while holding the {0} lock")]
    Poisoned(&'static str),
    /// The engine thread stopped before the request finished (it panicked or was stopped).
    #[error("internal error: the engine thread stopped before the request finished")]
    EngineStopped,
    /// A generation step failed after admission; every row in a failed batched step fails
    /// with it (their caches may be partly updated, so none is published).
    #[error("internal error: a generation step failed: {0}")]
    StepFailed(String),
}

/// Whose fault an error is, and so what a server answers (mapped to HTTP statuses once,
/// in the server): the request's, a passing condition's, or the engine's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ErrorClass {
    /// The request is wrong; sent again unchanged it fails again (HTTP 4xx).
    Invalid,
    /// The engine is overloaded or shutting down; the request may succeed later (HTTP 503).
    Unavailable,
    /// A failure inside the engine, not the request's fault (HTTP 500).
    Internal,
}

/// Result of an engine call.
pub type Result<T> = std::result::Result<T, EngineError>;

impl EngineError {
    /// Whose fault this error is when it answers a request. Loading and storage failures
    /// are the engine's: a request never names a file.
    pub fn class(&self) -> ErrorClass {
        match self {
            EngineError::Tokenizer(_)
            | EngineError::Template(_)
            | EngineError::PromptTooLong { .. }
            | EngineError::InvalidParameter { .. }
            | EngineError::TokenOutOfRange { .. } => ErrorClass::Invalid,
            EngineError::Mlx(_)
            | EngineError::Cache(_)
            | EngineError::StoreOpen(_)
            | EngineError::StoreRegister(_)
            | EngineError::StoreInsert(_)
            | EngineError::StoreWrite(_)
            | EngineError::Io { .. }
            | EngineError::NotAModel(_)
            | EngineError::CorruptWeights { .. }
            | EngineError::Config { .. }
            | EngineError::UnsupportedArchitecture(_)
            | EngineError::MissingTensor(_)
            | EngineError::ShapeMismatch { .. }
            | EngineError::Poisoned(_)
            | EngineError::EngineStopped
            | EngineError::StepFailed(_) => ErrorClass::Internal,
        }
    }

    pub(crate) fn config(source_name: impl Into<String>, message: impl Into<String>) -> Self {
        EngineError::Config {
            source_name: source_name.into(),
            message: message.into(),
        }
    }

    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        EngineError::Io {
            path: path.into(),
            source,
        }
    }
}
