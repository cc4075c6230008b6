//! HIP code objects compiled ahead of time and embedded in the library, so that a fresh machine
//! loads them instead of running hiprtc on its first calls (every rank of every new machine
//! compiles otherwise, seconds a unit).
//!
//! `mscclpp-aot --hip gfx90a,gfx942` (aot/) builds them with clang and ROCm's device libraries
//! ([`crate::clang`]); a build with `MSCCLPP_AOT_HIP_BLOB=<blob>` embeds the blob (build.rs sets
//! the `mscclpp_aot_hip` cfg), a build without it embeds nothing. `RocmGpu::build_module` asks
//! [`lookup`] first and goes to hiprtc only for what the blob cannot serve, or for everything
//! under `MSCCLPP_NVRTC_FORCE=1` (the variable names NVRTC, and means the run-time compiler).
//!
//! # Key and target
//! [`embedded_key`]: SHA-256 over a format tag, the source, the headers, the options hiprtc is
//! given ([`Hiprtc::options_for`]) and the target, as `gfx942`, the device's `gcnArchName` without
//! its feature suffix. A code object runs on its own target only, and one built for the bare
//! target (sramecc and xnack "any") runs whichever way the GPU is set, so [`find`] takes the
//! device's exact target or nothing. The compiler is left out: ROCm 6 loads code objects of
//! version 5, which clang 19 writes. A code object the runtime refuses all the same (an older
//! ROCm) is compiled by hiprtc instead, with one warning. The format of the blob is
//! `mscclpp_core::kernel_image`'s.

use crate::hiprtc::{CompileRequest, Hiprtc};
use mscclpp_core::kernel_image::{parse_embedded, request_key, Blob};
use std::sync::{Once, OnceLock};

/// Bumped when anything about how the key is made changes.
const KEY_FORMAT: &str = "mscclpp-rs embedded HIP code object v1";

/// The key of `req` in a blob (module docs).
pub fn embedded_key(req: &CompileRequest) -> [u8; 32] {
    request_key(KEY_FORMAT, req, &Hiprtc::options_for(req), None)
}

/// Why [`find`] found nothing; hiprtc compiles the unit then.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Miss {
    /// No code object of the unit for this target (a user's unit, a variant or a target not
    /// embedded).
    NotEmbedded,
    /// The unit's frame is corrupt (the message says how).
    Corrupt(String),
}

/// The code object of `req` for its target `req.arch`.
pub fn find<'b>(blob: &'b Blob<'_>, req: &CompileRequest) -> Result<&'b [u8], Miss> {
    match blob.image(&embedded_key(req)) {
        Ok(Some(image)) => Ok(image),
        Ok(None) => Err(Miss::NotEmbedded),
        Err(why) => Err(Miss::Corrupt(why)),
    }
}

/// What `RocmGpu::build_module` loads for `req` before asking hiprtc: its code object in `blob`
/// (the embedded one, if any), unless `force` (`MSCCLPP_NVRTC_FORCE`). `None` means hiprtc
/// compiles it; corruption is logged once.
pub fn lookup<'b>(
    blob: Option<&'b Blob<'_>>,
    force: bool,
    req: &CompileRequest,
) -> Option<&'b [u8]> {
    let blob = blob.filter(|_| !force)?;
    match find(blob, req) {
        Ok(image) => Some(image),
        Err(Miss::NotEmbedded) => {
            tracing::debug!(target: "mscclpp::gpu", "{} for {} is not embedded", req.name, req.arch);
            None
        }
        Err(Miss::Corrupt(why)) => {
            static CORRUPT: Once = Once::new();
            CORRUPT.call_once(|| {
                tracing::error!(
                    target: "mscclpp::gpu",
                    "embedded code objects: {why}; the kernels of that frame are compiled by hiprtc"
                )
            });
            None
        }
    }
}

/// The blob this build embeds (`MSCCLPP_AOT_HIP_BLOB` at build time), parsed on first use;
/// `None` where there is none or it is corrupt (logged once).
pub fn embedded() -> Option<&'static Blob<'static>> {
    #[cfg(mscclpp_aot_hip)]
    static BYTES: &[u8] = include_bytes!(env!("MSCCLPP_AOT_HIP_BLOB_PATH"));
    #[cfg(not(mscclpp_aot_hip))]
    static BYTES: &[u8] = &[];
    static BLOB: OnceLock<Option<Blob<'static>>> = OnceLock::new();
    BLOB.get_or_init(|| parse_embedded(BYTES, "hiprtc"))
        .as_ref()
}

#[cfg(test)]
mod tests {
    use super::*;
    use mscclpp_core::kernel_image::testing::two_unit_blob;

    fn req<'a>(source: &'a str, arch: &'a str) -> CompileRequest<'a> {
        CompileRequest {
            name: source,
            source,
            arch,
            headers: &[("mscclpp/a.cuh", "#define A 1\n")],
            options: &[],
        }
    }

    /// A blob by clang 19.1 with units `k` and `other` for gfx90a and gfx942, each image
    /// `<arch>:<unit>`.
    fn blob() -> Vec<u8> {
        two_unit_blob((19, 1), &["gfx90a", "gfx942"], |u, a| {
            embedded_key(&req(u, a))
        })
    }

    #[test]
    fn a_device_gets_its_own_targets_code_object_or_none() {
        let bytes = blob();
        let blob = Blob::parse(&bytes).expect("parse");
        assert_eq!(find(&blob, &req("k", "gfx942")), Ok(&b"gfx942:k"[..]));
        assert_eq!(
            find(&blob, &req("other", "gfx90a")),
            Ok(&b"gfx90a:other"[..])
        );
        // MI100 and MI355X: no code object of theirs, none of a neighbour's.
        assert_eq!(find(&blob, &req("k", "gfx908")), Err(Miss::NotEmbedded));
        assert_eq!(find(&blob, &req("k", "gfx950")), Err(Miss::NotEmbedded));
        assert_eq!(
            find(&blob, &req("user code", "gfx942")),
            Err(Miss::NotEmbedded)
        );
    }

    /// The key is hiprtc's request: its options (so the optimisation level and the target) and
    /// the headers, not the unit's name.
    #[test]
    fn the_key_is_the_run_time_request() {
        let base = embedded_key(&req("k", "gfx942"));
        assert_eq!(
            base,
            embedded_key(&CompileRequest {
                name: "renamed",
                ..req("k", "gfx942")
            })
        );
        assert_eq!(
            base,
            request_key(
                KEY_FORMAT,
                &req("k", "gfx942"),
                &Hiprtc::options_for(&req("k", "gfx942")),
                None
            )
        );
        assert_ne!(base, embedded_key(&req("k", "gfx90a")));
        let options = ["-DX=1".to_string()];
        assert_ne!(
            base,
            embedded_key(&CompileRequest {
                options: &options,
                ..req("k", "gfx942")
            })
        );
        assert_ne!(
            base,
            embedded_key(&CompileRequest {
                headers: &[],
                ..req("k", "gfx942")
            })
        );
    }

    /// MSCCLPP_NVRTC_FORCE skips the blob; a unit it lacks, a corrupt frame, or no blob is
    /// hiprtc's (None).
    #[test]
    fn lookup_serves_what_is_embedded_unless_forced_or_corrupt() {
        let bytes = blob();
        let parsed = Blob::parse(&bytes).expect("parse");
        let k = req("k", "gfx942");
        assert_eq!(lookup(Some(&parsed), false, &k), Some(&b"gfx942:k"[..]));
        assert_eq!(lookup(Some(&parsed), true, &k), None);
        assert_eq!(lookup(None, false, &k), None);
        assert_eq!(lookup(Some(&parsed), false, &req("user", "gfx942")), None);
        let mut damaged = bytes.clone();
        let last = damaged.len() - 2;
        damaged[last] ^= 0x55;
        let damaged = Blob::parse(&damaged).expect("the tables are intact");
        assert!(matches!(
            find(&damaged, &req("k", "gfx942")),
            Err(Miss::Corrupt(_))
        ));
        assert_eq!(lookup(Some(&damaged), false, &req("k", "gfx942")), None);
    }

    /// In builds that embed code objects (`MSCCLPP_AOT_HIP_BLOB`): every frame inflates, and the
    /// runtime's request for the README's bf16 sum all-reduce on an MI300X finds a gfx942 code
    /// object defining its kernels, so the build tool's keys are the runtime's.
    #[cfg(mscclpp_aot_hip)]
    #[test]
    fn the_embedded_code_objects_are_intact_and_serve_the_runtime() {
        use mscclpp_core::{DataType, ReduceOp};
        use mscclpp_kernels_cu::collectives::{self as kc, CollectiveFile, ReduceSpec};
        let blob = embedded().expect("this build embeds a blob that parses");
        blob.check_every_frame().expect("every frame inflates");
        let spec = ReduceSpec {
            dtype: DataType::Bf16,
            acc: DataType::Bf16,
            op: ReduceOp::Sum,
        };
        let source = kc::unit_source(CollectiveFile::AllReduce, Some(spec)).expect("source");
        let name = kc::unit_name(CollectiveFile::AllReduce, Some(spec));
        let headers = mscclpp_kernels_hip::all_headers();
        let request = CompileRequest {
            name: &name,
            source: &source,
            arch: "gfx942",
            headers: &headers,
            options: &[],
        };
        let image = find(blob, &request).expect("embedded");
        let info = crate::clang::inspect_code_object(image).expect("a code object");
        assert_eq!(info.arch, "gfx942");
        assert!(!info.kernels.is_empty());
    }
}
