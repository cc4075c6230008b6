//! `mscclpp-bench plan-check FILE|DIR... [--ranks N]`: proves MSCCL++ JSON execution plans on the
//! CPU reference interpreter (no GPU needed); one line per plan, non-zero exit if any fails.

use mscclpp_core::{Error, Result};
use mscclpp_executor::check::{check_file, plan_files};
use std::path::PathBuf;

pub const USAGE: &str = "usage: mscclpp-bench plan-check FILE|DIR... [--ranks N]";

pub fn run(argv: &[String]) -> Result<()> {
    let mut paths = Vec::new();
    let mut ranks = None;
    let mut it = argv.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "-n" | "--ranks" => {
                let v = it
                    .next()
                    .ok_or_else(|| Error::InvalidArgument(format!("{a} needs a value")))?;
                let n = v
                    .parse::<usize>()
                    .map_err(|_| Error::InvalidArgument(format!("{a} {v}: not a number")))?;
                ranks = Some(n);
            }
            "-h" | "--help" => {
                println!("{USAGE}");
                return Ok(());
            }
            _ => paths.push(PathBuf::from(a)),
        }
    }
    if paths.is_empty() {
        return Err(Error::InvalidArgument(format!(
            "no plan files given; {USAGE}"
        )));
    }
    let files = plan_files(&paths)
        .map_err(|e| Error::InvalidArgument(format!("reading plan paths: {e}")))?;
    let mut failed = 0;
    for f in &files {
        let line = check_file(f, ranks);
        println!("{}", line.text);
        failed += usize::from(!line.ok);
    }
    if failed > 0 {
        return Err(Error::Plan(format!(
            "{failed} of {} plans failed",
            files.len()
        )));
    }
    Ok(())
}
