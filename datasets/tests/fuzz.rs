//! Every file reader of the datasets crate fuzzed (`tests/support/fuzz.rs`): Criteo TSV (failing
//! on and skipping bad lines), Criteo Parquet, MovieLens ml-100k, ml-1m and RecBole files
//! (ratings and items). No input may panic, hang or allocate without bound; every error must
//! name the file it came from.

#[path = "../../tests/support/fuzz.rs"]
mod fuzz;
#[path = "support/parquet_file.rs"]
mod parquet_file;

use embers_datasets::{
    BadRecordPolicy, CriteoConfig, CriteoParquetReader, CriteoTsvReader, MovieLensConfig,
    MovieLensFormat, MovieLensReader,
};
use std::path::{Path, PathBuf};

#[global_allocator]
static ALLOC: fuzz::CountingAlloc = fuzz::CountingAlloc;

/// Writes `bytes` to `dir/name` and returns the path.
fn put(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

/// Drains `reader` (at most 100,000 records); the first error, which must name `file`.
fn drain<T, E: std::fmt::Display>(
    reader: impl Iterator<Item = Result<T, E>>,
    file: &str,
) -> Result<(), String> {
    for r in reader.take(100_000) {
        if let Err(e) = r {
            let msg = e.to_string();
            assert!(msg.contains(file), "the error does not name {file}: {msg}");
            return Err(msg);
        }
    }
    Ok(())
}

fn criteo_lines(n: usize) -> Vec<u8> {
    let mut s = String::new();
    for r in 0..n {
        s.push_str(&format!("{}", r % 2));
        for j in 0..13 {
            if (r + j) % 5 == 0 {
                s.push('\t');
            } else {
                s.push_str(&format!("\t{}", r * 7 + j));
            }
        }
        for f in 0..26 {
            if (r + f) % 7 == 0 {
                s.push('\t');
            } else {
                s.push_str(&format!(
                    "\t{:08x}",
                    (r * 2_654_435_761 + f * 97) % (1 << 32)
                ));
            }
        }
        s.push('\n');
    }
    s.into_bytes()
}

fn criteo_tsv(policy: BadRecordPolicy, name: &str) {
    let dir = tempfile::tempdir().unwrap();
    let seeds = vec![criteo_lines(1), criteo_lines(4)];
    fuzz::run(name, &seeds, |bytes| {
        let path = put(dir.path(), "day.tsv", bytes);
        let config = CriteoConfig {
            bad_records: policy,
            ..CriteoConfig::default()
        };
        let reader = CriteoTsvReader::open([&path], config).map_err(|e| e.to_string())?;
        drain(reader, "day.tsv")
    });
}

#[test]
fn criteo_tsv_failing_on_bad_lines() {
    criteo_tsv(BadRecordPolicy::Fail, "criteo-tsv");
}

#[test]
fn criteo_tsv_skipping_bad_lines() {
    criteo_tsv(BadRecordPolicy::SkipAndCount, "criteo-tsv-skip");
}

#[test]
fn criteo_parquet() {
    let dir = tempfile::tempdir().unwrap();
    let seed_path = dir.path().join("seed.parquet");
    parquet_file::write_file(&seed_path, 12, 5);
    let seeds = vec![std::fs::read(&seed_path).unwrap()];
    for policy in [BadRecordPolicy::Fail, BadRecordPolicy::SkipAndCount] {
        fuzz::run(&format!("criteo-parquet-{policy:?}"), &seeds, |bytes| {
            let path = put(dir.path(), "part.parquet", bytes);
            let config = CriteoConfig {
                bad_records: policy,
                ..CriteoConfig::default()
            };
            let reader = CriteoParquetReader::open([&path], config)
                .map_err(|e| e.to_string())?
                .with_rows_per_batch(4)
                .map_err(|e| e.to_string())?;
            drain(reader, "part.parquet")
        });
    }
}

/// Fuzzes one MovieLens file (`which`: 0 the ratings, 1 the items) with the other kept valid.
fn movielens(format: MovieLensFormat, names: [&str; 2], files: [&[u8]; 2], which: usize) {
    let dir = tempfile::tempdir().unwrap();
    let label = format!("movielens-{format:?}-{}", names[which]);
    let seeds = vec![files[which].to_vec()];
    fuzz::run(&label, &seeds, |bytes| {
        let mut paths = [PathBuf::new(), PathBuf::new()];
        for k in 0..2 {
            paths[k] = put(
                dir.path(),
                names[k],
                if k == which { bytes } else { files[k] },
            );
        }
        let mut config = MovieLensConfig::new(format, &paths[0]);
        config.items_path = Some(paths[1].clone());
        let reader = match MovieLensReader::open(config) {
            Ok(r) => r,
            Err(e) => {
                let msg = e.to_string();
                assert!(
                    msg.contains(names[0]) || msg.contains(names[1]),
                    "the error names neither file: {msg}"
                );
                return Err(msg);
            }
        };
        drain(reader, names[0])
    });
}

const U_DATA: &[u8] = b"196\t242\t3\t881250949\n186\t302\t4\t891717742\n22\t377\t1\t878887116\n";
const U_ITEM: &[u8] =
    b"242|Kolya (1996)|24-Jan-1997||http://x|0|0|0|0|0|1|0|0|0|0|0|0|0|0|0|0|0|0|0\n\
302|L.A. Confidential (1997)|01-Jan-1997||http://x|0|0|0|0|0|0|1|0|0|0|0|0|0|1|0|0|1|0|0\n\
377|Heavyweights (1994)|01-Jan-1994||http://x|0|0|0|0|1|1|0|0|0|0|0|0|0|0|0|0|0|0|0\n";
const RATINGS_DAT: &[u8] = b"1::1193::5::978300760\n1::661::3::978302109\n2::1193::4::978298413\n";
const MOVIES_DAT: &[u8] = b"1193::One Flew Over the Cuckoo's Nest (1975)::Drama\n\
661::James and the Giant Peach (1996)::Animation|Children's|Musical\n";
const INTER: &[u8] = b"user_id:token\titem_id:token\trating:float\ttimestamp:float\n\
196\t242\t3\t881250949\n186\t302\t4\t891717742\n";
const ITEM: &[u8] = b"item_id:token\tmovie_title:token_seq\trelease_year:token\tclass:token_seq\n\
242\tKolya\t1996\tComedy\n302\tL.A. Confidential\t1997\tCrime Film-Noir Mystery Thriller\n";

#[test]
fn movielens_ml100k() {
    for which in 0..2 {
        movielens(
            MovieLensFormat::Ml100k,
            ["u.data", "u.item"],
            [U_DATA, U_ITEM],
            which,
        );
    }
}

#[test]
fn movielens_ml1m() {
    for which in 0..2 {
        movielens(
            MovieLensFormat::Ml1m,
            ["ratings.dat", "movies.dat"],
            [RATINGS_DAT, MOVIES_DAT],
            which,
        );
    }
}

#[test]
fn movielens_recbole() {
    for which in 0..2 {
        movielens(
            MovieLensFormat::RecBoleInter,
            ["ml.inter", "ml.item"],
            [INTER, ITEM],
            which,
        );
    }
}
