//! What tests need to write byte-level BPE tokenizers (GPT-2's, Llama 3's)
//! as `tokenizer.json` fixtures.

/// GPT-2's map from bytes to the printable characters a byte-level BPE
/// spells them with: printable Latin-1 as itself, the rest shifted past 255.
pub fn byte_chars() -> Vec<char> {
    let printable = |b: u32| (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || (0xae..=0xff).contains(&b);
    let mut shifted = 0;
    (0u32..256)
        .map(|b| {
            if printable(b) {
                char::from_u32(b).unwrap_or('?')
            } else {
                shifted += 1;
                char::from_u32(255 + shifted).unwrap_or('?')
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_byte_has_its_own_printable_character() {
        let chars = super::byte_chars();
        let distinct: std::collections::HashSet<char> = chars.iter().copied().collect();
        assert_eq!(distinct.len(), 256);
        assert!(chars.iter().all(|c| !c.is_whitespace() && !c.is_control()));
        assert_eq!((chars[b'a' as usize], chars[b' ' as usize]), ('a', 'Ġ'));
    }
}
