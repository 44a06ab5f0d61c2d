//! `sqlx::migrate!` embeds migrations/ at compile time; a new or changed migration must
//! rebuild the gateway. `OUTBOX_GIT_COMMIT`, the commit `outbox_build_info` reports, is
//! the environment's when set (a build from a source archive can pass it), else that of
//! `git rev-parse HEAD` when the sources are a git checkout (CI builds from a clone),
//! else "unknown".

use std::{path::PathBuf, process::Command};

fn main() {
    println!("cargo:rerun-if-changed=migrations");
    println!("cargo:rerun-if-env-changed=OUTBOX_GIT_COMMIT");
    let commit = std::env::var("OUTBOX_GIT_COMMIT")
        .ok()
        .filter(|commit| !commit.trim().is_empty())
        .or_else(|| git(&["rev-parse", "HEAD"]))
        .unwrap_or_else(|| {
            // Asked again on every build (a path that does not exist is never fresh): a
            // build directory shared with a checkout must not keep "unknown" for it.
            println!("cargo:rerun-if-changed=.git/HEAD");
            "unknown".to_owned()
        });
    println!("cargo:rustc-env=OUTBOX_GIT_COMMIT={}", commit.trim());
    // Built again when HEAD moves: on a checkout or a commit (the branch's ref, loose or
    // packed). Only paths that exist: cargo reruns the script on every build for a
    // missing one.
    let mut watched = vec![git(&["rev-parse", "--git-path", "HEAD"])];
    if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"]) {
        watched.push(git(&["rev-parse", "--git-path", branch.trim()]));
    }
    watched.push(git(&["rev-parse", "--git-path", "packed-refs"]));
    for path in watched.into_iter().flatten() {
        let path = PathBuf::from(path.trim());
        if path.exists() {
            println!("cargo:rerun-if-changed={}", path.display());
        }
    }
}

/// What `git <args>` prints, when git is there and succeeds.
fn git(args: &[&str]) -> Option<String> {
    let output = Command::new("git").args(args).output().ok()?;
    if !output.status.success() {
        return None;
    }
    String::from_utf8(output.stdout).ok()
}
