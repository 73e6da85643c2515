//! Row storage that huge pages can back.
//!
//! A TBE's rows are gathered at random, so every lookup of a large table is a TLB miss with
//! 4 KiB pages. [`RowBuffer`] allocates large buffers on a 2 MiB boundary and, on Linux, asks the
//! kernel (`madvise(MADV_HUGEPAGE)`) to back them with transparent huge pages *before* the pages
//! are first touched. The overhead is at most one alignment pad (< 2 MiB), under 1% for any
//! table large enough to be aligned this way.

use std::alloc::{self, Layout};
use std::ptr::NonNull;

use crate::{Error, Result};

/// Element types a [`RowBuffer`] may hold: plain numbers for which all-zero bytes are 0.
pub trait RowElement: Copy + Send + Sync + 'static + private::Sealed {}
impl RowElement for f32 {}
impl RowElement for u8 {}

mod private {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for u8 {}
}

const HUGE_PAGE: usize = 2 << 20;
const CACHE_LINE: usize = 64;

/// A zero-initialised, fixed-size buffer aligned for huge pages when large.
pub struct RowBuffer<T: RowElement> {
    ptr: NonNull<T>,
    len: usize,
    layout: Layout,
}

// SAFETY: RowBuffer owns its allocation exclusively (like Vec<T>), and T is Send + Sync.
unsafe impl<T: RowElement> Send for RowBuffer<T> {}
// SAFETY: shared access only hands out `&[T]`; mutation needs `&mut self`.
unsafe impl<T: RowElement> Sync for RowBuffer<T> {}

impl<T: RowElement> RowBuffer<T> {
    /// A buffer of `len` zeros.
    pub fn zeros(len: usize) -> Result<Self> {
        let bytes = len
            .checked_mul(std::mem::size_of::<T>())
            .ok_or_else(|| Error::invalid("RowBuffer", format!("{len} elements overflow")))?;
        let align = if bytes >= HUGE_PAGE {
            HUGE_PAGE
        } else {
            CACHE_LINE
        };
        if bytes == 0 {
            return Ok(RowBuffer {
                ptr: NonNull::dangling(),
                len: 0,
                layout: Layout::from_size_align(0, align).expect("valid empty layout"),
            });
        }
        let layout = Layout::from_size_align(bytes, align)
            .map_err(|e| Error::invalid("RowBuffer", format!("{bytes} bytes: {e}")))?;
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { alloc::alloc(layout) };
        let Some(ptr) = NonNull::new(raw as *mut T) else {
            return Err(Error::invalid(
                "RowBuffer",
                format!("out of memory allocating {bytes} bytes"),
            ));
        };
        if align == HUGE_PAGE {
            advise_huge_pages(raw, bytes);
        }
        // SAFETY: `raw` is valid for `bytes` writes; zero bytes are a valid f32 (0.0) and u8.
        // Zeroing after the advice makes the first touch fault in huge pages.
        unsafe { std::ptr::write_bytes(raw, 0, bytes) };
        Ok(RowBuffer { ptr, len, layout })
    }

    /// A buffer holding a copy of `data`.
    pub fn from_slice(data: &[T]) -> Result<Self> {
        let mut b = RowBuffer::zeros(data.len())?;
        b.copy_from_slice(data);
        Ok(b)
    }

    /// Bytes the allocation takes, alignment included.
    pub fn allocated_bytes(&self) -> usize {
        self.layout.size()
    }
}

impl<T: RowElement> std::ops::Deref for RowBuffer<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: ptr is valid (or dangling with len 0) for len initialised elements.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl<T: RowElement> std::ops::DerefMut for RowBuffer<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as in deref, and `&mut self` guarantees exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl<T: RowElement> Clone for RowBuffer<T> {
    fn clone(&self) -> Self {
        RowBuffer::from_slice(self).expect("cloning a row buffer: out of memory")
    }
}

impl<T: RowElement> Drop for RowBuffer<T> {
    fn drop(&mut self) {
        if self.layout.size() != 0 {
            // SAFETY: allocated in `zeros` with exactly this layout.
            unsafe { alloc::dealloc(self.ptr.as_ptr() as *mut u8, self.layout) };
        }
    }
}

impl<T: RowElement + std::fmt::Debug> std::fmt::Debug for RowBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RowBuffer(len={})", self.len)
    }
}

/// Asks Linux to back `[ptr, ptr + bytes)` with transparent huge pages. A hint only: failure
/// (or another OS) changes speed, never results.
#[allow(unused_variables)]
fn advise_huge_pages(ptr: *mut u8, bytes: usize) {
    #[cfg(all(target_os = "linux", target_arch = "x86_64"))]
    {
        const SYS_MADVISE: usize = 28;
        const MADV_HUGEPAGE: usize = 14;
        let _ret: usize;
        // SAFETY: madvise only changes the paging policy of memory this process owns (the
        // range was just allocated); it reads or writes no user memory. The syscall clobbers
        // rcx and r11 as the x86-64 Linux ABI says.
        unsafe {
            std::arch::asm!(
                "syscall",
                inlateout("rax") SYS_MADVISE => _ret,
                in("rdi") ptr as usize,
                in("rsi") bytes,
                in("rdx") MADV_HUGEPAGE,
                lateout("rcx") _,
                lateout("r11") _,
                options(nostack),
            );
        }
    }
}
