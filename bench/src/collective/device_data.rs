//! The checks' inputs and comparisons on the GPU (kernels-cu's `bench_data` unit), for `--check
//! device` (the default) and `--check both`.
//!
//! The kernel draws a rank's input with data.rs's generator and compares an output with
//! check.rs's rules, so a check of a 1 GiB output moves two counters across PCIe instead of the
//! output, and the host draws nothing: drawing and comparing on the host were most of the main
//! job's time (docs/support.md has the numbers). When the kernel counts a wrong element, the
//! output is copied back and the host check counts and describes it, so every reported mismatch
//! reads as before.
//!
//! The host does what the kernel does not: fp8 (its encoder is the host's), float products
//! (their inputs are drawn through exp2, which the device rounds differently), the skewed
//! all-to-all-v (its parts are found by a search), more than [`MAX_RANKS`] ranks, and everything
//! where the unit does not load, which the header says.
//!
//! `--check both` is the check of the checks: inputs drawn on the device, one output element
//! overwritten with the poison after the call, then both checks; they must agree on the count and
//! both must see the planted element, else the row counts the disagreement as wrong.

use super::check::{sendrecv_peers, CheckResult};
use super::data::{poison_byte, smallest_subnormal, unit_roundoff, Draw, InputSpec};
use super::shape::Shape;
use mscclpp_collectives::resources::DeviceBuffer;
use mscclpp_core::gpu::{DevicePtr, Function, Gpu, LaunchConfig, Stream};
use mscclpp_core::{Collective, ReduceOp, Result};
use mscclpp_kernels_cu::bench_data::{
    dtype_code, BenchDataArgs, DRAW_FLOAT, DRAW_INT, ENTRY, MAX_RANKS, MODE_CHECK_BLOCKS,
    MODE_CHECK_COPY, MODE_CHECK_REDUCE, MODE_FILL, SOURCE, UNIT_NAME,
};
use std::ffi::c_void;
use std::sync::Arc;

/// Threads per block of `bench_data`.
const THREADS: u32 = 256;
/// Most blocks of one launch (the kernel strides over the rest).
const MAX_BLOCKS: u32 = 4096;

/// How one rank's output is checked (made once a check, so its size does not matter).
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum CheckPlan {
    /// Not at all: reduce and gather write the root's output only.
    Unchecked,
    /// On the host (see the module docs for what).
    Host,
    /// By `bench_data` with these arguments (output pointer and counters left to fill).
    Device(BenchDataArgs),
}

/// What a device check of one output found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceCount {
    pub wrong: u64,
    /// The lowest wrong index (`u64::MAX` when none is).
    pub first: u64,
}

/// The loaded unit and the two counters its checks write.
pub struct DeviceData {
    gpu: Arc<dyn Gpu>,
    function: Function,
    counters: DeviceBuffer,
}

impl DeviceData {
    /// Loads the unit (from the ahead-of-time blob, the kernel cache, or NVRTC).
    pub fn load(gpu: &Arc<dyn Gpu>) -> Result<DeviceData> {
        let module = gpu.build_module(UNIT_NAME, SOURCE)?;
        Ok(DeviceData {
            gpu: gpu.clone(),
            function: gpu.get_function(module, ENTRY)?,
            counters: DeviceBuffer::zeroed(gpu, 16)?,
        })
    }

    /// The arguments every launch for `spec` shares, or `None` where the host must draw.
    fn base_args(spec: &InputSpec) -> Option<BenchDataArgs> {
        let dtype = dtype_code(spec.dtype)?;
        if spec.nranks > MAX_RANKS {
            return None;
        }
        let mut keys = [0u64; MAX_RANKS];
        for (r, k) in keys.iter_mut().enumerate().take(spec.nranks) {
            *k = spec.rank(r).key();
        }
        let (draw, scale, lo, span) = match spec.draw() {
            Draw::Float { scale } => (DRAW_FLOAT, scale, 0, 1),
            Draw::Int { lo, span } => (DRAW_INT, 0.0, lo, span),
            Draw::Product { .. } => return None,
        };
        Some(BenchDataArgs {
            data: 0,
            count: 0,
            wrong: 0,
            first: 0,
            keys,
            scale,
            u: unit_roundoff(spec.dtype),
            s: smallest_subnormal(spec.dtype),
            lo,
            span,
            block: 1,
            base: 0,
            dtype,
            draw,
            mode: MODE_FILL,
            op: 0,
            nranks: spec.nranks as u32,
            rank: 0,
        })
    }

    fn launch(&self, mut args: BenchDataArgs, stream: Stream) -> Result<()> {
        if args.count == 0 {
            return Ok(());
        }
        let blocks = args
            .count
            .div_ceil(u64::from(THREADS))
            .min(u64::from(MAX_BLOCKS)) as u32;
        let mut params = [&mut args as *mut BenchDataArgs as *mut c_void];
        // SAFETY: `bench_data` takes one BenchDataArgs (layout-checked by the unit's NVRTC test);
        // `data` spans `count` elements of the caller's buffer and the counters are ours.
        unsafe {
            self.gpu.launch(
                self.function,
                LaunchConfig::linear(blocks, THREADS),
                stream,
                &mut params,
            )
        }
    }

    /// Writes `rank`'s first `count` input elements at `ptr` on `stream`; `false` (nothing
    /// written) where the host must draw them.
    pub fn fill(
        &self,
        spec: &InputSpec,
        rank: usize,
        ptr: DevicePtr,
        count: usize,
        stream: Stream,
    ) -> Result<bool> {
        let Some(mut args) = Self::base_args(spec).filter(|_| rank < spec.nranks) else {
            return Ok(false);
        };
        args.data = ptr;
        args.count = count as u64;
        args.rank = rank as u32;
        self.launch(args, stream)?;
        Ok(true)
    }

    /// How `rank`'s output of the call `shape` describes is checked: the same mapping as
    /// check.rs's `check_range`.
    pub fn plan(
        shape: &Shape,
        spec: &InputSpec,
        op: ReduceOp,
        (rank, root): (usize, usize),
    ) -> CheckPlan {
        if matches!(shape.collective, Collective::Reduce | Collective::Gather) && rank != root {
            return CheckPlan::Unchecked;
        }
        let Some(mut args) = Self::base_args(spec) else {
            return CheckPlan::Host;
        };
        let n = spec.nranks;
        let c = shape.per_rank_count.max(1) as u64;
        let reduces = matches!(
            shape.collective,
            Collective::AllReduce | Collective::ReduceScatter | Collective::Reduce
        );
        // (mode, source rank, block, base)
        let (mode, source, block, base) = match shape.collective {
            _ if reduces && n > 1 => {
                let base = if shape.collective == Collective::ReduceScatter {
                    rank as u64 * c
                } else {
                    0
                };
                (MODE_CHECK_REDUCE, 0, 1, base)
            }
            Collective::AllGather | Collective::Gather => (MODE_CHECK_BLOCKS, 0, c, 0),
            Collective::AllToAll if shape.skewed => return CheckPlan::Host,
            Collective::AllToAll => (MODE_CHECK_BLOCKS, 0, c, rank as u64 * c),
            Collective::Scatter => (MODE_CHECK_COPY, root, 1, rank as u64 * c),
            Collective::SendRecv => (MODE_CHECK_COPY, sendrecv_peers(rank, n).1, 1, 0),
            _ => (MODE_CHECK_COPY, root, 1, 0),
        };
        if source >= n {
            return CheckPlan::Host;
        }
        args.count = (shape.output_bytes / spec.dtype.size()) as u64;
        args.mode = mode;
        args.rank = source as u32;
        args.block = block;
        args.base = base;
        args.op = op.to_nccl() as u32;
        CheckPlan::Device(args)
    }

    /// Runs the check `args` ([`plan`](Self::plan)) of the output at `output` on `stream`;
    /// `sync` waits for the stream.
    pub fn count_wrong(
        &self,
        mut args: BenchDataArgs,
        output: DevicePtr,
        stream: Stream,
        sync: &dyn Fn() -> Result<()>,
    ) -> Result<DeviceCount> {
        let counters = self.counters.ptr();
        let reset = [0u64.to_le_bytes(), u64::MAX.to_le_bytes()].concat();
        self.gpu.copy_to_device(counters, &reset)?;
        args.data = output;
        args.wrong = counters;
        args.first = counters + 8;
        self.launch(args, stream)?;
        sync()?;
        let mut got = [0u8; 16];
        self.gpu.copy_from_device(&mut got, counters)?;
        let word = |b: &[u8]| u64::from_le_bytes(b.try_into().expect("8 bytes"));
        Ok(DeviceCount {
            wrong: word(&got[..8]),
            first: word(&got[8..]),
        })
    }

    /// `--check both`: overwrites element `index` of `output` with the poison of `spec`'s type
    /// (a value no correct output holds) on `stream`.
    pub fn plant_wrong(
        &self,
        spec: &InputSpec,
        output: DevicePtr,
        index: usize,
        stream: Stream,
    ) -> Result<()> {
        let size = spec.dtype.size();
        self.gpu.memset_async(
            output + (index * size) as u64,
            poison_byte(spec.dtype),
            size,
            stream,
        )
    }
}

/// The verdict of `--check both` on one output: the device's count and the host's must agree,
/// and both must have seen the element planted at `planted`; the count reported leaves it out.
pub fn cross_check(device: DeviceCount, host: CheckResult, planted: usize) -> CheckResult {
    let seen = device.wrong >= 1 && device.first <= planted as u64;
    if device.wrong as usize == host.wrong && seen && host.wrong >= 1 {
        return CheckResult {
            wrong: host.wrong - 1,
            first: if host.wrong > 1 { host.first } else { None },
        };
    }
    CheckResult {
        wrong: host.wrong.max(1),
        first: Some(format!(
            "the checks disagree: the device counted {} wrong (lowest index {}), the host {} \
             ({}), with element {planted} overwritten by the poison",
            device.wrong,
            device.first,
            host.wrong,
            host.first.as_deref().unwrap_or("none described")
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_checks_must_agree_and_see_the_planted_element() {
        let host = |wrong, first: Option<&str>| CheckResult {
            wrong,
            first: first.map(str::to_string),
        };
        let dev = |wrong, first| DeviceCount { wrong, first };
        // Only the planted element is wrong: a clean row.
        assert_eq!(
            cross_check(dev(1, 7), host(1, Some("element 7")), 7),
            host(0, None)
        );
        // Another wrong element besides it: counted, described by the host.
        assert_eq!(
            cross_check(dev(2, 3), host(2, Some("element 3")), 7),
            host(1, Some("element 3"))
        );
        // The device missed it, or the counts differ, or neither saw anything: wrong.
        for (d, h) in [
            (dev(0, u64::MAX), host(1, Some("element 7"))),
            (dev(1, 7), host(2, Some("element 3"))),
            (dev(0, u64::MAX), host(0, None)),
        ] {
            let out = cross_check(d, h, 7);
            assert!(out.wrong >= 1, "{out:?}");
            assert!(out.first.unwrap().contains("the checks disagree"));
        }
    }
}
