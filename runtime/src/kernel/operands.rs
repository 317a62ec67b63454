//! Operand checks: what every kernel expects of the tensors an instruction
//! hands it (count, dtype, elements per slot), and the kernel's own
//! attributes (positive sizes, finite hyper-parameters). One function per
//! family of kernels; [`Kernel::check_operands`] dispatches.

use super::{AdamParams, Attention, Kernel, Matmul, Slot};
use crate::program::{DType, Instr, Program, TensorIdx};

/// What one operand must be.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Want {
    /// f32 or bf16.
    Float(u64),
    F32(u64),
    I32(u64),
}
use Want::*;

/// The operands a kernel expects, per slot.
struct Operands {
    inputs: Vec<Want>,
    outputs: Vec<Want>,
    updates: Vec<Want>,
}

/// Inputs and outputs, nothing updated in place.
fn io(inputs: Vec<Want>, outputs: Vec<Want>) -> Operands {
    Operands {
        inputs,
        outputs,
        updates: vec![],
    }
}

type Checked = Result<Operands, String>;

impl Kernel {
    /// Checks the operands of `ins` (which runs this kernel) against the
    /// kernel's signature.
    pub fn check_operands(&self, p: &Program, ins: &Instr) -> Result<(), String> {
        self.check_dims()?;
        if let Kernel::View = self {
            return check_view(p, ins);
        }
        if let Kernel::CopyToHost { elements } | Kernel::CopyToDevice { elements } = *self {
            return check_copy(p, ins, elements);
        }
        let want = self.operands(p, ins)?;
        check_list(p, "input", &ins.inputs, &want.inputs)?;
        check_list(p, "output", &ins.outputs, &want.outputs)?;
        check_list(p, "update", &ins.updates, &want.updates)
    }

    /// Every size attribute must be positive.
    fn check_dims(&self) -> Result<(), String> {
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
            | Kernel::MatmulTn(Matmul { m, k, n })
            | Kernel::MatmulTnAccumulate(Matmul { m, k, n }) => &[("m", *m), ("k", *k), ("n", *n)],
            Kernel::CrossEntropy { rows, classes, .. }
            | Kernel::CrossEntropyBackward { rows, classes, .. } => {
                &[("rows", *rows), ("classes", *classes)]
            }
            Kernel::AllGather { world }
            | Kernel::ReduceScatter { world, .. }
            | Kernel::AllReduce { world, .. } => &[("world_size", *world as u64)],
            _ => &[],
        };
        match dims.iter().find(|&&(_, v)| v == 0) {
            Some((what, _)) => Err(format!("{what} must be positive")),
            None => Ok(()),
        }
    }

    /// The operands this kernel expects of `ins` (views check themselves).
    fn operands(&self, p: &Program, ins: &Instr) -> Checked {
        match self {
            Kernel::Embedding { .. } | Kernel::EmbeddingBackward { .. } => {
                Ok(self.embedding_operands())
            }
            Kernel::RmsNorm { .. }
            | Kernel::RmsNormBackward { .. }
            | Kernel::LayerNorm { .. }
            | Kernel::LayerNormBackward { .. } => self.norm_operands(),
            Kernel::Linear(m)
            | Kernel::LinearBackwardData(m)
            | Kernel::LinearBackwardWeight(m)
            | Kernel::MatmulNt(m)
            | Kernel::MatmulNn(m)
            | Kernel::MatmulTn(m)
            | Kernel::MatmulTnAccumulate(m) => Ok(self.matmul_operands(m)),
            Kernel::AttentionScores(a)
            | Kernel::AttentionScoresBackward(a)
            | Kernel::CausalSoftmax(a)
            | Kernel::CausalSoftmaxBackward(a)
            | Kernel::AttentionValues(a)
            | Kernel::AttentionValuesBackward(a)
            | Kernel::FusedAttention(a)
            | Kernel::FusedAttentionBackward(a) => self.attention_operands(a),
            Kernel::Rope(_)
            | Kernel::SwiGlu { .. }
            | Kernel::SwiGluBackward { .. }
            | Kernel::Add { .. }
            | Kernel::Gelu { .. }
            | Kernel::Relu { .. }
            | Kernel::Cast { .. }
            | Kernel::GeluBackward { .. }
            | Kernel::ReluBackward { .. } => self.pointwise_operands(),
            Kernel::CrossEntropy { .. } | Kernel::CrossEntropyBackward { .. } => {
                self.loss_operands()
            }
            Kernel::GradNorm { .. } | Kernel::Adam(_) => self.optimizer_operands(p, ins),
            Kernel::Pack { .. } | Kernel::ChunkCat(_) | Kernel::CopyOut(_) => {
                self.packing_operands(p, ins)
            }
            Kernel::AllGather { .. } | Kernel::ReduceScatter { .. } | Kernel::AllReduce { .. } => {
                self.collective_operands(p, ins)
            }
            Kernel::View => unreachable!("views are checked by check_view"),
            Kernel::CopyToHost { .. } | Kernel::CopyToDevice { .. } => {
                unreachable!("copies are checked by check_copy")
            }
        }
    }

    fn embedding_operands(&self) -> Operands {
        match *self {
            Kernel::Embedding {
                batch,
                seq,
                width,
                vocab,
                positions,
            } => {
                let bt = batch * seq;
                let mut i = vec![I32(bt), Float(vocab * width)];
                if positions {
                    i.push(Float(seq * width));
                }
                io(i, vec![Float(bt * width)])
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
                if accumulate {
                    i.push(Float(vocab * width));
                }
                let mut o = vec![Float(vocab * width)];
                if positions {
                    o.push(Float(seq * width));
                }
                io(i, o)
            }
            _ => unreachable!("not an embedding kernel"),
        }
    }

    fn norm_operands(&self) -> Checked {
        // Checked as the kernels compute with it (f32).
        let check_eps = |eps: f64| {
            if (eps as f32).is_finite() && eps >= 0.0 {
                Ok(())
            } else {
                Err(format!("eps must be a non-negative number, got {eps}"))
            }
        };
        Ok(match *self {
            Kernel::RmsNorm { rows, cols, eps } => {
                check_eps(eps)?;
                io(
                    vec![Float(rows * cols), Float(cols)],
                    vec![Float(rows * cols), F32(rows)],
                )
            }
            Kernel::RmsNormBackward { rows, cols } => io(
                vec![
                    Float(rows * cols),
                    Float(rows * cols),
                    F32(rows),
                    Float(cols),
                ],
                vec![Float(rows * cols), Float(cols)],
            ),
            Kernel::LayerNorm { rows, cols, eps } => {
                check_eps(eps)?;
                io(
                    vec![Float(rows * cols), Float(cols), Float(cols)],
                    vec![Float(rows * cols), F32(rows), F32(rows)],
                )
            }
            Kernel::LayerNormBackward { rows, cols } => io(
                vec![
                    Float(rows * cols),
                    Float(rows * cols),
                    F32(rows),
                    F32(rows),
                    Float(cols),
                ],
                vec![Float(rows * cols), Float(cols), Float(cols)],
            ),
            _ => unreachable!("not a norm kernel"),
        })
    }

    fn matmul_operands(&self, &Matmul { m, k, n }: &Matmul) -> Operands {
        match self {
            Kernel::Linear(_) => io(
                vec![Float(m * k), Float(k * n), Float(n)],
                vec![Float(m * n)],
            ),
            Kernel::LinearBackwardData(_) => {
                io(vec![Float(m * n), Float(k * n)], vec![Float(m * k)])
            }
            Kernel::LinearBackwardWeight(_) => io(
                vec![Float(m * n), Float(m * k)],
                vec![Float(k * n), Float(n)],
            ),
            Kernel::MatmulTnAccumulate(_) => Operands {
                inputs: vec![Float(m * k), Float(k * n)],
                outputs: vec![],
                updates: vec![Float(m * n)],
            },
            _ => io(vec![Float(m * k), Float(k * n)], vec![Float(m * n)]),
        }
    }

    fn attention_operands(&self, a: &Attention) -> Checked {
        let fused = matches!(
            self,
            Kernel::FusedAttention(_) | Kernel::FusedAttentionBackward(_)
        );
        check_attention(a, fused)?;
        let (qkv, probs, out) = (Float(a.qkv()), Float(a.probs()), Float(a.out()));
        Ok(match self {
            Kernel::AttentionScores(_) => io(vec![qkv], vec![probs]),
            Kernel::AttentionScoresBackward(_) => Operands {
                inputs: vec![probs, qkv],
                outputs: vec![],
                updates: vec![qkv],
            },
            Kernel::CausalSoftmax(_) => io(vec![probs], vec![probs]),
            Kernel::CausalSoftmaxBackward(_) => io(vec![probs, probs], vec![probs]),
            Kernel::AttentionValues(_) => io(vec![probs, qkv], vec![out]),
            Kernel::AttentionValuesBackward(_) => io(vec![out, probs, qkv], vec![probs, qkv]),
            Kernel::FusedAttention(_) => io(vec![qkv], vec![out, F32(a.rows())]),
            Kernel::FusedAttentionBackward(_) => io(vec![out, qkv, out, F32(a.rows())], vec![qkv]),
            _ => unreachable!("not an attention kernel"),
        })
    }

    fn pointwise_operands(&self) -> Checked {
        Ok(match *self {
            Kernel::Rope(ref r) => {
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
                io(vec![Float(r.elements())], vec![Float(r.elements())])
            }
            Kernel::SwiGlu { rows, hidden } => {
                io(vec![Float(2 * rows * hidden)], vec![Float(rows * hidden)])
            }
            Kernel::SwiGluBackward { rows, hidden } => io(
                vec![Float(rows * hidden), Float(2 * rows * hidden)],
                vec![Float(2 * rows * hidden)],
            ),
            Kernel::Add { elements }
            | Kernel::GeluBackward { elements }
            | Kernel::ReluBackward { elements } => io(
                vec![Float(elements), Float(elements)],
                vec![Float(elements)],
            ),
            Kernel::Gelu { elements } | Kernel::Relu { elements } | Kernel::Cast { elements } => {
                io(vec![Float(elements)], vec![Float(elements)])
            }
            _ => unreachable!("not a pointwise kernel"),
        })
    }

    fn loss_operands(&self) -> Checked {
        match *self {
            Kernel::CrossEntropy {
                rows,
                classes,
                divisor,
            } => {
                if classes == 0 || divisor < rows {
                    return Err("classes must be positive and divisor at least rows".into());
                }
                Ok(io(vec![Float(rows * classes), I32(rows)], vec![F32(1)]))
            }
            Kernel::CrossEntropyBackward {
                rows,
                classes,
                scale,
            } => {
                if classes == 0 || !scale.is_finite() {
                    return Err("classes must be positive and scale finite".into());
                }
                Ok(io(
                    vec![Float(rows * classes), I32(rows)],
                    vec![Float(rows * classes)],
                ))
            }
            _ => unreachable!("not a loss kernel"),
        }
    }

    fn optimizer_operands(&self, p: &Program, ins: &Instr) -> Checked {
        match self {
            Kernel::GradNorm { .. } => {
                // Any number of float tensors in, one f32 norm out.
                if ins.inputs.is_empty() {
                    return Err("grad_norm needs at least one input".into());
                }
                let i = ins
                    .inputs
                    .iter()
                    .map(|&t| Float(p.tensor(t).elements()))
                    .collect();
                Ok(io(i, vec![F32(1)]))
            }
            Kernel::Adam(a) => adam_operands(a, ins),
            _ => unreachable!("not an optimizer kernel"),
        }
    }

    fn packing_operands(&self, p: &Program, ins: &Instr) -> Checked {
        let l = match self {
            Kernel::Pack { offsets, elements } => return check_pack(p, ins, offsets, *elements),
            Kernel::ChunkCat(l) | Kernel::CopyOut(l) => l,
            _ => unreachable!("not a packing kernel"),
        };
        let gather = matches!(self, Kernel::ChunkCat(_));
        let (parts, flat) = if gather {
            (&ins.inputs, &ins.outputs)
        } else {
            (&ins.outputs, &ins.inputs)
        };
        let sizes: Vec<u64> = parts.iter().map(|&t| p.tensor(t).elements()).collect();
        l.check(&sizes)?;
        // The parts share a dtype; `chunk_cat` may write another (FSDP2
        // packs bf16 gradients into an f32 reduce-scatter input), `copy_out`
        // converts nothing.
        let want = if gather { parts.first() } else { flat.first() };
        if let Some(&w) = want
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
        Ok(if gather {
            io(parts, flat)
        } else {
            io(flat, parts)
        })
    }

    fn collective_operands(&self, p: &Program, ins: &Instr) -> Checked {
        Ok(match *self {
            Kernel::AllGather { world } => {
                let s = shard_of(p, ins, Slot::Input)?;
                io(vec![Float(s)], vec![Float(s * world as u64)])
            }
            Kernel::ReduceScatter { world, .. } => {
                let s = shard_of(p, ins, Slot::Output)?;
                io(vec![Float(s * world as u64)], vec![Float(s)])
            }
            Kernel::AllReduce { .. } => {
                let e = ins.updates.first().map_or(0, |&t| p.tensor(t).elements());
                Operands {
                    inputs: vec![],
                    outputs: vec![],
                    updates: vec![Float(e)],
                }
            }
            _ => unreachable!("not a collective kernel"),
        })
    }
}

/// Adam's hyper-parameters must be finite with betas in `[0, 1)`, as the
/// update computes with them (f32); it reads
/// the gradient (and the clip coefficient when clipping) and updates the
/// parameter and both moments, with an optional copy of the parameter out.
fn adam_operands(a: &AdamParams, ins: &Instr) -> Checked {
    for (what, x) in [
        ("lr", a.lr),
        ("beta1", a.beta1),
        ("beta2", a.beta2),
        ("eps", a.eps),
        ("weight_decay", a.weight_decay),
    ] {
        if !(x as f32).is_finite() {
            return Err(format!("{what} must be finite, got {x}"));
        }
    }
    if !(0.0..1.0).contains(&(a.beta1 as f32)) || !(0.0..1.0).contains(&(a.beta2 as f32)) {
        return Err(format!(
            "betas must lie in [0, 1), got {} and {}",
            a.beta1, a.beta2
        ));
    }
    if a.first_step == 0 {
        return Err("the first step number is 1, got 0".into());
    }
    let e = a.elements;
    let mut inputs = vec![Float(e)];
    if a.max_norm.is_some() {
        inputs.push(F32(1));
    }
    let outputs = if ins.outputs.len() == 1 {
        vec![Float(e)]
    } else {
        vec![]
    };
    Ok(Operands {
        inputs,
        outputs,
        updates: vec![Float(e), Float(e), Float(e)],
    })
}

/// A view takes its base and makes views of it; it updates nothing.
fn check_view(p: &Program, ins: &Instr) -> Result<(), String> {
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
    Ok(())
}

/// `pack` puts its inputs at increasing, non-overlapping offsets of one
/// flat output of `elements`.
fn check_pack(p: &Program, ins: &Instr, offsets: &[u64], elements: u64) -> Checked {
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
        if off < end || off + x.elements() > elements {
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
    Ok(io(i, vec![Float(elements)]))
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
    if !(a.scale as f32).is_finite() {
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

/// A copy between device and host memory: one input, one output or one
/// update, of the same dtype and `elements` elements.
fn check_copy(p: &Program, ins: &Instr, elements: u64) -> Result<(), String> {
    let dst: Vec<TensorIdx> = ins.outputs.iter().chain(&ins.updates).copied().collect();
    let ([src], [dst]) = (&ins.inputs[..], &dst[..]) else {
        return Err("a copy reads one tensor and writes one (an output or an update)".into());
    };
    let (a, b) = (p.tensor(*src), p.tensor(*dst));
    if a.dtype != b.dtype || a.elements() != elements || b.elements() != elements {
        return Err(format!(
            "a copy of {elements} elements: {:?} is {} x {}, {:?} is {} x {}",
            a.name,
            a.elements(),
            a.dtype,
            b.name,
            b.elements(),
            b.dtype
        ));
    }
    Ok(())
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
