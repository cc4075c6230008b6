//! The one wrapper every export runs in: it turns errors into `ncclResult_t` codes, records the
//! message that `ncclGetLastError` returns, and stops panics at the C boundary.

use crate::abi::*;
use mscclpp::core::Error;
use std::cell::RefCell;
use std::ffi::{c_char, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Mutex;

/// A failed call: the code it returns and what the user should read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    pub code: NcclResult,
    pub message: String,
}

impl Failure {
    pub fn new(code: NcclResult, message: impl Into<String>) -> Self {
        Failure {
            code,
            message: message.into(),
        }
    }
    pub fn invalid_argument(message: impl Into<String>) -> Self {
        Self::new(INVALID_ARGUMENT, message)
    }
    pub fn invalid_usage(message: impl Into<String>) -> Self {
        Self::new(INVALID_USAGE, message)
    }
}

/// The NCCL code for each of our errors.
pub fn code_of(e: &Error) -> NcclResult {
    match e {
        Error::InvalidArgument(_) | Error::LaunchShape(_) | Error::Plan(_) => INVALID_ARGUMENT,
        Error::Unsupported(_) | Error::Env { .. } => INVALID_USAGE,
        Error::BackendUnavailable { .. } | Error::Driver { .. } | Error::Compile { .. } => {
            UNHANDLED_CUDA_ERROR
        }
        Error::Timeout { .. } | Error::Peer { .. } | Error::DeviceTimeout(_) => REMOTE_ERROR,
        Error::IbUnavailable(_) | Error::Bootstrap(_) | Error::Io { .. } | Error::Aborted(_) => {
            SYSTEM_ERROR
        }
        Error::Internal(_) => INTERNAL_ERROR,
    }
}

impl From<Error> for Failure {
    fn from(e: Error) -> Self {
        Failure::new(code_of(&e), e.to_string())
    }
}

pub type CallResult<T = NcclResult> = Result<T, Failure>;

/// The last failure of any call in this process (NCCL keeps one too).
static LAST_ERROR: Mutex<String> = Mutex::new(String::new());

thread_local! {
    /// The copy whose pointer `ncclGetLastError` hands out on this thread: valid until this
    /// thread's next call of it, whatever other threads record meanwhile.
    static RETURNED: RefCell<CString> = RefCell::new(CString::default());
    /// The last failure of a call on this thread (the C API's `mscclppGetLastError`): what other
    /// threads fail meanwhile does not replace it.
    static THREAD_LAST: RefCell<CString> = RefCell::new(CString::default());
}

pub fn record(call: &str, failure: &Failure) {
    let text = format!("{call}: {}", failure.message);
    tracing::warn!(target: "mscclpp::nccl", "{text}");
    let c = CString::new(text.replace('\0', " ")).unwrap_or_default();
    // `try_with`: see `last_error_ptr`.
    let _ = THREAD_LAST.try_with(|t| *t.borrow_mut() = c);
    if let Ok(mut last) = LAST_ERROR.lock() {
        *last = text;
    }
}

/// The text of the last recorded failure, as a C string owned by this thread.
pub fn last_error_ptr() -> *const c_char {
    let text = LAST_ERROR.lock().map(|s| s.clone()).unwrap_or_default();
    let c = CString::new(text.replace('\0', " ")).unwrap_or_default();
    // `try_with`: a thread whose thread-locals are being destroyed (a C++ destructor calling us)
    // gets an empty text rather than a panic there.
    RETURNED
        .try_with(|r| {
            *r.borrow_mut() = c;
            r.borrow().as_ptr()
        })
        .unwrap_or(c"".as_ptr())
}

/// The text of the last failure of a call on this thread (empty if none), valid until this
/// thread's next failing call.
pub fn thread_last_error_ptr() -> *const c_char {
    THREAD_LAST
        .try_with(|t| t.borrow().as_ptr())
        .unwrap_or(c"".as_ptr())
}

/// Runs one export: its result code, or the failure's code after recording it; a panic becomes
/// `ncclInternalError` with the panic's message, never an unwind into C.
pub fn ffi(call: &str, body: impl FnOnce() -> CallResult) -> NcclResult {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(code)) => code,
        Ok(Err(failure)) => {
            record(call, &failure);
            failure.code
        }
        Err(panic) => {
            let what = mscclpp::core::process::panic_message(panic.as_ref());
            let failure = Failure::new(
                INTERNAL_ERROR,
                format!("internal error (a bug in mscclpp-rs): {what}"),
            );
            record(call, &failure);
            failure.code
        }
    }
}

/// A NUL-terminated text argument named `what`; NULL or not UTF-8 is an invalid argument.
///
/// # Safety
/// `p` is null or a NUL-terminated string that outlives `'a`.
pub unsafe fn text_arg<'a>(p: *const c_char, what: &str) -> CallResult<&'a str> {
    if p.is_null() {
        return Err(Failure::invalid_argument(format!("{what} is NULL")));
    }
    // SAFETY: non-null; the caller promises a NUL-terminated string.
    unsafe { std::ffi::CStr::from_ptr(p) }
        .to_str()
        .map_err(|_| Failure::invalid_argument(format!("{what} is not UTF-8")))
}

/// Writes `value` through an out-pointer argument named `what`; null is an invalid argument.
///
/// # Safety
/// `out` is null or valid for one write of `T`.
pub unsafe fn write_out<T>(out: *mut T, what: &str, value: T) -> CallResult<()> {
    if out.is_null() {
        return Err(Failure::invalid_argument(format!("{what} is NULL")));
    }
    // SAFETY: non-null, and the caller promises it is writable.
    unsafe { out.write(value) };
    Ok(())
}

/// The static text of each result code (`ncclGetErrorString`).
pub fn error_string(code: NcclResult) -> &'static std::ffi::CStr {
    match code {
        SUCCESS => c"no error",
        UNHANDLED_CUDA_ERROR => c"unhandled cuda error (see ncclGetLastError for the call)",
        SYSTEM_ERROR => c"unhandled system error (network, socket or operating system)",
        INTERNAL_ERROR => c"internal error - please report this issue to mscclpp-rs",
        INVALID_ARGUMENT => c"invalid argument (see ncclGetLastError for which)",
        INVALID_USAGE => c"invalid usage (see ncclGetLastError for what is not supported)",
        REMOTE_ERROR => c"remote process exited or there was a network error",
        IN_PROGRESS => c"NCCL operation in progress",
        _ => c"unknown result code",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn panics_become_internal_errors_with_their_message() {
        let code = ffi("ncclTest", || panic!("boom"));
        assert_eq!(code, INTERNAL_ERROR);
        let text = unsafe { std::ffi::CStr::from_ptr(last_error_ptr()) };
        assert!(text.to_string_lossy().contains("ncclTest: internal error"));
        assert!(text.to_string_lossy().contains("boom"));
        let mine = unsafe { std::ffi::CStr::from_ptr(thread_last_error_ptr()) };
        assert!(mine.to_string_lossy().contains("ncclTest: internal error"));
        let other = std::thread::spawn(|| {
            let p = thread_last_error_ptr();
            unsafe { std::ffi::CStr::from_ptr(p) }.to_bytes().len()
        });
        assert_eq!(
            other.join().unwrap(),
            0,
            "another thread has no failure of its own"
        );
    }

    #[test]
    fn every_error_maps_to_a_failure_code() {
        let e = Error::Timeout {
            what: "rank(s) [1] to join".into(),
            timeout: std::time::Duration::from_secs(1),
        };
        assert_eq!(code_of(&e), REMOTE_ERROR);
        assert_eq!(
            code_of(&Error::InvalidArgument("x".into())),
            INVALID_ARGUMENT
        );
        assert_eq!(code_of(&Error::Unsupported("x".into())), INVALID_USAGE);
    }
}
