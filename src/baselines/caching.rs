//! A simulation of PyTorch's CUDA caching allocator, to tell what a PyTorch
//! eager user would see as reserved memory for the same step.
//!
//! Modelled after `c10/cuda/CUDACachingAllocator.cpp` with default settings
//! (checked against its `round_size`, `get_pool`, `get_allocation_size`,
//! `get_free_block`, `should_split`, `alloc_found_block` and `free_block`):
//! - requests round up to a multiple of 512 bytes (at least 512);
//! - two pools per stream: small (rounded requests ≤ 1 MiB) and large; a
//!   free block serves only requests of its own pool and stream;
//! - a cache miss reserves a new segment: 2 MiB for small requests, 20 MiB
//!   for requests under 10 MiB, else the request rounded up to 2 MiB;
//! - lookup is best fit: the smallest free cached block of the pool that is
//!   large enough;
//! - a block is split when the remainder is ≥ 512 B (small pool) or > 1 MiB
//!   (large pool); the remainder stays free in the pool, and an unsplit
//!   block is handed out whole (its whole size counts as allocated, as in
//!   PyTorch's `allocated_bytes`);
//! - a freed block merges with its free neighbours in its segment and stays
//!   cached; segments are never released.
//!
//! Simplified: real ties between equal-sized free blocks go to the lowest
//! device address, which a simulation cannot know; here they go to the
//! oldest segment, then the lowest offset. No `max_split_size`,
//! `roundup_power2_divisions`, garbage collection or expandable segments
//! (all off by default in PyTorch). No release-and-retry after an
//! out-of-memory error (memory is unbounded, so the peak reserved is what
//! the step would ask of the device). A tensor used on another stream than
//! its own is freed at once, as if `record_stream` events completed
//! immediately. Events happen in op order: an op's outputs are allocated,
//! then every tensor whose last use was that op is freed; the kernels'
//! internal workspaces are not modelled.

use std::collections::{BTreeMap, BTreeSet};

const MIN_BLOCK: u64 = 512;
const SMALL_SIZE: u64 = 1 << 20;
const SMALL_BUFFER: u64 = 2 << 20;
const LARGE_BUFFER: u64 = 20 << 20;
const MIN_LARGE_ALLOC: u64 = 10 << 20;
const ROUND_LARGE: u64 = 2 << 20;

/// Peak figures of a simulated run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CachingStats {
    /// Peak of bytes held by live blocks (`max_memory_allocated`, rounded
    /// sizes).
    pub max_allocated: u64,
    /// Peak of bytes reserved in segments (`max_memory_reserved`).
    pub max_reserved: u64,
    /// Number of segments reserved.
    pub segments: usize,
}

#[derive(Clone, Copy, Debug)]
struct Block {
    size: u64,
    free: bool,
    small: bool,
}

/// The allocator's state.
#[derive(Default, Debug)]
pub struct CachingAllocator {
    /// Blocks of every segment by offset.
    segments: Vec<BTreeMap<u64, Block>>,
    /// Stream of every segment.
    segment_stream: Vec<u32>,
    /// Free blocks: (stream, size, segment, offset), one set per pool.
    small_pool: BTreeSet<(u32, u64, usize, u64)>,
    large_pool: BTreeSet<(u32, u64, usize, u64)>,
    allocated: u64,
    reserved: u64,
    pub stats: CachingStats,
}

/// Where an allocation lives, to free it later.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Handle {
    segment: usize,
    offset: u64,
}

fn round_size(size: u64) -> u64 {
    if size < MIN_BLOCK {
        MIN_BLOCK
    } else {
        size.div_ceil(MIN_BLOCK) * MIN_BLOCK
    }
}

fn segment_size(size: u64) -> u64 {
    if size <= SMALL_SIZE {
        SMALL_BUFFER
    } else if size < MIN_LARGE_ALLOC {
        LARGE_BUFFER
    } else {
        size.div_ceil(ROUND_LARGE) * ROUND_LARGE
    }
}

impl CachingAllocator {
    pub fn new() -> Self {
        Self::default()
    }

    fn pool(&mut self, small: bool) -> &mut BTreeSet<(u32, u64, usize, u64)> {
        if small {
            &mut self.small_pool
        } else {
            &mut self.large_pool
        }
    }

    /// Allocates `size` bytes (must be > 0) on stream 0.
    pub fn malloc(&mut self, size: u64) -> Handle {
        self.malloc_on(size, 0)
    }

    /// Allocates `size` bytes (must be > 0) for use on `stream`.
    pub fn malloc_on(&mut self, size: u64, stream: u32) -> Handle {
        let size = round_size(size);
        let small = size <= SMALL_SIZE;
        let found = self
            .pool(small)
            .range((stream, size, 0, 0)..=(stream, u64::MAX, usize::MAX, u64::MAX))
            .next()
            .copied();
        let (segment, offset, bsize) = match found {
            Some(key) => {
                self.pool(small).remove(&key);
                (key.2, key.3, key.1)
            }
            None => {
                let seg = segment_size(size);
                self.segments.push(BTreeMap::from([(
                    0,
                    Block {
                        size: seg,
                        free: true,
                        small,
                    },
                )]));
                self.segment_stream.push(stream);
                self.reserved += seg;
                self.stats.segments = self.segments.len();
                self.stats.max_reserved = self.stats.max_reserved.max(self.reserved);
                (self.segments.len() - 1, 0, seg)
            }
        };
        let remaining = bsize - size;
        let split = if small {
            remaining >= MIN_BLOCK
        } else {
            remaining > SMALL_SIZE
        };
        let used = if split { size } else { bsize };
        let seg = &mut self.segments[segment];
        seg.insert(
            offset,
            Block {
                size: used,
                free: false,
                small,
            },
        );
        if split {
            seg.insert(
                offset + size,
                Block {
                    size: remaining,
                    free: true,
                    small,
                },
            );
            self.pool(small)
                .insert((stream, remaining, segment, offset + size));
        }
        self.allocated += used;
        self.stats.max_allocated = self.stats.max_allocated.max(self.allocated);
        Handle { segment, offset }
    }

    /// Frees an allocation, merging it with free neighbours.
    pub fn free(&mut self, h: Handle) {
        let seg = &mut self.segments[h.segment];
        let Some(mut b) = seg.get(&h.offset).copied() else {
            return;
        };
        if b.free {
            return;
        }
        self.allocated -= b.size;
        let small = b.small;
        let stream = self.segment_stream[h.segment];
        let mut start = h.offset;
        let mut merged_away = Vec::new();
        // Merge with the next block.
        if let Some((&no, &nb)) = seg.range(h.offset + 1..).next()
            && nb.free
            && no == h.offset + b.size
        {
            merged_away.push((stream, nb.size, h.segment, no));
            seg.remove(&no);
            b.size += nb.size;
        }
        // Merge with the previous block.
        if let Some((&po, &pb)) = seg.range(..h.offset).next_back()
            && pb.free
            && po + pb.size == h.offset
        {
            merged_away.push((stream, pb.size, h.segment, po));
            seg.remove(&h.offset);
            start = po;
            b.size += pb.size;
        }
        b.free = true;
        self.segments[h.segment].insert(start, b);
        let pool = self.pool(small);
        for k in merged_away {
            pool.remove(&k);
        }
        pool.insert((stream, b.size, h.segment, start));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounds_splits_and_reuses_cached_blocks() {
        let mut a = CachingAllocator::new();
        let x = a.malloc(100);
        assert_eq!(a.stats.max_reserved, 2 << 20);
        let y = a.malloc(600);
        assert_eq!(a.allocated, 512 + 1024);
        a.free(x);
        a.free(y);
        // Everything merged back into one free 2 MiB block.
        assert_eq!(a.small_pool.len(), 1);
        let _z = a.malloc(3 << 20);
        assert_eq!(a.stats.max_reserved, (2 << 20) + (20 << 20));
        // 12 MiB fits the 17 MiB remainder of the 20 MiB segment.
        let _w = a.malloc(12 << 20);
        assert_eq!(a.stats.segments, 2);
        // 18 MiB fits nowhere: a new segment of exactly 18 MiB.
        let _v = a.malloc(18 << 20);
        assert_eq!(a.stats.segments, 3);
        assert_eq!(a.stats.max_reserved, (2 << 20) + (20 << 20) + (18 << 20));
    }

    #[test]
    fn streams_do_not_share_cached_blocks() {
        let mut a = CachingAllocator::new();
        let x = a.malloc_on(1000, 0);
        a.free(x);
        // The free 2 MiB segment belongs to stream 0: stream 1 needs its own.
        let _y = a.malloc_on(1000, 1);
        assert_eq!(a.stats.segments, 2);
        let _z = a.malloc_on(1000, 0);
        assert_eq!(a.stats.segments, 2);
        assert_eq!(a.stats.max_reserved, 2 * (2 << 20));
    }

    #[test]
    fn best_fit_prefers_the_smallest_block_then_the_oldest_segment() {
        let mut a = CachingAllocator::new();
        // x splits a 20 MiB segment (16 MiB stay free); y does not fit
        // there and gets a segment of exactly 18 MiB. Freeing x merges
        // segment 0 back into one free 20 MiB block.
        let x = a.malloc(4 << 20);
        let y = a.malloc(18 << 20);
        a.free(x);
        assert_eq!(a.stats.segments, 2);
        let z = a.malloc(5 << 20);
        assert_eq!(z.segment, 0);
        a.free(y);
        // Free: 15 MiB in segment 0, 18 MiB segment 1. A 15 MiB request
        // fits segment 0's block exactly (best fit), not segment 1.
        let w = a.malloc(15 << 20);
        assert_eq!((w.segment, w.offset), (0, 5 << 20));
        assert_eq!(a.stats.segments, 2);
    }

    #[test]
    fn large_blocks_split_only_above_one_mib() {
        let mut a = CachingAllocator::new();
        let x = a.malloc(19 << 20);
        // 20 MiB segment, remainder exactly 1 MiB: not split.
        assert_eq!(a.allocated, 20 << 20);
        a.free(x);
        let _y = a.malloc(2 << 20);
        assert_eq!(a.allocated, 2 << 20);
        assert_eq!(a.stats.segments, 1);
    }
}
