//! A built-in example as one value: its name, its options and the
//! transforms applied after it ([`ExampleSpec`]). The CLI builds one from
//! `--example NAME` and its flags, the bench and the bindings read one
//! from text (`example:NAME[,key=value...]`, [`ExampleSpec::parse`]); both
//! build the graph with [`ExampleSpec::build`], so a step named either way
//! is the same graph.
//!
//! The keys: `batch`, `seq`, `layers`, `dtype`, `clip`, `split` (the loss
//! chain in that many chunks), `world` (one rank's step sharded FSDP-style
//! over that many ranks), `prefetch` (all-gathers issued ahead, default 1)
//! and the flags `noreshard` (keep gathered parameters from forward to
//! backward), `flat` (FSDP1's flat shards), `reduce=bf16` (reduce-scatter
//! in bf16 under mixed precision), `checkpoint`, `fused` (fused attention)
//! and `mixed` (mixed precision), each the CLI flag of the same name.

use crate::error::Error;
use crate::graph::Graph;
use crate::models::fsdp::ShardLayout;
use crate::models::{DType, EXAMPLES, ExampleOptions};
use crate::transforms::Transforms;

/// The prefix that names a built-in example instead of a file.
pub const PREFIX: &str = "example:";

/// A built-in example, its options and its transforms.
#[derive(Clone, Debug)]
pub struct ExampleSpec {
    /// One of [`EXAMPLES`].
    pub name: String,
    pub opts: ExampleOptions,
    /// Split and shard as these say ([`crate::transforms`]).
    pub transforms: Transforms,
}

impl ExampleSpec {
    /// Example `name` with its default options and no transforms; an error
    /// naming the known examples when there is none of that name.
    pub fn new(name: &str) -> Result<ExampleSpec, Error> {
        if !EXAMPLES.contains(&name) {
            return Err(Error::InvalidArgument(format!(
                "unknown example {name:?}; known examples: {}",
                EXAMPLES.join(", ")
            )));
        }
        Ok(ExampleSpec {
            name: name.to_string(),
            opts: ExampleOptions::default(),
            transforms: Transforms::default(),
        })
    }

    /// Reads `NAME[,key=value...]` (with or without the `example:`
    /// prefix); an error quoting `text` names the key that is wrong.
    pub fn parse(text: &str) -> Result<ExampleSpec, Error> {
        let rest = text.trim();
        let rest = rest.strip_prefix(PREFIX).unwrap_or(rest);
        let bad = |why: String| Error::InvalidArgument(format!("{text:?}: {why}"));
        let mut parts = rest.split(',');
        let name = parts.next().unwrap_or_default().trim();
        let mut spec = ExampleSpec::new(name).map_err(|e| bad(e.to_string()))?;
        for part in parts {
            let (key, value) = match part.split_once('=') {
                Some((k, v)) => (k.trim(), Some(v.trim())),
                None => (part.trim(), None),
            };
            spec.set(key, value).map_err(|why| {
                bad(why.unwrap_or_else(|| {
                    format!(
                        "unknown option {part:?} (batch=N, seq=N, layers=N, dtype=T, clip=X, split=K, world=N, prefetch=N, noreshard, flat, reduce=bf16|f32, checkpoint, fused, mixed)"
                    )
                }))
            })?;
        }
        Ok(spec)
    }

    /// Sets one key of the text form; `Err(None)` for an unknown key,
    /// `Err(Some(why))` for a bad value.
    fn set(&mut self, key: &str, value: Option<&str>) -> Result<(), Option<String>> {
        let num = |v: Option<&str>| -> Result<u64, Option<String>> {
            let v = v.ok_or_else(|| Some(format!("{key} needs a value: {key}=N")))?;
            match v.parse::<u64>() {
                Ok(n) if n > 0 => Ok(n),
                _ => Err(Some(format!("{key} must be a positive integer, got {v:?}"))),
            }
        };
        let (opts, fsdp) = (&mut self.opts, &mut self.transforms.fsdp);
        match key {
            "batch" => opts.batch = Some(num(value)?),
            "seq" => opts.seq = Some(num(value)?),
            "layers" => opts.layers = Some(num(value)?),
            "world" => fsdp.world = num(value)?,
            "split" => self.transforms.split_chunks = Some(num(value)?),
            "prefetch" => {
                let v = value.unwrap_or_default();
                fsdp.prefetch = v
                    .parse()
                    .map_err(|_| Some(format!("prefetch must be a whole number, got {v:?}")))?;
            }
            "noreshard" if value.is_none() => fsdp.reshard_after_forward = false,
            "flat" if value.is_none() => fsdp.layout = ShardLayout::Flat,
            "reduce" if value == Some("bf16") => fsdp.reduce_in_compute_dtype = true,
            "reduce" if value == Some("f32") => fsdp.reduce_in_compute_dtype = false,
            "dtype" => {
                let v = value.unwrap_or_default();
                opts.dtype = Some(
                    DType::parse(v)
                        .ok_or_else(|| Some(format!("unknown dtype {v:?} (f32, bf16, f16)")))?,
                );
            }
            "checkpoint" if value.is_none() => opts.checkpoint = true,
            "fused" if value.is_none() => opts.fused_attention = true,
            "mixed" if value.is_none() => opts.mixed_precision = true,
            "clip" => {
                let v = value.unwrap_or_default();
                match v.parse::<f64>().ok().map(crate::models::clip_grad_norm) {
                    Some(Ok(x)) => opts.clip_grad_norm = Some(x),
                    _ => return Err(Some(format!("clip must be a positive number, got {v:?}"))),
                }
            }
            _ => return Err(None),
        }
        Ok(())
    }

    /// The example's graph, split and sharded as the transforms say.
    pub fn build(&self) -> Result<Graph, Error> {
        let g = crate::models::example(&self.name, &self.opts)?;
        self.transforms.apply(g)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_and_fields_give_the_same_spec() {
        let read = ExampleSpec::parse("example:llama-tiny,batch=2,world=2,mixed,split=3").unwrap();
        let mut made = ExampleSpec::new("llama-tiny").unwrap();
        made.opts.batch = Some(2);
        made.opts.mixed_precision = true;
        made.transforms.fsdp.world = 2;
        made.transforms.split_chunks = Some(3);
        let (a, b) = (read.build().unwrap(), made.build().unwrap());
        assert_eq!(
            crate::io::json::write_graph(&a),
            crate::io::json::write_graph(&b)
        );
        // The prefix is optional.
        assert_eq!(
            ExampleSpec::parse("mlp,batch=8").unwrap().opts.batch,
            Some(8)
        );
        for (bad, why) in [
            ("gpt9", "unknown example \"gpt9\""),
            ("gpt2-tiny,batch=0", "batch must be a positive integer"),
            ("gpt2-tiny,clip=-1", "clip must be a positive number"),
            ("gpt2-tiny,colour=red", "unknown option \"colour=red\""),
        ] {
            let e = ExampleSpec::parse(bad).unwrap_err().to_string();
            assert!(e.contains(bad) && e.contains(why), "{e}");
        }
    }
}
