//! Pipeline schedules as data, and a simulator that costs them.
