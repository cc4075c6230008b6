//! On-disk cache of compiled kernels, so a rank compiles each (source, options, arch, compiler)
//! combination once per machine instead of on every start: the run-time compiles of both backends
//! (NVRTC's CUBINs and PTX, hiprtc's code objects), whatever their build does not embed.
//!
//! # Key
//! SHA-256 over, each length-prefixed so no two inputs can collide by concatenation: a format tag,
//! the source, every (include name, text) header pair, the compiler's full option list (ours and
//! the caller's, include folders included), the target architecture and the compiler's version
//! ([`request_key`]).
//!
//! # Entry file (`<name>-<arch>-<key>.kbin` under the cache folder)
//! ```text
//! magic "MSCLKRN1" (8) | key (32) | image_len u64 LE | log_len u64 LE | sha256(image ++ log) (32)
//! | image | log
//! ```
//! An entry whose magic, key, lengths or checksum do not match is never trusted: it is logged,
//! recompiled and replaced. Writes go to a unique temp file in the same folder and are renamed into
//! place, so readers never see a partial file.
//!
//! # One compile per machine
//! Ranks that start together (torchrun puts eight on a host) ask for the same kernels at once. A
//! process about to compile an entry first takes an exclusive `flock` on `<entry>.lock` and looks
//! for the entry again once it holds it: the others wait for the first compile and load its entry,
//! instead of each spending the same CPU (a cold start of eight ranks compiled every unit eight
//! times over). The kernel drops the lock of a process that dies; a lock that cannot be taken (a
//! read-only folder, a file system without `flock`) or is held past `COMPILE_WAIT` (a stopped
//! process) is passed by: the caller compiles itself, as without the lock.

use crate::error::IoContext;
use crate::kernel_image::{request_key, CompileRequest, CompiledKernel};
use crate::{Error, Result};
use sha2::{Digest, Sha256};
use std::io::Write;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

const MAGIC: &[u8; 8] = b"MSCLKRN1";
const HEADER_LEN: usize = 8 + 32 + 8 + 8 + 32;
/// Bumped when anything about how we compile changes in a way the key does not capture.
const KEY_FORMAT: &str = "mscclpp-rs kernel cache v1";
/// Longest wait for another process's compile of the same entry: the slowest unit (the plan
/// interpreter) takes about a minute on a loaded host.
const COMPILE_WAIT: Duration = Duration::from_secs(120);

/// A run-time compiler whose output the cache keeps (NVRTC, hiprtc).
pub trait KernelCompiler {
    /// Every option a compile of `req` passes, ours and the caller's (the key names them).
    fn options_for(&self, req: &CompileRequest) -> Vec<String>;
    /// (major, minor): another version makes other entries.
    fn version(&self) -> (i32, i32);
    fn compile(&self, req: &CompileRequest) -> Result<CompiledKernel>;
}

/// How a [`KernelCache::get_or_compile`] call got its image.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheOutcome {
    /// No entry existed: compiled and stored.
    Compiled,
    /// A valid entry was loaded from disk.
    Hit,
    /// An entry existed but was corrupt or truncated: recompiled and replaced.
    Rebuilt,
}

/// A kernel image from the cache, with how it was obtained and how long that took.
#[derive(Debug, Clone)]
pub struct CachedKernel {
    pub kernel: CompiledKernel,
    pub outcome: CacheOutcome,
    /// Wall time of this call (compile + store, or read + verify).
    pub elapsed: Duration,
    /// Hex SHA-256 key of the entry.
    pub key: String,
}

/// Totals since the cache was created, for reporting first-use compile time against cached loads.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    pub compiles: u64,
    pub hits: u64,
    /// Entries found corrupt and rebuilt (also counted in `compiles`).
    pub rebuilt: u64,
    pub compile_time: Duration,
    pub load_time: Duration,
}

/// Compile-or-load cache of one compiler's output under one folder (normally `Env.cache_dir`).
#[derive(Debug)]
pub struct KernelCache<C> {
    dir: PathBuf,
    compiler: C,
    stats: Mutex<CacheStats>,
}

impl<C: KernelCompiler> KernelCache<C> {
    /// A cache in `dir` (created if missing) that compiles with `compiler`.
    pub fn new(dir: impl Into<PathBuf>, compiler: C) -> Result<KernelCache<C>> {
        let dir = dir.into();
        std::fs::create_dir_all(&dir)
            .io_context(|| format!("creating kernel cache folder {}", dir.display()))?;
        Ok(KernelCache {
            dir,
            compiler,
            stats: Mutex::new(CacheStats::default()),
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn compiler(&self) -> &C {
        &self.compiler
    }

    pub fn stats(&self) -> CacheStats {
        match self.stats.lock() {
            Ok(s) => *s,
            Err(poisoned) => *poisoned.into_inner(),
        }
    }

    /// The 32-byte key of `req` (see the module docs).
    pub fn key(&self, req: &CompileRequest) -> [u8; 32] {
        request_key(
            KEY_FORMAT,
            req,
            &self.compiler.options_for(req),
            Some(self.compiler.version()),
        )
    }

    /// Where `req`'s entry lives.
    pub fn entry_path(&self, req: &CompileRequest) -> PathBuf {
        self.path_for(req, &hex::encode(self.key(req)))
    }

    fn path_for(&self, req: &CompileRequest, key_hex: &str) -> PathBuf {
        let safe: String = req
            .name
            .chars()
            .take(48)
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '_' || c == '-' {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        self.dir.join(format!("{safe}-{}-{key_hex}.kbin", req.arch))
    }

    /// Returns the compiled image of `req`, from disk when a valid entry exists, else by compiling
    /// and storing it (after any other process compiling it: module docs). A failure to store is
    /// logged, not returned: the image is still good.
    pub fn get_or_compile(&self, req: &CompileRequest) -> Result<CachedKernel> {
        let start = Instant::now();
        let key = self.key(req);
        let key_hex = hex::encode(key);
        let path = self.path_for(req, &key_hex);
        let hit = |kernel: CompiledKernel| {
            let elapsed = start.elapsed();
            self.record(|s| {
                s.hits += 1;
                s.load_time += elapsed;
            });
            tracing::debug!("kernel {} loaded from cache in {elapsed:?}", req.name);
            CachedKernel {
                kernel,
                outcome: CacheOutcome::Hit,
                elapsed,
                key: key_hex.clone(),
            }
        };
        let mut outcome = match load_entry(&path, &key, req.name) {
            Ok(kernel) => return Ok(hit(kernel)),
            Err(outcome) => outcome,
        };
        // Held until the entry is stored (the end of this call).
        let lock = CompileLock::acquire(&path, COMPILE_WAIT);
        if lock.is_some() {
            match load_entry(&path, &key, req.name) {
                Ok(kernel) => return Ok(hit(kernel)),
                Err(again) => outcome = again,
            }
        }

        let kernel = self.compiler.compile(req)?;
        if let Err(e) = write_atomically(&path, &encode_entry(&key, &kernel)) {
            tracing::warn!("could not store kernel {} in the cache: {e}", req.name);
        }
        let elapsed = start.elapsed();
        self.record(|s| {
            s.compiles += 1;
            s.compile_time += elapsed;
            if outcome == CacheOutcome::Rebuilt {
                s.rebuilt += 1;
            }
        });
        tracing::debug!(
            "kernel {} compiled for {} in {elapsed:?}",
            req.name,
            req.arch
        );
        Ok(CachedKernel {
            kernel,
            outcome,
            elapsed,
            key: key_hex,
        })
    }

    fn record(&self, f: impl FnOnce(&mut CacheStats)) {
        match self.stats.lock() {
            Ok(mut s) => f(&mut s),
            Err(poisoned) => f(&mut poisoned.into_inner()),
        }
    }
}

/// The valid entry at `path`, or what compiling it will be: `Compiled` where there is none,
/// `Rebuilt` where it is unreadable or corrupt (logged).
fn load_entry(
    path: &Path,
    key: &[u8; 32],
    name: &str,
) -> std::result::Result<CompiledKernel, CacheOutcome> {
    match std::fs::read(path) {
        Ok(bytes) => decode_entry(&bytes, key).map_err(|why| {
            tracing::warn!(
                "kernel cache entry {} is unusable ({why}); recompiling {name}",
                path.display()
            );
            CacheOutcome::Rebuilt
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(CacheOutcome::Compiled),
        Err(e) => {
            tracing::warn!(
                "cannot read kernel cache entry {}: {e}; recompiling",
                path.display()
            );
            Err(CacheOutcome::Rebuilt)
        }
    }
}

/// An exclusive `flock` on `<entry>.lock`, held while this process compiles the entry (module
/// docs); released when dropped, or by the kernel when the process dies.
struct CompileLock {
    _file: std::fs::File,
}

impl CompileLock {
    /// Waits up to `wait` for the lock of `entry`; `None` (logged) where the lock file cannot be
    /// made or locked, or another process holds it longer.
    fn acquire(entry: &Path, wait: Duration) -> Option<CompileLock> {
        let path = entry.with_extension("lock");
        let file = match std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
        {
            Ok(f) => f,
            Err(e) => {
                tracing::debug!("kernel cache: no lock {} ({e}); compiling", path.display());
                return None;
            }
        };
        let deadline = Instant::now() + wait;
        loop {
            // SAFETY: `file` owns the descriptor for the whole call.
            if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
                return Some(CompileLock { _file: file });
            }
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::WouldBlock {
                tracing::debug!(
                    "kernel cache: cannot lock {} ({e}); compiling",
                    path.display()
                );
                return None;
            }
            if Instant::now() >= deadline {
                tracing::warn!(
                    "kernel cache: {} still locked by another process after {wait:?}; compiling here too",
                    path.display()
                );
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

fn checksum(image: &[u8], log: &[u8]) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(image);
    h.update(log);
    h.finalize().into()
}

fn encode_entry(key: &[u8; 32], k: &CompiledKernel) -> Vec<u8> {
    let log = k.log.as_bytes();
    let mut out = Vec::with_capacity(HEADER_LEN + k.image.len() + log.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(key);
    out.extend_from_slice(&(k.image.len() as u64).to_le_bytes());
    out.extend_from_slice(&(log.len() as u64).to_le_bytes());
    out.extend_from_slice(&checksum(&k.image, log));
    out.extend_from_slice(&k.image);
    out.extend_from_slice(log);
    out
}

/// Parses and verifies an entry; the error says what was wrong (for the log).
fn decode_entry(bytes: &[u8], key: &[u8; 32]) -> std::result::Result<CompiledKernel, String> {
    if bytes.len() < HEADER_LEN {
        return Err(format!("truncated header ({} bytes)", bytes.len()));
    }
    let (header, body) = bytes.split_at(HEADER_LEN);
    if &header[0..8] != MAGIC {
        return Err("bad magic".into());
    }
    if &header[8..40] != key {
        return Err("key mismatch".into());
    }
    let u64_at = |off: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&header[off..off + 8]);
        u64::from_le_bytes(b)
    };
    let (image_len, log_len) = (u64_at(40), u64_at(48));
    let expected = image_len.checked_add(log_len);
    if expected != Some(body.len() as u64) {
        return Err(format!(
            "length mismatch: header says {image_len}+{log_len} bytes, file has {}",
            body.len()
        ));
    }
    // Fits: equals body.len().
    let (image, log) = body.split_at(image_len as usize);
    if checksum(image, log)[..] != header[56..88] {
        return Err("checksum mismatch".into());
    }
    if image.is_empty() {
        return Err("empty image".into());
    }
    Ok(CompiledKernel {
        image: image.to_vec(),
        log: String::from_utf8_lossy(log).into_owned(),
    })
}

/// Writes `data` to a temp file beside `path` and renames it over `path`.
fn write_atomically(path: &Path, data: &[u8]) -> Result<()> {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let dir = path
        .parent()
        .ok_or_else(|| Error::Internal(format!("cache path {} has no folder", path.display())))?;
    let file_name = path.file_name().and_then(|n| n.to_str()).ok_or_else(|| {
        Error::Internal(format!("cache path {} has no file name", path.display()))
    })?;
    let tmp = dir.join(format!(
        ".{file_name}.{}.{}.tmp",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    let result = (|| -> Result<()> {
        let mut f =
            std::fs::File::create(&tmp).io_context(|| format!("creating {}", tmp.display()))?;
        f.write_all(data)
            .io_context(|| format!("writing {}", tmp.display()))?;
        f.sync_data()
            .io_context(|| format!("flushing {}", tmp.display()))?;
        std::fs::rename(&tmp, path)
            .io_context(|| format!("renaming {} to {}", tmp.display(), path.display()))
    })();
    if result.is_err() {
        // Leave no temp files behind; the original error is what matters.
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;
    use rstest::rstest;

    fn sample() -> CompiledKernel {
        CompiledKernel {
            image: b"\x7fELF fake image".to_vec(),
            log: "warning: x".into(),
        }
    }

    #[test]
    fn entry_round_trips() {
        let key = [7u8; 32];
        let enc = encode_entry(&key, &sample());
        assert_eq!(decode_entry(&enc, &key), Ok(sample()));
    }

    #[rstest]
    #[case::truncated_header(|e: &mut Vec<u8>| e.truncate(10), "truncated")]
    #[case::truncated_body(|e: &mut Vec<u8>| { e.pop(); }, "length mismatch")]
    #[case::flipped_image_byte(|e: &mut Vec<u8>| e[HEADER_LEN] ^= 1, "checksum")]
    #[case::bad_magic(|e: &mut Vec<u8>| e[0] = b'X', "magic")]
    #[case::other_key(|e: &mut Vec<u8>| e[8] ^= 1, "key")]
    #[case::huge_length(|e: &mut Vec<u8>| e[40..48].copy_from_slice(&u64::MAX.to_le_bytes()), "length")]
    fn corrupt_entries_are_rejected(#[case] damage: fn(&mut Vec<u8>), #[case] why: &str) {
        let key = [7u8; 32];
        let mut enc = encode_entry(&key, &sample());
        damage(&mut enc);
        let err = decode_entry(&enc, &key).unwrap_err();
        assert!(err.contains(why), "{err}");
    }

    #[test]
    fn a_compile_lock_waits_for_its_holder_and_gives_up_at_the_deadline() {
        let dir = std::env::temp_dir().join(format!("mscclpp-cache-lock-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let entry = dir.join("k-sm_90-00.kbin");
        let held = CompileLock::acquire(&entry, Duration::ZERO).expect("a free lock");
        // Another open file description conflicts, as another process would.
        let t = Instant::now();
        assert!(CompileLock::acquire(&entry, Duration::from_millis(50)).is_none());
        assert!(t.elapsed() >= Duration::from_millis(50));
        let waiter = std::thread::spawn(move || {
            let t = Instant::now();
            let got = CompileLock::acquire(&entry, Duration::from_secs(10));
            (got.is_some(), t.elapsed())
        });
        std::thread::sleep(Duration::from_millis(200));
        drop(held);
        let (got, waited) = waiter.join().unwrap();
        assert!(got, "the lock was not passed on");
        assert!(waited >= Duration::from_millis(150), "{waited:?}");
        assert!(waited < Duration::from_secs(5), "{waited:?}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Set in the child process of `a_compile_lock_outlives_no_killed_or_stopped_holder`: the
    /// entry whose lock the child takes and holds.
    const HOLDER_ENV: &str = "MSCCLPP_TEST_COMPILE_LOCK_HOLDER";

    /// The child's part (does nothing without [`HOLDER_ENV`]): takes the lock, says so, and holds
    /// it until it is killed.
    #[test]
    fn compile_lock_holder() {
        let Some(entry) = std::env::var_os(HOLDER_ENV) else {
            return;
        };
        let _held = CompileLock::acquire(Path::new(&entry), Duration::ZERO).expect("a free lock");
        println!("lock held");
        std::thread::sleep(Duration::from_secs(300));
    }

    /// A real process holding the lock of `entry` (this test binary again, running
    /// `compile_lock_holder`); killed on drop.
    struct Holder(std::process::Child);

    impl Holder {
        fn start(entry: &Path) -> Holder {
            use std::io::BufRead;
            let exe = std::env::current_exe().expect("the test binary");
            let mut child = std::process::Command::new(exe)
                .args([
                    "kernel_cache::tests::compile_lock_holder",
                    "--exact",
                    "--nocapture",
                ])
                .env(HOLDER_ENV, entry)
                .stdout(std::process::Stdio::piped())
                .spawn()
                .expect("starting the holder");
            let out = std::io::BufReader::new(child.stdout.take().expect("its stdout"));
            let mut holder = Holder(child);
            for line in out.lines() {
                if line.expect("the holder's output") == "lock held" {
                    return holder;
                }
            }
            let status = holder.0.wait();
            panic!("the holder ended without taking the lock: {status:?}");
        }

        fn signal(&self, sig: libc::c_int) {
            // SAFETY: a signal to our own child, which has not been reaped (`Drop` reaps it).
            assert_eq!(unsafe { libc::kill(self.0.id() as libc::pid_t, sig) }, 0);
        }
    }

    impl Drop for Holder {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    /// What happens to a rank that compiles when another dies or stops mid-compile: a killed
    /// holder's lock is free at once (the kernel drops it), a stopped holder's is passed by at the
    /// deadline.
    #[test]
    fn a_compile_lock_outlives_no_killed_or_stopped_holder() {
        let dir = std::env::temp_dir().join(format!("mscclpp-cache-holder-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let entry = dir.join("k-sm_90-00.kbin");

        let mut holder = Holder::start(&entry);
        assert!(CompileLock::acquire(&entry, Duration::from_millis(50)).is_none());
        holder.0.kill().unwrap();
        holder.0.wait().unwrap();
        let t = Instant::now();
        assert!(CompileLock::acquire(&entry, Duration::from_secs(10)).is_some());
        assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());

        let holder = Holder::start(&entry);
        holder.signal(libc::SIGSTOP);
        let t = Instant::now();
        assert!(CompileLock::acquire(&entry, Duration::from_millis(300)).is_none());
        assert!(
            t.elapsed() >= Duration::from_millis(300),
            "{:?}",
            t.elapsed()
        );
        drop(holder);
        assert!(CompileLock::acquire(&entry, Duration::from_secs(10)).is_some());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn atomic_write_replaces_and_leaves_no_temp() {
        let dir = std::env::temp_dir().join(format!("mscclpp-cache-unit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("x.kbin");
        write_atomically(&p, b"one").unwrap();
        write_atomically(&p, b"two").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"two");
        let names: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 1, "{names:?}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
