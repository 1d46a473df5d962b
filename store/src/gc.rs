//! Garbage collection (placeholder, filled below).
