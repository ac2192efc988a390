//! Gathering a strided view into a contiguous buffer.

use rayon::prelude::*;

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
