//! Each model loaded from its Hugging Face fixture reproduces the logits
//! Hugging Face computed for it: on one rank, from half-precision copies of
//! the weights, from a bare base-model checkpoint, run stage by stage, on
//! two tensor-parallel or expert-parallel ranks, and by the pipeline executor
//! over two stages.

mod common;
use common::*;
use safetensors::Dtype;
use tessera::dist::inproc::{mesh_groups, InProcess};
use tessera::dist::mesh::Mesh;
use tessera::module::{Act, Cx, Module, Replicated, Shard, SplitHidden, Staged};
use tessera::parallel::pipeline::{run_stage, sync_tied_grads, ScheduleKind};
use tessera::{bf16, f16, Device, Tensor};
use tessera_models::gpt2::Gpt2;
use tessera_models::hf::{self, HfModel};
use tessera_models::llama::Llama;
use tessera_models::mixtral::Mixtral;

/// The tolerance on f32 logits of magnitude up to about 4.
const TOL: f32 = 1e-4;

fn matches_reference<M: HfModel + Module<In = Replicated, Out = SplitHidden>>(name: &str) {
    let cx = &mut Cx::new(Device::cpu());
    let r = reference(name, cx.device());
    let model = hf::load_pretrained::<M>(fixture(name), cx).unwrap().model;
    let y = logits(&model, cx, &r.ids);
    assert_eq!(y.dims(), r.dims.as_slice());
    let err = max_abs_diff(&y.to_f32_vec().unwrap(), &r.logits);
    assert!(err <= TOL, "{name}: max abs error {err} against Hugging Face's logits");
}

#[test]
fn gpt2_reproduces_hugging_face_logits() {
    matches_reference::<Gpt2>("gpt2");
}

#[test]
fn llama_reproduces_hugging_face_logits() {
    matches_reference::<Llama>("llama");
}

#[test]
fn mixtral_reproduces_hugging_face_logits() {
    matches_reference::<Mixtral>("mixtral");
}

/// Weights stored in bf16 or f16 load as exactly those values in f32.
#[test]
fn half_precision_weights_load_as_their_values() {
    let original = hf::load_pretrained::<Llama>(fixture("llama"), &Cx::new(Device::cpu())).unwrap().model;
    for dtype in [Dtype::BF16, Dtype::F16] {
        let dir = copy_fixture("llama");
        let path = dir.path().join("model.safetensors");
        let mut tensors = read_tensors(&path);
        for (d, _, bytes) in tensors.values_mut() {
            let halves: Vec<u8> = f32s(bytes)
                .into_iter()
                .flat_map(|v| if dtype == Dtype::BF16 { bf16::from_f32(v).to_bits() } else { f16::from_f32(v).to_bits() }.to_le_bytes())
                .collect();
            (*d, *bytes) = (dtype, halves);
        }
        write_tensors(&path, &tensors);
        let loaded = hf::load_pretrained::<Llama>(dir.path(), &Cx::new(Device::cpu())).unwrap().model;
        for ((name, want), (_, got)) in param_bits(&original).into_iter().zip(param_bits(&loaded)) {
            let rounded: Vec<u32> = want
                .iter()
                .map(|&b| {
                    let v = f32::from_bits(b);
                    if dtype == Dtype::BF16 { bf16::from_f32(v).to_f32() } else { f16::from_f32(v).to_f32() }.to_bits()
                })
                .collect();
            assert_eq!(got, rounded, "{dtype:?}: `{name}`");
        }
    }
}

/// `GPT2Model` checkpoints name their tensors without `transformer.`.
#[test]
fn a_bare_base_model_checkpoint_loads() {
    let dir = copy_fixture("gpt2");
    let path = dir.path().join("model.safetensors");
    let tensors = read_tensors(&path).into_iter().map(|(n, t)| (n.strip_prefix("transformer.").unwrap_or(&n).to_string(), t)).collect();
    write_tensors(&path, &tensors);
    let cx = &mut Cx::new(Device::cpu());
    let r = reference("gpt2", cx.device());
    let model = hf::load_pretrained::<Gpt2>(dir.path(), cx).unwrap().model;
    assert!(max_abs_diff(&logits(&model, cx, &r.ids).to_f32_vec().unwrap(), &r.logits) <= TOL);
}

/// The pipeline entry points, run in order over the layers one at a time,
/// compute the model's forward (GPT-2's first stage holds two embeddings).
#[test]
fn stage_by_stage_equals_the_whole_forward() {
    let cx = &mut Cx::new(Device::cpu());
    cx.set_training(false);
    let r = reference("gpt2", cx.device());
    let model = hf::load_pretrained::<Gpt2>(fixture("gpt2"), cx).unwrap().model;
    let whole = logits(&model, cx, &r.ids).to_f32_vec().unwrap();
    let (mut h, _) = model.forward_first(cx, Act::new(r.ids.clone())).unwrap();
    for layer in 0..model.split_layers() {
        h = model.forward_split(cx, layer..layer + 1, h).unwrap().0;
    }
    let staged = model.forward_last(cx, h).unwrap().0.into_tensor().to_f32_vec().unwrap();
    assert_eq!(staged, whole);
}

/// Loads fixture `name` on every rank of `spec` (4 ranks at most, one
/// thread each) and checks each rank's logits: its vocabulary slice over
/// the tensor-parallel group. `check` inspects each rank's model.
fn matches_reference_on_mesh<M, F>(name: &str, spec: &str, world: usize, check: F)
where
    M: HfModel + Module<In = Replicated, Out = SplitHidden>,
    F: Fn(&M, &Cx) + Sync,
{
    on_mesh::<M, F>(name, spec, world, false, check)
}

/// [`matches_reference_on_mesh`], with sequence parallelism when `sp` (on
/// the first 6 tokens, which the tensor-parallel degree divides: the model
/// is causal, so their logits are the reference's).
fn on_mesh<M, F>(name: &str, spec: &str, world: usize, sp: bool, check: F)
where
    M: HfModel + Module<In = Replicated, Out = SplitHidden>,
    F: Fn(&M, &Cx) + Sync,
{
    let mesh = Mesh::parse(spec, world, world).unwrap();
    let net = InProcess::new(world).unwrap();
    std::thread::scope(|s| {
        for rank in 0..world {
            let (mesh, net, check) = (&mesh, &net, &check);
            s.spawn(move || {
                let dev = Device::cpu();
                let cx = &mut Cx::new(dev.clone()).with_groups(mesh_groups(net, mesh, rank, &dev).unwrap()).with_sequence_parallel(sp);
                let r = reference(name, &dev);
                let model = hf::load_pretrained::<M>(fixture(name), cx).unwrap().model;
                check(&model, cx);
                let (batch, vocab) = (r.dims[0], r.dims[2]);
                let seq = if sp { 6 } else { r.dims[1] };
                let y = logits(&model, cx, &r.ids.narrow(1, 0, seq).unwrap().contiguous().unwrap());
                let (tp, tp_rank) = (cx.tp().size(), cx.tp().rank());
                let part = vocab / tp;
                assert_eq!(y.dims(), &[batch, seq, part], "{name} rank {rank}: a vocabulary slice");
                let rows = r.logits.chunks(vocab).enumerate().filter(|(i, _)| i % r.dims[1] < seq);
                let expect: Vec<f32> = rows.flat_map(|(_, row)| row[tp_rank * part..(tp_rank + 1) * part].to_vec()).collect();
                let err = max_abs_diff(&y.to_f32_vec().unwrap(), &expect);
                assert!(err <= TOL, "{name} on {spec}, rank {rank}: max abs error {err}");
            });
        }
    });
}

/// Every parameter that the tensor-parallel layout splits holds half its rows or columns.
fn holds_halves<M: Module>(model: &M, cx: &Cx) {
    let mut split = 0;
    for p in tessera::module::distinct_params(model).unwrap() {
        let (global, local) = (p.param.global_shape().dims().to_vec(), p.param.local_shape().dims().to_vec());
        match p.param.shard() {
            Shard::Split { dim, rank, degree } => {
                assert_eq!((rank, degree), (cx.tp().rank(), 2));
                assert_eq!(local[dim] * 2, global[dim], "`{}`", p.name());
                assert_eq!(p.param.value().unwrap().dims(), local.as_slice());
                split += 1;
            }
            Shard::Full => assert_eq!(local, global),
        }
    }
    assert!(split > 0, "some parameters are split");
}

#[test]
fn gpt2_on_two_tensor_parallel_ranks() {
    matches_reference_on_mesh::<Gpt2, _>("gpt2", "tp2", 2, holds_halves);
}

#[test]
fn llama_on_two_tensor_parallel_ranks() {
    matches_reference_on_mesh::<Llama, _>("llama", "tp2", 2, holds_halves);
}

#[test]
fn mixtral_on_two_tensor_parallel_ranks() {
    matches_reference_on_mesh::<Mixtral, _>("mixtral", "tp2", 2, holds_halves);
}

/// Under sequence parallelism each rank adds the position rows of its slice
/// of the sequence (GPT-2) and routes its own tokens (Mixtral).
#[test]
fn sequence_parallel_ranks_reproduce_the_logits() {
    on_mesh::<Gpt2, _>("gpt2", "tp2", 2, true, holds_halves);
    on_mesh::<Mixtral, _>("mixtral", "tp2", 2, true, holds_halves);
}

/// Each of two expert-parallel ranks loads only its two experts.
#[test]
fn mixtral_on_two_expert_parallel_ranks() {
    matches_reference_on_mesh::<Mixtral, _>("mixtral", "ep2", 2, |m, cx| {
        let r = cx.groups().ep.rank();
        assert_eq!(m.local_experts(), 2 * r..2 * r + 2);
        let experts: Vec<String> = tessera::module::distinct_params(m)
            .unwrap()
            .iter()
            .map(|p| p.name().to_string())
            .filter(|n| n.starts_with("layers.0.block_sparse_moe.experts."))
            .collect();
        assert_eq!(experts.len(), 6, "{experts:?}");
        assert!(experts.iter().all(|n| n.contains(&format!("experts.{}.", 2 * r)) || n.contains(&format!("experts.{}.", 2 * r + 1))), "{experts:?}");
    });
}

/// Mixtral (tied embeddings, so the shared weight lives on both ends) run
/// by the pipeline executor over two stages, one batch row per microbatch:
/// the last stage's outputs are the reference logits.
#[test]
fn mixtral_on_two_pipeline_stages() {
    let mesh = Mesh::parse("pp2", 2, 2).unwrap();
    let net = InProcess::new(2).unwrap();
    let schedule = ScheduleKind::OneFOneB.build(2, 2).unwrap();
    std::thread::scope(|s| {
        for stage in 0..2 {
            let (mesh, net, schedule) = (&mesh, &net, &schedule);
            s.spawn(move || {
                let dev = Device::cpu();
                let cx = &mut Cx::new(dev.clone()).with_groups(mesh_groups(net, mesh, stage, &dev).unwrap());
                let r = reference("mixtral", &dev);
                let model = hf::load_pretrained::<Mixtral>(fixture("mixtral"), cx).unwrap().model;
                let rows: Vec<Tensor> = (0..2).map(|b| r.ids.narrow(0, b, 1).unwrap().contiguous().unwrap()).collect();
                let row_len = r.dims[1] * r.dims[2];
                let mut seen = Vec::new();
                run_stage(&model, cx, schedule, stage, &rows, |mb, out| {
                    let err = max_abs_diff(&out.tensor().to_f32_vec()?, &r.logits[mb * row_len..(mb + 1) * row_len]);
                    assert!(err <= TOL, "microbatch {mb}: max abs error {err}");
                    seen.push(mb);
                    Ok((0.0, Act::new(out.tensor().zeros_like()?)))
                })
                .unwrap();
                sync_tied_grads(&model, cx).unwrap();
                assert_eq!(seen, if stage == 1 { vec![0, 1] } else { vec![] }, "the last stage computes every microbatch's logits");
            });
        }
    });
}
