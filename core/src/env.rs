//! The typed environment: every `MSCCLPP_*` (and launcher) variable, parsed once, in one place.
//!
//! [`Env::get`] parses the process environment the first time it is called and returns the same
//! `&'static Env` afterwards; if parsing failed, every call returns the same error. Tests build an
//! [`Env`] from a list of pairs with [`Env::from_vars`] so they never touch the process environment.
//!
//! # Rules
//! - A value that cannot be used is [`Error::Env`] naming the variable, its value and why; it is
//!   never replaced by a default behind the user's back.
//! - An empty value counts as unset (MSCCL++ reads `""` as "not given", and `export X=` is the usual
//!   way to clear a variable in a job script).
//! - Booleans accept `1/0`, `true/false`, `yes/no`, `on/off` (case-insensitive).
//! - Durations are seconds, fractions allowed (`0.5`), finite and greater than zero.
//! - Where MSCCL++ has two names for one setting (`MSCCLPP_LOG_LEVEL` and the older `MSCCLPP_DEBUG`)
//!   the first name in the table wins.
//!
//! # Variables
//!
//! | Variable | Field | Values | Default |
//! |---|---|---|---|
//! | `MSCCLPP_LOG_LEVEL`, else `MSCCLPP_DEBUG` | `log_level` | `TRACE DEBUG INFO WARN ERROR ABORT VERSION NONE/OFF` | unset (logging decides) |
//! | `MSCCLPP_LOG_SUBSYS`, else `MSCCLPP_DEBUG_SUBSYS` | `debug_subsys` | comma list of `ENV GPU NET CONN EXEC NCCL ALGO ALL`; a leading `^` means "all but" | all |
//! | `MSCCLPP_LOG_FILE`, else `MSCCLPP_DEBUG_FILE` | `log_file` | path; `%h` host name, `%p` pid, `%%` a percent sign | stderr |
//! | `MSCCLPP_CACHE_DIR` | `cache_dir` | path | `$HOME/.cache/mscclpp` (`$TMPDIR/mscclpp-cache` without `HOME`) |
//! | `MSCCLPP_NVRTC_LIB` | - (read by `mscclpp-cuda`'s NVRTC loader) | path of `libnvrtc.so*`, or a folder holding one; when set, the only place tried | `$CUDA_HOME/lib64`, `$CUDA_PATH/lib64`, `/usr/local/cuda/lib64`, the loader's path, then PyPI's nvidia wheels |
//! | `MSCCLPP_NVRTC_FORCE` | `nvrtc_force` | bool; compile every kernel at run time, with NVRTC (through the disk cache) or on ROCm with hiprtc, even where the build embeds it precompiled (`mscclpp-aot`, CUBINs and AMD code objects): to compare, or to rule the embedded kernels out | false |
//! | `MSCCLPP_AOT_BLOB` | - (read at build time by `mscclpp-cuda`'s build script) | absolute path of a blob of `scripts/aot-blob.sh`, whose precompiled kernels the build embeds; known here so that a run in the same shell does not report it | unset: nothing embedded, NVRTC compiles every kernel |
//! | `MSCCLPP_AOT_HIP_BLOB` | - (read at build time by `mscclpp-rocm`'s build script) | absolute path of a blob of `scripts/aot-blob.sh --hip`, whose AMD code objects (gfx90a, gfx942) the build embeds; known here for the same reason | unset: nothing embedded, hiprtc compiles every kernel |
//! | `MSCCLPP_SOCKET_IFNAME` | `socket_ifname` | interface name or prefix | any |
//! | `MSCCLPP_SOCKET_FAMILY` | `socket_family` | `AF_INET IPv4 inet`, `AF_INET6 IPv6 inet6` | any |
//! | `MSCCLPP_HOSTID` | `host_id` | string naming this rank's host: ranks with equal ids map each other's memory (CudaIpc), others talk through a network transport; a different id per rank lets one machine pose as several hosts ([`crate::topology`]) | host name and boot id |
//! | `MSCCLPP_COMM_ID` | `comm_id` | `host:port` of rank 0's bootstrap listener | unset |
//! | `MSCCLPP_HCA_DEVICES` | `hca_devices` | comma list of HCA names (`mlx5_0,mlx5_1`) | every HCA found |
//! | `MSCCLPP_IBV_SO` | `ibv_so` | path of `libibverbs.so` | the loader's search |
//! | `MSCCLPP_IBV_MODE` | `ibv_mode` | `host` (signal by RDMA atomic add), `host-no-atomic` (RDMA write-with-immediate) | `host` |
//! | `MSCCLPP_IB_GID_INDEX` | `ib_gid_index` | integer | chosen by the IB transport |
//! | `MSCCLPP_DISABLE_IB_TESTS` | `disable_ib_tests` | bool | false |
//! | `MSCCLPP_FORCE_DISABLE_GDR` | `force_disable_gdr` | bool | false |
//! | `MSCCLPP_NCCL_LIB_PATH` | `nccl_lib_path` | path of the real `libnccl.so` for fallback | unset |
//! | `MSCCLPP_ENABLE_NCCL_FALLBACK` | `enable_nccl_fallback` | bool | false |
//! | `MSCCLPP_FORCE_NCCL_FALLBACK_OPERATION` | `force_nccl_fallback_operation` | `all` or a comma list of `allreduce allgather reducescatter broadcast reduce alltoall send recv sendrecv gather scatter` | empty |
//! | `MSCCLPP_NCCL_SYMMETRIC_MEMORY` | `nccl_symmetric_memory` | bool | false |
//! | `MSCCLPP_NCCL_ACCUM_DTYPE` | `nccl_accum_dtype` | `f16`, `f32` or `auto`: the type the NCCL shim's fp8 reductions accumulate in (NCCL has no such option) | `auto` (the input type) |
//! | `MSCCLPP_NCCL_GROUP_LOCKSTEP` | `nccl_group_lockstep` | bool; an NCCL group over several communicators of this process launches every communicator's i-th operation before any (i+1)-th (see the NCCL shim's `group` module); `0` only to compare | true |
//! | `MSCCLPP_NCCL_WATCHDOG_WAIT` | `nccl_watchdog_wait` | seconds (0: off); a call of the NCCL shim on a failed communicator that another thread watches through ncclCommGetAsyncError (PyTorch's watchdog) returns its error once that communicator is aborted or destroyed, waiting at most this long (see the shim's `watchdog` module) | 10 |
//! | `MSCCLPP_EXECUTION_PLAN_DIR` | `execution_plan_dir` | directory of JSON plans, for the default plan search (`mscclpp_executor::load`: the NCCL shim, the C API of `libmscclpp_embed`, `mscclpp-bench --plan default`); every rank must find the same plans, else none is used | unset |
//! | `MSCCLPP_NPKIT_DUMP_DIR` | `npkit_dump_dir` | directory | unset |
//! | `MSCCLPP_DISABLE_CHANNEL_CACHE` | `disable_channel_cache` | bool | false |
//! | `MSCCLPP_CUDAIPC_USE_DEFAULT_STREAM` | `cudaipc_use_default_stream` | bool | false |
//! | `MSCCLPP_FORCE_DISABLE_NVLS`, also `MSCCLPP_DISABLE_NVLS` | `force_disable_nvls` | bool (either set true disables) | false |
//! | `MSCCLPP_ENABLE_NVLS` | `enable_nvls` | bool; NVLS runs only when this is set true | false |
//! | `MSCCLPP_PROGRAMMATIC_LAUNCH` | `programmatic_launch` | bool; native collective kernels may launch while the stream's previous kernel finishes (CUDA programmatic dependent launch, sm_90+) | true |
//! | `MSCCLPP_EAGER_GRAPH_LAUNCH` | `eager_graph_launch` | bool; outside stream capture, native collective kernels launch through a cached one-kernel CUDA graph, whose launch costs the calling thread about half of cuLaunchKernel's (the programmatic overlap does not apply then) | true |
//! | `NCCL_NVLS_ENABLE` | `nccl_nvls_enable` | bool; `0` also disables NVLS here | unset |
//! | `CUDA_DEVICE_MAX_CONNECTIONS` | `cuda_device_max_connections` | CUDA's own: hardware queues the process's streams share; read to refuse PortChannel patterns that hang on one queue ([`crate::port_channel::shared_queue_hazard`]) | unset (CUDA: 8); set to 32 when unset by `import mscclpp`, by the NCCL shim when loaded and by the CUDA backend before any CUDA library is loaded (docs/troubleshooting.md) |
//! | `MSCCLPP_MASTER_ADDR` | `master_addr` | host name or IP | unset |
//! | `MSCCLPP_MASTER_PORT` | `master_port` | 1-65535 | unset |
//! | `MSCCLPP_GPU_BACKEND` | `gpu_backend` | `cuda rocm auto` | unset (= auto) |
//! | `MSCCLPP_BOOTSTRAP_TIMEOUT` | `bootstrap_timeout` | seconds | 30 |
//! | `MSCCLPP_DEVICE_WAIT_TIMEOUT` | `device_wait_timeout` | seconds the host waits for the device (stream sync, proxy flush), and the wall-clock budget of every device-side wait (docs/fail-fast.md) | 60 |
//! | `MSCCLPP_LIVENESS_TIMEOUT` | `liveness_timeout` | seconds without a bootstrap heartbeat after which a peer counts as stalled (stopped, hung) and the job is aborted (docs/fail-fast.md) | `MSCCLPP_DEVICE_WAIT_TIMEOUT` |
//! | `RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE` | `launcher` (torchrun) | integers | - |
//! | `OMPI_COMM_WORLD_RANK _SIZE _LOCAL_RANK _LOCAL_SIZE` | `launcher` (Open MPI) | integers | - |
//! | `PMI_RANK PMI_SIZE MPI_LOCALRANKID MPI_LOCALNRANKS` | `launcher` (PMI: MPICH, Intel MPI) | integers | - |
//! | `SLURM_PROCID SLURM_NTASKS SLURM_LOCALID SLURM_NTASKS_PER_NODE` | `launcher` (Slurm) | integers | - |
//! | `MASTER_ADDR MASTER_PORT` | `torch_master` | host and port (both or neither) | unset |
//!
//! Launchers are tried in the order of the table (torchrun first: it runs under Slurm and MPI too
//! and then its own variables are the ones that describe this process).
//!
//! Any other variable whose name starts with `MSCCLPP_` is listed in [`Env::unknown`], so logging
//! can warn about typos without refusing to start.

use crate::error::{Error, Result};
use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::OnceLock;
use std::time::Duration;

/// Every variable [`Env`] reads. Values of these are checked for UTF-8; the `MSCCLPP_` ones not in
/// this list are reported as unknown.
pub const VARIABLES: &[&str] = &[
    "MSCCLPP_LOG_LEVEL",
    "MSCCLPP_DEBUG",
    "MSCCLPP_LOG_SUBSYS",
    "MSCCLPP_DEBUG_SUBSYS",
    "MSCCLPP_LOG_FILE",
    "MSCCLPP_DEBUG_FILE",
    "MSCCLPP_CACHE_DIR",
    "MSCCLPP_NVRTC_LIB",
    "MSCCLPP_NVRTC_FORCE",
    "MSCCLPP_AOT_BLOB",
    "MSCCLPP_AOT_HIP_BLOB",
    "MSCCLPP_SOCKET_IFNAME",
    "MSCCLPP_SOCKET_FAMILY",
    "MSCCLPP_HOSTID",
    "MSCCLPP_COMM_ID",
    "MSCCLPP_HCA_DEVICES",
    "MSCCLPP_IBV_SO",
    "MSCCLPP_IBV_MODE",
    "MSCCLPP_IB_GID_INDEX",
    "MSCCLPP_DISABLE_IB_TESTS",
    "MSCCLPP_FORCE_DISABLE_GDR",
    "MSCCLPP_NCCL_LIB_PATH",
    "MSCCLPP_ENABLE_NCCL_FALLBACK",
    "MSCCLPP_FORCE_NCCL_FALLBACK_OPERATION",
    "MSCCLPP_NCCL_SYMMETRIC_MEMORY",
    "MSCCLPP_NCCL_ACCUM_DTYPE",
    "MSCCLPP_NCCL_GROUP_LOCKSTEP",
    "MSCCLPP_NCCL_WATCHDOG_WAIT",
    "MSCCLPP_EXECUTION_PLAN_DIR",
    "MSCCLPP_NPKIT_DUMP_DIR",
    "MSCCLPP_DISABLE_CHANNEL_CACHE",
    "MSCCLPP_CUDAIPC_USE_DEFAULT_STREAM",
    "MSCCLPP_FORCE_DISABLE_NVLS",
    "MSCCLPP_DISABLE_NVLS",
    "MSCCLPP_ENABLE_NVLS",
    "MSCCLPP_PROGRAMMATIC_LAUNCH",
    "MSCCLPP_EAGER_GRAPH_LAUNCH",
    "NCCL_NVLS_ENABLE",
    "CUDA_DEVICE_MAX_CONNECTIONS",
    "MSCCLPP_MASTER_ADDR",
    "MSCCLPP_MASTER_PORT",
    "MSCCLPP_GPU_BACKEND",
    "MSCCLPP_BOOTSTRAP_TIMEOUT",
    "MSCCLPP_DEVICE_WAIT_TIMEOUT",
    "MSCCLPP_LIVENESS_TIMEOUT",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
    "PMI_RANK",
    "PMI_SIZE",
    "MPI_LOCALRANKID",
    "MPI_LOCALNRANKS",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
    "SLURM_NTASKS_PER_NODE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "HOME",
];

/// Default for [`Env::bootstrap_timeout`].
pub const DEFAULT_BOOTSTRAP_TIMEOUT: Duration = Duration::from_secs(30);
/// Default for [`Env::device_wait_timeout`].
pub const DEFAULT_DEVICE_WAIT_TIMEOUT: Duration = Duration::from_secs(60);
/// Default for [`Env::nccl_watchdog_wait`]: longer than the 8 s PyTorch's watchdog gives itself
/// to print a failed collective's stack.
pub const DEFAULT_NCCL_WATCHDOG_WAIT: Duration = Duration::from_secs(10);

/// Log verbosity, NCCL/MSCCL++ spelling. Ordered from quietest to loudest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum LogLevel {
    /// `NONE` / `OFF`: nothing at all.
    Off,
    /// `VERSION`: the version banner only (NCCL_DEBUG=VERSION).
    Version,
    /// `ABORT`: only the message of a fatal error.
    Abort,
    Error,
    Warn,
    Info,
    Debug,
    Trace,
}

impl FromStr for LogLevel {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.trim().to_ascii_uppercase().as_str() {
            "NONE" | "OFF" => Ok(LogLevel::Off),
            "VERSION" => Ok(LogLevel::Version),
            "ABORT" => Ok(LogLevel::Abort),
            "ERROR" => Ok(LogLevel::Error),
            "WARN" | "WARNING" => Ok(LogLevel::Warn),
            "INFO" => Ok(LogLevel::Info),
            "DEBUG" => Ok(LogLevel::Debug),
            "TRACE" => Ok(LogLevel::Trace),
            _ => Err(
                "expected one of TRACE, DEBUG, INFO, WARN, ERROR, ABORT, VERSION, NONE, OFF".into(),
            ),
        }
    }
}

/// A logging subsystem; each one is a `tracing` target (see `crate::log::target`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Subsystem {
    Env,
    Gpu,
    Net,
    Conn,
    Exec,
    Nccl,
    Algo,
}

impl Subsystem {
    pub const ALL: [Subsystem; 7] = [
        Subsystem::Env,
        Subsystem::Gpu,
        Subsystem::Net,
        Subsystem::Conn,
        Subsystem::Exec,
        Subsystem::Nccl,
        Subsystem::Algo,
    ];

    /// The spelling used in `MSCCLPP_DEBUG_SUBSYS`.
    pub const fn name(self) -> &'static str {
        match self {
            Subsystem::Env => "ENV",
            Subsystem::Gpu => "GPU",
            Subsystem::Net => "NET",
            Subsystem::Conn => "CONN",
            Subsystem::Exec => "EXEC",
            Subsystem::Nccl => "NCCL",
            Subsystem::Algo => "ALGO",
        }
    }

    const fn bit(self) -> u8 {
        1 << (self as u8)
    }
}

impl fmt::Display for Subsystem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Subsystem {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let upper = s.trim().to_ascii_uppercase();
        Subsystem::ALL
            .into_iter()
            .find(|sub| sub.name() == upper)
            .ok_or_else(|| {
                format!("unknown subsystem {s:?}; expected ENV, GPU, NET, CONN, EXEC, NCCL, ALGO or ALL")
            })
    }
}

/// Which subsystems log. Parsed like `NCCL_DEBUG_SUBSYS`: `NET,CONN` enables those two, `ALL`
/// enables every one, and a leading `^` inverts the whole list (`^NET` = all but NET).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SubsystemFilter {
    bits: u8,
}

impl SubsystemFilter {
    pub const fn all() -> Self {
        SubsystemFilter { bits: 0x7f }
    }

    pub const fn none() -> Self {
        SubsystemFilter { bits: 0 }
    }

    pub fn only(subsystems: &[Subsystem]) -> Self {
        SubsystemFilter {
            bits: subsystems.iter().fold(0, |acc, s| acc | s.bit()),
        }
    }

    pub const fn contains(self, subsystem: Subsystem) -> bool {
        self.bits & subsystem.bit() != 0
    }

    /// The enabled subsystems, in [`Subsystem::ALL`] order.
    pub fn enabled(self) -> impl Iterator<Item = Subsystem> {
        Subsystem::ALL
            .into_iter()
            .filter(move |s| self.contains(*s))
    }

    pub const fn is_all(self) -> bool {
        self.bits == Self::all().bits
    }
}

impl Default for SubsystemFilter {
    fn default() -> Self {
        Self::all()
    }
}

impl FromStr for SubsystemFilter {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let (negate, list) = match s.trim().strip_prefix('^') {
            Some(rest) => (true, rest),
            None => (false, s.trim()),
        };
        let mut bits = 0u8;
        for item in list.split(',') {
            let item = item.trim();
            if item.is_empty() {
                return Err("empty entry in the subsystem list".into());
            }
            if item.eq_ignore_ascii_case("ALL") {
                bits = SubsystemFilter::all().bits;
            } else {
                bits |= item.parse::<Subsystem>()?.bit();
            }
        }
        let bits = if negate {
            !bits & SubsystemFilter::all().bits
        } else {
            bits
        };
        Ok(SubsystemFilter { bits })
    }
}

/// Address family for bootstrap and Ethernet sockets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SocketFamily {
    Inet,
    Inet6,
}

impl FromStr for SocketFamily {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.trim().to_ascii_uppercase().as_str() {
            "AF_INET" | "IPV4" | "INET" => Ok(SocketFamily::Inet),
            "AF_INET6" | "IPV6" | "INET6" => Ok(SocketFamily::Inet6),
            _ => Err("expected AF_INET (IPv4, inet) or AF_INET6 (IPv6, inet6)".into()),
        }
    }
}

/// How an IB connection signals the peer's semaphore (MSCCL++'s `MSCCLPP_IBV_MODE`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum IbvMode {
    /// `host`: the proxy signals with an RDMA atomic fetch-and-add on the remote semaphore.
    #[default]
    Host,
    /// `host-no-atomic`: the proxy signals with an RDMA write-with-immediate; a receiver thread
    /// forwards the value to the GPU. For HCAs (or bridges) without usable RDMA atomics.
    HostNoAtomic,
}

impl FromStr for IbvMode {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "host" => Ok(IbvMode::Host),
            "host-no-atomic" | "host_no_atomic" => Ok(IbvMode::HostNoAtomic),
            _ => Err(
                "expected `host` (RDMA atomic add) or `host-no-atomic` (RDMA write-with-immediate)"
                    .into(),
            ),
        }
    }
}

/// `MSCCLPP_GPU_BACKEND`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BackendChoice {
    Cuda,
    Rocm,
    /// Detect: CUDA first, then ROCm.
    Auto,
}

impl FromStr for BackendChoice {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "cuda" => Ok(BackendChoice::Cuda),
            "rocm" | "hip" => Ok(BackendChoice::Rocm),
            "auto" => Ok(BackendChoice::Auto),
            _ => Err("expected cuda, rocm or auto".into()),
        }
    }
}

/// Which launcher's variables described this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LauncherKind {
    Torchrun,
    OpenMpi,
    Pmi,
    Slurm,
}

/// Rank layout given by the launcher that started this process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Launcher {
    pub rank: usize,
    pub world_size: usize,
    pub local_rank: usize,
    pub local_size: Option<usize>,
    pub source: LauncherKind,
}

/// The parsed environment. See the module docs for every variable.
#[derive(Debug, Clone, PartialEq)]
pub struct Env {
    pub log_level: Option<LogLevel>,
    pub debug_subsys: SubsystemFilter,
    pub log_file: Option<PathBuf>,
    pub cache_dir: PathBuf,
    pub nvrtc_force: bool,
    pub socket_ifname: Option<String>,
    pub socket_family: Option<SocketFamily>,
    pub host_id: Option<String>,
    pub comm_id: Option<String>,
    pub hca_devices: Vec<String>,
    pub ibv_so: Option<PathBuf>,
    pub ibv_mode: IbvMode,
    pub ib_gid_index: Option<u32>,
    pub disable_ib_tests: bool,
    pub force_disable_gdr: bool,
    pub nccl_lib_path: Option<PathBuf>,
    pub enable_nccl_fallback: bool,
    /// Lower-case operation names (`allreduce`, ...) that always go to NCCL.
    pub force_nccl_fallback_operation: Vec<String>,
    pub nccl_symmetric_memory: bool,
    pub nccl_accum_dtype: crate::dtype::AccumType,
    pub nccl_group_lockstep: bool,
    pub nccl_watchdog_wait: Duration,
    pub execution_plan_dir: Option<PathBuf>,
    pub npkit_dump_dir: Option<PathBuf>,
    pub disable_channel_cache: bool,
    pub cudaipc_use_default_stream: bool,
    pub force_disable_nvls: bool,
    pub enable_nvls: bool,
    pub programmatic_launch: bool,
    pub eager_graph_launch: bool,
    pub nccl_nvls_enable: Option<bool>,
    pub cuda_device_max_connections: Option<u32>,
    pub master_addr: Option<String>,
    pub master_port: Option<u16>,
    pub gpu_backend: Option<BackendChoice>,
    pub bootstrap_timeout: Duration,
    pub device_wait_timeout: Duration,
    pub liveness_timeout: Duration,
    pub launcher: Option<Launcher>,
    pub torch_master: Option<(String, u16)>,
    /// The recognised variables that were set (non-empty), for logging what was in effect.
    pub recognized: Vec<(&'static str, String)>,
    /// Set variables that start with `MSCCLPP_` but that this version does not know (typos?).
    pub unknown: Vec<String>,
}

/// Operation names accepted by `MSCCLPP_FORCE_NCCL_FALLBACK_OPERATION` (NCCL's collectives).
const FALLBACK_OPERATIONS: &[&str] = &[
    "all",
    "allreduce",
    "allgather",
    "reducescatter",
    "broadcast",
    "reduce",
    "alltoall",
    "send",
    "recv",
    "sendrecv",
    "gather",
    "scatter",
];

static GLOBAL: OnceLock<std::result::Result<Env, (&'static str, String, String)>> = OnceLock::new();

/// Looks variables up by name; empty values are already dropped.
struct Vars {
    map: BTreeMap<String, String>,
}

fn bad(var: &'static str, value: &str, reason: impl Into<String>) -> Error {
    Error::Env {
        var,
        value: value.to_string(),
        reason: reason.into(),
    }
}

impl Vars {
    fn raw(&self, var: &'static str) -> Option<&str> {
        self.map.get(var).map(String::as_str)
    }

    /// The first of `names` that is set, with the name it was found under.
    fn first(&self, names: &[&'static str]) -> Option<(&'static str, &str)> {
        names.iter().find_map(|n| self.raw(n).map(|v| (*n, v)))
    }

    fn string(&self, var: &'static str) -> Option<String> {
        self.raw(var).map(|v| v.trim().to_string())
    }

    fn path(&self, var: &'static str) -> Option<PathBuf> {
        self.raw(var).map(PathBuf::from)
    }

    fn parse<T: FromStr<Err = String>>(&self, var: &'static str) -> Result<Option<T>> {
        self.raw(var)
            .map(|v| v.parse::<T>().map_err(|reason| bad(var, v, reason)))
            .transpose()
    }

    fn boolean(&self, var: &'static str) -> Result<Option<bool>> {
        self.raw(var).map(|v| parse_bool(var, v)).transpose()
    }

    fn flag(&self, var: &'static str) -> Result<bool> {
        Ok(self.boolean(var)?.unwrap_or(false))
    }

    fn integer<T: FromStr>(&self, var: &'static str, what: &str) -> Result<Option<T>> {
        self.raw(var)
            .map(|v| {
                v.trim()
                    .parse::<T>()
                    .map_err(|_| bad(var, v, format!("expected {what}")))
            })
            .transpose()
    }

    /// A timeout: a finite number of seconds > 0.
    fn seconds(&self, var: &'static str, default: Duration) -> Result<Duration> {
        self.duration(var, default, false)
    }

    /// A wait that 0 turns off: a finite number of seconds >= 0.
    fn seconds_or_off(&self, var: &'static str, default: Duration) -> Result<Duration> {
        self.duration(var, default, true)
    }

    fn duration(&self, var: &'static str, default: Duration, zero: bool) -> Result<Duration> {
        let Some(v) = self.raw(var) else {
            return Ok(default);
        };
        let secs: f64 = v
            .trim()
            .parse()
            .map_err(|_| bad(var, v, "expected a number of seconds, e.g. 30 or 2.5"))?;
        if !secs.is_finite() || secs < 0.0 || (secs == 0.0 && !zero) {
            let allowed = if zero { ">= 0 (0: off)" } else { "> 0" };
            return Err(bad(
                var,
                v,
                format!("must be a finite number of seconds {allowed}"),
            ));
        }
        Duration::try_from_secs_f64(secs).map_err(|e| bad(var, v, e.to_string()))
    }

    fn port(&self, var: &'static str) -> Result<Option<u16>> {
        match self.integer::<u16>(var, "a TCP port number 1-65535")? {
            Some(0) => Err(bad(
                var,
                "0",
                "port 0 cannot be connected to; expected 1-65535",
            )),
            other => Ok(other),
        }
    }
}

fn parse_bool(var: &'static str, value: &str) -> Result<bool> {
    match value.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Ok(true),
        "0" | "false" | "no" | "off" => Ok(false),
        _ => Err(bad(
            var,
            value,
            "expected a boolean: 1/0, true/false, yes/no, on/off",
        )),
    }
}

/// Comma list with no empty entries (a doubled comma is a typo worth reporting).
fn comma_list(var: &'static str, value: &str) -> Result<Vec<String>> {
    value
        .split(',')
        .map(|item| {
            let item = item.trim();
            if item.is_empty() {
                Err(bad(var, value, "empty entry in the comma-separated list"))
            } else if item.contains(char::is_whitespace) {
                Err(bad(
                    var,
                    value,
                    format!("entry {item:?} contains whitespace"),
                ))
            } else {
                Ok(item.to_string())
            }
        })
        .collect()
}

fn host_name() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is valid for its length; gethostname NUL-terminates on success (we also
    // stop at the buffer end if it did not).
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return "unknown-host".to_string();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

/// Substitutes `%h` (host name), `%p` (pid) and `%%` in a log file name, like NCCL_DEBUG_FILE.
fn expand_log_file(var: &'static str, value: &str) -> Result<PathBuf> {
    let mut out = String::with_capacity(value.len() + 16);
    let mut chars = value.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('h') => out.push_str(&host_name()),
            Some('p') => out.push_str(&std::process::id().to_string()),
            Some('%') => out.push('%'),
            Some(other) => {
                return Err(bad(
                    var,
                    value,
                    format!(
                        "unknown pattern %{other}; only %h (host), %p (pid) and %% are substituted"
                    ),
                ))
            }
            None => return Err(bad(var, value, "trailing % (write %% for a percent sign)")),
        }
    }
    Ok(PathBuf::from(out))
}

/// Names of one launcher's variables: rank, size, local rank, local size.
struct LauncherVars {
    kind: LauncherKind,
    rank: &'static str,
    size: &'static str,
    local_rank: &'static str,
    local_size: &'static str,
}

const LAUNCHERS: [LauncherVars; 4] = [
    LauncherVars {
        kind: LauncherKind::Torchrun,
        rank: "RANK",
        size: "WORLD_SIZE",
        local_rank: "LOCAL_RANK",
        local_size: "LOCAL_WORLD_SIZE",
    },
    LauncherVars {
        kind: LauncherKind::OpenMpi,
        rank: "OMPI_COMM_WORLD_RANK",
        size: "OMPI_COMM_WORLD_SIZE",
        local_rank: "OMPI_COMM_WORLD_LOCAL_RANK",
        local_size: "OMPI_COMM_WORLD_LOCAL_SIZE",
    },
    LauncherVars {
        kind: LauncherKind::Pmi,
        rank: "PMI_RANK",
        size: "PMI_SIZE",
        local_rank: "MPI_LOCALRANKID",
        local_size: "MPI_LOCALNRANKS",
    },
    LauncherVars {
        kind: LauncherKind::Slurm,
        rank: "SLURM_PROCID",
        size: "SLURM_NTASKS",
        local_rank: "SLURM_LOCALID",
        local_size: "SLURM_NTASKS_PER_NODE",
    },
];

fn parse_launcher(vars: &Vars) -> Result<Option<Launcher>> {
    for l in &LAUNCHERS {
        let (rank_raw, size_raw) = (vars.raw(l.rank), vars.raw(l.size));
        if rank_raw.is_none() && size_raw.is_none() {
            continue;
        }
        let (Some(rank_v), Some(size_v)) = (rank_raw, size_raw) else {
            let (set, missing, value) = match rank_raw {
                Some(v) => (l.rank, l.size, v),
                None => (l.size, l.rank, size_raw.unwrap_or_default()),
            };
            return Err(bad(
                set,
                value,
                format!("{set} is set but {missing} is not; a launcher sets both"),
            ));
        };
        let rank: usize = vars
            .integer(l.rank, "a rank (non-negative integer)")?
            .ok_or_else(|| bad(l.rank, rank_v, "missing"))?;
        let world_size: usize = vars
            .integer(l.size, "a world size (positive integer)")?
            .ok_or_else(|| bad(l.size, size_v, "missing"))?;
        if world_size == 0 {
            return Err(bad(l.size, size_v, "world size must be at least 1"));
        }
        if rank >= world_size {
            return Err(bad(
                l.rank,
                rank_v,
                format!("{}={rank} is not below {}={world_size}", l.rank, l.size),
            ));
        }
        // Slurm's SLURM_NTASKS_PER_NODE may be `4(x2)`-style or absent; a plain count is used and
        // anything else means "unknown" rather than an error, because Slurm writes it, not users.
        let local_size: Option<usize> = if l.kind == LauncherKind::Slurm {
            vars.raw(l.local_size).and_then(|v| v.trim().parse().ok())
        } else {
            vars.integer(l.local_size, "a local world size (positive integer)")?
        };
        let local_rank: usize =
            match vars.integer(l.local_rank, "a local rank (non-negative integer)")? {
                Some(r) => r,
                None if world_size == 1 => 0,
                None => {
                    return Err(bad(
                        l.rank,
                        rank_v,
                        format!(
                        "{} is set but {} is not, so the local rank (which GPU to use) is unknown",
                        l.rank, l.local_rank
                    ),
                    ))
                }
            };
        if let Some(ls) = local_size {
            let ls_v = vars.raw(l.local_size).unwrap_or_default();
            if ls == 0 || ls > world_size {
                return Err(bad(
                    l.local_size,
                    ls_v,
                    format!(
                        "{}={ls} must be between 1 and {}={world_size}",
                        l.local_size, l.size
                    ),
                ));
            }
            if local_rank >= ls {
                return Err(bad(
                    l.local_rank,
                    vars.raw(l.local_rank).unwrap_or_default(),
                    format!(
                        "{}={local_rank} is not below {}={ls}",
                        l.local_rank, l.local_size
                    ),
                ));
            }
        }
        if local_rank >= world_size {
            return Err(bad(
                l.local_rank,
                vars.raw(l.local_rank).unwrap_or_default(),
                format!(
                    "{}={local_rank} is not below {}={world_size}",
                    l.local_rank, l.size
                ),
            ));
        }
        return Ok(Some(Launcher {
            rank,
            world_size,
            local_rank,
            local_size,
            source: l.kind,
        }));
    }
    Ok(None)
}

impl Env {
    /// The process environment, parsed on first use. Every later call returns the same value, or
    /// the same error if the first parse failed (the environment does not change under us in a way
    /// we would honour, so re-parsing would only make behaviour depend on timing).
    pub fn get() -> Result<&'static Env> {
        let parsed = GLOBAL.get_or_init(|| match Env::from_process() {
            Ok(env) => Ok(env),
            Err(Error::Env { var, value, reason }) => Err((var, value, reason)),
            Err(other) => Err(("MSCCLPP_*", String::new(), other.to_string())),
        });
        match parsed {
            Ok(env) => Ok(env),
            Err((var, value, reason)) => Err(Error::Env {
                var,
                value: value.clone(),
                reason: reason.clone(),
            }),
        }
    }

    fn from_process() -> Result<Env> {
        let mut pairs = Vec::new();
        for (key, value) in std::env::vars_os() {
            let Some(key) = key.to_str() else { continue };
            match value.into_string() {
                Ok(v) => pairs.push((key.to_string(), v)),
                Err(raw) => {
                    if let Some(var) = VARIABLES.iter().find(|v| **v == key) {
                        return Err(bad(
                            var,
                            &raw.to_string_lossy(),
                            "the value is not valid UTF-8",
                        ));
                    }
                }
            }
        }
        Env::from_vars(pairs)
    }

    /// Parses the given variables (name, value) as if they were the whole environment.
    pub fn from_vars<I: IntoIterator<Item = (String, String)>>(vars: I) -> Result<Env> {
        let map: BTreeMap<String, String> =
            vars.into_iter().filter(|(_, v)| !v.is_empty()).collect();
        let vars = Vars { map };

        let log_level = match vars.first(&["MSCCLPP_LOG_LEVEL", "MSCCLPP_DEBUG"]) {
            Some((var, v)) => Some(v.parse::<LogLevel>().map_err(|r| bad(var, v, r))?),
            None => None,
        };
        let debug_subsys = match vars.first(&["MSCCLPP_LOG_SUBSYS", "MSCCLPP_DEBUG_SUBSYS"]) {
            Some((var, v)) => v.parse::<SubsystemFilter>().map_err(|r| bad(var, v, r))?,
            None => SubsystemFilter::all(),
        };
        let log_file = match vars.first(&["MSCCLPP_LOG_FILE", "MSCCLPP_DEBUG_FILE"]) {
            Some((var, v)) => Some(expand_log_file(var, v)?),
            None => None,
        };
        let cache_dir = match (vars.path("MSCCLPP_CACHE_DIR"), vars.raw("HOME")) {
            (Some(dir), _) => dir,
            (None, Some(home)) => PathBuf::from(home).join(".cache").join("mscclpp"),
            (None, None) => std::env::temp_dir().join("mscclpp-cache"),
        };
        let hca_devices = match vars.raw("MSCCLPP_HCA_DEVICES") {
            Some(v) => comma_list("MSCCLPP_HCA_DEVICES", v)?,
            None => Vec::new(),
        };
        let nccl_accum_dtype = match vars.raw("MSCCLPP_NCCL_ACCUM_DTYPE") {
            None => crate::dtype::AccumType::Auto,
            Some(v) => match v.to_ascii_lowercase().as_str() {
                "auto" => crate::dtype::AccumType::Auto,
                "f16" | "fp16" | "half" | "float16" => crate::dtype::AccumType::F16,
                "f32" | "fp32" | "float" | "float32" => crate::dtype::AccumType::F32,
                _ => {
                    return Err(bad(
                        "MSCCLPP_NCCL_ACCUM_DTYPE",
                        v,
                        "expected f16, f32 or auto",
                    ))
                }
            },
        };
        let force_nccl_fallback_operation = match vars.raw("MSCCLPP_FORCE_NCCL_FALLBACK_OPERATION")
        {
            Some(v) => comma_list("MSCCLPP_FORCE_NCCL_FALLBACK_OPERATION", v)?
                .into_iter()
                .map(|op| {
                    let op = op.to_ascii_lowercase();
                    if FALLBACK_OPERATIONS.contains(&op.as_str()) {
                        Ok(op)
                    } else {
                        Err(bad(
                            "MSCCLPP_FORCE_NCCL_FALLBACK_OPERATION",
                            v,
                            format!(
                                "unknown operation {op:?}; expected some of {}",
                                FALLBACK_OPERATIONS.join(", ")
                            ),
                        ))
                    }
                })
                .collect::<Result<Vec<_>>>()?,
            None => Vec::new(),
        };
        let comm_id = vars.string("MSCCLPP_COMM_ID");
        if let Some(id) = &comm_id {
            check_host_port("MSCCLPP_COMM_ID", id)?;
        }
        let master_addr = vars.string("MSCCLPP_MASTER_ADDR");
        let master_port = vars.port("MSCCLPP_MASTER_PORT")?;
        let torch_master = match (vars.string("MASTER_ADDR"), vars.port("MASTER_PORT")?) {
            (Some(addr), Some(port)) => Some((addr, port)),
            (None, None) => None,
            (Some(addr), None) => {
                return Err(bad(
                    "MASTER_ADDR",
                    &addr,
                    "MASTER_ADDR is set but MASTER_PORT is not",
                ))
            }
            (None, Some(port)) => {
                return Err(bad(
                    "MASTER_PORT",
                    &port.to_string(),
                    "MASTER_PORT is set but MASTER_ADDR is not",
                ))
            }
        };

        let recognized = VARIABLES
            .iter()
            .filter_map(|v| vars.raw(v).map(|value| (*v, value.to_string())))
            .collect();
        let unknown = vars
            .map
            .keys()
            .filter(|k| k.starts_with("MSCCLPP_") && !VARIABLES.contains(&k.as_str()))
            .cloned()
            .collect();
        let device_wait_timeout =
            vars.seconds("MSCCLPP_DEVICE_WAIT_TIMEOUT", DEFAULT_DEVICE_WAIT_TIMEOUT)?;

        Ok(Env {
            log_level,
            debug_subsys,
            log_file,
            cache_dir,
            nvrtc_force: vars.flag("MSCCLPP_NVRTC_FORCE")?,
            socket_ifname: vars.string("MSCCLPP_SOCKET_IFNAME"),
            socket_family: vars.parse("MSCCLPP_SOCKET_FAMILY")?,
            host_id: vars.string("MSCCLPP_HOSTID"),
            comm_id,
            hca_devices,
            ibv_so: vars.path("MSCCLPP_IBV_SO"),
            ibv_mode: vars.parse("MSCCLPP_IBV_MODE")?.unwrap_or_default(),
            ib_gid_index: vars
                .integer("MSCCLPP_IB_GID_INDEX", "a GID index (non-negative integer)")?,
            disable_ib_tests: vars.flag("MSCCLPP_DISABLE_IB_TESTS")?,
            force_disable_gdr: vars.flag("MSCCLPP_FORCE_DISABLE_GDR")?,
            nccl_lib_path: vars.path("MSCCLPP_NCCL_LIB_PATH"),
            enable_nccl_fallback: vars.flag("MSCCLPP_ENABLE_NCCL_FALLBACK")?,
            force_nccl_fallback_operation,
            nccl_symmetric_memory: vars.flag("MSCCLPP_NCCL_SYMMETRIC_MEMORY")?,
            nccl_accum_dtype,
            nccl_group_lockstep: vars.boolean("MSCCLPP_NCCL_GROUP_LOCKSTEP")?.unwrap_or(true),
            nccl_watchdog_wait: vars
                .seconds_or_off("MSCCLPP_NCCL_WATCHDOG_WAIT", DEFAULT_NCCL_WATCHDOG_WAIT)?,
            execution_plan_dir: vars.path("MSCCLPP_EXECUTION_PLAN_DIR"),
            npkit_dump_dir: vars.path("MSCCLPP_NPKIT_DUMP_DIR"),
            disable_channel_cache: vars.flag("MSCCLPP_DISABLE_CHANNEL_CACHE")?,
            cudaipc_use_default_stream: vars.flag("MSCCLPP_CUDAIPC_USE_DEFAULT_STREAM")?,
            // Both spellings are read and either one disables: a safety switch must not be lost
            // because the user wrote the older name.
            force_disable_nvls: vars.flag("MSCCLPP_FORCE_DISABLE_NVLS")?
                | vars.flag("MSCCLPP_DISABLE_NVLS")?,
            enable_nvls: vars.flag("MSCCLPP_ENABLE_NVLS")?,
            programmatic_launch: vars.boolean("MSCCLPP_PROGRAMMATIC_LAUNCH")?.unwrap_or(true),
            eager_graph_launch: vars.boolean("MSCCLPP_EAGER_GRAPH_LAUNCH")?.unwrap_or(true),
            nccl_nvls_enable: vars.boolean("NCCL_NVLS_ENABLE")?,
            cuda_device_max_connections: vars.integer(
                "CUDA_DEVICE_MAX_CONNECTIONS",
                "a number of hardware queues (non-negative integer)",
            )?,
            master_addr,
            master_port,
            gpu_backend: vars.parse("MSCCLPP_GPU_BACKEND")?,
            bootstrap_timeout: vars
                .seconds("MSCCLPP_BOOTSTRAP_TIMEOUT", DEFAULT_BOOTSTRAP_TIMEOUT)?,
            device_wait_timeout,
            // A stalled peer is one whose device work would time out: the same budget.
            liveness_timeout: vars.seconds("MSCCLPP_LIVENESS_TIMEOUT", device_wait_timeout)?,
            launcher: parse_launcher(&vars)?,
            torch_master,
            recognized,
            unknown,
        })
    }

    /// NVLink multicast may run only when explicitly enabled and not disabled by either switch
    /// (see DESIGN.md, "Safety on shared GPUs").
    pub fn nvls_allowed(&self) -> bool {
        self.enable_nvls && !self.force_disable_nvls && self.nccl_nvls_enable != Some(false)
    }
}

/// Checks `host:port` (IPv6 hosts in brackets) with a usable port.
fn check_host_port(var: &'static str, value: &str) -> Result<()> {
    let Some((host, port)) = value.rsplit_once(':') else {
        return Err(bad(var, value, "expected host:port"));
    };
    if host.is_empty() {
        return Err(bad(var, value, "expected host:port; the host is empty"));
    }
    match port.parse::<u16>() {
        Ok(p) if p > 0 => Ok(()),
        _ => Err(bad(
            var,
            value,
            format!("port {port:?} is not a number 1-65535"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rstest::rstest;

    fn env(pairs: &[(&str, &str)]) -> Result<Env> {
        Env::from_vars(pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())))
    }

    fn err_var(pairs: &[(&str, &str)]) -> &'static str {
        match env(pairs) {
            Err(Error::Env { var, .. }) => var,
            other => panic!("expected an Env error for {pairs:?}, got {other:?}"),
        }
    }

    #[test]
    fn empty_environment_gives_documented_defaults() {
        let e = env(&[("HOME", "/home/u")]).unwrap();
        assert_eq!(e.log_level, None);
        assert!(e.debug_subsys.is_all());
        assert_eq!(e.log_file, None);
        assert_eq!(e.cache_dir, PathBuf::from("/home/u/.cache/mscclpp"));
        assert_eq!(e.ibv_mode, IbvMode::Host);
        assert!(!e.disable_ib_tests && !e.force_disable_nvls && !e.enable_nvls);
        assert!(e.programmatic_launch);
        assert!(
            !env(&[("MSCCLPP_PROGRAMMATIC_LAUNCH", "0")])
                .unwrap()
                .programmatic_launch
        );
        assert!(e.eager_graph_launch);
        assert!(e.nccl_group_lockstep);
        assert!(
            !env(&[("MSCCLPP_NCCL_GROUP_LOCKSTEP", "off")])
                .unwrap()
                .nccl_group_lockstep
        );
        assert!(
            !env(&[("MSCCLPP_EAGER_GRAPH_LAUNCH", "false")])
                .unwrap()
                .eager_graph_launch
        );
        assert_eq!(e.bootstrap_timeout, Duration::from_secs(30));
        assert_eq!(e.device_wait_timeout, DEFAULT_DEVICE_WAIT_TIMEOUT);
        assert_eq!(e.launcher, None);
        assert_eq!(e.gpu_backend, None);
        assert!(!e.nvls_allowed());
        assert_eq!(e.recognized, vec![("HOME", "/home/u".to_string())]);
    }

    #[test]
    fn empty_value_counts_as_unset() {
        let e = env(&[("MSCCLPP_LOG_LEVEL", ""), ("MSCCLPP_DEBUG", "info")]).unwrap();
        assert_eq!(e.log_level, Some(LogLevel::Info));
    }

    #[rstest]
    #[case("TRACE", LogLevel::Trace)]
    #[case("debug", LogLevel::Debug)]
    #[case("Info", LogLevel::Info)]
    #[case("WARN", LogLevel::Warn)]
    #[case("error", LogLevel::Error)]
    #[case("ABORT", LogLevel::Abort)]
    #[case("VERSION", LogLevel::Version)]
    #[case("none", LogLevel::Off)]
    #[case("OFF", LogLevel::Off)]
    fn log_level_values(#[case] value: &str, #[case] want: LogLevel) {
        assert_eq!(
            env(&[("MSCCLPP_LOG_LEVEL", value)]).unwrap().log_level,
            Some(want)
        );
        assert_eq!(
            env(&[("MSCCLPP_DEBUG", value)]).unwrap().log_level,
            Some(want)
        );
    }

    #[test]
    fn log_level_prefers_new_name_and_rejects_garbage() {
        let e = env(&[("MSCCLPP_LOG_LEVEL", "WARN"), ("MSCCLPP_DEBUG", "TRACE")]).unwrap();
        assert_eq!(e.log_level, Some(LogLevel::Warn));
        assert_eq!(err_var(&[("MSCCLPP_DEBUG", "loud")]), "MSCCLPP_DEBUG");
        assert_eq!(err_var(&[("MSCCLPP_LOG_LEVEL", "3")]), "MSCCLPP_LOG_LEVEL");
    }

    #[rstest]
    #[case("ALL", &Subsystem::ALL[..])]
    #[case("NET,CONN", &[Subsystem::Net, Subsystem::Conn][..])]
    #[case("env, gpu", &[Subsystem::Env, Subsystem::Gpu][..])]
    #[case("^NET", &[Subsystem::Env, Subsystem::Gpu, Subsystem::Conn, Subsystem::Exec, Subsystem::Nccl, Subsystem::Algo][..])]
    #[case("^ALL", &[][..])]
    #[case("EXEC,NCCL,ALGO", &[Subsystem::Exec, Subsystem::Nccl, Subsystem::Algo][..])]
    fn subsystem_filter_values(#[case] value: &str, #[case] want: &[Subsystem]) {
        let e = env(&[("MSCCLPP_DEBUG_SUBSYS", value)]).unwrap();
        assert_eq!(e.debug_subsys.enabled().collect::<Vec<_>>(), want);
        assert_eq!(e.debug_subsys, SubsystemFilter::only(want));
    }

    #[rstest]
    #[case("INIT")]
    #[case("NET,,CONN")]
    #[case("^")]
    fn subsystem_filter_rejects(#[case] value: &str) {
        assert_eq!(
            err_var(&[("MSCCLPP_DEBUG_SUBSYS", value)]),
            "MSCCLPP_DEBUG_SUBSYS"
        );
        assert_eq!(
            err_var(&[("MSCCLPP_LOG_SUBSYS", value)]),
            "MSCCLPP_LOG_SUBSYS"
        );
    }

    #[test]
    fn log_file_substitutes_host_and_pid() {
        let e = env(&[("MSCCLPP_DEBUG_FILE", "/tmp/log.%h.%p.%%")]).unwrap();
        let want = format!("/tmp/log.{}.{}.%", host_name(), std::process::id());
        assert_eq!(e.log_file, Some(PathBuf::from(want)));
        let e = env(&[("MSCCLPP_LOG_FILE", "/a"), ("MSCCLPP_DEBUG_FILE", "/b")]).unwrap();
        assert_eq!(e.log_file, Some(PathBuf::from("/a")));
    }

    #[rstest]
    #[case("/tmp/x.%q")]
    #[case("/tmp/x%")]
    fn log_file_rejects_bad_patterns(#[case] value: &str) {
        assert_eq!(err_var(&[("MSCCLPP_LOG_FILE", value)]), "MSCCLPP_LOG_FILE");
    }

    #[test]
    fn cache_dir_explicit_and_without_home() {
        let e = env(&[("MSCCLPP_CACHE_DIR", "/scratch/c"), ("HOME", "/h")]).unwrap();
        assert_eq!(e.cache_dir, PathBuf::from("/scratch/c"));
        let e = env(&[]).unwrap();
        assert_eq!(e.cache_dir, std::env::temp_dir().join("mscclpp-cache"));
    }

    #[rstest]
    #[case("AF_INET", SocketFamily::Inet)]
    #[case("ipv4", SocketFamily::Inet)]
    #[case("inet", SocketFamily::Inet)]
    #[case("AF_INET6", SocketFamily::Inet6)]
    #[case("IPv6", SocketFamily::Inet6)]
    #[case("inet6", SocketFamily::Inet6)]
    fn socket_family_values(#[case] value: &str, #[case] want: SocketFamily) {
        assert_eq!(
            env(&[("MSCCLPP_SOCKET_FAMILY", value)])
                .unwrap()
                .socket_family,
            Some(want)
        );
    }

    #[test]
    fn socket_settings() {
        assert_eq!(
            err_var(&[("MSCCLPP_SOCKET_FAMILY", "AF_UNIX")]),
            "MSCCLPP_SOCKET_FAMILY"
        );
        let e = env(&[
            ("MSCCLPP_SOCKET_IFNAME", "eth0"),
            ("MSCCLPP_HOSTID", "node7"),
        ])
        .unwrap();
        assert_eq!(e.socket_ifname.as_deref(), Some("eth0"));
        assert_eq!(e.host_id.as_deref(), Some("node7"));
    }

    #[rstest]
    #[case("10.0.0.1:5000", true)]
    #[case("[::1]:5000", true)]
    #[case("host", false)]
    #[case(":5000", false)]
    #[case("host:0", false)]
    #[case("host:70000", false)]
    fn comm_id_values(#[case] value: &str, #[case] ok: bool) {
        let r = env(&[("MSCCLPP_COMM_ID", value)]);
        if ok {
            assert_eq!(r.unwrap().comm_id.as_deref(), Some(value));
        } else {
            assert_eq!(err_var(&[("MSCCLPP_COMM_ID", value)]), "MSCCLPP_COMM_ID");
        }
    }

    #[test]
    fn ib_settings() {
        let e = env(&[
            ("MSCCLPP_HCA_DEVICES", "mlx5_0, mlx5_1"),
            ("MSCCLPP_IBV_SO", "/opt/lib/libibverbs.so"),
            ("MSCCLPP_IBV_MODE", "host-no-atomic"),
            ("MSCCLPP_IB_GID_INDEX", "3"),
            ("MSCCLPP_DISABLE_IB_TESTS", "yes"),
            ("MSCCLPP_FORCE_DISABLE_GDR", "1"),
        ])
        .unwrap();
        assert_eq!(e.hca_devices, vec!["mlx5_0", "mlx5_1"]);
        assert_eq!(e.ibv_so, Some(PathBuf::from("/opt/lib/libibverbs.so")));
        assert_eq!(e.ibv_mode, IbvMode::HostNoAtomic);
        assert_eq!(e.ib_gid_index, Some(3));
        assert!(e.disable_ib_tests && e.force_disable_gdr);
        assert_eq!(
            env(&[("MSCCLPP_IBV_MODE", "HOST")]).unwrap().ibv_mode,
            IbvMode::Host
        );
    }

    #[rstest]
    #[case("MSCCLPP_HCA_DEVICES", "mlx5_0,,mlx5_1")]
    #[case("MSCCLPP_HCA_DEVICES", "mlx5 0")]
    #[case("MSCCLPP_IBV_MODE", "gpu")]
    #[case("MSCCLPP_IB_GID_INDEX", "-1")]
    #[case("MSCCLPP_IB_GID_INDEX", "three")]
    #[case("MSCCLPP_DISABLE_IB_TESTS", "2")]
    #[case("MSCCLPP_FORCE_DISABLE_GDR", "maybe")]
    fn ib_settings_reject(#[case] var: &str, #[case] value: &str) {
        assert_eq!(err_var(&[(var, value)]), var);
    }

    #[rstest]
    #[case("1", true)]
    #[case("0", false)]
    #[case("TRUE", true)]
    #[case("false", false)]
    #[case("Yes", true)]
    #[case("no", false)]
    #[case("on", true)]
    #[case("OFF", false)]
    fn booleans(#[case] value: &str, #[case] want: bool) {
        for var in [
            "MSCCLPP_DISABLE_IB_TESTS",
            "MSCCLPP_ENABLE_NCCL_FALLBACK",
            "MSCCLPP_NCCL_SYMMETRIC_MEMORY",
            "MSCCLPP_DISABLE_CHANNEL_CACHE",
            "MSCCLPP_CUDAIPC_USE_DEFAULT_STREAM",
            "MSCCLPP_FORCE_DISABLE_NVLS",
            "MSCCLPP_ENABLE_NVLS",
        ] {
            let e = env(&[(var, value)]).unwrap();
            let got = match var {
                "MSCCLPP_DISABLE_IB_TESTS" => e.disable_ib_tests,
                "MSCCLPP_ENABLE_NCCL_FALLBACK" => e.enable_nccl_fallback,
                "MSCCLPP_NCCL_SYMMETRIC_MEMORY" => e.nccl_symmetric_memory,
                "MSCCLPP_DISABLE_CHANNEL_CACHE" => e.disable_channel_cache,
                "MSCCLPP_CUDAIPC_USE_DEFAULT_STREAM" => e.cudaipc_use_default_stream,
                "MSCCLPP_FORCE_DISABLE_NVLS" => e.force_disable_nvls,
                _ => e.enable_nvls,
            };
            assert_eq!(got, want, "{var}={value}");
            assert_eq!(err_var(&[(var, "enable")]), var);
        }
        assert_eq!(
            env(&[("NCCL_NVLS_ENABLE", value)])
                .unwrap()
                .nccl_nvls_enable,
            Some(want)
        );
    }

    #[test]
    fn nccl_settings() {
        let e = env(&[
            ("MSCCLPP_NCCL_LIB_PATH", "/usr/lib/libnccl.so.2"),
            (
                "MSCCLPP_FORCE_NCCL_FALLBACK_OPERATION",
                "AllReduce,broadcast",
            ),
            ("MSCCLPP_EXECUTION_PLAN_DIR", "/plans"),
            ("MSCCLPP_NPKIT_DUMP_DIR", "/npkit"),
        ])
        .unwrap();
        assert_eq!(
            e.nccl_lib_path,
            Some(PathBuf::from("/usr/lib/libnccl.so.2"))
        );
        assert_eq!(
            e.force_nccl_fallback_operation,
            vec!["allreduce", "broadcast"]
        );
        assert_eq!(e.execution_plan_dir, Some(PathBuf::from("/plans")));
        assert_eq!(e.npkit_dump_dir, Some(PathBuf::from("/npkit")));
        assert_eq!(
            err_var(&[("MSCCLPP_FORCE_NCCL_FALLBACK_OPERATION", "allreduce,scan")]),
            "MSCCLPP_FORCE_NCCL_FALLBACK_OPERATION"
        );
    }

    #[rstest]
    #[case(&[("MSCCLPP_ENABLE_NVLS", "1")], true)]
    #[case(&[], false)]
    #[case(&[("MSCCLPP_ENABLE_NVLS", "1"), ("MSCCLPP_FORCE_DISABLE_NVLS", "1")], false)]
    #[case(&[("MSCCLPP_ENABLE_NVLS", "1"), ("MSCCLPP_DISABLE_NVLS", "1")], false)]
    #[case(&[("MSCCLPP_ENABLE_NVLS", "1"), ("NCCL_NVLS_ENABLE", "0")], false)]
    #[case(&[("MSCCLPP_ENABLE_NVLS", "1"), ("NCCL_NVLS_ENABLE", "1")], true)]
    #[case(&[("NCCL_NVLS_ENABLE", "1")], false)]
    fn nvls_gate(#[case] pairs: &[(&str, &str)], #[case] allowed: bool) {
        assert_eq!(env(pairs).unwrap().nvls_allowed(), allowed);
    }

    #[test]
    fn cuda_device_max_connections_is_read_and_checked() {
        assert_eq!(env(&[]).unwrap().cuda_device_max_connections, None);
        let e = env(&[("CUDA_DEVICE_MAX_CONNECTIONS", "1")]).unwrap();
        assert_eq!(e.cuda_device_max_connections, Some(1));
        assert_eq!(
            err_var(&[("CUDA_DEVICE_MAX_CONNECTIONS", "many")]),
            "CUDA_DEVICE_MAX_CONNECTIONS"
        );
    }

    #[test]
    fn master_and_backend() {
        let e = env(&[
            ("MSCCLPP_MASTER_ADDR", "node0"),
            ("MSCCLPP_MASTER_PORT", "29500"),
            ("MSCCLPP_GPU_BACKEND", "ROCm"),
            ("MASTER_ADDR", "10.1.1.1"),
            ("MASTER_PORT", "1234"),
        ])
        .unwrap();
        assert_eq!(e.master_addr.as_deref(), Some("node0"));
        assert_eq!(e.master_port, Some(29500));
        assert_eq!(e.gpu_backend, Some(BackendChoice::Rocm));
        assert_eq!(e.torch_master, Some(("10.1.1.1".to_string(), 1234)));
        assert_eq!(
            env(&[("MSCCLPP_GPU_BACKEND", "cuda")]).unwrap().gpu_backend,
            Some(BackendChoice::Cuda)
        );
        assert_eq!(
            env(&[("MSCCLPP_GPU_BACKEND", "auto")]).unwrap().gpu_backend,
            Some(BackendChoice::Auto)
        );
    }

    #[rstest]
    #[case("MSCCLPP_MASTER_PORT", "0")]
    #[case("MSCCLPP_MASTER_PORT", "65536")]
    #[case("MSCCLPP_MASTER_PORT", "http")]
    #[case("MSCCLPP_GPU_BACKEND", "metal")]
    #[case("MASTER_PORT", "x")]
    fn master_and_backend_reject(#[case] var: &str, #[case] value: &str) {
        let mut pairs = vec![(var, value)];
        if var == "MASTER_PORT" {
            pairs.push(("MASTER_ADDR", "h"));
        }
        assert_eq!(err_var(&pairs), var);
    }

    #[test]
    fn torch_master_needs_both() {
        assert_eq!(err_var(&[("MASTER_ADDR", "h")]), "MASTER_ADDR");
        assert_eq!(err_var(&[("MASTER_PORT", "1")]), "MASTER_PORT");
    }

    #[rstest]
    #[case("2.5", Duration::from_millis(2500))]
    #[case("120", Duration::from_secs(120))]
    #[case("0.001", Duration::from_millis(1))]
    fn timeouts(#[case] value: &str, #[case] want: Duration) {
        assert_eq!(
            env(&[("MSCCLPP_BOOTSTRAP_TIMEOUT", value)])
                .unwrap()
                .bootstrap_timeout,
            want
        );
        assert_eq!(
            env(&[("MSCCLPP_DEVICE_WAIT_TIMEOUT", value)])
                .unwrap()
                .device_wait_timeout,
            want
        );
        assert_eq!(
            env(&[("MSCCLPP_LIVENESS_TIMEOUT", value)])
                .unwrap()
                .liveness_timeout,
            want
        );
    }

    /// Without its own variable the liveness timeout follows the device wait budget.
    #[test]
    fn liveness_timeout_defaults_to_the_device_wait_timeout() {
        let e = env(&[("MSCCLPP_DEVICE_WAIT_TIMEOUT", "3")]).unwrap();
        assert_eq!(e.liveness_timeout, Duration::from_secs(3));
        assert_eq!(
            env(&[]).unwrap().liveness_timeout,
            DEFAULT_DEVICE_WAIT_TIMEOUT
        );
    }

    #[rstest]
    #[case("0")]
    #[case("-1")]
    #[case("inf")]
    #[case("NaN")]
    #[case("30s")]
    #[case("1e300")]
    fn timeouts_reject(#[case] value: &str) {
        assert_eq!(
            err_var(&[("MSCCLPP_BOOTSTRAP_TIMEOUT", value)]),
            "MSCCLPP_BOOTSTRAP_TIMEOUT"
        );
        assert_eq!(
            err_var(&[("MSCCLPP_DEVICE_WAIT_TIMEOUT", value)]),
            "MSCCLPP_DEVICE_WAIT_TIMEOUT"
        );
        assert_eq!(
            err_var(&[("MSCCLPP_LIVENESS_TIMEOUT", value)]),
            "MSCCLPP_LIVENESS_TIMEOUT"
        );
    }

    /// The shim's wait for a watchdog takes 0 (off) as well as a number of seconds.
    #[test]
    fn watchdog_wait_takes_zero_and_rejects_the_rest_of_the_bad_values() {
        assert_eq!(
            env(&[]).unwrap().nccl_watchdog_wait,
            DEFAULT_NCCL_WATCHDOG_WAIT
        );
        for (value, want) in [("0", Duration::ZERO), ("2.5", Duration::from_millis(2500))] {
            let e = env(&[("MSCCLPP_NCCL_WATCHDOG_WAIT", value)]).unwrap();
            assert_eq!(e.nccl_watchdog_wait, want);
        }
        for value in ["-1", "inf", "NaN", "10s"] {
            assert_eq!(
                err_var(&[("MSCCLPP_NCCL_WATCHDOG_WAIT", value)]),
                "MSCCLPP_NCCL_WATCHDOG_WAIT"
            );
        }
    }

    #[rstest]
    #[case(&[("RANK", "3"), ("WORLD_SIZE", "8"), ("LOCAL_RANK", "3"), ("LOCAL_WORLD_SIZE", "4")],
           Launcher { rank: 3, world_size: 8, local_rank: 3, local_size: Some(4), source: LauncherKind::Torchrun })]
    #[case(&[("OMPI_COMM_WORLD_RANK", "5"), ("OMPI_COMM_WORLD_SIZE", "16"), ("OMPI_COMM_WORLD_LOCAL_RANK", "1"), ("OMPI_COMM_WORLD_LOCAL_SIZE", "8")],
           Launcher { rank: 5, world_size: 16, local_rank: 1, local_size: Some(8), source: LauncherKind::OpenMpi })]
    #[case(&[("PMI_RANK", "2"), ("PMI_SIZE", "4"), ("MPI_LOCALRANKID", "0")],
           Launcher { rank: 2, world_size: 4, local_rank: 0, local_size: None, source: LauncherKind::Pmi })]
    #[case(&[("SLURM_PROCID", "7"), ("SLURM_NTASKS", "8"), ("SLURM_LOCALID", "3"), ("SLURM_NTASKS_PER_NODE", "4(x2)")],
           Launcher { rank: 7, world_size: 8, local_rank: 3, local_size: None, source: LauncherKind::Slurm })]
    #[case(&[("RANK", "0"), ("WORLD_SIZE", "1")],
           Launcher { rank: 0, world_size: 1, local_rank: 0, local_size: None, source: LauncherKind::Torchrun })]
    // torchrun inside an srun step: torchrun's variables describe this process.
    #[case(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "1"), ("SLURM_LOCALID", "0"), ("RANK", "1"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "1")],
           Launcher { rank: 1, world_size: 2, local_rank: 1, local_size: None, source: LauncherKind::Torchrun })]
    fn launchers(#[case] pairs: &[(&str, &str)], #[case] want: Launcher) {
        assert_eq!(env(pairs).unwrap().launcher, Some(want));
    }

    #[rstest]
    #[case(&[("RANK", "4"), ("WORLD_SIZE", "4"), ("LOCAL_RANK", "0")], "RANK")]
    #[case(&[("RANK", "0")], "RANK")]
    #[case(&[("WORLD_SIZE", "2")], "WORLD_SIZE")]
    #[case(&[("RANK", "0"), ("WORLD_SIZE", "0")], "WORLD_SIZE")]
    #[case(&[("RANK", "x"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0")], "RANK")]
    #[case(&[("RANK", "1"), ("WORLD_SIZE", "2")], "RANK")]
    #[case(&[("RANK", "1"), ("WORLD_SIZE", "4"), ("LOCAL_RANK", "2"), ("LOCAL_WORLD_SIZE", "2")], "LOCAL_RANK")]
    #[case(&[("RANK", "1"), ("WORLD_SIZE", "4"), ("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "8")], "LOCAL_WORLD_SIZE")]
    #[case(&[("OMPI_COMM_WORLD_RANK", "9"), ("OMPI_COMM_WORLD_SIZE", "2"), ("OMPI_COMM_WORLD_LOCAL_RANK", "0")], "OMPI_COMM_WORLD_RANK")]
    #[case(&[("PMI_RANK", "1"), ("PMI_SIZE", "2"), ("MPI_LOCALRANKID", "-1")], "MPI_LOCALRANKID")]
    #[case(&[("SLURM_PROCID", "2"), ("SLURM_NTASKS", "2"), ("SLURM_LOCALID", "0")], "SLURM_PROCID")]
    fn launchers_reject(#[case] pairs: &[(&str, &str)], #[case] var: &str) {
        assert_eq!(err_var(pairs), var);
    }

    #[test]
    fn rank_error_names_both_variables() {
        let msg = env(&[("RANK", "4"), ("WORLD_SIZE", "4"), ("LOCAL_RANK", "0")])
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("RANK=4") && msg.contains("WORLD_SIZE=4"),
            "{msg}"
        );
    }

    #[test]
    fn nccl_shim_variables() {
        use crate::dtype::AccumType;
        let e = env(&[("MSCCLPP_NCCL_ACCUM_DTYPE", "F32")]).unwrap();
        assert_eq!(e.nccl_accum_dtype, AccumType::F32);
        assert_eq!(env(&[]).unwrap().nccl_accum_dtype, AccumType::Auto);
        assert_eq!(
            err_var(&[("MSCCLPP_NCCL_ACCUM_DTYPE", "fp8")]),
            "MSCCLPP_NCCL_ACCUM_DTYPE"
        );
        let e = env(&[("MSCCLPP_FORCE_NCCL_FALLBACK_OPERATION", "all")]).unwrap();
        assert_eq!(e.force_nccl_fallback_operation, ["all"]);
    }

    #[test]
    fn recognized_and_unknown_variables() {
        let e = env(&[
            ("MSCCLPP_DEBUG", "INFO"),
            ("MSCCLPP_DEBUGG", "1"),
            ("PATH", "/bin"),
        ])
        .unwrap();
        assert_eq!(e.recognized, vec![("MSCCLPP_DEBUG", "INFO".to_string())]);
        assert_eq!(e.unknown, vec!["MSCCLPP_DEBUGG".to_string()]);
    }

    #[test]
    fn error_message_names_variable_value_and_reason() {
        let msg = env(&[("MSCCLPP_IBV_MODE", "fast")])
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("MSCCLPP_IBV_MODE")
                && msg.contains("fast")
                && msg.contains("host-no-atomic"),
            "{msg}"
        );
    }

    #[test]
    fn get_is_stable() {
        // Whatever the test process's environment holds, two calls agree.
        match (Env::get(), Env::get()) {
            (Ok(a), Ok(b)) => assert!(std::ptr::eq(a, b)),
            (Err(a), Err(b)) => assert_eq!(a.to_string(), b.to_string()),
            (a, b) => panic!("Env::get changed its answer: {a:?} vs {b:?}"),
        }
    }
}
