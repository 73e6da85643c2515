//! Shard rectangles per sharding type, exactly as TorchRec enumerates them.
//!
//! Row splits give every rank `ceil(rows / n)` rows until the rows run out, so trailing ranks
//! may get a short block or nothing (10 rows on 4 ranks: 3, 3, 3, 1). Column splits use the
//! smallest width >= the minimum partition (128 by default) that divides the dimension and is
//! a multiple of 4, falling back to the whole dimension.

use crate::types::ShardingType;

/// TorchRec's default smallest column block.
pub const MIN_CW_DIM: u64 = 128;

/// `[rows, cols]` sizes and `[row, col]` offsets of each shard.
pub type Rects = Vec<([u64; 2], [u64; 2])>;

/// Row blocks of `rows` over `n` devices.
pub fn row_blocks(rows: u64, n: usize) -> Vec<(u64, u64)> {
    let n = n.max(1) as u64;
    let block = rows.div_ceil(n);
    let mut out = Vec::with_capacity(n as usize);
    let mut offset = 0;
    for _ in 0..n {
        let size = block.min(rows - offset);
        out.push((size, offset));
        offset += size;
    }
    out
}

/// The column block width for a table of `dim` columns and a minimum partition.
pub fn column_block(dim: u64, min_partition: Option<u64>) -> u64 {
    let lower = min_partition.unwrap_or(MIN_CW_DIM);
    let base = (lower..dim)
        .find(|&w| dim % w == 0 && w % 4 == 0)
        .unwrap_or(dim);
    let block = base.min(dim);
    if dim % block != 0 {
        dim
    } else {
        block
    }
}

/// The shards of a `rows x dim` table under `sharding_type`.
pub fn shard_rects(
    rows: u64,
    dim: u64,
    sharding_type: ShardingType,
    world_size: usize,
    local_world_size: usize,
    min_partition: Option<u64>,
) -> Rects {
    match sharding_type {
        ShardingType::DataParallel => vec![([rows, dim], [0, 0]); world_size],
        ShardingType::TableWise => vec![([rows, dim], [0, 0])],
        ShardingType::RowWise => row_blocks(rows, world_size)
            .into_iter()
            .map(|(r, o)| ([r, dim], [o, 0]))
            .collect(),
        ShardingType::TableRowWise => row_blocks(rows, local_world_size)
            .into_iter()
            .map(|(r, o)| ([r, dim], [o, 0]))
            .collect(),
        ShardingType::ColumnWise | ShardingType::TableColumnWise => {
            let block = column_block(dim, min_partition);
            (0..dim / block)
                .map(|k| ([rows, block], [0, k * block]))
                .collect()
        }
        ShardingType::GridShard => {
            let block = column_block(dim, min_partition);
            let rb = row_blocks(rows, local_world_size);
            (0..dim / block)
                .flat_map(|k| rb.iter().map(move |&(r, o)| ([r, block], [o, k * block])))
                .collect()
        }
    }
}

/// How many shards [`shard_rects`] makes, without making them.
pub fn shard_count(
    dim: u64,
    sharding_type: ShardingType,
    world_size: usize,
    local_world_size: usize,
    min_partition: Option<u64>,
) -> u64 {
    let columns = || dim / column_block(dim, min_partition);
    match sharding_type {
        ShardingType::DataParallel | ShardingType::RowWise => world_size as u64,
        ShardingType::TableWise => 1,
        ShardingType::TableRowWise => local_world_size as u64,
        ShardingType::ColumnWise | ShardingType::TableColumnWise => columns(),
        ShardingType::GridShard => columns().saturating_mul(local_world_size as u64),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shard_counts_are_the_shards_made() {
        use ShardingType::*;
        for st in [
            DataParallel,
            TableWise,
            RowWise,
            TableRowWise,
            ColumnWise,
            TableColumnWise,
            GridShard,
        ] {
            for (rows, dim, w, lw, mp) in [
                (10, 512, 4, 2, None),
                (3, 200, 8, 8, Some(64)),
                (1, 8, 1, 1, Some(4)),
            ] {
                let made = shard_rects(rows, dim, st, w, lw, mp).len() as u64;
                assert_eq!(
                    shard_count(dim, st, w, lw, mp),
                    made,
                    "{st:?} {rows} {dim} {w} {lw} {mp:?}"
                );
            }
        }
    }

    #[test]
    fn rows_fill_prefix_ranks() {
        assert_eq!(row_blocks(10, 4), vec![(3, 0), (3, 3), (3, 6), (1, 9)]);
        assert_eq!(row_blocks(5, 4), vec![(2, 0), (2, 2), (1, 4), (0, 5)]);
        assert_eq!(row_blocks(3, 8).iter().map(|x| x.0).sum::<u64>(), 3);
    }

    #[test]
    fn column_blocks_follow_min_partition() {
        assert_eq!(column_block(80, Some(40)), 40);
        assert_eq!(column_block(256, Some(64)), 64);
        assert_eq!(column_block(10, None), 10);
        assert_eq!(column_block(512, None), 128);
        assert_eq!(column_block(200, Some(64)), 100);
        assert_eq!(column_block(130, Some(64)), 130);
    }
}
