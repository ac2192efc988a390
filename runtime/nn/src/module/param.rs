//! Parameters: a logical (global) tensor description, this rank's shard of
//! it once materialised, and its accumulated gradient.

use parking_lot::{Mutex, MutexGuard};
use std::fmt;
use std::hash::Hasher;
use std::sync::Arc;
use tessera_core::ops::{self, QuantizedWeight};
use tessera_core::tensor::{DType, Init, Shape, Tensor};
use tessera_core::{Error, Result};

/// A parameter's identity (see [`Param::id`]), valid while the parameter lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ParamId(usize);

/// How a parameter is laid out over the tensor-parallel group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shard {
    /// Every rank holds the whole parameter.
    Full,
    /// Rank `rank` of `degree` holds the `rank`-th equal slice of dimension `dim`.
    Split {
        /// The dimension that is split.
        dim: usize,
        /// Which slice this rank holds.
        rank: usize,
        /// How many slices there are (the group's size).
        degree: usize,
    },
}

/// Where a parameter's first values come from when it is materialised, in
/// place of a draw from its [`Init`]: a pretrained checkpoint's tensor, read
/// for one rank only when that rank materialises its model (see
/// [`Param::set_initial_values`]).
pub trait InitialValues: Send + Sync {
    /// This rank's `shard` of a parameter of global shape `global`, as a
    /// tensor of the shard's shape in `dtype` on `device`.
    fn read(&self, global: &Shape, shard: Shard, dtype: DType, device: &tessera_core::Device) -> Result<Tensor>;
}

/// A trainable parameter.
///
/// A layer creates its parameters with their *global* shape and initial
/// distribution only; nothing is allocated until the model is materialised
/// for a rank, when the parameter gets its shard (decided by the role of the
/// layer in its parent) and draws exactly the values the unsharded parameter
/// holds there. Cloning shares the parameter (that is how weights are tied).
#[derive(Clone)]
pub struct Param(Arc<Inner>);

struct Inner {
    global: Shape,
    init: Init,
    /// A matrix that may be replaced by a quantized form for inference (a
    /// linear layer's weight; see [`Param::new_quantizable`]).
    quantizable: bool,
    state: Mutex<State>,
}

struct State {
    name: Option<String>,
    /// Where materialising reads the first values from instead of drawing
    /// them (see [`Param::set_initial_values`]); dropped once used.
    source: Option<Arc<dyn InitialValues>>,
    shard: Shard,
    value: Option<Tensor>,
    /// The quantized form that replaced the value for inference (see
    /// [`Param::set_quantized`]).
    quantized: Option<QuantizedWeight>,
    /// The dtype of the last value held (kept when a sharding engine frees
    /// the value): the dtype gradients are accumulated in.
    held: Option<DType>,
    grad: Option<Tensor>,
    /// Forward uses whose gradient has not arrived yet.
    pending: usize,
    /// Held by other pipeline stages only: never materialised on this rank.
    remote: bool,
}

impl Param {
    /// A parameter of global shape `shape`, to be drawn from `init`.
    pub fn new(shape: impl Into<Shape>, init: Init) -> Param {
        Self::with_kind(shape.into(), init, false)
    }

    /// A parameter like [`new`](Self::new) that inference may replace by a
    /// quantized form ([`set_quantized`](Self::set_quantized)): the weight
    /// matrix of a layer whose forward multiplies by it with
    /// [`quant_matmul`](tessera_core::ops::quant_matmul) when it holds one
    /// ([`Linear`](crate::Linear)'s). Other layers' parameters are never
    /// quantized by [`quantize_linears`](crate::quantize_linears), since
    /// they would have nothing to read.
    pub fn new_quantizable(shape: impl Into<Shape>, init: Init) -> Param {
        Self::with_kind(shape.into(), init, true)
    }

    fn with_kind(global: Shape, init: Init, quantizable: bool) -> Param {
        let state = State { name: None, source: None, shard: Shard::Full, value: None, quantized: None, held: None, grad: None, pending: 0, remote: false };
        Param(Arc::new(Inner { global, init, quantizable, state: Mutex::new(state) }))
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.0.state.lock()
    }

    /// The logical shape, before sharding.
    pub fn global_shape(&self) -> &Shape {
        &self.0.global
    }

    /// The initial distribution.
    pub fn init(&self) -> Init {
        self.0.init
    }

    /// The dotted name given at materialisation (the first, for a tied parameter).
    pub fn name(&self) -> Option<String> {
        self.state().name.clone()
    }

    /// This rank's shard layout.
    pub fn shard(&self) -> Shard {
        self.state().shard
    }

    /// The shape of this rank's shard.
    pub fn local_shape(&self) -> Shape {
        local_shape(&self.0.global, self.shard())
    }

    /// Whether both handles name one parameter (tied weights do).
    pub fn same(&self, other: &Param) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }

    /// The parameter's identity, equal for every handle to it (tied weights
    /// share one): a key for maps, so that walking a model of many thousand
    /// parameters stays linear.
    pub fn id(&self) -> ParamId {
        ParamId(Arc::as_ptr(&self.0) as usize)
    }

    /// Whether only other pipeline stages hold the parameter: materialising
    /// for a stage (see [`Cx::with_pipeline_chunks`](super::Cx::with_pipeline_chunks))
    /// gives this rank no value for it, and nothing here reads or updates it.
    pub fn is_remote(&self) -> bool {
        self.state().remote
    }

    /// This rank's values; an error before the model is materialised, and
    /// once the values were replaced by a quantized form.
    pub fn value(&self) -> Result<Tensor> {
        let s = self.state();
        s.value.clone().ok_or_else(|| {
            let name = s.name.as_deref().unwrap_or("?");
            if let Some(q) = &s.quantized {
                Error::param_unavailable(
                    "param",
                    format!(
                        "parameter `{name}` holds only its {} quantized form, for inference: only a layer that multiplies by it reads it; load the model again to train it or to read its f32 values",
                        q.format()
                    ),
                )
            } else if s.remote {
                Error::param_unavailable("param", format!("parameter `{name}` belongs to another pipeline stage; only the stages that run it hold its value"))
            } else {
                Error::param_unavailable("param", format!("parameter `{name}` has no value yet; materialise the model for a rank first"))
            }
        })
    }

    /// Replaces this rank's values (loading a checkpoint, ZeRO-3 gathering);
    /// a quantized form the parameter held is dropped, as it no longer
    /// stands for these values.
    pub fn set_value(&self, t: Tensor) -> Result<()> {
        let expected = self.local_shape();
        if *t.shape() != expected {
            return Err(Error::shape("param", format!("a value of shape {} for a parameter whose shard is {expected}", t.shape())));
        }
        let mut s = self.state();
        s.held = Some(t.dtype());
        s.value = Some(t);
        s.quantized = None;
        Ok(())
    }

    /// Whether inference may replace this parameter by a quantized form
    /// (made with [`new_quantizable`](Self::new_quantizable)).
    pub fn is_quantizable(&self) -> bool {
        self.0.quantizable
    }

    /// Replaces this rank's values by their quantized form `q` for
    /// inference, freeing the values: the layer's forward then multiplies
    /// by `q`, its backward refuses to run, and [`value`](Self::value) is an
    /// error that says so. `q` must have this rank's shard's shape (a
    /// tensor-parallel layer quantizes its own shard) and the parameter must
    /// be [quantizable](Self::is_quantizable). Most code calls
    /// [`quantize_linears`](crate::quantize_linears) instead.
    pub fn set_quantized(&self, q: QuantizedWeight) -> Result<()> {
        let expected = self.local_shape();
        let mut s = self.state();
        let name = s.name.as_deref().unwrap_or("?");
        if !self.0.quantizable {
            return Err(Error::invalid(
                "Param::set_quantized",
                format!("parameter `{name}` is not a layer's weight matrix that multiplies by a quantized form (see `Param::new_quantizable`); quantize linear layers' weights only"),
            ));
        }
        if q.shape() != expected {
            return Err(Error::shape(
                "Param::set_quantized",
                format!("a quantized weight of shape {} for parameter `{name}`, whose shard is {expected}", q.shape()),
            ));
        }
        s.value = None;
        s.grad = None;
        s.quantized = Some(q);
        Ok(())
    }

    /// The quantized form that replaced this rank's values, if any.
    pub fn quantized(&self) -> Option<QuantizedWeight> {
        self.state().quantized.clone()
    }

    /// Whether the parameter holds a quantized form instead of its values.
    pub fn is_quantized(&self) -> bool {
        self.state().quantized.is_some()
    }

    /// Drops this rank's values (ZeRO-3 frees parameters between uses).
    pub fn free_value(&self) {
        self.state().value = None;
    }

    /// The gradient accumulated since the last [`take_grad`](Self::take_grad).
    pub fn grad(&self) -> Option<Tensor> {
        self.state().grad.clone()
    }

    /// Replaces the accumulated gradient (data parallelism writes back the
    /// average over replicas); the shape must be this rank's shard's.
    pub fn set_grad(&self, g: Tensor) -> Result<()> {
        let expected = self.local_shape();
        if *g.shape() != expected {
            return Err(Error::shape("param", format!("a gradient of shape {} for a parameter whose shard is {expected}", g.shape())));
        }
        self.state().grad = Some(g);
        Ok(())
    }

    /// Takes the accumulated gradient, leaving none, and forgets forward
    /// uses still waiting for theirs (a forward whose backward never ran must
    /// not hold back the next step's gradient-ready announcement).
    pub fn take_grad(&self) -> Option<Tensor> {
        let mut s = self.state();
        s.pending = 0;
        s.grad.take()
    }

    /// Makes materialising read this parameter's values from `source`
    /// instead of drawing them from its [`Init`]: each rank then reads only
    /// its own shard, when it materialises (fine-tuning from a pretrained
    /// checkpoint, on any mesh). Set before the model is materialised; a
    /// parameter that already holds values keeps them.
    pub fn set_initial_values(&self, source: Arc<dyn InitialValues>) {
        self.state().source = Some(source);
    }

    pub(crate) fn materialise(&self, name: &str, shard: Shard, dtype: DType, key_seed: u64, device: &tessera_core::Device) -> Result<()> {
        let mut s = self.state();
        if s.value.is_some() || s.quantized.is_some() {
            // A tied parameter is reached through each of its users; the
            // first materialises it. A quantized one is already in place.
            return Ok(());
        }
        let local = local_shape(&self.0.global, shard);
        // The source is used once: it may hold a whole checkpoint's files open.
        let t = match s.source.take() {
            Some(source) => {
                let t = source.read(&self.0.global, shard, dtype, device)?;
                if *t.shape() != local || t.dtype() != dtype {
                    return Err(Error::shape(
                        "param",
                        format!("the initial values of `{name}` are {} {:?}; its shard is {local} {dtype:?}", t.shape(), t.dtype()),
                    ));
                }
                t
            }
            None => {
                let mut starts = vec![0; self.0.global.rank()];
                if let Shard::Split { dim, rank, .. } = shard {
                    starts[dim] = rank * local.dims()[dim];
                }
                let key = tessera_core::RngKey::new(key_seed, stream_of(name));
                Tensor::rand_slice(self.0.init, key, &self.0.global, &starts, local, dtype, device)?
            }
        };
        s.name = Some(name.to_string());
        s.shard = shard;
        s.held = Some(t.dtype());
        s.value = Some(t);
        s.remote = false;
        Ok(())
    }

    /// Names the parameter and its shard without a value: other pipeline
    /// stages hold it. A later [`materialise`](Self::materialise) (a tied
    /// weight another part of this stage uses) overrides this.
    pub(crate) fn mark_remote(&self, name: &str, shard: Shard) {
        let mut s = self.state();
        if s.value.is_none() {
            s.name = Some(name.to_string());
            s.shard = shard;
            s.remote = true;
            // The source stays: a tied weight that another part of this
            // stage uses is materialised after all.
        }
    }

    /// Records a forward use whose gradient the backward will deliver.
    pub(crate) fn note_use(&self) {
        self.state().pending += 1;
    }

    /// Adds `g` to the gradient; returns whether the gradient is now final
    /// (every forward use has delivered its part).
    pub(crate) fn add_grad(&self, g: Tensor) -> Result<bool> {
        let mut s = self.state();
        // Gradients are held in the parameter's own dtype: f32 (or f64) when
        // the parameter is its master copy, bf16/f16 when it is held in half
        // precision (each use's contribution then rounds once as it is added).
        let dtype = s.held.filter(|d| d.is_float()).unwrap_or(DType::F32);
        match &s.grad {
            Some(acc) if acc.dtype() == DType::F32 || acc.dtype() == DType::F64 => ops::accumulate(acc, &g)?,
            Some(acc) => {
                let sum = ops::add(&acc.to_dtype(DType::F32)?, &g.to_dtype(DType::F32)?)?.to_dtype(dtype)?;
                s.grad = Some(sum);
            }
            None if g.dtype() == dtype => s.grad = Some(g.contiguous()?),
            None => s.grad = Some(g.to_dtype(dtype)?),
        }
        s.pending = s.pending.saturating_sub(1);
        Ok(s.pending == 0)
    }
}

fn local_shape(global: &Shape, shard: Shard) -> Shape {
    match shard {
        Shard::Full => global.clone(),
        Shard::Split { dim, degree, .. } => {
            let mut d = global.dims().to_vec();
            d[dim] /= degree;
            Shape::new(d)
        }
    }
}

/// The RNG stream of a parameter: a hash of its dotted name, so its initial
/// values do not depend on how many parameters came before it or on the mesh.
fn stream_of(name: &str) -> u64 {
    // FNV-1a, 64 bit: stable across platforms and releases.
    let mut h = fnv::FnvHasher::default();
    h.write(name.as_bytes());
    h.finish()
}

impl fmt::Debug for Param {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = self.state();
        write!(f, "Param({}, global {}, {:?})", s.name.as_deref().unwrap_or("?"), self.0.global, s.shard)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_core::Device;

    /// Slices of one known global tensor: `[4, 6]` holding `0, 1, 2, ...`.
    struct Counting;

    impl InitialValues for Counting {
        fn read(&self, global: &Shape, shard: Shard, dtype: DType, device: &Device) -> Result<Tensor> {
            let whole = Tensor::from_vec((0..global.elem_count()).map(|i| i as f32).collect::<Vec<_>>(), global.clone(), device)?;
            let part = match shard {
                Shard::Full => whole,
                Shard::Split { dim, rank, degree } => {
                    let len = global.dims()[dim] / degree;
                    whole.narrow(dim, rank * len, len)?.contiguous()?
                }
            };
            part.to_dtype(dtype)
        }
    }

    /// A source handing back the wrong shape.
    struct Wrong;

    impl InitialValues for Wrong {
        fn read(&self, _: &Shape, _: Shard, dtype: DType, device: &Device) -> Result<Tensor> {
            Tensor::zeros([3], dtype, device)
        }
    }

    #[test]
    fn materialising_reads_this_ranks_shard_from_the_source_once() {
        let dev = Device::cpu();
        let p = Param::new([4, 6], Init::Normal { mean: 0.0, std: 1.0 });
        let source: Arc<dyn InitialValues> = Arc::new(Counting);
        p.set_initial_values(source.clone());
        p.materialise("w", Shard::Split { dim: 1, rank: 1, degree: 2 }, DType::F32, 7, &dev).unwrap();
        let want: Vec<f32> = (0..4).flat_map(|r| (3..6).map(move |c| (r * 6 + c) as f32)).collect();
        assert_eq!(p.value().unwrap().to_vec::<f32>().unwrap(), want);
        // Used once, then let go: the source may hold a checkpoint's files open.
        assert_eq!(Arc::strong_count(&source), 1);

        // Without a source the draw is the usual one.
        let drawn = Param::new([4, 6], Init::Normal { mean: 0.0, std: 1.0 });
        drawn.materialise("w", Shard::Full, DType::F32, 7, &dev).unwrap();
        assert_ne!(drawn.value().unwrap().to_vec::<f32>().unwrap(), (0..24).map(|i| i as f32).collect::<Vec<_>>());
    }

    #[test]
    fn a_source_of_the_wrong_shape_is_refused_naming_the_parameter() {
        let p = Param::new([4, 6], Init::Normal { mean: 0.0, std: 1.0 });
        p.set_initial_values(Arc::new(Wrong));
        let e = p.materialise("blocks.0.w", Shard::Full, DType::F32, 7, &Device::cpu()).unwrap_err().to_string();
        assert!(e.contains("blocks.0.w") && e.contains("[4, 6]"), "{e}");
        assert!(p.value().is_err(), "nothing was set");
    }
}
