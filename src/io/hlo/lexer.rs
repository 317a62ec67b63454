//! Tokens of HLO text.
//!
//! HLO text is a sequence of words (names, opcodes, numbers, element types,
//! anything that is not punctuation), quoted strings, and the punctuation
//! `{ } ( ) [ ] , = :`. Comments `/* ... */` (XLA prints `/*index=5*/` in
//! long tuples) are skipped wherever they appear. Each token records its line
//! and column, and whether it starts a line: an instruction is one line, so
//! a token at the start of a line ends whatever value came before it.

use super::HloError;

/// What a token is.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Tok<'a> {
    /// A run of characters that are not punctuation, quotes or spaces.
    Word(&'a str),
    /// A quoted string, without its quotes (escapes left as written).
    Str(&'a str),
    /// One of `{ } ( ) [ ] , = :`.
    Punct(u8),
    /// The end of the text.
    Eof,
}

/// A token and where it is.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Token<'a> {
    pub tok: Tok<'a>,
    pub line: u32,
    pub col: u32,
    /// The first token of its line.
    pub line_start: bool,
}

impl Token<'_> {
    /// The token as the user wrote it, for messages.
    pub fn describe(&self) -> String {
        match self.tok {
            Tok::Word(w) => format!("'{}'", truncate(w)),
            Tok::Str(s) => format!("string \"{}\"", truncate(s)),
            Tok::Punct(c) => format!("'{}'", c as char),
            Tok::Eof => "the end of the file".to_string(),
        }
    }
}

fn truncate(s: &str) -> String {
    if s.chars().count() > 40 {
        let t: String = s.chars().take(40).collect();
        format!("{t}...")
    } else {
        s.to_string()
    }
}

fn is_punct(c: u8) -> bool {
    matches!(
        c,
        b'{' | b'}' | b'(' | b')' | b'[' | b']' | b',' | b'=' | b':'
    )
}

/// An on-demand tokenizer with one token of look-ahead.
pub struct Lexer<'a> {
    text: &'a str,
    pos: usize,
    line: u32,
    line_begin: usize,
    /// Whether a newline was crossed since the last token.
    newline: bool,
    peeked: Option<Token<'a>>,
    /// The last column computed: (byte offset, column), so columns cost
    /// O(1) amortised even on very long lines.
    col_cache: std::cell::Cell<(usize, u32)>,
}

impl<'a> Lexer<'a> {
    pub fn new(text: &'a str) -> Self {
        Lexer {
            text,
            pos: 0,
            line: 1,
            line_begin: 0,
            newline: true,
            peeked: None,
            col_cache: std::cell::Cell::new((0, 1)),
        }
    }

    /// The next token, without consuming it.
    pub fn peek(&mut self) -> Result<Token<'a>, HloError> {
        if let Some(t) = self.peeked {
            return Ok(t);
        }
        let t = self.scan()?;
        self.peeked = Some(t);
        Ok(t)
    }

    /// Consumes and returns the next token.
    pub fn next_token(&mut self) -> Result<Token<'a>, HloError> {
        match self.peeked.take() {
            Some(t) => Ok(t),
            None => self.scan(),
        }
    }

    fn col(&self, at: usize) -> u32 {
        // Columns count characters, not bytes. Offsets only grow, so count
        // from the last computed column when it is on this line.
        let (from, col) = match self.col_cache.get() {
            (p, c) if p >= self.line_begin && p <= at => (p, c),
            _ => (self.line_begin, 1),
        };
        let c = col + self.text[from..at].chars().count() as u32;
        self.col_cache.set((at, c));
        c
    }

    fn err_here(&self, at: usize, msg: impl Into<String>) -> HloError {
        HloError::new(self.line, self.col(at), msg)
    }

    fn scan(&mut self) -> Result<Token<'a>, HloError> {
        let b = self.text.as_bytes();
        loop {
            while self.pos < b.len() && b[self.pos].is_ascii_whitespace() {
                if b[self.pos] == b'\n' {
                    self.line += 1;
                    self.line_begin = self.pos + 1;
                    self.newline = true;
                }
                self.pos += 1;
            }
            if b[self.pos..].starts_with(b"/*") {
                let start = self.pos;
                let (line, col) = (self.line, self.col(start));
                match self.text[start + 2..].find("*/") {
                    Some(end) => {
                        let stop = start + 2 + end + 2;
                        for (i, &c) in b[start..stop].iter().enumerate() {
                            if c == b'\n' {
                                self.line += 1;
                                self.line_begin = start + i + 1;
                                self.newline = true;
                            }
                        }
                        self.pos = stop;
                        continue;
                    }
                    None => {
                        return Err(HloError::new(line, col, "unterminated comment '/*'"));
                    }
                }
            }
            break;
        }
        let line_start = std::mem::replace(&mut self.newline, false);
        let start = self.pos;
        let (line, col) = (self.line, self.col(start));
        let mk = |tok| Token {
            tok,
            line,
            col,
            line_start,
        };
        if start >= b.len() {
            return Ok(mk(Tok::Eof));
        }
        let c = b[start];
        if is_punct(c) {
            self.pos += 1;
            return Ok(mk(Tok::Punct(c)));
        }
        if c == b'"' {
            let mut i = start + 1;
            while i < b.len() {
                match b[i] {
                    b'\\' => i += 2,
                    b'"' => {
                        self.pos = i + 1;
                        return Ok(mk(Tok::Str(&self.text[start + 1..i])));
                    }
                    b'\n' => {
                        self.line += 1;
                        self.line_begin = i + 1;
                        i += 1;
                    }
                    _ => i += 1,
                }
            }
            return Err(HloError::new(line, col, "unterminated string"));
        }
        let mut i = start;
        while i < b.len()
            && !b[i].is_ascii_whitespace()
            && !is_punct(b[i])
            && b[i] != b'"'
            && !b[i..].starts_with(b"/*")
        {
            i += 1;
        }
        // `i > start` always: the first byte is none of the stop bytes. A
        // word never ends inside a UTF-8 sequence, since every stop byte is
        // ASCII.
        if i == start {
            return Err(self.err_here(start, "unexpected character"));
        }
        self.pos = i;
        Ok(mk(Tok::Word(&self.text[start..i])))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn toks(s: &str) -> Vec<Tok<'_>> {
        let mut l = Lexer::new(s);
        let mut out = Vec::new();
        loop {
            let t = l.next_token().unwrap();
            if t.tok == Tok::Eof {
                return out;
            }
            out.push(t.tok);
        }
    }

    #[test]
    fn words_punctuation_strings_comments() {
        use Tok::*;
        assert_eq!(
            toks("%a = f32[2,<=3]{1,0} add(%x, /*index=5*/%y), m={n=\"q\\\"}\"}"),
            vec![
                Word("%a"),
                Punct(b'='),
                Word("f32"),
                Punct(b'['),
                Word("2"),
                Punct(b','),
                Word("<"),
                Punct(b'='),
                Word("3"),
                Punct(b']'),
                Punct(b'{'),
                Word("1"),
                Punct(b','),
                Word("0"),
                Punct(b'}'),
                Word("add"),
                Punct(b'('),
                Word("%x"),
                Punct(b','),
                Word("%y"),
                Punct(b')'),
                Punct(b','),
                Word("m"),
                Punct(b'='),
                Punct(b'{'),
                Word("n"),
                Punct(b'='),
                Str("q\\\"}"),
                Punct(b'}'),
            ]
        );
    }

    #[test]
    fn tracks_lines_and_line_starts() {
        let mut l = Lexer::new("a b\n  c /* x\n y */ d\n×e");
        let a = l.next_token().unwrap();
        let b = l.next_token().unwrap();
        let c = l.next_token().unwrap();
        let d = l.next_token().unwrap();
        let e = l.next_token().unwrap();
        assert!(a.line_start && !b.line_start && c.line_start && d.line_start);
        assert_eq!((c.line, c.col), (2, 3));
        assert_eq!((d.line, d.col), (3, 7));
        assert_eq!(e.tok, Tok::Word("×e"));
        assert_eq!(e.line, 4);
    }

    #[test]
    fn unterminated_things_are_errors() {
        assert!(Lexer::new("\"abc").next_token().is_err());
        assert!(Lexer::new("  /* abc").next_token().is_err());
    }
}
