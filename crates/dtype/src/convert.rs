//! Whole-slice conversions between f32 and the 16-bit floats, at the memory's speed: sixteen
//! elements an instruction with AVX-512 where the CPU has it (detected at run time), a
//! branch-free loop the compiler vectorizes otherwise (compiled for AVX2 where the CPU has
//! that). Every path gives the bits of `half`'s one-element conversions (`bf16::from_f32`,
//! `f16::from_f32`, `to_f32`): rounding to nearest even, a NaN kept a NaN (quiet, sign and
//! leading payload bits kept), infinities and subnormals exact where the format holds them.

use half::{bf16, f16};

/// `dst[i] = bf16::from_f32(src[i])`. Panics if the lengths differ (a caller's bug).
pub fn f32_to_bf16(src: &[f32], dst: &mut [bf16]) {
    assert_eq!(src.len(), dst.len(), "f32_to_bf16: lengths differ");
    // SAFETY: `dst` holds `src.len()` writable elements.
    unsafe { f32_to_bf16_raw(src, dst.as_mut_ptr()) }
}

/// `dst[i] = src[i].to_f32()` (bf16 widens exactly). Panics if the lengths differ.
pub fn bf16_to_f32(src: &[bf16], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len(), "bf16_to_f32: lengths differ");
    // SAFETY: `dst` holds `src.len()` writable elements.
    unsafe { bf16_to_f32_raw(src, dst.as_mut_ptr()) }
}

/// `dst[i] = f16::from_f32(src[i])`. Panics if the lengths differ.
pub fn f32_to_f16(src: &[f32], dst: &mut [f16]) {
    assert_eq!(src.len(), dst.len(), "f32_to_f16: lengths differ");
    // SAFETY: `dst` holds `src.len()` writable elements.
    unsafe { f32_to_f16_raw(src, dst.as_mut_ptr()) }
}

/// `dst[i] = src[i].to_f32()` (f16 widens exactly). Panics if the lengths differ.
pub fn f16_to_f32(src: &[f16], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len(), "f16_to_f32: lengths differ");
    // SAFETY: `dst` holds `src.len()` writable elements.
    unsafe { f16_to_f32_raw(src, dst.as_mut_ptr()) }
}

/// `src` rounded to bf16, as a new vector (no zero-fill pass before the conversion).
pub fn to_bf16_vec(src: &[f32]) -> Vec<bf16> {
    // SAFETY: the kernel writes all `src.len()` elements.
    unsafe { fill_new(src.len(), |p| f32_to_bf16_raw(src, p)) }
}

/// `src` rounded to f16, as a new vector.
pub fn to_f16_vec(src: &[f32]) -> Vec<f16> {
    // SAFETY: the kernel writes all `src.len()` elements.
    unsafe { fill_new(src.len(), |p| f32_to_f16_raw(src, p)) }
}

/// `src` widened to f32, as a new vector.
pub fn bf16_to_f32_vec(src: &[bf16]) -> Vec<f32> {
    // SAFETY: the kernel writes all `src.len()` elements.
    unsafe { fill_new(src.len(), |p| bf16_to_f32_raw(src, p)) }
}

/// `src` widened to f32, as a new vector.
pub fn f16_to_f32_vec(src: &[f16]) -> Vec<f32> {
    // SAFETY: the kernel writes all `src.len()` elements.
    unsafe { fill_new(src.len(), |p| f16_to_f32_raw(src, p)) }
}

/// A vector of `n` elements written by `write` (which must write every one of them).
///
/// # Safety
/// `write` must initialize `n` elements from the pointer it is given.
unsafe fn fill_new<T: Copy>(n: usize, write: impl FnOnce(*mut T)) -> Vec<T> {
    let mut v = Vec::with_capacity(n);
    write(v.as_mut_ptr());
    // SAFETY: the capacity is `n`, and `write` initialized the first `n` elements.
    unsafe { v.set_len(n) };
    v
}

/// One f32 rounded to bf16: `bf16::from_f32`'s bits without its branches, so that a loop of
/// it vectorizes (the element kernels of a reduction, one tile at a time).
#[inline(always)]
pub fn round_bf16(x: f32) -> bf16 {
    bf16::from_bits(bf16_bits(x.to_bits()))
}

/// One bf16 widened to f32: `bf16::to_f32`'s bits, branch-free.
#[inline(always)]
pub fn widen_bf16(h: bf16) -> f32 {
    f32::from_bits(bf16_widen_bits(h.to_bits()))
}

/// True when this CPU runs the AVX-512 kernels (AVX-512F: the integer rounding for bf16,
/// `vcvtps2ph`/`vcvtph2ps` for f16).
fn has_avx512() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

fn has_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// The bf16 bits of an f32's bits: round to nearest even by adding `0x7fff` plus the lowest
/// kept bit (a carry past bit 16 is the round-up, into the exponent when the mantissa is all
/// ones, up to infinity); a NaN keeps its top bits with the quiet bit set. Branch-free, so a
/// loop of it vectorizes. `half::bf16::from_f32` computes the same function.
#[inline(always)]
fn bf16_bits(x: u32) -> u16 {
    let rounded = x.wrapping_add(0x7fff + ((x >> 16) & 1)) >> 16;
    let quiet_nan = (x >> 16) | 0x40;
    (if x & 0x7fff_ffff > 0x7f80_0000 {
        quiet_nan
    } else {
        rounded
    }) as u16
}

/// The f32 bits of a bf16's bits: the same bits shifted up, a NaN's quiet bit set (as
/// `half::bf16::to_f32`).
#[inline(always)]
fn bf16_widen_bits(h: u16) -> u32 {
    let x = u32::from(h) << 16;
    let quiet = if x & 0x7fff_ffff > 0x7f80_0000 { 0x0040_0000 } else { 0 };
    x | quiet
}

/// # Safety
/// `dst` must be valid for `src.len()` element writes.
unsafe fn f32_to_bf16_raw(src: &[f32], dst: *mut bf16) {
    #[cfg(target_arch = "x86_64")]
    {
        if has_avx512() {
            // SAFETY: the CPU has AVX-512F; `dst` as the caller promised.
            return unsafe { x86::f32_to_bf16_avx512(src, dst) };
        }
        if has_avx2() {
            // SAFETY: the CPU has AVX2; `dst` as the caller promised.
            return unsafe { x86::f32_to_bf16_avx2(src, dst) };
        }
    }
    // SAFETY: as the caller promised.
    unsafe { f32_to_bf16_any(src, dst) }
}

/// # Safety
/// `dst` must be valid for `src.len()` element writes.
#[inline(always)]
unsafe fn f32_to_bf16_any(src: &[f32], dst: *mut bf16) {
    for (i, &x) in src.iter().enumerate() {
        // SAFETY: `i < src.len()`, within `dst` as the caller promised.
        unsafe { dst.add(i).write(round_bf16(x)) };
    }
}

/// # Safety
/// `dst` must be valid for `src.len()` element writes.
unsafe fn bf16_to_f32_raw(src: &[bf16], dst: *mut f32) {
    #[cfg(target_arch = "x86_64")]
    {
        if has_avx512() {
            // SAFETY: the CPU has AVX-512F; `dst` as the caller promised.
            return unsafe { x86::bf16_to_f32_avx512(src, dst) };
        }
        if has_avx2() {
            // SAFETY: the CPU has AVX2; `dst` as the caller promised.
            return unsafe { x86::bf16_to_f32_avx2(src, dst) };
        }
    }
    // SAFETY: as the caller promised.
    unsafe { bf16_to_f32_any(src, dst) }
}

/// # Safety
/// `dst` must be valid for `src.len()` element writes.
#[inline(always)]
unsafe fn bf16_to_f32_any(src: &[bf16], dst: *mut f32) {
    for (i, &h) in src.iter().enumerate() {
        // SAFETY: `i < src.len()`, within `dst` as the caller promised.
        unsafe { dst.add(i).write(widen_bf16(h)) };
    }
}

/// # Safety
/// `dst` must be valid for `src.len()` element writes.
unsafe fn f32_to_f16_raw(src: &[f32], dst: *mut f16) {
    #[cfg(target_arch = "x86_64")]
    if has_avx512() {
        // SAFETY: the CPU has AVX-512F; `dst` as the caller promised.
        return unsafe { x86::f32_to_f16_avx512(src, dst) };
    }
    for (i, &x) in src.iter().enumerate() {
        // SAFETY: `i < src.len()`, within `dst` as the caller promised.
        unsafe { dst.add(i).write(f16::from_f32(x)) };
    }
}

/// # Safety
/// `dst` must be valid for `src.len()` element writes.
unsafe fn f16_to_f32_raw(src: &[f16], dst: *mut f32) {
    #[cfg(target_arch = "x86_64")]
    if has_avx512() {
        // SAFETY: the CPU has AVX-512F; `dst` as the caller promised.
        return unsafe { x86::f16_to_f32_avx512(src, dst) };
    }
    for (i, &h) in src.iter().enumerate() {
        // SAFETY: `i < src.len()`, within `dst` as the caller promised.
        unsafe { dst.add(i).write(h.to_f32()) };
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{bf16, bf16_to_f32_any, f16, f32_to_bf16_any};
    use std::arch::x86_64::*;

    /// Sixteen f32 lanes at a time: [`super::bf16_bits`] in vector form, then `vpmovdw`
    /// keeps the low halves; the tail one at a time.
    ///
    /// # Safety
    /// The CPU must have AVX-512F; `dst` valid for `src.len()` writes.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn f32_to_bf16_avx512(src: &[f32], dst: *mut bf16) {
        let n = src.len() / 16 * 16;
        let (one, bias) = (_mm512_set1_epi32(1), _mm512_set1_epi32(0x7fff));
        let (abs, inf, quiet) = (
            _mm512_set1_epi32(0x7fff_ffff),
            _mm512_set1_epi32(0x7f80_0000),
            _mm512_set1_epi32(0x40),
        );
        for i in (0..n).step_by(16) {
            // SAFETY: elements `i..i + 16` are inside `src` and `dst` (`i + 16 <= n`).
            unsafe {
                let x = _mm512_loadu_si512(src.as_ptr().add(i).cast());
                let high = _mm512_srli_epi32::<16>(x);
                let rounded =
                    _mm512_srli_epi32::<16>(_mm512_add_epi32(x, _mm512_add_epi32(bias, _mm512_and_si512(high, one))));
                let nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(x, abs), inf);
                let bits = _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(high, quiet));
                _mm256_storeu_si256(dst.add(i).cast(), _mm512_cvtepi32_epi16(bits));
            }
        }
        // SAFETY: the tail's elements are inside `src` and `dst`.
        unsafe { f32_to_bf16_any(&src[n..], dst.add(n)) }
    }

    /// The branch-free loop, compiled for AVX2.
    ///
    /// # Safety
    /// The CPU must have AVX2; `dst` valid for `src.len()` writes.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn f32_to_bf16_avx2(src: &[f32], dst: *mut bf16) {
        // SAFETY: as the caller promised.
        unsafe { f32_to_bf16_any(src, dst) }
    }

    /// Sixteen at a time: `vpmovzxwd`, a shift, the quiet bit on NaNs.
    ///
    /// # Safety
    /// The CPU must have AVX-512F; `dst` valid for `src.len()` writes.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn bf16_to_f32_avx512(src: &[bf16], dst: *mut f32) {
        let n = src.len() / 16 * 16;
        let (abs, inf, quiet) = (
            _mm512_set1_epi32(0x7fff_ffff),
            _mm512_set1_epi32(0x7f80_0000),
            _mm512_set1_epi32(0x0040_0000),
        );
        for i in (0..n).step_by(16) {
            // SAFETY: elements `i..i + 16` are inside `src` and `dst`.
            unsafe {
                let h = _mm256_loadu_si256(src.as_ptr().add(i).cast());
                let x = _mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h));
                let nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(x, abs), inf);
                let bits = _mm512_mask_or_epi32(x, nan, x, quiet);
                _mm512_storeu_si512(dst.add(i).cast(), bits);
            }
        }
        // SAFETY: the tail's elements are inside `src` and `dst`.
        unsafe { bf16_to_f32_any(&src[n..], dst.add(n)) }
    }

    /// # Safety
    /// The CPU must have AVX2; `dst` valid for `src.len()` writes.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn bf16_to_f32_avx2(src: &[bf16], dst: *mut f32) {
        // SAFETY: as the caller promised.
        unsafe { bf16_to_f32_any(src, dst) }
    }

    /// Sixteen at a time through `vcvtps2ph` (round to nearest even, whatever MXCSR says).
    ///
    /// # Safety
    /// The CPU must have AVX-512F; `dst` valid for `src.len()` writes.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn f32_to_f16_avx512(src: &[f32], dst: *mut f16) {
        let n = src.len() / 16 * 16;
        for i in (0..n).step_by(16) {
            // SAFETY: elements `i..i + 16` are inside `src` and `dst`.
            unsafe {
                let x = _mm512_loadu_ps(src.as_ptr().add(i));
                let h = _mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(x);
                _mm256_storeu_si256(dst.add(i).cast(), h);
            }
        }
        for (i, &x) in src.iter().enumerate().skip(n) {
            // SAFETY: `i < src.len()`.
            unsafe { dst.add(i).write(f16::from_f32(x)) };
        }
    }

    /// Sixteen at a time through `vcvtph2ps` (exact).
    ///
    /// # Safety
    /// The CPU must have AVX-512F; `dst` valid for `src.len()` writes.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn f16_to_f32_avx512(src: &[f16], dst: *mut f32) {
        let n = src.len() / 16 * 16;
        for i in (0..n).step_by(16) {
            // SAFETY: elements `i..i + 16` are inside `src` and `dst`.
            unsafe {
                let h = _mm256_loadu_si256(src.as_ptr().add(i).cast());
                _mm512_storeu_ps(dst.add(i), _mm512_cvtph_ps(h));
            }
        }
        for (i, &h) in src.iter().enumerate().skip(n) {
            // SAFETY: `i < src.len()`.
            unsafe { dst.add(i).write(h.to_f32()) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// f32 bit patterns that exercise every rounding case: each 16-bit high half with low
    /// halves at and around the tie (0x7fff, 0x8000, 0x8001), zero, one and all ones, plus
    /// a pseudo-random spread; and every f16 rounding boundary comes from the same mix.
    fn patterns() -> Vec<u32> {
        let lows = [0u32, 1, 0x1000, 0x2000, 0x3fff, 0x7fff, 0x8000, 0x8001, 0xc000, 0xffff];
        let mut v: Vec<u32> = (0..=0xffffu32)
            .flat_map(|hi| lows.iter().map(move |&lo| hi << 16 | lo))
            .collect();
        let mut s = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..200_000 {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            v.push(s as u32);
        }
        v
    }

    fn floats() -> Vec<f32> {
        patterns().into_iter().map(f32::from_bits).collect()
    }

    #[test]
    fn narrowing_to_bf16_gives_halfs_bits_on_every_path() {
        let x = floats();
        let want: Vec<u16> = x.iter().map(|&v| bf16::from_f32_const(v).to_bits()).collect();
        let mut got = vec![bf16::ZERO; x.len()];
        // SAFETY: `got` holds `x.len()` elements.
        unsafe { f32_to_bf16_any(&x, got.as_mut_ptr()) };
        assert!(
            got.iter().map(|h| h.to_bits()).eq(want.iter().copied()),
            "the scalar loop"
        );
        f32_to_bf16(&x, &mut got);
        assert!(
            got.iter().map(|h| h.to_bits()).eq(want.iter().copied()),
            "the dispatched kernel"
        );
        // odd lengths: the vector body and the tail meet at every offset
        for n in [0, 1, 15, 16, 17, 33] {
            assert!(to_bf16_vec(&x[7..7 + n])
                .iter()
                .map(|h| h.to_bits())
                .eq(want[7..7 + n].iter().copied()));
        }
    }

    #[test]
    fn widening_bf16_and_f16_gives_halfs_bits_for_all_65536_values() {
        let b: Vec<bf16> = (0..=0xffffu16).map(bf16::from_bits).collect();
        let f: Vec<f16> = (0..=0xffffu16).map(f16::from_bits).collect();
        let (wb, wf) = (bf16_to_f32_vec(&b), f16_to_f32_vec(&f));
        let mut scalar = vec![0.0f32; b.len()];
        // SAFETY: `scalar` holds `b.len()` elements.
        unsafe { bf16_to_f32_any(&b, scalar.as_mut_ptr()) };
        for i in 0..b.len() {
            assert_eq!(wb[i].to_bits(), b[i].to_f32_const().to_bits(), "bf16 {i:#06x}");
            assert_eq!(
                scalar[i].to_bits(),
                b[i].to_f32_const().to_bits(),
                "bf16 {i:#06x} scalar"
            );
            assert_eq!(wf[i].to_bits(), f[i].to_f32_const().to_bits(), "f16 {i:#06x}");
        }
        let mut into = vec![0.0f32; 5];
        bf16_to_f32(&b[100..105], &mut into);
        f16_to_f32(&f[100..105], &mut into);
        assert_eq!(into[4].to_bits(), f[104].to_f32_const().to_bits());
    }

    #[test]
    fn narrowing_to_f16_gives_halfs_bits() {
        let x = floats();
        let got = to_f16_vec(&x);
        for (i, (&v, h)) in x.iter().zip(&got).enumerate() {
            assert_eq!(
                h.to_bits(),
                f16::from_f32_const(v).to_bits(),
                "{i}: {:#010x}",
                v.to_bits()
            );
        }
        let mut into = vec![f16::ZERO; 3];
        f32_to_f16(&x[..3], &mut into);
        assert_eq!(into, got[..3]);
    }

    #[test]
    fn nans_stay_nans_and_ties_go_to_even() {
        let snan = f32::from_bits(0x7f80_0001);
        let b = to_bf16_vec(&[
            snan,
            -f32::NAN,
            f32::INFINITY,
            f32::from_bits(0x3f80_8000),
            f32::from_bits(0x3f81_8000),
        ]);
        assert!(b[0].is_nan() && b[1].is_nan() && b[1].is_sign_negative());
        assert_eq!(b[2], bf16::INFINITY);
        // 1 + half an ulp ties down to 1 (even); the next odd value ties up
        assert_eq!((b[3].to_bits(), b[4].to_bits()), (0x3f80, 0x3f82));
        assert_eq!(to_bf16_vec(&[f32::MAX])[0], bf16::INFINITY);
    }
}
