//! Compile-time checks of the model DSL, pinned with the compiler's own
//! output: every case under `ui/<category>/` is one mistake that must be
//! refused with the `.stderr` beside it, pointing at the user's code; every
//! case under `ui/pass/` must compile.
//!
//! After a deliberate change of a message, regenerate the expectations with
//! `TRYBUILD=overwrite cargo test -p tessera-tests --test ui` and read the
//! diff of the `.stderr` files.

use std::path::Path;
use std::process::Command;

#[test]
fn ui() {
    let run = std::panic::catch_unwind(|| {
        let t = trybuild::TestCases::new();
        for category in ["layout", "attr", "stage", "precision", "mesh", "dsl", "derive", "multi"] {
            t.compile_fail(format!("ui/{category}/*.rs"));
        }
        t.pass("ui/pass/*.rs");
        // The cases are built and checked when `t` is dropped.
    });
    if let Err(panic) = run {
        eprintln!("{}", diagnosis());
        std::panic::resume_unwind(panic);
    }
}

/// What to look at when the cases failed. trybuild builds every case in one
/// cargo run and reads the compiler's messages; when cargo itself fails (a
/// full disk, a killed compiler) there are no messages, and every
/// compile-fail case reports that it "succeeded". Rebuilding the cases here
/// shows cargo's own error, and the free space says whether the disk ran out.
fn diagnosis() -> String {
    format!("{}{}", null_device(), cargo_output())
}

/// Cargo learns the target's properties by running `rustc -` with its input
/// from `/dev/null`. On a machine where `/dev/null` has become a regular file
/// (a container that replaced the device, a `rm` run as root), rustc reads
/// whatever was last thrown away there, fails, and so does every cargo run
/// trybuild makes.
fn null_device() -> String {
    use std::os::unix::fs::FileTypeExt;
    match std::fs::metadata("/dev/null") {
        Ok(m) if m.file_type().is_char_device() => String::new(),
        Ok(m) => format!(
            "\nui: /dev/null is not the null device but a regular file of {} bytes, which cargo feeds to rustc \
             as source; restore it (as root: rm /dev/null && mknod -m 666 /dev/null c 1 3) and rerun.\n",
            m.len()
        ),
        Err(e) => format!("\nui: /dev/null cannot be read ({e}); cargo needs it.\n"),
    }
}

/// The rebuild described on [`diagnosis`].
fn cargo_output() -> String {
    let trybuild = Path::new(env!("CARGO_TARGET_TMPDIR")).join("../tests/trybuild");
    let project = trybuild.join(env!("CARGO_PKG_NAME"));
    let free = Command::new("df").args(["-h", "--output=avail,target"]).arg(&trybuild).output();
    let free = free.map(|o| String::from_utf8_lossy(&o.stdout).lines().last().unwrap_or("").trim().to_string()).unwrap_or_default();
    let build = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .current_dir(&project)
        .env("CARGO_TARGET_DIR", &trybuild)
        .args(["build", "--bins", "--offline", "--quiet", "--keep-going", "--color=never", "--message-format=json"])
        .output();
    let cargo_said = match build {
        Ok(o) => {
            // The compiler's messages go to stdout as JSON; on stderr, the
            // cases that fail to compile are expected, anything else is news.
            let stderr = String::from_utf8_lossy(&o.stderr).into_owned();
            let expected = |l: &str| l.trim().is_empty() || (l.contains("could not compile") && l.contains("(bin \"trybuild"));
            let news: Vec<&str> = stderr.lines().filter(|l| !expected(l)).collect();
            if news.is_empty() {
                "(nothing beyond the cases' own errors)".to_string()
            } else {
                news.iter().rev().take(20).rev().copied().collect::<Vec<_>>().join("\n")
            }
        }
        Err(e) => format!("(cargo could not be run: {e})"),
    };
    format!(
        "\nui: if every compile-fail case above \"succeeded\", trybuild's cargo run failed before compiling them.\n\
         ui: free space where the cases are built: {free}\n\
         ui: the last lines cargo prints when the cases are rebuilt (compiler errors of the cases are expected):\n{cargo_said}\n"
    )
}
