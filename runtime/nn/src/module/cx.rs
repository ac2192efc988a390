//! The per-rank context every forward and backward runs in.

use super::deferred::{Job, WeightGrads};
use super::overlap::InFlight;
use super::{ContextSplit, Param, Shard, TokenRun};
use std::sync::{Arc, Mutex};
use tessera_core::tensor::{DType, Tensor};
use tessera_core::Result;
use tessera_core::{Device, RngKey};
use tessera_dist::{Communicator, Groups};

/// Observers of a model's execution: ZeRO-3 gathers parameters before a
/// sub-module runs and frees them after; tracing records spans; data
/// parallelism starts a gradient's all-reduce as soon as it is final.
pub trait Hooks: Send + Sync {
    /// Before the sub-module at `path` runs its forward.
    fn before_forward(&self, _path: &str) -> Result<()> {
        Ok(())
    }
    /// After the sub-module at `path` ran its forward.
    fn after_forward(&self, _path: &str) -> Result<()> {
        Ok(())
    }
    /// Before the sub-module at `path` runs its backward.
    fn before_backward(&self, _path: &str) -> Result<()> {
        Ok(())
    }
    /// After the sub-module at `path` ran its backward.
    fn after_backward(&self, _path: &str) -> Result<()> {
        Ok(())
    }
    /// `param`'s gradient is final for this backward: every use delivered its part.
    fn grad_ready(&self, _param: &Param) -> Result<()> {
        Ok(())
    }
}

/// Whether sub-modules marked `#[recompute]` recompute, overriding the attributes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum RecomputeOverride {
    /// Follow each field's attribute.
    #[default]
    AsDeclared,
    /// Keep every activation (no recompute anywhere).
    Off,
    /// Full recompute for every field that declares any recompute.
    Full,
}

/// The context of one rank: device, communicators, randomness, precision and hooks.
pub struct Cx {
    device: Device,
    groups: Groups,
    seed: u64,
    step: u64,
    training: bool,
    compute_dtype: DType,
    recompute: RecomputeOverride,
    /// Where fully recomputed calls keep their inputs ([`Cx::with_activation_offload`]).
    activation_host: Option<Device>,
    selective: bool,
    recomputing: bool,
    layer_recompute: Option<super::Recompute>,
    master_dtype: DType,
    param_dtype: DType,
    sequence_parallel: bool,
    token_slice: bool,
    batch_offset: u64,
    pipeline_chunks: Option<usize>,
    announce_grads: bool,
    path: Vec<String>,
    hooks: Vec<Arc<dyn Hooks>>,
    decode: Option<Arc<super::Decode>>,
    /// Weight gradients put aside while a split backward's input half runs.
    deferred: Option<Mutex<WeightGrads>>,
    /// Pieces the sequence-parallel collectives are cut into (1: whole).
    tp_overlap: usize,
    /// The reduction a row-parallel forward left running for its caller's `all_reduce`.
    reduction: Mutex<Option<InFlight>>,
    /// While a model's whole backward runs under sequence parallelism: the
    /// gradients of replicated parameters that wait to be summed over the
    /// tensor-parallel group in one all-reduce at its end ([`Cx::grad`]).
    replicated_sums: Option<Mutex<Vec<(Param, Tensor)>>>,
    /// Sums of replicated gradients started before the end of the backward
    /// ([`Cx::start_replicated_sums`]), delivered at its end.
    replicated_started: Mutex<Vec<StartedSums>>,
    /// FP8 products' scaling state ([`Cx::with_fp8`]).
    pub(super) fp8: Option<Arc<super::fp8::Fp8State>>,
    /// Whether the layer running now keeps its products out of FP8 (the
    /// output head).
    pub(super) fp8_paused: bool,
}

impl Cx {
    /// A single-rank context on `device`: f32 compute, training mode, seed 0.
    pub fn new(device: Device) -> Self {
        Cx {
            device,
            groups: Groups::single(),
            seed: 0,
            step: 0,
            training: true,
            compute_dtype: DType::F32,
            recompute: RecomputeOverride::AsDeclared,
            activation_host: None,
            selective: false,
            recomputing: false,
            layer_recompute: None,
            master_dtype: DType::F32,
            param_dtype: DType::F32,
            sequence_parallel: false,
            token_slice: false,
            batch_offset: 0,
            pipeline_chunks: None,
            announce_grads: true,
            path: Vec::new(),
            hooks: Vec::new(),
            decode: None,
            deferred: None,
            tp_overlap: 1,
            reduction: Mutex::new(None),
            replicated_sums: None,
            replicated_started: Mutex::default(),
            fp8: None,
            fp8_paused: false,
        }
    }

    /// Uses `groups` for the mesh axes.
    pub fn with_groups(mut self, groups: Groups) -> Self {
        self.groups = groups;
        self
    }

    /// Seeds dropout and every other randomness of the run.
    pub fn with_seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// Adds an observer.
    pub fn with_hooks(mut self, hooks: Arc<dyn Hooks>) -> Self {
        self.hooks.push(hooks);
        self
    }

    /// The decoding state of the serving step running now, if any (see
    /// [`Decode`](super::Decode)): the layers that look across tokens read it.
    pub fn decode(&self) -> Option<&super::Decode> {
        self.decode.as_deref()
    }

    /// Sets (or clears) the decoding state; returns the previous one. A
    /// serving engine sets it around each step's forward.
    pub fn set_decode(&mut self, d: Option<Arc<super::Decode>>) -> Option<Arc<super::Decode>> {
        std::mem::replace(&mut self.decode, d)
    }

    /// The device this rank computes on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The communicators, one per mesh axis.
    pub fn groups(&self) -> &Groups {
        &self.groups
    }

    /// The tensor-parallel group.
    pub fn tp(&self) -> &dyn Communicator {
        &*self.groups.tp
    }

    /// The context-parallel group: the ranks each sequence is split over.
    pub fn cp(&self) -> &dyn Communicator {
        &*self.groups.cp
    }

    /// How each sequence is split over the context-parallel group (see
    /// [`ContextSplit`](super::ContextSplit)).
    pub fn context_split(&self) -> ContextSplit {
        ContextSplit::new(self.groups.cp.rank(), self.groups.cp.size()).expect("a communicator's rank is below its size")
    }

    /// Where the `len` tokens of each sequence of a `[batch, len, ..]`
    /// activation of this rank lie in the global sequence: `sliced` says
    /// whether the activation is a sequence-parallel slice (see
    /// [`sequence_split`](Self::sequence_split)) of the rank's share rather
    /// than all of it. One run of `0..len` without context or sequence
    /// parallelism.
    pub fn token_runs(&self, len: usize, sliced: bool) -> Result<Vec<TokenRun>> {
        let (share, start) = self.share_of(len, sliced);
        self.context_split().window(share, start, len)
    }

    /// The length of the global sequence of which a rank's activation holds
    /// `len` tokens (see [`token_runs`](Self::token_runs)).
    pub fn global_seq_len(&self, len: usize, sliced: bool) -> usize {
        self.share_of(len, sliced).0 * self.groups.cp.size()
    }

    /// The global position of each of those tokens (see [`token_runs`](Self::token_runs)).
    pub fn token_positions(&self, len: usize, sliced: bool) -> Result<Vec<u32>> {
        Ok(self.token_runs(len, sliced)?.iter().flat_map(TokenRun::positions).collect())
    }

    /// The rank's share of each sequence of which an activation holds `len`
    /// tokens, and where in it they start: a sequence-parallel slice is
    /// this rank's `1/tp` of the share.
    fn share_of(&self, len: usize, sliced: bool) -> (usize, usize) {
        if sliced && self.sequence_split() {
            (len * self.tp().size(), len * self.tp().rank())
        } else {
            (len, 0)
        }
    }

    /// The seed of dropout and every other randomness of the run.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Whether dropout is active and gradients are recorded.
    pub fn training(&self) -> bool {
        self.training
    }

    /// Turns training mode (see [`training`](Self::training)) on or off.
    pub fn set_training(&mut self, on: bool) {
        self.training = on;
    }

    /// Advances the counter that, with the seed, keys this step's dropout masks.
    pub fn set_step(&mut self, step: u64) {
        self.step = step;
    }

    /// The dtype activations are computed in (the precision policy).
    pub fn compute_dtype(&self) -> DType {
        self.compute_dtype
    }

    /// Sets the dtype activations are computed in.
    pub fn set_compute_dtype(&mut self, dtype: DType) {
        self.compute_dtype = dtype;
    }

    /// Whether layers recompute as declared, never, or fully.
    pub fn recompute_override(&self) -> RecomputeOverride {
        self.recompute
    }

    /// Turns recompute on or off for every layer that declares it (the planner's knob).
    pub fn set_recompute_override(&mut self, r: RecomputeOverride) {
        self.recompute = r;
    }

    /// Activation offload: the inputs that fully recomputed calls keep for
    /// their backward (`#[recompute]`, or every recomputing field under
    /// [`RecomputeOverride::Full`]) are copied to `host` after the forward
    /// and brought back for the recompute, a stack's next layer fetched
    /// while the current one runs its backward (on CPU devices; a CUDA
    /// device copies at use). `host` is its own memory pool, so the
    /// device's accounting no longer counts them; pass a fresh
    /// `Device::cpu()`. Values are unchanged, bit for bit.
    pub fn with_activation_offload(mut self, host: Device) -> Self {
        self.activation_host = Some(host);
        self
    }

    /// Where fully recomputed calls keep their inputs, if not on the device.
    pub fn activation_host(&self) -> Option<&Device> {
        self.activation_host.as_ref()
    }

    /// Whether the layers running now should drop what is large and cheap to
    /// recompute (set inside a `#[recompute(selective)]` field).
    pub fn selective_recompute(&self) -> bool {
        self.selective
    }

    /// Sets the selective-recompute flag; returns the previous value.
    pub fn set_selective_recompute(&mut self, on: bool) -> bool {
        std::mem::replace(&mut self.selective, on)
    }

    /// Whether the forward running now is a recomputation inside a backward
    /// (its parameter uses are not counted again).
    pub fn recomputing(&self) -> bool {
        self.recomputing
    }

    /// Sets the recomputing flag; returns the previous value.
    pub fn set_recomputing(&mut self, on: bool) -> bool {
        std::mem::replace(&mut self.recomputing, on)
    }

    /// The recompute a parent declared for the layers of a [`Stack`](crate::Stack)
    /// it is about to call; the stack takes it (leaving `None`) and applies it per layer.
    pub fn take_layer_recompute(&mut self) -> Option<super::Recompute> {
        self.layer_recompute.take()
    }

    pub(crate) fn set_layer_recompute(&mut self, r: Option<super::Recompute>) {
        self.layer_recompute = r;
    }

    /// The dtype master weights are materialised in (f32; f64 for gradient checks).
    pub fn master_dtype(&self) -> DType {
        self.master_dtype
    }

    /// Sets master-weight and compute dtype together (f64 runs whole models
    /// in double precision). Parameters are held in the master dtype (see
    /// [`with_half_params`](Self::with_half_params)).
    pub fn with_dtype(mut self, dtype: DType) -> Self {
        self.master_dtype = if dtype == DType::F64 { DType::F64 } else { DType::F32 };
        self.compute_dtype = dtype;
        self.param_dtype = self.master_dtype;
        self
    }

    /// Holds the parameters, and so their gradients, in the compute dtype
    /// (bf16 or f16 after [`with_dtype`](Self::with_dtype)) rather than the
    /// master dtype: mixed precision that saves memory. They are
    /// initialised in the master dtype and rounded once; the optimizer
    /// (`AdamW`, or a ZeRO engine) keeps their master copy in f32 and
    /// updates it, then rounds it into the parameter. Per parameter element
    /// that is 2 + 2 bytes of parameter and gradient and 4 + 4 + 4 of
    /// master copy and moments: 16 bytes, which ZeRO divides as the paper
    /// does (`docs/zero.md`).
    pub fn with_half_params(mut self) -> Self {
        self.param_dtype = self.compute_dtype;
        self
    }

    /// The dtype parameters (and their gradients) are held in: the master
    /// dtype, or the compute dtype after [`with_half_params`](Self::with_half_params).
    pub fn param_dtype(&self) -> DType {
        self.param_dtype
    }

    /// Turns sequence parallelism on or off (the model is unchanged).
    ///
    /// With it on (and a tensor-parallel group of more than one rank), the
    /// `Replicated` activations that per-token layers read are split along
    /// the sequence (dim 1) over the group. Which values are split is fixed at
    /// compile time by what each layer declares ([`Module::SEQ_IN`](super::Module::SEQ_IN),
    /// [`Seq`](super::Seq)); the generated code gathers or slices where a
    /// value's form differs from what its consumer takes, `all_reduce`
    /// becomes a reduce-scatter, and column-parallel layers all-gather their
    /// input (reduce-scattering its gradient). Parameters replicated over the
    /// group and read on a slice of the tokens have their gradients summed
    /// over the group ([`grad`](Self::grad)). A model computes the same loss
    /// and gradients with it on or off.
    pub fn with_sequence_parallel(mut self, on: bool) -> Self {
        self.sequence_parallel = on;
        self
    }

    /// Overlaps the tensor-parallel collectives of sequence parallelism
    /// with the products beside them (with `pieces` ≥ 2; 1, the default,
    /// runs them whole, each before or after its product): an all-gather
    /// before a product (a column-parallel layer's input, a row-parallel
    /// layer's or a vocabulary-parallel embedding's output gradient) runs
    /// while this rank's own slice's part does; a row-parallel layer (or the
    /// embedding) computes each other rank's slice of its output first and
    /// sends it while the next runs, its own slice last, and the `all_reduce`
    /// of its output sums the parts of this rank's slice; and the
    /// reduce-scatter of a column-parallel layer's input gradient is cut
    /// into `pieces` along the tokens, each piece's sum travelling while the
    /// next piece's product runs. The results agree with whole collectives'
    /// to the rounding of products computed a part at a time; without
    /// sequence parallelism it changes nothing.
    pub fn with_tp_overlap(mut self, pieces: usize) -> Self {
        self.tp_overlap = pieces.max(1);
        self
    }

    /// How many pieces the sequence-parallel reduce-scatters are cut into,
    /// when the collectives overlap the products: `None` without sequence
    /// parallelism, with one piece, or while a forward is recomputed (whose
    /// output nothing reduces).
    pub fn tp_overlap(&self) -> Option<usize> {
        (self.sequence_split() && self.tp_overlap > 1 && !self.recomputing).then_some(self.tp_overlap)
    }

    /// Leaves a row-parallel forward's reduction running for the
    /// `all_reduce` of its output (replacing, and so dropping, one that
    /// nothing took).
    pub(crate) fn start_reduction(&self, r: InFlight) {
        *self.reduction.lock().unwrap_or_else(|e| e.into_inner()) = Some(r);
    }

    /// The reduction left running for `value`, if one was (any other is dropped).
    pub(crate) fn take_reduction(&self, value: &Tensor) -> Option<InFlight> {
        self.reduction.lock().unwrap_or_else(|e| e.into_inner()).take().filter(|r| r.sums(value))
    }

    /// Whether the layer running now reads this rank's slice of the tokens
    /// (set around each sub-module call from its [`Module::SEQ_IN`](super::Module::SEQ_IN));
    /// returns the previous value.
    pub fn set_token_slice(&mut self, on: bool) -> bool {
        std::mem::replace(&mut self.token_slice, on)
    }

    /// The index, in the step's global batch, of the first row (sequence) of
    /// the batch this rank computes now: data-parallel replicas and pipeline
    /// microbatches each hold a block of rows, and dropout draws its mask at
    /// global positions from it, so any parallel run drops exactly the
    /// elements a single rank would. 0 by default.
    pub fn batch_offset(&self) -> u64 {
        self.batch_offset
    }

    /// Sets [`batch_offset`](Self::batch_offset); returns the previous value.
    pub fn set_batch_offset(&mut self, rows: u64) -> u64 {
        std::mem::replace(&mut self.batch_offset, rows)
    }

    /// Declares that this rank runs one stage of a pipeline over the
    /// `groups().pp` group, with `chunks` model chunks per stage (1 unless
    /// the schedule interleaves; see [`PipelineLayout`](super::PipelineLayout)).
    ///
    /// Materialising a model in this context then gives this rank only its
    /// stage's parameters (see [`materialize`](super::materialize)), the
    /// pipeline executor checks that its schedule has this many chunks, and
    /// a checkpoint knows which stage owns each parameter. Without it every
    /// rank holds the whole model.
    pub fn with_pipeline_chunks(mut self, chunks: usize) -> Self {
        self.pipeline_chunks = Some(chunks);
        self
    }

    /// The pipeline layout declared with [`with_pipeline_chunks`](Self::with_pipeline_chunks)
    /// (over the pp group's size), if any; an error for zero chunks.
    pub fn pipeline_layout(&self) -> Result<Option<super::PipelineLayout>> {
        self.pipeline_chunks.map(|c| super::PipelineLayout::new(self.groups.pp.size(), c)).transpose()
    }

    /// Whether residual activations are split along the sequence right now
    /// (sequence parallelism on, over a tensor-parallel group of several ranks).
    pub fn sequence_split(&self) -> bool {
        self.sequence_parallel && self.groups.tp.size() > 1
    }

    /// The dotted path of the sub-module running now.
    pub fn path(&self) -> String {
        self.path.join(".")
    }

    /// The key of a dropout site: seed and step pick the draw, the module path
    /// picks the stream, so a recomputed forward draws the very same mask.
    pub fn dropout_key(&self) -> RngKey {
        let path = self.path();
        let stream = path.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3));
        RngKey::new(self.seed ^ self.step.wrapping_mul(0x9E37_79B9_7F4A_7C15), stream)
    }

    /// Whether no sub-module is entered: the code running is a model's own.
    pub(super) fn at_root(&self) -> bool {
        self.path.is_empty()
    }

    /// Enters the sub-module `name` (for hooks and dropout streams).
    pub fn enter(&mut self, name: &str) {
        self.path.push(name.to_string());
    }

    /// Leaves the sub-module entered last.
    pub fn exit(&mut self) {
        self.path.pop();
    }

    pub(crate) fn each_hook(&self, f: impl Fn(&dyn Hooks, &str) -> Result<()>) -> Result<()> {
        if self.hooks.is_empty() {
            return Ok(());
        }
        let path = self.path();
        self.hooks.iter().try_for_each(|h| f(&**h, &path))
    }

    /// A parameter's value for a forward, in the compute dtype; records the
    /// use so the gradient is known final once every use has delivered.
    pub fn param(&self, p: &Param) -> Result<Tensor> {
        let v = p.value()?;
        if self.training && !self.recomputing {
            p.note_use();
        }
        if v.dtype() == self.compute_dtype || !v.dtype().is_float() {
            Ok(v)
        } else {
            v.to_dtype(self.compute_dtype)
        }
    }

    /// Whether gradients that become final are announced to the hooks. A
    /// step that accumulates gradients over several microbatches turns this
    /// off for all but the last, so data parallelism synchronises once per
    /// step, on the accumulated gradient. Returns the previous setting.
    pub fn set_announce_grads(&mut self, on: bool) -> bool {
        std::mem::replace(&mut self.announce_grads, on)
    }

    /// Starts putting weight gradients aside instead of computing them (the
    /// input half of a split backward; see [`WeightGrads`]). Anything put
    /// aside and not yet taken is dropped.
    pub fn defer_weight_grads(&mut self) {
        self.deferred = Some(Mutex::default());
    }

    /// Stops putting weight gradients aside and returns what was.
    pub fn take_weight_grads(&mut self) -> WeightGrads {
        self.deferred.take().map(|m| m.into_inner().unwrap_or_else(|e| e.into_inner())).unwrap_or_default()
    }

    /// Runs `compute`, a layer's weight-gradient computation that ends by
    /// delivering its gradients with [`grad`](Self::grad), now, or puts it
    /// aside while [`defer_weight_grads`](Self::defer_weight_grads) is on.
    /// It must own what it reads (clones of tensors and parameters are
    /// cheap handles).
    pub fn weight_grad(&self, compute: impl FnOnce(&Cx) -> Result<()> + Send + 'static) -> Result<()> {
        match &self.deferred {
            Some(put_aside) => {
                let job: Job = Box::new(compute);
                put_aside.lock().unwrap_or_else(|e| e.into_inner()).push(self.token_slice, job);
                Ok(())
            }
            None => compute(self),
        }
    }

    /// Delivers one use's gradient of `p`; announces it to the hooks once final.
    ///
    /// Every gradient delivered here must be complete for the values the
    /// layer read. One case is completed here rather than in each layer: a
    /// layer that reads a slice of the tokens under sequence parallelism
    /// (see [`set_token_slice`](Self::set_token_slice)) computes, for a
    /// parameter replicated over the tensor-parallel group, only its tokens'
    /// part, so that part is summed over the group first.
    ///
    /// Inside a model's whole backward ([`backward_root`](super::backward_root))
    /// those sums wait for its end, where one all-reduce makes them all
    /// (the same sums, element by element, in the same rank order: the
    /// same bits), instead of one latency-bound collective per parameter
    /// in the middle of the backward.
    pub fn grad(&self, p: &Param, g: Tensor) -> Result<()> {
        if self.token_slice && self.sequence_split() && p.shard() == Shard::Full {
            if let Some(waiting) = &self.replicated_sums {
                waiting.lock().unwrap_or_else(|e| e.into_inner()).push((p.clone(), g));
                return Ok(());
            }
            let g = self.tp().all_reduce_sum(&g)?;
            return self.deliver(p, g);
        }
        self.deliver(p, g)
    }

    /// Adds `g` to `p`'s gradient; announces it to the hooks once final.
    fn deliver(&self, p: &Param, g: Tensor) -> Result<()> {
        if p.add_grad(g)? && self.announce_grads {
            for h in &self.hooks {
                h.grad_ready(p)?;
            }
        }
        Ok(())
    }
}

/// Summing replicated parameters' gradients once per backward (see [`Cx::grad`]).
impl Cx {
    /// Starts collecting the replicated gradients [`Cx::grad`] would sum
    /// one by one; returns whether this call started it (false when it was
    /// already on, or there is nothing to sum: no sequence split).
    pub(super) fn collect_replicated_sums(&mut self) -> bool {
        if self.replicated_sums.is_some() || !self.sequence_split() {
            return false;
        }
        self.replicated_sums = Some(Mutex::default());
        true
    }

    /// Starts summing the replicated gradients collected so far, in the
    /// background, for the end of the backward to deliver: a layer that
    /// knows the rest of the backward delivers none (a vocabulary-parallel
    /// embedding, the first layer of a language model) calls it, so that
    /// the sum travels while the layer computes. Gradients delivered
    /// afterwards are summed at the end as usual. Every rank calls it at the
    /// same point, as every rank runs the same backward.
    pub(crate) fn start_replicated_sums(&self) -> Result<()> {
        let Some(waiting) = &self.replicated_sums else { return Ok(()) };
        let grads = std::mem::take(&mut *waiting.lock().unwrap_or_else(|e| e.into_inner()));
        if grads.is_empty() {
            return Ok(());
        }
        let started = StartedSums::sum(self, grads, true)?;
        self.replicated_started.lock().unwrap_or_else(|e| e.into_inner()).push(started);
        Ok(())
    }

    /// Stops collecting; with `deliver`, sums what was collected over the
    /// tensor-parallel group (one all-reduce per dtype, the gradients
    /// concatenated in the order they came) and delivers each sum, after
    /// those started earlier. Without it (the backward failed on this rank)
    /// the gradients are dropped and nothing more is sent.
    pub(super) fn finish_replicated_sums(&mut self, deliver: bool) -> Result<()> {
        let started = std::mem::take(&mut *self.replicated_started.lock().unwrap_or_else(|e| e.into_inner()));
        let Some(waiting) = self.replicated_sums.take() else { return Ok(()) };
        let waiting = waiting.into_inner().unwrap_or_else(|e| e.into_inner());
        if !deliver {
            return Ok(());
        }
        for s in started {
            s.deliver(self)?;
        }
        if waiting.is_empty() {
            return Ok(());
        }
        StartedSums::sum(self, waiting, false)?.deliver(self)
    }
}

/// Replicated gradients whose sums over the tensor-parallel group were
/// started (one all-reduce per dtype, the gradients concatenated in the
/// order they came).
struct StartedSums {
    grads: Vec<(Param, Tensor)>,
    /// Per dtype: the gradients' indices and their summed concatenation.
    sums: Vec<(Vec<usize>, tessera_dist::Pending)>,
}

impl StartedSums {
    /// The sums, started in the background or (without `background`) done now.
    fn sum(cx: &Cx, grads: Vec<(Param, Tensor)>, background: bool) -> Result<Self> {
        let mut dtypes: Vec<DType> = Vec::new();
        for (_, g) in &grads {
            if !dtypes.contains(&g.dtype()) {
                dtypes.push(g.dtype());
            }
        }
        let mut sums = Vec::with_capacity(dtypes.len());
        for dtype in dtypes {
            let of: Vec<usize> = (0..grads.len()).filter(|&i| grads[i].1.dtype() == dtype).collect();
            let flat = Tensor::concat_flat(&of.iter().map(|&i| &grads[i].1).collect::<Vec<_>>())?;
            let total =
                if background { cx.tp().all_reduce_sum_async(&flat)? } else { tessera_dist::Pending::ready("all_reduce_sum", cx.tp().all_reduce_sum(&flat)) };
            sums.push((of, total));
        }
        Ok(StartedSums { grads, sums })
    }

    /// Waits for the sums and delivers each gradient's.
    fn deliver(self, cx: &Cx) -> Result<()> {
        let mut out: Vec<Option<Tensor>> = vec![None; self.grads.len()];
        for (of, total) in self.sums {
            let total = total.wait()?;
            let mut at = 0;
            for i in of {
                let g = &self.grads[i].1;
                // Each in storage of its own: a parameter used twice adds
                // one of its sums into the other in place.
                out[i] = Some(Tensor::concat_flat(&[&total.narrow(0, at, g.elem_count())?])?.reshape(g.shape().clone())?);
                at += g.elem_count();
            }
        }
        for ((p, _), sum) in self.grads.iter().zip(out) {
            cx.deliver(p, sum.expect("every gradient is in its dtype's sum"))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::module::call::backward_root;
    use std::sync::Arc;
    use tessera_dist::inproc::InProcess;

    /// Replicated gradients collected before and after a sum started early
    /// ([`Cx::start_replicated_sums`]) are each summed over the group once
    /// (the early ones in the background), and a parameter delivered on both
    /// sides of the start gets both sums.
    #[test]
    fn sums_started_early_and_late_are_both_delivered() {
        let world = InProcess::new(2).unwrap();
        let got: Vec<Vec<Vec<f32>>> = std::thread::scope(|s| {
            let threads: Vec<_> = (0..2)
                .map(|rank| {
                    let world = world.clone();
                    s.spawn(move || {
                        let dev = Device::cpu();
                        let mut groups = Groups::single();
                        groups.tp = Arc::new(world.communicator(rank, &dev).unwrap());
                        let mut cx = Cx::new(dev.clone()).with_groups(groups).with_sequence_parallel(true);
                        let zero = || tessera_core::tensor::Init::Normal { mean: 0.0, std: 0.0 };
                        let (early, late, both) = (Param::new([3], zero()), Param::new([2], zero()), Param::new([2], zero()));
                        let r = rank as f32;
                        let g = |v: Vec<f32>| Tensor::from_vec(v.clone(), [v.len()], &dev).unwrap();
                        backward_root(&mut cx, |cx| {
                            cx.set_token_slice(true);
                            cx.grad(&early, g(vec![1.0 + r, 2.0, 3.0 * r]))?;
                            cx.grad(&both, g(vec![r, 1.0]))?;
                            cx.start_replicated_sums()?;
                            cx.grad(&late, g(vec![10.0 * r, -1.0]))?;
                            cx.grad(&both, g(vec![100.0, 100.0 * r]))
                        })
                        .unwrap();
                        [early, late, both].iter().map(|p| p.grad().unwrap().to_vec::<f32>().unwrap()).collect()
                    })
                })
                .collect();
            threads.into_iter().map(|t| t.join().unwrap()).collect()
        });
        for g in got {
            assert_eq!(g, vec![vec![3.0, 4.0, 3.0], vec![10.0, -2.0], vec![201.0, 102.0]]);
        }
    }
}
