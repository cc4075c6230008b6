//! Kernels compiled ahead of time and embedded in the library, so that a fresh machine loads them
//! instead of running NVRTC on its first calls (seconds a unit, on every new machine and for
//! every rank at once).
//!
//! `mscclpp-aot` (a build tool, aot/) compiles the units the runtime loads and writes one blob;
//! a build with `MSCCLPP_AOT_BLOB=<blob>` in its environment embeds it (build.rs sets the
//! `mscclpp_aot` cfg), a build without it embeds nothing and compiles everything at run time.
//! `CudaGpu::build_module` asks [`find`] first and goes to NVRTC (through the disk cache) only
//! for what the blob cannot serve, or for everything under `MSCCLPP_NVRTC_FORCE=1`.
//!
//! # Key
//! [`embedded_key`]: SHA-256 over a format tag, the source, the headers, the options every compile
//! passes ([`crate::nvrtc::base_options`]) and the caller's, and the architecture. Unlike the disk
//! cache's key it leaves out the include folders (paths that differ between machines but name
//! the same toolkit headers) and the NVRTC version: a CUBIN does not depend on which NVRTC the
//! machine running it has, only on the driver being new enough, which [`find`] checks against
//! the compiler version the blob records.
//!
//! # What the driver can run
//! A CUBIN made by NVRTC 13.x loads on a driver of CUDA 13.0 or newer, and a CUBIN for sm_80 runs
//! on sm_86 and sm_89 (one major, any later minor). PTX is JIT-compiled by the driver for GPUs
//! newer than every CUBIN, but only by a driver at least as new as the compiler that wrote it.
//! So [`find`] takes, in order: the CUBIN of the device's major with the highest minor not above
//! the device's, where the driver's major is at least the compiler's; the PTX of the newest
//! architecture not above the device, where the driver is at least the compiler's full version;
//! else nothing (NVRTC compiles it). An image the driver refuses all the same is compiled by NVRTC
//! too (`build_module` warns once).
//!
//! The blob's format is `mscclpp_core::kernel_image`'s; a blob whose frames are corrupt serves
//! nothing (logged once), and NVRTC compiles instead, never loading a wrong kernel.

use crate::nvrtc::{base_options, CompileRequest};
pub use mscclpp_core::kernel_image::{encode, Blob, FrameImages, Version};
use mscclpp_core::kernel_image::{parse_embedded, request_key};
use std::sync::{Once, OnceLock};

/// Bumped when anything about how the key is made changes.
const KEY_FORMAT: &str = "mscclpp-rs embedded kernel v1";

/// The key of `req` in a blob (module docs): the same for every machine and NVRTC.
pub fn embedded_key(req: &CompileRequest) -> [u8; 32] {
    let mut options = base_options(req.arch);
    options.extend(req.options.iter().cloned());
    request_key(KEY_FORMAT, req, &options, None)
}

/// `cuDriverGetVersion`'s number as a [`Version`], e.g. 13000 as (13, 0).
pub fn driver_version(raw: i32) -> Version {
    let raw = u32::try_from(raw).unwrap_or(0);
    (raw / 1000, raw % 1000 / 10)
}

/// What [`find`] found for a unit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Found<'b> {
    /// `sm_XY` (a CUBIN) or `compute_XY` (PTX, which the driver JIT-compiles).
    pub arch: &'b str,
    pub image: &'b [u8],
}

/// Why [`find`] found nothing; NVRTC compiles the unit then.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Miss {
    /// The driver is older than the compiler's major: nothing in the blob loads.
    DriverTooOld { driver: Version, compiler: Version },
    /// No image of the unit for this device (a user's unit, a variant not embedded).
    NotEmbedded,
    /// The unit's frame is corrupt (the message says how).
    Corrupt(String),
}

/// `sm_XY` / `compute_XY` as (X, Y); `None` for other names.
fn arch_version(arch: &str) -> Option<Version> {
    let digits = arch
        .strip_prefix("sm_")
        .or_else(|| arch.strip_prefix("compute_"))?;
    if digits.len() < 2 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let (major, minor) = digits.split_at(digits.len() - 1);
    Some((major.parse().ok()?, minor.parse().ok()?))
}

/// The image of `req` (its `arch` ignored) for a device of compute capability `device` under a
/// driver of version `driver`, by the rules in the module docs.
pub fn find<'b>(
    blob: &'b Blob<'_>,
    req: &CompileRequest,
    device: Version,
    driver: Version,
) -> Result<Found<'b>, Miss> {
    if driver.0 < blob.compiler().0 {
        return Err(Miss::DriverTooOld {
            driver,
            compiler: blob.compiler(),
        });
    }
    let with_arch = |arch: &'b str| -> Result<Option<Found<'b>>, Miss> {
        let key = embedded_key(&CompileRequest { arch, ..*req });
        match blob.image(&key) {
            Ok(image) => Ok(image.map(|image| Found { arch, image })),
            Err(why) => Err(Miss::Corrupt(why)),
        }
    };
    // (version, arch) of each kind, newest first, among those the device can run.
    let mut cubins: Vec<(Version, &'b str)> = Vec::new();
    let mut ptx: Vec<(Version, &'b str)> = Vec::new();
    for arch in blob.archs() {
        match arch_version(arch) {
            Some(v) if arch.starts_with("sm_") && v.0 == device.0 && v.1 <= device.1 => {
                cubins.push((v, arch))
            }
            Some(v) if arch.starts_with("compute_") && v <= device => ptx.push((v, arch)),
            _ => {}
        }
    }
    cubins.sort_unstable_by(|a, b| b.cmp(a));
    ptx.sort_unstable_by(|a, b| b.cmp(a));
    for &(_, arch) in &cubins {
        if let Some(found) = with_arch(arch)? {
            return Ok(found);
        }
    }
    if driver >= blob.compiler() {
        for &(_, arch) in &ptx {
            if let Some(found) = with_arch(arch)? {
                return Ok(found);
            }
        }
    }
    Err(Miss::NotEmbedded)
}

/// What `CudaGpu::build_module` loads for `req` before asking NVRTC: the image [`find`] finds in
/// `blob` (the embedded one, if any), unless `force` (`MSCCLPP_NVRTC_FORCE`). `None` means NVRTC
/// compiles it; why is logged (the driver's age and corruption once: they hold for every unit).
pub fn lookup<'b>(
    blob: Option<&'b Blob<'_>>,
    force: bool,
    req: &CompileRequest,
    device: Version,
    driver: impl FnOnce() -> Version,
) -> Option<Found<'b>> {
    let blob = blob.filter(|_| !force)?;
    match find(blob, req, device, driver()) {
        Ok(found) => Some(found),
        Err(miss) => {
            log_miss(req.name, req.arch, &miss);
            None
        }
    }
}

/// The blob this build embeds (`MSCCLPP_AOT_BLOB` at build time), parsed on first use; `None`
/// where there is none or it is corrupt (logged once).
pub fn embedded() -> Option<&'static Blob<'static>> {
    #[cfg(mscclpp_aot)]
    static BYTES: &[u8] = include_bytes!(env!("MSCCLPP_AOT_BLOB_PATH"));
    #[cfg(not(mscclpp_aot))]
    static BYTES: &[u8] = &[];
    static BLOB: OnceLock<Option<Blob<'static>>> = OnceLock::new();
    BLOB.get_or_init(|| parse_embedded(BYTES, "NVRTC")).as_ref()
}

/// Logs why the blob did not serve a unit, where NVRTC is asked instead: the driver's age and
/// corruption once per process (they hold for every unit), a unit that is not embedded at debug
/// level (users' units and rare variants are expected to be compiled).
fn log_miss(name: &str, arch: &str, miss: &Miss) {
    static DRIVER: Once = Once::new();
    static CORRUPT: Once = Once::new();
    match miss {
        Miss::DriverTooOld { driver, compiler } => DRIVER.call_once(|| {
            tracing::warn!(
                target: "mscclpp::gpu",
                "the embedded kernels were compiled by NVRTC {}.{}, which needs a CUDA {}.x driver; \
                 this driver is {}.{}: every kernel is compiled by NVRTC",
                compiler.0, compiler.1, compiler.0, driver.0, driver.1
            )
        }),
        Miss::Corrupt(why) => CORRUPT.call_once(|| {
            tracing::error!(
                target: "mscclpp::gpu",
                "embedded kernels: {why}; the kernels of that frame are compiled by NVRTC"
            )
        }),
        Miss::NotEmbedded => {
            tracing::debug!(target: "mscclpp::gpu", "{name} for {arch} is not embedded")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mscclpp_core::kernel_image::testing::two_unit_blob;

    const HEADERS: &[(&str, &str)] = &[("mscclpp/a.cuh", "#define A 1\n")];

    fn req<'a>(name: &'a str, source: &'a str, arch: &'a str) -> CompileRequest<'a> {
        CompileRequest {
            name,
            source,
            arch,
            headers: HEADERS,
            options: &[],
        }
    }

    /// A blob by NVRTC 13.5 with unit `k` (source "k") for `archs`, its image `<arch>:k`, and a
    /// second unit in the same frames.
    fn blob_for(archs: &[&str]) -> Vec<u8> {
        two_unit_blob((13, 5), archs, |u, a| embedded_key(&req(u, u, a)))
    }

    fn found(blob: &Blob, device: Version, driver: Version) -> Result<String, Miss> {
        find(blob, &req("k", "k", "sm_00"), device, driver)
            .map(|f| String::from_utf8(f.image.to_vec()).expect("utf-8"))
    }

    #[test]
    fn the_key_ignores_the_name_and_names_source_headers_options_and_arch() {
        let base = embedded_key(&req("k", "k", "sm_90"));
        assert_eq!(base, embedded_key(&req("renamed", "k", "sm_90")));
        assert_ne!(base, embedded_key(&req("k", "k2", "sm_90")));
        assert_ne!(base, embedded_key(&req("k", "k", "sm_80")));
        assert_ne!(
            base,
            embedded_key(&CompileRequest {
                headers: &[],
                ..req("k", "k", "sm_90")
            })
        );
        let options = ["-DX=1".to_string()];
        assert_ne!(
            base,
            embedded_key(&CompileRequest {
                options: &options,
                ..req("k", "k", "sm_90")
            })
        );
    }

    /// The disk cache's key names the NVRTC version, the embedded key does not: the same request
    /// gets one embedded key whatever compiler a machine has.
    #[test]
    fn the_key_is_the_same_for_every_nvrtc() {
        let r = req("k", "k", "sm_90");
        let options = base_options("sm_90");
        let nvrtc_13_0 = request_key(KEY_FORMAT, &r, &options, Some((13, 0)));
        let nvrtc_13_5 = request_key(KEY_FORMAT, &r, &options, Some((13, 5)));
        assert_ne!(nvrtc_13_0, nvrtc_13_5);
        assert_eq!(
            embedded_key(&r),
            request_key(KEY_FORMAT, &r, &options, None)
        );
    }

    #[test]
    fn the_device_gets_its_cubin_then_its_majors_then_ptx() {
        let bytes = blob_for(&["sm_80", "sm_90", "sm_100", "compute_120"]);
        let blob = Blob::parse(&bytes).expect("parse");
        let driver = (13, 5);
        assert_eq!(found(&blob, (9, 0), driver).as_deref(), Ok("sm_90:k"));
        assert_eq!(found(&blob, (8, 9), driver).as_deref(), Ok("sm_80:k"));
        assert_eq!(found(&blob, (10, 3), driver).as_deref(), Ok("sm_100:k"));
        assert_eq!(
            found(&blob, (12, 0), driver).as_deref(),
            Ok("compute_120:k")
        );
        assert_eq!(
            found(&blob, (13, 0), driver).as_deref(),
            Ok("compute_120:k")
        );
        // No CUBIN of the major and PTX only for newer GPUs.
        assert_eq!(found(&blob, (7, 5), driver), Err(Miss::NotEmbedded));
        let other = find(&blob, &req("user", "user code", "sm_90"), (9, 0), driver);
        assert_eq!(other, Err(Miss::NotEmbedded));
    }

    #[test]
    fn an_old_driver_loads_cubins_of_its_major_and_no_newer_ptx() {
        let bytes = blob_for(&["sm_90", "compute_120"]);
        let blob = Blob::parse(&bytes).expect("parse");
        assert_eq!(found(&blob, (9, 0), (13, 0)).as_deref(), Ok("sm_90:k"));
        assert_eq!(found(&blob, (12, 0), (13, 0)), Err(Miss::NotEmbedded));
        assert_eq!(
            found(&blob, (9, 0), (12, 8)),
            Err(Miss::DriverTooOld {
                driver: (12, 8),
                compiler: (13, 5)
            })
        );
        assert_eq!(driver_version(13000), (13, 0));
        assert_eq!(driver_version(12080), (12, 8));
    }

    /// A frame whose bytes were damaged after the tables: parsing succeeds, the lookup says the
    /// frame is corrupt (NVRTC compiles instead), never a wrong image.
    #[test]
    fn a_corrupt_frame_serves_nothing() {
        let mut bytes = blob_for(&["sm_90"]);
        let last = bytes.len() - 2;
        bytes[last] ^= 0x55;
        let blob = Blob::parse(&bytes).expect("the tables are intact");
        match found(&blob, (9, 0), (13, 5)) {
            Err(Miss::Corrupt(why)) => assert!(why.contains("frame 0"), "{why}"),
            other => panic!("a corrupt frame gave {other:?}"),
        }
        // What build_module sees: nothing, so NVRTC compiles the unit.
        let k = req("k", "k", "sm_90");
        assert_eq!(lookup(Some(&blob), false, &k, (9, 0), || (13, 5)), None);
    }

    /// MSCCLPP_NVRTC_FORCE skips the blob; a unit it lacks, or no blob, is NVRTC's (None).
    #[test]
    fn lookup_serves_what_is_embedded_unless_forced() {
        let bytes = blob_for(&["sm_90"]);
        let blob = Blob::parse(&bytes).expect("parse");
        let driver = || (13, 0);
        let k = req("k", "k", "sm_90");
        let got = lookup(Some(&blob), false, &k, (9, 0), driver).map(|f| f.image);
        assert_eq!(got, Some(&b"sm_90:k"[..]));
        assert_eq!(lookup(Some(&blob), true, &k, (9, 0), driver), None);
        assert_eq!(lookup(None, false, &k, (9, 0), driver), None);
        let user = req("user", "user code", "sm_90");
        assert_eq!(lookup(Some(&blob), false, &user, (9, 0), driver), None);
    }

    /// In builds that embed a blob (`MSCCLPP_AOT_BLOB`, every one of which has sm_90): it parses,
    /// every frame inflates, and the runtime's request for the README's bf16 sum all-reduce on
    /// an H100 finds its CUBIN, so the build tool's keys are the runtime's.
    #[cfg(mscclpp_aot)]
    #[test]
    fn the_embedded_blob_is_intact_and_serves_the_runtime() {
        use mscclpp_core::{DataType, ReduceOp};
        use mscclpp_kernels_cu::collectives::{self as kc, CollectiveFile, ReduceSpec};
        let blob = embedded().expect("this build embeds a blob that parses");
        assert!(!blob.is_empty());
        blob.check_every_frame().expect("every frame inflates");
        let spec = ReduceSpec {
            dtype: DataType::Bf16,
            acc: DataType::Bf16,
            op: ReduceOp::Sum,
        };
        let source = kc::unit_source(CollectiveFile::AllReduce, Some(spec)).expect("source");
        let name = kc::unit_name(CollectiveFile::AllReduce, Some(spec));
        let request = CompileRequest {
            name: &name,
            source: &source,
            arch: "sm_90",
            headers: mscclpp_kernels_cu::HEADERS,
            options: &[],
        };
        let found = find(blob, &request, (9, 0), blob.compiler()).expect("embedded");
        assert_eq!(found.arch, "sm_90");
        assert!(found.image.starts_with(b"\x7fELF"), "not a CUBIN");
    }

    #[test]
    fn arch_names_parse() {
        assert_eq!(arch_version("sm_90"), Some((9, 0)));
        assert_eq!(arch_version("sm_120"), Some((12, 0)));
        assert_eq!(arch_version("compute_100"), Some((10, 0)));
        assert_eq!(arch_version("sm_90a"), None);
        assert_eq!(arch_version("gfx942"), None);
    }
}
