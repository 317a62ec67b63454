//! The typed kernels an instruction runs, with their operand signatures.
//!
//! Each variant's exact semantics (formulas, operand order, shapes) is in
//! `docs/ops.md`; the variant docs here give the operands. Shapes use `B`
//! batch, `T` sequence, `C` width, `H` heads, `D = C / H`, `V` vocabulary,
//! `R` rows, `E` elements, `W` world size. "float" is f32 (or bf16 where a
//! backend takes it); statistics, losses and norms are always f32.

mod operands;

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
    /// Multiplies `q·k` (usually `1/√D`). Hyper-parameters are kept as the
    /// graph gives them (f64); a kernel computes with them in its own
    /// precision (f32 on every backend today).
    pub scale: f64,
}

impl Attention {
    /// Multi-head attention (as many key/value heads as query heads).
    pub fn mha(batch: u64, heads: u64, seq: u64, head_dim: u64, scale: f64) -> Attention {
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
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    /// AdamW: decay the weights directly (`w -= lr·wd·w`) instead of adding
    /// `wd·w` to the gradient (Adam).
    pub decoupled: bool,
    /// Step number of the first execution (bias correction uses
    /// `first_step + steps run so far`).
    pub first_step: u64,
    /// Clip by global norm: the second input is the norm (or its square).
    pub max_norm: Option<f64>,
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
    LayerNorm { rows: u64, cols: u64, eps: f64 },
    /// in `[dy RC, x RC, mean R, rstd R, gamma C]`, out `[dx RC, dgamma C, dbeta C]`.
    LayerNormBackward { rows: u64, cols: u64 },
    /// in `[x RC, gamma C]`, out `[y RC, rstd f32 R]` (RMSNorm).
    RmsNorm { rows: u64, cols: u64, eps: f64 },
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
    /// in `[a KM, b KN]`, updates `[c MN]`: `c += aᵀ b` (`matmul_tn` with
    /// `accumulate`: the weight gradient of a split chain, chunk by chunk).
    MatmulTnAccumulate(Matmul),
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
    /// in `[x E]` in device memory, out (or update) `[x E]` in host
    /// memory, any dtype, the bytes as they are: an offloaded tensor's copy
    /// to the host (docs/offload.md).
    CopyToHost { elements: u64 },
    /// in `[x E]` in host memory, out `[x E]` in device memory, any dtype:
    /// an offloaded tensor's copy back.
    CopyToDevice { elements: u64 },
    /// in `[x E]`, out `[gelu(x)]` (tanh approximation).
    Gelu { elements: u64 },
    /// in `[dy E, x E]`, out `[dx E]`.
    GeluBackward { elements: u64 },
    /// in `[x E]`, out `[max(x, 0)]`.
    Relu { elements: u64 },
    /// in `[dy E, x E]`, out `[dy · (x > 0)]`.
    ReluBackward { elements: u64 },
    /// in `[logits RV, targets i32 R]`, out `[loss f32 1]`: the sum over
    /// rows divided by `divisor` (`rows`: the mean; a chunk of a split
    /// loss divides by the rows of the whole batch).
    CrossEntropy {
        rows: u64,
        classes: u64,
        divisor: u64,
    },
    /// in `[logits RV, targets i32 R]`, out `[dlogits RV]`.
    CrossEntropyBackward { rows: u64, classes: u64, scale: f64 },
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
            Kernel::MatmulTn(_) | Kernel::MatmulTnAccumulate(_) => "matmul_tn",
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
            Kernel::CopyToHost { .. } => "copy_to_host",
            Kernel::CopyToDevice { .. } => "copy_to_device",
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
}
