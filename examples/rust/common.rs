//! What both Rust examples do around their collective: join the job on a GPU, and run one f32 sum
//! all-reduce with an algorithm and check every element.

use mscclpp::core::bootstrap::{Bootstrap, BootstrapConfig, TcpBootstrap};
use mscclpp::core::communicator::Communicator;
use mscclpp::core::gpu::Stream;
use mscclpp::core::{AccumType, Algorithm, DataType, ExecuteArgs, ReduceOp};
use mscclpp::{Env, Error, Gpu, Result};
use mscclpp_collectives::resources::DeviceBuffer;
use std::sync::Arc;

/// This process's rank of the job, on its GPU.
pub struct Job {
    pub gpu: Arc<dyn Gpu>,
    pub comm: Arc<Communicator>,
}

/// Joins the job on GPU `LOCAL_RANK` (modulo the GPUs visible): rank and world size from the
/// launcher (torchrun, Open MPI, Slurm), or a job of one rank without one. `Ok(None)`, with the
/// reason printed, where there is no GPU to run on.
pub fn join_job() -> Result<Option<Job>> {
    let env = Env::get()?;
    let gpu: Arc<dyn Gpu> = match mscclpp::select_backend(env) {
        Ok(backend) => Arc::new(backend),
        Err(e) if e.is_unavailable() => {
            println!("SKIP: no usable GPU backend: {e}");
            return Ok(None);
        }
        Err(e) => return Err(e),
    };
    let gpus = gpu.device_count()?;
    if gpus == 0 {
        println!("SKIP: the {} backend sees no GPU", gpu.backend_name());
        return Ok(None);
    }
    let (bootstrap, local_rank): (Arc<dyn Bootstrap>, usize) = match &env.launcher {
        Some(l) => (Arc::new(TcpBootstrap::from_env(env)?), l.local_rank),
        None => {
            let config = BootstrapConfig::from_env(env);
            let id = TcpBootstrap::create_unique_id(&config)?;
            (Arc::new(TcpBootstrap::new(0, 1, &id, &config)?), 0)
        }
    };
    let device = local_rank % gpus;
    gpu.set_device(device)?;
    let comm = Arc::new(Communicator::new(bootstrap, gpu.clone(), device)?);
    Ok(Some(Job { gpu, comm }))
}

/// Sums `count` f32 elements over every rank with `algorithm` (rank r contributes r + 1 in every
/// element, so every output element is n (n + 1) / 2), in place or into a second buffer, and
/// checks every element. Collective: every rank calls it.
pub fn sum_and_check(
    job: &Job,
    algorithm: &dyn Algorithm,
    count: usize,
    in_place: bool,
) -> Result<()> {
    let (rank, nranks) = (job.comm.rank(), job.comm.size());
    let input = DeviceBuffer::upload(&job.gpu, &vec![(rank + 1) as f32; count])?;
    let output = if in_place {
        None
    } else {
        Some(DeviceBuffer::upload(&job.gpu, &vec![f32::NAN; count])?)
    };
    let out_ptr = output.as_ref().map_or(input.ptr(), |o| o.ptr());
    let bytes = count * std::mem::size_of::<f32>();
    let args = ExecuteArgs {
        input: input.ptr(),
        output: out_ptr,
        input_bytes: bytes,
        output_bytes: bytes,
        dtype: DataType::F32,
        op: ReduceOp::Sum,
        accum: AccumType::Auto,
        root: 0,
        stream: Stream::DEFAULT,
        nblocks: None,
        nthreads: None,
    };
    algorithm.execute(&args)?;
    job.gpu.synchronize_stream(args.stream)?;

    let mut out = vec![0u8; bytes];
    job.gpu.copy_from_device(&mut out, out_ptr)?;
    let want = (nranks * (nranks + 1) / 2) as f32;
    let wrong = out
        .chunks_exact(4)
        .filter(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]) != want)
        .count();
    if wrong > 0 {
        return Err(Error::Internal(format!(
            "{}: {wrong} of {count} elements are not {want}",
            algorithm.name()
        )));
    }
    println!(
        "rank {rank}/{nranks}: {} summed {count} f32 elements correctly",
        algorithm.name()
    );
    Ok(())
}
