//! Human-readable numbers and tables.

/// Bytes in binary units with two decimals: `1.50 GiB`.
pub fn human_bytes(b: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.2} {}", UNITS[u])
    }
}

/// An integer with thousands separators: `1,234,567`.
pub fn grouped(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::with_capacity(s.len() + s.len() / 3);
    for (i, ch) in s.chars().enumerate() {
        if i > 0 && (s.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(ch);
    }
    out
}

/// A count held as f64 (FLOPs): grouped digits up to 10^15, exponent
/// notation above (`3.000e20`), where an integer would claim digits the
/// figure does not have.
pub fn grouped_f64(x: f64) -> String {
    if x.is_finite() && x.abs() < 1e15 {
        let r = x.round();
        let s = grouped(r.abs() as u64);
        if r < 0.0 { format!("-{s}") } else { s }
    } else {
        format!("{x:.3e}")
    }
}

/// A plain text table with right-aligned numeric columns (all but the first).
pub fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let cols = header.len();
    let mut width: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for r in rows {
        for (i, c) in r.iter().enumerate().take(cols) {
            width[i] = width[i].max(c.chars().count());
        }
    }
    let line = |cells: Vec<&str>| -> String {
        let mut s = String::new();
        for (i, c) in cells.iter().enumerate() {
            let pad = width[i] - c.chars().count();
            if i == 0 {
                s.push_str(c);
                s.push_str(&" ".repeat(pad));
            } else {
                s.push_str("  ");
                s.push_str(&" ".repeat(pad));
                s.push_str(c);
            }
        }
        s.trim_end().to_string()
    };
    let mut out = line(header.to_vec());
    out.push('\n');
    out.push_str(&"-".repeat(width.iter().sum::<usize>() + 2 * (cols - 1)));
    out.push('\n');
    for r in rows {
        out.push_str(&line(r.iter().map(|s| s.as_str()).collect()));
        out.push('\n');
    }
    out
}

/// What `plan --json` and `compare --json` both open with: the graph's
/// name and size and every figure of the plan's [`memplan::PlanStats`]
/// (through its own serialisation; `time_limit_hit` written even when
/// false).
pub fn plan_summary(g: &memplan::graph::Graph, plan: &memplan::Plan) -> serde_json::Value {
    let s = &plan.stats;
    let mut v = serde_json::json!({
        "graph": g.name,
        "ops": g.num_ops(),
        "tensors": g.num_tensors(),
    });
    // The stats carry `peak_bytes`, the arena's deprecated copy, for one
    // more release; `arena_bytes` is its name.
    if let Ok(serde_json::Value::Object(stats)) = serde_json::to_value(s) {
        for (k, x) in stats {
            v[k] = x;
        }
    }
    v["arena_bytes"] = serde_json::json!(plan.arena_bytes);
    v["gap"] = serde_json::json!(plan.gap());
    v["time_limit_hit"] = serde_json::json!(s.time_limit_hit);
    v
}

/// What `--split` chose, as `plan --json` and `compare --json` write it.
pub fn split_json(split: &memplan::split::SplitReport) -> serde_json::Value {
    serde_json::json!({
        "chunks": split.chunks,
        "chains": split.chains,
        "regions": split.regions,
        "added_flops": split.added_flops,
        "step_flops": split.step_flops,
        "tried": split.tried.iter().map(|&(k, b)| serde_json::json!({"chunks": k, "arena_bytes": b, "peak_bytes": b})).collect::<Vec<_>>(),
    })
}

/// What `--split` chose, as `plan` and `compare` print it.
pub fn split_line(split: &memplan::split::SplitReport) -> String {
    let tried: Vec<String> = split
        .tried
        .iter()
        .map(|&(k, b)| format!("{k}: {}", human_bytes(b)))
        .collect();
    format!(
        "split: {} (arena by chunks: {}; {} FLOPs added, {:.4}% of the step's)",
        if split.chunks > 1 {
            format!(
                "{} loss chain(s) and {} row-wise region(s) into {} chunks",
                split.chains, split.regions, split.chunks
            )
        } else {
            "none (no split lowered the arena)".to_string()
        },
        tried.join(", "),
        grouped(split.added_flops as u64),
        100.0 * split.added_flops / split.step_flops.max(1.0)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_numbers() {
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(3 << 29), "1.50 GiB");
        assert_eq!(grouped(1234567), "1,234,567");
        assert_eq!(grouped(12), "12");
    }
}
