//! Bad arguments to every collective and point-to-point export, on the CPU: a one-rank
//! communicator over the host test GPU. Each call must return NCCL's code for the mistake and
//! leave a last-error text naming it, before anything reaches a buffer (the buffers here are
//! never dereferenced), and the communicator must stay usable: never ncclInternalError, which is
//! what a panic caught at the boundary turns into.

use crate::abi::*;
use crate::concurrency_tests::host_comms;
use crate::guard::thread_last_error_ptr;
use crate::handles::Handle;
use crate::lifecycle::ncclCommDestroy;
use crate::ops::*;
use std::ffi::{c_int, c_void, CStr};

const FLOAT: c_int = 7;
const SUM: c_int = 0;
/// An address no call may read or write: every call below must fail before using it.
const NOWHERE: usize = 0x10;

fn send() -> *const c_void {
    NOWHERE as *const c_void
}

fn recv() -> *mut c_void {
    NOWHERE as *mut c_void
}

/// This thread's last failure (what `mscclppGetLastError` returns): `ncclGetLastError`'s text is
/// the process's, which the other tests of this binary overwrite as they run.
fn last_error() -> String {
    // SAFETY: a NUL-terminated text that stays valid until this thread's next failing call.
    unsafe { CStr::from_ptr(thread_last_error_ptr()) }
        .to_string_lossy()
        .into_owned()
}

/// Runs `call`, then checks its code and that the last error names each of `words`.
fn expect(what: &str, code: NcclResult, words: &[&str], call: impl FnOnce() -> NcclResult) {
    let got = call();
    let text = last_error();
    assert_eq!(got, code, "{what}: code {got}, expected {code} ({text})");
    for w in words {
        assert!(
            text.contains(w),
            "{what}: the error {text:?} does not name {w:?}"
        );
    }
}

#[test]
fn bad_arguments_are_named_and_never_reach_a_buffer() {
    let comm = host_comms(1)[0];
    let c = comm.get();
    let s = std::ptr::null_mut();
    let huge = usize::MAX / 2;
    // SAFETY (every call): the shim's documented prototypes; each call fails its argument checks
    // before it touches the buffers (which is what this test checks).
    unsafe {
        expect(
            "allreduce, type 99",
            INVALID_ARGUMENT,
            &["ncclAllReduce", "99"],
            || ncclAllReduce(send(), recv(), 4, 99, SUM, c, s),
        );
        expect("allreduce, type -1", INVALID_ARGUMENT, &["-1"], || {
            ncclAllReduce(send(), recv(), 4, -1, SUM, c, s)
        });
        expect(
            "allreduce, op -1",
            INVALID_ARGUMENT,
            &["-1", "operator"],
            || ncclAllReduce(send(), recv(), 4, FLOAT, -1, c, s),
        );
        expect(
            "allreduce, overflow",
            INVALID_ARGUMENT,
            &["overflows"],
            || ncclAllReduce(send(), recv(), huge, FLOAT, SUM, c, s),
        );
        // A PreMulSum op is the real NCCL's: without one behind the shim the call says so.
        expect(
            "allreduce, PreMulSum",
            INVALID_USAGE,
            &["PreMulSum", "real NCCL"],
            || ncclAllReduce(send(), recv(), 4, FLOAT, NUM_BUILTIN_OPS, c, s),
        );
        expect(
            "allgather, overflow",
            INVALID_ARGUMENT,
            &["ncclAllGather", "overflows"],
            || ncclAllGather(send(), recv(), huge, FLOAT, c, s),
        );
        expect(
            "reducescatter, op 40",
            INVALID_USAGE,
            &["ncclReduceScatter"],
            || ncclReduceScatter(send(), recv(), 4, FLOAT, 40, c, s),
        );
        expect("reducescatter, type 12", INVALID_ARGUMENT, &["12"], || {
            ncclReduceScatter(send(), recv(), 4, 12, SUM, c, s)
        });
        for root in [-1, 1, c_int::MAX] {
            let words = ["root", &root.to_string(), "not a rank"];
            expect("broadcast, root", INVALID_ARGUMENT, &words, || {
                ncclBroadcast(send(), recv(), 4, FLOAT, root, c, s)
            });
            expect("bcast, root", INVALID_ARGUMENT, &words, || {
                ncclBcast(recv(), 4, FLOAT, root, c, s)
            });
            expect("reduce, root", INVALID_ARGUMENT, &words, || {
                ncclReduce(send(), recv(), 4, FLOAT, SUM, root, c, s)
            });
        }
        for peer in [-1, 1, 7] {
            let words = ["peer", &peer.to_string(), "not a rank"];
            expect("send, peer", INVALID_ARGUMENT, &words, || {
                ncclSend(send(), 4, FLOAT, peer, c, s)
            });
            expect("recv, peer", INVALID_ARGUMENT, &words, || {
                ncclRecv(recv(), 4, FLOAT, peer, c, s)
            });
        }
        expect(
            "send, overflow",
            INVALID_ARGUMENT,
            &["ncclSend", "overflows"],
            || ncclSend(send(), huge, FLOAT, 0, c, s),
        );
        expect(
            "alltoall, type 99",
            INVALID_ARGUMENT,
            &["ncclAlltoAll", "99"],
            || ncclAlltoAll(send(), recv(), 4, 99, c, s),
        );
        expect(
            "gather, root 3",
            INVALID_ARGUMENT,
            &["ncclGather", "root"],
            || ncclGather(send(), recv(), 4, FLOAT, 3, c, s),
        );
        expect(
            "scatter, root -2",
            INVALID_ARGUMENT,
            &["ncclScatter", "root"],
            || ncclScatter(send(), recv(), 4, FLOAT, -2, c, s),
        );
        // Not a communicator: NULL, and an address the shim never handed out.
        for bad in [std::ptr::null_mut(), 0x1234 as Handle] {
            expect(
                "allreduce, no communicator",
                INVALID_ARGUMENT,
                &["comm"],
                || ncclAllReduce(send(), recv(), 4, FLOAT, SUM, bad, s),
            );
        }
        // Every failure above left the communicator as it was.
        assert!(crate::handles::live(c).is_ok());
        assert_eq!(ncclCommDestroy(c), SUCCESS);
        expect(
            "allreduce, destroyed",
            INVALID_ARGUMENT,
            &["destroyed"],
            || ncclAllReduce(send(), recv(), 4, FLOAT, SUM, c, s),
        );
    }
}
