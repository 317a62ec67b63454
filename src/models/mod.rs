//! Built-in example graphs, generated in code: GPT-2 and Llama style decoder
//! training steps and an MLP. Ops carry their type, shapes and hyper-parameters so an
//! executor can run them (op types are listed in `docs/ops.md`).

pub mod fsdp;
pub mod gpt2;
pub mod llama;
pub mod mlp;
mod step;

use crate::error::Error;
use crate::graph::Graph;

/// Element type of the built-in models.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Default)]
pub enum DType {
    #[default]
    F32,
    BF16,
    F16,
}

impl DType {
    /// Bytes per element ([`crate::dtype`]'s table).
    pub fn bytes(self) -> u64 {
        crate::dtype::ElementType::parse(self.as_str())
            .expect("the models' types are in the table")
            .unpacked_bytes()
    }
    pub fn as_str(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
        }
    }
    /// A name of [`crate::dtype`]'s table (`f32`, `float32`, ...) of one
    /// of the types the models build.
    pub fn parse(s: &str) -> Option<DType> {
        match crate::dtype::ElementType::named(s)?.name {
            "f32" => Some(DType::F32),
            "bf16" => Some(DType::BF16),
            "f16" => Some(DType::F16),
            _ => None,
        }
    }
}

/// Names of the built-in examples.
pub const EXAMPLES: &[&str] = &[
    "gpt2-tiny",
    "gpt2-small",
    "gpt2-medium",
    "gpt2-large",
    "gpt2-xl",
    "llama-tiny",
    "llama3-1b",
    "llama3-8b",
    "llama2-7b",
    "mlp",
];

/// Options a user may set on a built-in example.
#[derive(Clone, Debug, Default)]
pub struct ExampleOptions {
    pub batch: Option<u64>,
    pub seq: Option<u64>,
    pub layers: Option<u64>,
    pub dtype: Option<DType>,
    pub checkpoint: bool,
    pub clip_grad_norm: Option<f64>,
    /// GPT-2: fused (flash-style) attention instead of the explicit
    /// scores and probabilities. Llama steps always use fused attention.
    pub fused_attention: bool,
    /// Mixed precision: f32 parameters and optimizer state, bf16 compute
    /// and activations (unless `dtype` says otherwise).
    pub mixed_precision: bool,
}

/// The most ops a built-in example may have (about 25,000 GPT-2 layers):
/// a request beyond it is refused with its estimated size before anything
/// is built, where it would otherwise take gigabytes or abort.
pub const MAX_EXAMPLE_OPS: u64 = 1_000_000;

/// Refuses an example request whose layer count gives more than
/// [`MAX_EXAMPLE_OPS`] ops. Ops and tensors grow linearly with the layers,
/// so the same example at one and two layers gives the count exactly.
///
/// Batch and sequence length are bounded too, so every tensor's size fits
/// in u64 with room to spare: the builders multiply them with the preset's
/// widths (at most 2^18) and, for attention scores, with the sequence and
/// the heads (at most 64), in bytes (at most 8 each), so tokens (batch ×
/// seq) times max(seq, 2^18) may be at most 2^55.
fn check_size(name: &str, opts: &ExampleOptions) -> Result<(), Error> {
    let (batch, seq) = if name == "mlp" {
        (opts.batch.unwrap_or(mlp::MlpConfig::default().batch), 1)
    } else if let Some(c) = llama::LlamaConfig::preset(name) {
        (opts.batch.unwrap_or(c.batch), opts.seq.unwrap_or(c.seq))
    } else if let Some(c) = gpt2::Gpt2Config::preset(name) {
        (opts.batch.unwrap_or(c.batch), opts.seq.unwrap_or(c.seq))
    } else {
        // Unknown: build_example names it.
        return Ok(());
    };
    let elements = (batch as u128) * (seq as u128) * (seq.max(1 << 18) as u128);
    if elements > 1 << 55 {
        return Err(Error::InvalidArgument(format!(
            "{name} at batch {batch}, seq {seq} has tensors too large to count in 64-bit bytes (batch × seq × max(seq, 262144) must be at most 2^55)"
        )));
    }
    let Some(layers) = opts.layers.filter(|&l| l > 2) else {
        return Ok(());
    };
    let counts = |l: u64| -> Result<(u64, u64), Error> {
        let small = ExampleOptions {
            layers: Some(l),
            ..opts.clone()
        };
        let (g, _) = build_example(name, &small)?;
        Ok((g.num_ops() as u64, g.num_tensors() as u64))
    };
    let (ops1, tensors1) = counts(1)?;
    let (ops2, tensors2) = counts(2)?;
    let at = |one: u64, two: u64| {
        let per_layer = two.saturating_sub(one);
        one.saturating_add(per_layer.saturating_mul(layers - 1))
    };
    let (ops, tensors) = (at(ops1, ops2), at(tensors1, tensors2));
    if ops > MAX_EXAMPLE_OPS {
        return Err(Error::InvalidArgument(format!(
            "{name} with {layers} layers would have {} ops and {} tensors, more than a built-in example may have ({} ops; at most {} layers here)",
            grouped(ops),
            grouped(tensors),
            grouped(MAX_EXAMPLE_OPS),
            1 + MAX_EXAMPLE_OPS.saturating_sub(ops1) / (ops2 - ops1).max(1)
        )));
    }
    Ok(())
}

/// `n` with thousands separators.
fn grouped(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// A gradient-clipping threshold, checked: the largest global norm the
/// gradients keep, so a finite number above 0 (`torch.nn.utils.
/// clip_grad_norm_` with 0 zeroes every gradient, with a negative one
/// flips them, and NaN or infinity make no sense).
pub fn clip_grad_norm(max_norm: f64) -> Result<f64, Error> {
    if max_norm.is_finite() && max_norm > 0.0 {
        Ok(max_norm)
    } else {
        Err(Error::InvalidArgument(format!(
            "clip_grad_norm must be a positive finite number, got {max_norm}"
        )))
    }
}

/// Sets the options the decoder configurations (GPT-2, Llama) share.
macro_rules! decoder_options {
    ($c:ident, $opts:ident) => {
        if let Some(b) = $opts.batch {
            $c.batch = b;
        }
        if let Some(s) = $opts.seq {
            $c.seq = s;
        }
        if let Some(l) = $opts.layers {
            $c.layers = l;
        }
        $c.checkpoint = $opts.checkpoint;
        $c.clip_grad_norm = $opts.clip_grad_norm;
        $c.mixed_precision = $opts.mixed_precision;
        // Mixed precision computes in bf16 unless told otherwise.
        match $opts.dtype {
            Some(d) => $c.dtype = d,
            None if $opts.mixed_precision => $c.dtype = DType::BF16,
            None => {}
        }
    };
}

/// Builds a built-in example by name, every op with its FLOPs
/// ([`crate::cost`]); its metadata names the example and its batch size.
pub fn example(name: &str, opts: &ExampleOptions) -> Result<Graph, Error> {
    if let Some(x) = opts.clip_grad_norm {
        clip_grad_norm(x)?;
    }
    check_size(name, opts)?;
    let (mut g, batch) = build_example(name, opts)?;
    crate::cost::fill_flops(&mut g);
    g.metadata.insert("example".into(), name.into());
    g.metadata.insert("batch".into(), batch.into());
    Ok(g)
}

/// The example's graph and batch size.
fn build_example(name: &str, opts: &ExampleOptions) -> Result<(Graph, u64), Error> {
    if name == "mlp" {
        if opts.mixed_precision {
            return Err(Error::InvalidArgument(
                "mlp: mixed precision is built for the GPT-2 and Llama examples only".into(),
            ));
        }
        let mut c = mlp::MlpConfig::default();
        if let Some(b) = opts.batch {
            c.batch = b;
        }
        if let Some(l) = opts.layers {
            c.layers = l;
        }
        if let Some(d) = opts.dtype {
            c.dtype = d;
        }
        return Ok((mlp::build(&c)?, c.batch));
    }
    if let Some(mut c) = llama::LlamaConfig::preset(name) {
        decoder_options!(c, opts);
        return Ok((llama::build(&c)?, c.batch));
    }
    let Some(mut c) = gpt2::Gpt2Config::preset(name) else {
        return Err(Error::UnknownExample {
            name: name.to_string(),
            known: EXAMPLES.join(", "),
        });
    };
    decoder_options!(c, opts);
    c.fused_attention = opts.fused_attention;
    Ok((gpt2::build(&c)?, c.batch))
}
