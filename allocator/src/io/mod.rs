//! Problem and layout files.

pub mod minimalloc_csv;
