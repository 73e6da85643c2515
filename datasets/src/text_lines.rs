//! Line-by-line reading of one or more text files as bytes, tracking file and line number.

use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};

use crate::{BadRecordPolicy, DatasetError, Example, Result, SkippedRecords};

/// The longest line read (bytes, its end included): records are lines of at most a few
/// kilobytes.
pub(crate) const MAX_LINE_BYTES: usize = 16 << 20;

/// Reads lines from a sequence of files without requiring UTF-8 (MovieLens item files are
/// Latin-1) and without allocating per line.
pub(crate) struct TextLines {
    paths: Vec<PathBuf>,
    next_file: usize,
    current: Option<(PathBuf, BufReader<File>)>,
    line_number: u64,
    buffer: Vec<u8>,
}

impl TextLines {
    pub(crate) fn new(paths: Vec<PathBuf>) -> Self {
        TextLines {
            paths,
            next_file: 0,
            current: None,
            line_number: 0,
            buffer: Vec::with_capacity(1024),
        }
    }

    /// Moves to the next line of the next non-exhausted file; `Ok(false)` after the last one.
    pub(crate) fn advance(&mut self) -> Result<bool> {
        loop {
            if self.current.is_none() {
                let Some(path) = self.paths.get(self.next_file).cloned() else {
                    return Ok(false);
                };
                self.next_file += 1;
                let file = File::open(&path).map_err(|source| DatasetError::Io {
                    path: path.clone(),
                    source,
                })?;
                // Large buffer: Criteo days are tens of GB and read strictly sequentially.
                self.current = Some((path, BufReader::with_capacity(1 << 20, file)));
                self.line_number = 0;
            }
            let Some((path, reader)) = self.current.as_mut() else {
                continue;
            };
            self.buffer.clear();
            // Bounded: a file with no `\n` (CR line ends, or not text) was read whole into
            // one line, as big as the file.
            let read = (reader.by_ref().take(MAX_LINE_BYTES as u64 + 1))
                .read_until(b'\n', &mut self.buffer)
                .map_err(|source| DatasetError::Io {
                    path: path.clone(),
                    source,
                })?;
            if read == 0 {
                // A file of no bytes at all is a truncated copy or a wrong path, not a day of
                // no records: say so rather than read nothing from it.
                if self.line_number == 0 {
                    return Err(DatasetError::Malformed {
                        path: path.clone(),
                        line: 0,
                        field: "file".to_string(),
                        message: "the file is empty (0 bytes)".to_string(),
                    });
                }
                self.current = None;
                continue;
            }
            self.line_number += 1;
            if read > MAX_LINE_BYTES && self.buffer.last() != Some(&b'\n') {
                return Err(DatasetError::Malformed {
                    path: path.clone(),
                    line: self.line_number,
                    field: "line".to_string(),
                    message: format!(
                        "longer than {MAX_LINE_BYTES} bytes without a line end (`\\n`)"
                    ),
                });
            }
            while matches!(self.buffer.last(), Some(b'\n' | b'\r')) {
                self.buffer.pop();
            }
            return Ok(true);
        }
    }

    /// The current line without its terminator.
    pub(crate) fn line(&self) -> &[u8] {
        &self.buffer
    }

    /// 1-based number of the current line in the current file.
    pub(crate) fn line_number(&self) -> u64 {
        self.line_number
    }

    /// The file the current line came from.
    pub(crate) fn path(&self) -> &Path {
        self.current
            .as_ref()
            .map_or_else(|| Path::new(""), |(path, _)| path.as_path())
    }
}

/// A line-based reader's walk through its files: one example per line (empty lines skipped
/// when asked), numbered in order; a record that fails to parse goes through the bad-record
/// policy; the end of the input or an error ends the iteration.
pub(crate) struct LineRecords {
    lines: TextLines,
    policy: BadRecordPolicy,
    skipped: SkippedRecords,
    skip_empty: bool,
    next_index: u64,
    done: bool,
}

impl LineRecords {
    pub(crate) fn new(lines: TextLines, policy: BadRecordPolicy, skip_empty: bool) -> Self {
        LineRecords {
            lines,
            policy,
            skipped: SkippedRecords::default(),
            skip_empty,
            next_index: 0,
            done: false,
        }
    }

    /// Handle on the count of skipped records.
    pub(crate) fn skipped(&self) -> SkippedRecords {
        self.skipped.clone()
    }

    /// The next example: the next line parsed by `parse(lines, index)`.
    pub(crate) fn next_example(
        &mut self,
        parse: impl Fn(&TextLines, u64) -> Result<Example>,
    ) -> Option<Result<Example>> {
        while !self.done {
            match self.lines.advance() {
                Ok(true) => {}
                Ok(false) => {
                    self.done = true;
                    return None;
                }
                Err(error) => {
                    self.done = true;
                    return Some(Err(error));
                }
            }
            if self.skip_empty && self.lines.line().is_empty() {
                continue;
            }
            let index = self.next_index;
            self.next_index += 1;
            match parse(&self.lines, index) {
                Ok(example) => return Some(Ok(example)),
                Err(error) => {
                    if let Err(error) = self.policy.apply(1, error, &self.skipped) {
                        self.done = true;
                        return Some(Err(error));
                    }
                }
            }
        }
        None
    }
}

/// Splits `line` on `separator` into `fields`, returning the number of fields seen (which may
/// exceed `fields.len()`; extra fields are counted, not stored).
pub(crate) fn split_fields<'a>(line: &'a [u8], separator: &[u8], fields: &mut [&'a [u8]]) -> usize {
    let mut count = 0;
    let mut rest = line;
    loop {
        let position = find(rest, separator);
        let (field, tail) = match position {
            Some(p) => (&rest[..p], Some(&rest[p + separator.len()..])),
            None => (rest, None),
        };
        if count < fields.len() {
            fields[count] = field;
        }
        count += 1;
        match tail {
            Some(tail) => rest = tail,
            None => return count,
        }
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    if needle.len() == 1 {
        return haystack.iter().position(|&b| b == needle[0]);
    }
    haystack.windows(needle.len()).position(|w| w == needle)
}
