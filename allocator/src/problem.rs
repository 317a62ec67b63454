//! Buffers with fixed lifetimes, and the layouts that place them.

use std::fmt;

/// One buffer to place: it needs `size` bytes during the half-open time
/// interval `[lower, upper)`, at an offset that is a multiple of `align`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Buffer {
    /// A name for messages and CSV output.
    pub id: String,
    /// First time step it is live.
    pub lower: u64,
    /// First time step it is no longer live (`upper > lower` unless the
    /// buffer is empty in time).
    pub upper: u64,
    /// Bytes it occupies.
    pub size: u64,
    /// Its offset must be a multiple of this (1 for none; a power of two
    /// is not required).
    pub align: u64,
    /// A fixed offset the layout must keep, if any.
    pub pinned: Option<u64>,
}

impl Buffer {
    /// A buffer live over `[lower, upper)` needing `size` bytes, no alignment.
    pub fn new(id: impl Into<String>, lower: u64, upper: u64, size: u64) -> Self {
        Buffer {
            id: id.into(),
            lower,
            upper,
            size,
            align: 1,
            pinned: None,
        }
    }
    /// Whether the two buffers are live at a common time.
    #[inline]
    pub fn overlaps_in_time(&self, other: &Buffer) -> bool {
        self.lower < other.upper && other.lower < self.upper
    }
    /// Whether the buffer takes any room at all.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.size == 0 || self.upper <= self.lower
    }
}

/// A set of buffers to place.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Problem {
    pub buffers: Vec<Buffer>,
}

/// A layout: one offset per buffer, and the arena height it needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Solution {
    pub offsets: Vec<u64>,
    /// `max(offset + size)` over all buffers (0 when there are none).
    pub height: u64,
}

/// A layout that breaks a rule; see [`validate`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    #[error("the layout has {got} offsets for {want} buffers")]
    WrongLength { got: usize, want: usize },
    #[error("buffer {id}: offset {offset} is not a multiple of its alignment {align}")]
    Misaligned { id: String, offset: u64, align: u64 },
    #[error("buffer {id}: pinned at {pinned} but placed at {offset}")]
    MovedPin {
        id: String,
        pinned: u64,
        offset: u64,
    },
    #[error("buffer {id}: [{offset}, {end}) passes the capacity {capacity}")]
    OverCapacity {
        id: String,
        offset: u64,
        end: u64,
        capacity: u64,
    },
    #[error("buffers {a} and {b} are live together and share bytes")]
    Overlap { a: String, b: String },
    #[error("buffer {id}: offset + size overflows u64")]
    Overflow { id: String },
}

impl Problem {
    /// The largest sum of sizes of buffers live at one time: no layout can be
    /// lower than this.
    pub fn max_live(&self) -> u64 {
        let mut events: Vec<(u64, i128)> = Vec::with_capacity(self.buffers.len() * 2);
        for b in &self.buffers {
            if !b.is_empty() {
                events.push((b.lower, b.size as i128));
                events.push((b.upper, -(b.size as i128)));
            }
        }
        // Frees at time t happen before allocations at t: [lower, upper).
        events.sort_by(|a, b| a.0.cmp(&b.0).then(a.1.cmp(&b.1)));
        let (mut cur, mut best) = (0i128, 0i128);
        for (_, d) in events {
            cur += d;
            best = best.max(cur);
        }
        best as u64
    }
}

/// Checks a layout on its own terms: alignment, pins, capacity (if given)
/// and that buffers live together never share a byte. Sweeps time, so it
/// costs `O(b log b + overlapping pairs)`.
pub fn validate(
    problem: &Problem,
    solution: &Solution,
    capacity: Option<u64>,
) -> Result<(), LayoutError> {
    let bufs = &problem.buffers;
    if solution.offsets.len() != bufs.len() {
        return Err(LayoutError::WrongLength {
            got: solution.offsets.len(),
            want: bufs.len(),
        });
    }
    for (b, &off) in bufs.iter().zip(&solution.offsets) {
        if b.align > 1 && off % b.align != 0 {
            return Err(LayoutError::Misaligned {
                id: b.id.clone(),
                offset: off,
                align: b.align,
            });
        }
        if let Some(pin) = b.pinned
            && pin != off
        {
            return Err(LayoutError::MovedPin {
                id: b.id.clone(),
                pinned: pin,
                offset: off,
            });
        }
        let end = off
            .checked_add(b.size)
            .ok_or_else(|| LayoutError::Overflow { id: b.id.clone() })?;
        if let Some(cap) = capacity
            && end > cap
        {
            return Err(LayoutError::OverCapacity {
                id: b.id.clone(),
                offset: off,
                end,
                capacity: cap,
            });
        }
    }
    // Sweep over time; keep the live set ordered by offset and check the new
    // buffer against its neighbours in address order.
    let mut idx: Vec<usize> = (0..bufs.len()).filter(|&i| !bufs[i].is_empty()).collect();
    idx.sort_by_key(|&i| (bufs[i].lower, i));
    let mut live: std::collections::BTreeMap<(u64, usize), ()> = Default::default();
    let mut ends: std::collections::BinaryHeap<std::cmp::Reverse<(u64, u64, usize)>> =
        Default::default();
    for &i in &idx {
        let b = &bufs[i];
        while let Some(&std::cmp::Reverse((upper, off, j))) = ends.peek() {
            if upper <= b.lower {
                ends.pop();
                live.remove(&(off, j));
            } else {
                break;
            }
        }
        let off = solution.offsets[i];
        let end = off + b.size;
        // The live buffer starting at or below `off` with the highest start,
        // and the first one starting above.
        if let Some((&(o, j), _)) = live.range(..=(off, usize::MAX)).next_back()
            && o + bufs[j].size > off
        {
            return Err(overlap(bufs, i, j));
        }
        if let Some((&(o, j), _)) = live.range((off, 0)..).next()
            && o < end
        {
            return Err(overlap(bufs, i, j));
        }
        live.insert((off, i), ());
        ends.push(std::cmp::Reverse((b.upper, off, i)));
    }
    Ok(())
}

fn overlap(bufs: &[Buffer], i: usize, j: usize) -> LayoutError {
    let (a, b) = if i < j { (i, j) } else { (j, i) };
    LayoutError::Overlap {
        a: bufs[a].id.clone(),
        b: bufs[b].id.clone(),
    }
}

impl fmt::Display for Solution {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} buffers in {} bytes", self.offsets.len(), self.height)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn max_live_uses_half_open_intervals() {
        let p = Problem {
            buffers: vec![Buffer::new("a", 0, 2, 4), Buffer::new("b", 2, 3, 4)],
        };
        assert_eq!(p.max_live(), 4);
    }

    #[test]
    fn validate_catches_overlap_and_alignment() {
        let mut p = Problem {
            buffers: vec![Buffer::new("a", 0, 2, 4), Buffer::new("b", 1, 3, 4)],
        };
        let ok = Solution {
            offsets: vec![0, 4],
            height: 8,
        };
        assert!(validate(&p, &ok, Some(8)).is_ok());
        let bad = Solution {
            offsets: vec![0, 2],
            height: 6,
        };
        assert!(matches!(
            validate(&p, &bad, None),
            Err(LayoutError::Overlap { .. })
        ));
        assert!(matches!(
            validate(&p, &ok, Some(7)),
            Err(LayoutError::OverCapacity { .. })
        ));
        p.buffers[1].align = 8;
        assert!(matches!(
            validate(&p, &ok, None),
            Err(LayoutError::Misaligned { .. })
        ));
    }
}
