//! One rank of the MPI tests (`tests/dist_mpi.rs` launches it with `mpiexec -n W`).
//!
//! ```text
//! embers-dist-worker <world> equivalence <case|all> <steps>   (pooled, then unpooled)
//! embers-dist-worker <world> kjt-all-to-all
//! embers-dist-worker <world> checkpoint <save|resume> <dir>
//! embers-dist-worker 2 pipeline
//! embers-dist-worker <world> fault <kill|pipeline-kill|stall|skip|plan|world> <timeout_s>
//! ```
//!
//! Prints `OK rank R ...` on success; errors go to stderr with exit code 1. Fault modes print
//! `FAULT rank R at <unix ms>` just before the fault so the test can time how long the other
//! ranks take to end.

#[path = "../../tests/support/dist_pipeline.rs"]
mod dist_pipeline;
#[path = "../../tests/support/dist_scenarios.rs"]
mod dist_scenarios;
#[path = "../../tests/support/dist_sequence.rs"]
mod dist_sequence;
#[path = "../../tests/support/kjt_docstring.rs"]
mod kjt_docstring;

use std::process::ExitCode;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use embers::distributed::{
    mpi_world, Comm, Placement, ShardedEmbeddingBagCollection, ShardingPlan, TrainPipeline,
};
use embers::sparse::KeyedJaggedTensor;

fn now_ms() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{e}");
            ExitCode::from(1)
        }
    }
}

fn run(args: &[String]) -> Result<(), String> {
    let usage = "usage: embers-dist-worker <world> equivalence <case|all> <steps> | \
                 kjt-all-to-all | checkpoint <save|resume> <dir> | pipeline | fault <kind> \
                 <timeout_s>";
    let world: usize = args.first().and_then(|w| w.parse().ok()).ok_or(usage)?;
    // Held for the whole run: MPI is finalised when the last communicator goes.
    let comm = mpi_world().map_err(|e| e.to_string())?;
    if comm.size() != world {
        return Err(format!(
            "launched as rank {} of {}, expected a world of {world} (is this mpiexec the MPI \
             embers was built against?)",
            comm.rank(),
            comm.size()
        ));
    }
    let rank = comm.rank();
    match args.get(1).map(String::as_str) {
        Some("equivalence") => {
            let which = args.get(2).ok_or(usage)?;
            let steps: usize = args.get(3).and_then(|s| s.parse().ok()).ok_or(usage)?;
            let cases: Vec<_> = (dist_scenarios::cases(world).into_iter())
                .filter(|c| which == "all" || &c.name == which)
                .collect();
            if cases.is_empty() {
                return Err(format!("no case `{which}`"));
            }
            for case in cases {
                let comm = mpi_world().map_err(|e| e.to_string())?;
                let report = dist_scenarios::run_case(comm, &case, steps)?;
                println!("OK rank {rank} {} pooled {report:?}", case.name);
                // This process's row files of the case (its directory is named by process).
                if !case.caches.dir.as_os_str().is_empty() && case.caches.dir.exists() {
                    std::fs::remove_dir_all(&case.caches.dir).map_err(|e| e.to_string())?;
                }
                // The same case for the unpooled collection.
                let comm = mpi_world().map_err(|e| e.to_string())?;
                let report = dist_sequence::run_ec_case(comm, &case, steps)?;
                println!("OK rank {rank} {} unpooled {report:?}", case.name);
                if !case.caches.dir.as_os_str().is_empty() && case.caches.dir.exists() {
                    std::fs::remove_dir_all(&case.caches.dir).map_err(|e| e.to_string())?;
                }
            }
            Ok(())
        }
        Some("kjt-all-to-all") => kjt_example(&comm),
        Some("pipeline") if world == 2 => pipeline(rank),
        Some("checkpoint") => {
            let dir = std::path::Path::new(args.get(3).ok_or(usage)?);
            checkpoint(comm, world, args.get(2).ok_or(usage)?, dir)
        }
        Some("fault") => {
            let kind = args.get(2).ok_or(usage)?;
            let timeout: f64 = args.get(3).and_then(|s| s.parse().ok()).ok_or(usage)?;
            fault(
                comm.with_timeout(Duration::from_secs_f64(timeout)),
                world,
                kind,
            )
        }
        _ => Err(usage.into()),
    }
}

/// The training pipeline across processes (its input distribution on a duplicated
/// communicator, on its own thread): rank 0 has 12 batches, rank 1 has 10; the pipelined and
/// the sequential run must both stop after 10 steps with the same losses and tables, bit for
/// bit.
fn pipeline(rank: usize) -> Result<(), String> {
    let e = |e: embers::Error| e.to_string();
    let mut outcomes = Vec::new();
    for pipelined in [false, true] {
        let comm = mpi_world().map_err(e)?;
        let n = if rank == 0 { 12 } else { 10 };
        let data = (0..n).map(|s| dist_pipeline::step(rank, s)).collect();
        let (outcome, report) = dist_pipeline::train(comm, pipelined, data).map_err(e)?;
        if report.steps != 10 {
            return Err(format!(
                "rank {rank}: pipelined={pipelined} trained {} steps, expected 10",
                report.steps
            ));
        }
        outcomes.push(outcome);
    }
    if outcomes[0] != outcomes[1] {
        return Err(format!(
            "rank {rank}: the pipelined run differs from the sequential one"
        ));
    }
    println!(
        "OK rank {rank} pipeline 10 steps, {} losses and {} tables bit-identical",
        outcomes[0].losses.len(),
        outcomes[0].tables.len()
    );
    Ok(())
}

/// `save`: trains the mixed row-wise Adagrad case for 3 steps (checked against the unsharded
/// run), saves it into `dir` and checks that the checkpoint loads into one unsharded collection
/// equal to the unsharded run. `resume`: loads `dir` under the row-wise plan of this world and
/// trains 3 more steps in step with an unsharded collection loaded from the same checkpoint.
fn checkpoint(comm: Comm, world: usize, mode: &str, dir: &std::path::Path) -> Result<(), String> {
    let e = |e: embers::Error| e.to_string();
    let rank = comm.rank();
    let rw_adagrad = embers::embedding::FusedOptimizer::RowWiseAdagrad { lr: 0.1, eps: 1e-8 };
    let trained = match mode {
        "save" => {
            let case = dist_scenarios::case(world, "mixed_adagrad").ok_or("no case")?;
            let trained = dist_scenarios::train(comm, &case, 0..3, None)?;
            trained.sharded.save(dir).map_err(e)?;
            dist_scenarios::load_whole_and_compare(dir, &trained.reference, rw_adagrad)
                .map_err(|m| format!("rank {rank}: {m}"))?;
            trained
        }
        "resume" => {
            let mut case = dist_scenarios::case(world, "row_wise").ok_or("no case")?;
            case.optimizer = rw_adagrad;
            dist_scenarios::train(comm, &case, 3..6, Some(dir))?
        }
        _ => return Err(format!("checkpoint mode `{mode}`: save or resume")),
    };
    let mut values = 0;
    for c in dist_scenarios::tables() {
        let got = trained.sharded.table_weights(&c.name).map_err(e)?;
        let want = trained.reference.table_weights(&c.name).map_err(e)?;
        dist_scenarios::compare(&format!("rank {rank}: {mode} {}", c.name), &got, &want)?;
        values += got.len();
    }
    println!("OK rank {rank} checkpoint {mode} {values} values");
    Ok(())
}

/// TorchRec's `KJTAllToAll` docstring example on 2 ranks: keys A, B to rank 0, C to rank 1.
/// Values are numbered `key·10 + index` (`A.V1` = 1, `B.V0` = 10, `C.V3` = 23).
fn kjt_example(comm: &Comm) -> Result<(), String> {
    kjt_docstring::check(comm)?;
    println!("OK rank {} kjt-all-to-all", comm.rank());
    Ok(())
}

/// Runs the mixed case and breaks it on rank 1 (`kill`: dies mid-step; `stall`: stops making
/// collectives; `skip`: skips a batch and goes on with the next) or breaks the setup on rank 1
/// (`plan`: another plan; `world`: a plan for another world size, on every rank).
fn fault(comm: Comm, world: usize, kind: &str) -> Result<(), String> {
    let e = |e: embers::Error| e.to_string();
    let rank = comm.rank();
    let case = dist_scenarios::case(world, "mixed").ok_or("no mixed case")?;
    let mut placements: Vec<(&str, Placement)> = (case.placements.iter())
        .map(|(n, p)| (n.as_str(), p.clone()))
        .collect();
    let mut plan_world = world;
    if kind == "plan" && rank == 1 {
        placements[1].1 = Placement::TableWise { rank: 0 };
    }
    if kind == "world" {
        plan_world = world + 1;
        placements = (placements.into_iter())
            .map(|(n, _)| (n, Placement::TableWise { rank: 0 }))
            .collect();
    }
    let plan = ShardingPlan::construct(
        &dist_scenarios::shapes(),
        &placements,
        plan_world,
        if plan_world % 2 == 0 {
            2.min(plan_world)
        } else {
            1
        },
    )
    .map_err(e)?;
    let sharded = ShardedEmbeddingBagCollection::new(
        dist_scenarios::tables(),
        &plan,
        case.optimizer,
        comm,
        dist_scenarios::SEED,
    )
    .map_err(e)?;
    if kind == "pipeline-kill" {
        // Rank 1 dies in its third step, with the pipeline's threads running.
        let pipeline = TrainPipeline::new(&sharded).map_err(e)?;
        let batches = (0..6).map(|step| {
            let batch = dist_scenarios::rank_batch(rank, step, case.batches[rank]);
            Ok(dist_scenarios::kjt_of(&[&batch], false))
        });
        let mut step = 0;
        pipeline
            .run(batches, |_: &KeyedJaggedTensor, pooled| {
                if rank == 1 && step == 2 {
                    println!("FAULT rank {rank} at {}", now_ms());
                    std::process::abort();
                }
                step += 1;
                pooled.values().sum_all()?.backward()
            })
            .map_err(e)?;
        println!("OK rank {rank} fault {kind}: no fault happened");
        return Ok(());
    }
    for step in 0..4 {
        let batch = dist_scenarios::rank_batch(rank, step, case.batches[rank]);
        let kjt = dist_scenarios::kjt_of(&[&batch], false);
        if rank == 1 && step == 2 {
            match kind {
                "stall" => {
                    println!("FAULT rank {rank} at {}", now_ms());
                    std::thread::sleep(Duration::from_secs(3600));
                }
                // Out of batches one step early (its last collective comes at the end).
                "skip" => continue,
                _ => {}
            }
        }
        let pooled = sharded.forward(&kjt).map_err(e)?;
        if rank == 1 && step == 2 && kind == "kill" {
            println!("FAULT rank {rank} at {}", now_ms());
            std::process::abort();
        }
        pooled
            .values()
            .sum_all()
            .map_err(e)?
            .backward()
            .map_err(e)?;
    }
    if rank == 1 && kind == "skip" {
        // The others now wait for a batch this rank never sends.
        println!("FAULT rank {rank} at {}", now_ms());
        return Ok(());
    }
    println!("OK rank {rank} fault {kind}: no fault happened");
    Ok(())
}
