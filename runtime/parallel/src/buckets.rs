//! Gradient buckets fixed when an engine is built, the same on every rank.

/// The parameters of a model cut into gradient buckets: in reverse order
/// (about the order their gradients become final), a new bucket every
/// `bucket_bytes`. Because the cut depends on the model alone, every rank
/// packs the same parameters in the same order, whatever order its own
/// backward announces them in (a layer that skips work on one rank, such as
/// an expert no token chose, must not misalign the sums).
pub(crate) struct Buckets {
    /// Each bucket's parameters (indices into the engine's list), in
    /// packing order.
    members: Vec<Vec<usize>>,
    /// Each parameter's bucket.
    bucket_of: Vec<usize>,
}

impl Buckets {
    /// Buckets over parameters of `bytes[i]` bytes each, cut every
    /// `bucket_bytes` (which must be positive).
    pub(crate) fn new(bytes: &[usize], bucket_bytes: usize) -> Self {
        debug_assert!(bucket_bytes > 0, "callers refuse an empty bucket size");
        let mut members: Vec<Vec<usize>> = Vec::new();
        let mut filled = bucket_bytes;
        for i in (0..bytes.len()).rev() {
            if filled >= bucket_bytes {
                members.push(Vec::new());
                filled = 0;
            }
            members.last_mut().expect("pushed").push(i);
            filled += bytes[i];
        }
        let mut bucket_of = vec![0; bytes.len()];
        for (b, params) in members.iter().enumerate() {
            for &i in params {
                bucket_of[i] = b;
            }
        }
        Buckets { members, bucket_of }
    }

    /// The number of buckets.
    pub(crate) fn len(&self) -> usize {
        self.members.len()
    }

    /// Bucket `b`'s parameters, in packing order.
    pub(crate) fn members(&self, b: usize) -> &[usize] {
        &self.members[b]
    }

    /// Every bucket's parameters, in bucket order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &[usize]> {
        self.members.iter().map(Vec::as_slice)
    }

    /// The bucket of parameter `i`.
    pub(crate) fn of(&self, i: usize) -> usize {
        self.bucket_of[i]
    }
}

#[cfg(test)]
mod tests {
    use super::Buckets;

    #[test]
    fn buckets_run_backwards_and_cut_once_full() {
        // Five parameters of 4, 8, 4, 12 and 4 bytes, cut every 10 bytes:
        // from the last, [4] + [12] reaches 16 ≥ 10, then [4, 8] = 12, then [4].
        let b = Buckets::new(&[4, 8, 4, 12, 4], 10);
        let got: Vec<&[usize]> = b.iter().collect();
        assert_eq!(got, vec![&[4usize, 3][..], &[2, 1][..], &[0][..]]);
        assert_eq!((0..5).map(|i| b.of(i)).collect::<Vec<_>>(), [2, 1, 1, 0, 0]);
        assert_eq!(b.len(), 3);
    }

    #[test]
    fn every_parameter_is_in_exactly_one_bucket() {
        for n in 0..20 {
            for cut in [1, 3, 7, 100] {
                let bytes: Vec<usize> = (0..n).map(|i| 1 + (i * 7) % 5).collect();
                let b = Buckets::new(&bytes, cut);
                let mut seen = vec![0; n];
                for (k, m) in b.iter().enumerate() {
                    assert!(!m.is_empty(), "bucket {k} is empty");
                    for &i in m {
                        seen[i] += 1;
                        assert_eq!(b.of(i), k);
                    }
                }
                assert!(seen.iter().all(|&c| c == 1), "n={n} cut={cut}: {seen:?}");
            }
        }
    }
}
