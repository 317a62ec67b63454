//! A GPT-2 style decoder training step: token and position embedding,
//! pre-LayerNorm blocks (causal self-attention, GELU MLP, residuals), a final
//! LayerNorm, the LM head (tied to the token embedding by default),
//! cross-entropy, the full backward pass and one Adam/AdamW update per
//! parameter with persistent moment buffers.
//!
//! Program order is what PyTorch eager runs: the forward pass, the backward
//! pass in reverse layer order (with activation checkpointing, each block's
//! forward is recomputed just before its backward), optional gradient-norm
//! clipping, then `optimizer.step()` over the parameters in order.
//!
//! Shapes: `B` batch, `T` sequence, `C` width, `H` heads, `V` vocabulary.
//! Linear weights are stored `[in, out]` (GPT-2's Conv1D layout):
//! `y = x @ W + b`. The op types and their attributes are listed in
//! `docs/ops.md`.

use memplan_runtime::{Attention, Kernel, Matmul};

use super::DType;
use super::step::{self, StepConfig, Update};
use crate::error::Error;
use crate::graph::{Graph, OpKind, Role, TensorId};
use crate::vocab;

pub use super::step::Optimizer;

/// Configuration of the GPT-2 training step.
#[derive(Clone, Debug, PartialEq)]
pub struct Gpt2Config {
    pub name: String,
    pub layers: u64,
    pub width: u64,
    pub heads: u64,
    pub seq: u64,
    pub batch: u64,
    pub vocab: u64,
    pub dtype: DType,
    /// Recompute each block's forward during its backward (activation
    /// checkpointing): only block inputs are kept from the forward pass.
    pub checkpoint: bool,
    /// Tie the LM head to the token embedding (GPT-2 does).
    pub tied: bool,
    pub optimizer: Optimizer,
    /// Clip the gradients' global norm to this value before the updates.
    pub clip_grad_norm: Option<f64>,
    /// Model the temporary each single-tensor Adam step allocates (the
    /// denominator, one parameter's size), as PyTorch's default Adam does.
    pub adam_workspace: bool,
    /// Alignment of every tensor in bytes.
    pub align: u64,
    pub lr: f64,
    pub weight_decay: f64,
    /// Fused (flash-style) attention: one `fused_attention` op per block
    /// saves the output and the `[B, H, T]` log-sum-exp instead of the
    /// `[B, H, T, T]` probabilities, and `fused_attention_backward`
    /// recomputes the scores tile by tile.
    pub fused_attention: bool,
    /// Mixed precision: f32 parameters and optimizer state, compute and
    /// activations in `dtype` (bf16); see `models::step`.
    pub mixed_precision: bool,
}

impl Gpt2Config {
    /// GPT-2's published sizes (sequence 1024, vocabulary 50257, batch 1),
    /// and `gpt2-tiny` (2 layers, width 128, 4 heads, sequence 128, batch 2:
    /// the shape of the `gpt2_tiny` HLO fixture).
    pub fn preset(name: &str) -> Option<Gpt2Config> {
        let (layers, width, heads, seq, batch) = match name {
            "gpt2-tiny" => (2, 128, 4, 128, 2),
            "gpt2-small" => (12, 768, 12, 1024, 1),
            "gpt2-medium" => (24, 1024, 16, 1024, 1),
            "gpt2-large" => (36, 1280, 20, 1024, 1),
            "gpt2-xl" => (48, 1600, 25, 1024, 1),
            _ => return None,
        };
        Some(Gpt2Config {
            name: name.to_string(),
            layers,
            width,
            heads,
            seq,
            batch,
            vocab: 50257,
            dtype: DType::F32,
            checkpoint: false,
            tied: true,
            optimizer: Optimizer::AdamW,
            clip_grad_norm: None,
            adam_workspace: true,
            align: 256,
            lr: 1e-3,
            weight_decay: 0.01,
            fused_attention: false,
            mixed_precision: false,
        })
    }

    /// A small configuration for tests and CPU runs.
    pub fn small_config(
        layers: u64,
        width: u64,
        heads: u64,
        seq: u64,
        batch: u64,
        vocab: u64,
    ) -> Self {
        Gpt2Config {
            name: format!("gpt2-l{layers}-d{width}-h{heads}-t{seq}-b{batch}-v{vocab}"),
            layers,
            width,
            heads,
            seq,
            batch,
            vocab,
            ..Gpt2Config::preset("gpt2-tiny").expect("preset exists")
        }
    }

    /// Number of trainable parameters.
    pub fn parameters(&self) -> u64 {
        let c = self.width;
        let block = 2 * c
            + (c * 3 * c + 3 * c)
            + (c * c + c)
            + 2 * c
            + (c * 4 * c + 4 * c)
            + (4 * c * c + c);
        let head = if self.tied { 0 } else { self.vocab * c };
        self.vocab * c + self.seq * c + self.layers * block + 2 * c + head
    }
}

/// What one block's backward needs from its forward.
struct BlockActs {
    x: TensorId,
    y1: TensorId,
    mean1: TensorId,
    rstd1: TensorId,
    qkv: TensorId,
    /// The softmax probabilities, or with fused attention the log-sum-exp
    /// of each query row.
    probs: TensorId,
    att: TensorId,
    x2: TensorId,
    y2: TensorId,
    mean2: TensorId,
    rstd2: TensorId,
    h: TensorId,
    g: TensorId,
}

/// Parameter indices of one block.
struct BlockParams {
    ln1_g: usize,
    ln1_b: usize,
    qkv_w: usize,
    qkv_b: usize,
    proj_w: usize,
    proj_b: usize,
    ln2_g: usize,
    ln2_b: usize,
    fc_w: usize,
    fc_b: usize,
    fc2_w: usize,
    fc2_b: usize,
}

impl StepConfig for Gpt2Config {
    fn dtype(&self) -> DType {
        self.dtype
    }
    fn align(&self) -> u64 {
        self.align
    }
    fn mixed_precision(&self) -> bool {
        self.mixed_precision
    }
}

type Net = step::Net<Gpt2Config>;

/// Builds the GPT-2 training-step graph for `cfg`.
pub fn build(cfg: &Gpt2Config) -> Result<Graph, Error> {
    if cfg.heads == 0 || cfg.width % cfg.heads != 0 {
        return Err(Error::InvalidArgument(format!(
            "gpt2: width {} is not a multiple of heads {}",
            cfg.width, cfg.heads
        )));
    }
    if [cfg.layers, cfg.width, cfg.seq, cfg.batch, cfg.vocab].contains(&0) {
        return Err(Error::InvalidArgument(
            "gpt2: layers, width, seq, batch and vocab must be positive".into(),
        ));
    }
    let options = [
        (cfg.checkpoint, "ckpt"),
        (cfg.fused_attention, "fused"),
        (cfg.mixed_precision, "mixed"),
    ];
    let name = step::step_name(&cfg.name, cfg.batch, &options);
    let mut net = Net::new(name, cfg.clone());
    let (bsz, t, c, v) = (cfg.batch, cfg.seq, cfg.width, cfg.vocab);

    // Parameters, in the order `model.parameters()` lists them.
    let wte = net.param("wte", &[v, c], "normal:0.02");
    let wpe = net.param("wpe", &[t, c], "normal:0.01");
    let blocks: Vec<BlockParams> = (0..cfg.layers).map(|l| block_params(&mut net, l)).collect();
    let lnf_g = net.param("ln_f.weight", &[c], "ones");
    let lnf_b = net.param("ln_f.bias", &[c], "zeros");
    let head = if cfg.tied {
        wte
    } else {
        net.param("lm_head.weight", &[v, c], "normal:0.02")
    };

    let tokens = net.input("tokens", &[bsz, t], "i32", 4);
    let targets = net.input("targets", &[bsz, t], "i32", 4);

    // Forward.
    let x0 = net.tensor("embed.out", &[bsz, t, c], Role::Activation);
    let (w_te, w_pe) = (net.w(wte), net.w(wpe));
    net.op(
        "embed",
        OpKind::Forward,
        Kernel::Embedding {
            batch: bsz,
            seq: t,
            width: c,
            vocab: v,
            positions: true,
        },
        &[tokens, w_te, w_pe],
        &[x0],
    );
    let mut x = x0;
    let mut saved = Vec::new();
    for (l, bp) in blocks.iter().enumerate() {
        let (acts, out) = block_forward(&mut net, l, bp, x, false);
        saved.push(acts);
        x = out.expect("a full forward has an output");
    }
    let x_last = x;
    let (yf, meanf, rstdf) = layernorm(&mut net, "ln_f", x_last, (lnf_g, lnf_b));
    let (dyf, dhead) = net.head_and_loss("lm_head", yf, head, cfg.tied, targets);
    let mut dx = layernorm_backward(&mut net, "ln_f", dyf, x_last, meanf, rstdf, lnf_g, lnf_b);
    for l in (0..cfg.layers as usize).rev() {
        let bp = &blocks[l];
        let acts = if cfg.checkpoint {
            block_forward(&mut net, l, bp, saved[l].x, true).0
        } else {
            std::mem::replace(&mut saved[l], dummy_acts())
        };
        dx = block_backward(&mut net, l, bp, &acts, dx);
    }
    let dwpe = net.grad(wpe);
    let dwte = net.grad(wte);
    let dhead = cfg.tied.then_some(dhead);
    let dims = [bsz, t, c, v];
    net.embedding_backward("embed.backward", dims, dx, tokens, dhead, &[dwte, dwpe]);

    net.optimizer_step(&Update {
        optimizer: cfg.optimizer,
        lr: cfg.lr,
        weight_decay: cfg.weight_decay,
        clip_grad_norm: cfg.clip_grad_norm,
        adam_workspace: cfg.adam_workspace,
        layers: cfg.layers,
    });
    Ok(net.b.build()?)
}

/// Block `l`'s parameters, in the order `model.parameters()` lists them.
fn block_params(net: &mut Net, l: u64) -> BlockParams {
    let c = net.cfg.width;
    let p = |s: &str| format!("h{l}.{s}");
    let resid_std = "normal_resid:0.02";
    BlockParams {
        ln1_g: net.param(&p("ln_1.weight"), &[c], "ones"),
        ln1_b: net.param(&p("ln_1.bias"), &[c], "zeros"),
        qkv_w: net.param(&p("attn.c_attn.weight"), &[c, 3 * c], "normal:0.02"),
        qkv_b: net.param(&p("attn.c_attn.bias"), &[3 * c], "zeros"),
        proj_w: net.param(&p("attn.c_proj.weight"), &[c, c], resid_std),
        proj_b: net.param(&p("attn.c_proj.bias"), &[c], "zeros"),
        ln2_g: net.param(&p("ln_2.weight"), &[c], "ones"),
        ln2_b: net.param(&p("ln_2.bias"), &[c], "zeros"),
        fc_w: net.param(&p("mlp.c_fc.weight"), &[c, 4 * c], "normal:0.02"),
        fc_b: net.param(&p("mlp.c_fc.bias"), &[4 * c], "zeros"),
        fc2_w: net.param(&p("mlp.c_proj.weight"), &[4 * c, c], resid_std),
        fc2_b: net.param(&p("mlp.c_proj.bias"), &[c], "zeros"),
    }
}

/// The attention of every block: as many key/value heads as heads, scaled
/// by `1/√D`.
fn attention(cfg: &Gpt2Config) -> Attention {
    let d = cfg.width / cfg.heads;
    Attention::mha(cfg.batch, cfg.heads, cfg.seq, d, 1.0 / (d as f64).sqrt())
}

fn add(elements: u64) -> Kernel {
    Kernel::Add { elements }
}

fn gelu(elements: u64) -> Kernel {
    Kernel::Gelu { elements }
}

fn dummy_acts() -> BlockActs {
    let z = TensorId(u32::MAX);
    BlockActs {
        x: z,
        y1: z,
        mean1: z,
        rstd1: z,
        qkv: z,
        probs: z,
        att: z,
        x2: z,
        y2: z,
        mean2: z,
        rstd2: z,
        h: z,
        g: z,
    }
}

/// A LayerNorm over the rows of `x` with parameters `g`, `b`: returns its
/// output, mean and reciprocal deviation (`{name}.out`, `.mean`, `.rstd`).
fn layernorm(
    net: &mut Net,
    name: &str,
    x: TensorId,
    (g, b): (usize, usize),
) -> (TensorId, TensorId, TensorId) {
    let shape = net.shape(x);
    let cols = *shape.last().expect("an activation has a shape");
    let rows = shape.iter().product::<u64>() / cols;
    let y = net.tensor(&format!("{name}.out"), &shape, Role::Activation);
    let mean = net.stats(&format!("{name}.mean"), rows);
    let rstd = net.stats(&format!("{name}.rstd"), rows);
    let (g, b) = (net.w(g), net.w(b));
    net.op(
        name,
        OpKind::Forward,
        Kernel::LayerNorm {
            rows,
            cols,
            eps: 1e-5,
        },
        &[x, g, b],
        &[y, mean, rstd],
    );
    (y, mean, rstd)
}

/// `x · w + b` by op `name` into a new activation `out` with `n` columns.
fn linear(
    net: &mut Net,
    name: &str,
    out: &str,
    x: TensorId,
    (w, b): (usize, usize),
    n: u64,
) -> TensorId {
    let mut shape = net.shape(x);
    let k = shape.pop().expect("an activation has a shape");
    let m = shape.iter().product::<u64>();
    shape.push(n);
    let y = net.tensor(out, &shape, Role::Activation);
    let (w, b) = (net.w(w), net.w(b));
    net.op(
        name,
        OpKind::Forward,
        Kernel::Linear(Matmul { m, k, n }),
        &[x, w, b],
        &[y],
    );
    y
}

/// An elementwise op `name` (`kernel` of its element count) over
/// `inputs` into a new activation shaped as the last input, whose bytes it
/// may take.
fn pointwise(
    net: &mut Net,
    name: &str,
    kernel: fn(u64) -> Kernel,
    inputs: &[TensorId],
) -> TensorId {
    let last = *inputs.last().expect("an op has inputs");
    let shape = net.shape(last);
    let y = net.tensor(name, &shape, Role::Activation);
    let elements = shape.iter().product::<u64>();
    let op = net.op(name, OpKind::Forward, kernel(elements), inputs, &[y]);
    net.reuse(op, y, last);
    y
}

/// One block's forward. With `recompute`, ops and tensors are prefixed
/// `recompute.`, and the ops that only feed the block's output (MLP
/// projection and the second residual) are skipped: the backward does not
/// need them.
fn block_forward(
    net: &mut Net,
    l: usize,
    bp: &BlockParams,
    x: TensorId,
    recompute: bool,
) -> (BlockActs, Option<TensorId>) {
    let cfg = net.cfg.clone();
    let (bsz, t, c, h) = (cfg.batch, cfg.seq, cfg.width, cfg.heads);
    let pre = if recompute {
        format!("recompute.h{l}")
    } else {
        format!("h{l}")
    };
    let n = |s: &str| format!("{pre}.{s}");
    net.recompute = recompute;

    let (y1, mean1, rstd1) = layernorm(net, &n("ln_1"), x, (bp.ln1_g, bp.ln1_b));
    let qkv_w = (bp.qkv_w, bp.qkv_b);
    let qkv = linear(net, &n("attn.c_attn"), &n("attn.qkv"), y1, qkv_w, 3 * c);
    let attn = attention(&cfg);
    let att = net.tensor(&n("attn.out"), &[bsz, t, c], Role::Activation);
    let probs = if cfg.fused_attention {
        let lse = net.stats(&n("attn.lse"), bsz * h * t);
        net.op(
            &n("attn.fused"),
            OpKind::Forward,
            Kernel::FusedAttention(attn),
            &[qkv],
            &[att, lse],
        );
        lse
    } else {
        explicit_attention(net, &n, qkv, att, attn)
    };
    let proj_w = (bp.proj_w, bp.proj_b);
    let a = linear(net, &n("attn.c_proj"), &n("attn.proj"), att, proj_w, c);
    let x2 = pointwise(net, &n("resid_1"), add, &[x, a]);
    let (y2, mean2, rstd2) = layernorm(net, &n("ln_2"), x2, (bp.ln2_g, bp.ln2_b));
    let fc_w = (bp.fc_w, bp.fc_b);
    let hh = linear(net, &n("mlp.c_fc"), &n("mlp.fc"), y2, fc_w, 4 * c);
    let g = pointwise(net, &n("mlp.gelu"), gelu, &[hh]);
    let acts = BlockActs {
        x,
        y1,
        mean1,
        rstd1,
        qkv,
        probs,
        att,
        x2,
        y2,
        mean2,
        rstd2,
        h: hh,
        g,
    };
    if recompute {
        net.recompute = false;
        return (acts, None);
    }
    let fc2_w = (bp.fc2_w, bp.fc2_b);
    let m = linear(net, &n("mlp.c_proj"), &n("mlp.proj"), g, fc2_w, c);
    let x3 = pointwise(net, &n("resid_2"), add, &[x2, m]);
    (acts, Some(x3))
}

/// LayerNorm backward: returns the input gradient; parameter gradients go to
/// the parameters' `.grad` tensors.
#[allow(clippy::too_many_arguments)]
fn layernorm_backward(
    net: &mut Net,
    name: &str,
    dy: TensorId,
    x: TensorId,
    mean: TensorId,
    rstd: TensorId,
    gp: usize,
    bp: usize,
) -> TensorId {
    let shape = net.shape(x);
    let rows: u64 = shape[..shape.len() - 1].iter().product();
    let cols = shape[shape.len() - 1];
    let dx = net.tensor(&format!("{name}.in.grad"), &shape, Role::Activation);
    let dg = net.grad(gp);
    let db = net.grad(bp);
    let gamma = net.w(gp);
    let op = net.op(
        &format!("{name}.backward"),
        OpKind::Backward,
        Kernel::LayerNormBackward { rows, cols },
        &[dy, x, mean, rstd, gamma],
        &[dx, dg, db],
    );
    net.reuse(op, dx, dy);
    dx
}

/// `y = x @ W + b` backward: input gradient, then weight and bias gradients.
fn linear_backward(
    net: &mut Net,
    name: &str,
    dy: TensorId,
    x: TensorId,
    wp: usize,
    bp: usize,
) -> TensorId {
    let xs = net.shape(x);
    let ws = net.param_shape(wp);
    let rows: u64 = xs[..xs.len() - 1].iter().product();
    let (k, n) = (ws[0], ws[1]);
    let dx = net.tensor(&format!("{name}.in.grad"), &xs, Role::Activation);
    let w = net.w(wp);
    net.op(
        &format!("{name}.backward_data"),
        OpKind::Backward,
        Kernel::LinearBackwardData(Matmul { m: rows, k, n }),
        &[dy, w],
        &[dx],
    );
    let dw = net.grad(wp);
    let db = net.grad(bp);
    net.op(
        &format!("{name}.backward_weight"),
        OpKind::Backward,
        Kernel::LinearBackwardWeight(Matmul { m: rows, k, n }),
        &[dy, x],
        &[dw, db],
    );
    dx
}

/// Explicit causal attention as PyTorch eager runs it: the `[B, H, T, T]`
/// scores, the softmax in place into the probabilities (saved for the
/// backward), then the values into `att`. Returns the probabilities.
fn explicit_attention(
    net: &mut Net,
    n: &dyn Fn(&str) -> String,
    qkv: TensorId,
    att: TensorId,
    attn: Attention,
) -> TensorId {
    let cfg = net.cfg.clone();
    let (bsz, t, h) = (cfg.batch, cfg.seq, cfg.heads);
    let kind = OpKind::Forward;
    let scores = net.tensor(&n("attn.scores"), &[bsz, h, t, t], Role::Temporary);
    net.op(
        &n("attn.scores"),
        kind,
        Kernel::AttentionScores(attn),
        &[qkv],
        &[scores],
    );
    let probs = net.tensor(&n("attn.probs"), &[bsz, h, t, t], Role::Activation);
    let op = net.op(
        &n("attn.softmax"),
        kind,
        Kernel::CausalSoftmax(attn),
        &[scores],
        &[probs],
    );
    net.reuse(op, probs, scores);
    net.op(
        &n("attn.values"),
        kind,
        Kernel::AttentionValues(attn),
        &[probs, qkv],
        &[att],
    );
    probs
}

/// The explicit attention's backward: `dprobs = dAtt Vᵀ` and `dV`, the
/// softmax backward, then `dQ`, `dK` added into `dqkv`.
fn explicit_attention_backward(
    net: &mut Net,
    n: &dyn Fn(&str) -> String,
    datt: TensorId,
    a: &BlockActs,
    dqkv: TensorId,
    attn: Attention,
) {
    let cfg = net.cfg.clone();
    let (bsz, t, h) = (cfg.batch, cfg.seq, cfg.heads);
    let kind = OpKind::Backward;
    let dprobs = net.tensor(&n("attn.probs.grad"), &[bsz, h, t, t], Role::Temporary);
    net.op(
        &n("attn.values.backward"),
        kind,
        Kernel::AttentionValuesBackward(attn),
        &[datt, a.probs, a.qkv],
        &[dprobs, dqkv],
    );
    let dscores = net.tensor(&n("attn.scores.grad"), &[bsz, h, t, t], Role::Temporary);
    let op = net.op(
        &n("attn.softmax.backward"),
        kind,
        Kernel::CausalSoftmaxBackward(attn),
        &[dprobs, a.probs],
        &[dscores],
    );
    net.reuse(op, dscores, dprobs);
    let k = Kernel::AttentionScoresBackward(attn);
    let spec = vocab::spec(n("attn.scores.backward"), kind, &k)
        .inputs([dscores, a.qkv])
        .updates([dqkv]);
    net.add(spec);
}

/// One block's backward from the gradient of its output; returns the
/// gradient of its input.
fn block_backward(
    net: &mut Net,
    l: usize,
    bp: &BlockParams,
    a: &BlockActs,
    dy: TensorId,
) -> TensorId {
    let cfg = net.cfg.clone();
    let (bsz, t, c) = (cfg.batch, cfg.seq, cfg.width);
    let rows = bsz * t;
    let n = |s: &str| format!("h{l}.{s}");
    let kind = OpKind::Backward;

    // x3 = x2 + m; m = gelu(h) @ W2 + b2
    let dg = linear_backward(net, &n("mlp.c_proj"), dy, a.g, bp.fc2_w, bp.fc2_b);
    let dh = net.tensor(&n("mlp.fc.grad"), &[bsz, t, 4 * c], Role::Activation);
    let op = net.op(
        &n("mlp.gelu.backward"),
        kind,
        Kernel::GeluBackward {
            elements: rows * 4 * c,
        },
        &[dg, a.h],
        &[dh],
    );
    net.reuse(op, dh, dg);
    let dy2 = linear_backward(net, &n("mlp.c_fc"), dh, a.y2, bp.fc_w, bp.fc_b);
    let dx2_ln = layernorm_backward(
        net,
        &n("ln_2"),
        dy2,
        a.x2,
        a.mean2,
        a.rstd2,
        bp.ln2_g,
        bp.ln2_b,
    );
    let dx2 = net.tensor(&n("resid_1.grad"), &[bsz, t, c], Role::Activation);
    let op = net.op(
        &n("resid_2.backward"),
        kind,
        add(rows * c),
        &[dy, dx2_ln],
        &[dx2],
    );
    net.reuse(op, dx2, dx2_ln);
    net.reuse(op, dx2, dy);

    // x2 = x + att @ Wo + bo
    let datt = linear_backward(net, &n("attn.c_proj"), dx2, a.att, bp.proj_w, bp.proj_b);
    let attn = attention(&cfg);
    let dqkv = net.tensor(&n("attn.qkv.grad"), &[bsz, t, 3 * c], Role::Activation);
    if cfg.fused_attention {
        net.op(
            &n("attn.fused.backward"),
            kind,
            Kernel::FusedAttentionBackward(attn),
            &[datt, a.qkv, a.att, a.probs],
            &[dqkv],
        );
    } else {
        explicit_attention_backward(net, &n, datt, a, dqkv, attn);
    }
    let dy1 = linear_backward(net, &n("attn.c_attn"), dqkv, a.y1, bp.qkv_w, bp.qkv_b);
    let dx_ln = layernorm_backward(
        net,
        &n("ln_1"),
        dy1,
        a.x,
        a.mean1,
        a.rstd1,
        bp.ln1_g,
        bp.ln1_b,
    );
    let dx = net.tensor(&n("in.grad"), &[bsz, t, c], Role::Activation);
    let op = net.op(
        &n("resid_1.backward"),
        kind,
        add(rows * c),
        &[dx2, dx_ln],
        &[dx],
    );
    net.reuse(op, dx, dx_ln);
    net.reuse(op, dx, dx2);
    dx
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameter_count_matches_gpt2_small() {
        let c = Gpt2Config::preset("gpt2-small").unwrap();
        assert_eq!(c.parameters(), 124_439_808);
        let g = build(&c).unwrap();
        let params: u64 = g
            .tensors()
            .iter()
            .filter(|t| t.role == Role::Parameter)
            .map(|t| t.size / 4)
            .sum();
        assert_eq!(params, 124_439_808);
    }

    #[test]
    fn builds_every_preset_and_checkpointing() {
        for name in ["gpt2-tiny", "gpt2-small", "gpt2-medium", "gpt2-xl"] {
            let mut c = Gpt2Config::preset(name).unwrap();
            build(&c).unwrap();
            c.checkpoint = true;
            c.clip_grad_norm = Some(1.0);
            let g = build(&c).unwrap();
            assert!(g.ops().iter().any(|o| o.name.starts_with("recompute.")));
        }
    }
}
