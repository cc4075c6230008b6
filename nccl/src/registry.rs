//! The registrations a program makes in this process for the NCCL calls: execution plans, and a
//! selector asked before each collective. The `mscclpp` Python package makes them here when this
//! library is loaded in its process (preloaded under PyTorch), so that what a program registers
//! through `AlgorithmCollectionBuilder` (`add_algorithm_builder`, `set_algorithm_selector`) is
//! what its `torch.distributed` calls run: the DSL guide's flow of registering, then
//! `init_process_group("nccl")`. C programs can call the same exports.
//!
//! - Plans join each communicator created after they are registered, beside the plan
//!   directory's (`comm::add_execution_plans`), agreed by every rank first: setting a plan up is
//!   collective. A communicator created earlier keeps the plans it has.
//! - The selector is asked on every collective call of every communicator, from the calling
//!   thread. It answers with an algorithm's name (a plan's, or a native algorithm's) or with no
//!   answer, after which the communicator's own selector chooses. Every rank must answer alike
//!   for the same call, as with any selector.

use crate::abi::*;
use crate::guard::{ffi, text_arg, Failure};
use mscclpp::core::algorithm_collection::SelectionContext;
use mscclpp::core::gpu::Stream;
use mscclpp::core::Collective;
use mscclpp_executor::plan::Plan;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

/// What the selector is told about a call (`mscclppNcclSelectionRequest` in C).
#[repr(C)]
#[derive(Debug)]
pub struct SelectionRequest {
    /// The collective as MSCCL++ names it: "allreduce", "allgather", "reducescatter"...
    pub collective: *const c_char,
    /// Bytes of the call's input buffer on this rank.
    pub message_size: usize,
    /// The element type as the runtime names it: "bf16", "f32", "i32"...
    pub dtype: *const c_char,
    pub world_size: c_int,
    /// Ranks on this rank's host.
    pub nranks_per_node: c_int,
    pub rank: c_int,
    /// The call's `cudaStream_t`.
    pub stream: *mut c_void,
    /// Non-zero when the buffers are in place, in MSCCL++'s meaning (`SelectionContext::in_place`).
    pub in_place: c_int,
    /// Non-zero when the caller promised symmetric memory.
    pub symmetric_memory: c_int,
}

/// The selector: writes an algorithm's name (NUL-terminated, at most `capacity` bytes with the
/// NUL) to `name` and returns 1; returns 0 for no answer; returns a negative value when it
/// failed, which fails the call.
pub type SelectorFn = unsafe extern "C" fn(
    request: *const SelectionRequest,
    name: *mut c_char,
    capacity: usize,
    context: *mut c_void,
) -> c_int;

/// The longest algorithm name a selector can answer with.
pub const MAX_NAME_BYTES: usize = 256;

struct RegisteredSelector {
    call: SelectorFn,
    context: *mut c_void,
}

// SAFETY: the context is the registering program's; it promised that the selector may be called
// with it from any thread, several at once (the export's documentation).
unsafe impl Send for RegisteredSelector {}
unsafe impl Sync for RegisteredSelector {}

#[derive(Default)]
struct Registry {
    plans: Vec<Arc<Plan>>,
    selector: Option<Arc<RegisteredSelector>>,
}

static REGISTRY: Mutex<Registry> = Mutex::new(Registry {
    plans: Vec::new(),
    selector: None,
});

/// Whether a selector is set: read before taking the lock, so that calls of programs that never
/// register one (most) pay one load, not a lock, on every collective.
static SELECTOR_SET: AtomicBool = AtomicBool::new(false);

fn registry() -> MutexGuard<'static, Registry> {
    REGISTRY.lock().unwrap_or_else(|e| e.into_inner())
}

/// The plans registered so far, in registration order.
pub fn plans() -> Vec<Arc<Plan>> {
    registry().plans.clone()
}

/// Asks the registered selector about the call `ctx` on `rank`: the algorithm it names, `None`
/// without a selector or an answer. The registry's lock is not held while it runs, so a
/// selector may register or clear.
pub fn ask(ctx: &SelectionContext, rank: usize, stream: Stream) -> mscclpp::Result<Option<String>> {
    if !SELECTOR_SET.load(Ordering::Acquire) {
        return Ok(None);
    }
    let Some(selector) = registry().selector.clone() else {
        return Ok(None);
    };
    let (collective, dtype) = (c_text(ctx.collective.name()), c_text(ctx.dtype.name()));
    let request = SelectionRequest {
        collective: collective.as_ptr(),
        message_size: ctx.message_bytes,
        dtype: dtype.as_ptr(),
        world_size: ctx.world_size as c_int,
        nranks_per_node: ctx.local_world_size as c_int,
        rank: rank as c_int,
        stream: stream.0 as *mut c_void,
        in_place: c_int::from(ctx.in_place),
        symmetric_memory: c_int::from(ctx.symmetric_memory),
    };
    let mut name = [0 as c_char; MAX_NAME_BYTES];
    // SAFETY: the request and the name buffer outlive the call; the selector's contract is the
    // export's documentation.
    let answer = unsafe {
        (selector.call)(
            &request,
            name.as_mut_ptr(),
            MAX_NAME_BYTES,
            selector.context,
        )
    };
    let call = || format!("{} of {} bytes", ctx.collective, ctx.message_bytes);
    match answer {
        0 => Ok(None),
        1 => {
            name[MAX_NAME_BYTES - 1] = 0;
            // SAFETY: NUL-terminated within the buffer (the last byte is NUL).
            let text = unsafe { CStr::from_ptr(name.as_ptr()) }.to_string_lossy();
            if text.is_empty() {
                return Err(mscclpp::Error::InvalidArgument(format!(
                    "the registered selector answered an empty name for {}",
                    call()
                )));
            }
            Ok(Some(text.into_owned()))
        }
        code => Err(mscclpp::Error::InvalidArgument(format!(
            "the registered selector failed for {} (it returned {code})",
            call()
        ))),
    }
}

fn c_text(s: &str) -> CString {
    CString::new(s).unwrap_or_default()
}

/// Registers the execution plan `json` (MSCCL++'s JSON plan format) for communicators created
/// from now on. A plan of the same name replaces the one registered before. Malformed or invalid
/// plans are refused with `ncclInvalidArgument` and the reason in `ncclGetLastError`.
#[no_mangle]
pub unsafe extern "C" fn mscclppNcclRegisterPlan(json: *const c_char) -> NcclResult {
    ffi("mscclppNcclRegisterPlan", || {
        let text = unsafe { text_arg(json, "json") }?;
        let plan = Plan::from_json(text.as_bytes())
            .map_err(|e| Failure::invalid_argument(format!("the plan is refused: {e}")))?;
        let mut reg = registry();
        reg.plans.retain(|p| p.name != plan.name);
        reg.plans.push(Arc::new(plan));
        Ok(SUCCESS)
    })
}

/// Sets the selector asked before every collective call (see [`SelectorFn`]), with `context`
/// handed back to it; NULL clears it. The selector may be called with `context` from any thread
/// that makes NCCL calls, several at once, until it is replaced or cleared (and by a call that
/// asked it just before).
#[no_mangle]
pub unsafe extern "C" fn mscclppNcclSetSelector(
    selector: Option<SelectorFn>,
    context: *mut c_void,
) -> NcclResult {
    ffi("mscclppNcclSetSelector", || {
        let mut reg = registry();
        reg.selector = selector.map(|call| Arc::new(RegisteredSelector { call, context }));
        SELECTOR_SET.store(reg.selector.is_some(), Ordering::Release);
        Ok(SUCCESS)
    })
}

/// Forgets every registered plan and the selector (communicators keep the plans they have).
#[no_mangle]
pub unsafe extern "C" fn mscclppNcclClearRegistry() -> NcclResult {
    ffi("mscclppNcclClearRegistry", || {
        let mut reg = registry();
        *reg = Registry::default();
        SELECTOR_SET.store(false, Ordering::Release);
        Ok(SUCCESS)
    })
}

/// What is registered, as text ("plans: a, b; selector: set"), for a program to check what
/// reached this library: copied NUL-terminated into `text` (at most `capacity` bytes, cut
/// there), its full length (without the NUL) written to `length` where that is not NULL.
#[no_mangle]
pub unsafe extern "C" fn mscclppNcclDescribeRegistry(
    text: *mut c_char,
    capacity: usize,
    length: *mut usize,
) -> NcclResult {
    ffi("mscclppNcclDescribeRegistry", || {
        let description = {
            let reg = registry();
            let names: Vec<&str> = reg.plans.iter().map(|p| p.name.as_str()).collect();
            format!(
                "plans: {}; selector: {}",
                if names.is_empty() {
                    "none".to_string()
                } else {
                    names.join(", ")
                },
                if reg.selector.is_some() {
                    "set"
                } else {
                    "none"
                }
            )
        };
        if !length.is_null() {
            // SAFETY: non-null, and the caller promises it is writable.
            unsafe { length.write(description.len()) };
        }
        if !text.is_null() && capacity > 0 {
            let n = description.len().min(capacity - 1);
            // SAFETY: the caller promises `capacity` writable bytes at `text`.
            unsafe {
                std::ptr::copy_nonoverlapping(description.as_ptr().cast(), text, n);
                text.add(n).write(0);
            }
        }
        Ok(SUCCESS)
    })
}

/// Asks the registered selector about `request` as a communicator does before a call, writing its
/// answer to `name` (`capacity` bytes): 1 and the name, 0 for no answer (`name` is then ""), or
/// the selector's failure as `ncclInvalidArgument`. For testing a selector outside a job.
#[no_mangle]
pub unsafe extern "C" fn mscclppNcclAskSelector(
    request: *const SelectionRequest,
    name: *mut c_char,
    capacity: usize,
    answered: *mut c_int,
) -> NcclResult {
    ffi("mscclppNcclAskSelector", || {
        if request.is_null() || name.is_null() || capacity == 0 {
            return Err(Failure::invalid_argument(
                "request and name must be non-NULL, capacity non-zero",
            ));
        }
        // SAFETY: non-null; the caller promises a valid request.
        let r = unsafe { &*request };
        let collective = unsafe { text_arg(r.collective, "request.collective") }?;
        let dtype = unsafe { text_arg(r.dtype, "request.dtype") }?;
        let ctx = SelectionContext {
            collective: Collective::from_name(collective).ok_or_else(|| {
                Failure::invalid_argument(format!(
                    "request.collective: no collective {collective:?}"
                ))
            })?,
            message_bytes: r.message_size,
            dtype: dtype
                .parse()
                .map_err(|e| Failure::invalid_argument(format!("request.dtype: {e}")))?,
            world_size: r.world_size.max(0) as usize,
            local_world_size: r.nranks_per_node.max(0) as usize,
            symmetric_memory: r.symmetric_memory != 0,
            capturing: false,
            arch: String::new(),
            nvls_allowed: false,
            in_place: r.in_place != 0,
            op: None,
        };
        let answer = ask(&ctx, r.rank.max(0) as usize, Stream(r.stream as u64))?;
        let text = answer.as_deref().unwrap_or("");
        let n = text.len().min(capacity - 1);
        // SAFETY: the caller promises `capacity` writable bytes at `name`.
        unsafe {
            std::ptr::copy_nonoverlapping(text.as_ptr().cast(), name, n);
            name.add(n).write(0);
        }
        unsafe { crate::guard::write_out(answered, "answered", c_int::from(answer.is_some())) }?;
        Ok(SUCCESS)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The registry is process-wide: the tests that change it run one at a time.
    static SERIAL: Mutex<()> = Mutex::new(());

    fn describe() -> String {
        let mut buf = [0 as c_char; 512];
        let mut len = 0usize;
        assert_eq!(
            unsafe { mscclppNcclDescribeRegistry(buf.as_mut_ptr(), buf.len(), &mut len) },
            SUCCESS
        );
        let text = unsafe { CStr::from_ptr(buf.as_ptr()) }
            .to_string_lossy()
            .into_owned();
        assert_eq!(text.len(), len);
        text
    }

    fn plan_json(name: &str) -> CString {
        let mut plan = mscclpp_executor::builder::allreduce(
            2,
            mscclpp_executor::plan::Protocol::Simple,
            mscclpp_executor::plan::PlanReduceOp::Sum,
        );
        plan["name"] = serde_json::json!(name);
        CString::new(plan.to_string()).unwrap()
    }

    #[test]
    fn plans_are_validated_named_and_replaced_by_name() {
        let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        unsafe { mscclppNcclClearRegistry() };
        assert_eq!(describe(), "plans: none; selector: none");
        let bad = CString::new("{\"name\": 3").unwrap();
        assert_eq!(
            unsafe { mscclppNcclRegisterPlan(bad.as_ptr()) },
            INVALID_ARGUMENT
        );
        let last = unsafe { CStr::from_ptr(crate::guard::last_error_ptr()) };
        assert!(
            last.to_string_lossy().contains("the plan is refused"),
            "{last:?}"
        );
        assert_eq!(
            unsafe { mscclppNcclRegisterPlan(std::ptr::null()) },
            INVALID_ARGUMENT
        );
        for name in ["mine", "mine", "other"] {
            assert_eq!(
                unsafe { mscclppNcclRegisterPlan(plan_json(name).as_ptr()) },
                SUCCESS
            );
        }
        let names: Vec<String> = plans().iter().map(|p| p.name.clone()).collect();
        assert_eq!(names, ["mine", "other"]);
        assert_eq!(describe(), "plans: mine, other; selector: none");
        unsafe { mscclppNcclClearRegistry() };
        assert!(plans().is_empty());
    }

    /// Answers with the request's fields, so the test sees what the selector was told.
    unsafe extern "C" fn echo(
        request: *const SelectionRequest,
        name: *mut c_char,
        capacity: usize,
        context: *mut c_void,
    ) -> c_int {
        let r = unsafe { &*request };
        let text = format!(
            "{}:{}:{}:{}/{}@{}:{}:{}:{}",
            unsafe { CStr::from_ptr(r.collective) }.to_string_lossy(),
            r.message_size,
            unsafe { CStr::from_ptr(r.dtype) }.to_string_lossy(),
            r.rank,
            r.world_size,
            r.nranks_per_node,
            r.stream as usize,
            r.in_place,
            context as usize
        );
        match r.message_size {
            0 => 0,
            1 => -3,
            _ => {
                let c = CString::new(text).unwrap();
                let n = c.as_bytes_with_nul().len().min(capacity);
                unsafe { std::ptr::copy_nonoverlapping(c.as_ptr(), name, n) };
                1
            }
        }
    }

    /// Asks the registered selector about a 4-rank bf16 all-reduce of `bytes` in place on rank 1
    /// (2 ranks a host, stream 7) through the C door, as a communicator would: (code, answered,
    /// name).
    fn ask_about(bytes: usize) -> (NcclResult, c_int, String) {
        let (collective, dtype) = (c_text("allreduce"), c_text("bf16"));
        let request = SelectionRequest {
            collective: collective.as_ptr(),
            message_size: bytes,
            dtype: dtype.as_ptr(),
            world_size: 4,
            nranks_per_node: 2,
            rank: 1,
            stream: 7 as *mut c_void,
            in_place: 1,
            symmetric_memory: 0,
        };
        let (mut name, mut answered) = ([0 as c_char; 64], 0);
        let code =
            unsafe { mscclppNcclAskSelector(&request, name.as_mut_ptr(), 64, &mut answered) };
        let text = unsafe { CStr::from_ptr(name.as_ptr()) }.to_string_lossy();
        (code, answered, text.into_owned())
    }

    #[test]
    fn the_selector_is_told_the_call_and_its_answer_or_failure_is_kept() {
        let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        unsafe { mscclppNcclClearRegistry() };
        assert_eq!(ask_about(4096), (SUCCESS, 0, String::new()));
        assert_eq!(
            unsafe { mscclppNcclSetSelector(Some(echo), 42 as *mut c_void) },
            SUCCESS
        );
        assert_eq!(describe(), "plans: none; selector: set");
        let told = "allreduce:4096:bf16:1/4@2:7:1:42".to_string();
        assert_eq!(ask_about(4096), (SUCCESS, 1, told));
        assert_eq!(ask_about(0), (SUCCESS, 0, String::new()));
        assert_eq!(ask_about(1).0, INVALID_ARGUMENT);
        let last = unsafe { CStr::from_ptr(crate::guard::last_error_ptr()) }.to_string_lossy();
        assert!(
            last.contains("the registered selector failed for allreduce of 1 bytes"),
            "{last}"
        );
        assert_eq!(
            unsafe { mscclppNcclSetSelector(None, std::ptr::null_mut()) },
            SUCCESS
        );
        assert_eq!(ask_about(4096), (SUCCESS, 0, String::new()));
    }
}
