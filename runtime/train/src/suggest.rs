//! "Did you mean ...?" for misspelt settings.

/// The candidate closest to `word` when it is close enough to be a
/// misspelling of it: one that differs only in case, `-`/`_` or a trailing
/// `s`; else one at most one edit per three characters away (at least one;
/// an exchange of neighbours is one edit); else one of four characters or
/// more that begins the word or that the word begins (`optimizer`, `optim`).
///
/// ```
/// use tessera::train::closest;
///
/// let keys = ["n_layer", "n_embd", "n_head"];
/// assert_eq!(closest("n_layers", &keys), Some("n_layer"));
/// assert_eq!(closest("n-head", &keys), Some("n_head"));
/// assert_eq!(closest("lr", &keys), None);
/// ```
pub fn closest<'a>(word: &str, candidates: &[&'a str]) -> Option<&'a str> {
    let norm = |s: &str| s.to_lowercase().replace('-', "_");
    let w = norm(word);
    if let Some(c) = candidates.iter().find(|c| {
        let c = norm(c);
        c == w || c.trim_end_matches('s') == w.trim_end_matches('s')
    }) {
        return Some(c);
    }
    let limit = (w.chars().count() / 3).max(1);
    let near = candidates.iter().map(|c| (edits(&w, &norm(c)), *c)).filter(|(d, _)| *d <= limit).min_by_key(|(d, _)| *d).map(|(_, c)| c);
    near.or_else(|| {
        candidates.iter().copied().find(|c| {
            let c = norm(c);
            let (short, long) = if c.len() < w.len() { (&c, &w) } else { (&w, &c) };
            short.chars().count() >= 4 && long.starts_with(short.as_str())
        })
    })
}

/// Edits (insertions, deletions, substitutions, exchanges of neighbours)
/// from `a` to `b`.
fn edits(a: &str, b: &str) -> usize {
    let (a, b): (Vec<char>, Vec<char>) = (a.chars().collect(), b.chars().collect());
    let mut d = vec![vec![0usize; b.len() + 1]; a.len() + 1];
    for (i, row) in d.iter_mut().enumerate() {
        row[0] = i;
    }
    for (j, cell) in d[0].iter_mut().enumerate() {
        *cell = j;
    }
    for i in 1..=a.len() {
        for j in 1..=b.len() {
            let cost = usize::from(a[i - 1] != b[j - 1]);
            d[i][j] = (d[i - 1][j] + 1).min(d[i][j - 1] + 1).min(d[i - 1][j - 1] + cost);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                d[i][j] = d[i][j].min(d[i - 2][j - 2] + 1);
            }
        }
    }
    d[a.len()][b.len()]
}

/// `; did you mean `x`?` for `word`, or nothing.
pub(crate) fn hint(word: &str, candidates: &[&str]) -> String {
    closest(word, candidates).map(|c| format!("; did you mean `{c}`?")).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn misspellings_find_their_key_and_strangers_find_none() {
        let keys = ["micro_batch", "seq_len", "grad_accum"];
        assert_eq!(closest("seqlen", &keys), Some("seq_len"));
        assert_eq!(closest("grad_acum", &keys), Some("grad_accum"));
        assert_eq!(closest("micro_bacth", &keys), Some("micro_batch"));
        assert_eq!(closest("Seq_Len", &keys), Some("seq_len"));
        assert_eq!(closest("batch_size", &keys), None);
        assert_eq!(closest("optimizer", &["optim", "mesh"]), Some("optim"));
        assert_eq!(closest("seq", &keys), None);
        assert_eq!(closest("", &keys), None);
        assert_eq!(closest("x", &[]), None);
    }
}
