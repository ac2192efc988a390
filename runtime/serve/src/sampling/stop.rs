//! When a request is done, and how much of its text may be shown so far.

use super::SamplingParams;

/// Why a request stopped generating.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StopReason {
    /// The model produced its end-of-sequence token (and `ignore_eos` is off).
    Eos,
    /// The model produced one of the request's `stop_token_ids`.
    StopToken(u32),
    /// The text contains one of the request's stop strings.
    StopString(String),
    /// The request generated `max_tokens` tokens.
    MaxTokens,
}

/// Whether generation goes on after a token.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Status {
    /// Generate the next token.
    Continue,
    /// The request is finished.
    Stop(StopReason),
}

/// What to do after one token: the text that is now safe to show, and whether
/// to go on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StopCheck {
    /// Text to append to the output. It can lag the tokens: text that might
    /// be the start of a stop string is held back until it is known not to
    /// be, since a stop string and what follows are cut from the output.
    pub emit: String,
    /// Whether to go on.
    pub status: Status,
}

/// Watches a request's tokens and text for its stop conditions.
///
/// Stop strings are found across token boundaries and multi-byte characters:
/// the output is cut before the first stop string to end (the longest, if two
/// end together), the same however the text was split into pieces. The text
/// of an end-of-sequence or stop token is not emitted; on any stop the
/// held-back text that is not cut is emitted with the last check.
#[derive(Clone, Debug)]
pub struct StopChecker {
    stop_strings: Vec<String>,
    stop_token_ids: Vec<u32>,
    eos: Option<u32>,
    max_tokens: usize,
    generated: usize,
    /// Text seen but not emitted: a suffix that begins some stop string.
    held: String,
    stopped: Option<StopReason>,
}

impl StopChecker {
    /// The stop conditions of a request with these (validated) parameters.
    pub fn new(params: &SamplingParams) -> Self {
        Self {
            stop_strings: params.stop.clone(),
            stop_token_ids: params.stop_token_ids.clone(),
            eos: params.eos_token_id.filter(|_| !params.ignore_eos),
            max_tokens: params.max_tokens,
            generated: 0,
            held: String::new(),
            stopped: None,
        }
    }

    /// Checks a newly generated token and its decoded text `piece` (possibly
    /// empty). Once stopped, every later call reports the same stop and
    /// emits nothing.
    pub fn push(&mut self, token: u32, piece: &str) -> StopCheck {
        if let Some(reason) = &self.stopped {
            return StopCheck { emit: String::new(), status: Status::Stop(reason.clone()) };
        }
        self.generated += 1;
        if self.eos == Some(token) {
            return self.stop(StopReason::Eos);
        }
        if self.stop_token_ids.contains(&token) {
            return self.stop(StopReason::StopToken(token));
        }
        self.held.push_str(piece);
        if let Some((start, stop)) = self.first_stop_string() {
            self.held.truncate(start);
            return self.stop(StopReason::StopString(stop));
        }
        if self.generated >= self.max_tokens {
            return self.stop(StopReason::MaxTokens);
        }
        let keep_from = self.start_of_open_stop_string();
        let emit = self.held[..keep_from].to_string();
        self.held.drain(..keep_from);
        StopCheck { emit, status: Status::Continue }
    }

    /// Empties the held-back text, for a request that ends for a reason the
    /// checker does not see (an abort, the model's context length).
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    fn stop(&mut self, reason: StopReason) -> StopCheck {
        self.stopped = Some(reason.clone());
        StopCheck { emit: self.flush(), status: Status::Stop(reason) }
    }

    /// The start of the stop string in `held` that ends first (the longest of
    /// those that end together), and that string. Only the last piece can have
    /// completed one: the text before it was checked already.
    fn first_stop_string(&self) -> Option<(usize, String)> {
        let found = self.stop_strings.iter().filter_map(|s| self.held.find(s.as_str()).map(|start| (start + s.len(), start, s)));
        found.min_by_key(|&(end, start, _)| (end, start)).map(|(_, start, s)| (start, s.clone()))
    }

    /// Where the longest suffix of `held` that begins a stop string starts
    /// (`held.len()` if none): what must wait for more text.
    fn start_of_open_stop_string(&self) -> usize {
        let longest = self.stop_strings.iter().map(String::len).max().unwrap_or(0);
        // A stop string that begins before this would be complete, and found.
        let earliest = self.held.len().saturating_sub(longest.saturating_sub(1));
        let begins_a_stop = |i: usize| self.stop_strings.iter().any(|s| s.starts_with(&self.held[i..]));
        self.held.char_indices().map(|(i, _)| i).find(|&i| i >= earliest && begins_a_stop(i)).unwrap_or(self.held.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_data::Gen;

    /// Characters of one to four bytes, so that cuts land between the bytes of
    /// a character if the code gets byte offsets wrong.
    const ALPHABET: [&str; 5] = ["a", "b", "é", "€", "𝄞"];

    /// One to `max_len` characters.
    fn random_text(g: &mut Gen, max_len: usize) -> String {
        let len = 1 + g.below(max_len);
        (0..len).map(|_| ALPHABET[g.below(ALPHABET.len())]).collect()
    }

    /// The output and stop of the whole text at once: cut at the stop string
    /// that ends first, the longest if several end there.
    fn reference(text: &str, stops: &[String]) -> (String, Option<String>) {
        let ends = (1..=text.len()).filter(|&e| text.is_char_boundary(e));
        for end in ends {
            let mut ending_here: Vec<&String> = stops.iter().filter(|s| text[..end].ends_with(s.as_str())).collect();
            ending_here.sort_by_key(|s| std::cmp::Reverse(s.len()));
            if let Some(s) = ending_here.first() {
                return (text[..end - s.len()].to_string(), Some(s.to_string()));
            }
        }
        (text.to_string(), None)
    }

    /// Feeds `pieces` one token each; returns the emitted text and the stop.
    fn run(params: &SamplingParams, pieces: &[&str]) -> (String, Option<StopReason>) {
        let mut checker = StopChecker::new(params);
        let mut out = String::new();
        for (i, piece) in pieces.iter().enumerate() {
            // Ids from 100, clear of the stop and end-of-sequence ids the tests pick.
            let step = checker.push(100 + i as u32, piece);
            out.push_str(&step.emit);
            if let Status::Stop(reason) = step.status {
                return (out, Some(reason));
            }
        }
        out.push_str(&checker.flush());
        (out, None)
    }

    #[test]
    fn stop_strings_are_found_and_cut_across_every_split_of_the_text() {
        let mut g = Gen::new(9);
        for case in 0..300 {
            let text = random_text(&mut g, 8);
            let chars: Vec<(usize, char)> = text.char_indices().collect();
            // Stop strings cut from the text itself (so they occur) and made up (so they may not).
            let stops: Vec<String> = (0..1 + g.below(3))
                .map(|_| {
                    if g.below(3) > 0 {
                        let a = g.below(chars.len());
                        let b = a + 1 + g.below(chars.len().min(a + 3) - a);
                        let end = chars.get(b).map_or(text.len(), |&(i, _)| i);
                        text[chars[a].0..end].to_string()
                    } else {
                        random_text(&mut g, 3)
                    }
                })
                .collect();
            let params = SamplingParams { stop: stops.clone(), max_tokens: 1000, ..SamplingParams::default() };
            let (want_text, want_stop) = reference(&text, &stops);
            // Every way of cutting the text into pieces at character boundaries,
            // with an empty piece (a token that decodes to nothing) now and then.
            for cuts in 0u32..1 << (chars.len() - 1) {
                let mut pieces = Vec::new();
                let mut start = 0;
                for (k, &(i, _)) in chars.iter().enumerate().skip(1) {
                    if cuts & (1 << (k - 1)) != 0 {
                        pieces.push(&text[start..i]);
                        start = i;
                        if g.below(8) == 0 {
                            pieces.push("");
                        }
                    }
                }
                pieces.push(&text[start..]);
                let (got_text, got_stop) = run(&params, &pieces);
                assert_eq!(got_text, want_text, "case {case}: text {text:?}, stops {stops:?}, pieces {pieces:?}");
                assert_eq!(got_stop, want_stop.clone().map(StopReason::StopString), "case {case}: text {text:?}, stops {stops:?}, pieces {pieces:?}");
            }
        }
    }

    #[test]
    fn text_that_cannot_begin_a_stop_string_is_emitted_at_once() {
        let params = SamplingParams { stop: vec!["€nd".into()], ..SamplingParams::default() };
        let mut checker = StopChecker::new(&params);
        assert_eq!(checker.push(0, "ab€").emit, "ab");
        assert_eq!(checker.push(1, "n").emit, "");
        assert_eq!(checker.push(2, "x").emit, "€nx");
        let step = checker.push(3, "€nd!");
        assert_eq!((step.emit.as_str(), step.status), ("", Status::Stop(StopReason::StopString("€nd".into()))));
    }

    #[test]
    fn eos_stop_tokens_and_max_tokens_stop_and_flush() {
        let params = SamplingParams { stop: vec!["zz".into()], stop_token_ids: vec![7], eos_token_id: Some(102), max_tokens: 4, ..SamplingParams::default() };
        // Eos (the third token, id 102): its own text is dropped, held text is flushed.
        assert_eq!(run(&params, &["a", "z", "</s>"]), ("az".into(), Some(StopReason::Eos)));
        // ignore_eos: token 102 is just a token.
        let ignoring = SamplingParams { ignore_eos: true, ..params.clone() };
        assert_eq!(run(&ignoring, &["a", "z", "<102>"]), ("az<102>".into(), None));
        // A stop token.
        let mut checker = StopChecker::new(&params);
        checker.push(0, "z");
        assert_eq!(checker.push(7, "<7>"), StopCheck { emit: "z".into(), status: Status::Stop(StopReason::StopToken(7)) });
        // Later pushes repeat the stop and emit nothing.
        assert_eq!(checker.push(0, "more"), StopCheck { emit: String::new(), status: Status::Stop(StopReason::StopToken(7)) });
        // max_tokens: the last token's text is kept.
        let no_eos = SamplingParams { eos_token_id: None, ..params };
        assert_eq!(run(&no_eos, &["a", "b", "c", "z", "z"]), ("abcz".into(), Some(StopReason::MaxTokens)));
        // A stop string completing on the last allowed token wins over max_tokens.
        assert_eq!(run(&no_eos, &["a", "b", "z", "z"]), ("ab".into(), Some(StopReason::StopString("zz".into()))));
    }
}
