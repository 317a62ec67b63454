//! A Llama-style decoder training step: token embedding (no position
//! embedding), pre-norm blocks (RMSNorm, grouped-query causal attention
//! with rotary position embedding, RMSNorm, SwiGLU MLP, residuals), a final
//! RMSNorm, an untied LM head (tied where the published model ties it),
//! cross-entropy, the full backward pass and one AdamW update per parameter.
//!
//! The graph is the step as people run it with fused kernels: attention is
//! always the fused (flash-style) op, as PyTorch's `scaled_dot_product_attention`
//! (Hugging Face's default `sdpa`) and torchtitan run it; the query, key and
//! value projections are one `[C, (H + 2·Hkv)·D]` weight (`wqkv`, as in
//! gpt-fast) and the MLP's gate and up projections one `[C, 2F]` weight
//! (`w13`), so each is one matrix product; SwiGLU is one op that saves its
//! input (gate and up) and output, as a fused SwiGLU kernel does. RoPE runs
//! in place on the projected `qkv` (the query and key parts), and its
//! backward in place on the attention's `dqkv`. Linear layers have no bias;
//! weights are stored `[in, out]` (`y = x @ W`).
//!
//! Program order is PyTorch eager's: forward, backward in reverse layer
//! order (with activation checkpointing each block's forward is recomputed
//! just before its backward), optional clipping, then the updates in
//! parameter order.
//!
//! Shapes: `B` batch, `T` sequence, `C` width, `H` query heads, `Hkv`
//! key/value heads, `D = C / H`, `F` MLP hidden size, `V` vocabulary.

use memplan_runtime::{Attention, Kernel, Matmul, Rope};

use super::DType;
use super::step::{self, Optimizer, StepConfig, Update};
use crate::error::Error;
use crate::graph::{Graph, OpKind, Role, TensorId};

/// Configuration of the Llama training step.
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {
    pub name: String,
    pub layers: u64,
    pub width: u64,
    pub heads: u64,
    /// Key/value heads (grouped-query attention when below `heads`).
    pub kv_heads: u64,
    /// Hidden size `F` of the SwiGLU MLP.
    pub ffn: u64,
    pub vocab: u64,
    pub seq: u64,
    pub batch: u64,
    pub dtype: DType,
    /// Tie the LM head to the token embedding.
    pub tied: bool,
    /// Base of the rotary frequencies.
    pub rope_theta: f64,
    pub norm_eps: f64,
    /// Recompute each block's forward during its backward.
    pub checkpoint: bool,
    pub clip_grad_norm: Option<f64>,
    pub adam_workspace: bool,
    pub align: u64,
    pub lr: f64,
    pub weight_decay: f64,
    /// Mixed precision: f32 parameters and optimizer state, compute and
    /// activations in `dtype` (bf16); see `models::step`.
    pub mixed_precision: bool,
}

impl LlamaConfig {
    /// Published sizes of Llama 2 7B, Llama 3 8B and Llama 3.2 1B (sequence
    /// 4096, batch 1), and `llama-tiny` for tests (2 layers, width 128,
    /// 4 query and 2 key/value heads, MLP 256, vocabulary 512, sequence 64,
    /// batch 2).
    pub fn preset(name: &str) -> Option<LlamaConfig> {
        // (layers, width, heads, kv_heads, ffn, vocab, seq, batch, tied, theta)
        let (layers, width, heads, kv_heads, ffn, vocab, seq, batch, tied, theta) = match name {
            "llama-tiny" => (2, 128, 4, 2, 256, 512, 64, 2, false, 10_000.0),
            "llama3-1b" => (16, 2048, 32, 8, 8192, 128_256, 4096, 1, true, 500_000.0),
            "llama3-8b" => (32, 4096, 32, 8, 14_336, 128_256, 4096, 1, false, 500_000.0),
            "llama2-7b" => (32, 4096, 32, 32, 11_008, 32_000, 4096, 1, false, 10_000.0),
            _ => return None,
        };
        Some(LlamaConfig {
            name: name.to_string(),
            layers,
            width,
            heads,
            kv_heads,
            ffn,
            vocab,
            seq,
            batch,
            dtype: DType::F32,
            tied,
            rope_theta: theta,
            norm_eps: 1e-5,
            checkpoint: false,
            clip_grad_norm: None,
            adam_workspace: true,
            align: 256,
            lr: 1e-3,
            weight_decay: 0.01,
            mixed_precision: false,
        })
    }

    /// Per-head dimension `D`.
    pub fn head_dim(&self) -> u64 {
        self.width / self.heads
    }

    /// Columns of the packed query/key/value projection.
    pub fn qkv_width(&self) -> u64 {
        (self.heads + 2 * self.kv_heads) * self.head_dim()
    }

    /// Number of trainable parameters.
    pub fn parameters(&self) -> u64 {
        let c = self.width;
        let block = 2 * c + c * self.qkv_width() + c * c + 3 * c * self.ffn;
        let head = if self.tied { 0 } else { self.vocab * c };
        self.vocab * c + self.layers * block + c + head
    }
}

impl StepConfig for LlamaConfig {
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

type Net = step::Net<LlamaConfig>;

/// Parameter indices of one block.
struct BlockParams {
    attn_norm: usize,
    wqkv: usize,
    wo: usize,
    ffn_norm: usize,
    w13: usize,
    w2: usize,
}

/// What one block's backward needs from its forward.
struct BlockActs {
    x: TensorId,
    y1: TensorId,
    rstd1: TensorId,
    /// `qkv` after RoPE.
    qkv: TensorId,
    att: TensorId,
    lse: TensorId,
    x2: TensorId,
    y2: TensorId,
    rstd2: TensorId,
    gu: TensorId,
    h: TensorId,
}

fn check(cfg: &LlamaConfig) -> Result<(), Error> {
    let bad = |why: String| Err(Error::InvalidArgument(format!("llama: {why}")));
    if [
        cfg.layers,
        cfg.width,
        cfg.heads,
        cfg.kv_heads,
        cfg.ffn,
        cfg.vocab,
        cfg.seq,
        cfg.batch,
    ]
    .contains(&0)
    {
        return bad(
            "layers, width, heads, kv_heads, ffn, vocab, seq and batch must be positive".into(),
        );
    }
    if cfg.width % cfg.heads != 0 {
        return bad(format!(
            "width {} is not a multiple of heads {}",
            cfg.width, cfg.heads
        ));
    }
    if cfg.heads % cfg.kv_heads != 0 {
        return bad(format!(
            "heads {} is not a multiple of kv_heads {}",
            cfg.heads, cfg.kv_heads
        ));
    }
    if cfg.head_dim() % 2 != 0 {
        return bad(format!(
            "head dimension {} must be even (RoPE turns pairs)",
            cfg.head_dim()
        ));
    }
    Ok(())
}

/// Builds the Llama training-step graph for `cfg`.
pub fn build(cfg: &LlamaConfig) -> Result<Graph, Error> {
    check(cfg)?;
    let options = [(cfg.checkpoint, "ckpt"), (cfg.mixed_precision, "mixed")];
    let name = step::step_name(&cfg.name, cfg.batch, &options);
    let mut net = Net::new(name, cfg.clone());
    let (bsz, t, c, v) = (cfg.batch, cfg.seq, cfg.width, cfg.vocab);
    let rows = bsz * t;

    // Parameters, in the order `model.parameters()` lists them.
    let wte = net.param("tok_embeddings.weight", &[v, c], "normal:0.02");
    let blocks: Vec<BlockParams> = (0..cfg.layers)
        .map(|l| {
            let p = |s: &str| format!("layers.{l}.{s}");
            let resid_std = "normal_resid:0.02";
            BlockParams {
                attn_norm: net.param(&p("attention_norm.weight"), &[c], "ones"),
                wqkv: net.param(&p("attention.wqkv"), &[c, cfg.qkv_width()], "normal:0.02"),
                wo: net.param(&p("attention.wo"), &[c, c], resid_std),
                ffn_norm: net.param(&p("ffn_norm.weight"), &[c], "ones"),
                w13: net.param(&p("feed_forward.w13"), &[c, 2 * cfg.ffn], "normal:0.02"),
                w2: net.param(&p("feed_forward.w2"), &[cfg.ffn, c], resid_std),
            }
        })
        .collect();
    let norm = net.param("norm.weight", &[c], "ones");
    let head = if cfg.tied {
        wte
    } else {
        net.param("output.weight", &[v, c], "normal:0.02")
    };
    let tokens = net.input("tokens", &[bsz, t], "i32", 4);
    let targets = net.input("targets", &[bsz, t], "i32", 4);

    // Forward.
    let x0 = net.tensor("tok_embeddings.out", &[bsz, t, c], Role::Activation);
    let w_te = net.w(wte);
    net.op(
        "tok_embeddings",
        OpKind::Forward,
        Kernel::Embedding {
            batch: bsz,
            seq: t,
            width: c,
            vocab: v,
            positions: false,
        },
        &[tokens, w_te],
        &[x0],
    );
    let mut x = x0;
    let mut saved = Vec::new();
    for (l, bp) in blocks.iter().enumerate() {
        let (acts, out) = block_forward(&mut net, l, bp, x, false);
        saved.push(Some(acts));
        x = out.expect("a full forward has an output");
    }
    let x_last = x;
    let yf = net.tensor("norm.out", &[bsz, t, c], Role::Activation);
    let rstdf = net.stats("norm.rstd", rows);
    let g_f = net.w(norm);
    net.op(
        "norm",
        OpKind::Forward,
        Kernel::RmsNorm {
            rows,
            cols: c,
            eps: cfg.norm_eps,
        },
        &[x_last, g_f],
        &[yf, rstdf],
    );
    let (dyf, dhead) = net.head_and_loss("output", yf, head, cfg.tied, targets);
    let mut dx = rmsnorm_backward(&mut net, "norm", dyf, x_last, rstdf, norm);
    for l in (0..cfg.layers as usize).rev() {
        let bp = &blocks[l];
        let acts = saved[l].take().expect("each block's backward runs once");
        let acts = if cfg.checkpoint {
            block_forward(&mut net, l, bp, acts.x, true).0
        } else {
            acts
        };
        dx = block_backward(&mut net, l, bp, &acts, dx);
    }
    let dwte = net.grad(wte);
    let dhead = cfg.tied.then_some(dhead);
    let dims = [bsz, t, c, v];
    net.embedding_backward("tok_embeddings.backward", dims, dx, tokens, dhead, &[dwte]);

    net.optimizer_step(&Update {
        optimizer: Optimizer::AdamW,
        lr: cfg.lr,
        weight_decay: cfg.weight_decay,
        clip_grad_norm: cfg.clip_grad_norm,
        adam_workspace: cfg.adam_workspace,
        layers: cfg.layers,
    });
    Ok(net.b.build()?)
}

/// The attention and the RoPE (forward, or backward when `inverse`) of
/// every block.
fn attention(cfg: &LlamaConfig, inverse: bool) -> (Attention, Rope) {
    let d = cfg.head_dim();
    let attn = Attention {
        batch: cfg.batch,
        heads: cfg.heads,
        kv_heads: cfg.kv_heads,
        seq: cfg.seq,
        head_dim: d,
        scale: 1.0 / (d as f64).sqrt(),
    };
    let rope = Rope {
        batch: cfg.batch,
        seq: cfg.seq,
        heads: cfg.heads,
        kv_heads: cfg.kv_heads,
        head_dim: d,
        theta: cfg.rope_theta,
        inverse,
    };
    (attn, rope)
}

/// `y = x @ W` (no bias): returns `y`.
fn linear(net: &mut Net, name: &str, x: TensorId, wp: usize) -> TensorId {
    let xs = net.shape(x);
    let ws = net.param_shape(wp);
    let rows: u64 = xs[..xs.len() - 1].iter().product();
    let mut ys = xs.clone();
    *ys.last_mut().expect("a row shape") = ws[1];
    let y = net.tensor(&format!("{name}.out"), &ys, Role::Activation);
    let w = net.w(wp);
    net.op(
        name,
        OpKind::Forward,
        Kernel::MatmulNn(Matmul {
            m: rows,
            k: ws[0],
            n: ws[1],
        }),
        &[x, w],
        &[y],
    );
    y
}

/// `y = x @ W` backward: the input gradient, then the weight gradient.
fn linear_backward(net: &mut Net, name: &str, dy: TensorId, x: TensorId, wp: usize) -> TensorId {
    let xs = net.shape(x);
    let ws = net.param_shape(wp);
    let rows: u64 = xs[..xs.len() - 1].iter().product();
    let (k, n) = (ws[0], ws[1]);
    let dx = net.tensor(&format!("{name}.in.grad"), &xs, Role::Activation);
    let w = net.w(wp);
    net.op(
        &format!("{name}.backward_data"),
        OpKind::Backward,
        Kernel::MatmulNt(Matmul {
            m: rows,
            k: n,
            n: k,
        }),
        &[dy, w],
        &[dx],
    );
    let dw = net.grad(wp);
    net.op(
        &format!("{name}.backward_weight"),
        OpKind::Backward,
        Kernel::MatmulTn(Matmul { m: k, k: rows, n }),
        &[x, dy],
        &[dw],
    );
    dx
}

/// RMSNorm: returns the output and the per-row `rstd`.
fn rmsnorm(net: &mut Net, name: &str, x: TensorId, gp: usize) -> (TensorId, TensorId) {
    let shape = net.shape(x);
    let rows: u64 = shape[..shape.len() - 1].iter().product();
    let cols = shape[shape.len() - 1];
    let y = net.tensor(&format!("{name}.out"), &shape, Role::Activation);
    let rstd = net.stats(&format!("{name}.rstd"), rows);
    let g = net.w(gp);
    let eps = net.cfg.norm_eps;
    net.op(
        name,
        OpKind::Forward,
        Kernel::RmsNorm { rows, cols, eps },
        &[x, g],
        &[y, rstd],
    );
    (y, rstd)
}

/// RMSNorm backward: returns the input gradient (in place of `dy` when the
/// plan allows); the weight's gradient goes to its `.grad` tensor.
fn rmsnorm_backward(
    net: &mut Net,
    name: &str,
    dy: TensorId,
    x: TensorId,
    rstd: TensorId,
    gp: usize,
) -> TensorId {
    let shape = net.shape(x);
    let rows: u64 = shape[..shape.len() - 1].iter().product();
    let cols = shape[shape.len() - 1];
    let dx = net.tensor(&format!("{name}.in.grad"), &shape, Role::Activation);
    let dg = net.grad(gp);
    let g = net.w(gp);
    let op = net.op(
        &format!("{name}.backward"),
        OpKind::Backward,
        Kernel::RmsNormBackward { rows, cols },
        &[dy, x, rstd, g],
        &[dx, dg],
    );
    net.reuse(op, dx, dy);
    dx
}

/// `out = a + b`, in place of `b` when the plan allows.
fn residual(net: &mut Net, name: &str, kind: OpKind, a: TensorId, b: TensorId) -> TensorId {
    let shape = net.shape(a);
    let out = net.tensor(name, &shape, Role::Activation);
    let elements = shape.iter().product::<u64>();
    let op = net.op(name, kind, Kernel::Add { elements }, &[a, b], &[out]);
    net.reuse(op, out, b);
    if kind == OpKind::Backward {
        net.reuse(op, out, a);
    }
    out
}

/// One block's forward. With `recompute`, ops and tensors are prefixed
/// `recompute.` and the MLP's down projection and second residual are
/// skipped (the backward does not need them).
fn block_forward(
    net: &mut Net,
    l: usize,
    bp: &BlockParams,
    x: TensorId,
    recompute: bool,
) -> (BlockActs, Option<TensorId>) {
    let cfg = net.cfg.clone();
    let (bsz, t) = (cfg.batch, cfg.seq);
    let rows = bsz * t;
    let pre = if recompute {
        format!("recompute.layers.{l}")
    } else {
        format!("layers.{l}")
    };
    let n = |s: &str| format!("{pre}.{s}");
    net.recompute = recompute;
    let kind = OpKind::Forward;
    let (attn, rope) = attention(&cfg, false);

    let (y1, rstd1) = rmsnorm(net, &n("attention_norm"), x, bp.attn_norm);
    let raw = linear(net, &n("attention.wqkv"), y1, bp.wqkv);
    let qkv = net.tensor(&n("attention.rope"), &net.shape(raw), Role::Activation);
    let op = net.op(
        &n("attention.rope"),
        kind,
        Kernel::Rope(rope),
        &[raw],
        &[qkv],
    );
    net.reuse(op, qkv, raw);
    let att = net.tensor(&n("attention.out"), &[bsz, t, cfg.width], Role::Activation);
    let lse = net.stats(&n("attention.lse"), bsz * cfg.heads * t);
    net.op(
        &n("attention.fused"),
        kind,
        Kernel::FusedAttention(attn),
        &[qkv],
        &[att, lse],
    );
    let a = linear(net, &n("attention.wo"), att, bp.wo);
    let x2 = residual(net, &n("resid_1"), kind, x, a);
    let (y2, rstd2) = rmsnorm(net, &n("ffn_norm"), x2, bp.ffn_norm);
    let gu = linear(net, &n("feed_forward.w13"), y2, bp.w13);
    let h = net.tensor(
        &n("feed_forward.swiglu"),
        &[bsz, t, cfg.ffn],
        Role::Activation,
    );
    net.op(
        &n("feed_forward.swiglu"),
        kind,
        Kernel::SwiGlu {
            rows,
            hidden: cfg.ffn,
        },
        &[gu],
        &[h],
    );
    let acts = BlockActs {
        x,
        y1,
        rstd1,
        qkv,
        att,
        lse,
        x2,
        y2,
        rstd2,
        gu,
        h,
    };
    if recompute {
        net.recompute = false;
        return (acts, None);
    }
    let m = linear(net, &n("feed_forward.w2"), h, bp.w2);
    let x3 = residual(net, &n("resid_2"), kind, x2, m);
    (acts, Some(x3))
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
    let rows = cfg.batch * cfg.seq;
    let n = |s: &str| format!("layers.{l}.{s}");
    let kind = OpKind::Backward;
    let (attn, rope) = attention(&cfg, true);

    // x3 = x2 + swiglu(rmsnorm(x2) @ W13) @ W2
    let dh = linear_backward(net, &n("feed_forward.w2"), dy, a.h, bp.w2);
    let dgu = net.tensor(
        &n("feed_forward.w13.out.grad"),
        &net.shape(a.gu),
        Role::Activation,
    );
    net.op(
        &n("feed_forward.swiglu.backward"),
        kind,
        Kernel::SwiGluBackward {
            rows,
            hidden: cfg.ffn,
        },
        &[dh, a.gu],
        &[dgu],
    );
    let dy2 = linear_backward(net, &n("feed_forward.w13"), dgu, a.y2, bp.w13);
    let dx2_n = rmsnorm_backward(net, &n("ffn_norm"), dy2, a.x2, a.rstd2, bp.ffn_norm);
    let dx2 = residual(net, &n("resid_1.grad"), kind, dy, dx2_n);

    // x2 = x + attention(rope(rmsnorm(x) @ Wqkv)) @ Wo
    let datt = linear_backward(net, &n("attention.wo"), dx2, a.att, bp.wo);
    let dqkv = net.tensor(
        &n("attention.rope.grad"),
        &net.shape(a.qkv),
        Role::Activation,
    );
    net.op(
        &n("attention.fused.backward"),
        kind,
        Kernel::FusedAttentionBackward(attn),
        &[datt, a.qkv, a.att, a.lse],
        &[dqkv],
    );
    let draw = net.tensor(
        &n("attention.wqkv.out.grad"),
        &net.shape(a.qkv),
        Role::Activation,
    );
    let op = net.op(
        &n("attention.rope.backward"),
        kind,
        Kernel::Rope(rope),
        &[dqkv],
        &[draw],
    );
    net.reuse(op, draw, dqkv);
    let dy1 = linear_backward(net, &n("attention.wqkv"), draw, a.y1, bp.wqkv);
    let dx_n = rmsnorm_backward(net, &n("attention_norm"), dy1, a.x, a.rstd1, bp.attn_norm);
    residual(net, &n("in.grad"), kind, dx2, dx_n)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Parameter counts of the published models.
    #[test]
    fn parameter_counts_match_the_published_models() {
        for (name, want) in [
            ("llama2-7b", 6_738_415_616u64),
            ("llama3-8b", 8_030_261_248),
            ("llama3-1b", 1_235_814_400),
        ] {
            let c = LlamaConfig::preset(name).unwrap();
            assert_eq!(c.parameters(), want, "{name}");
        }
        let c = LlamaConfig::preset("llama-tiny").unwrap();
        let g = build(&c).unwrap();
        let params: u64 = g
            .tensors()
            .iter()
            .filter(|t| t.role == Role::Parameter)
            .map(|t| t.size / 4)
            .sum();
        assert_eq!(params, c.parameters());
    }

    #[test]
    fn builds_presets_with_checkpointing_and_rejects_bad_shapes() {
        for name in ["llama-tiny", "llama3-1b"] {
            let mut c = LlamaConfig::preset(name).unwrap();
            c.seq = 256;
            build(&c).unwrap();
            c.checkpoint = true;
            c.clip_grad_norm = Some(1.0);
            let g = build(&c).unwrap();
            assert!(g.ops().iter().any(|o| o.name.starts_with("recompute.")));
        }
        let mut c = LlamaConfig::preset("llama-tiny").unwrap();
        c.kv_heads = 3;
        let e = build(&c).unwrap_err().to_string();
        assert!(e.contains("kv_heads 3"), "{e}");
    }
}
