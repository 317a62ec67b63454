//! HLO shapes: element types, array shapes with their layouts, tuples, and
//! the bytes an array occupies.
//!
//! An array's size is `elements × element bytes`, where an element of a
//! sub-byte type (`s4`, `u2`, `f4e2m1fn`, ...) takes one byte unless its
//! layout packs it (`E(bits)` in the layout, as XLA prints it), and a bounded
//! dynamic dimension (`<=N`) counts at its bound. Tokens and opaque values
//! occupy nothing. Every product is checked: a shape too large for `u64`
//! bytes is an error, not a wrap-around.

use std::fmt;

pub use crate::dtype::ElementType;

/// One array dimension.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum Dim {
    /// A static size.
    Static(u64),
    /// A dynamic size bounded by `N` (`<=N`); sized at its bound.
    Bounded(u64),
}

impl Dim {
    /// The size memory is reserved for.
    pub fn bound(self) -> u64 {
        match self {
            Dim::Static(n) | Dim::Bounded(n) => n,
        }
    }
}

/// An array shape, e.g. `f32[4096,1024]{1,0}`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ArrayShape {
    pub element: ElementType,
    pub dims: Vec<Dim>,
    /// Minor-to-major dimension order, if the text gave a layout.
    pub minor_to_major: Option<Vec<u32>>,
    /// Packed element width from the layout's `E(bits)`, if any.
    pub element_bits: Option<u32>,
}

impl ArrayShape {
    /// The layout's minor-to-major order, or XLA's default (the last
    /// dimension most minor) when the text gave none.
    pub fn effective_layout(&self) -> Vec<u32> {
        match &self.minor_to_major {
            Some(l) => l.clone(),
            None => (0..self.dims.len() as u32).rev().collect(),
        }
    }
    /// Whether the layout is the default row-major one (or absent).
    pub fn has_default_layout(&self) -> bool {
        match &self.minor_to_major {
            None => true,
            Some(l) => l.iter().copied().eq((0..self.dims.len() as u32).rev()),
        }
    }
    /// Number of elements, `None` on overflow.
    pub fn elements(&self) -> Option<u64> {
        self.dims
            .iter()
            .try_fold(1u64, |acc, d| acc.checked_mul(d.bound()))
    }
    /// Bytes the array occupies, `None` on overflow.
    pub fn byte_size(&self) -> Option<u64> {
        let n = self.elements()?;
        match self.element_bits {
            Some(bits) if bits > 0 && bits < 8 => Some(n.checked_mul(bits as u64)?.div_ceil(8)),
            _ => n.checked_mul(self.element.unpacked_bytes()),
        }
    }
    /// The dimensions as plain numbers (bounds for dynamic ones).
    pub fn dim_sizes(&self) -> Vec<u64> {
        self.dims.iter().map(|d| d.bound()).collect()
    }
    /// XLA's `ShapeUtil::Equal`: same element type, dimensions and layout.
    pub fn same_as(&self, other: &ArrayShape) -> bool {
        self.element == other.element
            && self.dims == other.dims
            && self.effective_layout() == other.effective_layout()
            && self.element_bits == other.element_bits
    }
}

/// An HLO shape: an array or a tuple of shapes.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Shape {
    Array(ArrayShape),
    Tuple(Vec<Shape>),
}

impl Shape {
    /// The leaves (arrays, tokens) in order, with their tuple index paths.
    pub fn leaves(&self) -> Vec<(Vec<u32>, &ArrayShape)> {
        let mut out = Vec::new();
        let mut stack: Vec<(Vec<u32>, &Shape)> = vec![(Vec::new(), self)];
        while let Some((path, s)) = stack.pop() {
            match s {
                Shape::Array(a) => out.push((path, a)),
                Shape::Tuple(parts) => {
                    for (i, p) in parts.iter().enumerate().rev() {
                        let mut q = path.clone();
                        q.push(i as u32);
                        stack.push((q, p));
                    }
                }
            }
        }
        out
    }
    pub fn as_array(&self) -> Option<&ArrayShape> {
        match self {
            Shape::Array(a) => Some(a),
            Shape::Tuple(_) => None,
        }
    }
}

impl fmt::Display for ArrayShape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}[", self.element.name)?;
        for (i, d) in self.dims.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            match d {
                Dim::Static(n) => write!(f, "{n}")?,
                Dim::Bounded(n) => write!(f, "<={n}")?,
            }
        }
        f.write_str("]")
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Shape::Array(a) => a.fmt(f),
            Shape::Tuple(parts) => {
                f.write_str("(")?;
                for (i, p) in parts.iter().enumerate() {
                    if i > 0 {
                        f.write_str(", ")?;
                    }
                    p.fmt(f)?;
                }
                f.write_str(")")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn arr(ty: &str, dims: &[u64]) -> ArrayShape {
        ArrayShape {
            element: ElementType::parse(ty).unwrap(),
            dims: dims.iter().map(|&d| Dim::Static(d)).collect(),
            minor_to_major: None,
            element_bits: None,
        }
    }

    #[test]
    fn sizes_by_element_type() {
        assert_eq!(arr("f32", &[4096, 4096]).byte_size(), Some(67108864));
        assert_eq!(arr("bf16", &[3]).byte_size(), Some(6));
        assert_eq!(arr("pred", &[7]).byte_size(), Some(7));
        assert_eq!(arr("c128", &[2]).byte_size(), Some(32));
        assert_eq!(arr("f32", &[]).byte_size(), Some(4));
        assert_eq!(arr("token", &[]).byte_size(), Some(0));
        // Sub-byte types take a byte each unless the layout packs them.
        assert_eq!(arr("s4", &[5]).byte_size(), Some(5));
        let mut packed = arr("s4", &[5]);
        packed.element_bits = Some(4);
        assert_eq!(packed.byte_size(), Some(3));
        assert_eq!(arr("f32", &[u64::MAX, 2]).byte_size(), None);
        assert_eq!(arr("f32", &[u64::MAX / 2]).byte_size(), None);
    }

    #[test]
    fn layouts_compare_with_defaults() {
        let a = arr("f32", &[2, 3]);
        let mut b = arr("f32", &[2, 3]);
        b.minor_to_major = Some(vec![1, 0]);
        assert!(a.same_as(&b) && b.has_default_layout());
        b.minor_to_major = Some(vec![0, 1]);
        assert!(!a.same_as(&b) && !b.has_default_layout());
    }
}
