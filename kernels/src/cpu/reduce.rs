//! (kernel family under construction)
