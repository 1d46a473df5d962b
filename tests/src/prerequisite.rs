//! What a test does when something it needs is missing (a model not fetched, no right to
//! mount a tmpfs, no `ip`): under CI it fails with the reason, so a CI run that passes has
//! run it; elsewhere it says loudly that it skipped. Shared by the test crates of the
//! workspace (`#[path]`-included), so they all decide alike.

use std::io::Write;

/// Whether this is a CI run: `$CI` set to anything but empty, `0` or `false`. `.ci/run`
/// sets `CI=1`; GitHub Actions and GitLab CI set `CI=true`.
pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| !matches!(v.trim(), "" | "0" | "false"))
}

/// The calling test cannot run: `why` it cannot, and `fix`, how to give it what it needs.
/// Under CI this panics (the test fails with the reason); elsewhere it prints
/// `SKIPPED <test>: <why> (<fix>)` straight to stderr, past `cargo test`'s capture of
/// passing tests' output, and returns: the caller then returns without checking anything.
#[track_caller]
pub fn missing(why: &str, fix: &str) {
    let thread = std::thread::current();
    let test = thread.name().unwrap_or("a test");
    if in_ci() {
        panic!("{test} cannot run under CI: {why} ({fix})");
    }
    let line = format!("SKIPPED {test}: {why} ({fix}); under CI=1 this fails\n");
    let _ = std::io::stderr().lock().write_all(line.as_bytes());
}
