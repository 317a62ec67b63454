//! Greedy best-fit placement in decreasing size order (TFLite's
//! greedy-by-size, XLA's spatial sort).
//!
//! Buffers are taken largest first (ties: longer life first, then index).
//! Each goes into the smallest gap between already placed buffers that are
//! live at the same time and that holds it at its alignment; when no gap
//! holds it, it goes on top of the highest of them. Pinned buffers are placed
//! first, where they are pinned. Cost: `O(b^2)` in the worst case, `O(b * k)`
//! where `k` is the number of buffers live together.

use crate::problem::{Buffer, Problem, Solution};

/// Where a buffer would land among `placed` (offset, end) ranges sorted by
/// offset, best fit: the smallest free gap that holds it, else the top.
pub(crate) fn best_fit_offset(b: &Buffer, placed: &mut [(u64, u64)]) -> u64 {
    placed.sort_unstable();
    let align = b.align.max(1);
    let mut best: Option<(u64, u64)> = None; // (gap size, offset)
    let mut cursor = 0u64;
    for &(off, end) in placed.iter() {
        if off > cursor {
            let start = cursor.next_multiple_of(align);
            if start + b.size <= off {
                let gap = off - cursor;
                if best.is_none_or(|(g, _)| gap < g) {
                    best = Some((gap, start));
                }
            }
        }
        cursor = cursor.max(end);
    }
    match best {
        Some((_, off)) => off,
        None => cursor.next_multiple_of(align),
    }
}

/// Places `problem`'s buffers greedily by decreasing size, best fit.
pub fn greedy_by_size(problem: &Problem) -> Solution {
    let bufs = &problem.buffers;
    let mut order: Vec<usize> = (0..bufs.len()).collect();
    order.sort_by(|&a, &b| {
        let (x, y) = (&bufs[a], &bufs[b]);
        y.pinned
            .is_some()
            .cmp(&x.pinned.is_some())
            .then(y.size.cmp(&x.size))
            .then((y.upper - y.lower.min(y.upper)).cmp(&(x.upper - x.lower.min(x.upper))))
            .then(a.cmp(&b))
    });
    place_in_order(problem, &order)
}

/// Places buffers one by one in the given order, each best fit among the
/// already placed buffers it overlaps in time.
pub fn place_in_order(problem: &Problem, order: &[usize]) -> Solution {
    let bufs = &problem.buffers;
    let mut offsets = vec![0u64; bufs.len()];
    let mut placed_ids: Vec<usize> = Vec::with_capacity(bufs.len());
    let mut scratch = Vec::new();
    let mut height = 0u64;
    for &i in order {
        let b = &bufs[i];
        if b.is_empty() {
            offsets[i] = b.pinned.unwrap_or(0);
            continue;
        }
        let off = match b.pinned {
            Some(pin) => pin,
            None => {
                scratch.clear();
                scratch.extend(
                    placed_ids
                        .iter()
                        .filter(|&&j| bufs[j].overlaps_in_time(b))
                        .map(|&j| (offsets[j], offsets[j] + bufs[j].size)),
                );
                best_fit_offset(b, &mut scratch)
            }
        };
        offsets[i] = off;
        height = height.max(off + b.size);
        placed_ids.push(i);
    }
    Solution { offsets, height }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::problem::validate;

    #[test]
    fn fills_the_gap_left_by_a_dead_buffer() {
        // a [0,2) 4B, b [0,4) 4B, c [2,4) 4B: c takes a's bytes.
        let p = Problem {
            buffers: vec![
                Buffer::new("a", 0, 2, 4),
                Buffer::new("b", 0, 4, 4),
                Buffer::new("c", 2, 4, 4),
            ],
        };
        let s = greedy_by_size(&p);
        validate(&p, &s, None).unwrap();
        assert_eq!(s.height, 8);
    }

    #[test]
    fn respects_alignment_and_pins() {
        let mut p = Problem {
            buffers: vec![Buffer::new("a", 0, 2, 3), Buffer::new("b", 0, 2, 8)],
        };
        p.buffers[0].align = 4;
        p.buffers[1].pinned = Some(0);
        let s = greedy_by_size(&p);
        validate(&p, &s, None).unwrap();
        assert_eq!(s.offsets, vec![8, 0]);
    }
}
