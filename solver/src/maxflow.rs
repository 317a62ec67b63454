//! Maximum flow / minimum s-t cut with Dinic's algorithm, built for solving
//! many small cuts in a row (the min-cut floor in [`crate::bounds`] solves
//! one per op).
//!
//! A [`FlowNetwork`] holds inner nodes `0..n` and two implicit terminals,
//! the source and the sink. Capacities from the source and to the sink are
//! kept per node rather than as arcs: before the flow starts, a node with
//! both gets `min(source, sink)` pushed straight through (a path of length
//! two that any maximum flow may take first), which removes most of the work
//! on the networks the floor builds. The rest is Dinic: breadth-first level
//! graphs, then blocking flows found by an iterative depth-first search with
//! current-arc pointers (no recursion, so deep chains are fine).
//!
//! Capacities are `u64`; [`INF`] marks an arc that may never be cut. A
//! network must have no source-to-sink path made only of [`INF`] arcs and
//! terminal capacities that sum above `u64::MAX` (the floor's networks have
//! none: every source-to-sink path crosses a finite arc). Totals saturate.
//!
//! Complexity: `O(V^2 E)` in general, far less in practice. The scratch
//! vectors are kept between solves: [`FlowNetwork::clear`] and reuse.

use std::collections::VecDeque;

/// Capacity of an arc that must never be cut.
pub const INF: u64 = u64::MAX;

const NO_LEVEL: u32 = u32::MAX;

/// A flow network with implicit source and sink; see the module docs.
#[derive(Clone, Debug, Default)]
pub struct FlowNetwork {
    n: usize,
    /// Capacity from the source to each inner node.
    source_cap: Vec<u64>,
    /// Capacity from each inner node to the sink.
    sink_cap: Vec<u64>,
    /// Inner arcs as added: `(from, to, capacity)`.
    arcs: Vec<(u32, u32, u64)>,
    // Residual graph (built by `solve`): arc `a` and its reverse `a ^ 1`.
    head: Vec<u32>,
    cap: Vec<u64>,
    start: Vec<u32>,
    level: Vec<u32>,
    cursor: Vec<u32>,
    queue: VecDeque<u32>,
    path: Vec<u32>,
    solved: bool,
}

impl FlowNetwork {
    /// An empty network.
    pub fn new() -> Self {
        Self::default()
    }

    /// Removes every node and arc, keeping the allocations.
    pub fn clear(&mut self) {
        self.n = 0;
        self.source_cap.clear();
        self.sink_cap.clear();
        self.arcs.clear();
        self.solved = false;
    }

    /// Number of inner nodes.
    pub fn num_nodes(&self) -> usize {
        self.n
    }

    /// Number of inner arcs added.
    pub fn num_arcs(&self) -> usize {
        self.arcs.len()
    }

    /// Adds an inner node and returns its index.
    pub fn add_node(&mut self) -> u32 {
        self.n += 1;
        self.source_cap.push(0);
        self.sink_cap.push(0);
        self.solved = false;
        self.n as u32 - 1
    }

    /// Adds `cap` to the capacity from the source to `v`.
    pub fn add_source_arc(&mut self, v: u32, cap: u64) {
        let c = &mut self.source_cap[v as usize];
        *c = c.saturating_add(cap);
        self.solved = false;
    }

    /// Adds `cap` to the capacity from `v` to the sink.
    pub fn add_sink_arc(&mut self, v: u32, cap: u64) {
        let c = &mut self.sink_cap[v as usize];
        *c = c.saturating_add(cap);
        self.solved = false;
    }

    /// Adds an arc `from -> to` of capacity `cap` ([`INF`]: uncuttable).
    pub fn add_arc(&mut self, from: u32, to: u32, cap: u64) {
        debug_assert!((from as usize) < self.n && (to as usize) < self.n);
        if from != to && cap > 0 {
            self.arcs.push((from, to, cap));
            self.solved = false;
        }
    }

    /// The value of a maximum flow, which equals the capacity of a minimum
    /// cut. Afterwards [`FlowNetwork::source_side`] tells the cut.
    pub fn solve(&mut self) -> u64 {
        let n = self.n;
        let (s, t) = (n as u32, n as u32 + 1);
        let mut flow = 0u64;
        // Terminal capacities: push the common part straight through.
        let mut pairs: Vec<(u32, u32, u64)> = Vec::with_capacity(self.arcs.len() + 2 * n);
        pairs.extend(self.arcs.iter().copied());
        for v in 0..n {
            let (a, b) = (self.source_cap[v], self.sink_cap[v]);
            let c = a.min(b);
            flow = flow.saturating_add(c);
            if a > c {
                pairs.push((s, v as u32, a - c));
            }
            if b > c {
                pairs.push((v as u32, t, b - c));
            }
        }
        let nodes = n + 2;
        let m = pairs.len();
        let mut degree = vec![0u32; nodes + 1];
        for &(a, b, _) in &pairs {
            degree[a as usize + 1] += 1;
            degree[b as usize + 1] += 1;
        }
        for i in 0..nodes {
            degree[i + 1] += degree[i];
        }
        self.start.clear();
        self.start.extend_from_slice(&degree);
        self.head.clear();
        self.head.resize(2 * m, 0);
        self.cap.clear();
        self.cap.resize(2 * m, 0);
        // Slot of every arc end; an arc and its reverse must be `a`, `a ^ 1`,
        // so arcs are laid out in pairs and the CSR holds arc indices.
        let mut fill = degree.clone();
        let mut adj = vec![0u32; 2 * m];
        for (i, &(a, b, c)) in pairs.iter().enumerate() {
            let f = 2 * i as u32;
            self.head[f as usize] = b;
            self.cap[f as usize] = c;
            self.head[f as usize + 1] = a;
            self.cap[f as usize + 1] = 0;
            adj[fill[a as usize] as usize] = f;
            fill[a as usize] += 1;
            adj[fill[b as usize] as usize] = f + 1;
            fill[b as usize] += 1;
        }
        self.level.clear();
        self.level.resize(nodes, NO_LEVEL);
        self.cursor.clear();
        self.cursor.resize(nodes, 0);
        loop {
            if !self.bfs(&adj, s, t) {
                break;
            }
            self.cursor.copy_from_slice(&self.start[..nodes]);
            flow = flow.saturating_add(self.blocking_flow(&adj, s, t));
        }
        // Final levels: reachable from the source in the residual graph.
        self.bfs(&adj, s, t);
        self.solved = true;
        flow
    }

    /// Levels from the source over residual arcs; whether the sink is
    /// reached.
    fn bfs(&mut self, adj: &[u32], s: u32, t: u32) -> bool {
        self.level.fill(NO_LEVEL);
        self.level[s as usize] = 0;
        self.queue.clear();
        self.queue.push_back(s);
        while let Some(v) = self.queue.pop_front() {
            let lv = self.level[v as usize];
            for &a in &adj[self.start[v as usize] as usize..self.start[v as usize + 1] as usize] {
                let w = self.head[a as usize];
                if self.cap[a as usize] > 0 && self.level[w as usize] == NO_LEVEL {
                    self.level[w as usize] = lv + 1;
                    self.queue.push_back(w);
                }
            }
        }
        self.level[t as usize] != NO_LEVEL
    }

    /// Saturates every shortest augmenting path of the current level graph.
    fn blocking_flow(&mut self, adj: &[u32], s: u32, t: u32) -> u64 {
        let mut total = 0u64;
        self.path.clear();
        let mut v = s;
        loop {
            if v == t {
                // Augment along the path by its bottleneck.
                let f = self
                    .path
                    .iter()
                    .map(|&a| self.cap[a as usize])
                    .min()
                    .unwrap_or(0);
                let mut cut_at = self.path.len();
                for (i, &a) in self.path.iter().enumerate() {
                    let a = a as usize;
                    if self.cap[a] != INF {
                        self.cap[a] -= f;
                    }
                    if self.cap[a ^ 1] != INF {
                        self.cap[a ^ 1] = self.cap[a ^ 1].saturating_add(f);
                    }
                    if self.cap[a] == 0 && cut_at == self.path.len() {
                        cut_at = i;
                    }
                }
                total = total.saturating_add(f);
                // Resume from the tail of the first saturated arc.
                self.path.truncate(cut_at);
                v = match self.path.last() {
                    Some(&a) => self.head[a as usize],
                    None => s,
                };
                continue;
            }
            // Advance along the current arc of `v`, skipping useless ones.
            let end = self.start[v as usize + 1];
            let mut advanced = false;
            while self.cursor[v as usize] < end {
                let a = adj[self.cursor[v as usize] as usize];
                let w = self.head[a as usize];
                if self.cap[a as usize] > 0
                    && self.level[w as usize] == self.level[v as usize].wrapping_add(1)
                {
                    self.path.push(a);
                    v = w;
                    advanced = true;
                    break;
                }
                self.cursor[v as usize] += 1;
            }
            if advanced {
                continue;
            }
            // Dead end: retreat and never come back to `v` in this phase.
            self.level[v as usize] = NO_LEVEL;
            match self.path.pop() {
                None => return total,
                Some(a) => {
                    v = self.head[a as usize ^ 1];
                    self.cursor[v as usize] += 1;
                }
            }
        }
    }

    /// After [`FlowNetwork::solve`]: whether inner node `v` is on the source
    /// side of a minimum cut (reachable from the source in the residual
    /// graph).
    pub fn source_side(&self, v: u32) -> bool {
        assert!(self.solved, "source_side before solve");
        self.level[v as usize] != NO_LEVEL
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The capacity of the cut the solver reports, summed from the arcs.
    fn cut_capacity(net: &FlowNetwork) -> u64 {
        let mut c = 0u64;
        for v in 0..net.num_nodes() as u32 {
            let s = net.source_side(v);
            if !s {
                c = c.saturating_add(net.source_cap[v as usize]);
            } else {
                c = c.saturating_add(net.sink_cap[v as usize]);
            }
        }
        for &(a, b, cap) in &net.arcs {
            if net.source_side(a) && !net.source_side(b) {
                c = c.saturating_add(cap);
            }
        }
        c
    }

    #[test]
    fn textbook_network() {
        // CLRS's example, with node 0 the source and 5 the sink folded
        // into terminal capacities.
        let mut net = FlowNetwork::new();
        for _ in 0..4 {
            net.add_node();
        }
        // s->1:16, s->2:13, 1->2:10, 1->3:12, 2->1:4, 2->4:14, 3->2:9,
        // 3->t:20, 4->3:7, 4->t:4 (inner nodes shifted down by one)
        net.add_source_arc(0, 16);
        net.add_source_arc(1, 13);
        net.add_arc(0, 1, 10);
        net.add_arc(0, 2, 12);
        net.add_arc(1, 0, 4);
        net.add_arc(1, 3, 14);
        net.add_arc(2, 1, 9);
        net.add_sink_arc(2, 20);
        net.add_arc(3, 2, 7);
        net.add_sink_arc(3, 4);
        assert_eq!(net.solve(), 23);
        assert_eq!(cut_capacity(&net), 23);
        // Solving again gives the same answer.
        assert_eq!(net.solve(), 23);
    }

    #[test]
    fn infinite_arcs_are_never_cut() {
        // s -5-> a -INF-> b -3-> t and a -2-> t: the cut must take a's
        // outgoing finite arcs or its source arc.
        let mut net = FlowNetwork::new();
        let a = net.add_node();
        let b = net.add_node();
        net.add_source_arc(a, 5);
        net.add_arc(a, b, INF);
        net.add_sink_arc(b, 3);
        net.add_sink_arc(a, 2);
        assert_eq!(net.solve(), 5);
        assert_eq!(cut_capacity(&net), 5);
    }

    #[test]
    fn deep_chain_does_not_recurse() {
        let mut net = FlowNetwork::new();
        let n = 200_000;
        for _ in 0..n {
            net.add_node();
        }
        net.add_source_arc(0, 7);
        for v in 0..n - 1 {
            net.add_arc(v, v + 1, INF);
        }
        net.add_sink_arc(n - 1, 9);
        assert_eq!(net.solve(), 7);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]
        /// Agrees with petgraph's Dinic on random networks, and the reported
        /// cut has the capacity of the flow.
        #[test]
        fn matches_petgraph(
            n in 1usize..12,
            arcs in proptest::collection::vec((0usize..14, 0usize..14, 0u64..20, any::<bool>()), 0..40),
        ) {
            let mut net = FlowNetwork::new();
            for _ in 0..n {
                net.add_node();
            }
            let mut g = petgraph::Graph::<(), u64>::new();
            let nodes: Vec<_> = (0..n + 2).map(|_| g.add_node(())).collect();
            let (s, t) = (nodes[n], nodes[n + 1]);
            for &(a, b, c, inf) in &arcs {
                // Indices n and n+1 stand for the terminals.
                let (a, b) = (a % (n + 2), b % (n + 2));
                match (a >= n, b >= n) {
                    (false, false) => {
                        let cap = if inf { INF } else { c };
                        net.add_arc(a as u32, b as u32, cap);
                        if a != b && cap > 0 {
                            g.add_edge(nodes[a], nodes[b], if inf { 1_000_000 } else { c });
                        }
                    }
                    (true, false) if a == n => {
                        net.add_source_arc(b as u32, c);
                        g.add_edge(s, nodes[b], c);
                    }
                    (false, true) if b == n + 1 => {
                        net.add_sink_arc(a as u32, c);
                        g.add_edge(nodes[a], t, c);
                    }
                    _ => {}
                }
            }
            let (want, _) = petgraph::algo::dinics(&g, s, t);
            let got = net.solve();
            prop_assert_eq!(got, want);
            prop_assert_eq!(cut_capacity(&net), got);
        }
    }
}
