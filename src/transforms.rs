//! The whole-graph transforms a command applies to the graph it loads: the
//! loss chain split into chunks ([`crate::split`]) or one rank's step
//! sharded FSDP-style ([`crate::models::fsdp`]), not yet both. The
//! CLI builds a [`Transforms`] from its flags (`--split`,
//! `--world-size`...) and a bench source from its spec's keys (`split=K`,
//! `world=N`...); both apply it here, so a graph named either way is the
//! same graph.

use crate::error::Error;
use crate::graph::Graph;
use crate::models::fsdp::{FsdpOptions, default_unit, shard_with};

/// What to do to a loaded graph (nothing by default).
#[derive(Clone, Debug)]
pub struct Transforms {
    /// Split the loss chain and the row-wise (MLP) regions into this many
    /// chunks (`None`: leave them).
    pub split_chunks: Option<u64>,
    /// Shard over `fsdp.world` ranks when that is more than one.
    pub fsdp: FsdpOptions,
}

impl Default for Transforms {
    fn default() -> Transforms {
        Transforms {
            split_chunks: None,
            fsdp: FsdpOptions::new(1),
        }
    }
}

impl Transforms {
    /// `g` sharded, then split, as these say. Sharding comes first: it
    /// reduce-scatters each gradient after the op that makes it, and a
    /// split step's head gradient is made by its first chunk and
    /// accumulated by the rest, so the reduction must read the sum; split
    /// after sharding, it does (as `memplan.torch` splits captured steps
    /// after sharding them).
    pub fn apply(&self, g: Graph) -> Result<Graph, Error> {
        if self.fsdp.world == 0 {
            return Err(Error::InvalidArgument(
                "the world size must be at least 1".into(),
            ));
        }
        let g = if self.fsdp.world > 1 {
            shard_with(&g, &self.fsdp, &default_unit)?
        } else {
            g
        };
        match self.split_chunks {
            Some(k) => crate::split::split_graph(&g, k),
            None => Ok(g),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::{ExampleOptions, example};

    #[test]
    fn split_and_shard_compose() {
        let g = || example("llama-tiny", &ExampleOptions::default()).unwrap();
        let plain = g();
        assert_eq!(
            Transforms::default().apply(g()).unwrap().ops().len(),
            plain.ops().len()
        );
        let split = Transforms {
            split_chunks: Some(4),
            ..Default::default()
        };
        assert!(split.apply(g()).unwrap().ops().len() > plain.ops().len());
        let mut sharded = Transforms::default();
        sharded.fsdp.world = 2;
        assert!(sharded.apply(g()).unwrap().name.ends_with("-fsdp2"));
        // Both: sharded first, then split, so the split head gradient is
        // accumulated before its reduce-scatter reads it.
        let both = Transforms {
            split_chunks: Some(4),
            fsdp: sharded.fsdp,
        };
        let sg = both.apply(g()).unwrap();
        let by_hand = crate::split::split_graph(&sharded.apply(g()).unwrap(), 4).unwrap();
        assert_eq!(sg.ops().len(), by_hand.ops().len());
        assert!(sg.ops().len() > sharded.apply(g()).unwrap().ops().len());
        // Whatever reads the head gradient on its way to the reduce-scatter
        // (its copy into the unit's flat buffer) runs after its last chunk.
        let order = sg.program_order();
        let at = |o| order.iter().position(|&x| x == o).unwrap();
        let last_chunk = sg
            .op_ids()
            .filter(|&o| sg.op(o).op_type == "matmul_tn" && !sg.op(o).updates.is_empty())
            .max_by_key(|&o| at(o))
            .expect("the head's products, split");
        let head = sg.op(last_chunk).updates[0];
        let readers: Vec<_> = sg
            .op_ids()
            .filter(|&o| sg.op(o).op_type != "matmul_tn" && sg.op(o).inputs.contains(&head))
            .collect();
        assert!(
            !readers.is_empty(),
            "the head gradient is read for its reduction"
        );
        assert!(readers.iter().all(|&o| at(o) > at(last_chunk)));
        sharded.fsdp.world = 0;
        assert!(sharded.apply(g()).is_err());
    }
}
