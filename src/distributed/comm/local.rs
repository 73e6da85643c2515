//! A group of ranks inside one process (one thread each), exchanging blocks through shared
//! memory: the transport of single-process tests and of runs without MPI. A collective that a
//! rank does not join in time is an error naming the missing ranks.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use parking_lot::{Condvar, Mutex};

use super::{Comm, Transport, TransportError};
use crate::error::Result;

/// One round of an exchange: every rank deposits a block per destination, then every rank
/// takes its column.
struct Round {
    /// Exchanges completed so far.
    generation: u64,
    /// Per source rank, its blocks per destination (taken as they are read).
    deposits: Vec<Option<Vec<Vec<u8>>>>,
    deposited: usize,
    taken: usize,
    /// Sub-groups made by `split`, by (split number, color).
    groups: HashMap<(u64, usize), Arc<Shared>>,
    splits: u64,
}

struct Shared {
    size: usize,
    round: Mutex<Round>,
    changed: Condvar,
}

impl Shared {
    fn new(size: usize) -> Arc<Shared> {
        Arc::new(Shared {
            size,
            round: Mutex::new(Round {
                generation: 0,
                deposits: vec![None; size],
                deposited: 0,
                taken: 0,
                groups: HashMap::new(),
                splits: 0,
            }),
            changed: Condvar::new(),
        })
    }
}

/// One rank of an in-process group.
struct LocalTransport {
    rank: usize,
    shared: Arc<Shared>,
}

/// Builds the [`Comm`]s of `size` ranks in this process, one per thread.
pub struct LocalGroup;

impl LocalGroup {
    /// The communicators of a group of `size` ranks (hand rank `r` its element `r` in its own
    /// thread); an error when `EMBERS_DIST_TIMEOUT_S` is set to something that is not a
    /// deadline ([`default_timeout`](super::default_timeout)).
    pub fn comms(size: usize) -> Result<Vec<Comm>> {
        let shared = Shared::new(size.max(1));
        (0..size.max(1))
            .map(|rank| {
                Comm::new(Arc::new(LocalTransport {
                    rank,
                    shared: shared.clone(),
                }))
            })
            .collect()
    }
}

impl LocalTransport {
    /// Deposits `send` (one block per rank) and returns the block each rank deposited for
    /// this one.
    fn exchange(
        &self,
        send: Vec<Vec<u8>>,
        deadline: Instant,
    ) -> Result<Vec<Vec<u8>>, TransportError> {
        let shared = &self.shared;
        let w = shared.size;
        let mut round = shared.round.lock();
        // A rank that finished the last round early waits for it to drain.
        while round.deposited == w {
            if shared.changed.wait_until(&mut round, deadline).timed_out() {
                return Err(TransportError::Timeout {
                    missing: Vec::new(),
                });
            }
        }
        let generation = round.generation;
        round.deposits[self.rank] = Some(send);
        round.deposited += 1;
        if round.deposited == w {
            shared.changed.notify_all();
        }
        while round.deposited < w && round.generation == generation {
            if shared.changed.wait_until(&mut round, deadline).timed_out() {
                let missing = (0..w).filter(|&r| round.deposits[r].is_none()).collect();
                // Withdraw, so the others see this rank as missing too.
                round.deposits[self.rank] = None;
                round.deposited -= 1;
                return Err(TransportError::Timeout { missing });
            }
        }
        let recv: Vec<Vec<u8>> = (0..w)
            .map(|s| {
                let blocks = round.deposits[s].as_mut().expect("every rank deposited");
                std::mem::take(&mut blocks[self.rank])
            })
            .collect();
        round.taken += 1;
        if round.taken == w {
            round.deposits.iter_mut().for_each(|d| *d = None);
            round.deposited = 0;
            round.taken = 0;
            round.generation += 1;
            shared.changed.notify_all();
        }
        Ok(recv)
    }
}

/// Copies the blocks each rank sent here into `recv`, failing when a block is not of the size
/// this rank expected from it (MPI would truncate or fail).
fn receive(recv: &mut [u8], blocks: &[Vec<u8>], expected: &[usize]) -> Result<(), TransportError> {
    if let Some((s, (b, &n))) =
        (blocks.iter().zip(expected).enumerate()).find(|(_, (b, &n))| b.len() != n)
    {
        return Err(TransportError::Failed(format!(
            "rank {s} sent {} bytes, {n} expected",
            b.len()
        )));
    }
    let mut at = 0;
    for b in blocks {
        recv[at..at + b.len()].copy_from_slice(b);
        at += b.len();
    }
    Ok(())
}

impl Transport for LocalTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.shared.size
    }

    fn all_to_all_v(
        &self,
        send: &[u8],
        send_sizes: &[usize],
        recv: &mut [u8],
        recv_sizes: &[usize],
        deadline: Instant,
    ) -> Result<(), TransportError> {
        let mut at = 0;
        let blocks = (send_sizes.iter())
            .map(|&n| {
                at += n;
                send[at - n..at].to_vec()
            })
            .collect();
        let got = self.exchange(blocks, deadline)?;
        receive(recv, &got, recv_sizes)
    }

    fn all_gather_v(
        &self,
        send: &[u8],
        recv: &mut [u8],
        recv_sizes: &[usize],
        deadline: Instant,
    ) -> Result<(), TransportError> {
        let got = self.exchange(vec![send.to_vec(); self.shared.size], deadline)?;
        receive(recv, &got, recv_sizes)
    }

    fn split(&self, color: usize, deadline: Instant) -> Result<Arc<dyn Transport>, TransportError> {
        let w = self.shared.size;
        let mut all = vec![0u8; 8 * w];
        self.all_gather_v(
            &(color as u64).to_le_bytes(),
            &mut all,
            &vec![8; w],
            deadline,
        )?;
        let colors: Vec<usize> = (all.chunks_exact(8))
            .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")) as usize)
            .collect();
        let members: Vec<usize> = (0..colors.len()).filter(|&r| colors[r] == color).collect();
        let rank = members
            .iter()
            .position(|&r| r == self.rank)
            .expect("this rank is in its own color");
        let shared = {
            let mut round = self.shared.round.lock();
            // Every rank counts its splits alike, so (split number, color) names one group.
            let key = (round.splits / self.shared.size as u64, color);
            round.splits += 1;
            round
                .groups
                .entry(key)
                .or_insert_with(|| Shared::new(members.len()))
                .clone()
        };
        Ok(Arc::new(LocalTransport { rank, shared }))
    }

    fn needs_watchdog(&self) -> bool {
        false
    }

    fn abort(&self, code: i32) -> ! {
        std::process::exit(code)
    }
}
