//! Criteo TSV parsing on small inline files, including malformed ones.

use std::path::{Path, PathBuf};

use embers_datasets::{
    BadRecordPolicy, CategoricalMapping, CriteoConfig, CriteoTsvReader, DatasetError,
    DenseTransform, Example,
};

fn line(label: &str, ints: &[&str; 13], cats: &[&str; 26]) -> String {
    let mut fields = vec![label.to_string()];
    fields.extend(ints.iter().map(|s| s.to_string()));
    fields.extend(cats.iter().map(|s| s.to_string()));
    fields.join("\t")
}

fn good_line(label: &str, first_int: &str, first_cat: &str) -> String {
    let mut ints = ["1"; 13];
    ints[0] = first_int;
    let mut cats = ["a"; 26];
    cats[0] = first_cat;
    line(label, &ints, &cats)
}

fn write(dir: &Path, name: &str, lines: &[String]) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, lines.join("\n") + "\n").unwrap();
    path
}

fn read_all(path: &Path, config: CriteoConfig) -> Vec<Example> {
    CriteoTsvReader::open([path], config)
        .unwrap()
        .collect::<Result<Vec<_>, _>>()
        .unwrap()
}

fn first_error(path: &Path) -> DatasetError {
    CriteoTsvReader::open([path], CriteoConfig::default())
        .unwrap()
        .find_map(Result::err)
        .expect("expected an error")
}

#[test]
fn parses_values_missing_fields_and_transforms() {
    let dir = tempfile::tempdir().unwrap();
    let mut ints = ["0"; 13];
    ints[0] = "3";
    ints[1] = "-2";
    ints[2] = ""; // missing → 0
    let mut cats = ["0"; 26];
    cats[0] = "68fd1e64";
    cats[1] = ""; // missing → default id
    cats[25] = "FFFFFFFF";
    let path = write(
        dir.path(),
        "day_0",
        &[line("1", &ints, &cats), good_line("0", "7", "10")],
    );

    let sizes: Vec<u64> = (0..26).map(|f| 1000 + f).collect();
    let config = CriteoConfig {
        categorical: CategoricalMapping::Modulo(sizes.clone()),
        missing_categorical_id: 7,
        ..CriteoConfig::default()
    };
    let examples = read_all(&path, config);
    assert_eq!(examples.len(), 2);
    let e = &examples[0];
    assert_eq!(e.index, 0);
    assert_eq!(e.labels, vec![1.0]);
    assert!((e.dense[0] - 4f32.ln()).abs() < 1e-6, "ln(3+1)");
    assert_eq!(e.dense[1], 0.0, "negative clamped to 0 before log1p");
    assert_eq!(e.dense[2], 0.0, "missing dense is 0");
    assert_eq!(e.ids.len(), 26);
    assert_eq!(e.lengths, vec![1; 26]);
    assert_eq!(e.ids[0], (0x68fd1e64u64 % 1000) as i64);
    assert_eq!(e.ids[1], 7, "missing categorical → configured id");
    assert_eq!(e.ids[25], (0xFFFF_FFFFu64 % 1025) as i64);
    assert_eq!(examples[1].index, 1);
    assert_eq!(examples[1].labels, vec![0.0]);
    assert_eq!(examples[1].ids[0], 0x10, "0x10 < 1000 is kept");

    let torchrec = CriteoConfig {
        dense_transform: DenseTransform::TorchRecLogPlus3,
        categorical: CategoricalMapping::Raw,
        ..CriteoConfig::default()
    };
    let raw = read_all(&path, torchrec);
    assert!((raw[0].dense[0] - 6f32.ln()).abs() < 1e-6, "ln(3+3)");
    assert_eq!(raw[0].dense[1], 0.0, "ln(-2+3) = 0");
    assert!(
        (raw[0].dense[2] - 3f32.ln()).abs() < 1e-6,
        "missing → ln(0+3)"
    );
    assert_eq!(raw[0].ids[0], 0x68fd1e64);
    assert_eq!(raw[0].ids[25], 0xFFFF_FFFF);
    assert_eq!(raw[0].ids[1], 0);
}

#[test]
fn hash_mapping_stays_in_range_and_is_deterministic() {
    let dir = tempfile::tempdir().unwrap();
    let lines: Vec<String> = (0..50)
        .map(|i| good_line("0", "1", &format!("{:x}", i * 7919)))
        .collect();
    let path = write(dir.path(), "d", &lines);
    let config = CriteoConfig {
        categorical: CategoricalMapping::Hash(vec![13; 26]),
        ..CriteoConfig::default()
    };
    let a = read_all(&path, config.clone());
    let b = read_all(&path, config);
    assert_eq!(a, b);
    assert!(a
        .iter()
        .all(|e| e.ids.iter().all(|&id| (0..13).contains(&id))));
    let distinct: std::collections::HashSet<i64> = a.iter().map(|e| e.ids[0]).collect();
    assert!(distinct.len() > 5, "hash spreads ids: {distinct:?}");
}

#[test]
fn wrong_field_count_names_file_line() {
    let dir = tempfile::tempdir().unwrap();
    let short = good_line("1", "1", "a")
        .rsplit_once('\t')
        .unwrap()
        .0
        .to_string();
    let path = write(
        dir.path(),
        "bad_count.tsv",
        &[good_line("1", "1", "a"), short],
    );
    let error = first_error(&path);
    match &error {
        DatasetError::Malformed {
            path: p,
            line,
            field,
            message,
        } => {
            assert_eq!(p, &path);
            assert_eq!(*line, 2);
            assert_eq!(field, "line");
            assert!(
                message.contains("expected 40") && message.contains("found 39"),
                "{message}"
            );
        }
        other => panic!("unexpected {other:?}"),
    }
    let text = error.to_string();
    assert!(text.contains("bad_count.tsv:2"), "{text}");
}

#[test]
fn non_hex_id_names_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let mut cats = ["a"; 26];
    cats[4] = "zz9";
    let path = write(dir.path(), "bad_hex.tsv", &[line("0", &["1"; 13], &cats)]);
    let text = first_error(&path).to_string();
    assert!(text.contains("bad_hex.tsv:1"), "{text}");
    assert!(text.contains("`cat_4`"), "{text}");
    assert!(text.contains("zz9"), "{text}");
}

#[test]
fn non_integer_dense_names_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let mut ints = ["1"; 13];
    ints[12] = "3.5";
    let path = write(
        dir.path(),
        "bad_int.tsv",
        &[
            good_line("0", "1", "a"),
            good_line("1", "2", "b"),
            line("0", &ints, &["a"; 26]),
        ],
    );
    match first_error(&path) {
        DatasetError::Malformed {
            line,
            field,
            message,
            ..
        } => {
            assert_eq!(line, 3);
            assert_eq!(field, "int_12");
            assert!(message.contains("3.5"), "{message}");
        }
        other => panic!("unexpected {other:?}"),
    }
}

#[test]
fn bad_label_and_overlong_hex_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "bad_label.tsv", &[good_line("2", "1", "a")]);
    assert!(first_error(&path).to_string().contains("`label`"));
    let path = write(
        dir.path(),
        "long_hex.tsv",
        &[good_line("1", "1", "12345678901234567")],
    );
    assert!(first_error(&path).to_string().contains("`cat_0`"));
    // An integer past i64 says so (it read "expected an integer").
    let path = write(
        dir.path(),
        "huge_int.tsv",
        &[good_line("1", "99999999999999999999", "a")],
    );
    let err = first_error(&path).to_string();
    assert!(
        err.contains("`int_0`") && err.contains("within ±2^63"),
        "{err}"
    );
}

#[test]
fn skip_and_count_mode_keeps_indices_of_good_lines() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(
        dir.path(),
        "mixed.tsv",
        &[
            good_line("1", "1", "a"),
            "garbage".to_string(),
            good_line("0", "x", "a"),
            good_line("0", "5", "b"),
        ],
    );
    let config = CriteoConfig {
        bad_records: BadRecordPolicy::SkipAndCount,
        ..CriteoConfig::default()
    };
    let reader = CriteoTsvReader::open([&path], config).unwrap();
    let skipped = reader.skipped();
    let examples: Vec<Example> = reader.map(Result::unwrap).collect();
    assert_eq!(examples.len(), 2);
    assert_eq!(examples[0].index, 0);
    assert_eq!(examples[1].index, 3, "skipped lines still consume an index");
    assert_eq!(skipped.count(), 2);
    let first = skipped.first_error().unwrap();
    assert!(first.contains("mixed.tsv:2"), "{first}");
}

#[test]
fn several_files_crlf_and_missing_file() {
    let dir = tempfile::tempdir().unwrap();
    let a = write(dir.path(), "a", &[good_line("1", "1", "a")]);
    let b = dir.path().join("b");
    std::fs::write(
        &b,
        format!(
            "{}\r\n{}\r\n",
            good_line("0", "2", "b"),
            good_line("1", "3", "c")
        ),
    )
    .unwrap();
    let examples: Vec<Example> = CriteoTsvReader::open([&a, &b], CriteoConfig::default())
        .unwrap()
        .map(Result::unwrap)
        .collect();
    assert_eq!(
        examples.iter().map(|e| e.index).collect::<Vec<_>>(),
        vec![0, 1, 2]
    );
    assert_eq!(examples[2].labels, vec![1.0]);

    let missing = dir.path().join("nope.tsv");
    let error = CriteoTsvReader::open([&missing], CriteoConfig::default())
        .unwrap()
        .next()
        .unwrap()
        .unwrap_err();
    assert!(matches!(error, DatasetError::Io { .. }));
    assert!(error.to_string().contains("nope.tsv"));
}

#[test]
fn test_set_without_label_and_config_validation() {
    let dir = tempfile::tempdir().unwrap();
    let no_label = good_line("1", "1", "a")
        .split_once('\t')
        .unwrap()
        .1
        .to_string();
    let path = write(dir.path(), "test.txt", &[no_label]);
    let config = CriteoConfig {
        has_label: false,
        ..CriteoConfig::default()
    };
    let examples = read_all(&path, config);
    assert_eq!(examples[0].labels, vec![0.0]);

    let bad = CriteoConfig {
        categorical: CategoricalMapping::Modulo(vec![10; 25]),
        ..CriteoConfig::default()
    };
    assert!(matches!(
        CriteoTsvReader::open([&path], bad),
        Err(DatasetError::InvalidConfig(_))
    ));
    let bad_missing = CriteoConfig {
        categorical: CategoricalMapping::Modulo(vec![10; 26]),
        missing_categorical_id: 10,
        ..CriteoConfig::default()
    };
    assert!(CriteoTsvReader::open([&path], bad_missing).is_err());
}

/// A file with no line end in its first 16 MiB (CR line ends, or not text at all) is a named
/// error at line 1, not one line read into memory as big as the file.
#[test]
fn a_line_past_16_mib_is_an_error_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let cr_only: String = (0..400_000)
        .map(|i| good_line("0", &i.to_string(), "68fd1e64") + "\r")
        .collect();
    assert!(cr_only.len() > 16 << 20);
    let path = dir.path().join("cr.tsv");
    std::fs::write(&path, cr_only).unwrap();
    match first_error(&path) {
        DatasetError::Malformed {
            line,
            field,
            message,
            ..
        } => {
            assert_eq!((line, field.as_str()), (1, "line"));
            assert!(message.contains("longer than 16777216 bytes"), "{message}");
        }
        other => panic!("unexpected {other:?}"),
    }
}

#[test]
fn an_empty_day_file_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let good = write(dir.path(), "day_0", &[good_line("1", "5", "a")]);
    let empty = dir.path().join("day_1");
    std::fs::write(&empty, b"").unwrap();
    let results: Vec<_> = CriteoTsvReader::open([&good, &empty], CriteoConfig::default())
        .unwrap()
        .collect();
    assert_eq!(results.len(), 2);
    assert!(results[0].is_ok());
    let error = results[1].as_ref().unwrap_err().to_string();
    assert!(
        error.contains("day_1") && error.contains("empty (0 bytes)"),
        "{error}"
    );
}
