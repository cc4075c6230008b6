//! `mscclpp-aot`: compiles the kernel units the runtime loads ([`units`]) ahead of time, for every
//! architecture asked for, and writes them as one blob (the format: `mscclpp_core::kernel_image`)
//! that a build embeds: CUBINs and PTX by NVRTC, which `mscclpp-cuda` embeds under
//! `MSCCLPP_AOT_BLOB=<blob>`, or with `--hip` AMD code objects by clang and ROCm's device
//! libraries (`mscclpp_rocm::clang`), which `mscclpp-rocm` embeds under `MSCCLPP_AOT_HIP_BLOB`.
//!
//! ```text
//! source scripts/nvrtc-env.sh
//! cargo run --release -p mscclpp-aot -- -o target/kernels.aot
//!     [--archs sm_80,sm_90,sm_100,sm_120] [--ptx compute_120] [--units default|all]
//! source scripts/hip-env.sh
//! cargo run --release -p mscclpp-aot -- -o target/kernels-hip.aot --hip gfx90a,gfx942
//! ```
//! `--ptx none` leaves PTX out. It prints, per architecture, the units, the CPU time their
//! compiles took and the bytes they take raw and compressed. A unit that does not compile fails
//! the tool, naming it. A blob already at the output path that holds exactly what would be
//! compiled is left as it is (the keys hash every input), so builds can ask for it every time.

mod units;

use mscclpp_core::kernel_image::{self as image, CompileRequest, FrameImages};
use mscclpp_cuda::compile_test::for_each_on_all_cores;
use mscclpp_cuda::Nvrtc;
use mscclpp_rocm::clang::{ClangHip, Output};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Mutex;
use std::time::{Duration, Instant};
use units::{Unit, UnitSet};

/// zstd's highest level short of `--ultra`: the blob is built once and read on every start.
const ZSTD_LEVEL: i32 = 19;

const USAGE: &str = "usage: mscclpp-aot -o FILE [--archs sm_80,sm_90,sm_100,sm_120] \
                     [--ptx compute_120|none] [--hip gfx90a,gfx942] [--units default|all]";

#[derive(Debug)]
struct Args {
    out: PathBuf,
    archs: Vec<String>,
    /// AMD code objects (`--hip`) instead of CUBINs and PTX.
    hip: bool,
    set: UnitSet,
}

/// The AMD targets `--hip` builds: the ones ROCm 6.0's device libraries and `inspect_code_object`
/// know (MI200 and MI300).
const HIP_TARGETS: [&str; 2] = ["gfx90a", "gfx942"];

fn parse_args() -> Result<Args, String> {
    let mut out = None;
    let mut cubins = "sm_80,sm_90,sm_100,sm_120".to_string();
    let mut ptx = "compute_120".to_string();
    let mut set = UnitSet::Default;
    let mut hip = None;
    let mut cuda_given = false;
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        let mut value = || {
            it.next()
                .ok_or_else(|| format!("{a} needs a value; {USAGE}"))
        };
        match a.as_str() {
            "-o" => out = Some(PathBuf::from(value()?)),
            "--archs" => (cubins, cuda_given) = (value()?, true),
            "--ptx" => (ptx, cuda_given) = (value()?, true),
            "--hip" => hip = Some(value()?),
            "--units" => {
                set = match value()?.as_str() {
                    "default" => UnitSet::Default,
                    "all" => UnitSet::All,
                    other => return Err(format!("--units {other}: default or all")),
                }
            }
            "-h" | "--help" => return Err(USAGE.into()),
            other => return Err(format!("unknown argument {other}; {USAGE}")),
        }
    }
    let out = out.ok_or_else(|| format!("-o FILE is required; {USAGE}"))?;
    if let Some(hip) = hip {
        if cuda_given {
            return Err(format!(
                "--hip builds AMD code objects only: leave out --archs and --ptx; {USAGE}"
            ));
        }
        let archs: Vec<String> = hip.split(',').map(str::to_string).collect();
        if let Some(a) = archs.iter().find(|a| !HIP_TARGETS.contains(&a.as_str())) {
            return Err(format!("{a}: --hip builds {}", HIP_TARGETS.join(" and ")));
        }
        return Ok(Args {
            out,
            archs,
            hip: true,
            set,
        });
    }
    let mut archs: Vec<String> = cubins.split(',').map(str::to_string).collect();
    if ptx != "none" {
        archs.extend(ptx.split(',').map(str::to_string));
    }
    for a in &archs {
        if !(a.starts_with("sm_") || a.starts_with("compute_")) {
            return Err(format!("{a} is no sm_XY or compute_XY architecture"));
        }
    }
    Ok(Args {
        out,
        archs,
        hip: false,
        set,
    })
}

/// CPU time of the calling thread: one NVRTC compile runs on one thread, and on a shared machine
/// its wall time says little.
fn thread_cpu() -> Duration {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: writes one timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) };
    Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
}

/// One compiled image, with its compile's CPU time.
struct Compiled {
    arch: usize,
    unit: usize,
    key: [u8; 32],
    image: Vec<u8>,
    took: Duration,
}

/// The compiler of one vendor's images, and the key the runtime looks each up by.
enum Compiler {
    Nvrtc(Nvrtc),
    /// clang for AMD code objects, with the headers every HIP unit is compiled with.
    Clang(ClangHip, Vec<(&'static str, &'static str)>),
}

impl Compiler {
    fn new(hip: bool) -> Result<Compiler, String> {
        if hip {
            let headers = mscclpp_kernels_hip::all_headers();
            return Ok(Compiler::Clang(ClangHip::new(&headers)?, headers));
        }
        Nvrtc::load()
            .map(Compiler::Nvrtc)
            .map_err(|e| e.to_string())
    }

    fn describe(&self) -> String {
        match self {
            Compiler::Nvrtc(n) => {
                let (major, minor) = n.version();
                format!("NVRTC {major}.{minor} from {}", n.location())
            }
            Compiler::Clang(c, _) => c.version_line().to_string(),
        }
    }

    /// The version the blob records: NVRTC's decides which drivers load it.
    fn version(&self) -> image::Version {
        match self {
            Compiler::Nvrtc(n) => {
                let (major, minor) = n.version();
                (
                    u32::try_from(major).unwrap_or(0),
                    u32::try_from(minor).unwrap_or(0),
                )
            }
            Compiler::Clang(c, _) => c.version(),
        }
    }

    fn request<'a>(&'a self, unit: &'a Unit, arch: &'a str) -> CompileRequest<'a> {
        CompileRequest {
            name: &unit.name,
            source: &unit.source,
            arch,
            headers: match self {
                Compiler::Nvrtc(_) => mscclpp_kernels_cu::HEADERS,
                Compiler::Clang(_, headers) => headers,
            },
            options: &[],
        }
    }

    /// The key the runtime's request for `unit` on `arch` has (`mscclpp_cuda::aot`,
    /// `mscclpp_rocm::aot`).
    fn key(&self, unit: &Unit, arch: &str) -> [u8; 32] {
        let req = self.request(unit, arch);
        match self {
            Compiler::Nvrtc(_) => mscclpp_cuda::aot::embedded_key(&req),
            Compiler::Clang(..) => mscclpp_rocm::aot::embedded_key(&req),
        }
    }

    fn compile(&self, unit: &Unit, arch: &str) -> Result<Vec<u8>, String> {
        match self {
            Compiler::Nvrtc(n) => n
                .compile(&self.request(unit, arch))
                .map(|k| k.image)
                .map_err(|e| e.to_string()),
            Compiler::Clang(c, _) => c.compile(&unit.name, &unit.source, arch, Output::CodeObject),
        }
    }
}

fn compile_all(
    compiler: &Compiler,
    units: &[Unit],
    archs: &[String],
) -> Result<Vec<Compiled>, String> {
    let jobs: Vec<(usize, usize)> = (0..archs.len())
        .flat_map(|a| (0..units.len()).map(move |u| (a, u)))
        .collect();
    let done = Mutex::new(Vec::with_capacity(jobs.len()));
    let failures = Mutex::new(Vec::new());
    for_each_on_all_cores(&jobs, |&(arch, unit)| {
        let u = &units[unit];
        let start = thread_cpu();
        let started = Instant::now();
        match compiler.compile(u, &archs[arch]) {
            Ok(image) => done
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(Compiled {
                    arch,
                    unit,
                    key: compiler.key(u, &archs[arch]),
                    image,
                    // clang runs in a child process: its time is the wall time of the call.
                    took: match compiler {
                        Compiler::Nvrtc(_) => thread_cpu().saturating_sub(start),
                        Compiler::Clang(..) => started.elapsed(),
                    },
                }),
            Err(e) => failures
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(format!("{} for {}: {e}", u.name, archs[arch])),
        }
    });
    let failures = failures.into_inner().unwrap_or_else(|p| p.into_inner());
    if !failures.is_empty() {
        return Err(failures.join("\n\n"));
    }
    Ok(done.into_inner().unwrap_or_else(|p| p.into_inner()))
}

fn run() -> Result<(), String> {
    let args = parse_args()?;
    let compiler = Compiler::new(args.hip)?;
    let units = units::units(args.set, args.hip).map_err(|e| e.to_string())?;
    eprintln!(
        "mscclpp-aot: {} units x {} ({}) with {}",
        units.len(),
        args.archs.join(" "),
        args.archs.len(),
        compiler.describe()
    );
    if up_to_date(&args, &units, &compiler) {
        println!("blob {}: up to date", args.out.display());
        return Ok(());
    }
    let start = Instant::now();
    let mut compiled = compile_all(&compiler, &units, &args.archs)?;
    let wall = start.elapsed();
    // Frames in a fixed order (architecture, family, unit), so the blob is reproducible.
    compiled.sort_by_key(|c| (c.arch, units[c.unit].family, c.unit));
    let mut frames: BTreeMap<(usize, &str), FrameImages> = BTreeMap::new();
    let mut cpu = vec![Duration::ZERO; args.archs.len()];
    let mut raw = vec![0usize; args.archs.len()];
    for c in compiled {
        cpu[c.arch] += c.took;
        raw[c.arch] += c.image.len();
        let frame = frames.entry((c.arch, units[c.unit].family)).or_default();
        frame.images.push((c.key, c.image));
    }
    let arch_of: Vec<usize> = frames.keys().map(|&(a, _)| a).collect();
    let frames: Vec<FrameImages> = frames.into_values().collect();
    let mut packed = vec![0usize; args.archs.len()];
    let mut frame_index = 0;
    let blob = image::encode(compiler.version(), &args.archs, &frames, |bytes| {
        let out = zstd::bulk::compress(bytes, ZSTD_LEVEL).expect("zstd compresses a buffer");
        packed[arch_of[frame_index]] += out.len();
        frame_index += 1;
        out
    })?;
    let inflate = verify(&blob, &frames)?;
    // Renamed into place: a build never embeds half a blob, nor does the next run reuse one.
    let tmp = args.out.with_extension("tmp");
    std::fs::write(&tmp, &blob)
        .and_then(|()| std::fs::rename(&tmp, &args.out))
        .map_err(|e| format!("{}: {e}", args.out.display()))?;
    // clang runs in child processes, so its column is each compile's wall time.
    let time = if args.hip {
        "compile s"
    } else {
        "compile CPU s"
    };
    println!("arch\tunits\t{time}\traw MiB\tcompressed MiB");
    let mib = |b: usize| b as f64 / (1 << 20) as f64;
    for (i, a) in args.archs.iter().enumerate() {
        println!(
            "{a}\t{}\t{:.0}\t{:.1}\t{:.1}",
            units.len(),
            cpu[i].as_secs_f64(),
            mib(raw[i]),
            mib(packed[i])
        );
    }
    println!(
        "blob {}: {:.1} MiB, {} images; {:.0} s wall; every image read back in {:.2} s",
        args.out.display(),
        mib(blob.len()),
        units.len() * args.archs.len(),
        wall.as_secs_f64(),
        inflate.as_secs_f64()
    );
    Ok(())
}

/// Whether the blob at `args.out` was made by this compiler for these architectures and holds
/// exactly the images `units` would compile: then the sources, headers and options they were
/// compiled from are today's (the keys hash them), and compiling again would rewrite the same blob.
fn up_to_date(args: &Args, units: &[Unit], compiler: &Compiler) -> bool {
    let Ok(bytes) = std::fs::read(&args.out) else {
        return false;
    };
    let Ok(blob) = image::Blob::parse(&bytes) else {
        return false;
    };
    if blob.compiler() != compiler.version()
        || blob.archs() != args.archs
        || blob.len() != units.len() * args.archs.len()
    {
        return false;
    }
    args.archs
        .iter()
        .all(|arch| units.iter().all(|u| blob.contains(&compiler.key(u, arch))))
}

/// Reads every image back through the run time's reader (`aot::Blob`, whose zstd decoder is not
/// the encoder's library) and compares it with what was compiled; returns how long that took.
fn verify(blob: &[u8], frames: &[FrameImages]) -> Result<Duration, String> {
    let start = Instant::now();
    let parsed =
        image::Blob::parse(blob).map_err(|e| format!("the blob written does not parse: {e}"))?;
    for (key, image) in frames.iter().flat_map(|f| &f.images) {
        match parsed.image(key) {
            Ok(Some(read)) if read == &image[..] => {}
            other => {
                return Err(format!(
                    "image {} reads back as {:?}",
                    key.iter().map(|b| format!("{b:02x}")).collect::<String>(),
                    other.map(|o| o.map(<[u8]>::len))
                ))
            }
        }
    }
    Ok(start.elapsed())
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("mscclpp-aot: {e}");
            ExitCode::FAILURE
        }
    }
}
