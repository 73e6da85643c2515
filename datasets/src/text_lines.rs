//! Line-by-line reading of one or more text files as bytes, tracking file and line number.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};

use crate::{DatasetError, Result};

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
            let read = reader
                .read_until(b'\n', &mut self.buffer)
                .map_err(|source| DatasetError::Io {
                    path: path.clone(),
                    source,
                })?;
            if read == 0 {
                self.current = None;
                continue;
            }
            self.line_number += 1;
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
