//! What the built-in decoder steps share: a graph builder that knows the
//! step's dtype and alignment, parameters with their gradient and Adam
//! moments, and the optimizer step at the end (optional global-norm
//! clipping, then one Adam/AdamW update per parameter in parameter order,
//! as PyTorch's single-tensor `optimizer.step()` runs them).
//!
//! Mixed precision (bf16 compute, f32 master weights, as `torch.autocast`
//! or FSDP2's `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=f32)`
//! run it): parameters and their Adam moments are f32; a `cast` op makes
//! each parameter's bf16 copy just before its first use, and every op
//! reads that copy; activations are bf16; each bf16 gradient is cast to
//! the f32 gradient the update reads right after the op that produces it.

use std::collections::HashMap;

use serde_json::{Value, json};

use memplan_runtime::{AdamParams, Kernel, Matmul};

use super::DType;
use crate::graph::{GraphBuilder, Lifetime, OpId, OpKind, OpSpec, Role, TensorId, TensorSpec};
use crate::vocab;

/// Which optimizer updates the parameters.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Optimizer {
    Adam,
    AdamW,
}

/// What the builder needs from a model's configuration.
pub(super) trait StepConfig {
    /// The dtype of activations (and of parameters without mixed
    /// precision).
    fn dtype(&self) -> DType;
    fn align(&self) -> u64;
    /// f32 master weights and optimizer state, computing in `dtype`.
    fn mixed_precision(&self) -> bool;
}

/// A step's graph name: the preset's, then `-bN` for a batch other than 1
/// and the suffix of each option that is on, in order.
pub(super) fn step_name(base: &str, batch: u64, options: &[(bool, &str)]) -> String {
    let mut name = base.to_string();
    if batch != 1 {
        name.push_str(&format!("-b{batch}"));
    }
    for &(on, suffix) in options {
        if on {
            name.push('-');
            name.push_str(suffix);
        }
    }
    name
}

/// A trainable parameter with its gradient and optimizer state.
pub(super) struct Param {
    pub w: TensorId,
    pub grad: Option<TensorId>,
    pub m: TensorId,
    pub v: TensorId,
    pub init: &'static str,
}

/// The optimizer step's settings.
pub(super) struct Update {
    pub optimizer: Optimizer,
    pub lr: f64,
    pub weight_decay: f64,
    pub clip_grad_norm: Option<f64>,
    /// Model the temporary each single-tensor Adam step allocates (the
    /// denominator, one parameter's size), as PyTorch's default Adam does.
    pub adam_workspace: bool,
    /// Layers of the model (the `normal_resid` init scales by it).
    pub layers: u64,
}

/// A graph under construction with the model's configuration and its
/// parameters.
pub(super) struct Net<C> {
    pub b: GraphBuilder,
    pub cfg: C,
    pub params: Vec<Param>,
    /// Mixed precision: each parameter's compute copy, once made.
    copies: HashMap<usize, TensorId>,
    /// Mixed precision: compute-dtype gradients still to cast to f32.
    uncast: HashMap<TensorId, usize>,
    /// Ops added now are a checkpointed block's recomputed forward.
    pub recompute: bool,
}

impl<C: StepConfig> Net<C> {
    pub fn new(name: String, cfg: C) -> Self {
        Net {
            b: GraphBuilder::new(name),
            cfg,
            params: Vec::new(),
            copies: HashMap::new(),
            uncast: HashMap::new(),
            recompute: false,
        }
    }
    /// The dtype of parameters, gradients as the update reads them, and
    /// optimizer state.
    fn master(&self) -> DType {
        if self.cfg.mixed_precision() {
            DType::F32
        } else {
            self.cfg.dtype()
        }
    }
    fn master_tensor(&mut self, name: &str, shape: &[u64], role: Role) -> TensorId {
        let dt = self.master();
        self.typed(name, shape, role, dt.as_str(), dt.bytes())
    }
    /// A tensor of the step's dtype.
    pub fn tensor(&mut self, name: &str, shape: &[u64], role: Role) -> TensorId {
        let dt = self.cfg.dtype();
        self.typed(name, shape, role, dt.as_str(), dt.bytes())
    }
    pub fn typed(
        &mut self,
        name: &str,
        shape: &[u64],
        role: Role,
        dtype: &str,
        bytes: u64,
    ) -> TensorId {
        let elems: u64 = shape.iter().product();
        self.b.add_tensor(
            TensorSpec::new(name, elems * bytes)
                .role(role)
                .align(self.cfg.align())
                .dtype(dtype)
                .shape(shape.to_vec()),
        )
    }
    /// Per-row statistics (normalization mean and 1/std, log-sum-exp) stay
    /// in f32.
    pub fn stats(&mut self, name: &str, rows: u64) -> TensorId {
        self.typed(name, &[rows], Role::Activation, "f32", 4)
    }
    /// A persistent input of the step (tokens, targets).
    pub fn input(&mut self, name: &str, shape: &[u64], dtype: &str, bytes: u64) -> TensorId {
        let t = self.typed(name, shape, Role::Input, dtype, bytes);
        self.b.tensor_spec_mut(t).lifetime = Lifetime::Persistent;
        t
    }
    /// A parameter and its two Adam moments (all persistent); returns its
    /// index.
    pub fn param(&mut self, name: &str, shape: &[u64], init: &'static str) -> usize {
        let w = self.master_tensor(name, shape, Role::Parameter);
        let m = self.master_tensor(&format!("{name}.adam_m"), shape, Role::OptimizerState);
        let v = self.master_tensor(&format!("{name}.adam_v"), shape, Role::OptimizerState);
        for t in [w, m, v] {
            self.b.tensor_spec_mut(t).lifetime = Lifetime::Persistent;
        }
        self.params.push(Param {
            w,
            grad: None,
            m,
            v,
            init,
        });
        self.params.len() - 1
    }
    /// The tensor ops read for parameter `p`: the parameter, or with mixed
    /// precision its compute copy (cast from the parameter at the first
    /// call, so just before the first use).
    pub fn w(&mut self, p: usize) -> TensorId {
        let w = self.params[p].w;
        if !self.cfg.mixed_precision() {
            return w;
        }
        if let Some(&c) = self.copies.get(&p) {
            return c;
        }
        let name = self.b.tensor_spec(w).name.clone();
        let shape = self.shape(w);
        let c = self.tensor(
            &format!("{name}.{}", self.cfg.dtype().as_str()),
            &shape,
            Role::Activation,
        );
        let elements: u64 = shape.iter().product();
        self.op(
            &format!("{name}.cast"),
            OpKind::Forward,
            Kernel::Cast { elements },
            &[w],
            &[c],
        );
        self.copies.insert(p, c);
        c
    }
    pub fn param_shape(&self, p: usize) -> Vec<u64> {
        self.shape(self.params[p].w)
    }
    /// The gradient tensor of parameter `p` (made once, by the op that
    /// produces it). With mixed precision it is in the compute dtype, and
    /// [`Net::op`] casts it to the f32 gradient right after that op.
    pub fn grad(&mut self, p: usize) -> TensorId {
        let name = format!("{}.grad", self.b.tensor_spec(self.params[p].w).name);
        let shape = self.shape(self.params[p].w);
        if self.cfg.mixed_precision() {
            let dt = self.cfg.dtype().as_str();
            let g = self.tensor(&format!("{name}.{dt}"), &shape, Role::Gradient);
            self.uncast.insert(g, p);
            return g;
        }
        let g = self.tensor(&name, &shape, Role::Gradient);
        self.params[p].grad = Some(g);
        g
    }
    pub fn shape(&self, t: TensorId) -> Vec<u64> {
        self.b.tensor_spec(t).shape.clone().unwrap_or_default()
    }
    /// Adds op `name` running kernel `k` (its type and attributes from
    /// [`vocab`]); see [`Net::add`].
    pub fn op(
        &mut self,
        name: &str,
        kind: OpKind,
        k: Kernel,
        inputs: &[TensorId],
        outputs: &[TensorId],
    ) -> OpId {
        self.add(
            vocab::spec(name, kind, &k)
                .inputs(inputs.iter().copied())
                .outputs(outputs.iter().copied()),
        )
    }
    /// Adds an op, marked `recompute` inside a checkpointed block's
    /// recomputed forward; with mixed precision, each compute-dtype
    /// gradient it makes is cast to its f32 gradient right after it.
    pub fn add(&mut self, mut spec: OpSpec) -> OpId {
        if self.recompute {
            spec.attrs.insert("recompute".into(), Value::Bool(true));
        }
        let outputs = spec.outputs.clone();
        let op = self.b.add_op(spec);
        for g in outputs {
            if let Some(p) = self.uncast.remove(&g) {
                self.cast_grad(g, p);
            }
        }
        op
    }
    /// Casts parameter `p`'s compute-dtype gradient `g` to its f32 gradient.
    fn cast_grad(&mut self, g: TensorId, p: usize) {
        let name = format!("{}.grad", self.b.tensor_spec(self.params[p].w).name);
        let shape = self.shape(g);
        let g32 = self.master_tensor(&name, &shape, Role::Gradient);
        let elements: u64 = shape.iter().product();
        let spec = vocab::spec(
            format!("{name}.cast"),
            OpKind::Backward,
            &Kernel::Cast { elements },
        )
        .inputs([g])
        .outputs([g32]);
        self.b.add_op(spec);
        self.params[p].grad = Some(g32);
    }
    /// Output `out` of `op` may take the bytes of its input `inp`.
    pub fn reuse(&mut self, op: OpId, out: TensorId, inp: TensorId) {
        self.b.op_spec_mut(op).reuse.push((out, inp));
    }

    /// The LM head `name` (`logits = y Hᵀ`, `H` parameter `head` of shape
    /// `[V, C]`), the mean cross-entropy against `targets`, and their
    /// backward: `dlogits` in place of the logits, `dy = dlogits H`, and the
    /// head's gradient. Returns `(dy, dhead)`; with a `tied` head, `dhead` is
    /// a plain tensor that the embedding's backward adds its gradient to.
    pub fn head_and_loss(
        &mut self,
        name: &str,
        y: TensorId,
        head: usize,
        tied: bool,
        targets: TensorId,
    ) -> (TensorId, TensorId) {
        let ys = self.shape(y);
        let (rows, c) = (ys[..ys.len() - 1].iter().product::<u64>(), ys[ys.len() - 1]);
        let v = self.param_shape(head)[0];
        let mut ls = ys.clone();
        *ls.last_mut().expect("a row shape") = v;
        let logits = self.tensor("logits", &ls, Role::Activation);
        let w = self.w(head);
        self.op(
            name,
            OpKind::Forward,
            Kernel::MatmulNt(Matmul {
                m: rows,
                k: c,
                n: v,
            }),
            &[y, w],
            &[logits],
        );
        let loss = self.typed("loss", &[1], Role::Output, "f32", 4);
        self.b.tensor_spec_mut(loss).lifetime = Lifetime::Persistent;
        let ce = Kernel::CrossEntropy {
            rows,
            classes: v,
            divisor: rows,
        };
        self.op("loss", OpKind::Forward, ce, &[logits, targets], &[loss]);

        let dlogits = self.tensor("logits.grad", &ls, Role::Activation);
        let op = self.op(
            "loss.backward",
            OpKind::Backward,
            Kernel::CrossEntropyBackward {
                rows,
                classes: v,
                scale: 1.0 / rows as f64,
            },
            &[logits, targets],
            &[dlogits],
        );
        self.reuse(op, dlogits, logits);
        let y_name = self.b.tensor_spec(y).name.clone();
        let dy = self.tensor(&format!("{y_name}.grad"), &ys, Role::Activation);
        self.op(
            &format!("{name}.backward_data"),
            OpKind::Backward,
            Kernel::MatmulNn(Matmul {
                m: rows,
                k: v,
                n: c,
            }),
            &[dlogits, w],
            &[dy],
        );
        let dhead = if tied {
            self.tensor(&format!("{name}.weight.grad"), &[v, c], Role::Gradient)
        } else {
            self.grad(head)
        };
        self.op(
            &format!("{name}.backward_weight"),
            OpKind::Backward,
            Kernel::MatmulTn(Matmul {
                m: v,
                k: rows,
                n: c,
            }),
            &[dlogits, y],
            &[dhead],
        );
        (dy, dhead)
    }

    /// The token embedding's backward `name`, `[B, T, C, V]` = `dims`: from
    /// the gradient `dx` of its output, the gradients `outs` (`[dwte]`, or
    /// `[dwte, dwpe]` with a position embedding). With a tied LM head,
    /// `dwte` adds to the head's gradient `dhead`, in its bytes.
    pub fn embedding_backward(
        &mut self,
        name: &str,
        [batch, seq, width, vocab]: [u64; 4],
        dx: TensorId,
        tokens: TensorId,
        dhead: Option<TensorId>,
        outs: &[TensorId],
    ) {
        let mut ins = vec![dx, tokens];
        ins.extend(dhead);
        let k = Kernel::EmbeddingBackward {
            batch,
            seq,
            width,
            vocab,
            accumulate: dhead.is_some(),
            positions: outs.len() == 2,
        };
        let op = self.op(name, OpKind::Backward, k, &ins, outs);
        if let Some(dhead) = dhead {
            self.reuse(op, outs[0], dhead);
        }
    }

    /// The optimizer step over every parameter, in parameter order.
    pub fn optimizer_step(&mut self, u: &Update) {
        let grads: Vec<TensorId> = self
            .params
            .iter()
            .map(|p| p.grad.expect("every parameter has a gradient"))
            .collect();
        let norm = u.clip_grad_norm.map(|_| {
            let norm = self.typed("grad_norm", &[1], Role::Temporary, "f32", 4);
            self.op(
                "clip_grad_norm",
                OpKind::Optimizer,
                Kernel::GradNorm { squared: false },
                &grads,
                &[norm],
            );
            norm
        });
        let (decoupled, weight_decay) = match u.optimizer {
            Optimizer::Adam => (false, 0.0),
            Optimizer::AdamW => (true, u.weight_decay),
        };
        for (i, &g) in grads.iter().enumerate() {
            let p = &self.params[i];
            let (w, m, vv, init) = (p.w, p.m, p.v, p.init);
            let pname = self.b.tensor_spec(w).name.clone();
            let shape = self.shape(w);
            let elems: u64 = shape.iter().product();
            let mut inputs = vec![g];
            inputs.extend(norm);
            let mut outputs = Vec::new();
            if u.adam_workspace {
                let denom = format!("{pname}.adam_denom");
                outputs.push(self.master_tensor(&denom, &shape, Role::Temporary));
            }
            let adam = Kernel::Adam(AdamParams {
                elements: elems,
                lr: u.lr,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                weight_decay,
                decoupled,
                first_step: 1,
                max_norm: u.clip_grad_norm,
                norm_squared: false,
            });
            let mut spec = vocab::spec(format!("{pname}.update"), OpKind::Optimizer, &adam)
                .inputs(inputs)
                .outputs(outputs)
                .updates([w, m, vv]);
            spec.attrs.insert("init".into(), json!(init));
            spec.attrs.insert("layers".into(), json!(u.layers));
            self.b.add_op(spec);
        }
    }
}
