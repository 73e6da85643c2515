//! The DLRM example (the project's main job) as a user runs it, one process: `--resume`
//! continues bit-identically (the data position is skipped, not replayed, on synthetic data and
//! on a Criteo TSV file across an epoch boundary), and an empty training file is an error
//! naming it instead of a model trained on nothing.

#[path = "support/checkpoint_files.rs"]
mod checkpoint_files;

#[path = "support/example_bin.rs"]
mod example_bin;

use checkpoint_files::tensors_of;
use example_bin::text;
use std::path::{Path, PathBuf};
use std::process::Output;

fn run(args: &[&str]) -> Output {
    example_bin::run("dlrm", args)
}

fn scratch(name: &str) -> PathBuf {
    let dir =
        std::env::temp_dir().join(format!("embers-dlrm-example-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Runs `common` straight to `steps`, and again to `half` then resumed to `steps`; the two
/// final checkpoints hold the same tensors, bit for bit.
fn straight_equals_resumed(dir: &Path, common: &[&str], half: u64, steps: u64) {
    let (a, b) = (dir.join("a"), dir.join("b"));
    let (a, b) = (a.to_str().unwrap(), b.to_str().unwrap());
    let go = |extra: &[&str]| {
        let args: Vec<&str> = common.iter().chain(extra).copied().collect();
        let out = run(&args);
        assert!(out.status.success(), "{}", text(&out));
        text(&out)
    };
    let (steps, half) = (steps.to_string(), half.to_string());
    let log = go(&["--steps", &steps, "--out", a]);
    assert!(log.contains(&format!("trained {steps} steps")), "{log}");
    go(&["--steps", &half, "--out", b]);
    let ckpt = format!("{b}/checkpoint.safetensors");
    let log = go(&["--steps", &steps, "--resume", &ckpt, "--out", b]);
    assert!(log.contains(&format!("at step {half}")), "{log}");
    assert!(log.contains(&format!("trained {steps} steps")), "{log}");
    let (x, y) = (
        tensors_of(Path::new(a), "checkpoint"),
        tensors_of(Path::new(b), "checkpoint"),
    );
    assert!(x.len() > 4, "{x:?}");
    assert!(x == y, "the straight and the resumed run differ");
}

/// `n` Criteo TSV lines (label, 13 integer and 26 hashed categorical columns, some empty).
fn write_criteo_tsv(path: &Path, n: usize, seed: u64) {
    let mut x: u64 = 0x2545_f491_4f6c_dd1d ^ seed.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut tsv = String::new();
    for _ in 0..n {
        let label = next() % 4 == 0;
        tsv.push_str(if label { "1" } else { "0" });
        for i in 0..13 {
            tsv.push('\t');
            if next() % 10 != 0 {
                tsv.push_str(&(next() % (10 + 40 * i)).to_string());
            }
        }
        for i in 0..26 {
            tsv.push('\t');
            if next() % 12 != 0 {
                tsv.push_str(&format!("{:08x}", next() % (50 + 997 * i)));
            }
        }
        tsv.push('\n');
    }
    std::fs::write(path, tsv).unwrap();
}

const QUICK: [&str; 6] = [
    "--no-progress",
    "--no-quantized-eval",
    "--validate-every",
    "0",
    "--validation-examples",
    "1000",
];

/// [`QUICK`] on 100k synthetic training examples, `eval` each for validation and test, batches
/// of 256, then `extra`.
fn synthetic<'a>(eval: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let data = [
        "--synthetic-train",
        "100000",
        "--synthetic-eval",
        eval,
        "--batch-size",
        "256",
    ];
    QUICK
        .iter()
        .copied()
        .chain(data)
        .chain(extra.iter().copied())
        .collect()
}

/// Resumed bit-identically; a resume with a flag that chooses the data otherwise (another
/// `--seed` moves examples between the splits) or a model otherwise (another learning rate)
/// is refused naming it, and changes nothing.
#[test]
fn resume_on_synthetic_data_is_bit_identical() {
    let dir = scratch("synthetic");
    let common = synthetic("1000", &[]);
    straight_equals_resumed(&dir, &common, 15, 40);
    let b = dir.join("b");
    let ckpt = b.join("checkpoint.safetensors");
    let before = std::fs::read(&ckpt).unwrap();
    for (extra, says) in [
        (
            ["--seed", "7"],
            "its run had --seed 0; this run has --seed 7",
        ),
        (
            ["--table-cap", "5000"],
            "--table-cap 100000; this run has --table-cap 5000",
        ),
        (["--sparse-lr", "0.5"], "written for another configuration"),
    ] {
        let args: Vec<&str> = (common.iter().copied())
            .chain(["--steps", "50", "--out", b.to_str().unwrap()])
            .chain(["--resume", ckpt.to_str().unwrap()])
            .chain(extra)
            .collect();
        let out = run(&args);
        let log = text(&out);
        assert!(!out.status.success() && log.contains(says), "{log}");
        assert!(
            std::fs::read(&ckpt).unwrap() == before,
            "{extra:?} changed the checkpoint"
        );
    }
    // A checkpoint from before the flags were recorded resumes, warning they went unchecked.
    drop_run_flags(&ckpt);
    let args: Vec<&str> = (common.iter().copied())
        .chain(["--steps", "50", "--out", b.to_str().unwrap()])
        .chain(["--resume", ckpt.to_str().unwrap()])
        .collect();
    let out = run(&args);
    let log = text(&out);
    assert!(out.status.success(), "{log}");
    assert!(
        log.contains("does not record --data, --path") && log.contains("at step 40"),
        "{log}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Rewrites the checkpoint at `path` without its `user.run.*` metadata, as written before
/// the example recorded them (the header keeps its length: spaces pad it).
fn drop_run_flags(path: &Path) {
    let bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let meta = header["__metadata__"].as_object_mut().unwrap();
    let before = meta.len();
    meta.retain(|k, _| !k.starts_with("user.run."));
    assert!(
        meta.len() < before,
        "no run flags recorded in {}",
        path.display()
    );
    let mut json = serde_json::to_vec(&header).unwrap();
    json.resize(n, b' ');
    let out: Vec<u8> = (bytes[..8].iter().chain(&json).chain(&bytes[8 + n..]))
        .copied()
        .collect();
    std::fs::write(path, out).unwrap();
}

/// Flags that would train on nothing or on a split of nothing are errors naming them, before
/// any training: fewer synthetic examples than one batch, a holdout past half, MovieLens
/// given several ratings files (only the first would be read).
#[test]
fn flags_that_leave_nothing_to_train_on_or_would_be_ignored_are_errors() {
    let dir = scratch("bad-flags");
    let out_dir = dir.join("out");
    let out_dir = out_dir.to_str().unwrap();
    let ratings = dir.join("u.data");
    std::fs::write(&ratings, "1\t2\t5\t881250949\n").unwrap();
    let ratings = ratings.to_str().unwrap();
    for (args, says) in [
        (
            vec!["--synthetic-train", "100", "--batch-size", "512"],
            "--synthetic-train 100 is less than one batch of 512",
        ),
        (
            vec!["--holdout", "0.7"],
            "--holdout 0.7 is not a fraction within (0, 0.5)",
        ),
        // Half for validation and half for test: none to train on.
        (
            vec!["--holdout", "0.5"],
            "--holdout 0.5 is not a fraction within (0, 0.5)",
        ),
        // Nothing held out: no example to validate or test on (the metrics were NaN).
        (
            vec!["--data", "movielens", "--path", ratings, "--holdout", "0"],
            "--holdout 0 is not a fraction within (0, 0.5)",
        ),
        // Data without a complete batch is found so in the first epoch, not after reading it
        // again in each of a billion.
        (
            vec![
                "--data",
                "movielens",
                "--path",
                ratings,
                "--epochs",
                "1000000000",
            ],
            "holds no complete batch",
        ),
        (vec!["--holdout", "NaN"], "--holdout NaN"),
        // DCN's shape without DCN, and both quantized-evaluation flags (each was ignored).
        (vec!["--dcn-rank", "8"], "--dcn"),
        (vec!["--dcn-layers", "2"], "--dcn"),
        // (With the base flags' --no-quantized-eval.)
        (vec!["--quantized-eval", "int8"], "cannot be used with"),
        // A load factor outside (0, 1] (with --write-planner-config NaN was written as
        // `null`, which the planner read as its default), a planner input for no rank.
        (
            vec![
                "--placement",
                "fused-uvm-caching",
                "--cache-load-factor",
                "NaN",
            ],
            "--cache-load-factor NaN is not a fraction within (0, 1]",
        ),
        (
            vec![
                "--write-planner-config",
                "p.json",
                "--cache-load-factor",
                "1.5",
            ],
            "--cache-load-factor 1.5 is not a fraction within (0, 1]",
        ),
        (
            vec!["--write-planner-config", "p.json", "--ranks", "0"],
            "--ranks 0",
        ),
        // No example to report on (it reported AUC 0.5 and NE NaN of none).
        (
            vec!["--synthetic-eval", "0", "--steps", "5"],
            "the validation and the test split holds no example: nothing to report",
        ),
        // A plan on a GPU (it trained on the host).
        (
            vec!["--plan", "auto", "--device", "cuda"],
            "--plan runs the sharded model on the host",
        ),
        (
            vec!["--data", "movielens", "--path", ratings, ratings],
            "reads one ratings file, --path gives 2",
        ),
        (
            vec!["--shuffle-buffer", "0"],
            "--shuffle-buffer 0 holds no example",
        ),
        (
            vec!["--early-stop-patience", "2"],
            "--validate-every 0 runs none",
        ),
        // Files without `--data`: the default synthetic source would ignore them.
        (vec!["--path", ratings], "--data is synthetic (the default)"),
        // Flags of the distributed run, the planner config and the caches that nothing here
        // would use (they were ignored).
        (vec!["--comm-precision", "fp16"], "--plan"),
        (vec!["--no-pipeline"], "--plan"),
        (vec!["--ranks", "4"], "--write-planner-config"),
        (
            vec!["--cache-stats-batches", "10"],
            "--write-planner-config",
        ),
        (
            vec!["--cache-dir", out_dir],
            "--cache-dir would do nothing: --placement fused",
        ),
        (
            vec!["--placement", "fused-uvm", "--cache-load-factor", "0.5"],
            "--cache-load-factor would do nothing: --placement fused-uvm",
        ),
        // Flags of another data source (each was ignored), and synthetic rows past the table
        // cap (they were quietly capped: 200000 made tables of 100000 rows).
        (
            vec!["--synthetic-rows", "200000"],
            "--synthetic-rows 200000 is more than --table-cap 100000",
        ),
        (
            vec!["--shuffle-buffer", "10"],
            "--shuffle-buffer applies to file data",
        ),
        (vec!["--holdout", "0.2"], "--holdout applies to file data"),
        (
            vec!["--movielens-split", "time"],
            "--movielens-split applies to --data movielens",
        ),
        (
            vec![
                "--data",
                "criteo-tsv",
                "--path",
                ratings,
                "--synthetic-eval",
                "5",
            ],
            "--synthetic-eval applies to --data synthetic; with --data criteo-tsv",
        ),
        (
            vec![
                "--data",
                "criteo-tsv",
                "--path",
                ratings,
                "--items-path",
                ratings,
            ],
            "--items-path applies to --data movielens",
        ),
        // Sizes past any memory (a petabyte of weights, beyond any address space, too):
        // errors naming the allocation, where the process aborted.
        (
            vec!["--dense-arch", "10000000000000"],
            "out of memory allocating 1040000000000000 bytes",
        ),
        (
            vec!["--batch-size", "18446744073709551615"],
            "is less than one batch of 18446744073709551615",
        ),
        (
            vec!["--train", ratings, "--valid", ratings, "--test", ratings],
            "are for Criteo files",
        ),
    ] {
        let args: Vec<&str> = (QUICK.iter().copied())
            .chain(["--out", out_dir])
            .chain(args)
            .collect();
        let out = run(&args);
        let log = text(&out);
        assert!(
            !out.status.success() && log.contains(says),
            "{args:?}: {log}"
        );
    }
    // A fresh run that fails part way (its data holds no complete batch: found as it trains)
    // leaves no earlier run's report beside what it wrote (they read as its own).
    let stale = ["metrics.csv", "metrics.json", "curves.png"];
    for name in stale {
        std::fs::write(Path::new(out_dir).join(name), "an earlier run's").unwrap();
    }
    let args: Vec<&str> = (QUICK.iter().copied())
        .chain(["--out", out_dir, "--data", "movielens", "--path", ratings])
        .collect();
    let out = run(&args);
    assert!(!out.status.success() && text(&out).contains("holds no complete batch"));
    for name in stale {
        assert!(!Path::new(out_dir).join(name).exists(), "{name} was left");
    }
    // Validating an empty validation split: an error, where it reported AUC 0.5 and NE NaN of
    // no example and early stopping stopped on them.
    let out = run(&[
        "--no-progress",
        "--no-quantized-eval",
        "--synthetic-train",
        "20000",
        "--synthetic-eval",
        "0",
        "--batch-size",
        "256",
        "--validate-every",
        "5",
        "--early-stop-patience",
        "2",
        "--steps",
        "30",
        "--out",
        out_dir,
    ]);
    assert!(
        !out.status.success()
            && text(&out).contains("the validation split holds no example (step 5)"),
        "{}",
        text(&out)
    );
    // `--epochs 0` asks for no training: that is not an empty training set.
    let args: Vec<&str> = (QUICK.iter().copied())
        .chain([
            "--out",
            out_dir,
            "--synthetic-train",
            "2000",
            "--synthetic-eval",
            "1000",
        ])
        .chain(["--epochs", "0"])
        .collect();
    let out = run(&args);
    assert!(out.status.success(), "{}", text(&out));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Several tasks: one logit and one set of metrics each (the report, `metrics.json`), resumed
/// bit-identically; the task flags of another data source are refused.
#[test]
fn several_tasks_on_synthetic_data() {
    let dir = scratch("tasks");
    let common = synthetic("2000", &["--synthetic-tasks", "3"]);
    straight_equals_resumed(&dir, &common, 15, 40);
    let log = text(&run(&common
        .iter()
        .copied()
        .chain(["--steps", "30", "--out", dir.join("c").to_str().unwrap()])
        .collect::<Vec<_>>()));
    for task in ["task1", "task2"] {
        assert!(log.contains(&format!("task {task}: test AUC 0.")), "{log}");
    }
    let json = std::fs::read_to_string(dir.join("c/metrics.json")).unwrap();
    let json: serde_json::Value = serde_json::from_str(&json).unwrap();
    for key in ["auc", "auc/task1", "ne/task2"] {
        let v = json["test"][key].as_f64();
        assert!(v.is_some_and(|v| v > 0.0), "test.{key} = {v:?} in {json}");
    }
    for (flag, value, names) in [
        ("--label-columns", "label,like", "--label-columns"),
        ("--synthetic-tasks", "2", "--synthetic-tasks"),
    ] {
        let data = if flag == "--label-columns" {
            "synthetic"
        } else {
            "movielens"
        };
        let out = run(&["--data", data, flag, value, "--path", "x"]);
        assert!(!out.status.success());
        assert!(text(&out).contains(names), "{}", text(&out));
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A Criteo TSV file (label, 13 integer and 26 hashed categorical columns), shuffled through a
/// buffer: the resumed run skips exactly the batches already trained on, across an epoch.
#[test]
fn resume_on_a_criteo_file_is_bit_identical_across_an_epoch() {
    let dir = scratch("criteo");
    let path = dir.join("day_0.tsv");
    write_criteo_tsv(&path, 4000, 1);
    let p = path.to_str().unwrap();
    let common: Vec<&str> = QUICK
        .iter()
        .copied()
        .chain([
            "--data",
            "criteo-tsv",
            "--path",
            p,
            "--batch-size",
            "128",
            "--epochs",
            "3",
            "--shuffle-buffer",
            "500",
        ])
        .collect();
    // About 25 training batches an epoch: step 30 is inside the second epoch, 60 in the third.
    straight_equals_resumed(&dir, &common, 30, 60);
    // The data file spelled another way is the same file: the resume is accepted.
    let respelled = dir.join(".").join("day_0.tsv");
    let (b, ckpt) = (dir.join("b"), dir.join("b/checkpoint.safetensors"));
    let args: Vec<&str> = (common.iter().copied())
        .map(|a| {
            if a == p {
                respelled.to_str().unwrap()
            } else {
                a
            }
        })
        .chain(["--steps", "61", "--out", b.to_str().unwrap()])
        .chain(["--resume", ckpt.to_str().unwrap()])
        .collect();
    let out = run(&args);
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("at step 60"), "{}", text(&out));
    // Another file, even with the same lines, is another run's data: refused naming --path.
    let other = dir.join("day_1.tsv");
    std::fs::copy(&path, &other).unwrap();
    let args: Vec<&str> = (args.iter().copied())
        .map(|a| {
            if a == respelled.to_str().unwrap() {
                other.to_str().unwrap()
            } else {
                a
            }
        })
        .collect();
    let out = run(&args);
    assert!(!out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("this run has --path"), "{}", text(&out));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn an_empty_training_file_is_an_error_naming_it() {
    let dir = scratch("empty");
    let path = dir.join("empty.tsv");
    std::fs::write(&path, "").unwrap();
    let out_dir = dir.join("out");
    let out = run(&[
        "--data",
        "criteo-tsv",
        "--path",
        path.to_str().unwrap(),
        "--no-progress",
        "--out",
        out_dir.to_str().unwrap(),
    ]);
    let log = text(&out);
    assert!(!out.status.success(), "{log}");
    assert!(
        log.contains("empty.tsv") && log.contains("the file is empty (0 bytes)"),
        "{log}"
    );
    assert!(
        !out_dir.join("checkpoint.safetensors").exists(),
        "a checkpoint was written: {log}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Explicit splits by file (TorchRec's Criteo reference: days 0-22 train, day 23 halved into
/// validation and test): the test report covers exactly the second half of the shared file;
/// incomplete or conflicting split flags are errors.
#[test]
fn explicit_train_valid_test_files() {
    let dir = scratch("splits");
    let days: Vec<PathBuf> = (0..3).map(|d| dir.join(format!("day_{d}.tsv"))).collect();
    for (d, path) in days.iter().enumerate() {
        write_criteo_tsv(path, 1500 + 101 * d, d as u64);
    }
    let day = |d: usize| days[d].to_str().unwrap();
    let out_dir = dir.join("out");
    let mut args: Vec<&str> = QUICK.to_vec();
    args.extend([
        "--data",
        "criteo-tsv",
        "--batch-size",
        "128",
        "--train",
        day(0),
        day(1),
        "--valid",
        day(2),
        "--test",
        day(2),
        "--out",
        out_dir.to_str().unwrap(),
    ]);
    let out = run(&args);
    let log = text(&out);
    assert!(out.status.success(), "{log}");
    // day 2 has 1702 lines: validation 0..851, test 851..1702.
    assert!(log.contains("test (851 examples)"), "{log}");
    // 1500 + 1601 training lines, 128 a batch, the last partial batch dropped: 24 steps.
    assert!(log.contains("trained 24 steps"), "{log}");
    for (extra, needle) in [
        (
            vec!["--train", day(0)],
            "need all of --train, --valid and --test",
        ),
        (
            vec![
                "--path",
                day(0),
                "--train",
                day(0),
                "--valid",
                day(1),
                "--test",
                day(2),
            ],
            "either --path",
        ),
    ] {
        let mut args: Vec<&str> = QUICK.to_vec();
        args.extend(["--data", "criteo-tsv", "--out", out_dir.to_str().unwrap()]);
        args.extend(extra);
        let out = run(&args);
        let log = text(&out);
        assert!(!out.status.success() && log.contains(needle), "{log}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Validation AUC lines of a run's log: (step, AUC as printed).
fn validations(log: &str) -> Vec<(u64, String)> {
    log.lines()
        .filter_map(|l| {
            let rest = l.strip_prefix("step ")?;
            let (step, rest) = rest.split_once(": validation AUC ")?;
            Some((
                step.parse().ok()?,
                rest.split_whitespace().next()?.to_string(),
            ))
        })
        .collect()
}

/// Early stopping: with learning rates of 0 the validation AUC never improves after the first
/// validation, so patience 2 stops at the third and restores the first; with training, the
/// restored checkpoint is the validation with the highest AUC, and the final validation
/// reports that AUC again.
#[test]
fn early_stopping_restores_the_best_checkpoint() {
    let dir = scratch("early");
    let out_dir = dir.join("out");
    let common: Vec<&str> = [
        "--no-progress",
        "--no-quantized-eval",
        "--synthetic-train",
        "200000",
        "--synthetic-eval",
        "2000",
        "--validation-examples",
        "2000",
        "--batch-size",
        "256",
        "--validate-every",
        "5",
        "--early-stop-patience",
        "2",
        "--out",
        out_dir.to_str().unwrap(),
    ]
    .to_vec();
    let mut frozen = common.clone();
    frozen.extend(["--dense-lr", "0", "--sparse-lr", "0", "--steps", "100"]);
    let out = run(&frozen);
    let log = text(&out);
    assert!(out.status.success(), "{log}");
    assert!(log.contains("early stop at step 15"), "{log}");
    assert!(log.contains("trained 15 steps"), "{log}");
    assert!(
        log.contains("restored the best checkpoint (step 5,"),
        "{log}"
    );
    // metrics.json counts the steps trained, and names the step reported (it gave the
    // restored step's count, 5, beside the 15 steps' seconds).
    let m: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out_dir.join("metrics.json")).unwrap()).unwrap();
    assert_eq!(
        (m["steps"].as_u64(), m["reported_step"].as_u64()),
        (Some(15), Some(5))
    );
    // Resumed from its last checkpoint (as if killed before its final report), the run that
    // stopped trains no further: it trained 10 more steps and overwrote the checkpoint.
    let ckpt = out_dir.join("checkpoint.safetensors");
    let resumed = [&frozen[..], &["--resume", ckpt.to_str().unwrap()]].concat();
    let out = run(&resumed);
    let log = text(&out);
    assert!(out.status.success(), "{log}");
    assert!(
        log.contains("nothing more to train") && log.contains("trained 15 steps"),
        "{log}"
    );
    assert!(!log.contains("step 20:"), "{log}");

    let mut trained = common.clone();
    trained.extend(["--steps", "120"]);
    let out = run(&trained);
    let log = text(&out);
    assert!(out.status.success(), "{log}");
    let seen = validations(&log);
    assert!(seen.len() >= 3, "{log}");
    let best = seen
        .iter()
        .fold(None::<&(u64, String)>, |b, v| match b {
            Some(b) if b.1.parse::<f64>().unwrap() >= v.1.parse::<f64>().unwrap() => Some(b),
            _ => Some(v),
        })
        .unwrap();
    let last = seen.last().unwrap();
    if best.0 != last.0 {
        assert!(
            log.contains(&format!("restored the best checkpoint (step {},", best.0)),
            "best {best:?}\n{log}"
        );
    }
    assert!(
        log.contains(&format!("validation: AUC {}", best.1)),
        "best {best:?}\n{log}"
    );

    // A run without early stopping keeps no best.safetensors: resumed with it, the best its
    // checkpoint records cannot be restored, and is tracked afresh (before, the end of the
    // run loaded a missing file, or another run's).
    let later = dir.join("later");
    let without: Vec<&str> = (common.iter().copied())
        .filter(|a| *a != "--early-stop-patience" && *a != "2")
        .map(|a| {
            if a == out_dir.to_str().unwrap() {
                later.to_str().unwrap()
            } else {
                a
            }
        })
        .chain(["--dense-lr", "0", "--sparse-lr", "0"])
        .collect();
    let out = run(&[&without[..], &["--steps", "10"]].concat());
    assert!(out.status.success(), "{}", text(&out));
    assert!(!later.join("best.safetensors").exists());
    let ckpt = later.join("checkpoint.safetensors");
    let resumed = [
        &without[..],
        &["--steps", "100", "--early-stop-patience", "2"],
        &["--resume", ckpt.to_str().unwrap()],
    ]
    .concat();
    let out = run(&resumed);
    let log = text(&out);
    assert!(out.status.success(), "{log}");
    assert!(
        log.contains("holds no checkpoint of the best step 5: the best is tracked afresh"),
        "{log}"
    );
    assert!(log.contains("early stop at step 25"), "{log}");
    assert!(
        log.contains("restored the best checkpoint (step 15,"),
        "{log}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// MovieLens split by time: ratings in a shuffled file order; the latest 10% test, the 10%
/// before validate. The test report covers exactly the latest 200 of 2000: all of them clicks
/// (CTR 1), which no hashed split of this file would give.
#[test]
fn movielens_split_by_time() {
    let dir = scratch("movielens-time");
    let path = dir.join("u.data");
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut lines: Vec<(u64, String)> = (0..2000u64)
        .map(|i| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let t = 880_000_000 + i * 3_600;
            // The latest 10% are all clicks (rating 5), every other rating is not (1).
            let rating = if i >= 1800 { 5 } else { 1 };
            let line = format!("{}\t{}\t{rating}\t{t}\n", 1 + x % 90, 1 + (x >> 20) % 300);
            (x, line)
        })
        .collect();
    lines.sort();
    std::fs::write(
        &path,
        lines.iter().map(|l| l.1.as_str()).collect::<String>(),
    )
    .unwrap();
    let out_dir = dir.join("out");
    let mut args: Vec<&str> = QUICK.to_vec();
    args.extend([
        "--data",
        "movielens",
        "--path",
        path.to_str().unwrap(),
        "--movielens-split",
        "time",
        "--batch-size",
        "64",
        "--table-cap",
        "500",
        "--out",
        out_dir.to_str().unwrap(),
    ]);
    let out = run(&args);
    let log = text(&out);
    assert!(out.status.success(), "{log}");
    assert!(log.contains("test (200 examples)"), "{log}");
    assert!(log.contains("CTR 1.0000"), "{log}");
    // 1600 training ratings, 64 a batch: 25 steps.
    assert!(log.contains("trained 25 steps"), "{log}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A time split of ratings without a timestamp column (RecBole `.inter` may have none) is an
/// error naming the file, and so is early stopping with `--plan` (not supported there yet).
#[test]
fn a_time_split_without_timestamps_is_an_error_naming_the_file() {
    let dir = scratch("movielens-no-time");
    let path = dir.join("ml.inter");
    std::fs::write(
        &path,
        "user_id:token\titem_id:token\trating:float\n1\t2\t5\n3\t4\t1\n",
    )
    .unwrap();
    let out_dir = dir.join("out");
    let mut args: Vec<&str> = QUICK.to_vec();
    args.extend([
        "--data",
        "movielens",
        "--path",
        path.to_str().unwrap(),
        "--movielens-split",
        "time",
        "--out",
        out_dir.to_str().unwrap(),
    ]);
    let out = run(&args);
    let log = text(&out);
    assert!(!out.status.success(), "{log}");
    assert!(log.contains("ml.inter has no timestamp column"), "{log}");
    // Flags a plan does not support yet, or that it decides itself (its kernels place the
    // tables), are refused beside it in words.
    for (extra, refusal) in [
        (
            &["--early-stop-patience", "2"][..],
            "--early-stop-patience is not supported with --plan",
        ),
        (
            &["--placement", "fused-uvm-caching"][..],
            "the plan's compute kernels place the tables",
        ),
    ] {
        let mut args: Vec<&str> = QUICK.to_vec();
        args.extend(["--plan", "auto"]);
        args.extend(extra);
        args.extend(["--out", out_dir.to_str().unwrap()]);
        let out = run(&args);
        let log = text(&out);
        assert!(!out.status.success() && log.contains(refusal), "{log}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `--placement fused-uvm-caching` (tables in files behind a 5% DRAM cache, each batch's rows
/// prefetched while the one before trains) trains the same model as `--placement fused`, bit
/// for bit, and reports the cache's miss rate.
#[test]
fn tables_in_files_behind_a_cache_train_the_same_model() {
    let dir = scratch("cached");
    let mut logs = Vec::new();
    let cache = [
        "--cache-load-factor",
        "0.05",
        "--cache-policy",
        "lfu",
        "--cache-prefetch",
    ];
    // The cache's flags with tables in memory would do nothing: refused, each named.
    let out = run(&synthetic(
        "1000",
        &[&["--placement", "fused"], &cache[..]].concat(),
    ));
    assert!(!out.status.success());
    assert!(
        text(&out).contains(
            "--cache-load-factor, --cache-policy, --cache-prefetch would do nothing: \
             --placement fused"
        ),
        "{}",
        text(&out)
    );
    for (name, placement) in [("mem", "fused"), ("file", "fused-uvm-caching")] {
        let out_dir = dir.join(name);
        let mut extra = vec!["--steps", "30", "--placement", placement];
        if placement != "fused" {
            extra.extend(cache);
        }
        extra.extend(["--out", out_dir.to_str().unwrap()]);
        let out = run(&synthetic("1000", &extra));
        assert!(out.status.success(), "{}", text(&out));
        logs.push(text(&out));
    }
    assert!(!logs[0].contains("table cache:"), "{}", logs[0]);
    assert!(
        logs[1].contains("table cache:") && logs[1].contains("miss rate"),
        "{}",
        logs[1]
    );
    // The cached run names where its checkpoint keeps the tables; the in-memory one has none.
    assert!(logs[1].contains("cached tables are in"), "{}", logs[1]);
    assert!(!logs[0].contains("cached tables are in"), "{}", logs[0]);
    assert!(dir.join("file/tables/ebc-group0.rows").exists());
    let (x, mut y) = (
        tensors_of(&dir.join("mem"), "checkpoint"),
        tensors_of(&dir.join("file"), "checkpoint"),
    );
    assert!(x.len() > 4, "{x:?}");
    // The cached run's checkpoint keeps its tables out of the file, in its parts directory.
    assert!(
        !y.keys().any(|k| k.starts_with("checkpoint/tables.")),
        "cached tables in the checkpoint file"
    );
    y.extend(cached_tables(&dir.join("file"), &x));
    assert!(x == y, "the cached and the in-memory run differ");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The tables of the checkpoint in `out` that live in its parts directory (each cached
/// group's row file and manifest), read by the layout the in-memory run's tensors `mem` give
/// (each row: its weights, then each optimizer state's values) and keyed and typed as there.
fn cached_tables(
    out: &std::path::Path,
    mem: &std::collections::BTreeMap<String, (String, Vec<u8>)>,
) -> std::collections::BTreeMap<String, (String, Vec<u8>)> {
    let parts = (std::fs::read_dir(out).unwrap().flatten())
        .map(|e| e.path())
        .find(|p| {
            (p.file_name().unwrap().to_string_lossy()).starts_with("checkpoint.safetensors.parts-")
        })
        .expect("a parts directory beside the checkpoint");
    let mut tables = std::collections::BTreeMap::new();
    // Its group directories (beside them the lock its writer and readers take).
    let groups = (std::fs::read_dir(&parts).unwrap().flatten()).filter(|g| g.path().is_dir());
    for group in groups {
        let manifest: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(group.path().join("manifest.json")).unwrap(),
        )
        .unwrap();
        let rows =
            std::fs::read(group.path().join(manifest["rows_file"].as_str().unwrap())).unwrap();
        let mut at = 0;
        for t in manifest["tables"].as_array().unwrap() {
            let (name, n) = (
                t["name"].as_str().unwrap(),
                t["rows"].as_u64().unwrap() as usize,
            );
            // Each part's key and floats per row.
            let record: Vec<(String, usize)> = (["weight", "momentum1", "momentum2"].iter())
                .map(|part| format!("checkpoint/tables.{name}.{part}"))
                .filter_map(|key| Some((key.clone(), mem.get(&key)?.1.len() / 4 / n)))
                .collect();
            let width: usize = record.iter().map(|r| r.1).sum();
            let mut columns = vec![Vec::new(); record.len()];
            for r in 0..n {
                let mut from = at + r * width * 4;
                for (k, (_, w)) in record.iter().enumerate() {
                    columns[k].extend_from_slice(&rows[from..from + w * 4]);
                    from += w * 4;
                }
            }
            at += n * width * 4;
            for ((key, _), values) in record.into_iter().zip(columns) {
                let kind = mem[&key].0.clone();
                tables.insert(key, (kind, values));
            }
        }
        assert_eq!(
            at,
            rows.len(),
            "{}: the manifest's tables fill the file",
            group.path().display()
        );
    }
    tables
}

/// `--device cuda --write-planner-config --cache-stats-batches N` measures each table's cache
/// statistics on N training batches: the file is a valid planner input for GPU ranks whose
/// tables carry them and the load factor they are priced at, and the planner's
/// `fused_uvm_caching` costs move with them. On CPU ranks, where the planner offers no cached
/// kernel, the statistics would change nothing: refused.
#[test]
fn the_planner_config_carries_cache_statistics_measured_on_batches() {
    use embers_planner::estimator::perf::shard_perfs;
    use embers_planner::types::{ComputeKernel, ShardingType};
    let dir = scratch("planner");
    let path = dir.join("planner.json");
    let extra = [
        "--write-planner-config",
        path.to_str().unwrap(),
        "--cache-stats-batches",
        "20",
    ];
    let out = run(&synthetic("1000", &extra));
    assert!(!out.status.success());
    assert!(
        text(&out).contains("the planner offers CPU ranks no cached kernel"),
        "{}",
        text(&out)
    );
    let on_gpus = [
        &extra[..],
        &["--device", "cuda", "--cache-load-factor", "0.3"],
    ]
    .concat();
    let out = run(&synthetic("1000", &on_gpus));
    assert!(out.status.success(), "{}", text(&out));
    let text = std::fs::read_to_string(&path).unwrap();
    let config = embers_planner::Config::from_json(&text).unwrap();
    let problem = config.resolve().unwrap();
    assert_eq!(
        problem.topology.compute_device,
        embers_planner::types::ComputeDevice::Cuda
    );
    assert_eq!(config.tables.len(), 26);
    for (t, resolved) in config.tables.iter().zip(&problem.tables) {
        assert_eq!(t.constraints.cache_load_factor, Some(0.3));
        // The statistics reach the cost: without them the same table prices differently.
        let perf = |table: &embers_planner::config::Table| {
            let sizes = [[table.rows, table.dim]];
            let p = shard_perfs(
                &problem.topology,
                table,
                ShardingType::TableWise,
                ComputeKernel::FusedUvmCaching,
                &sizes,
            )
            .unwrap();
            p[0].total()
        };
        let mut without = resolved.clone();
        without.constraints.cache_stats = None;
        assert_ne!(perf(resolved), perf(&without), "{}", t.name);
        let stats = t.constraints.cache_stats.as_ref().expect("cache stats");
        assert_eq!(stats.height, t.rows);
        assert_eq!(stats.mrc_hist_counts.len(), 100);
        // 256 samples a batch, one id each: at most 256 distinct ids per batch.
        assert!(stats.expected_lookups > 1.0 && stats.expected_lookups <= 256.0);
        assert!(
            stats.mrc_hist_counts.iter().sum::<f64>() > 0.0,
            "{}",
            t.name
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A resumed run's report goes back to its first step: the checkpoints hold the history so
/// far, so `metrics.csv` of a run stopped at step 20 and resumed to 40 lists the rows of the
/// straight run (every value but the timings, bit for bit); it listed only the rows after
/// the resume.
#[test]
fn a_resumed_run_reports_the_whole_history() {
    let dir = scratch("history");
    let common = [
        "--no-progress",
        "--no-quantized-eval",
        "--validate-every",
        "10",
        "--validation-examples",
        "500",
        "--synthetic-train",
        "20000",
        "--synthetic-eval",
        "500",
        "--batch-size",
        "256",
    ];
    let go = |extra: &[&str]| {
        let args: Vec<&str> = common.iter().chain(extra).copied().collect();
        let out = run(&args);
        assert!(out.status.success(), "{}", text(&out));
    };
    let (a, b) = (dir.join("a"), dir.join("b"));
    go(&["--steps", "40", "--out", a.to_str().unwrap()]);
    go(&["--steps", "20", "--out", b.to_str().unwrap()]);
    let ckpt = b.join("checkpoint.safetensors");
    go(&[
        "--steps",
        "40",
        "--resume",
        ckpt.to_str().unwrap(),
        "--out",
        b.to_str().unwrap(),
    ]);
    // Every column but the seconds (2) and the rate (6).
    let rows = |d: &Path| -> Vec<Vec<String>> {
        let csv = std::fs::read_to_string(d.join("metrics.csv")).unwrap();
        (csv.lines().skip(1))
            .map(|l| {
                (l.split(',').enumerate())
                    .filter(|(i, _)| *i != 2 && *i != 6)
                    .map(|(_, v)| v.to_string())
                    .collect()
            })
            .collect()
    };
    let (straight, resumed) = (rows(&a), rows(&b));
    let steps: Vec<&str> = straight.iter().map(|r| r[0].as_str()).collect();
    assert_eq!(steps, ["10", "20", "30", "40"]);
    assert_eq!(resumed, straight);
    // Stopped between validations (its last checkpoint at step 25 holds the losses of steps
    // 21-25, which row 30 averages with 26-30): the same rows again; and the seconds go on
    // from where the run stopped, never back.
    let c = dir.join("c");
    go(&["--steps", "25", "--out", c.to_str().unwrap()]);
    let ckpt = c.join("checkpoint.safetensors");
    let resume = ["--steps", "40", "--resume", ckpt.to_str().unwrap()];
    go(&[&resume[..], &["--out", c.to_str().unwrap()]].concat());
    assert_eq!(rows(&c), straight);
    for d in [&b, &c] {
        let csv = std::fs::read_to_string(d.join("metrics.csv")).unwrap();
        let seconds: Vec<f64> = (csv.lines().skip(1))
            .map(|l| l.split(',').nth(2).unwrap().parse().unwrap())
            .collect();
        assert!(
            seconds.windows(2).all(|w| w[0] <= w[1]),
            "{d:?}: {seconds:?}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
