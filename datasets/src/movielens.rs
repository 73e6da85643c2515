//! MovieLens ratings as click data: users, items and genres as sparse features.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use crate::criteo_tsv::parse_i64;
use crate::error::show_field;
use crate::hashing::fnv1a64;
use crate::text_lines::{split_fields, LineRecords, TextLines};
use crate::{
    BadRecordPolicy, DatasetError, Example, ExampleSource, FeatureSchema, Result, SkippedRecords,
};

/// The MovieLens genre vocabulary in ml-100k's `u.item` flag order; a genre's id is its index.
/// ml-1m's `movies.dat` and RecBole's `.item` use the same names (matched case-insensitively).
pub const MOVIELENS_GENRES: [&str; 19] = [
    "unknown",
    "Action",
    "Adventure",
    "Animation",
    "Children's",
    "Comedy",
    "Crime",
    "Documentary",
    "Drama",
    "Fantasy",
    "Film-Noir",
    "Horror",
    "Musical",
    "Mystery",
    "Romance",
    "Sci-Fi",
    "Thriller",
    "War",
    "Western",
];

/// Layout of the ratings file (and of the matching items file).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MovieLensFormat {
    /// ml-100k `u.data`: `user \t item \t rating \t timestamp`; items file `u.item`
    /// (`|`-separated, 19 genre flags at the end).
    Ml100k,
    /// ml-1m `ratings.dat`: `user::item::rating::timestamp`; items file `movies.dat`
    /// (`id::title::Genre1|Genre2`).
    Ml1m,
    /// RecBole atomic files: `.inter` TSV with a typed header (`user_id:token`, `item_id:token`,
    /// `rating:float`, optional `timestamp:float`, any order, extra columns ignored); items file
    /// `.item` with `item_id:token` and `class:token_seq` (space-separated genres).
    RecBoleInter,
}

/// Options of [`MovieLensReader`].
#[derive(Debug, Clone, PartialEq)]
pub struct MovieLensConfig {
    /// Layout of the files.
    pub format: MovieLensFormat,
    /// The ratings (interactions) file.
    pub ratings_path: PathBuf,
    /// Optional items file; when given, a multi-hot `genres` feature is added.
    pub items_path: Option<PathBuf>,
    /// A rating ≥ this is a click (label 1). Default 4.
    pub click_threshold: f32,
    /// Rows of the user table: ids are reduced modulo this when set, else kept raw.
    pub user_table_size: Option<u64>,
    /// Rows of the item table: ids are reduced modulo this when set, else kept raw.
    pub item_table_size: Option<u64>,
    /// What to do with malformed lines of the ratings file (the items file must be clean).
    pub bad_records: BadRecordPolicy,
}

impl MovieLensConfig {
    /// Defaults for `format` reading `ratings_path`, no items file.
    pub fn new(format: MovieLensFormat, ratings_path: impl Into<PathBuf>) -> Self {
        MovieLensConfig {
            format,
            ratings_path: ratings_path.into(),
            items_path: None,
            click_threshold: 4.0,
            user_table_size: None,
            item_table_size: None,
            bad_records: BadRecordPolicy::Fail,
        }
    }
}

/// Seconds from the Unix epoch to 1995-01-01 (just before the earliest MovieLens rating).
const EPOCH_1995: f64 = 788_918_400.0;
const SECONDS_PER_DECADE: f64 = 10.0 * 365.25 * 86_400.0;

/// Column positions in a RecBole `.inter` header.
#[derive(Debug, Clone, Copy)]
struct InterColumns {
    user: usize,
    item: usize,
    rating: usize,
    timestamp: Option<usize>,
    count: usize,
}

/// Streams MovieLens ratings as click examples.
///
/// Sparse features: `user_id`, `item_id` (one id each) and, with an items file, `genres`
/// (multi-hot; an item missing from the items file has no genres, a zero-length bag).
/// Dense features (3), all derived from the timestamp, since the rating is the label:
/// `time_decades_since_1995` = (t − 1995-01-01) / 10 years, `hour_of_day` = UTC hour / 24,
/// `day_of_week` = (Monday = 0) / 7. Without a timestamp column they are 0.
///
/// Ids: a numeric token is used as is; a non-numeric one (possible in RecBole files) is
/// FNV-1a-hashed to a non-negative `i64`; then reduced modulo the table size when one is set.
pub struct MovieLensReader {
    records: LineRecords,
    schema: FeatureSchema,
    ratings: Ratings,
}

/// What parsing a ratings line needs: the config, the items' genres, the RecBole columns.
struct Ratings {
    config: MovieLensConfig,
    genres: Option<HashMap<i64, Vec<i64>>>,
    inter_columns: Option<InterColumns>,
    /// The timestamp (seconds) of the last example parsed.
    last_seconds: std::cell::Cell<Option<f64>>,
}

/// A user or item id: in RecBole's files any token (a non-negative integer as itself, any
/// other token hashed), in MovieLens' own files a non-negative integer (`196 ` or `-1` there
/// is a malformed id, not another user).
fn id_of(raw: &[u8], format: MovieLensFormat) -> std::result::Result<i64, String> {
    if raw.is_empty() {
        return Err("empty".to_string());
    }
    match (parse_i64(raw), format) {
        (Some(value), _) if value >= 0 => Ok(value),
        (_, MovieLensFormat::RecBoleInter) => Ok((fnv1a64(raw) & (i64::MAX as u64)) as i64),
        _ => Err(format!(
            "expected a non-negative integer, found `{}`",
            show_field(raw)
        )),
    }
}

fn genre_id(name: &[u8]) -> Option<i64> {
    let name = String::from_utf8_lossy(name);
    MOVIELENS_GENRES
        .iter()
        .position(|g| g.eq_ignore_ascii_case(name.trim()))
        .map(|p| p as i64)
}

fn parse_f64(raw: &[u8]) -> Option<f64> {
    std::str::from_utf8(raw)
        .ok()?
        .trim()
        .parse::<f64>()
        .ok()
        .filter(|v| v.is_finite())
}

impl MovieLensReader {
    /// Opens the files of `config` (the items file is read fully now: it is small).
    pub fn open(config: MovieLensConfig) -> Result<Self> {
        for (name, size) in [
            ("user_table_size", config.user_table_size),
            ("item_table_size", config.item_table_size),
        ] {
            if size == Some(0) {
                return Err(DatasetError::InvalidConfig(format!("{name} must be ≥ 1")));
            }
        }
        if !config.click_threshold.is_finite() {
            return Err(DatasetError::InvalidConfig(
                "click_threshold must be finite".to_string(),
            ));
        }
        let genres = match &config.items_path {
            Some(path) => Some(read_items(config.format, path)?),
            None => None,
        };
        let mut lines = TextLines::new(vec![config.ratings_path.clone()]);
        let inter_columns = if config.format == MovieLensFormat::RecBoleInter {
            Some(read_inter_header(&mut lines, &config.ratings_path)?)
        } else {
            None
        };
        let mut sparse_keys = vec!["user_id".to_string(), "item_id".to_string()];
        if genres.is_some() {
            sparse_keys.push("genres".to_string());
        }
        let schema = FeatureSchema {
            dense_names: vec![
                "time_decades_since_1995".to_string(),
                "hour_of_day".to_string(),
                "day_of_week".to_string(),
            ],
            sparse_keys,
            tasks: vec!["click".to_string()],
        };
        Ok(MovieLensReader {
            records: LineRecords::new(lines, config.bad_records, true),
            schema,
            ratings: Ratings {
                config,
                genres,
                inter_columns,
                last_seconds: std::cell::Cell::new(None),
            },
        })
    }

    /// Handle on the count of skipped records (stays live after the reader is moved).
    pub fn skipped(&self) -> SkippedRecords {
        self.records.skipped()
    }
}

impl Ratings {
    /// The example on the current line of `lines`.
    fn parse(&self, lines: &TextLines, index: u64) -> Result<Example> {
        let line = lines.line();
        let malformed = |field: &str, message: String| DatasetError::Malformed {
            path: lines.path().to_path_buf(),
            line: lines.line_number(),
            field: field.to_string(),
            message,
        };
        let mut fields: [&[u8]; 16] = [&[]; 16];
        let (user, item, rating, timestamp) = match (self.config.format, self.inter_columns) {
            (MovieLensFormat::RecBoleInter, Some(columns)) => {
                let count = split_fields(line, b"\t", &mut fields);
                if count != columns.count {
                    return Err(malformed(
                        "line",
                        format!(
                            "expected {} tab-separated fields, found {count}",
                            columns.count
                        ),
                    ));
                }
                (
                    fields[columns.user],
                    fields[columns.item],
                    fields[columns.rating],
                    columns.timestamp.map(|c| fields[c]),
                )
            }
            (format, _) => {
                let separator: &[u8] = if format == MovieLensFormat::Ml1m {
                    b"::"
                } else {
                    b"\t"
                };
                let count = split_fields(line, separator, &mut fields);
                if count != 4 {
                    return Err(malformed(
                        "line",
                        format!(
                            "expected 4 `{}`-separated fields (user, item, rating, timestamp), found {count}",
                            String::from_utf8_lossy(separator).escape_default()
                        ),
                    ));
                }
                (fields[0], fields[1], fields[2], Some(fields[3]))
            }
        };
        let format = self.config.format;
        let user = id_of(user, format).map_err(|m| malformed("user_id", m))?;
        let item = id_of(item, format).map_err(|m| malformed("item_id", m))?;
        let rating = parse_f64(rating).ok_or_else(|| {
            malformed(
                "rating",
                format!("expected a number, found `{}`", show_field(rating)),
            )
        })?;
        let seconds = match timestamp {
            None => None,
            Some(raw) => Some(parse_f64(raw).ok_or_else(|| {
                malformed(
                    "timestamp",
                    format!("expected a number, found `{}`", show_field(raw)),
                )
            })?),
        };
        self.last_seconds.set(seconds);
        let dense = match seconds {
            None => vec![0.0; 3],
            Some(t) => {
                // Whole seconds are exact in f64 up to 2^53: past that the hour and weekday
                // come out of rounding, not the clock.
                if t.abs() > MAX_EXACT_SECONDS {
                    return Err(malformed(
                        "timestamp",
                        format!("{t} s is past ±2^53 s, where seconds are no longer exact"),
                    ));
                }
                let days = (t / 86_400.0).floor();
                let hour = ((t - days * 86_400.0) / 3600.0).floor();
                // 1970-01-01 was a Thursday (Monday = 0 → Thursday = 3).
                let weekday = (days + 3.0).rem_euclid(7.0);
                let dense = vec![
                    ((t - EPOCH_1995) / SECONDS_PER_DECADE) as f32,
                    (hour / 24.0) as f32,
                    (weekday / 7.0) as f32,
                ];
                if dense.iter().any(|x| !x.is_finite()) {
                    return Err(malformed(
                        "timestamp",
                        format!("{t} s is past the features' f32 range"),
                    ));
                }
                dense
            }
        };
        let reduce = |id: i64, size: Option<u64>| match size {
            Some(size) => (id as u64 % size) as i64,
            None => id,
        };
        let mut ids = vec![
            reduce(user, self.config.user_table_size),
            reduce(item, self.config.item_table_size),
        ];
        let mut lengths = vec![1, 1];
        if let Some(genres) = &self.genres {
            let item_genres = genres.get(&item).map_or(&[][..], Vec::as_slice);
            ids.extend_from_slice(item_genres);
            lengths.push(item_genres.len() as i32);
        }
        if !(rating as f32).is_finite() {
            return Err(malformed(
                "rating",
                format!("{rating:e} is past f32's range"),
            ));
        }
        let label = if rating as f32 >= self.config.click_threshold {
            1.0
        } else {
            0.0
        };
        Ok(Example {
            index,
            dense,
            ids,
            lengths,
            labels: vec![label],
            true_probability: None,
        })
    }
}

fn read_inter_header(lines: &mut TextLines, path: &Path) -> Result<InterColumns> {
    let malformed = |line: u64, field: &str, message: String| DatasetError::Malformed {
        path: path.to_path_buf(),
        line,
        field: field.to_string(),
        message,
    };
    if !lines.advance()? {
        return Err(malformed(1, "header", "file is empty".to_string()));
    }
    let mut fields: [&[u8]; 16] = [&[]; 16];
    let count = split_fields(lines.line(), b"\t", &mut fields);
    if count > fields.len() {
        return Err(malformed(
            1,
            "header",
            format!("{count} columns, at most 16 supported"),
        ));
    }
    let find = |name: &str| {
        fields[..count].iter().position(|f| {
            let column = f.split(|&b| b == b':').next().unwrap_or(&[]);
            column == name.as_bytes()
        })
    };
    let required = |name: &str| {
        find(name).ok_or_else(|| {
            malformed(
                1,
                name,
                format!(
                    "column missing from header `{}`",
                    String::from_utf8_lossy(lines.line())
                ),
            )
        })
    };
    Ok(InterColumns {
        user: required("user_id")?,
        item: required("item_id")?,
        rating: required("rating")?,
        timestamp: find("timestamp"),
        count,
    })
}

/// Timestamps are taken within ±2^53 s, where whole seconds are exact in f64.
const MAX_EXACT_SECONDS: f64 = 9_007_199_254_740_992.0;

/// Reads an items file into item id → genre ids.
fn read_items(format: MovieLensFormat, path: &Path) -> Result<HashMap<i64, Vec<i64>>> {
    let mut lines = TextLines::new(vec![path.to_path_buf()]);
    let mut genres = HashMap::new();
    let malformed = |line: u64, field: &str, message: String| DatasetError::Malformed {
        path: path.to_path_buf(),
        line,
        field: field.to_string(),
        message,
    };
    let mut recbole_columns = None;
    while lines.advance()? {
        let line_number = lines.line_number();
        let line = lines.line();
        if line.is_empty() {
            continue;
        }
        let mut fields: [&[u8]; 32] = [&[]; 32];
        let (item, item_genres) = match format {
            MovieLensFormat::Ml100k => {
                let count = split_fields(line, b"|", &mut fields);
                if count != 5 + 19 {
                    return Err(malformed(
                        line_number,
                        "line",
                        format!("expected 24 `|`-separated fields, found {count}"),
                    ));
                }
                let mut ids = Vec::new();
                for (genre, flag) in fields[5..24].iter().enumerate() {
                    match *flag {
                        b"1" => ids.push(genre as i64),
                        b"0" => {}
                        other => {
                            return Err(malformed(
                                line_number,
                                MOVIELENS_GENRES[genre],
                                format!("expected a 0/1 genre flag, found `{}`", show_field(other)),
                            ))
                        }
                    }
                }
                (fields[0], ids)
            }
            MovieLensFormat::Ml1m => {
                let count = split_fields(line, b"::", &mut fields);
                if count != 3 {
                    return Err(malformed(
                        line_number,
                        "line",
                        format!("expected 3 `::`-separated fields, found {count}"),
                    ));
                }
                let ids = parse_genre_list(fields[2], b'|')
                    .map_err(|m| malformed(line_number, "genres", m))?;
                (fields[0], ids)
            }
            MovieLensFormat::RecBoleInter => {
                let count = split_fields(line, b"\t", &mut fields);
                let Some((item_column, class_column, width)) = recbole_columns else {
                    let position = |name: &[u8]| {
                        fields[..count.min(fields.len())]
                            .iter()
                            .position(|f| f.split(|&b| b == b':').next() == Some(name))
                    };
                    // RecBole's ml-100k names the genres `class`, its ml-1m and larger `genre`.
                    let genres = position(b"class").or_else(|| position(b"genre"));
                    match (position(b"item_id"), genres) {
                        (Some(item), Some(class)) => recbole_columns = Some((item, class, count)),
                        _ => {
                            return Err(malformed(
                                line_number,
                                "header",
                                "RecBole items header needs `item_id` and `class` (or `genre`) \
                                 columns"
                                    .to_string(),
                            ))
                        }
                    }
                    continue;
                };
                if count != width {
                    return Err(malformed(
                        line_number,
                        "line",
                        format!("expected {width} tab-separated fields, found {count}"),
                    ));
                }
                let ids = parse_genre_list(fields[class_column], b' ')
                    .map_err(|m| malformed(line_number, "class", m))?;
                (fields[item_column], ids)
            }
        };
        let item = id_of(item, format).map_err(|m| malformed(line_number, "item_id", m))?;
        genres.insert(item, item_genres);
    }
    Ok(genres)
}

fn parse_genre_list(raw: &[u8], separator: u8) -> std::result::Result<Vec<i64>, String> {
    raw.split(|&b| b == separator)
        .filter(|name| !name.is_empty())
        .map(|name| genre_id(name).ok_or_else(|| format!("unknown genre `{}`", show_field(name))))
        .collect()
}

impl MovieLensReader {
    /// The timestamp (seconds since 1970) of the example [`next`](Iterator::next) returned
    /// last; `None` where the ratings file has no timestamp column (or before the first).
    pub fn last_timestamp(&self) -> Option<f64> {
        self.ratings.last_seconds.get()
    }
}

impl Iterator for MovieLensReader {
    type Item = Result<Example>;

    fn next(&mut self) -> Option<Self::Item> {
        let ratings = &self.ratings;
        (self.records).next_example(|lines, index| ratings.parse(lines, index))
    }
}

impl ExampleSource for MovieLensReader {
    fn schema(&self) -> &FeatureSchema {
        &self.schema
    }

    fn indices_ascend(&self) -> bool {
        true
    }
}
