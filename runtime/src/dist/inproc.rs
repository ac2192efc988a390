//! In-process communicators: every rank is a thread of one process.
