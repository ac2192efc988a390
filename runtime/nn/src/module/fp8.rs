//! FP8 training state of one rank ([`Cx::with_fp8`]): a delayed scaling
//! per operand of every linear layer, and the largest magnitudes seen this
//! step, reduced over the ranks at its end.
//!
//! A linear layer under FP8 multiplies E4M3 operands in its forward (its
//! input and weight) and an E5M2 gradient by E4M3 operands in its backward
//! (`dX = dY·W`, `dW = dYᵀ·X`), each scaled by the [`DelayedScaling`] of
//! that operand of that layer: the scale comes from earlier steps' amaxes,
//! so a step's scales are fixed from its start and every use of an
//! operand in the step (a recompute, the backward's second reading of the
//! weight) quantizes it to the same codes. The step's amaxes are taken as
//! it goes and recorded by [`Cx::end_fp8_step`], reduced (max) over the
//! tensor-parallel group and the data replicas first, so that every rank
//! scales as a single rank training the whole batch would.

use super::Cx;
use parking_lot::Mutex;
use std::collections::BTreeMap;
use tessera_core::ops::{self, DelayedScaling, Fp8Format};
use tessera_core::{DType, Error, Result, Tensor};

/// The FP8 settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fp8Recipe {
    /// Steps of amax history each scale is taken over (16 is common).
    pub history: usize,
    /// Binades below the format's largest value the recent amax lands (0 is usual).
    pub margin: i32,
}

impl Default for Fp8Recipe {
    fn default() -> Self {
        Fp8Recipe { history: 16, margin: 0 }
    }
}

/// Which operand of a linear layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Operand {
    /// The input, E4M3.
    Input,
    /// The weight, E4M3.
    Weight,
    /// The output's gradient, E5M2.
    Grad,
}

impl Operand {
    /// The FP8 format this operand is quantized to.
    pub(crate) fn format(self) -> Fp8Format {
        match self {
            Operand::Input | Operand::Weight => Fp8Format::E4M3,
            Operand::Grad => Fp8Format::E5M2,
        }
    }
}

type Key = (String, Operand);

/// One rank's FP8 scaling state.
#[derive(Debug)]
pub(crate) struct Fp8State {
    recipe: Fp8Recipe,
    scalings: Mutex<BTreeMap<Key, DelayedScaling>>,
    /// This step's amaxes of each operand so far, one per use, left on the
    /// device (one-element f32 tensors) until the step's end reads them
    /// all at once: no use waits for the device.
    pending: Mutex<BTreeMap<Key, Vec<Tensor>>>,
}

impl Fp8State {
    pub(crate) fn new(recipe: Fp8Recipe) -> Result<Self> {
        // Checks the settings once, here.
        DelayedScaling::new(Fp8Format::E4M3, recipe.history, recipe.margin)?;
        Ok(Fp8State { recipe, scalings: Mutex::new(BTreeMap::new()), pending: Mutex::new(BTreeMap::new()) })
    }

    /// `x`'s FP8 values for operand `operand` of layer `layer` (unscaled
    /// codes' values, see [`ops::fp8_values`]) and the scale they carry;
    /// notes `x`'s amax for the step's end.
    ///
    /// An operand's first use has no history to delay from: it is scaled
    /// by its own amax, the largest over the tensor-parallel group and the
    /// data replicas (every rank of which quantizes the same operands in the
    /// same order), so that its first step is neither flushed to zero nor
    /// different from one rank's.
    pub(crate) fn quantize(&self, cx: &Cx, layer: &str, operand: Operand, x: &Tensor) -> Result<(Tensor, f32)> {
        let scale = self.scale_for(cx, layer, operand, x)?;
        self.quantize_at(layer, operand, x, scale)
    }

    /// The scale operand `operand` of layer `layer` is quantized at this
    /// step: the delayed one, or on the operand's first use the one `whole`
    /// sets (its amax over the tensor-parallel group and the data replicas).
    /// A product cut into pieces takes it from the whole operand once, so
    /// that every piece is quantized as the uncut operand would be.
    pub(crate) fn scale_for(&self, cx: &Cx, layer: &str, operand: Operand, whole: &Tensor) -> Result<f32> {
        let key = (layer.to_string(), operand);
        if let Some(scale) = self.scalings.lock().get(&key).map(|s| s.scale()) {
            return Ok(scale);
        }
        // The first use reads its amax at once (once per operand and run):
        // it sets the scale this very step.
        let amax = ops::max_abs(whole)?.to_dtype(DType::F32)?.to_vec::<f32>()?[0];
        let mut s = DelayedScaling::new(operand.format(), self.recipe.history, self.recipe.margin)?;
        s.start_from(max_over_groups(cx, vec![amax])?[0]);
        let scale = s.scale();
        self.scalings.lock().insert(key, s);
        Ok(scale)
    }

    /// `x`'s FP8 values at `scale` (from [`scale_for`](Self::scale_for))
    /// and that scale; notes `x`'s amax for the step's end.
    pub(crate) fn quantize_at(&self, layer: &str, operand: Operand, x: &Tensor, scale: f32) -> Result<(Tensor, f32)> {
        let amax = ops::max_abs(x)?.to_dtype(DType::F32)?.reshape([1])?;
        self.pending.lock().entry((layer.to_string(), operand)).or_default().push(amax);
        Ok((ops::fp8_values(x, operand.format(), scale)?, scale))
    }

    /// The scales in use, by layer and operand (for reports and tests).
    pub(crate) fn scales(&self) -> Vec<(String, &'static str, f32)> {
        self.scalings.lock().iter().map(|((l, o), s)| (l.clone(), operand_name(*o), s.scale())).collect()
    }
}

/// One operand's delayed scaling as a checkpoint keeps it.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Fp8Saved {
    /// The amaxes recorded, oldest first.
    pub history: Vec<f32>,
    /// The scale in use.
    pub scale: f32,
}

/// Every operand's delayed scaling of a rank, keyed `layer/operand`
/// (`input`, `weight` or `grad`): what [`Cx::fp8_snapshot`] takes and
/// [`Cx::restore_fp8`] puts back, so a resumed FP8 run scales exactly as
/// the uninterrupted one.
pub type Fp8Snapshot = BTreeMap<String, Fp8Saved>;

fn operand_name(o: Operand) -> &'static str {
    match o {
        Operand::Input => "input",
        Operand::Weight => "weight",
        Operand::Grad => "grad",
    }
}

fn parse_key(key: &str) -> Result<Key> {
    let bad = || Error::invalid("Cx::restore_fp8", format!("`{key}` names no FP8 operand; keys are `layer/input`, `layer/weight` or `layer/grad`"));
    let (layer, operand) = key.rsplit_once('/').ok_or_else(bad)?;
    let operand = match operand {
        "input" => Operand::Input,
        "weight" => Operand::Weight,
        "grad" => Operand::Grad,
        _ => return Err(bad()),
    };
    Ok((layer.to_string(), operand))
}

impl Cx {
    /// The delayed scaling of every FP8 operand seen so far (empty without
    /// FP8): for a checkpoint, taken between steps.
    pub fn fp8_snapshot(&self) -> Fp8Snapshot {
        let Some(state) = &self.fp8 else { return Fp8Snapshot::new() };
        let saved = state
            .scalings
            .lock()
            .iter()
            .map(|((l, o), s)| (format!("{l}/{}", operand_name(*o)), Fp8Saved { history: s.history().collect(), scale: s.scale() }))
            .collect();
        saved
    }

    /// Puts back the delayed scalings of a snapshot (restoring a
    /// checkpoint, between steps), replacing every operand's state: those
    /// it does not name start afresh at their next use. Entries for layers
    /// this rank does not run (another pipeline stage's) are kept too and
    /// simply never used. Without FP8 it is a no-op.
    pub fn restore_fp8(&self, saved: &Fp8Snapshot) -> Result<()> {
        let Some(state) = &self.fp8 else { return Ok(()) };
        let mut scalings = BTreeMap::new();
        for (key, s) in saved {
            let key = parse_key(key)?;
            let mut scaling = DelayedScaling::new(key.1.format(), state.recipe.history, state.recipe.margin)?;
            scaling.restore_with_scale(&s.history, s.scale)?;
            scalings.insert(key, scaling);
        }
        *state.scalings.lock() = scalings;
        state.pending.lock().clear();
        Ok(())
    }

    /// Runs every linear layer's products in FP8 (training only; the output
    /// head, a layer in the [`Vocab`](super::Vocab) role, keeps the compute dtype): E4M3
    /// inputs and weights, E5M2 output gradients, per-operand delayed
    /// scaling over `recipe.history` steps. Call
    /// [`end_fp8_step`](Self::end_fp8_step) after each step's backward.
    /// With [`with_tp_overlap`](Self::with_tp_overlap) a product cut into
    /// pieces quantizes each piece at the scale of the whole operand, as the
    /// uncut product does.
    pub fn with_fp8(mut self, recipe: Fp8Recipe) -> Result<Self> {
        self.fp8 = Some(std::sync::Arc::new(Fp8State::new(recipe)?));
        Ok(self)
    }

    /// The FP8 state, where the products run in FP8 now (training with
    /// [`with_fp8`](Self::with_fp8), not a serving step).
    pub(crate) fn fp8(&self) -> Option<&Fp8State> {
        self.fp8.as_deref().filter(|_| self.training() && self.decode().is_none() && !self.fp8_paused)
    }

    /// Runs `f` with the products out of FP8 (the output head keeps its
    /// logits' precision, as FP8 recipes do).
    pub(crate) fn without_fp8<T>(&mut self, f: impl FnOnce(&mut Cx) -> Result<T>) -> Result<T> {
        let was = std::mem::replace(&mut self.fp8_paused, true);
        let out = f(self);
        self.fp8_paused = was;
        out
    }

    /// The FP8 scales in use: `(layer, operand, scale)` for every operand
    /// seen so far; empty without FP8.
    pub fn fp8_scales(&self) -> Vec<(String, &'static str, f32)> {
        self.fp8.as_ref().map(|f| f.scales()).unwrap_or_default()
    }

    /// Ends a step under FP8: the step's amax of every operand, the
    /// largest over the tensor-parallel group and the data replicas (every
    /// member of which holds the same layers), goes into its history and sets the
    /// next step's scale. Every rank of those groups calls it together. A
    /// step whose amaxes are not all finite (an overflow) records nothing.
    pub fn end_fp8_step(&self) -> Result<()> {
        let Some(state) = &self.fp8 else { return Ok(()) };
        let pending = std::mem::take(&mut *state.pending.lock());
        let keys: Vec<Key> = pending.keys().cloned().collect();
        // Every use's amax in one read from the device, then the largest
        // per operand (NaN where any is NaN).
        let all: Vec<&Tensor> = pending.values().flatten().collect();
        let values = if all.is_empty() { Vec::new() } else { Tensor::concat_flat(&all)?.to_vec::<f32>()? };
        let mut at = 0;
        let mut step_amax = Vec::with_capacity(keys.len());
        for uses in pending.values() {
            let seen = &values[at..at + uses.len()];
            at += uses.len();
            step_amax.push(seen.iter().fold(0.0f32, |a, &b| if a.is_nan() || b.is_nan() { f32::NAN } else { a.max(b) }));
        }
        let amax = max_over_groups(self, step_amax)?;
        if amax.iter().any(|a| !a.is_finite()) {
            return Ok(());
        }
        let mut scalings = state.scalings.lock();
        for (key, a) in keys.into_iter().zip(amax) {
            if let Some(s) = scalings.get_mut(&key) {
                s.record(a);
            }
        }
        Ok(())
    }
}

/// The element-wise largest of `values` over the tensor-parallel group and
/// the data replicas (NaN where any rank has NaN). Every member must bring as many
/// values: their count goes first, so that a mismatch is an error, not a
/// hang or a misread.
fn max_over_groups(cx: &Cx, mut values: Vec<f32>) -> Result<Vec<f32>> {
    let n = values.len();
    // The data replicas, not only the data-parallel group: with experts
    // split, the expert-parallel ranks hold the same FP8 layers too (the
    // experts' products stay in the compute dtype).
    for group in [&cx.groups().tp, &cx.groups().replicas] {
        if group.size() == 1 {
            continue;
        }
        let count = Tensor::from_vec(vec![n as f32], [1], cx.device())?;
        let counts = group.all_gather(&count, 0)?.to_vec::<f32>()?;
        if counts.iter().any(|&c| c != n as f32) {
            return Err(Error::state_mismatch(
                "FP8 scaling",
                format!("the ranks of a group quantized different numbers of operands ({counts:?}); FP8 needs every rank of a tensor-parallel group or of the data replicas to run the same linear layers"),
            ));
        }
        if n == 0 {
            continue;
        }
        let all = group.all_gather(&Tensor::from_vec(values.clone(), [n], cx.device())?, 0)?.to_vec::<f32>()?;
        for (i, a) in values.iter_mut().enumerate() {
            for rank in 0..group.size() {
                let b = all[rank * n + i];
                *a = if a.is_nan() || b.is_nan() { f32::NAN } else { a.max(b) };
            }
        }
    }
    Ok(values)
}
