//! libmscclpp_nccl.so: the NCCL 2.28 C interface (`include/nccl.h`) over mscclpp-rs, usable with
//! `LD_PRELOAD` or as `libnccl.so.2` on `LD_LIBRARY_PATH` (its SONAME).
//!
//! How each export is served (native, through the real NCCL of `MSCCLPP_NCCL_LIB_PATH`, or an
//! error naming why) is tabulated in `README.md` of this crate. Every export runs inside
//! [`guard::ffi`]: errors become `ncclResult_t` codes with a message for `ncclGetLastError`, and
//! no panic unwinds into C.
//!
//! The exports take raw pointers from C; their contract is NCCL's documentation of the same
//! function, so the `# Safety` sections would only repeat it.
#![allow(non_snake_case, clippy::missing_safety_doc)]

/// Defines an export under its NCCL name and its profiling alias (`p` prefix), as libnccl does.
macro_rules! nccl_export {
    ($(#[$m:meta])* fn $name:ident / $alias:ident ( $($arg:ident : $ty:ty),* $(,)? ) -> $ret:ty $body:block) => {
        $(#[$m])*
        #[no_mangle]
        pub unsafe extern "C" fn $name($($arg: $ty),*) -> $ret $body

        #[doc = concat!("Profiling alias of [`", stringify!($name), "`].")]
        #[no_mangle]
        pub unsafe extern "C" fn $alias($($arg: $ty),*) -> $ret {
            unsafe { $name($($arg),*) }
        }
    };
}

pub mod abi;
pub mod comm;
pub mod device;
pub mod device_api;
pub mod embedding;
pub mod fallback;
pub mod group;
pub mod guard;
pub mod handles;
pub mod lifecycle;
pub mod memory;
pub mod ops;
pub mod preload;
pub mod registry;
pub mod watchdog;

#[cfg(test)]
mod argument_tests;
#[cfg(test)]
mod concurrency_tests;
