//! Checking that a model computes the same loss and gradients on every
//! parallel layout as on one rank.
//!
//! Its place: a tool crate beside the trainer, on the engines it checks
//! (dist, nn, parallel). It owns the parallel-equivalence checks, finite
//! differences and the fuzzer that the test suites use. Users reach it as
//! `tessera::testing`.
//!
//! [`check_parallel`] builds a user's model on one rank and on each of a list
//! of meshes of in-process ranks (threads), feeds all of them the same batch,
//! and compares the loss and every parameter's gradient (gathered from its
//! shards) with the single-rank run. It also checks that a parameter held by
//! several ranks (replicated over the tensor-parallel group, or over data
//! replicas) has bitwise equal gradients everywhere, and, optionally, the
//! single-rank gradients against central finite differences in f64.
//!
//! The loss is a fixed random linear functional of the output,
//! `L = (1/B) Σ_b ⟨y_b, r_b⟩` over the `B` rows (dimension 0) of the batch:
//! its gradient with respect to the output is `r/B`, so every parameter's
//! gradient is a vector–Jacobian product of the model, checked exactly,
//! whatever the output's layout. Each data-parallel replica takes a block of
//! rows; a pipeline splits a replica's rows into microbatches.
//!
//! ```
//! use tessera::nn::{LayerNorm, Linear};
//! use tessera::prelude::*;
//! use tessera::testing::{check_parallel, Check};
//!
//! #[derive(Module)]
//! pub struct Mlp {
//!     ln: LayerNorm,
//!     #[shard(column)] up: Linear,
//!     #[shard(row)] down: Linear,
//! }
//!
//! #[forward]
//! impl Mlp {
//!     fn forward(&self, x: Act<Replicated>) -> Act<Replicated> {
//!         x + all_reduce(self.down(gelu(self.up(self.ln(x)))))
//!     }
//! }
//!
//! # fn main() -> tessera::Result<()> {
//! let make = |_: &tessera::testing::Rank| -> tessera::Result<Mlp> {
//!     Ok(Mlp { ln: LayerNorm::new(8, 1e-5, true)?, up: Linear::new(8, 16, true)?, down: Linear::new(16, 8, true)? })
//! };
//! let x = Tensor::rand(Init::Normal { mean: 0.0, std: 1.0 }, RngKey::new(1, 0), [2, 4, 8], DType::F32, &Device::cpu())?;
//! let check = Check::new(["tp2", "tp2+sp", "dp2,tp2+bucket=256"]).with_finite_differences(2);
//! let report = check_parallel(make, &x, &check)?;
//! assert!(report.worst() <= 1e-5);
//! # Ok(())
//! # }
//! ```
//!
//! [`fuzz`] holds the bounded mutation fuzzer the project runs on its
//! loaders of outside input.

mod byte_level;
mod compare;
mod fd;
pub mod fuzz;
mod run;
mod scratch;

pub use byte_level::byte_chars;
pub use run::Rank;
pub use scratch::Scratch;

use std::fmt;
use std::str::FromStr;
use tessera_core::tensor::{DType, Tensor};
use tessera_core::{Error, Result};
use tessera_dist::mesh::{Axis, Degrees};
use tessera_nn::module::{Module, Staged};

/// One parallel configuration to check: the mesh degrees and the options
/// that change how ranks compute.
///
/// Written `degrees[+option]..`, e.g. `tp2`, `tp4+sp`, `dp2,tp2+bucket=64`,
/// `pp2+mb=2`: the degrees as [`Degrees::parse`] reads them (`dp`, `tp`,
/// `pp`, `cp`: each rank takes its chunks of every sequence, dimension 1 of
/// the input and output; `ep` is not supported), then `+sp` for sequence parallelism,
/// `+overlap=N` for its collectives overlapping the products, the
/// reduce-scatters in `N` pieces ([`Cx::with_tp_overlap`](tessera_nn::module::Cx::with_tp_overlap)),
/// `+bucket=N` for data-parallel buckets of `N` bytes, `+mb=N` for `N`
/// microbatches per pipeline step (default: the pipeline degree).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParallelRun {
    /// Ranks along each mesh axis.
    pub degrees: Degrees,
    /// Sequence parallelism on the tensor-parallel group.
    pub sequence_parallel: bool,
    /// Pieces the sequence-parallel collectives are cut into (1: whole).
    pub tp_overlap: usize,
    /// Data-parallel bucket size in bytes.
    pub bucket_bytes: usize,
    /// Microbatches per step through the pipeline (1 without one).
    pub microbatches: usize,
}

impl ParallelRun {
    /// Ranks in all.
    pub fn world(&self) -> usize {
        self.degrees.product().unwrap_or(usize::MAX)
    }
}

impl FromStr for ParallelRun {
    type Err = Error;
    fn from_str(spec: &str) -> Result<ParallelRun> {
        const OP: &str = "ParallelRun";
        let mut parts = spec.split('+');
        let degrees = Degrees::parse(parts.next().unwrap_or(""))?;
        if degrees.get(Axis::Ep) != 1 {
            return Err(Error::unsupported(
                OP,
                format!("`{spec}`: expert parallelism changes which tokens each expert sees; check it with the model's own tests"),
            ));
        }
        let mut run = ParallelRun { degrees, sequence_parallel: false, tp_overlap: 1, bucket_bytes: 1 << 20, microbatches: degrees.get(Axis::Pp) };
        for opt in parts {
            let (key, value) = opt.split_once('=').unwrap_or((opt, ""));
            let number = || {
                value
                    .parse::<usize>()
                    .ok()
                    .filter(|&n| n > 0)
                    .ok_or_else(|| Error::invalid(OP, format!("`{opt}` in `{spec}` needs a positive number, as in `{key}=2`")))
            };
            match key {
                "sp" => run.sequence_parallel = true,
                "overlap" => run.tp_overlap = number()?,
                "bucket" => run.bucket_bytes = number()?,
                "mb" => run.microbatches = number()?,
                _ => {
                    return Err(Error::invalid(OP, format!("unknown option `{opt}` in `{spec}`; the options are `+sp`, `+overlap=N`, `+bucket=N` and `+mb=N`")))
                }
            }
        }
        if run.tp_overlap > 1 && !(run.sequence_parallel && degrees.get(Axis::Tp) > 1) {
            return Err(Error::invalid(
                OP,
                format!("`{spec}` cuts the collectives of sequence parallelism into pieces without any; add `tp2` (or more) and `+sp`"),
            ));
        }
        if run.microbatches > 1 && degrees.get(Axis::Pp) == 1 {
            return Err(Error::invalid(OP, format!("`{spec}` sets microbatches without a pipeline; add `pp2` (or more) or drop `+mb`")));
        }
        Ok(run)
    }
}

impl fmt::Display for ParallelRun {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let axes: Vec<String> = Axis::ALL.iter().filter(|&&a| self.degrees.get(a) > 1).map(|&a| format!("{a}{}", self.degrees.get(a))).collect();
        f.write_str(if axes.is_empty() { "single".to_string() } else { axes.join(",") }.as_str())?;
        if self.sequence_parallel {
            f.write_str("+sp")?;
        }
        if self.tp_overlap > 1 {
            write!(f, "+overlap={}", self.tp_overlap)?;
        }
        if self.degrees.get(Axis::Dp) > 1 {
            write!(f, "+bucket={}", self.bucket_bytes)?;
        }
        if self.degrees.get(Axis::Pp) > 1 {
            write!(f, "+mb={}", self.microbatches)?;
        }
        Ok(())
    }
}

/// What [`check_parallel`] checks and how strictly.
#[derive(Clone, Debug)]
pub struct Check {
    /// The parallel configurations.
    pub runs: Vec<ParallelRun>,
    /// The dtype every run computes in (f32 by default; f64 makes every
    /// `#[precision(..)]` region a no-op).
    pub dtype: DType,
    /// Largest accepted relative error (1e-5 by default): of each gradient,
    /// `‖a − b‖ / ‖b‖` (an exactly zero reference is measured against the
    /// largest gradient norm of the model); of the loss, `|l − l₁|` over the
    /// sum of its terms' magnitudes (a loss whose terms cancel is small, its
    /// rounding error is not).
    pub tolerance: f64,
    /// Seed of the model's initialisation, dropout and the loss.
    pub seed: u64,
    /// Elements per parameter compared with finite differences (0: none).
    pub finite_differences: usize,
    /// When positive (and the dtype is f32), each comparison also accepts
    /// up to this many times the error one rank's own run makes in f32,
    /// measured against the same run in f64: a badly conditioned model
    /// magnifies rounding, in one rank's run as in a parallel one, while a
    /// layout error is far larger than rounding. Only for models without
    /// half-precision regions, which f64 runs skip (0 by default: off).
    pub rounding_allowance: f64,
    /// The first run spec [`Check::new`] could not parse, reported by the check.
    bad_spec: Option<String>,
}

impl Check {
    /// A check of `runs`, each parsed as a [`ParallelRun`]; an unparsable
    /// one is reported when the check runs.
    pub fn new<S: AsRef<str>>(runs: impl IntoIterator<Item = S>) -> Check {
        let runs = runs.into_iter().map(|r| r.as_ref().to_string()).collect::<Vec<_>>();
        Check { runs: Vec::new(), dtype: DType::F32, tolerance: 1e-5, seed: 7, finite_differences: 0, rounding_allowance: 0.0, bad_spec: None }.with_specs(runs)
    }

    fn with_specs(mut self, specs: Vec<String>) -> Check {
        self.runs = specs.iter().filter_map(|s| s.parse().ok()).collect();
        if self.runs.len() != specs.len() {
            // Keep the first bad spec to report it from `check_parallel`.
            self.bad_spec = specs.into_iter().find(|s| s.parse::<ParallelRun>().is_err());
        }
        self
    }

    fn validate(&self) -> Result<()> {
        if let Some(spec) = &self.bad_spec {
            spec.parse::<ParallelRun>()?;
        }
        if !matches!(self.dtype, DType::F32 | DType::F64) {
            return Err(Error::unsupported(
                "check_parallel",
                format!("runs compute in f32 or f64, not {}; set a model's half-precision regions with `#[precision(..)]`", self.dtype),
            ));
        }
        Ok(())
    }

    /// Computes in `dtype` (f32 or f64).
    pub fn with_dtype(mut self, dtype: DType) -> Check {
        self.dtype = dtype;
        self
    }

    /// Accepts relative errors up to `tolerance` (see [`Check::tolerance`]).
    pub fn with_tolerance(mut self, tolerance: f64) -> Check {
        self.tolerance = tolerance;
        self
    }

    /// Also accepts `k` times one rank's own f32 rounding error (see
    /// [`Check::rounding_allowance`]).
    pub fn with_rounding_allowance(mut self, k: f64) -> Check {
        self.rounding_allowance = k;
        self
    }

    /// Seeds initialisation, dropout and the loss with `seed`.
    pub fn with_seed(mut self, seed: u64) -> Check {
        self.seed = seed;
        self
    }

    /// Also compares up to `per_param` elements of every parameter's
    /// single-rank gradient (and of a float input's) with central finite
    /// differences, in f64.
    pub fn with_finite_differences(mut self, per_param: usize) -> Check {
        self.finite_differences = per_param;
        self
    }
}

/// The largest error [`check_parallel`] measured in each comparison.
#[derive(Clone, Debug, Default)]
pub struct Report {
    /// `(what was compared, largest relative error)`, in the order run.
    pub errors: Vec<(String, f64)>,
}

impl Report {
    /// The largest relative error of all comparisons.
    pub fn worst(&self) -> f64 {
        self.errors.iter().map(|(_, e)| *e).fold(0.0, f64::max)
    }
}

/// Checks `make`'s model on every run of `check` against the single-rank
/// run (see the [module docs](self)). `make` builds the model for a rank (it
/// is called once per rank, and once for the single-rank reference);
/// `input` is the whole batch, rows along dimension 0.
///
/// Returns the errors measured, or an error naming every comparison that
/// failed (loss, gradient, replicas that disagree) with its size.
/// Pipeline runs need [`check_parallel_staged`].
pub fn check_parallel<M: Module, F: Fn(&Rank) -> Result<M> + Sync>(make: F, input: &Tensor, check: &Check) -> Result<Report> {
    check.validate()?;
    if let Some(run) = check.runs.iter().find(|r| r.degrees.get(Axis::Pp) > 1) {
        return Err(Error::unsupported(
            "check_parallel",
            format!("`{run}` runs a pipeline, which needs a model with a `#[stage(split)]` field: use `check_parallel_staged`"),
        ));
    }
    run::check(&make, input, check, &run::Plain)
}

/// [`check_parallel`] for a model with a `#[stage(split)]` field, which
/// also runs pipeline configurations (`pp2`, ...) through the pipeline
/// executor with a 1F1B schedule. A pipeline run is compared with a single
/// rank running the same microbatches one after another.
pub fn check_parallel_staged<M: Staged, F: Fn(&Rank) -> Result<M> + Sync>(make: F, input: &Tensor, check: &Check) -> Result<Report> {
    check.validate()?;
    run::check(&make, input, check, &run::Pipelined)
}
