//! The distributed engine across processes: `mpiexec -n W` runs `embers-dist-worker` (built
//! with `--features mpi`), one process per rank.
//!
//! * sharded == unsharded for every case of `support/dist_scenarios.rs` at 2 and 4 ranks, for
//!   the pooled collection and the unpooled one (`support/dist_sequence.rs`)
//!   (with the closed-form byte checks);
//! * TorchRec's `KJTAllToAll` docstring example;
//! * the training pipeline (pipelined == sequential, uneven data) and the DLRM example on 2
//!   processes (`--plan auto`, resumed bit-identically, and on 1 process; a plan with
//!   `fused_uvm_caching` tables, bit-identical to the same plan all `fused`);
//! * faults: a rank killed mid-step, a rank that stalls, a rank that skips a batch, a rank with
//!   another plan, a plan for another world size — every rank ends, with the named error,
//!   within the deadline + 2 s.
//!
//! Without MPI (no `mpiexec`, or the `mpi` feature off) each test prints why it was skipped
//! and passes; `EMBERS_REQUIRE_MPI=1` (set by CI) makes that a failure.

#[path = "support/checkpoint_files.rs"]
mod checkpoint_files;

use checkpoint_files::{tables_of_sharded, tensors_of};
use std::process::{Command, Output};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// `mpiexec` and its extra arguments, or why it cannot run.
fn launcher() -> Result<(String, Vec<String>), String> {
    let exe = std::env::var("EMBERS_MPIEXEC").unwrap_or_else(|_| "mpiexec".to_string());
    let version = Command::new(&exe)
        .arg("--version")
        .output()
        .map_err(|e| format!("no `{exe}` ({e}); install mpich (Debian: mpich libmpich-dev)"))?;
    let text = String::from_utf8_lossy(&version.stdout).to_string()
        + &String::from_utf8_lossy(&version.stderr);
    let mut extra = Vec::new();
    if text.contains("Open MPI") || text.contains("OpenRTE") {
        // Open MPI refuses more ranks than cores, and root, unless told.
        extra.push("--oversubscribe".to_string());
        if std::env::var("USER").is_ok_and(|u| u == "root") {
            extra.push("--allow-run-as-root".to_string());
        }
    }
    Ok((exe, extra))
}

/// The worker binary, or why there is none.
fn worker() -> Result<&'static str, String> {
    #[cfg(feature = "mpi")]
    {
        Ok(env!("CARGO_BIN_EXE_embers-dist-worker"))
    }
    #[cfg(not(feature = "mpi"))]
    {
        Err("the `mpi` feature is off (cargo test --features mpi)".to_string())
    }
}

/// Runs the worker on `world` ranks, or `None` (reason printed) when MPI is not available.
fn mpirun(world: usize, args: &[&str]) -> Option<(Output, Instant)> {
    mpirun_as(world, world, args)
}

/// Runs `ranks` workers told to expect a world of `world`.
fn mpirun_as(ranks: usize, world: usize, args: &[&str]) -> Option<(Output, Instant)> {
    mpirun_env(ranks, world, args, &[])
}

/// [`mpirun_as`] with `env` set for every rank.
fn mpirun_env(
    ranks: usize,
    world: usize,
    args: &[&str],
    env: &[(&str, &str)],
) -> Option<(Output, Instant)> {
    let worker = match worker() {
        Ok(w) => w,
        Err(why) => {
            let required = std::env::var("EMBERS_REQUIRE_MPI").is_ok_and(|v| v == "1");
            assert!(!required, "EMBERS_REQUIRE_MPI=1 but {why}");
            println!("SKIP: {why}");
            return None;
        }
    };
    let world = world.to_string();
    let all: Vec<&str> = [world.as_str()]
        .into_iter()
        .chain(args.iter().copied())
        .collect();
    launch_parts(&[(ranks, worker, &all)], env)
}

/// Runs `program args` on `ranks` ranks under mpiexec.
fn launch(ranks: usize, program: &str, args: &[&str]) -> Option<(Output, Instant)> {
    launch_parts(&[(ranks, program, args)], &[])
}

/// One MPI job of several parts (`mpiexec -n 1 a : -n 1 b`): each part's ranks run its program
/// with its arguments, ranks numbered in part order. See [`launch`].
/// `env` is set for every rank.
fn launch_parts(
    parts: &[(usize, &str, &[&str])],
    env: &[(&str, &str)],
) -> Option<(Output, Instant)> {
    let (exe, extra) = match launcher() {
        Ok(s) => s,
        Err(why) => {
            let required = std::env::var("EMBERS_REQUIRE_MPI").is_ok_and(|v| v == "1");
            assert!(!required, "EMBERS_REQUIRE_MPI=1 but {why}");
            println!("SKIP: {why}");
            return None;
        }
    };
    // One MPI job at a time: jobs sharing 2 cores would stretch the timed faults.
    static ONE_JOB: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _job = ONE_JOB.lock().unwrap_or_else(|e| e.into_inner());
    let mut cmd = Command::new(exe);
    cmd.args(&extra);
    for (i, &(ranks, program, args)) in parts.iter().enumerate() {
        if i > 0 {
            cmd.arg(":");
        }
        cmd.args(["-n", &ranks.to_string(), program]).args(args);
    }
    // A backstop: no MPI job of this file may outlive it (MPICH's launcher timeout).
    cmd.env("MPIEXEC_TIMEOUT", "240").envs(env.iter().copied());
    let out = cmd.output().expect("mpiexec runs");
    Some((out, Instant::now()))
}

fn text(out: &Output) -> String {
    format!(
        "exit {:?}\n--- stdout\n{}\n--- stderr\n{}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// The DLRM example built with the `mpi` feature, or `None` (after saying why) when a test
/// using it is skipped.
fn dlrm_example() -> Option<String> {
    if worker().is_err() {
        let required = std::env::var("EMBERS_REQUIRE_MPI").is_ok_and(|v| v == "1");
        assert!(!required, "EMBERS_REQUIRE_MPI=1 but the mpi feature is off");
        println!("SKIP: the `mpi` feature is off");
        return None;
    }
    // Examples are built beside the test binaries (target/<profile>/examples).
    let me = std::env::current_exe().unwrap();
    let example = me.parent().unwrap().parent().unwrap().join("examples/dlrm");
    if !example.exists() {
        assert!(
            std::env::var("EMBERS_REQUIRE_MPI").is_err(),
            "{} was not built (cargo test builds the examples)",
            example.display()
        );
        println!("SKIP: {} was not built", example.display());
        return None;
    }
    Some(example.to_str().unwrap().to_string())
}

fn equivalence(world: usize) {
    let Some((out, _)) = mpirun(world, &["equivalence", "all", "5"]) else {
        return;
    };
    let log = text(&out);
    assert!(out.status.success(), "{log}");
    let cases = log.lines().filter(|l| l.starts_with("OK rank 0 ")).count();
    // Every case for the sharded EBC and the sharded EC.
    let unpooled = (log.lines())
        .filter(|l| l.starts_with("OK rank 0 ") && l.contains(" unpooled "))
        .count();
    assert!(cases >= 18 && unpooled * 2 == cases, "{log}");
    for r in 0..world {
        assert_eq!(
            log.lines()
                .filter(|l| l.starts_with(&format!("OK rank {r} ")))
                .count(),
            cases,
            "{log}"
        );
    }
}

#[test]
fn sharded_equals_unsharded_across_two_processes() {
    equivalence(2);
}

#[test]
fn sharded_equals_unsharded_across_four_processes_as_two_hosts() {
    equivalence(4);
}

/// The training pipeline across 2 processes (its communication thread on a duplicated MPI
/// communicator): pipelined == sequential, bit for bit, and uneven data (12 and 10 batches)
/// ends both ranks after 10 steps.
#[test]
fn the_training_pipeline_across_two_processes() {
    let Some((out, _)) = mpirun(2, &["pipeline"]) else {
        return;
    };
    let log = text(&out);
    assert!(out.status.success(), "{log}");
    for r in 0..2 {
        let ok = format!("OK rank {r} pipeline 10 steps, 10 losses and 5 tables bit-identical");
        assert!(log.lines().any(|l| l == ok), "{log}");
    }
}

/// Saved by 4 processes (2 hosts of 2, a mixed plan), resumed by 2 under a row-wise plan.
#[test]
fn a_checkpoint_of_four_processes_resumes_on_two() {
    let dir = std::env::temp_dir().join(format!("embers-mpi-ckpt-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let path = dir.to_str().unwrap();
    for (world, mode) in [(4, "save"), (2, "resume")] {
        let Some((out, _)) = mpirun(world, &["checkpoint", mode, path]) else {
            return;
        };
        let log = text(&out);
        assert!(out.status.success(), "{log}");
        for r in 0..world {
            let ok = format!("OK rank {r} checkpoint {mode} ");
            assert!(log.lines().any(|l| l.starts_with(&ok)), "{log}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn kjt_all_to_all_matches_torchrecs_docstring_example() {
    let Some((out, _)) = mpirun(2, &["kjt-all-to-all"]) else {
        return;
    };
    let log = text(&out);
    assert!(out.status.success(), "{log}");
    assert!(
        log.contains("OK rank 0 kjt-all-to-all") && log.contains("OK rank 1 kjt-all-to-all"),
        "{log}"
    );
}

const DEADLINE_S: f64 = 3.0;
/// What ending a job may take past the deadline: the watchdog's pause before it aborts, the
/// launcher tearing down 4 ranks on a loaded 2-core machine. Far below a hang.
const SLACK_S: f64 = 4.0;

/// Runs a fault on 4 ranks; returns the log and, when rank 1 announced its fault, the seconds
/// from the fault to the end of the job.
fn fault(kind: &str) -> Option<(Output, String, Option<f64>)> {
    let (out, end) = mpirun(4, &["fault", kind, &DEADLINE_S.to_string()])?;
    let ended_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis()
        - end.elapsed().as_millis();
    let log = text(&out);
    let fault_ms = log
        .lines()
        .find_map(|l| l.strip_prefix("FAULT rank 1 at "))
        .and_then(|t| t.trim().parse::<u128>().ok());
    let after = fault_ms.map(|f| ended_ms.saturating_sub(f) as f64 / 1e3);
    Some((out, log, after))
}

#[test]
fn a_rank_killed_mid_step_ends_the_job() {
    let Some((out, log, after)) = fault("kill") else {
        return;
    };
    assert!(!out.status.success(), "{log}");
    let after = after.expect("the fault was announced");
    assert!(
        after <= DEADLINE_S + SLACK_S,
        "ended {after:.2} s after the fault\n{log}"
    );
}

/// A rank killed mid-epoch with the training pipeline running (its loader and communication
/// threads, a duplicated communicator): the job ends, naming the dead process.
#[test]
fn a_rank_killed_mid_epoch_in_the_pipeline_ends_the_job() {
    let Some((out, log, after)) = fault("pipeline-kill") else {
        return;
    };
    assert!(!out.status.success(), "{log}");
    assert!(!log.contains("no fault happened"), "{log}");
    // The launcher names the dead process (MPICH: its PID, host and exit code; Open MPI: its
    // rank and signal), or a survivor's watchdog names the collective it waited on.
    assert!(
        log.contains("BAD TERMINATION")
            || log.contains("exited on signal")
            || log.contains("exceeded"),
        "{log}"
    );
    let after = after.expect("the fault was announced");
    assert!(
        after <= DEADLINE_S + SLACK_S,
        "ended {after:.2} s after the fault\n{log}"
    );
}

/// A rank that stops making collectives (stalled, or out of batches before the others): the
/// others' watchdogs abort the job with the op and its number.
fn watchdog_case(kind: &str) {
    let Some((out, log, after)) = fault(kind) else {
        return;
    };
    assert!(!out.status.success(), "{log}");
    let after = after.expect("the fault was announced");
    assert!(
        after <= DEADLINE_S + SLACK_S,
        "ended {after:.2} s after the fault\n{log}"
    );
    // Which rank's watchdog fires first depends on timing; it names itself, the op and its
    // number.
    let named = log.lines().any(|l| {
        l.starts_with("rank ")
            && l.contains(" #")
            && l.contains(&format!("exceeded {DEADLINE_S:.1} s"))
    });
    assert!(named, "{log}");
}

#[test]
fn a_stalled_rank_ends_the_job_at_the_deadline() {
    watchdog_case("stall");
}

#[test]
fn a_rank_that_skips_a_batch_ends_the_job_at_the_deadline() {
    watchdog_case("skip");
}

#[test]
fn ranks_with_different_plans_all_fail_naming_the_rank_and_table() {
    let Some((out, log, _)) = fault("plan") else {
        return;
    };
    assert!(!out.status.success(), "{log}");
    for r in 0..4 {
        assert!(
            log.contains(&format!("rank {r}: rank 1 holds another plan"))
                && log.contains("table `t1`"),
            "rank {r}: {log}"
        );
    }
}

#[test]
fn a_plan_for_another_world_size_fails_on_every_rank() {
    let Some((out, log, _)) = fault("world") else {
        return;
    };
    assert!(!out.status.success(), "{log}");
    for r in 0..4 {
        assert!(
            log.contains(&format!(
                "rank {r}: the plan is for 5 ranks, the communicator has 4"
            )),
            "{log}"
        );
    }
}

/// An `EMBERS_DIST_TIMEOUT_S` that is no deadline ends every rank naming it (`1e20` s
/// panicked making the `Duration`; a value that did not parse quietly meant 300 s).
#[test]
fn a_deadline_variable_that_is_no_deadline_is_refused_on_every_rank() {
    for bad in ["1e20", "5m"] {
        let env = [("EMBERS_DIST_TIMEOUT_S", bad)];
        let Some((out, _)) = mpirun_env(2, 2, &["kjt-all-to-all"], &env) else {
            return;
        };
        let log = text(&out);
        assert!(!out.status.success(), "{log}");
        let named = format!("EMBERS_DIST_TIMEOUT_S={bad:?} is not a positive number");
        assert_eq!(log.matches(&named).count(), 2, "{log}");
    }
}

/// A bad `EMBERS_DIST_TIMEOUT_S` on one rank only: every rank fails at once, the others naming
/// that rank (they waited in their first collective for their own deadline, 300 s).
#[test]
fn a_deadline_variable_bad_on_one_rank_fails_every_rank_at_once() {
    let Ok(worker) = worker() else {
        let required = std::env::var("EMBERS_REQUIRE_MPI").is_ok_and(|v| v == "1");
        assert!(!required, "EMBERS_REQUIRE_MPI=1 but the mpi feature is off");
        return;
    };
    let started = Instant::now();
    let Some((out, _)) = launch_parts(
        &[
            (
                1,
                "env",
                &["EMBERS_DIST_TIMEOUT_S=5m", worker, "2", "kjt-all-to-all"],
            ),
            (1, worker, &["2", "kjt-all-to-all"]),
        ],
        &[],
    ) else {
        return;
    };
    let log = text(&out);
    assert!(!out.status.success(), "{log}");
    assert!(
        started.elapsed() < Duration::from_secs(60),
        "took {:?}\n{log}",
        started.elapsed()
    );
    assert_eq!(
        log.matches("EMBERS_DIST_TIMEOUT_S=\"5m\" is not a positive number")
            .count(),
        1,
        "{log}"
    );
    assert!(log.contains("rank 0's EMBERS_DIST_TIMEOUT_S"), "{log}");
}

#[test]
fn a_world_other_than_the_expected_one_is_refused() {
    // `mpiexec` from another MPI than the one embers was built against starts W singletons
    // ("rank 0 of 1" each); the worker refuses to run on a world it was not told about.
    let Some((out, _)) = mpirun_as(2, 3, &["kjt-all-to-all"]) else {
        return;
    };
    let log = text(&out);
    assert!(!out.status.success(), "{log}");
    assert!(log.contains("expected a world of 3"), "{log}");
}

/// As in one process, `--plan` with no complete batch on the ranks is an error naming it,
/// not a run of 0 steps with NaN metrics; so is validating an empty validation split.
#[test]
fn the_dlrm_example_refuses_an_empty_training_set_across_processes() {
    let Some(example) = dlrm_example() else {
        return;
    };
    let dir = std::env::temp_dir().join(format!("embers-mpi-empty-{}", std::process::id()));
    let out_dir = dir.join("out");
    let args = [
        "--plan",
        "auto",
        "--synthetic-train",
        "100",
        "--synthetic-eval",
        "1000",
        "--no-progress",
        "--out",
        out_dir.to_str().unwrap(),
    ];
    let (out, _) = launch(2, &example, &args).expect("mpiexec runs");
    let log = text(&out);
    assert!(
        !out.status.success() && log.contains("the training set is empty"),
        "{log}"
    );
    assert!(!out_dir.join("checkpoint").exists(), "{log}");
    // Validating an empty validation split: an error on every rank at the first validation
    // (it reported AUC 0.5 and NE NaN of no example).
    let args = [
        "--plan",
        "auto",
        "--synthetic-train",
        "20000",
        "--synthetic-eval",
        "0",
        "--validate-every",
        "5",
        "--steps",
        "20",
        "--no-progress",
        "--out",
        out_dir.to_str().unwrap(),
    ];
    let (out, _) = launch(2, &example, &args).expect("mpiexec runs");
    let log = text(&out);
    assert!(!out.status.success(), "{log}");
    assert_eq!(
        log.matches("the validation split holds no example (step 5)")
            .count(),
        2,
        "{log}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A rank of the DLRM example that refuses its command line (a flag for other data, a flag
/// that does not parse, a plan file it cannot read, another --plan than rank 0's, data it
/// cannot open: here no --path) ends every rank at once, each naming it;
/// without `--plan` the launched ranks all refuse to train alone into one `--out`. (A rank
/// refusing its flags before meeting the others left them waiting in MPI's initialisation
/// until the launcher's timeout.)
#[test]
fn one_rank_refusing_its_command_line_ends_every_rank_at_once() {
    let Some(example) = dlrm_example() else {
        return;
    };
    let dir = std::env::temp_dir().join(format!("embers-mpi-flags-{}", std::process::id()));
    let out_dir = dir.join("out");
    let common = [
        "--synthetic-train",
        "2000",
        "--synthetic-eval",
        "500",
        "--epochs",
        "1",
        "--no-progress",
        "--out",
        out_dir.to_str().unwrap(),
    ];
    let with = |extra: &[&'static str]| -> Vec<String> {
        (extra.iter().copied())
            .chain(common.iter().copied())
            .map(String::from)
            .collect()
    };
    let missing_plan = dir.join("no-such-plan.json");
    let cases: [(Vec<String>, Vec<String>, &[&str]); 5] = [
        (
            with(&["--plan", "auto"]),
            with(&["--plan", "auto", "--shuffle-buffer", "4"]),
            &[
                "dlrm.flags failed on rank 1",
                "--shuffle-buffer applies to file data",
            ],
        ),
        (
            with(&["--plan", "auto"]),
            with(&["--plan", "auto", "--no-such-flag"]),
            &[
                "dlrm.flags failed on rank 1",
                "unexpected argument '--no-such-flag'",
            ],
        ),
        (
            with(&["--plan", "auto"]),
            [
                vec!["--plan".to_string(), missing_plan.display().to_string()],
                with(&[]),
            ]
            .concat(),
            &["plan.load failed on rank 1", "no-such-plan.json"],
        ),
        (
            [
                vec!["--plan".to_string(), missing_plan.display().to_string()],
                with(&[]),
            ]
            .concat(),
            with(&["--plan", "auto"]),
            &["no-such-plan.json", "rank 0 was given a plan file"],
        ),
        (
            with(&["--plan", "auto"]),
            [
                "--plan",
                "auto",
                "--data",
                "criteo-tsv",
                "--no-progress",
                "--out",
                out_dir.to_str().unwrap(),
            ]
            .map(String::from)
            .to_vec(),
            &["dlrm.data failed on rank 1", "needs --path"],
        ),
    ];
    for (rank0, rank1, expected) in &cases {
        let a: Vec<&str> = rank0.iter().map(String::as_str).collect();
        let b: Vec<&str> = rank1.iter().map(String::as_str).collect();
        let started = Instant::now();
        let (out, _) =
            launch_parts(&[(1, &example, &a), (1, &example, &b)], &[]).expect("mpiexec runs");
        let took = started.elapsed().as_secs_f64();
        let log = text(&out);
        assert!(!out.status.success(), "{log}");
        for e in *expected {
            assert!(log.contains(e), "{e:?} missing:\n{log}");
        }
        assert!(took < 60.0, "{took:.0} s: a rank waited\n{log}");
        assert!(!out_dir.join("checkpoint").exists(), "{log}");
    }
    let started = Instant::now();
    let (out, _) = launch(
        2,
        &example,
        &with(&[]).iter().map(String::as_str).collect::<Vec<_>>(),
    )
    .expect("mpiexec runs");
    let log = text(&out);
    assert!(!out.status.success(), "{log}");
    assert_eq!(
        log.matches("without --plan each would train").count(),
        2,
        "{log}"
    );
    assert!(started.elapsed().as_secs_f64() < 60.0, "{log}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A loss that is not finite on one rank (here its dense learning rate alone is absurd) ends
/// every rank at that step, before any backward spreads it (the rank that saw it stopped
/// after its step; the others waited in the next batch's collectives until the deadline).
#[test]
fn a_rank_whose_loss_diverges_ends_every_rank_at_that_step() {
    let Some(example) = dlrm_example() else {
        return;
    };
    let dir = std::env::temp_dir().join(format!("embers-mpi-diverge-{}", std::process::id()));
    let out_dir = dir.join("out");
    let common = [
        "--plan",
        "auto",
        "--synthetic-train",
        "20000",
        "--synthetic-eval",
        "500",
        "--no-progress",
        "--out",
        out_dir.to_str().unwrap(),
    ];
    let wild: Vec<&str> = common
        .iter()
        .copied()
        .chain(["--dense-lr", "1e30"])
        .collect();
    let started = Instant::now();
    let (out, _) =
        launch_parts(&[(1, &example, &common), (1, &example, &wild)], &[]).expect("mpiexec runs");
    let log = text(&out);
    assert!(!out.status.success(), "{log}");
    assert!(log.contains("train.loss failed on rank 1"), "{log}");
    assert!(log.contains("rank 1: the loss of step"), "{log}");
    assert!(started.elapsed().as_secs_f64() < 60.0, "{log}");
    assert!(!out_dir.join("checkpoint").exists(), "{log}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The DLRM example across processes (`--plan auto`, FP16/BF16 comms, pipelined, two tasks):
/// 60 steps straight (three epochs) and 30 + 30 resumed from the checkpoint (in the second
/// epoch; each epoch's reader is opened as the one before ends) end with the same dense half,
/// optimizer state, metrics state and tables, bit for bit; the checkpoint of 2 processes
/// resumes on 1. A resume one rank refuses (its flags choose other data, or it cannot read the
/// checkpoint) is refused by every rank at once, naming that rank.
#[test]
fn the_dlrm_example_trains_across_processes_and_resumes_bit_identically() {
    let Some(example) = dlrm_example() else {
        return;
    };
    let example = example.as_str();
    let dir = std::env::temp_dir().join(format!("embers-mpi-dlrm-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let (a, b) = (dir.join("a"), dir.join("b"));
    let (a, b) = (a.to_str().unwrap(), b.to_str().unwrap());
    // 20 steps an epoch on 2 ranks: the runs and the resume cross epochs.
    let common = [
        "--plan",
        "auto",
        "--synthetic-train",
        "10240",
        "--epochs",
        "4",
        "--synthetic-eval",
        "2000",
        "--validate-every",
        "30",
        "--validation-examples",
        "2000",
        "--no-progress",
        "--comm-precision",
        "fp16,bf16",
        "--batch-size",
        "256",
        "--synthetic-tasks",
        "2",
    ];
    let run = |ranks: usize, extra: &[&str]| {
        let args: Vec<&str> = common.iter().chain(extra).copied().collect();
        let (out, _) = launch(ranks, example, &args).expect("mpiexec runs");
        let log = text(&out);
        assert!(out.status.success(), "{log}");
        log
    };
    let log = run(2, &["--steps", "60", "--out", a]);
    assert!(log.contains("trained 60 steps on 2 ranks"), "{log}");
    assert!(log.contains("DLRM on 2 processes"), "{log}");
    assert!(log.contains("task task1: test AUC 0."), "{log}");
    run(2, &["--steps", "30", "--out", b]);
    let resume = format!("{b}/checkpoint");
    let log = run(2, &["--steps", "60", "--resume", &resume, "--out", b]);
    assert!(log.contains("trained 30 steps on 2 ranks"), "{log}");
    for (sub, prefix) in [("checkpoint", "rank"), ("checkpoint/tables", "rank-")] {
        let (x, y) = (dir.join("a").join(sub), dir.join("b").join(sub));
        assert!(
            tensors_of(&x, prefix) == tensors_of(&y, prefix),
            "{sub}/{prefix}*: the straight and the resumed run differ"
        );
    }
    // The resumed run's report goes back to step 0: the same history (validations at 30
    // and 60, train and validation metrics); it listed only those after the resume.
    let history = |d: &str| -> serde_json::Value {
        let m: serde_json::Value =
            serde_json::from_slice(&std::fs::read(format!("{d}/metrics.json")).unwrap()).unwrap();
        m["history"].clone()
    };
    assert_eq!(history(a).as_array().map(Vec::len), Some(2));
    assert!(history(a) == history(b), "{}\n{}", history(a), history(b));
    // On another world size: the tables reshard, the dense half comes from rank 0.
    let log = run(
        1,
        &[
            "--steps",
            "70",
            "--resume",
            &format!("{a}/checkpoint"),
            "--out",
            b,
        ],
    );
    assert!(
        log.contains("resumed a checkpoint of 2 ranks on 1"),
        "{log}"
    );
    assert!(log.contains("trained 10 steps on 1 ranks"), "{log}");

    let c = dir.join("c");
    let checkpoint = format!("{a}/checkpoint");
    let resumed: Vec<&str> = (common.iter().copied())
        .chain([
            "--steps",
            "70",
            "--resume",
            &checkpoint,
            "--out",
            c.to_str().unwrap(),
        ])
        .collect();
    // Rank 1 alone is given another --seed than the checkpoint's run had (other data), or
    // cannot read the checkpoint (its copy lacks rank 0's file or its own, as on a host that
    // does not share the directory).
    let without = |file: &str| {
        let partial = dir.join(format!("without-{file}"));
        std::fs::create_dir_all(&partial).unwrap();
        for e in std::fs::read_dir(&checkpoint).unwrap() {
            let e = e.unwrap();
            if e.file_type().unwrap().is_file() && e.file_name() != file {
                std::fs::copy(e.path(), partial.join(e.file_name())).unwrap();
            }
        }
        partial.to_str().unwrap().to_string()
    };
    let (no_rank0, no_own) = (without("rank0.safetensors"), without("rank1.safetensors"));
    let resuming = |from: &str| -> Vec<String> {
        (resumed.iter())
            .map(|&x| match x == checkpoint {
                true => from.to_string(),
                false => x.to_string(),
            })
            .collect()
    };
    let mut other_flags = resuming(&checkpoint);
    other_flags.extend(["--seed".to_string(), "7".to_string()]);
    // Another model configuration (the dense learning rate: it kept the checkpoint's).
    let mut other_model = resuming(&checkpoint);
    other_model.extend(["--dense-lr".to_string(), "0.5".to_string()]);
    for (other, says) in [
        (other_flags, "its run had --seed 0".to_string()),
        (
            other_model,
            "written for another model configuration".to_string(),
        ),
        (resuming(&no_rank0), format!("{no_rank0}/rank0.safetensors")),
        (resuming(&no_own), format!("{no_own}/rank1.safetensors")),
    ] {
        let other: Vec<&str> = other.iter().map(String::as_str).collect();
        let (out, _) = launch_parts(&[(1, example, &resumed[..]), (1, example, &other[..])], &[])
            .expect("mpiexec runs");
        let log = text(&out);
        assert!(!out.status.success(), "{log}");
        // (The ranks' messages may interleave, piece by piece.)
        assert!(log.contains(&says), "{log}");
        assert!(
            log.contains("rank 0: resume.read failed on rank 1"),
            "rank 0 did not learn of rank 1's refusal: {log}"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A plan whose kernels put tables behind caches (`fused_uvm_caching`, the planner's choice
/// under a kernel constraint) trains the DLRM example on 2 processes to the same tables,
/// optimizer state and dense half, bit for bit, as the same plan with every table `fused`;
/// the cached shards' rows live in files under `--cache-dir`, one per rank, and each batch's
/// rows are prefetched into the caches while the batch before trains (`--cache-prefetch`).
#[test]
fn the_dlrm_example_trains_a_plan_with_cached_tables_bit_identically() {
    let Some(example) = dlrm_example() else {
        return;
    };
    let example = example.as_str();
    let dir = std::env::temp_dir().join(format!("embers-mpi-cached-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let path = |name: &str| dir.join(name).to_str().unwrap().to_string();
    // The example's planner input, with every other table constrained to a cached kernel
    // (a GPU topology: TorchRec's planner offers no UVM kernels for CPU ranks).
    let out = Command::new(example)
        .args([
            "--write-planner-config",
            &path("config.json"),
            "--ranks",
            "2",
        ])
        .args(["--out", &path("config")])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let mut config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
    config["topology"]["compute_device"] = "cuda".into();
    for (i, table) in (config["tables"].as_array_mut().unwrap().iter_mut()).enumerate() {
        let kernel = if i % 2 == 0 {
            "fused_uvm_caching"
        } else {
            "fused"
        };
        table["constraints"] = serde_json::json!({
            "compute_kernels": [kernel],
            "sharding_types": ["table_wise", "row_wise"],
            "cache_load_factor": 0.1,
        });
    }
    let problem = embers_planner::Config::from_json(&config.to_string())
        .and_then(|c| c.resolve())
        .unwrap();
    let mut plan =
        embers_planner::plan_problem(&problem, embers_planner::CostModel::Torchrec).unwrap();
    let kernels = |p: &embers_planner::Plan| -> Vec<&'static str> {
        p.tables.iter().map(|t| t.compute_kernel.as_str()).collect()
    };
    assert!(
        kernels(&plan).contains(&"fused_uvm_caching"),
        "{:?}",
        kernels(&plan)
    );
    std::fs::write(dir.join("cached.json"), plan.to_json()).unwrap();
    for t in &mut plan.tables {
        t.compute_kernel = embers_planner::types::ComputeKernel::Fused;
    }
    std::fs::write(dir.join("fused.json"), plan.to_json()).unwrap();
    // 40 steps, then 20 more resumed from the checkpoint of the 40 (the cached shards' saved
    // row files loaded whole under the same plan).
    for (steps, trained, resume) in [("40", 40, false), ("60", 20, true)] {
        for name in ["fused", "cached"] {
            let (plan_path, out_path) = (path(&format!("{name}.json")), path(name));
            let rows_path = path(&format!("{name}-rows"));
            let checkpoint = path(&format!("{name}/checkpoint"));
            let mut args = vec![
                "--plan",
                &plan_path,
                "--steps",
                steps,
                "--synthetic-train",
                "40000",
                "--synthetic-eval",
                "2000",
                "--validation-examples",
                "2000",
                "--batch-size",
                "256",
                "--no-progress",
                "--out",
                &out_path,
                "--cache-dir",
                &rows_path,
            ];
            if name == "cached" {
                // Each batch's cached rows brought in while the batch before trains.
                args.push("--cache-prefetch");
            }
            if resume {
                args.extend(["--resume", &checkpoint]);
            }
            let (out, _) = launch(2, example, &args).expect("mpiexec runs");
            let log = text(&out);
            assert!(out.status.success(), "{log}");
            assert!(
                log.contains(&format!("trained {trained} steps on 2 ranks")),
                "{log}"
            );
            if name == "cached" {
                assert!(log.contains("fused_uvm_caching"), "{log}");
            }
        }
        for rank in 0..2 {
            let file = dir.join(format!("cached-rows/ebc-rank{rank}-group0.rows"));
            assert!(file.exists(), "{} missing", file.display());
        }
        assert!(
            !dir.join("fused-rows").exists(),
            "a fused plan wrote row files"
        );
        let (x, y) = (dir.join("fused/checkpoint"), dir.join("cached/checkpoint"));
        let (dense_x, dense_y) = (tensors_of(&x, "rank"), tensors_of(&y, "rank"));
        assert!(!dense_x.is_empty(), "no tensors in fused/checkpoint");
        assert!(
            dense_x == dense_y,
            "step {steps}: the dense halves of the cached and the fused plan differ"
        );
        // The cached plan's checkpoint keeps its cached shards as row files in parts
        // directories; read back, every table and its optimizer state equal the fused plan's,
        // bit for bit.
        let (tables_x, tables_y) = (
            tables_of_sharded(&x.join("tables")),
            tables_of_sharded(&y.join("tables")),
        );
        assert!(!tables_x.is_empty());
        for (name, want) in &tables_x {
            assert!(
                tables_y.get(name) == Some(want),
                "step {steps}, table {name}: the cached and the fused plan trained differently"
            );
        }
        assert_eq!(tables_x.len(), tables_y.len());
        let parts = (std::fs::read_dir(y.join("tables")).unwrap())
            .filter(|e| (e.as_ref().unwrap().file_name().to_string_lossy()).contains(".parts-"))
            .count();
        assert_eq!(parts, 2, "one parts directory per rank");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
