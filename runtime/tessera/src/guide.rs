//! # The model DSL
//!
//! A model is a struct of layers with `#[derive(Module)]`, plus one
//! `#[forward]` impl holding its forward body. From the two, the macros
//! generate [`Module`](crate::module::Module): the forward with a typed
//! `Saved` struct, the backward, the parameter visitor and weight tying.
//!
//! ```
//! use tessera::prelude::*;
//! use tessera::nn::{CausalAttention, LayerNorm, Linear};
//! use tessera::{forward, Module};
//!
//! #[derive(Module)]
//! pub struct Block {
//!     ln1: LayerNorm,
//!     #[shard(column)] qkv: Linear,   // Replicated -> SplitHidden (heads split over TP)
//!     attn: CausalAttention,          // SplitHidden -> SplitHidden (local heads)
//!     #[shard(row)] proj: Linear,     // SplitHidden -> PartialSum
//!     ln2: LayerNorm,
//!     #[shard(column)] up: Linear,
//!     #[shard(row)] down: Linear,
//! }
//!
//! #[forward]
//! impl Block {
//!     fn forward(&self, x: Act<Replicated>) -> Act<Replicated> {
//!         let h = x + all_reduce(self.proj(self.attn(self.qkv(self.ln1(x)))));
//!         h + all_reduce(self.down(gelu(self.up(self.ln2(h)))))
//!     }
//! }
//! # fn main() {}
//! ```
//!
//! ## Grammar of a forward body
//!
//! ```text
//! forward  := "fn" NAME "(&self," IDENT ": Act<" LAYOUT ">) -> Act<" LAYOUT ">" "{" stmt* expr "}"
//! stmt     := "let" IDENT "=" expr ";"
//! expr     := IDENT                              a value bound earlier (or the input)
//!           | "self." FIELD "(" expr ")"         a sub-module call
//!           | FUNC "(" expr ("," expr)? ")"       a DSL function
//!           | expr "+" expr | expr "*" expr      elementwise, equal layouts only
//!           | "(" expr ")"
//! FUNC     := gelu | silu | swiglu | all_reduce | reduce_scatter | all_gather
//! ```
//!
//! Anything else is a compile error that lists what is allowed. For layers
//! the DSL cannot express, implement [`Module`](crate::module::Module) by
//! hand with an explicit backward, as every layer of [`nn`](crate::nn) does.
//! The `#[forward]` impl may sit in any module that can name the struct and
//! the layer types of its fields (it reaches the struct's definition through
//! a macro the derive imports under the struct's name, and reads the field
//! types where it expands); on a struct without `#[derive(Module)]` it is an
//! error that says so.
//!
//! ## Layouts
//!
//! Every value is an [`Act<L>`](crate::module::Act) whose layout `L` says how
//! it lies on the tensor-parallel group (`Replicated`, `SplitHidden`,
//! `SplitSeq`, `PartialSum`, `Dispatched`). Each sub-module call checks the
//! value's layout against the layer's input, `+` requires equal layouts, and
//! `all_reduce` takes only `PartialSum`: mistakes are compile errors on the
//! expression, worded by the runtime's traits.
//!
//! | DSL | forward | generated backward |
//! |---|---|---|
//! | `#[shard(column)]` linear | `Replicated -> SplitHidden` | input gradient all-reduced |
//! | `#[shard(row)]` linear | `SplitHidden -> PartialSum` | no communication |
//! | `all_reduce(x)` | `PartialSum -> Replicated` | identity |
//! | `reduce_scatter(x)` | `PartialSum -> SplitSeq` | all-gather |
//! | `all_gather(x)` | `SplitSeq -> Replicated` | this rank's slice, no communication |
//! | `#[shard(vocab)]` embedding | ids `-> PartialSum` | scatter-add into local rows |
//! | `#[shard(vocab)]` linear head | `Replicated -> SplitHidden` | input gradient all-reduced |
//! | `a + b` | equal layouts (`PartialSum + PartialSum` stays partial) | the gradient to both |
//! | `a * b`, `swiglu(a, b)` | equal layouts, not `PartialSum` | elementwise |
//! | `gelu(a)`, `silu(a)` | any layout but `PartialSum` | elementwise |
//!
//! The backward column follows from one invariant: the gradient of a
//! `Replicated`, `SplitHidden` or `SplitSeq` value is complete on every rank
//! (for the part it holds), and the gradient of a `PartialSum` is the
//! complete gradient of the sum. A `PartialSum` goes only through linear
//! operations: `gelu(a) + gelu(b)` is not `gelu(a + b)`, so a nonlinear
//! function or a product of a partial sum is a compile error until it is
//! reduced. A value used twice (a residual) receives the sum of both uses'
//! gradients.
//!
//! ## Sequence parallelism
//!
//! [`Cx::with_sequence_parallel`](crate::module::Cx::with_sequence_parallel)
//! splits the tokens that per-token layers read over the tensor-parallel
//! group, without changing the model. Each `Replicated` value then has a
//! form fixed at compile time, whole or this rank's slice of the sequence
//! ([`Seq`](crate::module::Seq)): a layer states the form it takes and
//! returns ([`Module::SEQ_IN`](crate::module::Module::SEQ_IN),
//! [`SEQ_OUT`](crate::module::Module::SEQ_OUT); norms, unsharded linear
//! maps, dropout and the position table take slices, a column-parallel linear
//! takes a slice and gathers it, an embedding and a mixture of experts take
//! the whole sequence, and any hand-written layer does unless it says
//! otherwise). The macro derives every value's form from the body and
//! inserts a gather or a slice wherever a value's form differs from what its
//! consumer takes; `all_reduce` becomes a reduce-scatter. A parameter
//! replicated over the group and read on a slice of the tokens has its
//! gradient summed over the group (all such sums of a model's backward in
//! one all-reduce at its end). Dropout masks are drawn at global positions.
//! The same model computes the same loss and gradients with sequence
//! parallelism on or off.
//!
//! [`Cx::with_tp_overlap`](crate::module::Cx::with_tp_overlap) overlaps
//! those collectives with the products beside them. For the backward of an
//! `all_reduce` whose argument is a call's output that nothing else reads,
//! the generated code hands the gradient to that call unreduced
//! ([`Module::backward_gathering`](crate::module::Module::backward_gathering)):
//! a row-parallel linear gathers it beside its own product, a
//! vocabulary-parallel embedding beside its own slice's rows, and a derived
//! model whose output is such a call's hands it on.
//!
//! ## Field attributes
//!
//! - `#[shard(column)]`, `#[shard(row)]`, `#[shard(vocab)]`: the role of the
//!   layer on the tensor-parallel group; it selects the layer's
//!   [`Module<Role>`](crate::module::Module) form, which fixes its layouts and
//!   how its parameters are split. A layer without that form (a norm marked
//!   `column`) is a compile error on the attribute.
//! - `#[stage(first)]`, `#[stage(split)]`, `#[stage(last)]`: the pipeline
//!   stage of the field; one `split` field (a [`Stack`](crate::nn::Stack)) is
//!   divided over the middle stages. Stages must follow the data flow.
//! - `#[recompute]`: keep only the sub-module's input and rerun its forward
//!   in the backward; on a `Stack`, per layer. `#[recompute(selective)]`:
//!   drop only the attention core (rerun in the backward). Both can be
//!   overridden at run time with
//!   [`Cx::set_recompute_override`](crate::module::Cx::set_recompute_override).
//! - `#[precision(f32)]` (or `bf16`, `f16`): the sub-module computes in that
//!   dtype; its input is cast at the border and its output cast back.
//! - `#[tied(field)]`: the layer shares the weight of `field` (an output head
//!   tied to the token embedding). Both must have the same `#[shard(..)]`
//!   (a compile error otherwise); weights of different shapes are an error
//!   when the model is built, naming both fields.
//!
//! Struct attributes, in `#[model(..)]`:
//!
//! - `precision = bf16` (or `f16`, `f32`): the compute dtype of the whole
//!   model; master weights stay f32.
//! - `loss_scaling = dynamic` or `none`: an fp16 model or region with
//!   `loss_scaling = none` is refused.
//! - `tp = N` and `dims(name = value, ..)`: a static tensor-parallel degree
//!   and const dimensions. Each dimension the degree does not divide is a
//!   compile error on its value; each becomes an associated constant
//!   (`Model::TP`, `Model::VOCAB`, ...) to build the layers from. When the
//!   model is built, the real group's size must equal `N` and divide every
//!   dimension, or [`module::build`](crate::module::build) says which.
//!
//! ```
//! use tessera::prelude::*;
//! use tessera::nn::{Embedding, Linear};
//! use tessera::{forward, Module};
//!
//! #[derive(Module)]
//! #[model(tp = 4, dims(vocab = 50304, hidden = 768))]
//! pub struct Bigram {
//!     #[shard(vocab)] tok: Embedding,
//!     #[shard(vocab)] #[tied(tok)] head: Linear,
//! }
//!
//! #[forward]
//! impl Bigram {
//!     fn forward(&self, ids: Act<Replicated>) -> Act<SplitHidden> {
//!         self.head(all_reduce(self.tok(ids)))
//!     }
//! }
//!
//! # fn main() -> tessera::Result<()> {
//! let model = Bigram {
//!     tok: Embedding::new(Bigram::VOCAB, Bigram::HIDDEN)?,
//!     head: Linear::new(Bigram::HIDDEN, Bigram::VOCAB, false)?,
//! };
//! # let _ = model; Ok(())
//! # }
//! ```
//!
//! ## Generic models
//!
//! A model may be generic over its layers; the `#[forward]` impl carries the
//! bounds, and every generated impl repeats them:
//!
//! ```
//! use tessera::prelude::*;
//! use tessera::nn::{Embedding, Linear, RmsNorm, Stack};
//! use tessera::{forward, Module};
//!
//! pub trait Block: Module<In = Replicated, Out = Replicated> {}
//! impl<B: Module<In = Replicated, Out = Replicated>> Block for B {}
//!
//! #[derive(Module)]
//! pub struct Lm<B: Block> {
//!     #[stage(first)] #[shard(vocab)] tok: Embedding,
//!     #[stage(split)] blocks: Stack<B>,
//!     #[stage(last)] norm: RmsNorm,
//!     #[stage(last)] #[shard(vocab)] #[tied(tok)] head: Linear,
//! }
//!
//! #[forward]
//! impl<B: Block> Lm<B> {
//!     fn forward(&self, ids: Act<Replicated>) -> Act<SplitHidden> {
//!         self.head(self.norm(self.blocks(all_reduce(self.tok(ids)))))
//!     }
//! }
//! # fn main() {}
//! ```
//!
//! `tessera_models` defines Llama and Mixtral this way, as one
//! `CausalLm<B>` over their two kinds of block.
//!
//! ## Pipeline stages
//!
//! A model with a `#[stage(split)]` field also gets typed entry points for a
//! pipeline executor: `forward_first`/`backward_first` (everything before the
//! split field), `forward_split`/`backward_split` over any range of its layers
//! (`Stack::stage_range` divides them), and `forward_last`/`backward_last`.
//! Their argument and result layouts are the split field's, so what crosses
//! a stage boundary is fixed by the types; they honour the model's and the
//! split field's `#[precision]`, and run in order over all layers they
//! compute exactly the model's forward and backward.
//!
//! ```
//! use tessera::prelude::*;
//! use tessera::nn::{Embedding, LayerNorm, Linear, Stack};
//! use tessera::{forward, Module};
//! # #[derive(Module)]
//! # pub struct Mlp { ln: LayerNorm, #[shard(column)] up: Linear, #[shard(row)] down: Linear }
//! # #[forward]
//! # impl Mlp {
//! #     fn forward(&self, x: Act<Replicated>) -> Act<Replicated> {
//! #         x + all_reduce(self.down(gelu(self.up(self.ln(x)))))
//! #     }
//! # }
//!
//! #[derive(Module)]
//! #[model(precision = bf16)]
//! pub struct Tiny {
//!     #[stage(first)] #[shard(vocab)] tok: Embedding,
//!     #[stage(split)] #[recompute] blocks: Stack<Mlp>,
//!     #[stage(last)] #[precision(f32)] norm: LayerNorm,
//!     #[stage(last)] #[shard(vocab)] #[tied(tok)] head: Linear,
//! }
//!
//! #[forward]
//! impl Tiny {
//!     fn forward(&self, ids: Act<Replicated>) -> Act<SplitHidden> {
//!         let h = all_reduce(self.tok(ids));
//!         self.head(self.norm(self.blocks(h)))
//!     }
//! }
//! # fn main() {}
//! ```
//!
//! ## What is checked at compile time
//!
//! - layout mismatches in the forward body (a `PartialSum` added to a
//!   `Replicated` residual, a row-parallel layer fed a replicated input, a
//!   norm fed `SplitHidden`, a reduction of a value that is not partial, a
//!   nonlinear function or a product of a `PartialSum`);
//! - attributes that contradict each other or the field (`row` and `column`
//!   together, `#[shard(column)]` on a norm, unknown keys, duplicates,
//!   `#[recompute]` on a parameter-free layer, `#[tied]` to a missing field
//!   or to a layer of another role);
//! - pipeline stages that go backwards in the data flow, two `split` fields;
//! - an fp16 region in a model with `loss_scaling = none`;
//! - a forward body outside the grammar, unknown fields and values, values
//!   computed and never used.
//!
//! What depends on run-time values (the tensor-parallel degree against
//! head counts and hidden sizes, a static `tp = N` against the real group,
//! the shapes of tied weights) is checked when the model is built for a rank
//! ([`module::build`](crate::module::build)), before anything is allocated,
//! naming every parameter that does not divide.
//!
//! ## Checking a model
//!
//! [`testing::check_parallel`](crate::testing::check_parallel) runs a model
//! on one rank and on a list of meshes of in-process ranks and compares the
//! loss and every gradient, and the single-rank gradients with finite
//! differences: the test to write for a hand-written layer, and what the
//! project's own differential fuzzer runs on generated models.
