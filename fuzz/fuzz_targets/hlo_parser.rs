//! Any bytes through the HLO importer: an error or a graph, never a panic.
//! A graph that imports must also plan and pass the checker.
#![no_main]

use libfuzzer_sys::fuzz_target;
use memplan::io::hlo::{ImportOptions, import_str};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    for xla_allocations in [false, true] {
        let import = ImportOptions {
            xla_allocations,
            ..Default::default()
        };
        let Ok(g) = import_str(text, &import) else {
            continue;
        };
        // Small graphs only: planning is not what is fuzzed here.
        if g.num_ops() <= 64 {
            let opts = memplan::Options {
                time_limit: std::time::Duration::from_millis(50),
                ..Default::default()
            };
            let plan = memplan::plan(&g, &opts).expect("an imported graph plans");
            memplan::checker::check(&g, &plan).expect("the plan passes the checker");
        }
    }
});
