//! XLA's memory-usage report beside a dumped module.
//!
//! XLA writes `<stem>-memory-usage-report.txt` next to `<stem>.txt` when
//! dumping after optimizations. Its line `Total bytes: N` under
//! `Memory Space: default` is the size of every allocation of the default
//! memory space: parameters, constants, thread-locals, the output tuple and
//! the temp arena, which is what memplan compares its peak with.

use std::path::{Path, PathBuf};

use crate::error::Error;

/// The report files that may belong to the module at `module`, in the order
/// they are tried.
pub fn candidates(module: &Path) -> Vec<PathBuf> {
    let Some(file) = module.file_name().and_then(|f| f.to_str()) else {
        return Vec::new();
    };
    let stem = file.strip_suffix(".gz").unwrap_or(file);
    let stem = stem.strip_suffix(".txt").unwrap_or(stem);
    let dir = module.parent().unwrap_or(Path::new(""));
    ["txt", "txt.gz"]
        .iter()
        .map(|ext| dir.join(format!("{stem}-memory-usage-report.{ext}")))
        .collect()
}

/// Reads `Total bytes` of the default memory space from a report's text.
pub fn total_bytes(text: &str) -> Option<u64> {
    let mut in_default = true;
    for line in text.lines() {
        let line = line.trim();
        if let Some(space) = line.strip_prefix("Memory Space:") {
            in_default = space.contains("color=0") || space.trim_start().starts_with("default");
            continue;
        }
        if in_default && let Some(rest) = line.strip_prefix("Total bytes:") {
            let digits: String = rest
                .trim_start()
                .chars()
                .take_while(|c| c.is_ascii_digit())
                .collect();
            return digits.parse().ok();
        }
    }
    None
}

/// The report beside `module` and its total, if a report is there. A
/// report that is there but has no total is an error.
pub fn find(module: &Path) -> Result<Option<(PathBuf, u64)>, Error> {
    for p in candidates(module) {
        if !p.is_file() {
            continue;
        }
        let text = crate::io::read_text(&p)?;
        return match total_bytes(&text) {
            Some(n) => Ok(Some((p, n))),
            None => Err(Error::Parse {
                path: p,
                line: 0,
                column: 0,
                msg: "no line 'Total bytes: N' for the default memory space".into(),
            }),
        };
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_default_space_total() {
        let text = "Memory Space: default (color=0)\nTotal bytes: 1857320348 (1.73GiB)\n  64.00MiB( 32%); 1×f32[4096]\n";
        assert_eq!(total_bytes(text), Some(1857320348));
        let two = "Memory Space: host (color=5)\nTotal bytes: 9\nMemory Space: default (color=0)\nTotal bytes: 7\n";
        assert_eq!(total_bytes(two), Some(7));
        assert_eq!(total_bytes("nothing here"), None);
    }

    #[test]
    fn report_names_follow_the_module_name() {
        let c = candidates(Path::new(
            "d/module_0001.jit_step.cpu_after_optimizations.txt.gz",
        ));
        assert_eq!(
            c[0],
            Path::new("d/module_0001.jit_step.cpu_after_optimizations-memory-usage-report.txt")
        );
        assert_eq!(
            c[1],
            Path::new("d/module_0001.jit_step.cpu_after_optimizations-memory-usage-report.txt.gz")
        );
    }
}
