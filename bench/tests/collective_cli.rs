//! The collective mode of the built binary, from the outside: help, option errors, and the clear
//! error on a machine without a GPU. Nothing here needs a GPU; the one test that would start the
//! benchmark skips (with the reason printed) where a GPU device node exists.

use std::path::Path;
use std::process::{Command, Output};

fn bench(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_mscclpp-bench"))
        .args(args)
        // Never let a developer's NVLS setting reach a test.
        .env_remove("MSCCLPP_ENABLE_NVLS")
        .output()
        .expect("the mscclpp-bench binary runs")
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn has_gpu_node() -> bool {
    std::fs::read_dir("/dev").is_ok_and(|d| {
        d.flatten().any(|e| {
            e.file_name()
                .to_str()
                .and_then(|n| n.strip_prefix("nvidia"))
                .is_some_and(|r| !r.is_empty() && r.bytes().all(|b| b.is_ascii_digit()))
        })
    }) || Path::new("/dev/kfd").exists()
}

#[test]
fn help_lists_every_option() {
    let o = bench(&["collective", "--help"]);
    assert!(o.status.success(), "{}", text(&o));
    let t = text(&o);
    for flag in [
        "-b",
        "-e",
        "-f",
        "-d",
        "-o",
        "-c",
        "-n",
        "-w",
        "-G",
        "--algo",
        "--nblocks",
        "--nthreads",
        "--inplace-only",
        "--outofplace-only",
        "--json",
        "--vs-nccl",
        "--ranks",
    ] {
        assert!(t.contains(flag), "help lacks {flag}:\n{t}");
    }
}

#[test]
fn bad_options_fail_with_the_option_named() {
    for (args, needle) in [
        (&["collective", "-c", "gatherv"][..], "gatherv"),
        (&["collective", "-d", "f128"][..], "f128"),
        (&["collective", "-b", "2M", "-e", "1M"][..], "larger than"),
        (&["collective", "--ranks", "0"][..], "--ranks"),
        (
            &["collective", "--inplace-only", "--outofplace-only"][..],
            "exclude",
        ),
    ] {
        let o = bench(args);
        assert!(!o.status.success(), "{args:?} succeeded");
        let t = text(&o);
        assert!(t.contains(needle), "{args:?}: {t}");
    }
}

#[test]
fn explicit_collective_mode_without_a_gpu_says_why() {
    if has_gpu_node() {
        eprintln!(
            "skipping: this machine has a GPU device node, so the benchmark would really run"
        );
        return;
    }
    let o = bench(&["collective", "-b", "1K", "-e", "1K"]);
    assert!(!o.status.success());
    let t = text(&o);
    assert!(
        t.contains("GPU backend") && t.contains("unavailable"),
        "{t}"
    );
}
