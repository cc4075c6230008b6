//! The backend's default for `CUDA_DEVICE_MAX_CONNECTIONS` (`driver::default_hardware_queues`):
//! 32 when the variable is unset and no CUDA library is loaded yet, a user's own value kept. A
//! binary of its own, since it changes the process environment before the first backend call.

use mscclpp_cuda::driver::{
    default_hardware_queues, probe_libcuda, DEFAULT_HARDWARE_QUEUES, HARDWARE_QUEUES_VAR,
};

#[test]
fn the_first_backend_call_sets_32_queues_unless_set() {
    std::env::remove_var(HARDWARE_QUEUES_VAR);
    // The probe applies the default before it loads libcuda; where libcuda is missing (CI) it
    // fails with its clear error, which does not matter here.
    let _ = probe_libcuda();
    assert_eq!(
        std::env::var(HARDWARE_QUEUES_VAR).as_deref(),
        Ok(DEFAULT_HARDWARE_QUEUES)
    );
    // A value of the user's stays.
    std::env::set_var(HARDWARE_QUEUES_VAR, "8");
    assert!(!default_hardware_queues());
    assert_eq!(std::env::var(HARDWARE_QUEUES_VAR).as_deref(), Ok("8"));
}
