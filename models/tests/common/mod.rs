//! Shared helpers of the model tests: the Hugging Face fixtures (made by
//! `scripts/make-hf-fixtures.py`), running a model, and editing checkpoints.
#![allow(dead_code)]

use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use tessera::module::{Act, Cx, Module, Replicated, SplitHidden};
use tessera::{Device, Tensor};

/// The fixture directory `name` (`gpt2`, `llama`, `mixtral`).
pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

/// The input ids and Hugging Face's logits for them.
pub struct Reference {
    /// `[batch, seq]`, u32.
    pub ids: Tensor,
    /// `[batch, seq, vocab]`, row-major.
    pub logits: Vec<f32>,
    pub dims: Vec<usize>,
}

pub fn reference(name: &str, dev: &Device) -> Reference {
    let tensors = read_tensors(&fixture(name).join("reference.safetensors"));
    let (dtype, shape, bytes) = &tensors["input_ids"];
    assert_eq!(*dtype, Dtype::I32);
    let ids: Vec<u32> = bytes.chunks_exact(4).map(|c| i32::from_le_bytes(c.try_into().unwrap()) as u32).collect();
    let (dtype, dims, bytes) = &tensors["logits"];
    assert_eq!(*dtype, Dtype::F32);
    Reference { ids: Tensor::from_vec(ids, shape.clone(), dev).unwrap(), logits: f32s(bytes), dims: dims.clone() }
}

/// Little-endian f32 values.
pub fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
}

/// The model's logits for `ids` (this rank's slice of the vocabulary), in eval mode.
pub fn logits<M: Module<In = Replicated, Out = SplitHidden>>(model: &M, cx: &mut Cx, ids: &Tensor) -> Tensor {
    cx.set_training(false);
    model.forward(cx, Act::new(ids.clone())).unwrap().0.into_tensor()
}

/// The largest absolute difference between two equally long slices.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "lengths differ");
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// A scratch directory removed when dropped.
pub use tessera::testing::Scratch as TempDir;

/// A copy of fixture `name`'s config and weights.
pub fn copy_fixture(name: &str) -> TempDir {
    let dir = TempDir::new(name);
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture(name).join(f), dir.path().join(f)).unwrap();
    }
    dir
}

/// Every tensor of a safetensors file: dtype, shape, bytes.
pub type Tensors = BTreeMap<String, (Dtype, Vec<usize>, Vec<u8>)>;

pub fn read_tensors(path: &Path) -> Tensors {
    let bytes = std::fs::read(path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    st.iter().map(|(n, v)| (n.to_string(), (v.dtype(), v.shape().to_vec(), v.data().to_vec()))).collect()
}

pub fn write_tensors(path: &Path, tensors: &Tensors) {
    let views: Vec<(&str, TensorView<'_>)> = tensors.iter().map(|(n, (d, s, b))| (n.as_str(), TensorView::new(*d, s.clone(), b).unwrap())).collect();
    std::fs::write(path, safetensors::tensor::serialize(views, None).unwrap()).unwrap();
}

/// Every parameter's value by first name, as f32 bits.
pub fn param_bits<M: Module>(model: &M) -> Vec<(String, Vec<u32>)> {
    tessera::module::distinct_params(model)
        .unwrap()
        .iter()
        .map(|p| (p.name().to_string(), p.param.value().unwrap().to_f32_vec().unwrap().iter().map(|v| v.to_bits()).collect()))
        .collect()
}
