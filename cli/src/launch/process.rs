//! Starting, signalling and reaping rank processes so that none outlives the
//! job.
//!
//! - Each rank leads its own process group, so one `kill(-pgid)` reaches the
//!   rank and every process it started that stayed in its group.
//! - On Linux each rank gets `PR_SET_PDEATHSIG = SIGKILL`: if the launcher
//!   dies without a chance to clean up (`SIGKILL`, the OOM killer), the kernel
//!   kills the ranks.
//! - On Linux the launcher is a child subreaper: a process that a rank leaves
//!   behind is re-parented to the launcher, not to init, so the launcher reaps
//!   it. Init in a container often reaps nothing, and a leftover zombie would
//!   keep its process group looking alive.
//!
//! The launcher reaps with `waitpid(-1)` itself rather than through
//! `std::process::Child`, since it must also reap those re-parented processes
//! and one `waitpid(-1)` would otherwise steal a rank's status from `Child`.

use std::ffi::OsStr;
use std::io;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, ExitStatus, Stdio};

/// Starts `program` with `args` and `vars` added to the environment, as the
/// leader of a new process group, stdin from /dev/null, stdout and stderr
/// piped to the launcher, no signal blocked, and (on Linux) a death signal.
///
/// Must be called from the thread that lives as long as the launcher: the
/// kernel sends the death signal when the *thread* that forked the child
/// ends, not the process.
pub fn spawn<'a>(program: &OsStr, args: &[std::ffi::OsString], vars: impl IntoIterator<Item = (&'a str, String)>) -> io::Result<Child> {
    let mut cmd = Command::new(program);
    // A rank in a background process group that read the terminal would be
    // stopped by SIGTTIN; training programs take their input from files.
    cmd.args(args).envs(vars).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).process_group(0);
    // The launcher blocks its stop signals (to take them with sigwait), and a
    // signal mask survives fork and exec: a rank would otherwise start deaf
    // to SIGTERM and SIGINT. Built here, since the child may not allocate.
    let unblocked = super::signals::signal_set([])?;
    let launcher = std::process::id() as libc::pid_t;
    // SAFETY: the closure runs in the child between fork and exec, where only
    // async-signal-safe work is allowed: sigprocmask, prctl and getppid are
    // plain system calls, and the errors are built from an errno without
    // allocating.
    unsafe {
        cmd.pre_exec(move || {
            if libc::sigprocmask(libc::SIG_SETMASK, &unblocked, std::ptr::null_mut()) == -1 {
                return Err(io::Error::last_os_error());
            }
            die_with(launcher)
        });
    }
    cmd.spawn()
}

/// In the child, before exec: asks the kernel for SIGKILL when the launcher
/// dies.
///
/// # Safety
///
/// Only between fork and exec, with `launcher` the launcher's pid.
#[cfg(target_os = "linux")]
unsafe fn die_with(launcher: libc::pid_t) -> io::Result<()> {
    // SAFETY: PR_SET_PDEATHSIG takes a signal number and touches no memory.
    if unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong, 0, 0, 0) } == -1 {
        return Err(io::Error::last_os_error());
    }
    // The launcher may have died between fork and prctl, and then no death
    // signal would ever come: do not start the rank at all.
    // SAFETY: getppid has no arguments and always succeeds.
    if unsafe { libc::getppid() } != launcher {
        return Err(io::Error::from_raw_os_error(libc::ESRCH));
    }
    Ok(())
}

#[cfg(not(target_os = "linux"))]
unsafe fn die_with(_: libc::pid_t) -> io::Result<()> {
    Ok(())
}

/// Makes the launcher the reaper of the processes its ranks leave behind
/// (Linux only; elsewhere they go to init as usual). Failing is harmless:
/// the launcher then only waits for leftovers until its grace period ends.
#[cfg(target_os = "linux")]
pub fn become_subreaper() {
    // SAFETY: PR_SET_CHILD_SUBREAPER takes one integer argument and touches
    // no memory of this process.
    unsafe {
        libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1 as libc::c_ulong, 0, 0, 0);
    }
}

#[cfg(not(target_os = "linux"))]
pub fn become_subreaper() {}

/// Sends `signal` to every process in the group `pgid`. A group that no
/// longer exists is not an error: the rank and everything it started are
/// already gone.
///
/// A group's id is its leader's pid, which the kernel does not hand out again
/// while any member of the group exists; once the group is empty the id could
/// in principle name a new group, but pids are recycled only after the whole
/// pid space has been used, far longer than a stop takes.
pub fn signal_group(pgid: u32, signal: libc::c_int) {
    // SAFETY: kill has no memory arguments; a negative pid names a group.
    unsafe {
        libc::kill(-(pgid as libc::pid_t), signal);
    }
}

/// Whether any process (a zombie included) is still in the group `pgid`.
pub fn group_exists(pgid: u32) -> bool {
    // SAFETY: signal 0 only checks that the group exists and may be signalled.
    let rc = unsafe { libc::kill(-(pgid as libc::pid_t), 0) };
    // EPERM: there are members, only not ours to signal.
    rc == 0 || io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

/// Reaps one exited child of the launcher, without blocking: a rank or a
/// process re-parented to the launcher. `None` when no child has exited.
pub fn reap() -> Option<(u32, ExitStatus)> {
    loop {
        let mut status: libc::c_int = 0;
        // SAFETY: waitpid writes only the status it is given a pointer to.
        let pid = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) };
        if pid > 0 {
            return Some((pid as u32, ExitStatus::from_raw(status)));
        }
        if pid == -1 && io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
            continue;
        }
        // 0: children exist but none has exited; ECHILD: no children at all.
        return None;
    }
}
