//! Executors that run a memory-planned training step inside one arena.
//! (Being built: see issue 6.)
