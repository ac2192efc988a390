//! `tessera perplexity`: how well a model predicts a text, `exp` of the mean
//! negative log-likelihood of its tokens, the measure quantization is judged
//! by (`--quantize` loads the model's linear layers quantized).
//!
//! The text is tokenized whole and scored in windows of the model's context
//! (or `--window` tokens), as Hugging Face's perplexity recipe does: each
//! window moves `--stride` tokens on (a whole window by default) and scores
//! only the tokens the previous window did not, each given every token
//! before it in its window. A token with nothing before it in its window
//! (the text's first, and each window's first when windows do not overlap)
//! is not scored.

use crate::model::{with_model, UseModel};
use anyhow::{bail, Context};
use std::path::PathBuf;
use tessera::data::SpecialTokens;
use tessera::module::{Act, Cx, Module, Replicated, SplitHidden};
use tessera::ops::QuantFormat;
use tessera::serve::prompt::{ModelTokenizer, TOKENIZER_FILE};
use tessera::Tensor;

/// Arguments of `tessera perplexity`.
#[derive(clap::Args)]
pub struct Args {
    /// A Hugging Face model directory, or a training run's directory.
    #[arg(long, value_name = "DIR")]
    model: PathBuf,
    /// The text to score (UTF-8).
    #[arg(long, value_name = "FILE")]
    text: PathBuf,
    /// A directory whose tokenizer.json to use instead of the model's (e.g.
    /// the data directory `tessera prepare` wrote, for a model trained from scratch).
    #[arg(long, value_name = "DIR")]
    tokenizer: Option<PathBuf>,
    /// Quantize the linear layers' weights when loading: int8, int4 (groups of 128), int4:N or w8a8.
    #[arg(long, value_name = "FORMAT")]
    quantize: Option<QuantFormat>,
    /// Tokens per forward (default: the model's context, at most 1024).
    #[arg(long)]
    window: Option<usize>,
    /// Tokens each window moves on (default: the window; less gives every
    /// scored token more context, at more forwards).
    #[arg(long)]
    stride: Option<usize>,
    /// Print one JSON line (tokens, nll, perplexity, quantize) instead of text.
    #[arg(long)]
    json: bool,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let quantize = args.quantize;
    with_model(&args.model.clone(), quantize, Score(args))
}

struct Score(Args);

impl UseModel for Score {
    type Output = ();

    fn run<M: Module<In = Replicated, Out = SplitHidden> + 'static>(
        self,
        model: M,
        mut cx: Cx,
        tokenizer: Option<ModelTokenizer>,
        context: usize,
    ) -> anyhow::Result<()> {
        let args = self.0;
        let tokenizer = match &args.tokenizer {
            Some(dir) => ModelTokenizer::from_dir(dir)?,
            None => tokenizer.with_context(|| format!("this model has no {TOKENIZER_FILE}; pass one with --tokenizer DIR"))?,
        };
        let text = std::fs::read_to_string(&args.text).with_context(|| format!("reading `{}` (a UTF-8 text)", args.text.display()))?;
        let ids = tokenizer.encode(&text, SpecialTokens::Omitted)?;
        let window = args.window.unwrap_or(context.min(1024));
        if window < 2 || window > context {
            bail!("--window {window}: a window holds 2 to {context} tokens (the model's context)");
        }
        let stride = args.stride.unwrap_or(window);
        if stride == 0 || stride > window {
            bail!("--stride {stride}: a window moves 1 to {window} tokens (--window)");
        }
        if ids.len() < 2 {
            bail!("`{}` is {} token(s) long; perplexity scores each token after the first, so it needs at least 2", args.text.display(), ids.len());
        }
        cx.set_training(false);
        let (nll, tokens) = score(&model, &mut cx, &ids, window, stride)?;
        let mean = nll / tokens as f64;
        let ppl = mean.exp();
        let format = args.quantize.map(|f| f.to_string());
        if args.json {
            say!("{}", serde_json::json!({"tokens": tokens, "nll": mean, "perplexity": ppl, "quantize": format, "window": window, "stride": stride}));
        } else {
            say!(
                "perplexity {ppl:.4} over {tokens} tokens ({mean:.4} nats per token; windows of {window}, stride {stride}{})",
                format.map(|f| format!("; weights {f}")).unwrap_or_default()
            );
        }
        Ok(())
    }
}

/// The summed negative log-likelihood (nats) of the tokens of `ids`, and
/// how many were scored, in windows as the module says.
fn score<M: Module<In = Replicated, Out = SplitHidden>>(model: &M, cx: &mut Cx, ids: &[u32], window: usize, stride: usize) -> anyhow::Result<(f64, usize)> {
    let (mut nll, mut count, mut scored, mut begin) = (0.0f64, 0usize, 0usize, 0usize);
    loop {
        let end = (begin + window).min(ids.len());
        let chunk = &ids[begin..end];
        let input = Tensor::from_vec(chunk.to_vec(), [1, chunk.len()], cx.device())?;
        let (logits, _) = model.forward(cx, Act::new(input))?;
        let vocab = *logits.tensor().dims().last().expect("logits have a vocabulary dimension");
        let logits = logits.tensor().to_f32_vec()?;
        // Token t is predicted by the logits of position t - 1; a window's
        // first token has none before it there (only when windows do not
        // overlap: it goes unscored, as in the recipe).
        for t in scored.max(begin + 1)..end {
            let row = &logits[(t - 1 - begin) * vocab..(t - begin) * vocab];
            nll += neg_log_prob(row, ids[t] as usize);
            count += 1;
        }
        scored = end;
        if end == ids.len() {
            return Ok((nll, count));
        }
        begin += stride;
    }
}

/// `-log softmax(row)[target]`, in f64.
fn neg_log_prob(row: &[f32], target: usize) -> f64 {
    let max = row.iter().fold(f64::NEG_INFINITY, |m, &v| m.max(v as f64));
    let lse = max + row.iter().map(|&v| (v as f64 - max).exp()).sum::<f64>().ln();
    lse - row[target] as f64
}

#[cfg(test)]
mod tests {
    use super::{neg_log_prob, score};
    use tessera::module::{self, Act, Cx, Module};
    use tessera::{ops, Device, Tensor};
    use tessera_models::llama::{Llama, LlamaConfig};

    /// The library's mean cross-entropy of the model on `ids` in one forward.
    fn cross_entropy(model: &Llama, cx: &mut Cx, ids: &[u32]) -> f64 {
        let n = ids.len();
        let input = Tensor::from_vec(ids[..n - 1].to_vec(), [1, n - 1], cx.device()).unwrap();
        let targets = Tensor::from_vec(ids[1..].to_vec(), [1, n - 1], cx.device()).unwrap();
        let (logits, _) = model.forward(cx, Act::new(input)).unwrap();
        let (loss, _) = ops::cross_entropy(logits.tensor(), &targets, None).unwrap();
        loss.to_f32_vec().unwrap()[0] as f64
    }

    /// Windows score what the library's cross-entropy gives: one window
    /// over the text, non-overlapping windows (each as its own text), and
    /// overlapping ones (each token once, with the larger context).
    #[test]
    fn windows_score_the_library_cross_entropy() {
        let mut cx = Cx::new(Device::cpu());
        cx.set_training(false);
        let model = module::build(Llama::new(&LlamaConfig::tiny(50, 32, 4, 2, 48, 2, 64)).unwrap(), &cx).unwrap();
        let ids: Vec<u32> = (0..40u32).map(|i| (i * 37 + 11) % 50).collect();
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-5 * b.abs().max(1.0);
        let (nll, n) = score(&model, &mut cx, &ids, 64, 64).unwrap();
        assert_eq!(n, 39);
        assert!(close(nll, 39.0 * cross_entropy(&model, &mut cx, &ids)), "{nll}");
        let (nll, n) = score(&model, &mut cx, &ids, 16, 16).unwrap();
        assert_eq!(n, 15 + 15 + 7);
        let want: f64 = ids.chunks(16).map(|c| (c.len() - 1) as f64 * cross_entropy(&model, &mut cx, c)).sum();
        assert!(close(nll, want), "{nll} against {want}");
        // Stride 8 in windows of 16: every token after the first once.
        let (_, n) = score(&model, &mut cx, &ids, 16, 8).unwrap();
        assert_eq!(n, 39);
        let (a, _) = score(&model, &mut cx, &ids, 16, 1).unwrap();
        // Stride 1: the first window scores tokens 1..16; each later token t
        // is scored in the window ending at t + 1, given the 15 before it:
        // that window's summed loss less its first 15 tokens' summed loss.
        let want: f64 = cross_entropy(&model, &mut cx, &ids[..16]) * 15.0
            + (16..40)
                .map(|t| {
                    let w = &ids[t + 1 - 16..=t];
                    let whole = cross_entropy(&model, &mut cx, w) * 15.0;
                    let head = cross_entropy(&model, &mut cx, &w[..15]) * 14.0;
                    whole - head
                })
                .sum::<f64>();
        assert!(close(a, want), "{a} against {want}");
    }

    #[test]
    fn the_negative_log_probability_is_the_log_softmax() {
        let row = [1.0f32, 2.0, 3.0, f32::NEG_INFINITY];
        let z: f64 = row.iter().map(|&v| (v as f64).exp()).sum();
        for t in 0..3 {
            assert!((neg_log_prob(&row, t) - (z.ln() - row[t] as f64)).abs() < 1e-12);
        }
        // Large logits do not overflow.
        assert!((neg_log_prob(&[1000.0, 1000.0], 0) - 2f64.ln()).abs() < 1e-12);
    }
}
