//! Inspection (placeholder, filled below).
