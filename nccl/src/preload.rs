//! What loading the shim does: it gives the process CUDA's most hardware queues
//! ([`mscclpp::default_hardware_queues`]) unless the user set `CUDA_DEVICE_MAX_CONNECTIONS`.
//!
//! The shim's first export call comes after the program's own CUDA work (PyTorch makes its
//! context before it creates a communicator), too late for a variable CUDA reads when it makes
//! a context. Under `LD_PRELOAD` the loader runs this initialiser before the program's `main`,
//! while the process is still single-threaded and has loaded no CUDA library.

/// Runs when the loader maps the shim, before `main` under `LD_PRELOAD`.
extern "C" fn on_load() {
    // Nothing may unwind into the loader; a failure here only leaves CUDA's default in place.
    let _ = std::panic::catch_unwind(|| {
        mscclpp::default_hardware_queues();
    });
}

#[used]
#[link_section = ".init_array"]
static ON_LOAD: extern "C" fn() = on_load;
