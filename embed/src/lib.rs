//! libmscclpp_embed: mscclpp-rs for stacks that are themselves the NCCL ABI (RCCL-style), to
//! link in beside their own symbols.
//!
//! Two C interfaces, one library:
//! - [`nccl_abi`]: every export of the NCCL shim (`nccl/exports.txt`) as `mscclpp_ncclX`
//!   (`nccl/include/mscclpp_nccl.h`), with no `ncclX` or `pncclX` symbol and no fallback library
//!   of its own: the host stack is the fallback ([`mscclpp_nccl::embedding`]).
//! - [`capi`]: `mscclpp.h`, our runtime's own shape below the NCCL ABI: a communicator from a
//!   unique id or over the host's bootstrap ([`host_bootstrap`]), registration, the algorithm
//!   collection by MSCCL++ name, execution plans, abort, asynchronous errors and versions.
//!
//! Both serve the same communicators: an `mscclppComm_t` is an `ncclComm_t` of the prefixed ABI
//! (one table of handles), so a stack may init through `mscclpp.h` and call
//! `mscclpp_ncclAllReduce` on the result.
//!
//! The crate builds a `staticlib`; `package.sh` makes the released `libmscclpp_embed.a` and
//! `libmscclpp_embed.so` from it, with every symbol but those of `exports.txt` local, so no Rust
//! symbol (and no symbol of the plain shim) reaches the host's link. `docs/embedding.md` is the
//! user's guide.
#![allow(non_snake_case, clippy::missing_safety_doc)]

pub mod capi;
pub mod host_bootstrap;
pub mod nccl_abi;
