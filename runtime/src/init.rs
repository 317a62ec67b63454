//! Deterministic values: parameter initialization and synthetic batches.
//!
//! Every value is a pure function of `(seed, key, element index)` (a
//! counter-based generator: splitmix64 over a hash of the key), so a
//! parameter gets the same values whether it is one tensor on one device or
//! a segment of a flat buffer sharded over several ranks. That is what lets
//! a sharded run be compared with a single-device run element by element.
//!
//! This module sits below [`crate::program`]: a tensor's description holds
//! its [`Init`], and the init knows only the tensor's element count.

use rand_xoshiro::SplitMix64;
use rand_xoshiro::rand_core::{Rng as _, SeedableRng};

/// How a segment of a tensor is filled.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Fill {
    Zeros,
    Ones,
    /// Normal with mean 0 and this standard deviation.
    Normal {
        std: f32,
    },
}

/// A run of elements of the (flat, unsharded) tensor filled from one key.
#[derive(Clone, Debug, PartialEq)]
pub struct InitSegment {
    /// The generator's key (the parameter's name): equal keys give equal values.
    pub key: String,
    /// First element of the segment in the flat tensor.
    pub offset: u64,
    pub elements: u64,
    pub fill: Fill,
}

/// How to initialize a tensor. Elements outside every segment are zero.
///
/// With `sharded`, the tensor is rank `r`'s shard of a flat buffer of
/// `world × elements` elements: it holds elements `[r·n, (r+1)·n)` of it.
#[derive(Clone, Debug, PartialEq)]
pub struct Init {
    pub segments: Vec<InitSegment>,
    pub sharded: bool,
}

impl Init {
    /// One segment covering the whole (unsharded) tensor.
    pub fn whole(key: impl Into<String>, elements: u64, fill: Fill) -> Init {
        Init {
            segments: vec![InitSegment {
                key: key.into(),
                offset: 0,
                elements,
                fill,
            }],
            sharded: false,
        }
    }

    /// Checks the segments are sorted, disjoint and, unless sharded, inside
    /// a tensor of `elements` elements.
    pub fn validate(&self, elements: u64) -> Result<(), String> {
        let mut end = 0u64;
        for s in &self.segments {
            if s.offset < end {
                return Err(format!(
                    "init segment {:?} starts at element {} inside the previous one",
                    s.key, s.offset
                ));
            }
            end = s
                .offset
                .checked_add(s.elements)
                .ok_or_else(|| format!("init segment {:?} overflows", s.key))?;
            if !self.sharded && end > elements {
                return Err(format!(
                    "init segment {:?} ends at element {end}, past the tensor's {elements}",
                    s.key
                ));
            }
            if let Fill::Normal { std } = s.fill
                && !(std.is_finite() && std >= 0.0)
            {
                return Err(format!("init segment {:?}: bad std {std}", s.key));
            }
        }
        Ok(())
    }

    /// The values of the `n` elements rank `rank` holds.
    pub fn values(&self, seed: u64, rank: u64, n: u64) -> Vec<f32> {
        let first = if self.sharded { rank * n } else { 0 };
        let mut out = vec![0.0f32; n as usize];
        for s in &self.segments {
            let lo = s.offset.max(first);
            let hi = (s.offset + s.elements).min(first + n);
            if lo >= hi {
                continue;
            }
            let key = hash_key(seed, &s.key);
            for p in lo..hi {
                out[(p - first) as usize] = match s.fill {
                    Fill::Zeros => 0.0,
                    Fill::Ones => 1.0,
                    Fill::Normal { std } => std * normal(key, p - s.offset),
                };
            }
        }
        out
    }
}

/// FNV-1a of the key, mixed with the seed.
pub fn hash_key(seed: u64, key: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in key.bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    splitmix(h ^ seed.wrapping_mul(0x9e37_79b9_7f4a_7c15))
}

/// A well-mixed 64-bit function of `x`: the first output of SplitMix64
/// seeded with `x` (its finalizer of `x` plus the golden-ratio step).
pub fn splitmix(x: u64) -> u64 {
    SplitMix64::seed_from_u64(x).next_u64()
}

/// A uniform value in (0, 1) for element `i` of stream `key`.
fn uniform(key: u64, i: u64, lane: u64) -> f64 {
    let r = splitmix(key ^ splitmix(i.wrapping_mul(2).wrapping_add(lane)));
    ((r >> 11) as f64 + 0.5) / (1u64 << 53) as f64
}

/// A standard normal value for element `i` of stream `key` (Box–Muller).
pub fn normal(key: u64, i: u64) -> f32 {
    let u1 = uniform(key, i, 0);
    let u2 = uniform(key, i, 1);
    ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
}

/// A synthetic integer in `[0, range)` for element `i` of stream `key`
/// (`range` ≥ 1).
pub fn integer(key: u64, i: u64, range: u64) -> i32 {
    (splitmix(key ^ splitmix(i)) % range.max(1)) as i32
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The reference SplitMix64's outputs (Vigna's splitmix64.c; the
    /// workspace's generator before it came from `rand_xoshiro`): every
    /// initial value and synthetic batch rests on them.
    #[test]
    fn splitmix_is_the_reference_generator() {
        assert_eq!(splitmix(0), 16294208416658607535);
        assert_eq!(splitmix(u64::MAX), 16490336266968443936);
        let mut x = 1234567u64;
        let mut seq = Vec::new();
        for _ in 0..3 {
            seq.push(splitmix(x));
            x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
        }
        assert_eq!(
            seq,
            [
                6457827717110365317,
                3203168211198807973,
                9817491932198370423
            ]
        );
    }

    #[test]
    fn shards_concatenate_to_the_whole() {
        let seg = |key: &str, offset, elements, fill| InitSegment {
            key: key.into(),
            offset,
            elements,
            fill,
        };
        let flat = Init {
            segments: vec![
                seg("a", 0, 5, Fill::Normal { std: 0.5 }),
                seg("b", 8, 3, Fill::Ones),
            ],
            sharded: true,
        };
        let whole_a = Init::whole("a", 5, Fill::Normal { std: 0.5 }).values(7, 0, 5);
        let mut all = Vec::new();
        for r in 0..4 {
            all.extend(flat.values(7, r, 3));
        }
        assert_eq!(&all[..5], &whole_a[..]);
        assert_eq!(&all[5..8], &[0.0; 3]);
        assert_eq!(&all[8..11], &[1.0; 3]);
        assert_eq!(all[11], 0.0);
        // A different seed gives different values.
        assert_ne!(
            Init::whole("a", 5, Fill::Normal { std: 0.5 }).values(8, 0, 5),
            whole_a
        );
    }

    #[test]
    fn normal_values_look_normal() {
        let v = Init::whole("w", 20000, Fill::Normal { std: 2.0 }).values(1, 0, 20000);
        let mean = v.iter().map(|&x| x as f64).sum::<f64>() / v.len() as f64;
        let var = v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / v.len() as f64;
        assert!(mean.abs() < 0.05, "mean {mean}");
        assert!((var.sqrt() - 2.0).abs() < 0.05, "std {}", var.sqrt());
    }

    #[test]
    fn rejects_overlapping_segments() {
        let t = 10;
        let init = Init {
            segments: vec![
                InitSegment {
                    key: "a".into(),
                    offset: 0,
                    elements: 6,
                    fill: Fill::Ones,
                },
                InitSegment {
                    key: "b".into(),
                    offset: 5,
                    elements: 2,
                    fill: Fill::Ones,
                },
            ],
            sharded: false,
        };
        assert!(
            init.validate(t)
                .unwrap_err()
                .contains("inside the previous")
        );
        let past = Init::whole("a", 11, Fill::Ones);
        assert!(past.validate(t).unwrap_err().contains("past the tensor"));
    }
}
