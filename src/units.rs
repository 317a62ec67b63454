//! Quantities as people write them: byte sizes (`24GiB`, `1.5 GB`,
//! `4096`). One rule for the CLI (`memplan fit --budget`, `alloc
//! --capacity`) and the bindings (`memplan.fit(budget="24GiB")`).

use crate::error::Error;

/// Bytes written as a number and an optional unit: `B`, decimal `KB`
/// `MB` `GB` `TB` (also `K` `M` `G` `T`), binary `KiB` `MiB` `GiB` `TiB`,
/// case-insensitive, spaces allowed around them. Fractions are rounded
/// down to whole bytes. Refuses, naming `text`, anything else: negative
/// or non-finite numbers and sizes of 2^64 bytes or more.
pub fn parse_bytes(text: &str) -> Result<u64, Error> {
    let t = text.trim();
    let bad = |why: &str| Error::InvalidArgument(format!("{text:?}: {why}"));
    let split = t.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let scale: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kb" => 1e3,
        "m" | "mb" => 1e6,
        "g" | "gb" => 1e9,
        "t" | "tb" => 1e12,
        "kib" => 1024.0,
        "mib" => 1024.0 * 1024.0,
        "gib" => 1024.0 * 1024.0 * 1024.0,
        "tib" => 1024f64.powi(4),
        u => {
            return Err(bad(&format!(
                "unknown unit {u:?} (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)"
            )));
        }
    };
    let num = num.trim();
    // Whole numbers of bytes are exact, however large (below 2^64).
    if scale == 1.0 && !num.is_empty() && num.bytes().all(|b| b.is_ascii_digit()) {
        return num
            .parse::<u64>()
            .map_err(|_| bad("out of range (2^64 bytes or more)"));
    }
    let n: f64 = num.parse().map_err(|_| bad("not a number of bytes"))?;
    let bytes = n * scale;
    if !bytes.is_finite() || bytes < 0.0 {
        return Err(bad("not a non-negative finite size"));
    }
    if bytes >= u64::MAX as f64 {
        return Err(bad("out of range (2^64 bytes or more)"));
    }
    Ok(bytes.floor() as u64)
}

#[cfg(test)]
mod tests {
    use super::parse_bytes;

    #[test]
    fn units_and_refusals() {
        assert_eq!(parse_bytes("4096").unwrap(), 4096);
        assert_eq!(parse_bytes(" 24GiB ").unwrap(), 24 << 30);
        assert_eq!(parse_bytes("1.5 GB").unwrap(), 1_500_000_000);
        assert_eq!(parse_bytes("2k").unwrap(), 2000);
        assert_eq!(parse_bytes("18446744073709551615").unwrap(), u64::MAX);
        for bad in [
            "",
            "-1",
            "1e400",
            "NaN",
            "inf GB",
            "3 parsecs",
            "18446744073709551616",
            "16EiB",
            "20000000 TiB",
        ] {
            let e = parse_bytes(bad).unwrap_err().to_string();
            assert!(e.starts_with(&format!("{bad:?}: ")), "{bad:?}: {e}");
        }
    }
}
