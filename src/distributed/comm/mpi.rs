//! The MPI transport (feature `mpi`): `MPI_COMM_WORLD` and the groups split from it, through
//! rsmpi. MPI is initialised with `MPI_THREAD_MULTIPLE` on the first [`mpi_world`] call and
//! finalised when the last communicator built on it is dropped.
//!
//! A blocked MPI call cannot return at a deadline, so the [`Comm`] arms a watchdog thread for
//! each collective that aborts the whole job (`MPI_Abort`, exit code 75) with a message naming
//! the rank, the op and its number.

use std::sync::{Arc, Weak};
use std::time::Instant;

use mpi::datatype::{Partition, PartitionMut};
use mpi::environment::Universe;
use mpi::topology::{Color, SimpleCommunicator};
use mpi::traits::*;
use mpi::{Count, Threading};
use parking_lot::Mutex;

use super::{Comm, Transport, TransportError};
use crate::error::{Error, Result};

/// The initialised MPI library; dropping it finalises MPI.
struct MpiEnv {
    _universe: Universe,
}

// SAFETY: MPI was initialised with MPI_THREAD_MULTIPLE (checked in `mpi_world`), so MPI may be
// called from any thread; `Universe` only holds plain data besides that.
unsafe impl Send for MpiEnv {}
// SAFETY: as above; `MpiEnv` offers no methods, it only finalises MPI on drop.
unsafe impl Sync for MpiEnv {}

/// The live MPI library, while a communicator uses it.
static ENV: Mutex<Option<Weak<MpiEnv>>> = Mutex::new(None);

/// `MPI_COMM_WORLD` as a [`Comm`], initialising MPI (with `MPI_THREAD_MULTIPLE`) on the first
/// call. MPI is finalised when every communicator built on it is gone; it cannot be started
/// again after that.
///
/// Run under `mpiexec`; a process started without it is a world of one. A collective: every
/// rank calls it (the ranks agree on their `EMBERS_DIST_TIMEOUT_S` here).
pub fn mpi_world() -> Result<Comm> {
    let mut slot = ENV.lock();
    let env = match slot.as_ref().and_then(Weak::upgrade) {
        Some(env) => env,
        None => {
            if mpi::environment::is_finalized() {
                return Err(Error::Distributed(
                    "MPI was finalised (every communicator was dropped); it cannot be \
                     initialised again in this process"
                        .into(),
                ));
            }
            let Some((universe, threading)) = mpi::initialize_with_threading(Threading::Multiple)
            else {
                return Err(Error::Distributed(
                    "MPI was initialised outside embers; embers initialises it itself (with \
                     MPI_THREAD_MULTIPLE)"
                        .into(),
                ));
            };
            if threading != Threading::Multiple {
                // The watchdog calls MPI_Abort from its own thread while the rank's thread is
                // blocked in a collective.
                return Err(Error::Distributed(format!(
                    "the MPI library provides threading level {threading:?}; embers needs \
                     MPI_THREAD_MULTIPLE"
                )));
            }
            let env = Arc::new(MpiEnv {
                _universe: universe,
            });
            *slot = Some(Arc::downgrade(&env));
            env
        }
    };
    drop(slot);
    let transport: Arc<dyn Transport> =
        Arc::new(MpiTransport::new(SimpleCommunicator::world(), env));
    // Each rank reads its own environment: a bad EMBERS_DIST_TIMEOUT_S on one rank would end
    // that rank here and leave the others in their first collective until their deadline.
    // The ranks first agree on their settings (one byte each, through the transport: before
    // the communicator, uncounted), and every rank fails at once, naming the rank.
    let mine = super::default_timeout();
    let size = transport.size();
    let mut verdicts = vec![0u8; size];
    transport
        .all_gather_v(
            &[u8::from(mine.is_ok())],
            &mut verdicts,
            &vec![1; size],
            Instant::now(),
        )
        .map_err(|e| match e {
            TransportError::Failed(m) => Error::Distributed(format!("MPI start: {m}")),
            TransportError::Timeout { .. } => Error::Distributed("MPI start timed out".into()),
        })?;
    let timeout = mine?;
    if let Some(r) = verdicts.iter().position(|&v| v == 0) {
        return Err(Error::Distributed(format!(
            "rank {r}'s EMBERS_DIST_TIMEOUT_S is not a positive number of seconds (its own \
             error names the value): no rank starts"
        )));
    }
    Ok(Comm::with_transport_timeout(transport, timeout))
}

/// One rank's end of an MPI communicator.
struct MpiTransport {
    /// Declared before `env`: a split communicator is freed before MPI is finalised.
    comm: SimpleCommunicator,
    _env: Arc<MpiEnv>,
    rank: usize,
    size: usize,
}

// SAFETY: MPI runs with MPI_THREAD_MULTIPLE (checked in `mpi_world`); the [`Comm`] above a
// transport makes one collective at a time on it, and the watchdog thread only calls
// MPI_Abort.
unsafe impl Send for MpiTransport {}
// SAFETY: as above.
unsafe impl Sync for MpiTransport {}

impl MpiTransport {
    fn new(comm: SimpleCommunicator, env: Arc<MpiEnv>) -> MpiTransport {
        let rank = comm.rank() as usize;
        let size = comm.size() as usize;
        MpiTransport {
            comm,
            _env: env,
            rank,
            size,
        }
    }
}

/// MPI's `int` counts and displacements of byte blocks of `sizes`.
fn counts(sizes: &[usize]) -> std::result::Result<(Vec<Count>, Vec<Count>), TransportError> {
    let too_big = || {
        TransportError::Failed(
            "a message over 2 GiB (MPI's int counts); split the batch".to_string(),
        )
    };
    let mut displs = Vec::with_capacity(sizes.len());
    let mut at: usize = 0;
    for &s in sizes {
        displs.push(Count::try_from(at).map_err(|_| too_big())?);
        at += s;
    }
    Count::try_from(at).map_err(|_| too_big())?;
    let counts = (sizes.iter())
        .map(|&s| Count::try_from(s).map_err(|_| too_big()))
        .collect::<std::result::Result<_, _>>()?;
    Ok((counts, displs))
}

impl Transport for MpiTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn all_to_all_v(
        &self,
        send: &[u8],
        send_sizes: &[usize],
        recv: &mut [u8],
        recv_sizes: &[usize],
        _deadline: Instant,
    ) -> std::result::Result<(), TransportError> {
        let (send_counts, send_displs) = counts(send_sizes)?;
        let (recv_counts, recv_displs) = counts(recv_sizes)?;
        let partition = Partition::new(send, send_counts, send_displs);
        let mut partition_mut = PartitionMut::new(recv, recv_counts, recv_displs);
        self.comm
            .all_to_all_varcount_into(&partition, &mut partition_mut);
        Ok(())
    }

    fn all_gather_v(
        &self,
        send: &[u8],
        recv: &mut [u8],
        recv_sizes: &[usize],
        _deadline: Instant,
    ) -> std::result::Result<(), TransportError> {
        let (recv_counts, recv_displs) = counts(recv_sizes)?;
        let mut partition_mut = PartitionMut::new(recv, recv_counts, recv_displs);
        self.comm.all_gather_varcount_into(send, &mut partition_mut);
        Ok(())
    }

    fn split(
        &self,
        color: usize,
        _deadline: Instant,
    ) -> std::result::Result<Arc<dyn Transport>, TransportError> {
        let value = Count::try_from(color)
            .map_err(|_| TransportError::Failed(format!("color {color} is over MPI's int")))?;
        let comm = (self.comm)
            .split_by_color(Color::with_value(value))
            .ok_or_else(|| TransportError::Failed("MPI_Comm_split gave no group".into()))?;
        Ok(Arc::new(MpiTransport::new(comm, self._env.clone())))
    }

    fn needs_watchdog(&self) -> bool {
        true
    }

    fn abort(&self, code: i32) -> ! {
        // MPI_Abort on the world ends every process of the job, not only this group.
        SimpleCommunicator::world().abort(code)
    }
}
