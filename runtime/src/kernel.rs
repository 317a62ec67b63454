//! The typed kernels an instruction runs, with their operand signatures.
//!
//! Each variant's exact semantics (formulas, operand order, shapes) is in
//! `docs/ops.md`; the variant docs here give the operands. Shapes use `B`
//! batch, `T` sequence, `C` width, `H` heads, `D = C / H`, `V` vocabulary,
//! `R` rows, `E` elements, `W` world size. "float" is f32 (or bf16 where a
//! backend takes it); statistics, losses and norms are always f32.

use crate::program::{DType, Instr, Program, TensorIdx};

/// Sizes of a matrix product: `m × k` times `k × n`.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Matmul {
    pub m: u64,
    pub k: u64,
    pub n: u64,
}

/// Sizes of causal multi-head attention over a packed `qkv` tensor
/// `[B, T, (H + 2·Hkv)·D]`: the query of head `h` at columns `hD`, the key
/// and value of key/value head `g` at `C + gD` and `C + Hkv·D + gD`
/// (`C = H·D`). Query head `h` reads key/value head `h / (H / Hkv)`
/// (grouped-query attention); with `Hkv = H` this is the plain `[B, T, 3C]`
/// layout.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct Attention {
    pub batch: u64,
    pub heads: u64,
    /// Key/value heads (`Hkv`, a divisor of `heads`).
    pub kv_heads: u64,
    pub seq: u64,
    pub head_dim: u64,
    /// Multiplies `q·k` (usually `1/√D`).
    pub scale: f32,
}

impl Attention {
    /// Multi-head attention (as many key/value heads as query heads).
    pub fn mha(batch: u64, heads: u64, seq: u64, head_dim: u64, scale: f32) -> Attention {
        Attention {
            batch,
            heads,
            kv_heads: heads,
            seq,
            head_dim,
            scale,
        }
    }
    pub fn width(&self) -> u64 {
        self.heads * self.head_dim
    }
    /// Elements of one row of `qkv`: `(H + 2·Hkv)·D`.
    pub fn qkv_width(&self) -> u64 {
        (self.heads + 2 * self.kv_heads) * self.head_dim
    }
    fn qkv(&self) -> u64 {
        self.batch * self.seq * self.qkv_width()
    }
    fn probs(&self) -> u64 {
        self.batch * self.heads * self.seq * self.seq
    }
    fn out(&self) -> u64 {
        self.batch * self.seq * self.width()
    }
    /// Query rows over all heads: `B·H·T`.
    fn rows(&self) -> u64 {
        self.batch * self.heads * self.seq
    }
}

/// Rotary position embedding (RoPE, the "rotate half" convention of
/// Hugging Face's Llama) applied to the query and key parts of a packed
/// `qkv` tensor laid out as in [`Attention`]; the value part is copied.
/// Dimension `i < D/2` of a head pairs with `i + D/2` and turns by the
/// angle `pos · theta^(−2i/D)` (`pos` the row's position in its sequence).
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct Rope {
    pub batch: u64,
    pub seq: u64,
    pub heads: u64,
    pub kv_heads: u64,
    pub head_dim: u64,
    /// Base of the frequencies (10000 in Llama 2, 500000 in Llama 3).
    pub theta: f64,
    /// Turn by the opposite angle: the backward pass (a rotation's
    /// transpose is its inverse).
    pub inverse: bool,
}

impl Rope {
    /// Elements of `qkv`.
    pub fn elements(&self) -> u64 {
        self.batch * self.seq * (self.heads + 2 * self.kv_heads) * self.head_dim
    }
}

/// Hyper-parameters of an Adam or AdamW update (PyTorch's single-tensor
/// algorithm, `amsgrad=False`).
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct AdamParams {
    pub elements: u64,
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
    /// AdamW: decay the weights directly (`w -= lr·wd·w`) instead of adding
    /// `wd·w` to the gradient (Adam).
    pub decoupled: bool,
    /// Step number of the first execution (bias correction uses
    /// `first_step + steps run so far`).
    pub first_step: u64,
    /// Clip by global norm: the second input is the norm (or its square).
    pub max_norm: Option<f32>,
    /// The norm input holds the squared norm.
    pub norm_squared: bool,
}

/// How a collective combines values.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    Sum,
    /// Sum divided by the world size.
    Avg,
}

/// What an instruction computes; see `docs/ops.md` for each formula.
#[derive(Clone, Debug, PartialEq)]
pub enum Kernel {
    /// in `[tokens i32 BT, wte VC, (wpe TC if positions)]`, out `[x BTC]`.
    Embedding {
        batch: u64,
        seq: u64,
        width: u64,
        vocab: u64,
        /// Add a learned position embedding (GPT-2; Llama has none).
        positions: bool,
    },
    /// in `[dx BTC, tokens i32 BT, (dhead VC if accumulate)]`, out
    /// `[dwte VC, (dwpe TC if positions)]`.
    EmbeddingBackward {
        batch: u64,
        seq: u64,
        width: u64,
        vocab: u64,
        accumulate: bool,
        positions: bool,
    },
    /// in `[x RC, gamma C, beta C]`, out `[y RC, mean f32 R, rstd f32 R]`.
    LayerNorm { rows: u64, cols: u64, eps: f32 },
    /// in `[dy RC, x RC, mean R, rstd R, gamma C]`, out `[dx RC, dgamma C, dbeta C]`.
    LayerNormBackward { rows: u64, cols: u64 },
    /// in `[x RC, gamma C]`, out `[y RC, rstd f32 R]` (RMSNorm).
    RmsNorm { rows: u64, cols: u64, eps: f32 },
    /// in `[dy RC, x RC, rstd R, gamma C]`, out `[dx RC, dgamma C]`.
    RmsNormBackward { rows: u64, cols: u64 },
    /// in `[qkv]`, out `[qkv rotated]` (`rope`, or `rope_backward` when
    /// `inverse`).
    Rope(Rope),
    /// in `[gate|up R·2F]`, out `[silu(gate)·up R·F]` (SwiGLU; each row
    /// holds the gate's `F` elements, then the up projection's).
    SwiGlu { rows: u64, hidden: u64 },
    /// in `[dh R·F, gate|up R·2F]`, out `[d(gate|up) R·2F]`.
    SwiGluBackward { rows: u64, hidden: u64 },
    /// in `[x MK, w KN, b N]`, out `[y MN]`.
    Linear(Matmul),
    /// in `[dy MN, w KN]`, out `[dx MK]`.
    LinearBackwardData(Matmul),
    /// in `[dy MN, x MK]`, out `[dw KN, db N]`.
    LinearBackwardWeight(Matmul),
    /// in `[a MK, b NK]`, out `[c MN]` (`c = a bᵀ`).
    MatmulNt(Matmul),
    /// in `[a MK, b KN]`, out `[c MN]`.
    MatmulNn(Matmul),
    /// in `[a KM, b KN]`, out `[c MN]` (`c = aᵀ b`).
    MatmulTn(Matmul),
    /// in `[qkv]`, out `[scores BHTT]`.
    AttentionScores(Attention),
    /// in `[dscores BHTT, qkv]`, updates `[dqkv]` (adds the query and key parts).
    AttentionScoresBackward(Attention),
    /// in `[scores BHTT]`, out `[probs BHTT]`.
    CausalSoftmax(Attention),
    /// in `[dprobs, probs]`, out `[dscores]`.
    CausalSoftmaxBackward(Attention),
    /// in `[probs, qkv]`, out `[att BTC]`.
    AttentionValues(Attention),
    /// in `[datt BTC, probs, qkv]`, out `[dprobs, dqkv]`.
    AttentionValuesBackward(Attention),
    /// Fused (flash-style) causal attention: `[qkv] -> [out, lse]`, out
    /// `[B, T, C]` as `attention_values` writes it, `lse` `[B, H, T]` (f32)
    /// the log-sum-exp of each query row's scaled scores. No `[T, T]`
    /// matrix is stored: extra memory is O(T) per head.
    FusedAttention(Attention),
    /// `[dout, qkv, out, lse] -> [dqkv]`: the gradient of all three parts
    /// of `qkv`, recomputing the scores tile by tile.
    FusedAttentionBackward(Attention),
    /// in `[a E, b E]`, out `[a + b]`.
    Add { elements: u64 },
    /// in `[x E]`, out `[y E]`: the values in the output's dtype (f32 to
    /// bf16 rounds to nearest, ties to even).
    Cast { elements: u64 },
    /// in `[x E]`, out `[gelu(x)]` (tanh approximation).
    Gelu { elements: u64 },
    /// in `[dy E, x E]`, out `[dx E]`.
    GeluBackward { elements: u64 },
    /// in `[x E]`, out `[max(x, 0)]`.
    Relu { elements: u64 },
    /// in `[dy E, x E]`, out `[dy · (x > 0)]`.
    ReluBackward { elements: u64 },
    /// in `[logits RV, targets i32 R]`, out `[loss f32 1]` (mean over rows).
    CrossEntropy { rows: u64, classes: u64 },
    /// in `[logits RV, targets i32 R]`, out `[dlogits RV]`.
    CrossEntropyBackward { rows: u64, classes: u64, scale: f32 },
    /// in `[g₁, g₂, …]`, out `[norm f32 1]` (the L2 norm of all, or its square).
    GradNorm { squared: bool },
    /// in `[g E, (norm f32 1)]`, out `[(denom E)]`, updates `[w E, m E, v E]`.
    Adam(AdamParams),
    /// in `[base]`, out `[views of base…]`: computes nothing.
    View,
    /// in `[x₁, x₂, …]`, out `[flat E]`: `xᵢ` at element `offsets[i]`, zeros elsewhere.
    Pack { offsets: Vec<u64>, elements: u64 },
    /// in `[x₁, x₂, …]`, out `[flat WS]`: FSDP2's gradient packing
    /// (`chunk_cat`): chunk `r` of every `xᵢ` in rank `r`'s segment. The
    /// `xᵢ` share a dtype; `flat` may have another (values are converted,
    /// as `torch._chunk_cat(..., out=)` does).
    ChunkCat(ChunkLayout),
    /// in `[full WS]`, out `[x₁, x₂, …]`: FSDP2's copy-out after an
    /// all-gather, the inverse of [`Kernel::ChunkCat`] (padding dropped).
    CopyOut(ChunkLayout),
    /// in `[shard S]`, out `[full WS]`: rank `r`'s shard lands at `rS`.
    AllGather { world: u32 },
    /// in `[full WS]`, out `[shard S]`: rank `r` gets chunk `r` combined over ranks.
    ReduceScatter { world: u32, op: ReduceOp },
    /// updates `[x]`: combined over ranks, in place.
    AllReduce { world: u32, op: ReduceOp },
}

/// Where per-parameter shards sit in a flat buffer of `world` segments of
/// `shard` elements (FSDP2): segment `r` holds chunk `r` of every parameter
/// `i`, that is elements `[r·cᵢ, (r+1)·cᵢ)` of the parameter (`cᵢ =
/// chunks[i]`, zero past its end), at element `offsets[i]` of the segment.
/// Sharding along dim 0 of a row-major tensor is exactly this chunking.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChunkLayout {
    pub world: u32,
    pub shard: u64,
    pub offsets: Vec<u64>,
    pub chunks: Vec<u64>,
}

impl ChunkLayout {
    /// `(rank, element in flat, element in xᵢ, length)` of every nonempty
    /// piece of parameter `i` of `elements` elements.
    pub fn pieces(&self, i: usize, elements: u64) -> impl Iterator<Item = (u64, u64, u64)> + '_ {
        let (off, c) = (self.offsets[i], self.chunks[i]);
        (0..self.world as u64).filter_map(move |r| {
            let lo = r * c;
            (lo < elements).then(|| (r * self.shard + off, lo, c.min(elements - lo)))
        })
    }

    /// Checks the layout against the parameters' element counts: one
    /// offset and chunk each, in order, disjoint, inside a segment, and
    /// `world` chunks covering each parameter.
    fn check(&self, elements: &[u64]) -> Result<(), String> {
        if self.world == 0 || self.shard == 0 {
            return Err("world_size and shard must be positive".into());
        }
        if self.offsets.len() != elements.len() || self.chunks.len() != elements.len() {
            return Err(format!(
                "{} offsets and {} chunks for {} parameters",
                self.offsets.len(),
                self.chunks.len(),
                elements.len()
            ));
        }
        let mut end = 0u64;
        for (i, ((&off, &c), &n)) in self
            .offsets
            .iter()
            .zip(&self.chunks)
            .zip(elements)
            .enumerate()
        {
            if off < end || off.saturating_add(c) > self.shard {
                return Err(format!(
                    "parameter {i}: chunk of {c} at element {off} overlaps the previous one or passes the segment's end ({})",
                    self.shard
                ));
            }
            if c.saturating_mul(self.world as u64) < n {
                return Err(format!(
                    "parameter {i}: {} chunks of {c} do not cover its {n} elements",
                    self.world
                ));
            }
            end = off + c;
        }
        Ok(())
    }
}

/// Operand list of an instruction.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Slot {
    Input,
    Output,
    Update,
}

/// What one operand must be.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Want {
    /// f32 or bf16.
    Float(u64),
    F32(u64),
    I32(u64),
}

impl Kernel {
    /// The op type this kernel implements (as in `docs/ops.md`).
    pub fn name(&self) -> &'static str {
        match self {
            Kernel::Embedding { .. } => "embedding",
            Kernel::EmbeddingBackward { .. } => "embedding_backward",
            Kernel::LayerNorm { .. } => "layernorm",
            Kernel::LayerNormBackward { .. } => "layernorm_backward",
            Kernel::RmsNorm { .. } => "rmsnorm",
            Kernel::RmsNormBackward { .. } => "rmsnorm_backward",
            Kernel::Rope(r) if r.inverse => "rope_backward",
            Kernel::Rope(_) => "rope",
            Kernel::SwiGlu { .. } => "swiglu",
            Kernel::SwiGluBackward { .. } => "swiglu_backward",
            Kernel::Linear(_) => "linear",
            Kernel::LinearBackwardData(_) => "linear_backward_data",
            Kernel::LinearBackwardWeight(_) => "linear_backward_weight",
            Kernel::MatmulNt(_) => "matmul_nt",
            Kernel::MatmulNn(_) => "matmul_nn",
            Kernel::MatmulTn(_) => "matmul_tn",
            Kernel::AttentionScores(_) => "attention_scores",
            Kernel::AttentionScoresBackward(_) => "attention_scores_backward",
            Kernel::CausalSoftmax(_) => "causal_softmax",
            Kernel::CausalSoftmaxBackward(_) => "causal_softmax_backward",
            Kernel::AttentionValues(_) => "attention_values",
            Kernel::AttentionValuesBackward(_) => "attention_values_backward",
            Kernel::FusedAttention(_) => "fused_attention",
            Kernel::FusedAttentionBackward(_) => "fused_attention_backward",
            Kernel::Add { .. } => "add",
            Kernel::Cast { .. } => "cast",
            Kernel::Gelu { .. } => "gelu",
            Kernel::GeluBackward { .. } => "gelu_backward",
            Kernel::Relu { .. } => "relu",
            Kernel::ReluBackward { .. } => "relu_backward",
            Kernel::CrossEntropy { .. } => "cross_entropy",
            Kernel::CrossEntropyBackward { .. } => "cross_entropy_backward",
            Kernel::GradNorm { .. } => "grad_norm",
            Kernel::Adam(p) if p.decoupled => "adamw",
            Kernel::Adam(_) => "adam",
            Kernel::View => "view",
            Kernel::Pack { .. } => "pack",
            Kernel::ChunkCat(_) => "chunk_cat",
            Kernel::CopyOut(_) => "copy_out",
            Kernel::AllGather { .. } => "all_gather",
            Kernel::ReduceScatter { .. } => "reduce_scatter",
            Kernel::AllReduce { .. } => "all_reduce",
        }
    }

    /// Whether it is a collective (runs through a communicator).
    pub fn is_collective(&self) -> bool {
        self.world_size().is_some()
    }

    /// The world size a collective is written for.
    pub fn world_size(&self) -> Option<u32> {
        match self {
            Kernel::AllGather { world }
            | Kernel::ReduceScatter { world, .. }
            | Kernel::AllReduce { world, .. } => Some(*world),
            _ => None,
        }
    }

    /// Inputs (by position) that output `output` may share its bytes with
    /// exactly: the kernel reads each element (or row) of such an input
    /// before it writes the same element (row) of the output. These are the
    /// reuse hints the graph builders declare.
    pub fn in_place_sources(&self, output: usize) -> &'static [usize] {
        if output != 0 {
            return &[];
        }
        match self {
            Kernel::Add { .. } => &[0, 1],
            Kernel::Gelu { .. }
            | Kernel::Relu { .. }
            | Kernel::GeluBackward { .. }
            | Kernel::ReluBackward { .. }
            | Kernel::CausalSoftmax(_)
            | Kernel::CausalSoftmaxBackward(_)
            | Kernel::CrossEntropyBackward { .. }
            | Kernel::LayerNormBackward { .. }
            | Kernel::RmsNormBackward { .. }
            | Kernel::Rope(_) => &[0],
            Kernel::EmbeddingBackward {
                accumulate: true, ..
            } => &[2],
            _ => &[],
        }
    }

    /// Checks the operands of `ins` (which runs this kernel) against the
    /// kernel's signature.
    pub fn check_operands(&self, p: &Program, ins: &Instr) -> Result<(), String> {
        use Want::*;
        let dims: &[(&str, u64)] = match self {
            Kernel::Embedding {
                batch,
                seq,
                width,
                vocab,
                ..
            }
            | Kernel::EmbeddingBackward {
                batch,
                seq,
                width,
                vocab,
                ..
            } => &[
                ("batch", *batch),
                ("seq", *seq),
                ("width", *width),
                ("vocab", *vocab),
            ],
            Kernel::LayerNorm { rows, cols, .. }
            | Kernel::LayerNormBackward { rows, cols }
            | Kernel::RmsNorm { rows, cols, .. }
            | Kernel::RmsNormBackward { rows, cols } => &[("rows", *rows), ("cols", *cols)],
            Kernel::SwiGlu { rows, hidden } | Kernel::SwiGluBackward { rows, hidden } => {
                &[("rows", *rows), ("hidden", *hidden)]
            }
            Kernel::Rope(r) => &[
                ("batch", r.batch),
                ("seq", r.seq),
                ("heads", r.heads),
                ("kv_heads", r.kv_heads),
                ("head_dim", r.head_dim),
            ],
            Kernel::Linear(Matmul { m, k, n })
            | Kernel::LinearBackwardData(Matmul { m, k, n })
            | Kernel::LinearBackwardWeight(Matmul { m, k, n })
            | Kernel::MatmulNt(Matmul { m, k, n })
            | Kernel::MatmulNn(Matmul { m, k, n })
            | Kernel::MatmulTn(Matmul { m, k, n }) => &[("m", *m), ("k", *k), ("n", *n)],
            Kernel::CrossEntropy { rows, classes }
            | Kernel::CrossEntropyBackward { rows, classes, .. } => {
                &[("rows", *rows), ("classes", *classes)]
            }
            Kernel::AllGather { world }
            | Kernel::ReduceScatter { world, .. }
            | Kernel::AllReduce { world, .. } => &[("world_size", *world as u64)],
            _ => &[],
        };
        for &(what, v) in dims {
            if v == 0 {
                return Err(format!("{what} must be positive"));
            }
        }
        let (i, o, u): (Vec<Want>, Vec<Want>, Vec<Want>) = match self {
            Kernel::Embedding {
                batch,
                seq,
                width,
                vocab,
                positions,
            } => {
                let bt = batch * seq;
                let mut i = vec![I32(bt), Float(vocab * width)];
                if *positions {
                    i.push(Float(seq * width));
                }
                (i, vec![Float(bt * width)], vec![])
            }
            Kernel::EmbeddingBackward {
                batch,
                seq,
                width,
                vocab,
                accumulate,
                positions,
            } => {
                let bt = batch * seq;
                let mut i = vec![Float(bt * width), I32(bt)];
                if *accumulate {
                    i.push(Float(vocab * width));
                }
                let mut o = vec![Float(vocab * width)];
                if *positions {
                    o.push(Float(seq * width));
                }
                (i, o, vec![])
            }
            Kernel::RmsNorm { rows, cols, eps } => {
                if !(eps.is_finite() && *eps >= 0.0) {
                    return Err(format!("eps must be a non-negative number, got {eps}"));
                }
                (
                    vec![Float(rows * cols), Float(*cols)],
                    vec![Float(rows * cols), F32(*rows)],
                    vec![],
                )
            }
            Kernel::RmsNormBackward { rows, cols } => (
                vec![
                    Float(rows * cols),
                    Float(rows * cols),
                    F32(*rows),
                    Float(*cols),
                ],
                vec![Float(rows * cols), Float(*cols)],
                vec![],
            ),
            Kernel::Rope(r) => {
                if r.kv_heads == 0 || r.heads % r.kv_heads != 0 {
                    return Err(format!(
                        "heads {} is not a multiple of kv_heads {}",
                        r.heads, r.kv_heads
                    ));
                }
                if r.head_dim % 2 != 0 {
                    return Err(format!("head_dim {} must be even", r.head_dim));
                }
                if !(r.theta.is_finite() && r.theta > 0.0) {
                    return Err(format!("theta must be positive, got {}", r.theta));
                }
                let e = r.elements();
                (vec![Float(e)], vec![Float(e)], vec![])
            }
            Kernel::SwiGlu { rows, hidden } => (
                vec![Float(2 * rows * hidden)],
                vec![Float(rows * hidden)],
                vec![],
            ),
            Kernel::SwiGluBackward { rows, hidden } => (
                vec![Float(rows * hidden), Float(2 * rows * hidden)],
                vec![Float(2 * rows * hidden)],
                vec![],
            ),
            Kernel::LayerNorm { rows, cols, eps } => {
                if !(eps.is_finite() && *eps >= 0.0) {
                    return Err(format!("eps must be a non-negative number, got {eps}"));
                }
                (
                    vec![Float(rows * cols), Float(*cols), Float(*cols)],
                    vec![Float(rows * cols), F32(*rows), F32(*rows)],
                    vec![],
                )
            }
            Kernel::LayerNormBackward { rows, cols } => (
                vec![
                    Float(rows * cols),
                    Float(rows * cols),
                    F32(*rows),
                    F32(*rows),
                    Float(*cols),
                ],
                vec![Float(rows * cols), Float(*cols), Float(*cols)],
                vec![],
            ),
            Kernel::Linear(Matmul { m, k, n }) => (
                vec![Float(m * k), Float(k * n), Float(*n)],
                vec![Float(m * n)],
                vec![],
            ),
            Kernel::LinearBackwardData(Matmul { m, k, n }) => {
                (vec![Float(m * n), Float(k * n)], vec![Float(m * k)], vec![])
            }
            Kernel::LinearBackwardWeight(Matmul { m, k, n }) => (
                vec![Float(m * n), Float(m * k)],
                vec![Float(k * n), Float(*n)],
                vec![],
            ),
            Kernel::MatmulNt(Matmul { m, k, n })
            | Kernel::MatmulNn(Matmul { m, k, n })
            | Kernel::MatmulTn(Matmul { m, k, n }) => {
                (vec![Float(m * k), Float(k * n)], vec![Float(m * n)], vec![])
            }
            Kernel::AttentionScores(a) => {
                check_attention(a, false)?;
                (vec![Float(a.qkv())], vec![Float(a.probs())], vec![])
            }
            Kernel::AttentionScoresBackward(a) => {
                check_attention(a, false)?;
                (
                    vec![Float(a.probs()), Float(a.qkv())],
                    vec![],
                    vec![Float(a.qkv())],
                )
            }
            Kernel::CausalSoftmax(a) => {
                check_attention(a, false)?;
                (vec![Float(a.probs())], vec![Float(a.probs())], vec![])
            }
            Kernel::CausalSoftmaxBackward(a) => {
                check_attention(a, false)?;
                (
                    vec![Float(a.probs()), Float(a.probs())],
                    vec![Float(a.probs())],
                    vec![],
                )
            }
            Kernel::AttentionValues(a) => {
                check_attention(a, false)?;
                (
                    vec![Float(a.probs()), Float(a.qkv())],
                    vec![Float(a.out())],
                    vec![],
                )
            }
            Kernel::AttentionValuesBackward(a) => {
                check_attention(a, false)?;
                (
                    vec![Float(a.out()), Float(a.probs()), Float(a.qkv())],
                    vec![Float(a.probs()), Float(a.qkv())],
                    vec![],
                )
            }
            Kernel::FusedAttention(a) => {
                check_attention(a, true)?;
                (
                    vec![Float(a.qkv())],
                    vec![Float(a.out()), F32(a.rows())],
                    vec![],
                )
            }
            Kernel::FusedAttentionBackward(a) => {
                check_attention(a, true)?;
                (
                    vec![
                        Float(a.out()),
                        Float(a.qkv()),
                        Float(a.out()),
                        F32(a.rows()),
                    ],
                    vec![Float(a.qkv())],
                    vec![],
                )
            }
            Kernel::Add { elements } => (
                vec![Float(*elements), Float(*elements)],
                vec![Float(*elements)],
                vec![],
            ),
            Kernel::Gelu { elements } | Kernel::Relu { elements } | Kernel::Cast { elements } => {
                (vec![Float(*elements)], vec![Float(*elements)], vec![])
            }
            Kernel::GeluBackward { elements } | Kernel::ReluBackward { elements } => (
                vec![Float(*elements), Float(*elements)],
                vec![Float(*elements)],
                vec![],
            ),
            Kernel::CrossEntropy { rows, classes } => {
                if *classes == 0 {
                    return Err("classes must be positive".into());
                }
                (
                    vec![Float(rows * classes), I32(*rows)],
                    vec![F32(1)],
                    vec![],
                )
            }
            Kernel::CrossEntropyBackward {
                rows,
                classes,
                scale,
            } => {
                if *classes == 0 || !scale.is_finite() {
                    return Err("classes must be positive and scale finite".into());
                }
                (
                    vec![Float(rows * classes), I32(*rows)],
                    vec![Float(rows * classes)],
                    vec![],
                )
            }
            Kernel::GradNorm { .. } => {
                if ins.inputs.is_empty() {
                    return Err("grad_norm needs at least one input".into());
                }
                let i = ins
                    .inputs
                    .iter()
                    .map(|&t| Float(p.tensor(t).elements()))
                    .collect();
                (i, vec![F32(1)], vec![])
            }
            Kernel::Adam(a) => {
                let e = a.elements;
                for (what, x) in [
                    ("lr", a.lr),
                    ("beta1", a.beta1),
                    ("beta2", a.beta2),
                    ("eps", a.eps),
                    ("weight_decay", a.weight_decay),
                ] {
                    if !x.is_finite() {
                        return Err(format!("{what} must be finite, got {x}"));
                    }
                }
                if !(0.0..1.0).contains(&a.beta1) || !(0.0..1.0).contains(&a.beta2) {
                    return Err(format!(
                        "betas must lie in [0, 1), got {} and {}",
                        a.beta1, a.beta2
                    ));
                }
                if a.first_step == 0 {
                    return Err("the first step number is 1, got 0".into());
                }
                let mut i = vec![Float(e)];
                if a.max_norm.is_some() {
                    i.push(F32(1));
                }
                let o = if ins.outputs.len() == 1 {
                    vec![Float(e)]
                } else {
                    vec![]
                };
                (i, o, vec![Float(e), Float(e), Float(e)])
            }
            Kernel::View => {
                if ins.inputs.len() != 1 {
                    return Err(format!(
                        "view takes one input (the base), got {}",
                        ins.inputs.len()
                    ));
                }
                let base = ins.inputs[0];
                for &t in &ins.outputs {
                    let x = p.tensor(t);
                    let mut cur = x.view_of;
                    while let Some(b) = cur {
                        if b == base {
                            break;
                        }
                        cur = p.tensor(b).view_of;
                    }
                    if cur.is_none() {
                        return Err(format!(
                            "output {:?} is not a view of the input {:?}",
                            x.name,
                            p.tensor(base).name
                        ));
                    }
                }
                if !ins.updates.is_empty() {
                    return Err("view updates nothing".into());
                }
                return Ok(());
            }
            Kernel::Pack { offsets, elements } => {
                if offsets.len() != ins.inputs.len() {
                    return Err(format!(
                        "{} offsets for {} inputs",
                        offsets.len(),
                        ins.inputs.len()
                    ));
                }
                let mut end = 0u64;
                for (&off, &t) in offsets.iter().zip(&ins.inputs) {
                    let x = p.tensor(t);
                    if off < end || off + x.elements() > *elements {
                        return Err(format!(
                            "input {:?} at element {off} overlaps the previous input or passes the end ({elements})",
                            x.name
                        ));
                    }
                    end = off + x.elements();
                }
                let i = ins
                    .inputs
                    .iter()
                    .map(|&t| Float(p.tensor(t).elements()))
                    .collect();
                (i, vec![Float(*elements)], vec![])
            }
            Kernel::ChunkCat(l) | Kernel::CopyOut(l) => {
                let (parts, flat) = match self {
                    Kernel::ChunkCat(_) => (&ins.inputs, &ins.outputs),
                    _ => (&ins.outputs, &ins.inputs),
                };
                let sizes: Vec<u64> = parts.iter().map(|&t| p.tensor(t).elements()).collect();
                l.check(&sizes)?;
                // The parts share a dtype; `chunk_cat` may write another
                // (FSDP2 packs bf16 gradients into an f32 reduce-scatter
                // input), `copy_out` converts nothing.
                let want = match (self, flat.first(), parts.first()) {
                    (Kernel::ChunkCat(_), _, Some(&x)) => Some(x),
                    (_, Some(&f), _) => Some(f),
                    _ => None,
                };
                if let Some(w) = want
                    && let Some(&t) = parts
                        .iter()
                        .find(|&&t| p.tensor(t).dtype != p.tensor(w).dtype)
                {
                    return Err(format!(
                        "{:?} is {}, not {} as {:?} (the copy converts nothing)",
                        p.tensor(t).name,
                        p.tensor(t).dtype,
                        p.tensor(w).dtype,
                        p.tensor(w).name
                    ));
                }
                let parts: Vec<Want> = sizes.into_iter().map(Float).collect();
                let flat = vec![Float(l.world as u64 * l.shard)];
                match self {
                    Kernel::ChunkCat(_) => (parts, flat, vec![]),
                    _ => (flat, parts, vec![]),
                }
            }
            Kernel::AllGather { world } => {
                let s = shard_of(p, ins, Slot::Input)?;
                (vec![Float(s)], vec![Float(s * *world as u64)], vec![])
            }
            Kernel::ReduceScatter { world, .. } => {
                let s = shard_of(p, ins, Slot::Output)?;
                (vec![Float(s * *world as u64)], vec![Float(s)], vec![])
            }
            Kernel::AllReduce { .. } => {
                let e = ins.updates.first().map_or(0, |&t| p.tensor(t).elements());
                (vec![], vec![], vec![Float(e)])
            }
        };
        check_list(p, "input", &ins.inputs, &i)?;
        check_list(p, "output", &ins.outputs, &o)?;
        check_list(p, "update", &ins.updates, &u)?;
        Ok(())
    }
}

/// `grouped`: the kernel supports fewer key/value heads than query heads.
fn check_attention(a: &Attention, grouped: bool) -> Result<(), String> {
    if a.heads == 0 || a.head_dim == 0 || a.seq == 0 {
        return Err("heads, head_dim and seq must be positive".into());
    }
    if a.kv_heads == 0 || a.heads % a.kv_heads != 0 {
        return Err(format!(
            "heads {} is not a multiple of kv_heads {}",
            a.heads, a.kv_heads
        ));
    }
    if !grouped && a.kv_heads != a.heads {
        return Err(format!(
            "explicit attention needs as many key/value heads as query heads \
             (got {} and {}); grouped-query attention runs as fused_attention",
            a.kv_heads, a.heads
        ));
    }
    if !a.scale.is_finite() {
        return Err(format!("scale must be finite, got {}", a.scale));
    }
    Ok(())
}

/// The shard size of a collective: elements of its first operand in `slot`.
fn shard_of(p: &Program, ins: &Instr, slot: Slot) -> Result<u64, String> {
    let list = match slot {
        Slot::Input => &ins.inputs,
        Slot::Output => &ins.outputs,
        Slot::Update => &ins.updates,
    };
    list.first()
        .map(|&t| p.tensor(t).elements())
        .ok_or_else(|| format!("{} needs a shard operand", ins.kernel.name()))
}

fn check_list(p: &Program, what: &str, list: &[TensorIdx], want: &[Want]) -> Result<(), String> {
    if list.len() != want.len() {
        return Err(format!("takes {} {what}s, got {}", want.len(), list.len()));
    }
    for (pos, (&t, w)) in list.iter().zip(want).enumerate() {
        let x = p.tensor(t);
        let (ok, elems, dt) = match *w {
            Want::Float(e) => (
                matches!(x.dtype, DType::F32 | DType::BF16),
                e,
                "f32 or bf16",
            ),
            Want::F32(e) => (x.dtype == DType::F32, e, "f32"),
            Want::I32(e) => (x.dtype == DType::I32, e, "i32"),
        };
        if !ok {
            return Err(format!(
                "{what} {pos} {:?} is {}, expected {dt}",
                x.name, x.dtype
            ));
        }
        if x.elements() != elems {
            return Err(format!(
                "{what} {pos} {:?} has {} elements (shape {:?}), expected {elems}",
                x.name,
                x.elements(),
                x.shape
            ));
        }
    }
    Ok(())
}
