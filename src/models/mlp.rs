//! A multi-layer perceptron training step: `layers` hidden linear layers with
//! ReLU, a linear classifier, softmax cross-entropy, the backward pass and an
//! Adam update per parameter (persistent moments). Program order is PyTorch
//! eager's: forward, backward, then every update.

use serde_json::{Value, json};

use super::DType;
use crate::error::Error;
use crate::graph::{Graph, GraphBuilder, Lifetime, OpKind, OpSpec, Role, TensorId, TensorSpec};

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
    fn op(&mut self, name: &str, kind: OpKind, ty: &str, i: &[TensorId], o: &[TensorId], a: Value) {
        let mut s = OpSpec::new(name, kind, ty)
            .inputs(i.iter().copied())
            .outputs(o.iter().copied());
        if let Value::Object(m) = a {
            s.attrs = m;
        }
        self.b.add_op(s);
    }
}

/// Builds the MLP training step.
pub fn build(cfg: &MlpConfig) -> Result<Graph, Error> {
    if [cfg.input, cfg.hidden, cfg.classes, cfg.batch].contains(&0) {
        return Err(Error::Invalid("mlp: sizes must be positive".into()));
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
        m.b.tensor_spec_mut(t).lifetime = Lifetime::Persistent;
    }
    // (weight, bias) per layer; the last layer is the classifier.
    let mut dims = vec![cfg.input];
    dims.extend(std::iter::repeat_n(cfg.hidden, cfg.layers as usize));
    dims.push(cfg.classes);
    let mut params = Vec::new();
    for l in 0..dims.len() - 1 {
        let mk = |m: &mut B, n: &str, shape: &[u64]| {
            let w = m.t(n, shape, Role::Parameter);
            let a = m.t(&format!("{n}.adam_m"), shape, Role::OptimizerState);
            let b = m.t(&format!("{n}.adam_v"), shape, Role::OptimizerState);
            for t in [w, a, b] {
                m.b.tensor_spec_mut(t).lifetime = Lifetime::Persistent;
            }
            (w, a, b)
        };
        let w = mk(&mut m, &format!("fc{l}.weight"), &[dims[l], dims[l + 1]]);
        let b = mk(&mut m, &format!("fc{l}.bias"), &[dims[l + 1]]);
        params.push((w, b));
    }
    // Forward: keep each layer's input (for dW) and pre-activation (for ReLU').
    let mut h = x;
    let mut saved = Vec::new();
    let nl = params.len();
    for (l, &((w, _, _), (b, _, _))) in params.iter().enumerate() {
        let z = m.t(&format!("fc{l}.out"), &[bs, dims[l + 1]], Role::Activation);
        m.op(
            &format!("fc{l}"),
            OpKind::Forward,
            "linear",
            &[h, w, b],
            &[z],
            json!({"m": bs, "k": dims[l], "n": dims[l + 1]}),
        );
        saved.push((h, z));
        if l + 1 < nl {
            let a = m.t(
                &format!("relu{l}.out"),
                &[bs, dims[l + 1]],
                Role::Activation,
            );
            m.op(
                &format!("relu{l}"),
                OpKind::Forward,
                "relu",
                &[z],
                &[a],
                json!({"elements": bs * dims[l + 1]}),
            );
            h = a;
        } else {
            h = z;
        }
    }
    let loss = m.typed("loss", &[1], Role::Output, "f32", 4);
    m.b.tensor_spec_mut(loss).lifetime = Lifetime::Persistent;
    m.op(
        "loss",
        OpKind::Forward,
        "cross_entropy",
        &[h, y],
        &[loss],
        json!({"rows": bs, "classes": cfg.classes}),
    );
    let mut dh = m.t("logits.grad", &[bs, cfg.classes], Role::Activation);
    m.op(
        "loss.backward",
        OpKind::Backward,
        "cross_entropy_backward",
        &[h, y],
        &[dh],
        json!({"rows": bs, "classes": cfg.classes, "scale": 1.0 / bs as f64}),
    );
    let mut grads = vec![(TensorId(0), TensorId(0)); nl];
    for l in (0..nl).rev() {
        let ((w, _, _), _) = params[l];
        let (inp, z) = saved[l];
        if l + 1 < nl {
            // dh is the gradient of relu(z): mask it by z > 0.
            let dz = m.t(
                &format!("fc{l}.out.grad"),
                &[bs, dims[l + 1]],
                Role::Activation,
            );
            m.op(
                &format!("relu{l}.backward"),
                OpKind::Backward,
                "relu_backward",
                &[dh, z],
                &[dz],
                json!({"elements": bs * dims[l + 1]}),
            );
            dh = dz;
        }
        let dw = m.t(
            &format!("fc{l}.weight.grad"),
            &[dims[l], dims[l + 1]],
            Role::Gradient,
        );
        let db = m.t(&format!("fc{l}.bias.grad"), &[dims[l + 1]], Role::Gradient);
        m.op(
            &format!("fc{l}.backward_weight"),
            OpKind::Backward,
            "linear_backward_weight",
            &[dh, inp],
            &[dw, db],
            json!({"m": bs, "k": dims[l], "n": dims[l + 1]}),
        );
        grads[l] = (dw, db);
        if l > 0 {
            let dx = m.t(&format!("fc{l}.in.grad"), &[bs, dims[l]], Role::Activation);
            m.op(
                &format!("fc{l}.backward_data"),
                OpKind::Backward,
                "linear_backward_data",
                &[dh, w],
                &[dx],
                json!({"m": bs, "k": dims[l], "n": dims[l + 1]}),
            );
            dh = dx;
        }
    }
    for (l, &(pw, pb)) in params.iter().enumerate() {
        for ((w, a, b), g, init) in [(pw, grads[l].0, "normal:0.05"), (pb, grads[l].1, "zeros")] {
            let pname = m.b.tensor_spec(w).name.clone();
            let elems =
                m.b.tensor_spec(w)
                    .shape
                    .as_ref()
                    .map_or(0, |s| s.iter().product::<u64>());
            let mut s = OpSpec::new(format!("{pname}.update"), OpKind::Optimizer, "adam")
                .inputs([g])
                .updates([w, a, b]);
            if let Value::Object(at) = json!({"elements": elems, "lr": cfg.lr, "beta1": 0.9,
                "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0, "step": 1, "init": init})
            {
                s.attrs = at;
            }
            m.b.add_op(s);
        }
    }
    Ok(m.b.build()?)
}
