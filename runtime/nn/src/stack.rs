//! A sequence of layers of one type (the blocks of a transformer).

use crate::module::{
    call, call_backward, call_recompute, call_recompute_backward, describe_call, seq_convert, seq_convert_backward, Act, Activation, Cx, Describe, Kept,
    Module, Pipelined, Plain, Seq, Visitor,
};
use std::ops::Range;
use tessera_core::{Device, Error, Result, Tensor};

/// `N` layers of one module type applied in order; the output of each is
/// the input of the next, so the layer's input and output layouts must be
/// equal. The layers are named `"0"`, `"1"`, ... (parameters such as
/// `blocks.3.attn.qkv.weight`).
///
/// A recompute declared on a stack field (`#[recompute]`) applies to each
/// layer separately: the stack keeps each layer's input and reruns that
/// layer alone during its backward, rather than rerunning the whole stack.
///
/// Under sequence parallelism the stack takes and returns values in the form
/// its layer takes ([`Module::SEQ_IN`]); should a layer return another form,
/// the stack converts each output back, so any range of its layers (a
/// pipeline stage's share) starts and ends in the same form.
///
/// ```
/// use tessera::module::{materialize, Act, Cx, Module};
/// use tessera::nn::{Linear, Stack};
/// use tessera::{DType, Device, Tensor};
///
/// let dev = Device::cpu();
/// let cx = &mut Cx::new(dev.clone());
/// let layers = Stack::from_fn(3, |_| Linear::new(4, 4, false))?;
/// materialize(&layers, cx)?;
/// let (y, saved) = layers.forward(cx, Act::new(Tensor::zeros([2, 4], DType::F32, &dev)?))?;
/// let _dx = layers.backward(cx, saved, y)?;
/// assert_eq!(layers.stage_range(1, 2), 2..3);
/// # Ok::<(), tessera::Error>(())
/// ```
#[derive(Debug)]
pub struct Stack<M> {
    layers: Vec<M>,
}

impl<M> Stack<M> {
    /// A stack of `layers`, applied first to last (at least one).
    pub fn new(layers: Vec<M>) -> Result<Stack<M>> {
        if layers.is_empty() {
            return Err(Error::invalid("Stack::new", "a stack needs at least one layer; leave the field out of the model instead"));
        }
        Ok(Stack { layers })
    }

    /// A stack of `n` layers, layer `i` built by `f(i)`.
    pub fn from_fn(n: usize, f: impl FnMut(usize) -> Result<M>) -> Result<Stack<M>> {
        Self::new((0..n).map(f).collect::<Result<_>>()?)
    }

    /// Number of layers.
    pub fn len(&self) -> usize {
        self.layers.len()
    }

    /// Always false: a stack has at least one layer.
    pub fn is_empty(&self) -> bool {
        self.layers.is_empty()
    }

    /// The layers, first to last.
    pub fn layers(&self) -> &[M] {
        &self.layers
    }

    /// Iterates over the layers, first to last.
    pub fn iter(&self) -> std::slice::Iter<'_, M> {
        self.layers.iter()
    }

    /// The layers of pipeline stage `stage` of `stages`: the split is as even
    /// as possible, earlier stages taking the extra layers (10 layers over 4
    /// stages: 3, 3, 2, 2). An empty range at the end when `stage` is not
    /// below `stages`.
    pub fn stage_range(&self, stage: usize, stages: usize) -> std::ops::Range<usize> {
        let n = self.layers.len();
        if stage >= stages {
            return n..n;
        }
        let (base, extra) = (n / stages, n % stages);
        let start = stage * base + stage.min(extra);
        start..start + base + usize::from(stage < extra)
    }
}

impl<'a, M> IntoIterator for &'a Stack<M> {
    type Item = &'a M;
    type IntoIter = std::slice::Iter<'a, M>;
    fn into_iter(self) -> Self::IntoIter {
        self.layers.iter()
    }
}

/// Per layer: everything it saved, or only its input when it recomputes.
type Saves<M> = Vec<Kept<<M as Module<Plain>>::Saved, <M as Module<Plain>>::In>>;

impl<M> Module<Plain> for Stack<M>
where
    M: Module<Plain>,
    M: Module<Plain, Out = <M as Module<Plain>>::In>,
{
    type In = <M as Module<Plain>>::In;
    type Out = <M as Module<Plain>>::In;
    /// One entry per layer, first to last.
    type Saved = Saves<M>;

    const RECOMPUTES_PER_LAYER: bool = true;
    const SEQ_IN: Seq = <M as Module<Plain>>::SEQ_IN;
    const SEQ_OUT: Seq = <M as Module<Plain>>::SEQ_IN;

    fn forward(&self, cx: &mut Cx, x: Act<Self::In>) -> Result<(Act<Self::Out>, Self::Saved)> {
        self.forward_layers(cx, 0..self.layers.len(), x)
    }

    fn backward(&self, cx: &mut Cx, saved: Self::Saved, dy: Act<Self::Out>) -> Result<Act<Self::In>> {
        self.backward_layers(cx, 0..self.layers.len(), saved, dy)
    }

    fn check_tp(&self, path: &str, degree: usize, problems: &mut Vec<String>) {
        // The layers are alike: one report for the first stands for all.
        if let Some(first) = self.layers.first() {
            first.check_tp(&crate::module::join_path(path, "0"), degree, problems);
        }
    }

    fn tie_params(&mut self) -> Result<()> {
        self.layers.iter_mut().try_for_each(|l| l.tie_params())
    }

    fn visit_params(&self, v: &mut Visitor<'_>) -> Result<()> {
        let count = self.layers.len();
        for (i, layer) in self.layers.iter().enumerate() {
            v.pipeline_layer(i, count, |v| v.child::<Plain>(&i.to_string(), |v| layer.visit_params(v)))?;
        }
        Ok(())
    }

    /// Each layer in turn, recomputed one by one as the stack's field declares.
    fn describe(&self, d: &mut Describe, x: Activation) -> Result<Activation> {
        let recompute = d.take_layer_recompute();
        d.boundary(&x);
        let count = self.layers.len();
        let mut h = x;
        for (i, layer) in self.layers.iter().enumerate() {
            let y = d.pipeline_layer(i, count, |d| describe_call::<Plain, M>(layer, d, &i.to_string(), h, recompute))?;
            h = d.seq_convert::<<M as Module<Plain>>::In>(y, <M as Module<Plain>>::SEQ_OUT, <M as Module<Plain>>::SEQ_IN);
        }
        Ok(h)
    }
}

impl<M> Pipelined for Stack<M>
where
    M: Module<Plain>,
    M: Module<Plain, Out = <M as Module<Plain>>::In>,
{
    fn layer_count(&self) -> usize {
        self.layers.len()
    }

    fn forward_layers(&self, cx: &mut Cx, layers: Range<usize>, x: Act<Self::In>) -> Result<(Act<Self::Out>, Self::Saved)> {
        self.check_range("forward_layers", &layers)?;
        let recompute = cx.take_layer_recompute();
        let mut saves = Vec::with_capacity(layers.len());
        let mut h = x;
        for i in layers {
            let (layer, name) = (&self.layers[i], i.to_string());
            let (y, kept) = match recompute {
                Some(rc) => call_recompute::<Plain, M, _>(layer, cx, &name, h, rc)?,
                None => {
                    let (y, s) = call::<Plain, M, _>(layer, cx, &name, h)?;
                    (y, Kept::Saved(s))
                }
            };
            saves.push(kept);
            h = seq_convert(cx, y, <M as Module<Plain>>::SEQ_OUT, <M as Module<Plain>>::SEQ_IN)?;
        }
        Ok((h, saves))
    }

    fn backward_layers(&self, cx: &mut Cx, layers: Range<usize>, saved: Self::Saved, dy: Act<Self::Out>) -> Result<Act<Self::In>> {
        self.check_range("backward_layers", &layers)?;
        if saved.len() != layers.len() {
            return Err(Error::state_mismatch(
                "Stack::backward",
                format!("{} saved states for {} layers; pass the state the forward over these layers returned", saved.len(), layers.len()),
            ));
        }
        let mut g = dy;
        let mut saved = saved;
        let mut fetching: Option<Fetch> = None;
        for i in layers.rev() {
            let (layer, name) = (&self.layers[i], i.to_string());
            let kept = match (saved.pop().expect("one state per layer, counted above"), fetching.take()) {
                (Kept::Input(_), Some(fetch)) => Kept::Input(Act::new(fetch.wait()?)),
                (kept, _) => kept,
            };
            // An offloaded input of the layer below starts back now, while
            // this one runs its backward.
            if let Some(Kept::Input(x)) = saved.last() {
                fetching = Fetch::start(x.tensor(), cx.device())?;
            }
            g = seq_convert_backward(cx, g, <M as Module<Plain>>::SEQ_OUT, <M as Module<Plain>>::SEQ_IN)?;
            g = match kept {
                Kept::Saved(s) => call_backward::<Plain, M>(layer, cx, &name, s, g)?,
                input @ Kept::Input(_) => call_recompute_backward::<Plain, M>(layer, cx, &name, input, g)?,
            };
        }
        Ok(g)
    }
}

/// An offloaded activation on its way back to the device, copied by a
/// helper thread.
struct Fetch(std::thread::JoinHandle<Result<Tensor>>);

impl Fetch {
    /// Starts bringing `x` back to `device` when it lives elsewhere; only
    /// for CPU devices (a CUDA copy is made at use, on the rank's thread).
    fn start(x: &Tensor, device: &Device) -> Result<Option<Fetch>> {
        if x.device().same(device) || !matches!(device, Device::Cpu(_)) {
            return Ok(None);
        }
        let (x, device) = (x.clone(), device.clone());
        let handle = std::thread::Builder::new()
            .name("activation-fetch".into())
            .spawn(move || x.to_device(&device))
            .map_err(|source| Error::Thread { what: "activation offload fetch", source })?;
        Ok(Some(Fetch(handle)))
    }

    fn wait(self) -> Result<Tensor> {
        self.0
            .join()
            .map_err(|_| Error::state_mismatch("Stack::backward", "the thread fetching an offloaded activation panicked; its message is printed above"))?
    }
}

impl<M> Stack<M> {
    fn check_range(&self, op: &'static str, layers: &Range<usize>) -> Result<()> {
        if layers.start > layers.end || layers.end > self.layers.len() {
            return Err(Error::invalid(op, format!("layers {layers:?} are outside this stack of {}", self.layers.len())));
        }
        Ok(())
    }
}
