//! The errors of loading, building and exporting the reference models.

/// Errors of `tessera-models`: each names the config field, file or tensor
/// at fault and says how to fix it.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A config field has a value this model cannot use (or a type it cannot read).
    #[error("config field `{field}`: {detail}")]
    Config {
        /// The field's name in `config.json` (dotted for nested fields).
        field: String,
        /// What is wrong and what would work.
        detail: String,
    },

    /// A file is missing, unreadable or not in the expected format.
    #[error("`{path}`: {detail}")]
    File {
        /// The file.
        path: String,
        /// What is wrong.
        detail: String,
    },

    /// A file or directory could not be read or written: the operating
    /// system's error is the source (and ends the message).
    #[error("`{path}`: {doing}: {source}")]
    Io {
        /// The file or directory.
        path: String,
        /// What was being done (`cannot read it`).
        doing: &'static str,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },

    /// The checkpoint lacks a tensor the model needs.
    #[error("checkpoint `{path}` has no tensor `{tensor}` (parameter `{param}` is stored there); the checkpoint is incomplete or belongs to another model")]
    MissingTensor {
        /// The checkpoint's weights file (or index).
        path: String,
        /// The Hugging Face name of the missing tensor.
        tensor: String,
        /// The Tessera parameter it would fill.
        param: String,
    },

    /// The checkpoint holds tensors for which the model has no parameter.
    #[error("checkpoint `{path}` holds tensors this model has no parameter for: {}; it belongs to another model or the config does not match the weights (layer count, tied embeddings)", tensors.join(", "))]
    UnexpectedTensors {
        /// The checkpoint's weights file (or index).
        path: String,
        /// The Hugging Face names of those tensors.
        tensors: Vec<String>,
    },

    /// A tensor's shape does not match what the config implies.
    #[error("checkpoint `{path}`: tensor `{tensor}` has shape {got:?}, but the config implies {expected:?}; the config does not match the weights")]
    TensorShape {
        /// The checkpoint's weights file.
        path: String,
        /// The Hugging Face name of the tensor.
        tensor: String,
        /// The shape the config implies.
        expected: Vec<usize>,
        /// The stored shape.
        got: Vec<usize>,
    },

    /// A tensor is stored in a dtype that cannot be loaded.
    #[error("checkpoint `{path}`: tensor `{tensor}` is stored as {dtype}; only f32, f16 and bf16 weights can be loaded (convert the checkpoint first)")]
    TensorDtype {
        /// The checkpoint's weights file.
        path: String,
        /// The Hugging Face name of the tensor.
        tensor: String,
        /// The stored dtype.
        dtype: String,
    },

    /// The model cannot be exported as it is.
    #[error("cannot export the model: {0}")]
    Export(String),

    /// An error of the runtime (building, materialising or running the model).
    #[error(transparent)]
    Tessera(#[from] tessera::Error),
}

/// Result with the [`Error`] of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// A [`Error::Config`] for `field`.
    pub(crate) fn config(field: impl Into<String>, detail: impl Into<String>) -> Error {
        Error::Config { field: field.into(), detail: detail.into() }
    }
}
