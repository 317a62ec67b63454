//! Buffers with fixed lifetimes, the constraints on their offsets, and the
//! layouts that place them.
//!
//! Time is a number line of steps. A buffer is live over the half-open
//! interval `[lower, upper)`: two buffers conflict when these intervals
//! intersect, and conflicting buffers may not share a byte. A buffer that is
//! live for the whole step ([`Buffer::persistent`]) spans `[0, u64::MAX)`.
//! A [`Reuse`] ties an output to an input whose bytes it takes over (an
//! in-place op): the two sit at the same offset and may share bytes even
//! while both are live.

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
    /// A buffer that keeps its bytes for the whole step (weights, optimizer
    /// state): live over `[0, u64::MAX)`, so it conflicts with every other
    /// buffer.
    pub fn persistent(id: impl Into<String>, size: u64) -> Self {
        Buffer::new(id, 0, u64::MAX, size)
    }
    /// The same buffer with offsets restricted to multiples of `align`.
    pub fn aligned(mut self, align: u64) -> Self {
        self.align = align.max(1);
        self
    }
    /// The same buffer fixed at `offset`.
    pub fn pinned_at(mut self, offset: u64) -> Self {
        self.pinned = Some(offset);
        self
    }
    /// Whether it is live for the whole step.
    pub fn is_persistent(&self) -> bool {
        self.lower == 0 && self.upper == u64::MAX
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

/// `output` takes over the bytes of `input` (indices into
/// [`Problem::buffers`]): both get the same offset, and they may share bytes
/// while both are live (the op that reads `input` writes `output` in place).
/// Chains of reuses form groups that share one offset.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Reuse {
    pub output: usize,
    pub input: usize,
}

/// A set of buffers to place, and the reuses that tie some of them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Problem {
    pub buffers: Vec<Buffer>,
    pub reuses: Vec<Reuse>,
}

/// A layout: one offset per buffer, and the arena height it needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Solution {
    pub offsets: Vec<u64>,
    /// `max(offset + size)` over all non-empty buffers (0 when there are
    /// none).
    pub height: u64,
}

/// A problem that no layout can satisfy for a reason visible up front; see
/// [`Problem::check`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProblemError {
    #[error("reuse #{index}: buffer index {buffer} is out of range ({len} buffers)")]
    ReuseOutOfRange {
        index: usize,
        buffer: usize,
        len: usize,
    },
    #[error("reuse #{index}: buffer {id} cannot reuse itself")]
    SelfReuse { index: usize, id: String },
    #[error("buffer {id}: alignment 0 (use 1 for none)")]
    ZeroAlign { id: String },
    #[error("buffer {id}: pinned at {pinned}, which is not a multiple of its alignment {align}")]
    MisalignedPin { id: String, pinned: u64, align: u64 },
    #[error("buffers {a} and {b} share an offset through reuses but are pinned at {pa} and {pb}")]
    ConflictingPins {
        a: String,
        b: String,
        pa: u64,
        pb: u64,
    },
    #[error("buffer {id}: offset + size overflows u64")]
    Overflow { id: String },
    #[error(
        "buffers {a} and {b} are pinned at offsets where they share bytes while both are live: no layout can satisfy both pins (the input is infeasible)"
    )]
    OverlappingPins { a: String, b: String },
    #[error(
        "buffer {id}: with the buffers live beside it at step {time}, more than 2^64 - 1 bytes are live at once: no layout has offsets that large (the input is infeasible)"
    )]
    TooLarge { id: String, time: u64 },
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
    #[error("buffer {output} reuses {input} but sits at {out_offset}, not {in_offset}")]
    BrokenReuse {
        output: String,
        input: String,
        out_offset: u64,
        in_offset: u64,
    },
    #[error("buffer {id}: offset + size overflows u64")]
    Overflow { id: String },
    #[error("the layout claims height {claimed} but its buffers reach {actual}")]
    WrongHeight { claimed: u64, actual: u64 },
}

/// Part of a reuse group's footprint: `size` bytes at the group's offset over
/// `[lower, upper)`. The pieces of one group never overlap in time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Piece {
    group: usize,
    lower: u64,
    upper: u64,
    size: u64,
    /// A buffer of the group whose size this piece takes (for messages).
    buffer: usize,
}

/// Union-find roots: the reuse group of every buffer (its smallest index).
/// Reuses out of range are ignored here (see [`Problem::check`]).
pub(crate) fn groups(problem: &Problem) -> Vec<usize> {
    let n = problem.buffers.len();
    let mut parent: Vec<usize> = (0..n).collect();
    fn find(p: &mut [usize], mut x: usize) -> usize {
        while p[x] != x {
            p[x] = p[p[x]];
            x = p[x];
        }
        x
    }
    for r in &problem.reuses {
        if r.output < n && r.input < n {
            let (a, b) = (find(&mut parent, r.output), find(&mut parent, r.input));
            let (lo, hi) = (a.min(b), a.max(b));
            parent[hi] = lo;
        }
    }
    (0..n).map(|i| find(&mut parent, i)).collect()
}

/// The footprint of every group: at each time, the largest member live then.
fn pieces(problem: &Problem) -> Vec<Piece> {
    let bufs = &problem.buffers;
    let group = groups(problem);
    let mut members: Vec<Vec<usize>> = vec![Vec::new(); bufs.len()];
    for (i, &g) in group.iter().enumerate() {
        if !bufs[i].is_empty() {
            members[g].push(i);
        }
    }
    let mut out = Vec::new();
    for (g, m) in members.iter().enumerate() {
        match m.as_slice() {
            [] => {}
            [i] => out.push(Piece {
                group: g,
                lower: bufs[*i].lower,
                upper: bufs[*i].upper,
                size: bufs[*i].size,
                buffer: *i,
            }),
            _ => {
                let mut cuts: Vec<u64> = m
                    .iter()
                    .flat_map(|&i| [bufs[i].lower, bufs[i].upper])
                    .collect();
                cuts.sort_unstable();
                cuts.dedup();
                for w in cuts.windows(2) {
                    let (lo, hi) = (w[0], w[1]);
                    let live = m
                        .iter()
                        .filter(|&&i| bufs[i].lower <= lo && hi <= bufs[i].upper)
                        .max_by_key(|&&i| bufs[i].size);
                    if let Some(&i) = live {
                        out.push(Piece {
                            group: g,
                            lower: lo,
                            upper: hi,
                            size: bufs[i].size,
                            buffer: i,
                        });
                    }
                }
            }
        }
    }
    out
}

impl Problem {
    /// A problem of these buffers with no reuses.
    pub fn new(buffers: Vec<Buffer>) -> Self {
        Problem {
            buffers,
            reuses: Vec::new(),
        }
    }

    /// The largest sum of sizes of buffers live at one time (a reuse group
    /// counts once, at the size of its largest member live then): no layout
    /// can be lower than this.
    pub fn max_live(&self) -> u64 {
        let mut events: Vec<(u64, i128)> = Vec::with_capacity(self.buffers.len() * 2);
        for p in pieces(self) {
            events.push((p.lower, p.size as i128));
            events.push((p.upper, -(p.size as i128)));
        }
        // Frees at time t happen before allocations at t: [lower, upper).
        events.sort_by(|a, b| a.0.cmp(&b.0).then(a.1.cmp(&b.1)));
        let (mut cur, mut best) = (0i128, 0i128);
        for (_, d) in events {
            cur += d;
            best = best.max(cur);
        }
        best.min(u64::MAX as i128) as u64
    }

    /// The first time more than `u64::MAX` bytes are live at once, with a
    /// buffer that starts then: such a problem has no layout.
    fn live_beyond_u64(&self) -> Option<(usize, u64)> {
        let mut events: Vec<(u64, i128, usize)> = Vec::with_capacity(self.buffers.len() * 2);
        for p in pieces(self) {
            events.push((p.lower, p.size as i128, p.buffer));
            events.push((p.upper, -(p.size as i128), p.buffer));
        }
        events.sort_by(|a, b| a.0.cmp(&b.0).then(a.1.cmp(&b.1)));
        let mut cur = 0i128;
        for (t, d, buffer) in events {
            cur += d;
            if cur > u64::MAX as i128 {
                return Some((buffer, t));
            }
        }
        None
    }

    /// Checks what can be checked without planning: reuse indices, pins that
    /// agree with alignments and with each other inside a reuse group.
    pub fn check(&self) -> Result<(), ProblemError> {
        let bufs = &self.buffers;
        for (index, r) in self.reuses.iter().enumerate() {
            for buffer in [r.output, r.input] {
                if buffer >= bufs.len() {
                    return Err(ProblemError::ReuseOutOfRange {
                        index,
                        buffer,
                        len: bufs.len(),
                    });
                }
            }
            if r.output == r.input {
                return Err(ProblemError::SelfReuse {
                    index,
                    id: bufs[r.output].id.clone(),
                });
            }
        }
        for b in bufs {
            if b.align == 0 {
                return Err(ProblemError::ZeroAlign { id: b.id.clone() });
            }
            if let Some(p) = b.pinned {
                if p % b.align != 0 {
                    return Err(ProblemError::MisalignedPin {
                        id: b.id.clone(),
                        pinned: p,
                        align: b.align,
                    });
                }
                if p.checked_add(b.size).is_none() {
                    return Err(ProblemError::Overflow { id: b.id.clone() });
                }
            }
        }
        let group = groups(self);
        let mut pin_of: Vec<Option<usize>> = vec![None; bufs.len()];
        for (i, b) in bufs.iter().enumerate() {
            let Some(p) = b.pinned else { continue };
            match pin_of[group[i]] {
                Some(j) if bufs[j].pinned != Some(p) => {
                    return Err(ProblemError::ConflictingPins {
                        a: bufs[j].id.clone(),
                        b: b.id.clone(),
                        pa: bufs[j].pinned.unwrap_or(0),
                        pb: p,
                    });
                }
                Some(_) => {}
                None => pin_of[group[i]] = Some(i),
            }
        }
        if let Some((buffer, time)) = self.live_beyond_u64() {
            return Err(ProblemError::TooLarge {
                id: bufs[buffer].id.clone(),
                time,
            });
        }
        // Pinned groups never move: two that share bytes while live make
        // every layout invalid, so say so here rather than after a search
        // (nothing to do without pins: the footprints cost a tenth of a
        // second at 200,000 buffers).
        if pin_of.iter().all(Option::is_none) {
            return Ok(());
        }
        let mut pinned: Vec<Piece> = pieces(self)
            .into_iter()
            .filter(|p| pin_of[p.group].is_some())
            .collect();
        let at = |p: &Piece| {
            bufs[pin_of[p.group].unwrap_or(p.buffer)]
                .pinned
                .unwrap_or(0)
        };
        if let Some((i, j)) = first_overlap(&mut pinned, at) {
            let (a, b) = (i.min(j), i.max(j));
            return Err(ProblemError::OverlappingPins {
                a: bufs[a].id.clone(),
                b: bufs[b].id.clone(),
            });
        }
        Ok(())
    }
}

/// Checks a layout on its own terms: alignment, pins, reuses (same offset),
/// capacity (if given), the claimed height, and that buffers live together
/// never share a byte unless a reuse ties them. Sweeps time, so it costs
/// `O(b log b)` plus the reuse groups' own sweeps.
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
    let mut height = 0u64;
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
        if b.is_empty() {
            continue;
        }
        height = height.max(end);
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
    if height != solution.height {
        return Err(LayoutError::WrongHeight {
            claimed: solution.height,
            actual: height,
        });
    }
    for r in &problem.reuses {
        let (o, i) = (
            solution.offsets.get(r.output),
            solution.offsets.get(r.input),
        );
        if let (Some(&o), Some(&i)) = (o, i)
            && o != i
        {
            return Err(LayoutError::BrokenReuse {
                output: bufs[r.output].id.clone(),
                input: bufs[r.input].id.clone(),
                out_offset: o,
                in_offset: i,
            });
        }
    }
    let mut ps = pieces(problem);
    match first_overlap(&mut ps, |p| solution.offsets[p.group]) {
        Some((i, j)) => Err(overlap(bufs, i, j)),
        None => Ok(()),
    }
}

/// Two buffers whose pieces share bytes while live, each piece at
/// `offset(piece)`. Sweeps time over
/// the groups' pieces (time-disjoint within a group, so any two live pieces
/// belong to different groups), keeps the live set ordered by offset and
/// checks each new piece against its neighbours in address order.
fn first_overlap(ps: &mut [Piece], offset: impl Fn(&Piece) -> u64) -> Option<(usize, usize)> {
    ps.sort_by_key(|p| (p.lower, p.group, p.upper));
    let mut live: std::collections::BTreeSet<(u64, usize)> = Default::default();
    let mut ends: std::collections::BinaryHeap<std::cmp::Reverse<(u64, u64, usize)>> =
        Default::default();
    for (k, p) in ps.iter().enumerate() {
        while let Some(&std::cmp::Reverse((upper, off, j))) = ends.peek() {
            if upper <= p.lower {
                ends.pop();
                live.remove(&(off, j));
            } else {
                break;
            }
        }
        let off = offset(p);
        let end = off.saturating_add(p.size);
        if let Some(&(o, j)) = live.range(..=(off, usize::MAX)).next_back()
            && o.saturating_add(ps[j].size) > off
        {
            return Some((p.buffer, ps[j].buffer));
        }
        if let Some(&(o, j)) = live.range((off, 0)..).next()
            && o < end
        {
            return Some((p.buffer, ps[j].buffer));
        }
        live.insert((off, k));
        ends.push(std::cmp::Reverse((p.upper, off, k)));
    }
    None
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
        let p = Problem::new(vec![Buffer::new("a", 0, 2, 4), Buffer::new("b", 2, 3, 4)]);
        assert_eq!(p.max_live(), 4);
    }

    #[test]
    fn max_live_counts_a_reuse_group_once() {
        // b takes a's bytes at step 1, where both are live.
        let mut p = Problem::new(vec![
            Buffer::new("a", 0, 2, 4),
            Buffer::new("b", 1, 3, 4),
            Buffer::new("c", 0, 3, 2),
        ]);
        assert_eq!(p.max_live(), 10);
        p.reuses.push(Reuse {
            output: 1,
            input: 0,
        });
        assert_eq!(p.max_live(), 6);
    }

    #[test]
    fn validate_catches_overlap_alignment_capacity_and_height() {
        let mut p = Problem::new(vec![Buffer::new("a", 0, 2, 4), Buffer::new("b", 1, 3, 4)]);
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
        let lying = Solution {
            offsets: vec![0, 4],
            height: 7,
        };
        assert!(matches!(
            validate(&p, &lying, None),
            Err(LayoutError::WrongHeight { .. })
        ));
        p.buffers[1].align = 8;
        assert!(matches!(
            validate(&p, &ok, None),
            Err(LayoutError::Misaligned { .. })
        ));
    }

    #[test]
    fn validate_lets_a_reuse_share_bytes_but_nothing_else() {
        let mut p = Problem::new(vec![
            Buffer::new("a", 0, 2, 4),
            Buffer::new("b", 1, 3, 4),
            Buffer::new("c", 1, 2, 4),
        ]);
        p.reuses.push(Reuse {
            output: 1,
            input: 0,
        });
        let ok = Solution {
            offsets: vec![0, 0, 4],
            height: 8,
        };
        assert_eq!(validate(&p, &ok, None), Ok(()));
        let moved = Solution {
            offsets: vec![0, 4, 8],
            height: 12,
        };
        assert!(matches!(
            validate(&p, &moved, None),
            Err(LayoutError::BrokenReuse { .. })
        ));
        // c on top of the group's bytes.
        let clash = Solution {
            offsets: vec![2, 2, 0],
            height: 6,
        };
        assert!(matches!(
            validate(&p, &clash, None),
            Err(LayoutError::Overlap { .. })
        ));
    }

    #[test]
    fn validate_sees_an_overlap_hidden_behind_a_short_neighbour() {
        // a [0,10) at 0..10, b [0,1) at 10..12 ends early, c [2,3) at 5..7
        // overlaps a only.
        let p = Problem::new(vec![
            Buffer::new("a", 0, 10, 10),
            Buffer::new("b", 0, 1, 2),
            Buffer::new("c", 2, 3, 2),
        ]);
        let s = Solution {
            offsets: vec![0, 10, 5],
            height: 12,
        };
        assert!(matches!(
            validate(&p, &s, None),
            Err(LayoutError::Overlap { .. })
        ));
    }

    #[test]
    fn check_rejects_bad_reuses_and_pins() {
        let mut p = Problem::new(vec![Buffer::new("a", 0, 2, 4), Buffer::new("b", 1, 3, 4)]);
        p.reuses.push(Reuse {
            output: 1,
            input: 7,
        });
        assert!(matches!(
            p.check(),
            Err(ProblemError::ReuseOutOfRange { .. })
        ));
        p.reuses[0].input = 0;
        p.buffers[0].pinned = Some(0);
        p.buffers[1].pinned = Some(4);
        assert!(matches!(
            p.check(),
            Err(ProblemError::ConflictingPins { .. })
        ));
        p.buffers[1].pinned = Some(0);
        assert_eq!(p.check(), Ok(()));
        p.buffers[1].align = 3;
        p.buffers[1].pinned = Some(4);
        p.reuses.clear();
        assert!(matches!(p.check(), Err(ProblemError::MisalignedPin { .. })));
    }

    /// Inputs no layout can satisfy are refused by name before any search
    /// (they used to reach the checker as "the allocator produced an
    /// invalid layout").
    #[test]
    fn check_refuses_overlapping_pins_and_more_than_u64_bytes_live() {
        let p = Problem::new(vec![
            Buffer::new("a", 0, 4, 8).pinned_at(0),
            Buffer::new("b", 2, 6, 8).pinned_at(4),
        ]);
        assert_eq!(
            p.check(),
            Err(ProblemError::OverlappingPins {
                a: "a".into(),
                b: "b".into()
            })
        );
        // Apart in time, or apart in bytes, they are fine; so is a reuse.
        let apart = Problem::new(vec![
            Buffer::new("a", 0, 2, 8).pinned_at(0),
            Buffer::new("b", 2, 6, 8).pinned_at(4),
            Buffer::new("c", 0, 6, 8).pinned_at(12),
        ]);
        assert_eq!(apart.check(), Ok(()));
        let mut reuse = Problem::new(vec![
            Buffer::new("x", 0, 3, 8).pinned_at(0),
            Buffer::new("y", 2, 6, 8).pinned_at(0),
        ]);
        reuse.reuses.push(Reuse {
            output: 1,
            input: 0,
        });
        assert_eq!(reuse.check(), Ok(()));
        let huge = Problem::new(vec![
            Buffer::new("h0", 0, 2, u64::MAX),
            Buffer::new("h1", 1, 3, u64::MAX),
        ]);
        assert_eq!(
            huge.check(),
            Err(ProblemError::TooLarge {
                id: "h1".into(),
                time: 1
            })
        );
        assert_eq!(huge.max_live(), u64::MAX);
        // One at a time fits at offset 0.
        let one = Problem::new(vec![
            Buffer::new("h0", 0, 2, u64::MAX),
            Buffer::new("h1", 2, 3, u64::MAX),
        ]);
        assert_eq!(one.check(), Ok(()));
    }
}
