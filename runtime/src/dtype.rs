//! Element types by name: the workspace's one table of them (XLA's
//! primitive types, with their width in bits, and the other spellings graph
//! files use for the same types). It lives in the lowest crate that needs
//! it, the runtime, whose [`crate::DType`] (the types the executors store)
//! takes its widths and spellings from it; `memplan` re-exports it as
//! `memplan::dtype`, where the HLO importer reads shapes with it, the cost
//! model the bytes of an element, and the built-in models their `DType`'s
//! width.

/// An element type, with its width in bits.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct ElementType {
    /// The name as HLO prints it, e.g. `f32`, `bf16`, `pred`.
    pub name: &'static str,
    /// Storage width in bits (0 for `token` and `opaque`).
    pub bits: u32,
}

/// Every XLA primitive type memplan knows, with its width in bits.
const ELEMENT_TYPES: &[(&str, u32)] = &[
    ("pred", 8),
    ("s1", 1),
    ("s2", 2),
    ("s4", 4),
    ("s8", 8),
    ("s16", 16),
    ("s32", 32),
    ("s64", 64),
    ("u1", 1),
    ("u2", 2),
    ("u4", 4),
    ("u8", 8),
    ("u16", 16),
    ("u32", 32),
    ("u64", 64),
    ("f16", 16),
    ("bf16", 16),
    ("f32", 32),
    ("f64", 64),
    ("c64", 64),
    ("c128", 128),
    ("f4e2m1fn", 4),
    ("f6e2m3fn", 6),
    ("f6e3m2fn", 6),
    ("f8e3m4", 8),
    ("f8e4m3", 8),
    ("f8e4m3fn", 8),
    ("f8e4m3fnuz", 8),
    ("f8e4m3b11fnuz", 8),
    ("f8e5m2", 8),
    ("f8e5m2fnuz", 8),
    ("f8e8m0fnu", 8),
    ("token", 0),
    ("opaque", 0),
];

impl ElementType {
    /// Looks up an element type by its HLO name (the HLO parser's rule:
    /// no other spelling).
    pub fn parse(name: &str) -> Option<ElementType> {
        ELEMENT_TYPES
            .iter()
            .find(|(n, _)| *n == name)
            .map(|&(name, bits)| ElementType { name, bits })
    }
    /// Looks up a graph tensor's `dtype`: an HLO name or one of
    /// [`ALIASES`] (`float32`, `i64`, `bool`, ...), under its HLO name.
    pub fn named(name: &str) -> Option<ElementType> {
        let hlo = ALIASES
            .iter()
            .find(|(alias, _)| *alias == name)
            .map_or(name, |&(_, hlo)| hlo);
        ElementType::parse(hlo)
    }
    /// Bytes one element takes when unpacked (sub-byte types take a byte).
    pub fn unpacked_bytes(self) -> u64 {
        (self.bits as u64).div_ceil(8)
    }
}

/// Other spellings of the same types in graph files: PyTorch's and NumPy's
/// names, and memplan's short integer names (`memplan.torch` writes `i64`).
pub const ALIASES: &[(&str, &str)] = &[
    ("float64", "f64"),
    ("float32", "f32"),
    ("float16", "f16"),
    ("bfloat16", "bf16"),
    ("i8", "s8"),
    ("i16", "s16"),
    ("i32", "s32"),
    ("i64", "s64"),
    ("int8", "s8"),
    ("int16", "s16"),
    ("int32", "s32"),
    ("int64", "s64"),
    ("uint8", "u8"),
    ("bool", "pred"),
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_aliases() {
        assert_eq!(ElementType::parse("bf16").unwrap().unpacked_bytes(), 2);
        assert_eq!(ElementType::parse("s4").unwrap().unpacked_bytes(), 1);
        // The HLO parser's rule: HLO names only.
        assert_eq!(ElementType::parse("float32"), None);
        assert_eq!(ElementType::named("float32").unwrap().name, "f32");
        assert_eq!(ElementType::named("i64").unwrap().unpacked_bytes(), 8);
        assert_eq!(ElementType::named("bool").unwrap().name, "pred");
        assert_eq!(ElementType::named("quaternion"), None);
        // The executors' types read their names and widths here.
        use crate::DType;
        for d in [DType::F32, DType::BF16, DType::I32] {
            assert_eq!(DType::parse(d.as_str()), Some(d));
        }
        assert_eq!(
            (DType::F32.size(), DType::BF16.size(), DType::I32.size()),
            (4, 2, 4)
        );
        assert_eq!(DType::parse("int32"), Some(DType::I32));
        assert_eq!(DType::parse("bfloat16"), Some(DType::BF16));
        assert_eq!(DType::parse("f16"), None);
        for (alias, hlo) in ALIASES {
            assert!(ElementType::parse(hlo).is_some(), "{alias} -> {hlo}");
            assert!(
                ElementType::parse(alias).is_none(),
                "{alias} is an HLO name"
            );
        }
    }
}
