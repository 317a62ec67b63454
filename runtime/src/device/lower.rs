//! Lowering one instruction to device operations, by kernel family: each
//! family's function turns its kernels into launches of `kernels.cu`,
//! cuBLAS calls, memsets, copies and collectives over byte offsets of the
//! device allocation ([`DeviceLayout`]).

use super::{
    Arg, AttentionLowering, Buf, CollectiveOp, DevKernel, DevOp, DeviceLayout, FLASH_MAX_HEAD_DIM,
    FLASH_ROWS, Launch, MMA_MAX_HEAD_DIM, MMA_ROWS, RowMajor, check_launch, elementwise,
    gemm_attention, gemm_row_major, per_row,
};
use crate::binding::{Bindings, InstrBinding};
use crate::error::{Result, RuntimeError};
use crate::kernel::{Attention, Kernel};
use crate::program::{DType, Instr, Program, TensorIdx};

/// The device operations of instruction `index` of `prog`, in order: the
/// copies of staged inputs, then the operations of its kernel's family.
pub fn lower(
    prog: &Program,
    b: &Bindings,
    layout: &DeviceLayout,
    index: usize,
) -> Result<Vec<DevOp>> {
    let ins = &prog.instrs[index];
    let a = Addr {
        p: prog,
        ins,
        bind: &b.instrs[index],
        layout,
        index,
    };
    let mut ops = Vec::new();
    for &(pos, w) in &a.bind.staged {
        let x = prog.tensor(ins.inputs[pos]);
        ops.push(DevOp::Copy {
            src: x.offset,
            dst: layout.staging + w,
            bytes: x.bytes(),
        });
    }
    match &ins.kernel {
        Kernel::Embedding { .. } | Kernel::EmbeddingBackward { .. } => embedding(&a, &mut ops)?,
        Kernel::LayerNorm { .. } | Kernel::LayerNormBackward { .. } => layernorm(&a, &mut ops)?,
        Kernel::RmsNorm { .. }
        | Kernel::RmsNormBackward { .. }
        | Kernel::Rope(_)
        | Kernel::SwiGlu { .. }
        | Kernel::SwiGluBackward { .. } => decoder(&a, &mut ops)?,
        Kernel::Linear(_)
        | Kernel::LinearBackwardData(_)
        | Kernel::LinearBackwardWeight(_)
        | Kernel::MatmulNt(_)
        | Kernel::MatmulNn(_)
        | Kernel::MatmulTn(_)
        | Kernel::MatmulTnAccumulate(_) => products(&a, &mut ops)?,
        Kernel::AttentionScores(_)
        | Kernel::CausalSoftmax(_)
        | Kernel::AttentionValues(_)
        | Kernel::AttentionValuesBackward(_)
        | Kernel::CausalSoftmaxBackward(_)
        | Kernel::AttentionScoresBackward(_) => attention(&a, &mut ops)?,
        Kernel::FusedAttention(_) | Kernel::FusedAttentionBackward(_) => {
            fused_attention(&a, &mut ops)?
        }
        Kernel::Cast { .. } => cast(&a, &mut ops)?,
        Kernel::CopyToHost { .. } | Kernel::CopyToDevice { .. } => {
            return Err(RuntimeError::InvalidInstr {
                instr: ins.name.clone(),
                why: "copies between device and host memory (an offloaded step, docs/offload.md) are run by the CPU executor only, not yet on CUDA".into(),
            });
        }
        Kernel::Add { .. }
        | Kernel::Gelu { .. }
        | Kernel::GeluBackward { .. }
        | Kernel::Relu { .. }
        | Kernel::ReluBackward { .. } => pointwise(&a, &mut ops)?,
        Kernel::CrossEntropy { .. } | Kernel::CrossEntropyBackward { .. } => loss(&a, &mut ops)?,
        Kernel::GradNorm { .. } | Kernel::Adam(_) => optimizer(&a, &mut ops)?,
        Kernel::View
        | Kernel::Pack { .. }
        | Kernel::ChunkCat(_)
        | Kernel::CopyOut(_)
        | Kernel::AllGather { .. }
        | Kernel::ReduceScatter { .. }
        | Kernel::AllReduce { .. } => layout_and_collectives(&a, &mut ops)?,
    }
    Ok(ops)
}

/// A kernel handed to the wrong family's lowering (a bug in [`lower`]).
fn misrouted(k: &Kernel, family: &str) -> RuntimeError {
    RuntimeError::InvalidProgram(format!(
        "internal error: kernel {} lowered as {family}",
        k.name()
    ))
}

/// Token and position embedding, forward and backward.
fn embedding(a: &Addr<'_>, ops: &mut Vec<DevOp>) -> Result<()> {
    let err = Arg::Ptr(a.layout.error_word);
    let code = Arg::I32(a.index as i32 + 1);
    match &a.ins.kernel {
        Kernel::Embedding {
            batch,
            seq,
            width,
            vocab,
            positions,
        } => {
            let bt = batch * seq;
            let wpe = if *positions { a.fi(2) } else { null() };
            ops.push(elementwise(
                DevKernel::EmbeddingFwd,
                bt * width,
                vec![
                    p(a.i(0)),
                    a.fi(1),
                    wpe,
                    a.fo(0),
                    n(bt),
                    n(*seq),
                    n(*width),
                    n(*vocab),
                    err,
                    code,
                ],
            ));
        }
        Kernel::EmbeddingBackward {
            batch,
            seq,
            width,
            vocab,
            accumulate,
            positions,
        } => {
            // The bucket sort of `embedding_count` .. `embedding_bwd_rows`
            // in scratch: bucket starts, fill counters, token order.
            let bt = batch * seq;
            let start = a.layout.scratch;
            let fill = start + 4 * (vocab + 1);
            let order = fill + 4 * vocab;
            ops.push(DevOp::Memset {
                at: start,
                bytes: 4 * (2 * vocab + 1),
            });
            ops.push(elementwise(
                DevKernel::EmbeddingCount,
                bt,
                vec![p(a.i(1)), p(start), n(bt), n(*vocab), err, code],
            ));
            ops.push(DevOp::Launch(Launch {
                kernel: DevKernel::ScanCounts,
                grid: 1,
                block: 1024,
                args: vec![p(start), n(vocab + 1)],
            }));
            ops.push(elementwise(
                DevKernel::EmbeddingPlace,
                bt,
                vec![p(a.i(1)), p(start), p(fill), p(order), n(bt), n(*vocab)],
            ));
            let init = if *accumulate { a.fi(2) } else { null() };
            ops.push(per_row(
                DevKernel::EmbeddingBwdRows,
                *vocab,
                *width,
                vec![
                    a.fi(0),
                    p(start),
                    p(order),
                    init,
                    a.fo(0),
                    n(*vocab),
                    n(*width),
                ],
            )?);
            if *positions {
                ops.push(elementwise(
                    DevKernel::EmbeddingBwdPositions,
                    seq * width,
                    vec![a.fi(0), a.fo(1), n(*batch), n(*seq), n(*width)],
                ));
            }
        }
        other => return Err(misrouted(other, "embedding")),
    }
    Ok(())
}

/// RMSNorm, rotary embedding and SwiGLU (Llama-style decoders).
fn decoder(a: &Addr<'_>, ops: &mut Vec<DevOp>) -> Result<()> {
    match &a.ins.kernel {
        Kernel::RmsNorm { rows, cols, eps } => ops.push(per_row(
            DevKernel::RmsnormFwd,
            *rows,
            *cols,
            vec![
                a.fi(0),
                a.fi(1),
                a.fo(0),
                a.fo(1),
                n(*rows),
                n(*cols),
                Arg::F32(*eps as f32),
            ],
        )?),
        Kernel::RmsNormBackward { rows, cols } => {
            // The parameter gradient first: the data kernel may overwrite dy.
            ops.push(elementwise(
                DevKernel::RmsnormBwdParams,
                *cols,
                vec![a.fi(0), a.fi(1), a.fi(2), a.fo(1), n(*rows), n(*cols)],
            ));
            ops.push(per_row(
                DevKernel::RmsnormBwdData,
                *rows,
                *cols,
                vec![
                    a.fi(0),
                    a.fi(1),
                    a.fi(2),
                    a.fi(3),
                    a.fo(0),
                    n(*rows),
                    n(*cols),
                ],
            )?);
        }
        Kernel::Rope(r) => {
            let rows = r.batch * r.seq;
            let rot_heads = r.heads + r.kv_heads;
            let width = (r.heads + 2 * r.kv_heads) * r.head_dim;
            let sign = if r.inverse { -1.0 } else { 1.0 };
            ops.push(elementwise(
                DevKernel::RopeFwd,
                rows * rot_heads * (r.head_dim / 2),
                vec![
                    a.fi(0),
                    a.fo(0),
                    n(rows),
                    n(r.seq),
                    n(rot_heads),
                    n(width),
                    n(r.head_dim),
                    Arg::F64(r.theta),
                    Arg::F32(sign),
                ],
            ));
        }
        Kernel::SwiGlu { rows, hidden } => ops.push(elementwise(
            DevKernel::SwigluFwd,
            rows * hidden,
            vec![a.fi(0), a.fo(0), n(*rows), n(*hidden)],
        )),
        Kernel::SwiGluBackward { rows, hidden } => ops.push(elementwise(
            DevKernel::SwigluBwd,
            rows * hidden,
            vec![a.fi(0), a.fi(1), a.fo(0), n(*rows), n(*hidden)],
        )),
        other => return Err(misrouted(other, "decoder")),
    }
    Ok(())
}

/// LayerNorm, forward and backward.
fn layernorm(a: &Addr<'_>, ops: &mut Vec<DevOp>) -> Result<()> {
    match &a.ins.kernel {
        Kernel::LayerNorm { rows, cols, eps } => ops.push(per_row(
            DevKernel::LayernormFwd,
            *rows,
            *cols,
            vec![
                a.fi(0),
                a.fi(1),
                a.fi(2),
                a.fo(0),
                a.fo(1),
                a.fo(2),
                n(*rows),
                n(*cols),
                Arg::F32(*eps as f32),
            ],
        )?),
        Kernel::LayerNormBackward { rows, cols } => {
            // Parameter gradients first: the data kernel may overwrite dy.
            ops.push(elementwise(
                DevKernel::LayernormBwdParams,
                *cols,
                vec![
                    a.fi(0),
                    a.fi(1),
                    a.fi(2),
                    a.fi(3),
                    a.fo(1),
                    a.fo(2),
                    n(*rows),
                    n(*cols),
                ],
            ));
            ops.push(per_row(
                DevKernel::LayernormBwdData,
                *rows,
                *cols,
                vec![
                    a.fi(0),
                    a.fi(1),
                    a.fi(2),
                    a.fi(3),
                    a.fi(4),
                    a.fo(0),
                    n(*rows),
                    n(*cols),
                ],
            )?);
        }
        other => return Err(misrouted(other, "layernorm")),
    }
    Ok(())
}

/// Linear layers and plain matrix products: cuBLAS calls (plus the bias).
fn products(a: &Addr<'_>, ops: &mut Vec<DevOp>) -> Result<()> {
    match &a.ins.kernel {
        Kernel::Linear(mm) => {
            ops.push(elementwise(
                DevKernel::FillRows,
                mm.m * mm.n,
                vec![a.fo(0), a.fi(2), n(mm.m), n(mm.n)],
            ));
            ops.push(DevOp::Gemm(gemm_row_major(
                mm.m,
                mm.n,
                mm.k,
                1.0,
                RowMajor::new(a.i(0), mm.k, a.di(0)),
                RowMajor::new(a.i(1), mm.n, a.di(1)),
                1.0,
                RowMajor::new(a.o(0), mm.n, a.dout(0)),
                1,
            )?));
        }
        Kernel::LinearBackwardData(mm) => ops.push(DevOp::Gemm(gemm_row_major(
            mm.m,
            mm.k,
            mm.n,
            1.0,
            RowMajor::new(a.i(0), mm.n, a.di(0)),
            RowMajor::new(a.i(1), mm.n, a.di(1)).t(),
            0.0,
            RowMajor::new(a.o(0), mm.k, a.dout(0)),
            1,
        )?)),
        Kernel::LinearBackwardWeight(mm) => {
            ops.push(DevOp::Gemm(gemm_row_major(
                mm.k,
                mm.n,
                mm.m,
                1.0,
                RowMajor::new(a.i(1), mm.k, a.di(1)).t(),
                RowMajor::new(a.i(0), mm.n, a.di(0)),
                0.0,
                RowMajor::new(a.o(0), mm.n, a.dout(0)),
                1,
            )?));
            ops.push(elementwise(
                DevKernel::ColSum,
                mm.n,
                vec![a.fi(0), a.fo(1), n(mm.m), n(mm.n)],
            ));
        }
        Kernel::MatmulNt(mm) => ops.push(DevOp::Gemm(gemm_row_major(
            mm.m,
            mm.n,
            mm.k,
            1.0,
            RowMajor::new(a.i(0), mm.k, a.di(0)),
            RowMajor::new(a.i(1), mm.k, a.di(1)).t(),
            0.0,
            RowMajor::new(a.o(0), mm.n, a.dout(0)),
            1,
        )?)),
        Kernel::MatmulNn(mm) => ops.push(DevOp::Gemm(gemm_row_major(
            mm.m,
            mm.n,
            mm.k,
            1.0,
            RowMajor::new(a.i(0), mm.k, a.di(0)),
            RowMajor::new(a.i(1), mm.n, a.di(1)),
            0.0,
            RowMajor::new(a.o(0), mm.n, a.dout(0)),
            1,
        )?)),
        Kernel::MatmulTn(mm) => ops.push(DevOp::Gemm(gemm_row_major(
            mm.m,
            mm.n,
            mm.k,
            1.0,
            RowMajor::new(a.i(0), mm.m, a.di(0)).t(),
            RowMajor::new(a.i(1), mm.n, a.di(1)),
            0.0,
            RowMajor::new(a.o(0), mm.n, a.dout(0)),
            1,
        )?)),
        Kernel::MatmulTnAccumulate(mm) => ops.push(DevOp::Gemm(gemm_row_major(
            mm.m,
            mm.n,
            mm.k,
            1.0,
            RowMajor::new(a.i(0), mm.m, a.di(0)).t(),
            RowMajor::new(a.i(1), mm.n, a.di(1)),
            1.0,
            RowMajor::new(a.u(0), mm.n, a.du(0)),
            1,
        )?)),
        other => return Err(misrouted(other, "products")),
    }
    Ok(())
}

/// Explicit attention: batched cuBLAS products (one matrix per head) and
/// row kernels.
fn attention(a: &Addr<'_>, ops: &mut Vec<DevOp>) -> Result<()> {
    let ins = a.ins;
    let operands = ins.inputs.iter().chain(&ins.outputs).chain(&ins.updates);
    if let Some(&t) = operands
        .into_iter()
        .find(|&&t| a.p.tensor(t).dtype != a.di(0))
    {
        return Err(RuntimeError::Unavailable(
            "CUDA",
            format!(
                "{} {:?}: operand {:?} is {}, not {} as its first input",
                ins.kernel.name(),
                ins.name,
                a.p.tensor(t).name,
                a.p.tensor(t).dtype,
                a.di(0)
            ),
        ));
    }
    match &a.ins.kernel {
        Kernel::AttentionScores(_) | Kernel::CausalSoftmax(_) | Kernel::AttentionValues(_) => {
            attention_forward(a, ops)
        }
        _ => attention_backward(a, ops),
    }
}

/// Explicit attention's forward ops: scores, causal softmax, values.
fn attention_forward(a: &Addr<'_>, ops: &mut Vec<DevOp>) -> Result<()> {
    match &a.ins.kernel {
        Kernel::AttentionScores(at) => {
            let g = Geometry::new(at, a.di(0));
            for bi in 0..at.batch {
                // scores_h = scale · Q_h K_hᵀ
                ops.push(DevOp::Gemm(gemm_row_major(
                    g.t,
                    g.t,
                    g.d,
                    at.scale as f32,
                    g.qkv(a.i(0), bi, 0),
                    g.qkv(a.i(0), bi, 1).t(),
                    0.0,
                    g.square(a.o(0), bi),
                    at.heads,
                )?));
            }
            ops.push(elementwise(
                DevKernel::ZeroUpper,
                at.batch * at.heads * g.t * g.t,
                vec![a.fo(0), n(at.batch * at.heads), n(g.t)],
            ));
        }
        Kernel::CausalSoftmax(at) => {
            let rows = at.batch * at.heads * at.seq;
            ops.push(per_row(
                DevKernel::CausalSoftmaxFwd,
                rows,
                at.seq,
                vec![a.fi(0), a.fo(0), n(rows), n(at.seq)],
            )?);
        }
        Kernel::AttentionValues(at) => {
            let g = Geometry::new(at, a.di(0));
            for bi in 0..at.batch {
                ops.push(DevOp::Gemm(gemm_row_major(
                    g.t,
                    g.d,
                    g.t,
                    1.0,
                    g.square(a.i(0), bi),
                    g.qkv(a.i(1), bi, 2),
                    0.0,
                    g.heads_out(a.o(0), bi),
                    at.heads,
                )?));
            }
        }
        other => return Err(misrouted(other, "attention")),
    }
    Ok(())
}

/// Explicit attention's backward ops, in reverse: values, softmax, scores.
fn attention_backward(a: &Addr<'_>, ops: &mut Vec<DevOp>) -> Result<()> {
    match &a.ins.kernel {
        Kernel::AttentionValuesBackward(at) => {
            let g = Geometry::new(at, a.di(0));
            for bi in 0..at.batch {
                // dprobs_h = dAtt_h V_hᵀ
                ops.push(DevOp::Gemm(gemm_row_major(
                    g.t,
                    g.t,
                    g.d,
                    1.0,
                    g.heads_out(a.i(0), bi),
                    g.qkv(a.i(2), bi, 2).t(),
                    0.0,
                    g.square(a.o(0), bi),
                    at.heads,
                )?));
            }
            ops.push(elementwise(
                DevKernel::ZeroUpper,
                at.batch * at.heads * g.t * g.t,
                vec![a.fo(0), n(at.batch * at.heads), n(g.t)],
            ));
            ops.push(elementwise(
                DevKernel::ZeroQk,
                at.batch * g.t * 2 * g.c,
                vec![a.fo(1), n(at.batch * g.t), n(g.c)],
            ));
            for bi in 0..at.batch {
                // dV_h = P_hᵀ dAtt_h
                ops.push(DevOp::Gemm(gemm_row_major(
                    g.t,
                    g.d,
                    g.t,
                    1.0,
                    g.square(a.i(1), bi).t(),
                    g.heads_out(a.i(0), bi),
                    0.0,
                    g.qkv(a.o(1), bi, 2),
                    at.heads,
                )?));
            }
        }
        Kernel::CausalSoftmaxBackward(at) => {
            let rows = at.batch * at.heads * at.seq;
            ops.push(per_row(
                DevKernel::CausalSoftmaxBwd,
                rows,
                at.seq,
                vec![a.fi(0), a.fi(1), a.fo(0), n(rows), n(at.seq)],
            )?);
        }
        Kernel::AttentionScoresBackward(at) => {
            let g = Geometry::new(at, a.di(0));
            for bi in 0..at.batch {
                // dQ_h += scale · dS_h K_h
                ops.push(DevOp::Gemm(gemm_row_major(
                    g.t,
                    g.d,
                    g.t,
                    at.scale as f32,
                    g.square(a.i(0), bi),
                    g.qkv(a.i(1), bi, 1),
                    1.0,
                    g.qkv(a.u(0), bi, 0),
                    at.heads,
                )?));
                // dK_h += scale · dS_hᵀ Q_h
                ops.push(DevOp::Gemm(gemm_row_major(
                    g.t,
                    g.d,
                    g.t,
                    at.scale as f32,
                    g.square(a.i(0), bi).t(),
                    g.qkv(a.i(1), bi, 0),
                    1.0,
                    g.qkv(a.u(0), bi, 1),
                    at.heads,
                )?));
            }
        }
        other => return Err(misrouted(other, "attention")),
    }
    Ok(())
}

/// Fused attention: the flash kernels of `kernels.cu` (the backward is two
/// launches, queries then keys and values).
fn fused_attention(a: &Addr<'_>, ops: &mut Vec<DevOp>) -> Result<()> {
    if let AttentionLowering::Gemm { rows } = a.layout.attention {
        let op = |at: u64, dtype: DType| gemm_attention::Operand { at, dtype };
        let scratch = a.layout.scratch;
        return match &a.ins.kernel {
            Kernel::FusedAttention(at) => gemm_attention::forward(
                at,
                rows,
                op(a.i(0), a.di(0)),
                op(a.o(0), a.dout(0)),
                op(a.o(1), a.dout(1)),
                scratch,
                ops,
            ),
            Kernel::FusedAttentionBackward(at) => gemm_attention::backward(
                at,
                rows,
                op(a.i(0), a.di(0)),
                op(a.i(1), a.di(1)),
                op(a.i(2), a.di(2)),
                op(a.i(3), a.di(3)),
                op(a.o(0), a.dout(0)),
                scratch,
                ops,
            ),
            other => Err(misrouted(other, "fused_attention")),
        };
    }
    let mma = a.layout.attention == AttentionLowering::TensorCores;
    match &a.ins.kernel {
        Kernel::FusedAttention(at) => {
            let kernel = if mma && tensor_cores_apply(at, &[a.di(0)]) {
                DevKernel::tensor_core_attention(at.head_dim)[0]
            } else {
                DevKernel::FlashAttnFwd
            };
            ops.push(flash(kernel, at, vec![a.fi(0), a.fo(0), a.fo(1)])?)
        }
        Kernel::FusedAttentionBackward(at) => {
            let args = vec![a.fi(0), a.fi(1), a.fi(2), a.fi(3), a.fo(0)];
            // The kernels read dO and qkv as bf16 fragments.
            let (dq, dkv) = if mma && tensor_cores_apply(at, &[a.di(0), a.di(1)]) {
                let [_, dq, dkv] = DevKernel::tensor_core_attention(at.head_dim);
                (dq, dkv)
            } else {
                (DevKernel::FlashAttnBwdDq, DevKernel::FlashAttnBwdDkv)
            };
            ops.push(flash(dq, at, args.clone())?);
            ops.push(flash(dkv, at, args)?);
        }
        other => return Err(misrouted(other, "fused_attention")),
    }
    Ok(())
}

/// Whether the tensor-core flash kernels can run an attention whose
/// fragment operands have `dtypes`: all bf16, and a head dimension that is
/// a multiple of 16 up to [`MMA_MAX_HEAD_DIM`].
pub(crate) fn tensor_cores_apply(at: &Attention, dtypes: &[DType]) -> bool {
    dtypes.iter().all(|&d| d == DType::BF16)
        && at.head_dim % 16 == 0
        && at.head_dim > 0
        && at.head_dim <= MMA_MAX_HEAD_DIM
}

/// A cast: a copy between equal dtypes, else the `cast` kernel.
fn cast(a: &Addr<'_>, ops: &mut Vec<DevOp>) -> Result<()> {
    let (x, y) = (a.p.tensor(a.ins.inputs[0]), a.p.tensor(a.ins.outputs[0]));
    if x.dtype != y.dtype {
        ops.push(elementwise(
            DevKernel::Cast,
            y.elements(),
            vec![a.fi(0), a.fo(0), n(y.elements())],
        ));
    } else if a.i(0) != a.o(0) {
        ops.push(DevOp::Copy {
            src: a.i(0),
            dst: a.o(0),
            bytes: y.bytes(),
        });
    }
    Ok(())
}

/// Elementwise kernels.
fn pointwise(a: &Addr<'_>, ops: &mut Vec<DevOp>) -> Result<()> {
    match &a.ins.kernel {
        Kernel::Add { elements } => ops.push(elementwise(
            DevKernel::Add,
            *elements,
            vec![a.fi(0), a.fi(1), a.fo(0), n(*elements)],
        )),
        Kernel::Gelu { elements } => ops.push(elementwise(
            DevKernel::GeluFwd,
            *elements,
            vec![a.fi(0), a.fo(0), n(*elements)],
        )),
        Kernel::GeluBackward { elements } => ops.push(elementwise(
            DevKernel::GeluBwd,
            *elements,
            vec![a.fi(0), a.fi(1), a.fo(0), n(*elements)],
        )),
        Kernel::Relu { elements } => ops.push(elementwise(
            DevKernel::ReluFwd,
            *elements,
            vec![a.fi(0), a.fo(0), n(*elements)],
        )),
        Kernel::ReluBackward { elements } => ops.push(elementwise(
            DevKernel::ReluBwd,
            *elements,
            vec![a.fi(0), a.fi(1), a.fo(0), n(*elements)],
        )),
        other => return Err(misrouted(other, "pointwise")),
    }
    Ok(())
}

/// Cross-entropy, forward and backward (token ids checked on the device).
fn loss(a: &Addr<'_>, ops: &mut Vec<DevOp>) -> Result<()> {
    let err = Arg::Ptr(a.layout.error_word);
    let code = Arg::I32(a.index as i32 + 1);
    match &a.ins.kernel {
        Kernel::CrossEntropy {
            rows,
            classes,
            divisor,
        } => {
            ops.push(DevOp::Memset {
                at: a.o(0),
                bytes: 4,
            });
            ops.push(per_row(
                DevKernel::CrossEntropyFwd,
                *rows,
                *classes,
                vec![
                    a.fi(0),
                    p(a.i(1)),
                    a.f32_out(0)?,
                    n(*rows),
                    n(*classes),
                    Arg::F32(*divisor as f32),
                    err,
                    code,
                ],
            )?);
        }
        Kernel::CrossEntropyBackward {
            rows,
            classes,
            scale,
        } => ops.push(per_row(
            DevKernel::CrossEntropyBwd,
            *rows,
            *classes,
            vec![
                a.fi(0),
                p(a.i(1)),
                a.fo(0),
                n(*rows),
                n(*classes),
                Arg::F32(*scale as f32),
                err,
                code,
            ],
        )?),
        other => return Err(misrouted(other, "loss")),
    }
    Ok(())
}

/// Gradient norm and Adam updates.
fn optimizer(a: &Addr<'_>, ops: &mut Vec<DevOp>) -> Result<()> {
    let ins = a.ins;
    let elems = |t: TensorIdx| a.p.tensor(t).elements();
    match &a.ins.kernel {
        Kernel::GradNorm { squared } => {
            ops.push(DevOp::Memset {
                at: a.o(0),
                bytes: 4,
            });
            for (pos, &t) in ins.inputs.iter().enumerate() {
                ops.push(elementwise(
                    DevKernel::SumSquares,
                    elems(t),
                    vec![a.fi(pos), a.f32_out(0)?, n(elems(t))],
                ));
            }
            if !squared {
                ops.push(DevOp::Launch(Launch {
                    kernel: DevKernel::SqrtInplace,
                    grid: 1,
                    block: 1,
                    args: vec![a.fo(0)],
                }));
            }
        }
        Kernel::Adam(ad) => {
            let norm = if ad.max_norm.is_some() {
                a.fi(1)
            } else {
                null()
            };
            let denom = if ins.outputs.len() == 1 {
                a.fo(0)
            } else {
                null()
            };
            ops.push(elementwise(
                DevKernel::AdamStep,
                ad.elements,
                vec![
                    a.fi(0),
                    norm,
                    a.fu(0),
                    a.fu(1),
                    a.fu(2),
                    denom,
                    n(ad.elements),
                    Arg::F32(ad.lr as f32),
                    Arg::F32(ad.beta1 as f32),
                    Arg::F32(ad.beta2 as f32),
                    Arg::F32(ad.eps as f32),
                    Arg::F32(ad.weight_decay as f32),
                    Arg::I32(ad.decoupled as i32),
                    Arg::Step(ad.first_step),
                    Arg::F32(ad.max_norm.unwrap_or(0.0) as f32),
                    Arg::I32(ad.norm_squared as i32),
                ],
            ));
        }
        other => return Err(misrouted(other, "optimizer")),
    }
    Ok(())
}

/// Views, packing and collectives.
fn layout_and_collectives(a: &Addr<'_>, ops: &mut Vec<DevOp>) -> Result<()> {
    let prog = a.p;
    let ins = a.ins;
    let elems = |t: TensorIdx| a.p.tensor(t).elements();
    match &a.ins.kernel {
        Kernel::View => {}
        Kernel::Pack { offsets, .. } => {
            let out = prog.tensor(ins.outputs[0]);
            ops.push(DevOp::Memset {
                at: out.offset,
                bytes: out.bytes(),
            });
            for (pos, (&t, &off)) in ins.inputs.iter().zip(offsets).enumerate() {
                let x = prog.tensor(t);
                ops.push(DevOp::Copy {
                    src: a.i(pos),
                    dst: out.offset + off * x.dtype.size(),
                    bytes: x.bytes(),
                });
            }
        }
        Kernel::ChunkCat(l) => {
            // Pieces are copies, or `cast` launches when the flat buffer
            // has another dtype than the parts.
            let out = prog.tensor(ins.outputs[0]);
            ops.push(DevOp::Memset {
                at: out.offset,
                bytes: out.bytes(),
            });
            let size = out.dtype.size();
            for (pos, &t) in ins.inputs.iter().enumerate() {
                let x = prog.tensor(t).dtype;
                for (at, from, n) in l.pieces(pos, elems(t)) {
                    let (src, dst) = (a.i(pos) + from * x.size(), out.offset + at * size);
                    ops.push(if x == out.dtype {
                        DevOp::Copy {
                            src,
                            dst,
                            bytes: n * size,
                        }
                    } else {
                        elementwise(
                            DevKernel::Cast,
                            n,
                            vec![buf(src, x), buf(dst, out.dtype), self::n(n)],
                        )
                    });
                }
            }
        }
        Kernel::CopyOut(l) => {
            let size = prog.tensor(ins.inputs[0]).dtype.size();
            for (pos, &t) in ins.outputs.iter().enumerate() {
                for (at, to, n) in l.pieces(pos, elems(t)) {
                    ops.push(DevOp::Copy {
                        src: a.i(0) + at * size,
                        dst: a.o(pos) + to * size,
                        bytes: n * size,
                    });
                }
            }
        }
        Kernel::AllGather { .. } => ops.push(DevOp::Collective(CollectiveOp::AllGather {
            send: a.i(0),
            recv: a.o(0),
            count: elems(ins.inputs[0]),
            dtype: a.p.tensor(ins.inputs[0]).dtype,
        })),
        Kernel::ReduceScatter { op, .. } => {
            ops.push(DevOp::Collective(CollectiveOp::ReduceScatter {
                send: a.i(0),
                recv: a.o(0),
                count: elems(ins.outputs[0]),
                op: *op,
                dtype: a.p.tensor(ins.outputs[0]).dtype,
            }))
        }
        Kernel::AllReduce { op, .. } => ops.push(DevOp::Collective(CollectiveOp::AllReduce {
            buf: a.u(0),
            count: elems(ins.updates[0]),
            op: *op,
            dtype: a.p.tensor(ins.updates[0]).dtype,
        })),
        other => return Err(misrouted(other, "layout_and_collectives")),
    }
    Ok(())
}

/// A launch of one of the flash-attention kernels: one block of 4 warps per
/// 16 rows (64 for the tensor-core kernels) of each head (each key/value
/// head for dK/dV); `args` are the pointers, the sizes follow.
fn flash(kernel: DevKernel, at: &Attention, mut args: Vec<Arg>) -> Result<DevOp> {
    if at.head_dim > FLASH_MAX_HEAD_DIM {
        return Err(RuntimeError::Unavailable(
            "fused attention on CUDA",
            format!(
                "head_dim {} exceeds the kernels' {FLASH_MAX_HEAD_DIM}",
                at.head_dim
            ),
        ));
    }
    // The dK/dV kernels have a block per key/value head's rows.
    let heads = if kernel.name().ends_with("_bwd_dkv") {
        at.kv_heads
    } else {
        at.heads
    };
    let rows = if kernel.is_tensor_core_attention() {
        MMA_ROWS
    } else {
        FLASH_ROWS
    };
    let blocks = at.batch * heads * at.seq.div_ceil(rows);
    let grid = u32::try_from(blocks).map_err(|_| {
        RuntimeError::Unavailable("CUDA", format!("{blocks} blocks exceed the grid limit"))
    })?;
    args.extend([
        n(at.batch),
        n(at.heads),
        n(at.kv_heads),
        n(at.seq),
        n(at.head_dim),
        Arg::F32(at.scale as f32),
    ]);
    Ok(DevOp::Launch(Launch {
        kernel,
        grid,
        // Exactly FA_THREADS (FA_WARPS warps), the kernels' launch bound.
        block: kernel.launch_bound(),
        args,
    }))
}

/// Where one instruction's operands are.
struct Addr<'a> {
    p: &'a Program,
    ins: &'a Instr,
    bind: &'a InstrBinding,
    layout: &'a DeviceLayout,
    /// The instruction's index (kernels report `index + 1` on failure).
    index: usize,
}

impl Addr<'_> {
    fn off(&self, t: TensorIdx) -> u64 {
        self.p.tensor(t).offset
    }
    /// Input `pos` (its staged copy if staged; an aliased input is at its
    /// output's bytes, which are its own).
    fn i(&self, pos: usize) -> u64 {
        match self.bind.staged_input(pos) {
            Some(w) => self.layout.staging + w,
            None => self.off(self.ins.inputs[pos]),
        }
    }
    fn o(&self, pos: usize) -> u64 {
        self.off(self.ins.outputs[pos])
    }
    fn u(&self, pos: usize) -> u64 {
        self.off(self.ins.updates[pos])
    }
    fn di(&self, pos: usize) -> DType {
        self.p.tensor(self.ins.inputs[pos]).dtype
    }
    fn dout(&self, pos: usize) -> DType {
        self.p.tensor(self.ins.outputs[pos]).dtype
    }
    fn du(&self, pos: usize) -> DType {
        self.p.tensor(self.ins.updates[pos]).dtype
    }
    /// Input `pos` as a float operand.
    fn fi(&self, pos: usize) -> Arg {
        buf(self.i(pos), self.di(pos))
    }
    fn fo(&self, pos: usize) -> Arg {
        buf(self.o(pos), self.dout(pos))
    }
    fn fu(&self, pos: usize) -> Arg {
        buf(self.u(pos), self.du(pos))
    }
    /// Output `pos`, which kernels accumulate into with f32 atomics.
    fn f32_out(&self, pos: usize) -> Result<Arg> {
        if self.dout(pos) != DType::F32 {
            return Err(RuntimeError::Unavailable(
                "CUDA",
                format!(
                    "{} {:?} accumulates into {:?} with f32 atomics, which is {}",
                    self.ins.kernel.name(),
                    self.ins.name,
                    self.p.tensor(self.ins.outputs[pos]).name,
                    self.dout(pos)
                ),
            ));
        }
        Ok(self.fo(pos))
    }
}

fn buf(at: u64, dtype: DType) -> Arg {
    Arg::Buf(Buf {
        at: Some(at),
        bf16: dtype == DType::BF16,
    })
}
fn null() -> Arg {
    Arg::Buf(Buf {
        at: None,
        bf16: false,
    })
}
fn p(x: u64) -> Arg {
    Arg::Ptr(x)
}
fn n(x: u64) -> Arg {
    Arg::I64(x as i64)
}

/// Strides of attention operands, in elements.
/// (The explicit attention kernels' operands all share one dtype.)
struct Geometry {
    t: u64,
    d: u64,
    c: u64,
    h: u64,
    dtype: DType,
}

impl Geometry {
    fn new(a: &Attention, dtype: DType) -> Self {
        Geometry {
            t: a.seq,
            d: a.head_dim,
            c: a.heads * a.head_dim,
            h: a.heads,
            dtype,
        }
    }
    fn at(&self, base: u64, elements: u64) -> u64 {
        base + self.dtype.size() * elements
    }
    /// Part `part` (0 query, 1 key, 2 value) of batch `b` of a `[B,T,3C]`
    /// tensor at `base`, one `T × D` matrix per head.
    fn qkv(&self, base: u64, b: u64, part: u64) -> RowMajor {
        let off = b * self.t * 3 * self.c + part * self.c;
        RowMajor::new(self.at(base, off), 3 * self.c, self.dtype).stride(self.d)
    }
    /// Batch `b` of a `[B,H,T,T]` tensor, one `T × T` matrix per head.
    fn square(&self, base: u64, b: u64) -> RowMajor {
        let off = b * self.h * self.t * self.t;
        RowMajor::new(self.at(base, off), self.t, self.dtype).stride(self.t * self.t)
    }
    /// Batch `b` of a `[B,T,C]` tensor, one `T × D` matrix per head.
    fn heads_out(&self, base: u64, b: u64) -> RowMajor {
        RowMajor::new(self.at(base, b * self.t * self.c), self.c, self.dtype).stride(self.d)
    }
}

/// Every instruction's device operations, each launch checked against its
/// kernel's launch bound.
pub fn lower_all(p: &Program, b: &Bindings, layout: &DeviceLayout) -> Result<Vec<Vec<DevOp>>> {
    (0..p.instrs.len())
        .map(|i| {
            let ops = lower(p, b, layout, i)?;
            for op in &ops {
                if let DevOp::Launch(l) = op {
                    check_launch(l).map_err(|why| {
                        RuntimeError::InvalidProgram(format!(
                            "instruction {}: {why}",
                            p.instrs[i].name
                        ))
                    })?;
                }
            }
            Ok(ops)
        })
        .collect()
}
