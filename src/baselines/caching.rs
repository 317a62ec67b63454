//! A simulation of PyTorch's CUDA caching allocator, to tell what a PyTorch
//! eager user would see as reserved memory for the same step, with the
//! default settings or with `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`.
//!
//! Modelled after `c10/cuda/CUDACachingAllocator.cpp` (checked against its
//! `round_size`, `get_pool`, `get_allocation_size`, `get_free_block`,
//! `should_split`, `alloc_found_block`, `free_block`, and for expandable
//! segments `find_expandable_block`, `map_block`,
//! `try_allocate_expandable_block` and `ExpandableSegment::map`).
//!
//! Default settings ([`CachingAllocator::new`]):
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
//! Expandable segments ([`CachingAllocator::expandable`]):
//! - the same rounding and the same two pools per stream, but each pool of
//!   each stream has one segment: a virtual address range whose start is
//!   backed by physical pages, grown at its end a page at a time; pages are
//!   2 MiB in the small pool and 20 MiB in the large one (`kSmallBuffer`,
//!   `kLargeBuffer`);
//! - a cache miss maps the fewest pages that, with the free block at the
//!   end of the mapped range if there is one, hold the request; reserved
//!   bytes are the mapped pages;
//! - lookup is best fit over the mapped free blocks, except that the free
//!   block at the end of the mapped range counts as large as the address
//!   space behind it (PyTorch's `expandable_size`), so it is taken only
//!   when no other free block fits;
//! - every block is split when the remainder is ≥ 512 B, in both pools;
//! - frees merge as above; pages are never unmapped.
//!
//! Simplified: with the default settings, real ties between equal-sized
//! free blocks go to the lowest device address, which a simulation cannot
//! know; here they go to the oldest segment, then the lowest offset. (With
//! expandable segments a pool has one segment, so the lowest offset is the
//! lowest address and ties are exact.) No `max_split_size`,
//! `roundup_power2_divisions` or garbage collection (all off by default in
//! PyTorch). No release-and-retry after an out-of-memory error, and no
//! unmapping of free pages, which PyTorch does only then or on
//! `empty_cache()` (memory is unbounded, so the peak reserved is what the
//! step would ask of the device); an expandable segment's address space
//! (1⅛ of the device's memory in PyTorch) is unbounded here, so a second
//! segment per pool never opens. A tensor used on another stream than its
//! own is freed at once, as if `record_stream` events completed
//! immediately. Events happen in op order: an op's outputs are allocated,
//! then every tensor whose last use was that op is freed; the kernels'
//! internal workspaces are not modelled.

use std::collections::{BTreeMap, BTreeSet, HashMap};

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
    /// Number of segments reserved (with expandable segments: segments
    /// opened, one per pool and stream).
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
    /// `expandable_segments:True`.
    expandable: bool,
    /// Blocks of every segment by offset.
    segments: Vec<BTreeMap<u64, Block>>,
    /// Expandable segments: the bytes mapped in each segment, from offset 0
    /// (its blocks cover exactly that range).
    mapped: Vec<u64>,
    /// Expandable segments: the segment of each (stream, small pool).
    expandable_of: HashMap<(u32, bool), usize>,
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
    /// The allocator with PyTorch's default settings.
    pub fn new() -> Self {
        Self::default()
    }

    /// The allocator with `expandable_segments:True`.
    pub fn expandable() -> Self {
        Self {
            expandable: true,
            ..Self::default()
        }
    }

    /// Best fit in `small`'s pool for a rounded `size` on `stream`:
    /// `(stream, size, segment, offset)` of the free block, taken out of the
    /// pool.
    fn take_free_block(
        &mut self,
        size: u64,
        stream: u32,
        small: bool,
    ) -> Option<(u64, usize, u64)> {
        let range = (stream, size, 0, 0)..=(stream, u64::MAX, usize::MAX, u64::MAX);
        let mut fits = if small {
            self.small_pool.range(range)
        } else {
            self.large_pool.range(range)
        };
        let first = fits.next().copied();
        let second = fits.next().copied();
        let key = match first {
            // The free block at the end of an expandable segment's mapped
            // range counts as large as the address space behind it: any
            // other block that fits comes first.
            Some(k) if self.expandable && k.3 + k.1 == self.mapped[k.2] => second.or(first),
            k => k,
        }?;
        self.pool(small).remove(&key);
        Some((key.1, key.2, key.3))
    }

    /// Expandable segments: maps pages at the end of `small`'s segment of
    /// `stream` until the free block there holds `size` bytes; returns
    /// `(block size, segment, offset)` of that block.
    fn grow(&mut self, size: u64, stream: u32, small: bool) -> (u64, usize, u64) {
        let segment = match self.expandable_of.get(&(stream, small)) {
            Some(&s) => s,
            None => {
                self.segments.push(BTreeMap::new());
                self.segment_stream.push(stream);
                self.mapped.push(0);
                self.stats.segments = self.segments.len();
                let s = self.segments.len() - 1;
                self.expandable_of.insert((stream, small), s);
                s
            }
        };
        let end = self.mapped[segment];
        let tail = self.segments[segment]
            .last_key_value()
            .filter(|(o, b)| b.free && *o + b.size == end)
            .map(|(&o, b)| (o, b.size));
        let (start, have) = match tail {
            Some((o, n)) => {
                self.pool(small).remove(&(stream, n, segment, o));
                (o, n)
            }
            None => (end, 0),
        };
        let page = if small { SMALL_BUFFER } else { LARGE_BUFFER };
        let grown = (size - have).div_ceil(page) * page;
        self.mapped[segment] += grown;
        self.reserved += grown;
        self.stats.max_reserved = self.stats.max_reserved.max(self.reserved);
        (have + grown, segment, start)
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
        let found = self.take_free_block(size, stream, small);
        let (segment, offset, bsize) = match found {
            Some((bsize, segment, offset)) => (segment, offset, bsize),
            None if self.expandable => {
                let (bsize, segment, offset) = self.grow(size, stream, small);
                (segment, offset, bsize)
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
        let split = if small || self.expandable {
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

    const MIB: u64 = 1 << 20;

    #[test]
    fn expandable_segments_grow_by_twenty_mib_pages_in_the_large_pool() {
        let mut a = CachingAllocator::expandable();
        // 100 B rounds to 512 B (small pool): one 2 MiB page of the small
        // pool's segment; the rest of the page stays free (split, ≥ 512 B).
        let _s = a.malloc(100);
        assert_eq!((a.reserved, a.allocated), (2 * MIB, 512));
        // 3 MiB (large pool): one 20 MiB page of a second segment; the
        // block is split, 17 MiB stay free at the end of the mapped range.
        let y = a.malloc(3 * MIB);
        assert_eq!(a.reserved, 22 * MIB);
        assert_eq!(a.stats.segments, 2);
        // 30 MiB fits no free block: the free 17 MiB at the end grow by the
        // fewest pages that hold the request, ceil(13 / 20) = 1 page, so
        // the block is [3, 40) MiB: z takes [3, 33), 7 MiB stay free. (The
        // default allocator would open a segment of 30 MiB here.)
        let z = a.malloc(30 * MIB);
        assert_eq!(a.reserved, (2 + 40) * MIB);
        assert_eq!((z.segment, z.offset), (1, 3 * MIB));
        assert_eq!(a.stats.segments, 2);
        // Free: 3 MiB at 0 and the 7 MiB tail at 33 MiB.
        a.free(y);
        // 5 MiB: only the tail fits; [33, 38) taken, 2 MiB tail left.
        let w = a.malloc(5 * MIB);
        assert_eq!(w.offset, 33 * MIB);
        // 2 MiB: the 2 MiB tail is the smallest fit, but the tail counts as
        // large as the address space behind it, so the 3 MiB block at 0 is
        // taken and split (remainder 1 MiB ≥ 512 B: split in both pools;
        // the default allocator would hand out the whole 3 MiB).
        let v = a.malloc(2 * MIB);
        assert_eq!(v.offset, 0);
        assert_eq!(a.allocated, 512 + (30 + 5 + 2) * MIB);
        assert_eq!(a.stats.max_reserved, 42 * MIB);
        // Allocated peaks now: 512 B + 30 + 5 + 2 MiB (y, 3 MiB, went
        // before w came).
        assert_eq!(a.stats.max_allocated, 512 + 37 * MIB);
    }

    #[test]
    fn expandable_segments_small_pool_pages_and_streams() {
        let mut a = CachingAllocator::expandable();
        // 1 MiB requests are small: 2 MiB pages. The first maps a page and
        // leaves 1 MiB free at its end; the second takes that tail whole;
        // the third finds no free block and no free tail: one more page.
        let x = a.malloc(MIB);
        let _y = a.malloc(MIB);
        assert_eq!(a.reserved, 2 * MIB);
        let _z = a.malloc(MIB);
        assert_eq!(a.reserved, 4 * MIB);
        a.free(x);
        // Stream 1 has its own segment: the free 1 MiB of stream 0 is not
        // its to take.
        let _w = a.malloc_on(1000, 1);
        assert_eq!(a.stats.segments, 2);
        assert_eq!(a.stats.max_reserved, 6 * MIB);
        // Back on stream 0, the freed block at 0 is reused.
        let v = a.malloc(MIB);
        assert_eq!((v.segment, v.offset), (0, 0));
        assert_eq!(a.stats.max_reserved, 6 * MIB);
    }

    /// Every structural rule of the state: blocks tile each segment (its
    /// mapped range with expandable segments, in whole pages), no two free
    /// blocks touch, the pools hold exactly the free blocks, and the
    /// counters add up.
    fn check_invariants(a: &CachingAllocator) {
        let mut free = BTreeSet::new();
        let (mut allocated, mut reserved) = (0, 0);
        for (i, seg) in a.segments.iter().enumerate() {
            let mut end = 0;
            let mut last_free = false;
            let mut small = None;
            for (&o, b) in seg {
                assert_eq!(o, end, "segment {i}: a gap or an overlap at {o}");
                assert!(
                    !(last_free && b.free),
                    "segment {i}: free blocks touch at {o}"
                );
                assert!(small.is_none_or(|s| s == b.small));
                small = Some(b.small);
                last_free = b.free;
                end += b.size;
                if b.free {
                    free.insert((b.small, (a.segment_stream[i], b.size, i, o)));
                } else {
                    allocated += b.size;
                }
            }
            if a.expandable {
                assert_eq!(end, a.mapped[i]);
                let page = if small == Some(true) {
                    SMALL_BUFFER
                } else {
                    LARGE_BUFFER
                };
                assert_eq!(end % page, 0);
            }
            reserved += end;
        }
        let pools: BTreeSet<_> = a
            .small_pool
            .iter()
            .map(|&k| (true, k))
            .chain(a.large_pool.iter().map(|&k| (false, k)))
            .collect();
        assert_eq!(pools, free);
        assert_eq!((a.allocated, a.reserved), (allocated, reserved));
        assert!(a.stats.max_allocated >= allocated && a.stats.max_reserved >= reserved);
    }

    #[test]
    fn random_mallocs_and_frees_keep_the_state_whole() {
        // A fixed pseudo-random run over both settings, two streams and
        // sizes across both pools.
        for expandable in [false, true] {
            let mut a = if expandable {
                CachingAllocator::expandable()
            } else {
                CachingAllocator::new()
            };
            let mut live: Vec<Handle> = Vec::new();
            let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
            for _ in 0..3000 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                if live.is_empty() || x % 5 < 3 {
                    let size = match (x >> 8) % 4 {
                        0 => 1 + (x >> 16) % 4096,
                        1 => 1 + (x >> 16) % (2 * MIB),
                        2 => 1 + (x >> 16) % (12 * MIB),
                        _ => 1 + (x >> 16) % (50 * MIB),
                    };
                    live.push(a.malloc_on(size, ((x >> 40) % 2) as u32));
                } else {
                    let h = live.swap_remove(((x >> 16) % live.len() as u64) as usize);
                    a.free(h);
                }
                check_invariants(&a);
            }
            for h in live {
                a.free(h);
            }
            check_invariants(&a);
            assert_eq!(a.allocated, 0);
        }
    }
}
