//! Training data: tokenizers (BPE and characters), token shards and their
//! validation, the data-parallel sampler and its cursor, and the bundled
//! arithmetic task with its exact-match evaluator.

use std::collections::HashSet;
use std::path::Path;
use tessera::data::arith::{self, Problem, Task};
use tessera::data::{CharTokenizer, Cursor, Dataset, Sampler, ShardWriter, TokenDType, Tokenizer, WindowRange};
use tessera::testing::Scratch;
use tessera::{Device, Error};

/// A fresh, empty directory for one test.
fn scratch(name: &str) -> Scratch {
    Scratch::new(&format!("data-{name}"))
}

const CORPUS: &str = "the quick brown fox jumps over the lazy dog.\n\
    the lazy dog sleeps; the quick fox runs on and on.\n\
    a tokenizer merges the pairs it sees most often: th, he, the, qu, ick.\n";

fn train_bpe(dir: &Path, vocab: usize) -> Tokenizer {
    let file = dir.join("corpus.txt");
    std::fs::write(&file, CORPUS.repeat(20)).unwrap();
    Tokenizer::train_bpe(&[file], vocab).unwrap()
}

#[test]
fn a_trained_bpe_round_trips_text_it_has_and_has_not_seen() {
    let dir = scratch("bpe");
    let tok = train_bpe(&dir, 300);
    assert!(tok.vocab_size() > 257 && tok.vocab_size() <= 300, "vocab {}", tok.vocab_size());
    assert_eq!(tok.document_separator(), Some(0));
    for text in [CORPUS, "unseen wörds, ünïcode → 字 and emoji 🦀\ttabs\n\n  spaces", ""] {
        let ids = tok.encode(text).unwrap();
        assert_eq!(tok.decode(&ids).unwrap(), text);
    }
    // Merges were learned: the corpus takes far fewer ids than bytes.
    assert!(tok.encode(CORPUS).unwrap().len() * 2 < CORPUS.len());
    assert!(matches!(tok.decode(&[tok.vocab_size() as u32]), Err(Error::Data(_))));
    assert!(matches!(Tokenizer::train_bpe(&[dir.join("corpus.txt")], 100), Err(Error::Data(_))));
    assert!(matches!(Tokenizer::train_bpe(&[dir.join("missing.txt")], 300), Err(Error::DataFile { path, .. }) if path.ends_with("missing.txt")));
}

#[test]
fn a_saved_tokenizer_loads_back_equal() {
    let dir = scratch("tokjson");
    let bpe = train_bpe(&dir, 280);
    let chars = Tokenizer::chars("ab\ncd").unwrap();
    for (name, tok) in [("bpe.json", bpe), ("chars.json", chars)] {
        let path = dir.join(name);
        tok.save(&path).unwrap();
        let back = Tokenizer::load(&path).unwrap();
        assert_eq!(back.kind(), tok.kind());
        assert_eq!(back.to_json().unwrap(), tok.to_json().unwrap());
        assert_eq!(back.vocab_size(), tok.vocab_size());
        assert_eq!(back.document_separator(), tok.document_separator());
        let text = "abc\ndcba";
        assert_eq!(back.encode(text).unwrap(), tok.encode(text).unwrap());
    }
    let garbage = dir.join("garbage.json");
    std::fs::write(&garbage, "{\"model\": 3}").unwrap();
    assert!(matches!(Tokenizer::load(&garbage), Err(Error::DataFile { path, .. }) if path.ends_with("garbage.json")));
}

#[test]
fn a_character_tokenizer_refuses_what_it_cannot_represent() {
    let tok = CharTokenizer::new("xyz").unwrap();
    assert_eq!(tok.encode("zyx").unwrap(), vec![2, 1, 0]);
    assert_eq!(tok.decode(&[0, 2]).unwrap(), "xz");
    let err = tok.encode("xw").unwrap_err().to_string();
    assert!(err.contains("'w'") && err.contains("position 1"), "{err}");
    assert!(tok.decode(&[3]).is_err());
    assert!(CharTokenizer::new("xx").is_err());
    assert!(CharTokenizer::new("").is_err());
    assert_eq!(CharTokenizer::covering(["ba", "ca"]).unwrap().alphabet(), "abc");
}

/// Writes `docs` with the given vocabulary and shard size; returns the stream the shards must hold.
fn write_docs(dir: &Path, vocab: usize, sep: Option<u32>, shard_tokens: usize, docs: &[Vec<u32>]) -> Vec<u32> {
    let mut w = ShardWriter::create(dir, vocab, sep, shard_tokens).unwrap();
    let mut stream = Vec::new();
    for (i, doc) in docs.iter().enumerate() {
        // A document pushed in two pieces is still one document.
        let (a, b) = doc.split_at(doc.len() / 2);
        w.push(a).unwrap();
        w.push(b).unwrap();
        w.end_document();
        if i > 0 {
            stream.extend(sep);
        }
        stream.extend_from_slice(doc);
    }
    let index = w.finish(None).unwrap();
    assert_eq!(index.documents, docs.len() as u64);
    assert_eq!(index.total_tokens, stream.len() as u64);
    stream
}

fn read_all(data: &Dataset) -> Vec<u32> {
    (0..data.shard_count()).flat_map(|s| data.tokens(s, 0, data.shard_tokens(s) as usize).unwrap()).collect()
}

#[test]
fn shards_round_trip_in_u16_and_u32() {
    for (vocab, dtype, width) in [(50_000usize, TokenDType::U16, 2u64), (70_000, TokenDType::U32, 4)] {
        let dir = scratch(&format!("shards-{vocab}"));
        let docs: Vec<Vec<u32>> = (0..5u32).map(|d| (0..(7 + 3 * d)).map(|i| (d * 9973 + i * 7919) % vocab as u32).collect()).collect();
        let stream = write_docs(&dir, vocab, Some(vocab as u32 - 1), 10, &docs);
        let data = Dataset::open(&dir).unwrap();
        assert_eq!(data.index().dtype, dtype);
        assert_eq!(data.shard_count(), stream.len().div_ceil(10));
        assert_eq!(read_all(&data), stream);
        assert!(stream.iter().any(|&t| t > u16::MAX as u32) == (dtype == TokenDType::U32));
        let first = dir.join(&data.index().shards[0].file);
        assert_eq!(std::fs::metadata(first).unwrap().len(), 24 + 10 * width);
        assert_eq!(data.tokens(1, 3, 4).unwrap(), stream[13..17]);
        assert!(data.tokens(0, 8, 3).is_err());
        assert!(matches!(data.tokenizer(), Err(Error::Data(_))));
    }
}

#[test]
fn a_damaged_shard_is_reported_by_name() {
    let dir = scratch("damaged");
    write_docs(&dir, 100, None, 16, &[(0..40).collect()]);
    let shard = dir.join("shard-00001.bin");
    let good = std::fs::read(&shard).unwrap();
    let expect_error = |bytes: &[u8], what: &str| {
        std::fs::write(&shard, bytes).unwrap();
        match Dataset::open(&dir) {
            Err(Error::DataFile { path, detail }) => {
                assert!(path.ends_with("shard-00001.bin"), "{path}");
                assert!(detail.contains(what) && detail.contains("tessera prepare"), "{detail}");
            }
            other => panic!("expected a data file error, got {other:?}"),
        }
    };
    expect_error(&good[..good.len() - 1], "truncated");
    expect_error(&good[..10], "truncated");
    expect_error(&[good.as_slice(), &[0, 0]].concat(), "trailing");
    let mut magic = good.clone();
    magic[0] = b'X';
    expect_error(&magic, "magic");
    let mut width = good.clone();
    width[12] = 4;
    expect_error(&width, "4-byte");
    let mut token = good.clone();
    token[24] = 200;
    std::fs::write(&shard, &token).unwrap();
    let data = Dataset::open(&dir).unwrap();
    assert!(matches!(data.tokens(1, 0, 2), Err(Error::DataFile { path, .. }) if path.ends_with("shard-00001.bin")));
    std::fs::remove_file(dir.join("index.json")).unwrap();
    assert!(
        matches!(Dataset::open(&dir), Err(Error::DataFileIo { path, source, .. }) if path.ends_with("index.json") && source.kind() == std::io::ErrorKind::NotFound)
    );
}

/// A dataset whose token at global stream position `p` is `p` itself, so a
/// row says where it came from: 3 shards of 100 tokens.
fn positional(name: &str) -> Dataset {
    let dir = scratch(name);
    write_docs(&dir, 1000, None, 100, &[(0..300).collect()]);
    Dataset::open(&dir).unwrap()
}

const SEQ: usize = 9;

/// The first tokens of each row of the next `steps` batches of `sampler`.
fn starts(sampler: &mut Sampler, steps: usize) -> Vec<Vec<u32>> {
    (0..steps)
        .map(|_| {
            let (ids, targets) = sampler.next_ids().unwrap();
            for (row, tgt) in ids.chunks(SEQ).zip(targets.chunks(SEQ)) {
                // Rows are consecutive tokens; targets are the next tokens.
                assert!(row.windows(2).all(|w| w[1] == w[0] + 1));
                assert!(row.iter().zip(tgt).all(|(&i, &t)| t == i + 1));
                assert_eq!(row[0] % 100 % SEQ as u32, 0, "a window starts at a multiple of T in its shard");
            }
            ids.chunks(SEQ).map(|r| r[0]).collect()
        })
        .collect()
}

#[test]
fn the_sampler_is_deterministic_and_covers_each_epoch_once() {
    let data = positional("determinism");
    // 99 usable tokens per shard: 11 windows of 9 (+1) each, 33 in all.
    let mut a = Sampler::new(&data, 3, SEQ, 0, 1, 5).unwrap();
    assert_eq!(a.windows_per_epoch(), 33);
    let mut b = Sampler::new(&data, 3, SEQ, 0, 1, 5).unwrap();
    let mut other = Sampler::new(&data, 3, SEQ, 0, 1, 6).unwrap();
    let (ea, eb, eo) = (starts(&mut a, 22), starts(&mut b, 22), starts(&mut other, 22));
    assert_eq!(ea, eb);
    assert_ne!(ea, eo);
    let epoch = |batches: &[Vec<u32>]| batches.iter().flatten().copied().collect::<Vec<_>>();
    let (first, second) = (epoch(&ea[..11]), epoch(&ea[11..]));
    let all: HashSet<u32> = (0..3).flat_map(|s| (0..11).map(move |k| s * 100 + k * SEQ as u32)).collect();
    assert_eq!(first.iter().copied().collect::<HashSet<_>>(), all);
    assert_eq!(first.len(), 33, "each window exactly once per epoch");
    assert_eq!(second.iter().copied().collect::<HashSet<_>>(), all);
    assert_ne!(first, second, "each epoch has its own order");
    // The epoch turns over lazily, when the next batch is drawn.
    assert_eq!((a.cursor().epoch, a.cursor().position), (1, 33));
    starts(&mut a, 1);
    assert_eq!((a.cursor().epoch, a.cursor().position), (2, 3));

    let (inputs, targets) = Sampler::new(&data, 3, SEQ, 0, 1, 5).unwrap().next_batch(&Device::cpu()).unwrap();
    assert_eq!(inputs.shape().dims(), &[3, SEQ]);
    assert_eq!(targets.to_vec::<u32>().unwrap()[0], inputs.to_vec::<u32>().unwrap()[0] + 1);
}

#[test]
fn data_parallel_ranks_split_the_global_batch() {
    let data = positional("dp");
    let mut single = Sampler::new(&data, 4, SEQ, 0, 1, 9).unwrap();
    let whole = starts(&mut single, 16);
    for dp in [2, 4] {
        let parts: Vec<Vec<Vec<u32>>> = (0..dp).map(|r| starts(&mut Sampler::new(&data, 4, SEQ, r, dp, 9).unwrap(), 16)).collect();
        for (step, batch) in whole.iter().enumerate() {
            let joined: Vec<u32> = parts.iter().flat_map(|p| p[step].clone()).collect();
            assert_eq!(&joined, batch, "dp {dp} step {step}");
            assert_eq!(joined.iter().collect::<HashSet<_>>().len(), 4, "the ranks' rows are disjoint");
        }
    }
    assert!(matches!(Sampler::new(&data, 6, SEQ, 0, 4, 9), Err(Error::Data(_))));
    assert!(matches!(Sampler::new(&data, 4, SEQ, 2, 2, 9), Err(Error::Data(_))));
    assert!(matches!(Sampler::new(&data, 40, SEQ, 0, 1, 9), Err(Error::Data(_))));
}

#[test]
fn a_restored_cursor_continues_exactly() {
    let data = positional("cursor");
    let mut straight = Sampler::new(&data, 4, SEQ, 1, 2, 3).unwrap();
    starts(&mut straight, 5);
    let saved = serde_json_round_trip(&straight.cursor());
    let expected = starts(&mut straight, 12); // crosses two epoch boundaries
    let mut resumed = Sampler::new(&data, 4, SEQ, 1, 2, 3).unwrap();
    resumed.restore(saved.clone()).unwrap();
    assert_eq!(starts(&mut resumed, 12), expected);
    // The position counts windows, so the run can resume on another number of ranks.
    let mut fewer_ranks = Sampler::new(&data, 4, SEQ, 0, 1, 3).unwrap();
    fewer_ranks.restore(saved.clone()).unwrap();
    let rows: Vec<Vec<u32>> = starts(&mut fewer_ranks, 12).into_iter().map(|b| b[2..].to_vec()).collect();
    assert_eq!(rows, expected);
    let mut other_seed = Sampler::new(&data, 4, SEQ, 1, 2, 4).unwrap();
    assert!(matches!(other_seed.restore(saved), Err(Error::Data(_))));
}

fn serde_json_round_trip(cursor: &Cursor) -> Cursor {
    let text = cursor.to_json().unwrap().to_string();
    Cursor::from_json(&text.parse().unwrap()).unwrap()
}

#[test]
fn skipped_and_excluded_data_is_passed_over_and_remembered() {
    let data = positional("skip");
    let mut a = Sampler::new(&data, 3, SEQ, 0, 1, 1).unwrap();
    let mut b = Sampler::new(&data, 3, SEQ, 0, 1, 1).unwrap();
    starts(&mut a, 2);
    b.skip_batches(2).unwrap();
    assert_eq!(b.cursor().skipped_batches, 2);
    assert_eq!(starts(&mut a, 5), starts(&mut b, 5));

    // A spike: exclude the batch just seen, go back to the healthy cursor.
    let healthy = a.cursor();
    let bad = starts(&mut a, 1).remove(0);
    assert_eq!(a.last_batch().len(), 3);
    a.exclude_last_batch().unwrap();
    a.rewind(healthy.clone()).unwrap();
    assert_eq!(a.cursor().excluded.len(), 3);
    let rewound = a.cursor();
    let later = starts(&mut a, 30);
    assert!(later.iter().flatten().all(|s| !bad.contains(s)), "excluded windows never come back");
    // The exclusions travel in the cursor: a resumed run passes over them too.
    let mut resumed = Sampler::new(&data, 3, SEQ, 0, 1, 1).unwrap();
    resumed.restore(serde_json_round_trip(&rewound)).unwrap();
    assert_eq!(starts(&mut resumed, 30), later);
    // Restore is exact: the healthy cursor had no exclusions, so the bad batch comes again.
    a.restore(healthy).unwrap();
    assert_eq!(starts(&mut a, 1)[0], bad);

    a.exclude(WindowRange::whole_shard(1)).unwrap();
    let rest: Vec<u32> = starts(&mut a, 20).into_iter().flatten().collect();
    assert!(rest.iter().all(|&s| !(100..200).contains(&s)));
    assert!(a.exclude(WindowRange::whole_shard(7)).is_err());
    a.exclude(WindowRange::whole_shard(0)).unwrap();
    assert!(matches!(a.exclude(WindowRange { shard: 2, start: 0, end: 9 }), Err(Error::Data(_))), "would leave fewer than a batch");
}

/// What a rollback does to the data, checked against a plain model of it
/// over many random runs: everything drawn between a checkpoint's cursor
/// and the spike is never served again, in any later epoch, and every
/// other window still comes once per epoch; the exclusions survive a
/// restore from JSON, and the skipped batches are counted.
#[test]
fn data_passed_over_by_a_rollback_is_never_served_again() {
    let data = positional("since");
    let all: HashSet<u32> = (0..3).flat_map(|s| (0..11).map(move |k| s * 100 + k * SEQ as u32)).collect();
    let mut rng = 0x1234_5678_u64;
    let mut next = |n: u64| {
        rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (rng >> 33) % n
    };
    for trial in 0..40 {
        let mut s = Sampler::new(&data, 3, SEQ, 0, 1, trial).unwrap();
        let mut excluded: HashSet<u32> = HashSet::new();
        // A few rollbacks, each over 1 to 4 batches, at random points
        // (some across an epoch boundary).
        for _ in 0..1 + next(3) {
            starts(&mut s, next(7) as usize);
            let checkpoint = serde_json_round_trip(&s.cursor());
            let drawn: Vec<u32> = starts(&mut s, 1 + next(4) as usize).into_iter().flatten().collect();
            let (before, position) = (s.cursor().skipped_batches, s.cursor().position);
            match s.exclude_since(&checkpoint) {
                Ok(()) => {
                    excluded.extend(&drawn);
                    assert_eq!(s.cursor().skipped_batches, before + (drawn.len() / 3) as u64, "trial {trial}");
                    assert_eq!(s.cursor().position, position, "the sampler keeps its place");
                }
                // Too little data would be left: nothing changes.
                Err(e) => assert!(e.to_string().contains("fewer than one global batch"), "{e}"),
            }
        }
        // Through JSON, as a resumed run gets it.
        let mut resumed = Sampler::new(&data, 3, SEQ, 0, 1, trial).unwrap();
        resumed.restore(serde_json_round_trip(&s.cursor())).unwrap();
        let left = all.len() - excluded.len();
        // Finish the epoch, then three whole epochs: each serves every window left once (but
        // an epoch's last incomplete batch, which is dropped).
        let rest_of_epoch = s.cursor().epoch;
        let mut by_epoch: std::collections::BTreeMap<u64, Vec<u32>> = Default::default();
        for _ in 0..4 * left / 3 + 2 {
            let epoch = resumed.cursor().epoch;
            let batch = starts(&mut resumed, 1).remove(0);
            let epoch = if resumed.cursor().epoch != epoch { resumed.cursor().epoch } else { epoch };
            by_epoch.entry(epoch).or_default().extend(batch);
        }
        for (epoch, served) in by_epoch.iter().filter(|(e, _)| **e > rest_of_epoch) {
            assert!(served.iter().all(|w| !excluded.contains(w)), "trial {trial} epoch {epoch}: an excluded window came back");
            let unique: HashSet<u32> = served.iter().copied().collect();
            assert_eq!(unique.len(), served.len(), "trial {trial} epoch {epoch}: a window twice");
            if served.len() == left / 3 * 3 {
                assert_eq!(unique.len(), left - left % 3, "trial {trial} epoch {epoch}");
            }
        }
    }
    // A cursor from another run, or from later than where the sampler stands, is refused.
    let mut s = Sampler::new(&data, 3, SEQ, 0, 1, 1).unwrap();
    let other = Sampler::new(&data, 3, SEQ, 0, 1, 2).unwrap().cursor();
    assert!(matches!(s.exclude_since(&other), Err(Error::Data(_))));
    let mut ahead = Sampler::new(&data, 3, SEQ, 0, 1, 1).unwrap();
    starts(&mut ahead, 2);
    assert!(matches!(s.exclude_since(&ahead.cursor()), Err(Error::Data(_))));
}

#[test]
fn the_arithmetic_split_is_disjoint_and_seeded() {
    let task = Task::new(11).with_train_size(20_000);
    let held: HashSet<Problem> = task.held_out_problems().iter().copied().collect();
    assert_eq!(held.len(), task.held_out_problems().len(), "held-out problems are distinct");
    assert!((8_000..12_000).contains(&held.len()), "about 1% held out: {}", held.len());
    assert!(held.iter().all(|&p| task.is_held_out(p)));
    let train = task.train_problems();
    assert_eq!(train.len(), 20_000);
    assert!(train.iter().all(|p| !held.contains(p)), "no training problem is held out");
    assert!(train.iter().collect::<HashSet<_>>().len() > 19_000);

    let text = task.train_text();
    assert_eq!(text.len(), 20_000 * arith::LINE_LEN);
    for (line, p) in text.lines().zip(&train) {
        let (prompt, answer) = line.split_at(arith::PROMPT_LEN);
        let (a, b) = prompt.trim_end_matches('=').split_once('+').unwrap();
        assert_eq!((little_endian(a), little_endian(b)), (p.a, p.b));
        assert_eq!(little_endian(answer), p.a + p.b);
    }
    assert_eq!(Task::new(11).with_train_size(20_000).train_text(), text);
    let other = Task::new(12);
    assert_ne!(other.held_out_problems(), task.held_out_problems());
    assert_eq!(Problem { a: 123, b: 45 }.line(), "321+540=8610\n");
}

/// The number written least significant digit first in `digits`.
fn little_endian(digits: &str) -> u32 {
    digits.chars().rev().collect::<String>().parse().unwrap()
}

/// Greedy "generation" that knows arithmetic, wrong whenever `wrong(problem)`.
fn oracle<'a>(task: &'a Task, wrong: impl Fn(u32, u32) -> bool + 'a) -> impl FnMut(&[u32]) -> tessera::Result<Vec<u32>> + 'a {
    move |prompt| {
        let text = task.tokenizer().decode(prompt)?;
        let (a, b) = text.trim_end_matches('=').split_once('+').unwrap();
        let (a, b) = (little_endian(a), little_endian(b));
        let sum = if wrong(a, b) { a + b + 1 } else { a + b };
        let answer: String = format!("{sum:04}").chars().rev().collect();
        task.tokenizer().encode(&format!("{answer}\n1+"))
    }
}

#[test]
fn the_evaluator_scores_exact_matches() {
    let task = Task::new(3);
    let perfect = task.eval(200, oracle(&task, |_, _| false)).unwrap();
    assert_eq!((perfect.correct, perfect.total, perfect.accuracy), (200, 200, 1.0));
    assert!(perfect.samples.iter().all(|s| s.got == s.expected));

    let wrong_when = |a: u32, _: u32| a % 2 == 1;
    let expected = task.held_out_problems()[..200].iter().filter(|p| !wrong_when(p.a, p.b)).count();
    let half = task.eval(200, oracle(&task, wrong_when)).unwrap();
    assert_eq!(half.correct, expected);
    assert!((half.accuracy - expected as f64 / 200.0).abs() < 1e-12);
    assert!(half.samples[0].got != half.samples[0].expected, "mistakes are shown first");
    assert_eq!(perfect.digit_accuracy, [1.0; 4]);
    // One more than the sum changes the lowest digit of every wrong answer.
    let digit0 = task.held_out_problems()[..200].iter().filter(|p| !wrong_when(p.a, p.b)).count() as f64 / 200.0;
    assert!((half.digit_accuracy[0] - digit0).abs() < 1e-12);
    assert!(half.digit_accuracy[3] > half.digit_accuracy[0]);

    let mut single = oracle(&task, wrong_when);
    let batched = task.eval_batched(200, 16, |prompts| prompts.iter().map(|p| single(p)).collect()).unwrap();
    assert_eq!(batched, half);

    // Ids outside the alphabet, or no newline after four digits, are wrong answers, not errors.
    let garbage = task.eval(10, |_| Ok(vec![99, 2, 3])).unwrap();
    assert_eq!(garbage.correct, 0);
    assert_eq!(garbage.samples[0].got, "?01");
    assert_eq!(garbage.digit_accuracy[0], 0.0, "an id outside the alphabet is no digit");
    assert!(task.eval(0, |_| Ok(vec![])).is_err());
}

#[test]
fn bundled_shards_feed_the_sampler_aligned_to_lines() {
    let dir = scratch("bundled");
    let task = Task::new(0).with_train_size(1_000);
    let index = task.write_shards(&dir, 1 << 20).unwrap();
    assert_eq!(index.total_tokens, 13_000);
    let data = Dataset::open(&dir).unwrap();
    let tok = data.tokenizer().unwrap();
    assert_eq!(tok.to_json().unwrap(), task.tokenizer().to_json().unwrap());
    let mut sampler = Sampler::new(&data, 8, arith::SEQ, 0, 1, 0).unwrap();
    let (ids, _) = sampler.next_ids().unwrap();
    for row in ids.chunks(arith::SEQ) {
        let text = tok.decode(row).unwrap();
        assert_eq!(text.lines().count(), 4);
        assert!(text.lines().all(|l| l.len() == arith::LINE_LEN - 1 && l.as_bytes()[3] == b'+'), "{text:?}");
    }
}

#[test]
fn answer_targets_keep_only_the_answers() {
    use tessera::train::Batches;
    let dir = scratch("answers");
    let task = Task::new(0).with_train_size(1_000);
    task.write_shards(&dir, 1 << 20).unwrap();
    let data = Dataset::open(&dir).unwrap();
    let tok = data.tokenizer().unwrap();
    let dev = Device::cpu();
    let mut plain = Sampler::new(&data, 4, arith::SEQ, 0, 1, 3).unwrap();
    let mut answers = tessera::data::AnswerTargets(Sampler::new(&data, 4, arith::SEQ, 0, 1, 3).unwrap());
    let (_, want) = plain.next_ids().unwrap();
    let (x, y) = answers.next_batch(&dev).unwrap();
    assert_eq!(x.dims(), &[4, arith::SEQ]);
    let (x, y) = (x.to_vec::<u32>().unwrap(), y.to_vec::<u32>().unwrap());
    let ignore = answers.ignore_index().unwrap();
    for ((row, want_row), input) in y.chunks(arith::SEQ).zip(want.chunks(arith::SEQ)).zip(x.chunks(arith::SEQ)) {
        // Per line: the four answer digits and the newline, nothing else.
        let kept: Vec<u32> = row
            .iter()
            .zip(want_row)
            .filter(|(t, _)| **t != ignore)
            .map(|(t, w)| {
                assert_eq!(t, w, "kept targets are unchanged");
                *t
            })
            .collect();
        let text = tok.decode(&kept).unwrap();
        assert_eq!(text.len(), 4 * arith::ANSWER_LEN, "{text:?}");
        let lines: Vec<String> = tok.decode(input).unwrap().lines().map(String::from).collect();
        assert_eq!(lines.len(), 4);
        for (got, line) in text.lines().zip(&lines) {
            assert_eq!(got, &line[arith::PROMPT_LEN..], "the answer of `{line}`");
        }
    }
    // The cursor is the sampler's: restoring it repeats the batch.
    let c = answers.cursor();
    let (_, a) = answers.next_batch(&dev).unwrap();
    answers.restore(&c).unwrap();
    let (_, b) = answers.next_batch(&dev).unwrap();
    assert_eq!(a.to_vec::<u32>().unwrap(), b.to_vec::<u32>().unwrap());
}
