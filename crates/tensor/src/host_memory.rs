//! The host allocator's policy for tensor-sized blocks. A training step frees and
//! allocates the same few-MiB activations and gradients every step; glibc's malloc by
//! default hands blocks of that size back to the kernel when they are freed (`mmap` above
//! its threshold, heap trimming below it), so every step's new tensors arrive as fresh pages
//! that fault in one by one on their first write. On the reference GPT (one thread) that was
//! about a tenth of the step, charged to whichever op happened to write first.

/// glibc's `M_TRIM_THRESHOLD` parameter of `mallopt`.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const M_TRIM_THRESHOLD: i32 = -1;
/// glibc's `M_MMAP_THRESHOLD` parameter of `mallopt`.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const M_MMAP_THRESHOLD: i32 = -3;

#[cfg(all(target_os = "linux", target_env = "gnu"))]
unsafe extern "C" {
    fn mallopt(param: i32, value: i32) -> i32;
}

/// Keeps freed tensor memory in the process for reuse: blocks up to 32 MiB (glibc's
/// largest `mmap` threshold) come from the heap, and up to 512 MiB of free heap is kept
/// instead of being trimmed. Call once at program start, before tensors exist (the `brigade`
/// binary does); returns whether the allocator took both settings (always `false` on
/// platforms other than Linux with glibc, where it does nothing).
pub fn retain_freed_host_memory() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: `mallopt` only changes malloc's tuning parameters; both values are in
        // the ranges glibc documents.
        unsafe { mallopt(M_MMAP_THRESHOLD, 32 << 20) == 1 && mallopt(M_TRIM_THRESHOLD, 512 << 20) == 1 }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}

#[cfg(test)]
mod tests {
    #[test]
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    fn glibc_accepts_the_settings() {
        assert!(super::retain_freed_host_memory());
    }
}
