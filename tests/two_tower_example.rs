//! The TwoTower example as a user runs it, on its synthetic data (planted factors): it trains,
//! writes its checkpoint, index (loaded back as the server's retrieval stage), metrics and plot, retrieves better than popularity through exact
//! search and close to it through IVF-PQ, and re-ranks with a DLRM; missing MovieLens files
//! are an error naming where it looked and how to fetch them.

#[path = "support/example_bin.rs"]
mod example_bin;

use example_bin::text;
use std::process::Output;

fn run(args: &[&str]) -> Output {
    example_bin::run("two_tower", args)
}

#[test]
fn synthetic_run_beats_popularity_and_writes_its_outputs() {
    let dir = std::env::temp_dir().join(format!("embers-two-tower-example-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let out = run(&[
        "--data",
        "synthetic",
        "--epochs",
        "3",
        "--nprobe",
        "8",
        "--rerank",
        "--rerank-epochs",
        "1",
        "--no-progress",
        "--out",
        dir.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", text(&out));
    for f in [
        "checkpoint.safetensors",
        "items.ivfpq",
        "metrics.json",
        "curves.png",
    ] {
        assert!(dir.join(f).is_file(), "{f} missing\n{}", text(&out));
    }
    // The checkpoint and the index are what the server's retrieval stage loads.
    {
        use embers::serve::{BatchModel, RetrievalRow, RetrievalServable};
        let stage = RetrievalServable::from_files(
            dir.join("checkpoint.safetensors"),
            dir.join("items.ivfpq"),
            8,
            100,
        )
        .unwrap();
        let rows = vec![RetrievalRow {
            ids: vec![vec![0]; stage.keys().len()],
            k: 10,
        }];
        stage.validate(&rows).unwrap();
        let found = stage.run(rows).unwrap();
        let found = [found[0].clone().unwrap()];
        assert_eq!(found[0].len(), 10);
        assert!(found[0]
            .iter()
            .all(|&(id, _)| id >= 0 && (id as usize) < stage.candidates()));
    }
    let m: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("metrics.json")).unwrap()).unwrap();
    let at = |path: &[&str]| -> f64 {
        let mut v = &m;
        for p in path {
            v = &v[*p];
        }
        v.as_f64().unwrap_or_else(|| panic!("{path:?} in {m}"))
    };
    let exact = at(&["exact", "recall_at_100"]);
    let ivf = at(&["ivf_pq", "quality", "recall_at_100"]);
    let popular = at(&["popularity", "recall_at_100"]);
    assert!(
        exact > popular + 0.05,
        "exact {exact} vs popularity {popular}\n{}",
        text(&out)
    );
    assert!(ivf >= 0.8 * exact, "IVF-PQ {ivf} vs exact {exact}");
    assert!(
        at(&["rerank", "quality", "recall_at_100"]) == exact,
        "re-ranking keeps the 100"
    );
    assert_eq!(m["history"].as_array().map(Vec::len), Some(3));
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn missing_movielens_files_are_a_named_error() {
    let out = run(&["--path", "/nonexistent/ml", "--no-progress"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("/nonexistent/ml/ml-100k.inter") && err.contains("movielens-100k.sh"),
        "{err}"
    );
}

#[test]
fn more_hard_negatives_than_negatives_is_a_named_error() {
    let out = run(&[
        "--data",
        "synthetic",
        "--rerank",
        "--rerank-hard-negatives",
        "5",
        "--no-progress",
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--rerank-hard-negatives 5: at most 4"),
        "{err}"
    );
}

/// Flags the run cannot honour are refused before it trains: an index that cannot be built
/// from the model's embeddings (it failed after every epoch had run), negatives past any
/// memory (an abort), re-ranking settings without --rerank, files with synthetic data and
/// softmax settings with the pointwise loss (all ignored).
#[test]
fn flags_it_cannot_honour_are_refused_before_training() {
    // `args` after `base` fail naming `says`, before any epoch is trained.
    let refused = |base: &[&'static str], args: Vec<&'static str>, says: &str| {
        let args: Vec<&str> = base.iter().copied().chain(args).collect();
        let out = run(&args);
        let log = text(&out);
        assert!(
            !out.status.success() && log.contains(says),
            "{args:?}: {log}"
        );
        assert!(!log.contains("epoch 1:"), "{args:?} trained first: {log}");
    };
    for (args, says) in [
        (vec!["--pq-m", "5"], "--nlist 16 --pq-m 5"),
        (vec!["--nprobe", "17"], "--nprobe 17: must be 1..=16"),
        (
            vec!["--nlist", "100000"],
            "at least 100000 training vectors",
        ),
        (vec!["--rerank-epochs", "2"], "--rerank"),
        (
            vec!["--random-negatives", "10000000000000000"],
            "out of memory allocating",
        ),
        // Flags the data or the loss would have ignored.
        (vec!["--path", "ml"], "--data synthetic reads none"),
        (
            vec!["--loss", "pointwise", "--random-negatives", "8"],
            "--loss pointwise draws one random negative",
        ),
        (
            vec!["--loss", "pointwise", "--no-log-q"],
            "--loss pointwise draws one random negative",
        ),
    ] {
        refused(
            &["--data", "synthetic", "--epochs", "1", "--no-progress"],
            args,
            says,
        );
    }
    // No pass at all (it wrote no checkpoint and reported NaN pairs a second).
    for args in [
        vec!["--epochs", "0"],
        vec!["--epochs", "1", "--rerank", "--rerank-epochs", "0"],
    ] {
        refused(
            &["--data", "synthetic", "--no-progress"],
            args,
            "must be at least 1",
        );
    }
}

/// Every tensor of the checkpoint at `path`, by name (as f64: f32, f64 and small i64 values
/// exactly).
fn tensors_of(path: &std::path::Path) -> Vec<(String, Vec<f64>)> {
    let r = embers::checkpoint::CheckpointReader::open(path).unwrap();
    let mut names = r.names();
    names.sort();
    (names.into_iter())
        .map(|n| {
            let t = r.read_tensor(&n).unwrap();
            (n, t.to_vec_f64().unwrap())
        })
        .collect()
}

/// A run stopped after its first epoch and resumed (`--resume`) ends as the uninterrupted run
/// does: the same history (each epoch's retrieval quality), final quality and index quality,
/// and every tensor of its checkpoint (tables, MLPs, both optimizers' state, the frequency
/// estimator), for the softmax loss and the pointwise one (whose negatives the example draws
/// itself). A resume with other data flags, another model, or no epoch left is refused
/// before it trains.
#[test]
fn a_resumed_run_ends_as_the_uninterrupted_run() {
    let root = std::env::temp_dir().join(format!("embers-two-tower-resume-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let metrics = |dir: &std::path::Path| -> serde_json::Value {
        serde_json::from_slice(&std::fs::read(dir.join("metrics.json")).unwrap()).unwrap()
    };
    for loss in ["softmax", "pointwise"] {
        let (straight, stopped) = (
            root.join(format!("{loss}-a")),
            root.join(format!("{loss}-b")),
        );
        let go = |epochs: &str, out: &std::path::Path, more: &[&str]| {
            let mut args = vec![
                "--data",
                "synthetic",
                "--loss",
                loss,
                "--epochs",
                epochs,
                "--no-progress",
                "--out",
                out.to_str().unwrap(),
            ];
            args.extend_from_slice(more);
            run(&args)
        };
        let out = go("3", &straight, &[]);
        assert!(out.status.success(), "{}", text(&out));
        let out = go("1", &stopped, &[]);
        assert!(out.status.success(), "{}", text(&out));
        let ckpt = stopped.join("checkpoint.safetensors");
        let resume = ["--resume", ckpt.to_str().unwrap()];
        // Refused before training: other data flags, another model, nothing left to train.
        for (epochs, more, says) in [
            (
                "3",
                vec!["--batch-size", "128"],
                "its run had --batch-size 256, this run has 128",
            ),
            (
                "3",
                vec!["--test-fraction", "0.3"],
                "its run had --test-fraction 0.2",
            ),
            ("3", vec!["--embedding-dim", "32"], "embedding_dim"),
            (
                "1",
                vec![],
                "its run trained 1 epochs, and --epochs 1 asks for no more",
            ),
        ] {
            let more: Vec<&str> = more.into_iter().chain(resume).collect();
            let out = go(epochs, &stopped, &more);
            let log = text(&out);
            assert!(
                !out.status.success() && log.contains(says),
                "{loss} {more:?}: {log}"
            );
            assert!(!log.contains("epoch 2:"), "{loss} {more:?} trained: {log}");
        }
        let out = go("3", &stopped, &resume);
        let log = text(&out);
        assert!(out.status.success(), "{log}");
        assert!(
            log.contains("resumed from") && !log.contains("epoch 1:") && log.contains("epoch 3:"),
            "{log}"
        );
        let (a, b) = (metrics(&straight), metrics(&stopped));
        for key in ["history", "exact", "popularity"] {
            assert!(a[key] == b[key], "{loss}: {key}: {} vs {}", a[key], b[key]);
        }
        let ivf = |m: &serde_json::Value| m["ivf_pq"]["quality"].clone();
        assert!(ivf(&a) == ivf(&b), "{loss}: {} vs {}", ivf(&a), ivf(&b));
        assert_eq!(b["history"].as_array().map(Vec::len), Some(3));
        let (a, b) = (
            tensors_of(&straight.join("checkpoint.safetensors")),
            tensors_of(&ckpt),
        );
        assert!(a.len() > 10, "{loss}: {} tensors", a.len());
        for ((na, va), (nb, vb)) in a.iter().zip(&b) {
            assert_eq!(na, nb, "{loss}");
            assert!(va == vb, "{loss}: `{na}` differs after the resume");
        }
        assert_eq!(a.len(), b.len());
    }
    std::fs::remove_dir_all(&root).ok();
}
