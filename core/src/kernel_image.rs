//! Compiled kernel images and the requests that make them, shared by the backends: the request a
//! run-time compiler (NVRTC, hiprtc) takes, its content key, and the blob of images compiled ahead
//! of time that a build embeds (`mscclpp-aot` writes it; `mscclpp_cuda::aot` and
//! `mscclpp_rocm::aot` say which image of it a device loads).
//!
//! # Blob (all integers little-endian)
//! ```text
//! magic "MSCLAOT1" (8) | compiler major u32 | minor u32 | archs u32 | frames u32 | entries u32
//! | sha256 of the tables (32)
//! tables: archs   archs x 16 bytes, NUL-padded ("sm_90", "compute_120", "gfx942")
//!         frames  frames x (offset u64 | compressed len u64 | raw len u64 | sha256 of raw (32))
//!         entries entries x (key (32) | frame u32 | offset u64 | len u64), sorted by key
//! data:   the frames, one zstd frame each, at their offsets from the end of the tables
//! ```
//! A frame holds the images of one kernel file's variants for one architecture back to back: the
//! variants share most of their code, so compressed together they take far less than each alone,
//! while a lookup inflates only its own frame (once per process). A blob whose magic, tables or
//! checksum do not match, and a frame whose inflated bytes do not match theirs, serve nothing:
//! the backend logs it once and compiles at run time instead, never loading a wrong kernel.

use sha2::{Digest, Sha256};
use std::io::Read;
use std::sync::OnceLock;

/// One kernel translation unit to compile for one target.
#[derive(Debug, Clone, Copy)]
pub struct CompileRequest<'a> {
    /// Program name, used in the compiler's messages and in our errors.
    pub name: &'a str,
    pub source: &'a str,
    /// The target: `sm_90` (a CUBIN) or `compute_90` (PTX) for NVRTC, `gfx942` for hiprtc.
    pub arch: &'a str,
    /// In-memory headers: (include name as written in `#include "..."`, text).
    pub headers: &'a [(&'a str, &'a str)],
    /// Extra compiler options, appended after the backend's own.
    pub options: &'a [String],
}

/// What a compiler made of a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CompiledKernel {
    /// A CUBIN (`sm_XX`), NUL-terminated PTX (`compute_XX`), or an AMD code object (`gfxNNN`).
    pub image: Vec<u8>,
    /// The compiler's log (warnings); empty when it had nothing to say.
    pub log: String,
}

/// SHA-256 over `format`, `req`'s source, headers and architecture, `options` and, where given, the
/// compiler's version, each field length-prefixed so no two inputs collide by concatenation: the
/// key of a disk cache entry (every option, the compiler's version) and of an embedded image (the
/// compiler left out, see the backends' `aot` modules). The name is left out: renaming a unit
/// changes no code.
pub fn request_key(
    format: &str,
    req: &CompileRequest,
    options: &[String],
    compiler: Option<(i32, i32)>,
) -> [u8; 32] {
    let mut h = Sha256::new();
    let mut field = |bytes: &[u8]| {
        h.update((bytes.len() as u64).to_le_bytes());
        h.update(bytes);
    };
    field(format.as_bytes());
    field(req.source.as_bytes());
    field(&(req.headers.len() as u64).to_le_bytes());
    for (name, text) in req.headers {
        field(name.as_bytes());
        field(text.as_bytes());
    }
    field(&(options.len() as u64).to_le_bytes());
    for o in options {
        field(o.as_bytes());
    }
    field(req.arch.as_bytes());
    if let Some((major, minor)) = compiler {
        field(&major.to_le_bytes());
        field(&minor.to_le_bytes());
    }
    h.finalize().into()
}

const MAGIC: &[u8; 8] = b"MSCLAOT1";
const HEADER_LEN: usize = 8 + 5 * 4 + 32;
const ARCH_LEN: usize = 16;
const FRAME_LEN: usize = 3 * 8 + 32;
const ENTRY_LEN: usize = 32 + 4 + 2 * 8;

/// A compiler's version as (major, minor): NVRTC's (13, 0), clang's (19, 1).
pub type Version = (u32, u32);

#[derive(Debug, Clone, Copy)]
struct Frame {
    offset: u64,
    compressed: u64,
    raw: u64,
    sha256: [u8; 32],
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    key: [u8; 32],
    frame: u32,
    offset: u64,
    len: u64,
}

/// A parsed blob; its frames are inflated on first use.
#[derive(Debug)]
pub struct Blob<'a> {
    compiler: Version,
    archs: Vec<String>,
    frames: Vec<Frame>,
    entries: Vec<Entry>,
    data: &'a [u8],
    inflated: Vec<OnceLock<Result<Vec<u8>, String>>>,
}

/// Little-endian reader over a byte slice; every read says what was cut short.
struct Cursor<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], String> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.bytes.len());
        let end = end.ok_or_else(|| format!("truncated at the {what}"))?;
        let out = &self.bytes[self.at..end];
        self.at = end;
        Ok(out)
    }

    fn u32(&mut self, what: &str) -> Result<u32, String> {
        let b = self.take(4, what)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self, what: &str) -> Result<u64, String> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.take(8, what)?);
        Ok(u64::from_le_bytes(a))
    }

    fn hash(&mut self, what: &str) -> Result<[u8; 32], String> {
        let mut a = [0u8; 32];
        a.copy_from_slice(self.take(32, what)?);
        Ok(a)
    }
}

impl<'a> Blob<'a> {
    /// Parses and checks the header and tables of `bytes`; the error says what is wrong.
    pub fn parse(bytes: &'a [u8]) -> Result<Blob<'a>, String> {
        let mut c = Cursor { bytes, at: 0 };
        if c.take(8, "magic")? != MAGIC {
            return Err("bad magic".into());
        }
        let compiler = (c.u32("header")?, c.u32("header")?);
        let (narchs, nframes, nentries) = (c.u32("header")?, c.u32("header")?, c.u32("header")?);
        let sha = c.hash("header")?;
        let table = |n: u32, len: usize| (n as usize).checked_mul(len);
        let tables_len = table(narchs, ARCH_LEN)
            .zip(table(nframes, FRAME_LEN))
            .zip(table(nentries, ENTRY_LEN))
            .and_then(|((a, f), e)| a.checked_add(f)?.checked_add(e))
            .ok_or("table sizes overflow")?;
        let tables = c.take(tables_len, "tables")?;
        if Sha256::digest(tables)[..] != sha {
            return Err("table checksum mismatch".into());
        }
        let mut t = Cursor {
            bytes: tables,
            at: 0,
        };
        let archs = (0..narchs)
            .map(|_| {
                let raw = t.take(ARCH_LEN, "archs")?;
                let name = raw.split(|&b| b == 0).next().unwrap_or_default();
                String::from_utf8(name.to_vec())
                    .map_err(|_| "an arch name is not UTF-8".to_string())
            })
            .collect::<Result<Vec<_>, _>>()?;
        let data = &bytes[c.at..];
        let frames = (0..nframes)
            .map(|_| {
                let f = Frame {
                    offset: t.u64("frames")?,
                    compressed: t.u64("frames")?,
                    raw: t.u64("frames")?,
                    sha256: t.hash("frames")?,
                };
                let fits = f
                    .offset
                    .checked_add(f.compressed)
                    .is_some_and(|end| end <= data.len() as u64);
                if fits {
                    Ok(f)
                } else {
                    Err(format!(
                        "a frame ({} bytes at {}) runs past the data ({} bytes)",
                        f.compressed,
                        f.offset,
                        data.len()
                    ))
                }
            })
            .collect::<Result<Vec<_>, String>>()?;
        let entries = (0..nentries)
            .map(|_| {
                let e = Entry {
                    key: t.hash("entries")?,
                    frame: t.u32("entries")?,
                    offset: t.u64("entries")?,
                    len: t.u64("entries")?,
                };
                let frame = frames
                    .get(e.frame as usize)
                    .ok_or("an entry names a missing frame")?;
                let fits = e
                    .offset
                    .checked_add(e.len)
                    .is_some_and(|end| end <= frame.raw);
                if !fits || e.len == 0 {
                    return Err("an entry lies outside its frame".to_string());
                }
                Ok(e)
            })
            .collect::<Result<Vec<_>, String>>()?;
        if !entries.windows(2).all(|w| w[0].key < w[1].key) {
            return Err("entries are not sorted by key".into());
        }
        Ok(Blob {
            compiler,
            archs,
            inflated: frames.iter().map(|_| OnceLock::new()).collect(),
            frames,
            entries,
            data,
        })
    }

    /// The version of the compiler that wrote the images.
    pub fn compiler(&self) -> Version {
        self.compiler
    }

    /// The architectures with images: `sm_XY` (CUBIN), `compute_XY` (PTX), `gfxNNN` (AMD code object).
    pub fn archs(&self) -> &[String] {
        &self.archs
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Whether an image is stored under `key` (nothing is inflated).
    pub fn contains(&self, key: &[u8; 32]) -> bool {
        self.entries.binary_search_by(|e| e.key.cmp(key)).is_ok()
    }

    /// The image stored under `key`: `Ok(None)` where there is none, an error where its frame is
    /// corrupt.
    pub fn image(&self, key: &[u8; 32]) -> Result<Option<&[u8]>, String> {
        let Ok(i) = self.entries.binary_search_by(|e| e.key.cmp(key)) else {
            return Ok(None);
        };
        let e = self.entries[i];
        let frame = self.inflated[e.frame as usize]
            .get_or_init(|| self.inflate(e.frame as usize))
            .as_ref()
            .map_err(Clone::clone)?;
        // In range: checked against the frame's raw length by `parse`, which `inflate` enforces.
        Ok(Some(&frame[e.offset as usize..(e.offset + e.len) as usize]))
    }

    /// Inflates and checks every frame (a build's test of the blob it embeds); the error names
    /// the first frame that is corrupt.
    pub fn check_every_frame(&self) -> Result<(), String> {
        (0..self.frames.len()).try_for_each(|i| self.inflate(i).map(drop))
    }

    fn inflate(&self, index: usize) -> Result<Vec<u8>, String> {
        let f = self.frames[index];
        let compressed = &self.data[f.offset as usize..(f.offset + f.compressed) as usize];
        // Room for what the table says, within reason: the table could be wrong.
        let mut raw = Vec::with_capacity(f.raw.min(1 << 28) as usize);
        ruzstd::decoding::StreamingDecoder::new(compressed)
            .map_err(|e| format!("frame {index}: {e}"))?
            .take(f.raw.saturating_add(1))
            .read_to_end(&mut raw)
            .map_err(|e| format!("frame {index}: {e}"))?;
        if raw.len() as u64 != f.raw {
            return Err(format!(
                "frame {index} inflates to {} bytes, the table says {}",
                raw.len(),
                f.raw
            ));
        }
        if Sha256::digest(&raw)[..] != f.sha256 {
            return Err(format!("frame {index}: checksum mismatch"));
        }
        Ok(raw)
    }
}

/// One frame of a blob being written: the images of one kernel file's variants for one
/// architecture (module docs).
#[derive(Debug, Default)]
pub struct FrameImages {
    pub images: Vec<([u8; 32], Vec<u8>)>,
}

/// Writes a blob of `frames`, compiled by `compiler` for `archs`, each frame compressed by
/// `compress` (a zstd frame; the build tool's encoder). Keys must be unique.
pub fn encode(
    compiler: Version,
    archs: &[String],
    frames: &[FrameImages],
    mut compress: impl FnMut(&[u8]) -> Vec<u8>,
) -> Result<Vec<u8>, String> {
    let mut tables = Vec::new();
    for a in archs {
        if a.len() >= ARCH_LEN {
            return Err(format!("architecture name {a} is too long"));
        }
        let mut field = [0u8; ARCH_LEN];
        field[..a.len()].copy_from_slice(a.as_bytes());
        tables.extend_from_slice(&field);
    }
    let mut data = Vec::new();
    let mut entries = Vec::new();
    for (index, frame) in frames.iter().enumerate() {
        let mut raw = Vec::new();
        for (key, image) in &frame.images {
            entries.push(Entry {
                key: *key,
                frame: index as u32,
                offset: raw.len() as u64,
                len: image.len() as u64,
            });
            raw.extend_from_slice(image);
        }
        let packed = compress(&raw);
        tables.extend_from_slice(&(data.len() as u64).to_le_bytes());
        tables.extend_from_slice(&(packed.len() as u64).to_le_bytes());
        tables.extend_from_slice(&(raw.len() as u64).to_le_bytes());
        tables.extend_from_slice(&Sha256::digest(&raw));
        data.extend_from_slice(&packed);
    }
    entries.sort_by_key(|e| e.key);
    if let Some(w) = entries.windows(2).find(|w| w[0].key == w[1].key) {
        return Err(format!("key {} is stored twice", hex::encode(w[0].key)));
    }
    for e in &entries {
        tables.extend_from_slice(&e.key);
        tables.extend_from_slice(&e.frame.to_le_bytes());
        tables.extend_from_slice(&e.offset.to_le_bytes());
        tables.extend_from_slice(&e.len.to_le_bytes());
    }
    let count = |n: usize, what: &str| u32::try_from(n).map_err(|_| format!("too many {what}"));
    let mut out = Vec::with_capacity(HEADER_LEN + tables.len() + data.len());
    out.extend_from_slice(MAGIC);
    for v in [
        compiler.0,
        compiler.1,
        count(archs.len(), "architectures")?,
        count(frames.len(), "frames")?,
        count(entries.len(), "entries")?,
    ] {
        out.extend_from_slice(&v.to_le_bytes());
    }
    out.extend_from_slice(&Sha256::digest(&tables));
    out.extend_from_slice(&tables);
    out.extend_from_slice(&data);
    Ok(out)
}

/// The blob a build embeds (`bytes`, empty where it embeds none), parsed: `None` where there is
/// none, or where it is corrupt, which is logged as an error once per process by the caller's
/// cell (every kernel is compiled at run time then, by `compiler`).
pub fn parse_embedded(bytes: &'static [u8], compiler: &str) -> Option<Blob<'static>> {
    if bytes.is_empty() {
        return None;
    }
    match Blob::parse(bytes) {
        Ok(blob) => {
            tracing::debug!(
                target: "mscclpp::gpu",
                "{} embedded kernel images (compiler {}.{}, {})",
                blob.len(),
                blob.compiler.0,
                blob.compiler.1,
                blob.archs.join(" ")
            );
            Some(blob)
        }
        Err(why) => {
            tracing::error!(
                target: "mscclpp::gpu",
                "the embedded kernels are unusable ({why}): every kernel is compiled by {compiler}"
            );
            None
        }
    }
}

/// Blobs for the backends' lookup tests.
#[cfg(any(test, feature = "testing"))]
pub mod testing {
    use super::{encode, FrameImages, Version};

    /// zstd's fastest level: what a test's blob is compressed with.
    pub fn compress_fast(raw: &[u8]) -> Vec<u8> {
        ruzstd::encoding::compress_to_vec(raw, ruzstd::encoding::CompressionLevel::Fastest)
    }

    /// A blob by `compiler` holding, for each of `archs` (one frame each), the units `k` and
    /// `other` under `key(unit, arch)`, each image the bytes `<arch>:<unit>`.
    pub fn two_unit_blob(
        compiler: Version,
        archs: &[&str],
        key: impl Fn(&str, &str) -> [u8; 32],
    ) -> Vec<u8> {
        let frames: Vec<FrameImages> = archs
            .iter()
            .map(|a| FrameImages {
                images: ["k", "other"]
                    .iter()
                    .map(|u| (key(u, a), format!("{a}:{u}").into_bytes()))
                    .collect(),
            })
            .collect();
        let archs: Vec<String> = archs.iter().map(|a| a.to_string()).collect();
        encode(compiler, &archs, &frames, compress_fast).expect("a test blob encodes")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FORMAT: &str = "test kernel v1";

    fn key(source: &str, arch: &str) -> [u8; 32] {
        let req = CompileRequest {
            name: source,
            source,
            arch,
            headers: &[("mscclpp/a.cuh", "#define A 1\n")],
            options: &[],
        };
        request_key(FORMAT, &req, &[], None)
    }

    fn blob_for(archs: &[&str]) -> Vec<u8> {
        testing::two_unit_blob((13, 5), archs, key)
    }

    #[test]
    fn a_blob_round_trips() {
        let bytes = blob_for(&["sm_80", "sm_90", "gfx942"]);
        let blob = Blob::parse(&bytes).expect("parse");
        assert_eq!(blob.compiler(), (13, 5));
        assert_eq!(blob.archs(), ["sm_80", "sm_90", "gfx942"]);
        assert_eq!(blob.len(), 6);
        for a in ["sm_80", "sm_90", "gfx942"] {
            for s in ["k", "other"] {
                assert!(blob.contains(&key(s, a)));
                let image = blob.image(&key(s, a)).expect("intact");
                assert_eq!(image, Some(format!("{a}:{s}").as_bytes()));
            }
        }
        assert_eq!(blob.image(&[0; 32]), Ok(None));
        blob.check_every_frame().expect("every frame inflates");
    }

    #[test]
    fn the_request_key_names_source_headers_options_arch_and_compiler_not_the_name() {
        let req = CompileRequest {
            name: "k",
            source: "k",
            arch: "sm_90",
            headers: &[("a.h", "x")],
            options: &[],
        };
        let base = request_key(FORMAT, &req, &[], None);
        let renamed = CompileRequest {
            name: "renamed",
            ..req
        };
        assert_eq!(base, request_key(FORMAT, &renamed, &[], None));
        let changed = [
            CompileRequest {
                source: "k2",
                ..req
            },
            CompileRequest {
                arch: "sm_80",
                ..req
            },
            CompileRequest {
                headers: &[],
                ..req
            },
            CompileRequest {
                headers: &[("a.h", "y")],
                ..req
            },
        ];
        for other in changed {
            assert_ne!(base, request_key(FORMAT, &other, &[], None), "{other:?}");
        }
        assert_ne!(base, request_key(FORMAT, &req, &["-DX=1".into()], None));
        assert_ne!(base, request_key("other format", &req, &[], None));
        assert_ne!(base, request_key(FORMAT, &req, &[], Some((13, 0))));
        assert_ne!(
            request_key(FORMAT, &req, &[], Some((13, 0))),
            request_key(FORMAT, &req, &[], Some((13, 5)))
        );
    }

    #[test]
    fn damaged_blobs_are_refused_with_a_reason() {
        let good = blob_for(&["sm_90"]);
        let damage = |f: &dyn Fn(&mut Vec<u8>)| {
            let mut b = good.clone();
            f(&mut b);
            b
        };
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (damage(&|b| b.truncate(20)), "truncated"),
            (damage(&|b| b[0] = b'X'), "magic"),
            (damage(&|b| b[HEADER_LEN] ^= 1), "checksum"),
            (
                damage(&|b| b[24..28].copy_from_slice(&u32::MAX.to_le_bytes())),
                "truncated",
            ),
            (damage(&|b| b.truncate(b.len() - 1)), "past the data"),
        ];
        for (bytes, why) in cases {
            let err = Blob::parse(&bytes).unwrap_err();
            assert!(err.contains(why), "{why}: {err}");
        }
    }

    /// A frame whose bytes were damaged after the tables: parsing succeeds, the lookup says the
    /// frame is corrupt, never a wrong image.
    #[test]
    fn a_corrupt_frame_serves_nothing() {
        let mut bytes = blob_for(&["sm_90"]);
        let last = bytes.len() - 2;
        bytes[last] ^= 0x55;
        let blob = Blob::parse(&bytes).expect("the tables are intact");
        let err = blob.image(&key("k", "sm_90")).unwrap_err();
        assert!(err.contains("frame 0"), "{err}");
        assert!(blob.check_every_frame().is_err());
    }

    #[test]
    fn a_key_stored_twice_is_refused() {
        let image = (key("k", "sm_90"), b"x".to_vec());
        let frame = FrameImages {
            images: vec![image.clone(), image],
        };
        let err = encode((13, 5), &["sm_90".into()], &[frame], testing::compress_fast).unwrap_err();
        assert!(err.contains("twice"), "{err}");
    }

    #[test]
    fn an_arch_name_longer_than_its_field_is_refused() {
        let err = encode((1, 0), &["x".repeat(ARCH_LEN)], &[], testing::compress_fast).unwrap_err();
        assert!(err.contains("too long"), "{err}");
    }

    #[test]
    fn nothing_embedded_parses_as_none() {
        assert!(parse_embedded(&[], "NVRTC").is_none());
        assert!(parse_embedded(b"not a blob", "NVRTC").is_none());
    }
}
