//! MiniMalloc's CSV format, in and out.
//!
//! Input: a header row, then one buffer per row. Columns, in any order:
//! `id` (or `buffer`), `lower` (or `begin`), `upper` (or `end`), `size`
//! (all required); memplan adds the optional `align` (≥ 1) and `pinned`
//! (an offset, or empty for none). An `offset` column (a previous layout,
//! as this module writes) is read and checked to be numbers; [`parse`]
//! leaves it out of the problem, [`parse_with_layout`] returns it too (so
//! `memplan alloc` can say whether it is a valid layout, and its height,
//! beside the one it finds). A buffer occupies `[offset, offset + size)`
//! during the times `[lower, upper)`.
//!
//! Output: the same columns (`align` and `pinned` only when some buffer
//! uses them) plus `offset`.
//!
//! Errors name the file, the line (1-based, the header is line 1) and what
//! is wrong.

use std::io::Write;
use std::path::Path;

use crate::error::AllocError;
use crate::problem::{Buffer, Problem, Solution};

#[derive(Clone, Copy, PartialEq, Eq)]
enum Col {
    Id,
    Lower,
    Upper,
    Size,
    Align,
    Pinned,
    Offset,
}

fn column(name: &str) -> Option<Col> {
    Some(match name {
        "id" | "buffer" | "buffer_id" => Col::Id,
        "lower" | "begin" | "start" => Col::Lower,
        "upper" | "end" => Col::Upper,
        "size" => Col::Size,
        "align" | "alignment" => Col::Align,
        "pinned" => Col::Pinned,
        "offset" => Col::Offset,
        _ => return None,
    })
}

/// Reads a problem from CSV text; `file` names it in errors. An `offset`
/// column is checked and left out ([`parse_with_layout`] returns it).
pub fn parse(text: &str, file: &str) -> Result<Problem, AllocError> {
    parse_with_layout(text, file).map(|(p, _)| p)
}

/// The layout an `offset` column gives: each buffer's offset (`None`
/// where its field is empty).
pub type GivenOffsets = Vec<Option<u64>>;

/// [`parse`], and the `offset` column's values, if the file has one.
pub fn parse_with_layout(
    text: &str,
    file: &str,
) -> Result<(Problem, Option<GivenOffsets>), AllocError> {
    let err = |line: u64, what: String| AllocError::Csv {
        file: file.to_string(),
        line,
        what,
    };
    let mut rdr = csv::ReaderBuilder::new()
        .has_headers(false)
        .trim(csv::Trim::All)
        .comment(Some(b'#'))
        .flexible(true)
        .from_reader(text.as_bytes());
    let mut records = rdr.records();
    let header = match records.next() {
        None => {
            return Err(err(
                1,
                "empty file: expected a header `id,lower,upper,size`".into(),
            ));
        }
        Some(r) => r.map_err(|e| csv_err(file, e))?,
    };
    let hline = header.position().map_or(1, |p| p.line());
    let cols = columns(&header).map_err(|what| err(hline, what))?;
    let mut buffers = Vec::new();
    let mut offsets = Vec::new();
    let mut seen = std::collections::HashMap::new();
    for rec in records {
        let rec = rec.map_err(|e| csv_err(file, e))?;
        let line = rec.position().map_or(0, |p| p.line());
        if rec.iter().all(|f| f.is_empty()) {
            continue;
        }
        let (b, offset) = buffer(&cols, &rec).map_err(|what| err(line, what))?;
        if let Some(prev) = seen.insert(b.id.clone(), line) {
            return Err(err(
                line,
                format!("buffer id {:?} already used on line {prev}", b.id),
            ));
        }
        buffers.push(b);
        offsets.push(offset);
    }
    let given = cols.contains(&Col::Offset).then_some(offsets);
    Ok((Problem::new(buffers), given))
}

/// The header's columns: each known, none twice, the four required ones
/// present.
fn columns(header: &csv::StringRecord) -> Result<Vec<Col>, String> {
    let mut cols: Vec<Col> = Vec::new();
    for name in header.iter() {
        let c = column(&name.to_ascii_lowercase()).ok_or_else(|| {
            format!(
                "unknown column {name:?} (expected id, lower, upper, size, and optionally align, pinned, offset)"
            )
        })?;
        if cols.contains(&c) {
            return Err(format!("column {name:?} appears twice"));
        }
        cols.push(c);
    }
    for (need, name) in [
        (Col::Id, "id"),
        (Col::Lower, "lower"),
        (Col::Upper, "upper"),
        (Col::Size, "size"),
    ] {
        if !cols.contains(&need) {
            return Err(format!("the header has no {name:?} column"));
        }
    }
    Ok(cols)
}

/// One row's buffer and its `offset` field, read by `cols` and checked.
fn buffer(cols: &[Col], rec: &csv::StringRecord) -> Result<(Buffer, Option<u64>), String> {
    if rec.len() != cols.len() {
        return Err(format!(
            "{} fields, but the header has {}",
            rec.len(),
            cols.len()
        ));
    }
    let mut b = Buffer::new("", 0, 0, 0);
    let mut offset = None;
    for (c, field) in cols.iter().zip(rec.iter()) {
        let num = |what: &str| -> Result<u64, String> {
            field
                .parse::<u64>()
                .map_err(|_| format!("{what}: expected a non-negative integer, got {field:?}"))
        };
        match c {
            Col::Id => {
                if field.is_empty() {
                    return Err("id: empty".into());
                }
                b.id = field.to_string();
            }
            Col::Lower => b.lower = num("lower")?,
            Col::Upper => b.upper = num("upper")?,
            Col::Size => b.size = num("size")?,
            Col::Align => {
                b.align = num("align")?;
                if b.align == 0 {
                    return Err("align: must be at least 1".into());
                }
            }
            Col::Pinned => {
                if !field.is_empty() {
                    b.pinned = Some(num("pinned")?);
                }
            }
            Col::Offset => {
                if !field.is_empty() {
                    offset = Some(num("offset")?);
                }
            }
        }
    }
    if b.upper < b.lower {
        return Err(format!(
            "buffer {}: upper {} is below lower {}",
            b.id, b.upper, b.lower
        ));
    }
    if let Some(p) = b.pinned
        && p % b.align != 0
    {
        return Err(format!(
            "buffer {}: pinned at {p}, not a multiple of its align {}",
            b.id, b.align
        ));
    }
    Ok((b, offset))
}

fn csv_err(file: &str, e: csv::Error) -> AllocError {
    let line = e.position().map_or(0, |p| p.line());
    AllocError::Csv {
        file: file.to_string(),
        line,
        what: e.to_string(),
    }
}

/// Reads a problem from a CSV file.
pub fn read(path: &Path) -> Result<Problem, AllocError> {
    read_with_layout(path).map(|(p, _)| p)
}

/// [`read`], and the file's `offset` column ([`parse_with_layout`]).
pub fn read_with_layout(path: &Path) -> Result<(Problem, Option<GivenOffsets>), AllocError> {
    let text = std::fs::read_to_string(path).map_err(|e| AllocError::Io {
        file: path.display().to_string(),
        source: e,
    })?;
    parse_with_layout(&text, &path.display().to_string())
}

/// Writes `problem` with the offsets of `solution` as CSV.
pub fn write(problem: &Problem, solution: &Solution, out: &mut dyn Write) -> std::io::Result<()> {
    let align = problem.buffers.iter().any(|b| b.align > 1);
    let pinned = problem.buffers.iter().any(|b| b.pinned.is_some());
    let mut w = csv::Writer::from_writer(out);
    let mut head = vec!["id", "lower", "upper", "size"];
    if align {
        head.push("align");
    }
    if pinned {
        head.push("pinned");
    }
    head.push("offset");
    w.write_record(&head)?;
    for (b, off) in problem.buffers.iter().zip(&solution.offsets) {
        let mut row = vec![
            b.id.clone(),
            b.lower.to_string(),
            b.upper.to_string(),
            b.size.to_string(),
        ];
        if align {
            row.push(b.align.to_string());
        }
        if pinned {
            row.push(b.pinned.map(|p| p.to_string()).unwrap_or_default());
        }
        row.push(off.to_string());
        w.write_record(&row)?;
    }
    w.flush()?;
    Ok(())
}

/// The CSV text of a layout.
pub fn to_string(problem: &Problem, solution: &Solution) -> String {
    let mut v = Vec::new();
    write(problem, solution, &mut v).expect("writing to memory");
    String::from_utf8(v).expect("CSV of UTF-8 fields")
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXAMPLE: &str =
        "id,lower,upper,size\nb1,0,3,4\nb2,3,9,4\nb3,0,9,4\nb4,9,21,4\nb5,0,21,4\n";

    #[test]
    fn reads_minimallocs_example() {
        let p = parse(EXAMPLE, "ex.csv").unwrap();
        assert_eq!(p.buffers.len(), 5);
        assert_eq!(p.buffers[3], Buffer::new("b4", 9, 21, 4));
        assert_eq!(p.max_live(), 12);
    }

    #[test]
    fn round_trips_with_offsets_and_extra_columns() {
        let text = "buffer,begin,end,size,align,pinned\na,0,2,3,4,\nb,1,3,8,1,8\n";
        let p = parse(text, "x.csv").unwrap();
        assert_eq!(p.buffers[0].align, 4);
        assert_eq!(p.buffers[1].pinned, Some(8));
        let s = Solution {
            offsets: vec![0, 8],
            height: 16,
        };
        let out = to_string(&p, &s);
        assert_eq!(
            out,
            "id,lower,upper,size,align,pinned,offset\na,0,2,3,4,,0\nb,1,3,8,1,8,8\n"
        );
        let again = parse(&out, "y.csv").unwrap();
        assert_eq!(again, p);
    }

    fn error_of(text: &str) -> String {
        parse(text, "bad.csv").unwrap_err().to_string()
    }

    #[test]
    fn bad_input_names_file_line_and_problem() {
        assert_eq!(
            error_of("id,lower,upper,size\na,0,2,4\nb,0,x,4\n"),
            "bad.csv:3: upper: expected a non-negative integer, got \"x\""
        );
        assert_eq!(
            error_of("id,lower,upper,size\na,0,2\n"),
            "bad.csv:2: 3 fields, but the header has 4"
        );
        assert_eq!(
            error_of("id,lower,upper,size\na,5,2,4\n"),
            "bad.csv:2: buffer a: upper 2 is below lower 5"
        );
        assert_eq!(
            error_of("id,lower,upper,size\na,0,2,4\na,1,3,4\n"),
            "bad.csv:3: buffer id \"a\" already used on line 2"
        );
        assert!(error_of("id,lower,upper\n").contains("no \"size\" column"));
        assert!(error_of("id,lower,upper,size,colour\n").contains("unknown column \"colour\""));
        assert!(error_of("").starts_with("bad.csv:1: empty file"));
        assert!(error_of("id,lower,upper,size\na,0,2,-4\n").contains("size: expected"));
    }
}
