//! `tessera plan`: the fastest layout of a model over a cluster, from the
//! model's own cost description and the cluster's profile.
//!
//! The model is a training configuration's `[model]` table (its other
//! sections give the batch and precision); the cluster is a profile file or
//! a shipped profile's name. The planner searches every layout Tessera runs
//! (data, tensor, pipeline, sequence and expert parallelism, the schedule
//! and its virtual stages, the micro-batch, recompute, the ZeRO stage),
//! drops those over memory, prints the best as a table, says why the
//! runner-up lost, and writes the best as a training configuration.
//! `--evaluate` estimates the configuration's own layout instead.

use anyhow::{bail, Context};
use std::path::PathBuf;
use tessera::data::{arith, Dataset};
use tessera::module::{CostSettings, ModelCost, RecomputeOverride};
use tessera::parallel::pipeline::ScheduleKind;
use tessera::train::{planned_layout, TrainConfig};
use tessera_models::kinds::{self, KindModel, ModelJob, ModelSpec};
use tessera_plan::estimate::{estimate, Estimate, Layout};
use tessera_plan::fixed::Fixed;
use tessera_plan::profile::ClusterProfile;
use tessera_plan::search::{search, Model, Request};

/// Arguments of `tessera plan`.
#[derive(clap::Args)]
pub struct Args {
    /// A training configuration (TOML): its `[model]` table is the model
    /// planned; its batch and precision are the defaults.
    #[arg(long, value_name = "CONFIG")]
    model: PathBuf,
    /// The cluster: a profile file (`tessera profile` writes one) or a
    /// shipped profile's name (a100-sxm4-80gb, h100-sxm5-80gb, h200-sxm-141gb).
    #[arg(long, value_name = "PROFILE")]
    cluster: String,
    /// Nodes of the cluster.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    nodes: u32,
    /// Sequences per step (default: the configuration's dp × ep × grad_accum × micro_batch).
    #[arg(long, value_name = "B")]
    global_batch: Option<usize>,
    /// Tokens per sequence (default: the configuration's batch.seq_len).
    #[arg(long, value_name = "T")]
    seq: Option<usize>,
    /// Override a setting of the configuration: `--set section.key=value` (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    set: Vec<String>,
    /// Plans shown.
    #[arg(long, default_value_t = 5)]
    top: usize,
    /// Where to write the best plan as a training configuration.
    #[arg(long, value_name = "FILE", default_value = "plan.toml")]
    out: PathBuf,
    /// The share of a device's memory a plan may fill.
    #[arg(long, default_value_t = 0.9)]
    memory_fraction: f64,
    /// Keep a part of the layout: `--fix KEY=VALUE` (repeatable) with KEY one
    /// of dp, tp, pp, ep, micro_batch (integers), sp (true/false), schedule
    /// (gpipe, 1f1b, interleaved, zb-h1; several comma-separated), recompute (none, declared, full), zero (0-3).
    #[arg(long = "fix", value_name = "KEY=VALUE")]
    fix: Vec<String>,
    /// Estimate the configuration's own layout (one JSON line) instead of searching.
    #[arg(long)]
    evaluate: bool,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(&args.model)
        .with_context(|| format!("cannot read the configuration `{}`; give a training configuration whose [model] table is the model", args.model.display()))?;
    let refs: Vec<&str> = args.set.iter().map(String::as_str).collect();
    let cfg = TrainConfig::parse(&text, &refs).with_context(|| format!("in the configuration `{}`", args.model.display()))?;
    let cluster = ClusterProfile::load(&args.cluster)?;
    if !(args.memory_fraction > 0.0 && args.memory_fraction <= 1.0) {
        bail!("--memory-fraction is {}; give a share of the device's memory in (0, 1]", args.memory_fraction);
    }
    let vocab = data_vocab(&cfg)?;
    kinds::with_configured_model(&cfg, vocab, Job { args: &args, cfg: &cfg, text: &text, cluster: &cluster })?
}

/// The vocabulary of the configuration's data (the model's when it names one).
fn data_vocab(cfg: &TrainConfig) -> anyhow::Result<usize> {
    if let Some(v) = cfg.model.get("vocab_size").and_then(|v| v.as_integer()) {
        return Ok(v.max(0) as usize);
    }
    if cfg.model.contains_key("from") {
        return Ok(1);
    }
    match cfg.data.source.as_str() {
        "bundled" => Ok(arith::Task::new(cfg.data.seed).tokenizer().vocab_size()),
        dir => match Dataset::open(dir) {
            Ok(d) => Ok(d.index().vocab_size),
            Err(e) => bail!("the model's vocabulary comes from its data ({dir}), which cannot be opened ({e}); set model.vocab_size to plan without the data"),
        },
    }
}

struct Job<'a> {
    args: &'a Args,
    cfg: &'a TrainConfig,
    text: &'a str,
    cluster: &'a ClusterProfile,
}

impl ModelJob for Job<'_> {
    type Output = anyhow::Result<()>;

    fn run<M: KindModel>(self, spec: ModelSpec<M>) -> tessera_models::Result<anyhow::Result<()>> {
        Ok(self.plan(spec))
    }
}

impl Job<'_> {
    fn plan<M: KindModel>(self, spec: ModelSpec<M>) -> anyhow::Result<()> {
        let (args, cfg, cluster) = (self.args, self.cfg, self.cluster);
        let model = Model::new(spec.kind().has_experts(), |s: CostSettings| spec.describe(s).map_err(to_tessera));
        if args.evaluate {
            let layout = planned_layout(cfg)?;
            let cost = model.cost(layout.settings()).ok_or_else(|| {
                anyhow::anyhow!("the model cannot run this layout: {}", spec.describe(layout.settings()).err().map(|e| e.to_string()).unwrap_or_default())
            })?;
            let e = estimate(&cost, model.flops_per_token(layout.seq_len, layout.compute)?, &layout, cluster)?;
            say!("{}", json_line(&e, &cost));
            return Ok(());
        }
        let base = planned_layout(cfg)?;
        let request = Request {
            nodes: args.nodes as usize,
            global_batch: args.global_batch.unwrap_or(base.global_batch()),
            seq_len: args.seq.unwrap_or(base.seq_len),
            compute: base.compute,
            half_params: base.half_params,
            bucket_bytes: base.bucket_bytes,
            fixed: Fixed::parse(&args.fix)?,
            memory_fraction: args.memory_fraction,
        };
        let ranked = search(&model, cluster, &request)?;
        let world = request.nodes * cluster.gpus_per_node;
        say!(
            "planning {} ({} parameters) on {} × {} ({} devices of {:.0} GiB): {} sequences of {} tokens per step, {}",
            spec.kind(),
            human(model.cost(CostSettings::single(request.seq_len)).map_or(0, |c| c.param_count()) as f64),
            request.nodes,
            cluster.name,
            world,
            cluster.device.memory_bytes as f64 / GIB,
            request.global_batch,
            request.seq_len,
            request.compute
        );
        say!("{} layouts considered, {} fit in memory", ranked.considered, ranked.fits.len());
        let Some(best) = ranked.fits.first() else {
            let hint = match &ranked.over_memory {
                Some(e) => format!("the smallest needs {:.1} GiB per device ({})", e.memory.total() / GIB, describe_layout(&e.layout)),
                None if args.fix.is_empty() => "no layout of this model divides the devices".into(),
                None => format!("no layout of this model divides the devices keeping {}", args.fix.join(", ")),
            };
            let loosen = if args.fix.is_empty() { "" } else { ", or fix fewer parts of the layout" };
            bail!(
                "no layout fits in {:.0}% of {:.0} GiB: {hint}; add nodes, shorten --seq or lower --global-batch{loosen}",
                args.memory_fraction * 100.0,
                cluster.device.memory_bytes as f64 / GIB
            );
        };
        print_table(&ranked.fits[..ranked.fits.len().min(args.top.max(1))]);
        if let Some(second) = ranked.fits.get(1) {
            say!("{}", why_lost(best, second));
        }
        let toml = plan_toml(self.text, best)?;
        tessera::file::write_atomic(&args.out, toml.as_bytes()).with_context(|| format!("cannot write `{}`", args.out.display()))?;
        say!("wrote the best plan to {} (tessera train {})", args.out.display(), args.out.display());
        Ok(())
    }
}

fn to_tessera(e: tessera_models::Error) -> tessera::Error {
    match e {
        tessera_models::Error::Tessera(e) => e,
        other => tessera::Error::invalid("plan", other.to_string()),
    }
}

const GIB: f64 = (1u64 << 30) as f64;

fn human(n: f64) -> String {
    match n {
        n if n >= 1e9 => format!("{:.1} B", n / 1e9),
        n if n >= 1e6 => format!("{:.1} M", n / 1e6),
        n if n >= 1e3 => format!("{:.1} K", n / 1e3),
        n => format!("{n:.0}"),
    }
}

fn schedule_name(s: ScheduleKind) -> String {
    match s {
        ScheduleKind::GPipe => "gpipe".into(),
        ScheduleKind::OneFOneB => "1f1b".into(),
        ScheduleKind::Interleaved { chunks } => format!("interleaved×{chunks}"),
        ScheduleKind::ZeroBubbleH1 => "zb-h1".into(),
    }
}

fn recompute_name(r: RecomputeOverride) -> &'static str {
    match r {
        RecomputeOverride::Off => "none",
        RecomputeOverride::AsDeclared => "declared",
        RecomputeOverride::Full => "full",
    }
}

fn describe_layout(l: &Layout) -> String {
    let mut s = format!("dp{} tp{} pp{}", l.dp, l.tp, l.pp);
    if l.ep > 1 {
        s += &format!(" ep{}", l.ep);
    }
    if l.cp > 1 {
        s += &format!(" cp{}", l.cp);
    }
    if l.sp {
        s += " sp";
    }
    if l.pp > 1 {
        s += &format!(" {}", schedule_name(l.schedule));
    }
    s + &format!(
        " mb{}×{} recompute {} zero{}{}",
        l.micro_batch,
        l.grad_accum,
        recompute_name(l.recompute),
        l.zero.number(),
        if l.offloaded() { " offload" } else { "" }
    )
}

fn print_table(plans: &[Estimate]) {
    say!(
        "{:>2}  {:<48} {:>9} {:>10} {:>6} {:>9}   {:>7} {:>7} {:>7} {:>7} {:>7}",
        "#",
        "layout",
        "step s",
        "tokens/s",
        "MFU",
        "GiB/dev",
        "compute",
        "tp/ep",
        "bubble",
        "dp",
        "optim"
    );
    for (i, e) in plans.iter().enumerate() {
        let t = &e.time;
        let share = |x: f64| format!("{:.0}%", 100.0 * x / t.step);
        say!(
            "{:>2}  {:<48} {:>9.4} {:>10} {:>5.1}% {:>9.2}   {:>7} {:>7} {:>7} {:>7} {:>7}",
            i + 1,
            describe_layout(&e.layout),
            t.step,
            human(e.tokens_per_s),
            100.0 * e.mfu,
            e.memory.total() / GIB,
            share(t.compute),
            share(t.model_comm),
            share(t.bubble),
            share(t.dp_exposed),
            share(t.optimizer)
        );
    }
}

/// Why `second` ranks below `best`: the components of the step that differ most.
fn why_lost(best: &Estimate, second: &Estimate) -> String {
    let (a, b) = (&best.time, &second.time);
    let mut parts = [
        ("compute", b.compute - a.compute),
        ("tensor/expert-parallel communication", b.model_comm - a.model_comm),
        ("pipeline bubble", b.bubble - a.bubble),
        ("exposed data-parallel communication", b.dp_exposed - a.dp_exposed),
        ("optimizer", b.optimizer - a.optimizer),
    ];
    parts.sort_by(|x, y| y.1.abs().total_cmp(&x.1.abs()));
    let diffs: Vec<String> =
        parts.iter().filter(|(_, d)| d.abs() > 1e-3 * a.step.max(1e-12)).take(3).map(|(name, d)| format!("{} {:+.4} s", name, d)).collect();
    if diffs.is_empty() {
        let more = second.memory.total() - best.memory.total();
        return format!("the runner-up ({}) takes the same time within 0.1% and needs {:.2} GiB more per device", describe_layout(&second.layout), more / GIB);
    }
    format!("the runner-up ({}) is {:.1}% slower: {}", describe_layout(&second.layout), 100.0 * (b.step / a.step - 1.0), diffs.join(", "))
}

/// The configuration `text` with the best layout in its `[mesh]`, `[batch]`,
/// `[recompute]` and `[zero]` tables.
fn plan_toml(text: &str, best: &Estimate) -> anyhow::Result<String> {
    let mut doc: toml::Table = text.parse().context("re-reading the configuration")?;
    let l = &best.layout;
    let table = |doc: &mut toml::Table, name: &str| -> anyhow::Result<toml::Table> {
        match doc.remove(name) {
            None => Ok(toml::Table::new()),
            Some(toml::Value::Table(t)) => Ok(t),
            Some(_) => bail!("[{name}] in the configuration is not a table"),
        }
    };
    let mut mesh = table(&mut doc, "mesh")?;
    for (k, v) in [("dp", l.dp), ("tp", l.tp), ("pp", l.pp), ("ep", l.ep), ("cp", l.cp)] {
        mesh.insert(k.into(), toml::Value::Integer(v as i64));
    }
    mesh.insert("sp".into(), toml::Value::Boolean(l.sp));
    let (schedule, chunks) = match l.schedule {
        ScheduleKind::GPipe => ("gpipe", 1),
        ScheduleKind::OneFOneB => ("1f1b", 1),
        ScheduleKind::Interleaved { chunks } => ("interleaved", chunks),
        ScheduleKind::ZeroBubbleH1 => ("zb-h1", 1),
    };
    mesh.insert("schedule".into(), toml::Value::String(schedule.into()));
    mesh.insert("chunks".into(), toml::Value::Integer(chunks as i64));
    doc.insert("mesh".into(), toml::Value::Table(mesh));
    let mut batch = table(&mut doc, "batch")?;
    for (k, v) in [("micro_batch", l.micro_batch), ("grad_accum", l.grad_accum), ("seq_len", l.seq_len)] {
        batch.insert(k.into(), toml::Value::Integer(v as i64));
    }
    doc.insert("batch".into(), toml::Value::Table(batch));
    let mut recompute = table(&mut doc, "recompute")?;
    recompute.insert("mode".into(), toml::Value::String(recompute_name(l.recompute).into()));
    doc.insert("recompute".into(), toml::Value::Table(recompute));
    let mut zero = table(&mut doc, "zero")?;
    zero.insert("stage".into(), toml::Value::Integer(i64::from(l.zero.number())));
    if l.offloaded() {
        zero.insert("offload".into(), toml::Value::Boolean(true));
    }
    doc.insert("zero".into(), toml::Value::Table(zero));
    let t = &best.time;
    let head = format!(
        "# Written by `tessera plan`: {}, estimated {:.4} s per step, {} tokens/s, MFU {:.1}%, {:.2} GiB per device.\n",
        describe_layout(l),
        t.step,
        human(best.tokens_per_s),
        100.0 * best.mfu,
        best.memory.total() / GIB
    );
    Ok(head + &toml::to_string(&doc)?)
}

fn json_line(e: &Estimate, cost: &ModelCost) -> String {
    let (t, m) = (&e.time, &e.memory);
    serde_json::json!({
        "layout": describe_layout(&e.layout),
        "step_s": t.step,
        "compute_s": t.compute,
        "model_comm_s": t.model_comm,
        "bubble_s": t.bubble,
        "dp_exposed_s": t.dp_exposed,
        "dp_total_s": t.dp_total,
        "optimizer_s": t.optimizer,
        "memory_bytes": m.total(),
        "host_bytes": m.host,
        "states_bytes": m.states.total(),
        "activation_bytes": m.activations,
        "logits_bytes": m.logits,
        "workspace_bytes": m.workspace,
        "tokens_per_s": e.tokens_per_s,
        "mfu": e.mfu,
        "model_flops_per_token": e.model_flops_per_token,
        "params": cost.param_count(),
    })
    .to_string()
}
