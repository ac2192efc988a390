//! What a call gave a rank, compared bit for bit.

use tessera_core::{DType, Tensor};

/// What one call gave one rank: the shape, the dtype and the bits of every
/// element (as `f64`, which holds every dtype's values exactly). Equal
/// outcomes are the same bits, `-0.0` and NaN payloads included.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Outcome {
    pub dims: Vec<usize>,
    pub dtype: DType,
    pub bits: Vec<u64>,
}

impl Outcome {
    /// The outcome that is `t`.
    pub fn of(t: &Tensor) -> Outcome {
        Outcome { dims: t.dims().to_vec(), dtype: t.dtype(), bits: t.to_f64_vec().unwrap().iter().map(|v| v.to_bits()).collect() }
    }

    /// The elements, for comparisons within a bound.
    pub fn values(&self) -> Vec<f64> {
        self.bits.iter().map(|&b| f64::from_bits(b)).collect()
    }
}

/// Asserts that `got` is `want`, bit for bit; the message names `what` and
/// the first difference (a result can be a million elements: printing both
/// would bury it).
#[track_caller]
pub fn assert_same_bits(got: &[Outcome], want: &[Outcome], what: &str) {
    assert!(got == want, "{what}: {}", first_difference(got, want));
}

/// Where `got` first differs from `want`, in words.
fn first_difference(got: &[Outcome], want: &[Outcome]) -> String {
    if got.len() != want.len() {
        return format!("{} results where {} were expected", got.len(), want.len());
    }
    for (k, (g, w)) in got.iter().zip(want).enumerate() {
        if (&g.dims, g.dtype) != (&w.dims, w.dtype) {
            return format!("result {k} is {:?} {:?}, expected {:?} {:?}", g.dtype, g.dims, w.dtype, w.dims);
        }
        if let Some(j) = (0..g.bits.len().max(w.bits.len())).find(|&j| g.bits.get(j) != w.bits.get(j)) {
            let value = |bits: &[u64]| bits.get(j).map_or("nothing".to_string(), |&b| format!("{} ({b:#018x})", f64::from_bits(b)));
            return format!("result {k} ({:?} {:?}), element {j}: {}, expected {}", g.dtype, g.dims, value(&g.bits), value(&w.bits));
        }
    }
    "no difference found".to_string()
}
