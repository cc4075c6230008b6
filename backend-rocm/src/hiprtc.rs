//! hiprtc, loaded at run time: compiles HIP C++ source to a code object for one `gfx` target.
//!
//! Same shape as the CUDA backend's NVRTC wrapper: a [`CompileRequest`] with in-memory headers in,
//! a [`CompiledKernel`] (code object + compiler log) out; a failed compile is [`Error::Compile`]
//! carrying hiprtc's log.

use crate::loader;
use mscclpp_core::kernel_cache::KernelCompiler;
use mscclpp_core::{Error, Result};
use std::ffi::{c_char, c_int, CStr, CString};

type HiprtcResult = c_int;
type HiprtcProgram = *mut std::ffi::c_void;
const HIPRTC_SUCCESS: HiprtcResult = 0;

/// Names tried for the hiprtc library (see `loader` for the directories). ROCm 5.2 and older
/// carry hiprtc inside the HIP runtime itself (Debian 12's libamdhip64-5 does), hence the last.
pub const HIPRTC_LIB_NAMES: &[&str] = &[
    "libhiprtc.so",
    "libhiprtc.so.6",
    "libhiprtc.so.5",
    "libamdhip64.so.5",
];

type FnCreate = unsafe extern "C" fn(
    *mut HiprtcProgram,
    *const c_char,
    *const c_char,
    c_int,
    *const *const c_char,
    *const *const c_char,
) -> HiprtcResult;
type FnCompile = unsafe extern "C" fn(HiprtcProgram, c_int, *const *const c_char) -> HiprtcResult;
type FnGetSize = unsafe extern "C" fn(HiprtcProgram, *mut usize) -> HiprtcResult;
type FnGetBytes = unsafe extern "C" fn(HiprtcProgram, *mut c_char) -> HiprtcResult;
type FnDestroy = unsafe extern "C" fn(*mut HiprtcProgram) -> HiprtcResult;
type FnErrorString = unsafe extern "C" fn(HiprtcResult) -> *const c_char;
type FnVersion = unsafe extern "C" fn(*mut c_int, *mut c_int) -> HiprtcResult;

struct Api {
    create: FnCreate,
    compile: FnCompile,
    log_size: FnGetSize,
    log: FnGetBytes,
    code_size: FnGetSize,
    code: FnGetBytes,
    destroy: FnDestroy,
    error_string: FnErrorString,
}

/// Held across each compilation, by every [`Hiprtc`] of the process: ROCm 5's hiprtc crashes
/// (SIGSEGV, seen with Debian 12's 5.2) when two programs compile at once, one per thread.
/// Compiles are rare and cached, so serialising them costs nothing that matters.
static COMPILING: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// A loaded hiprtc library.
pub struct Hiprtc {
    api: Api,
    version: (i32, i32),
    location: String,
    // Keeps the function pointers valid; dropped last.
    _lib: libloading::Library,
}

impl std::fmt::Debug for Hiprtc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hiprtc")
            .field("version", &self.version)
            .field("location", &self.location)
            .finish()
    }
}

/// One run-time compilation (shared with the other backend and the build tool).
pub use mscclpp_core::kernel_image::CompileRequest;

/// A compiled code object (an ELF image `hipModuleLoadData` accepts) and hiprtc's log.
pub use mscclpp_core::kernel_image::CompiledKernel;

fn c_string(what: &str, s: &str) -> Result<CString> {
    CString::new(s).map_err(|_| Error::InvalidArgument(format!("{what} {s:?} contains a NUL byte")))
}

/// Destroys the program on every exit path of `compile`.
struct Program<'a> {
    api: &'a Api,
    prog: HiprtcProgram,
}

impl Drop for Program<'_> {
    fn drop(&mut self) {
        // SAFETY: `prog` came from hiprtcCreateProgram and is destroyed once, here.
        unsafe { (self.api.destroy)(&mut self.prog) };
    }
}

impl Hiprtc {
    /// Loads hiprtc, or says which library was looked for and where.
    pub fn load() -> Result<Hiprtc> {
        let (opened, (api, version_fn)) =
            loader::open_first("the hiprtc library", HIPRTC_LIB_NAMES, |lib, location| {
                let api = Api {
                    create: loader::symbol(lib, location, "hiprtcCreateProgram\0")?,
                    compile: loader::symbol(lib, location, "hiprtcCompileProgram\0")?,
                    log_size: loader::symbol(lib, location, "hiprtcGetProgramLogSize\0")?,
                    log: loader::symbol(lib, location, "hiprtcGetProgramLog\0")?,
                    code_size: loader::symbol(lib, location, "hiprtcGetCodeSize\0")?,
                    code: loader::symbol(lib, location, "hiprtcGetCode\0")?,
                    destroy: loader::symbol(lib, location, "hiprtcDestroyProgram\0")?,
                    error_string: loader::symbol(lib, location, "hiprtcGetErrorString\0")?,
                };
                let version_fn: FnVersion = loader::symbol(lib, location, "hiprtcVersion\0")?;
                Ok((api, version_fn))
            })?;
        let (mut major, mut minor) = (0, 0);
        // SAFETY: two valid out-pointers.
        let rc = unsafe { version_fn(&mut major, &mut minor) };
        let version = if rc == HIPRTC_SUCCESS {
            (major, minor)
        } else {
            (0, 0)
        };
        Ok(Hiprtc {
            api,
            version,
            location: opened.location,
            _lib: opened.lib,
        })
    }

    /// (major, minor) as hiprtc reports it; (0, 0) if it would not say.
    pub fn version(&self) -> (i32, i32) {
        self.version
    }

    /// Where the library was found.
    pub fn location(&self) -> &str {
        &self.location
    }

    fn check(&self, call: &'static str, rc: HiprtcResult) -> Result<()> {
        if rc == HIPRTC_SUCCESS {
            return Ok(());
        }
        // SAFETY: returns a static string or null.
        let p = unsafe { (self.api.error_string)(rc) };
        let message = if p.is_null() {
            "unknown hiprtc error".to_string()
        } else {
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        };
        Err(Error::Driver {
            call,
            code: i64::from(rc),
            message,
        })
    }

    /// The options every compile gets, before the caller's: the target and optimisation.
    pub fn options_for(req: &CompileRequest) -> Vec<String> {
        let mut opts = vec![
            format!("--offload-arch={}", req.arch),
            "-O3".to_string(),
            "-std=c++17".to_string(),
        ];
        opts.extend(req.options.iter().cloned());
        opts
    }

    pub fn compile(&self, req: &CompileRequest) -> Result<CompiledKernel> {
        let source = c_string("source of", req.source)?;
        let name = c_string("program name", req.name)?;
        let header_texts = req
            .headers
            .iter()
            .map(|(_, text)| c_string("header text", text))
            .collect::<Result<Vec<_>>>()?;
        let header_names = req
            .headers
            .iter()
            .map(|(n, _)| c_string("header name", n))
            .collect::<Result<Vec<_>>>()?;
        let text_ptrs: Vec<*const c_char> = header_texts.iter().map(|s| s.as_ptr()).collect();
        let name_ptrs: Vec<*const c_char> = header_names.iter().map(|s| s.as_ptr()).collect();
        let options = Self::options_for(req)
            .iter()
            .map(|o| c_string("option", o))
            .collect::<Result<Vec<_>>>()?;
        let option_ptrs: Vec<*const c_char> = options.iter().map(|s| s.as_ptr()).collect();
        let count = |n: usize, what: &str| {
            c_int::try_from(n).map_err(|_| Error::InvalidArgument(format!("too many {what}: {n}")))
        };

        let _one_at_a_time = COMPILING.lock().unwrap_or_else(|p| p.into_inner());
        let mut prog: HiprtcProgram = std::ptr::null_mut();
        // SAFETY: all pointers are valid NUL-terminated strings living until the end of this call.
        let rc = unsafe {
            (self.api.create)(
                &mut prog,
                source.as_ptr(),
                name.as_ptr(),
                count(text_ptrs.len(), "headers")?,
                text_ptrs.as_ptr(),
                name_ptrs.as_ptr(),
            )
        };
        self.check("hiprtcCreateProgram", rc)?;
        let program = Program {
            api: &self.api,
            prog,
        };

        // SAFETY: a live program and an array of option strings.
        let rc = unsafe {
            (self.api.compile)(
                program.prog,
                count(option_ptrs.len(), "options")?,
                option_ptrs.as_ptr(),
            )
        };
        let log = self.read(
            &program,
            self.api.log_size,
            self.api.log,
            "hiprtcGetProgramLog",
        )?;
        let log = String::from_utf8_lossy(log.split(|&b| b == 0).next().unwrap_or_default())
            .trim()
            .to_string();
        if rc != HIPRTC_SUCCESS {
            return Err(Error::Compile {
                name: format!("{} for {}", req.name, req.arch),
                log: if log.is_empty() {
                    format!("hiprtcCompileProgram returned {rc}")
                } else {
                    log
                },
            });
        }
        let image = self.read(&program, self.api.code_size, self.api.code, "hiprtcGetCode")?;
        Ok(CompiledKernel { image, log })
    }

    fn read(
        &self,
        program: &Program,
        size_fn: FnGetSize,
        get_fn: FnGetBytes,
        call: &'static str,
    ) -> Result<Vec<u8>> {
        let mut size = 0usize;
        // SAFETY: a live program and a valid out-pointer.
        self.check(call, unsafe { size_fn(program.prog, &mut size) })?;
        let mut buf = vec![0u8; size];
        if size > 0 {
            // SAFETY: `buf` has exactly the size hiprtc reported.
            self.check(call, unsafe {
                get_fn(program.prog, buf.as_mut_ptr().cast())
            })?;
        }
        Ok(buf)
    }
}

impl KernelCompiler for Hiprtc {
    fn options_for(&self, req: &CompileRequest) -> Vec<String> {
        Hiprtc::options_for(req)
    }
    fn version(&self) -> (i32, i32) {
        Hiprtc::version(self)
    }
    fn compile(&self, req: &CompileRequest) -> Result<CompiledKernel> {
        Hiprtc::compile(self, req)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_put_the_target_first() {
        let extra = vec!["-DX=1".to_string()];
        let req = CompileRequest {
            name: "k",
            source: "",
            arch: "gfx942",
            headers: &[],
            options: &extra,
        };
        assert_eq!(
            Hiprtc::options_for(&req),
            vec!["--offload-arch=gfx942", "-O3", "-std=c++17", "-DX=1"]
        );
    }

    #[test]
    fn absent_hiprtc_gives_a_clear_error() {
        match Hiprtc::load() {
            Ok(h) => eprintln!("skipping: hiprtc is present here ({})", h.location()),
            Err(e) => {
                let msg = e.to_string();
                assert!(e.is_unavailable(), "{msg}");
                assert!(
                    msg.contains("libhiprtc.so") && msg.contains("/opt/rocm/lib"),
                    "{msg}"
                );
            }
        }
    }
}
