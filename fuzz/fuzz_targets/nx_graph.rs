//! Any bytes through the networkx node-link reader (Checkmate's and
//! Moccasin's graphs): an error or a graph, never a panic. A graph that
//! reads must also plan and pass the checker.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let path = std::path::Path::new("fuzz.json");
    if let Ok(g) = memplan::io::nx::parse_graph(text, path) {
        if g.num_ops() <= 64 {
            let opts = memplan::Options {
                time_limit: std::time::Duration::from_millis(50),
                ..Default::default()
            };
            let plan = memplan::plan(&g, &opts).expect("a valid graph plans");
            memplan::checker::check(&g, &plan).expect("the plan passes the checker");
        }
    }
});
