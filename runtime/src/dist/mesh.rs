//! The device mesh: named parallel axes and the groups of ranks along them.
