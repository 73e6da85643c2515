//! Killing a child process in the middle of a file write (Linux: kill(1) and /proc).

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant, SystemTime};

/// Sends `signal` (a name such as `STOP`) to process `pid` with kill(1).
fn signal(pid: u32, signal: &str) {
    let status = Command::new("kill")
        .args([format!("-{signal}"), pid.to_string()])
        .status()
        .unwrap();
    assert!(status.success(), "kill -{signal} {pid} failed");
}

/// Whether process `pid` is stopped, from the state field of `/proc/<pid>/stat`.
fn is_stopped(pid: u32) -> bool {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // The state follows the command name, which is in parentheses and may hold spaces.
    let state = stat[stat.rfind(')').unwrap() + 1..]
        .split_whitespace()
        .next();
    matches!(state, Some("T" | "t"))
}

/// Leaves process `pid` stopped inside a write (while `writing()` holds, e.g. while its
/// temporary checkpoint file exists): stops it as soon as `writing()` holds, and resumes it to
/// try again if the write finished meanwhile.
pub fn stop_inside_a_write(pid: u32, writing: impl Fn() -> bool) {
    let start = Instant::now();
    loop {
        assert!(
            start.elapsed() < Duration::from_secs(300),
            "never caught the writer inside a write"
        );
        if !writing() {
            std::thread::sleep(Duration::from_micros(200));
            continue;
        }
        signal(pid, "STOP");
        while !is_stopped(pid) {
            std::thread::sleep(Duration::from_micros(100));
        }
        if writing() {
            return;
        }
        signal(pid, "CONT");
    }
}

/// The modification time of `path`, if it exists.
pub fn modified(path: &Path) -> Option<SystemTime> {
    std::fs::metadata(path).and_then(|m| m.modified()).ok()
}

/// Waits until the child has written a new version of `path` (one modified otherwise than
/// `before`), at most 300 s.
pub fn wait_for_new_version(path: &Path, before: Option<SystemTime>) {
    let start = Instant::now();
    loop {
        let now = modified(path);
        if now.is_some() && now != before {
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(300),
            "child wrote nothing"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Gets ready to kill child `pid` in round `round`: even rounds stop it inside a write (see
/// [`stop_inside_a_write`]), odd rounds wait a time that moves around between rounds.
pub fn before_kill(pid: u32, round: u64, writing: impl Fn() -> bool) {
    if round % 2 == 0 {
        stop_inside_a_write(pid, writing);
    } else {
        std::thread::sleep(Duration::from_millis((13 + 37 * round) % 300));
    }
}
