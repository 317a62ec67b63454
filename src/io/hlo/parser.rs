//! HLO text → a module of computations of instructions.
//!
//! The grammar, as XLA prints it:
//! ```text
//! HloModule NAME [, key=value]*
//! [FileNames / FunctionNames / FileLocations / StackFrames sections]
//! [ENTRY] %COMP [(PARAMS) -> SHAPE] {
//!   [ROOT] %NAME = SHAPE OPCODE(OPERANDS)[, key=value]*
//!   ...
//! }
//! ```
//! Operands may carry their shapes (`f32[2]{0} %x`, older dumps) or not
//! (`%x`); names may carry `%` or not. Attribute values are skipped as
//! balanced token runs, except the few the importer needs (called
//! computations, fusion kind, tuple index, aliasing, `op_name` metadata).
//! Nothing recurses on the input's nesting except tuple shapes, whose depth
//! is limited, so deep nesting is an error, not a stack overflow.

use std::collections::HashMap;

use super::HloError;
use super::lexer::{Lexer, Tok, Token};
use super::shape::{ArrayShape, Dim, ElementType, Shape};

/// Deepest tuple shape accepted.
pub const MAX_SHAPE_DEPTH: usize = 64;

/// Index of an instruction in its computation.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct InstrIdx(pub u32);

/// Index of a computation in a [`Module`].
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CompIdx(pub u32);

impl InstrIdx {
    pub fn index(self) -> usize {
        self.0 as usize
    }
}
impl CompIdx {
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// A tuple index path, e.g. `{1,0}`.
pub type ShapeIndex = Vec<u32>;

/// `input_output_alias` entry: output `output` may live in parameter
/// `param`'s buffer at `param_index`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Alias {
    pub output: ShapeIndex,
    pub param: u64,
    pub param_index: ShapeIndex,
    /// `may-alias` or `must-alias` (absent in older dumps).
    pub kind: Option<String>,
}

/// A parsed module.
#[derive(Clone, Debug)]
pub struct Module {
    pub name: String,
    /// `is_scheduled=true`: each computation lists its instructions in
    /// execution order.
    pub is_scheduled: bool,
    pub input_output_alias: Vec<Alias>,
    /// `buffer_donor` entries: parameters donated without a fixed output.
    pub buffer_donors: Vec<(u64, ShapeIndex)>,
    pub computations: Vec<Computation>,
    pub entry: CompIdx,
}

impl Module {
    pub fn comp(&self, c: CompIdx) -> &Computation {
        &self.computations[c.index()]
    }
    pub fn entry(&self) -> &Computation {
        self.comp(self.entry)
    }
    /// Instructions in the whole module, fused bodies included.
    pub fn num_instructions(&self) -> usize {
        self.computations.iter().map(|c| c.instrs.len()).sum()
    }
}

/// A computation: a list of instructions, operands before their users.
#[derive(Clone, Debug)]
pub struct Computation {
    pub name: String,
    pub line: u32,
    pub instrs: Vec<Instr>,
    pub root: InstrIdx,
    /// The `parameter(N)` instruction of each parameter number.
    pub params: Vec<InstrIdx>,
}

/// An instruction with what the importer needs of its attributes.
#[derive(Clone, Debug)]
pub struct Instr {
    pub name: String,
    pub shape: Shape,
    pub opcode: String,
    pub operands: Vec<InstrIdx>,
    pub line: u32,
    pub col: u32,
    /// `parameter(N)`'s number.
    pub param_number: Option<u64>,
    /// `get-tuple-element`'s `index=`.
    pub tuple_index: Option<u64>,
    /// Fusion `kind=` (`kLoop`, `kInput`, `kOutput`, `kCustom`).
    pub fusion_kind: Option<String>,
    /// Called computations: `calls`, `to_apply`, `body`, `condition`,
    /// `branch_computations`, `true_computation`, `false_computation`, by
    /// attribute name.
    pub called: Vec<(String, CompIdx)>,
    /// `output_to_operand_aliasing` of custom-calls: (output index, operand,
    /// operand index).
    pub output_operand_alias: Vec<(ShapeIndex, u64, ShapeIndex)>,
    /// `metadata={op_name="..."}`.
    pub op_name: Option<String>,
    /// `custom_call_target`.
    pub custom_call_target: Option<String>,
    /// `control-predecessors={...}`: instructions that must run before this
    /// one although it reads nothing of theirs (defined before it).
    pub control_preds: Vec<InstrIdx>,
    /// `dot`'s `lhs_contracting_dims`.
    pub lhs_contracting_dims: Vec<u32>,
    /// `convolution`'s `dim_labels` (e.g. `b01f_01io->b01f`).
    pub dim_labels: Option<String>,
}

impl Instr {
    /// The computation called through attribute `attr`, if any.
    pub fn called(&self, attr: &str) -> Option<CompIdx> {
        self.called.iter().find(|(a, _)| a == attr).map(|&(_, c)| c)
    }
    /// Computations called through attribute `attr` (several for lists).
    pub fn called_all<'s>(&'s self, attr: &'s str) -> impl Iterator<Item = CompIdx> + 's {
        self.called
            .iter()
            .filter(move |(a, _)| a == attr)
            .map(|&(_, c)| c)
    }
}

/// Whether `opcode` moves data between devices: the collectives and their
/// asynchronous start/done halves.
pub fn is_collective(opcode: &str) -> bool {
    let base = opcode
        .strip_suffix("-start")
        .or_else(|| opcode.strip_suffix("-done"))
        .unwrap_or(opcode);
    matches!(
        base,
        "all-gather"
            | "all-reduce"
            | "reduce-scatter"
            | "all-to-all"
            | "ragged-all-to-all"
            | "collective-permute"
            | "collective-broadcast"
            | "send"
            | "recv"
    )
}

/// Parses a whole HLO module.
pub fn parse_module(text: &str) -> Result<Module, HloError> {
    Parser {
        lx: Lexer::new(text),
    }
    .module()
}

/// Strips the `%` XLA puts in front of names.
fn bare(name: &str) -> &str {
    name.strip_prefix('%').unwrap_or(name)
}

/// Whether a word at an operand position starts a shape (an element type)
/// rather than naming an operand.
fn looks_like_shape_start(w: &str) -> bool {
    ElementType::parse(w).is_some()
}

/// A computation reference not yet resolved to an index.
struct PendingRef {
    comp: usize,
    instr: usize,
    attr: String,
    name: String,
    line: u32,
    col: u32,
}

struct Parser<'a> {
    lx: Lexer<'a>,
}

impl<'a> Parser<'a> {
    fn err(&self, t: &Token<'_>, msg: impl Into<String>) -> HloError {
        HloError::new(t.line, t.col, msg)
    }

    fn unexpected(&self, t: &Token<'_>, wanted: &str) -> HloError {
        self.err(t, format!("expected {wanted}, found {}", t.describe()))
    }

    fn expect_punct(&mut self, c: u8) -> Result<Token<'a>, HloError> {
        let t = self.lx.next_token()?;
        if t.tok == Tok::Punct(c) {
            Ok(t)
        } else {
            Err(self.unexpected(&t, &format!("'{}'", c as char)))
        }
    }

    fn expect_word(&mut self, what: &str) -> Result<(&'a str, Token<'a>), HloError> {
        let t = self.lx.next_token()?;
        match t.tok {
            Tok::Word(w) => Ok((w, t)),
            _ => Err(self.unexpected(&t, what)),
        }
    }

    fn peek_is(&mut self, c: u8) -> Result<bool, HloError> {
        Ok(self.lx.peek()?.tok == Tok::Punct(c))
    }

    fn expect_u64(&mut self, what: &str) -> Result<u64, HloError> {
        let (w, t) = self.expect_word(what)?;
        w.parse::<u64>()
            .map_err(|_| self.err(&t, format!("expected {what}, found '{w}'")))
    }

    /// Skips one balanced value: tokens up to a `,` at depth 0, a closing
    /// bracket at depth 0 (not consumed), or the start of a new line at
    /// depth 0. Iterative, so nesting depth costs no stack.
    fn skip_value(&mut self) -> Result<(), HloError> {
        let mut stack: Vec<u8> = Vec::new();
        let mut first = true;
        loop {
            let t = self.lx.peek()?;
            if stack.is_empty() && !first {
                match t.tok {
                    Tok::Punct(b',' | b'}' | b')' | b']') | Tok::Eof => return Ok(()),
                    _ if t.line_start => return Ok(()),
                    _ => {}
                }
            }
            first = false;
            match t.tok {
                Tok::Eof => {
                    return Err(match stack.last() {
                        Some(&open) => self.err(
                            &t,
                            format!("unexpected end of file inside '{}'", open as char),
                        ),
                        None => self.err(&t, "unexpected end of file: expected a value"),
                    });
                }
                Tok::Punct(c @ (b'{' | b'(' | b'[')) => stack.push(c),
                Tok::Punct(c @ (b'}' | b')' | b']')) => {
                    let open = match c {
                        b'}' => b'{',
                        b')' => b'(',
                        _ => b'[',
                    };
                    if stack.pop() != Some(open) {
                        return Err(self.err(&t, format!("unbalanced '{}'", c as char)));
                    }
                }
                _ => {}
            }
            // A value may continue after a group or a word (e.g.
            // `[2,2]<=[4]`); the loop head decides.
            self.lx.next_token()?;
        }
    }

    /// Skips the rest of the current line (balanced).
    fn skip_line(&mut self) -> Result<(), HloError> {
        loop {
            let t = self.lx.peek()?;
            if t.tok == Tok::Eof || t.line_start {
                return Ok(());
            }
            self.skip_value()?;
            if self.peek_is(b',')? {
                self.lx.next_token()?;
            } else {
                let t = self.lx.peek()?;
                if !(t.tok == Tok::Eof || t.line_start) {
                    // A stray closing bracket on a skipped line.
                    self.lx.next_token()?;
                }
            }
        }
    }

    fn module(mut self) -> Result<Module, HloError> {
        let (w, t) = self.expect_word("'HloModule'")?;
        if w != "HloModule" {
            return Err(self.err(&t, format!("expected 'HloModule', found '{w}'")));
        }
        let (name, _) = self.expect_word("the module name")?;
        let mut m = Module {
            name: bare(name).trim_end_matches(',').to_string(),
            is_scheduled: false,
            input_output_alias: Vec::new(),
            buffer_donors: Vec::new(),
            computations: Vec::new(),
            entry: CompIdx(0),
        };
        // Header attributes, up to the end of the line.
        while self.peek_is(b',')? && !self.lx.peek()?.line_start {
            self.lx.next_token()?;
            let (key, _) = self.expect_word("a module attribute")?;
            self.expect_punct(b'=')?;
            match key {
                "is_scheduled" => {
                    let (v, _) = self.expect_word("true or false")?;
                    m.is_scheduled = v == "true";
                }
                "input_output_alias" => m.input_output_alias = self.alias_list()?,
                "buffer_donor" => m.buffer_donors = self.donor_list()?,
                _ => self.skip_value()?,
            }
        }

        let mut pending: Vec<PendingRef> = Vec::new();
        let mut entry: Option<CompIdx> = None;
        loop {
            let t = self.lx.peek()?;
            match t.tok {
                Tok::Eof => break,
                Tok::Word("FileNames" | "FunctionNames" | "FileLocations" | "StackFrames") => {
                    self.lx.next_token()?;
                    // Numbered lines follow the section name.
                    while let Tok::Word(w) = self.lx.peek()?.tok {
                        if !w.bytes().all(|b| b.is_ascii_digit()) {
                            break;
                        }
                        self.lx.next_token()?;
                        self.skip_line()?;
                    }
                }
                Tok::Word(w) => {
                    let is_entry = w == "ENTRY";
                    if is_entry {
                        self.lx.next_token()?;
                    }
                    let idx = CompIdx(m.computations.len() as u32);
                    let comp = self.computation(idx.index(), &mut pending)?;
                    if is_entry {
                        if entry.is_some() {
                            return Err(self.err(&t, "a second ENTRY computation"));
                        }
                        entry = Some(idx);
                    }
                    m.computations.push(comp);
                }
                _ => return Err(self.unexpected(&t, "a computation")),
            }
        }
        if m.computations.is_empty() {
            let t = self.lx.peek()?;
            return Err(self.err(&t, "the module has no computations"));
        }
        // Without an ENTRY marker, the last computation is the entry (as
        // XLA's parser does).
        m.entry = entry.unwrap_or(CompIdx(m.computations.len() as u32 - 1));

        let mut by_name: HashMap<&str, CompIdx> = HashMap::new();
        for (i, c) in m.computations.iter().enumerate() {
            if by_name.insert(c.name.as_str(), CompIdx(i as u32)).is_some() {
                return Err(HloError::new(
                    c.line,
                    1,
                    format!("computation %{} is defined twice", c.name),
                ));
            }
        }
        let mut resolved = Vec::with_capacity(pending.len());
        for p in &pending {
            let Some(&c) = by_name.get(p.name.as_str()) else {
                return Err(HloError::new(
                    p.line,
                    p.col,
                    format!("{}=%{} names an unknown computation", p.attr, p.name),
                ));
            };
            resolved.push(c);
        }
        for (p, c) in pending.into_iter().zip(resolved) {
            m.computations[p.comp].instrs[p.instr]
                .called
                .push((p.attr, c));
        }
        Ok(m)
    }

    /// `{ {0}: (0, {}, may-alias), ... }`
    fn alias_list(&mut self) -> Result<Vec<Alias>, HloError> {
        self.expect_punct(b'{')?;
        let mut out = Vec::new();
        loop {
            if self.peek_is(b'}')? {
                self.lx.next_token()?;
                return Ok(out);
            }
            let output = self.shape_index()?;
            self.expect_punct(b':')?;
            self.expect_punct(b'(')?;
            let param = self.expect_u64("a parameter number")?;
            self.expect_punct(b',')?;
            let param_index = self.shape_index()?;
            let mut kind = None;
            if self.peek_is(b',')? {
                self.lx.next_token()?;
                let (k, _) = self.expect_word("may-alias or must-alias")?;
                kind = Some(k.to_string());
            }
            self.expect_punct(b')')?;
            out.push(Alias {
                output,
                param,
                param_index,
                kind,
            });
            if self.peek_is(b',')? {
                self.lx.next_token()?;
            }
        }
    }

    /// `{ (0, {}), (1, {}) }`
    fn donor_list(&mut self) -> Result<Vec<(u64, ShapeIndex)>, HloError> {
        self.expect_punct(b'{')?;
        let mut out = Vec::new();
        loop {
            if self.peek_is(b'}')? {
                self.lx.next_token()?;
                return Ok(out);
            }
            self.expect_punct(b'(')?;
            let p = self.expect_u64("a parameter number")?;
            self.expect_punct(b',')?;
            let idx = self.shape_index()?;
            self.expect_punct(b')')?;
            out.push((p, idx));
            if self.peek_is(b',')? {
                self.lx.next_token()?;
            }
        }
    }

    /// `{}` or `{1,0}`
    fn shape_index(&mut self) -> Result<ShapeIndex, HloError> {
        self.expect_punct(b'{')?;
        let mut out = Vec::new();
        loop {
            let t = self.lx.next_token()?;
            match t.tok {
                Tok::Punct(b'}') => return Ok(out),
                Tok::Punct(b',') => {}
                Tok::Word(w) => out.push(
                    w.parse::<u32>()
                        .map_err(|_| self.unexpected(&t, "a tuple index"))?,
                ),
                _ => return Err(self.unexpected(&t, "a tuple index or '}'")),
            }
        }
    }

    /// A shape: `f32[2,3]{1,0}`, `(s32[], f32[2])`, `token[]`.
    fn shape(&mut self, depth: usize) -> Result<Shape, HloError> {
        let t = self.lx.next_token()?;
        if depth > MAX_SHAPE_DEPTH {
            return Err(self.err(
                &t,
                format!("tuple shapes nested deeper than {MAX_SHAPE_DEPTH} levels"),
            ));
        }
        match t.tok {
            Tok::Punct(b'(') => {
                let mut parts = Vec::new();
                if self.peek_is(b')')? {
                    self.lx.next_token()?;
                    return Ok(Shape::Tuple(parts));
                }
                loop {
                    parts.push(self.shape(depth + 1)?);
                    let t = self.lx.next_token()?;
                    match t.tok {
                        Tok::Punct(b',') => {}
                        Tok::Punct(b')') => return Ok(Shape::Tuple(parts)),
                        _ => return Err(self.unexpected(&t, "',' or ')' in a tuple shape")),
                    }
                }
            }
            Tok::Word(w) => {
                let Some(element) = ElementType::parse(w) else {
                    return Err(self.err(&t, format!("unknown element type '{w}'")));
                };
                let mut dims = Vec::new();
                if self.peek_is(b'[')? {
                    self.lx.next_token()?;
                    loop {
                        let t = self.lx.next_token()?;
                        match t.tok {
                            Tok::Punct(b']') => break,
                            Tok::Punct(b',') => {}
                            Tok::Word(n) if n.bytes().all(|b| b.is_ascii_digit()) => {
                                dims.push(Dim::Static(n.parse::<u64>().map_err(|_| {
                                    self.err(&t, format!("dimension '{n}' does not fit in 64 bits"))
                                })?));
                            }
                            Tok::Word("<") => {
                                self.expect_punct(b'=')?;
                                let (n, nt) = self.expect_word("a dimension bound")?;
                                dims.push(Dim::Bounded(n.parse::<u64>().map_err(|_| {
                                    self.err(&nt, format!("bad dimension bound '{n}'"))
                                })?));
                            }
                            Tok::Word("?") => {
                                return Err(self.err(
                                    &t,
                                    "unbounded dynamic dimension '?': memplan needs a bound to size the array",
                                ));
                            }
                            _ => return Err(self.unexpected(&t, "a dimension")),
                        }
                    }
                } else if element.bits != 0 {
                    let t = self.lx.peek()?;
                    return Err(self.unexpected(&t, "'[' after the element type"));
                }
                let mut a = ArrayShape {
                    element,
                    dims,
                    minor_to_major: None,
                    element_bits: None,
                };
                if self.peek_is(b'{')? {
                    self.layout(&mut a)?;
                }
                Ok(Shape::Array(a))
            }
            _ => Err(self.unexpected(&t, "a shape")),
        }
    }

    /// `{1,0}`, `{1,0:T(8,128)E(4)}`: keeps minor-to-major and `E(bits)`.
    fn layout(&mut self, a: &mut ArrayShape) -> Result<(), HloError> {
        self.expect_punct(b'{')?;
        let mut order = Vec::new();
        let mut in_order = true;
        let mut depth = 0usize;
        loop {
            let t = self.lx.next_token()?;
            match t.tok {
                Tok::Punct(b'}') if depth == 0 => break,
                Tok::Punct(b'(' | b'[' | b'{') => depth += 1,
                Tok::Punct(b')' | b']' | b'}') => {
                    depth = depth
                        .checked_sub(1)
                        .ok_or_else(|| self.err(&t, "unbalanced bracket in a layout"))?;
                }
                Tok::Punct(b':') => in_order = false,
                Tok::Word("E") if !in_order && depth == 0 && self.peek_is(b'(')? => {
                    self.lx.next_token()?;
                    let bits = self.expect_u64("an element size in bits")?;
                    self.expect_punct(b')')?;
                    a.element_bits = Some(bits.min(u32::MAX as u64) as u32);
                }
                Tok::Word(w) if in_order => {
                    order.push(
                        w.parse::<u32>().map_err(|_| {
                            self.err(&t, format!("bad dimension '{w}' in a layout"))
                        })?,
                    );
                }
                Tok::Eof => return Err(self.err(&t, "unexpected end of file in a layout")),
                _ => {}
            }
        }
        if !order.is_empty() || a.dims.is_empty() {
            if order.len() != a.dims.len() {
                return Err(HloError::new(
                    self.lx.peek()?.line,
                    self.lx.peek()?.col,
                    format!(
                        "layout names {} dimensions, the shape {a} has {}",
                        order.len(),
                        a.dims.len()
                    ),
                ));
            }
            a.minor_to_major = Some(order);
        }
        Ok(())
    }

    fn computation(
        &mut self,
        comp: usize,
        pending: &mut Vec<PendingRef>,
    ) -> Result<Computation, HloError> {
        let (name, nt) = self.expect_word("a computation name")?;
        // Signature `(params) -> shape` and anything else up to the `{` at
        // depth 0 (a layout's `{` is inside the result shape, after `]`).
        let mut depth = 0usize;
        let mut after_bracket = false;
        loop {
            let t = self.lx.next_token()?;
            match t.tok {
                Tok::Eof => {
                    return Err(self.err(&t, format!("computation %{} has no body", bare(name))));
                }
                _ if t.line_start && t.line != nt.line => {
                    return Err(self.unexpected(&t, "'{' opening the computation's body"));
                }
                // The body's `{` ends its line; a layout's does not.
                Tok::Punct(b'{')
                    if depth == 0 && (!after_bracket || self.lx.peek()?.line_start) =>
                {
                    break;
                }
                Tok::Punct(b'{' | b'(' | b'[') => depth += 1,
                Tok::Punct(c @ (b'}' | b')' | b']')) => {
                    depth = depth
                        .checked_sub(1)
                        .ok_or_else(|| self.err(&t, "unbalanced bracket in a signature"))?;
                    after_bracket = c == b']' && depth == 0;
                    continue;
                }
                _ => {}
            }
            after_bracket = false;
        }
        let mut instrs: Vec<Instr> = Vec::new();
        let mut names: HashMap<&'a str, InstrIdx> = HashMap::new();
        let mut root: Option<InstrIdx> = None;
        loop {
            let t = self.lx.peek()?;
            if t.tok == Tok::Punct(b'}') {
                self.lx.next_token()?;
                break;
            }
            if t.tok == Tok::Eof {
                return Err(self.err(
                    &t,
                    format!("unexpected end of file inside computation %{}", bare(name)),
                ));
            }
            let idx = InstrIdx(instrs.len() as u32);
            let (is_root, key, instr) = self.instruction(comp, idx, &names, pending)?;
            if names.insert(key, idx).is_some() {
                return Err(HloError::new(
                    instr.line,
                    instr.col,
                    format!("instruction %{} is defined twice", instr.name),
                ));
            }
            if is_root {
                if root.is_some() {
                    return Err(HloError::new(
                        instr.line,
                        instr.col,
                        format!("computation %{} has two ROOT instructions", bare(name)),
                    ));
                }
                root = Some(idx);
            }
            instrs.push(instr);
        }
        if instrs.is_empty() {
            return Err(self.err(&nt, format!("computation %{} is empty", bare(name))));
        }
        let root = root.unwrap_or(InstrIdx(instrs.len() as u32 - 1));
        // Parameters by number; numbers must be 0..n without gaps.
        let nparams = instrs.iter().filter(|i| i.param_number.is_some()).count();
        let mut params = vec![None; nparams];
        for (i, ins) in instrs.iter().enumerate() {
            if let Some(p) = ins.param_number {
                let slot = usize::try_from(p)
                    .ok()
                    .and_then(|p| params.get_mut(p))
                    .ok_or_else(|| {
                        HloError::new(
                            ins.line,
                            ins.col,
                            format!(
                                "parameter({p}) is out of range: computation %{} has {nparams} parameters",
                                bare(name)
                            ),
                        )
                    })?;
                if slot.is_some() {
                    return Err(HloError::new(
                        ins.line,
                        ins.col,
                        format!("parameter({p}) appears twice in %{}", bare(name)),
                    ));
                }
                *slot = Some(InstrIdx(i as u32));
            }
        }
        Ok(Computation {
            name: bare(name).to_string(),
            line: nt.line,
            instrs,
            root,
            params: params.into_iter().map(|p| p.expect("all set")).collect(),
        })
    }

    /// `[ROOT] %name = shape opcode(operands)[, key=value]*`
    fn instruction(
        &mut self,
        comp: usize,
        idx: InstrIdx,
        names: &HashMap<&'a str, InstrIdx>,
        pending: &mut Vec<PendingRef>,
    ) -> Result<(bool, &'a str, Instr), HloError> {
        let (mut w, mut t) = self.expect_word("an instruction")?;
        let is_root = w == "ROOT";
        if is_root {
            (w, t) = self.expect_word("an instruction name after ROOT")?;
        }
        let name = bare(w);
        if !t.line_start && !is_root {
            return Err(self.err(&t, format!("instruction %{name} does not start a line")));
        }
        self.expect_punct(b'=')?;
        let shape = self.shape(0)?;
        let (opcode, _) = self.expect_word("an opcode")?;
        let mut ins = Instr {
            name: name.to_string(),
            shape,
            opcode: opcode.to_string(),
            operands: Vec::new(),
            line: t.line,
            col: t.col,
            param_number: None,
            tuple_index: None,
            fusion_kind: None,
            called: Vec::new(),
            output_operand_alias: Vec::new(),
            op_name: None,
            custom_call_target: None,
            control_preds: Vec::new(),
            lhs_contracting_dims: Vec::new(),
            dim_labels: None,
        };
        self.expect_punct(b'(')?;
        match opcode {
            "parameter" => {
                ins.param_number = Some(self.expect_u64("a parameter number")?);
                self.expect_punct(b')')?;
            }
            "constant" => self.literal()?,
            _ => ins.operands = self.operands(name, names)?,
        }
        while self.peek_is(b',')? && !self.lx.peek()?.line_start {
            self.lx.next_token()?;
            let (key, _) = self.expect_word("an attribute name")?;
            self.expect_punct(b'=')?;
            self.attribute(key, &mut ins, (comp, idx), names, pending)?;
        }
        let t = self.lx.peek()?;
        if !(t.line_start || t.tok == Tok::Eof || t.tok == Tok::Punct(b'}')) {
            return Err(self.unexpected(&t, &format!("',' or the end of instruction %{name}")));
        }
        Ok((is_root, name, ins))
    }

    /// A constant's literal up to its closing `)`: skipped, balanced.
    fn literal(&mut self) -> Result<(), HloError> {
        if self.peek_is(b')')? {
            self.lx.next_token()?;
            return Ok(());
        }
        loop {
            self.skip_value()?;
            let t = self.lx.next_token()?;
            match t.tok {
                Tok::Punct(b')') => return Ok(()),
                Tok::Punct(b',') => {}
                _ => return Err(self.unexpected(&t, "')' closing the literal")),
            }
        }
    }

    /// Operands up to the closing `)`: `[shape] %name` separated by commas,
    /// each defined before instruction `name` in its computation.
    fn operands(
        &mut self,
        name: &str,
        names: &HashMap<&'a str, InstrIdx>,
    ) -> Result<Vec<InstrIdx>, HloError> {
        let mut out = Vec::new();
        if self.peek_is(b')')? {
            self.lx.next_token()?;
            return Ok(out);
        }
        loop {
            let t = self.lx.peek()?;
            let (on, otok) = match t.tok {
                Tok::Word(w) if !looks_like_shape_start(w) => {
                    self.lx.next_token()?;
                    (w, t)
                }
                Tok::Word(_) | Tok::Punct(b'(') => {
                    self.shape(0)?;
                    self.expect_word("an operand name after its shape")?
                }
                _ => return Err(self.unexpected(&t, "an operand")),
            };
            let Some(&oi) = names.get(bare(on)) else {
                return Err(self.err(
                    &otok,
                    format!(
                        "%{name} uses %{}, which is not defined before it in this computation",
                        bare(on)
                    ),
                ));
            };
            out.push(oi);
            let t = self.lx.next_token()?;
            match t.tok {
                Tok::Punct(b',') => {}
                Tok::Punct(b')') => return Ok(out),
                _ => return Err(self.unexpected(&t, "',' or ')' after an operand")),
            }
        }
    }

    /// The value of attribute `key` of `ins`, the instruction `at`
    /// (computation, index): what the importer needs is kept, the rest
    /// skipped. Called computations are resolved later (`pending`).
    fn attribute(
        &mut self,
        key: &str,
        ins: &mut Instr,
        at: (usize, InstrIdx),
        names: &HashMap<&'a str, InstrIdx>,
        pending: &mut Vec<PendingRef>,
    ) -> Result<(), HloError> {
        match key {
            "calls"
            | "to_apply"
            | "body"
            | "condition"
            | "branch_computations"
            | "true_computation"
            | "false_computation" => {
                for (n, nt) in self.name_list()? {
                    pending.push(PendingRef {
                        comp: at.0,
                        instr: at.1.index(),
                        attr: key.to_string(),
                        name: bare(n).to_string(),
                        line: nt.line,
                        col: nt.col,
                    });
                }
            }
            "kind" => {
                let (k, _) = self.expect_word("a fusion kind")?;
                ins.fusion_kind = Some(k.to_string());
            }
            "index" => ins.tuple_index = Some(self.expect_u64("a tuple index")?),
            "output_to_operand_aliasing" => {
                ins.output_operand_alias = self.operand_alias_list()?;
            }
            "custom_call_target" => {
                let t = self.lx.next_token()?;
                match t.tok {
                    Tok::Str(s) | Tok::Word(s) => ins.custom_call_target = Some(s.to_string()),
                    _ => return Err(self.unexpected(&t, "a custom-call target")),
                }
            }
            "metadata" => ins.op_name = self.metadata()?,
            "lhs_contracting_dims" => ins.lhs_contracting_dims = self.shape_index()?,
            "dim_labels" => {
                let (w, _) = self.expect_word("dimension labels")?;
                ins.dim_labels = Some(w.to_string());
            }
            "control-predecessors" => {
                for (n, nt) in self.name_list()? {
                    let Some(&p) = names.get(bare(n)) else {
                        return Err(self.err(
                            &nt,
                            format!(
                                "%{} has control predecessor %{}, which is not defined before it in this computation",
                                ins.name,
                                bare(n)
                            ),
                        ));
                    };
                    ins.control_preds.push(p);
                }
            }
            _ => self.skip_value()?,
        }
        Ok(())
    }

    /// `%name` or `{%a, %b}`.
    fn name_list(&mut self) -> Result<Vec<(&'a str, Token<'a>)>, HloError> {
        if self.peek_is(b'{')? {
            self.lx.next_token()?;
            let mut out = Vec::new();
            loop {
                let t = self.lx.next_token()?;
                match t.tok {
                    Tok::Punct(b'}') => return Ok(out),
                    Tok::Punct(b',') => {}
                    Tok::Word(w) => out.push((w, t)),
                    _ => return Err(self.unexpected(&t, "a name")),
                }
            }
        }
        let (w, t) = self.expect_word("a computation name")?;
        Ok(vec![(w, t)])
    }

    /// `{ {0}: (1, {}), {}: (0, {1}) }`
    fn operand_alias_list(&mut self) -> Result<Vec<(ShapeIndex, u64, ShapeIndex)>, HloError> {
        self.expect_punct(b'{')?;
        let mut out = Vec::new();
        loop {
            if self.peek_is(b'}')? {
                self.lx.next_token()?;
                return Ok(out);
            }
            let o = self.shape_index()?;
            self.expect_punct(b':')?;
            self.expect_punct(b'(')?;
            let n = self.expect_u64("an operand number")?;
            self.expect_punct(b',')?;
            let i = self.shape_index()?;
            self.expect_punct(b')')?;
            out.push((o, n, i));
            if self.peek_is(b',')? {
                self.lx.next_token()?;
            }
        }
    }

    /// `{op_name="..." source_file="..." ...}`: keeps `op_name`.
    fn metadata(&mut self) -> Result<Option<String>, HloError> {
        if !self.peek_is(b'{')? {
            self.skip_value()?;
            return Ok(None);
        }
        self.lx.next_token()?;
        let mut op_name = None;
        let mut depth = 0usize;
        let mut prev_key: Option<&str> = None;
        loop {
            let t = self.lx.next_token()?;
            match t.tok {
                Tok::Punct(b'}') if depth == 0 => return Ok(op_name),
                Tok::Punct(b'{' | b'(' | b'[') => depth += 1,
                Tok::Punct(b'}' | b')' | b']') => {
                    depth = depth
                        .checked_sub(1)
                        .ok_or_else(|| self.err(&t, "unbalanced bracket in metadata"))?;
                }
                Tok::Word(w) => prev_key = Some(w),
                Tok::Str(s) => {
                    if depth == 0 && prev_key == Some("op_name") {
                        op_name = Some(s.replace("\\'", "'").replace("\\\"", "\""));
                    }
                    prev_key = None;
                }
                Tok::Eof => return Err(self.err(&t, "unexpected end of file in metadata")),
                _ => {}
            }
        }
    }
}
