//! Gathering a strided view into a contiguous buffer, and copying a large
//! buffer past the caches.

use rayon::prelude::*;

/// Copies `src` into `dst` (same length) with non-temporal stores on x86-64:
/// the destination's cache lines are written straight to memory, neither
/// read first (an ordinary store reads every line it writes: half again the
/// memory traffic of the copy) nor left in the cache, where they would push
/// out data that is still to be read. For destinations far larger than the
/// cache that nobody reads soon, such as a collective's multi-megabyte
/// result; a destination that is read again at once is better written by
/// [`slice::copy_from_slice`]. The stores are fenced before returning, so
/// they are ordered before whatever the caller does next (such as telling
/// another thread the data is there). Elsewhere, a plain copy.
pub fn copy_nontemporal<T: Copy>(src: &[T], dst: &mut [T]) {
    assert_eq!(src.len(), dst.len(), "copy_nontemporal: source and destination lengths differ");
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
        let bytes = std::mem::size_of_val(src);
        let (s, d) = (src.as_ptr().cast::<u8>(), dst.as_mut_ptr().cast::<u8>());
        // The unaligned head and the tail that does not fill a 16-byte store
        // are copied plainly.
        let head = d.align_offset(16).min(bytes);
        let body = (bytes - head) / 16 * 16;
        // SAFETY: every offset below `bytes` is inside both slices (their
        // byte lengths are equal), which do not overlap (`dst` is a unique
        // borrow); `d + head` is 16-byte aligned as `_mm_stream_si128`
        // requires, and unaligned loads have no alignment requirement. SSE2
        // is part of every x86-64 CPU.
        unsafe {
            std::ptr::copy_nonoverlapping(s, d, head);
            let mut at = head;
            while at < head + body {
                _mm_stream_si128(d.add(at).cast::<__m128i>(), _mm_loadu_si128(s.add(at).cast::<__m128i>()));
                at += 16;
            }
            std::ptr::copy_nonoverlapping(s.add(at), d.add(at), bytes - at);
            _mm_sfence();
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    dst.copy_from_slice(src);
}

/// Copies the elements of a strided view of `src` into `dst` in row-major order.
///
/// `shape` and `strides` (in elements) describe the view and `offset` its first
/// element; `dst.len()` must equal the number of elements of `shape`. Works for
/// any element type: it moves data, it computes nothing.
pub fn copy_strided<T: Copy + Send + Sync>(src: &[T], shape: &[usize], strides: &[usize], offset: usize, dst: &mut [T]) {
    assert_eq!(shape.len(), strides.len(), "copy_strided: one stride per dimension");
    let count: usize = shape.iter().product();
    assert_eq!(dst.len(), count, "copy_strided: destination length");
    if count == 0 {
        return;
    }
    if shape.is_empty() {
        dst[0] = src[offset];
        return;
    }
    let rank = shape.len();
    let inner = shape[rank - 1];
    let inner_stride = strides[rank - 1];
    let outer_shape = &shape[..rank - 1];
    let outer_strides = &strides[..rank - 1];
    // Each destination row is one index of the outer dimensions.
    let copy_row = |(row, out): (usize, &mut [T])| {
        let mut rem = row;
        let mut at = offset;
        for (&d, &s) in outer_shape.iter().zip(outer_strides).rev() {
            at += (rem % d) * s;
            rem /= d;
        }
        if inner_stride == 1 {
            out.copy_from_slice(&src[at..at + inner]);
        } else {
            for (j, o) in out.iter_mut().enumerate() {
                *o = src[at + j * inner_stride];
            }
        }
    };
    if count >= 1 << 15 {
        dst.par_chunks_mut(inner).enumerate().for_each(copy_row);
    } else {
        dst.chunks_mut(inner).enumerate().for_each(copy_row);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nontemporal_copies_any_alignment_and_length() {
        let src: Vec<u16> = (0..1000).collect();
        for start in 0..9 {
            for len in [0, 1, 7, 8, 9, 63, 64, 65, 500] {
                let mut dst = vec![0u16; 1000];
                copy_nontemporal(&src[start..start + len], &mut dst[start..start + len]);
                assert_eq!(&dst[start..start + len], &src[start..start + len], "start {start} len {len}");
                assert!(dst[..start].iter().chain(&dst[start + len..]).all(|&v| v == 0), "only the destination range is written");
            }
        }
    }

    #[test]
    fn transposed_and_narrowed_views() {
        // a 3x4 matrix 0..12; its transpose is 4x3 with strides [1, 4]
        let src: Vec<u32> = (0..12).collect();
        let mut dst = vec![0; 12];
        copy_strided(&src, &[4, 3], &[1, 4], 0, &mut dst);
        assert_eq!(dst, vec![0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11]);
        // columns 1..3 of every row: shape [3, 2], strides [4, 1], offset 1
        let mut dst = vec![0; 6];
        copy_strided(&src, &[3, 2], &[4, 1], 1, &mut dst);
        assert_eq!(dst, vec![1, 2, 5, 6, 9, 10]);
        let mut one = vec![0; 1];
        copy_strided(&src, &[], &[], 7, &mut one);
        assert_eq!(one, vec![7]);
    }

    #[test]
    fn large_copies_match_small_path() {
        let (a, b, c) = (64, 33, 17);
        let src: Vec<u64> = (0..(a * b * c) as u64).collect();
        // permute to [c, a, b]
        let mut dst = vec![0; a * b * c];
        copy_strided(&src, &[c, a, b], &[1, b * c, c], 0, &mut dst);
        for k in 0..c {
            for i in 0..a {
                for j in 0..b {
                    assert_eq!(dst[(k * a + i) * b + j], src[(i * b + j) * c + k]);
                }
            }
        }
    }
}
