//! clang driven the way hiprtc drives it, on a machine without ROCm: for the HIP compile gate
//! (tests/kernels_compile.rs) and for the code objects `mscclpp-aot --hip` builds ahead of time.
//!
//! hiprtc compiles a program as HIP device code with `-D__HIPCC_RTC__` and `-nogpuinc`, its own
//! runtime header (the declarations it puts in front of every program, read here from ROCm's
//! libhiprtc-builtins) as a forced include, the caller's in-memory headers, and the options
//! [`Hiprtc::options_for`] gives; then it links ROCm's device libraries (ockl, ocml: work-item
//! ids, wave votes, fences) into a code object. [`ClangHip`] does the same with an upstream clang
//! (`MSCCLPP_HIP_CLANG`, default `clang-19`, with its lld) and the device libraries' bitcode in
//! `MSCCLPP_HIP_DEVICE_LIBS` (scripts/hip-env.sh fetches ROCm 6.0's, which build gfx90a and
//! gfx942). The assembly and front-end outputs need no device libraries.

use crate::hiprtc::{CompileRequest, Hiprtc};
use mscclpp_core::kernel_image::Version;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};

/// What [`ClangHip::compile`] produces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Output {
    /// The front end alone (`-fsyntax-only`): every template instantiated and type-checked.
    SyntaxOnly,
    /// The target's assembly (`-S`): every instruction selected, nothing linked.
    Assembly,
    /// A linked code object, what `hipModuleLoadData` loads.
    CodeObject,
}

/// hiprtc's runtime header as ROCm ships it in libhiprtc-builtins (5 or 6).
pub fn hiprtc_runtime_header() -> Result<Vec<u8>, String> {
    let names = ["libhiprtc-builtins.so.5", "libhiprtc-builtins.so.6"];
    let mut errors = Vec::new();
    for name in names {
        // SAFETY: a data-only library of ROCm's; nothing of it runs except its (empty) init.
        let lib = match unsafe { libloading::Library::new(name) } {
            Ok(l) => l,
            Err(e) => {
                errors.push(format!("{name}: {e}"));
                continue;
            }
        };
        // SAFETY: both symbols are data (a byte array and its length, an unsigned int); a
        // `*const T` symbol is the object's address, read while `lib` is loaded.
        let text = unsafe {
            let size = lib
                .get::<*const u32>(b"__hipRTC_header_size\0")
                .map_err(|e| format!("{name}: {e}"))?;
            let start = lib
                .get::<*const u8>(b"__hipRTC_header\0")
                .map_err(|e| format!("{name}: {e}"))?;
            std::slice::from_raw_parts(*start, **size as usize).to_vec()
        };
        return Ok(text);
    }
    Err(format!(
        "hiprtc's runtime header not found ({})",
        errors.join("; ")
    ))
}

/// clang with the headers and hiprtc's runtime header as files in a folder of its own (removed
/// on drop).
#[derive(Debug)]
pub struct ClangHip {
    clang: String,
    version_line: String,
    version: Version,
    device_libs: Option<PathBuf>,
    dir: PathBuf,
    runtime: PathBuf,
}

/// `clang version 19.1.7` (after any vendor's words) as (19, 1).
fn parse_clang_version(line: &str) -> Option<Version> {
    let rest = &line[line.find("clang version ")? + "clang version ".len()..];
    let mut parts = rest.split(|c: char| !c.is_ascii_digit());
    Some((parts.next()?.parse().ok()?, parts.next()?.parse().ok()?))
}

impl ClangHip {
    /// The compiler for programs that include `headers`, or why there is none (no clang, no
    /// hiprtc runtime header).
    pub fn new(headers: &[(&str, &str)]) -> Result<ClangHip, String> {
        let clang = std::env::var("MSCCLPP_HIP_CLANG").unwrap_or_else(|_| "clang-19".into());
        let version_line = match Command::new(&clang).arg("--version").output() {
            Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout)
                .lines()
                .next()
                .unwrap_or_default()
                .to_string(),
            Ok(o) => return Err(format!("{clang} --version failed: {o:?}")),
            Err(e) => return Err(format!("{clang} not found: {e}")),
        };
        let version = parse_clang_version(&version_line)
            .ok_or_else(|| format!("{clang} --version printed no version: {version_line}"))?;
        let header = hiprtc_runtime_header()?;
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let dir =
            std::env::temp_dir().join(format!("mscclpp-clang-hip-{}-{n}", std::process::id()));
        let write = |path: &Path, text: &[u8]| {
            std::fs::create_dir_all(path.parent().expect("a file in the folder"))
                .and_then(|()| std::fs::write(path, text))
                .map_err(|e| format!("{}: {e}", path.display()))
        };
        for (name, text) in headers {
            write(&dir.join("include").join(name), text.as_bytes())?;
        }
        let runtime = dir.join("hiprtc_runtime.h");
        write(&runtime, &header)?;
        Ok(ClangHip {
            clang,
            version_line,
            version,
            device_libs: std::env::var_os("MSCCLPP_HIP_DEVICE_LIBS").map(PathBuf::from),
            dir,
            runtime,
        })
    }

    /// `clang --version`'s first line.
    pub fn version_line(&self) -> &str {
        &self.version_line
    }

    /// clang's (major, minor), which a blob of its code objects records.
    pub fn version(&self) -> Version {
        self.version
    }

    /// Compiles `source` for `arch` to `output`: the assembly's or the code object's bytes (none
    /// for [`Output::SyntaxOnly`]); the error is clang's message.
    pub fn compile(
        &self,
        name: &str,
        source: &str,
        arch: &str,
        output: Output,
    ) -> Result<Vec<u8>, String> {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let stem = format!("{name}-{arch}-{}", NEXT.fetch_add(1, Ordering::Relaxed));
        let src = self.dir.join(format!("{stem}.hip"));
        let out = self.dir.join(format!("{stem}.out"));
        std::fs::write(&src, source).map_err(|e| format!("{}: {e}", src.display()))?;
        let mut cmd = self.command(arch, output)?;
        if output == Output::SyntaxOnly {
            cmd.arg(&src);
        } else {
            cmd.arg(&src).arg("-o").arg(&out);
        }
        let ran = cmd.output().map_err(|e| format!("{}: {e}", self.clang));
        let _ = std::fs::remove_file(&src);
        let ran = ran?;
        if !ran.status.success() {
            let _ = std::fs::remove_file(&out);
            return Err(String::from_utf8_lossy(&ran.stderr).into_owned());
        }
        if output == Output::SyntaxOnly {
            return Ok(Vec::new());
        }
        let bytes = std::fs::read(&out).map_err(|e| format!("{}: {e}", out.display()));
        let _ = std::fs::remove_file(&out);
        bytes
    }

    /// clang with the options hiprtc is given for `arch` ([`Hiprtc::options_for`]), the defines
    /// and includes it adds itself, device code only.
    fn command(&self, arch: &str, output: Output) -> Result<Command, String> {
        let mut cmd = Command::new(&self.clang);
        cmd.args(["-x", "hip", "--cuda-device-only", "-nogpuinc"])
            .args(["-D__HIPCC_RTC__", "-Wno-pragma-once-outside-header"])
            .args(Hiprtc::options_for(&CompileRequest {
                name: "",
                source: "",
                arch,
                headers: &[],
                options: &[],
            }))
            .arg("-include")
            .arg(&self.runtime)
            .arg("-I")
            .arg(self.dir.join("include"));
        match output {
            Output::SyntaxOnly => {
                cmd.args(["-nogpulib", "-fsyntax-only"]);
            }
            Output::Assembly => {
                cmd.args(["-nogpulib", "-S"]);
            }
            Output::CodeObject => {
                let libs = self.device_libs.as_ref().ok_or(
                    "a code object links ROCm's device libraries: set MSCCLPP_HIP_DEVICE_LIBS to \
                     their bitcode folder (source scripts/hip-env.sh)",
                )?;
                // A plain code object, not an offload bundle (which needs ROCm's bundler).
                cmd.arg("--no-gpu-bundle-output")
                    .arg(format!("--rocm-device-lib-path={}", libs.display()));
            }
        }
        Ok(cmd)
    }
}

impl Drop for ClangHip {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// What an AMD GPU code object says of itself: its target and its kernels.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CodeObjectInfo {
    /// The `gfxNNN` its ELF header's machine flags name.
    pub arch: String,
    /// The kernels it defines (each symbol with a `.kd` kernel descriptor).
    pub kernels: Vec<String>,
}

/// ELF's machine number for AMD GPUs.
const EM_AMDGPU: u16 = 224;

/// The `EF_AMDGPU_MACH` values of the targets this project builds.
const MACHINES: [(u32, &str); 2] = [(0x3f, "gfx90a"), (0x4c, "gfx942")];

/// Reads a code object's ELF header and symbol table: the check that a built image is what it
/// claims to be, made without a GPU.
pub fn inspect_code_object(image: &[u8]) -> Result<CodeObjectInfo, String> {
    let at = |off: usize, len: usize| {
        image
            .get(off..off + len)
            .ok_or_else(|| format!("cut short at byte {off}"))
    };
    let u16_at = |off| at(off, 2).map(|b| u16::from_le_bytes([b[0], b[1]]));
    let u32_at = |off| at(off, 4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]));
    let u64_at = |off| {
        at(off, 8).map(|b| {
            let mut a = [0u8; 8];
            a.copy_from_slice(b);
            u64::from_le_bytes(a)
        })
    };
    if at(0, 4)? != b"\x7fELF" || at(4, 2)? != [2, 1] {
        return Err("not a 64-bit little-endian ELF image".into());
    }
    if u16_at(18)? != EM_AMDGPU {
        return Err(format!("machine {} is not AMDGPU", u16_at(18)?));
    }
    let mach = u32_at(48)? & 0xff;
    let arch = MACHINES
        .iter()
        .find(|&&(m, _)| m == mach)
        .map_or_else(|| format!("machine 0x{mach:x}"), |&(_, a)| a.to_string());
    let (shoff, shentsize, shnum) = (u64_at(40)? as usize, u16_at(58)? as usize, u16_at(60)?);
    let section = |i: usize| -> Result<(u32, usize, usize, u32), String> {
        let base = shoff + i * shentsize;
        Ok((
            u32_at(base + 4)?,
            u64_at(base + 24)? as usize,
            u64_at(base + 32)? as usize,
            u32_at(base + 40)?,
        ))
    };
    const SHT_SYMTAB: u32 = 2;
    let mut kernels = Vec::new();
    for i in 0..shnum as usize {
        let (kind, offset, size, link) = section(i)?;
        if kind != SHT_SYMTAB {
            continue;
        }
        let (_, str_off, str_size, _) = section(link as usize)?;
        let strings = at(str_off, str_size)?;
        for sym in (0..size / 24).map(|k| offset + k * 24) {
            let name_off = u32_at(sym)? as usize;
            let name = strings
                .get(name_off..)
                .and_then(|s| s.split(|&b| b == 0).next())
                .ok_or("a symbol name lies outside the string table")?;
            if let Some(kernel) = name.strip_suffix(b".kd") {
                kernels.push(String::from_utf8_lossy(kernel).into_owned());
            }
        }
    }
    kernels.sort();
    Ok(CodeObjectInfo { arch, kernels })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clang_versions_parse_after_a_vendors_words() {
        assert_eq!(
            parse_clang_version("Debian clang version 19.1.7 (3~deb12u1)"),
            Some((19, 1))
        );
        assert_eq!(
            parse_clang_version("AMD clang version 17.0.0 (https://github.com/RadeonOpenCompute/llvm-project roc-6.0.2)"),
            Some((17, 0))
        );
        assert_eq!(parse_clang_version("gcc (Debian 12.2.0)"), None);
    }

    #[test]
    fn what_is_no_amd_code_object_is_named() {
        assert!(inspect_code_object(b"\x7fEL")
            .unwrap_err()
            .contains("cut short"));
        assert!(inspect_code_object(&[0u8; 64])
            .unwrap_err()
            .contains("not a 64-bit"));
        let mut x86 = vec![0u8; 64];
        x86[..6].copy_from_slice(b"\x7fELF\x02\x01");
        x86[18] = 62;
        assert!(inspect_code_object(&x86)
            .unwrap_err()
            .contains("not AMDGPU"));
    }
}
