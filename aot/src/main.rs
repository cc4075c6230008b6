//! `mscclpp-aot`: compiles the kernel units the runtime loads ([`units`]) ahead of time with
//! NVRTC, for every architecture asked for, and writes them as one blob (the format:
//! `mscclpp_cuda::aot`) that a build with `MSCCLPP_AOT_BLOB=<blob>` embeds.
//!
//! ```text
//! source scripts/nvrtc-env.sh
//! cargo run --release -p mscclpp-aot -- -o target/kernels.aot
//!     [--archs sm_80,sm_90,sm_100,sm_120] [--ptx compute_120] [--units default|all]
//! ```
//! `--ptx none` leaves PTX out. It prints, per architecture, the units, the CPU time their
//! compiles took and the bytes they take raw and compressed. A unit that does not compile fails
//! the tool, naming it. A blob already at the output path that holds exactly what would be
//! compiled is left as it is (the keys hash every input), so builds can ask for it every time.

mod units;

use mscclpp_cuda::aot::{self, FrameImages};
use mscclpp_cuda::compile_test::for_each_on_all_cores;
use mscclpp_cuda::{CompileRequest, Nvrtc};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Mutex;
use std::time::{Duration, Instant};
use units::{Unit, UnitSet};

/// zstd's highest level short of `--ultra`: the blob is built once and read on every start.
const ZSTD_LEVEL: i32 = 19;

const USAGE: &str = "usage: mscclpp-aot -o FILE [--archs sm_80,sm_90,sm_100,sm_120] \
                     [--ptx compute_120|none] [--units default|all]";

#[derive(Debug)]
struct Args {
    out: PathBuf,
    archs: Vec<String>,
    set: UnitSet,
}

fn parse_args() -> Result<Args, String> {
    let mut out = None;
    let mut cubins = "sm_80,sm_90,sm_100,sm_120".to_string();
    let mut ptx = "compute_120".to_string();
    let mut set = UnitSet::Default;
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        let mut value = || {
            it.next()
                .ok_or_else(|| format!("{a} needs a value; {USAGE}"))
        };
        match a.as_str() {
            "-o" => out = Some(PathBuf::from(value()?)),
            "--archs" => cubins = value()?,
            "--ptx" => ptx = value()?,
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
        out: out.ok_or_else(|| format!("-o FILE is required; {USAGE}"))?,
        archs,
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

fn compile_all(nvrtc: &Nvrtc, units: &[Unit], archs: &[String]) -> Result<Vec<Compiled>, String> {
    let jobs: Vec<(usize, usize)> = (0..archs.len())
        .flat_map(|a| (0..units.len()).map(move |u| (a, u)))
        .collect();
    let done = Mutex::new(Vec::with_capacity(jobs.len()));
    let failures = Mutex::new(Vec::new());
    for_each_on_all_cores(&jobs, |&(arch, unit)| {
        let u = &units[unit];
        let req = CompileRequest {
            name: &u.name,
            source: &u.source,
            arch: &archs[arch],
            headers: mscclpp_kernels_cu::HEADERS,
            options: &[],
        };
        let start = thread_cpu();
        match nvrtc.compile(&req) {
            Ok(k) => done
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(Compiled {
                    arch,
                    unit,
                    key: aot::embedded_key(&req),
                    image: k.image,
                    took: thread_cpu().saturating_sub(start),
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
    let nvrtc = Nvrtc::load().map_err(|e| e.to_string())?;
    let units = units::units(args.set).map_err(|e| e.to_string())?;
    let (major, minor) = nvrtc.version();
    eprintln!(
        "mscclpp-aot: {} units x {} ({}) with NVRTC {major}.{minor} from {}",
        units.len(),
        args.archs.join(" "),
        args.archs.len(),
        nvrtc.location()
    );
    let compiler = (
        u32::try_from(major).unwrap_or(0),
        u32::try_from(minor).unwrap_or(0),
    );
    if up_to_date(&args, &units, compiler) {
        println!("blob {}: up to date", args.out.display());
        return Ok(());
    }
    let start = Instant::now();
    let mut compiled = compile_all(&nvrtc, &units, &args.archs)?;
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
    let blob = aot::encode(compiler, &args.archs, &frames, |bytes| {
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
    println!("arch\tunits\tcompile CPU s\traw MiB\tcompressed MiB");
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

/// Whether the blob at `args.out` was made by this NVRTC for these architectures and holds
/// exactly the images `units` would compile: then the sources, headers and options they were
/// compiled from are today's (the keys hash them), and compiling again would rewrite the same blob.
fn up_to_date(args: &Args, units: &[Unit], compiler: aot::Version) -> bool {
    let Ok(bytes) = std::fs::read(&args.out) else {
        return false;
    };
    let Ok(blob) = aot::Blob::parse(&bytes) else {
        return false;
    };
    if blob.compiler() != compiler
        || blob.archs() != args.archs
        || blob.len() != units.len() * args.archs.len()
    {
        return false;
    }
    args.archs.iter().all(|arch| {
        units.iter().all(|u| {
            let req = CompileRequest {
                name: &u.name,
                source: &u.source,
                arch,
                headers: mscclpp_kernels_cu::HEADERS,
                options: &[],
            };
            blob.contains(&aot::embedded_key(&req))
        })
    })
}

/// Reads every image back through the run time's reader (`aot::Blob`, whose zstd decoder is not
/// the encoder's library) and compares it with what was compiled; returns how long that took.
fn verify(blob: &[u8], frames: &[FrameImages]) -> Result<Duration, String> {
    let start = Instant::now();
    let parsed =
        aot::Blob::parse(blob).map_err(|e| format!("the blob written does not parse: {e}"))?;
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
