//! NVRTC, loaded at run time with our own small loader.
//!
//! cudarc's NVRTC loader only looks for the `.so` major version of its build feature, and panics when
//! it is missing; users run CUDA 12 and CUDA 13. So we `dlopen` whichever NVRTC is present and resolve
//! the handful of entry points we use.
//!
//! # Where NVRTC is looked for (first hit wins)
//! 1. `$MSCCLPP_NVRTC_LIB`: a library file, or a folder holding `libnvrtc.so.13`/`.so.12`/`.so`. When
//!    set, it is the only place tried, so a wrong value is reported instead of silently bypassed.
//! 2. `$CUDA_HOME/lib64`, `$CUDA_PATH/lib64`, `/usr/local/cuda/lib64`.
//! 3. The dynamic loader's search path (`LD_LIBRARY_PATH`, `ld.so.cache`).
//! 4. PyPI wheels: `site-packages/nvidia/cu13/lib` (nvidia-cuda-nvrtc for CUDA 13),
//!    `nvidia/cu12/lib`, `nvidia/cuda_nvrtc/lib` (CUDA 12 wheels).
//!
//! Every compile passes `-std=c++17 --gpu-architecture=<arch> -default-device -DMSCCLPP_NVRTC=1` and
//! `-I` for the headers' folder (see [`cuda_include_dirs`]), then the caller's options. Embedded
//! headers (`mscclpp/packet.cuh`, ...) are handed to NVRTC in memory, so nothing is read from disk.

use crate::toolkit::{self, NVRTC_LIB_ENV, NVRTC_LIB_NAMES};
use mscclpp_core::kernel_cache::KernelCompiler;
use mscclpp_core::{Error, Result};
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::path::PathBuf;

pub use crate::toolkit::cuda_include_dirs;

type NvrtcResult = c_int;
type NvrtcProgram = *mut c_void;

const NVRTC_SUCCESS: NvrtcResult = 0;

type FnVersion = unsafe extern "C" fn(*mut c_int, *mut c_int) -> NvrtcResult;
type FnCreateProgram = unsafe extern "C" fn(
    *mut NvrtcProgram,
    *const c_char,
    *const c_char,
    c_int,
    *const *const c_char,
    *const *const c_char,
) -> NvrtcResult;
type FnCompileProgram =
    unsafe extern "C" fn(NvrtcProgram, c_int, *const *const c_char) -> NvrtcResult;
type FnGetSize = unsafe extern "C" fn(NvrtcProgram, *mut usize) -> NvrtcResult;
type FnGetBytes = unsafe extern "C" fn(NvrtcProgram, *mut c_char) -> NvrtcResult;
type FnDestroyProgram = unsafe extern "C" fn(*mut NvrtcProgram) -> NvrtcResult;
type FnGetErrorString = unsafe extern "C" fn(NvrtcResult) -> *const c_char;

/// The resolved NVRTC entry points.
struct Api {
    version: FnVersion,
    create_program: FnCreateProgram,
    compile_program: FnCompileProgram,
    get_program_log_size: FnGetSize,
    get_program_log: FnGetBytes,
    get_cubin_size: FnGetSize,
    get_cubin: FnGetBytes,
    get_ptx_size: FnGetSize,
    get_ptx: FnGetBytes,
    destroy_program: FnDestroyProgram,
    get_error_string: FnGetErrorString,
}

/// A loaded NVRTC library.
pub struct Nvrtc {
    api: Api,
    version: (i32, i32),
    /// Where the library was found (a path, or a bare name resolved by the dynamic loader).
    location: String,
    /// Include folders passed to every compile: the loaded library's own headers first.
    include_dirs: Vec<PathBuf>,
    // Keeps the function pointers in `api` valid; dropped last.
    _lib: libloading::Library,
}

/// NVRTC opens `libnvrtc-builtins.so.<major>.<minor>` by name at its first compile. Copies that do
/// not carry a run path to their own folder (PyPI's wheels, for one) then fail with "failed to open
/// libnvrtc-builtins". Loading the builtins that sit next to the chosen library first, with
/// RTLD_GLOBAL, makes that later lookup find them. The handle is leaked on purpose: NVRTC keeps
/// using the builtins for the life of the process.
fn preload_builtins(nvrtc_path: &str) {
    let Some(dir) = std::path::Path::new(nvrtc_path).parent() else {
        return;
    };
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if name.starts_with("libnvrtc-builtins.so.") && !name.contains("alt") {
            // SAFETY: the builtins library has no initialisers with preconditions.
            let lib = unsafe {
                libloading::os::unix::Library::open(
                    Some(entry.path()),
                    libloading::os::unix::RTLD_NOW | libloading::os::unix::RTLD_GLOBAL,
                )
            };
            match lib {
                Ok(lib) => std::mem::forget(lib),
                Err(e) => tracing::debug!(target: "mscclpp::gpu", "preloading {name}: {e}"),
            }
        }
    }
}

impl std::fmt::Debug for Nvrtc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nvrtc")
            .field("version", &self.version)
            .field("location", &self.location)
            .field("include_dirs", &self.include_dirs)
            .finish()
    }
}

/// One run-time compilation (shared with the other backend and the build tool).
pub use mscclpp_core::kernel_image::CompileRequest;

/// A compiled program (shared with the other backend and the disk cache).
pub use mscclpp_core::kernel_image::CompiledKernel;

/// Resolves one symbol, naming the library and symbol when it is missing.
fn symbol<T: Copy>(lib: &libloading::Library, location: &str, name: &str) -> Result<T> {
    // SAFETY: the caller names a symbol whose C signature matches `T` (see the type aliases above).
    let sym = unsafe { lib.get::<T>(name.as_bytes()) };
    match sym {
        Ok(s) => Ok(*s),
        Err(e) => Err(Error::BackendUnavailable {
            backend: "cuda".into(),
            reason: format!(
                "NVRTC library {location} lacks {name}: {}",
                toolkit::describe_dl_error(&e)
            ),
        }),
    }
}

/// The candidates to `dlopen`, in search order (see the module docs). A candidate is either a path
/// or a bare name for the dynamic loader.
fn library_candidates() -> Result<Vec<String>> {
    if let Some(v) = std::env::var_os(NVRTC_LIB_ENV).filter(|v| !v.is_empty()) {
        let p = PathBuf::from(&v);
        if p.is_dir() {
            return Ok(NVRTC_LIB_NAMES
                .iter()
                .map(|n| p.join(n))
                .filter(|f| f.exists())
                .map(|f| f.display().to_string())
                .collect());
        }
        if p.is_file() {
            return Ok(vec![p.display().to_string()]);
        }
        return Err(Error::Env {
            var: NVRTC_LIB_ENV,
            value: v.to_string_lossy().into_owned(),
            reason: "not an existing NVRTC library file or folder".into(),
        });
    }
    let in_dirs = |dirs: Vec<PathBuf>| -> Vec<String> {
        dirs.iter()
            .flat_map(|d| NVRTC_LIB_NAMES.iter().map(move |n| d.join(n)))
            .filter(|f| f.exists())
            .map(|f| f.display().to_string())
            .collect()
    };
    let mut out = in_dirs(toolkit::toolkit_lib_dirs());
    out.extend(NVRTC_LIB_NAMES.iter().map(|n| n.to_string()));
    out.extend(in_dirs(toolkit::pip_lib_dirs()));
    Ok(out)
}

/// The file the dynamic loader actually opened for `lib` (bare names resolve through `ld.so`), so we
/// can find the headers shipped beside it.
fn loaded_path(location: &str, probe: *const c_void) -> PathBuf {
    if location.contains('/') {
        return PathBuf::from(location);
    }
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: `probe` is a function pointer inside the loaded library; dladdr only reads it.
    let ok = unsafe { libc::dladdr(probe, &mut info) } != 0;
    if ok && !info.dli_fname.is_null() {
        // SAFETY: dladdr returns a NUL-terminated path owned by the loader.
        let s = unsafe { CStr::from_ptr(info.dli_fname) };
        return PathBuf::from(s.to_string_lossy().into_owned());
    }
    PathBuf::from(location)
}

impl Nvrtc {
    /// Loads NVRTC from the first place in the search order that has it.
    pub fn load() -> Result<Nvrtc> {
        let candidates = library_candidates()?;
        let mut failures: Vec<String> = Vec::new();
        for cand in &candidates {
            preload_builtins(cand);
            // SAFETY: loading NVRTC runs its initialisers, which have no preconditions.
            match unsafe { libloading::Library::new(cand) } {
                Ok(lib) => return Self::from_library(lib, cand),
                Err(e) => failures.push(format!("{cand}: {}", toolkit::describe_dl_error(&e))),
            }
        }
        let tried = if failures.is_empty() {
            format!("{NVRTC_LIB_ENV} names a folder with no NVRTC library")
        } else {
            failures.join("; ")
        };
        Err(Error::BackendUnavailable {
            backend: "cuda".into(),
            reason: format!(
                "NVRTC (libnvrtc.so.13/.so.12) could not be loaded; set {NVRTC_LIB_ENV} or CUDA_HOME, \
                 or `pip install nvidia-cuda-nvrtc`. Tried: {tried}"
            ),
        })
    }

    fn from_library(lib: libloading::Library, location: &str) -> Result<Nvrtc> {
        let api = Api {
            version: symbol(&lib, location, "nvrtcVersion")?,
            create_program: symbol(&lib, location, "nvrtcCreateProgram")?,
            compile_program: symbol(&lib, location, "nvrtcCompileProgram")?,
            get_program_log_size: symbol(&lib, location, "nvrtcGetProgramLogSize")?,
            get_program_log: symbol(&lib, location, "nvrtcGetProgramLog")?,
            get_cubin_size: symbol(&lib, location, "nvrtcGetCUBINSize")?,
            get_cubin: symbol(&lib, location, "nvrtcGetCUBIN")?,
            get_ptx_size: symbol(&lib, location, "nvrtcGetPTXSize")?,
            get_ptx: symbol(&lib, location, "nvrtcGetPTX")?,
            destroy_program: symbol(&lib, location, "nvrtcDestroyProgram")?,
            get_error_string: symbol(&lib, location, "nvrtcGetErrorString")?,
        };
        let (mut major, mut minor) = (0, 0);
        // SAFETY: nvrtcVersion writes two ints.
        let r = unsafe { (api.version)(&mut major, &mut minor) };
        let path = loaded_path(location, api.version as *const c_void);
        let mut include_dirs: Vec<PathBuf> =
            toolkit::sibling_include_dir(&path).into_iter().collect();
        for d in cuda_include_dirs() {
            if !include_dirs.contains(&d) {
                include_dirs.push(d);
            }
        }
        let nvrtc = Nvrtc {
            api,
            version: (major, minor),
            location: path.display().to_string(),
            include_dirs,
            _lib: lib,
        };
        nvrtc.check("nvrtcVersion", r)?;
        tracing::debug!(
            "loaded NVRTC {major}.{minor} from {} (include dirs {:?})",
            nvrtc.location,
            nvrtc.include_dirs
        );
        Ok(nvrtc)
    }

    /// NVRTC's (major, minor) version.
    pub fn version(&self) -> (i32, i32) {
        self.version
    }

    /// Path (or loader name) of the library in use.
    pub fn location(&self) -> &str {
        &self.location
    }

    /// The `-I` folders every compile gets.
    pub fn include_dirs(&self) -> &[PathBuf] {
        &self.include_dirs
    }

    /// The full option list a compile of `req` passes to NVRTC (ours, then the caller's). The kernel
    /// cache hashes this, so anything that changes the output must appear here.
    pub fn options_for(&self, req: &CompileRequest) -> Vec<String> {
        let mut opts = base_options(req.arch);
        opts.extend(
            self.include_dirs
                .iter()
                .map(|d| format!("-I{}", d.display())),
        );
        opts.extend(req.options.iter().cloned());
        opts
    }

    /// Compiles `req`. A program that does not compile is [`Error::Compile`] carrying NVRTC's log.
    pub fn compile(&self, req: &CompileRequest) -> Result<CompiledKernel> {
        validate_arch(req.arch)?;
        let cstr = |what: &str, s: &str| {
            CString::new(s).map_err(|_| {
                Error::InvalidArgument(format!("kernel {}: {what} contains a NUL byte", req.name))
            })
        };
        let source = cstr("source", req.source)?;
        let name = cstr("name", req.name)?;
        let header_texts: Vec<CString> = req
            .headers
            .iter()
            .map(|(n, t)| cstr(&format!("header {n}"), t))
            .collect::<Result<_>>()?;
        let header_names: Vec<CString> = req
            .headers
            .iter()
            .map(|(n, _)| cstr("header name", n))
            .collect::<Result<_>>()?;
        let options: Vec<CString> = self
            .options_for(req)
            .iter()
            .map(|o| cstr(&format!("option {o}"), o))
            .collect::<Result<_>>()?;
        let text_ptrs: Vec<*const c_char> = header_texts.iter().map(|c| c.as_ptr()).collect();
        let name_ptrs: Vec<*const c_char> = header_names.iter().map(|c| c.as_ptr()).collect();
        let opt_ptrs: Vec<*const c_char> = options.iter().map(|c| c.as_ptr()).collect();
        let num_headers = c_int::try_from(req.headers.len()).map_err(|_| {
            Error::InvalidArgument(format!("kernel {}: too many headers", req.name))
        })?;
        let num_options = c_int::try_from(opt_ptrs.len()).map_err(|_| {
            Error::InvalidArgument(format!("kernel {}: too many options", req.name))
        })?;

        let mut prog: NvrtcProgram = std::ptr::null_mut();
        // SAFETY: all pointers come from live CStrings/Vecs above; NVRTC copies what it keeps.
        let r = unsafe {
            (self.api.create_program)(
                &mut prog,
                source.as_ptr(),
                name.as_ptr(),
                num_headers,
                if req.headers.is_empty() {
                    std::ptr::null()
                } else {
                    text_ptrs.as_ptr()
                },
                if req.headers.is_empty() {
                    std::ptr::null()
                } else {
                    name_ptrs.as_ptr()
                },
            )
        };
        self.check("nvrtcCreateProgram", r)?;
        let program = Program { nvrtc: self, prog };

        // SAFETY: `prog` is live; the option pointers outlive the call.
        let r = unsafe { (self.api.compile_program)(program.prog, num_options, opt_ptrs.as_ptr()) };
        let log = program.log()?;
        if r != NVRTC_SUCCESS {
            let log = if log.trim().is_empty() {
                format!(
                    "nvrtcCompileProgram returned {} ({})",
                    r,
                    self.error_string(r)
                )
            } else {
                log
            };
            return Err(Error::Compile {
                name: req.name.to_string(),
                log,
            });
        }
        let image = if req.arch.starts_with("sm_") {
            program.bytes("nvrtcGetCUBIN", self.api.get_cubin_size, self.api.get_cubin)?
        } else {
            program.bytes("nvrtcGetPTX", self.api.get_ptx_size, self.api.get_ptx)?
        };
        if image.is_empty() {
            return Err(Error::Compile {
                name: req.name.to_string(),
                log: format!("NVRTC produced an empty image for {}", req.arch),
            });
        }
        Ok(CompiledKernel { image, log })
    }

    fn error_string(&self, r: NvrtcResult) -> String {
        // SAFETY: nvrtcGetErrorString returns a static string (or NULL) for any code.
        let p = unsafe { (self.api.get_error_string)(r) };
        if p.is_null() {
            return "unknown NVRTC error".into();
        }
        // SAFETY: non-null, NUL-terminated, static.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }

    fn check(&self, call: &'static str, r: NvrtcResult) -> Result<()> {
        if r == NVRTC_SUCCESS {
            return Ok(());
        }
        Err(Error::Driver {
            call,
            code: i64::from(r),
            message: self.error_string(r),
        })
    }
}

/// The options every compile for `arch` starts with, before the include folders and the caller's
/// options. The embedded kernels' key ([`crate::aot::embedded_key`]) hashes these but not the
/// include folders, which differ from machine to machine.
pub fn base_options(arch: &str) -> Vec<String> {
    vec![
        "-std=c++17".to_string(),
        format!("--gpu-architecture={arch}"),
        "-default-device".to_string(),
        "-DMSCCLPP_NVRTC=1".to_string(),
    ]
}

/// Accepts `sm_XY[Z][a|f]` and `compute_XY[Z][a|f]`; anything else would give a confusing NVRTC
/// option error, so we name the problem here.
fn validate_arch(arch: &str) -> Result<()> {
    let rest = arch
        .strip_prefix("sm_")
        .or_else(|| arch.strip_prefix("compute_"));
    let ok = rest.is_some_and(|r| {
        let digits = r.trim_end_matches(['a', 'f']);
        (2..=3).contains(&digits.len())
            && digits.bytes().all(|b| b.is_ascii_digit())
            && r.len() - digits.len() <= 1
    });
    if ok {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!(
            "GPU architecture {arch:?} is not of the form sm_90 / sm_100a / compute_90"
        )))
    }
}

/// An NVRTC program, destroyed on drop (also on every error path).
struct Program<'a> {
    nvrtc: &'a Nvrtc,
    prog: NvrtcProgram,
}

impl Program<'_> {
    fn log(&self) -> Result<String> {
        let bytes = self.bytes(
            "nvrtcGetProgramLog",
            self.nvrtc.api.get_program_log_size,
            self.nvrtc.api.get_program_log,
        )?;
        let text = String::from_utf8_lossy(&bytes);
        Ok(text.trim_end_matches('\0').trim_end().to_string())
    }

    /// Size-then-copy pattern shared by the log, CUBIN and PTX getters.
    fn bytes(&self, call: &'static str, size: FnGetSize, get: FnGetBytes) -> Result<Vec<u8>> {
        let mut n: usize = 0;
        // SAFETY: `prog` is live; writes one size_t.
        let r = unsafe { size(self.prog, &mut n) };
        self.nvrtc.check(call, r)?;
        let mut buf = vec![0u8; n];
        if n > 0 {
            // SAFETY: `buf` holds exactly the `n` bytes NVRTC said it will write.
            let r = unsafe { get(self.prog, buf.as_mut_ptr().cast()) };
            self.nvrtc.check(call, r)?;
        }
        Ok(buf)
    }
}

impl Drop for Program<'_> {
    fn drop(&mut self) {
        // SAFETY: `prog` came from nvrtcCreateProgram and is destroyed once.
        let r = unsafe { (self.nvrtc.api.destroy_program)(&mut self.prog) };
        if r != NVRTC_SUCCESS {
            tracing::warn!("nvrtcDestroyProgram failed: {}", self.nvrtc.error_string(r));
        }
    }
}

impl KernelCompiler for Nvrtc {
    fn options_for(&self, req: &CompileRequest) -> Vec<String> {
        Nvrtc::options_for(self, req)
    }
    fn version(&self) -> (i32, i32) {
        Nvrtc::version(self)
    }
    fn compile(&self, req: &CompileRequest) -> Result<CompiledKernel> {
        Nvrtc::compile(self, req)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arch_names() {
        for ok in [
            "sm_80",
            "sm_90",
            "sm_90a",
            "sm_100",
            "sm_100f",
            "compute_90",
        ] {
            assert!(validate_arch(ok).is_ok(), "{ok}");
        }
        for bad in ["", "90", "sm_", "sm_9", "sm_90ab", "gfx942", "sm_9x"] {
            assert!(validate_arch(bad).is_err(), "{bad}");
        }
    }
}
