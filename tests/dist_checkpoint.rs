//! Sharded checkpoints, in one process (ranks are threads over a `LocalGroup`): save under one
//! plan and world size, load under another or into one unsharded collection, and back; bad
//! checkpoints change nothing.

#[path = "support/config_edit.rs"]
mod config_edit;
#[path = "support/dist_scenarios.rs"]
mod dist_scenarios;

use std::path::{Path, PathBuf};
use std::time::Duration;

use dist_scenarios::{
    case, compare, kjt_of, load_whole_and_compare, rank_batch, sharded_of, state_of, tables, train,
};
use embers::distributed::{init_table, load_into_unsharded, Comm, LocalGroup, Placement};
use embers::embedding::{EmbeddingBagCollection, FusedOptimizer};
use embers::tensor::rng::seeded;

const RW_ADAGRAD: FusedOptimizer = FusedOptimizer::RowWiseAdagrad { lr: 0.1, eps: 1e-8 };

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("embers-dist-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Runs `f` on every rank of a `world`-rank group; panics with every rank's error.
fn on_ranks<T: Send>(world: usize, f: impl Fn(Comm) -> Result<T, String> + Sync) -> Vec<T> {
    let comms = LocalGroup::comms(world).expect("a local group");
    let results: Vec<Result<T, String>> = std::thread::scope(|s| {
        let handles: Vec<_> = (comms.into_iter())
            .map(|comm| comm.with_timeout(Duration::from_secs(20)))
            .map(|comm| s.spawn(|| f(comm)))
            .collect();
        (handles.into_iter())
            .map(|h| h.join().unwrap_or_else(|_| Err("rank panicked".into())))
            .collect()
    });
    let errors: Vec<String> = (results.iter().enumerate())
        .filter_map(|(r, x)| x.as_ref().err().map(|e| format!("rank {r}: {e}")))
        .collect();
    assert!(errors.is_empty(), "{}", errors.join("\n"));
    results.into_iter().map(|r| r.unwrap()).collect()
}

fn e(e: embers::Error) -> String {
    e.to_string()
}

fn fresh(optimizer: FusedOptimizer) -> EmbeddingBagCollection {
    EmbeddingBagCollection::new(tables(), optimizer, &mut seeded(77)).unwrap()
}

/// Train on 4 ranks (2 hosts of 2) under a mixed plan with row-wise Adagrad, save; the
/// checkpoint loads into one unsharded collection equal to the unsharded run (weights and
/// optimizer state), and training resumes on 2 ranks under other plans in step with the
/// unsharded collection resumed from the same checkpoint.
#[test]
fn train_on_four_ranks_resume_on_two_or_one() {
    let dir = temp_dir("resume");
    let four = case(4, "mixed_adagrad").unwrap();
    let refs = on_ranks(4, |comm| {
        let trained = train(comm, &four, 0..3, None)?;
        trained.sharded.save(&dir).map_err(e)?;
        // Any rank can serve the whole model from the checkpoint.
        let (whole, report) = load_whole_and_compare(&dir, &trained.reference, RW_ADAGRAD)?;
        assert!(report.approximated_row_state.is_empty(), "{report:?}");
        for c in tables() {
            let want = state_of(&trained.reference, &c.name)?;
            assert_eq!(want.len(), 1, "row-wise Adagrad keeps one state");
            assert!(want[0].iter().any(|&v| v > 0.0), "{} was trained", c.name);
        }
        assert_eq!(whole.tbes()[0].step(), 3);
        trained.reference.table_weights("t2").map_err(e)
    });
    assert!(refs.windows(2).all(|w| w[0] == w[1]));
    // Resharding: 4 ranks → 2, other layouts (no column blocks: with row-wise Adagrad each
    // block keeps its own statistic, so those do not train like the whole table).
    for name in ["row_wise", "table_wise", "table_row_wise", "mixed"] {
        let mut two = case(2, name).unwrap();
        two.optimizer = RW_ADAGRAD;
        if name == "mixed" {
            two.placements[3].1 = Placement::TableWise { rank: 1 };
        }
        let tables_checked = on_ranks(2, |comm| {
            let trained = train(comm, &two, 3..6, Some(&dir))?;
            let mut n = 0;
            for c in tables() {
                let got = trained.sharded.table_weights(&c.name).map_err(e)?;
                let want = trained.reference.table_weights(&c.name).map_err(e)?;
                compare(&format!("{name}: table {}", c.name), &got, &want)?;
                n += got.len();
            }
            assert_eq!(trained.report.predictions, 3 * two.batches[trained.rank]);
            Ok(n)
        });
        assert!(tables_checked.iter().all(|&n| n > 0));
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// An unsharded collection's checkpoint loads into column blocks (the per-row state split,
/// reported), and the blocks' checkpoint loads back into one collection unchanged.
#[test]
fn unsharded_file_to_column_blocks_and_back() {
    let dir = temp_dir("columns");
    let file = dir.join("whole.safetensors");
    let whole = fresh(RW_ADAGRAD);
    for c in tables() {
        whole
            .set_table_weights(&c.name, &init_table(&c, 5).unwrap())
            .unwrap();
    }
    for step in 0..2 {
        let batch = rank_batch(0, step, 6);
        let pooled = whole.forward(&kjt_of(&[&batch], false)).unwrap();
        pooled.values().sum_all().unwrap().backward().unwrap();
    }
    whole.save(&file).unwrap();
    let columns = case(2, "column_wise").unwrap();
    let blocks = dir.join("blocks");
    on_ranks(2, |comm| {
        let mut columns = columns.clone();
        columns.optimizer = RW_ADAGRAD;
        let s = sharded_of(comm, &columns)?;
        let report = s.load(&file).map_err(e)?;
        let mut split = report.approximated_row_state.clone();
        split.sort();
        // Every table is in two column blocks; this rank holds blocks of these tables.
        let mut held: Vec<String> = (tables().into_iter())
            .filter(|c| !s.local_shards(&c.name).unwrap().is_empty())
            .map(|c| c.name)
            .collect();
        held.sort();
        assert_eq!(split, held);
        for c in tables() {
            let got = s.table_weights(&c.name).map_err(e)?;
            assert_eq!(got, whole.table_weights(&c.name).map_err(e)?, "{}", c.name);
        }
        s.save(&blocks).map_err(e)
    });
    // Each block got the whole row's statistic; merging equal blocks gives it back exactly.
    let back = fresh(RW_ADAGRAD);
    let report = load_into_unsharded(&back, &blocks).unwrap();
    assert!(report.approximated_row_state.is_empty());
    for c in tables() {
        assert_eq!(
            back.table_weights(&c.name).unwrap(),
            whole.table_weights(&c.name).unwrap()
        );
        let (got, want) = (
            state_of(&back, &c.name).unwrap(),
            state_of(&whole, &c.name).unwrap(),
        );
        compare(&format!("state of {}", c.name), &got[0], &want[0]).unwrap();
    }
    assert_eq!(back.tbes()[0].step(), 2);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Column blocks trained with row-wise Adagrad (each block its own per-row statistic): the
/// unsharded load holds each row's width-weighted mean of its blocks' statistics.
#[test]
fn column_blocks_merge_their_row_statistics() {
    let dir = temp_dir("merge");
    let mut columns = case(2, "column_wise").unwrap();
    columns.optimizer = RW_ADAGRAD;
    let blocks = on_ranks(2, |comm| {
        let s = sharded_of(comm, &columns)?;
        for step in 0..3 {
            let batch = rank_batch(s.comm().rank(), step, 5);
            let pooled = s.forward(&kjt_of(&[&batch], false)).map_err(e)?;
            let squares = pooled.values().mul(pooled.values()).map_err(e)?;
            squares.sum_all().map_err(e)?.backward().map_err(e)?;
        }
        s.save(&dir).map_err(e)?;
        Ok((tables().iter())
            .map(|c| s.local_shards(&c.name).unwrap())
            .collect::<Vec<_>>())
    });
    let whole = fresh(RW_ADAGRAD);
    load_into_unsharded(&whole, &dir).unwrap();
    for (t, c) in tables().iter().enumerate() {
        let mut want = vec![0.0f32; c.num_embeddings];
        let mut weights = vec![0.0f32; c.num_embeddings * c.embedding_dim];
        for shard in blocks.iter().flat_map(|rank| &rank[t]) {
            assert_eq!(shard.states.len(), 1);
            let share = shard.cols as f32 / c.embedding_dim as f32;
            for r in 0..shard.rows {
                want[shard.row_offset + r] += share * shard.states[0].1[r];
                let (from, to) = (r * shard.cols, (shard.row_offset + r) * c.embedding_dim);
                weights[to + shard.col_offset..to + shard.col_offset + shard.cols]
                    .copy_from_slice(&shard.values[from..from + shard.cols]);
            }
        }
        assert!(want.iter().any(|&v| v > 0.0), "{} was trained", c.name);
        compare(&c.name, &state_of(&whole, &c.name).unwrap()[0], &want).unwrap();
        assert_eq!(whole.table_weights(&c.name).unwrap(), weights, "{}", c.name);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
    }
}

/// A missing manifest, a truncated rank file, a step past 2^63, a rank file outside the
/// checkpoint, another optimizer, other tables, a save into a file: each is an error on every
/// rank that names it, and the tables stay as they were. Files of an unfinished save are
/// ignored by loads and removed by the next save.
#[test]
fn bad_checkpoints_change_nothing() {
    let dir = temp_dir("bad");
    let good = dir.join("good");
    let mixed = case(2, "mixed").unwrap();
    on_ranks(2, |comm| {
        let s = sharded_of(comm, &mixed)?;
        let batch = rank_batch(s.comm().rank(), 0, 4);
        let pooled = s.forward(&kjt_of(&[&batch], false)).map_err(e)?;
        pooled
            .values()
            .sum_all()
            .map_err(e)?
            .backward()
            .map_err(e)?;
        s.save(&good).map_err(e)
    });
    let names: Vec<String> = (std::fs::read_dir(&good).unwrap())
        .map(|x| x.unwrap().file_name().to_string_lossy().to_string())
        .collect();
    let rank1 = names
        .iter()
        .find(|n| n.starts_with("rank-1-of-2."))
        .unwrap();
    let truncated = dir.join("truncated");
    copy_dir(&good, &truncated);
    let len = std::fs::metadata(truncated.join(rank1)).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(truncated.join(rank1))
        .unwrap()
        .set_len(len / 2)
        .unwrap();
    let stepped = dir.join("stepped");
    copy_dir(&good, &stepped);
    let manifest = stepped.join("manifest.safetensors");
    config_edit::rewrite_metadata(&manifest, "step", |_| u64::MAX.to_string());
    // A manifest naming a rank file outside its directory.
    let outside = dir.join("outside");
    copy_dir(&good, &outside);
    let manifest = outside.join("manifest.safetensors");
    config_edit::rewrite_metadata(&manifest, "files", |v| {
        v.replacen("rank-0", "../good/rank-0", 1)
    });
    let empty = temp_dir("bad-empty");
    let a_file = dir.join("a-file");
    std::fs::write(&a_file, b"keep me").unwrap();

    on_ranks(2, |comm| {
        let rank = comm.rank();
        let s = sharded_of(comm, &mixed)?;
        let before: Vec<Vec<f32>> = (tables().iter())
            .map(|c| s.table_weights(&c.name).unwrap())
            .collect();
        let unchanged = |what: &str| {
            for (c, b) in tables().iter().zip(&before) {
                assert_eq!(&s.table_weights(&c.name).unwrap(), b, "{what}: {}", c.name);
            }
        };
        let err = s.load(&empty).unwrap_err().to_string();
        assert!(err.contains("no manifest"), "{err}");
        unchanged("empty directory");
        let err = s.load(&truncated).unwrap_err().to_string();
        if rank == 1 {
            assert!(err.contains(rank1.as_str()), "rank 1 names its file: {err}");
        } else {
            assert!(err.contains("rank 1"), "rank 0 names rank 1: {err}");
        }
        unchanged("truncated rank file");
        let err = s.load(&stepped).unwrap_err().to_string();
        assert!(err.contains("not a count below 2^63"), "{err}");
        unchanged("a step past 2^63");
        let err = s.load(&outside).unwrap_err().to_string();
        assert!(
            err.contains("`../good/rank-0") && err.contains("not a file name"),
            "{err}"
        );
        unchanged("a rank file outside the checkpoint");
        let err = s.save(&a_file).unwrap_err().to_string();
        assert!(err.contains("a-file"), "{err}");
        Ok(())
    });
    assert_eq!(std::fs::read(&a_file).unwrap(), b"keep me");

    // Another optimizer; other tables (t2 with more rows than saved).
    on_ranks(2, |comm| {
        let mut adagrad = mixed.clone();
        adagrad.optimizer = RW_ADAGRAD;
        let s = sharded_of(comm, &adagrad)?;
        let err = s.load(&good).unwrap_err().to_string();
        assert!(err.contains("optimizer"), "{err}");
        Ok(())
    });
    let mut bigger = tables();
    bigger[2].num_embeddings = 35;
    let whole =
        EmbeddingBagCollection::new(bigger, FusedOptimizer::Sgd { lr: 0.1 }, &mut seeded(3))
            .unwrap();
    let before = whole.table_weights("t2").unwrap();
    let err = load_into_unsharded(&whole, &good).unwrap_err().to_string();
    assert!(err.contains("`t2` was saved as 30 × "), "{err}");
    assert_eq!(whole.table_weights("t2").unwrap(), before);
    // Fewer rows than saved: refused too (the rows past the target's were
    // left unread, and the load reported success).
    let mut smaller = tables();
    smaller[2].num_embeddings = 25;
    let whole =
        EmbeddingBagCollection::new(smaller, FusedOptimizer::Sgd { lr: 0.1 }, &mut seeded(3))
            .unwrap();
    let before = whole.table_weights("t2").unwrap();
    let err = load_into_unsharded(&whole, &good).unwrap_err().to_string();
    assert!(
        err.contains("`t2` was saved as 30 × ") && err.contains("is 25 × "),
        "{err}"
    );
    assert_eq!(whole.table_weights("t2").unwrap(), before);
    // A rectangle listed twice (its overlap could hide a gap elsewhere): refused.
    let twice = dir.join("twice");
    copy_dir(&good, &twice);
    config_edit::rewrite_metadata(&twice.join("manifest.safetensors"), "rects.0", |v| {
        let mut listed: Vec<serde_json::Value> = serde_json::from_str(v).unwrap();
        listed.push(listed[0].clone());
        serde_json::to_string(&listed).unwrap()
    });
    let whole = EmbeddingBagCollection::new(tables(), mixed.optimizer, &mut seeded(3)).unwrap();
    let err = load_into_unsharded(&whole, &twice).unwrap_err().to_string();
    assert!(err.contains("overlap"), "{err}");

    // A listed rectangle of no rows, of any width, holds nothing: loading past it into tables
    // cached in files (which read a few rows at a time, by the widest rectangle met) reads
    // what the others hold.
    let zero = dir.join("zero");
    copy_dir(&good, &zero);
    let manifest = zero.join("manifest.safetensors");
    let files = (embers::checkpoint::CheckpointReader::open(&manifest).unwrap())
        .required_metadata("files")
        .unwrap()
        .to_string();
    let first = files.split(',').next().unwrap();
    config_edit::add_to(&zero.join(first), |w| {
        w.add::<f32>("t0@5,0.weight", &[0, 1 << 62], &[]).unwrap();
    });
    config_edit::rewrite_metadata(&manifest, "rects.0", |v| {
        let mut listed: Vec<serde_json::Value> = serde_json::from_str(v).unwrap();
        listed.push(serde_json::json!(["t0", 5, 0, 0, 1u64 << 62]));
        serde_json::to_string(&listed).unwrap()
    });
    let cached_from = |from: &Path, name: &str| {
        let placement = embers::embedding::Placement::Cached {
            dir: dir.join(name),
            size: embers::embedding::CacheSize::LoadFactor(0.3),
            policy: embers::embedding::CachePolicy::Lru,
        };
        let ebc = EmbeddingBagCollection::with_placement(
            tables(),
            mixed.optimizer,
            &placement,
            &mut seeded(7),
        )
        .unwrap();
        load_into_unsharded(&ebc, from).map(|_| ebc)
    };
    let want = cached_from(&good, "cached-good").unwrap();
    let got = cached_from(&zero, "cached-zero").unwrap();
    for c in tables() {
        let weights = |ebc: &EmbeddingBagCollection| ebc.table_weights(&c.name).unwrap();
        assert_eq!(weights(&got), weights(&want), "{}", c.name);
    }

    // An unfinished save's file is ignored, then removed by the next save.
    let stale = good.join("rank-0-of-2.00000000deadbeef.safetensors");
    std::fs::write(&stale, b"half written").unwrap();
    on_ranks(2, |comm| {
        let s = sharded_of(comm, &mixed)?;
        s.load(&good).map_err(e)?;
        s.save(&good).map_err(e)
    });
    assert!(!stale.exists());
    let files = std::fs::read_dir(&good).unwrap().count();
    assert_eq!(
        files, 4,
        "the manifest, one file per rank and the saves' lock"
    );
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(&empty);
}

/// Copies directory `from` into `to`, subdirectories included.
fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        if entry.file_type().unwrap().is_dir() {
            copy_tree(&entry.path(), &to.join(entry.file_name()));
        } else {
            std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
        }
    }
}

/// A shard's name (`<table>@<row>,<col>`), values and optimizer state by name.
type ShardState = (String, Vec<f32>, Vec<(&'static str, Vec<f32>)>);

/// Every table's shards on this rank: values and optimizer state.
fn shards_of(s: &embers::distributed::ShardedEmbeddingBagCollection) -> Vec<ShardState> {
    let mut out = Vec::new();
    for c in tables() {
        for v in s.local_shards(&c.name).unwrap() {
            let name = format!("{}@{},{}", c.name, v.row_offset, v.col_offset);
            out.push((name, v.values, v.states));
        }
    }
    out
}

/// The inode of every file in `dir`.
fn inodes(dir: &Path) -> Vec<(String, u64)> {
    use std::os::unix::fs::MetadataExt;
    let mut out: Vec<(String, u64)> = (std::fs::read_dir(dir).unwrap())
        .map(|x| x.unwrap())
        .map(|x| {
            let name = x.file_name().to_string_lossy().to_string();
            (name, x.metadata().unwrap().ino())
        })
        .collect();
    out.sort();
    out
}

/// Shards whose tables are cached in files are saved as their row files (copied into a parts
/// directory beside each rank file, never read into memory) and load under any layout: under
/// the same plan the saved row files become the shards' own (whole, bit for bit); under another
/// plan, into tables in memory or into other caches, and into one unsharded collection, only
/// the rows each rectangle needs are read (into other caches: their row files written a few
/// rows at a time). A flipped byte in a saved row file is refused as
/// corrupt and changes nothing; a later save removes the earlier one's parts. An unsharded
/// collection's checkpoint of cached tables loads into a sharded one too.
#[test]
fn cached_shards_are_saved_as_their_row_files_and_load_under_any_layout() {
    let dir = temp_dir("cached");
    let saved = dir.join("saved");
    let mut files = case(2, "row_wise_cached_files").unwrap();
    files.optimizer = RW_ADAGRAD;
    let trained = on_ranks(2, |comm| {
        let trained = train(comm, &files, 0..3, None)?;
        trained.sharded.save(&saved).map_err(e)?;
        // Into memory, from the row files.
        let (_, report) = load_whole_and_compare(&saved, &trained.reference, RW_ADAGRAD)?;
        assert!(report.approximated_row_state.is_empty(), "{report:?}");
        Ok(shards_of(&trained.sharded))
    });
    // The rank files hold no table: each names its parts directory, one cached group in it.
    let mut rank_files = 0;
    for entry in std::fs::read_dir(&saved).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        if !(name.starts_with("rank-") && name.ends_with(".safetensors")) {
            continue;
        }
        rank_files += 1;
        let r = embers::checkpoint::CheckpointReader::open(&path).unwrap();
        assert!(r.names().is_empty(), "{name} holds {:?}", r.names());
        let parts = r.parts_dir().unwrap().expect("a parts directory");
        assert!(parts.join("group0/manifest.json").is_file(), "{parts:?}");
    }
    assert_eq!(rank_files, 2);

    // The same plan: the saved row files replace the shards' own (new files: new inodes),
    // bit for bit; then training resumes in step with the unsharded collection.
    on_ranks(2, |comm| {
        let rank = comm.rank();
        let s = sharded_of(comm, &files)?;
        s.comm().barrier("built").map_err(e)?;
        let before = inodes(&files.caches.dir);
        s.comm().barrier("looked").map_err(e)?;
        s.load(&saved).map_err(e)?;
        s.comm().barrier("loaded").map_err(e)?;
        let after = inodes(&files.caches.dir);
        assert_eq!(before.len(), after.len(), "{before:?} / {after:?}");
        for (b, a) in before.iter().zip(&after) {
            assert_eq!(b.0, a.0);
            assert_ne!(b.1, a.1, "{} was not replaced by the saved rows", b.0);
        }
        assert!(
            shards_of(&s) == trained[rank],
            "rank {rank}: other values after the load"
        );
        Ok(())
    });
    on_ranks(2, |comm| {
        train(comm, &files, 3..5, Some(&saved)).map(|_| ())
    });

    // Other plans: in memory (row-wise), and other caches over host memory (mixed).
    let mut row_wise = case(2, "row_wise").unwrap();
    row_wise.optimizer = RW_ADAGRAD;
    let mixed_cached = case(2, "mixed_cached").unwrap();
    let again = dir.join("again");
    for other in [&row_wise, &mixed_cached] {
        on_ranks(2, |comm| {
            let trained = train(comm, other, 3..5, Some(&saved))?;
            if other.name == "mixed_cached" {
                // ... whose own checkpoint (cached and uncached shards) loads whole too.
                trained.sharded.save(&again).map_err(e)?;
                load_whole_and_compare(&again, &trained.reference, RW_ADAGRAD)?;
            }
            Ok(())
        });
    }

    // A flipped byte in rank 1's saved row file: refused by the reading ranks, nothing changed.
    let corrupt = dir.join("corrupt");
    copy_tree(&saved, &corrupt);
    let parts = std::fs::read_dir(&corrupt)
        .unwrap()
        .map(|x| x.unwrap().path())
        .find(|p| p.is_dir() && p.to_string_lossy().contains("rank-1-of-2."))
        .unwrap();
    let rows_file = std::fs::read_dir(parts.join("group0"))
        .unwrap()
        .map(|x| x.unwrap().path())
        .find(|p| p.extension().is_some_and(|x| x == "bin"))
        .unwrap();
    let mut bytes = std::fs::read(&rows_file).unwrap();
    bytes[100] ^= 0x40;
    std::fs::write(&rows_file, bytes).unwrap();
    on_ranks(2, |comm| {
        let rank = comm.rank();
        let s = sharded_of(comm, &files)?;
        let before = shards_of(&s);
        let err = s.load(&corrupt).unwrap_err().to_string();
        if rank == 1 {
            assert!(err.contains("corrupt"), "{err}");
        } else {
            assert!(err.contains("rank 1"), "rank 0 names rank 1: {err}");
        }
        assert!(
            shards_of(&s) == before,
            "rank {rank}: changed by a refused load"
        );
        // The copy staged beside the shards' row files went with the refusal (on every rank:
        // all have returned).
        s.comm().barrier("refused").map_err(e)?;
        let left: Vec<String> = (std::fs::read_dir(&files.caches.dir).unwrap())
            .map(|x| x.unwrap().file_name().to_string_lossy().to_string())
            .filter(|n| n.contains("restore"))
            .collect();
        assert!(left.is_empty(), "{left:?}");
        Ok(())
    });
    // A group whose manifest names its table for another table: refused by name.
    let renamed = dir.join("renamed");
    copy_tree(&saved, &renamed);
    let parts = std::fs::read_dir(&renamed)
        .unwrap()
        .map(|x| x.unwrap().path())
        .find(|p| p.is_dir() && p.to_string_lossy().contains("rank-0-of-2."))
        .unwrap();
    let manifest = parts.join("group0/manifest.json");
    let text = std::fs::read_to_string(&manifest).unwrap();
    let mut m: serde_json::Value = serde_json::from_str(&text).unwrap();
    let name = m["tables"][0]["name"].as_str().unwrap().to_string();
    m["tables"][0]["name"] = format!("other{name}").into();
    std::fs::write(&manifest, m.to_string()).unwrap();
    let err = load_into_unsharded(&fresh(RW_ADAGRAD), &renamed)
        .unwrap_err()
        .to_string();
    assert!(err.contains("named for"), "{err}");
    let whole = fresh(RW_ADAGRAD);
    let before = whole.table_weights("t0").unwrap();
    let err = load_into_unsharded(&whole, &corrupt)
        .unwrap_err()
        .to_string();
    assert!(err.contains("corrupt"), "{err}");
    assert_eq!(whole.table_weights("t0").unwrap(), before);

    // A second save into the same directory leaves only its own parts directories.
    on_ranks(2, |comm| {
        let s = sharded_of(comm, &files)?;
        s.load(&saved).map_err(e)?;
        s.save(&saved).map_err(e)
    });
    let parts_dirs: Vec<String> = (std::fs::read_dir(&saved).unwrap())
        .map(|x| x.unwrap().path())
        .filter(|p| p.is_dir())
        .map(|p| p.file_name().unwrap().to_string_lossy().to_string())
        .collect();
    assert_eq!(parts_dirs.len(), 2, "{parts_dirs:?}");

    // An unsharded collection of cached tables: its checkpoint loads into shards in memory,
    // and into another cached collection.
    let placement = |name: &str| embers::embedding::Placement::Cached {
        dir: dir.join(name),
        size: embers::embedding::CacheSize::LoadFactor(0.3),
        policy: embers::embedding::CachePolicy::Lru,
    };
    let cached = EmbeddingBagCollection::with_placement(
        tables(),
        RW_ADAGRAD,
        &placement("ebc"),
        &mut seeded(5),
    )
    .unwrap();
    for step in 0..2 {
        let batch = rank_batch(0, step, 6);
        let pooled = cached.forward(&kjt_of(&[&batch], false)).unwrap();
        pooled.values().sum_all().unwrap().backward().unwrap();
    }
    let file = dir.join("ebc.safetensors");
    cached.save(&file).unwrap();
    for layout in [&row_wise, &files] {
        // (Into shards cached in files: their new row files written a few rows at a time.)
        on_ranks(2, |comm| {
            let s = sharded_of(comm, layout)?;
            s.load(&file).map_err(e)?;
            for c in tables() {
                let got = s.table_weights(&c.name).map_err(e)?;
                assert_eq!(got, cached.table_weights(&c.name).unwrap(), "{}", c.name);
                let want = state_of(&cached, &c.name)?;
                for shard in s.local_shards(&c.name).map_err(e)? {
                    let rows = shard.row_offset..shard.row_offset + shard.rows;
                    assert_eq!(shard.states[0].1[..], want[0][rows], "{}", c.name);
                }
            }
            Ok(())
        });
    }
    let other = EmbeddingBagCollection::with_placement(
        tables(),
        RW_ADAGRAD,
        &placement("ebc-other"),
        &mut seeded(6),
    )
    .unwrap();
    load_into_unsharded(&other, &file).unwrap();
    for c in tables() {
        assert_eq!(
            other.table_weights(&c.name).unwrap(),
            cached.table_weights(&c.name).unwrap()
        );
        assert_eq!(state_of(&other, &c.name), state_of(&cached, &c.name));
    }
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(&files.caches.dir);
}

/// A save into a directory another save holds (its lock, `<dir>/.lock`) is refused on every
/// rank, naming the directory, and writes nothing (two saves at once each removed the other's
/// files as garbage); once the lock is released the save goes through.
#[test]
fn a_save_into_a_locked_directory_is_refused_on_every_rank() {
    let dir = temp_dir("locked");
    let mixed = case(2, "mixed").unwrap();
    let held = embers::distributed::lock_checkpoint_dir(&dir).unwrap();
    // The lock is exclusive: a second holder is refused too.
    let again = embers::distributed::lock_checkpoint_dir(&dir)
        .unwrap_err()
        .to_string();
    assert!(again.contains("is locked"), "{again}");
    let errors = on_ranks(2, |comm| {
        let s = sharded_of(comm, &mixed)?;
        Ok(s.save(&dir).map_err(e).unwrap_err())
    });
    assert!(
        errors[0].contains("is locked") && errors[0].contains("another save"),
        "{}",
        errors[0]
    );
    assert!(errors[1].contains("rank 0 could not lock"), "{}", errors[1]);
    let written: Vec<String> = (std::fs::read_dir(&dir).unwrap())
        .map(|x| x.unwrap().file_name().to_string_lossy().to_string())
        .filter(|n| n != ".lock")
        .collect();
    assert!(written.is_empty(), "{written:?}");
    drop(held);
    on_ranks(2, |comm| sharded_of(comm, &mixed)?.save(&dir).map_err(e));
    assert!(dir.join("manifest.safetensors").exists());
    let _ = std::fs::remove_dir_all(&dir);
}
