//! The GPU backend's lowering (kernel launches, cuBLAS calls, memsets,
//! copies, collectives over one device allocation) run on the host
//! emulator, against the CPU executor: same losses and final state for
//! planned GPT-2 and MLP steps, single-device and sharded.

use std::time::Duration;

use memplan::exec;
use memplan::graph::Graph;
use memplan::models::fsdp;
use memplan::models::gpt2::{self, Gpt2Config};
use memplan::models::llama::{self, LlamaConfig};
use memplan::models::mlp::{self, MlpConfig};
use memplan::{Options, checker};
use memplan_runtime::device::emulate::Emulator;
use memplan_runtime::device::{CollectiveOp, DevOp};
use memplan_runtime::runner::{Data, RunConfig, loss_tensors, run_cpu, synthetic_batch};
use memplan_runtime::{Communicator, Program, run_ranks};

fn program(g: &Graph) -> Program {
    let opts = Options {
        time_limit: Duration::from_secs(2),
        ..Options::default()
    };
    let plan = memplan::plan(g, &opts).unwrap();
    checker::check(g, &plan).unwrap();
    exec::program(g, &plan).unwrap()
}

/// Each rank's persistent f32 tensors by name.
type State = Vec<Vec<(String, Vec<f32>)>>;

/// Losses per step and each rank's persistent f32 tensors, on the emulator.
fn emulate(p: &Program, steps: usize) -> (Vec<f32>, State) {
    let per_rank = run_ranks(p.world_size as usize, |rank, comm| {
        let mut em = Emulator::new(p.clone())?;
        em.initialize(0, rank);
        let batch = synthetic_batch(p, 1, rank)?;
        let mut losses = Vec::new();
        for _ in 0..steps {
            for (t, d) in &batch {
                match d {
                    Data::F32(v) => em.write_f32(*t, v),
                    Data::I32(v) => em.write_i32(*t, v),
                }
            }
            em.step(&comm as &dyn Communicator<[f32]>)?;
            losses.push(
                loss_tensors(p)
                    .iter()
                    .map(|&t| em.read_f32(t)[0])
                    .sum::<f32>(),
            );
        }
        let state = p
            .persistent_tensors()
            .filter(|&t| p.tensor(t).dtype == memplan_runtime::DType::F32)
            .map(|t| (p.tensor(t).name.clone(), em.read_f32(t)))
            .collect::<Vec<_>>();
        Ok((losses, state))
    })
    .unwrap();
    let w = per_rank.len() as f32;
    let losses = (0..steps)
        .map(|s| per_rank.iter().map(|r| r.0[s]).sum::<f32>() / w)
        .collect();
    (losses, per_rank.into_iter().map(|r| r.1).collect())
}

fn matches_cpu(g: &Graph, steps: usize) -> Program {
    let p = program(g);
    let cpu = run_cpu(
        &p,
        &RunConfig {
            steps,
            keep_state: true,
            ..RunConfig::default()
        },
    )
    .unwrap();
    let (losses, state) = emulate(&p, steps);
    for (s, (a, b)) in losses.iter().zip(&cpu.steps).enumerate() {
        assert!(
            (a - b.loss).abs() <= 1e-4 * (1.0 + b.loss.abs()),
            "step {s}: loss {a} vs {}",
            b.loss
        );
    }
    assert_eq!(state.len(), cpu.state.len());
    for (ra, rb) in state.iter().zip(&cpu.state) {
        for ((na, va), (nb, vb)) in ra.iter().zip(rb) {
            assert_eq!(na, nb);
            for (i, (x, y)) in va.iter().zip(vb).enumerate() {
                assert!(
                    (x - y).abs() <= 1e-3 * y.abs() + 1e-5,
                    "{na}[{i}]: {x} vs {y}"
                );
            }
        }
    }
    p
}

#[test]
fn gpt2_lowered_for_the_gpu_matches_the_cpu_executor() {
    let mut cfg = Gpt2Config::small_config(2, 32, 2, 16, 2, 64);
    matches_cpu(&gpt2::build(&cfg).unwrap(), 2);
    cfg.checkpoint = true;
    cfg.clip_grad_norm = Some(0.5);
    matches_cpu(&gpt2::build(&cfg).unwrap(), 2);
}

#[test]
fn sharded_gpt2_lowered_for_the_gpu_matches_the_cpu_executor() {
    let mut cfg = Gpt2Config::small_config(1, 32, 2, 8, 1, 64);
    cfg.clip_grad_norm = Some(0.1);
    let p = matches_cpu(&fsdp::shard(&gpt2::build(&cfg).unwrap(), 2).unwrap(), 2);
    // Collectives are device operations of their own.
    let em = Emulator::new(p).unwrap();
    let n = |f: fn(&CollectiveOp) -> bool| {
        em.ops()
            .iter()
            .flatten()
            .filter(|o| matches!(o, DevOp::Collective(c) if f(c)))
            .count()
    };
    assert!(n(|c| matches!(c, CollectiveOp::AllGather { .. })) > 0);
    assert!(n(|c| matches!(c, CollectiveOp::ReduceScatter { .. })) > 0);
    assert_eq!(n(|c| matches!(c, CollectiveOp::AllReduce { .. })), 1);
}

#[test]
fn mlp_lowered_for_the_gpu_matches_the_cpu_executor() {
    let cfg = MlpConfig {
        input: 20,
        hidden: 32,
        layers: 2,
        classes: 5,
        batch: 8,
        ..MlpConfig::default()
    };
    matches_cpu(&mlp::build(&cfg).unwrap(), 2);
}

#[test]
fn fused_attention_lowered_for_the_gpu_matches_the_cpu_executor() {
    // Sequence 40: the kernels' 16-row blocks and 32-row tiles end part-way.
    let mut cfg = Gpt2Config::small_config(1, 32, 2, 40, 2, 64);
    cfg.fused_attention = true;
    let p = matches_cpu(&gpt2::build(&cfg).unwrap(), 2);
    let em = Emulator::new(p).unwrap();
    let flash = em
        .ops()
        .iter()
        .flatten()
        .filter(|o| matches!(o, DevOp::Launch(l) if l.kernel.name().starts_with("flash_attn")))
        .count();
    assert_eq!(flash, 3, "one forward and two backward launches");
    cfg.checkpoint = true;
    matches_cpu(&fsdp::shard(&gpt2::build(&cfg).unwrap(), 2).unwrap(), 2);
}

/// The Llama step's kernels (embedding without positions, RMSNorm, RoPE in
/// place, grouped-query flash attention, SwiGLU) lowered for the GPU.
#[test]
fn llama_lowered_for_the_gpu_matches_the_cpu_executor() {
    let cfg = LlamaConfig {
        layers: 1,
        width: 32,
        heads: 4,
        kv_heads: 2,
        ffn: 40,
        vocab: 64,
        seq: 40,
        batch: 2,
        ..LlamaConfig::preset("llama-tiny").unwrap()
    };
    let p = matches_cpu(&llama::build(&cfg).unwrap(), 2);
    let em = Emulator::new(p).unwrap();
    let launched: Vec<&str> = em
        .ops()
        .iter()
        .flatten()
        .filter_map(|o| match o {
            DevOp::Launch(l) => Some(l.kernel.name()),
            _ => None,
        })
        .collect();
    for k in [
        "rmsnorm_fwd",
        "rope_fwd",
        "swiglu_bwd",
        "flash_attn_bwd_dkv",
    ] {
        assert!(launched.contains(&k), "{k} not launched");
    }
    let mut sharded = cfg.clone();
    sharded.checkpoint = true;
    sharded.tied = true;
    matches_cpu(
        &fsdp::shard(&llama::build(&sharded).unwrap(), 2).unwrap(),
        2,
    );
}
