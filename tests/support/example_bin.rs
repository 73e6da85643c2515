//! Running an example binary as a user does, from an integration test.

use std::path::PathBuf;
use std::process::{Command, Output};

/// The example `name`'s binary, built beside the test binaries by `cargo test`.
pub fn example(name: &str) -> PathBuf {
    let me = std::env::current_exe().unwrap();
    let exe = me
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .join("examples")
        .join(name);
    assert!(
        exe.exists(),
        "{} was not built (cargo test builds the examples)",
        exe.display()
    );
    exe
}

/// Runs example `name` with `args` to completion.
pub fn run(name: &str, args: &[&str]) -> Output {
    Command::new(example(name))
        .args(args)
        .output()
        .expect("the example starts")
}

/// Both output streams, for assertion messages.
pub fn text(out: &Output) -> String {
    format!(
        "--- stdout\n{}\n--- stderr\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}
