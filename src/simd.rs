//! CPU SIMD dispatch for the hot loops (TBE pooling and backward, DLRM's interaction): one
//! run-time check of the x86-64 features they are compiled for ([`has_avx2`]: AVX2, FMA and
//! F16C), and one macro, [`multiversion!`](crate::multiversion), that compiles a kernel body
//! twice — portable, and with those features enabled — and picks at run time. Kernels take
//! their arguments as one struct, so the macro needs no long parameter lists.

/// Whether this CPU has AVX2, FMA and F16C (checked once; always false off x86-64).
pub fn has_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static DETECTED: OnceLock<bool> = OnceLock::new();
        *DETECTED.get_or_init(|| {
            is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Defines `fn name<G: Bound, ...>(arg: Args) -> R` running a kernel compiled with AVX2, FMA
/// and F16C when [`has_avx2`] says the CPU has them, and portably otherwise.
///
/// * `=> body` — one body for both (an `#[inline(always)]` function taking `arg`): the
///   compiler vectorises it for each target;
/// * `=> avx2: fast, portable: slow` — two bodies (e.g. one with explicit intrinsics, which
///   may only run where the features exist).
#[macro_export]
#[doc(hidden)]
macro_rules! multiversion {
    ($(#[$meta:meta])* $vis:vis fn $name:ident $(<$($g:ident : $bound:path),+>)?
        ($arg:ident : $ty:ty) $(-> $ret:ty)? => avx2: $fast:expr, portable: $slow:expr) => {
        $(#[$meta])*
        $vis fn $name $(<$($g: $bound),+>)? ($arg: $ty) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2,fma,f16c")]
                unsafe fn avx2 $(<$($g: $bound),+>)? ($arg: $ty) $(-> $ret)? {
                    $fast($arg)
                }
                if $crate::simd::has_avx2() {
                    // SAFETY: the CPU has every feature `avx2` is compiled for (checked above).
                    return unsafe { avx2($arg) };
                }
            }
            $slow($arg)
        }
    };
    ($(#[$meta:meta])* $vis:vis fn $name:ident $(<$($g:ident : $bound:path),+>)?
        ($arg:ident : $ty:ty) $(-> $ret:ty)? => $body:expr) => {
        $crate::multiversion!($(#[$meta])* $vis fn $name $(<$($g: $bound),+>)? ($arg: $ty)
            $(-> $ret)? => avx2: $body, portable: $body);
    };
}
