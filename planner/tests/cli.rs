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
