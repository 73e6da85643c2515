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

/// Kills children until at least 4 rounds have run and two kills landed inside a write (or
/// `max_rounds` rounds have run), and asserts that two did. Each round runs this test
/// binary's test `child` with `env` set, waits for a new version of `watched`, kills it
/// (SIGKILL, no cleanup; even rounds inside a write, see [`before_kill`]) and calls
/// `after(pid, mid_write)`, where `mid_write` is `writing(pid)` once the child is dead. Returns
/// what `after` returned, round by round.
pub fn kill_rounds<T, E>(
    child: &str,
    env: (&str, &Path),
    watched: &Path,
    max_rounds: u64,
    writing: impl Fn(u32) -> bool,
    mut after: impl FnMut(u32, bool) -> Result<T, E>,
) -> Result<Vec<T>, E> {
    let exe = std::env::current_exe().unwrap();
    let mut results = Vec::new();
    let mut killed_mid_write = 0;
    let mut round = 0u64;
    while round < 4 || (killed_mid_write < 2 && round < max_rounds) {
        round += 1;
        let before = modified(watched);
        let mut child = Command::new(&exe)
            .args(["--exact", child, "--nocapture"])
            .env(env.0, env.1)
            .spawn()
            .unwrap();
        let pid = child.id();
        wait_for_new_version(watched, before);
        before_kill(pid, round, || writing(pid));
        child.kill().unwrap();
        child.wait().unwrap();
        let mid_write = writing(pid);
        killed_mid_write += u64::from(mid_write);
        results.push(after(pid, mid_write)?);
    }
    println!("{child}: {killed_mid_write} of {round} kills landed inside a write");
    assert!(
        killed_mid_write >= 2,
        "{killed_mid_write} kills landed during a write in {round} rounds"
    );
    Ok(results)
}
