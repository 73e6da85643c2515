//! The DLRM example (the project's main job) as a user runs it, one process: `--resume`
//! continues bit-identically (the data position is skipped, not replayed, on synthetic data and
//! on a Criteo TSV file across an epoch boundary), and an empty training file is an error
//! naming it instead of a model trained on nothing.

#[path = "support/checkpoint_files.rs"]
mod checkpoint_files;

use checkpoint_files::tensors_of;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The example binary, built beside the test binaries by `cargo test`.
fn example() -> PathBuf {
    let me = std::env::current_exe().unwrap();
    let exe = me.parent().unwrap().parent().unwrap().join("examples/dlrm");
    assert!(
        exe.exists(),
        "{} was not built (cargo test builds the examples)",
        exe.display()
    );
    exe
}

fn run(args: &[&str]) -> Output {
    Command::new(example())
        .args(args)
        .output()
        .expect("the example starts")
}

fn text(out: &Output) -> String {
    format!(
        "--- stdout\n{}\n--- stderr\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
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

const QUICK: [&str; 6] = [
    "--no-progress",
    "--no-quantized-eval",
    "--validate-every",
    "0",
    "--validation-examples",
    "1000",
];

#[test]
fn resume_on_synthetic_data_is_bit_identical() {
    let dir = scratch("synthetic");
    let common: Vec<&str> = QUICK
        .iter()
        .copied()
        .chain([
            "--synthetic-train",
            "100000",
            "--synthetic-eval",
            "1000",
            "--batch-size",
            "256",
        ])
        .collect();
    straight_equals_resumed(&dir, &common, 15, 40);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A Criteo TSV file (label, 13 integer and 26 hashed categorical columns), shuffled through a
/// buffer: the resumed run skips exactly the batches already trained on, across an epoch.
#[test]
fn resume_on_a_criteo_file_is_bit_identical_across_an_epoch() {
    let dir = scratch("criteo");
    let path = dir.join("day_0.tsv");
    let mut x: u64 = 0x2545_f491_4f6c_dd1d;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut tsv = String::new();
    for _ in 0..4000 {
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
    std::fs::write(&path, tsv).unwrap();
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
    assert!(log.contains("empty.tsv") && log.contains("no"), "{log}");
    assert!(
        !out_dir.join("checkpoint.safetensors").exists(),
        "a checkpoint was written: {log}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
