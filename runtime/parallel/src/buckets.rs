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
    /// Buckets that never mix parameters of different `keys[i]` (those
    /// summed over different groups): in reverse order, each parameter goes
    /// into the open bucket of its key, and a key's bucket is cut once it
    /// holds `bucket_bytes`. Buckets are numbered in the order they open.
    pub(crate) fn keyed(bytes: &[usize], keys: &[usize], bucket_bytes: usize) -> Self {
        debug_assert!(bucket_bytes > 0, "callers refuse an empty bucket size");
        debug_assert_eq!(bytes.len(), keys.len(), "one key per parameter");
        let mut members: Vec<Vec<usize>> = Vec::new();
        // Each key's open bucket and the bytes it holds.
        let mut open: std::collections::HashMap<usize, (usize, usize)> = std::collections::HashMap::new();
        for i in (0..bytes.len()).rev() {
            let (b, filled) = match open.get(&keys[i]) {
                Some(&(b, filled)) if filled < bucket_bytes => (b, filled),
                _ => {
                    members.push(Vec::new());
                    (members.len() - 1, 0)
                }
            };
            members[b].push(i);
            open.insert(keys[i], (b, filled + bytes[i]));
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

    /// Buckets of parameters that may all share one.
    fn unkeyed(bytes: &[usize], bucket_bytes: usize) -> Buckets {
        Buckets::keyed(bytes, &vec![0; bytes.len()], bucket_bytes)
    }

    #[test]
    fn buckets_run_backwards_and_cut_once_full() {
        // Five parameters of 4, 8, 4, 12 and 4 bytes, cut every 10 bytes:
        // from the last, [4] + [12] reaches 16 ≥ 10, then [4, 8] = 12, then [4].
        let b = unkeyed(&[4, 8, 4, 12, 4], 10);
        let got: Vec<&[usize]> = b.iter().collect();
        assert_eq!(got, vec![&[4usize, 3][..], &[2, 1][..], &[0][..]]);
        assert_eq!((0..5).map(|i| b.of(i)).collect::<Vec<_>>(), [2, 1, 1, 0, 0]);
        assert_eq!(b.len(), 3);
    }

    #[test]
    fn keyed_buckets_never_mix_keys_and_cut_each_key_once_full() {
        // Keys 0 1 0 1 1 over 4-byte parameters, cut every 8 bytes: from
        // the last, key 1 opens [4, 3], key 0 opens [2, 0], key 1's next
        // parameter (1) opens a new bucket since [4, 3] is full.
        let b = Buckets::keyed(&[4; 5], &[0, 1, 0, 1, 1], 8);
        let got: Vec<&[usize]> = b.iter().collect();
        assert_eq!(got, vec![&[4usize, 3][..], &[2, 0][..], &[1][..]]);
        for n in 0..16 {
            let bytes: Vec<usize> = (0..n).map(|i| 1 + (i * 5) % 7).collect();
            let keys: Vec<usize> = (0..n).map(|i| (i * 7 + 3) % 3).collect();
            let b = Buckets::keyed(&bytes, &keys, 6);
            for m in b.iter() {
                assert!(m.iter().all(|&i| keys[i] == keys[m[0]]), "n={n}: a bucket mixes keys: {m:?}");
                // Cut once full: only the last parameter may take it past the size.
                let before_last: usize = m[..m.len() - 1].iter().map(|&i| bytes[i]).sum();
                assert!(before_last < 6, "n={n}: {m:?} was not cut when full");
            }
            assert_eq!(b.iter().map(<[usize]>::len).sum::<usize>(), n);
        }
    }

    #[test]
    fn every_parameter_is_in_exactly_one_bucket() {
        for n in 0..20 {
            for cut in [1, 3, 7, 100] {
                let bytes: Vec<usize> = (0..n).map(|i| 1 + (i * 7) % 5).collect();
                let b = unkeyed(&bytes, cut);
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
