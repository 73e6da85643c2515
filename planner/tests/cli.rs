//! The `embers-plan` binary as a user runs it: `-o` writes the plan atomically (no partial
//! file, no temporary left), and a reader that goes away (`| head`) ends it quietly.

use std::process::{Command, Stdio};

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_embers-plan"))
}

fn example(name: &str) -> String {
    format!("{}/examples/{name}", env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn the_plan_file_is_written_whole_and_nothing_else() {
    let dir = std::env::temp_dir().join(format!("embers-plan-cli-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let plan = dir.join("plan.json");
    std::fs::write(&plan, "an older plan").unwrap();
    let out = bin()
        .args(["plan", &example("small.toml"), "--format", "json", "-o"])
        .arg(&plan)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let written: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&plan).unwrap()).unwrap();
    let printed: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(written, printed);
    let names: Vec<String> = (std::fs::read_dir(&dir).unwrap())
        .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
        .collect();
    assert_eq!(names, ["plan.json"]);
    // A config that cannot be planned leaves the file as it was.
    let bad = dir.join("bad.toml");
    std::fs::write(&bad, "batch_size = 0\n").unwrap();
    let out = bin()
        .args(["plan"])
        .arg(&bad)
        .arg("-o")
        .arg(&plan)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert_eq!(
        serde_json::from_slice::<serde_json::Value>(&std::fs::read(&plan).unwrap()).unwrap(),
        written
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_reader_that_goes_away_ends_the_output_quietly() {
    for args in [
        ["plan", "criteo_8xh100.toml"],
        ["estimate", "criteo_8xh100.toml"],
    ] {
        let mut child = bin()
            .arg(args[0])
            .arg(example(args[1]))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // The reader closes at once, before the output is written.
        drop(child.stdout.take());
        let out = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        assert!(out.status.success(), "{args:?}: {:?} {err}", out.status);
    }
}

/// A config that cannot be planned exits 3 naming TorchRec's error type; a bad one exits 1
/// (both exited 1, with no type).
#[test]
fn no_plan_and_a_bad_config_exit_apart() {
    let dir = std::env::temp_dir().join(format!("embers-plan-cli-exit-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let too_big = dir.join("too_big.json");
    std::fs::write(
        &too_big,
        r#"{"batch_size": 512,
            "topology": {"world_size": 2, "local_world_size": 2, "hbm_cap": "1GiB", "ddr_cap": "1GiB"},
            "optimizer": {"kind": "sgd"},
            "tables": [{"name": "t", "rows": 100000000, "dim": 128}]}"#,
    )
    .unwrap();
    let out = bin().arg("plan").arg(&too_big).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{err}");
    assert!(err.contains("[INSUFFICIENT_STORAGE]"), "{err}");
    let bad = dir.join("bad.json");
    std::fs::write(&bad, r#"{"batch_size": 0}"#).unwrap();
    let out = bin().arg("plan").arg(&bad).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.starts_with("error: "), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}
