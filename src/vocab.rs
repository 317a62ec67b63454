//! The op vocabulary: the ops memplan's executors run, as graph ops (an
//! `op_type` and attributes, `docs/ops.md`) and as typed
//! [`memplan_runtime::Kernel`]s, converted both ways here and nowhere
//! else.
//!
//! The built-in models, the sharding transform and the splitting pass
//! describe each op as a `Kernel` and write it with [`spec`]; the
//! executors' program ([`crate::exec`]) reads it back with [`kernel`].
//! [`write`] writes every attribute of a kernel; [`kernel`] also reads the
//! graphs written by hand or by older versions, where an optional
//! attribute is left out (`kv_heads` = `heads`, `positions` = true,
//! `accumulate` = false, `divisor` = `rows`, Adam's betas 0.9 and 0.999,
//! `eps` 1e-8, no weight decay, first step 1).
//!
//! Adding an op: a `Kernel` variant (its operands and formula in
//! `docs/ops.md`, its `op_type` in `Kernel::name`), its name in
//! [`OP_TYPES`] and its arms in [`write`] and [`kernel`], its cost in [`crate::cost`], and one kernel
//! per backend in `runtime/`.

use serde_json::{Map, Value, json};

use memplan_runtime::{self as rt, AdamParams, Attention, Kernel, Matmul, ReduceOp, Rope};

use crate::error::Error;
use crate::graph::{Op, OpKind, OpSpec};

pub(crate) fn bad_op(op: &Op, why: impl std::fmt::Display) -> Error {
    Error::Unsupported(format!("op {:?} ({}): {why}", op.name, op.op_type))
}

/// Typed access to an op's attributes with errors that name the op.
pub(crate) struct Attrs<'a> {
    op: &'a Op,
    map: &'a Map<String, Value>,
}

impl<'a> Attrs<'a> {
    pub(crate) fn new(op: &'a Op) -> Self {
        Attrs { op, map: &op.attrs }
    }
    pub(crate) fn get(&self, key: &str) -> Result<&'a Value, Error> {
        self.map
            .get(key)
            .ok_or_else(|| bad_op(self.op, format!("missing attribute {key:?}")))
    }
    pub(crate) fn u64(&self, key: &str) -> Result<u64, Error> {
        let v = self.get(key)?;
        v.as_u64()
            .or_else(|| {
                v.as_f64()
                    .filter(|f| f.fract() == 0.0 && *f >= 0.0)
                    .map(|f| f as u64)
            })
            .ok_or_else(|| {
                bad_op(
                    self.op,
                    format!("attribute {key:?} must be a non-negative integer, got {v}"),
                )
            })
    }
    pub(crate) fn real(&self, key: &str) -> Result<f64, Error> {
        let v = self.get(key)?;
        v.as_f64().ok_or_else(|| {
            bad_op(
                self.op,
                format!("attribute {key:?} must be a number, got {v}"),
            )
        })
    }
    pub(crate) fn opt_real(&self, key: &str) -> Result<Option<f64>, Error> {
        match self.map.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(_) => self.real(key).map(Some),
        }
    }
    pub(crate) fn bool_or(&self, key: &str, default: bool) -> Result<bool, Error> {
        match self.map.get(key) {
            None | Some(Value::Null) => Ok(default),
            Some(v) => v.as_bool().ok_or_else(|| {
                bad_op(
                    self.op,
                    format!("attribute {key:?} must be true or false, got {v}"),
                )
            }),
        }
    }
    pub(crate) fn u64_list(&self, key: &str) -> Result<Vec<u64>, Error> {
        let v = self.get(key)?;
        v.as_array()
            .and_then(|a| a.iter().map(|x| x.as_u64()).collect::<Option<Vec<_>>>())
            .ok_or_else(|| {
                bad_op(
                    self.op,
                    format!("attribute {key:?} must be a list of non-negative integers"),
                )
            })
    }
    pub(crate) fn matmul(&self) -> Result<Matmul, Error> {
        Ok(Matmul {
            m: self.u64("m")?,
            k: self.u64("k")?,
            n: self.u64("n")?,
        })
    }
    pub(crate) fn u64_or(&self, key: &str, default: u64) -> Result<u64, Error> {
        match self.map.get(key) {
            None | Some(Value::Null) => Ok(default),
            Some(_) => self.u64(key),
        }
    }
    pub(crate) fn attention(&self) -> Result<Attention, Error> {
        let heads = self.u64("heads")?;
        Ok(Attention {
            batch: self.u64("batch")?,
            heads,
            kv_heads: self.u64_or("kv_heads", heads)?,
            seq: self.u64("seq")?,
            head_dim: self.u64("head_dim")?,
            scale: self.real("scale")?,
        })
    }
    pub(crate) fn rope(&self, inverse: bool) -> Result<Rope, Error> {
        let heads = self.u64("heads")?;
        let theta = self
            .get("theta")?
            .as_f64()
            .ok_or_else(|| bad_op(self.op, "attribute \"theta\" must be a number".to_string()))?;
        Ok(Rope {
            batch: self.u64("batch")?,
            seq: self.u64("seq")?,
            heads,
            kv_heads: self.u64_or("kv_heads", heads)?,
            head_dim: self.u64("head_dim")?,
            theta,
            inverse,
        })
    }
    pub(crate) fn reduce_op(&self) -> Result<ReduceOp, Error> {
        match self.map.get("op").and_then(|v| v.as_str()) {
            None | Some("sum") => Ok(ReduceOp::Sum),
            Some("avg") => Ok(ReduceOp::Avg),
            Some(other) => Err(bad_op(
                self.op,
                format!("attribute \"op\" must be \"sum\" or \"avg\", got {other:?}"),
            )),
        }
    }
    pub(crate) fn chunks(&self) -> Result<rt::ChunkLayout, Error> {
        Ok(rt::ChunkLayout {
            world: self.world()?,
            shard: self.u64("shard")?,
            offsets: self.u64_list("offsets")?,
            chunks: self.u64_list("chunks")?,
        })
    }
    pub(crate) fn world(&self) -> Result<u32, Error> {
        let w = self.u64("world_size")?;
        u32::try_from(w).map_err(|_| bad_op(self.op, format!("world_size {w} is too large")))
    }
}

/// The kernel an op runs, from its `op_type` and attributes.
pub fn kernel(op: &Op) -> Result<Kernel, Error> {
    let a = Attrs::new(op);
    let elements = || a.u64("elements");
    Ok(match op.op_type.as_str() {
        "embedding" => Kernel::Embedding {
            batch: a.u64("batch")?,
            seq: a.u64("seq")?,
            width: a.u64("width")?,
            vocab: a.u64("vocab")?,
            positions: a.bool_or("positions", true)?,
        },
        "embedding_backward" => Kernel::EmbeddingBackward {
            batch: a.u64("batch")?,
            seq: a.u64("seq")?,
            width: a.u64("width")?,
            vocab: a.u64("vocab")?,
            accumulate: a.bool_or("accumulate", false)?,
            positions: a.bool_or("positions", true)?,
        },
        "rmsnorm" => Kernel::RmsNorm {
            rows: a.u64("rows")?,
            cols: a.u64("cols")?,
            eps: a.opt_real("eps")?.unwrap_or(1e-6),
        },
        "rmsnorm_backward" => Kernel::RmsNormBackward {
            rows: a.u64("rows")?,
            cols: a.u64("cols")?,
        },
        "rope" => Kernel::Rope(a.rope(false)?),
        "rope_backward" => Kernel::Rope(a.rope(true)?),
        "cast" => Kernel::Cast {
            elements: elements()?,
        },
        "copy_to_host" => Kernel::CopyToHost {
            elements: elements()?,
        },
        "copy_to_device" => Kernel::CopyToDevice {
            elements: elements()?,
        },
        "swiglu" => Kernel::SwiGlu {
            rows: a.u64("rows")?,
            hidden: a.u64("hidden")?,
        },
        "swiglu_backward" => Kernel::SwiGluBackward {
            rows: a.u64("rows")?,
            hidden: a.u64("hidden")?,
        },
        "layernorm" => Kernel::LayerNorm {
            rows: a.u64("rows")?,
            cols: a.u64("cols")?,
            eps: a.opt_real("eps")?.unwrap_or(1e-5),
        },
        "layernorm_backward" => Kernel::LayerNormBackward {
            rows: a.u64("rows")?,
            cols: a.u64("cols")?,
        },
        "linear" => Kernel::Linear(a.matmul()?),
        "linear_backward_data" => Kernel::LinearBackwardData(a.matmul()?),
        "linear_backward_weight" => Kernel::LinearBackwardWeight(a.matmul()?),
        "matmul_nt" => Kernel::MatmulNt(a.matmul()?),
        "matmul_nn" => Kernel::MatmulNn(a.matmul()?),
        "matmul_tn" if a.bool_or("accumulate", false)? => Kernel::MatmulTnAccumulate(a.matmul()?),
        "matmul_tn" => Kernel::MatmulTn(a.matmul()?),
        "attention_scores" => Kernel::AttentionScores(a.attention()?),
        "attention_scores_backward" => Kernel::AttentionScoresBackward(a.attention()?),
        "causal_softmax" => Kernel::CausalSoftmax(a.attention()?),
        "causal_softmax_backward" => Kernel::CausalSoftmaxBackward(a.attention()?),
        "attention_values" => Kernel::AttentionValues(a.attention()?),
        "attention_values_backward" => Kernel::AttentionValuesBackward(a.attention()?),
        "fused_attention" => Kernel::FusedAttention(a.attention()?),
        "fused_attention_backward" => Kernel::FusedAttentionBackward(a.attention()?),
        "add" => Kernel::Add {
            elements: elements()?,
        },
        "gelu" => Kernel::Gelu {
            elements: elements()?,
        },
        "gelu_backward" => Kernel::GeluBackward {
            elements: elements()?,
        },
        "relu" => Kernel::Relu {
            elements: elements()?,
        },
        "relu_backward" => Kernel::ReluBackward {
            elements: elements()?,
        },
        "cross_entropy" => Kernel::CrossEntropy {
            rows: a.u64("rows")?,
            classes: a.u64("classes")?,
            divisor: a.u64_or("divisor", a.u64("rows")?)?,
        },
        "cross_entropy_backward" => Kernel::CrossEntropyBackward {
            rows: a.u64("rows")?,
            classes: a.u64("classes")?,
            scale: a.real("scale")?,
        },
        "grad_norm" => Kernel::GradNorm {
            squared: a.bool_or("squared", false)?,
        },
        "adam" | "adamw" => Kernel::Adam(AdamParams {
            elements: elements()?,
            lr: a.real("lr")?,
            beta1: a.opt_real("beta1")?.unwrap_or(0.9),
            beta2: a.opt_real("beta2")?.unwrap_or(0.999),
            eps: a.opt_real("eps")?.unwrap_or(1e-8),
            weight_decay: a.opt_real("weight_decay")?.unwrap_or(0.0),
            decoupled: op.op_type == "adamw",
            first_step: match a.map.get("step") {
                None => 1,
                Some(_) => a.u64("step")?,
            },
            max_norm: match a.opt_real("clip")? {
                Some(c) => Some(c),
                None => a.opt_real("max_norm")?,
            },
            norm_squared: a.bool_or("norm_squared", false)?,
        }),
        "view" => Kernel::View,
        "pack" => Kernel::Pack {
            offsets: a.u64_list("offsets")?,
            elements: elements()?,
        },
        "chunk_cat" => Kernel::ChunkCat(a.chunks()?),
        "copy_out" => Kernel::CopyOut(a.chunks()?),
        "all_gather" => Kernel::AllGather { world: a.world()? },
        "reduce_scatter" => Kernel::ReduceScatter {
            world: a.world()?,
            op: a.reduce_op()?,
        },
        "all_reduce" => Kernel::AllReduce {
            world: a.world()?,
            op: a.reduce_op()?,
        },
        other => {
            return Err(bad_op(
                op,
                format!("the executor has no kernel for op type {other:?} (see docs/ops.md)"),
            ));
        }
    })
}

/// Every op type [`kernel`] reads, in `docs/ops.md`'s order.
pub const OP_TYPES: &[&str] = &[
    "embedding",
    "embedding_backward",
    "layernorm",
    "layernorm_backward",
    "rmsnorm",
    "rmsnorm_backward",
    "rope",
    "rope_backward",
    "swiglu",
    "swiglu_backward",
    "linear",
    "linear_backward_data",
    "linear_backward_weight",
    "matmul_nt",
    "matmul_nn",
    "matmul_tn",
    "attention_scores",
    "attention_scores_backward",
    "causal_softmax",
    "causal_softmax_backward",
    "attention_values",
    "attention_values_backward",
    "fused_attention",
    "fused_attention_backward",
    "add",
    "cast",
    "copy_to_host",
    "copy_to_device",
    "gelu",
    "gelu_backward",
    "relu",
    "relu_backward",
    "cross_entropy",
    "cross_entropy_backward",
    "grad_norm",
    "adam",
    "adamw",
    "view",
    "pack",
    "chunk_cat",
    "copy_out",
    "all_gather",
    "reduce_scatter",
    "all_reduce",
];

/// A graph op that runs `k`: its `op_type` and every attribute of `k`
/// (inputs, outputs and further attributes are the caller's).
pub fn spec(name: impl Into<String>, kind: OpKind, k: &Kernel) -> OpSpec {
    let mut s = OpSpec::new(name, kind, k.name());
    write(k, &mut s.attrs);
    s
}

/// Writes the attributes of `k` into `attrs` (replacing those of the same
/// names, keeping the others): the inverse of [`kernel`].
pub fn write(k: &Kernel, attrs: &mut Map<String, Value>) {
    let mut put = |key: &str, v: Value| {
        attrs.insert(key.to_string(), v);
    };
    let matmul = |put: &mut dyn FnMut(&str, Value), mm: &Matmul| {
        put("m", json!(mm.m));
        put("k", json!(mm.k));
        put("n", json!(mm.n));
    };
    let attention = |put: &mut dyn FnMut(&str, Value), a: &Attention| {
        put("batch", json!(a.batch));
        put("heads", json!(a.heads));
        put("kv_heads", json!(a.kv_heads));
        put("seq", json!(a.seq));
        put("head_dim", json!(a.head_dim));
        put("scale", json!(a.scale));
    };
    let chunks = |put: &mut dyn FnMut(&str, Value), c: &rt::ChunkLayout| {
        put("world_size", json!(c.world));
        put("shard", json!(c.shard));
        put("offsets", json!(c.offsets));
        put("chunks", json!(c.chunks));
    };
    let embedding = |put: &mut dyn FnMut(&str, Value), [b, t, c, v]: [&u64; 4]| {
        put("batch", json!(b));
        put("seq", json!(t));
        put("width", json!(c));
        put("vocab", json!(v));
    };
    let reduce = |op: &ReduceOp| match op {
        ReduceOp::Sum => json!("sum"),
        ReduceOp::Avg => json!("avg"),
    };
    match k {
        Kernel::Embedding {
            batch,
            seq,
            width,
            vocab,
            positions,
        } => {
            embedding(&mut put, [batch, seq, width, vocab]);
            put("positions", json!(positions));
        }
        Kernel::EmbeddingBackward {
            batch,
            seq,
            width,
            vocab,
            accumulate,
            positions,
        } => {
            embedding(&mut put, [batch, seq, width, vocab]);
            put("accumulate", json!(accumulate));
            put("positions", json!(positions));
        }
        Kernel::LayerNorm { rows, cols, eps } | Kernel::RmsNorm { rows, cols, eps } => {
            put("rows", json!(rows));
            put("cols", json!(cols));
            put("eps", json!(eps));
        }
        Kernel::LayerNormBackward { rows, cols } | Kernel::RmsNormBackward { rows, cols } => {
            put("rows", json!(rows));
            put("cols", json!(cols));
        }
        Kernel::Rope(r) => {
            put("batch", json!(r.batch));
            put("seq", json!(r.seq));
            put("heads", json!(r.heads));
            put("kv_heads", json!(r.kv_heads));
            put("head_dim", json!(r.head_dim));
            put("theta", json!(r.theta));
        }
        Kernel::SwiGlu { rows, hidden } | Kernel::SwiGluBackward { rows, hidden } => {
            put("rows", json!(rows));
            put("hidden", json!(hidden));
        }
        Kernel::Linear(mm)
        | Kernel::LinearBackwardData(mm)
        | Kernel::LinearBackwardWeight(mm)
        | Kernel::MatmulNt(mm)
        | Kernel::MatmulNn(mm)
        | Kernel::MatmulTn(mm) => matmul(&mut put, mm),
        Kernel::MatmulTnAccumulate(mm) => {
            matmul(&mut put, mm);
            put("accumulate", json!(true));
        }
        Kernel::AttentionScores(a)
        | Kernel::AttentionScoresBackward(a)
        | Kernel::CausalSoftmax(a)
        | Kernel::CausalSoftmaxBackward(a)
        | Kernel::AttentionValues(a)
        | Kernel::AttentionValuesBackward(a)
        | Kernel::FusedAttention(a)
        | Kernel::FusedAttentionBackward(a) => attention(&mut put, a),
        Kernel::Add { elements }
        | Kernel::Cast { elements }
        | Kernel::CopyToHost { elements }
        | Kernel::CopyToDevice { elements }
        | Kernel::Gelu { elements }
        | Kernel::GeluBackward { elements }
        | Kernel::Relu { elements }
        | Kernel::ReluBackward { elements } => put("elements", json!(elements)),
        Kernel::CrossEntropy {
            rows,
            classes,
            divisor,
        } => {
            put("rows", json!(rows));
            put("classes", json!(classes));
            put("divisor", json!(divisor));
        }
        Kernel::CrossEntropyBackward {
            rows,
            classes,
            scale,
        } => {
            put("rows", json!(rows));
            put("classes", json!(classes));
            put("scale", json!(scale));
        }
        Kernel::GradNorm { squared } => put("squared", json!(squared)),
        Kernel::Adam(p) => {
            put("elements", json!(p.elements));
            put("lr", json!(p.lr));
            put("beta1", json!(p.beta1));
            put("beta2", json!(p.beta2));
            put("eps", json!(p.eps));
            put("weight_decay", json!(p.weight_decay));
            put("step", json!(p.first_step));
            put("clip", json!(p.max_norm));
            put("norm_squared", json!(p.norm_squared));
        }
        Kernel::View => {}
        Kernel::Pack { offsets, elements } => {
            put("offsets", json!(offsets));
            put("elements", json!(elements));
        }
        Kernel::ChunkCat(c) | Kernel::CopyOut(c) => chunks(&mut put, c),
        Kernel::AllGather { world } => put("world_size", json!(world)),
        Kernel::ReduceScatter { world, op } | Kernel::AllReduce { world, op } => {
            put("world_size", json!(world));
            put("op", reduce(op));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::{EXAMPLES, ExampleOptions, example, fsdp};

    /// One kernel of every variant (and of each op type two share).
    fn samples() -> Vec<Kernel> {
        let mm = Matmul { m: 6, k: 5, n: 3 };
        let att = Attention {
            batch: 2,
            heads: 4,
            kv_heads: 2,
            seq: 8,
            head_dim: 16,
            scale: 0.25,
        };
        let rope = Rope {
            batch: 2,
            seq: 8,
            heads: 4,
            kv_heads: 2,
            head_dim: 16,
            theta: 500000.0,
            inverse: false,
        };
        vec![
            Kernel::Embedding {
                batch: 2,
                seq: 8,
                width: 16,
                vocab: 50,
                positions: false,
            },
            Kernel::EmbeddingBackward {
                batch: 2,
                seq: 8,
                width: 16,
                vocab: 50,
                accumulate: true,
                positions: true,
            },
            Kernel::LayerNorm {
                rows: 3,
                cols: 4,
                eps: 1e-5,
            },
            Kernel::LayerNormBackward { rows: 3, cols: 4 },
            Kernel::RmsNorm {
                rows: 3,
                cols: 4,
                eps: 1e-6,
            },
            Kernel::RmsNormBackward { rows: 3, cols: 4 },
            Kernel::Rope(rope),
            Kernel::Rope(Rope {
                inverse: true,
                ..rope
            }),
            Kernel::SwiGlu { rows: 3, hidden: 8 },
            Kernel::SwiGluBackward { rows: 3, hidden: 8 },
            Kernel::Linear(mm),
            Kernel::LinearBackwardData(mm),
            Kernel::LinearBackwardWeight(mm),
            Kernel::MatmulNt(mm),
            Kernel::MatmulNn(mm),
            Kernel::MatmulTn(mm),
            Kernel::MatmulTnAccumulate(mm),
            Kernel::AttentionScores(att),
            Kernel::AttentionScoresBackward(att),
            Kernel::CausalSoftmax(att),
            Kernel::CausalSoftmaxBackward(att),
            Kernel::AttentionValues(att),
            Kernel::AttentionValuesBackward(att),
            Kernel::FusedAttention(att),
            Kernel::FusedAttentionBackward(att),
        ]
        .into_iter()
        .chain(pointwise_and_update_samples())
        .collect()
    }

    /// The pointwise, loss, update, layout and collective kernels.
    fn pointwise_and_update_samples() -> Vec<Kernel> {
        let chunks = rt::ChunkLayout {
            world: 2,
            shard: 10,
            offsets: vec![0, 6],
            chunks: vec![6, 4],
        };
        let adam = AdamParams {
            elements: 12,
            lr: 3e-4,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
            decoupled: true,
            first_step: 3,
            max_norm: Some(1.0),
            norm_squared: true,
        };
        let e = 7;
        vec![
            Kernel::Add { elements: e },
            Kernel::Cast { elements: e },
            Kernel::CopyToHost { elements: e },
            Kernel::CopyToDevice { elements: e },
            Kernel::Gelu { elements: e },
            Kernel::GeluBackward { elements: e },
            Kernel::Relu { elements: e },
            Kernel::ReluBackward { elements: e },
            Kernel::CrossEntropy {
                rows: 6,
                classes: 50,
                divisor: 12,
            },
            Kernel::CrossEntropyBackward {
                rows: 6,
                classes: 50,
                scale: 1.0 / 12.0,
            },
            Kernel::GradNorm { squared: true },
            Kernel::Adam(adam),
            Kernel::Adam(AdamParams {
                decoupled: false,
                max_norm: None,
                ..adam
            }),
            Kernel::View,
            Kernel::Pack {
                offsets: vec![0, 4],
                elements: 9,
            },
            Kernel::ChunkCat(chunks.clone()),
            Kernel::CopyOut(chunks),
            Kernel::AllGather { world: 4 },
            Kernel::ReduceScatter {
                world: 4,
                op: ReduceOp::Avg,
            },
            Kernel::AllReduce {
                world: 4,
                op: ReduceOp::Sum,
            },
        ]
    }

    fn op(s: OpSpec) -> Op {
        Op {
            name: s.name,
            kind: s.kind,
            op_type: s.op_type,
            inputs: Vec::new(),
            outputs: Vec::new(),
            updates: Vec::new(),
            reuse: Vec::new(),
            after: Vec::new(),
            cost: None,
            flops: None,
            stream: 0,
            attrs: s.attrs,
        }
    }

    #[test]
    fn every_kernel_reads_back_as_written() {
        let mut types = std::collections::BTreeSet::new();
        for k in samples() {
            let o = op(spec("x", OpKind::Other, &k));
            assert!(OP_TYPES.contains(&o.op_type.as_str()), "{}", o.op_type);
            types.insert(o.op_type.clone());
            assert_eq!(kernel(&o).unwrap(), k, "{}", o.op_type);
        }
        let all: std::collections::BTreeSet<String> =
            OP_TYPES.iter().map(|t| t.to_string()).collect();
        assert_eq!(types, all, "a sample of every op type");
    }

    #[test]
    fn omitted_attributes_read_as_their_defaults() {
        let mut o = op(OpSpec::new("a", OpKind::Forward, "fused_attention"));
        for (k, v) in [("batch", 1), ("heads", 4), ("seq", 8), ("head_dim", 2)] {
            o.attrs.insert(k.into(), json!(v));
        }
        o.attrs.insert("scale".into(), json!(0.5));
        let Kernel::FusedAttention(a) = kernel(&o).unwrap() else {
            panic!("not attention")
        };
        assert_eq!(a.kv_heads, 4);
        let mut u = op(OpSpec::new("u", OpKind::Optimizer, "adam"));
        u.attrs.insert("elements".into(), json!(3));
        u.attrs.insert("lr".into(), json!(0.1));
        let Kernel::Adam(p) = kernel(&u).unwrap() else {
            panic!("not adam")
        };
        assert_eq!(
            (p.beta1, p.beta2, p.first_step, p.max_norm),
            (0.9, 0.999, 1, None)
        );
        let e = kernel(&op(OpSpec::new("m", OpKind::Forward, "matmul_nn"))).unwrap_err();
        assert!(e.to_string().contains("missing attribute \"m\""), "{e}");
    }

    /// The built-in steps, plain and sharded, are written in the
    /// vocabulary: every op's attributes are exactly what [`write`] makes
    /// of its kernel (plus attributes no kernel reads).
    #[test]
    fn built_in_steps_are_written_in_the_vocabulary() {
        let mut ops = 0;
        for name in EXAMPLES {
            for (checkpoint, mixed) in [(false, false), (true, true)] {
                let opts = ExampleOptions {
                    layers: Some(1),
                    seq: Some(16),
                    checkpoint,
                    mixed_precision: mixed && *name != "mlp",
                    clip_grad_norm: Some(1.0),
                    ..ExampleOptions::default()
                };
                let g = example(name, &opts).unwrap();
                let s = fsdp::shard(&g, 2).unwrap();
                for o in g.ops().iter().chain(s.ops()) {
                    if !OP_TYPES.contains(&o.op_type.as_str()) {
                        continue;
                    }
                    let k = kernel(o).unwrap_or_else(|e| panic!("{}: {e}", o.name));
                    let mut again = o.attrs.clone();
                    write(&k, &mut again);
                    assert_eq!(again, o.attrs, "{}", o.name);
                    ops += 1;
                }
            }
        }
        assert!(ops > 500, "{ops}");
    }
}
