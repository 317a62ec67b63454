//! A multi-layer perceptron training step: `layers` hidden linear layers with
//! ReLU, a linear classifier, softmax cross-entropy, the backward pass and an
//! Adam update per parameter (persistent moments). Program order is PyTorch
//! eager's: forward, backward, then every update.

use memplan_runtime::{AdamParams, Kernel, Matmul};
use serde_json::json;

use super::DType;
use crate::error::Error;
use crate::graph::{Graph, GraphBuilder, Lifetime, OpKind, Role, TensorId, TensorSpec};
use crate::vocab;

#[derive(Clone, Debug, PartialEq)]
pub struct MlpConfig {
    pub name: String,
    pub input: u64,
    pub hidden: u64,
    pub layers: u64,
    pub classes: u64,
    pub batch: u64,
    pub dtype: DType,
    pub align: u64,
    pub lr: f64,
}

impl Default for MlpConfig {
    /// 4 hidden layers of 1024, input 784, 10 classes, batch 64.
    fn default() -> Self {
        MlpConfig {
            name: "mlp".into(),
            input: 784,
            hidden: 1024,
            layers: 4,
            classes: 10,
            batch: 64,
            dtype: DType::F32,
            align: 256,
            lr: 1e-3,
        }
    }
}

struct B {
    b: GraphBuilder,
    cfg: MlpConfig,
}

impl B {
    fn t(&mut self, name: &str, shape: &[u64], role: Role) -> TensorId {
        let (dt, bytes) = (self.cfg.dtype.as_str(), self.cfg.dtype.bytes());
        self.typed(name, shape, role, dt, bytes)
    }
    fn typed(&mut self, name: &str, shape: &[u64], role: Role, dt: &str, bytes: u64) -> TensorId {
        let n: u64 = shape.iter().product();
        self.b.add_tensor(
            TensorSpec::new(name, n * bytes)
                .role(role)
                .align(self.cfg.align)
                .dtype(dt)
                .shape(shape.to_vec()),
        )
    }
    fn op(&mut self, name: &str, kind: OpKind, k: Kernel, i: &[TensorId], o: &[TensorId]) {
        let s = vocab::spec(name, kind, &k)
            .inputs(i.iter().copied())
            .outputs(o.iter().copied());
        self.b.add_op(s);
    }
}

/// A persistent tensor with its two Adam moments.
type Param = (TensorId, TensorId, TensorId);

/// A layer's (weight, bias).
type Layer = (Param, Param);

impl B {
    fn persistent(&mut self, t: TensorId) {
        self.b.tensor_spec_mut(t).lifetime = Lifetime::Persistent;
    }

    fn param(&mut self, n: &str, shape: &[u64]) -> Param {
        let w = self.t(n, shape, Role::Parameter);
        let a = self.t(&format!("{n}.adam_m"), shape, Role::OptimizerState);
        let b = self.t(&format!("{n}.adam_v"), shape, Role::OptimizerState);
        for t in [w, a, b] {
            self.persistent(t);
        }
        (w, a, b)
    }

    /// The forward pass from `x`: the logits, and each layer's input (for
    /// dW) and pre-activation (for ReLU').
    fn forward(
        &mut self,
        layers: &[Layer],
        dims: &[u64],
        x: TensorId,
    ) -> (TensorId, Vec<(TensorId, TensorId)>) {
        let bs = self.cfg.batch;
        let mut h = x;
        let mut saved = Vec::new();
        for (l, &((w, _, _), (b, _, _))) in layers.iter().enumerate() {
            let z = self.t(&format!("fc{l}.out"), &[bs, dims[l + 1]], Role::Activation);
            self.op(
                &format!("fc{l}"),
                OpKind::Forward,
                Kernel::Linear(Matmul {
                    m: bs,
                    k: dims[l],
                    n: dims[l + 1],
                }),
                &[h, w, b],
                &[z],
            );
            saved.push((h, z));
            h = z;
            if l + 1 < layers.len() {
                let a = self.t(
                    &format!("relu{l}.out"),
                    &[bs, dims[l + 1]],
                    Role::Activation,
                );
                self.op(
                    &format!("relu{l}"),
                    OpKind::Forward,
                    Kernel::Relu {
                        elements: bs * dims[l + 1],
                    },
                    &[z],
                    &[a],
                );
                h = a;
            }
        }
        (h, saved)
    }

    /// The loss of `logits` against `labels` and its gradient.
    fn loss(&mut self, logits: TensorId, labels: TensorId) -> TensorId {
        let (bs, classes) = (self.cfg.batch, self.cfg.classes);
        let loss = self.typed("loss", &[1], Role::Output, "f32", 4);
        self.persistent(loss);
        self.op(
            "loss",
            OpKind::Forward,
            Kernel::CrossEntropy {
                rows: bs,
                classes,
                divisor: bs,
            },
            &[logits, labels],
            &[loss],
        );
        let dh = self.t("logits.grad", &[bs, classes], Role::Activation);
        self.op(
            "loss.backward",
            OpKind::Backward,
            Kernel::CrossEntropyBackward {
                rows: bs,
                classes,
                scale: 1.0 / bs as f64,
            },
            &[logits, labels],
            &[dh],
        );
        dh
    }

    /// The backward pass from the logits' gradient `dh`: each layer's
    /// (weight, bias) gradients.
    fn backward(
        &mut self,
        layers: &[Layer],
        dims: &[u64],
        saved: &[(TensorId, TensorId)],
        mut dh: TensorId,
    ) -> Vec<(TensorId, TensorId)> {
        let bs = self.cfg.batch;
        let nl = layers.len();
        let mut grads = vec![(TensorId(0), TensorId(0)); nl];
        for l in (0..nl).rev() {
            let ((w, _, _), _) = layers[l];
            let (inp, z) = saved[l];
            let shape = [bs, dims[l + 1]];
            let mm = Matmul {
                m: bs,
                k: dims[l],
                n: dims[l + 1],
            };
            if l + 1 < nl {
                // dh is the gradient of relu(z): mask it by z > 0.
                let dz = self.t(&format!("fc{l}.out.grad"), &shape, Role::Activation);
                self.op(
                    &format!("relu{l}.backward"),
                    OpKind::Backward,
                    Kernel::ReluBackward {
                        elements: bs * dims[l + 1],
                    },
                    &[dh, z],
                    &[dz],
                );
                dh = dz;
            }
            let wshape = [dims[l], dims[l + 1]];
            let dw = self.t(&format!("fc{l}.weight.grad"), &wshape, Role::Gradient);
            let db = self.t(&format!("fc{l}.bias.grad"), &[dims[l + 1]], Role::Gradient);
            self.op(
                &format!("fc{l}.backward_weight"),
                OpKind::Backward,
                Kernel::LinearBackwardWeight(mm),
                &[dh, inp],
                &[dw, db],
            );
            grads[l] = (dw, db);
            if l > 0 {
                let dx = self.t(&format!("fc{l}.in.grad"), &[bs, dims[l]], Role::Activation);
                self.op(
                    &format!("fc{l}.backward_data"),
                    OpKind::Backward,
                    Kernel::LinearBackwardData(mm),
                    &[dh, w],
                    &[dx],
                );
                dh = dx;
            }
        }
        grads
    }

    /// An Adam update per parameter, after the whole backward (eager's
    /// order).
    fn updates(&mut self, layers: &[Layer], grads: &[(TensorId, TensorId)]) {
        for (&(pw, pb), &(gw, gb)) in layers.iter().zip(grads) {
            for ((w, a, b), g, init) in [(pw, gw, "normal:0.05"), (pb, gb, "zeros")] {
                let spec = self.b.tensor_spec(w);
                let pname = spec.name.clone();
                let elems = spec.shape.as_ref().map_or(0, |s| s.iter().product::<u64>());
                let adam = Kernel::Adam(AdamParams {
                    elements: elems,
                    lr: self.cfg.lr,
                    beta1: 0.9,
                    beta2: 0.999,
                    eps: 1e-8,
                    weight_decay: 0.0,
                    decoupled: false,
                    first_step: 1,
                    max_norm: None,
                    norm_squared: false,
                });
                let mut s = vocab::spec(format!("{pname}.update"), OpKind::Optimizer, &adam)
                    .inputs([g])
                    .updates([w, a, b]);
                s.attrs.insert("init".into(), json!(init));
                self.b.add_op(s);
            }
        }
    }
}

/// Builds the MLP training step.
pub fn build(cfg: &MlpConfig) -> Result<Graph, Error> {
    if [cfg.input, cfg.hidden, cfg.classes, cfg.batch].contains(&0) {
        return Err(Error::InvalidArgument("mlp: sizes must be positive".into()));
    }
    let mut name = cfg.name.clone();
    if cfg.batch != MlpConfig::default().batch {
        name.push_str(&format!("-b{}", cfg.batch));
    }
    let mut m = B {
        b: GraphBuilder::new(name),
        cfg: cfg.clone(),
    };
    let bs = cfg.batch;
    let x = m.t("input", &[bs, cfg.input], Role::Input);
    let y = m.typed("labels", &[bs], Role::Input, "i32", 4);
    for t in [x, y] {
        m.persistent(t);
    }
    // (weight, bias) per layer; the last layer is the classifier.
    let mut dims = vec![cfg.input];
    dims.extend(std::iter::repeat_n(cfg.hidden, cfg.layers as usize));
    dims.push(cfg.classes);
    let layers: Vec<Layer> = (0..dims.len() - 1)
        .map(|l| {
            let w = m.param(&format!("fc{l}.weight"), &[dims[l], dims[l + 1]]);
            let b = m.param(&format!("fc{l}.bias"), &[dims[l + 1]]);
            (w, b)
        })
        .collect();
    let (logits, saved) = m.forward(&layers, &dims, x);
    let dh = m.loss(logits, y);
    let grads = m.backward(&layers, &dims, &saved, dh);
    m.updates(&layers, &grads);
    Ok(m.b.build()?)
}
